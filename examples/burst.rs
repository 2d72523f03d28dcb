//! cargo run --example burst [-- path/to/chart.svg]
//!
//! The burst experiment: one trace of 80 requests goes through every algorithm with the same
//! settings (limit 10 per 1-second window; capacity 10 and 10 per second for the buckets), on the
//! in-process store with a manual clock, so the run is exact and takes no time. It prints who was
//! admitted, and the largest number admitted in any 1-second interval, next to the figures of the
//! reference experiment, and draws a timeline of every decision as an SVG chart. Then it starts a
//! real axum server with tollgate's layer on a loopback port, sends it a burst, and prints what
//! came back (`examples/server_burst.rs`).

use std::collections::VecDeque;
use std::error::Error;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::{MemoryStore, Policy, Rate};

// The HTTP half of the demo; its own `main` runs it alone.
#[allow(dead_code)]
#[path = "server_burst.rs"]
mod server_burst;

/// The limit of every policy: 10 per window, or a capacity of 10 for a bucket.
const LIMIT: u64 = 10;
/// The window, and the span the bucket rate is given over (10 per second: one every 100 ms).
const WINDOW: Duration = Duration::from_secs(1);
const MS: u64 = 1_000_000;
const SECOND: u64 = 1_000 * MS;

/// The 80 arrival times, in nanoseconds, in three phases:
/// - 10 requests spaced 100 ms apart (50 ms, 150 ms, ..., 950 ms): exactly the allowed rate;
/// - 20 requests 5 ms apart right after the window boundary (1000 ms to 1095 ms): a burst;
/// - 50 requests 20 ms apart (1100 ms to 2080 ms): sustained pressure at twice the rate.
///
/// The first two phases put 20 requests inside one second, split by the fixed window's
/// boundary at 1 s: the double burst the fixed window lets through.
fn trace() -> Vec<u64> {
    let steady = (0..10).map(|i| 50 * MS + i * 100 * MS);
    let burst = (0..20).map(|i| 1_000 * MS + i * 5 * MS);
    let pressure = (0..50).map(|i| 1_100 * MS + i * 20 * MS);
    steady.chain(burst).chain(pressure).collect()
}

/// What happened to each request of the trace, for one algorithm.
struct Run {
    name: &'static str,
    /// Whether each request was admitted (for the queue: accepted into the queue).
    admitted: Vec<bool>,
    /// When each admitted request leaves a queue (only for the shaper): what its
    /// "admitted in any second" counts, because that is when the service sees it.
    released: Option<Vec<u64>>,
    /// The figure of the reference experiment for this algorithm, if it has one.
    reference: Option<u64>,
    /// Why our figure may differ from the reference's.
    why_different: &'static str,
}

impl Run {
    /// The times the service receives the admitted requests.
    fn delivered(&self, trace: &[u64]) -> Vec<u64> {
        match &self.released {
            Some(released) => released.clone(),
            None => trace
                .iter()
                .zip(&self.admitted)
                .filter(|(_, ok)| **ok)
                .map(|(t, _)| *t)
                .collect(),
        }
    }

    fn admitted_count(&self) -> usize {
        self.admitted.iter().filter(|ok| **ok).count()
    }
}

/// Sends the trace to a fresh in-process store under `policy`, moving a manual clock to each
/// arrival time, and returns which requests were admitted.
fn run_store(policy: &Policy, trace: &[u64]) -> Result<Vec<bool>, Box<dyn Error>> {
    let clock = ManualClock::new();
    let store = MemoryStore::with_clock(clock.clone());
    let mut admitted = Vec::with_capacity(trace.len());
    for &at in trace {
        clock.set(Duration::from_nanos(at));
        admitted.push(store.check_now("client", policy, 1)?.allowed());
    }
    Ok(admitted)
}

/// The leaky bucket as a queue (a shaper): at most `capacity` requests wait, and they leave one
/// every `interval`; a request arriving at an empty queue leaves one interval later. A request
/// that finds the queue full is dropped. Returns, for each request, when it leaves (None when
/// dropped).
fn run_queue(trace: &[u64], capacity: usize, interval: u64) -> Vec<Option<u64>> {
    // The departure times of the requests still waiting, oldest first.
    let mut waiting: VecDeque<u64> = VecDeque::new();
    let mut departures = Vec::with_capacity(trace.len());
    for &at in trace {
        while waiting.front().is_some_and(|&leaves| leaves <= at) {
            waiting.pop_front();
        }
        if waiting.len() < capacity {
            let leaves = waiting.back().map_or(at, |&last| last) + interval;
            waiting.push_back(leaves);
            departures.push(Some(leaves));
        } else {
            departures.push(None);
        }
    }
    departures
}

/// The largest number of `times` (sorted) inside any interval `[t, t + span)`, and the `t` of
/// the first such interval. Only intervals starting at one of the times need checking: moving an
/// interval's start forward to the first time it holds never loses one.
fn max_in_any_interval(times: &[u64], span: u64) -> (usize, u64) {
    let mut best = (0, 0);
    let mut end = 0;
    for (start, &t) in times.iter().enumerate() {
        while end < times.len() && times[end] < t + span {
            end += 1;
        }
        if end - start > best.0 {
            best = (end - start, t);
        }
    }
    best
}

/// Every algorithm on the same trace, in the order of the table.
fn run_all(trace: &[u64]) -> Result<Vec<Run>, Box<dyn Error>> {
    let rate = Rate::new(LIMIT, WINDOW);
    let interval = WINDOW.as_nanos() as u64 / LIMIT;
    let queue = run_queue(trace, LIMIT as usize, interval);
    let store_run = |name, policy: Result<Policy, _>, reference, why_different| {
        Ok::<_, Box<dyn Error>>(Run {
            name,
            admitted: run_store(&policy?, trace)?,
            released: None,
            reference,
            why_different,
        })
    };
    Ok(vec![
        store_run(
            "fixed window",
            Policy::fixed_window(LIMIT, WINDOW),
            Some(20),
            "a full window just before the boundary and another just after it",
        )?,
        store_run(
            "sliding log",
            Policy::sliding_log(LIMIT, WINDOW),
            Some(10),
            "the log is exact: never more than the limit in any window",
        )?,
        store_run(
            "sliding window counter",
            Policy::sliding_window(LIMIT, WINDOW),
            Some(11),
            "the estimate assumes the previous window's requests were spread evenly",
        )?,
        store_run(
            "token bucket",
            Policy::token_bucket(rate, LIMIT),
            Some(19),
            "the saved tokens plus those earned during the second; how many were saved depends \
             on the trace",
        )?,
        store_run(
            "leaky bucket (meter)",
            Policy::leaky_bucket(rate, LIMIT),
            Some(10),
            "a meter admits exactly what the token bucket admits; the reference's 10 is the \
             queue's output (next row)",
        )?,
        store_run(
            "GCRA",
            Policy::gcra(rate, LIMIT),
            None,
            "not in the reference: it admits exactly what the token bucket admits",
        )?,
        Run {
            name: "leaky bucket (queue)",
            admitted: queue.iter().map(Option::is_some).collect(),
            released: Some(queue.iter().flatten().copied().collect()),
            reference: Some(10),
            why_different: "the queue releases one request every 100 ms, whatever arrives",
        },
    ])
}

fn print_table(runs: &[Run], trace: &[u64]) {
    println!(
        "{} requests; limit {LIMIT} per {} s (buckets: capacity {LIMIT}, {LIMIT} per second)",
        trace.len(),
        WINDOW.as_secs()
    );
    println!(
        "trace: 10 requests 100 ms apart (50..950 ms), a burst of 20 5 ms apart right after \
         the 1 s boundary\n(1000..1095 ms), then 50 requests 20 ms apart (1100..2080 ms)\n"
    );
    println!(
        "{:<24} {:>8} {:>8} {:>12} {:>10}",
        "algorithm", "admitted", "rejected", "max in 1 s", "reference"
    );
    for run in runs {
        let (max, _) = max_in_any_interval(&run.delivered(trace), SECOND);
        let admitted = run.admitted_count();
        let reference = run.reference.map_or("-".to_owned(), |r| r.to_string());
        println!(
            "{:<24} {admitted:>8} {:>8} {max:>12} {reference:>10}",
            run.name,
            trace.len() - admitted,
        );
        match run.reference {
            Some(r) if r == max as u64 => {}
            Some(_) => println!("{:<24}   ^ differs: {}", "", run.why_different),
            None => println!("{:<24}   ^ {}", "", run.why_different),
        }
    }
    println!(
        "\n\"max in 1 s\" is the largest number admitted in any interval [t, t + 1 s); for the \
         queue,\nit counts the requests as they leave the queue, which is when the service sees \
         them."
    );
}

/// One row of the chart per algorithm: a tall green bar per admitted request, a short red bar
/// per rejected one, a blue triangle where the queue releases a request, and a shaded band on
/// the 1-second interval holding the most admissions.
fn svg_chart(runs: &[Run], trace: &[u64]) -> String {
    let (left, top, row_h, px_per_ms) = (190.0, 50.0, 48.0, 0.5);
    // The axis runs to the last arrival or departure, rounded up to a tick.
    let last = runs
        .iter()
        .flat_map(|run| run.released.iter().flatten())
        .chain(trace)
        .max()
        .copied()
        .unwrap_or(0);
    let end_ms = (last / MS / 200 + 1) * 200;
    let x = |ns: u64| left + ns as f64 / MS as f64 * px_per_ms;
    let width = left + end_ms as f64 * px_per_ms + 30.0;
    let height = top + row_h * runs.len() as f64 + 90.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="22" font-size="15">{} requests, limit {LIMIT} per second: who was admitted when</text>"#,
        trace.len()
    );
    // The fixed window's boundaries.
    for b in (0..=end_ms / 1_000).map(|k| k * SECOND) {
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{top}" x2="{0}" y2="{1}" stroke="#999" stroke-dasharray="4 3"/>"##,
            x(b),
            top + row_h * runs.len() as f64
        );
    }
    for (row, run) in runs.iter().enumerate() {
        let y = top + row_h * row as f64;
        let mid = y + row_h / 2.0;
        let _ = writeln!(s, r#"<text x="10" y="{}">{}</text>"#, mid + 4.0, run.name);
        let delivered = run.delivered(trace);
        let (max, from) = max_in_any_interval(&delivered, SECOND);
        let _ = writeln!(
            s,
            r##"<rect x="{}" y="{}" width="{}" height="{}" fill="#fff3c4"><title>{max} admitted in [{} ms, {} ms)</title></rect>"##,
            x(from),
            y + 3.0,
            x(from + SECOND) - x(from),
            row_h - 6.0,
            from / MS,
            (from + SECOND) / MS
        );
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" fill="#8a6d00">max {max} in 1 s</text>"##,
            x(from) + 3.0,
            y + 14.0
        );
        for (&at, &ok) in trace.iter().zip(&run.admitted) {
            let (h, colour) = if ok {
                (18.0, "#1a9850")
            } else {
                (8.0, "#d73027")
            };
            let _ = writeln!(
                s,
                r#"<rect x="{:.1}" y="{:.1}" width="1.6" height="{h}" fill="{colour}"/>"#,
                x(at) - 0.8,
                mid + 10.0 - h
            );
        }
        for &at in run.released.iter().flatten() {
            let _ = writeln!(
                s,
                r##"<path d="M{:.1} {} l3 6 h-6 z" fill="#4575b4"/>"##,
                x(at),
                mid + 16.0
            );
        }
    }
    // The time axis.
    let axis_y = top + row_h * runs.len() as f64 + 10.0;
    let _ = writeln!(
        s,
        r#"<line x1="{left}" y1="{axis_y}" x2="{}" y2="{axis_y}" stroke="black"/>"#,
        x(end_ms * MS)
    );
    for ms in (0..=end_ms).step_by(200) {
        let tx = x(ms * MS);
        let _ = writeln!(
            s,
            r#"<line x1="{tx}" y1="{axis_y}" x2="{tx}" y2="{}" stroke="black"/><text x="{tx}" y="{}" text-anchor="middle">{ms}</text>"#,
            axis_y + 5.0,
            axis_y + 18.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="end">time (ms)</text>"#,
        x(end_ms * MS),
        axis_y + 34.0
    );
    // The legend.
    let ly = axis_y + 52.0;
    let _ = writeln!(
        s,
        r##"<rect x="{left}" y="{}" width="3" height="14" fill="#1a9850"/><text x="{}" y="{ly}">admitted</text>
<rect x="{}" y="{}" width="3" height="7" fill="#d73027"/><text x="{}" y="{ly}">rejected</text>
<path d="M{} {} l4 8 h-8 z" fill="#4575b4"/><text x="{}" y="{ly}">leaves the queue</text>
<rect x="{}" y="{}" width="14" height="12" fill="#fff3c4"/><text x="{}" y="{ly}">the 1 s with the most admitted</text>
<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#999" stroke-dasharray="4 3"/><text x="{}" y="{ly}">fixed window boundary</text>"##,
        ly - 12.0,
        left + 8.0,
        left + 90.0,
        ly - 7.0,
        left + 98.0,
        left + 184.0,
        ly - 10.0,
        left + 194.0,
        left + 320.0,
        ly - 10.0,
        left + 340.0,
        left + 560.0,
        ly - 12.0,
        left + 560.0,
        ly + 2.0,
        left + 568.0,
    );
    s.push_str("</svg>\n");
    s
}

fn main() -> Result<(), Box<dyn Error>> {
    let path = std::env::args_os()
        .nth(1)
        .map_or_else(|| PathBuf::from("target/burst.svg"), PathBuf::from);
    let trace = trace();
    let runs = run_all(&trace)?;
    print_table(&runs, &trace);
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&path, svg_chart(&runs, &trace))?;
    println!("\nTimeline chart written to {}", path.display());

    // The same idea over HTTP: a real axum server with the layer, and a burst of requests.
    println!("\n---\n");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(server_burst::run())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_figures_are_the_reference_experiments() -> Result<(), Box<dyn Error>> {
        let trace = trace();
        assert_eq!(trace.len(), 80);
        let runs = run_all(&trace)?;
        let figures: Vec<(&str, usize, usize)> = runs
            .iter()
            .map(|r| {
                let (max, _) = max_in_any_interval(&r.delivered(&trace), SECOND);
                (r.name, r.admitted_count(), max)
            })
            .collect();
        assert_eq!(
            figures,
            [
                ("fixed window", 25, 20),
                ("sliding log", 21, 10),
                ("sliding window counter", 21, 11),
                ("token bucket", 30, 19),
                ("leaky bucket (meter)", 30, 19),
                ("GCRA", 30, 19),
                ("leaky bucket (queue)", 30, 10),
            ]
        );
        // The three bucket algorithms admit exactly the same requests.
        assert_eq!(runs[3].admitted, runs[4].admitted);
        assert_eq!(runs[3].admitted, runs[5].admitted);
        Ok(())
    }

    #[test]
    fn the_busiest_interval_is_half_open() {
        assert_eq!(max_in_any_interval(&[], SECOND), (0, 0));
        // 0 and 1 s are never in one [t, t + 1 s); 1 s and 1.5 s are.
        let times = [0, SECOND, SECOND + SECOND / 2, 2 * SECOND + 400 * MS];
        assert_eq!(max_in_any_interval(&times, SECOND), (2, SECOND));
    }

    #[test]
    fn the_queue_releases_one_per_interval_and_drops_when_full() {
        let at = |ms: u64| ms * MS;
        // Three at once into a queue of two: the third is dropped; the first leaves one
        // interval after arriving, the second one interval later.
        let out = run_queue(&[at(0), at(0), at(0), at(250)], 2, at(100));
        assert_eq!(out, [Some(at(100)), Some(at(200)), None, Some(at(350))]);
    }
}
