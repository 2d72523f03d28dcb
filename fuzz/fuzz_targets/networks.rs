#![no_main]

#[allow(dead_code)]
#[path = "../checks/forwarded.rs"]
mod forwarded;
#[path = "../checks/input.rs"]
mod input;
#[path = "../checks/networks.rs"]
mod networks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| networks::check(data));
