//! Fuzz target `shim`: see `gleam_fuzz_harness::shim`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gleam_fuzz_harness::shim::run(data));
