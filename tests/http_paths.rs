//! Path rules count the path the application acts on, whatever its spelling: escaped letters,
//! `%2F`, dot segments and double slashes, through a real axum router with a wildcard route
//! (generated spellings, and the reported ones over a real server), and inside
//! `Router::nest`, where axum strips the nest's prefix before the inner layers see the path.

mod support;

use std::convert::Infallible;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::routing::{get, post};
use http::{Method, Request, Response, StatusCode};
use proptest::prelude::*;
use support::{Client, serve, store};
use tollgate::limiter::Rule;
use tollgate::{MemoryStore, Policy, RateLimitLayer};
use tower::{Service, ServiceBuilder, ServiceExt};

fn window(limit: u64) -> Policy {
    Policy::fixed_window(limit, Duration::from_secs(60)).unwrap()
}

/// `/files/{*path}`, whose handler answers with the path it was given (decoded by axum).
fn files() -> Router {
    Router::new().route(
        "/files/{*path}",
        get(|Path(path): Path<String>| async move { path }),
    )
}

fn limit(rule: Rule, n: u64) -> RateLimitLayer<MemoryStore<tollgate::clock::ManualClock>> {
    RateLimitLayer::builder(store().0)
        .rule(rule.policy(window(n)))
        .build()
        .unwrap()
}

/// The reported spellings, over a real server: with a limit of 1 on `/files/exports`, each is
/// refused once the plain path used it up (each was served every time before the fix).
#[tokio::test]
async fn an_escaped_letter_or_slash_does_not_get_past_a_path_rule() {
    for spelling in [
        "/files/%65xports/a.csv",
        "/files/exports%2Fa.csv",
        "/files/exports%2fa.csv",
        "/files/%65%78%70%6F%72%74%73/a.csv",
        "/files//exports/a.csv",
        "/files/./exports/a.csv",
        "/files/x/../exports/a.csv",
        "/files/../exports/a.csv",
        "/files/%2E%2E/exports/a.csv",
    ] {
        let layer = limit(Rule::new("exports").path_prefix("/files/exports"), 1);
        let client = Client::new(serve(files().layer(layer)).await);
        let plain = client.get("/files/exports/a.csv").await;
        assert_eq!(plain.status, StatusCode::OK, "{spelling}");
        let spelled = client.get(spelling).await;
        assert_eq!(
            spelled.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{spelling} was served as {:?}",
            spelled.text()
        );
    }
    // An exact path rule reads paths alike.
    let layer = limit(Rule::new("one").path("/files/exports/a.csv"), 1);
    let client = Client::new(serve(files().layer(layer)).await);
    assert_eq!(
        client.get("/files/exports/a.csv").await.status,
        StatusCode::OK
    );
    assert_eq!(
        client.get("/files/exports/%61.csv").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another file is another path.
    assert_eq!(
        client.get("/files/exports/b.csv").await.status,
        StatusCode::OK
    );
}

/// Inside `Router::nest("/api", ...)` the rules see the full path (axum's `OriginalUri`): a
/// rule on `/api/login`, one on the prefix `/api` and one on the route template all refuse
/// the second login (before the fix, paths and prefixes never matched there: 200, 200, 200).
#[tokio::test]
async fn path_rules_apply_inside_a_nested_router() {
    for rule in [
        Rule::new("login").path("/api/login"),
        Rule::new("api").path_prefix("/api"),
        Rule::new("tpl").route("/api/login"),
    ] {
        let name = rule.name().to_owned();
        let inner = Router::new()
            .route("/login", post(|| async { "ok" }))
            .route("/health", get(|| async { "up" }))
            .layer(limit(rule, 1));
        let client = Client::new(serve(Router::new().nest("/api", inner)).await);
        let mut statuses = Vec::new();
        for _ in 0..3 {
            statuses.push(client.send(Method::POST, "/api/login", &[]).await.status);
        }
        assert_eq!(
            statuses,
            [
                StatusCode::OK,
                StatusCode::TOO_MANY_REQUESTS,
                StatusCode::TOO_MANY_REQUESTS
            ],
            "{name}"
        );
        // Paths still tell routes apart inside the nest.
        if name == "login" {
            assert_eq!(client.get("/api/health").await.status, StatusCode::OK);
        }
    }
    // A rule written for the path inside the nest does not match the full path.
    let inner = Router::new()
        .route("/login", post(|| async { "ok" }))
        .layer(limit(Rule::new("inner").path("/login"), 1));
    let client = Client::new(serve(Router::new().nest("/api", inner)).await);
    for _ in 0..2 {
        let answer = client.send(Method::POST, "/api/login", &[]).await;
        assert_eq!(answer.status, StatusCode::OK);
    }
}

/// The concurrency layer matches paths as the rate limit does (one matcher): with one place
/// on `/files/exports`, an escaped spelling waits its turn like the plain path.
#[tokio::test(start_paused = true)]
async fn the_concurrency_layer_reads_paths_alike() {
    use std::sync::Arc;
    use tokio::sync::Semaphore;
    use tollgate::ConcurrencyLimitLayer;

    let gate = Arc::new(Semaphore::new(0));
    let held = gate.clone();
    let app = Router::new()
        .route(
            "/files/{*path}",
            get(move || {
                let gate = held.clone();
                async move {
                    gate.acquire().await.unwrap().forget();
                    "ok"
                }
            }),
        )
        .layer(
            ConcurrencyLimitLayer::builder()
                .rule(Rule::new("exports").path_prefix("/files/exports"), 1)
                .build()
                .unwrap(),
        );
    let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    let first = tokio::spawn(app.clone().oneshot(get("/files/exports/a.csv")));
    tokio::time::sleep(Duration::from_millis(1)).await;
    for spelling in [
        "/files/%65xports/b.csv",
        "/files/exports%2Fb.csv",
        "/files/x/../exports/b",
    ] {
        let second = app.clone().oneshot(get(spelling)).await.unwrap();
        assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS, "{spelling}");
    }
    gate.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
}

// Generated spellings, in process (`oneshot` through the router).

/// One segment of a generated path after `/files/`.
fn segment() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "exports",
        "exports",
        "a.csv",
        "x",
        "exports.csv",
        "Exports",
        ".",
        "..",
        "",
    ])
}

/// A spelling: segments after `/files/`, each character escaped or not (`%XX` in either
/// case), joined by `/` or an escaped `/`.
fn spelling() -> impl Strategy<Value = String> {
    prop::collection::vec((segment(), prop::collection::vec(0u8..4, 16), 0u8..4), 1..6).prop_map(
        |parts| {
            let mut path = String::from("/files/");
            for (i, (segment, escapes, separator)) in parts.iter().enumerate() {
                if i > 0 {
                    path.push_str(match separator {
                        0 => "%2F",
                        1 => "%2f",
                        _ => "/",
                    });
                }
                for (c, escape) in segment.chars().zip(escapes.iter().cycle()) {
                    match escape {
                        0 => path.push_str(&format!("%{:02X}", c as u32)),
                        1 => path.push_str(&format!("%{:02x}", c as u32)),
                        _ => path.push(c),
                    }
                }
            }
            path
        },
    )
}

/// What a handler of `/files/{*path}` acts on, given the path axum handed it: its segments
/// with `.`, empty ones and `..` resolved, never above its root (as a file server does).
fn acted_on(path: &str) -> Vec<&str> {
    let mut kept = Vec::new();
    for segment in path.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                kept.pop();
            }
            s => kept.push(s),
        }
    }
    kept
}

/// Whether `spelling` is spelled plainly: no escape, no dot segment, no empty segment.
fn plain(spelling: &str) -> bool {
    !spelling.contains('%')
        && !spelling.contains("//")
        && spelling
            .split('/')
            .skip(1)
            .all(|s| s != "." && s != ".." && !s.is_empty())
}

/// Sends `path` through `app`: whether the handler was reached, with what, and whether the
/// rule `exports` counted the request.
fn through<S>(runtime: &tokio::runtime::Runtime, app: &S, path: &str) -> (Option<String>, bool)
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone,
    S::Future: Send,
{
    runtime.block_on(async {
        let request = Request::get(path).body(Body::empty()).unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        let counted = response
            .headers()
            .get("ratelimit-policy")
            .is_some_and(|v| v.to_str().unwrap().contains("\"exports\""));
        let reached = response.status() == StatusCode::OK;
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        (
            reached.then(|| String::from_utf8(body.to_vec()).unwrap()),
            counted,
        )
    })
}

fn big_limit(prefix: &str) -> RateLimitLayer<MemoryStore<tollgate::clock::ManualClock>> {
    limit(Rule::new("exports").path_prefix(prefix), 1_000_000_000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Every spelling that reaches the handler as a path under `exports` is counted by the
    /// rule on `/files/exports`, wherever the layer is: on the router, around it, or on a
    /// router nested under `/v1`. A plain spelling is counted exactly when it is under it.
    #[test]
    fn every_spelling_that_reaches_the_handler_as_the_limited_path_is_counted(
        spelling in spelling()
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let inside = files().layer(big_limit("/files/exports"));
        let around = ServiceBuilder::new()
            .layer(big_limit("/files/exports"))
            .service(files());
        let nested = Router::new().nest("/v1", files().layer(big_limit("/v1/files/exports")));
        let nested_path = format!("/v1{spelling}");
        for (placement, (reached, counted)) in [
            ("inside", through(&runtime, &inside, &spelling)),
            ("around", through(&runtime, &around, &spelling)),
            ("nested", through(&runtime, &nested, &nested_path)),
        ] {
            let Some(given) = reached else { continue };
            let limited = acted_on(&given).first() == Some(&"exports");
            if limited {
                prop_assert!(counted, "{placement}: {spelling} reached the handler as {given:?}, uncounted");
            }
            if plain(&spelling) {
                prop_assert_eq!(counted, limited, "{}: {} as {:?}", placement, spelling, given);
            }
        }
    }
}
