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
//! A client in the same process sends 150 % of what the dependency can serve for 6 seconds,
//! giving up on any answer after 1 second, in two scenarios:
//!
//! - **priorities**: a third `critical`, two thirds `sheddable`; once without the shedder and
//!   once with it;
//! - **a noisy tenant**: one tenant (its 40 users) sends 500 requests a second beside 10 small
//!   tenants sending 10 a second each, all of one class; once with the shedder alone and once
//!   with it fair among tenants (`fair_by` the `x-tenant` header).
//!
//! It prints what each class or tenant got (answers in time, latency, goodput), and writes
//! `overload.svg`: the priorities run with shedding (requests in the handlers, admitted and
//! shed per 100 ms, the adaptive limit) and what the noisy tenant and the small ones were
//! served, second by second, without and with fairness. About 30 seconds in all.

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
/// In the tenant scenario, one request in this many is a small tenant's (100 a second in
/// all), the rest the noisy tenant's (500 a second).
const SMALL_EVERY: u64 = 6;
const SMALL_TENANTS: u64 = 10;
/// How long the sampler watches (and the chart shows): the load, the clients' patience after
/// it, and half a second more for the server to see the last of them go.
const WATCH: Duration = Duration::from_millis(7_500);
/// How often the sampler looks, and the width of the chart's served-per-second buckets.
const SAMPLE: Duration = Duration::from_millis(100);
const BUCKET: Duration = Duration::from_millis(250);

/// What stands in front of the router's three other protections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shedder {
    /// No shedder.
    None,
    /// The shedder, by class.
    ByClass,
    /// The shedder, by class and fair among the tenants of the `x-tenant` header.
    Fair,
}

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

/// One request counted inside a handler for as long as the handler runs: the count goes
/// down when it is dropped, also when the handler is cancelled because its client went away
/// (counting down after the handler's last `await` would miss those).
struct Inside(Arc<AtomicI64>);

impl Inside {
    fn enter(count: &Arc<AtomicI64>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Inside(Arc::clone(count))
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The router with its slow dependency behind the four protections (or all but the shedder).
pub fn app(shedder: Shedder) -> Result<App, Box<dyn Error>> {
    let workers = Arc::new(Semaphore::new(WORKERS));
    let inside = Arc::new(AtomicI64::new(0));
    let handler = {
        let (workers, inside) = (workers.clone(), inside.clone());
        move || {
            let (workers, inside) = (workers.clone(), inside.clone());
            async move {
                let _inside = Inside::enter(&inside);
                let _worker = workers.acquire().await;
                tokio::time::sleep(SERVICE_TIME).await;
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
    // 1. Outermost: the shedder, against an adaptive limit, sheddable traffic first (and,
    //    with fairness, a tenant past its fair share before anyone else).
    let shed = LoadShedLayer::builder(Limit::vegas(20).bounds(5, 500))
        .classify(ByHeader::from_static("x-criticality"));
    let shed = match shedder {
        Shedder::None => {
            return Ok(App {
                router,
                shed: None,
                inside,
            });
        }
        Shedder::ByClass => shed.build()?,
        Shedder::Fair => shed.fair_by(Header::from_static("x-tenant")).build()?,
    };
    Ok(App {
        router: router.layer(shed.clone()),
        shed: Some(shed),
        inside,
    })
}

/// The two scenarios' senders, by the request's number: its path and headers, and which of
/// two groups it is counted in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    /// Group 0 critical (a third), group 1 sheddable; one request in 20 to `/report`.
    Priorities,
    /// Group 0 the noisy tenant, group 1 the small tenants; all of the default class.
    Tenants,
}

impl Scenario {
    fn groups(self) -> [&'static str; 2] {
        match self {
            Scenario::Priorities => ["critical", "sheddable"],
            Scenario::Tenants => ["noisy tenant", "small tenants"],
        }
    }

    fn request(self, n: u64, addr: SocketAddr) -> Result<(usize, Request), Box<dyn Error>> {
        let builder = http::Request::builder();
        let (group, builder) = match self {
            Scenario::Priorities => {
                let group = usize::from(n % 3 != 0);
                let path = if n % 20 == 7 { "/report" } else { "/api/items" };
                let builder = builder
                    .uri(format!("http://{addr}{path}"))
                    .header("x-user", format!("user-{}", n % USERS))
                    .header("x-criticality", ["critical", "sheddable"][group]);
                (group, builder)
            }
            Scenario::Tenants if n % SMALL_EVERY == 0 => {
                let tenant = format!("small-{}", n / SMALL_EVERY % SMALL_TENANTS);
                let builder = builder
                    .uri(format!("http://{addr}/api/items"))
                    .header("x-user", &tenant)
                    .header("x-tenant", &tenant);
                (1, builder)
            }
            Scenario::Tenants => {
                let builder = builder
                    .uri(format!("http://{addr}/api/items"))
                    .header("x-user", format!("noisy-{}", n % USERS))
                    .header("x-tenant", "noisy");
                (0, builder)
            }
        };
        Ok((group, builder.body(Empty::new())?))
    }
}

/// A request as the client sends it.
type Request = http::Request<Empty<bytes::Bytes>>;

/// What the client saw of one group.
#[derive(Default)]
struct Seen {
    sent: u64,
    in_time: u64,
    latencies: Vec<Duration>,
    /// When each answer in time came, since the start.
    served_at: Vec<Duration>,
}

/// One run, and every 100 ms: requests inside the handlers, admitted, shed, the limit.
struct Outcome {
    seen: [Seen; 2],
    series: Vec<[i64; 4]>,
    span: Duration,
}

/// One run: 150 % load for `RUN` against the app, as `scenario` sends it.
async fn run(shedder: Shedder, scenario: Scenario) -> Result<Outcome, Box<dyn Error>> {
    let App {
        router,
        shed,
        inside,
    } = app(shedder)?;
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
            let mut tick = tokio::time::interval(SAMPLE);
            for _ in 0..=WATCH.as_millis() / SAMPLE.as_millis() {
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
        let (group, request) = scenario.request(n, addr)?;
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
            seen[group].sent += 1;
            if let Ok(Some(StatusCode::OK)) = answer {
                seen[group].in_time += 1;
                seen[group].latencies.push(began.elapsed());
                seen[group].served_at.push(start.elapsed());
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    let span = start.elapsed();
    let series = sampler.await?;
    server.abort();
    let seen = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(Outcome { seen, series, span })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Prints what each group saw; the goodput, in answers in time per second over the run's
/// span (from the first request to the last answer).
fn report(name: &str, scenario: Scenario, outcome: &mut Outcome) -> f64 {
    println!("\n{name}");
    println!("  {:<14} sent  answered in time     p50      p99", "");
    let mut goodput = 0;
    for (group, s) in scenario.groups().iter().zip(outcome.seen.iter_mut()) {
        s.latencies.sort_unstable();
        goodput += s.in_time;
        println!(
            "  {group:<14} {:>5}  {:>5} ({:>5.1} %)  {:>6.0?}  {:>6.0?}",
            s.sent,
            s.in_time,
            100.0 * s.in_time as f64 / s.sent.max(1) as f64,
            percentile(&s.latencies, 0.5),
            percentile(&s.latencies, 0.99),
        );
    }
    let span = outcome.span;
    let per_second = goodput as f64 / span.as_secs_f64();
    println!(
        "  goodput: {per_second:.0} answers in time per second over {span:.1?}, {:.0} % of what the dependency can serve",
        100.0 * per_second / CAPACITY_PER_SECOND as f64
    );
    let left = outcome.series.last().map_or(0, |s| s[0]);
    println!("  requests in the handlers at {WATCH:?}, every client done: {left}");
    per_second
}

/// A line on a chart: its name, colour, whether dashed, and its points (seconds, value).
struct Line {
    name: &'static str,
    color: &'static str,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

/// A step for about five ticks up to `top`: 1, 2 or 5 times a power of ten.
fn tick_step(top: f64) -> f64 {
    let raw = (top / 5.0).max(1e-9);
    let power = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&step| step >= raw)
        .unwrap_or(10.0 * power)
}

/// One panel of the chart at height `y0`: its title, y axis name, a time axis in seconds (a
/// tick a second, the end of the load marked), a y scale from 0 to `top`, and the lines.
fn panel(out: &mut String, y0: f64, title: &str, unit: &str, top: f64, lines: &[Line]) {
    let (left, right, width, height) = (60.0, 200.0, 760.0, 260.0);
    let (plot_top, plot_bottom) = (y0 + 40.0, y0 + height - 40.0);
    let seconds = WATCH.as_secs_f64();
    let step = tick_step(top);
    let top = (top / step).ceil().max(1.0) * step;
    let x = |t: f64| left + (width - left - right) * t / seconds;
    let y = |v: f64| plot_bottom - (plot_bottom - plot_top) * v / top;
    let plot_right = width - right;
    let _ = writeln!(
        out,
        r#"<text x="{left}" y="{}" font-weight="bold">{title}</text>"#,
        y0 + 22.0
    );
    // The y scale: grid lines and labels.
    let mut v = 0.0;
    while v <= top + step / 2.0 {
        let _ = writeln!(
            out,
            r##"<line x1="{left}" y1="{yv:.1}" x2="{plot_right}" y2="{yv:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{v}</text>"##,
            left - 6.0,
            y(v) + 4.0,
            yv = y(v),
        );
        v += step;
    }
    let _ = writeln!(
        out,
        r#"<text x="14" y="{:.1}" transform="rotate(-90 14 {:.1})" text-anchor="middle">{unit}</text>"#,
        (plot_top + plot_bottom) / 2.0,
        (plot_top + plot_bottom) / 2.0
    );
    // The time axis: a tick a second, and where the load ends.
    let _ = writeln!(
        out,
        r#"<line x1="{left}" y1="{plot_bottom}" x2="{plot_right}" y2="{plot_bottom}" stroke="black"/><line x1="{left}" y1="{plot_top}" x2="{left}" y2="{plot_bottom}" stroke="black"/>"#
    );
    for s in 0..=seconds as u64 {
        let xs = x(s as f64);
        let _ = writeln!(
            out,
            r#"<line x1="{xs:.1}" y1="{plot_bottom}" x2="{xs:.1}" y2="{}" stroke="black"/><text x="{xs:.1}" y="{}" text-anchor="middle">{s} s</text>"#,
            plot_bottom + 5.0,
            plot_bottom + 18.0
        );
    }
    let end = x(RUN.as_secs_f64());
    let _ = writeln!(
        out,
        r#"<line x1="{end:.1}" y1="{plot_top}" x2="{end:.1}" y2="{plot_bottom}" stroke="gray" stroke-dasharray="4 3"/><text x="{:.1}" y="{:.1}" fill="gray">load ends</text>"#,
        end + 4.0,
        plot_top + 12.0
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time since the load began</text>"#,
        (left + plot_right) / 2.0,
        plot_bottom + 34.0
    );
    for (k, line) in lines.iter().enumerate() {
        let points: Vec<String> = line
            .points
            .iter()
            .map(|&(t, v)| format!("{:.1},{:.1}", x(t), y(v.min(top))))
            .collect();
        let dash = if line.dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let (lx, ly) = (plot_right + 12.0, plot_top + 18.0 * k as f64);
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/><line x1="{lx}" y1="{ly:.1}" x2="{}" y2="{ly:.1}" stroke="{color}" stroke-width="2"{dash}/><text x="{}" y="{:.1}">{name}</text>"#,
            points.join(" "),
            lx + 24.0,
            lx + 30.0,
            ly + 4.0,
            color = line.color,
            name = line.name,
        );
    }
}

/// Answers in time per second, in buckets of `BUCKET` (by when they came), at each bucket's
/// middle.
fn served_per_second(served_at: &[Duration]) -> Vec<(f64, f64)> {
    let buckets = (WATCH.as_millis() / BUCKET.as_millis()) as usize;
    let mut counts = vec![0u64; buckets];
    for at in served_at {
        let i = (at.as_millis() / BUCKET.as_millis()) as usize;
        if let Some(c) = counts.get_mut(i) {
            *c += 1;
        }
    }
    counts
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            (
                (i as f64 + 0.5) * BUCKET.as_secs_f64(),
                c as f64 / BUCKET.as_secs_f64(),
            )
        })
        .collect()
}

/// The chart: the priorities run with shedding as a time series (in the handlers, admitted
/// and shed per 100 ms, the limit), then the tenants' answers in time per second without and
/// with fairness, on one scale.
fn svg(priorities: &Outcome, unfair: &Outcome, fair: &Outcome) -> String {
    let mut out = String::from(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="760" height="800" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
"#,
    );
    let at = |i: usize| i as f64 * SAMPLE.as_secs_f64();
    let column = |k: usize| -> Vec<(f64, f64)> {
        priorities
            .series
            .iter()
            .enumerate()
            .map(|(i, s)| (at(i), s[k] as f64))
            .collect()
    };
    let top = priorities
        .series
        .iter()
        .flat_map(|s| s.iter().copied())
        .max()
        .unwrap_or(1) as f64;
    let series = [
        ("in the handlers", "#4575b4"),
        ("admitted / 100 ms", "#1a9850"),
        ("shed / 100 ms", "#d73027"),
        ("adaptive limit", "#984ea3"),
    ];
    let lines: Vec<Line> = series
        .iter()
        .enumerate()
        .map(|(k, &(name, color))| Line {
            name,
            color,
            dashed: false,
            points: column(k),
        })
        .collect();
    panel(
        &mut out,
        0.0,
        "Priorities, 150 % load, with the shedder (every 100 ms)",
        "requests",
        top,
        &lines,
    );
    let tenants = |outcome: &Outcome| -> [Line; 3] {
        [
            Line {
                name: "noisy tenant served",
                color: "#d73027",
                dashed: false,
                points: served_per_second(&outcome.seen[0].served_at),
            },
            Line {
                name: "small tenants served",
                color: "#1a9850",
                dashed: false,
                points: served_per_second(&outcome.seen[1].served_at),
            },
            Line {
                name: "small tenants' demand",
                color: "#1a9850",
                dashed: true,
                points: vec![
                    (0.0, (OFFERED_PER_SECOND / SMALL_EVERY) as f64),
                    (RUN.as_secs_f64(), (OFFERED_PER_SECOND / SMALL_EVERY) as f64),
                ],
            },
        ]
    };
    let (unfair, fair) = (tenants(unfair), tenants(fair));
    let top = unfair
        .iter()
        .chain(&fair)
        .flat_map(|l| l.points.iter().map(|p| p.1))
        .fold(1.0, f64::max);
    panel(
        &mut out,
        270.0,
        "A noisy tenant beside 10 small ones: the shedder alone",
        "answers in time / s",
        top,
        &unfair,
    );
    panel(
        &mut out,
        540.0,
        "The same with fair_by(x-tenant)",
        "answers in time / s",
        top,
        &fair,
    );
    out.push_str("</svg>\n");
    out
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    println!(
        "The dependency serves {CAPACITY_PER_SECOND} requests/s; the client sends {OFFERED_PER_SECOND}/s for {RUN:?} and gives up after {PATIENCE:?}."
    );
    println!("\nPriorities: a third critical, two thirds sheddable.");
    let scenario = Scenario::Priorities;
    let mut without = run(Shedder::None, scenario).await?;
    let plain = report(
        "Without the shedder (rate limit, shaping and concurrency limits only):",
        scenario,
        &mut without,
    );
    let mut with = run(Shedder::ByClass, scenario).await?;
    let shed = report("With the shedder in front:", scenario, &mut with);
    println!(
        "\nGoodput with shedding is {:.1}x the goodput without.",
        shed / plain.max(1.0)
    );

    println!(
        "\nA noisy tenant: {}/s over {USERS} users, beside {SMALL_TENANTS} small tenants at {}/s each; one class.",
        OFFERED_PER_SECOND - OFFERED_PER_SECOND / SMALL_EVERY,
        OFFERED_PER_SECOND / SMALL_EVERY / SMALL_TENANTS
    );
    let scenario = Scenario::Tenants;
    let mut unfair = run(Shedder::ByClass, scenario).await?;
    report("The shedder alone:", scenario, &mut unfair);
    let mut fair = run(Shedder::Fair, scenario).await?;
    report("The shedder, fair by tenant:", scenario, &mut fair);

    std::fs::write("overload.svg", svg(&with, &unfair, &fair))?;
    println!("\nWrote overload.svg.");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::extract::Request;
    use tower::ServiceExt;

    fn request(class: &str) -> Request {
        Request::get("/api/items")
            .header("x-user", "u1")
            .header("x-tenant", "t1")
            .header("x-criticality", class)
            .body(axum::body::Body::empty())
            .unwrap()
    }

    /// The stack answers an ordinary request through all four layers, with the rate limit's
    /// fields, with the shedder fair or not.
    #[tokio::test]
    async fn the_stack_answers() {
        for shedder in [Shedder::ByClass, Shedder::Fair] {
            let App { router, shed, .. } = app(shedder).unwrap();
            let response = router.clone().oneshot(request("critical")).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            assert!(response.headers().contains_key("ratelimit"));
            let shed = shed.unwrap();
            assert_eq!(shed.in_flight(), 1, "until its body is done");
            drop(response);
            assert_eq!(shed.in_flight(), 0);
        }
    }

    /// Handlers whose clients gave up (here: a timeout drops the request, as a closed
    /// connection does) leave the count of requests in the handlers, and the shedder's.
    #[tokio::test(start_paused = true)]
    async fn requests_given_up_leave_the_handlers() {
        for shedder in [Shedder::None, Shedder::ByClass] {
            let App {
                router,
                shed,
                inside,
            } = app(shedder).unwrap();
            // 15: under the shedder's first limit (18 critical of 20) and the 20 workers.
            let clients: Vec<_> = (0..15)
                .map(|_| {
                    let request = router.clone().oneshot(request("critical"));
                    tokio::spawn(tokio::time::timeout(Duration::from_millis(10), request))
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(5)).await;
            assert_eq!(inside.load(Ordering::Relaxed), 15, "{shedder:?}");
            for client in clients {
                assert!(client.await.unwrap().is_err(), "gave up");
            }
            assert_eq!(inside.load(Ordering::Relaxed), 0, "{shedder:?}");
            assert_eq!(shed.map_or(0, |s| s.in_flight()), 0);
        }
    }
}
