-- sliding_log.lua: mirrors src/algorithm/sliding_log.rs step for step.
-- State: a list [b, s0, t1, s1, t2, s2, ...]: the base second, then the admitted entries oldest
-- first, each a time (ns offset from b) and a running sum s_i = s0 + c1 + ... + c_i, where c_i
-- is the cost logged at t_i and s0 what the entries already forgotten summed to. Both columns
-- increase along the list, so the cost between two entries is one subtraction, and the first
-- live entry and the entry that decides retry_after are found by bisection (LINDEX, O(log n)
-- reads), never by a scan. Admitting touches the two ends only (pruning is one LPOP with a
-- count), and so does a refund: it rewrites the entries from the one it takes the cost out of
-- to the newest, nearly always the newest alone. An emptied log is deleted. The base moves
-- when the log empties or (rarely, O(entries)) once it or the sums pass LOG_REBASE, so offsets
-- and sums stay below 2^53.
--
-- Keys of this layout are named `...:sl2:...` (src/store/redis/keys.rs); the list of (time,
-- cost) pairs of the first layout, under `...:sl:...`, is never read and expires on its own.

local LOG_REBASE = 1125899906842624 -- 2^50: ns (about 13 days) for the base, units for the sums
local LOG_CHUNK = 32 -- entries read with the header

-- Entry i's time (field 0) or running sum (field 1); entry 0's sum is s0. From what was read
-- with the state when it is there, else one LINDEX (each index read once).
local function log_value(log, i, field)
  local at = 2 * i + field -- 0-based list index
  if at < #log.head then
    return tonumber(log.head[at + 1])
  end
  if i == log.n then
    if field == 0 then
      return log.newest
    end
    return log.last
  end
  local v = log.seen[at]
  if v == nil then
    v = tonumber(redis.call('LINDEX', log.key, at))
    log.seen[at] = v
  end
  return v
end

-- The first entry from `from` on whose field is at least v (n + 1 if none): a look at the
-- entries read with the header, then bisection over the rest.
local function log_seek(log, field, from, v)
  local lo, hi = from, log.n + 1
  local cached = min(log.n, floor((#log.head - 2) / 2))
  while lo <= cached do
    if log_value(log, lo, field) >= v then
      return lo
    end
    lo = lo + 1
  end
  while lo < hi do
    local mid = floor((lo + hi) / 2)
    if log_value(log, mid, field) < v then
      lo = mid + 1
    else
      hi = mid
    end
  end
  return lo
end

local function sliding_log_check(log, limit, window, now, cost)
  if log.n > 0 then
    now = max(now, log.newest)
  end
  -- The first m entries have left the window (t + W <= now).
  local m = log_seek(log, 0, 1, now - window + 1) - 1
  local expired = log_value(log, m, 1) - log_value(log, 0, 1)
  local used = log.total - expired
  local newest_expiry = (log.newest or 0) + window
  if used + cost <= limit then
    used = used + cost
    local reset = 0
    if cost > 0 then
      reset = window
    elseif used > 0 then
      reset = newest_expiry - now
    end
    return m, now, { 1, limit - used, reset, 0 }
  end
  -- Rejected: wait until enough of the oldest live entries have expired: the first whose
  -- running sum, counted from the last expired one, reaches `need` (none if the live entries
  -- do not sum to it).
  local need = used + cost - limit
  local at = newest_expiry
  if need <= used then
    local i = log_seek(log, 1, m + 1, log_value(log, m, 1) + need)
    at = log_value(log, i, 0) + window
  end
  local reset = 0
  if used > 0 then
    reset = newest_expiry - now
  end
  return nil, now, { 0, limit - used, reset, at - now }
end

ALGORITHMS['sliding_log'] = function(key, limit, window, cost, horizon, sec, nsec)
  local head = redis.call('LRANGE', key, 0, 1 + 2 * LOG_CHUNK)
  local log = { key = key, head = {}, seen = {}, n = 0, total = 0, last = 0 }
  local b, shift = sec, 0
  if #head >= 4 then
    local n, newest, last = (#head - 2) / 2, tonumber(head[#head - 1]), tonumber(head[#head])
    if n == LOG_CHUNK then
      n = (redis.call('LLEN', key) - 2) / 2
      if n > LOG_CHUNK then
        local tail = redis.call('LRANGE', key, -2, -1)
        newest, last = tonumber(tail[1]), tonumber(tail[2])
      end
    end
    local stored_b = tonumber(head[1])
    -- Older than its window (all entries expired) reads as fresh; checked before any large
    -- offset is formed.
    if (sec - stored_b) * NS <= LOG_REBASE + horizon + 2 * NS
      and newest + window > (sec - stored_b) * NS + nsec then
      b, shift = stored_b, (sec - stored_b) * NS
      log.head, log.n, log.newest, log.last = head, n, newest, last
      log.total = last - tonumber(head[2])
    end
  end
  local m, now, d = sliding_log_check(log, limit, window, shift + nsec, cost)
  if m == nil or cost == 0 then
    return d, nil
  end
  return d, function(slack, token)
    -- The expired entries go; what they summed to becomes s0.
    local s0 = log_value(log, m, 1)
    local sum = log.last + cost
    local left = log.n - m
    if left == 0 or shift > LOG_REBASE or s0 > LOG_REBASE then
      -- Start over on the current second and from a zero sum, carrying the live entries.
      local entries = {}
      if left > 0 then
        local live = redis.call('LRANGE', key, 2 + 2 * m, -1)
        for i = 1, #live, 2 do
          entries[i] = int(tonumber(live[i]) - shift)
          entries[i + 1] = int(tonumber(live[i + 1]) - s0)
        end
      end
      now = now - shift
      local n = #entries
      if n > 0 and tonumber(entries[n - 1]) == now then
        entries[n] = int(sum - s0)
      else
        entries[n + 1] = int(now)
        entries[n + 2] = int(sum - s0)
      end
      -- A new key has nothing to delete; deleting it anyway would be a first write that lets
      -- the RPUSH past Redis's maxmemory check (see "Memory" in mod.rs).
      if #head > 0 then
        redis.call('DEL', key)
      end
      redis.call('RPUSH', key, int(sec), '0')
      rpush_all(key, entries)
      b = sec
    else
      if m > 0 then
        redis.call('LPOP', key, 2 + 2 * m)
        redis.call('LPUSH', key, int(s0), int(b))
      end
      if log.newest == now then
        redis.call('LSET', key, -1, int(sum))
      else
        redis.call('RPUSH', key, int(now), int(sum))
      end
    end
    redis.call('PEXPIRE', key, ttl_ms(window, slack))
    return b, now
  end
end

-- Taking the cost back out of the entry logged at ref_t is exact; once it has left the
-- window, it no longer matters. The entries from that one to the newest are read from the
-- tail, twice as many each time, and rewritten: O(k) for k entries logged after it (those
-- admitted while this call was in flight), O(1) for the newest.
REFUNDS['sliding_log'] = function(key, limit, window, cost, horizon, token, ref_b, ref_t, sec, nsec, settle)
  if settle then
    return
  end
  local head = redis.call('LRANGE', key, 0, 2)
  if #head < 3 then
    return
  end
  local t = ref_t + (ref_b - tonumber(head[1])) * NS
  if t < tonumber(head[3]) then
    return
  end
  local n = (redis.call('LLEN', key) - 2) / 2
  local k = 1
  while true do
    k = min(k, n)
    -- [the sum before them, then the newest k entries]
    local tail = redis.call('LRANGE', key, -2 * k - 1, -1)
    for j = #tail - 1, 2, -2 do
      local tj = tonumber(tail[j])
      if tj < t then
        return
      end
      if tj == t then
        local c = tonumber(tail[j + 1]) - tonumber(tail[j - 1])
        local back = min(c, cost) -- out of every running sum from this entry on
        local rewritten = {}
        if c > back then
          rewritten[1], rewritten[2] = tail[j], int(tonumber(tail[j + 1]) - back)
        end
        for i = j + 2, #tail, 2 do
          rewritten[#rewritten + 1] = tail[i]
          rewritten[#rewritten + 1] = int(tonumber(tail[i + 1]) - back)
        end
        local popped = #tail - j + 1
        if popped == 2 * n and #rewritten == 0 then
          redis.call('DEL', key)
        elseif popped == 2 and #rewritten == 2 then
          redis.call('LSET', key, -1, rewritten[2])
        else
          redis.call('RPOP', key, popped)
          rpush_all(key, rewritten)
        end
        return
      end
    end
    if k == n then
      return
    end
    k = 2 * k
  end
end
