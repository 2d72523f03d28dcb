//! The field writers, through the rate-limit layer: for rules, policies and a decision of the
//! fuzzer's choosing, `RateLimit-Policy` and `RateLimit` parse as Structured Fields lists
//! (RFC 9651, with the `sfv` crate) and carry exactly the names and numbers they stand for;
//! `Retry-After` and the legacy `X-RateLimit-*` fields agree with the decision.

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tollgate::answer::HeaderProfile;
use tollgate::limiter::Rule;
use tollgate::{Algorithm, Check, Decision, Policy, Rate, RateLimitLayer, Store, StoreError};
use tower_layer::Layer;
use tower_service::Service;

use crate::input::Input;

/// The largest Structured Fields integer.
const SF_MAX: u64 = 999_999_999_999_999;

/// Names a rule or policy might be given: valid ones, and some that must be refused.
const NAMES: &[&str] = &[
    "per-second",
    "a",
    "api:v1.read_write",
    "x",
    "UPPER-lower_09",
    "with space",
    "quote\"",
    "back\\slash",
    "",
    "comma,",
    "semi;",
    "é",
    "0123456789012345678901234567890123456789012345678901234567890123",
    "01234567890123456789012345678901234567890123456789012345678901234",
];

pub(crate) fn check(data: &[u8]) {
    let mut input = Input::new(data);
    let rules_wanted = 1 + input.below(3);
    let mut rules = Vec::new();
    let mut model: Vec<(String, Vec<(String, Policy)>)> = Vec::new();
    let mut buildable = true;
    for _ in 0..rules_wanted {
        let rule_name = name(&mut input);
        buildable &= valid(&rule_name) && model.iter().all(|(n, _)| *n != rule_name);
        let count = 1 + input.below(3);
        let mut policies = Vec::new();
        for i in 0..count {
            let Some(mut policy) = policy(&mut input) else {
                return;
            };
            let own = name(&mut input);
            let named = input.bool();
            let shown = match policy.clone().named(&own) {
                Ok(p) if named => {
                    policy = p;
                    own
                }
                Err(_) if named => {
                    assert!(!valid(&own), "{own:?} was refused");
                    derived(&rule_name, count, i)
                }
                _ => derived(&rule_name, count, i),
            };
            policies.push((shown, policy));
        }
        rules.push(Rule::new(rule_name.clone()).policies(policies.iter().map(|(_, p)| p.clone())));
        model.push((rule_name, policies));
    }
    let checks: usize = model.iter().map(|(_, p)| p.len()).sum();
    let index = input.below(checks);
    let limit = input.edgy_u64();
    let remaining = input.edgy_u64();
    let reset = Duration::from_nanos(input.edgy_u64());
    let allowed = input.bool();
    let decision = if allowed {
        Decision::admitted(limit, remaining, reset)
    } else {
        Decision::rejected(
            limit,
            remaining,
            reset,
            Duration::from_nanos(input.edgy_u64()),
        )
    }
    .with_index(index);

    let mut builder = RateLimitLayer::builder(Decided(decision)).headers(HeaderProfile::Both);
    for rule in rules {
        builder = builder.rule(rule);
    }
    let layer = match builder.build() {
        Ok(layer) => layer,
        Err(e) => {
            assert!(!buildable, "a valid set of rules was refused: {e}");
            return;
        }
    };
    assert!(buildable, "invalid rule names were accepted: {model:?}");
    let response = respond(layer.layer(Ok200));
    let headers = response.headers();
    let text = |name: &str| -> &str {
        headers
            .get(name)
            .unwrap_or_else(|| panic!("no {name}"))
            .to_str()
            .unwrap_or_else(|_| panic!("{name} is not ASCII"))
    };

    // RateLimit-Policy: every policy, in order, as "name";q=limit;w=window-seconds.
    let listed = parse_list(text("ratelimit-policy"));
    let all: Vec<&(String, Policy)> = model.iter().flat_map(|(_, p)| p).collect();
    assert_eq!(listed.len(), all.len(), "{}", text("ratelimit-policy"));
    for ((name, params), (want_name, policy)) in listed.iter().zip(&all) {
        assert_eq!(name, want_name);
        let window = policy.window().as_nanos().div_ceil(1_000_000_000).max(1);
        let window = u64::try_from(window).unwrap_or(u64::MAX).min(SF_MAX);
        assert_eq!(
            params,
            &[
                ("q".to_owned(), policy.limit().min(SF_MAX)),
                ("w".to_owned(), window)
            ],
            "{}",
            text("ratelimit-policy")
        );
    }

    // RateLimit: the decision's policy, "name";r=remaining;t=seconds.
    let (name, policy) = all[index];
    let status = parse_list(text("ratelimit"));
    let t = t_secs(&decision, policy).min(SF_MAX);
    assert_eq!(
        status,
        [(
            name.clone(),
            vec![("r".to_owned(), remaining.min(SF_MAX)), ("t".to_owned(), t)]
        )],
        "{}",
        text("ratelimit")
    );

    // Retry-After and the legacy fields.
    let secs = decision.retry_after_secs();
    if allowed {
        assert_eq!(response.status(), StatusCode::OK);
        assert!(headers.get("retry-after").is_none());
    } else {
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        let retry = text("retry-after")
            .parse::<u64>()
            .expect("Retry-After is delta seconds");
        assert_eq!(Some(retry), secs);
        assert_eq!(t, retry.min(SF_MAX), "t is Retry-After on a refusal");
        let nanos = u64::try_from(decision.retry_after().unwrap().as_nanos()).unwrap();
        assert!(
            retry >= nanos.div_ceil(1_000_000_000),
            "Retry-After rounds up"
        );
    }
    assert_eq!(text("x-ratelimit-limit"), limit.to_string());
    assert_eq!(text("x-ratelimit-remaining"), remaining.to_string());
    let reset_secs = secs.unwrap_or_else(|| decision.reset_after_secs());
    assert_eq!(text("x-ratelimit-reset"), reset_secs.to_string());
}

/// `t` per the draft and the layer's docs: on a refusal the retry in seconds; else until the
/// next unit refills (buckets), the window ends (fixed window, sliding log: the reset), or the
/// current window ends (sliding window counter), rounded up.
fn t_secs(d: &Decision, policy: &Policy) -> u64 {
    if let Some(retry) = d.retry_after_secs() {
        return retry;
    }
    let reset = u128::from(u64::try_from(d.reset_after().as_nanos()).unwrap_or(u64::MAX));
    let period = policy.interval().as_nanos();
    let nanos = match policy.algorithm() {
        Algorithm::Gcra | Algorithm::TokenBucket | Algorithm::LeakyBucket if reset == 0 => 0,
        Algorithm::Gcra | Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            (reset - 1) % period + 1
        }
        Algorithm::SlidingWindow if reset > period => reset - period,
        _ => reset,
    };
    u64::try_from(nanos.div_ceil(1_000_000_000)).unwrap()
}

/// A Structured Fields list of items that are strings with integer parameters.
fn parse_list(text: &str) -> Vec<(String, Vec<(String, u64)>)> {
    let list = sfv::Parser::new(text)
        .parse::<sfv::List>()
        .unwrap_or_else(|e| panic!("{text:?} is not a Structured Fields list: {e}"));
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = match &item.bare_item {
                    sfv::BareItem::String(s) => s.as_str().to_owned(),
                    other => panic!("{text:?}: a name that is not a string: {other:?}"),
                };
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| {
                        let v = v
                            .as_integer()
                            .unwrap_or_else(|| panic!("{text:?}: {k} = {v:?}"));
                        (
                            k.as_str().to_owned(),
                            u64::try_from(i64::from(v)).expect("not negative"),
                        )
                    })
                    .collect();
                (name, params)
            }
            sfv::ListEntry::InnerList(_) => panic!("{text:?}: an inner list"),
        })
        .collect()
}

fn valid(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}

fn derived(rule: &str, count: usize, i: usize) -> String {
    if count == 1 {
        rule.to_owned()
    } else {
        format!("{rule}.{i}")
    }
}

fn name(input: &mut Input<'_>) -> String {
    if input.u8() % 4 == 0 {
        String::from_utf8_lossy(input.bytes(70)).into_owned()
    } else {
        input.pick(NAMES).to_string()
    }
}

fn policy(input: &mut Input<'_>) -> Option<Policy> {
    let limit = input.edgy_u64();
    let period = Duration::from_nanos(input.edgy_u64().max(1));
    match input.u8() % 6 {
        0 => Policy::fixed_window(limit, period),
        1 => Policy::sliding_log(limit, period),
        2 => Policy::sliding_window(limit, period),
        3 => Policy::token_bucket(Rate::new(1 + input.edgy_u64() % 1000, period), limit),
        4 => Policy::leaky_bucket(Rate::new(1 + input.edgy_u64() % 1000, period), limit),
        _ => Policy::gcra(Rate::new(1 + input.edgy_u64() % 1000, period), limit),
    }
    .ok()
}

/// A store that answers every stack of checks with one decision.
struct Decided(Decision);

impl Store for Decided {
    type Future = Ready<Result<Decision, StoreError>>;

    fn check_all(&self, checks: &[Check<'_>]) -> Self::Future {
        assert!(!checks.is_empty());
        ready(Ok(self.0))
    }
}

#[derive(Clone)]
struct Ok200;

impl Service<Request<()>> for Ok200 {
    type Response = Response<String>;
    type Error = Infallible;
    type Future = Ready<Result<Response<String>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<()>) -> Self::Future {
        ready(Ok(Response::new(String::new())))
    }
}

/// One request through `service`, which must answer at once (its store and inner service do).
fn respond<S>(mut service: S) -> S::Response
where
    S: Service<Request<()>>,
    S::Error: std::fmt::Debug,
{
    let mut cx = Context::from_waker(Waker::noop());
    assert!(service.poll_ready(&mut cx).is_ready());
    let future = pin!(service.call(Request::new(())));
    match future.poll(&mut cx) {
        Poll::Ready(response) => response.expect("the layer answers"),
        Poll::Pending => panic!("a ready store and service answer at once"),
    }
}
