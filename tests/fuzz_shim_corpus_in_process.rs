//! The `shim` fuzz target's corpus replayed with the session engine in this process
//! ([`gleam_fuzz_harness::shim::start_in_process`]), the peer the fuzzer itself runs against: every input
//! must behave there as it does against a real server (`tests/fuzz_shim_corpus.rs`), or the fuzzer's
//! verdicts would not carry over. In a test binary of its own: the shim holds one session per process.

use gleam_fuzz_harness::{corpus, shim};

#[test]
fn shim_corpus_replays_cleanly_in_process() {
    shim::start_in_process();
    let n = corpus::replay("shim", shim::run);
    eprintln!("shim (in-process peer): {n} inputs");
}
