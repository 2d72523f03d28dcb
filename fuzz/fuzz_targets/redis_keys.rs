#![no_main]

#[path = "../checks/input.rs"]
mod input;
#[path = "../checks/redis_keys.rs"]
mod redis_keys;

libfuzzer_sys::fuzz_target!(|data: &[u8]| redis_keys::check(data));
