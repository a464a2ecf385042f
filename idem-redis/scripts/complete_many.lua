-- complete_many: complete.lua for a batch of leases, in one call, in order.
-- KEYS: the records (on Redis Cluster, all in one hash slot).
-- ARGV: [1] retention ms (0 ..= MAX_MS), then per key: token (16 bytes),
-- response.
-- Returns one integer per key, as complete.lua's (1 completed, or already
-- completed by this token; 0 the token no longer holds the key), or an
-- error reply "IDEM_INVALID ..." for a bad argument, before any write.
-- The record's format: see acquire.lua.
local MAX_MS = 3153600000000 -- idem_core::MAX_DURATION in ms
local HEADER_LEN = 94
local NO_LEASE = string.rep('\0', 8)

local count = #KEYS
if #ARGV ~= 1 + 2 * count then
  return redis.error_reply('IDEM_INVALID complete_many takes 1 + 2 arguments per key')
end
local retention = tonumber(ARGV[1])
if retention == nil or retention ~= retention or retention ~= math.floor(retention)
    or retention < 0 or retention > MAX_MS then
  return redis.error_reply('IDEM_INVALID retention must be an integer number of ms in 0..='
    .. string.format('%.0f', MAX_MS))
end
for i = 1, count do
  if #ARGV[2 * i] ~= 16 then return redis.error_reply('IDEM_INVALID token must be 16 bytes') end
end

-- Every record read in one MGET (in chunks: Lua's unpack holds a few
-- thousand values at most); a key's later items read it again, after the
-- earlier items' writes. MGET's nil (absent, or another type) is a loss.
local first = {}
for from = 1, count, 1000 do
  local to = math.min(from + 999, count)
  local got = redis.call('MGET', unpack(KEYS, from, to))
  for j = 1, to - from + 1 do first[from + j - 1] = got[j] end
end
local seen = {}

local now
local out = {}
for i = 1, count do
  local key, token, response = KEYS[i], ARGV[2 * i], ARGV[2 * i + 1]
  local v = first[i]
  if seen[key] then v = redis.pcall('GET', key) end
  -- Only a key of another type reads as corrupt / not ours: any other
  -- error (an ACL that refuses GET) is the caller's to see.
  if type(v) == 'table' and not string.find(tostring(v.err), 'WRONGTYPE', 1, true) then return v end
  seen[key] = true
  if type(v) ~= 'string' or #v < HEADER_LEN or string.sub(v, 35, 50) ~= token then
    out[i] = 0
  elseif string.byte(v, 1) == 99 then
    out[i] = 1
  elseif string.byte(v, 1) ~= 112 then
    out[i] = 0
  else
    if not now then
      local time = redis.call('TIME')
      now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
    end
    local expires = now + retention
    -- The header with its status, lease, expiry and completion changed
    -- (fingerprint, token, attempt, fence and creation kept as they are),
    -- then the response.
    redis.call('SET', key,
      'c' .. string.sub(v, 2, 62) .. NO_LEASE .. string.sub(v, 71, 78)
        .. struct.pack('>I8I8', expires, now) .. response,
      'PXAT', string.format('%.0f', expires))
    out[i] = 1
  end
end
return out
