//! `cargo run --example overload`
//!
//! A real axum server on loopback whose dependency serves at most 400 requests per second (20
//! workers, 50 ms each), behind tollgate's four protections in the recommended order:
//!
//! 1. `LoadShedLayer`: the service's own health, an adaptive limit (Vegas), sheddable traffic
//!    first: the cheapest "no";
//! 2. `RateLimitLayer`: each user's quota;
//! 3. `ShapeLayer`: the expensive `/report` route, delayed to a steady 5 per second per user;
//! 4. `ConcurrencyLimitLayer`: at most 32 requests in flight per user.
//!
//! A client in the same process sends 150 % of what the dependency can serve for 6 seconds
//! (a third `critical`, two thirds `sheddable`), giving up on any answer after 1 second; once
//! without the shedder and once with it. It prints each class's success, the goodput (answers in time) and
//! the latency, and writes `overload.svg`: requests in flight, admitted, shed, and the adaptive
//! limit, every 100 ms of the run with shedding.

use std::error::Error;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http::StatusCode;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tollgate::key::Header;
use tollgate::limiter::Rule;
use tollgate::shed::{ByHeader, Criticality, Limit};
use tollgate::{
    ConcurrencyLimitLayer, LoadShedLayer, MemoryStore, Policy, Rate, RateLimitLayer, ShapeLayer,
};

/// The dependency: 20 workers, 50 ms a request, so 400 requests per second.
const WORKERS: usize = 20;
const SERVICE_TIME: Duration = Duration::from_millis(50);
const CAPACITY_PER_SECOND: u64 = 400;
/// The load: 150 % of capacity, for this long, from clients that wait this long at most.
const OFFERED_PER_SECOND: u64 = CAPACITY_PER_SECOND * 3 / 2;
const RUN: Duration = Duration::from_secs(6);
const PATIENCE: Duration = Duration::from_secs(1);
const USERS: u64 = 40;

/// The application, and what the example watches of it.
#[derive(Debug)]
pub struct App {
    /// The router with its slow dependency, behind the protections.
    pub router: Router,
    /// The shedder, when there is one.
    pub shed: Option<LoadShedLayer>,
    /// Requests inside the handlers (waiting for the dependency or served by it).
    pub inside: Arc<AtomicI64>,
}

/// The router with its slow dependency behind the four protections (or all but the shedder).
pub fn app(shedding: bool) -> Result<App, Box<dyn Error>> {
    let workers = Arc::new(Semaphore::new(WORKERS));
    let inside = Arc::new(AtomicI64::new(0));
    let handler = {
        let (workers, inside) = (workers.clone(), inside.clone());
        move || {
            let (workers, inside) = (workers.clone(), inside.clone());
            async move {
                inside.fetch_add(1, Ordering::Relaxed);
                let _worker = workers.acquire().await;
                tokio::time::sleep(SERVICE_TIME).await;
                inside.fetch_sub(1, Ordering::Relaxed);
                "done"
            }
        }
    };
    let router = Router::new()
        .route("/api/items", get(handler.clone()))
        .route("/report", get(handler));

    let user = || Header::from_static("x-user");
    // 4. Innermost: at most 32 in flight per user (a client that stops reading its answers
    //    cannot pile up more).
    let concurrency = ConcurrencyLimitLayer::builder()
        .rule(Rule::new("per-user-in-flight").key(user()), 32)
        .build()?;
    // 3. `/report` leaves at 5 per second per user; at most 5 wait.
    let shape = ShapeLayer::builder(MemoryStore::new())
        .rule(
            Rule::new("reports").path("/report").key(user()),
            Rate::per_second(5),
            5,
        )
        .build()?;
    // 2. Each user's quota.
    let quota = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::new("per-user")
                .key(user())
                .policy(Policy::gcra(Rate::per_second(100), 50)?),
        )
        .build()?;
    let router = router.layer(concurrency).layer(shape).layer(quota);
    // 1. Outermost: the shedder, against an adaptive limit, sheddable traffic first.
    if !shedding {
        return Ok(App {
            router,
            shed: None,
            inside,
        });
    }
    let shed = LoadShedLayer::builder(Limit::vegas(20).bounds(5, 500))
        .classify(ByHeader::from_static("x-criticality"))
        .build()?;
    Ok(App {
        router: router.layer(shed.clone()),
        shed: Some(shed),
        inside,
    })
}

/// What the client saw of one class.
#[derive(Default)]
struct Seen {
    sent: u64,
    in_time: u64,
    latencies: Vec<Duration>,
}

/// One run: 150 % load for `RUN` against the app; per class what was seen, and every 100 ms
/// (requests inside, admitted, shed, limit).
async fn run(shedding: bool) -> Result<([Seen; 2], Vec<[i64; 4]>, Duration), Box<dyn Error>> {
    let App {
        router,
        shed,
        inside,
    } = app(shedding)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr: SocketAddr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });

    let sampler = {
        let (shed, inside) = (shed.clone(), inside.clone());
        tokio::spawn(async move {
            let mut series = Vec::new();
            let mut last = (0, 0);
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            for _ in 0..(RUN.as_millis() / 100 + 10) {
                tick.tick().await;
                let (admitted, shed_now, limit) = match &shed {
                    Some(s) => {
                        let stats = s.stats();
                        let sum = |f: &dyn Fn(Criticality) -> u64| {
                            Criticality::ALL.iter().map(|&c| f(c)).sum::<u64>()
                        };
                        (
                            sum(&|c| stats.admitted(c)),
                            sum(&|c| stats.shed(c)),
                            i64::from(s.limit()),
                        )
                    }
                    None => (0, 0, 0),
                };
                series.push([
                    inside.load(Ordering::Relaxed),
                    (admitted - last.0) as i64,
                    (shed_now - last.1) as i64,
                    limit,
                ]);
                last = (admitted, shed_now);
            }
            series
        })
    };

    let client: Client<_, Empty<bytes::Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let seen = Arc::new(std::sync::Mutex::new([Seen::default(), Seen::default()]));
    let sent = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_nanos(1_000_000_000 / OFFERED_PER_SECOND));
    while start.elapsed() < RUN {
        tick.tick().await;
        let n = sent.fetch_add(1, Ordering::Relaxed);
        let class = usize::from(n % 3 != 0); // 0: critical (a third), 1: sheddable
        let path = if n % 20 == 7 { "/report" } else { "/api/items" };
        let request = http::Request::get(format!("http://{addr}{path}"))
            .header("x-user", format!("user-{}", n % USERS))
            .header("x-criticality", ["critical", "sheddable"][class])
            .body(Empty::new())?;
        let (client, seen) = (client.clone(), seen.clone());
        tasks.push(tokio::spawn(async move {
            let began = Instant::now();
            let answer = tokio::time::timeout(PATIENCE, async {
                let response = client.request(request).await.ok()?;
                let status = response.status();
                response.into_body().collect().await.ok()?;
                Some(status)
            })
            .await;
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            seen[class].sent += 1;
            if let Ok(Some(StatusCode::OK)) = answer {
                seen[class].in_time += 1;
                seen[class].latencies.push(began.elapsed());
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    let span = start.elapsed();
    server.abort();
    let series = sampler.await?;
    let seen = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
    Ok((seen, series, span))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Prints what each class saw; the goodput, in answers in time per second over `span` (from
/// the first request to the last answer).
fn report(name: &str, seen: &mut [Seen; 2], span: Duration) -> f64 {
    println!("\n{name}");
    println!("  class      sent  answered in time     p50      p99");
    let mut goodput = 0;
    for (class, s) in ["critical", "sheddable"].iter().zip(seen.iter_mut()) {
        s.latencies.sort_unstable();
        goodput += s.in_time;
        println!(
            "  {class:<9} {:>5}  {:>5} ({:>5.1} %)  {:>6.0?}  {:>6.0?}",
            s.sent,
            s.in_time,
            100.0 * s.in_time as f64 / s.sent.max(1) as f64,
            percentile(&s.latencies, 0.5),
            percentile(&s.latencies, 0.99),
        );
    }
    let per_second = goodput as f64 / span.as_secs_f64();
    println!(
        "  goodput: {per_second:.0} answers in time per second over {span:.1?}, {:.0} % of what the dependency can serve",
        100.0 * per_second / CAPACITY_PER_SECOND as f64
    );
    per_second
}

/// The run with shedding as a time series: in flight, admitted and shed per 100 ms, the limit.
fn svg(series: &[[i64; 4]]) -> String {
    let (w, h, pad) = (760.0, 320.0, 40.0);
    let top = series
        .iter()
        .flat_map(|s| s.iter().copied())
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let x = |i: usize| pad + (w - 2.0 * pad) * i as f64 / (series.len().max(2) - 1) as f64;
    let y = |v: i64| h - pad - (h - 2.0 * pad) * v as f64 / top;
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{pad}" y="20">150 % load with shedding, every 100 ms (top of the scale: {top})</text>
<line x1="{pad}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/>
"#,
        b = h - pad,
        r = w - pad
    );
    let names = [
        ("in the handlers", "#4575b4"),
        ("admitted / 100 ms", "#1a9850"),
        ("shed / 100 ms", "#d73027"),
        ("adaptive limit", "#984ea3"),
    ];
    for (k, (name, color)) in names.iter().enumerate() {
        let points: Vec<String> = series
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{:.1},{:.1}", x(i), y(s[k])))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/><text x="{}" y="{}" fill="{color}">{name}</text>"#,
            points.join(" "),
            pad + 180.0 * k as f64,
            h - 10.0
        );
    }
    out.push_str("</svg>\n");
    out
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    println!(
        "The dependency serves {CAPACITY_PER_SECOND} requests/s; the client sends {OFFERED_PER_SECOND}/s for {RUN:?}, a third critical, two thirds sheddable, and gives up after {PATIENCE:?}."
    );
    let (mut without, _, span) = run(false).await?;
    let plain = report(
        "Without the shedder (rate limit, shaping and concurrency limits only):",
        &mut without,
        span,
    );
    let (mut with, series, span) = run(true).await?;
    let shed = report("With the shedder in front:", &mut with, span);
    println!(
        "\nGoodput with shedding is {:.1}x the goodput without.",
        shed / plain.max(1.0)
    );
    std::fs::write("overload.svg", svg(&series))?;
    println!("Wrote overload.svg.");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::extract::Request;
    use tower::ServiceExt;

    /// The stack answers an ordinary request through all four layers, with the rate limit's
    /// fields.
    #[tokio::test]
    async fn the_stack_answers() {
        let App { router, shed, .. } = app(true).unwrap();
        let request = |class: &str| {
            Request::get("/api/items")
                .header("x-user", "u1")
                .header("x-criticality", class)
                .body(axum::body::Body::empty())
                .unwrap()
        };
        let response = router.clone().oneshot(request("critical")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().contains_key("ratelimit"));
        let shed = shed.unwrap();
        assert_eq!(shed.in_flight(), 1, "until its body is done");
        drop(response);
        assert_eq!(shed.in_flight(), 0);
    }
}
