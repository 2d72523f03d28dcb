//! The fuzz targets' checks (`fuzz/checks/`) on stable Rust: every file of
//! `fuzz/corpus/<target>/` (a minimized seed set) and `fuzz/regressions/<target>/` (inputs
//! that once failed) goes through the same check as under `cargo fuzz` (see scripts/fuzz).

#[path = "../fuzz/checks/algorithms.rs"]
mod algorithms;
#[path = "../fuzz/checks/config.rs"]
mod config;
#[path = "../fuzz/checks/fields.rs"]
mod fields;
#[path = "../fuzz/checks/forwarded.rs"]
mod forwarded;
#[cfg(feature = "client")]
#[path = "../fuzz/checks/hints.rs"]
mod hints;
#[path = "../fuzz/checks/input.rs"]
mod input;
#[path = "../fuzz/checks/networks.rs"]
mod networks;
#[cfg(feature = "redis")]
#[path = "../fuzz/checks/redis_keys.rs"]
mod redis_keys;

use std::path::{Path, PathBuf};

/// Every input of `target`, corpus and regressions; how many came from the corpus.
fn inputs(target: &str) -> (Vec<(PathBuf, Vec<u8>)>, usize) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut all = Vec::new();
    let mut corpus = 0;
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
        paths.sort();
        for path in paths {
            let bytes = std::fs::read(&path).unwrap();
            if dir == "corpus" {
                corpus += 1;
            }
            all.push((path, bytes));
        }
    }
    (all, corpus)
}

/// Runs `check` on every input of `target`, naming the input that fails.
fn replay(target: &str, check: fn(&[u8])) {
    let (all, corpus) = inputs(target);
    assert!(corpus > 0, "fuzz/corpus/{target}/ holds no seeds");
    for (path, bytes) in all {
        if std::panic::catch_unwind(|| check(&bytes)).is_err() {
            panic!("{} fails its check (see the panic above)", path.display());
        }
    }
}

#[test]
fn forwarded() {
    replay("forwarded", forwarded::check);
}

#[test]
fn networks() {
    replay("networks", networks::check);
}

#[cfg(feature = "client")]
#[test]
fn hints() {
    replay("hints", hints::check);
}

#[test]
fn fields() {
    replay("fields", fields::check);
}

#[cfg(feature = "redis")]
#[test]
fn redis_keys() {
    replay("redis_keys", redis_keys::check);
}

#[test]
fn config() {
    replay("config", config::check);
}

#[test]
fn algorithms() {
    replay("algorithms", algorithms::check);
}
