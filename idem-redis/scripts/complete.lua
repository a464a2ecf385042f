-- complete: compare-and-set on the token.
-- KEYS[1] the record. ARGV: [1] token (16 bytes), [2] response, [3]
-- retention ms (0 ..= MAX_MS).
-- Returns 1, or 0 if the token no longer holds the key (LeaseLost), or an
-- error reply "IDEM_INVALID ..." for a bad argument, before any write.
-- Completing again with the token that completed the record returns 1 and
-- changes nothing: a retry after a lost reply must not look like a loss.
-- The record's format: see acquire.lua.
local MAX_MS = 3153600000000 -- idem_core::MAX_DURATION in ms
local HEADER = '>c1c1c32c16I4I8I8I8I8I8'
local HEADER_LEN = 94

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

local v = redis.pcall('GET', key)
-- Only a key of another type reads as corrupt / not ours: any other
-- error (an ACL that refuses GET) is the caller's to see.
if type(v) == 'table' and not string.find(tostring(v.err), 'WRONGTYPE', 1, true) then return v end
if type(v) ~= 'string' or #v < HEADER_LEN then return 0 end
if string.sub(v, 35, 50) ~= token then return 0 end
local s = string.byte(v, 1)
if s == 99 then return 1 end
if s ~= 112 then return 0 end
local _, hasfp, f, t, a, n, _, c = struct.unpack(HEADER, v)
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local expires = now + retention
redis.call('SET', key, struct.pack(HEADER, 'c', hasfp, f, t, a, n, 0, c, expires, now) .. response,
  'PXAT', int(expires))
return 1
