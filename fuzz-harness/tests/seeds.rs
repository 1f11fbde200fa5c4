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

#[test]
fn gossip_seeds_run_clean() {
    for seed in gleam_fuzz_harness::seeds::gossip() {
        gleam_fuzz_harness::gossip::run(&seed);
    }
}

#[test]
fn link_seeds_run_clean() {
    for seed in gleam_fuzz_harness::seeds::link() {
        gleam_fuzz_harness::link::run(&seed);
    }
}

#[test]
fn control_seeds_run_clean() {
    for seed in gleam_fuzz_harness::seeds::control() {
        gleam_fuzz_harness::control::run(&seed);
    }
}
