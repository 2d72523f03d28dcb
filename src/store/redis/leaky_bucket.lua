-- leaky_bucket.lua: mirrors src/algorithm/leaky_bucket.rs step for step.
-- State: hash {b, level, last, p}; level in ns of draining, limit * interval at the rim.

local function leaky_bucket_check(level, last, limit, interval, now, cost)
  local capacity = limit * interval
  now = max(now, last)
  level = max(level - (now - last), 0)
  local level_after = level + cost * interval
  if level_after <= capacity then
    local remaining = floor((capacity - level_after) / interval)
    return { level_after, now }, { 1, remaining, level_after, 0 }
  else
    local remaining = floor(max(capacity - level, 0) / interval)
    local retry = level_after - capacity
    return nil, { 0, remaining, level, retry }
  end
end

ALGORITHMS['leaky_bucket'] = function(key, limit, interval, cost, horizon, sec, now)
  local s = load_hash(key, sec, horizon, { 'level', 'last' })
  local level, last = 0, now
  if s then
    level, last = s.level, s.last - s.shift
  end
  local new, d = leaky_bucket_check(level, last, limit, interval, now, cost)
  if new == nil or cost == 0 then
    return d, nil
  end
  return d, function(slack, token)
    local p = s and pending_absorb(s.p, last + level, now, now_ms(sec, now))
    if token ~= '' then
      p = pending_add(p, token, cost * interval, now_ms(sec, now))
    end
    local ttl = ttl_ms(new[2] + new[1] - now, slack)
    store_hash(key, sec, p, s and s.p, ttl, 'level', int(new[1]), 'last', int(new[2]))
    return 0, 0
  end
end

REFUNDS['leaky_bucket'] = function(key, limit, interval, cost, horizon, token, ref_b, ref_t, sec, now, settle)
  refund_bucket(key, sec, horizon, { 'level', 'last' }, token, settle, cost * interval, function(s, delta)
    -- A level below zero reads as an empty bucket, like a theoretical arrival time in the past.
    return 'level', int(s.level - delta), 'last', int(s.last - s.shift)
  end)
end
