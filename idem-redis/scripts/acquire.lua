-- acquire: every outcome in one call.
-- KEYS[1] the record (a hash). ARGV: [1] fingerprint (32 bytes, or ""),
-- [2] new token (16 bytes), [3] lease ms, [4] in-progress grace ms.
-- Returns {"acquired", attempt, lease_until_ms, stored fingerprint or ""}
--       | {"completed", response, fingerprint, attempt, completed_ms, expires_ms}
--       | {"in_progress", lease_until_ms, attempt, now_ms}
--       | {"mismatch"}
--       | {"corrupt", detail}
-- Fields: s status (1 in progress, 2 completed), f fingerprint, t token,
-- a attempt, l lease until, r response, c created, d completed, e expires
-- (all times in ms by the server's TIME).
local key = KEYS[1]
local fp, token = ARGV[1], ARGV[2]
local lease, grace = tonumber(ARGV[3]), tonumber(ARGV[4])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local until_ms = now + lease

local kind = redis.call('TYPE', key).ok
if kind ~= 'none' and kind ~= 'hash' then
  return {'corrupt', 'the record is a ' .. kind .. ', not a hash'}
end

local s, f, a, l, e = nil, nil, nil, nil, nil
if kind == 'hash' then
  local v = redis.call('HMGET', key, 's', 'f', 'a', 'l', 'e')
  s, f, a, l, e = v[1], v[2], tonumber(v[3]), tonumber(v[4]), tonumber(v[5])
  if s ~= '1' and s ~= '2' then
    return {'corrupt', 'unknown status ' .. tostring(s)}
  end
  if not a or not e or (s == '1' and not l) then
    return {'corrupt', 'missing or non-numeric attempt, lease or expiry'}
  end
end

-- Absent, or expired (Redis removes it at `e`; this guards the same ms).
if kind == 'none' or e <= now then
  redis.call('DEL', key)
  redis.call('HSET', key, 's', '1', 't', token, 'a', 1, 'l', until_ms, 'c', now, 'e', until_ms + grace)
  if fp ~= '' then redis.call('HSET', key, 'f', fp) end
  redis.call('PEXPIREAT', key, until_ms + grace)
  return {'acquired', 1, until_ms, fp}
end

if f and fp ~= '' and f ~= fp then
  return {'mismatch'}
end

if s == '2' then
  local v = redis.call('HMGET', key, 'r', 'd')
  if not v[1] or not tonumber(v[2]) then
    return {'corrupt', 'completed without a response or completion time'}
  end
  return {'completed', v[1], f or '', a, tonumber(v[2]), e}
end

if l > now then
  return {'in_progress', l, a, now}
end

-- Takeover: the holder's lease is over. Fingerprint and attempt carry over.
a = a + 1
redis.call('HSET', key, 't', token, 'a', a, 'l', until_ms, 'e', until_ms + grace)
if not f and fp ~= '' then redis.call('HSET', key, 'f', fp) end
redis.call('PEXPIREAT', key, until_ms + grace)
return {'acquired', a, until_ms, f or fp}
