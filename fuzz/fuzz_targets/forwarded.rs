#![no_main]

#[path = "../checks/forwarded.rs"]
mod forwarded;
#[path = "../checks/input.rs"]
mod input;

libfuzzer_sys::fuzz_target!(|data: &[u8]| forwarded::check(data));
