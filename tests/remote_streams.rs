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
    let server = Server::start("emu");
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
