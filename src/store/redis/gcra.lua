-- gcra.lua: mirrors src/algorithm/gcra.rs step for step. State: hash {b, tat, p}.

local function gcra_check(tat, limit, interval, now, cost)
  local capacity = limit * interval
  tat = max(tat, now)
  local new_tat = tat + cost * interval
  local backlog = new_tat - now
  if backlog <= capacity then
    local remaining = floor((capacity - backlog) / interval)
    return new_tat, { 1, remaining, backlog, 0 }
  else
    local held = tat - now
    local remaining = floor(max(capacity - held, 0) / interval)
    return nil, { 0, remaining, held, backlog - capacity }
  end
end

ALGORITHMS['gcra'] = function(key, limit, interval, cost, horizon, sec, now)
  local s = load_hash(key, sec, horizon, { 'tat' })
  -- A fresh key has tat = 0 on the Rust time line; here, "no later than now".
  local tat = s and (s.tat - s.shift) or now
  local new_tat, d = gcra_check(tat, limit, interval, now, cost)
  if new_tat == nil or cost == 0 then
    return d, nil
  end
  return d, function(slack, token)
    local p = s and pending_absorb(s.p, tat, now, now_ms(sec, now))
    if token ~= '' then
      p = pending_add(p, token, cost * interval, now_ms(sec, now))
    end
    store_hash(key, sec, p, s and s.p, ttl_ms(new_tat - now, slack), 'tat', int(new_tat))
    return 0, 0
  end
end

REFUNDS['gcra'] = function(key, limit, interval, cost, horizon, token, ref_b, ref_t, sec, now, settle)
  refund_bucket(key, sec, horizon, { 'tat' }, token, settle, cost * interval, function(s, delta)
    return 'tat', int(s.tat - s.shift - delta)
  end)
end
