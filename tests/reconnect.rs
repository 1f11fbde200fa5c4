//! Sessions that survive network drops (issue 11, item 3), in network namespaces (see `common/netns.rs`):
//! a `gleam serve --backend emu` peer in one namespace, a CUDA program through `gleam run` in another,
//! and the client's link taken down (`ip link set ... down` on its bridge port) while the program runs.
//!
//! The program (`tests/remote/reconnect_loop.c`) launches a kernel that adds one to a counter every
//! iteration (fire and forget, on a stream of its own) and copies a pattern there and back; at the end the
//! counter must equal the number of iterations, so a launch run twice after a drop, or lost in it, fails
//! the test, as does a copy that comes back wrong.
//!
//! The grace window counts from the last time a side heard from the other. QUIC's idle timeout (5 s)
//! ends the connection; the session waits out the rest of the window for the client to come back.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::{Lab, Proc, wait_for};

static BIN: std::sync::LazyLock<PathBuf> = std::sync::LazyLock::new(common::gleam);
const PORT: u16 = 4747;
/// The serving peer's node and the client's.
const SERVER: usize = 1;
const CLIENT: usize = 0;

/// A lab with a client node and a serving peer, and the test program.
struct Setup {
    lab: Lab,
    program: PathBuf,
    config: PathBuf,
    server: Option<Proc>,
    starts: u32,
    peer_id: String,
}

impl Setup {
    /// `None` where namespace tests cannot run (not root, no `ip`).
    fn new(grace: Option<&str>) -> Option<Self> {
        let mut lab = Lab::new()?;
        assert_eq!(lab.add_node(), CLIENT);
        assert_eq!(lab.add_node(), SERVER);
        let program = common::compile_c("reconnect_loop", lab.dir.path());
        let config = lab.config_dir("peer");
        let mut setup = Self {
            lab,
            program,
            config,
            server: None,
            starts: 0,
            peer_id: String::new(),
        };
        setup.start_server(grace);
        Some(setup)
    }

    /// Starts (or restarts) `gleam serve` on the serving node, with the same identity each time.
    fn start_server(&mut self, grace: Option<&str>) {
        let mut command = self.lab.command_in(SERVER, &*BIN);
        command
            .env("GLEAM_LOG", "info")
            .env_remove("LD_LIBRARY_PATH")
            .args([
                "serve",
                &format!("{}:{PORT}", self.lab.node(SERVER).ip),
                "--backend",
                "emu",
                "--config-dir",
            ])
            .arg(&self.config);
        if let Some(grace) = grace {
            command.args(["--session-grace", grace]);
        }
        self.starts += 1;
        let log = self.config.join(format!("serve-{}.log", self.starts));
        let server = Proc::spawn(command, log);
        let id = wait_for(Duration::from_secs(10), || {
            let text = server.log_text();
            let line = text
                .lines()
                .find(|l| l.contains("gleam serve: listening on"))?;
            Some(line.rsplit(" as ").next()?.trim().to_owned())
        })
        .unwrap_or_else(|| panic!("gleam serve did not start:\n{}", server.log_text()));
        self.peer_id = id;
        self.server = Some(server);
    }

    /// Runs the program through `gleam run` on the client node: `iterations` of `pause_ms` each, copying
    /// `copy_kib` each way per iteration.
    fn start_program(&self, iterations: u32, pause_ms: u32, copy_kib: u32) -> Proc {
        let mut command = self.lab.command_in(CLIENT, &*BIN);
        command
            .env("GLEAM_SHIM", common::shim())
            .env(
                "GLEAM_LOG",
                std::env::var("GLEAM_TEST_CLIENT_LOG").unwrap_or_else(|_| "info".into()),
            )
            .arg("run")
            .arg("--peer")
            .arg(format!(
                "{}@{}:{PORT}",
                self.peer_id,
                self.lab.node(SERVER).ip
            ))
            .arg("--config-dir")
            .arg(&self.config)
            .arg("--")
            .arg(&self.program)
            .args([
                iterations.to_string(),
                pause_ms.to_string(),
                copy_kib.to_string(),
            ]);
        Proc::spawn(command, self.config.join("program.log"))
    }

    fn server_log(&self) -> String {
        self.server.as_ref().map(Proc::log_text).unwrap_or_default()
    }

    fn ip_in_client(&self, args: &[&str]) {
        let out = Command::new("ip")
            .args(["-n", &self.lab.node(CLIENT).ns])
            .args(args)
            .output()
            .expect("run ip");
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Waits until the program has done `n` iterations.
fn wait_for_iterations(program: &Proc, n: u32) {
    let reached = wait_for(Duration::from_secs(30), || {
        program
            .log_text()
            .contains(&format!("iter {n}\n"))
            .then_some(())
    });
    assert!(
        reached.is_some(),
        "the program did not reach iteration {n}:\n{}",
        program.log_text()
    );
}

/// Waits for the program to end (within `limit`); its exit status and when it ended.
fn wait_for_exit(program: &mut Proc, limit: Duration) -> (std::process::ExitStatus, Instant) {
    let started = Instant::now();
    loop {
        if let Some(child) = program.child.as_mut()
            && let Ok(Some(status)) = child.try_wait()
        {
            return (status, Instant::now());
        }
        assert!(
            started.elapsed() < limit,
            "the program still runs after {limit:?}:\n{}",
            program.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The program finished with every launch counted once and every copy correct.
fn assert_completed(
    setup: &Setup,
    program: &Proc,
    status: std::process::ExitStatus,
    iterations: u32,
) {
    let log = program.log_text();
    assert!(
        status.success() && log.contains(&format!("done iterations={iterations} counter=ok")),
        "the program failed ({status:?}):\n{log}\n===== server =====\n{}",
        setup.server_log()
    );
}

/// Link down for `drop`, then up; the program (which runs across it, copying `copy_kib` each way per
/// iteration) must finish correctly. Returns how long the program took once the link was back, what its
/// remaining iterations took at its pace before the drop, and the client's "resumed" log line (empty if
/// it did not need to resume).
fn survive(
    grace: Option<&str>,
    drop: Duration,
    copy_kib: u32,
) -> Option<(Duration, Duration, String)> {
    let setup = Setup::new(grace)?;
    let iterations = 30;
    let mut program = setup.start_program(iterations, 50, copy_kib);
    wait_for_iterations(&program, 1);
    let first = Instant::now();
    wait_for_iterations(&program, 5);
    // The program's own pace on this machine: what its remaining iterations take once the link is back,
    // however loaded the machine is (8 MiB copies each way cost more than the 50 ms pause here).
    let pace = first.elapsed() / 4;
    setup.lab.partition(CLIENT);
    let cut = Instant::now();
    std::thread::sleep(drop);
    setup.lab.heal(CLIENT);
    let healed = Instant::now();
    let (status, ended) = wait_for_exit(&mut program, Duration::from_secs(60));
    assert_completed(&setup, &program, status, iterations);
    let log = program.log_text();
    let resumed = log
        .lines()
        .find(|l| l.contains("resumed on a new connection"))
        .unwrap_or_default()
        .to_owned();
    if !resumed.is_empty() {
        eprintln!("client: {resumed}");
    }
    eprintln!(
        "link down {:.1} s: program finished correctly {:.1} s after the link came back ({:.1} s after the drop)",
        (healed - cut).as_secs_f64(),
        (ended - healed).as_secs_f64(),
        (ended - cut).as_secs_f64()
    );
    Some((ended - healed, pace * (iterations - 5), resumed))
}

#[test]
fn a_3_s_drop_is_survived_and_the_program_finishes_correctly() {
    survive(None, Duration::from_secs(3), 1024);
}

#[test]
fn a_10_s_drop_resumes_the_session_and_the_program_finishes_correctly() {
    // 8 MiB copies travel in pieces of 4 MiB: the drop catches requests and replies in flight, which
    // each side sends again.
    let Some((setup_free, rest, resumed)) = survive(None, Duration::from_secs(10), 8192) else {
        return;
    };
    // The copies go by content: the resumed session has new bulk connections for their chunks.
    let stripes: usize = resumed
        .split("stripes=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        stripes > 0,
        "the resumed session has no bulk connection: {resumed}"
    );
    // The program had about 25 iterations left: it finishes soon after the link is back (within the
    // time those iterations take at its pace before the drop, and the resume's few seconds).
    assert!(
        setup_free < rest + Duration::from_secs(5),
        "the program took {setup_free:?} after the link came back (its iterations take {rest:?})"
    );
}

/// A drop longer than the window: the program's calls fail with CUDA_ERROR_DEVICE_UNAVAILABLE when the
/// window ends (counted from the drop), never later, and the session process is gone.
fn drop_past_the_window(grace: Option<&str>, window: Duration, drop: Duration) {
    let Some(setup) = Setup::new(grace) else {
        return;
    };
    let mut program = setup.start_program(1000, 50, 1024);
    wait_for_iterations(&program, 5);
    setup.lab.partition(CLIENT);
    let cut = Instant::now();
    let (status, ended) = wait_for_exit(&mut program, drop + Duration::from_secs(10));
    let took = ended - cut;
    setup.lab.heal(CLIENT);
    let log = program.log_text();
    eprintln!(
        "link down past a {:.1} s window: the program failed {:.1} s after the drop",
        window.as_secs_f64(),
        took.as_secs_f64()
    );
    assert!(
        !status.success() && log.contains("CUDA_ERROR_DEVICE_UNAVAILABLE"),
        "the program did not fail with CUDA_ERROR_DEVICE_UNAVAILABLE ({status:?}):\n{log}"
    );
    assert!(
        took >= window.saturating_sub(Duration::from_millis(500))
            && took <= window + Duration::from_secs(2),
        "failed {took:?} after the drop, the window is {window:?}:\n{log}"
    );
    assert!(
        took < drop,
        "the program failed only after the link came back"
    );
    // The serving side gave up too: its session process ended.
    let gone = wait_for(Duration::from_secs(5), || {
        setup.server_log().contains("session ended").then_some(())
    });
    assert!(
        gone.is_some(),
        "the session did not end:\n{}",
        setup.server_log()
    );
}

#[test]
fn a_drop_past_a_6_s_window_fails_at_the_window() {
    drop_past_the_window(Some("6"), Duration::from_secs(6), Duration::from_secs(9));
}

#[test]
#[ignore = "slow (20 s): the issue's figure with the default 15 s window; the 6 s window test covers the behaviour"]
fn a_20_s_drop_fails_at_the_default_15_s_window() {
    drop_past_the_window(None, Duration::from_secs(15), Duration::from_secs(20));
}

#[test]
fn the_client_resumes_from_a_new_address() {
    let Some(setup) = Setup::new(None) else {
        return;
    };
    let iterations = 30;
    let mut program = setup.start_program(iterations, 50, 1024);
    wait_for_iterations(&program, 5);
    // The client's network goes away and comes back with another address (a new DHCP lease, another
    // access point): the old connection cannot come back, a new one must.
    setup.lab.partition(CLIENT);
    let old = format!("{}/24", setup.lab.node(CLIENT).ip);
    setup.ip_in_client(&["addr", "del", &old, "dev", "eth0"]);
    setup.ip_in_client(&["addr", "add", "10.77.0.77/24", "dev", "eth0"]);
    std::thread::sleep(Duration::from_secs(7));
    setup.lab.heal(CLIENT);
    let healed = Instant::now();
    let (status, ended) = wait_for_exit(&mut program, Duration::from_secs(60));
    assert_completed(&setup, &program, status, iterations);
    let log = setup.server_log();
    assert!(
        log.contains("client resumes its session") && log.contains("10.77.0.77"),
        "the session was not resumed from the new address:\n{log}"
    );
    eprintln!(
        "address changed during a 7 s drop: program finished correctly {:.1} s after the link came back",
        (ended - healed).as_secs_f64()
    );
}

#[test]
fn a_peer_restarted_during_the_drop_says_at_once_that_the_session_is_gone() {
    let Some(mut setup) = Setup::new(None) else {
        return;
    };
    let mut program = setup.start_program(1000, 50, 1024);
    wait_for_iterations(&program, 5);
    setup.lab.partition(CLIENT);
    let cut = Instant::now();
    // The peer restarts while the client is away: its sessions (and their GPU state) are gone.
    if let Some(mut server) = setup.server.take() {
        server.kill();
    }
    setup.start_server(None);
    std::thread::sleep(Duration::from_secs(7).saturating_sub(cut.elapsed()));
    setup.lab.heal(CLIENT);
    let healed = Instant::now();
    let (status, ended) = wait_for_exit(&mut program, Duration::from_secs(20));
    let log = program.log_text();
    assert!(
        !status.success() && log.contains("CUDA_ERROR_DEVICE_UNAVAILABLE"),
        "the program did not fail with CUDA_ERROR_DEVICE_UNAVAILABLE ({status:?}):\n{log}"
    );
    assert!(
        log.contains("no longer has this session"),
        "the error does not say the session is gone:\n{log}"
    );
    // The restarted peer answered the resume; the program ended right after.
    let server_log = setup.server_log();
    assert!(
        server_log.contains("nothing to resume"),
        "the restarted peer was not asked:\n{server_log}"
    );
    let took = ended - healed;
    eprintln!(
        "peer restarted during a 7 s drop: the program failed {:.2} s after the link came back",
        took.as_secs_f64()
    );
    // Reaching the peer again takes up to one dial attempt (1 s) after the link is back; the answer then
    // comes at once.
    assert!(
        took < Duration::from_millis(2500),
        "the error came {took:?} after the link came back"
    );
}

#[test]
fn the_session_follows_a_client_address_move_without_a_drop() {
    let Some(setup) = Setup::new(None) else {
        return;
    };
    let iterations = 30;
    let mut program = setup.start_program(iterations, 50, 1024);
    wait_for_iterations(&program, 5);
    // The address moves while the link stays up: QUIC follows the client to its new address (or, if the
    // old path is gone for good, the session resumes from the new one).
    let old = format!("{}/24", setup.lab.node(CLIENT).ip);
    // Deleting a subnet's first address deletes the others of the subnet too, unless they are promoted.
    let promote = Command::new("ip")
        .args(["netns", "exec", &setup.lab.node(CLIENT).ns])
        .args(["sysctl", "-qw", "net.ipv4.conf.eth0.promote_secondaries=1"])
        .status()
        .expect("run sysctl");
    assert!(promote.success(), "sysctl promote_secondaries failed");
    let moved = Instant::now();
    setup.ip_in_client(&["addr", "add", "10.77.0.78/24", "dev", "eth0"]);
    setup.ip_in_client(&["addr", "del", &old, "dev", "eth0"]);
    let (status, ended) = wait_for_exit(&mut program, Duration::from_secs(60));
    assert_completed(&setup, &program, status, iterations);
    let resumed = setup.server_log().contains("client resumes its session");
    eprintln!(
        "address moved mid-session: program finished correctly {:.1} s later ({})",
        (ended - moved).as_secs_f64(),
        if resumed {
            "the session resumed on a new connection"
        } else {
            "the connection migrated"
        }
    );
}
