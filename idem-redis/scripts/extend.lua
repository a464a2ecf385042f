-- extend: compare-and-set lease renewal. KEYS[1] the record.
-- ARGV: [1] token, [2] lease ms, [3] in-progress grace ms.
-- Returns {attempt, lease_until_ms}, or 0 if the token no longer holds it.
local key = KEYS[1]
if redis.call('TYPE', key).ok ~= 'hash' then return 0 end
local v = redis.call('HMGET', key, 's', 't', 'a')
if v[1] ~= '1' or v[2] ~= ARGV[1] then return 0 end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local until_ms = now + tonumber(ARGV[2])
local expires = until_ms + tonumber(ARGV[3])
redis.call('HSET', key, 'l', until_ms, 'e', expires)
redis.call('PEXPIREAT', key, expires)
return {tonumber(v[3]) or 0, until_ms}
