//! End to end, no GPU: the cargo examples (unmodified cudarc programs) through `gleam run` against the emu
//! backend. Each checks its own result against a CPU reference and exits non-zero on a mismatch; its
//! stdout must also be exactly what it printed on NVIDIA's driver (`examples/expected/<name>.stdout`).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{Server, output_within, text};

fn example(name: &str) -> PathBuf {
    let dir = common::build_dir().join("examples").join(name);
    assert!(
        dir.is_file(),
        "example {name} is not built at {} (cargo test builds examples)",
        dir.display()
    );
    dir
}

fn run_example(name: &str) {
    run_example_with(name, &[]);
}

/// Runs an example with `env` set and checks its output against the real GPU's.
fn run_example_with(name: &str, env: &[(&str, &str)]) {
    run_example_against(&Server::start("emu"), name, env);
}

/// Runs an example through `server` with `env` set and checks its output against the real GPU's.
fn run_example_against(server: &Server, name: &str, env: &[(&str, &str)]) {
    let mut command = server.run(&example(name), &[]);
    command.envs(env.iter().copied());
    let out = output_within(command, Duration::from_secs(300));
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{name} failed ({:?})\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        text(&out.stderr)
    );
    let expected_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/expected")
        .join(format!("{name}.stdout"));
    let expected = std::fs::read_to_string(&expected_path)
        .unwrap_or_else(|e| panic!("{}: {e}", expected_path.display()));
    assert_eq!(
        stdout, expected,
        "{name}: output differs from the real GPU's"
    );
}

#[test]
fn vector_add() {
    run_example("vector_add");
}

#[test]
fn matmul() {
    run_example("matmul");
}

#[test]
fn streams() {
    run_example("streams");
}

#[test]
fn reduce() {
    run_example("reduce");
}

/// Copies larger than the client's send buffer (and the session's per-lane queue) keep flowing: the
/// benchmark's 256 MiB copies each way, both synchronous and on a stream. (A calling thread's inline
/// flush once left quinn holding a no-op waker, and a copy past 32 MiB stalled for good.)
#[test]
fn copies_larger_than_every_buffer_complete() {
    let server = Server::start("emu");
    let mut command = server.run(&example("bench_driver"), &[]);
    command
        .env("GLEAM_BENCH_COPY_MIB", "256")
        .env("GLEAM_BENCH_LAUNCHES", "100")
        .env("GLEAM_BENCH_SYNCS", "20");
    let out = output_within(command, Duration::from_secs(120));
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "bench_driver failed ({:?})\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        text(&out.stderr)
    );
    assert!(stdout.contains("\"copy_mib\": 256"), "{stdout}");
}

/// The differential test of CUDA's asynchrony: with `CUDA_LAUNCH_BLOCKING=1` every call waits for the peer
/// (no fire-and-forget, no batching), and each example must give the same output as without it (and as on
/// the real GPU).
#[test]
fn every_example_gives_the_same_output_with_cuda_launch_blocking() {
    for name in ["vector_add", "matmul", "streams", "reduce"] {
        run_example_with(name, &[("CUDA_LAUNCH_BLOCKING", "1")]);
    }
}

/// With waiters spinning and both network threads polling through round trips (the default on hosts with
/// four cores or more, off on smaller ones such as CI's), every example gives the real GPU's output. The
/// spin is short here: on two cores, four spinning threads take turns.
#[test]
fn every_example_gives_the_same_output_with_both_ends_polling() {
    let spin = [("GLEAM_SPIN_US", "200")];
    let server = Server::start_in("emu", tempfile::tempdir().expect("temp dir"), &spin);
    for name in ["vector_add", "matmul", "streams", "reduce"] {
        run_example_against(&server, name, &spin);
    }
}
