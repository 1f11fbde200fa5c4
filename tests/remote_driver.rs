//! End to end, no GPU: a C driver-API program compiled at test time runs through `gleam run` against a
//! real `gleam serve --backend emu` over QUIC on loopback.

mod common;

use std::time::Duration;

use common::{Server, compile_c, output_within, text};

const LIMIT: Duration = Duration::from_secs(120);

/// Runs `driver_basic [mode]` through `gleam run` against a fresh emu server, with extra environment
/// variables; asserts that it succeeded and returns its stdout and stderr.
fn driver_basic(mode: &[&str], env: &[(&str, &str)]) -> (String, String) {
    let server = Server::start("emu");
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_basic", dir.path());
    let mut cmd = server.run(&exe, mode);
    cmd.envs(env.iter().copied());
    let out = output_within(cmd, LIMIT);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    (stdout, stderr)
}

#[test]
fn c_program_copies_and_checks_errors() {
    let (stdout, stderr) = driver_basic(&[], &[]);
    assert!(
        stdout.contains("copied 12582912 bytes there and back"),
        "{stdout}"
    );
    assert!(
        stdout.contains("bad module handle: CUDA_ERROR_INVALID_HANDLE"),
        "{stdout}"
    );
    assert!(stdout.contains("all ok"), "{stdout}");
    // cuDeviceGetExecAffinitySupport: forwarded by its one line in driver-api.list, answered by the emu.
    assert!(
        stdout.contains("exec affinity (SM count) supported: 0"),
        "{stdout}"
    );
    // The stub logged its name.
    assert!(stderr.contains("cuTexRefCreate"), "{stderr}");
}

#[test]
fn c_program_launches_a_ptx_kernel() {
    let (stdout, _) = driver_basic(&["kernel"], &[]);
    assert!(stdout.contains("kernel ok"), "{stdout}");
}

#[test]
fn blocking_mode_gives_the_same_results() {
    let (stdout, _) = driver_basic(&["kernel"], &[("CUDA_LAUNCH_BLOCKING", "1")]);
    assert!(
        stdout.contains("kernel ok") && stdout.contains("all ok"),
        "{stdout}"
    );
}

#[test]
fn a_forked_child_is_refused_and_the_parent_keeps_its_session() {
    let (stdout, _) = driver_basic(&["fork"], &[]);
    assert!(
        stdout.contains("child: CUDA_ERROR_NOT_INITIALIZED CUDA_ERROR_NOT_INITIALIZED"),
        "{stdout}"
    );
    assert!(stdout.contains("fork ok"), "{stdout}");
}

#[test]
fn exit_codes_and_signals_pass_through() {
    let server = Server::start("emu");
    let sh = std::path::Path::new("/bin/sh");
    let out = output_within(server.run(sh, &["-c", "echo through; exit 7"]), LIMIT);
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(text(&out.stdout), "through\n");
    let out = output_within(server.run(sh, &["-c", "kill -9 $$"]), LIMIT);
    assert_eq!(out.status.code(), Some(128 + 9));
    // The shim is in place under every name CUDA programs look for.
    let out = output_within(
        server.run(
            sh,
            &[
                "-c",
                "for n in libcuda.so.1 libcuda.so libcuda.so.13; do \
            for d in $(echo $LD_LIBRARY_PATH | tr : ' '); do test -e $d/$n && echo $n; done; done; \
            echo $GLEAM_PEER",
            ],
        ),
        LIMIT,
    );
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("libcuda.so.1\nlibcuda.so\nlibcuda.so.13\n"),
        "{stdout}"
    );
    assert!(stdout.trim_end().ends_with(&server.target()), "{stdout}");
}
