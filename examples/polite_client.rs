//! 200 clients meet a server that is down for a second, once with retries that all wait the
//! same exponential backoff and once with full jitter (`tollgate::client::RetryLayer`'s
//! default): when do their retries arrive?
//!
//! ```sh
//! cargo run --example polite_client
//! ```
//!
//! A real axum server on loopback answers `503` without a `Retry-After` (as a proxy in front
//! of a dead backend would) for its first two seconds, then `200`. Each client is a hyper
//! client behind a `RetryLayer` (the default backoff: 200 ms doubling, up to 6 attempts; no
//! budget so that every retry shows). Without jitter, the 200 clients come back together at
//! 0.2, 0.6, 1.4 and 3.0 s: waves of 200, the last of which the recovering server meets all
//! at once. With full jitter, each retry waits uniformly below its ceiling, and the same
//! retries spread out. The example prints the arrivals per 100 ms side by side and writes
//! `polite_client.svg`.

use std::error::Error;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tollgate::client::{Jitter, RetryLayer, RetryPolicy};
use tower::{ServiceBuilder, ServiceExt};

const CLIENTS: usize = 200;
const DOWN_FOR: Duration = Duration::from_secs(2);
const BUCKET: Duration = Duration::from_millis(100);
const BUCKETS: usize = 70;

/// One run: the arrivals at the server (time since the start), and how many clients got a 200.
async fn run(jitter: Jitter) -> Result<(Vec<Duration>, usize), Box<dyn Error>> {
    let start = Instant::now();
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let seen = arrivals.clone();
    let app = Router::new().route(
        "/",
        get(move || {
            let seen = seen.clone();
            async move {
                let at = start.elapsed();
                if let Ok(mut seen) = seen.lock() {
                    seen.push(at);
                }
                if at < DOWN_FOR {
                    (StatusCode::SERVICE_UNAVAILABLE, "down")
                } else {
                    (StatusCode::OK, "up")
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let policy = RetryPolicy::builder()
        .max_attempts(6)
        .jitter(jitter)
        .no_budget()
        .seed(7)
        .build()?;
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .service(http);
    let uri = format!("http://{addr}/");
    let mut calls = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        let (client, uri) = (client.clone(), uri.clone());
        calls.push(tokio::spawn(async move {
            let request = Request::get(uri).body(Full::new(Bytes::new()))?;
            let response = client.oneshot(request).await?;
            Ok::<_, Box<dyn Error + Send + Sync>>(response.status() == StatusCode::OK)
        }));
    }
    let mut served = 0;
    for call in calls {
        if matches!(call.await, Ok(Ok(true))) {
            served += 1;
        }
    }
    server.abort();
    let arrivals = arrivals.lock().map(|a| a.clone()).unwrap_or_default();
    Ok((arrivals, served))
}

/// Arrivals per [`BUCKET`], the first requests (at the start) left out: retries only.
fn histogram(arrivals: &[Duration]) -> [usize; BUCKETS] {
    let mut buckets = [0; BUCKETS];
    let mut sorted = arrivals.to_vec();
    sorted.sort_unstable();
    for at in sorted.iter().skip(CLIENTS) {
        let i = (at.as_millis() / BUCKET.as_millis()) as usize;
        buckets[i.min(BUCKETS - 1)] += 1;
    }
    buckets
}

fn svg(plain: &[usize; BUCKETS], jittered: &[usize; BUCKETS]) -> String {
    let (w, h, pad) = (760.0, 300.0, 40.0);
    let top = plain
        .iter()
        .chain(jittered)
        .copied()
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let slot = (w - 2.0 * pad) / BUCKETS as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{pad}" y="20">Retries of {CLIENTS} clients per 100 ms, the server down for the first two seconds (top: {top})</text>
<line x1="{pad}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/>"#,
        b = h - pad,
        r = w - pad
    );
    for (k, (series, color, name)) in [
        (plain, "#d73027", "the same backoff for all (waves)"),
        (jittered, "#4575b4", "full jitter (spread)"),
    ]
    .into_iter()
    .enumerate()
    {
        for (i, &n) in series.iter().enumerate() {
            let height = (h - 2.0 * pad) * n as f64 / top;
            let _ = writeln!(
                out,
                r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{height:.1}" fill="{color}"/>"#,
                pad + slot * i as f64 + slot / 2.0 * k as f64,
                h - pad - height,
                slot / 2.0 - 1.0
            );
        }
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" fill="{color}">{name}</text>"#,
            pad + 300.0 * k as f64,
            h - 12.0
        );
    }
    for i in (0..=BUCKETS).step_by(10) {
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{:.1} s</text>"#,
            pad + slot * i as f64,
            h - pad + 14.0,
            i as f64 * BUCKET.as_secs_f64()
        );
    }
    out.push_str("</svg>\n");
    out
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    println!(
        "{CLIENTS} clients call a server that answers 503 for its first {DOWN_FOR:?}; each retries up to 5 times (the default backoff: 200 ms doubling)."
    );
    let (plain, plain_served) = run(Jitter::None).await?;
    let (jittered, jittered_served) = run(Jitter::Full).await?;
    let (a, b) = (histogram(&plain), histogram(&jittered));
    println!("\nretries arriving per 100 ms:\n   from   same backoff   full jitter");
    for i in 0..BUCKETS {
        if a[i] + b[i] > 0 {
            println!(
                "{:>5} ms {:>6} {:<20} {:>4} {}",
                i * 100,
                a[i],
                "#".repeat(a[i].div_ceil(10)),
                b[i],
                "#".repeat(b[i].div_ceil(10))
            );
        }
    }
    let busiest = |h: &[usize; BUCKETS], from: usize| h[from..].iter().copied().max().unwrap_or(0);
    let back = (DOWN_FOR.as_millis() / BUCKET.as_millis()) as usize;
    println!(
        "\nbusiest 100 ms: {} retries with the same backoff, {} with full jitter",
        busiest(&a, 0),
        busiest(&b, 0)
    );
    println!(
        "busiest 100 ms once the server is back: {} with the same backoff, {} with full jitter",
        busiest(&a, back),
        busiest(&b, back)
    );
    println!(
        "calls made: {} and {}; clients served in the end: {plain_served} and {jittered_served} of {CLIENTS}",
        plain.len(),
        jittered.len()
    );
    std::fs::write("polite_client.svg", svg(&a, &b))?;
    println!("Wrote polite_client.svg.");
    Ok(())
}
