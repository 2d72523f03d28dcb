-- sliding_window.lua: mirrors src/algorithm/sliding_window.rs step for step.
-- State: hash {b, start, prev, cur}; the window is named by its start, as in fixed_window.lua.
--
-- Rust compares `prev * (W - elapsed) + cur * W` with `(limit + 1) * W` in u128. Here
-- prev * (W - elapsed) = q * W + r with q = muldiv(prev, W - elapsed, 0, W) exact and
-- 0 <= r < W, so every comparison of the Rust code reduces to one on q: admit iff
-- q + cur + cost <= limit, and remaining = limit - q - cur. The waits use the same identity:
-- ceil((scaled - target) / prev) = W - elapsed - floor(((limit + 1 - cost - cur) * W - 1) / prev).

local function sliding_window_admitted_at(limit, window, start, elapsed, prev, cur, cost)
  -- Still in this window: prev * (W - elapsed - d) + cur * W <= target.
  if prev > 0 then
    local a = limit + 1 - cost - cur
    if a >= 1 then
      local d = window - elapsed - muldiv(a, window, -1, prev)
      if elapsed + d < window then
        return start + elapsed + d
      end
    end
  end
  -- In the next window, d into it: cur * (W - d) <= target.
  local next = start + window
  if cur + cost <= limit then
    return next
  end
  if cur > 0 then
    local d = window - muldiv(limit + 1 - cost, window, -1, cur)
    if d < window then
      return next + d
    end
  end
  -- The window after: both counts have aged out.
  return next + window
end

local function sliding_window_check(stored, limit, window, now, phase_now, cost)
  local start = now - phase_now
  if stored then
    start = max(start, stored.start)
  end
  local elapsed = min(max(now - start, 0), window - 1)
  local prev, cur = 0, 0
  if stored and start == stored.start then
    prev, cur = stored.prev, stored.cur
  elseif stored and start == stored.start + window then
    prev, cur = stored.cur, 0
  end
  local q = muldiv(prev, window - elapsed, 0, window)
  local admit = q + cur + cost <= limit
  if admit then
    cur = cur + cost
  end
  -- The largest n with estimate + n - 1 < limit.
  local remaining = min(max(limit - q - cur, 0), limit)
  local reset
  if cur > 0 then
    reset = start + 2 * window
  elseif prev > 0 then
    reset = start + window
  else
    reset = now
  end
  reset = max(reset - now, 0)
  if admit then
    return { start, prev, cur }, { 1, remaining, reset, 0 }
  end
  local at = sliding_window_admitted_at(limit, window, start, elapsed, prev, cur, cost)
  return nil, { 0, remaining, reset, max(at - now, 0) }
end

ALGORITHMS['sliding_window'] = function(key, limit, window, cost, horizon, sec, now)
  local s = load_hash(key, sec, horizon, { 'start', 'prev', 'cur' })
  local stored
  if s then
    stored = { start = s.start - s.shift, prev = s.prev, cur = s.cur }
  end
  local new, d = sliding_window_check(stored, limit, window, now, phase(sec, now, window), cost)
  if new == nil or cost == 0 then
    return d, nil
  end
  return d, function(slack, token)
    store_hash(key, sec, nil, false, ttl_ms(new[1] + 2 * window - now, slack),
      'start', int(new[1]), 'prev', int(new[2]), 'cur', int(new[3]))
    return sec, new[1]
  end
end

-- The counts are linear: the cost went into the window that started at ref_t; it is in `cur`
-- while that window lasts, in `prev` during the next one, and forgotten after.
REFUNDS['sliding_window'] = function(key, limit, window, cost, horizon, token, ref_b, ref_t, sec, now, settle)
  if settle then
    return
  end
  local s = load_hash(key, sec, horizon, { 'start', 'prev', 'cur' })
  if s == nil then
    return
  end
  local start, at = s.start - s.shift, ref_t - (sec - ref_b) * NS
  if start == at then
    redis.call('HSET', key, 'cur', int(max(s.cur - cost, 0)))
  elseif start == at + window then
    redis.call('HSET', key, 'prev', int(max(s.prev - cost, 0)))
  end
end
