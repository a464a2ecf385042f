-- complete: compare-and-set on the token.
-- KEYS[1] the record. ARGV: [1] token (16 bytes), [2] response, [3]
-- retention ms (0 ..= MAX_MS).
-- Returns 1, or 0 if the token no longer holds the key (LeaseLost), or an
-- error reply "IDEM_INVALID ..." for a bad argument, before any write.
-- Completing again with the token that completed the record returns 1 and
-- changes nothing: a retry after a lost reply must not look like a loss.
local MAX_MS = 3153600000000 -- idem_core::MAX_DURATION in ms

local function invalid(detail)
  return redis.error_reply('IDEM_INVALID ' .. detail)
end
local function int(n)
  return string.format('%.0f', n)
end

if #KEYS ~= 1 or #ARGV ~= 3 then return invalid('complete takes 1 key and 3 arguments') end
local key = KEYS[1]
local token, response = ARGV[1], ARGV[2]
local retention = tonumber(ARGV[3])
if #token ~= 16 then return invalid('token must be 16 bytes') end
if retention == nil or retention ~= retention or retention ~= math.floor(retention)
    or retention < 0 or retention > MAX_MS then
  return invalid('retention must be an integer number of ms in 0..=' .. int(MAX_MS))
end

if redis.call('TYPE', key).ok ~= 'hash' then return 0 end
local v = redis.call('HMGET', key, 's', 't')
if v[2] ~= token then return 0 end
if v[1] == '2' then return 1 end
if v[1] ~= '1' then return 0 end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local expires = now + retention
redis.call('HSET', key, 's', '2', 'r', response, 'd', int(now), 'e', int(expires))
redis.call('HDEL', key, 'l')
redis.call('PEXPIREAT', key, int(expires))
return 1
