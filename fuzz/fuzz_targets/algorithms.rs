#![no_main]

#[path = "../checks/algorithms.rs"]
mod algorithms;
#[path = "../checks/input.rs"]
mod input;

libfuzzer_sys::fuzz_target!(|data: &[u8]| algorithms::check(data));
