-- acquire: every outcome in one call.
-- KEYS[1] the record (a hash). ARGV: [1] fingerprint (32 bytes, or ""),
-- [2] new token (16 bytes), [3] lease ms (1 ..= MAX_MS), [4] in-progress
-- grace ms (0 ..= MAX_MS).
-- Returns {"acquired", attempt, lease_until_ms, stored fingerprint or "", fence}
--       | {"completed", response, fingerprint, attempt, completed_ms, expires_ms,
--          fence, ttl_ms}
--       | {"in_progress", lease_until_ms, attempt, now_ms}
--       | {"mismatch"}
--       | {"corrupt", detail}
-- or an error reply "IDEM_INVALID ..." for a bad argument, before any write.
-- Fields: s status (1 in progress, 2 completed), f fingerprint, t token,
-- a attempt, n fence, l lease until, r response, c created, d completed,
-- e expires (all times in ms by the server's TIME).
--
-- The fence is TIME in microseconds, or the stored fence + 1 if that is
-- higher: it increases across takeovers even if the clock stalls, and
-- after a release, a delete or an expiry (the hash is gone) it rests on
-- the server's clock alone.
local MAX_MS = 3153600000000 -- idem_core::MAX_DURATION in ms

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
-- Numbers are written as plain integers, never in exponent notation.
local function int(n)
  return string.format('%.0f', n)
end

-- A stored integer in [0, 2^53 - 1], or nil.
local function stored(v)
  local n = tonumber(v)
  if n == nil or n ~= n or n ~= math.floor(n) or n < 0 or n > 9007199254740991 then
    return nil
  end
  return n
end

if #KEYS ~= 1 or #ARGV ~= 4 then return invalid('acquire takes 1 key and 4 arguments') end
local key = KEYS[1]
local fp, token = ARGV[1], ARGV[2]
local lease, grace = ms(ARGV[3], 1), ms(ARGV[4], 0)
if #fp ~= 0 and #fp ~= 32 then return invalid('fingerprint must be 0 or 32 bytes') end
if #token ~= 16 then return invalid('token must be 16 bytes') end
if not lease then return invalid('lease must be an integer number of ms in 1..=' .. int(MAX_MS)) end
if not grace then return invalid('grace must be an integer number of ms in 0..=' .. int(MAX_MS)) end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local until_ms = now + lease

local kind = redis.call('TYPE', key).ok
if kind ~= 'none' and kind ~= 'hash' then
  return {'corrupt', 'the record is a ' .. kind .. ', not a hash'}
end

local s, f, t, a, l, e, n = nil, nil, nil, nil, nil, nil, nil
if kind == 'hash' then
  local v = redis.call('HMGET', key, 's', 'f', 't', 'a', 'l', 'e', 'n')
  s, f, t, a, l, e = v[1], v[2], v[3], stored(v[4]), stored(v[5]), stored(v[6])
  if s ~= '1' and s ~= '2' then
    return {'corrupt', 'unknown status ' .. tostring(s)}
  end
  if not a or a < 1 or a > 4294967295 or not e or (s == '1' and not l) then
    return {'corrupt', 'missing or out-of-range attempt, lease or expiry'}
  end
  -- Records written before fences existed have none: 0.
  n = stored(v[7] or '0')
  if not n then
    return {'corrupt', 'non-numeric or out-of-range fence'}
  end
end

-- The fence of a new acquisition: above the stored one, even one of an
-- expired record that Redis has not removed yet.
local fence = now_us
if n and n >= fence then fence = n + 1 end

-- Absent, or expired (Redis removes it at `e`; this guards the same ms).
if kind == 'none' or e <= now then
  redis.call('DEL', key)
  redis.call('HSET', key, 's', '1', 't', token, 'a', '1', 'n', int(fence),
    'l', int(until_ms), 'c', int(now), 'e', int(until_ms + grace))
  if fp ~= '' then redis.call('HSET', key, 'f', fp) end
  redis.call('PEXPIREAT', key, int(until_ms + grace))
  return {'acquired', 1, until_ms, fp, fence}
end

-- The same call again (a client retry after a lost reply): this token
-- already holds the key, so it is still acquired, with its fence.
if s == '1' and t == token then
  return {'acquired', a, l, f or '', n}
end

if f and fp ~= '' and f ~= fp then
  return {'mismatch'}
end

if s == '2' then
  local v = redis.call('HMGET', key, 'r', 'd')
  if not v[1] or not tonumber(v[2]) then
    return {'corrupt', 'completed without a response or completion time'}
  end
  return {'completed', v[1], f or '', a, tonumber(v[2]), e, n, e - now}
end

if l > now then
  return {'in_progress', l, a, now}
end

-- Takeover: the holder's lease is over. Fingerprint and attempt carry over
-- (the attempt saturates at u32::MAX).
if a < 4294967295 then a = a + 1 end
redis.call('HSET', key, 't', token, 'a', int(a), 'n', int(fence),
  'l', int(until_ms), 'e', int(until_ms + grace))
if not f and fp ~= '' then redis.call('HSET', key, 'f', fp) end
redis.call('PEXPIREAT', key, int(until_ms + grace))
return {'acquired', a, until_ms, f or fp, fence}
