//! The minimum Rust version the README states, per feature, checked against what the
//! dependencies themselves declare.
//!
//! No older toolchain can be installed here, so this reads the declarations instead of
//! building: for each row of the README's table it asks `cargo metadata` for the crates that
//! those features pull in (normal and build dependencies, on every platform, as locked; cargo may fetch the
//! manifests of other platforms' crates once) and
//! fails when one declares a `rust-version` above the row's. It also fails when a feature of
//! `Cargo.toml` has no row, and when `Cargo.toml`'s `rust-version` is not the default row's.

use std::collections::{HashMap, HashSet};
use std::process::Command;

use serde_json::Value;

/// The README's section, between its heading and the next one.
fn readme_rows() -> Vec<(String, String)> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let section = readme
        .split("\n## Minimum Rust version\n")
        .nth(1)
        .expect("README.md has a section `## Minimum Rust version`");
    let section = section.split("\n## ").next().unwrap_or(section);
    section
        .lines()
        .filter(|line| line.starts_with("| `"))
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            assert_eq!(cells.len(), 2, "a row is `| features | Rust |`: {line}");
            (cells[0].trim_matches('`').to_owned(), cells[1].to_owned())
        })
        .collect()
}

fn version(v: &str) -> Vec<u64> {
    v.split('.')
        .map(|part| part.parse().expect("a version number"))
        .collect()
}

/// The later of two versions, compared as numbers (1.9 < 1.85 as text, not as versions).
fn above(declared: &str, stated: &str) -> bool {
    let (mut d, mut s) = (version(declared), version(stated));
    let len = d.len().max(s.len());
    d.resize(len, 0);
    s.resize(len, 0);
    d > s
}

fn metadata(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked"])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON")
}

/// Every crate a build with these cargo arguments compiles, with its declared `rust-version`.
fn compiled(args: &[&str]) -> Vec<(String, Option<String>)> {
    let meta = metadata(args);
    let packages: HashMap<&str, &Value> = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| (p["id"].as_str().expect("id"), p))
        .collect();
    let nodes: HashMap<&str, &Value> = meta["resolve"]["nodes"]
        .as_array()
        .expect("resolve")
        .iter()
        .map(|n| (n["id"].as_str().expect("id"), n))
        .collect();
    let root = meta["resolve"]["root"].as_str().expect("the root package");
    let mut seen = HashSet::from([root]);
    let mut todo = vec![root];
    while let Some(id) = todo.pop() {
        for dep in nodes[id]["deps"].as_array().expect("deps") {
            // Dev-dependencies build our tests, not a user's crate.
            let used = dep["dep_kinds"]
                .as_array()
                .expect("dep_kinds")
                .iter()
                .any(|k| k["kind"].as_str() != Some("dev"));
            let dep_id = dep["pkg"].as_str().expect("pkg");
            if used && seen.insert(dep_id) {
                todo.push(dep_id);
            }
        }
    }
    seen.remove(root);
    let mut crates: Vec<(String, Option<String>)> = seen
        .into_iter()
        .map(|id| {
            let p = packages[id];
            let name = format!(
                "{} {}",
                p["name"].as_str().unwrap_or("?"),
                p["version"].as_str().unwrap_or("?")
            );
            (name, p["rust_version"].as_str().map(str::to_owned))
        })
        .collect();
    crates.sort();
    crates
}

#[test]
fn every_dependency_builds_on_the_stated_rust_version() {
    let rows = readme_rows();
    let manifest = metadata(&["--no-deps"]);
    let package = &manifest["packages"][0];
    let declared = package["rust_version"]
        .as_str()
        .expect("Cargo.toml declares rust-version");
    let default = rows
        .iter()
        .find(|(features, _)| features == "default")
        .expect("the README's table has a `default` row");
    assert_eq!(
        default.1, declared,
        "Cargo.toml's rust-version is the default build's"
    );

    let features: Vec<&str> = package["features"]
        .as_object()
        .expect("features")
        .keys()
        .map(String::as_str)
        .filter(|f| *f != "default")
        .collect();
    let in_default: Vec<&str> = package["features"]["default"]
        .as_array()
        .expect("default features")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for feature in features.iter().filter(|f| !in_default.contains(f)) {
        assert!(
            rows.iter()
                .any(|(f, _)| f.split(['`', ',', ' ']).any(|part| part == *feature)),
            "feature `{feature}` has no row in the README's minimum Rust version table"
        );
    }

    let mut problems = Vec::new();
    for (row, stated) in &rows {
        let args: Vec<String> = match row.as_str() {
            "default" => Vec::new(),
            "no default features" => vec!["--no-default-features".into()],
            "all" => vec!["--all-features".into()],
            list => vec!["--features".into(), list.replace(['`', ' '], "")],
        };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let crates = compiled(&args);
        assert!(
            crates.len() > 5,
            "{row}: only {} crates found",
            crates.len()
        );
        for (name, rust) in crates {
            if let Some(rust) = rust {
                if above(&rust, stated) {
                    problems.push(format!(
                        "{row} (Rust {stated}): {name} declares rust-version {rust}"
                    ));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "dependencies above the stated minimum:\n{}",
        problems.join("\n")
    );
}

#[test]
fn versions_compare_as_numbers() {
    assert!(above("1.95", "1.85"));
    assert!(above("1.85.1", "1.85"));
    assert!(!above("1.85.0", "1.85"));
    assert!(!above("1.9", "1.85"));
    assert!(above("1.100", "1.95"));
}
