//! What the Redis benches share: this process's CPU time, the script calls a server ran, and
//! `redis-benchmark`'s ceiling for one check script (the anchor every Redis figure is read
//! against). The servers themselves come from the tests' `support` module.

use std::process::Command;

use tollgate::Policy;

use crate::support;

/// This process's CPU time so far, in microseconds (Linux `/proc/self/stat`, 100 ticks/s).
pub(crate) fn cpu_time_us() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) * 10_000.0
}

/// The scripts the server has run so far (`EVALSHA`, and `EVAL` after a `NOSCRIPT`).
pub(crate) fn script_calls(server: &support::RedisServer) -> u64 {
    server
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// `redis-benchmark` running `EVALSHA` of the check script `sha` for `policy`, 64 clients,
/// pipeline 16: on the key `bench:{hot}`, or with `keys` > 0 on `bench:{n}` for n drawn
/// from `keys`. Requests per second.
pub(crate) fn ceiling(port: u16, sha: &str, policy: &Policy, keys: u64) -> f64 {
    let key = if keys > 0 {
        "bench:{__rand_int__}"
    } else {
        "bench:{hot}"
    };
    let period = policy.interval().as_nanos().to_string();
    let horizon = policy.window().as_nanos().to_string();
    let limit = policy.limit().to_string();
    let mut command = Command::new("redis-benchmark");
    command
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", "64", "-P", "16", "-n", "400000", "-q"]);
    if keys > 0 {
        command.args(["-r", &keys.to_string()]);
    }
    let out = command
        .args([
            "EVALSHA",
            sha,
            "1",
            key,
            "",
            "0",
            "1000",
            policy.algorithm().as_str(),
            &limit,
            &period,
            "1",
            &horizon,
            "",
        ])
        .output()
        .expect("redis-benchmark");
    let text = String::from_utf8_lossy(&out.stdout);
    // "EVALSHA ...: 143000.00 requests per second, p50=..."
    text.rsplit('\r')
        .chain(text.lines())
        .find_map(|l| {
            let (_, rest) = l.split_once(": ")?;
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .unwrap_or(f64::NAN)
}
