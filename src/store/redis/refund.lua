-- refund.lua: takes back what check.lua consumed for a cross-slot check that another slot
-- rejected or, with ARGV[3] = 'settle', only forgets how to (the call was admitted
-- everywhere). KEYS: the state keys. ARGV: [1], [2] time as in check.lua, [3] 'refund' or
-- 'settle', then eight per check: algorithm, limit, period, cost, horizon, refund token,
-- ref_b, ref_t.

local sec, nsec = clock_now()
local settle = ARGV[3] == 'settle'
for i = 1, #KEYS do
  local j = 3 + (i - 1) * 8
  local refund = REFUNDS[ARGV[j + 1]]
  if refund then
    refund(KEYS[i], tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4]),
      tonumber(ARGV[j + 5]), ARGV[j + 6], tonumber(ARGV[j + 7]), tonumber(ARGV[j + 8]), sec, nsec, settle)
  end
end
return #KEYS
