-- acquire_many: acquire.lua for a batch of keys, in one call, item after
-- item in order (a key that appears twice sees its earlier item's effect).
-- KEYS: the records (on Redis Cluster, all in one hash slot).
-- ARGV: [1] lease ms (1 ..= MAX_MS), [2] in-progress grace ms (0 ..= MAX_MS),
-- then per key: fingerprint (32 bytes, or ""), new token (16 bytes).
-- Returns {now_ms, now_us, then each key's reply}, where a key's reply is
--   the record as stored (a bulk string) followed by its time left in ms,
--     for a replay of a completed record (the time left as acquire.lua
--     gives it: the key's PTTL on the fast path, else `expires` - now);
--   1 for a key that was absent and is now acquired: attempt 1, lease
--     until now_ms + lease, fence now_us, the request's fingerprint;
--   or else a table exactly as acquire.lua's.
-- The two shortcuts are the common answers, and the cheapest to build,
-- send and parse (no table per key). Or an error reply "IDEM_INVALID ..."
-- for a bad argument, before any write.
-- The record's format: see acquire.lua.
local MAX_MS = 3153600000000 -- idem_core::MAX_DURATION in ms
local HEADER = '>c1c1c32c16I4I8I8I8I8I8'
local HEADER_LEN = 94

local function invalid(detail)
  return redis.error_reply('IDEM_INVALID ' .. detail)
end
-- An integer in [min, MAX_MS], or nil (not a number, NaN, inf, a fraction).
local function ms(v, min)
  local n = tonumber(v)
  if n == nil or n ~= n or n ~= math.floor(n) or n < min or n > MAX_MS then
    return nil
  end
  return n
end
local function int(n)
  return string.format('%.0f', n)
end

local count = #KEYS
if #ARGV ~= 2 + 2 * count then
  return invalid('acquire_many takes 2 + 2 arguments per key')
end
local lease, grace = ms(ARGV[1], 1), ms(ARGV[2], 0)
if not lease then return invalid('lease must be an integer number of ms in 1..=' .. int(MAX_MS)) end
if not grace then return invalid('grace must be an integer number of ms in 0..=' .. int(MAX_MS)) end
for i = 1, count do
  local fp, token = ARGV[1 + 2 * i], ARGV[2 + 2 * i]
  if #fp ~= 0 and #fp ~= 32 then return invalid('fingerprint must be 0 or 32 bytes') end
  if #token ~= 16 then return invalid('token must be 16 bytes') end
end

-- One instant for the whole batch (time stands still inside a script
-- anyway): every write, lease and time left is computed from it.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local until_ms = now + lease
local absent_until = int(until_ms + grace)
-- A first acquisition's header after its token: attempt 1, fence now_us,
-- lease until until_ms, created now, expires with the grace, not completed.
local FIRST_TAIL = struct.pack('>I4I8I8I8I8I8', 1, now_us, until_ms, now, until_ms + grace, 0)
local ZEROS = string.rep('\0', 32)

-- Every record read in one MGET. MGET answers nil for a key that holds
-- something other than a string, so an absent key is written with SET NX
-- (which refuses such a key, then read with GET: WRONGTYPE, Corrupt); and
-- a key's later items in the batch read it again, after its earlier
-- items' writes.
-- (In chunks: Lua's unpack holds a few thousand values at most.)
local first = {}
for from = 1, count, 1000 do
  local to = math.min(from + 999, count)
  local got = redis.call('MGET', unpack(KEYS, from, to))
  for j = 1, to - from + 1 do first[from + j - 1] = got[j] end
end
local seen = {}

local function acquire(i, key, fp, token)
  local v = first[i]
  if seen[key] then v = redis.pcall('GET', key) end
  -- Only a key of another type reads as corrupt / not ours: any other
  -- error (an ACL that refuses GET) is the caller's to see.
  if type(v) == 'table' and not string.find(tostring(v.err), 'WRONGTYPE', 1, true) then error(v) end
  seen[key] = true
  if not v then
    -- Absent as MGET saw it: claimed with SET NX, which refuses a key that
    -- holds another type (MGET's nil too); that one is read with GET below.
    local has, stored_fp = '1', fp
    if fp == '' then has, stored_fp = '0', ZEROS end
    if redis.call('SET', key, 'p' .. has .. stored_fp .. token .. FIRST_TAIL,
        'NX', 'PXAT', absent_until) then
      return 1
    end
    v = redis.pcall('GET', key)
    -- Only a key of another type reads as corrupt / not ours: any other
    -- error (an ACL that refuses GET) is the caller's to see.
    if type(v) == 'table' and not string.find(tostring(v.err), 'WRONGTYPE', 1, true) then error(v) end
  end
  if type(v) == 'table' then
    return {'corrupt', 'the record is not a string: ' .. tostring(v.err)}
  end
  if v and #v >= HEADER_LEN and string.byte(v, 1) == 99 then
    local hasfp = string.byte(v, 2)
    if hasfp == 48 or hasfp == 49 then
      -- As acquire.lua, by the key's own time left (an operator's PEXPIRE
      -- may have moved it from `expires`): a mismatch only of a record
      -- with time left.
      local ttl = redis.call('PTTL', key)
      if ttl > 0 then
        if hasfp == 49 and fp ~= '' and string.sub(v, 3, 34) ~= fp then
          return {'mismatch'}
        end
        return v, ttl
      end
    end
  end

  local s, f, t, a, n, l, c, e, d
  if v then
    if #v < HEADER_LEN then
      return {'corrupt', 'record of ' .. #v .. ' bytes, shorter than its header'}
    end
    local hasfp
    s, hasfp, f, t, a, n, l, c, e, d = struct.unpack(HEADER, v)
    if s ~= 'p' and s ~= 'c' then
      return {'corrupt', 'unknown status ' .. string.format('%q', s)}
    end
    if hasfp == '0' then
      f = nil
    elseif hasfp ~= '1' then
      return {'corrupt', 'bad fingerprint flag'}
    end
    if a < 1 or a > 4294967295 or n > 9007199254740991 or l > 9007199254740991
        or c > 9007199254740991 or e > 9007199254740991 or d > 9007199254740991
        or (s == 'p' and l == 0) then
      return {'corrupt', 'out-of-range attempt, fence, lease, time or expiry'}
    end
    -- As the client decodes it (format.rs): a record in progress has no
    -- response; one that has is corrupt, never taken over.
    if s == 'p' and #v ~= HEADER_LEN then
      return {'corrupt', 'in progress with a response'}
    end
  end

  local fence = now_us
  if n and n >= fence then fence = n + 1 end
  local function write(fp_stored, attempt, created)
    local has = '1'
    if not fp_stored then has, fp_stored = '0', ZEROS end
    redis.call('SET', key,
      struct.pack(HEADER, 'p', has, fp_stored, token, attempt, fence, until_ms, created,
        until_ms + grace, 0),
      'PXAT', int(until_ms + grace))
  end

  if not v or e <= now then
    local stored_fp = nil
    if fp ~= '' then stored_fp = fp end
    write(stored_fp, 1, now)
    return {'acquired', 1, until_ms, fp, fence}
  end
  if s == 'p' and t == token then
    return {'acquired', a, l, f or '', n}
  end
  if f and fp ~= '' and f ~= fp then
    return {'mismatch'}
  end
  if s == 'c' then
    return v, e - now
  end
  if l > now then
    return {'in_progress', l, a, now}
  end
  if a < 4294967295 then a = a + 1 end
  if not f and fp ~= '' then f = fp end
  write(f, a, c)
  return {'acquired', a, until_ms, f or '', fence}
end

local out = {now, now_us}
local n = 2
for i = 1, count do
  local reply, ttl = acquire(i, KEYS[i], ARGV[1 + 2 * i], ARGV[2 + 2 * i])
  n = n + 1
  out[n] = reply
  if ttl then
    n = n + 1
    out[n] = ttl
  end
end
return out
