//! The process's session with its GPU peer: opened once by `cuInit`, shared by every thread.
//!
//! `cuInit` reads `GLEAM_PEER` (`<peer-id>@host:port[,host:port...]`, set by `gleam run`; every address is
//! tried, see [`gleam_auth::PeerAddr`]) and `GLEAM_CONFIG_DIR` (this
//! device's identity and mesh secret), connects, and keeps the [`Session`] (or the failure, which every
//! later `cuInit` returns again, as a real driver does). A `fork()`ed child sees a different pid and is
//! refused with `CUDA_ERROR_NOT_INITIALIZED`: the connection belongs to the parent.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Once, OnceLock};
use std::time::Duration;

use gleam_auth::PeerAddr;
use gleam_auth::identity::{Identity, MeshSecret, default_config_dir};
use gleam_client::{Client, ClientError};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{DeviceInfo, Reply};

/// The session of this process.
#[derive(Debug)]
pub struct Session {
    /// The connection to the serving peer.
    pub client: Client,
    /// The process that opened it.
    pid: u32,
    /// Where the peer is, for messages.
    peer: String,
}

static SESSION: OnceLock<Result<Session, CUresult>> = OnceLock::new();
/// This process's pid, once read (0: not yet, or a fork since). Every call checks that the session is
/// its process's, and `getpid()` is a system call (glibc does not cache it): a fifth of the client's
/// CPU per launch went there. A child of `fork()` starts with 0 again (the handler below).
static PID: AtomicU32 = AtomicU32::new(0);
static ATFORK: Once = Once::new();

/// `std::process::id()`, without a system call after the first.
fn pid() -> u32 {
    match PID.load(Ordering::Relaxed) {
        0 => {
            ATFORK.call_once(|| {
                extern "C" fn forgotten_in_child() {
                    PID.store(0, Ordering::Relaxed);
                }
                // SAFETY: registers a handler that only stores to an atomic (async-signal-safe).
                unsafe { libc::pthread_atfork(None, None, Some(forgotten_in_child)) };
            });
            let pid = std::process::id();
            PID.store(pid, Ordering::Relaxed);
            pid
        }
        pid => pid,
    }
}
static LOST_REPORTED: AtomicBool = AtomicBool::new(false);
static FORK_REPORTED: AtomicBool = AtomicBool::new(false);

/// How long the process waits at exit for the peer to finish queued work before closing.
const GOODBYE_TIMEOUT: Duration = Duration::from_secs(2);

/// `cuInit`'s work: connects once; later calls return the first outcome.
pub fn init() -> Result<(), CUresult> {
    crate::state::init_logging();
    let outcome = SESSION.get_or_init(connect);
    match outcome {
        Ok(session) if session.pid != pid() => Err(forked()),
        Ok(_) => Ok(()),
        Err(err) => Err(*err),
    }
}

/// Makes `client` this process's session, in place of the one `cuInit` would open from `GLEAM_PEER`: for
/// harnesses that drive the C exports against a peer in their own process
/// ([`gleam_client::in_process`]). Not a C export. Fails (giving the client back) if `cuInit` already ran.
pub fn install(client: Client) -> Result<(), Box<Client>> {
    let session = Session {
        peer: format!("in-process ({})", client.hello().server),
        client,
        pid: pid(),
    };
    SESSION.set(Ok(session)).map_err(|refused| match refused {
        Ok(session) => Box::new(session.client),
        Err(_) => unreachable!("an Ok was offered"),
    })
}

/// The session, if `cuInit` succeeded in this process.
pub fn session() -> Result<&'static Session, CUresult> {
    match SESSION.get() {
        None => Err(CUresult::NOT_INITIALIZED),
        Some(Err(err)) => Err(*err),
        Some(Ok(session)) if session.pid != pid() => Err(forked()),
        Some(Ok(session)) => Ok(session),
    }
}

/// The session if one is up, without reporting anything (for answers that have an offline default).
pub fn session_if_up() -> Option<&'static Session> {
    match SESSION.get() {
        Some(Ok(session)) if session.pid == pid() => Some(session),
        _ => None,
    }
}

/// The device `ordinal` of the session.
pub fn device(ordinal: i32) -> Result<&'static DeviceInfo, CUresult> {
    let session = session()?;
    usize::try_from(ordinal)
        .ok()
        .and_then(|i| session.client.hello().devices.get(i))
        .ok_or(CUresult::INVALID_DEVICE)
}

/// Turns a session failure into the CUDA result the application sees; the first time, tells the user what
/// happened and what to do.
pub fn lost(err: ClientError) -> CUresult {
    if !LOST_REPORTED.swap(true, Ordering::AcqRel) {
        let peer = session_if_up().map_or("?", |s| s.peer.as_str());
        tracing::error!(%peer, reason = %err, "GPU session lost");
        eprintln!(
            "gleam: the session with GPU peer {peer} ended: {err}.\n\
             gleam: every CUDA call of this process now fails; check that the peer is running \
             (`gleam peers list`) and reachable, then run the program again."
        );
    }
    err.cuda_result()
}

/// A reply of the wrong kind: the server broke the protocol.
pub fn mismatch(call: &str, reply: &Reply) -> CUresult {
    tracing::error!(
        call,
        ?reply,
        "the server answered with the wrong kind of reply"
    );
    CUresult::UNKNOWN
}

/// At exit: lets the server finish and free everything, then closes the connection.
///
/// With `GLEAM_STATS=FILE`, writes what the session moved over the network to FILE as JSON (for
/// benchmarks: bytes on the wire, QUIC overhead included).
pub fn shutdown() {
    if let Some(session) = session_if_up() {
        session.client.close(GOODBYE_TIMEOUT);
        if let Some(path) = std::env::var_os("GLEAM_STATS") {
            let stats = session.client.wire_stats();
            let written = std::fs::write(&path, stats.to_json());
            if let Err(err) = written {
                tracing::warn!(path = %std::path::Path::new(&path).display(), error = %err, "cannot write GLEAM_STATS");
            }
        }
    }
}

fn forked() -> CUresult {
    if !FORK_REPORTED.swap(true, Ordering::AcqRel) {
        tracing::error!(
            "CUDA used in a fork()ed child of the process that initialized it; refused, as NVIDIA's driver \
             refuses it (use the 'spawn' start method)"
        );
    }
    CUresult::NOT_INITIALIZED
}

fn connect() -> Result<Session, CUresult> {
    let target = match std::env::var("GLEAM_PEER") {
        Ok(target) if !target.trim().is_empty() => target,
        _ => {
            eprintln!(
                "gleam: GLEAM_PEER is not set, so this libcuda has no GPU peer to use.\n\
                 gleam: run the program through `gleam run [--peer <peer-id>@HOST:PORT] -- PROGRAM`."
            );
            return Err(CUresult::NO_DEVICE);
        }
    };
    let target: PeerAddr = match target.parse() {
        Ok(parsed) => parsed,
        Err(why) => {
            eprintln!("gleam: GLEAM_PEER={target:?} is not <peer-id>@HOST:PORT: {why}");
            return Err(CUresult::NO_DEVICE);
        }
    };
    let peer = target.id;
    let dir = match default_config_dir() {
        Ok(dir) => dir,
        Err(err) => {
            eprintln!("gleam: {err}");
            return Err(CUresult::NO_DEVICE);
        }
    };
    let identity = match Identity::load_or_create(&dir) {
        Ok(identity) => identity,
        Err(err) => {
            eprintln!(
                "gleam: cannot load this device's identity from {}: {err}",
                dir.display()
            );
            return Err(CUresult::NO_DEVICE);
        }
    };
    let secret = match MeshSecret::load(&dir) {
        Ok(secret) => secret,
        Err(err) => {
            eprintln!(
                "gleam: no mesh secret in {}: {err}\ngleam: join the peer's mesh with `gleam mesh join CODE`.",
                dir.display()
            );
            return Err(CUresult::NO_DEVICE);
        }
    };
    match Client::connect_any(
        peer,
        &target.addrs,
        &identity,
        &secret,
        gleam_client::CONNECT_TIMEOUT,
    ) {
        Ok(client) => {
            let addr = client
                .peer_addr()
                .map_or_else(|| "?".to_owned(), |addr| addr.to_string());
            let hello = client.hello();
            tracing::info!(%peer, %addr, backend = %hello.backend, server = %hello.server,
                devices = hello.devices.len(), "connected to GPU peer");
            if hello.devices.is_empty() {
                eprintln!("gleam: GPU peer {peer} at {addr} offers no device");
                return Err(CUresult::NO_DEVICE);
            }
            Ok(Session {
                client,
                pid: pid(),
                peer: format!("{peer}@{addr}"),
            })
        }
        Err(err) => {
            eprintln!(
                "gleam: cannot use GPU peer {peer}: {err}\n\
                 gleam: CUDA reports no device to this program; check that `gleam serve`/`gleam peer` runs \
                 there and that both devices are in the same mesh."
            );
            Err(err.cuda_result())
        }
    }
}

/// Logs to stderr through `tracing`, filtered by `GLEAM_LOG` (default: warnings only). Nothing is logged
/// once the calling thread's thread-local storage is gone or the library is torn down
/// ([`crate::logging_safe`]): the CUDA runtime calls the driver from `exit()`.
pub fn init_logging() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("GLEAM_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        // Colour only on a terminal: the program's stderr is often a file or a pipe.
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
            && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        // Global filters only (no per-layer filter, which keeps thread-local state); the teardown check
        // is the outermost, so it runs first.
        let _ = tracing_subscriber::registry()
            .with(filter)
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(ansi)
                    .with_writer(std::io::stderr),
            )
            .with(tracing_subscriber::filter::filter_fn(|_| {
                crate::logging_safe()
            }))
            .try_init();
    });
}
