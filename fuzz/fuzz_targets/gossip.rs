//! Fuzz target `gossip`: see `gleam_fuzz_harness::gossip`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gleam_fuzz_harness::gossip::run(data));
