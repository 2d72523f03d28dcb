//! refund.lua's keys and arguments: how a consumption is taken back (a slot's when another
//! rejected, a lease's unspent part) or settled.

use fred::types::{Key, Value};

use super::scripts::static_str;
use super::{Answered, Inner, Item, Ticket};

impl Inner {
    /// The keys and arguments of refund.lua: `mode` is `refund` (take back `cost` of what each
    /// consumed) or `settle` (the call was admitted: forget how to refund it).
    pub(super) fn refund_args(
        &self,
        time: [Value; 3],
        consumed: impl Iterator<Item = (Ticket, u64)>,
        mode: &'static str,
    ) -> (Vec<Key>, Vec<Value>) {
        let mut keys: Vec<Key> = Vec::new();
        let [sec, nsec, _] = time;
        let mut args: Vec<Value> = vec![sec, nsec, static_str(mode)];
        for (t, cost) in consumed {
            keys.push(t.key);
            args.push(static_str(t.algorithm));
            args.push(Value::from(t.limit.to_string()));
            args.push(Value::from(t.period.to_string()));
            args.push(Value::from(cost.to_string()));
            args.push(Value::from(t.horizon.to_string()));
            args.push(Value::from(t.token));
            args.push(Value::from(t.ref_b.to_string()));
            args.push(Value::from(t.ref_t.to_string()));
        }
        (keys, args)
    }
}

/// What refund.lua needs to take back an item's consumption.
pub(super) fn refund_of(it: &Item, token: &str, a: &Answered) -> Ticket {
    Ticket {
        key: it.key.clone(),
        algorithm: it.algorithm,
        limit: it.limit,
        period: it.period,
        horizon: it.horizon,
        token: token.to_owned(),
        ref_b: a.ref_b,
        ref_t: a.ref_t,
    }
}

/// What refund.lua needs to take back an item's consumption whose answer never came: its
/// token finds it (the references only the sliding log needs, and it has no token).
pub(super) fn blind_refund_of(it: &Item, token: &str) -> Ticket {
    Ticket {
        key: it.key.clone(),
        algorithm: it.algorithm,
        limit: it.limit,
        period: it.period,
        horizon: it.horizon,
        token: token.to_owned(),
        ref_b: 0,
        ref_t: 0,
    }
}
