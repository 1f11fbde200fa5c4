//! Soak: many clients against one `gleam serve --backend emu` for a while, running the examples, some
//! killed (SIGKILL) and some cut off from the network mid-run. Afterwards the server must be back where it
//! started: no session process left, its open file descriptors and memory back to their values after the
//! warm-up (within [`RSS_SLACK`]), and every client that was neither killed nor cut must have printed
//! exactly what the example printed on NVIDIA's driver (`examples/expected/`).
//!
//! `soak_short` runs in CI (4 clients, 20 s). The full soak is `soak_full`, ignored by default:
//!
//! ```sh
//! nice -n 19 cargo test --release --test soak soak_full -- --ignored --nocapture
//! GLEAM_SOAK_CLIENTS=16 GLEAM_SOAK_SECS=600 GLEAM_SOAK_SEED=7 ...   # the defaults of soak_full
//! ```
//!
//! A client is one example process with Gleam's `libcuda.so.1` in front of it (as `gleam run` sets it up),
//! so SIGKILL hits the program itself. A client to be cut talks to the server through a UDP relay of its
//! own ([`Relay`]); cutting drops every datagram both ways, which looks to both ends like a network gone
//! dead: the client's session ends with an error after QUIC's idle timeout, and the server kills the
//! session process. Each client's fate is drawn from a seeded generator (the seed is printed, and
//! `GLEAM_SOAK_SEED` replays it).

mod common;

use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Server, text};

/// The examples the clients run, each with its recorded output.
const EXAMPLES: [&str; 4] = ["vector_add", "matmul", "streams", "reduce"];
/// Growth of the server's resident memory tolerated after the soak, over its value after the warm-up:
/// allocators keep some freed memory; a leak per session grows without bound.
const RSS_SLACK: u64 = 16 << 20;
/// Longest a client may take, killed or not, before the soak calls it hung.
const CLIENT_LIMIT: Duration = Duration::from_secs(120);
/// Longest the server may take to end every session after the last client is gone.
const DRAIN_LIMIT: Duration = Duration::from_secs(60);

#[test]
fn soak_short() {
    soak(&Plan::from_env(4, Duration::from_secs(20)));
}

#[test]
#[ignore = "the full soak (16 clients, 10 minutes): run it by hand, see the file's documentation"]
fn soak_full() {
    soak(&Plan::from_env(16, Duration::from_secs(600)));
}

/// How big a soak, and its random seed.
#[derive(Debug)]
struct Plan {
    clients: usize,
    duration: Duration,
    seed: u64,
}

impl Plan {
    fn from_env(clients: usize, duration: Duration) -> Self {
        let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        let seed = var("GLEAM_SOAK_SEED").unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
        Self {
            clients: var("GLEAM_SOAK_CLIENTS").map_or(clients, |n| n as usize),
            duration: var("GLEAM_SOAK_SECS").map_or(duration, Duration::from_secs),
            seed,
        }
    }
}

/// What happened to one client run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Ran to the end: its output is checked.
    Completed,
    /// SIGKILLed mid-run.
    Killed,
    /// Its network was cut mid-run; it ended with an error.
    Cut,
}

#[derive(Debug, Default)]
struct Tally {
    completed: u64,
    killed: u64,
    cut: u64,
    /// Seconds from the cut to the client's exit, per cut client.
    cut_to_exit: Vec<f64>,
    failures: Vec<String>,
}

fn soak(plan: &Plan) {
    eprintln!("soak: {plan:?}");
    let examples: Vec<(&str, PathBuf, String)> = EXAMPLES
        .iter()
        .map(|&name| (name, example(name), expected(name)))
        .collect();
    let server = Server::start_in(
        "emu",
        tempfile::tempdir().expect("temp dir"),
        &[("GLEAM_EMU_MEMORY", "1GiB")],
    );
    let shim_dir = shim_dir();
    let pid = server.child.id();

    // Warm-up: every example once, so that what the server allocates once (runtime, caches) is there.
    for (name, path, want) in &examples {
        let out = client(&server, &shim_dir, path, server.addr)
            .output()
            .expect("run example");
        assert!(
            out.status.success() && text(&out.stdout) == *want,
            "warm-up run of {name} failed ({:?}): {}\n{}",
            out.status,
            text(&out.stdout),
            text(&out.stderr)
        );
    }
    wait_for_no_sessions(&server);
    let before = Sample::of(pid);
    eprintln!("soak: after warm-up: {before:?}");

    let tally = Mutex::new(Tally::default());
    let started = Instant::now();
    let deadline = started + plan.duration;
    std::thread::scope(|s| {
        for worker in 0..plan.clients {
            let (server, shim_dir, examples, tally) = (&server, &shim_dir, &examples, &tally);
            let mut rng = Rng(plan.seed ^ (worker as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            s.spawn(move || {
                while Instant::now() < deadline {
                    let (name, path, want) = &examples[rng.below(examples.len() as u64) as usize];
                    let roll = rng.below(10);
                    // A run takes about half a second: most kills and cuts land mid-run.
                    let after = Duration::from_millis(rng.below(600));
                    let outcome = match roll {
                        0..=5 => run_to_end(server, shim_dir, path, want),
                        6 | 7 => run_and_kill(server, shim_dir, path, want, after),
                        _ => run_and_cut(server, shim_dir, path, want, after),
                    };
                    let mut t = tally.lock().unwrap();
                    match outcome {
                        Ok((Fate::Completed, _)) => t.completed += 1,
                        Ok((Fate::Killed, _)) => t.killed += 1,
                        Ok((Fate::Cut, secs)) => {
                            t.cut += 1;
                            t.cut_to_exit.push(secs);
                        }
                        Err(why) => t.failures.push(format!("{name}: {why}")),
                    }
                }
            });
        }
    });
    let soaked = started.elapsed();
    let drained = wait_for_no_sessions(&server);
    // Killed sessions' last frees may still be on their way out of the allocator: let it settle. The
    // peer also remembers each ended session for `ENDED_MEMORY` (to tell a client that comes back to
    // resume it that it is gone): memory above the slack must be back once those have expired.
    std::thread::sleep(Duration::from_secs(1));
    let mut after = Sample::of(pid);
    let remembered = Instant::now() + gleam_host::ENDED_MEMORY + Duration::from_secs(5);
    while after.rss > before.rss + RSS_SLACK && Instant::now() < remembered {
        std::thread::sleep(Duration::from_secs(1));
        after = Sample::of(pid);
    }
    let t = tally.into_inner().unwrap();
    let cut_max = t.cut_to_exit.iter().copied().fold(0f64, f64::max);
    let cut_mean = t.cut_to_exit.iter().sum::<f64>() / t.cut_to_exit.len().max(1) as f64;
    eprintln!(
        "soak: {} clients for {:.0} s: {} completed, {} killed, {} cut (exit {:.1} s after the cut on \
         average, {:.1} s at most); sessions drained {:.1} s after the last client; server before {before:?}, \
         after {after:?}; {} failures",
        plan.clients,
        soaked.as_secs_f64(),
        t.completed,
        t.killed,
        t.cut,
        cut_mean,
        cut_max,
        drained.as_secs_f64(),
        t.failures.len()
    );
    assert!(
        t.failures.is_empty(),
        "failures:\n{}",
        t.failures.join("\n")
    );
    assert!(t.completed > 0, "no client completed");
    assert!(
        server.session_pids().is_empty(),
        "session processes left: {:?}",
        server.session_pids()
    );
    assert_eq!(
        after.fds, before.fds,
        "the server's open file descriptors changed: {before:?} -> {after:?}"
    );
    assert!(
        after.rss <= before.rss + RSS_SLACK,
        "the server's memory grew: {before:?} -> {after:?}"
    );
}

/// The server process's resident memory and open file descriptors.
#[derive(Debug, Clone, Copy)]
struct Sample {
    rss: u64,
    fds: usize,
}

impl Sample {
    fn of(pid: u32) -> Self {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("server status");
        let rss_kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS");
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .expect("server fds")
            .count();
        Self {
            rss: rss_kib * 1024,
            fds,
        }
    }
}

/// Waits until the server runs no session process; how long that took.
fn wait_for_no_sessions(server: &Server) -> Duration {
    let start = Instant::now();
    while !server.session_pids().is_empty() {
        assert!(
            start.elapsed() < DRAIN_LIMIT,
            "session processes still running {DRAIN_LIMIT:?} after their clients ended: {:?}",
            server.session_pids()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

fn example(name: &str) -> PathBuf {
    let path = common::build_dir().join("examples").join(name);
    assert!(
        path.is_file(),
        "example {name} is not built (cargo test builds examples)"
    );
    path
}

fn expected(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/expected")
        .join(format!("{name}.stdout"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A directory holding the shim under the names programs load NVIDIA's driver by.
fn shim_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for name in ["libcuda.so.1", "libcuda.so", "libcuda.so.13"] {
        std::os::unix::fs::symlink(common::shim(), dir.path().join(name)).expect("symlink");
    }
    dir
}

/// The example at `path` as a client of the server reached at `addr`.
fn client(server: &Server, shim_dir: &tempfile::TempDir, path: &Path, addr: SocketAddr) -> Command {
    let mut cmd = Command::new(path);
    cmd.env("LD_LIBRARY_PATH", shim_dir.path())
        .env("GLEAM_PEER", format!("{}@{addr}", server.peer))
        .env("GLEAM_CONFIG_DIR", server.config_path())
        .env("GLEAM_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Waits for `child` until `limit`; `None` if it is still running then.
fn wait_until(child: &mut Child, limit: Instant) -> Option<std::process::ExitStatus> {
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Collects a finished client's output and checks it completed correctly.
fn check_completed(
    child: Child,
    status: std::process::ExitStatus,
    want: &str,
) -> Result<(Fate, f64), String> {
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let stdout = text(&out.stdout);
    if !status.success() || stdout != want {
        return Err(format!(
            "a client that was neither killed nor cut failed ({status:?})\nstdout:\n{stdout}\nstderr:\n{}",
            text(&out.stderr)
        ));
    }
    Ok((Fate::Completed, 0.0))
}

fn hung(mut child: Child, what: &str) -> String {
    let _ = child.kill();
    let out = child.wait_with_output().ok();
    format!(
        "{what}: still running after {CLIENT_LIMIT:?}; stderr:\n{}",
        out.map(|o| text(&o.stderr)).unwrap_or_default()
    )
}

fn run_to_end(
    server: &Server,
    dir: &tempfile::TempDir,
    path: &Path,
    want: &str,
) -> Result<(Fate, f64), String> {
    let mut child = client(server, dir, path, server.addr)
        .spawn()
        .map_err(|e| e.to_string())?;
    match wait_until(&mut child, Instant::now() + CLIENT_LIMIT) {
        Some(status) => check_completed(child, status, want),
        None => Err(hung(child, "a client")),
    }
}

fn run_and_kill(
    server: &Server,
    dir: &tempfile::TempDir,
    path: &Path,
    want: &str,
    after: Duration,
) -> Result<(Fate, f64), String> {
    let mut child = client(server, dir, path, server.addr)
        .spawn()
        .map_err(|e| e.to_string())?;
    if let Some(status) = wait_until(&mut child, Instant::now() + after) {
        // It finished first: a normal run.
        return check_completed(child, status, want);
    }
    child.kill().map_err(|e| e.to_string())?;
    let _ = child.wait();
    Ok((Fate::Killed, 0.0))
}

fn run_and_cut(
    server: &Server,
    dir: &tempfile::TempDir,
    path: &Path,
    want: &str,
    after: Duration,
) -> Result<(Fate, f64), String> {
    let relay = Relay::start(server.addr).map_err(|e| e.to_string())?;
    let mut child = client(server, dir, path, relay.addr)
        .spawn()
        .map_err(|e| e.to_string())?;
    if let Some(status) = wait_until(&mut child, Instant::now() + after) {
        return check_completed(child, status, want);
    }
    relay.cut();
    let cut_at = Instant::now();
    match wait_until(&mut child, cut_at + CLIENT_LIMIT) {
        // Cut just as it finished: a normal run.
        Some(status) if status.success() => check_completed(child, status, want),
        Some(_) => Ok((Fate::Cut, cut_at.elapsed().as_secs_f64())),
        None => Err(hung(child, "a client whose network was cut")),
    }
}

/// A UDP relay between one client and the server that can be cut (both directions then drop every
/// datagram). Blocking sockets and two threads: no spinning, so sixteen of them cost nothing.
struct Relay {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Relay {
    fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let front = UdpSocket::bind("127.0.0.1:0")?;
        let back = UdpSocket::bind("127.0.0.1:0")?;
        back.connect(upstream)?;
        for s in [&front, &back] {
            s.set_read_timeout(Some(Duration::from_millis(50)))?;
        }
        let addr = front.local_addr()?;
        let cut = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let client: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
        let (front2, back2) = (front.try_clone()?, back.try_clone()?);
        let up = {
            let (cut, stop, client) = (cut.clone(), stop.clone(), client.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((n, from)) = front.recv_from(&mut buf) {
                        *client.lock().unwrap() = Some(from);
                        if !cut.load(Ordering::Relaxed) {
                            let _ = back.send(&buf[..n]);
                        }
                    }
                }
            })
        };
        let down = {
            let (cut, stop) = (cut.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(n) = back2.recv(&mut buf) {
                        let to = *client.lock().unwrap();
                        if let (Some(to), false) = (to, cut.load(Ordering::Relaxed)) {
                            let _ = front2.send_to(&buf[..n], to);
                        }
                    }
                }
            })
        };
        Ok(Self {
            addr,
            cut,
            stop,
            threads: vec![up, down],
        })
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// xorshift64*: reproducible fates from the printed seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        let mut x = self.0.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }
}
