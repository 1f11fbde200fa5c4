//! Shared by the `tests/remote_*.rs` end-to-end tests: a real `gleam serve --backend emu` on loopback, the
//! shim built by cargo, and C test programs compiled at test time against it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// The `gleam` binary under test.
pub fn gleam() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gleam"))
}

/// The shim cargo built for these tests (a dev-dependency lands in `deps/`; a direct build beside `gleam`).
pub fn shim() -> PathBuf {
    let dir = gleam()
        .parent()
        .expect("gleam has a directory")
        .to_path_buf();
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

/// A running `gleam serve 127.0.0.1:0 --backend emu`, killed on drop.
pub struct Server {
    pub child: Child,
    /// `<peer-id>@<addr>`, what `gleam run --peer` takes.
    pub target: String,
    pub config: tempfile::TempDir,
}

impl Server {
    pub fn start() -> Self {
        let config = tempfile::tempdir().expect("temp dir");
        let mut child = Command::new(gleam())
            .args(["serve", "127.0.0.1:0", "--backend", "emu", "--config-dir"])
            .arg(config.path())
            .env_remove("LD_LIBRARY_PATH")
            .env("GLEAM_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start gleam serve");
        let stdout = child.stdout.take().expect("piped");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the listening line");
        // "gleam serve: listening on <addr> as <peer-id>"
        let rest = line
            .trim()
            .strip_prefix("gleam serve: listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
        let (addr, peer) = rest.split_once(" as ").expect("<addr> as <peer-id>");
        Self {
            child,
            target: format!("{peer}@{addr}"),
            config,
        }
    }

    pub fn config_dir(&self) -> &Path {
        self.config.path()
    }

    /// `gleam run --peer <this> --config-dir <this> -- program args`, with the test's shim.
    pub fn run(&self, program: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new(gleam());
        cmd.arg("run")
            .arg("--peer")
            .arg(&self.target)
            .arg("--config-dir")
            .arg(self.config_dir())
            .arg("--")
            .arg(program)
            .args(args)
            .env("GLEAM_SHIM", shim())
            .env("GLEAM_LOG", "warn");
        cmd
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

/// Runs with a time limit: a hang is a test failure, not a stuck CI job.
pub fn output_within(mut cmd: Command, limit: Duration) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.expect("wait"),
        Err(_) => {
            // SAFETY: kill(2) on the child we spawned.
            unsafe { libc_kill(pid as i32, 9) };
            panic!("command did not finish within {limit:?}: {cmd:?}");
        }
    }
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
