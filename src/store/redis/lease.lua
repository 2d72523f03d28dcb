-- lease.lua: the leases of a concurrency limit (after common.lua). A key's requests in flight
-- are a sorted set: member = lease id (instance.counter), score = the lease's deadline in
-- milliseconds. Leases past their deadline (an instance that crashed, or lost its renewals)
-- are removed before anything else, so they free their places by themselves.
--
-- KEYS[1]  the set
-- ARGV     sec, nsec (injected time, or '' for Redis TIME), slack_ms, op, id, max, lease_ms
--   op = 'acquire': a lease if fewer than `max` are live; answers {admitted (0/1), live}
--   op = 'renew':   moves a live lease's deadline; answers {1 if it was still live, live}
--   op = 'restore': puts a lease back (or moves it): its request still runs, though the lease
--                   was lost (renewals failed for a lease time, Redis lost data); answers
--                   {1 if it was still live, live}
--   op = 'release': removes the lease;          answers {1 if it was there, live}

local key, op, id = KEYS[1], ARGV[4], ARGV[5]
if op == 'release' then
  local removed = redis.call('ZREM', key, id)
  return { removed, redis.call('ZCARD', key) }
end

local sec, nsec = clock_now()
local now = now_ms(sec, nsec)
local max_live, lease = tonumber(ARGV[6]), tonumber(ARGV[7])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local live = redis.call('ZCARD', key)
local deadline = now + lease

local ok = 0
if op == 'renew' or op == 'restore' then
  if redis.call('ZSCORE', key, id) then
    redis.call('ZADD', key, int(deadline), id)
    ok = 1
  elseif op == 'restore' then
    redis.call('ZADD', key, int(deadline), id)
    live = live + 1
  end
elseif live < max_live then
  redis.call('ZADD', key, int(deadline), id)
  live = live + 1
  ok = 1
end
if live > 0 then
  -- The set lives as long as its latest lease (and the slack), whoever wrote it.
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', key, ttl_ms((tonumber(last[2]) - now) * 1000000, tonumber(ARGV[3])))
end
return { ok, live }
