//! Routes through a real server: a rule per route template via axum's `MatchedPath`, exact and
//! prefix paths, and one limit shared by every route axum clones the layer onto
//! (`Router::layer` and `Router::route_layer`).

mod support;

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http::StatusCode;
use support::{Client, serve, serve_service_on, store};
use tollgate::key::{Global, PeerIp};
use tollgate::limiter::Rule;
use tollgate::{Policy, RateLimitLayer};

fn window(limit: u64) -> Policy {
    Policy::fixed_window(limit, Duration::from_secs(60)).unwrap()
}

fn routes() -> Router {
    Router::new()
        .route("/users/{id}", get(|| async { "user" }))
        .route("/users/{id}/posts", get(|| async { "posts" }))
        .route("/api/a", get(|| async { "a" }))
        .route("/api/b", get(|| async { "b" }))
        .route("/health", get(|| async { "up" }))
}

#[tokio::test]
async fn a_rule_per_route_template() {
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("user-page")
                .route("/users/{id}")
                .key(PeerIp::new())
                .policy(window(2)),
        )
        .build()
        .unwrap();
    let client = Client::new(serve(routes().layer(layer)).await);

    // Every /users/{id} is one route: different ids share the limit.
    assert_eq!(client.get("/users/1").await.status, StatusCode::OK);
    assert_eq!(client.get("/users/2").await.status, StatusCode::OK);
    let refused = client.get("/users/3").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    // Another template is not this route.
    let posts = client.get("/users/1/posts").await;
    assert_eq!(posts.status, StatusCode::OK);
    assert!(posts.header("ratelimit").is_none());
}

#[tokio::test]
async fn exact_and_prefix_paths() {
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(Rule::new("api").path_prefix("/api").policy(window(3)))
        .rule(Rule::new("health").path("/health").policy(window(1)))
        .build()
        .unwrap();
    let client = Client::new(serve(routes().layer(layer)).await);
    assert_eq!(
        client.get("/api/a").await.ratelimit(),
        ("api".into(), 2, 60)
    );
    assert_eq!(
        client.get("/api/b").await.ratelimit(),
        ("api".into(), 1, 60)
    );
    assert_eq!(
        client.get("/health").await.ratelimit(),
        ("health".into(), 0, 60)
    );
    assert_eq!(
        client.get("/health").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert!(client.get("/users/1").await.header("ratelimit").is_none());
}

async fn one_limit_across_routes(route_layer: bool) {
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(Rule::new("all").key(Global).policy(window(4)))
        .build()
        .unwrap();
    let app = if route_layer {
        routes().route_layer(layer)
    } else {
        routes().layer(layer)
    };
    let client = Client::new(serve(app).await);
    for path in ["/api/a", "/api/b", "/health", "/users/9"] {
        assert_eq!(client.get(path).await.status, StatusCode::OK, "{path}");
    }
    // Five routes, one limit of four.
    for path in ["/api/a", "/users/1/posts"] {
        assert_eq!(
            client.get(path).await.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{path}"
        );
    }
}

#[tokio::test]
async fn one_limit_shared_across_routes_with_layer() {
    one_limit_across_routes(false).await;
}

#[tokio::test]
async fn one_limit_shared_across_routes_with_route_layer() {
    one_limit_across_routes(true).await;
}

#[tokio::test]
async fn a_layer_around_the_whole_router_and_on_a_nested_router() {
    // Outside the router (no MatchedPath), paths still match; a template rule does not.
    let (outer_store, _clock) = store();
    let layer = RateLimitLayer::builder(outer_store)
        .rule(Rule::new("api").path_prefix("/v1/api").policy(window(1)))
        .rule(Rule::new("tpl").route("/v1/users/{id}").policy(window(1)))
        .build()
        .unwrap();
    let app = Router::new().nest("/v1", routes());
    let service = tower::ServiceBuilder::new().layer(layer).service(app);
    let client = Client::new(serve(Router::new().fallback_service(service)).await);
    assert_eq!(client.get("/v1/api/a").await.status, StatusCode::OK);
    assert_eq!(
        client.get("/v1/api/b").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(client.get("/v1/users/1").await.status, StatusCode::OK);
    assert_eq!(client.get("/v1/users/1").await.status, StatusCode::OK);

    // Inside a nested router, MatchedPath is the full template.
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(Rule::new("tpl").route("/v1/users/{id}").policy(window(1)))
        .build()
        .unwrap();
    let app = Router::new().nest("/v1", routes().layer(layer));
    let client = Client::new(serve(app).await);
    assert_eq!(client.get("/v1/users/1").await.status, StatusCode::OK);
    assert_eq!(
        client.get("/v1/users/2").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// The recipe in the crate docs: the layer wrapped around the whole router (once per request,
/// before routing) and served with `ConnectInfo`; the peer address keys the rule, every
/// response carries the fields.
#[tokio::test]
async fn around_the_router() {
    use tower::Layer;

    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(Rule::new("per-ip").key(PeerIp::new()).policy(window(2)))
        .build()
        .unwrap();
    let client = Client::new(serve_service_on("127.0.0.1:0", layer.layer(routes())).await);

    let first = client.get("/users/1").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.policies().keys().collect::<Vec<_>>(), ["per-ip"]);
    assert_eq!(first.ratelimit(), ("per-ip".to_string(), 1, 60));
    assert_eq!(client.get("/users/2").await.status, StatusCode::OK);
    let refused = client.get("/health").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.retry_after(), Some(60));
}

/// A template in axum 0.7's syntax never matches under axum 0.8: refused when the layer is
/// built, with the template in 0.8's syntax (before the fix the layer was built, and the rule
/// never counted anything).
#[test]
fn an_axum_07_template_is_refused_with_a_hint() {
    use tollgate::limiter::LimiterError;
    for (old, new) in [
        ("/users/:id", "/users/{id}"),
        ("/files/*rest", "/files/{*rest}"),
    ] {
        let error = RateLimitLayer::builder(store().0)
            .rule(Rule::new("old").route(old).policy(window(1)))
            .build()
            .expect_err("refused");
        assert_eq!(
            error,
            LimiterError::OldRouteSyntax {
                rule: "old".into(),
                route: old.into(),
                suggested: new.into()
            }
        );
        assert!(error.to_string().contains(&format!("{new:?}")), "{error}");
    }
}
