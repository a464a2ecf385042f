-- complete: compare-and-set on the token.
-- KEYS[1] the record. ARGV: [1] token, [2] response, [3] retention ms.
-- Returns 1, or 0 if the token no longer holds the key (LeaseLost).
local key = KEYS[1]
if redis.call('TYPE', key).ok ~= 'hash' then return 0 end
local v = redis.call('HMGET', key, 's', 't')
if v[1] ~= '1' or v[2] ~= ARGV[1] then return 0 end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local expires = now + tonumber(ARGV[3])
redis.call('HSET', key, 's', '2', 'r', ARGV[2], 'd', now, 'e', expires)
redis.call('HDEL', key, 'l')
redis.call('PEXPIREAT', key, expires)
return 1
