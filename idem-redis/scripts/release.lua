-- release: compare-and-set delete, harmless to send twice (the cluster
-- client resends a script after a lost reply).
-- KEYS[1] the record; KEYS[2] this call's marker, a key whose name holds a
-- random request id and that lives in the record's hash slot (as
-- delete.lua's). ARGV[1] the token (16 bytes), ARGV[2] how long the marker
-- lives, in ms (an integer >= 1).
-- Returns 1, or 0 if the token no longer holds the key (LeaseLost), or an
-- error reply "IDEM_INVALID ..." for a bad argument, before any write.
-- A release that freed the key leaves the marker: its resend finds it and
-- answers 1 again (the record is gone, so without it the resend would
-- answer LeaseLost for the release it did). A refusal leaves none: a
-- token that lost the key never holds it again, so a resend answers 0
-- too. The record's format: see acquire.lua.
if #KEYS ~= 2 or #ARGV ~= 2 then
  return redis.error_reply('IDEM_INVALID release takes 2 keys and 2 arguments')
end
local key = KEYS[1]
local token = ARGV[1]
if #token ~= 16 then return redis.error_reply('IDEM_INVALID token must be 16 bytes') end
local ttl = tonumber(ARGV[2])
-- At most idem_core::MAX_DURATION in ms (inf and 1e300 pass the other
-- tests, and PX would refuse them after the script's first write).
if ttl == nil or ttl ~= ttl or ttl ~= math.floor(ttl) or ttl < 1 or ttl > 3153600000000 then
  return redis.error_reply('IDEM_INVALID marker ttl must be an integer number of ms in 1..=3153600000000')
end
if redis.call('GET', KEYS[2]) then return 1 end
local v = redis.pcall('GET', key)
-- Only a key of another type reads as corrupt / not ours: any other
-- error (an ACL that refuses GET) is the caller's to see.
if type(v) == 'table' and not string.find(tostring(v.err), 'WRONGTYPE', 1, true) then return v end
if type(v) ~= 'string' or #v < 94 then return 0 end
if string.byte(v, 1) ~= 112 or string.sub(v, 35, 50) ~= token then return 0 end
redis.call('DEL', key)
redis.call('SET', KEYS[2], 1, 'PX', string.format('%.0f', ttl))
return 1
