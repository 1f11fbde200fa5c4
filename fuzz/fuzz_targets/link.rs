//! Fuzz target `link`: see `gleam_fuzz_harness::link`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gleam_fuzz_harness::link::run(data));
