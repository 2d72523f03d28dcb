-- arith.lua: exact integer helpers for the window algorithms (concatenated after
-- common.lua where needed).

-- (a * b) mod m, exact for a, b < 2^53 and m <= 2^52 (doubling: every sum stays below 2^53).
local function mulmod(a, b, m)
  local r = 0
  a = a % m
  while b > 0 do
    if b % 2 == 1 then
      r = (r + a) % m
    end
    a = (a + a) % m
    b = floor(b / 2)
  end
  return r
end

-- Where `now` sits in its aligned window of `w` ns: (sec * 1e9 + nsec) mod w, exact.
local function phase(sec, nsec, w)
  return (mulmod(sec % w, NS, w) + nsec) % w
end

local LIMB = 16777216 -- 2^24

local function limbs(x)
  local x0 = x % LIMB
  local t = (x - x0) / LIMB
  local x1 = t % LIMB
  return x0, x1, (t - x1) / LIMB
end

-- The sign of a*b + s - q*c, exactly, for integers 0 <= a, b, q, c < 2^53 and |s| < 2^48.
local function cmp_products(a, b, s, q, c)
  local a0, a1, a2 = limbs(a)
  local b0, b1, b2 = limbs(b)
  local q0, q1, q2 = limbs(q)
  local c0, c1, c2 = limbs(c)
  local l0 = a0 * b0 - q0 * c0 + s
  local l1 = a0 * b1 + a1 * b0 - q0 * c1 - q1 * c0
  local l2 = a0 * b2 + a1 * b1 + a2 * b0 - q0 * c2 - q1 * c1 - q2 * c0
  local l3 = a1 * b2 + a2 * b1 - q1 * c2 - q2 * c1
  local l4 = a2 * b2 - q2 * c2
  -- Carry from limb to limb; the sign of the whole is the sign of the final carry, unless
  -- that is zero and some limb is not.
  local v = l0
  local carry = floor(v / LIMB)
  local nonzero = v ~= carry * LIMB
  v = l1 + carry
  carry = floor(v / LIMB)
  nonzero = nonzero or v ~= carry * LIMB
  v = l2 + carry
  carry = floor(v / LIMB)
  nonzero = nonzero or v ~= carry * LIMB
  v = l3 + carry
  carry = floor(v / LIMB)
  nonzero = nonzero or v ~= carry * LIMB
  v = l4 + carry
  carry = floor(v / LIMB)
  nonzero = nonzero or v ~= carry * LIMB
  if carry < 0 then
    return -1
  elseif carry > 0 or nonzero then
    return 1
  end
  return 0
end

-- floor((a * b + s) / c) for a non-negative numerator and a quotient below 2^53: a double
-- estimate, corrected exactly.
local function muldiv(a, b, s, c)
  local q = floor((a * b + s) / c)
  if q < 0 then
    q = 0
  end
  while q > 0 and cmp_products(a, b, s, q, c) < 0 do
    q = q - 1
  end
  while cmp_products(a, b, s, q + 1, c) >= 0 do
    q = q + 1
  end
  return q
end

