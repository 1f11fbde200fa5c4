//! End to end, no GPU: what a program sees when the peer is unreachable or dies.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Server, compile_c, output_within, shim, text};

/// A loopback UDP port with nothing behind it.
fn dead_port() -> u16 {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.local_addr().unwrap().port()
}

#[test]
fn unreachable_peer_is_a_clear_message_from_gleam_run() {
    let server = Server::start("emu");
    let peer = server.peer;
    let target = format!("{peer}@127.0.0.1:{}", dead_port());
    let started = Instant::now();
    let out = output_within(
        {
            let mut cmd = Command::new(common::gleam());
            cmd.args(["run", "--peer", &target, "--config-dir"])
                .arg(server.config_path())
                .args(["--", "/bin/true"]);
            cmd
        },
        Duration::from_secs(30),
    );
    let elapsed = started.elapsed();
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("cannot use GPU peer"), "{stderr}");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
}

#[test]
fn unreachable_peer_fails_cu_init_quickly() {
    // The shim on its own (no `gleam run` pre-check): cuInit must fail within seconds, with a message.
    let server = Server::start("emu");
    let peer = server.peer;
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_basic", dir.path());
    let libs = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(shim(), libs.path().join("libcuda.so.1")).unwrap();
    let mut cmd = Command::new(&exe);
    cmd.arg("init")
        .env("LD_LIBRARY_PATH", libs.path())
        .env("GLEAM_PEER", format!("{peer}@127.0.0.1:{}", dead_port()))
        .env("GLEAM_CONFIG_DIR", server.config_path());
    let started = Instant::now();
    let out = output_within(cmd, Duration::from_secs(30));
    let elapsed = started.elapsed();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("cuInit=CUDA_ERROR_NO_DEVICE"), "{stdout}");
    // Later calls keep failing the same way instead of trying again.
    assert!(
        stdout.contains("cuDeviceGetCount=CUDA_ERROR_NO_DEVICE"),
        "{stdout}"
    );
    assert!(
        text(&out.stderr).contains("cannot use GPU peer"),
        "{}",
        text(&out.stderr)
    );
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");

    // Without GLEAM_PEER at all: also an error and a hint, not a hang.
    let mut cmd = Command::new(&exe);
    cmd.arg("init")
        .env("LD_LIBRARY_PATH", libs.path())
        .env_remove("GLEAM_PEER");
    let out = output_within(cmd, Duration::from_secs(30));
    assert!(text(&out.stdout).contains("cuInit=CUDA_ERROR_NO_DEVICE"));
    assert!(
        text(&out.stderr).contains("gleam run"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn killed_server_gives_a_cuda_error_within_seconds() {
    // A session waits out its grace window for an unreachable peer to come back (15 s by default, counted
    // from the last packet): a short window keeps this test about the error, not the wait.
    let mut server = Server::start_in(
        "emu",
        tempfile::tempdir().unwrap(),
        &[("GLEAM_SESSION_GRACE", "5")],
    );
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_basic", dir.path());
    let mut cmd = server.run(&exe, &["wait"]);
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert!(line.starts_with("driver"), "{line}");
    line.clear();
    stdout.read_line(&mut line).unwrap();
    assert!(line.starts_with("exec affinity"), "{line}");
    line.clear();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");

    // Kill the server (its session process loses its parent and its connection with it).
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let started = Instant::now();
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut rest);
        let _ = tx.send(rest);
    });
    let Ok(rest) = rx.recv_timeout(Duration::from_secs(20)) else {
        let _ = child.kill();
        panic!("the program hung after the server died");
    };
    let elapsed = started.elapsed();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr);
    assert!(status.success(), "{rest}\n{stderr}");
    assert!(
        rest.contains("after: CUDA_ERROR_DEVICE_UNAVAILABLE CUDA_ERROR_DEVICE_UNAVAILABLE"),
        "{rest}\n{stderr}"
    );
    assert!(stderr.contains("session with GPU peer"), "{stderr}");
    assert!(elapsed < Duration::from_secs(15), "took {elapsed:?}");
}
