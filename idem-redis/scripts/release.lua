-- release: compare-and-set delete. KEYS[1] the record, ARGV[1] the token.
-- Returns 1, or 0 if the token no longer holds the key (LeaseLost).
local key = KEYS[1]
if redis.call('TYPE', key).ok ~= 'hash' then return 0 end
local v = redis.call('HMGET', key, 's', 't')
if v[1] ~= '1' or v[2] ~= ARGV[1] then return 0 end
redis.call('DEL', key)
return 1
