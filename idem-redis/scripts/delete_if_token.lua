-- delete_if_token: deletes the record only if the acquisition that holds
-- it is still the one with this lease token and it is not in progress
-- with a live lease (by the server's TIME), in one round trip. For
-- operator tools that check a record, then delete it: a takeover (or a
-- delete and a new acquisition) in between gives the record another
-- token, and a late heartbeat's extend makes its lease live again; either
-- way it is left alone. Harmless to send twice (the cluster client resends
-- a script after a lost reply): the first run leaves its answer in a
-- marker, and a resend answers it again without looking at the record
-- (which it would find gone, and answer 0 for a record it deleted).
-- KEYS[1] the record; KEYS[2] this call's marker, a key whose name holds a
-- random request id and that lives in the record's hash slot (as
-- delete.lua's). ARGV[1] the token (16 bytes), ARGV[2] how long the marker
-- lives, in ms (an integer >= 1).
-- Returns 1 if deleted, 0 if there is no record or it has another token,
-- or an error reply "IDEM_INVALID ..." for a bad argument.
-- The header is format 2 (see acquire.lua): status, fingerprint flag,
-- fingerprint, token (bytes 35..50), attempt, fence, lease deadline (ms).
if #KEYS ~= 2 or #ARGV ~= 2 then
  return redis.error_reply('IDEM_INVALID delete_if_token takes 2 keys and 2 arguments')
end
if #ARGV[1] ~= 16 then
  return redis.error_reply('IDEM_INVALID the token must be 16 bytes')
end
local ttl = tonumber(ARGV[2])
-- At most idem_core::MAX_DURATION in ms (inf and 1e300 pass the other
-- tests, and PX would refuse them after the script's first write).
if ttl == nil or ttl ~= ttl or ttl ~= math.floor(ttl) or ttl < 1 or ttl > 3153600000000 then
  return redis.error_reply('IDEM_INVALID marker ttl must be an integer number of ms in 1..=3153600000000')
end
local first = redis.call('GET', KEYS[2])
if first then return tonumber(first) end
local function answer(n)
  redis.call('SET', KEYS[2], n, 'PX', string.format('%.0f', ttl))
  return n
end
local raw = redis.call('GET', KEYS[1])
if not raw or #raw < 94 or string.sub(raw, 35, 50) ~= ARGV[1] then
  return answer(0)
end
local status, _, _, _, _, _, lease_until = struct.unpack('>c1c1c32c16I4I8I8', raw)
if status == 'p' then
  local time = redis.call('TIME')
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  if lease_until > now then
    return answer(0)
  end
end
return answer(redis.call('DEL', KEYS[1]))
