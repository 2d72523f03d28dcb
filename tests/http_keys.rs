//! Keys through a real server over loopback: a spoofed X-Forwarded-For from an untrusted peer
//! is ignored, a trusted proxy's header is believed, and IPv6 addresses rotating inside one
//! /64 share one key.

mod support;

use std::time::Duration;

use axum::Router;
use http::StatusCode;
use support::{Client, ok_app, serve, store};
use tollgate::key::{Forwarded, PeerIp};
use tollgate::limiter::Rule;
use tollgate::{Policy, RateLimitLayer};

fn limited_app(key: impl tollgate::key::KeyExtractor, limit: u64) -> Router {
    let (store, _clock) = store();
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new("client")
                .key(key)
                .policy(Policy::fixed_window(limit, Duration::from_secs(60)).unwrap()),
        )
        .build()
        .unwrap();
    ok_app(layer)
}

#[tokio::test]
async fn spoofed_forwarded_for_from_an_untrusted_peer_is_ignored() {
    // Only 10.0.0.0/8 is trusted; the test client connects from 127.0.0.1.
    let key = Forwarded::trusting(["10.0.0.0/8"]).unwrap();
    let client = Client::new(serve(limited_app(key, 3)).await);
    for i in 0..3 {
        let spoof = format!("203.0.113.{i}");
        let ok = client.get_with("/", &[("x-forwarded-for", &spoof)]).await;
        assert_eq!(ok.status, StatusCode::OK);
    }
    // A fresh spoofed address per request buys nothing: all of them are 127.0.0.1.
    let refused = client
        .get_with("/", &[("x-forwarded-for", "198.51.100.77")])
        .await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    let refused = client
        .get_with("/", &[("forwarded", "for=198.51.100.78")])
        .await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn a_trusted_proxy_is_believed_up_to_the_first_untrusted_hop() {
    // The loopback address plays the load balancer.
    let key = Forwarded::trusting(["127.0.0.0/8", "10.0.0.0/8"]).unwrap();
    let client = Client::new(serve(limited_app(key, 2)).await);
    // The client forged the left entry; the proxies appended the right ones.
    let chain = |client_ip: &str| format!("6.6.6.6, {client_ip}, 10.1.2.3");
    for _ in 0..2 {
        let chain = chain("192.0.2.10");
        let ok = client.get_with("/", &[("x-forwarded-for", &chain)]).await;
        assert_eq!(ok.status, StatusCode::OK);
    }
    let chain_a = chain("192.0.2.10");
    let refused = client.get_with("/", &[("x-forwarded-for", &chain_a)]).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    // Another client behind the same proxies has its own key.
    let chain_b = chain("192.0.2.11");
    let other = client.get_with("/", &[("x-forwarded-for", &chain_b)]).await;
    assert_eq!(other.status, StatusCode::OK);
    // Garbage written where the client's address should be ends at the proxy: one shared key,
    // not one per request.
    for garbage in ["not-an-ip, 10.1.2.3", "%%%, 10.1.2.3"] {
        let a = client.get_with("/", &[("x-forwarded-for", garbage)]).await;
        assert_eq!(a.status, StatusCode::OK, "{garbage}");
    }
    let refused = client
        .get_with("/", &[("x-forwarded-for", "unknown, 10.1.2.3")])
        .await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn rotating_ipv6_addresses_inside_one_64_share_a_key() {
    // A trusted proxy on loopback reports IPv6 clients, as a dual-stack edge would.
    let key = Forwarded::trusting(["127.0.0.1"]).unwrap();
    let client = Client::new(serve(limited_app(key, 4)).await);
    for i in 0..4u32 {
        let addr = format!("2001:db8:aaaa:1:{:x}:{:x}::{:x}", i * 7919, i + 1, i * 31);
        let ok = client.get_with("/", &[("x-forwarded-for", &addr)]).await;
        assert_eq!(ok.status, StatusCode::OK, "{addr}");
    }
    let refused = client
        .get_with(
            "/",
            &[("x-forwarded-for", "2001:db8:aaaa:1:ffff:ffff:ffff:ffff")],
        )
        .await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    // The neighbouring /64 is someone else.
    let neighbour = client
        .get_with("/", &[("x-forwarded-for", "2001:db8:aaaa:2::1")])
        .await;
    assert_eq!(neighbour.status, StatusCode::OK);
}

#[tokio::test]
async fn a_wider_ipv6_prefix_groups_more() {
    let key = Forwarded::trusting(["127.0.0.1"]).unwrap().ipv6_prefix(48);
    let client = Client::new(serve(limited_app(key, 2)).await);
    for sub in ["2001:db8:bbbb:1::1", "2001:db8:bbbb:ffff::1"] {
        let ok = client.get_with("/", &[("x-forwarded-for", sub)]).await;
        assert_eq!(ok.status, StatusCode::OK);
    }
    let refused = client
        .get_with("/", &[("x-forwarded-for", "2001:db8:bbbb:7::1")])
        .await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn the_peer_address_over_ipv6_loopback() {
    // Skips quietly where the machine has no IPv6 loopback.
    let Ok(listener) = tokio::net::TcpListener::bind("[::1]:0").await else {
        return;
    };
    drop(listener);
    let addr = support::serve_on("[::1]:0", limited_app(PeerIp::new(), 1)).await;
    let client = Client::new(addr);
    assert_eq!(client.get("/").await.status, StatusCode::OK);
    assert_eq!(client.get("/").await.status, StatusCode::TOO_MANY_REQUESTS);
}

/// The review's reproduction: behind a proxy that appends its element to the client's
/// `Forwarded` line, a client that ends its own element with an unterminated quoted string
/// used to swallow the proxy's element and have its own `for=` taken as the client, a fresh
/// key per request. Now such a line yields no address and the key is the proxy's: twenty
/// rotating addresses buy no more than the limit.
#[tokio::test]
async fn an_unterminated_quote_in_forwarded_buys_no_fresh_key() {
    // The loopback address plays the proxy, which appends `, for=<the real client>`.
    let key = Forwarded::trusting(["127.0.0.0/8", "10.0.0.0/8"])
        .unwrap()
        .rfc7239();
    let client = Client::new(serve(limited_app(key, 3)).await);
    let mut admitted = 0;
    for i in 0..20 {
        let line = format!("for=198.51.100.{i};x=\", for=203.0.113.9");
        let answer = client.get_with("/", &[("forwarded", &line)]).await;
        admitted += usize::from(answer.status == StatusCode::OK);
    }
    assert_eq!(admitted, 3);
}
