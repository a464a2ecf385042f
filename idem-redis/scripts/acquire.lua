-- acquire: every outcome in one call.
-- KEYS[1] the record. ARGV: [1] fingerprint (32 bytes, or ""),
-- [2] new token (16 bytes), [3] lease ms (1 ..= MAX_MS), [4] in-progress
-- grace ms (0 ..= MAX_MS).
-- Returns {"acquired", attempt, lease_until_ms, stored fingerprint or "", fence}
--       | {"completed", record, ttl_ms}   (the record as stored; the client
--                                          decodes it)
--       | {"in_progress", lease_until_ms, attempt, now_ms}
--       | {"mismatch"}
--       | {"corrupt", detail}
-- or an error reply "IDEM_INVALID ..." for a bad argument, before any write.
--
-- The record is one string (format 2): a 94-byte header, then the response
-- of a completed record. Header (integers big-endian, times in ms by the
-- server's TIME, fence in us):
--   [1] status 'p' in progress | 'c' completed
--   [2] '1' if a fingerprint is stored, else '0'
--   [3..34] fingerprint (zeros if none)   [35..50] token
--   [51..54] attempt (u32)   [55..62] fence   [63..70] lease until (0 once
--   completed)   [71..78] created   [79..86] expires   [87..94] completed
--   (0 while in progress)
-- The key's PEXPIREAT is always `expires`.
--
-- A duplicate of a completed record (the path idem exists for) costs one
-- GET and one PTTL: the key exists, so Redis holds it unexpired (time
-- stands still inside a script), and PTTL is its time left by the
-- server's clock.
--
-- The fence is TIME in microseconds, or the stored fence + 1 if that is
-- higher: it increases across takeovers even if the clock stalls, and
-- after a release, a delete or an expiry (the key is gone) it rests on
-- the server's clock alone.

-- The fast path first, before anything else is defined or parsed: a
-- completed record, replayed as stored (it writes nothing, so the
-- arguments it does not read are checked on the other paths only).
if #KEYS ~= 1 or #ARGV ~= 4 then
  return redis.error_reply('IDEM_INVALID acquire takes 1 key and 4 arguments')
end
local key, fp = KEYS[1], ARGV[1]
if #fp ~= 0 and #fp ~= 32 then
  return redis.error_reply('IDEM_INVALID fingerprint must be 0 or 32 bytes')
end
local v = redis.pcall('GET', key)
-- Only a key of another type reads as corrupt / not ours: any other
-- error (an ACL that refuses GET) is the caller's to see.
if type(v) == 'table' and not string.find(tostring(v.err), 'WRONGTYPE', 1, true) then return v end
if type(v) == 'table' then
  return {'corrupt', 'the record is not a string: ' .. tostring(v.err)}
end
if v and #v >= 94 and string.byte(v, 1) == 99 then
  local hasfp = string.byte(v, 2)
  if hasfp == 48 or hasfp == 49 then
    local ttl = redis.call('PTTL', key)
    -- Live (time left): a mismatch or a replay. Never a mismatch before
    -- that is known: an expired record is absent for any payload.
    if ttl > 0 then
      if hasfp == 49 and fp ~= '' and string.sub(v, 3, 34) ~= fp then
        return {'mismatch'}
      end
      return {'completed', v, ttl}
    end
  end
  -- No expiry (someone PERSISTed it), its last ms, or a bad header: the
  -- general path below decides.
end

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

local token = ARGV[2]
local lease, grace = ms(ARGV[3], 1), ms(ARGV[4], 0)
if #token ~= 16 then return invalid('token must be 16 bytes') end
if not lease then return invalid('lease must be an integer number of ms in 1..=' .. int(MAX_MS)) end
if not grace then return invalid('grace must be an integer number of ms in 0..=' .. int(MAX_MS)) end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local until_ms = now + lease

local s, f, t, a, n, l, c, e, d = nil, nil, nil, nil, nil, nil, nil, nil, nil
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

-- The fence of a new acquisition: above the stored one, even one of an
-- expired record that Redis has not removed yet.
local fence = now_us
if n and n >= fence then fence = n + 1 end

local function write(status, fp_stored, attempt, created)
  local has = '1'
  if not fp_stored then has, fp_stored = '0', string.rep('\0', 32) end
  redis.call('SET', key,
    struct.pack(HEADER, status, has, fp_stored, token, attempt, fence, until_ms, created,
      until_ms + grace, 0),
    'PXAT', int(until_ms + grace))
end

-- Absent, or expired (Redis removes it at `e`; this guards the same ms).
if not v or e <= now then
  local stored_fp = nil
  if fp ~= '' then stored_fp = fp end
  write('p', stored_fp, 1, now)
  return {'acquired', 1, until_ms, fp, fence}
end

-- The same call again (a client retry after a lost reply): this token
-- already holds the key, so it is still acquired, with its fence.
if s == 'p' and t == token then
  return {'acquired', a, l, f or '', n}
end

if f and fp ~= '' and f ~= fp then
  return {'mismatch'}
end

if s == 'c' then
  return {'completed', v, e - now}
end

if l > now then
  return {'in_progress', l, a, now}
end

-- Takeover: the holder's lease is over. Fingerprint and attempt carry over
-- (the attempt saturates at u32::MAX).
if a < 4294967295 then a = a + 1 end
if not f and fp ~= '' then f = fp end
write('p', f, a, c)
return {'acquired', a, until_ms, f or '', fence}
