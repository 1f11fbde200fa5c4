//! Multi-peer mesh tests: real `gleam peer` processes in network namespaces joined by a bridge
//! (see `common/netns.rs`), each with its own GLEAM_CONFIG_DIR, on the emulated backend.
//!
//! Issue 10 (the mesh in the field), items 1-5, each has its test here: link-local addresses with their
//! interface and every address tried (`gleam_run_reaches_a_peer_known_only_by_link_local_addresses`),
//! recovery after a partition (`a_peer_cut_off_comes_back_within_seconds_of_the_link_returning`), probes
//! within their share of a slow link (`probes_take_a_small_share_of_a_slow_link_and_the_peer_stays`), a
//! copied identity (`a_copied_identity_is_refused_and_reported_on_both_devices`), and peer choice
//! following a link change (`a_link_change_shows_in_peer_choice_within_2_s`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::{Lab, Proc, wait_for};
use common::output_within;
use serde_json::Value;

/// The binary under test (`GLEAM_BIN` runs these tests against another build, e.g. an older one).
static BIN: std::sync::LazyLock<PathBuf> = std::sync::LazyLock::new(common::gleam);
const PORT: u16 = 4747;

/// One peer: its namespace index, config dir, id and (while running) its process.
struct Peer {
    node: usize,
    dir: PathBuf,
    id: String,
    proc: Option<Proc>,
}

fn gleam(dir: &Path) -> Command {
    let mut command = Command::new(&*BIN);
    command
        .env("GLEAM_CONFIG_DIR", dir)
        .env("GLEAM_LOG", "info,gleam_mesh=debug");
    command
}

fn run_gleam(dir: &Path, args: &[&str]) -> std::process::Output {
    let mut command = gleam(dir);
    command.args(args);
    output_within(command, Duration::from_secs(20))
}

fn json_of(output: &std::process::Output) -> Value {
    assert!(
        output.status.success(),
        "gleam failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON output")
}

/// Creates `n` peers in `lab`; the first `members` share one mesh, the others each make their own.
fn make_peers(lab: &mut Lab, n: usize, members: usize) -> Vec<Peer> {
    let mut code: Option<String> = None;
    (0..n)
        .map(|i| {
            let node = lab.add_node();
            let dir = lab.config_dir(&format!("peer{i}"));
            match (&code, i < members) {
                (Some(code), true) => {
                    let out = run_gleam(&dir, &["mesh", "join", code]);
                    assert!(
                        out.status.success(),
                        "{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                _ => {
                    let out = run_gleam(&dir, &["mesh", "init"]);
                    assert!(
                        out.status.success(),
                        "{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    if i < members {
                        let show = json_of(&run_gleam(&dir, &["mesh", "show", "--code", "--json"]));
                        code = Some(show["join_code"].as_str().expect("join code").to_owned());
                    }
                }
            }
            let show = json_of(&run_gleam(&dir, &["mesh", "show", "--json"]));
            let id = show["peer_id"].as_str().expect("peer id").to_owned();
            Peer {
                node,
                dir,
                id,
                proc: None,
            }
        })
        .collect()
}

fn start(lab: &Lab, peer: &mut Peer, name: &str) {
    start_with(lab, peer, name, &[]);
}

/// Starts the peer as a laptop would that only borrows GPUs: it offers none (not even its emulated one).
fn start_borrower(lab: &Lab, peer: &mut Peer, name: &str) {
    start_with(lab, peer, name, &["--borrow-only"]);
}

/// Peer 0 is the client: it borrows and serves nothing, so only the serving peers 1.. compete.
fn start_client_and_servers(lab: &Lab, peers: &mut [Peer]) {
    for (i, peer) in peers.iter_mut().enumerate() {
        if i == 0 {
            start_borrower(lab, peer, "node0");
        } else {
            start(lab, peer, &format!("node{i}"));
        }
    }
}

/// The bandwidths of peers 1 and 2 as peer 0 probed them, once both are measured (20 s at most).
fn probed_bandwidths(peers: &[Peer]) -> Option<(u64, u64)> {
    wait_for(Duration::from_secs(20), || {
        let rows = listed(&peers[0])?;
        let probed = |peer: &Peer| {
            rows.iter().find(|row| row["id"] == peer.id.as_str())?["bandwidth_bps"].as_u64()
        };
        Some((probed(&peers[1])?, probed(&peers[2])?))
    })
}

fn start_with(lab: &Lab, peer: &mut Peer, name: &str, extra: &[&str]) {
    let mut command = lab.command_in(peer.node, &*BIN);
    command
        .env("GLEAM_CONFIG_DIR", &peer.dir)
        .env("GLEAM_LOG", "info,gleam_mesh=debug")
        .args([
            "peer",
            "--listen",
            &format!("0.0.0.0:{PORT}"),
            "--name",
            name,
        ])
        .args(extra);
    peer.proc = Some(Proc::spawn(command, peer.dir.join("peer.log")));
}

/// The ids in a peer's `gleam peers list --json`, or `None` when the daemon does not answer.
fn listed(peer: &Peer) -> Option<Vec<Value>> {
    let out = run_gleam(&peer.dir, &["peers", "list", "--json"]);
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice::<Vec<Value>>(&out.stdout).ok()
}

fn ids(rows: &[Value]) -> Vec<String> {
    let mut ids: Vec<String> = rows
        .iter()
        .map(|row| row["id"].as_str().unwrap_or("").to_owned())
        .collect();
    ids.sort();
    ids
}

fn dump_logs(peers: &[Peer]) {
    for peer in peers {
        if let Some(proc) = &peer.proc {
            eprintln!("===== log of {} =====\n{}", peer.id, proc.log_text());
        }
    }
}

/// Waits until every running peer lists exactly `expected` (sorted ids); returns the time taken.
fn wait_until_lists(
    peers: &[Peer],
    running: &[usize],
    expected: &[String],
    timeout: Duration,
) -> Option<Duration> {
    let started = Instant::now();
    wait_for(timeout, || {
        running
            .iter()
            .all(|&i| listed(&peers[i]).is_some_and(|rows| ids(&rows) == expected))
            .then(|| started.elapsed())
    })
}

#[test]
fn peers_discover_each_other_list_the_right_contents_and_drop_a_killed_peer() {
    let Some(mut lab) = Lab::new() else { return };
    let mut peers = make_peers(&mut lab, 3, 3);
    for (i, peer) in peers.iter_mut().enumerate() {
        start(&lab, peer, &format!("node{i}"));
    }
    // Discovery time counts from the start of the last process, start-up included.
    let mut all: Vec<String> = peers.iter().map(|p| p.id.clone()).collect();
    all.sort();
    let took = wait_until_lists(&peers, &[0, 1, 2], &all, Duration::from_secs(10));
    let Some(took) = took else {
        dump_logs(&peers);
        panic!("peers did not all discover each other within 10 s");
    };
    eprintln!("all peers discovered in {took:?}");
    if took > Duration::from_secs(3) {
        dump_logs(&peers);
        panic!("discovery took {took:?}, more than 3 s");
    }

    // Contents: self first, names, the emulated GPU, addresses on the lab network.
    let rows = listed(&peers[0]).expect("list");
    assert_eq!(rows[0]["id"], peers[0].id.as_str());
    assert_eq!(rows[0]["is_self"], true);
    for (i, peer) in peers.iter().enumerate() {
        let row = rows
            .iter()
            .find(|row| row["id"] == peer.id.as_str())
            .expect("row");
        assert_eq!(row["host"], format!("node{i}"));
        assert_eq!(
            row["gpus"][0]["model"],
            "Gleam emulated GPU (PTX interpreter)"
        );
        assert_eq!(row["gpus"][0]["emulated"], true);
        assert!(row["total_memory"].as_u64().unwrap() > 0);
        assert_eq!(row["active_sessions"], 0);
        let addr = format!("{}:{PORT}", lab.node(peer.node).ip);
        let wanted = wait_for(Duration::from_secs(5), || {
            let rows = listed(&peers[0])?;
            let row = rows.into_iter().find(|row| row["id"] == peer.id.as_str())?;
            row["addrs"]
                .as_array()?
                .iter()
                .any(|a| a == addr.as_str())
                .then_some(())
        });
        assert!(
            wanted.is_some(),
            "{addr} not among the addresses of peer {i}"
        );
        if i != 0 {
            let rtt = row["rtt_us"].as_u64().expect("rtt to a connected peer");
            assert!(rtt < 100_000, "rtt {rtt} us");
        }
    }
    // The table form works too: full ids (not a terminal), an address column, memory in a unit that
    // shows it; the cache digest is hex text in JSON.
    let table = run_gleam(&peers[0].dir, &["peers", "list"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("node1") && table.contains("Gleam emulated GPU"),
        "{table}"
    );
    assert!(table.contains(&peers[1].id), "{table}");
    assert!(
        table.contains(&format!("{}:{PORT}", lab.node(peers[1].node).ip)),
        "{table}"
    );
    assert!(!table.contains("0.0 / 0.0 GiB"), "{table}");
    assert!(rows[0]["cache"]["digest"].is_string(), "{}", rows[0]);

    // Kill peer 2 without a goodbye: it leaves the other lists within 5 s.
    peers[2].proc.as_mut().expect("running").kill();
    let killed = Instant::now();
    let mut rest: Vec<String> = peers[..2].iter().map(|p| p.id.clone()).collect();
    rest.sort();
    let gone = wait_until_lists(&peers, &[0, 1], &rest, Duration::from_secs(10));
    let Some(_) = gone else {
        dump_logs(&peers);
        panic!("killed peer still listed after 10 s");
    };
    let took = killed.elapsed();
    eprintln!("killed peer dropped in {took:?}");
    assert!(
        took <= Duration::from_secs(5),
        "killed peer dropped only after {took:?}"
    );
}

#[test]
fn a_device_without_the_mesh_secret_can_neither_join_nor_run_work() {
    let Some(mut lab) = Lab::new() else { return };
    // Peers 0 and 1 share a mesh; peer 2 made its own.
    let mut peers = make_peers(&mut lab, 3, 2);
    for (i, peer) in peers.iter_mut().enumerate() {
        start(&lab, peer, &format!("node{i}"));
    }
    let mut members: Vec<String> = peers[..2].iter().map(|p| p.id.clone()).collect();
    members.sort();
    let joined = wait_until_lists(&peers, &[0, 1], &members, Duration::from_secs(10));
    if joined.is_none() {
        dump_logs(&peers);
        panic!("members did not find each other");
    }
    // Give the outsider time to try (it sees the others over mDNS and dials them).
    std::thread::sleep(Duration::from_secs(3));
    for (i, peer) in peers[..2].iter().enumerate() {
        assert_eq!(
            ids(&listed(peer).expect("list")),
            members,
            "member {i} lists the outsider"
        );
    }
    assert_eq!(
        ids(&listed(&peers[2]).expect("list")),
        vec![peers[2].id.clone()],
        "the outsider joined"
    );
    // The members say why they refused it.
    let log = peers[0].proc.as_ref().expect("running").log_text()
        + &peers[1].proc.as_ref().expect("running").log_text();
    assert!(
        log.contains("refusing peer")
            && log.contains(&peers[2].id)
            && log.contains("not in this mesh"),
        "no refusal logged:\n{log}"
    );

    // Running work: a CUDA session from the outsider is refused at authentication.
    let target = format!("{}@{}:{PORT}", peers[0].id, lab.node(peers[0].node).ip);
    let mut command = lab.command_in(peers[2].node, &*BIN);
    command
        .env("GLEAM_CONFIG_DIR", &peers[2].dir)
        .args(["peers", "ping", &target]);
    let out = output_within(command, Duration::from_secs(20));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the outsider got in");
    assert!(
        stderr.contains("refused us") && stderr.contains("mesh secret"),
        "{stderr}"
    );
    // So does a real program through `gleam run` (when the examples are built).
    let example = BIN
        .as_path()
        .parent()
        .expect("bin dir")
        .join("examples/vector_add");
    if example.is_file() {
        let mut command = lab.command_in(peers[2].node, &*BIN);
        command
            .env("GLEAM_CONFIG_DIR", &peers[2].dir)
            .args(["run", "--peer", &target, "--"])
            .arg(&example);
        let out = output_within(command, Duration::from_secs(60));
        assert!(!out.status.success(), "the outsider ran work");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("mesh secret"), "{stderr}");
    } else {
        eprintln!("note: vector_add not built; `gleam run` from the outsider not tried");
    }
    // A member gets in, and the peer starts a session for it.
    let mut command = lab.command_in(peers[1].node, &*BIN);
    command
        .env("GLEAM_CONFIG_DIR", &peers[1].dir)
        .args(["peers", "ping", &target]);
    let out = output_within(command, Duration::from_secs(20));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "member refused: {stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("authenticated"));
    let served = wait_for(Duration::from_secs(5), || {
        let log = peers[0].proc.as_ref()?.log_text();
        (log.contains("CUDA session starts") && log.contains(&peers[1].id)).then_some(())
    });
    assert!(
        served.is_some(),
        "the member's CUDA session did not reach the session host"
    );
}

#[test]
fn best_peer_is_the_one_behind_the_better_link() {
    let Some(mut lab) = Lab::new() else { return };
    let mut peers = make_peers(&mut lab, 3, 3);
    // Peer 1's link is shaped to 20 Mbit/s; peer 2's is the bare veth.
    lab.shape(1, "20mbit");
    start_client_and_servers(&lab, &mut peers);
    let measured = probed_bandwidths(&peers);
    let Some((slow, fast)) = measured else {
        dump_logs(&peers);
        panic!("links were not probed within 20 s");
    };
    eprintln!(
        "probed: shaped {} Mbit/s, bare {} Mbit/s",
        slow / 1_000_000,
        fast / 1_000_000
    );
    assert!(slow < 40_000_000, "shaped link measured at {slow} bit/s");
    assert!(
        fast > 2 * slow,
        "bare link {fast} bit/s not clearly faster than shaped {slow} bit/s"
    );

    let best = json_of(&run_gleam(
        &peers[0].dir,
        &["peers", "best", "--bytes", "100000000", "--json"],
    ));
    assert_eq!(best["id"], peers[2].id.as_str(), "{best}");
    let addr = format!("{}:{PORT}", lab.node(peers[2].node).ip);
    assert_eq!(best["addrs"][0], addr.as_str(), "{best}");
}

#[test]
fn peers_find_each_other_over_ipv6_link_local_only() {
    let Some(mut lab) = Lab::new() else { return };
    let secret_dir = lab.config_dir("v6peer0");
    let out = run_gleam(&secret_dir, &["mesh", "init"]);
    assert!(out.status.success());
    let show = json_of(&run_gleam(
        &secret_dir,
        &["mesh", "show", "--code", "--json"],
    ));
    let code = show["join_code"].as_str().expect("code").to_owned();
    let mut peers: Vec<Peer> = (0..2)
        .map(|i| {
            let node = lab.add_node_v6_only();
            let dir = lab.config_dir(&format!("v6peer{i}"));
            if i > 0 {
                assert!(run_gleam(&dir, &["mesh", "join", &code]).status.success());
            }
            let id = json_of(&run_gleam(&dir, &["mesh", "show", "--json"]))["peer_id"]
                .as_str()
                .expect("id")
                .to_owned();
            Peer {
                node,
                dir,
                id,
                proc: None,
            }
        })
        .collect();
    for (i, peer) in peers.iter_mut().enumerate() {
        // The default listen address: dual-stack [::]:4747.
        let mut command = lab.command_in(peer.node, &*BIN);
        command
            .env("GLEAM_CONFIG_DIR", &peer.dir)
            .env("GLEAM_LOG", "info,gleam_mesh=debug")
            .args(["peer", "--name", &format!("v6node{i}")]);
        peer.proc = Some(Proc::spawn(command, peer.dir.join("peer.log")));
    }
    let mut all: Vec<String> = peers.iter().map(|p| p.id.clone()).collect();
    all.sort();
    // Link-local addresses appear only after duplicate address detection (~1-2 s).
    let took = wait_until_lists(&peers, &[0, 1], &all, Duration::from_secs(15));
    let Some(took) = took else {
        dump_logs(&peers);
        panic!("IPv6-only peers did not find each other");
    };
    eprintln!("IPv6-only discovery took {took:?}");
    let rows = listed(&peers[0]).expect("list");
    let other = rows
        .iter()
        .find(|row| row["id"] == peers[1].id.as_str())
        .expect("row");
    assert!(other["rtt_us"].as_u64().is_some(), "not connected: {other}");
    let v6 = wait_for(Duration::from_secs(5), || {
        let rows = listed(&peers[0])?;
        let row = rows
            .into_iter()
            .find(|row| row["id"] == peers[1].id.as_str())?;
        let addrs = row["addrs"].as_array()?.clone();
        addrs
            .iter()
            .any(|a| a.as_str().is_some_and(|a| a.starts_with("[fe80:")))
            .then_some(addrs)
    });
    assert!(v6.is_some(), "no IPv6 link-local address advertised");
}

#[test]
fn gleam_run_without_peer_runs_on_the_better_linked_peer() {
    let Some(mut lab) = Lab::new() else { return };
    let exe_dir = BIN.as_path().parent().expect("bin dir").to_owned();
    let example = exe_dir.join("examples").join("vector_add");
    if !example.is_file() || !has_shim(&exe_dir) {
        eprintln!(
            "SKIPPED: needs the shim and the vector_add example built \
             (`cargo build --workspace --all-targets`)"
        );
        return;
    }
    let mut peers = make_peers(&mut lab, 3, 3);
    lab.shape(1, "20mbit");
    start_client_and_servers(&lab, &mut peers);
    // Wait until peer 0 has measured both links, so its choice is informed.
    let measured = probed_bandwidths(&peers);
    if measured.is_none() {
        dump_logs(&peers);
        panic!("links were not probed within 20 s");
    }
    // An unmodified CUDA program, no --peer: the daemon picks the peer.
    let mut command = lab.command_in(peers[0].node, &*BIN);
    command
        .env("GLEAM_CONFIG_DIR", &peers[0].dir)
        .env("GLEAM_LOG", "info")
        .arg("run")
        .arg("--")
        .arg(&example);
    let out = output_within(command, Duration::from_secs(300));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gleam run failed: {stderr}");
    let session_on = |peer: &Peer| {
        let log = peer.proc.as_ref().expect("running").log_text();
        log.lines()
            .any(|line| line.contains("CUDA session starts") && line.contains(&peers[0].id))
    };
    assert!(
        session_on(&peers[2]),
        "the session did not run on the better-linked peer"
    );
    assert!(!session_on(&peers[1]), "the session ran on the shaped peer");
}

#[test]
fn a_session_on_a_killed_peer_ends_with_an_error_not_a_hang() {
    let Some(mut lab) = Lab::new() else { return };
    let exe_dir = BIN.as_path().parent().expect("bin dir").to_owned();
    let example = exe_dir.join("examples").join("bench_driver");
    if !example.is_file() || !has_shim(&exe_dir) {
        eprintln!(
            "SKIPPED: needs the shim and the bench_driver example built \
             (`cargo build --workspace --all-targets`)"
        );
        return;
    }
    let mut peers = make_peers(&mut lab, 2, 2);
    // Peer 0 borrows, peer 1 serves. A session waits out its grace window (15 s by default, from the last
    // packet) for an unreachable peer to come back: a short one keeps this test about the error.
    start_borrower(&lab, &mut peers[0], "node0");
    start_with(&lab, &mut peers[1], "node1", &["--session-grace", "5"]);
    let mut all: Vec<String> = peers.iter().map(|p| p.id.clone()).collect();
    all.sort();
    assert!(
        wait_until_lists(&peers, &[0, 1], &all, Duration::from_secs(10)).is_some(),
        "peers did not find each other"
    );
    // A long-running program (millions of launches) on peer 1, chosen by the daemon.
    let mut command = lab.command_in(peers[0].node, &*BIN);
    command
        .env("GLEAM_CONFIG_DIR", &peers[0].dir)
        .env("GLEAM_BENCH_LAUNCHES", "100000000")
        .args(["run", "--"])
        .arg(&example);
    let mut program = Proc::spawn(command, peers[0].dir.join("program.log"));
    let started = wait_for(Duration::from_secs(20), || {
        let log = peers[1].proc.as_ref()?.log_text();
        log.contains("session started").then_some(())
    });
    assert!(started.is_some(), "the session did not start");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        program.running(),
        "the program ended early:\n{}",
        program.log_text()
    );

    peers[1].proc.as_mut().expect("running").kill();
    let killed = Instant::now();
    let ended = wait_for(Duration::from_secs(30), || {
        (!program.running()).then_some(())
    });
    assert!(
        ended.is_some(),
        "the program still runs 30 s after its peer died:\n{}",
        program.log_text()
    );
    let took = killed.elapsed();
    eprintln!("program ended {took:?} after its peer was killed");
    eprintln!("its output:\n{}", program.log_text());
    let status = program.child.take().expect("child").wait().expect("status");
    assert!(!status.success(), "the program reported success");
    assert!(
        program.log_text().contains("CUDA_ERROR"),
        "no CUDA error reported:\n{}",
        program.log_text()
    );
    assert!(took < Duration::from_secs(15), "took {took:?}");
}

/// `gleam peers best --json` on `peer` for a job moving `bytes`.
fn best_of(peer: &Peer, bytes: u64) -> Option<Value> {
    let out = run_gleam(
        &peer.dir,
        &["peers", "best", "--bytes", &bytes.to_string(), "--json"],
    );
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).ok())?
}

/// `gleam ARGS` in `peer`'s namespace as that peer's user; returns the output and how long it took.
fn gleam_in(lab: &Lab, peer: &Peer, args: &[&str]) -> (std::process::Output, Duration) {
    let mut command = lab.command_in(peer.node, &*BIN);
    command
        .env("GLEAM_CONFIG_DIR", &peer.dir)
        .env("GLEAM_LOG", "info")
        .args(args);
    let started = Instant::now();
    let out = output_within(command, Duration::from_secs(30));
    (out, started.elapsed())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Issue 10, item 1: on a link with only IPv6 link-local addresses, every address handed out carries
/// its interface, `gleam run` without `--peer` reaches the chosen peer, and `--peer` tries every
/// address it is given (happy eyeballs) and accepts an id prefix or a host name.
#[test]
fn gleam_run_reaches_a_peer_known_only_by_link_local_addresses() {
    let Some(mut lab) = Lab::new() else { return };
    let first = lab.config_dir("ll0");
    assert!(run_gleam(&first, &["mesh", "init"]).status.success());
    let code = json_of(&run_gleam(&first, &["mesh", "show", "--code", "--json"]))["join_code"]
        .as_str()
        .expect("code")
        .to_owned();
    let mut peers: Vec<Peer> = (0..2)
        .map(|i| {
            let node = lab.add_node_v6_only();
            let dir = lab.config_dir(&format!("ll{i}"));
            if i > 0 {
                assert!(run_gleam(&dir, &["mesh", "join", &code]).status.success());
            }
            let id = json_of(&run_gleam(&dir, &["mesh", "show", "--json"]))["peer_id"]
                .as_str()
                .expect("id")
                .to_owned();
            Peer {
                node,
                dir,
                id,
                proc: None,
            }
        })
        .collect();
    for (i, peer) in peers.iter_mut().enumerate() {
        let mut command = lab.command_in(peer.node, &*BIN);
        command
            .env("GLEAM_CONFIG_DIR", &peer.dir)
            .env("GLEAM_LOG", "info,gleam_mesh=debug")
            .args(["peer", "--name", &format!("llnode{i}")]);
        if i == 0 {
            command.arg("--borrow-only");
        }
        peer.proc = Some(Proc::spawn(command, peer.dir.join("peer.log")));
    }
    let mut all: Vec<String> = peers.iter().map(|p| p.id.clone()).collect();
    all.sort();
    if wait_until_lists(&peers, &[0, 1], &all, Duration::from_secs(15)).is_none() {
        dump_logs(&peers);
        panic!("IPv6-only peers did not find each other");
    }
    // Every link-local address the daemon hands out names its interface.
    let best =
        wait_for(Duration::from_secs(5), || best_of(&peers[0], 1 << 20)).expect("a best peer");
    assert_eq!(best["id"], peers[1].id.as_str(), "{best}");
    let addrs: Vec<String> = best["addrs"]
        .as_array()
        .expect("addrs")
        .iter()
        .map(|a| a.as_str().unwrap_or("").to_owned())
        .collect();
    assert!(!addrs.is_empty(), "{best}");
    for addr in &addrs {
        assert!(
            !addr.starts_with("[fe80") || addr.contains('%'),
            "link-local address without its interface: {addr} in {best}"
        );
    }
    let rows = listed(&peers[0]).expect("list");
    let row = rows
        .iter()
        .find(|row| row["id"] == peers[1].id.as_str())
        .expect("row");
    for addr in row["addrs"].as_array().expect("addrs") {
        let addr = addr.as_str().unwrap_or("");
        assert!(!addr.starts_with("[fe80") || addr.contains('%'), "{row}");
    }

    // No --peer: the daemon's choice, reached over a link-local address.
    let (out, took) = gleam_in(&lab, &peers[0], &["run", "--", "/bin/true"]);
    assert!(
        out.status.success(),
        "gleam run failed after {took:?}: {}",
        text(&out.stderr)
    );
    eprintln!("gleam run over link-local IPv6 took {took:?}");
    // The choice is explained in words, not as a ranking figure.
    let stderr = text(&out.stderr);
    assert!(stderr.contains("chose GPU peer llnode1"), "{stderr}");
    assert!(!stderr.contains("expected_secs"), "{stderr}");

    // Happy eyeballs: a silent address first costs one stagger, not a timeout.
    let good = addrs[0].clone();
    let target = format!("{}@[fe80::dead:beef%eth0]:4747,{good}", peers[1].id);
    let (out, took) = gleam_in(
        &lab,
        &peers[0],
        &["run", "--peer", &target, "--", "/bin/true"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    eprintln!("gleam run with a dead first address took {took:?}");
    assert!(took < Duration::from_secs(3), "took {took:?}");
    // A link-local address without its interface is tried on every interface.
    let (ip, port) = good
        .trim_start_matches('[')
        .split_once('%')
        .map(|(ip, rest)| {
            (
                ip.to_owned(),
                rest.split_once("]:").map_or("4747", |(_, p)| p).to_owned(),
            )
        })
        .expect("a scoped address");
    let bare = format!("{}@[{ip}]:{port}", peers[1].id);
    let (out, _) = gleam_in(
        &lab,
        &peers[0],
        &["run", "--peer", &bare, "--", "/bin/true"],
    );
    assert!(out.status.success(), "{bare}: {}", text(&out.stderr));
    // A unique id prefix and a host name, resolved by the daemon.
    for name in [&peers[1].id[..8], "llnode1"] {
        let (out, _) = gleam_in(&lab, &peers[0], &["run", "--peer", name, "--", "/bin/true"]);
        assert!(out.status.success(), "--peer {name}: {}", text(&out.stderr));
    }
    let (out, _) = gleam_in(
        &lab,
        &peers[0],
        &["run", "--peer", "nosuchhost", "--", "/bin/true"],
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("no peer in the mesh"),
        "{}",
        text(&out.stderr)
    );
}

/// Issue 10, item 2: a peer cut off long enough to be declared down comes back within seconds of its
/// link returning, without any new peer: whether its QUIC links survived the cut (the membership
/// protocol alone must bring it back) or timed out (the links must be dialled again).
#[test]
fn a_peer_cut_off_comes_back_within_seconds_of_the_link_returning() {
    let Some(mut lab) = Lab::new() else { return };
    let mut peers = make_peers(&mut lab, 3, 3);
    start_client_and_servers(&lab, &mut peers);
    let mut all: Vec<String> = peers.iter().map(|p| p.id.clone()).collect();
    all.sort();
    if wait_until_lists(&peers, &[0, 1, 2], &all, Duration::from_secs(10)).is_none() {
        dump_logs(&peers);
        panic!("peers did not find each other");
    }
    let mut rest: Vec<String> = peers[..2].iter().map(|p| p.id.clone()).collect();
    rest.sort();
    lab.partition(2);
    let dropped = wait_until_lists(&peers, &[0, 1], &rest, Duration::from_secs(8));
    if dropped.is_none() {
        dump_logs(&peers);
        panic!("the cut-off peer was not declared down");
    }
    // Back at once: its QUIC links are still up (they give up after 5 s of silence), so nothing but
    // the membership protocol can bring it back.
    lab.heal(2);
    let back = wait_until_lists(&peers, &[0, 1, 2], &all, Duration::from_secs(15));
    let Some(back) = back else {
        dump_logs(&peers);
        panic!("the peer did not come back within 15 s of the link returning");
    };
    eprintln!(
        "declared down after {:?}; back in every list {back:?} after the link returned",
        dropped.unwrap_or_default()
    );
    if std::env::var_os("GLEAM_TEST_DUMP").is_some() {
        dump_logs(&peers);
    }
    assert!(
        back <= Duration::from_secs(5),
        "came back only after {back:?}"
    );

    // Throttled to a trickle until it is declared down (the field report: a 1 Mbit/s link full of
    // probes), then the throttle goes: back within seconds.
    lab.shape(2, "4kbit");
    let throttled = Instant::now();
    if wait_until_lists(&peers, &[0, 1], &rest, Duration::from_secs(15)).is_none() {
        dump_logs(&peers);
        panic!("the throttled peer was never declared down");
    }
    let dropped_after = throttled.elapsed();
    lab.unshape(2);
    let back = wait_until_lists(&peers, &[0, 1, 2], &all, Duration::from_secs(15));
    let Some(back) = back else {
        dump_logs(&peers);
        panic!("the peer did not come back within 15 s of the throttle's removal");
    };
    eprintln!(
        "throttled to 4 kbit/s: declared down after {dropped_after:?}; back in every list {back:?} after \
         the throttle was removed"
    );
    assert!(
        back <= Duration::from_secs(5),
        "came back only after {back:?}"
    );

    // A longer cut (6 s: its links time out after 5 s of silence): back within seconds too.
    lab.partition(2);
    let cut = Instant::now();
    assert!(wait_until_lists(&peers, &[0, 1], &rest, Duration::from_secs(8)).is_some());
    std::thread::sleep(Duration::from_secs(6).saturating_sub(cut.elapsed()));
    lab.heal(2);
    let back = wait_until_lists(&peers, &[0, 1, 2], &all, Duration::from_secs(15));
    let Some(back) = back else {
        dump_logs(&peers);
        panic!("the peer did not come back after a long cut");
    };
    eprintln!("after a 6 s cut: back in every list {back:?} after the link returned");
    if std::env::var_os("GLEAM_TEST_DUMP").is_some() {
        dump_logs(&peers);
    }
    assert!(
        back <= Duration::from_secs(6),
        "came back only after {back:?}"
    );
}

/// Issue 10, item 3: on a 1 Mbit/s link, the mesh's own traffic (gossip and bandwidth probes) takes a
/// small share, the peer stays a member, and the link stays responsive.
#[test]
fn probes_take_a_small_share_of_a_slow_link_and_the_peer_stays() {
    let Some(mut lab) = Lab::new() else { return };
    let mut peers = make_peers(&mut lab, 2, 2);
    lab.shape(1, "1mbit");
    start_client_and_servers(&lab, &mut peers);
    let mut all: Vec<String> = peers.iter().map(|p| p.id.clone()).collect();
    all.sort();
    if wait_until_lists(&peers, &[0, 1], &all, Duration::from_secs(10)).is_none() {
        dump_logs(&peers);
        panic!("peers did not find each other");
    }
    // Measured at all (the first probe goes out at once).
    let measured = wait_for(Duration::from_secs(10), || {
        let rows = listed(&peers[0])?;
        rows.iter().find(|row| row["id"] == peers[1].id.as_str())?["bandwidth_bps"].as_u64()
    });
    let Some(bps) = measured else {
        dump_logs(&peers);
        panic!("the slow link was never measured");
    };
    eprintln!("1 Mbit/s link measured at {} kbit/s", bps / 1000);
    assert!((300_000..3_000_000).contains(&bps), "{bps} bit/s");

    // 10 s of an idle mesh: bytes on the link each way, and membership sampled throughout.
    let window = Duration::from_secs(10);
    let before = lab.link_counters(1);
    let started = Instant::now();
    let mut missing = 0;
    while started.elapsed() < window {
        if listed(&peers[0]).is_none_or(|rows| ids(&rows) != all) {
            missing += 1;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let after = lab.link_counters(1);
    let secs = started.elapsed().as_secs_f64();
    // The busier direction (each is shaped to 1 Mbit/s on its own).
    let bytes = (after.0 - before.0).max(after.1 - before.1);
    let share = bytes as f64 * 8.0 / secs / 1e6;
    let probes: u64 = peers
        .iter()
        .filter_map(|peer| peer.proc.as_ref())
        .map(|proc| proc.log_text().matches("bandwidth probe").count() as u64)
        .sum();
    eprintln!(
        "mesh traffic on the 1 Mbit/s link: {} and {} bytes each way in {secs:.1} s; the busier way \
         {:.1} % of its capacity ({probes} probes since start)",
        after.0 - before.0,
        after.1 - before.1,
        share * 100.0
    );
    assert_eq!(missing, 0, "the peer left the list {missing} times");
    if share >= 0.05 {
        dump_logs(&peers);
        panic!("mesh traffic took {:.1} % of the link", share * 100.0);
    }
    // The link answers promptly: a session handshake is not stuck behind probe traffic.
    let target = format!("{}@{}:{PORT}", peers[1].id, lab.node(peers[1].node).ip);
    let (out, took) = gleam_in(&lab, &peers[0], &["peers", "ping", &target]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    eprintln!("ping over the 1 Mbit/s link: {}", text(&out.stdout).trim());
    assert!(took < Duration::from_secs(3), "{took:?}");
}

/// Issue 10, item 4: a copy of a peer's config directory started on another device does not take over
/// the identity: the device that was there first keeps its place, and both devices say what happened.
#[test]
fn a_copied_identity_is_refused_and_reported_on_both_devices() {
    let Some(mut lab) = Lab::new() else { return };
    let mut peers = make_peers(&mut lab, 2, 2);
    start(&lab, &mut peers[0], "node0");
    start(&lab, &mut peers[1], "node1");
    let mut all: Vec<String> = peers.iter().map(|p| p.id.clone()).collect();
    all.sort();
    if wait_until_lists(&peers, &[0, 1], &all, Duration::from_secs(10)).is_none() {
        dump_logs(&peers);
        panic!("peers did not find each other");
    }
    // The copy: peer 1's identity and mesh secret on a third device.
    let node = lab.add_node();
    let dir = lab.config_dir("copy");
    for file in ["identity.key", "mesh.secret"] {
        std::fs::copy(peers[1].dir.join(file), dir.join(file)).expect("copy the config dir");
    }
    let mut copy = Peer {
        node,
        dir,
        id: peers[1].id.clone(),
        proc: None,
    };
    start(&lab, &mut copy, "copy");
    let original_ip = lab.node(peers[1].node).ip.clone();
    let copy_ip = lab.node(node).ip.clone();

    // For 5 s, peer 0 keeps listing the original, at the original's address.
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        let rows = listed(&peers[0]).expect("list");
        let row = rows.iter().find(|row| row["id"] == peers[1].id.as_str());
        let Some(row) = row else {
            dump_logs(&peers);
            panic!(
                "the original left peer 0's list after {:?}",
                started.elapsed()
            );
        };
        let addrs = row["addrs"].to_string();
        assert!(addrs.contains(&original_ip), "{row}");
        assert!(
            !addrs.contains(&copy_ip),
            "the copy's address is listed: {row}"
        );
        assert_eq!(row["host"], "node1", "{row}");
        std::thread::sleep(Duration::from_millis(300));
    }
    // Loud on both devices, and on the peer that settled it.
    let log0 = peers[0].proc.as_ref().expect("running").log_text();
    assert!(
        log0.contains("two devices present peer id"),
        "peer 0:\n{log0}"
    );
    let copy_log = copy.proc.as_ref().expect("running").log_text();
    assert!(
        copy_log.contains("ERROR")
            && copy_log.contains("another device already uses this device's identity"),
        "copy:\n{copy_log}"
    );
    let original_log = peers[1].proc.as_ref().expect("running").log_text();
    assert!(
        original_log.contains("using this device's identity")
            || original_log.contains("advertised from"),
        "original:\n{original_log}"
    );
    for (who, log) in [
        ("peer 0", &log0),
        ("copy", &copy_log),
        ("original", &original_log),
    ] {
        if let Some(line) = log
            .lines()
            .find(|l| l.contains("ERROR") || l.contains("WARN"))
        {
            eprintln!("{who}: {line}");
        }
    }
    let warnings = |peer: &Peer| {
        listed(peer)
            .and_then(|rows| rows.first().map(|row| row["warnings"].clone()))
            .unwrap_or(Value::Null)
    };
    let (copy_warning, original_warning) = (warnings(&copy), warnings(&peers[1]));
    assert!(
        copy_warning.to_string().contains("identity"),
        "{copy_warning}"
    );
    assert!(
        original_warning.to_string().contains("identity"),
        "{original_warning}"
    );
    let out = run_gleam(&copy.dir, &["peers", "list"]);
    assert!(
        text(&out.stderr).contains("warning:"),
        "{}",
        text(&out.stderr)
    );

    // The copy goes away: nothing changes for the original.
    copy.proc.as_mut().expect("running").kill();
    std::thread::sleep(Duration::from_secs(2));
    let rows = listed(&peers[0]).expect("list");
    assert_eq!(ids(&rows), all);
}

/// Issue 10, item 5: when one link slows down and another speeds up, the daemon's choice follows
/// within 2 s.
#[test]
fn a_link_change_shows_in_peer_choice_within_2_s() {
    let Some(mut lab) = Lab::new() else { return };
    let mut peers = make_peers(&mut lab, 3, 3);
    lab.shape(1, "20mbit");
    start_client_and_servers(&lab, &mut peers);
    let bytes = 100_000_000;
    let settled = wait_for(Duration::from_secs(20), || {
        let rows = listed(&peers[0])?;
        let slow = rows.iter().find(|row| row["id"] == peers[1].id.as_str())?;
        slow["bandwidth_bps"].as_u64()?;
        let best = best_of(&peers[0], bytes)?;
        (best["id"] == peers[2].id.as_str()).then_some(())
    });
    if settled.is_none() {
        dump_logs(&peers);
        panic!("peer 2 (bare link) never became the choice");
    }
    // Swap: peer 1's link becomes the fast one, peer 2's the slow one.
    lab.unshape(1);
    lab.shape(2, "20mbit");
    let changed = Instant::now();
    let followed = wait_for(Duration::from_secs(10), || {
        let best = best_of(&peers[0], bytes)?;
        (best["id"] == peers[1].id.as_str()).then(|| changed.elapsed())
    });
    let Some(took) = followed else {
        dump_logs(&peers);
        panic!("the choice did not follow the link change within 10 s");
    };
    eprintln!("peer choice followed the link change after {took:?}");
    assert!(took <= Duration::from_secs(2), "took {took:?}");
}

/// Whether a shim was built beside `gleam` (directly, or as a test dependency in `deps/`).
fn has_shim(exe_dir: &std::path::Path) -> bool {
    exe_dir.join("libgleamcuda.so").is_file()
        || exe_dir.join("deps").join("libgleamcuda.so").is_file()
}
