//! Shadow mode through a real server: a shadow rule decides and reports but never refuses,
//! and its fields stay out of the responses.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::get;
use axum::{Extension, Router};
use http::StatusCode;
use support::{Client, serve, store};
use tollgate::key::PeerIp;
use tollgate::limiter::{Rule, ShadowRejection};
use tollgate::{Policy, RateLimitLayer};

#[tokio::test]
async fn shadow_rules_report_but_never_refuse() {
    let (store, _clock) = store();
    let seen: Arc<Mutex<Vec<(String, String, u64)>>> = Arc::default();
    let observed = seen.clone();
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("enforced")
                .key(PeerIp::new())
                .policy(Policy::fixed_window(5, Duration::from_secs(60)).unwrap()),
        )
        .rule(
            Rule::new("candidate")
                .key(PeerIp::new())
                .policy(Policy::fixed_window(2, Duration::from_secs(60)).unwrap())
                .shadow(),
        )
        .on_shadow_rejection(move |r: &ShadowRejection| {
            observed.lock().unwrap().push((
                r.rule().to_owned(),
                r.policy().to_owned(),
                r.decision().retry_after_secs().unwrap(),
            ));
        })
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            get(|shadow: Option<Extension<ShadowRejection>>| async move {
                match shadow {
                    Some(Extension(s)) => format!("would be refused by {}", s.rule()),
                    None => "fine".to_owned(),
                }
            }),
        )
        .layer(layer);
    let client = Client::new(serve(app).await);

    let mut bodies = Vec::new();
    for _ in 0..5 {
        let answer = client.get("/").await;
        assert_eq!(answer.status, StatusCode::OK);
        // Only the enforced rule shows.
        assert_eq!(answer.policies().len(), 1);
        assert_eq!(answer.ratelimit().0, "enforced");
        bodies.push(answer.text().to_owned());
    }
    assert_eq!(
        bodies,
        [
            "fine",
            "fine",
            "would be refused by candidate",
            "would be refused by candidate",
            "would be refused by candidate"
        ]
    );
    assert_eq!(
        seen.lock().unwrap().as_slice(),
        vec![("candidate".to_owned(), "candidate".to_owned(), 60); 3]
    );

    // The enforced rule still enforces; a refused request is not counted by the shadow rule.
    let refused = client.get("/").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(seen.lock().unwrap().len(), 3);
}
