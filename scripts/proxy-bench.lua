-- wrk script of scripts/proxy-bench: the requests of one case, and a check
-- of every answer.
--
--   wrk ... -s scripts/proxy-bench.lua URL -- MODE PREFIX [N]
--
-- MODE:
--   get     GET, no key (passed through by the proxy)
--   unique  POST, a fresh Idempotency-Key per request: PREFIX-THREAD-COUNTER
--           (PREFIX is random per run, THREAD is the wrk thread's number)
--   record  POST the keys PREFIX-0 .. PREFIX-(N-1) in order, then again
--           (run it with -t 1 -c 1: the first N answers are fresh, the
--           rest replays; wrk runs its whole -d whatever the script does)
--   replay  POST cycling over those N keys (each thread, and each
--           connection, from its own offset): every answer is a replay
--
-- done() prints one line that scripts/proxy-bench parses:
--   RESULT requests=R seconds=S rps=X p50_us=A p99_us=B non2xx=C replayed=D
--          sockerr=E (connect+read+write+timeout)
-- non2xx counts the answers whose status is not 2xx (wrk's own
-- "Non-2xx or 3xx" count lets 3xx pass); replayed counts the answers that
-- carry `Idempotent-Replayed`.

local threads = {}
local counter = 0

function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end

local mode, prefix, n
-- Globals: done() reads them with thread:get.
non2xx, replayed = 0, 0
local body = '{"amount":100,"currency":"EUR"}'

function init(args)
  mode = args[1] or "unique"
  prefix = args[2] or tostring(math.random(1, 1e9))
  n = tonumber(args[3] or "1000")
  -- Each thread its own prefix (unique) or its own start (replay).
  if mode == "unique" then
    prefix = prefix .. "-t" .. tostring(tid)
  elseif mode == "replay" then
    counter = (tid * 7919) % n
  end
end

local function post(key)
  return wrk.format("POST", nil, {
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = key,
  }, body)
end

function request()
  if mode == "get" then
    return wrk.format("GET", nil, nil, nil)
  end
  local c = counter
  counter = counter + 1
  if mode == "unique" then
    return post(prefix .. "-" .. c)
  else -- record, replay: the N recorded keys
    return post(prefix .. "-" .. (c % n))
  end
end

function response(status, headers, _)
  if status < 200 or status > 299 then
    non2xx = non2xx + 1
  end
  if headers["idempotent-replayed"] or headers["Idempotent-Replayed"] then
    replayed = replayed + 1
  end
end

function done(summary, latency, _)
  local bad, rep = 0, 0
  for _, t in ipairs(threads) do
    bad = bad + (t:get("non2xx") or 0)
    rep = rep + (t:get("replayed") or 0)
  end
  local e = summary.errors
  local seconds = summary.duration / 1e6
  io.write(string.format(
    "RESULT requests=%d seconds=%.3f rps=%.1f p50_us=%d p99_us=%d non2xx=%d replayed=%d sockerr=%d status_wrk=%d\n",
    summary.requests, seconds, summary.requests / seconds,
    latency:percentile(50), latency:percentile(99), bad, rep,
    e.connect + e.read + e.write + e.timeout, e.status))
end
