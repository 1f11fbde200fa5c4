//! The seeds are sessions that work (their calls succeed, checked while they are built) and run through
//! their targets cleanly.

#[test]
fn frame_seeds_run_clean() {
    for seed in gleam_fuzz_harness::seeds::frames() {
        gleam_fuzz_harness::frames::run(&seed);
    }
}

#[test]
fn ptx_seeds_run_clean() {
    for seed in gleam_fuzz_harness::seeds::ptx() {
        gleam_fuzz_harness::ptx::run(&seed);
    }
}

#[test]
fn fatbin_seeds_run_clean() {
    for seed in gleam_fuzz_harness::seeds::fatbin() {
        gleam_fuzz_harness::fatbin::run(&seed);
    }
}
