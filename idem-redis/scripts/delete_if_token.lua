-- delete_if_token: deletes the record only if the acquisition that holds
-- it is still the one with this lease token and it is not in progress
-- with a live lease (by the server's TIME), in one round trip. For
-- operator tools that check a record, then delete it: a takeover (or a
-- delete and a new acquisition) in between gives the record another
-- token, and a late heartbeat's extend makes its lease live again; either
-- way it is left alone. Harmless to send twice: a resend finds no record,
-- or one it leaves alone.
-- KEYS[1] the record. ARGV[1] the token (16 bytes).
-- Returns 1 if deleted, 0 if there is no record or it has another token,
-- or an error reply "IDEM_INVALID ..." for a bad argument.
-- The header is format 2 (see acquire.lua): status, fingerprint flag,
-- fingerprint, token (bytes 35..50), attempt, fence, lease deadline (ms).
if #KEYS ~= 1 or #ARGV ~= 1 then
  return redis.error_reply('IDEM_INVALID delete_if_token takes 1 key and 1 argument')
end
if #ARGV[1] ~= 16 then
  return redis.error_reply('IDEM_INVALID the token must be 16 bytes')
end
local raw = redis.call('GET', KEYS[1])
if not raw or #raw < 94 or string.sub(raw, 35, 50) ~= ARGV[1] then
  return 0
end
local status, _, _, _, _, _, lease_until = struct.unpack('>c1c1c32c16I4I8I8', raw)
if status == 'p' then
  local time = redis.call('TIME')
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  if lease_until > now then
    return 0
  end
end
return redis.call('DEL', KEYS[1])
