//! The time `Config::from_toml` takes to read a file of just under 1 MiB (7,800 rules), clean,
//! and with 100 problems (an unknown field in each of 100 rules): with each problem, the
//! reading sets the field aside and reads again. Five runs of each, the median printed.
//!
//! ```sh
//! cargo bench --bench config_read
//! ```
#![allow(missing_docs)]

use std::time::{Duration, Instant};

use tollgate::config::Config;

/// 7,800 rules (just under 1 MiB), of which every 78th (100) has an unknown field if `bad`.
fn file(bad: bool) -> String {
    (0..7_800)
        .map(|i| {
            let unknown = if bad && i % 78 == 0 {
                "polices = 1\n"
            } else {
                ""
            };
            format!(
                "[[rules]]\nname = \"rule-{i:05}\"\npath_prefix = \"/api/v1/resource-{i:05}\"\n\
                 {unknown}policies = [{{ algorithm = \"gcra\", rate = \"10/s\", burst = 20 }}]\n"
            )
        })
        .collect()
}

fn main() {
    for (name, text) in [("clean", file(false)), ("100 problems", file(true))] {
        let mut times: Vec<Duration> = (0..5)
            .map(|_| {
                // Measurement, not limiting: the wall clock is what a benchmark reads.
                #[allow(clippy::disallowed_methods)]
                let start = Instant::now();
                let read = Config::from_toml(&text);
                let took = start.elapsed();
                let problems = read.err().map_or(0, |e| e.errors().len());
                std::hint::black_box(problems);
                took
            })
            .collect();
        times.sort();
        println!(
            "config_read/{name}: {} bytes, median {:.1} ms",
            text.len(),
            times[2].as_secs_f64() * 1e3
        );
    }
}
