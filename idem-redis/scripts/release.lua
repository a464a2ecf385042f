-- release: compare-and-set delete. KEYS[1] the record, ARGV[1] the token
-- (16 bytes). Returns 1, or 0 if the token no longer holds the key
-- (LeaseLost), or an error reply "IDEM_INVALID ..." for a bad argument.
-- The record's format: see acquire.lua.
if #KEYS ~= 1 or #ARGV ~= 1 then
  return redis.error_reply('IDEM_INVALID release takes 1 key and 1 argument')
end
local key = KEYS[1]
local token = ARGV[1]
if #token ~= 16 then return redis.error_reply('IDEM_INVALID token must be 16 bytes') end
local v = redis.pcall('GET', key)
-- Only a key of another type reads as corrupt / not ours: any other
-- error (an ACL that refuses GET) is the caller's to see.
if type(v) == 'table' and not string.find(tostring(v.err), 'WRONGTYPE', 1, true) then return v end
if type(v) ~= 'string' or #v < 94 then return 0 end
if string.byte(v, 1) ~= 112 or string.sub(v, 35, 50) ~= token then return 0 end
redis.call('DEL', key)
return 1
