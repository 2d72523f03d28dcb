-- token_bucket.lua: mirrors src/algorithm/token_bucket.rs step for step.
-- State: hash {b, credit, last, p}; credit in ns of refill, limit * interval when full.

local function token_bucket_check(credit, last, limit, interval, now, cost)
  local capacity = limit * interval
  now = max(now, last)
  credit = min(credit + (now - last), capacity)
  local need = cost * interval
  if credit >= need then
    local left = credit - need
    return { left, now }, { 1, floor(left / interval), capacity - left, 0 }
  else
    return nil, { 0, floor(credit / interval), capacity - credit, need - credit }
  end
end

ALGORITHMS['token_bucket'] = function(key, limit, interval, cost, horizon, sec, now)
  local s = load_hash(key, sec, horizon, { 'credit', 'last' })
  -- A fresh key is a full bucket.
  local credit, last = limit * interval, now
  if s then
    credit, last = s.credit, s.last - s.shift
  end
  local new, d = token_bucket_check(credit, last, limit, interval, now, cost)
  if new == nil or cost == 0 then
    return d, nil
  end
  return d, function(slack, token)
    local capacity = limit * interval
    -- The theoretical arrival time before this write, for the pending refunds.
    local p = s and pending_absorb(s.p, last + capacity - credit, now, now_ms(sec, now))
    if token ~= '' then
      p = pending_add(p, token, cost * interval, now_ms(sec, now))
    end
    local ttl = ttl_ms(new[2] + (capacity - new[1]) - now, slack)
    store_hash(key, sec, p, s and s.p, ttl, 'credit', int(new[1]), 'last', int(new[2]))
    return 0, 0
  end
end

REFUNDS['token_bucket'] = function(key, limit, interval, cost, horizon, token, ref_b, ref_t, sec, now, settle)
  refund_bucket(key, sec, horizon, { 'credit', 'last' }, token, settle, cost * interval, function(s, delta)
    -- Credit above the capacity is capped when read, like a theoretical arrival time in the past.
    return 'credit', int(s.credit + delta), 'last', int(s.last - s.shift)
  end)
end
