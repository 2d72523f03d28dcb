-- check.lua: decides every check of one call atomically, all or nothing.
-- KEYS: one state key per check, all in one hash slot.
-- ARGV: [1] injected seconds or '' for Redis TIME, [2] injected nanoseconds, [3] TTL slack in
-- ms, then six per check: algorithm, limit, period (ns), cost, horizon (ns), refund token
-- ('' when the call is not part of a cross-slot check).
-- Returns {all_admitted, then per check: allowed, remaining, reset_after, retry_after, ref_b,
-- ref_t}: ref_b and ref_t tell the refund script where the cost went.

local sec, nsec = clock_now()
local slack = tonumber(ARGV[3])
local n = #KEYS
local decisions, commits, tokens = {}, {}, {}
local all = 1
for i = 1, n do
  local j = 3 + (i - 1) * 6
  local decide = ALGORITHMS[ARGV[j + 1]]
  if decide == nil then
    return redis.error_reply('tollgate: unknown algorithm ' .. tostring(ARGV[j + 1]))
  end
  local d, commit = decide(KEYS[i], tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]),
    tonumber(ARGV[j + 4]), tonumber(ARGV[j + 5]), sec, nsec)
  decisions[i], commits[i], tokens[i] = d, commit, ARGV[j + 6]
  if d[1] == 0 then
    all = 0
  end
end
return commit_and_answer(all, decisions, commits, tokens, slack)
