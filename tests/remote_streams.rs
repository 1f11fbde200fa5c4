//! End to end, no GPU: stream capture, stream attributes, stream memory operations and the CUDA 3.x
//! names of a few calls, as a C program (`tests/remote/driver_streams.c`) sees them through `gleam run`
//! against `gleam serve --backend emu`. The same program runs on NVIDIA's driver and through Gleam on a
//! real GPU (`scripts/gpu/driver-api.sh`), so the semantics it expects are the real driver's.

mod common;

use std::time::Duration;

use common::{Server, compile_c, output_within, text};

const LIMIT: Duration = Duration::from_secs(120);

/// Runs `driver_streams <mode>` through Gleam against a fresh emu server; returns its stdout once it
/// succeeded.
fn run(mode: &str) -> String {
    run_on(&Server::start("emu"), mode)
}

fn run_on(server: &Server, mode: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_streams", dir.path());
    let out = output_within(server.run(&exe, &[mode]), LIMIT);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "driver_streams {mode}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains(&format!("{mode} ok")), "{stdout}");
    stdout
}

/// Fork/join captures replay as graphs; an event recorded in a capture cannot be queried or waited for
/// on the host (`CUDA_ERROR_CAPTURED_EVENT`, the capture invalidated), and `cuStreamIsCapturing` says so.
#[test]
fn captures_fork_join_replay_and_refuse_questions_about_captured_events() {
    let stdout = run("capture");
    assert!(
        stdout.contains("fork/join capture and replay ok"),
        "{stdout}"
    );
    assert!(stdout.contains("captured events ok"), "{stdout}");
}

/// Stream attributes are kept per stream, checked as the driver checks them, copied by
/// `cuStreamCopyAttributes`; the priority attribute is the stream's scheduling priority.
#[test]
fn stream_attributes_are_kept_checked_and_copied() {
    let stdout = run("attributes");
    assert!(stdout.contains("access policy window ok"), "{stdout}");
}

/// Streams wait on values in device memory (every comparison, 32 and 64 bits) without blocking other
/// streams, released by another stream's write or by a host copy; batches run in order; a captured
/// write replays with its graph.
#[test]
fn streams_wait_on_and_write_values_in_device_memory() {
    let stdout = run("memops");
    for line in [
        "wait EQ released by a stream write ok",
        "wait GEQ (cyclic) released by a host copy ok",
        "wait AND ok",
        "wait NOR ok",
        "64-bit wait and write ok",
        "batch ok",
        "captured write ok",
    ] {
        assert!(stdout.contains(line), "{line}:\n{stdout}");
    }
}

/// The CUDA 3.x names (`cuStreamDestroy`, `cuEventDestroy`, `cuCtxDestroy`) are the same calls as
/// their successors; the pre-3.2 `cuCtxCreate` and the v1 stream memory operations are refused as
/// NVIDIA's 580 driver refuses them.
#[test]
fn old_names_are_their_successors() {
    run("old-names");
}

/// On a machine with a GPU: the same program on NVIDIA's driver directly (what CUDA itself says) and
/// through Gleam on that GPU. On the GPU machine without Rust, `scripts/gpu/driver-api.sh` does the same
/// from a carried build.
#[test]
#[ignore = "needs a GPU: driver_streams on NVIDIA's driver and through gleam serve --backend cuda"]
fn the_same_program_passes_on_nvidias_driver_and_through_gleam_on_a_gpu() {
    let server = Server::start("cuda");
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_streams", dir.path());
    for mode in ["capture", "attributes", "memops", "old-names"] {
        // Run directly, the program loads the system's libcuda.so.1.
        let native = output_within(
            {
                let mut cmd = std::process::Command::new(&exe);
                cmd.arg(mode).env_remove("LD_LIBRARY_PATH");
                cmd
            },
            LIMIT,
        );
        assert!(
            native.status.success(),
            "{mode} on NVIDIA's driver:\n{}{}",
            text(&native.stdout),
            text(&native.stderr)
        );
        run_on(&server, mode);
    }
}
