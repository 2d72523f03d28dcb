//! The pacing of one server: when its next request may leave, from what its responses said.
//! Pure: times are the clock's nanoseconds, passed in.

use smallvec::SmallVec;

use crate::client::Quota;

/// The most policies tracked per server (a server sends one or a few; more are ignored).
pub(crate) const MAX_POLICIES: usize = 8;

/// What one server said, and the departures reserved since.
#[derive(Debug, Default)]
pub(crate) struct Server {
    /// No request leaves before this: the end of a refusal's hint.
    gate: u64,
    /// The policy the refusal that set the gate named (its exhausted quota), if any.
    gate_policy: Option<Box<str>>,
    /// Requests that have a departure and no answer yet (waiting or sent).
    in_flight: u64,
    tracks: SmallVec<[Track; 2]>,
    /// The last departure reserved or answer read: for forgetting idle servers.
    pub(crate) last_used: u64,
}

/// One policy (quota) of a server.
#[derive(Debug)]
struct Track {
    policy: Option<Box<str>>,
    /// The quota: as sent (`q`, `X-RateLimit-Limit`), else one more than the most remaining
    /// ever reported.
    limit: u64,
    /// The spacing of departures while paced; 0 while the quota is ample.
    interval: u64,
    /// The earliest departure of the next request under this quota.
    next_at: u64,
    /// When the quota is restored: from then on it paces nothing until it reports again.
    reset_at: u64,
}

/// A departure further away than the longest wait allowed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct TooLong<'a> {
    /// Nanoseconds to wait.
    pub(crate) wait: u64,
    /// The policy that holds the request back: the quota that paces it, or the exhausted
    /// quota of the refusal that closed the gate (`None`: a refusal that named none, or a
    /// legacy field).
    pub(crate) policy: Option<&'a str>,
}

/// A refusal read from a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Refusal<'a> {
    /// Its hint, in nanoseconds.
    pub(crate) wait: u64,
    /// The quota it named as exhausted (the longest to reset), if any.
    pub(crate) policy: Option<&'a str>,
}

/// The longest a refusal's hint closes the gate, in nanoseconds.
pub(crate) const MAX_GATE: u64 = 60_000_000_000;

impl Server {
    /// Reserves the departure of a request asked for at `now`: the time it may leave, or how
    /// long it would have to wait if that is beyond `max_wait` (then nothing is reserved).
    pub(crate) fn depart(&mut self, now: u64, max_wait: u64) -> Result<u64, TooLong<'_>> {
        self.last_used = now;
        let mut at = now.max(self.gate);
        let mut binding = None;
        for (i, track) in self.tracks.iter().enumerate() {
            if now < track.reset_at && track.next_at > at {
                at = track.next_at;
                binding = Some(i);
            }
        }
        if at - now > max_wait {
            let policy = match binding {
                Some(i) => self.tracks[i].policy.as_deref(),
                None => self.gate_policy.as_deref(),
            };
            return Err(TooLong {
                wait: at - now,
                policy,
            });
        }
        for track in &mut self.tracks {
            if now < track.reset_at {
                track.next_at = at.saturating_add(track.interval);
            }
        }
        self.in_flight += 1;
        Ok(at)
    }

    /// A request with a departure was answered, or gave up.
    pub(crate) fn landed(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// A response read at `now` (its own request already landed) reported `quotas`, and if it
    /// was a refusal, its hint.
    pub(crate) fn observe(&mut self, now: u64, quotas: &[Quota], refused: Option<Refusal<'_>>) {
        self.last_used = now;
        if let Some(refusal) = refused {
            // At most a minute: one answer with a day-long hint cannot cut the server off for a
            // day; a request after the minute asks again.
            let until = now.saturating_add(refusal.wait.min(MAX_GATE));
            if until > self.gate {
                self.gate = until;
                self.gate_policy = refusal.policy.map(Box::from);
            }
        }
        for quota in quotas {
            let index = match self
                .tracks
                .iter()
                .position(|t| t.policy.as_deref() == quota.policy.as_deref())
            {
                Some(i) => i,
                None if self.tracks.len() < MAX_POLICIES => {
                    self.tracks.push(Track {
                        policy: quota.policy.as_deref().map(Box::from),
                        limit: 0,
                        interval: 0,
                        next_at: now,
                        reset_at: now,
                    });
                    self.tracks.len() - 1
                }
                None => continue,
            };
            let track = &mut self.tracks[index];
            track.limit = quota
                .limit
                .unwrap_or_else(|| track.limit.max(quota.remaining.saturating_add(1)));
            // The requests still out will take their share of what remains.
            let remaining = quota.remaining.saturating_sub(self.in_flight);
            let reset = u64::try_from(quota.reset.as_nanos()).unwrap_or(u64::MAX);
            track.reset_at = now.saturating_add(reset);
            if remaining.saturating_mul(2) > track.limit {
                // Ample: more than half the quota left, no need to space anything.
                track.interval = 0;
                track.next_at = track.next_at.min(now);
            } else {
                // What remains, spread evenly until the reset: r requests leave at
                // t/(r+1), 2t/(r+1), ..., rt/(r+1), the last one before the reset, and with
                // nothing left the next one leaves at the reset.
                track.interval = reset / remaining.saturating_add(1);
                track.next_at = track.next_at.max(now.saturating_add(track.interval));
            }
            if refused.is_some() {
                // A refusal's quotas hold the server back no longer than its hint may (an
                // exhausted daily quota's `t` is a refusal's hint too): after the minute, one
                // request asks again, and its answer says how things stand.
                track.interval = track.interval.min(MAX_GATE);
                track.next_at = track.next_at.min(now.saturating_add(MAX_GATE));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn quota(policy: Option<&str>, remaining: u64, reset_s: u64, limit: Option<u64>) -> Quota {
        let mut h = http::HeaderMap::new();
        let name = policy.unwrap_or("p");
        h.insert(
            "ratelimit",
            format!("\"{name}\";r={remaining};t={reset_s}")
                .parse()
                .unwrap(),
        );
        if let Some(q) = limit {
            h.insert(
                "ratelimit-policy",
                format!("\"{name}\";q={q};w=10").parse().unwrap(),
            );
        }
        let mut q = crate::client::ServerHints::read(&h).quotas.remove(0);
        if policy.is_none() {
            q.policy = None;
        }
        q
    }

    #[test]
    fn ample_quota_leaves_at_once_then_spreads_what_remains() {
        let mut s = Server::default();
        assert_eq!(s.depart(0, u64::MAX), Ok(0));
        s.landed();
        s.observe(0, &[quota(Some("p"), 6, 10, Some(10))], None);
        assert_eq!(s.depart(0, u64::MAX), Ok(0));
        s.landed();
        // 5 of 10 left is no longer ample: 10 s / 6 apart.
        s.observe(0, &[quota(Some("p"), 5, 10, Some(10))], None);
        assert_eq!(s.depart(0, u64::MAX), Ok(10 * S / 6));
        // A second request, asked before the first is answered, leaves one interval later.
        assert_eq!(s.depart(0, u64::MAX), Ok(2 * (10 * S / 6)));
        s.landed();
        // The answer to the first: 4 left, one of them for the request still out.
        s.observe(2 * S, &[quota(Some("p"), 4, 8, Some(10))], None);
        assert_eq!(s.in_flight, 1);
        assert_eq!(s.tracks[0].interval, 8 * S / 4);
        // The spacing from now (4 s) or after the departure still reserved (5 s): the later.
        assert_eq!(s.depart(2 * S, u64::MAX), Ok(3 * (10 * S / 6)));
        s.landed();
        s.landed();
        // Nothing left: the next request leaves at the reset.
        s.observe(5 * S, &[quota(Some("p"), 0, 3, Some(10))], None);
        assert_eq!(s.depart(5 * S, u64::MAX), Ok(8 * S));
        // Past its reset, a quota paces nothing until it reports again.
        s.landed();
        assert_eq!(s.depart(9 * S, u64::MAX), Ok(9 * S));
    }

    #[test]
    fn the_limit_is_estimated_when_not_sent() {
        let mut s = Server::default();
        // First seen with 9 left: the quota is taken to be 10.
        s.observe(0, &[quota(None, 9, 10, None)], None);
        assert_eq!(s.tracks[0].limit, 10);
        s.observe(0, &[quota(None, 5, 10, None)], None);
        assert_eq!(s.tracks[0].limit, 10);
        assert_eq!(s.tracks[0].interval, 10 * S / 6);
        s.observe(0, &[quota(None, 6, 10, None)], None);
        assert_eq!(s.tracks[0].interval, 0);
        // A sent limit wins.
        s.observe(0, &[quota(None, 6, 10, Some(100))], None);
        assert_eq!(s.tracks[0].limit, 100);
    }

    #[test]
    fn a_refusals_hint_closes_the_gate_for_a_minute_at_most() {
        let mut s = Server::default();
        s.observe(0, &[], Some(refusal(86_400 * S, None)));
        assert!(s.depart(0, u64::MAX).is_ok_and(|at| at == MAX_GATE));
    }

    fn refusal(wait: u64, policy: Option<&str>) -> Refusal<'_> {
        Refusal { wait, policy }
    }

    /// Issue 24, 3: a refusal whose exhausted quota resets in a day closed the gate for a
    /// minute but set the quota's next departure a day ahead: the server was never asked
    /// again. Its quotas now hold the server back a minute at most too, and one request a
    /// minute asks again.
    #[test]
    fn a_refusals_quota_holds_the_server_back_a_minute_at_most() {
        let mut s = Server::default();
        s.observe(
            0,
            &[quota(Some("daily"), 0, 86_400, Some(1000))],
            Some(refusal(86_400 * S, Some("daily"))),
        );
        let e = s.depart(S, 30 * S).unwrap_err();
        assert_eq!((e.wait, e.policy), (MAX_GATE - S, Some("daily")));
        assert_eq!(s.depart(S, u64::MAX), Ok(MAX_GATE));
        s.landed();
        // A request asked an hour on leaves at once, and the next one a minute after it.
        assert_eq!(s.depart(3600 * S, 0), Ok(3600 * S));
        assert_eq!(s.depart(3600 * S, u64::MAX), Ok(3600 * S + MAX_GATE));
        // The same quota in a 200 is the server's word that nothing is left until the reset.
        let mut s = Server::default();
        s.observe(0, &[quota(Some("daily"), 0, 86_400, Some(1000))], None);
        assert_eq!(s.depart(3600 * S, u64::MAX), Ok(86_400 * S));
    }

    /// A quota paces nothing from its reset on, the instant of the reset included (mutants:
    /// `now < reset_at` as `<=`, in both loops of `depart`).
    #[test]
    fn a_quota_paces_nothing_from_the_instant_of_its_reset() {
        let mut s = Server::default();
        s.observe(0, &[quota(Some("p"), 0, 10, Some(10))], None);
        // Reserved at the reset; the next one would be an interval later under the old quota.
        assert_eq!(s.depart(0, u64::MAX), Ok(10 * S));
        s.landed();
        assert_eq!(s.depart(10 * S, u64::MAX), Ok(10 * S));
        s.landed();
        // A departure at the reset does not reserve under the old quota: the new one's
        // spacing holds (4 left of 10 over 10 s: 2 s apart), not the old one's 10 s.
        let mut s = Server::default();
        s.observe(0, &[quota(Some("p"), 0, 10, Some(10))], None);
        assert_eq!(s.depart(10 * S, u64::MAX), Ok(10 * S));
        s.landed();
        s.observe(10 * S, &[quota(Some("p"), 4, 10, Some(10))], None);
        assert_eq!(s.depart(10 * S, u64::MAX), Ok(12 * S));
    }

    /// Of quotas that hold a request back equally, the first reported is named; a quota that
    /// holds it as long as the gate does not take the gate's name (mutant: `next_at > at` as
    /// `>=`).
    #[test]
    fn ties_name_the_first_that_held_the_request_back() {
        let mut s = Server::default();
        s.observe(
            0,
            &[
                quota(Some("a"), 0, 5, Some(10)),
                quota(Some("b"), 0, 5, Some(10)),
            ],
            None,
        );
        assert_eq!(s.depart(0, 0).unwrap_err().policy, Some("a"));
        let mut s = Server::default();
        s.observe(0, &[], Some(refusal(5 * S, Some("gate"))));
        s.observe(0, &[quota(Some("quota"), 0, 5, Some(10))], None);
        assert_eq!(s.depart(0, 0).unwrap_err().policy, Some("gate"));
    }

    /// The gate names the policy of the refusal that closed it, until it opens.
    #[test]
    fn the_gate_names_its_policy() {
        let mut s = Server::default();
        s.observe(0, &[], Some(refusal(30 * S, Some("burst"))));
        let e = s.depart(0, 0).unwrap_err();
        assert_eq!((e.wait, e.policy), (30 * S, Some("burst")));
        // A shorter refusal does not move the gate, nor its name; nor does one that ends with
        // it (mutant: `until > gate` as `>=`).
        s.observe(0, &[], Some(refusal(10 * S, Some("other"))));
        assert_eq!(s.depart(0, 0).unwrap_err().policy, Some("burst"));
        s.observe(0, &[], Some(refusal(30 * S, Some("same"))));
        assert_eq!(s.depart(0, 0).unwrap_err().policy, Some("burst"));
        // A longer one does.
        s.observe(0, &[], Some(refusal(40 * S, None)));
        assert_eq!(s.depart(0, 0).unwrap_err().policy, None);
        // An open gate names nothing.
        assert_eq!(s.depart(40 * S, 0), Ok(40 * S));
    }

    #[test]
    fn a_refusal_closes_the_gate_and_long_waits_are_refused() {
        let mut s = Server::default();
        s.observe(0, &[], Some(refusal(30 * S, None)));
        assert_eq!(
            s.depart(S, 10 * S),
            Err(TooLong {
                wait: 29 * S,
                policy: None
            })
        );
        assert_eq!(s.in_flight, 0);
        assert_eq!(s.depart(S, 30 * S), Ok(30 * S));
        s.landed();
        // A shorter hint does not open the gate earlier.
        s.observe(S, &[], Some(refusal(S, None)));
        assert_eq!(s.depart(S, u64::MAX), Ok(30 * S));
        s.landed();
        // The policy that holds a request back is named.
        s.observe(40 * S, &[quota(Some("daily"), 0, 3600, Some(1000))], None);
        let e = s.depart(40 * S, 60 * S).unwrap_err();
        assert_eq!((e.wait, e.policy), (3600 * S, Some("daily")));
        // The slowest quota holds: each policy is paced on its own.
        let mut s = Server::default();
        s.observe(
            0,
            &[
                quota(Some("a"), 1, 2, Some(10)),
                quota(Some("b"), 1, 4, Some(10)),
            ],
            None,
        );
        assert_eq!(s.depart(0, u64::MAX), Ok(2 * S));
        assert_eq!(s.tracks[0].next_at, 3 * S);
        assert_eq!(s.tracks[1].next_at, 4 * S);
        // Past the most policies tracked, more are ignored.
        let many: Vec<_> = (0..20)
            .map(|i| quota(Some(&format!("p{i}")), 0, 1, None))
            .collect();
        s.observe(0, &many, None);
        assert_eq!(s.tracks.len(), MAX_POLICIES);
    }
}
