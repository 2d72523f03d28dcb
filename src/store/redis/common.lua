-- common.lua: helpers shared by every tollgate script (concatenated before the algorithms).
--
-- Precision. Lua numbers in Redis are IEEE doubles: integers are exact only below 2^53, while
-- the Rust state machines count u64 nanoseconds (now ~1.8e18 since the Unix epoch). So no
-- script ever holds an absolute time in nanoseconds. Time is read as (sec, nsec); every key
-- stores a base second `b` and all its times as nanosecond offsets from `b`. On load, the
-- offsets are moved onto the current second (`t - (sec - b) * 1e9`), `now` is just `nsec`, and
-- the state is written back with `b = sec` ("rebase on write"). A state older than its
-- policy's horizon plus two seconds has fully recovered and is read as fresh, so
-- `(sec - b) * 1e9` stays below the horizon and every value below 2^53 (the Rust side refuses
-- policies whose horizon exceeds MAX_HORIZON_NS). The sliding window's products of counts by
-- the window (up to 2^105) go through `muldiv` (arith.lua), exact with 24-bit limbs.
--
-- Scripts run with effects replication (the default since Redis 5), so reading TIME and then
-- writing is safe; LPOP with a count needs Redis 6.2.

local NS = 1000000000

-- The algorithms register here: ALGORITHMS[code](key, limit, period, cost, horizon, sec, nsec)
-- returns the decision {allowed, remaining, reset_after, retry_after} (ns) and, when admitted
-- with a cost, a commit function(slack_ms, token) -> ref_b, ref_t (what a refund needs).
-- REFUNDS[code](key, limit, period, cost, horizon, token, ref_b, ref_t, sec, nsec) undoes it.
local ALGORITHMS, REFUNDS = {}, {}
local floor, max, min = math.floor, math.max, math.min
local tonumber = tonumber

-- An integer as a string, exactly: redis.call and tostring would print numbers with 14
-- significant digits only.
local function int(x)
  return string.format('%.0f', x)
end

-- The current time as (sec, nsec): from Redis TIME, or injected by the caller (tests).
local function clock_now()
  if ARGV[1] ~= '' then
    return tonumber(ARGV[1]), tonumber(ARGV[2])
  end
  local t = redis.call('TIME')
  return tonumber(t[1]), tonumber(t[2]) * 1000
end

-- Milliseconds for PEXPIRE: `ns` rounded up, plus the configured slack, at least 1.
local function ttl_ms(ns, slack)
  return max(1, math.ceil(ns / 1000000) + slack)
end

-- Loads a hash state: the base second and the fields, or nil when absent or fully recovered
-- (older than the horizon plus two seconds). Times are returned moved onto `sec`.
local function load_hash(key, sec, horizon, fields)
  local v = redis.call('HMGET', key, 'b', 'p', unpack(fields))
  local b = tonumber(v[1])
  if b == nil then
    return nil
  end
  if (sec - b) * NS > horizon + 2 * NS then
    -- Stale: as good as fresh, and so are its pending refunds, which must not be read as the
    -- next state's (a late refund would take back what it never counted).
    redis.call('HDEL', key, 'p', 'q')
    return nil
  end
  local out = { shift = (sec - b) * NS }
  for i, f in ipairs(fields) do
    out[f] = tonumber(v[i + 2])
  end
  if v[2] then
    out.p = v[2]
  end
  return out
end

-- Pending refunds of the bucket algorithms (cross-slot checks), kept in field `p` as
-- "token,delta,created_ms,headroom;...". `delta` is how much later the bucket's theoretical
-- arrival time T is because of that consumption. An admitted write at `now` moves T to
-- max(T, now) + cost, which can absorb part of a delta (idle time): delta' = max(T, now) -
-- max(T - delta, now) = min(delta, backlog) with backlog = max(T - now, 0). `headroom` is the
-- least backlog seen by a write since the consumption (-1: none yet). Refunding i changes the
-- delta of another pending j from delta_j to clamp(h - delta_i, 0, delta_j), where h is the
-- headroom of the later of the two: without both consumptions the difference would be
-- min(delta_i + delta_j, h); and the headrooms drop by delta_i where writes saw it: a
-- younger entry's by delta_i, an older one's to at most h_i - delta_i (the list is in the
-- order of the consumptions). Entries older than PENDING_MS are dropped (the refund, if any,
-- comes within the call's timeout; an admitted call settles its entry at once); at most
-- PENDING_MAX are kept, the newest: beyond that the oldest is forgotten (its consumption, if
-- a refund was still to come, stays: an over-rejection, never an over-admission). Refunds
-- come within a round trip, and settles of admitted calls may lag behind a burst, so the
-- oldest entry is the one least likely to be needed.

local PENDING_MS = 2000
local PENDING_MAX = 256
local PENDING_ENTRY = '([^,;]+),([^,;]+),([^,;]+),([^,;]+)'

local function now_ms(sec, nsec)
  return sec * 1000 + floor(nsec / 1000000)
end

local function pending_absorb(p, T, now, ms)
  if p == nil or p == false or p == '' then
    return nil
  end
  local out = {}
  local backlog = max(T - now, 0)
  for tok, d, at, h in string.gmatch(p, PENDING_ENTRY) do
    d, h = tonumber(d), tonumber(h)
    local left = max(T, now) - max(T - d, now)
    if h < 0 or backlog < h then
      h = backlog
    end
    if left > 0 and ms - tonumber(at) <= PENDING_MS then
      out[#out + 1] = tok .. ',' .. int(left) .. ',' .. at .. ',' .. int(h)
    end
  end
  if #out == 0 then
    return nil
  end
  -- The newest PENDING_MAX - 1 (room for the entry pending_add appends): the oldest are the
  -- least likely to be refunded still (an admitted call's settle may simply be late).
  return table.concat(out, ';', max(#out - PENDING_MAX + 2, 1))
end

local function pending_add(p, token, delta, ms)
  local entry = token .. ',' .. int(delta) .. ',' .. int(ms) .. ',-1'
  if p == nil or p == false or p == '' then
    return entry
  end
  local n = select(2, string.gsub(p, ';', ';')) + 1
  if n >= PENDING_MAX then
    -- Full: the oldest entry goes.
    p = string.sub(p, (string.find(p, ';', 1, true) or #p) + 1)
    if p == '' then
      return entry
    end
  end
  return p .. ';' .. entry
end

-- Takes `token` out of the pending list: its delta (0 if unknown), at most `cap` (a quota
-- lease gives back only its unspent part), and the list left. With `settle` (the consumption
-- stays), the other entries are left as they are.
local function pending_take(p, token, settle, cap)
  if p == nil or p == false or p == '' then
    return 0, nil
  end
  local delta, hi, at_i = 0, -1, 0
  local n = 0
  for tok, d, _, h in string.gmatch(p, PENDING_ENTRY) do
    n = n + 1
    if tok == token then
      delta, hi, at_i = min(tonumber(d), cap), tonumber(h), n
    end
  end
  local out = {}
  n = 0
  for tok, d, at, h in string.gmatch(p, PENDING_ENTRY) do
    d, h = tonumber(d), tonumber(h)
    n = n + 1
    if tok ~= token then
      if not settle and delta > 0 and h >= 0 and hi >= 0 then
        d = min(max(max(h, hi) - delta, 0), d)
      end
      if not settle and delta > 0 then
        -- Without the refunded consumption, the backlogs that writes saw after it were
        -- smaller by its delta. The list is in the order of the consumptions: the headroom
        -- of an older entry is the least of what writes saw before the refunded one (not
        -- changed) and after it (its headroom `hi`); a newer entry's writes all came after.
        if n < at_i then
          if hi >= 0 then
            h = min(h, max(hi - delta, 0))
          end
        elseif h >= 0 then
          h = max(h - delta, 0)
        end
      end
      if d > 0 then
        out[#out + 1] = tok .. ',' .. int(d) .. ',' .. at .. ',' .. int(h)
      end
    end
  end
  if #out == 0 then
    return delta, nil
  end
  return delta, table.concat(out, ';')
end

-- The refund of a bucket: loads its state and takes this call's pending delta out of it, at
-- most `cap` (0 with `settle`: the call was admitted everywhere, so only how to refund it is
-- forgotten). `fields_after(s, delta)` returns the field and value pairs of the refunded
-- state.
local function refund_bucket(key, sec, horizon, fields, token, settle, cap, fields_after)
  local s = load_hash(key, sec, horizon, fields)
  if s == nil then
    return
  end
  local delta, p = pending_take(s.p, token, settle, cap)
  if settle then
    delta = 0
  end
  redis.call('HSET', key, 'b', int(sec), fields_after(s, delta))
  if p then
    redis.call('HSET', key, 'p', p)
  else
    redis.call('HDEL', key, 'p')
  end
end

-- RPUSH of many values, in batches that fit Lua's stack.
local function rpush_all(key, values)
  for i = 1, #values, 1000 do
    redis.call('RPUSH', key, unpack(values, i, min(i + 999, #values)))
  end
end

-- Writes a hash state (values already strings) with its base second, its pending list and
-- its expiry, in one step. `had_p`: whether the stored state had a pending list to clear.
local function store_hash(key, sec, p, had_p, ttl, ...)
  if p then
    redis.call('HSET', key, 'b', int(sec), 'p', p, ...)
  else
    redis.call('HSET', key, 'b', int(sec), ...)
    if had_p then
      redis.call('HDEL', key, 'p')
    end
  end
  redis.call('PEXPIRE', key, ttl)
end

-- The answer of check.lua and take.lua: when every check was admitted (`all` = 1), commits
-- each one's consumption; then {all, and per check: allowed, remaining, reset_after,
-- retry_after, ref_b, ref_t}, with take.lua's `granted` after each (0 unless all admitted).
local function commit_and_answer(all, decisions, commits, tokens, slack, granted)
  local out = { all }
  for i = 1, #decisions do
    local ref_b, ref_t = 0, 0
    if all == 1 and commits[i] then
      ref_b, ref_t = commits[i](slack, tokens[i])
    end
    local d = decisions[i]
    out[#out + 1] = d[1]
    out[#out + 1] = d[2]
    out[#out + 1] = d[3]
    out[#out + 1] = d[4]
    out[#out + 1] = ref_b
    out[#out + 1] = ref_t
    if granted then
      out[#out + 1] = (all == 1) and granted[i] or 0
    end
  end
  return out
end
