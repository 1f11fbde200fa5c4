//! Fuzz target `ptx`: see `gleam_fuzz_harness::ptx`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gleam_fuzz_harness::ptx::run(data));
