//! The configuration file: every error path, round trips, layers from a file and from code,
//! and reload (state kept, bad files refused, no request lost under load).

mod support;

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tollgate::config::{
    AlgorithmConfig, Bindings, Config, HumanRate, KeyConfig, KeyKind, PolicyConfig, RuleConfig,
};
use tollgate::key::Header;
use tollgate::limiter::Rule;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
use tower::{Service, ServiceBuilder, ServiceExt};

/// Every field of the format, once (the example of the module docs, in memory).
const FULL: &str = r#"
trace_keys = "hashed"

[store]
kind = "memory"
name = "local"
max_keys = 50000
shards = 16
max_key_len = 200

[keys.client]
kind = "forwarded"
trusted = ["10.0.0.0/8", "fd00::/8"]
rfc7239 = true
ipv4_prefix = 24
ipv6_prefix = 56

[keys.peer]
kind = "peer_ip"

[keys.api_key]
kind = "header"
header = "x-api-key"

[keys.caller]
kind = "any_of"
of = ["api_key", "client"]

[keys.both]
kind = "all_of"
of = ["api_key", "peer"]

[keys.tenant]
kind = "custom"
binding = "tenant"

[answers]
headers = "both"
legacy_reset = "unix_seconds"
unavailable_retry_after = "3s"
decision_extension = true

[[rules]]
name = "search"
methods = ["GET", "post"]
exact_methods = true
path_prefix = "/search"
key = "caller"
cost = 5
on_missing_key = "skip"
policies = [
  { algorithm = "token_bucket", rate = "100/minute", burst = 50 },
  { algorithm = "fixed_window", limit = 10000, window = "1d", name = "daily" },
  { algorithm = "sliding_window", rate = "600 per 1h" },
  { algorithm = "sliding_log", limit = 20, window = "15m" },
  { algorithm = "leaky_bucket", rate = "10/s", burst = 30 },
  { algorithm = "gcra", rate = "5/s" },
]

[[rules]]
name = "plan"
route = "/users/{id}"
key = "api_key"
on_missing_key = 401
shadow = true
[rules.tiers]
resolver = "plans"
keys = { "k-internal" = "pro" }
default = "free"
cache_for = "5m"
cache_capacity = 1000
plans = [
  { name = "free", policies = [{ algorithm = "gcra", rate = "60/minute", burst = 10 }] },
  { name = "pro", policies = [{ algorithm = "gcra", rate = "600/minute", burst = 100 }] },
]

[[rules]]
name = "login"
path = "/login"
key = "both"
policies = [{ algorithm = "sliding_log", rate = "5 per 15m" }]

[concurrency]
name = "in-flight"
total = 512
queue = { max_waiting = 64, max_wait = "100ms" }
rules = [{ name = "exports", methods = ["GET"], path_prefix = "/export", key = "tenant", on_missing_key = "skip", max_in_flight = 2 }]

[shed]
name = "front"
limit = "vegas"
initial = 100
min = 10
max = 1000
class_header = "x-criticality"
shares = { sheddable = 0.5, critical = 0.95 }
fair_by = "tenant"
fair_from = 0.7
queue = { max_waiting = 100, max_wait = "50ms" }
deadline_header = "grpc-timeout"
"#;

#[derive(Clone)]
struct Tenant(String);

impl std::fmt::Display for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn bindings() -> Bindings {
    Bindings::new()
        .key("tenant", tollgate::key::Extension::<Tenant>::new())
        .resolver("plans", |key: String| async move {
            key.starts_with("pro-").then(|| "pro".to_owned())
        })
}

/// Every field of the full file is read, and every layer builds.
#[tokio::test]
async fn the_full_file_builds_every_layer() {
    let config = Config::from_toml(FULL).unwrap();
    assert_eq!(config.rules.len(), 3);
    assert_eq!(config.keys.len(), 6);
    let store = config.store().await.unwrap();
    assert!(store.memory().is_some());
    let layer = config.rate_limit_layer(store.clone(), &bindings()).unwrap();
    assert_eq!(
        layer.limiter().rule_names().collect::<Vec<_>>(),
        ["search", "plan", "login"]
    );
    assert!(
        store
            .concurrency_layer(&config, &bindings())
            .unwrap()
            .is_some()
    );
    assert!(config.shed_layer(&bindings()).unwrap().is_some());
}

/// A file written back is read back to the same value, and so is one written in code.
#[test]
fn round_trips() {
    let config = Config::from_toml(FULL).unwrap();
    let text = config.to_toml().unwrap();
    assert_eq!(Config::from_toml(&text).unwrap(), config, "{text}");

    let mut code = Config::default();
    let mut key = KeyConfig::default();
    key.kind = KeyKind::Header;
    key.header = Some("x-api-key".into());
    code.keys.insert("api".into(), key);
    let mut rule = RuleConfig::default();
    rule.name = "per-key".into();
    rule.key = Some("api".into());
    rule.cost = Some(2);
    let mut policy = PolicyConfig::new(AlgorithmConfig::Gcra);
    policy.rate = Some(HumanRate::from(Rate::new(7, Duration::from_millis(1500))));
    policy.burst = Some(9);
    rule.policies.push(policy);
    code.rules.push(rule);
    let text = code.to_toml().unwrap();
    assert_eq!(Config::from_toml(&text).unwrap(), code, "{text}");
    // An empty file is the default configuration, and writes back as nearly nothing.
    assert_eq!(Config::from_toml("").unwrap(), Config::default());
}

/// Every problem of a file is reported at once, each with its field's path.
#[test]
fn every_error_is_reported_with_its_path() {
    let bad = r#"
[store]
kind = "memory"
url = "redis://x"
shards = 3

[keys.client]
kind = "forwarded"
trusted = ["10.0.0.0/8", "10.0.0.0/33"]

[keys.h]
kind = "header"
header = "bad header"

[keys.loop]
kind = "any_of"
of = ["loop", "h"]

[answers]
headers = "ietf"

[[rules]]
name = "ok"
policies = [{ algorithm = "gcra", rate = "10/s" }]

[[rules]]
name = "ok"
key = "nope"
methods = ["G E T"]
path = "/a"
path_prefix = "/b"
policies = [
  { algorithm = "fixed_window", limit = 0, window = "1m" },
  { algorithm = "sliding_log", limit = 5 },
  { algorithm = "gcra", rate = "10/s", window = "1s" },
  { algorithm = "token_bucket", rate = "0/s" },
  { algorithm = "fixed_window", limit = 5, window = "0s" },
  { algorithm = "gcra", rate = "1/s", name = "bad name!" },
]

[[rules]]
name = "bad name!"
on_missing_key = 200
policies = [{ algorithm = "gcra", rate = "10/s" }]
cost = 20

[[rules]]
name = "none"

[shed]
limit = "aimd"
initial = 0
shares = { urgent = 0.5 }
"#;
    let errors = Config::from_toml(bad).unwrap_err();
    let text = errors.to_string();
    assert_eq!(
        errors.paths(),
        [
            "keys.client.trusted[1]",
            "keys.h.header",
            "keys.loop.of",
            "store.url",
            "store.shards",
            "rules[1].name",
            "rules[1].methods[0]",
            "rules[1].path_prefix",
            "rules[1].key",
            "rules[1].policies[0].limit",
            "rules[1].policies[1].window",
            "rules[1].policies[2].window",
            "rules[1].policies[3].rate",
            "rules[1].policies[4].window",
            "rules[1].policies[5].name",
            "rules[2].name",
            "rules[2].on_missing_key",
            "rules[2].cost",
            "rules[3].policies",
            "shed.initial",
            "shed.latency",
        ],
        "{text}"
    );
    assert!(
        text.contains("rules[1].policies[0].limit: the limit"),
        "{text}"
    );
    assert!(
        text.contains("rules[1].policies[4].window: the window"),
        "{text}"
    );
}

/// The same policy twice in a rule, or in a tier, is refused with its path (before the fix
/// the file was accepted, and every request counted twice against it). The same numbers under
/// two names, or in two tiers, are two policies.
#[test]
fn a_policy_listed_twice_is_refused_with_its_path() {
    let text = r#"
[[rules]]
name = "dup"
policies = [
  { algorithm = "fixed_window", limit = 10, window = "1m" },
  { algorithm = "gcra", rate = "1/s" },
  { algorithm = "fixed_window", limit = 10, window = "60s" },
]

[[rules]]
name = "named"
policies = [
  { algorithm = "fixed_window", limit = 10, window = "1m" },
  { algorithm = "fixed_window", limit = 10, window = "1m", name = "again" },
]

[[rules]]
name = "tiers"
tiers.keys = { k = "pro" }
tiers.plans = [
  { name = "free", policies = [{ algorithm = "gcra", rate = "1/s" }] },
  { name = "pro", policies = [{ algorithm = "gcra", rate = "1/s" }, { algorithm = "gcra", rate = "1/s" }] },
]
"#;
    let errors = Config::from_toml(text).unwrap_err();
    assert_eq!(
        errors.paths(),
        [
            "rules[0].policies[2]",
            "rules[2].tiers.plans[1].policies[1]"
        ],
        "{errors}"
    );
    assert!(
        errors
            .to_string()
            .contains("the same policy as rules[0].policies[0]"),
        "{errors}"
    );
}

/// A route in axum 0.7's syntax, which axum 0.8 never matches, is refused with the template
/// in 0.8's syntax, in rate-limit and concurrency rules alike (before the fix it was accepted
/// and never matched).
#[test]
fn an_axum_07_route_is_refused_with_a_hint() {
    let text = r#"
[[rules]]
name = "user"
route = "/users/:id"
policies = [{ algorithm = "gcra", rate = "1/s" }]

[concurrency]
rules = [{ name = "files", route = "/files/*rest", max_in_flight = 2 }]
"#;
    let errors = Config::from_toml(text).unwrap_err();
    assert_eq!(
        errors.paths(),
        ["rules[0].route", "concurrency.rules[0].route"],
        "{errors}"
    );
    let text = errors.to_string();
    assert!(text.contains(r#"write "/users/{id}""#), "{text}");
    assert!(text.contains(r#"write "/files/{*rest}""#), "{text}");
}

/// Unknown fields and values of the wrong type are all reported, not only the first.
#[test]
fn unknown_fields_and_types_are_all_reported() {
    let bad = r#"
[store]
kind = "disk"

[answers]
header = "ietf"

[[rules]]
name = "a"
polices = []

[[rules]]
name = "b"
cost = "two"
policies = [{ algorithm = "gcra", rate = "ten per second", burst = 5 }]
"#;
    let errors = Config::from_toml(bad).unwrap_err();
    let text = errors.to_string();
    assert_eq!(
        errors.paths(),
        [
            "answers.header",
            "rules[0].polices",
            "rules[1].cost",
            "rules[1].policies[0].rate",
            "store.kind",
        ],
        "{text}"
    );
    assert!(text.contains("unknown field `header`"), "{text}");
    // Not TOML at all: the syntax error, with its place.
    let errors = Config::from_toml("[rules\nname = 1").unwrap_err();
    assert!(errors.to_string().starts_with("not TOML"), "{errors}");
}

/// Reading problems do not hide the problems of the values read: an unknown field and a bad
/// value elsewhere are reported together, reading's first. The part of the file that held a
/// field set aside reports nothing more, since its problems could only echo the one set aside
/// (a rule whose misspelt `polices` went has no policies; a store whose kind went is a
/// memory store with a Redis URL).
#[test]
fn a_required_field_of_the_wrong_type_is_one_problem_not_two() {
    // Set aside for its type, a required field would leave its parent "missing" it: that echo
    // is not a second problem.
    let errors = Config::from_toml(
        r#"
        [[rules]]
        name = "r"
        policies = [{ algorithm = 5, limit = 10, window = "1m" }]
        "#,
    )
    .unwrap_err();
    assert_eq!(
        errors.paths(),
        ["rules[0].policies[0].algorithm"],
        "{errors}"
    );
}

#[test]
fn a_file_with_hundreds_of_problems_reports_the_first_hundred() {
    // One reading problem, then 150 rules with a window of zero: the report stops at 100.
    let mut text = String::from("colour = \"blue\"\n");
    for i in 0..150 {
        text.push_str(&format!(
            "[[rules]]\nname = \"r{i}\"\npolicies = [{{ algorithm = \"fixed_window\", limit = 1, window = \"0s\" }}]\n"
        ));
    }
    let errors = Config::from_toml(&text).unwrap_err();
    assert_eq!(errors.errors().len(), 100, "{errors}");
    assert_eq!(errors.paths()[0], "colour");
    assert_eq!(errors.paths()[99], "rules[98].policies[0].window");
}

#[test]
fn reading_problems_do_not_hide_value_problems() {
    let errors = Config::from_toml(
        r#"
        [keys.api]
        kind = "header"
        header = "x-api-key"
        colour = "blue"
        [[rules]]
        name = "a"
        polices = [{ algorithm = "gcra", rate = "1/s" }]
        [[rules]]
        name = "b"
        key = "api"
        policies = [{ algorithm = "fixed_window", limit = 10, window = "0s" }]
        [shed]
        limit = "fixed"
        initial = 0
        "#,
    )
    .unwrap_err();
    assert_eq!(
        errors.paths(),
        [
            "keys.api.colour",
            "rules[0].polices",
            "rules[1].policies[0].window",
            "shed.initial",
        ],
        "{errors}"
    );
    let messages: Vec<_> = errors.errors().iter().map(|e| e.message()).collect();
    assert!(
        messages[0].starts_with("unknown field `colour`"),
        "{errors}"
    );
    assert!(
        messages[1].starts_with("unknown field `polices`"),
        "{errors}"
    );
    assert_eq!(messages[3], "must be at least 1");

    // The store's reading problem leaves out the store's other problems, and the rules' (the
    // store decides which policies run on Redis); the other sections are checked.
    let errors = Config::from_toml(
        r#"
        [store]
        kind = "disk"
        url = "redis://x"
        [[rules]]
        name = "r"
        policies = [{ algorithm = "gcra", rate = "0/s" }]
        [shed]
        limit = "fixed"
        initial = 0
        "#,
    )
    .unwrap_err();
    assert_eq!(errors.paths(), ["store.kind", "shed.initial"], "{errors}");

    // A key set aside whole would make every rule that names it an echo: nothing more is
    // reported until it reads.
    let errors = Config::from_toml(
        r#"
        keys.api = 5
        [[rules]]
        name = "r"
        key = "api"
        policies = [{ algorithm = "gcra", rate = "1/s" }]
        [shed]
        limit = "fixed"
        initial = 0
        "#,
    )
    .unwrap_err();
    assert_eq!(errors.paths(), ["keys.api"], "{errors}");
}

/// The bounds of a key's address prefixes and of the store's key length: each reported at its
/// field, with the bound; the bounds themselves are accepted.
#[test]
fn prefixes_and_key_length_are_bounded() {
    let errors = Config::from_toml(
        r#"
        [store]
        max_key_len = 0
        [keys.v4]
        kind = "peer_ip"
        ipv4_prefix = 33
        [keys.v6]
        kind = "forwarded"
        trusted = ["10.0.0.0/8"]
        ipv6_prefix = 129
        [keys.header]
        kind = "header"
        header = "x-api-key"
        ipv4_prefix = 24
        ipv6_prefix = 64
        "#,
    )
    .unwrap_err();
    let found: Vec<_> = errors
        .errors()
        .iter()
        .map(|e| (e.path(), e.message()))
        .collect();
    assert_eq!(
        found,
        [
            (
                "keys.header.ipv4_prefix",
                "not used by a key of kind header"
            ),
            (
                "keys.header.ipv6_prefix",
                "not used by a key of kind header"
            ),
            ("keys.v4.ipv4_prefix", "33 bits: at most 32"),
            ("keys.v6.ipv6_prefix", "129 bits: at most 128"),
            ("store.max_key_len", "must be at least 1"),
        ],
        "{errors}"
    );
    Config::from_toml(
        r#"
        store.max_key_len = 1
        keys.peer = { kind = "peer_ip", ipv4_prefix = 32, ipv6_prefix = 128 }
        keys.proxied = { kind = "forwarded", trusted = ["10.0.0.0/8"], ipv4_prefix = 0, ipv6_prefix = 0 }
        "#,
    )
    .unwrap();
}

/// The options the memory file (`FULL`) cannot set, for the round trip below: a Redis store
/// with all its options, a distributed concurrency limit, an AIMD shedder, and the answers'
/// other values.
#[cfg(all(feature = "redis", feature = "axum"))]
const REDIS_FULL: &str = r#"
trace_keys = "plain"

[store]
kind = "redis"
name = "shared"
url = "redis://127.0.0.1:6379/2"
prefix = "rl:"
pool_size = 8
timeout = "40ms"
deny_cache = 5000
max_cross_slot_calls = 64
on_failure = "local"
instances = 3
breaker = { failures = 4, open_for = "1s500ms" }
max_key_len = 300

[keys.client]
kind = "peer_ip"
ipv4_prefix = 24
ipv6_prefix = 48

[keys.tenant]
kind = "header"
header = "x-tenant"

[answers]
headers = "legacy"
legacy_reset = "delta_seconds"
unavailable_retry_after = "1s"
decision_extension = true

[[rules]]
name = "per-client"
methods = ["GET", "HEAD"]
exact_methods = true
path_prefix = "/api"
key = "client"
cost = 2
on_missing_key = 429
shadow = true
policies = [{ algorithm = "gcra", rate = "50/s", burst = 100, name = "steady" }]

[[rules]]
name = "plan"
key = "tenant"
on_missing_key = "skip"
[rules.tiers]
resolver = "plans"
keys = { "t-1" = "gold", "t-2" = "free" }
default = "free"
cache_for = "30s"
cache_capacity = 5000
timeout = "250ms"
plans = [
  { name = "free", policies = [{ algorithm = "fixed_window", limit = 100, window = "1m" }] },
  { name = "gold", policies = [
      { algorithm = "token_bucket", rate = "1000/minute", burst = 200 },
      { algorithm = "sliding_window", rate = "50000 per 1h", name = "gold-hourly" },
  ] },
]

[concurrency]
name = "leases"
total = 100
queue = { max_waiting = 10, max_wait = "20ms" }
distributed = true
lease_time = "5s"
on_store_error = "closed"
rules = [
  { name = "jobs", methods = ["POST"], route = "/jobs/{id}", key = "tenant", on_missing_key = 400, max_in_flight = 3 },
  { name = "uploads", path = "/upload", max_in_flight = 1 },
]

[shed]
name = "edge"
limit = "aimd"
initial = 50
min = 5
max = 500
latency = "200ms"
class_header = "x-class"
shares = { critical = 0.9, sheddable_plus = 0.7 }
fair_by = "tenant"
fair_from = 0.5
fair_cap = 0.25
queue = { max_waiting = 20, max_wait = "10ms" }
deadline_header = "x-deadline"
"#;

/// Files that together set every option of the schema (a Redis store with a URL, then with a
/// cluster; the memory file) are read, written and read back to the same configuration, and
/// written again to the same text.
#[cfg(all(feature = "redis", feature = "axum"))]
#[test]
fn files_with_every_option_round_trip() {
    let cluster = REDIS_FULL.replace(
        r#"url = "redis://127.0.0.1:6379/2""#,
        r#"cluster = ["10.0.0.1:6379", "[fd00::1]:6380"]"#,
    );
    let files = [FULL, REDIS_FULL, cluster.as_str()];
    assert_eq!(options_missing(&files), Vec::<String>::new());
    for text in files {
        let config = Config::from_toml(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let written = config.to_toml().unwrap();
        let again = Config::from_toml(&written).unwrap_or_else(|e| panic!("{e}\n{written}"));
        assert_eq!(again, config, "{written}");
        assert_eq!(again.to_toml().unwrap(), written);
    }
}

/// Bindings a file names but code did not give are errors at build time, with their paths.
#[test]
fn unbound_names_are_errors() {
    let config = Config::from_toml(FULL).unwrap();
    let errors = config
        .rate_limit_layer(MemoryStore::new(), &Bindings::new())
        .unwrap_err();
    assert_eq!(
        errors.paths(),
        ["keys.tenant.binding", "rules[1].tiers.resolver"],
        "{errors}"
    );
}

type App = tower::util::BoxCloneSyncService<Request<String>, Response<String>, Infallible>;
type Ok = fn(Request<String>) -> std::future::Ready<Result<Response<String>, Infallible>>;

fn app<L>(layer: L) -> App
where
    L: tower::Layer<tower::util::ServiceFn<Ok>>,
    L::Service: Service<Request<String>, Response = Response<String>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    <L::Service as Service<Request<String>>>::Future: Send + 'static,
{
    fn ok(_: Request<String>) -> std::future::Ready<Result<Response<String>, Infallible>> {
        std::future::ready(Ok(Response::new(String::new())))
    }
    let service = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(ok as Ok));
    tower::util::BoxCloneSyncService::new(service)
}

async fn send(service: &App, path: &str, api_key: &str) -> Response<String> {
    let request = Request::get(path)
        .header("x-api-key", api_key)
        .body(String::new())
        .unwrap();
    service.clone().oneshot(request).await.unwrap()
}

fn field(response: &Response<String>, name: &str) -> String {
    response
        .headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// The same limits from a file and from code answer the same, field for field.
#[tokio::test]
async fn a_layer_from_a_file_is_the_layer_from_code() {
    let config = Config::from_toml(
        r#"
        keys.api = { kind = "header", header = "x-api-key" }
        [[rules]]
        name = "per-key"
        key = "api"
        policies = [
          { algorithm = "gcra", rate = "2/s", burst = 3 },
          { algorithm = "fixed_window", rate = "5/minute", name = "minute" },
        ]
        [[rules]]
        name = "export"
        path_prefix = "/export"
        cost = 2
        policies = [{ algorithm = "token_bucket", rate = "1/s", burst = 4 }]
        "#,
    )
    .unwrap();
    let clock = tollgate::clock::ManualClock::new();
    let from_file = app(config
        .rate_limit_layer(MemoryStore::with_clock(clock.clone()), &Bindings::new())
        .unwrap());
    let from_code = app(
        RateLimitLayer::builder(MemoryStore::with_clock(clock.clone()))
            .rule(
                Rule::new("per-key")
                    .key(Header::from_static("x-api-key"))
                    .policy(Policy::gcra(Rate::per_second(2), 3).unwrap())
                    .policy(
                        Policy::fixed_window(5, Duration::from_secs(60))
                            .unwrap()
                            .named("minute")
                            .unwrap(),
                    ),
            )
            .rule(
                Rule::new("export")
                    .path_prefix("/export")
                    .cost(2)
                    .policy(Policy::token_bucket(Rate::per_second(1), 4).unwrap()),
            )
            .build()
            .unwrap(),
    );
    for step in 0..12 {
        let path = if step % 3 == 0 { "/export/x" } else { "/" };
        let key = if step % 5 == 0 { "k2" } else { "k1" };
        let a = send(&from_file, path, key).await;
        let b = send(&from_code, path, key).await;
        assert_eq!(a.status(), b.status(), "step {step}");
        for name in ["ratelimit", "ratelimit-policy", "retry-after"] {
            assert_eq!(field(&a, name), field(&b, name), "step {step}, {name}");
        }
        clock.advance(Duration::from_millis(150));
    }
}

const RELOAD_A: &str = r#"
keys.api = { kind = "header", header = "x-api-key" }
[[rules]]
name = "per-key"
key = "api"
policies = [{ algorithm = "fixed_window", limit = 3, window = "1h" }]
[[rules]]
name = "global"
policies = [{ algorithm = "fixed_window", limit = 6, window = "1h", name = "all" }]
"#;

/// A reload keeps what clients consumed under unchanged (rule, policy) pairs, starts changed
/// policies fresh, and refuses a bad file or a changed store, keeping the old configuration.
#[tokio::test]
async fn reload_keeps_state_and_refuses_bad_files() {
    let config = Config::from_toml(RELOAD_A).unwrap();
    let store = MemoryStore::new();
    let (layer, reloader) = config
        .reloadable_rate_limit_layer(store.clone(), Bindings::new())
        .unwrap();
    let service = app(layer.clone());
    for _ in 0..3 {
        assert_eq!(send(&service, "/", "k1").await.status(), StatusCode::OK);
    }
    assert_eq!(
        send(&service, "/", "k1").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    // The same rules plus one: k1 stays exhausted (its state is kept).
    let with_extra = format!(
        "{RELOAD_A}\n[[rules]]\nname = \"extra\"\npolicies = [{{ algorithm = \"gcra\", rate = \"100/s\" }}]\n"
    );
    let summary = reloader.reload_toml(&with_extra).unwrap();
    assert_eq!(summary.added, ["extra"]);
    assert!(summary.changed.is_empty() && summary.removed.is_empty());
    assert_eq!(
        send(&service, "/", "k1").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(send(&service, "/", "k2").await.status(), StatusCode::OK);
    assert_eq!(layer.limiter().rule_names().count(), 3);

    // A bad file: refused with its errors, the running rules stay.
    let bad = RELOAD_A.replace("limit = 3", "limit = 0");
    let errors = reloader.reload_toml(&bad).unwrap_err();
    assert_eq!(errors.paths(), ["rules[0].policies[0].limit"]);
    assert_eq!(reloader.current().rules.len(), 3);
    assert_eq!(
        send(&service, "/", "k1").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    // A changed store: refused, whatever else the file says.
    let moved = format!("store.max_keys = 10\n{with_extra}");
    let errors = reloader.reload_toml(&moved).unwrap_err();
    assert_eq!(errors.paths(), ["store"]);

    // The per-key policy changed (a new limit): new state, so k1 gets its allowance again;
    // the global policy is unchanged and keeps counting: 4 admitted so far, 2 left.
    let raised = RELOAD_A.replace("limit = 3", "limit = 4");
    let summary = reloader.reload_toml(&raised).unwrap();
    assert_eq!(summary.changed, ["per-key"]);
    assert_eq!(summary.removed, ["extra"]);
    assert_eq!(send(&service, "/", "k1").await.status(), StatusCode::OK);
    assert_eq!(send(&service, "/", "k2").await.status(), StatusCode::OK);
    let refused = send(&service, "/", "k3").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(
        field(&refused, "ratelimit").starts_with(r#""all";r=0"#),
        "{:?}",
        refused.headers()
    );
}

/// Under concurrent requests, reloads back and forth lose no request and answer none twice
/// (every request sent reaches the handler once and is answered 200), and no request sees half
/// of one configuration and half of the other. Each reload waits until every client has been
/// answered under the new configuration, so reloads and requests interleave however fast or
/// slow the machine is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_is_atomic_and_loses_nothing() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering::SeqCst};
    const CLIENTS: usize = 4;
    const RELOADS: usize = 100;
    const A: &str = r#""a";q=1000000;w=1, "a";q=1000000;w=1"#;
    const B: &str = r#""b";q=1000000;w=1, "b";q=1000000;w=1"#;
    let config_named = |name: &str| {
        Config::from_toml(&format!(
            r#"
            [[rules]]
            name = "one"
            policies = [{{ algorithm = "gcra", rate = "1000000/s", name = "{name}" }}]
            [[rules]]
            name = "two"
            policies = [{{ algorithm = "gcra", rate = "1000000/s", name = "{name}" }}]
            "#
        ))
        .unwrap()
    };
    let (layer, reloader) = config_named("a")
        .reloadable_rate_limit_layer(MemoryStore::new(), Bindings::new())
        .unwrap();
    // The handler counts the requests that reach it.
    let handled = Arc::new(AtomicU64::new(0));
    let service: App = {
        let handled = handled.clone();
        let handler = tower::service_fn(move |_: Request<String>| {
            handled.fetch_add(1, SeqCst);
            std::future::ready(Ok::<_, Infallible>(Response::new(String::new())))
        });
        tower::util::BoxCloneSyncService::new(ServiceBuilder::new().layer(layer).service(handler))
    };
    // The configuration each client was last answered under: 0 (none yet), b'a' or b'b'.
    let last: Arc<[AtomicU8; CLIENTS]> = Arc::new(std::array::from_fn(|_| AtomicU8::new(0)));
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (service, last, stop) = (service.clone(), last.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut sent, mut ok, mut seen) = (0u64, 0u64, std::collections::BTreeSet::new());
                while !stop.load(SeqCst) {
                    sent += 1;
                    let response = send(&service, "/", "k").await;
                    ok += u64::from(response.status() == StatusCode::OK);
                    // Both rules' policies carry one configuration's name, never a mix.
                    let name = match field(&response, "ratelimit-policy").as_str() {
                        A => b'a',
                        B => b'b',
                        mixed => panic!("{mixed}"),
                    };
                    seen.insert(name);
                    last[client].store(name, SeqCst);
                    tokio::task::yield_now().await;
                }
                (sent, ok, seen.len())
            })
        })
        .collect();
    let reloads = async {
        for i in 0..=RELOADS {
            // The first round waits for the first configuration; then each reload swaps.
            let name = if i % 2 == 0 { b'a' } else { b'b' };
            if i > 0 {
                let name = if name == b'a' { "a" } else { "b" };
                reloader.reload(config_named(name)).unwrap();
            }
            while last.iter().any(|l| l.load(SeqCst) != name) {
                if clients.iter().any(|c| c.is_finished()) {
                    return; // a client failed: its panic is reported below
                }
                tokio::task::yield_now().await;
            }
        }
    };
    // A bound for a reload that never takes effect, not a timing: it takes milliseconds.
    tokio::time::timeout(Duration::from_secs(30), reloads)
        .await
        .expect("every client is answered under each new configuration");
    stop.store(true, SeqCst);
    let mut total = 0;
    for client in clients {
        let (sent, ok, configurations) = client.await.unwrap();
        assert_eq!(ok, sent, "every request answered 200");
        // Answered under both configurations: the reloads happened between its requests.
        assert_eq!(configurations, 2);
        total += sent;
    }
    assert_eq!(handled.load(SeqCst), total, "each request handled once");
    assert!(total >= (CLIENTS * (RELOADS + 1)) as u64, "{total}");
}

/// The file of the module docs, as written; with `commented`, with the options it shows
/// commented out (`# shards = 64`) in.
fn documented_file(commented: bool) -> String {
    let source = include_str!("../src/config/mod.rs");
    let start = source.find("//! ```toml\n").unwrap() + "//! ```toml\n".len();
    let end = start + source[start..].find("//! ```\n").unwrap();
    let is_option = |line: &str| {
        line.split_once(" = ").is_some_and(|(name, _)| {
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        })
    };
    source[start..end]
        .lines()
        .map(|line| {
            let line = line
                .strip_prefix("//!")
                .unwrap()
                .strip_prefix(' ')
                .unwrap_or("");
            match line.strip_prefix("# ") {
                Some(option) if commented && is_option(option) => option,
                _ => line,
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The file of the module docs is a valid configuration.
#[cfg(all(feature = "redis", feature = "axum"))]
#[test]
fn the_documented_file_is_valid() {
    let text = documented_file(false);
    let config = Config::from_toml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(config.rules.len(), 4);
    assert!(config.concurrency.is_some() && config.shed.is_some());
}

/// One step into a TOML value.
#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

fn value_at<'v>(value: &'v toml::Value, at: &[Step]) -> &'v toml::Value {
    at.iter().fold(value, |value, step| match step {
        Step::Key(key) => &value[key.as_str()],
        Step::Index(i) => &value[*i],
    })
}

/// The fields of the struct that the table at `at` is read into, learnt from the error of
/// reading it with one more field; `None` for a map (whose keys are names, not fields).
fn fields_of(root: &toml::Value, at: &[Step]) -> Option<Vec<String>> {
    let mut probed = root.clone();
    let mut table = &mut probed;
    for step in at {
        table = match step {
            Step::Key(key) => table.get_mut(key.as_str()),
            Step::Index(i) => table.get_mut(*i),
        }
        .unwrap();
    }
    let probe = "zzz_probe";
    table
        .as_table_mut()
        .unwrap()
        .insert(probe.into(), toml::Value::Integer(0));
    let error = probed.try_into::<Config>().err()?.to_string();
    let unknown = format!("unknown field `{probe}`");
    let line = error.lines().find(|line| line.contains(&unknown))?;
    let expected = line.find("expected").map_or("", |at| &line[at..]);
    Some(
        expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect(),
    )
}

/// The options of the configuration's schema that none of `texts` sets, sorted, each as the
/// path of a table of its struct (`store.pool_size`, `rules[].tiers.timeout`,
/// `keys.*.binding`). The schema is not listed here: each table is asked for the fields of
/// its struct, so a field added to the schema is missing until the texts set it. A struct's
/// fields may be set in any of its tables (a policy's `window` in a rule or in a tier); a
/// struct none of the texts has shows as its missing field in its parent.
fn options_missing(texts: &[&str]) -> Vec<String> {
    use std::collections::{BTreeMap, BTreeSet};
    let join = |shape: &str, name: &str| {
        if shape.is_empty() {
            name.to_owned()
        } else {
            format!("{shape}.{name}")
        }
    };
    // By struct (its fields): the first path of a table of it, and the fields set there.
    let mut structs: BTreeMap<Vec<String>, (String, BTreeSet<String>)> = BTreeMap::new();
    for text in texts {
        let root =
            toml::Value::Table(toml::from_str(text).unwrap_or_else(|e| panic!("{e}\n{text}")));
        let mut tables = vec![(String::new(), Vec::new())];
        while let Some((shape, at)) = tables.pop() {
            let fields = fields_of(&root, &at);
            let table = value_at(&root, &at).as_table().unwrap();
            let is_struct = fields.is_some();
            if let Some(fields) = fields {
                let (first, set) = structs
                    .entry(fields)
                    .or_insert_with(|| (shape.clone(), BTreeSet::new()));
                if shape < *first {
                    first.clone_from(&shape);
                }
                set.extend(table.keys().cloned());
            }
            for (name, child) in table {
                let shape = join(&shape, if is_struct { name } else { "*" });
                let mut at = at.clone();
                at.push(Step::Key(name.clone()));
                match child {
                    toml::Value::Table(_) => tables.push((shape, at)),
                    toml::Value::Array(items) => {
                        for (i, item) in items.iter().enumerate() {
                            if item.is_table() {
                                let mut at = at.clone();
                                at.push(Step::Index(i));
                                tables.push((format!("{shape}[]"), at));
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    assert!(structs.len() > 1, "no struct found: {structs:?}");
    let mut missing: Vec<_> = structs
        .iter()
        .flat_map(|(fields, (shape, set))| {
            fields
                .iter()
                .filter(|field| !set.contains(*field))
                .map(|field| join(shape, field))
        })
        .collect();
    missing.sort();
    missing
}

/// The file of the module docs shows every option of the schema (set, or commented out where
/// it cannot be set with the others).
#[test]
fn the_documented_file_shows_every_option() {
    assert_eq!(
        options_missing(&[&documented_file(true)]),
        Vec::<String>::new()
    );
    // The check finds what a file leaves out, down to the fields of nested tables.
    let missing = options_missing(&[&documented_file(false)]);
    assert_eq!(
        missing,
        [
            "shed.latency",
            "store.cluster",
            "store.max_keys",
            "store.shards"
        ]
    );
    let fewer = options_missing(&[r#"
        [store]
        kind = "memory"
        [[rules]]
        name = "r"
        policies = [{ algorithm = "gcra", rate = "1/s" }]
        tiers = { resolver = "x", plans = [{ name = "p", policies = [] }] }
        "#]);
    for path in [
        "keys",
        "store.pool_size",
        "rules[].methods",
        "rules[].policies[].burst",
        "rules[].tiers.timeout",
    ] {
        assert!(fewer.contains(&path.to_owned()), "{path} in {fewer:?}");
    }
    assert!(
        !fewer.contains(&"rules[].tiers.plans[].name".to_owned()),
        "{fewer:?}"
    );
}

/// Absurd key graphs are refused quickly with a clear error: a cycle, too many parts, and a
/// diamond that would be exponential if each reference were built anew.
#[test]
fn absurd_keys_are_refused() {
    let errors = Config::from_toml(
        r#"
        keys.a = { kind = "any_of", of = ["b", "peer"] }
        keys.b = { kind = "all_of", of = ["a", "peer"] }
        keys.peer = { kind = "peer_ip" }
        keys.wide = { kind = "any_of", of = ["peer", "peer", "peer", "peer", "peer", "peer", "peer", "peer", "peer", "peer", "peer", "peer", "peer", "peer", "peer", "peer", "peer"] }
        "#,
    )
    .unwrap_err();
    assert!(
        errors.to_string().contains("nested more than 8 deep"),
        "{errors}"
    );
    assert!(errors.paths().contains(&"keys.wide.of"), "{errors}");
    // A diamond 8 deep with 16 parts a level: built once per name, but each request would run
    // 16^7 extractors; refused, as is a name given twice.
    let mut text = String::from("keys.k0 = { kind = \"peer_ip\" }\n");
    for level in 1..8 {
        let parts = (0..16)
            .map(|i| format!("\"k{}-{i}\"", level - 1))
            .collect::<Vec<_>>()
            .join(", ");
        for i in 0..16 {
            text.push_str(&format!(
                "keys.\"k{level}-{i}\" = {{ kind = \"any_of\", of = [{parts}] }}\n"
            ));
        }
        for i in 0..16 {
            if level == 1 {
                text.push_str(&format!("keys.\"k0-{i}\" = {{ kind = \"peer_ip\" }}\n"));
            }
        }
    }
    let errors = Config::from_toml(&text).unwrap_err();
    assert!(
        errors.to_string().contains("more than 32 extractors"),
        "{errors}"
    );
    let twice = Config::from_toml(
        "keys.p = { kind = \"peer_ip\" }\nkeys.h = { kind = \"header\", header = \"x\" }\n\
         keys.a = { kind = \"any_of\", of = [\"h\", \"p\", \"h\"] }\n",
    )
    .unwrap_err();
    assert_eq!(twice.paths(), ["keys.a.of[2]"]);
    // Within the bound: 4 x 8 extractors.
    let text = "keys.p = { kind = \"peer_ip\" }\n".to_owned()
        + &(0..8)
            .map(|i| format!("keys.h{i} = {{ kind = \"header\", header = \"x-{i}\" }}\n"))
            .collect::<String>()
        + "keys.eight = { kind = \"any_of\", of = [\"h0\", \"h1\", \"h2\", \"h3\", \"h4\", \"h5\", \"h6\", \"h7\"] }\n"
        + "keys.e2 = { kind = \"all_of\", of = [\"eight\", \"p\"] }\n"
        + "keys.wide = { kind = \"any_of\", of = [\"eight\", \"e2\", \"p\"] }\n";
    Config::from_toml(&text).unwrap();
}

/// The paths of the problems of every other section: tiers, the store, the overload layers.
#[test]
fn every_section_reports_its_paths() {
    let tiers = r#"
        [[rules]]
        name = "plan"
        [rules.tiers]
        keys = { "k1" = "gold" }
        default = "silver"
        cache_capacity = 0
        plans = [
          { name = "free", policies = [{ algorithm = "gcra", rate = "1/s" }] },
          { name = "free", policies = [] },
          { name = "bad name", policies = [{ algorithm = "gcra" }] },
        ]
        [[rules]]
        name = "no-plans"
        tiers = { resolver = "x" }
    "#;
    let errors = Config::from_toml(tiers).unwrap_err();
    assert_eq!(
        errors.paths(),
        [
            "rules[0].tiers.keys",
            "rules[0].tiers.default",
            "rules[0].tiers.plans[1].name",
            "rules[0].tiers.plans[1].policies",
            "rules[0].tiers.plans[2].name",
            "rules[0].tiers.plans[2].policies[0].rate",
            "rules[0].tiers.cache_capacity",
            "rules[1].tiers.plans",
        ],
        "{errors}"
    );

    let store = r#"
        [store]
        kind = "redis"
        name = "has space"
        cluster = ["10.0.0.1:6379", "nope"]
        url = "redis://x"
        max_keys = 5
        pool_size = 1000
        max_cross_slot_calls = 0
        timeout = "0s"
        instances = 3
        breaker = { failures = 0, open_for = "0s" }
    "#;
    let errors = Config::from_toml(store).unwrap_err();
    let mut paths = errors.paths();
    // Without feature `redis`, the kind itself is a problem too.
    paths.retain(|p| *p != "store.kind");
    assert_eq!(
        paths,
        [
            "store.max_keys",
            "store.name",
            "store.cluster",
            "store.cluster[1]",
            "store.timeout",
            "store.pool_size",
            "store.max_cross_slot_calls",
            "store.instances",
            "store.breaker.failures",
            "store.breaker.open_for",
        ],
        "{errors}"
    );

    let overload = r#"
        keys.peer = { kind = "peer_ip" }
        [concurrency]
        total = 0
        lease_time = "10s"
        on_store_error = "closed"
        queue = { max_waiting = 0, max_wait = "0s" }
        rules = [
          { name = "a", max_in_flight = 0 },
          { name = "a", key = "ghost", max_in_flight = 1 },
        ]
        [shed]
        limit = "fixed"
        initial = 10
        min = 2
        latency = "1s"
        class_header = "bad header"
        shares = { urgent = 0.5, sheddable = 2.0 }
        fair_from = 0
        fair_cap = 1.5
        fair_by = "ghost"
        deadline_header = "grpc-timeout"
    "#;
    let errors = Config::from_toml(overload).unwrap_err();
    assert_eq!(
        errors.paths(),
        [
            "concurrency.rules[0].max_in_flight",
            "concurrency.rules[1].name",
            "concurrency.rules[1].key",
            "concurrency.total",
            "concurrency.queue.max_waiting",
            "concurrency.queue.max_wait",
            "concurrency.lease_time",
            "concurrency.on_store_error",
            "shed.min",
            "shed.latency",
            "shed.class_header",
            "shed.shares.sheddable",
            "shed.shares.urgent",
            "shed.fair_from",
            "shed.fair_cap",
            "shed.deadline_header",
            "shed.fair_by",
        ],
        "{errors}"
    );
    let distributed =
        Config::from_toml("[concurrency]\ntotal = 5\ndistributed = true\n").unwrap_err();
    assert_eq!(distributed.paths(), ["concurrency.distributed"]);
    let aimd = Config::from_toml("[shed]\nlimit = \"aimd\"\ninitial = 5\n").unwrap_err();
    assert_eq!(aimd.paths(), ["shed.latency"]);
}

/// A file naming a Redis store connects to it behind its failure policy, and the layers it
/// describes (the rate limit, a distributed concurrency limit) run on it.
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_redis_store_from_the_file() {
    let server = redis_or_skip!();
    let text = format!(
        r#"
        keys.api = {{ kind = "header", header = "x-api-key" }}
        [store]
        kind = "redis"
        name = "shared"
        url = "{}"
        prefix = "cfg:"
        timeout = "2s"
        on_failure = "closed"
        breaker = {{ failures = 3, open_for = "1s" }}
        [[rules]]
        name = "per-key"
        key = "api"
        policies = [{{ algorithm = "fixed_window", limit = 2, window = "1h" }}]
        [concurrency]
        distributed = true
        lease_time = "10s"
        rules = [{{ name = "exports", key = "api", max_in_flight = 1 }}]
        "#,
        server.url()
    );
    let config = Config::from_toml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let store = config.store().await.unwrap();
    assert_eq!(store.redis().unwrap().name(), "shared");
    let concurrency = store.concurrency_layer(&config, &Bindings::new()).unwrap();
    assert!(concurrency.is_some());
    let service = app(config.rate_limit_layer(store, &Bindings::new()).unwrap());
    assert_eq!(send(&service, "/", "k1").await.status(), StatusCode::OK);
    assert_eq!(send(&service, "/", "k1").await.status(), StatusCode::OK);
    assert_eq!(
        send(&service, "/", "k1").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // On Redis: the keys carry the file's prefix.
    assert!(server.cli(&["KEYS", "cfg:*"]).contains("cfg:"));
}

/// Keys spelt with brackets, quotes or dots in the file: reported, never a panic.
#[test]
fn odd_key_names_are_reported() {
    for text in [
        "[keys.\"a[0]]\"]\nkind = 5\n",
        "[keys.\"a[0]]\"]\nkind = \"header\"\nheader = 5\n",
        "[keys.\"]\"]\nkind = 5\n",
        "[keys.\"a.b\"]\nkind = 5\n",
        "[[rules]]\nname = \"r\"\npolicies = [{ algorithm = \"gcra\", rate = \"1/s\" }]\n[rules.tiers]\nkeys = { \"k[0]]\" = 5 }\n",
        "rules = [{ name = \"r\", policies = [{ rate = \"1/s\" }, \"gcra\", 7] }]\n",
    ] {
        let errors = Config::from_toml(text).unwrap_err();
        assert!(!errors.errors().is_empty(), "{text}");
        assert!(errors.errors().len() < 10, "{text}: {errors}");
    }
}

/// Values the arithmetic cannot hold are reported at the field that holds them; with the
/// Redis store, policies it cannot run exactly are refused up front (not answered 503 later).
#[test]
fn values_out_of_range_name_their_field() {
    let errors = Config::from_toml(
        r#"
        [[rules]]
        name = "r"
        cost = 10
        policies = [
          { algorithm = "sliding_log", limit = 2000000, window = "1s" },
          { algorithm = "gcra", rate = "1/day", burst = 100000000 },
        ]
        [[rules]]
        name = "t"
        cost = 10
        tiers = { keys = { k = "small" }, plans = [{ name = "small", policies = [{ algorithm = "gcra", rate = "5/s" }] }] }
        "#,
    )
    .unwrap_err();
    assert_eq!(
        errors.paths(),
        [
            "rules[0].policies[0].limit",
            "rules[0].policies[1].burst",
            "rules[1].tiers.plans[0].policies[0]",
        ],
        "{errors}"
    );
    #[cfg(feature = "redis")]
    {
        let errors = Config::from_toml(
            r#"
            store = { kind = "redis", url = "redis://127.0.0.1:1" }
            [[rules]]
            name = "month"
            policies = [{ algorithm = "sliding_window", limit = 10, window = "30d" }]
            "#,
        )
        .unwrap_err();
        assert_eq!(errors.paths(), ["rules[0].policies[0]"], "{errors}");
        assert!(
            errors.to_string().contains("Redis store cannot run"),
            "{errors}"
        );
    }
}

/// A reload that changes nothing swaps nothing (tier caches stay warm); one that changes a key
/// the concurrency limit or the shedder uses is refused, since those read their keys at start.
#[tokio::test]
async fn reload_keeps_what_it_must_not_change() {
    let text = r#"
        keys.client = { kind = "forwarded", trusted = ["10.0.0.0/8"] }
        keys.either = { kind = "any_of", of = ["client", "api"] }
        keys.api = { kind = "header", header = "x-api-key" }
        [[rules]]
        name = "per-client"
        key = "client"
        policies = [{ algorithm = "gcra", rate = "10/s" }]
        [concurrency]
        rules = [{ name = "in-flight", key = "either", max_in_flight = 4 }]
    "#;
    let config = Config::from_toml(text).unwrap();
    let (layer, reloader) = config
        .reloadable_rate_limit_layer(MemoryStore::new(), Bindings::new())
        .unwrap();
    let before: *const _ = &*layer.limiter();
    let summary = reloader.reload_toml(text).unwrap();
    assert!(summary.is_empty());
    assert_eq!(summary.to_string(), "no change");
    assert_eq!(before, &*layer.limiter() as *const _, "nothing swapped");

    // `client` is used by the rate limit and, through `either`, by the concurrency limit.
    let moved = text.replace("10.0.0.0/8", "192.168.0.0/16");
    let errors = reloader.reload_toml(&moved).unwrap_err();
    assert_eq!(errors.paths(), ["concurrency"], "{errors}");
    // A key only the rate limit uses may change.
    let only_rate = text.replace("x-api-key", "x-key");
    let errors = reloader.reload_toml(&only_rate).unwrap_err();
    assert_eq!(
        errors.paths(),
        ["concurrency"],
        "api is part of either: {errors}"
    );
    let header = text.replace("\"10/s\"", "\"20/s\"");
    let summary = reloader.reload_toml(&header).unwrap();
    assert_eq!(summary.changed, ["per-client"]);
    assert!(!summary.answers_changed);
    let traced = format!("trace_keys = \"hashed\"\n{header}");
    assert!(reloader.reload_toml(&traced).unwrap().answers_changed);
}

/// Bounds checked up front rather than clamped or found at start: the shedder's bounds, the
/// lease time against the store's timeout, and the size of a file.
#[test]
fn bounds_are_checked_not_clamped() {
    let shed = Config::from_toml("[shed]\nlimit = \"vegas\"\ninitial = 5000\n").unwrap_err();
    assert_eq!(shed.paths(), ["shed.initial"], "{shed}");
    let shed = Config::from_toml("[shed]\nlimit = \"vegas\"\ninitial = 5\nmin = 0\n").unwrap_err();
    assert_eq!(shed.paths(), ["shed.min"], "{shed}");
    #[cfg(feature = "redis")]
    {
        let lease = Config::from_toml(
            "store = { kind = \"redis\", url = \"redis://x\", timeout = \"1s\" }\n\
             [concurrency]\ntotal = 5\ndistributed = true\nlease_time = \"2s\"\n",
        )
        .unwrap_err();
        assert_eq!(lease.paths(), ["concurrency.lease_time"], "{lease}");
    }
    let huge = format!("# {}\n", "x".repeat(tollgate::config::MAX_FILE_LEN));
    let errors = Config::from_toml(&huge).unwrap_err();
    assert!(errors.to_string().contains("at most"), "{errors}");
    let path = std::env::temp_dir().join(format!("tollgate-huge-{}.toml", std::process::id()));
    std::fs::write(&path, &huge).unwrap();
    assert!(
        Config::from_toml_file(&path)
            .unwrap_err()
            .to_string()
            .contains("at most")
    );
    std::fs::remove_file(&path).ok();
}

/// A reload keeps the tier answers of the rules it leaves as they were: the resolver (a
/// database, in real life) is not asked again for them; a changed rule asks afresh.
#[tokio::test]
async fn reload_keeps_the_tier_caches_of_unchanged_rules() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let asked = std::sync::Arc::new(AtomicUsize::new(0));
    let bindings = {
        let asked = asked.clone();
        Bindings::new().resolver("plans", move |key: String| {
            asked.fetch_add(1, Ordering::SeqCst);
            async move { key.starts_with("pro-").then(|| "pro".to_owned()) }
        })
    };
    let text = |other: &str| {
        format!(
            r#"
            keys.api = {{ kind = "header", header = "x-api-key" }}
            [[rules]]
            name = "plan"
            key = "api"
            tiers = {{ resolver = "plans", plans = [
              {{ name = "free", policies = [{{ algorithm = "gcra", rate = "10/s" }}] }},
              {{ name = "pro", policies = [{{ algorithm = "gcra", rate = "100/s" }}] }},
            ] }}
            [[rules]]
            name = "other"
            policies = [{{ algorithm = "gcra", rate = "{other}" }}]
            "#
        )
    };
    let (layer, reloader) = Config::from_toml(&text("1000/s"))
        .unwrap()
        .reloadable_rate_limit_layer(MemoryStore::new(), bindings)
        .unwrap();
    let service = app(layer);
    assert_eq!(send(&service, "/", "pro-1").await.status(), StatusCode::OK);
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    // Another rule changes: the plan rule's answers stay.
    assert_eq!(
        reloader.reload_toml(&text("2000/s")).unwrap().changed,
        ["other"]
    );
    assert_eq!(send(&service, "/", "pro-1").await.status(), StatusCode::OK);
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    // The plan rule changes: it asks again.
    let changed = text("2000/s").replace("\"100/s\"", "\"200/s\"");
    assert_eq!(reloader.reload_toml(&changed).unwrap().changed, ["plan"]);
    assert_eq!(send(&service, "/", "pro-1").await.status(), StatusCode::OK);
    assert_eq!(asked.load(Ordering::SeqCst), 2);
}

/// The shedder is read at start: a reload that changes it, or the key its fairness uses, is
/// refused; one that changes neither is applied.
#[tokio::test]
async fn reload_refuses_a_changed_shedder() {
    let text = r#"
        keys.tenant = { kind = "header", header = "x-tenant" }
        [[rules]]
        name = "all"
        policies = [{ algorithm = "gcra", rate = "10/s" }]
        [shed]
        limit = "fixed"
        initial = 100
        fair_by = "tenant"
    "#;
    let (_, reloader) = Config::from_toml(text)
        .unwrap()
        .reloadable_rate_limit_layer(MemoryStore::new(), Bindings::new())
        .unwrap();
    let limit = text.replace("initial = 100", "initial = 200");
    assert_eq!(reloader.reload_toml(&limit).unwrap_err().paths(), ["shed"]);
    let key = text.replace("x-tenant", "x-org");
    assert_eq!(reloader.reload_toml(&key).unwrap_err().paths(), ["shed"]);
    let rate = text.replace("\"10/s\"", "\"20/s\"");
    assert_eq!(reloader.reload_toml(&rate).unwrap().changed, ["all"]);
}

/// A reload from a file reads it whole: a missing file is an error that names it.
#[tokio::test]
async fn reload_from_a_file() {
    let path = std::env::temp_dir().join(format!("tollgate-reload-{}.toml", std::process::id()));
    std::fs::write(&path, RELOAD_A).unwrap();
    let (_, reloader) = Config::from_toml_file(&path)
        .unwrap()
        .reloadable_rate_limit_layer(MemoryStore::new(), Bindings::new())
        .unwrap();
    std::fs::write(&path, RELOAD_A.replace("limit = 3", "limit = 9")).unwrap();
    assert_eq!(reloader.reload_file(&path).unwrap().changed, ["per-key"]);
    std::fs::remove_file(&path).unwrap();
    let missing = reloader.reload_file(&path).unwrap_err();
    assert!(
        missing.to_string().contains("tollgate-reload-"),
        "{missing}"
    );
}

// Deep nesting: refused before anything recurses on it, never a crash.

mod nesting {
    use super::*;
    use proptest::prelude::*;
    use tollgate::config::{MAX_FILE_LEN, MAX_NESTING};

    /// `Config::from_toml` on a thread with a 2 MiB stack (tokio's workers' default): a
    /// stack overflow ends the whole process, which fails the suite.
    fn read_on_a_small_stack(text: String) -> Result<Config, tollgate::config::ConfigErrors> {
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || Config::from_toml(&text))
            .unwrap()
            .join()
            .expect("no panic")
    }

    fn too_deep(result: &Result<Config, tollgate::config::ConfigErrors>) -> bool {
        result
            .as_ref()
            .is_err_and(|e| e.to_string().contains("nests more than"))
    }

    /// Inline tables each holding a dotted key of `parts` parts, `depth` of them, then `1`.
    fn inline_tables(depth: usize, parts: usize) -> String {
        let key = vec!["b"; parts].join(".");
        let mut text = String::from("a = ");
        for _ in 0..depth {
            text.push_str(&format!("{{ {key} = "));
        }
        text.push('1');
        text.push_str(&" }".repeat(depth));
        text.push('\n');
        text
    }

    /// The reported text (80 inline tables each holding a 79-part dotted key: 6,241 tables in
    /// 43 KB, which toml's separate bounds on each let through), and the deepest texts of each
    /// kind that fit the size limit: refused with an error that says why, on a 2 MiB stack.
    #[test]
    fn the_deepest_texts_are_refused_not_a_crash() {
        let reported = inline_tables(80, 79);
        assert!(reported.len() < 50_000);
        let fill = |unit: &str, around: usize| unit.repeat((MAX_FILE_LEN - around) / unit.len());
        let texts = [
            ("reported", reported),
            // Inline tables, with one-part and two-part keys, as deep as 1 MiB goes.
            ("inline tables", inline_tables((MAX_FILE_LEN - 16) / 10, 1)),
            (
                "inline tables, dotted",
                inline_tables((MAX_FILE_LEN - 16) / 12, 2),
            ),
            ("arrays", format!("a = {}", fill("[", 8))),
            ("dotted key", format!("{}a = 1", fill("a.", 8))),
            ("header", format!("[{}a]", fill("a.", 8))),
            ("array of tables", format!("[[{}a]]", fill("a.", 8))),
            ("mixed", format!("a = {}", fill("{ b.c = [", 16))),
        ];
        for (kind, text) in texts {
            assert!(text.len() <= MAX_FILE_LEN, "{kind}: {} bytes", text.len());
            let result = read_on_a_small_stack(text);
            assert!(too_deep(&result), "{kind}: {result:?}");
            let error = result.unwrap_err().to_string();
            assert!(error.contains(&MAX_NESTING.to_string()), "{kind}: {error}");
            assert!(error.starts_with("line 1:"), "{kind}: {error}");
        }
    }

    /// The deepest texts that are let through are parsed, cloned, read and dropped on a 2 MiB
    /// stack (in debug, where each level costs most).
    #[test]
    fn the_deepest_texts_let_through_are_read_on_a_small_stack() {
        let texts = [
            format!(
                "a = {}1{}",
                "[".repeat(MAX_NESTING),
                "]".repeat(MAX_NESTING)
            ),
            format!("{}a = 1", "a.".repeat(MAX_NESTING)),
            inline_tables(MAX_NESTING, 1),
            inline_tables(MAX_NESTING / 4, 4),
            format!("[{}a]\nb = 1", "a.".repeat(MAX_NESTING / 2 - 1)),
        ];
        for text in texts {
            let result = read_on_a_small_stack(text.clone());
            assert!(!too_deep(&result), "{text}: {result:?}");
            // Not a configuration, but read: the first unknown field is reported.
            assert!(result.is_err_and(|e| e.to_string().contains("unknown field")));
        }
        // One level more is refused.
        let deeper = format!("{}a = 1", "a.".repeat(MAX_NESTING + 1));
        assert!(too_deep(&read_on_a_small_stack(deeper)));
    }

    /// Strings and comments are not nesting: brackets, braces and dots in them count for
    /// nothing, in every kind of string.
    #[test]
    fn strings_and_comments_do_not_nest() {
        let noise = "[{.[{.".repeat(MAX_NESTING);
        let text = format!(
            r#"
# {noise}
[[rules]] # {noise}
name = "x{noise}"
"quoted.{noise}".'also.{noise}' = 1
literal = '{noise}'
multi = """
{noise} \""" {noise}
"""
multi_literal = '''
{noise}
'''
escaped = "\"{noise}"
"#
        );
        let result = read_on_a_small_stack(text);
        assert!(!too_deep(&result), "{result:?}");
    }

    /// One generated level of nesting: an inline table holding a dotted key of `parts` parts
    /// (`parts` levels), or an array (one level).
    #[derive(Clone, Debug)]
    enum Level {
        Table(usize),
        Array,
    }

    /// Noise that nests nothing: whitespace, a comment at a line's end (inside arrays, where
    /// lines may break), strings full of brackets.
    fn noise() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec!["", " ", "\n", " # [{.[{ \n", "\t"])
    }

    /// A text whose nesting is known: a header of `h` parts (`[[..]]` or `[..]`; its parts
    /// count twice, as each may be an array of tables and its element), a key of `k` parts,
    /// and nested levels; and that nesting.
    fn text() -> impl Strategy<Value = (String, usize)> {
        (
            0usize..4,
            any::<bool>(),
            1usize..6,
            prop::collection::vec(
                prop_oneof![(1usize..6).prop_map(Level::Table), Just(Level::Array)],
                0..(MAX_NESTING + 8),
            ),
            noise(),
        )
            .prop_map(|(h, array, k, levels, noise)| {
                let mut text = String::new();
                let mut depth = 0;
                if h > 0 {
                    let parts = vec!["\"h.[{\""; h].join(".");
                    text.push_str(&if array {
                        format!("[[{parts}]] # [{{\n")
                    } else {
                        format!("[{parts}]\n")
                    });
                    depth += 2 * h;
                }
                text.push_str(&vec!["k"; k].join("."));
                text.push_str(" = ");
                depth += k - 1;
                let mut closing = Vec::new();
                for level in &levels {
                    match level {
                        Level::Table(parts) => {
                            let key = vec!["'t.]'"; *parts].join(" . ");
                            text.push_str(&format!("{{ s = \"}}]\", {key} = "));
                            closing.push(" }");
                            depth += parts;
                        }
                        Level::Array => {
                            text.push_str(&format!("[\"]}}\",{noise}"));
                            closing.push("]");
                            depth += 1;
                        }
                    }
                }
                text.push('1');
                while let Some(close) = closing.pop() {
                    text.push_str(close);
                }
                text.push('\n');
                (text, depth)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// A text nesting deeper than the bound is refused as such; one within it never is;
        /// neither ever ends the process.
        #[test]
        fn nesting_is_counted_as_the_docs_say((text, depth) in text()) {
            let result = read_on_a_small_stack(text.clone());
            prop_assert_eq!(too_deep(&result), depth > MAX_NESTING, "depth {}: {}", depth, text);
        }
    }
}

// Listed tier keys, written as requests carry them.

mod listed_keys {
    use super::*;
    use proptest::prelude::*;

    /// The keys of the file and the rule's key; the tiers list `listed` as `pro` (the default
    /// is `free`, 1 per hour; `pro` 100).
    fn layer(keys: &str, key: &str, listed: &[&str]) -> tollgate::RateLimitLayer<MemoryStore> {
        let entries: Vec<String> = listed
            .iter()
            .map(|k| format!("\"{k}\" = \"pro\""))
            .collect();
        let text = format!(
            r#"
{keys}
[[rules]]
name = "plan"
key = "{key}"
on_missing_key = "skip"
tiers.keys = {{ {} }}
tiers.default = "free"
tiers.plans = [
  {{ name = "free", policies = [{{ algorithm = "fixed_window", limit = 1, window = "1h", name = "free" }}] }},
  {{ name = "pro", policies = [{{ algorithm = "fixed_window", limit = 100, window = "1h", name = "pro" }}] }},
]
"#,
            entries.join(", ")
        );
        Config::from_toml(&text)
            .and_then(|c| c.rate_limit_layer(MemoryStore::new(), &Bindings::new()))
            .unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    /// The policy that named a request with these headers (`free` or `pro`).
    fn tier(layer: &tollgate::RateLimitLayer<MemoryStore>, headers: &[(&str, &str)]) -> String {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let service = ServiceBuilder::new()
            .layer(layer.clone())
            .service(tower::service_fn(|_: Request<()>| async {
                Ok::<_, Infallible>(Response::new(String::new()))
            }));
        let mut request = Request::get("/");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = runtime
            .block_on(service.oneshot(request.body(()).unwrap()))
            .unwrap();
        let field = response.headers()["ratelimit"].to_str().unwrap();
        field.split('"').nth(1).unwrap().to_owned()
    }

    const KEYS: &str = r#"
[keys.a]
kind = "header"
header = "x-a"
[keys.b]
kind = "header"
header = "x-b"
[keys.c]
kind = "header"
header = "x-c"
[keys.ab]
kind = "all_of"
of = ["a", "b"]
[keys.either]
kind = "any_of"
of = ["a", "b"]
[keys.nested]
kind = "any_of"
of = ["c", "ab", "a"]
"#;

    /// The reported keys: `k%1` was listed, and its holder counted in the default tier.
    #[test]
    fn a_listed_key_with_a_percent_sign_matches() {
        let layer = layer(KEYS, "a", &["k-2", "k%1"]);
        assert_eq!(tier(&layer, &[("x-a", "k-2")]), "pro");
        assert_eq!(tier(&layer, &[("x-a", "k%1")]), "pro");
        assert_eq!(tier(&layer, &[("x-a", "k%251")]), "free");
        assert_eq!(tier(&layer, &[("x-a", "k-3")]), "free");
    }

    /// `any_of`: the first key's value as it is, another's as `name=value`; a value listed
    /// for one key never matches another's (a client cannot claim a listed address's tier by
    /// sending it as an API key). `all_of`: the values joined by `/`.
    #[test]
    fn composite_keys_are_listed_as_their_values() {
        let either = layer(KEYS, "either", &["k-1", "b=10.0.0.5"]);
        assert_eq!(tier(&either, &[("x-a", "k-1")]), "pro");
        assert_eq!(tier(&either, &[("x-b", "10.0.0.5")]), "pro");
        assert_eq!(tier(&either, &[("x-a", "10.0.0.5")]), "free");
        assert_eq!(tier(&either, &[("x-b", "k-1")]), "free");
        let ab = layer(KEYS, "ab", &["acme/4%2"]);
        assert_eq!(tier(&ab, &[("x-a", "acme"), ("x-b", "4%2")]), "pro");
        assert_eq!(tier(&ab, &[("x-a", "acme/4"), ("x-b", "%2")]), "free");
        // A listed key that is none of the key's: a problem, the key not echoed.
        let text = format!(
            "{KEYS}\n[[rules]]\nname = \"p\"\nkey = \"ab\"\ntiers.keys = {{ \"secret\" = \"x\" }}\n\
             tiers.plans = [{{ name = \"x\", policies = [{{ algorithm = \"gcra\", rate = \"1/s\" }}] }}]\n"
        );
        let errors = Config::from_toml(&text)
            .and_then(|c| {
                c.rate_limit_layer(MemoryStore::new(), &Bindings::new())
                    .map(|_| c)
            })
            .unwrap_err();
        assert_eq!(errors.paths(), ["rules[0].tiers.keys"], "{errors}");
        assert!(!errors.to_string().contains("secret"), "{errors}");
    }

    fn value() -> impl Strategy<Value = String> {
        "[a-z0-9%/=|.]{1,8}"
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// A key listed as the request carries it puts that request in its tier, whatever the
        /// bytes of the values (`%`, `/`, `=`, `|`) and the key's shape, nested ones included;
        /// the same values in another branch do not.
        #[test]
        fn listed_as_carried_is_matched(a in value(), b in value(), c in value()) {
            // (rule key, listed, headers of the holder); a first branch's value with a `=`
            // is written with its key's name.
            let first = |name: &str, v: &str| {
                if v.contains('=') { format!("{name}={v}") } else { v.to_owned() }
            };
            type Case<'a> = (&'a str, String, Vec<(&'a str, &'a str)>);
            let mut cases: Vec<Case<'_>> = vec![
                ("a", a.clone(), vec![("x-a", &a)]),
                ("either", first("a", &a), vec![("x-a", &a)]),
                ("either", format!("b={b}"), vec![("x-b", &b)]),
                ("nested", first("c", &c), vec![("x-c", &c)]),
                ("nested", format!("a={a}"), vec![("x-a", &a)]),
            ];
            if !a.contains('/') {
                cases.push(("ab", format!("{a}/{b}"), vec![("x-a", &a), ("x-b", &b)]));
                cases.push(("nested", format!("ab={a}/{b}"), vec![("x-a", &a), ("x-b", &b)]));
            }
            for (key, listed, headers) in cases {
                let layer = layer(KEYS, key, &[listed.as_str()]);
                prop_assert_eq!(tier(&layer, &headers), "pro", "{} listed {:?}", key, listed);
            }
            // The first key's value, sent as the other's, is another key.
            let either = layer(KEYS, "either", &[first("a", &a).as_str()]);
            prop_assert_eq!(tier(&either, &[("x-b", a.as_str())]), "free");
        }
    }
}
