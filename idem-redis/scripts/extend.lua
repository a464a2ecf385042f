-- extend: compare-and-set lease renewal. KEYS[1] the record.
-- ARGV: [1] token (16 bytes), [2] lease ms (1 ..= MAX_MS), [3] in-progress
-- grace ms (0 ..= MAX_MS).
-- Returns {attempt, lease_until_ms, fence}, or 0 if the token no longer
-- holds it, or an error reply "IDEM_INVALID ..." for a bad argument, before
-- any write. The record's format: see acquire.lua.
local MAX_MS = 3153600000000 -- idem_core::MAX_DURATION in ms
local HEADER = '>c1c1c32c16I4I8I8I8I8I8'
local HEADER_LEN = 94

local function invalid(detail)
  return redis.error_reply('IDEM_INVALID ' .. detail)
end
local function ms(v, min)
  local n = tonumber(v)
  if n == nil or n ~= n or n ~= math.floor(n) or n < min or n > MAX_MS then
    return nil
  end
  return n
end
local function int(n)
  return string.format('%.0f', n)
end

if #KEYS ~= 1 or #ARGV ~= 3 then return invalid('extend takes 1 key and 3 arguments') end
local key = KEYS[1]
local token = ARGV[1]
local lease, grace = ms(ARGV[2], 1), ms(ARGV[3], 0)
if #token ~= 16 then return invalid('token must be 16 bytes') end
if not lease then return invalid('lease must be an integer number of ms in 1..=' .. int(MAX_MS)) end
if not grace then return invalid('grace must be an integer number of ms in 0..=' .. int(MAX_MS)) end

local v = redis.pcall('GET', key)
-- Only a key of another type reads as corrupt / not ours: any other
-- error (an ACL that refuses GET) is the caller's to see.
if type(v) == 'table' and not string.find(tostring(v.err), 'WRONGTYPE', 1, true) then return v end
if type(v) ~= 'string' or #v < HEADER_LEN then return 0 end
if string.byte(v, 1) ~= 112 or string.sub(v, 35, 50) ~= token then return 0 end
local s, hasfp, f, t, a, n, _, c = struct.unpack(HEADER, v)
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local until_ms = now + lease
local expires = until_ms + grace
redis.call('SET', key, struct.pack(HEADER, s, hasfp, f, t, a, n, until_ms, c, expires, 0),
  'PXAT', int(expires))
-- Attempt and fence as stored (the client reports a bad one as corrupt).
return {a, until_ms, n}
