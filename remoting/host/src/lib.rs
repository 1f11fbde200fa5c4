//! Hosting sessions: one authenticated QUIC connection ↔ one session process.
//!
//! [`serve_connection`] accepts the client's command stream, starts a [`WorkerCommand`] (normally
//! `gleam session --backend X`) and relays frames between the stream and the process's stdin/stdout without
//! decoding them: it only checks each frame's lengths against the frame limits ([`gleam_protocol::frame`]). The process is killed when the
//! connection ends (so the driver frees all the session's GPU memory), and the connection is closed with a
//! reason when the process exits. One client never shares a process with another, and a malformed message
//! ends only its own session.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use quinn::VarInt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tracing::{debug, info, warn};

use gleam_protocol::frame::{FrameError, Scanner};
use gleam_ratelimit::RateLimit;
use gleam_server::worker::ExitReason;

/// Close code: the session ended normally (Goodbye, or the client finished its stream).
pub const CLOSE_ENDED: VarInt = VarInt::from_u32(0);
/// Close code: the client broke the framing (a frame over the limits) or sent a malformed request.
pub const CLOSE_PROTOCOL_VIOLATION: VarInt = VarInt::from_u32(0x4743_0001);
/// Close code: the session process failed (crashed, was killed, or its backend could not start).
pub const CLOSE_WORKER_FAILED: VarInt = VarInt::from_u32(0x4743_0002);
/// Close code: the session process could not be started.
pub const CLOSE_WORKER_START: VarInt = VarInt::from_u32(0x4743_0003);
/// Close code: the client opened no command stream in time.
pub const CLOSE_NO_STREAM: VarInt = VarInt::from_u32(0x4743_0004);

/// How long a client may take to open its command stream after authenticating.
const STREAM_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the last replies may take to reach the client after the session process exited.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// Relay buffer for replies.
const RELAY_BUFFER: usize = 1 << 20;
/// Received chunks (about a packet each) handed to the request pipe per `writev`.
const RELAY_CHUNKS: usize = 256;
/// Size asked for the session process's pipes.
const PIPE_SIZE: libc::c_int = 1 << 20;

/// Warnings about one connection (clients decide how often those happen): a few a minute, the rest
/// counted in the next one logged.
static CONNECTION_WARNINGS: RateLimit = RateLimit::new(20, Duration::from_secs(60));

/// The program that runs one session (`gleam session --backend X`).
#[derive(Clone, Debug)]
pub struct WorkerCommand {
    /// Executable path.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Variables set in its environment, on top of the server's own.
    pub env: Vec<(OsString, OsString)>,
}

/// Counters of one hosted session.
#[derive(Debug, Default)]
struct Traffic {
    from_client: AtomicU64,
    to_client: AtomicU64,
}

/// How the session ended, as reported to the client.
enum End {
    /// The connection closed (client left, or network failure): the worker is killed.
    ConnectionLost(quinn::ConnectionError),
    /// The client broke the framing.
    Protocol(String),
    /// The worker exited (status, or the error waiting for it).
    WorkerExited(std::io::Result<ExitStatus>),
}

/// Hosts one authenticated connection's CUDA session until it ends. Never panics on network input.
pub async fn serve_connection(
    conn: quinn::Connection,
    peer: impl std::fmt::Display,
    worker: WorkerCommand,
) {
    let started = Instant::now();
    let remote = conn.remote_address();
    let (send, recv) = match tokio::time::timeout(STREAM_TIMEOUT, conn.accept_bi()).await {
        Ok(Ok(streams)) => streams,
        Ok(Err(err)) => {
            debug!(%peer, %remote, error = %err, "connection ended before a session started");
            return;
        }
        Err(_) => {
            if let Some(suppressed) = CONNECTION_WARNINGS.admit() {
                warn!(%peer, %remote, suppressed, "client opened no session stream: closing");
            }
            conn.close(CLOSE_NO_STREAM, b"no session stream opened");
            return;
        }
    };

    let mut child = match spawn(&worker) {
        Ok(child) => child,
        Err(err) => {
            if let Some(suppressed) = CONNECTION_WARNINGS.admit() {
                warn!(%peer, program = %worker.program.display(), error = %err, suppressed,
                    "cannot start the session process");
            }
            conn.close(
                CLOSE_WORKER_START,
                b"server could not start a session process",
            );
            return;
        }
    };
    let pid = child.id().unwrap_or(0);
    info!(%peer, %remote, pid, "session started");
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        // Unreachable with piped stdio, but never worth a panic.
        conn.close(
            CLOSE_WORKER_START,
            b"server could not start a session process",
        );
        return;
    };

    grow_pipe(&stdin);
    grow_pipe(&stdout);
    let traffic = Arc::new(Traffic::default());
    let mut upload = tokio::spawn(relay_in(recv, stdin, traffic.clone()));
    let mut download = tokio::spawn(relay_out(stdout, send, traffic.clone()));

    let mut upload_done = false;
    let end = loop {
        // Biased, upload first: its failure is the most specific explanation of an end.
        tokio::select! {
            biased;
            result = &mut upload, if !upload_done => {
                upload_done = true;
                match result {
                    // The client finished its stream: stdin is closed, the worker ends by itself.
                    Ok((Ok(()), _)) => {}
                    // The worker's stdin (held in `_stdin`) closes only once the violation is recorded.
                    Ok((Err(RelayError::FrameTooLarge(err)), _stdin)) => {
                        break End::Protocol(format!("request {err}"));
                    }
                    // A reset stream or a broken pipe: the connection or the worker is going away and
                    // the other branches report why.
                    Ok((Err(err), _)) => debug!(%peer, error = %err, "request relay stopped"),
                    Err(err) => debug!(%peer, error = %err, "request relay task failed"),
                }
            }
            err = conn.closed() => break End::ConnectionLost(err),
            status = child.wait() => break End::WorkerExited(status),
        }
    };

    let (code, reason) = match end {
        End::ConnectionLost(err) => {
            kill(&mut child).await;
            (None, format!("connection closed: {err}"))
        }
        End::Protocol(why) => {
            conn.close(CLOSE_PROTOCOL_VIOLATION, why.as_bytes());
            kill(&mut child).await;
            (Some(CLOSE_PROTOCOL_VIOLATION), why)
        }
        End::WorkerExited(status) => {
            // Let the last replies (e.g. Goodbye's) reach the client before closing.
            if tokio::time::timeout(DRAIN_TIMEOUT, &mut download)
                .await
                .is_err()
            {
                debug!(%peer, "replies not drained in time");
            }
            let (code, why) = match status {
                Ok(status) => describe_exit(status),
                Err(err) => (CLOSE_WORKER_FAILED, format!("session process lost: {err}")),
            };
            conn.close(code, why.as_bytes());
            (Some(code), why)
        }
    };
    upload.abort();
    download.abort();
    let level_ok = code.is_none_or(|c| c == CLOSE_ENDED);
    let from_client = traffic.from_client.load(Ordering::Relaxed);
    let to_client = traffic.to_client.load(Ordering::Relaxed);
    let duration_ms = started.elapsed().as_millis() as u64;
    if level_ok {
        info!(%peer, %remote, pid, duration_ms, from_client, to_client, %reason, "session ended");
    } else if let Some(suppressed) = CONNECTION_WARNINGS.admit() {
        warn!(%peer, %remote, pid, duration_ms, from_client, to_client, %reason, suppressed,
            "session failed");
    }
}

fn spawn(worker: &WorkerCommand) -> std::io::Result<Child> {
    let mut command = Command::new(&worker.program);
    // SAFETY: the closure runs between fork and exec and only makes an async-signal-safe syscall.
    // If the server dies without killing its sessions (SIGKILL), the kernel kills them. (The signal is
    // tied to the forking thread: a tokio worker thread, which lives as long as the runtime.)
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command
        .args(&worker.args)
        .envs(worker.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        // If this task is dropped (server shutdown), the session process goes with it.
        .kill_on_drop(true)
        .spawn()
}

/// Pipes default to 64 KiB; a bulk copy then costs a context switch per 64 KiB. Ask for 1 MiB (the
/// unprivileged maximum by default); failure only costs speed.
fn grow_pipe(pipe: &impl std::os::fd::AsRawFd) {
    // SAFETY: F_SETPIPE_SZ on a descriptor we own; no memory is passed.
    let r = unsafe { libc::fcntl(pipe.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE) };
    if r < 0 {
        debug!(error = %std::io::Error::last_os_error(), "cannot grow the session pipe");
    }
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
            let close = match code {
                c if c == i32::from(gleam_server::worker::EXIT_MALFORMED)
                    || c == i32::from(gleam_server::worker::EXIT_FRAME_TOO_LARGE) =>
                {
                    CLOSE_PROTOCOL_VIOLATION
                }
                _ => CLOSE_WORKER_FAILED,
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

/// A relay direction stopped.
#[derive(Debug, thiserror::Error)]
enum RelayError {
    #[error("{0}")]
    FrameTooLarge(FrameError),
    #[error("reading the client stream: {0}")]
    Read(#[from] quinn::ReadError),
    #[error("writing the client stream: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("session process pipe: {0}")]
    Pipe(#[from] std::io::Error),
}

/// Client stream → worker stdin, checking frame lengths on the way. The received chunks go to the pipe
/// as they are, many per `writev`, without first being copied into a buffer of ours.
async fn relay_in(
    recv: quinn::RecvStream,
    mut stdin: ChildStdin,
    traffic: Arc<Traffic>,
) -> (Result<(), RelayError>, Option<ChildStdin>) {
    match relay_frames(recv, &mut stdin, traffic).await {
        // The client finished its stream: closing stdin tells the worker the client is done.
        Ok(()) => (Ok(()), None),
        // Stdin stays open until the caller has taken note of the failure: on EOF the worker would exit
        // cleanly, and that exit could be reported instead of, say, a protocol violation.
        Err(err) => (Err(err), Some(stdin)),
    }
}

async fn relay_frames(
    mut recv: quinn::RecvStream,
    stdin: &mut ChildStdin,
    traffic: Arc<Traffic>,
) -> Result<(), RelayError> {
    let mut frames = Scanner::new();
    let mut chunks: Vec<Bytes> = vec![Bytes::new(); RELAY_CHUNKS];
    while let Some(count) = recv.read_chunks(&mut chunks).await? {
        let received = &mut chunks[..count];
        let mut n = 0;
        for chunk in received.iter() {
            frames.feed(chunk).map_err(RelayError::FrameTooLarge)?;
            n += chunk.len();
        }
        write_all_chunks(stdin, received).await?;
        traffic.from_client.fetch_add(n as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// Writes every byte of `chunks` (consuming them) with vectored writes.
async fn write_all_chunks(stdin: &mut ChildStdin, chunks: &mut [Bytes]) -> std::io::Result<()> {
    let mut first = 0;
    while first < chunks.len() {
        let slices: Vec<std::io::IoSlice<'_>> = chunks[first..]
            .iter()
            .map(|c| std::io::IoSlice::new(c))
            .collect();
        let mut written = stdin.write_vectored(&slices).await?;
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while written > 0 {
            let chunk = &mut chunks[first];
            let take = written.min(chunk.len());
            chunk.advance(take);
            written -= take;
            if chunk.is_empty() {
                first += 1;
            }
        }
        while first < chunks.len() && chunks[first].is_empty() {
            first += 1;
        }
    }
    Ok(())
}

/// Worker stdout → client stream: whatever the worker wrote since the last read goes out in one write,
/// handed to quinn as it is (no copy into quinn's own buffer).
async fn relay_out(
    mut stdout: ChildStdout,
    mut send: quinn::SendStream,
    traffic: Arc<Traffic>,
) -> Result<(), RelayError> {
    let mut buf = BytesMut::new();
    loop {
        // Reuses the block while quinn has released what was sent from it, else starts a new one.
        if buf.capacity() < RELAY_BUFFER / 4 {
            buf.reserve(RELAY_BUFFER);
        }
        let n = stdout.read_buf(&mut buf).await?;
        if n == 0 {
            break;
        }
        send.write_chunk(buf.split().freeze()).await?;
        traffic.to_client.fetch_add(n as u64, Ordering::Relaxed);
    }
    // The worker is done: finish the stream and wait until the client has it all (or gave up).
    let _ = send.finish();
    let _ = send.stopped().await;
    Ok(())
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
        assert!(why.contains("malformed"), "{why}");
        let (code, why) = describe_exit(ExitStatus::from_raw(9));
        assert_eq!(code, CLOSE_WORKER_FAILED);
        assert!(why.contains("signal 9"), "{why}");
    }
}
