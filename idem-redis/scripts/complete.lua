-- complete: compare-and-set on the token.
-- KEYS[1] the record. ARGV: [1] token, [2] response, [3] retention ms.
-- Returns 1, or 0 if the token no longer holds the key (LeaseLost).
-- Completing again with the token that completed the record returns 1 and
-- changes nothing: a retry after a lost reply must not look like a loss.
local key = KEYS[1]
if redis.call('TYPE', key).ok ~= 'hash' then return 0 end
local v = redis.call('HMGET', key, 's', 't')
if v[2] ~= ARGV[1] then return 0 end
if v[1] == '2' then return 1 end
if v[1] ~= '1' then return 0 end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local expires = now + tonumber(ARGV[3])
redis.call('HSET', key, 's', '2', 'r', ARGV[2], 'd', now, 'e', expires)
redis.call('HDEL', key, 'l')
redis.call('PEXPIREAT', key, expires)
return 1
