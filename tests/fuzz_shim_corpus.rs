//! The `shim` fuzz target's corpus (`fuzz/corpus/shim/`), replayed on the stable toolchain against a real
//! `gleam serve --backend emu`: hostile arguments to the shim's C exports must give CUDA errors, never a
//! crash, and leave the session healthy. In a test binary of its own: the shim holds one session per
//! process, opened from environment variables the harness sets.

use std::path::Path;

use gleam_fuzz_harness::{corpus, shim};

#[test]
fn shim_corpus_replays_cleanly() {
    shim::start(Path::new(env!("CARGO_BIN_EXE_gleam")));
    let n = corpus::replay("shim", shim::run);
    eprintln!("shim: {n} inputs");
}
