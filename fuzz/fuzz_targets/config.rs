#![no_main]

#[path = "../checks/config.rs"]
mod config;
#[path = "../checks/input.rs"]
mod input;

libfuzzer_sys::fuzz_target!(|data: &[u8]| config::check(data));
