-- put / tombstone of a cache entry, ordered by fence.
-- KEYS[1] the entry (a string). ARGV: [1] the new value, whose bytes 3..22
-- are its fence as 20 decimal digits (so string order is number order),
-- [2] ttl ms, [3] "keep-equal" (a record: an entry with the same fence
-- stays) or "replace-equal" (a tombstone: it replaces the record it
-- deletes).
-- Returns 1 if written, 0 if the entry holds a higher (or equal) fence.
local ttl = tonumber(ARGV[2])
if not ttl or ttl < 1 or string.len(ARGV[1]) < 22 then
  return redis.error_reply('ERR idem cache: bad arguments')
end
local new_fence = string.sub(ARGV[1], 3, 22)
local old = redis.call('GET', KEYS[1])
if old and string.len(old) >= 22 then
  local magic = string.sub(old, 1, 2)
  if magic == 'I2' or magic == 'T2' then
    local old_fence = string.sub(old, 3, 22)
    if old_fence > new_fence or (old_fence == new_fence and ARGV[3] == 'keep-equal') then
      return 0
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
return 1
