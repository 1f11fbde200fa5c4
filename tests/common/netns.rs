//! Network-namespace labs for multi-peer tests: peers in their own namespaces, joined by a
//! bridge in a separate "hub" namespace, so nothing touches the host's network.
//!
//! Everything is named uniquely per test run and torn down on drop (even when the test panics);
//! child processes are killed on drop. Tests call [`Lab::new`], which returns `None` (after
//! printing why) when the machine cannot run them: not root, or no `ip`.

#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Namespace tests share two cores with everything else: run them one at a time so their timing
/// assertions measure Gleam, not contention between tests.
static SERIAL: Mutex<()> = Mutex::new(());
static NEXT_LAB: AtomicU32 = AtomicU32::new(0);

/// A hub namespace with a bridge, plus one namespace per node.
pub struct Lab {
    pub prefix: String,
    hub: String,
    nodes: Vec<Node>,
    pub dir: tempfile::TempDir,
    _serial: MutexGuard<'static, ()>,
}

/// One namespace attached to the lab's bridge.
pub struct Node {
    pub ns: String,
    /// The node's IPv4 address on the lab network.
    pub ip: String,
    /// The node's interface inside its namespace.
    pub ifname: String,
    /// The bridge-side interface (in the hub namespace) of this node's link.
    pub hub_if: String,
}

impl Lab {
    /// Creates the hub; `None` (with the reason printed) when namespace tests cannot run here.
    pub fn new() -> Option<Self> {
        // SAFETY-free check of the effective uid through /proc (no libc needed in tests).
        let uid = fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|status| {
                status
                    .lines()
                    .find(|line| line.starts_with("Uid:"))
                    .and_then(|line| line.split_whitespace().nth(2).map(str::to_owned))
            });
        if uid.as_deref() != Some("0") {
            eprintln!("SKIPPED: network-namespace tests need root (effective uid {uid:?})");
            return None;
        }
        if Command::new("ip").arg("-V").output().is_err() {
            eprintln!("SKIPPED: network-namespace tests need `ip` (iproute2)");
            return None;
        }
        let serial = SERIAL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = NEXT_LAB.fetch_add(1, Ordering::Relaxed);
        let prefix = format!("gl{}x{n}", std::process::id());
        let hub = format!("{prefix}hub");
        let lab = Self {
            prefix,
            hub: hub.clone(),
            nodes: Vec::new(),
            dir: tempfile::tempdir().expect("tempdir"),
            _serial: serial,
        };
        ip(&["netns", "add", &hub]);
        ip(&["-n", &hub, "link", "set", "lo", "up"]);
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"]);
        // No STP delay: ports forward at once.
        ip(&[
            "-n",
            &hub,
            "link",
            "set",
            "br0",
            "type",
            "bridge",
            "forward_delay",
            "0",
            "stp_state",
            "0",
        ]);
        ip(&["-n", &hub, "link", "set", "br0", "up"]);
        Some(lab)
    }

    /// Adds a namespace with address 10.77.0.(index+1)/24 (and an IPv6 link-local one) on the
    /// bridge.
    pub fn add_node(&mut self) -> usize {
        self.add_node_with(true)
    }

    /// Adds a namespace with only an IPv6 link-local address on the bridge.
    pub fn add_node_v6_only(&mut self) -> usize {
        self.add_node_with(false)
    }

    fn add_node_with(&mut self, ipv4: bool) -> usize {
        let index = self.nodes.len();
        let ns = format!("{}n{index}", self.prefix);
        let hub_if = format!("v{index}");
        let ip_addr = format!("10.77.0.{}", index + 1);
        ip(&["netns", "add", &ns]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        ip(&[
            "-n", &self.hub, "link", "add", &hub_if, "type", "veth", "peer", "name", "eth0",
            "netns", &ns,
        ]);
        ip(&["-n", &self.hub, "link", "set", &hub_if, "master", "br0"]);
        ip(&["-n", &self.hub, "link", "set", &hub_if, "up"]);
        if ipv4 {
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{ip_addr}/24"),
                "dev",
                "eth0",
            ]);
        }
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        self.nodes.push(Node {
            ns,
            ip: ip_addr,
            ifname: "eth0".into(),
            hub_if,
        });
        index
    }

    pub fn node(&self, index: usize) -> &Node {
        &self.nodes[index]
    }

    /// Shapes both directions of a node's link with a token bucket (`tc tbf`).
    pub fn shape(&self, index: usize, rate: &str) {
        let node = &self.nodes[index];
        for (ns, dev) in [(&self.hub, &node.hub_if), (&node.ns, &node.ifname)] {
            run_ok(Command::new("ip").args([
                "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                "burst", "32kbit", "latency", "50ms",
            ]));
        }
    }

    /// Removes the shaping of [`Lab::shape`].
    pub fn unshape(&self, index: usize) {
        let node = &self.nodes[index];
        for (ns, dev) in [(&self.hub, &node.hub_if), (&node.ns, &node.ifname)] {
            run_ok(Command::new("ip").args([
                "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root",
            ]));
        }
    }

    /// Cuts a node off the bridge (its bridge port goes down; the node keeps its addresses, as when
    /// a cable is pulled or Wi-Fi drops).
    pub fn partition(&self, index: usize) {
        ip(&[
            "-n",
            &self.hub,
            "link",
            "set",
            &self.nodes[index].hub_if,
            "down",
        ]);
    }

    /// Undoes [`Lab::partition`].
    pub fn heal(&self, index: usize) {
        ip(&[
            "-n",
            &self.hub,
            "link",
            "set",
            &self.nodes[index].hub_if,
            "up",
        ]);
    }

    /// Bytes that crossed a node's link so far: (from the node, to the node), counted on the bridge
    /// side.
    pub fn link_counters(&self, index: usize) -> (u64, u64) {
        let node = &self.nodes[index];
        let counts: Vec<u64> = ["rx_bytes", "tx_bytes"]
            .iter()
            .map(|counter| {
                let output = Command::new("ip")
                    .args(["netns", "exec", &self.hub, "cat"])
                    .arg(format!(
                        "/sys/class/net/{}/statistics/{counter}",
                        node.hub_if
                    ))
                    .output()
                    .expect("read link counters");
                String::from_utf8_lossy(&output.stdout)
                    .trim()
                    .parse::<u64>()
                    .expect("a byte count")
            })
            .collect();
        (counts[0], counts[1])
    }

    /// A command that runs inside a node's namespace.
    pub fn command_in(&self, index: usize, program: impl AsRef<Path>) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.nodes[index].ns])
            .arg(program.as_ref());
        command
    }

    /// A fresh per-peer config directory inside the lab's temporary directory.
    pub fn config_dir(&self, name: &str) -> PathBuf {
        let dir = self.dir.path().join(name);
        fs::create_dir_all(&dir).expect("config dir");
        dir
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of each veth pair, and with it the other end.
        for node in &self.nodes {
            let _ = Command::new("ip").args(["netns", "del", &node.ns]).output();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.hub])
            .output();
    }
}

/// A child process killed (SIGKILL) and reaped on drop.
pub struct Proc {
    pub child: Option<Child>,
    pub log: PathBuf,
}

impl Proc {
    /// Spawns `command` with stdout and stderr going to `log`.
    pub fn spawn(mut command: Command, log: PathBuf) -> Self {
        let file = fs::File::create(&log).expect("log file");
        let err = file.try_clone().expect("log file");
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::from(file))
            .stderr(Stdio::from(err))
            .spawn()
            .expect("spawn");
        Self {
            child: Some(child),
            log,
        }
    }

    /// Kills with SIGKILL (no goodbye) and reaps.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `probe` every 100 ms until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(timeout: Duration, mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = probe() {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn ip(args: &[&str]) {
    run_ok(Command::new("ip").args(args));
}

fn run_ok(command: &mut Command) {
    let output = command.output().expect("run ip/tc");
    assert!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}
