//! End to end, no GPU: contexts, memory pools, virtual memory management, streams and events, as a C
//! program (`tests/remote/driver_api.c`) sees them through `gleam run` against `gleam serve --backend emu`.
//! The same program runs on NVIDIA's driver and through Gleam on a real GPU (the `needs a GPU` tests, and
//! `tests/remote/gpu/driver-api.sh`), so the semantics it expects are the real driver's.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{Server, compile_c, output_within, text};

const LIMIT: Duration = Duration::from_secs(120);

/// Runs `driver_api <args>` through Gleam against `server`; returns its stdout once it succeeded.
fn run(server: &Server, args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_api", dir.path());
    let out = output_within(server.run(&exe, args), LIMIT);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "driver_api {args:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stdout
}

#[test]
fn contexts_are_created_stacked_destroyed_and_reset() {
    let stdout = run(&Server::start("emu"), &["contexts"]);
    assert!(stdout.contains("cuCtxCreate_v3/_v4 ok"), "{stdout}");
    assert!(stdout.contains("contexts ok"), "{stdout}");
}

#[test]
fn memory_pools_allocate_in_stream_order_and_keep_their_statistics() {
    let stdout = run(&Server::start("emu"), &["pools"]);
    assert!(stdout.contains("pools ok"), "{stdout}");
}

#[test]
fn virtual_memory_maps_physical_allocations_at_reserved_addresses() {
    let stdout = run(&Server::start("emu"), &["vmm"]);
    assert!(stdout.contains("granularity 2097152"), "{stdout}");
    assert!(stdout.contains("vmm ok"), "{stdout}");
}

#[test]
fn events_order_streams_and_time_them() {
    let stdout = run(&Server::start("emu"), &["streams"]);
    assert!(stdout.contains("streams ok"), "{stdout}");
}

/// A kernel that never ends is stopped by the emu's watchdog: the session gets the sticky
/// `CUDA_ERROR_LAUNCH_TIMEOUT`, and the program ends instead of hanging.
/// The stream priority range is read from the peer once per context (a property of its device), however
/// often the program asks, whichever out-pointers it passes.
#[test]
fn the_stream_priority_range_crosses_the_network_once_per_context() {
    let server = Server::start("emu");
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_api", dir.path());
    let report = dir.path().join("trace.tsv");
    let out = output_within(server.trace_with(&report, &exe, &["contexts"]), LIMIT);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("contexts ok"),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    let report = std::fs::read_to_string(&report).unwrap();
    let counts = common::trace_counts(&report, "cuCtxGetStreamPriorityRange")
        .unwrap_or_else(|| panic!("no cuCtxGetStreamPriorityRange in\n{report}"));
    // Three reads (both values, the greatest alone, the least alone) in one context.
    assert_eq!(counts.iter().sum::<u64>(), 3, "{counts:?}\n{report}");
    assert_eq!(counts[2], 1, "waited for: {counts:?}\n{report}");
}

#[test]
fn a_kernel_that_never_ends_times_out() {
    let server = Server::start_in(
        "emu",
        tempfile::tempdir().unwrap(),
        &[("GLEAM_EMU_KERNEL_TIMEOUT", "0.5")],
    );
    let started = Instant::now();
    let stdout = run(&server, &["watchdog"]);
    assert!(stdout.contains("watchdog ok"), "{stdout}");
    assert!(started.elapsed() < Duration::from_secs(60));
}

/// A thousand streams with work on each (each was a thread before) run on a bounded pool of threads, not a thread per stream.
#[test]
fn a_thousand_streams_share_a_bounded_pool_of_threads() {
    let server = Server::start_in(
        "emu",
        tempfile::tempdir().unwrap(),
        &[("GLEAM_EMU_STREAM_WORKERS", "4")],
    );
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_api", dir.path());
    let mut child = server
        .run(&exe, &["many-streams", "1000"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The session process's threads, sampled while the program runs.
    let deadline = Instant::now() + LIMIT;
    let mut most = 0;
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        for pid in server.session_pids() {
            let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, Iterator::count);
            most = most.max(threads);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("many-streams ok"),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    // 4 stream workers, the threads a kernel launch would add (none here), and the process's own few.
    assert!(
        most > 0 && most < 32,
        "{most} threads in the session process"
    );
}

/// On a machine with a GPU: the same program on NVIDIA's driver directly (what CUDA itself says) and
/// through Gleam on that GPU (`gleam serve --backend cuda`). On the GPU machine without Rust,
/// `scripts/gpu/driver-api.sh` does the same from a carried build.
#[test]
#[ignore = "needs a GPU: driver_api on NVIDIA's driver and through gleam serve --backend cuda"]
fn the_same_program_passes_on_nvidias_driver_and_through_gleam_on_a_gpu() {
    let server = Server::start("cuda");
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_api", dir.path());
    for mode in ["contexts", "pools", "vmm", "streams"] {
        // Linked as a program links NVIDIA's driver: run directly, it loads the system's libcuda.so.1.
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
        let stdout = run(&server, &[mode]);
        assert!(stdout.contains(&format!("{mode} ok")), "{stdout}");
    }
}
