#![no_main]

#[path = "../checks/hints.rs"]
mod hints;
#[path = "../checks/input.rs"]
mod input;

libfuzzer_sys::fuzz_target!(|data: &[u8]| hints::check(data));
