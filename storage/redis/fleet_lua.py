"""The Lua scripts of the fleet ledger (storage/redis/fleet.py), which documents what each does.

Every script takes the tenant's five meta keys, in FleetLedger.meta's order (used, sizes, keys,
quota, pending). RESERVE applies the limit the caller passes (the tenant's sealed quota, or the
sidecar's own, storage/redis/fleet_quota.py) only while the quota key still holds the value the caller
read (ARGV[4]); otherwise it answers {2, 0, the value now} and changes nothing.
"""

RESERVE = """
local q = redis.call('GET', KEYS[4]) or ''
if q ~= ARGV[4] then return {2, 0, q} end
local limit = tonumber(ARGV[3])
local old = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local delta = tonumber(ARGV[2]) - old
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if limit >= 0 and delta > 0 and used + delta > limit then return {0, used, limit} end
local t = redis.call('TIME')
redis.call('INCRBY', KEYS[1], delta)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[3], t[1] .. string.format('%06d', tonumber(t[2])), ARGV[1])
redis.call('SADD', KEYS[5], ARGV[1])
return {1, used + delta, limit}
"""

FORGET = """
local s = redis.call('ZSCORE', KEYS[3], ARGV[1])
if ARGV[2] ~= '' and s ~= ARGV[2] then return -1 end
if ARGV[3] ~= '' and s and redis.call('SISMEMBER', KEYS[5], ARGV[1]) == 1 then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000000 + tonumber(t[2]) - tonumber(s) < tonumber(ARGV[3]) then return -1 end
end
local size = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
if size > 0 then redis.call('DECRBY', KEYS[1], size) end
return size
"""

OLDEST = """
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) * 1000000 + tonumber(t[2]) - tonumber(ARGV[2])
local items = redis.call('ZRANGE', KEYS[3], 0, tonumber(ARGV[3]) - 1, 'WITHSCORES')
local out = {}
local freed = 0
for i = 1, #items, 2 do
  if freed >= tonumber(ARGV[1]) then break end
  if tonumber(items[i + 1]) < cutoff or redis.call('SISMEMBER', KEYS[5], items[i]) == 0 then
    local size = redis.call('HGET', KEYS[2], items[i]) or '0'
    out[#out + 1] = items[i]
    out[#out + 1] = items[i + 1]
    out[#out + 1] = size
    freed = freed + tonumber(size)
  end
end
return out
"""

ADOPT = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old == ARGV[2] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if old and redis.call('SISMEMBER', KEYS[5], ARGV[1]) == 1 then
  local s = tonumber(redis.call('ZSCORE', KEYS[3], ARGV[1]) or '0')
  if now - s < tonumber(ARGV[3]) then return 0 end
end
local delta = tonumber(ARGV[2]) - tonumber(old or '0')
redis.call('INCRBY', KEYS[1], delta)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if not old then redis.call('ZADD', KEYS[3], t[1] .. string.format('%06d', tonumber(t[2])), ARGV[1]) end
return delta
"""

SETTLE = """
local sum = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do sum = sum + tonumber(v) end
local before = tonumber(redis.call('GET', KEYS[1]) or '0')
if sum == 0 then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[5])
else
  redis.call('SET', KEYS[1], sum)
end
return {before, sum}
"""

COMMIT = """
for i = 1, #ARGV do redis.call('SREM', KEYS[5], ARGV[i]) end
return #ARGV
"""

USAGE = """
return {tonumber(redis.call('GET', KEYS[1]) or '0'), redis.call('HLEN', KEYS[2]),
  redis.call('GET', KEYS[4]) or ''}
"""
