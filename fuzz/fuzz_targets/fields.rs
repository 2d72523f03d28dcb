#![no_main]

#[path = "../checks/fields.rs"]
mod fields;
#[path = "../checks/input.rs"]
mod input;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fields::check(data));
