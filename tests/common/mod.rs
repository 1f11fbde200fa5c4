//! Shared by the root crate's integration tests (each test file says `mod common;`):
//!
//! - [`Server`]: a real `gleam serve` process on loopback with its own temporary config dir, killed on
//!   drop; [`Server::run`] builds the `gleam run` command that points a program at it.
//! - [`client`]: a minimal client of the session protocol (real QUIC, mesh authentication, framing).
//! - [`netns`]: network-namespace labs for multi-peer mesh tests.
//! - Process helpers: [`gleam`], [`shim`], [`compile_c`], [`output_within`], [`children`], [`text`].

#![allow(dead_code)]

pub mod client;
pub mod netns;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use gleam_auth::identity::{MeshSecret, PeerId};

/// The `gleam` binary under test; `GLEAM_BIN` runs the tests against a copied binary (e.g. on the GPU
/// machine).
pub fn gleam() -> PathBuf {
    std::env::var_os("GLEAM_BIN")
        .map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_gleam")), PathBuf::from)
}

/// Where cargo put the binaries, examples and shim of this test build.
pub fn build_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_gleam"))
        .parent()
        .expect("gleam has a directory")
        .to_path_buf()
}

/// The shim cargo built for these tests (a dev-dependency lands in `deps/`; a direct build beside `gleam`).
pub fn shim() -> PathBuf {
    let dir = build_dir();
    let candidates = [
        dir.join("deps").join("libgleamcuda.so"),
        dir.join("libgleamcuda.so"),
    ];
    candidates
        .iter()
        .filter(|p| p.is_file())
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .cloned()
        .expect("libgleamcuda.so is built by cargo (gleam-shim is a dev-dependency)")
}

/// A running `gleam serve 127.0.0.1:0 --backend <backend>`, killed on drop.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
    pub peer: PeerId,
    pub config_dir: tempfile::TempDir,
}

impl Server {
    /// Starts `gleam serve 127.0.0.1:0 --backend <backend>` with a fresh config dir.
    pub fn start(backend: &str) -> Self {
        let config_dir = tempfile::tempdir().expect("temp dir");
        Self::start_in(backend, config_dir, &[])
    }

    /// Starts a server on `config_dir` with extra environment variables; returns once it listens.
    pub fn start_in(backend: &str, config_dir: tempfile::TempDir, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(gleam());
        // Quiet servers unless the developer asks for logs (`GLEAM_LOG=info cargo test`).
        if std::env::var_os("GLEAM_LOG").is_none() {
            command.env("GLEAM_LOG", "warn");
        }
        if backend == "emu" {
            // cargo's library path holds the shim; an emu server never needs a driver from it.
            command.env_remove("LD_LIBRARY_PATH");
        }
        let mut child = command
            .args(["serve", "127.0.0.1:0", "--backend", backend, "--config-dir"])
            .arg(config_dir.path())
            .envs(env.iter().copied())
            .env_remove("GLEAM_CONFIG_DIR")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start gleam serve");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the listening line");
        let (addr, peer) = parse_listening_line(&line);
        Self {
            child,
            addr,
            peer,
            config_dir,
        }
    }

    /// `<peer-id>@<addr>`, what `gleam run --peer` takes.
    pub fn target(&self) -> String {
        format!("{}@{}", self.peer, self.addr)
    }

    pub fn config_path(&self) -> &Path {
        self.config_dir.path()
    }

    /// The mesh secret the server created in its config dir.
    pub fn secret(&self) -> MeshSecret {
        MeshSecret::load(self.config_path()).expect("server created a mesh secret")
    }

    /// Pids of the session processes this server runs now.
    pub fn session_pids(&self) -> Vec<u32> {
        children(self.child.id())
    }

    /// `gleam run --peer <this> --config-dir <this> -- program args`, with the test's shim.
    pub fn run(&self, program: &Path, args: &[&str]) -> Command {
        self.gleam(&["run"], program, args)
    }

    /// `gleam trace --report <report>` of `program` through this server: [`Server::run`] with the call
    /// counts written to `report` (see [`trace_counts`]).
    #[allow(dead_code)]
    pub fn trace(&self, report: &Path, program: &Path) -> Command {
        self.trace_with(report, program, &[])
    }

    /// `gleam trace --report <report> -- <program> <args>` against this server.
    pub fn trace_with(&self, report: &Path, program: &Path, args: &[&str]) -> Command {
        let report = report.to_str().expect("a UTF-8 report path");
        self.gleam(&["trace", "--report", report], program, args)
    }

    fn gleam(&self, command: &[&str], program: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new(gleam());
        cmd.args(command)
            .arg("--peer")
            .arg(self.target())
            .arg("--config-dir")
            .arg(self.config_path())
            .arg("--")
            .arg(program)
            .args(args)
            .env("GLEAM_SHIM", shim())
            // The application's side logs what `GLEAM_TEST_CLIENT_LOG` asks for (e.g.
            // `gleamcuda::memory=trace`), else warnings only.
            .env(
                "GLEAM_LOG",
                std::env::var("GLEAM_TEST_CLIENT_LOG").unwrap_or_else(|_| "warn".into()),
            );
        cmd
    }
}

/// The counts a `gleam trace` report gives `call` (local, fire-and-forget, waited for, ...), if it was
/// called.
#[allow(dead_code)]
pub fn trace_counts(report: &str, call: &str) -> Option<Vec<u64>> {
    report
        .lines()
        .find_map(|l| l.strip_prefix(&format!("call\t{call}\t")))
        .map(|counts| {
            counts
                .split('\t')
                .map(|v| v.parse().expect("a count in the trace report"))
                .collect()
        })
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `gleam serve: listening on <addr> as <peer-id>`, the one stdout line scripts and tests parse.
fn parse_listening_line(line: &str) -> (SocketAddr, PeerId) {
    let rest = line
        .trim()
        .strip_prefix("gleam serve: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    let (addr, peer) = rest.split_once(" as ").expect("`<addr> as <peer-id>`");
    (
        addr.parse().expect("socket address"),
        peer.parse().expect("peer id"),
    )
}

/// Direct children of `pid` (from /proc).
pub fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        if let Ok(list) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(
                list.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Compiles the C program `tests/remote/<name>.c` against the shim, linked as a program links NVIDIA's
/// driver (`-lcuda`, so it needs `libcuda.so.1` at run time).
pub fn compile_c(name: &str, out_dir: &Path) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/remote")
        .join(format!("{name}.c"));
    let link_dir = out_dir.join("link");
    std::fs::create_dir_all(&link_dir).expect("link dir");
    let link = link_dir.join("libcuda.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(shim(), &link).expect("symlink libcuda.so");
    let exe = out_dir.join(name);
    let status = Command::new("cc")
        .arg("-O1")
        .arg("-o")
        .arg(&exe)
        .arg(&source)
        .arg("-L")
        .arg(&link_dir)
        .arg("-lcuda")
        .status()
        .expect("run cc");
    assert!(status.success(), "cc failed for {}", source.display());
    exe
}

/// Runs a command (stdin closed) with a time limit: a hang is a test failure, not a stuck CI job.
pub fn output_within(mut command: Command, limit: Duration) -> Output {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let id = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(output) => output.expect("wait"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &id.to_string()]).output();
            panic!("command did not finish within {limit:?}: {command:?}");
        }
    }
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
