//! Two in-process daemons on loopback (no mDNS: one seeds the other): membership through the
//! control socket, CUDA sessions handed to the handler only after the mesh-secret proof, the
//! best-peer answer, and a graceful leave.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gleam_auth::proof::{AuthError, authenticate_as_client};
use gleam_auth::tls;
use gleam_auth::{Identity, MeshSecret, PeerId};
use gleam_mesh::control::{self, PeerRow};
use gleam_mesh::daemon::{Daemon, DaemonConfig, DeviceInfo, DeviceLoad, SessionHandler};
use gleam_mesh::select::JobHint;
use gleam_mesh::state::GpuSummary;
use tokio::sync::{mpsc, oneshot};

struct FakeGpu;

impl DeviceInfo for FakeGpu {
    fn gpus(&self) -> Vec<GpuSummary> {
        vec![GpuSummary {
            model: "Test GPU".into(),
            total_memory: 16 << 30,
            compute_capability: (8, 6),
            emulated: true,
        }]
    }

    fn load(&self) -> DeviceLoad {
        DeviceLoad {
            utilization: 0.25,
            free_memory: Some(12 << 30),
            queue_len: 1,
        }
    }
}

/// A device that only borrows.
struct NoGpu;

impl DeviceInfo for NoGpu {
    fn gpus(&self) -> Vec<GpuSummary> {
        Vec::new()
    }
}

struct Running {
    id: PeerId,
    addr: SocketAddr,
    socket: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

fn start(
    dir: &Path,
    secret: &MeshSecret,
    seeds: Vec<gleam_auth::PeerAddr>,
    handler: SessionHandler,
) -> Running {
    start_with_device(dir, secret, seeds, handler, Arc::new(FakeGpu))
}

fn start_with_device(
    dir: &Path,
    secret: &MeshSecret,
    seeds: Vec<gleam_auth::PeerAddr>,
    handler: SessionHandler,
    device: Arc<dyn DeviceInfo>,
) -> Running {
    let identity = Identity::load_or_create(dir).unwrap();
    let socket = dir.join("daemon.sock");
    let mut config = DaemonConfig::new(socket.clone());
    config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.mdns = false;
    config.seeds = seeds;
    config.host = dir.file_name().unwrap().to_string_lossy().into_owned();
    config.probe_interval = Duration::from_secs(1);
    let daemon = Daemon::bind(config, identity, secret.clone(), device, handler).unwrap();
    let (id, addr) = (daemon.peer_id(), daemon.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        daemon
            .run(async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    Running {
        id,
        addr,
        socket,
        stop: Some(stop),
        task,
    }
}

async fn list(socket: &Path) -> Vec<PeerRow> {
    let socket = socket.to_owned();
    tokio::task::spawn_blocking(move || control::list_peers(&socket).unwrap_or_default())
        .await
        .unwrap()
}

async fn wait_for_ids(socket: &Path, want: &[PeerId], timeout: Duration) -> Vec<PeerRow> {
    let deadline = Instant::now() + timeout;
    loop {
        let rows = list(socket).await;
        let mut ids: Vec<PeerId> = rows.iter().map(|row| row.id).collect();
        ids.sort();
        let mut want = want.to_vec();
        want.sort();
        if ids == want {
            return rows;
        }
        assert!(Instant::now() < deadline, "listed {ids:?}, want {want:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemons_join_serve_sessions_to_members_only_and_leave_gracefully() {
    let dirs = tempfile::tempdir().unwrap();
    let (dir_a, dir_b) = (dirs.path().join("a"), dirs.path().join("b"));
    let secret = MeshSecret::generate();

    let (sessions_tx, mut sessions) = mpsc::unbounded_channel();
    let handler_b: SessionHandler = Arc::new(move |conn: quinn::Connection, peer: PeerId| {
        let _ = sessions_tx.send((peer, conn));
    });
    let refuse_all: SessionHandler = Arc::new(|conn: quinn::Connection, _| {
        conn.close(1u32.into(), b"no");
    });
    let mut b = start(&dir_b, &secret, Vec::new(), handler_b);
    // A borrows only (no GPU of its own), so B is the one place to run work.
    let mut a = start_with_device(
        &dir_a,
        &secret,
        vec![gleam_auth::PeerAddr::new(b.id, [b.addr])],
        refuse_all,
        Arc::new(NoGpu),
    );

    // Both learn each other: A dialed B, B learns A from the link and from gossip.
    let rows = wait_for_ids(&a.socket, &[a.id, b.id], Duration::from_secs(3)).await;
    wait_for_ids(&b.socket, &[a.id, b.id], Duration::from_secs(3)).await;
    assert!(rows[0].is_self && rows[0].id == a.id);
    let row_b = rows.iter().find(|row| row.id == b.id).unwrap();
    assert_eq!(row_b.host, "b");
    assert_eq!(row_b.gpus[0].model, "Test GPU");
    assert_eq!(
        (row_b.free_memory, row_b.total_memory),
        (12 << 30, 16 << 30)
    );
    assert_eq!((row_b.utilization, row_b.queue_len), (0.25, 1));
    assert!(row_b.rtt_us.is_some());

    // A CUDA session from a member reaches B's handler, tagged with the client's id.
    let client_dir = dirs.path().join("client");
    let client = Identity::load_or_create(&client_dir).unwrap();
    let endpoint = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let config = tls::client_config(&client, b.id, tls::ALPN_CUDA).unwrap();
    let conn = endpoint
        .connect_with(config.clone(), b.addr, &tls::server_name(b.id))
        .unwrap()
        .await
        .unwrap();
    assert_eq!(authenticate_as_client(&conn, &secret).await.unwrap(), b.id);
    let (peer, served) = tokio::time::timeout(Duration::from_secs(3), sessions.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(peer, client.peer_id());
    // The session works end to end: the handler side answers on a stream.
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(b"cuInit").await.unwrap();
    send.finish().unwrap();
    let (mut s_send, mut s_recv) = served.accept_bi().await.unwrap();
    assert_eq!(s_recv.read_to_end(64).await.unwrap(), b"cuInit");
    s_send.write_all(b"CUDA_SUCCESS").await.unwrap();
    s_send.finish().unwrap();
    assert_eq!(recv.read_to_end(64).await.unwrap(), b"CUDA_SUCCESS");

    // B counts the session while it is open, and publishes the count.
    let deadline = Instant::now() + Duration::from_secs(3);
    while list(&a.socket)
        .await
        .iter()
        .find(|row| row.id == b.id)
        .map(|row| row.active_sessions)
        != Some(1)
    {
        assert!(Instant::now() < deadline, "A never saw B's session");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    conn.close(0u32.into(), b"done");

    // Without the secret: refused, and the handler never sees it.
    let outsider = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let conn = outsider
        .connect_with(config, b.addr, &tls::server_name(b.id))
        .unwrap()
        .await
        .unwrap();
    let err = authenticate_as_client(&conn, &MeshSecret::generate())
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::Refused { .. }), "{err}");
    assert!(
        tokio::time::timeout(Duration::from_millis(500), sessions.recv())
            .await
            .is_err()
    );

    // A picks B for a job (the only other member), with B's address first.
    let socket = a.socket.clone();
    let best = tokio::task::spawn_blocking(move || control::best_peer(&socket, JobHint::default()))
        .await
        .unwrap()
        .unwrap()
        .expect("a best peer");
    assert_eq!(best.id, b.id);
    assert_eq!(best.addrs[0], b.addr);

    // B leaves gracefully: A drops it at once (no failure detection needed).
    let left = Instant::now();
    b.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), &mut b.task)
        .await
        .unwrap()
        .unwrap();
    wait_for_ids(&a.socket, &[a.id], Duration::from_secs(2)).await;
    assert!(left.elapsed() < Duration::from_secs(2));
    assert!(!b.socket.exists(), "control socket left behind");

    a.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), a.task)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_second_daemon_on_the_same_socket_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let secret = MeshSecret::generate();
    let handler: SessionHandler = Arc::new(|_, _| {});
    let first = start(dir.path(), &secret, Vec::new(), handler.clone());
    let identity = Identity::load_or_create(dir.path()).unwrap();
    let mut config = DaemonConfig::new(first.socket.clone());
    config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.mdns = false;
    let err = Daemon::bind(config, identity, secret, Arc::new(FakeGpu), handler)
        .err()
        .unwrap();
    assert!(err.to_string().contains("already running"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_rejoins_and_its_new_run_replaces_the_old() {
    let dirs = tempfile::tempdir().unwrap();
    let (dir_a, dir_b) = (dirs.path().join("a"), dirs.path().join("b"));
    let secret = MeshSecret::generate();
    let handler: SessionHandler = Arc::new(|_, _| {});
    let mut b = start(&dir_b, &secret, Vec::new(), handler.clone());
    let mut a = start(
        &dir_a,
        &secret,
        vec![gleam_auth::PeerAddr::new(b.id, [b.addr])],
        handler.clone(),
    );
    wait_for_ids(&a.socket, &[a.id, b.id], Duration::from_secs(3)).await;

    // B stops, then comes back on the same address with the same identity (a reboot).
    b.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), &mut b.task)
        .await
        .unwrap()
        .unwrap();
    wait_for_ids(&a.socket, &[a.id], Duration::from_secs(2)).await;

    let identity = Identity::load_or_create(&dir_b).unwrap();
    let mut config = DaemonConfig::new(dir_b.join("daemon.sock"));
    config.listen = b.addr;
    config.mdns = false;
    let daemon =
        Daemon::bind(config, identity, secret.clone(), Arc::new(FakeGpu), handler).unwrap();
    assert_eq!(daemon.peer_id(), b.id);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        daemon
            .run(async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    // A keeps redialing its seed with a capped backoff; the new run is accepted despite the
    // old one having left.
    wait_for_ids(&a.socket, &[a.id, b.id], Duration::from_secs(8)).await;

    stop.send(()).unwrap();
    a.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), a.task)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_lone_peer_with_a_gpu_offers_itself_over_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let secret = MeshSecret::generate();
    let handler: SessionHandler =
        Arc::new(|conn: quinn::Connection, _| conn.close(1u32.into(), b"no"));
    let mut lone = start(dir.path(), &secret, Vec::new(), handler);
    let socket = lone.socket.clone();
    let best = tokio::task::spawn_blocking(move || control::best_peer(&socket, JobHint::default()))
        .await
        .unwrap()
        .unwrap()
        .expect("this device's own GPU");
    assert_eq!(best.id, lone.id);
    assert_eq!(best.addrs[0], lone.addr);
    lone.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), lone.task)
        .await
        .unwrap()
        .unwrap();
}

/// A program that runs on this device's GPU directly (`gleam run` when the daemon picks this device) is
/// counted as a session served for as long as its control connection stays open.
#[tokio::test]
async fn a_program_run_directly_on_this_gpu_counts_as_a_session_while_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let secret = MeshSecret::generate();
    let handler: SessionHandler =
        Arc::new(|conn: quinn::Connection, _| conn.close(1u32.into(), b"no"));
    let mut lone = start(dir.path(), &secret, Vec::new(), handler);
    let own_sessions = |rows: Vec<PeerRow>| {
        rows.iter()
            .find(|row| row.is_self)
            .map(|row| row.active_sessions)
    };
    assert_eq!(own_sessions(list(&lone.socket).await), Some(0));
    let socket = lone.socket.clone();
    let running = tokio::task::spawn_blocking(move || control::local_session(&socket))
        .await
        .unwrap()
        .expect("the daemon counts the run");
    // The daemon refreshes its own row every quarter second.
    let deadline = Instant::now() + Duration::from_secs(5);
    while own_sessions(list(&lone.socket).await) != Some(1) {
        assert!(Instant::now() < deadline, "the run is not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(running);
    let deadline = Instant::now() + Duration::from_secs(5);
    while own_sessions(list(&lone.socket).await) != Some(0) {
        assert!(Instant::now() < deadline, "the ended run is still counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    lone.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), lone.task)
        .await
        .unwrap()
        .unwrap();
}
