//! Fuzz target `fatbin`: see `gleam_fuzz_harness::fatbin`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gleam_fuzz_harness::fatbin::run(data));
