//! `gleam-host`: serving CUDA sessions over QUIC, one process per client session.
//!
//! * [`serve_connection`] (the peer's side): on an authenticated connection (`gleam serve`, `gleam peer`),
//!   the client asks for a session ([`Control::Open`]); the peer starts a session process
//!   ([`SessionCommand`], normally `gleam session`), which listens on an endpoint of its own, and answers
//!   with its port and a one-time token ([`Control::Offer`]). The client connects to the session process
//!   directly: no relay in the data path. This connection stays open as the session's lifeline: when the
//!   session process dies abnormally it is closed with the reason, so the client knows at once.
//! * [`process`]: the session process itself: its endpoint, the client's lanes (one QUIC stream per CUDA
//!   stream), the scheduler that keeps CUDA's cross-stream order, and the executor thread running the
//!   session engine (`gleam-server`) on a backend.
//!
//! A session outlives a drop of its connections for its grace window ([`process`]): the client dials
//! this peer again, asks to resume it ([`Control::Resume`], with the session's token, over a connection
//! authenticated as the same peer) and is sent back to the same session process, or told at once that
//! the session is gone (it ended, or this peer restarted since). The new connection becomes the
//! session's lifeline; a lifeline that drops with the link does not end the session.
//!
//! One client never shares a process with another; when a client leaves (or its process dies) the driver
//! frees everything it held; a malformed message ends only its own session.

pub mod process;

use std::collections::HashMap;
use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use gleam_protocol::frame::{self, FrameReader};
use gleam_protocol::wire::{Control, PROTOCOL_VERSION};
use quinn::VarInt;
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::process::ExitReason;

/// Close code: the session ended normally (Goodbye, or the client left).
pub const CLOSE_ENDED: VarInt = VarInt::from_u32(0);
/// Close code: the client broke the protocol (a frame over the limits, a malformed or misordered request).
pub const CLOSE_PROTOCOL_VIOLATION: VarInt = VarInt::from_u32(0x4743_0001);
/// Close code: the session process failed (crashed, was killed, or its backend could not start).
pub const CLOSE_WORKER_FAILED: VarInt = VarInt::from_u32(0x4743_0002);
/// Close code: the session process could not be started.
pub const CLOSE_WORKER_START: VarInt = VarInt::from_u32(0x4743_0003);
/// Close code: the client asked for no session in time.
pub const CLOSE_NO_STREAM: VarInt = VarInt::from_u32(0x4743_0004);

/// How long this peer remembers why a session ended, to tell a client that comes back to resume it.
pub const ENDED_MEMORY: Duration = Duration::from_secs(120);
/// How long a client may take to ask for a session after authenticating.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a session process may take to announce its endpoint.
const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(10);

/// The program that runs one session (`gleam session --backend X --config-dir D`). The peer adds
/// `--client <peer id> --bind <address>`.
#[derive(Clone, Debug)]
pub struct SessionCommand {
    /// Executable path.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Variables set in its environment, on top of the server's own.
    pub env: Vec<(OsString, OsString)>,
}

/// Serves one authenticated connection's session until it ends. Never panics on network input.
pub async fn serve_connection(
    conn: quinn::Connection,
    peer: gleam_auth::identity::PeerId,
    command: SessionCommand,
) {
    let started = Instant::now();
    let remote = conn.remote_address();
    let (mut send, mut recv) = match tokio::time::timeout(OPEN_TIMEOUT, conn.accept_bi()).await {
        Ok(Ok(streams)) => streams,
        Ok(Err(err)) => {
            debug!(%peer, %remote, error = %err, "connection ended before a session started");
            return;
        }
        Err(_) => {
            warn!(%peer, %remote, "client asked for no session: closing");
            conn.close(CLOSE_NO_STREAM, b"no session asked for");
            return;
        }
    };
    let refuse = |reason: String| Control::Refused {
        protocol: PROTOCOL_VERSION,
        reason,
    };
    let reply = match read_control(&mut recv).await {
        Ok(Control::Open { protocol }) if protocol == PROTOCOL_VERSION => None,
        Ok(Control::Resume {
            protocol,
            session,
            token,
        }) if protocol == PROTOCOL_VERSION => {
            resume(conn, peer, send, session, &token).await;
            return;
        }
        Ok(Control::Open { protocol } | Control::Resume { protocol, .. }) => {
            warn!(%peer, client_protocol = protocol, server_protocol = PROTOCOL_VERSION,
                "client speaks another protocol version: upgrade the older side");
            Some(refuse(format!(
                "this peer speaks Gleam protocol {PROTOCOL_VERSION}, the client {protocol}: \
                 update Gleam on the older device"
            )))
        }
        Ok(_) => Some(refuse("expected a session request".into())),
        Err(err) => {
            debug!(%peer, %remote, error = %err, "no session request");
            conn.close(CLOSE_PROTOCOL_VIOLATION, err.as_bytes());
            return;
        }
    };
    if let Some(refusal) = reply {
        let _ = write_control(&mut send, &refusal).await;
        let _ = send.finish();
        let _ = tokio::time::timeout(Duration::from_secs(1), conn.closed()).await;
        return;
    }

    // The session process listens on the address the client reached this peer on (the client dials it
    // there, at the session's port), or on every address of the client's family where that address is
    // unknown or needs a scope (link-local IPv6).
    let bind = match (conn.local_ip(), remote) {
        (Some(IpAddr::V4(ip)), SocketAddr::V4(_)) => ip.to_string(),
        (Some(IpAddr::V6(ip)), SocketAddr::V6(_)) if !ip.is_unicast_link_local() => ip.to_string(),
        (_, SocketAddr::V4(_)) => "0.0.0.0".to_owned(),
        (_, SocketAddr::V6(_)) => "::".to_owned(),
    };
    let mut child = match spawn(&command, peer, &bind) {
        Ok(child) => child,
        Err(err) => {
            warn!(%peer, program = %command.program.display(), error = %err, "cannot start the session process");
            let _ = write_control(
                &mut send,
                &refuse("the peer could not start a session process".into()),
            )
            .await;
            conn.close(
                CLOSE_WORKER_START,
                b"server could not start a session process",
            );
            return;
        }
    };
    let pid = child.id().unwrap_or(0);
    let offer = tokio::time::timeout(ANNOUNCE_TIMEOUT, read_announce(&mut child)).await;
    let (port, token, grace) = match offer {
        Ok(Ok(offer)) => offer,
        Ok(Err(err)) => {
            let status = child.wait().await;
            let why = status.map_or_else(|e| e.to_string(), |s| describe_exit(s).1);
            warn!(%peer, pid, error = %err, %why, "the session process did not start");
            let _ = write_control(
                &mut send,
                &refuse(format!("the session process did not start: {why}")),
            )
            .await;
            conn.close(CLOSE_WORKER_START, why.as_bytes());
            return;
        }
        Err(_) => {
            kill(&mut child).await;
            let _ = write_control(
                &mut send,
                &refuse("the session process did not start in time".into()),
            )
            .await;
            conn.close(CLOSE_WORKER_START, b"session process did not start in time");
            return;
        }
    };
    let session: u64 = rand::random();
    let offer = Control::Offer {
        port,
        token,
        session,
        grace_ms: grace.as_millis() as u64,
    };
    let (lifelines_tx, mut lifelines) = mpsc::channel(2);
    lock_sessions().insert(
        session,
        Entry {
            peer,
            token,
            offer: offer.clone(),
            state: EntryState::Live(lifelines_tx),
        },
    );
    if write_control(&mut send, &offer).await.is_err() {
        // The client left: the session process exits when nobody attaches.
        debug!(%peer, "client gone before the offer");
    }
    info!(%peer, %remote, pid, port, "session started");

    // The lifeline reports how the session process ended. It may drop with the link (the session
    // process then waits for the client for its grace window, and decides); a client that resumes hands
    // in a new one.
    let mut conn = conn;
    let mut lifeline_up = true;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            err = conn.closed(), if lifeline_up => {
                debug!(%peer, error = %err, "lifeline closed");
                lifeline_up = false;
            }
            Some(new) = lifelines.recv() => {
                conn.close(process::CLOSE_SUPERSEDED, b"the session resumed on a new connection");
                conn = new;
                lifeline_up = true;
            }
        }
    };
    let (code, reason) = match status {
        Ok(status) => describe_exit(status),
        Err(err) => (CLOSE_WORKER_FAILED, format!("session process lost: {err}")),
    };
    let idle = {
        let mut sessions = lock_sessions();
        if let Some(entry) = sessions.get_mut(&session) {
            entry.state = EntryState::Ended(reason.clone());
        }
        !sessions
            .values()
            .any(|entry| matches!(entry.state, EntryState::Live(_)))
    };
    if idle {
        return_free_memory();
    }
    tokio::spawn(async move {
        tokio::time::sleep(ENDED_MEMORY).await;
        lock_sessions().remove(&session);
    });
    conn.close(code, reason.as_bytes());
    let duration_ms = started.elapsed().as_millis() as u64;
    if code == CLOSE_ENDED {
        info!(%peer, %remote, pid, duration_ms, %reason, "session ended");
    } else {
        warn!(%peer, %remote, pid, duration_ms, %reason, "session failed");
    }
}

/// The sessions this peer runs (and recently ran), by [`Control::Offer::session`]: where a client that
/// lost its connections is sent back to. One table per process (`gleam serve` and `gleam peer` each
/// serve connections through [`serve_connection`]).
static SESSIONS: LazyLock<Mutex<HashMap<u64, Entry>>> = LazyLock::new(Mutex::default);

struct Entry {
    /// The peer that opened it (only it may resume it).
    peer: gleam_auth::identity::PeerId,
    token: [u8; 32],
    /// What the client was told at the start (the same answer resumes it).
    offer: Control,
    state: EntryState,
}

enum EntryState {
    /// Its process runs; a resumed client's connection becomes its lifeline through this.
    Live(mpsc::Sender<quinn::Connection>),
    /// It ended, for this reason.
    Ended(String),
}

/// Gives the memory the allocator keeps from freed allocations back to the system, once the peer serves
/// no session: a lending device idles for hours between jobs, and glibc's per-thread arenas would keep
/// the high-water mark of the busiest moment (tens of MB after thousands of sessions) resident.
fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas; it is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn lock_sessions() -> std::sync::MutexGuard<'static, HashMap<u64, Entry>> {
    // A poisoned lock only means a thread panicked while holding it; the table stays consistent.
    SESSIONS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A client asks to resume `session` after a drop: it is sent back to the session's process if the
/// session lives and is its own, else told at once that it is gone.
async fn resume(
    conn: quinn::Connection,
    peer: gleam_auth::identity::PeerId,
    mut send: quinn::SendStream,
    session: u64,
    token: &[u8; 32],
) {
    let answer = {
        let sessions = lock_sessions();
        match sessions.get(&session) {
            Some(entry) if entry.peer == peer && process::tokens_match(&entry.token, token) => {
                match &entry.state {
                    EntryState::Live(lifelines) => Ok((entry.offer.clone(), lifelines.clone())),
                    EntryState::Ended(why) => Err(format!("the session ended: {why}")),
                }
            }
            // Another peer's session, a wrong token, or one this process never ran (it restarted):
            // the same answer for all, so nothing is learnt about other sessions.
            _ => Err("this peer has no such session (it ended, or the peer restarted)".to_owned()),
        }
    };
    match answer {
        Ok((offer, lifelines)) => {
            if write_control(&mut send, &offer).await.is_ok() {
                info!(%peer, remote = %conn.remote_address(), session, "client resumes its session");
                let _ = lifelines.send(conn).await;
            }
        }
        Err(reason) => {
            info!(%peer, remote = %conn.remote_address(), session, %reason, "nothing to resume");
            let _ = write_control(&mut send, &Control::Gone { reason }).await;
            let _ = send.finish();
            let _ = tokio::time::timeout(Duration::from_secs(1), conn.closed()).await;
        }
    }
}

async fn read_control(recv: &mut quinn::RecvStream) -> Result<Control, String> {
    let mut frames = FrameReader::new();
    loop {
        if let Some(frame) = frames.next_frame().map_err(|e| e.to_string())? {
            return frame
                .decode()
                .map_err(|e| format!("malformed session request: {e}"));
        }
        match recv.read_chunk(64 << 10, true).await {
            Ok(Some(chunk)) => frames.feed(&chunk.bytes),
            Ok(None) => return Err("stream ended before the session request".into()),
            Err(err) => return Err(err.to_string()),
        }
    }
}

async fn write_control(send: &mut quinn::SendStream, msg: &Control) -> Result<(), String> {
    let mut out = Vec::new();
    frame::encode(msg, &[], &mut out).map_err(|e| e.to_string())?;
    send.write_all(&out).await.map_err(|e| e.to_string())
}

fn spawn(
    command: &SessionCommand,
    client: gleam_auth::identity::PeerId,
    bind: &str,
) -> std::io::Result<Child> {
    let mut cmd = Command::new(&command.program);
    // SAFETY: the closure runs between fork and exec and only makes an async-signal-safe syscall.
    // If the server dies without killing its sessions (SIGKILL), the kernel kills them. (The signal is
    // tied to the forking thread: a tokio worker thread, which lives as long as the runtime.)
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.args(&command.args)
        .arg("--client")
        .arg(client.to_string())
        .arg("--bind")
        .arg(bind)
        .envs(command.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        // If this task is dropped (server shutdown), the session process goes with it.
        .kill_on_drop(true)
        .spawn()
}

/// Reads the session process's announcement: `<port> <token in hex> <grace in ms>`.
async fn read_announce(child: &mut Child) -> Result<(u16, [u8; 32], Duration), String> {
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| "no pipe to the session process".to_owned())?;
    let mut line = String::new();
    let mut reader = tokio::io::BufReader::new(stdout);
    reader
        .read_line(&mut line)
        .await
        .map_err(|e| e.to_string())?;
    parse_announce(&line).ok_or_else(|| format!("unexpected announcement {line:?}"))
}

/// Parses `<port> <64 hex digits> <grace in ms>`.
fn parse_announce(line: &str) -> Option<(u16, [u8; 32], Duration)> {
    let mut words = line.split_whitespace();
    let (port, token, grace) = (words.next()?, words.next()?, words.next()?);
    if words.next().is_some() {
        return None;
    }
    let port = port.parse().ok()?;
    let grace = Duration::from_millis(grace.parse().ok()?);
    let mut bytes = [0u8; 32];
    if token.len() != 64 {
        return None;
    }
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(token.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some((port, bytes, grace))
}

/// The announcement line for `port`, `token` and the grace window (what [`read_announce`] parses).
pub fn announcement(port: u16, token: &[u8; 32], grace: Duration) -> String {
    let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
    format!("{port} {hex} {}", grace.as_millis())
}

async fn kill(child: &mut Child) {
    if let Err(err) = child.kill().await {
        debug!(error = %err, "session process already gone");
    }
}

/// The close code and reason for a finished session process.
fn describe_exit(status: ExitStatus) -> (VarInt, String) {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(0), _) => (CLOSE_ENDED, "session ended".to_owned()),
        (Some(code), _) => {
            let why = ExitReason::describe_code(code);
            let close = if code == i32::from(process::EXIT_PROTOCOL) {
                CLOSE_PROTOCOL_VIOLATION
            } else {
                CLOSE_WORKER_FAILED
            };
            (close, format!("{why} (session process exit code {code})"))
        }
        (None, Some(signal)) => (
            CLOSE_WORKER_FAILED,
            format!("session process killed by signal {signal}"),
        ),
        (None, None) => (CLOSE_WORKER_FAILED, "session process ended".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_become_close_reasons() {
        use std::os::unix::process::ExitStatusExt;
        let (code, why) = describe_exit(ExitStatus::from_raw(0));
        assert_eq!((code, why.as_str()), (CLOSE_ENDED, "session ended"));
        let (code, why) = describe_exit(ExitStatus::from_raw(3 << 8));
        assert_eq!(code, CLOSE_PROTOCOL_VIOLATION);
        assert!(why.contains("protocol"), "{why}");
        let (code, why) = describe_exit(ExitStatus::from_raw(9));
        assert_eq!(code, CLOSE_WORKER_FAILED);
        assert!(why.contains("signal 9"), "{why}");
    }

    #[test]
    fn announcements_round_trip() {
        let token: [u8; 32] = std::array::from_fn(|i| i as u8 * 7);
        let grace = Duration::from_millis(15_000);
        let line = announcement(4748, &token, grace);
        assert_eq!(
            parse_announce(&format!("{line}\n")),
            Some((4748, token, grace))
        );
        assert_eq!(parse_announce("4748 abc"), None);
        assert_eq!(parse_announce("port 00"), None);
        assert_eq!(parse_announce(""), None);
    }
}
