-- take.lua: check.lua for a call that takes quota leases (src/store/redis/leased.rs). A check
-- may ask for more than its cost: `want` units, consumed by its algorithm exactly as `want`
-- units of admitted cost are. When `want` is refused but what is left (the decision's
-- `remaining`: the largest cost admitted right now) covers the cost, that much is taken
-- instead (never more than `want`); when even the cost is refused, the decision is the one
-- for the cost alone (its `retry_after` is the request's own). All or nothing, as check.lua.
-- KEYS: one state key per check, all in one hash slot.
-- ARGV: [1], [2], [3] as check.lua, then seven per check: algorithm, limit, period (ns), cost,
-- horizon (ns), refund token ('' for none), want (at least the cost).
-- Returns {all_admitted, then per check: allowed, remaining, reset_after, retry_after, ref_b,
-- ref_t, granted}: granted is what was consumed (0 unless all were admitted).

local sec, nsec = clock_now()
local slack = tonumber(ARGV[3])
local n = #KEYS
local decisions, commits, tokens, granted = {}, {}, {}, {}
local all = 1
for i = 1, n do
  local j = 3 + (i - 1) * 7
  local decide = ALGORITHMS[ARGV[j + 1]]
  if decide == nil then
    return redis.error_reply('tollgate: unknown algorithm ' .. tostring(ARGV[j + 1]))
  end
  local limit, period = tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3])
  local cost, horizon, want = tonumber(ARGV[j + 4]), tonumber(ARGV[j + 5]), tonumber(ARGV[j + 7])
  local g = want
  local d, commit = decide(KEYS[i], limit, period, g, horizon, sec, nsec)
  if d[1] == 0 and want > cost then
    g = max(min(want, d[2]), cost)
    d, commit = decide(KEYS[i], limit, period, g, horizon, sec, nsec)
    if d[1] == 0 and g > cost then
      g = cost
      d, commit = decide(KEYS[i], limit, period, g, horizon, sec, nsec)
    end
  end
  decisions[i], commits[i], tokens[i], granted[i] = d, commit, ARGV[j + 6], g
  if d[1] == 0 then
    all = 0
  end
end
return commit_and_answer(all, decisions, commits, tokens, slack, granted)
