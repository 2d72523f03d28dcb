//! In-process store benchmarks: filled in by the benchmark work.

fn main() {}
