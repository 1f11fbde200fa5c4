//! Every input the fuzzers kept (`fuzz/corpus/<target>/`, minimised, checked in) runs again here through
//! the same harness functions, on the stable toolchain: whatever once made a target do something new keeps
//! being run by every `cargo test`, and a fixed crash stays fixed. (`tests/fuzz_shim_corpus.rs` replays the
//! `shim` target, which needs a process of its own.) How to fuzz: `fuzz/README.md`.

use gleam_fuzz_harness::{control, corpus, fatbin, frames, gossip, link, ptx};

#[test]
fn frames_corpus_replays_cleanly() {
    let n = corpus::replay("frames", frames::run);
    eprintln!("frames: {n} inputs");
}

#[test]
fn ptx_corpus_replays_cleanly() {
    let n = corpus::replay("ptx", ptx::run);
    eprintln!("ptx: {n} inputs");
}

#[test]
fn fatbin_corpus_replays_cleanly() {
    let n = corpus::replay("fatbin", fatbin::run);
    eprintln!("fatbin: {n} inputs");
}

#[test]
fn gossip_corpus_replays_cleanly() {
    let n = corpus::replay("gossip", gossip::run);
    eprintln!("gossip: {n} inputs");
}

#[test]
fn link_corpus_replays_cleanly() {
    let n = corpus::replay("link", link::run);
    eprintln!("link: {n} inputs");
}

#[test]
fn control_corpus_replays_cleanly() {
    let n = corpus::replay("control", control::run);
    eprintln!("control: {n} inputs");
}
