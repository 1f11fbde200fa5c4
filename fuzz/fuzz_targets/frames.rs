//! Fuzz target `frames`: see `gleam_fuzz_harness::frames`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gleam_fuzz_harness::frames::run(data));
