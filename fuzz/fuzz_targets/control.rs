//! Fuzz target `control`: see `gleam_fuzz_harness::control`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gleam_fuzz_harness::control::run(data));
