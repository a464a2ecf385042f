-- delete: a DEL that is harmless to send twice (a client retry after a
-- lost reply), in one round trip.
-- KEYS[1] the record; KEYS[2] this call's marker, a key whose name holds a
-- random request id and that lives in the record's hash slot.
-- ARGV[1] how long the marker lives, in ms (an integer >= 1).
-- Returns 1 if the record existed, else 0, or an error reply
-- "IDEM_INVALID ..." for a bad argument, before any write.
--
-- The first run deletes the record and leaves the marker holding its
-- answer. A resend of the same call finds the marker and returns that
-- answer without deleting again: the record there now, if any, is a later
-- acquisition's (a plain DEL resent after the first one's reply was lost
-- would delete that live reservation, and its key would run twice).
if #KEYS ~= 2 or #ARGV ~= 1 then
  return redis.error_reply('IDEM_INVALID delete takes 2 keys and 1 argument')
end
local ttl = tonumber(ARGV[1])
-- At most idem_core::MAX_DURATION in ms (inf and 1e300 pass the other
-- tests, and PX would refuse them after the script's first write).
if ttl == nil or ttl ~= ttl or ttl ~= math.floor(ttl) or ttl < 1 or ttl > 3153600000000 then
  return redis.error_reply('IDEM_INVALID marker ttl must be an integer number of ms in 1..=3153600000000')
end
local first = redis.call('GET', KEYS[2])
if first then return tonumber(first) end
local removed = redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], removed, 'PX', string.format('%.0f', ttl))
return removed
