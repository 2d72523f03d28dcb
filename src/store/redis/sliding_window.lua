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
    -- Pending refunds follow their counts: `p` lists the current window's, `q` the previous
    -- one's; a window that moves on by one turns `p` into `q`, by more forgets both.
    local p = nil
    if s and new[1] == stored.start then
      p = s.p
    elseif s and new[1] == stored.start + window and s.p then
      redis.call('HSET', key, 'q', s.p)
    elseif s then
      redis.call('HDEL', key, 'q')
    end
    if token ~= '' then
      p = pending_add(p, token, cost, now_ms(sec, now))
    end
    -- The list is written only when it changed (a call without a token leaves it as it is).
    local old = s and s.p
    if p == old then
      p, old = nil, nil
    end
    store_hash(key, sec, p, old, ttl_ms(new[1] + 2 * window - now, slack),
      'start', int(new[1]), 'prev', int(new[2]), 'cur', int(new[3]))
    return 0, 0
  end
end

-- The counts are linear: a consumption is in `cur` while its window lasts and in `prev` during
-- the next one, and its pending entry moves from `p` to `q` with it. A refund takes back only
-- what its own entry recorded (as fixed_window.lua does): twice, or after a failover lost the
-- consumption, it finds nothing and subtracts nothing.
local function pending_holds(p, token)
  return p and p ~= '' and string.find(';' .. p, ';' .. token .. ',', 1, true) ~= nil
end

REFUNDS['sliding_window'] = function(key, limit, window, cost, horizon, token, ref_b, ref_t, sec, now, settle)
  local s = load_hash(key, sec, horizon, { 'start', 'prev', 'cur' })
  if s == nil then
    return
  end
  local field, count, list, pending = 'cur', s.cur, 'p', s.p
  if not pending_holds(pending, token) then
    field, count, list, pending = 'prev', s.prev, 'q', redis.call('HGET', key, 'q')
    if not pending_holds(pending, token) then
      return
    end
  end
  local delta, rest = pending_take(pending, token, settle, cost)
  if settle then
    delta = 0
  end
  redis.call('HSET', key, field, int(max(count - delta, 0)))
  if rest then
    redis.call('HSET', key, list, rest)
  else
    redis.call('HDEL', key, list)
  end
end
