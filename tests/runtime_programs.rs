//! End to end, no GPU: CUDA runtime-API programs built by NVIDIA's nvcc (static cudart, kernels as
//! compute_75 PTX) run unmodified through `gleam run` on the emu backend: `tests/cuda/*.cu` (device
//! queries, streams and events, async copies, pinned memory, `__constant__` symbols, atomics, errors coming
//! back as errors, CUDA graphs through stream capture). Each program checks its own results and prints
//! `PASS <name>`; it must also exit cleanly (the runtime tears down through the driver from `exit()`).
//!
//! nvcc comes from PyPI (`scripts/ci/install-cuda-toolchain.sh`, which `.ci/run` runs). Without it these
//! tests say so and pass, unless `GLEAM_REQUIRE_CUDA_TESTS=1` (set by CI), which makes a missing toolchain
//! a failure.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use common::{Server, output_within, text};

const PROGRAMS: &[&str] = &[
    "device_query",
    "streams_events",
    "async_pinned",
    "kernels",
    "symbols",
    "errors",
    "graphs",
    "unified_textures",
    "readback",
];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// nvcc of the PyPI toolchain, if installed.
fn nvcc() -> Option<PathBuf> {
    let dir = std::env::var_os("GLEAM_CUDA_TOOLCHAIN")
        .map_or_else(|| repo().join("target/cuda-toolchain"), PathBuf::from);
    let nvcc = dir.join("nvidia/cu13/bin/nvcc");
    if nvcc.is_file() {
        return Some(nvcc);
    }
    assert!(
        std::env::var_os("GLEAM_REQUIRE_CUDA_TESTS").is_none(),
        "GLEAM_REQUIRE_CUDA_TESTS is set but there is no nvcc at {}: run scripts/ci/install-cuda-toolchain.sh",
        nvcc.display()
    );
    eprintln!(
        "runtime_programs: skipped, no CUDA toolchain at {} (bash scripts/ci/install-cuda-toolchain.sh)",
        nvcc.display()
    );
    None
}

fn modified(path: &Path) -> SystemTime {
    path.metadata()
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Builds `tests/cuda/<name>.cu` with `scripts/ci/nvcc.sh` (static cudart, compute_75 PTX), unless the
/// binary is newer than its sources.
fn build(nvcc: &Path, name: &str) -> PathBuf {
    let out_dir = common::build_dir().join("cuda-tests");
    std::fs::create_dir_all(&out_dir).expect("output dir");
    let source = repo().join("tests/cuda").join(format!("{name}.cu"));
    let exe = out_dir.join(name);
    let newest_source = modified(&source).max(modified(&repo().join("tests/cuda/check.h")));
    if exe.is_file() && modified(&exe) > newest_source {
        return exe;
    }
    let out = Command::new("bash")
        .arg(repo().join("scripts/ci/nvcc.sh"))
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(&source)
        .env("NVCC", nvcc)
        .output()
        .expect("run nvcc");
    assert!(
        out.status.success(),
        "nvcc failed for {}:\n{}",
        source.display(),
        text(&out.stderr)
    );
    exe
}

/// Every program, built once per test process (in parallel: nvcc is slow).
fn programs() -> Option<&'static Vec<(String, PathBuf)>> {
    static BUILT: OnceLock<Option<Vec<(String, PathBuf)>>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let nvcc = nvcc()?;
            let built = std::thread::scope(|s| {
                let handles: Vec<_> = PROGRAMS
                    .iter()
                    .map(|name| {
                        let nvcc = &nvcc;
                        s.spawn(move || ((*name).to_owned(), build(nvcc, name)))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("build thread"))
                    .collect()
            });
            Some(built)
        })
        .as_ref()
}

fn run(server: &Server, name: &str, exe: &Path) -> Result<String, String> {
    let out = output_within(server.run(exe, &[]), Duration::from_secs(180));
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    let passed = out.status.success() && stdout.lines().any(|l| l == format!("PASS {name}"));
    let clean = !stderr.contains("panicked") && !stderr.contains("Thread Local Storage");
    if passed && clean {
        Ok(stdout)
    } else {
        Err(format!(
            "{name}: {:?}\n--- stdout\n{stdout}--- stderr\n{stderr}",
            out.status
        ))
    }
}

#[test]
fn nvcc_programs_pass_through_gleam_on_the_emu_backend() {
    let Some(programs) = programs() else {
        return;
    };
    let server = Server::start("emu");
    let failures: Vec<String> = programs
        .iter()
        .filter_map(|(name, exe)| run(&server, name, exe).err())
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The module image a program's kernels need crosses the network once per serving peer: a second run (a
/// new session, so a new session process) finds it in the peer's content cache and sends nothing.
#[test]
fn module_images_are_sent_once_per_peer() {
    let Some(programs) = programs() else {
        return;
    };
    let (_, exe) = programs
        .iter()
        .find(|(name, _)| name == "symbols")
        .expect("symbols is built");
    let server = Server::start("emu");
    let dir = tempfile::tempdir().expect("temp dir");
    let trace = |n: usize| {
        let report = dir.path().join(format!("trace-{n}.tsv"));
        let out = output_within(server.trace(&report, exe), Duration::from_secs(180));
        assert!(out.status.success(), "{}", text(&out.stderr));
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("unimplemented entry points reached: none"),
            "{stderr}"
        );
        let report = std::fs::read_to_string(&report).expect("the trace report");
        let modules = report
            .lines()
            .find_map(|l| l.strip_prefix("modules\t"))
            .expect("a modules record")
            .split('\t')
            .map(|v| v.parse::<u64>().expect("a count"))
            .collect::<Vec<_>>();
        (modules, report)
    };
    let (first, report) = trace(1);
    assert!(
        first[0] >= 1 && first[1] > 0,
        "the first run sends its image: {first:?}"
    );
    // The launch is fire-and-forget; the runtime's device queries never leave the client.
    assert!(report.contains("call\tcuDeviceGetAttribute\t"), "{report}");
    let (second, _) = trace(2);
    assert_eq!(second[0], 0, "nothing sent the second time: {second:?}");
    assert!(second[2] >= 1, "the peer had it: {second:?}");
}

/// A read-back (`tensor.item()`: an asynchronous copy to the host, then a synchronization of the same
/// stream) costs one round trip: the copy's reply says the stream is idle, and with nothing sent since,
/// the synchronization is answered on the client. With other work in between, it is waited for.
#[test]
fn a_synchronization_right_after_a_read_back_is_answered_locally() {
    let Some(programs) = programs() else {
        return;
    };
    let (_, exe) = programs
        .iter()
        .find(|(name, _)| name == "readback")
        .expect("readback is built");
    let server = Server::start("emu");
    let dir = tempfile::tempdir().expect("temp dir");
    let report = dir.path().join("trace.tsv");
    let out = output_within(server.trace(&report, exe), Duration::from_secs(180));
    let stdout = text(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("PASS readback"),
        "{stdout}{}",
        text(&out.stderr)
    );
    let report = std::fs::read_to_string(&report).expect("the trace report");
    let counts = common::trace_counts(&report, "cuStreamSynchronize")
        .expect("cuStreamSynchronize in the report");
    let (local, waited) = (counts[0], counts[2]);
    // The loops' 70 (50 into pageable memory, 20 into page-locked): here; the three after other work
    // (the stream's own, another stream's) was sent since the copy: waited for.
    assert!(local >= 70, "answered locally: {counts:?}\n{report}");
    assert!(waited >= 3, "waited for: {counts:?}\n{report}");
    // Twenty limit reads and two after sets: at most the first of each limit and the two after a set
    // cross the network.
    if let Some(counts) = common::trace_counts(&report, "cuCtxGetLimit") {
        assert!(
            counts[2] <= 4,
            "cuCtxGetLimit waited for: {counts:?}\n{report}"
        );
    }
}
