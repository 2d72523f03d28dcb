-- fixed_window.lua: mirrors src/algorithm/fixed_window.rs step for step.
-- State: hash {b, start, count}. The Rust state keeps the window's index k; here the window
-- is named by its start (k * W as an offset), and `phase` aligns it exactly to [kW, (k+1)W)
-- on the Unix time line.

local function fixed_window_check(stored_start, stored_count, limit, window, now, phase_now, cost)
  local start = now - phase_now
  if stored_start ~= nil then
    start = max(start, stored_start)
  end
  local count = 0
  if start == stored_start then
    count = stored_count
  end
  local window_end = start + window
  local until_end = max(window_end - now, 0)
  if count + cost <= limit then
    count = count + cost
    local reset = 0
    if count > 0 then
      reset = until_end
    end
    return { start, count }, { 1, limit - count, reset, 0 }
  else
    local reset = 0
    if count > 0 then
      reset = until_end
    end
    return nil, { 0, max(limit - count, 0), reset, until_end }
  end
end

ALGORITHMS['fixed_window'] = function(key, limit, window, cost, horizon, sec, now)
  local s = load_hash(key, sec, horizon, { 'start', 'count' })
  local stored_start, stored_count
  if s then
    stored_start, stored_count = s.start - s.shift, s.count
  end
  local new, d = fixed_window_check(stored_start, stored_count, limit, window, now, phase(sec, now, window), cost)
  if new == nil or cost == 0 then
    return d, nil
  end
  return d, function(slack, token)
    -- Pending refunds belong to their window: a new window starts with none.
    local p = nil
    if s and new[1] == stored_start then
      p = s.p
    end
    if token ~= '' then
      p = pending_add(p, token, cost, now_ms(sec, now))
    end
    -- The list is written only when it changed (a call without a token leaves it as it is).
    local old = s and s.p
    if p == old then
      p, old = nil, nil
    end
    store_hash(key, sec, p, old, ttl_ms(new[1] + window - now, slack),
      'start', int(new[1]), 'count', int(new[2]))
    return 0, 0
  end
end

-- The counter is linear: taking the cost back out of the same window is exact; once the
-- window has passed, its count no longer matters. A refund takes back only what its own
-- consumption recorded in this window's pending list (`p`, as the buckets keep it): a refund
-- that comes twice, or after a failover lost the consumption it undoes, finds no entry and
-- subtracts nothing, so it can never take back other requests' counts. An entry pushed out
-- of a full list leaves its consumption counted: an over-rejection, never an over-admission.
REFUNDS['fixed_window'] = function(key, limit, window, cost, horizon, token, ref_b, ref_t, sec, now, settle)
  local s = load_hash(key, sec, horizon, { 'start', 'count' })
  if s == nil then
    return
  end
  local delta, p = pending_take(s.p, token, settle, cost)
  if settle then
    delta = 0
  end
  if delta == 0 and p == s.p then
    return
  end
  redis.call('HSET', key, 'count', int(max(s.count - delta, 0)))
  if p then
    redis.call('HSET', key, 'p', p)
  else
    redis.call('HDEL', key, 'p')
  end
end
