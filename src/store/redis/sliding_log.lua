-- sliding_log.lua: mirrors src/algorithm/sliding_log.rs step for step.
-- State: a list [b, total, newest, t1, c1, t2, c2, ...]: the base second, the summed cost, the
-- newest time, then the admitted (time, cost) entries oldest first, times as offsets from b.
-- Appending or pruning never rewrites the entries; the base moves when the log empties, or
-- (rarely, O(entries)) once it is LOG_REBASE old, so offsets stay below 2^53.

local LOG_REBASE = 1125899906842624 -- 2^50 ns, about 13 days
local LOG_CHUNK = 32

-- Reads entries on demand, LOG_CHUNK at a time.
local function log_reader(key, head)
  local cache = head
  local r = { n = 0 }
  function r.entry(i)
    local at = 3 + 2 * (i - 1) -- 0-based list index of the entry's time
    while at + 2 > #cache do
      local more = redis.call('LRANGE', key, #cache, #cache + 2 * LOG_CHUNK - 1)
      if #more == 0 then
        break
      end
      for _, v in ipairs(more) do
        cache[#cache + 1] = v
      end
    end
    return tonumber(cache[at + 1]), tonumber(cache[at + 2])
  end
  return r
end

local function sliding_log_check(log, limit, window, now, cost)
  if log.n > 0 then
    now = max(now, log.newest)
  end
  local expired, m = 0, 0
  while m < log.n do
    local t, c = log.entry(m + 1)
    if t + window > now then
      break
    end
    expired = expired + c
    m = m + 1
  end
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
  -- Rejected: wait until enough of the oldest live entries have expired.
  local need = used + cost - limit
  local at = newest_expiry
  for i = m + 1, log.n do
    local t, c = log.entry(i)
    if c >= need then
      at = t + window
      break
    end
    need = need - c
  end
  local reset = 0
  if used > 0 then
    reset = newest_expiry - now
  end
  return nil, now, { 0, limit - used, reset, at - now }
end

ALGORITHMS['sliding_log'] = function(key, limit, window, cost, horizon, sec, nsec)
  local head = redis.call('LRANGE', key, 0, 2 + 2 * LOG_CHUNK)
  local log = log_reader(key, head)
  local b, shift = sec, 0
  if #head >= 3 then
    local stored_b = tonumber(head[1])
    local newest = tonumber(head[3])
    -- Older than its window (all entries expired) reads as fresh; checked before any large
    -- offset is formed.
    if (sec - stored_b) * NS <= LOG_REBASE + horizon + 2 * NS
      and newest + window > (sec - stored_b) * NS + nsec then
      b, shift = stored_b, (sec - stored_b) * NS
      log.n = (#head - 3) / 2
      if log.n >= LOG_CHUNK then
        log.n = (redis.call('LLEN', key) - 3) / 2
      end
      log.total, log.newest = tonumber(head[2]), newest
    end
  end
  if log.n == 0 then
    log.total = 0
  end
  local m, now, d = sliding_log_check(log, limit, window, shift + nsec, cost)
  if m == nil or cost == 0 then
    return d, nil
  end
  return d, function(slack, token)
    local total = log.total
    for i = 1, m do
      local _, c = log.entry(i)
      total = total - c
    end
    total = total + cost
    local left = log.n - m
    if left == 0 or shift > LOG_REBASE then
      -- Start over on the current second, carrying the live entries.
      local entries = {}
      for i = m + 1, log.n do
        local t, c = log.entry(i)
        entries[#entries + 1] = int(t - shift)
        entries[#entries + 1] = int(c)
      end
      now = now - shift
      local n = #entries
      if n > 0 and tonumber(entries[n - 1]) == now then
        entries[n] = int(tonumber(entries[n]) + cost)
      else
        entries[n + 1] = int(now)
        entries[n + 2] = int(cost)
      end
      redis.call('DEL', key)
      redis.call('RPUSH', key, int(sec), int(total), int(now))
      rpush_all(key, entries)
      b = sec
    else
      redis.call('LPOP', key, 3 + 2 * m)
      if log.newest == now then
        local c = tonumber(redis.call('LINDEX', key, -1))
        redis.call('LSET', key, -1, int(c + cost))
      else
        redis.call('RPUSH', key, int(now), int(cost))
      end
      redis.call('LPUSH', key, int(now), int(total), int(b))
    end
    redis.call('PEXPIRE', key, ttl_ms(window, slack))
    return b, now
  end
end

-- Taking the cost back out of the entry logged at ref_t is exact; once it has left the
-- window, it no longer matters.
REFUNDS['sliding_log'] = function(key, limit, window, cost, horizon, token, ref_b, ref_t, sec, nsec, settle)
  if settle then
    return
  end
  local all = redis.call('LRANGE', key, 0, -1)
  if #all < 5 then
    return
  end
  local b = tonumber(all[1])
  local t = ref_t + (ref_b - b) * NS
  for i = #all - 1, 4, -2 do
    if tonumber(all[i]) == t then
      local c = tonumber(all[i + 1]) - cost
      local total = tonumber(all[2]) - cost
      if c > 0 then
        redis.call('LSET', key, i, int(c))
        redis.call('LSET', key, 1, int(max(total, 0)))
      else
        table.remove(all, i + 1)
        table.remove(all, i)
        if #all < 5 then
          redis.call('DEL', key)
          return
        end
        all[2] = int(max(total, 0))
        all[3] = all[#all - 1]
        local ttl = redis.call('PTTL', key)
        redis.call('DEL', key)
        rpush_all(key, all)
        if ttl > 0 then
          redis.call('PEXPIRE', key, ttl)
        end
      end
      return
    end
    if tonumber(all[i]) < t then
      return
    end
  end
end
