//! End to end, no GPU: host functions (`cuLaunchHostFunc`, `cuStreamAddCallback`) as a C program
//! (`tests/remote/driver_callbacks.c`) sees them through `gleam run` against `gleam serve --backend emu`:
//! they run on the client in their stream's order, hold only their own stream, and synchronization waits
//! for them.

mod common;

use std::time::{Duration, Instant};

use common::{Server, compile_c, output_within, text};

const LIMIT: Duration = Duration::from_secs(60);

/// Runs `driver_callbacks <mode>` through Gleam on `server`; returns its stdout once it succeeded.
fn run_on(server: &Server, exe: &std::path::Path, mode: &str) -> String {
    let out = output_within(server.run(exe, &[mode]), LIMIT);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "driver_callbacks {mode}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains(&format!("{mode} ok")), "{stdout}");
    stdout
}

fn program() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_callbacks", dir.path());
    (dir, exe)
}

/// Kernels, copies and functions on one stream run in order, each function seeing the copy before it;
/// the legacy and per-thread streams too; a running function holds its stream's later work (a kernel,
/// an event) until it returns, and `cuStreamSynchronize`/`cuCtxSynchronize` wait for it while the call
/// itself never waits.
#[test]
fn host_functions_run_in_stream_order_and_hold_their_stream() {
    let server = Server::start("emu");
    let (_dir, exe) = program();
    let stdout = run_on(&server, &exe, "order");
    for line in [
        "functions run in stream order and see the stream's copies ok",
        "legacy and per-thread streams ok",
        "bad arguments refused ok",
    ] {
        assert!(stdout.contains(line), "{line}:\n{stdout}");
    }
    let stdout = run_on(&server, &exe, "hold");
    assert!(
        stdout.contains("a running function holds its stream ok"),
        "{stdout}"
    );
    assert!(
        stdout.contains("the stream goes on once it returned ok"),
        "{stdout}"
    );
    let stdout = run_on(&server, &exe, "sync");
    for line in [
        "cuStreamSynchronize waits ok",
        "cuCtxSynchronize waits ok",
        "events after a function ok",
    ] {
        assert!(stdout.contains(line), "{line}:\n{stdout}");
    }
}

/// A function on stream A that waits for a function on stream B finishes: A's function holds neither B's
/// kernels and copies nor B's functions.
#[test]
fn a_function_on_one_stream_does_not_hold_another() {
    let server = Server::start("emu");
    let (_dir, exe) = program();
    let stdout = run_on(&server, &exe, "streams");
    assert!(
        stdout.contains("a function on one stream does not hold another ok"),
        "{stdout}"
    );
}

/// A stream held by a function, with 256 MiB of copies queued behind it (more than the client, the network
/// or the serving side buffers for one stream, wherever they pile up), does not hold another stream: its
/// work runs and the function waiting for it returns.
#[test]
fn a_stream_with_a_full_backlog_does_not_hold_another() {
    let server = Server::start("emu");
    let (_dir, exe) = program();
    let stdout = run_on(&server, &exe, "backlog");
    for line in [
        "MiB queued behind the held stream ok",
        "a full stream does not hold another ok",
    ] {
        assert!(stdout.contains(line), "{line}:\n{stdout}");
    }
}

/// `cuStreamAddCallback` functions get their stream, data and `CUDA_SUCCESS`; after a kernel faults
/// they get the context's error, and `cuLaunchHostFunc` functions are not called, as CUDA documents.
#[test]
fn callbacks_get_the_status_and_host_functions_skip_a_failed_context() {
    let server = Server::start("emu");
    let (_dir, exe) = program();
    let stdout = run_on(&server, &exe, "status");
    assert!(
        stdout.contains("a callback gets CUDA_SUCCESS and its data ok"),
        "{stdout}"
    );
    let stdout = run_on(&server, &exe, "fault");
    assert!(
        stdout.contains("after a fault callbacks get the error and host functions do not run ok"),
        "{stdout}"
    );
}

/// A host function queued in a stream capture is refused (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`: a
/// graph's host node would call back into the client at every launch) and invalidates the capture; a
/// function on a stream outside the capture runs.
#[test]
fn host_functions_in_a_capture_are_refused() {
    let server = Server::start("emu");
    let (_dir, exe) = program();
    let stdout = run_on(&server, &exe, "capture");
    assert!(
        stdout.contains("host functions in a capture are refused ok"),
        "{stdout}"
    );
}

/// A program that exits while its function never returns (its stream held on the peer) exits at once,
/// its session process ends within seconds, and the server serves the next program.
#[test]
fn leaving_with_a_function_that_never_returns_does_not_hang() {
    let server = Server::start("emu");
    let (_dir, exe) = program();
    let started = Instant::now();
    run_on(&server, &exe, "exit");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the program took {:?} to exit",
        started.elapsed()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.session_pids().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the session process is still running: {:?}",
            server.session_pids()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    run_on(&server, &exe, "status");
}

/// On a machine with a GPU: the same program on NVIDIA's driver directly and through Gleam on that GPU
/// (not `capture`, where Gleam refuses what CUDA records, nor `exit`).
#[test]
#[ignore = "needs a GPU: driver_callbacks on NVIDIA's driver and through gleam serve --backend cuda"]
fn the_same_program_passes_on_nvidias_driver_and_through_gleam_on_a_gpu() {
    let server = Server::start("cuda");
    let (_dir, exe) = program();
    for mode in [
        "order", "hold", "streams", "backlog", "sync", "status", "fault",
    ] {
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
        run_on(&server, &exe, mode);
    }
}
