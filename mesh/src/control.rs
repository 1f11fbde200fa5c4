//! The local control API of the daemon: a Unix socket, one JSON [`Request`] per connection
//! answered by one JSON [`Response`], each a single line.
//!
//! `gleam peers list` sends [`Request::List`]; `gleam run` without `--peer` sends
//! [`Request::Best`]. The client side ([`request`], [`best_peer`]) is blocking and needs no async
//! runtime, so the shim and small tools can use it too.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::select::JobHint;
use crate::state::{CacheDigest, GpuSummary};
use gleam_auth::identity::PeerId;

/// A request to the daemon.
#[derive(Clone, Debug, Deserialize, PartialEq, Serialize)]
#[serde(tag = "request", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Request {
    /// Every live member, this device included.
    List,
    /// The best peer for a job.
    Best {
        /// What the job needs.
        hint: JobHint,
    },
    /// A program of this device runs on this device's GPU directly, on NVIDIA's driver (the best peer
    /// was this device): the daemon counts it as a session it serves for as long as the connection that
    /// asked stays open ([`local_session`]).
    LocalSession,
}

/// The daemon's answer.
#[derive(Clone, Debug, Deserialize, PartialEq, Serialize)]
#[serde(tag = "response", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Response {
    /// Answer to [`Request::List`].
    Peers {
        /// One row per member, this device first.
        peers: Vec<PeerRow>,
    },
    /// Answer to [`Request::Best`]; `None` when no peer can take the job.
    Best {
        /// The choice.
        best: Option<BestPeer>,
    },
    /// Answer to [`Request::LocalSession`]: counted until the connection closes.
    LocalSession,
    /// The request failed.
    Error {
        /// Why.
        message: String,
    },
}

/// One member as `gleam peers list` shows it.
#[derive(Clone, Debug, Deserialize, PartialEq, Serialize)]
pub struct PeerRow {
    /// The peer.
    pub id: PeerId,
    /// Whether this row is the local device.
    pub is_self: bool,
    /// Host name it reports.
    pub host: String,
    /// Its GPUs.
    pub gpus: Vec<GpuSummary>,
    /// Free device memory, bytes.
    pub free_memory: u64,
    /// Total device memory, bytes.
    pub total_memory: u64,
    /// GPU utilization, 0.0 to 1.0.
    pub utilization: f32,
    /// CUDA sessions it serves now.
    pub active_sessions: u32,
    /// Jobs waiting for its GPU.
    pub queue_len: u32,
    /// Smoothed RTT from this device, microseconds (`None` for ourselves or not connected).
    pub rtt_us: Option<u32>,
    /// Probed bandwidth from this device, bits per second (`None` until measured).
    pub bandwidth_bps: Option<u64>,
    /// Recent loss on the link from this device, 0.0 to 1.0.
    pub loss: f32,
    /// Its cache summary.
    pub cache: CacheDigest,
    /// Addresses it can be reached at from this device, best first (link-local ones with this
    /// device's interface).
    pub addrs: Vec<SocketAddr>,
    /// Problems the daemon wants its user to see (only on this device's own row; e.g. another device
    /// using this device's identity).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// Where to run a job.
#[derive(Clone, Debug, Deserialize, PartialEq, Serialize)]
pub struct BestPeer {
    /// The chosen peer (pin it with [`gleam_auth::tls::client_config`]).
    pub id: PeerId,
    /// Its addresses, best first: the one this daemon is connected through, then every other (link-local
    /// ones with this device's interface). Try them all.
    pub addrs: Vec<SocketAddr>,
    /// Expected completion time of the job there, seconds (a ranking figure, not a prediction).
    pub expected_secs: f64,
    /// The host name it reports.
    #[serde(default)]
    pub host: String,
    /// Smoothed RTT from this device, microseconds (`None` for this device itself).
    #[serde(default)]
    pub rtt_us: Option<u32>,
    /// Bandwidth from this device, bits per second (`None` until measured, or for this device).
    #[serde(default)]
    pub bandwidth_bps: Option<u64>,
    /// Whether its GPU is Gleam's emulated one (kernels interpreted on the CPU).
    #[serde(default)]
    pub emulated: bool,
    /// Whether it is this device.
    #[serde(default)]
    pub is_self: bool,
    /// Recent loss on the link from this device, 0.0 to 1.0 (0 for this device).
    #[serde(default)]
    pub loss: f32,
}

/// The control socket: `$GLEAM_CONFIG_DIR/daemon.sock` when that variable is set, else
/// `$XDG_RUNTIME_DIR/gleam/daemon.sock`, else `daemon.sock` in the default config directory.
pub fn default_socket_path() -> Result<PathBuf, gleam_auth::identity::ConfigDirError> {
    let non_empty = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
    if let Some(dir) = non_empty("GLEAM_CONFIG_DIR") {
        return Ok(PathBuf::from(dir).join(SOCKET_NAME));
    }
    if let Some(dir) = non_empty("XDG_RUNTIME_DIR") {
        return Ok(PathBuf::from(dir).join("gleam").join(SOCKET_NAME));
    }
    Ok(gleam_auth::identity::default_config_dir()?.join(SOCKET_NAME))
}

/// Where the system service (`contrib/gleam-peer.service`) listens; users in group `gleam` may talk
/// to it.
pub const SYSTEM_SOCKET: &str = "/run/gleam/daemon.sock";

/// `preferred` when a daemon could be there (the socket exists), else the system service's socket when
/// that exists, else `preferred` (so the error names the place the user expects).
pub fn socket_or_system(preferred: PathBuf) -> PathBuf {
    let system = Path::new(SYSTEM_SOCKET);
    // A socket we may not even look at is still the one to name: the error then says why.
    let system_there = match std::fs::metadata(system) {
        Ok(_) => true,
        Err(err) => err.kind() == std::io::ErrorKind::PermissionDenied,
    };
    match preferred.exists() || !system_there {
        true => preferred,
        false => system.to_owned(),
    }
}

/// What to do about a failed connection to the daemon's socket.
fn connect_hint(path: &Path, err: &std::io::Error) -> &'static str {
    match err.kind() {
        std::io::ErrorKind::PermissionDenied if path.starts_with("/run/gleam") => {
            "; the system service's socket is for group `gleam`: `sudo usermod -aG gleam $USER`, then log \
             in again"
        }
        std::io::ErrorKind::PermissionDenied => "",
        _ => " (is `gleam peer` running?)",
    }
}

/// Sends one request to the daemon listening on `socket` and waits for its answer.
pub fn request(socket: &Path, request: &Request) -> Result<Response, ControlError> {
    exchange(socket, request).map(|(response, _)| response)
}

/// Sends one request and reads the answer; returns the connection with it.
fn exchange(socket: &Path, request: &Request) -> Result<(Response, UnixStream), ControlError> {
    let stream = UnixStream::connect(socket).map_err(|source| ControlError::Connect {
        path: socket.to_owned(),
        source,
    })?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .map_err(ControlError::Io)?;
    stream
        .set_write_timeout(Some(TIMEOUT))
        .map_err(ControlError::Io)?;
    let mut line = serde_json::to_vec(request).map_err(ControlError::Json)?;
    line.push(b'\n');
    (&stream).write_all(&line).map_err(ControlError::Io)?;
    let mut reader = BufReader::new((&stream).take(MAX_LINE));
    let mut answer = String::new();
    reader.read_line(&mut answer).map_err(ControlError::Io)?;
    if answer.is_empty() {
        return Err(ControlError::Closed);
    }
    let response = serde_json::from_str(&answer).map_err(ControlError::Json)?;
    Ok((response, stream))
}

/// Asks the daemon for the best peer for a job (what `gleam run` does without `--peer`).
pub fn best_peer(socket: &Path, hint: JobHint) -> Result<Option<BestPeer>, ControlError> {
    match request(socket, &Request::Best { hint })? {
        Response::Best { best } => Ok(best),
        Response::Error { message } => Err(ControlError::Daemon(message)),
        _ => Err(ControlError::Unexpected),
    }
}

/// Tells the daemon that a program of this device runs on its GPU directly; the daemon counts the
/// session until the returned guard is dropped (or this process ends).
pub fn local_session(socket: &Path) -> Result<LocalSession, ControlError> {
    let (response, stream) = exchange(socket, &Request::LocalSession)?;
    match response {
        Response::LocalSession => {
            // The daemon writes nothing more; the connection only has to stay open.
            stream.set_read_timeout(None).map_err(ControlError::Io)?;
            Ok(LocalSession { _stream: stream })
        }
        Response::Error { message } => Err(ControlError::Daemon(message)),
        _ => Err(ControlError::Unexpected),
    }
}

/// A session the daemon counts while this lives (see [`local_session`]).
#[derive(Debug)]
pub struct LocalSession {
    _stream: UnixStream,
}

/// Asks the daemon for the member list.
pub fn list_peers(socket: &Path) -> Result<Vec<PeerRow>, ControlError> {
    match request(socket, &Request::List)? {
        Response::Peers { peers } => Ok(peers),
        Response::Error { message } => Err(ControlError::Daemon(message)),
        _ => Err(ControlError::Unexpected),
    }
}

/// Talking to the daemon failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The daemon hung up without answering.
    #[error("the daemon closed the connection without answering")]
    Closed,
    /// No daemon listens on the socket.
    #[error("cannot reach the Gleam daemon at {}{}", path.display(), connect_hint(path, source))]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The daemon answered with an error.
    #[error("daemon: {0}")]
    Daemon(String),
    /// Reading or writing the socket failed (or timed out).
    #[error("talking to the Gleam daemon over its control socket failed")]
    Io(#[source] std::io::Error),
    /// A message was not valid JSON of the expected shape.
    #[error("the Gleam daemon's answer is not what this gleam expects (same version on both?)")]
    Json(#[source] serde_json::Error),
    /// The daemon answered a different question.
    #[error("unexpected answer from the daemon")]
    Unexpected,
}

/// Longest accepted line, either way.
pub const MAX_LINE: u64 = 1 << 20;
const SOCKET_NAME: &str = "daemon.sock";
const TIMEOUT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_responses_round_trip_as_json_lines() {
        let best = Request::Best {
            hint: JobHint {
                bytes: 1,
                compute_secs: 2.0,
                memory: 3,
            },
        };
        let text = serde_json::to_string(&best).unwrap();
        assert_eq!(
            text,
            r#"{"request":"best","hint":{"bytes":1,"compute_secs":2.0,"memory":3}}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), best);
        assert_eq!(
            serde_json::to_string(&Request::List).unwrap(),
            r#"{"request":"list"}"#
        );
        let response = Response::Best { best: None };
        let text = serde_json::to_string(&response).unwrap();
        assert_eq!(serde_json::from_str::<Response>(&text).unwrap(), response);
    }

    #[test]
    fn no_daemon_is_a_clear_error_that_says_the_os_error_once() {
        let dir = tempfile::tempdir().unwrap();
        let err = list_peers(&dir.path().join("daemon.sock")).unwrap_err();
        assert!(matches!(err, ControlError::Connect { .. }), "{err}");
        assert!(err.to_string().contains("gleam peer"));
        // The cause is the source, not also part of the message: `{err:#}`-style chains say it once.
        let chain = gleam_auth::Chain(&err).to_string();
        assert_eq!(chain.matches("os error 2").count(), 1, "{chain}");
    }
}
