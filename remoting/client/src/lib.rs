//! `gleam-client`: the client side of a CUDA session with a serving peer.
//!
//! [`Client::connect_any`] dials the peer (TLS pinned to its [`PeerId`], then the mesh-secret proof) and asks
//! it for a session ([`Control::Open`]); the peer starts the session's own process and answers where it
//! listens ([`Control::Offer`]). The client connects there directly and attaches with the offered token:
//! no relay in the data path. The first connection stays open as the session's lifeline: if the session
//! process dies, the peer closes it with the reason.
//!
//! Requests travel on lanes ([`gleam_protocol::order`]): one QUIC stream per CUDA stream, plus the control
//! lane for everything else, so a long transfer on one stream never holds back another stream's calls.
//! A [`Sequencer`] numbers every request and works out what it must follow (per-lane order, barriers,
//! event records); the serving side's scheduler keeps exactly that order.
//!
//! Sending costs no thread hop: the calling thread encodes its frame and hands it to quinn itself
//! (quinn's driver then sends it). Fire-and-forget requests are coalesced per lane: they accumulate in the
//! lane's batch and the lane's writer task hands the batch to quinn as one chunk shortly after, so a burst
//! of launches costs one segment, not one per launch; a request that waits for its reply flushes its lane
//! at once. What quinn cannot take yet is bounded ([`BUFFER_LIMIT`]): past it, callers wait. Replies are
//! read by one task per lane and handed to the waiting thread through a [`slot::Slot`] (spin, then park).
//!
//! If the session is lost (QUIC idle timeout with keep-alives on, the session process died, a protocol
//! violation), every pending and later call fails with [`ClientError::Lost`] within seconds, never hangs.

mod signal;
mod slot;
pub mod upload;

use std::collections::HashMap;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use gleam_auth::identity::{Identity, MeshSecret, PeerId};
use gleam_auth::proof::{AuthError, authenticate_as_client};
use gleam_auth::tls::{ALPN_CUDA, TlsError, client_config};
use gleam_protocol::frame::{self, FrameError, FrameReader};
use gleam_protocol::order::{Lane, Sequencer};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{
    COPY_CHUNK, Call, ClientHello, Control, PROTOCOL_VERSION, Reply, ReplyFrame, Request,
    ServerHello, StreamOpen,
};
use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::slot::Slot;

/// How long [`Client::connect`] may take in all (handshake, authentication, session start, hello).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes the client holds that quinn has not taken yet (across lanes); past it, a submitting thread
/// waits for the network to catch up.
pub const BUFFER_LIMIT: usize = 32 << 20;
/// A lane's batch of fire-and-forget frames is handed to quinn at once when it reaches this size.
const BATCH_FLUSH: usize = 256 << 10;
/// QUIC application close code of an orderly client exit.
const CLOSE_CLIENT_EXIT: u32 = 0;

/// What the calling thread sent, for `gleam trace` (which classifies each driver call by it): one
/// thread-local byte set per request, read and reset by the shim around each call.
pub mod sent {
    use std::cell::Cell;

    /// A request without a reply was queued.
    pub const FIRE_AND_FORGET: u8 = 1;
    /// A request whose reply the caller waits for was queued.
    pub const WAITED: u8 = 2;

    thread_local! {
        static SENT: Cell<u8> = const { Cell::new(0) };
    }

    pub(crate) fn note(expects_reply: bool) {
        let bit = if expects_reply {
            WAITED
        } else {
            FIRE_AND_FORGET
        };
        let _ = SENT.try_with(|s| s.set(s.get() | bit));
    }

    /// What this thread sent since the last call (a combination of the bits above), and forget it.
    pub fn take() -> u8 {
        SENT.try_with(|s| s.replace(0)).unwrap_or(0)
    }
}

/// Why a session could not be established, or why it ended.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The local UDP endpoint could not be created.
    #[error("cannot open a local UDP socket: {0}")]
    Endpoint(String),
    /// The TLS configuration could not be built from this device's identity.
    #[error("TLS configuration: {0}")]
    Tls(Arc<TlsError>),
    /// The peer did not complete the QUIC/TLS handshake.
    #[error("cannot reach peer {peer} at {addr}: {reason}")]
    Unreachable {
        /// The peer dialled.
        peer: PeerId,
        /// Its address.
        addr: SocketAddr,
        /// What went wrong.
        reason: String,
    },
    /// The mesh-secret proof failed (the peer is in another mesh, or refused us).
    #[error("peer refused the session: {0}")]
    Auth(Arc<AuthError>),
    /// The whole connect sequence took longer than allowed.
    #[error("peer {peer} at {addr} did not answer within {timeout:?}")]
    Timeout {
        /// The peer dialled.
        peer: PeerId,
        /// Its address.
        addr: SocketAddr,
        /// The limit.
        timeout: Duration,
    },
    /// The peer speaks another protocol version.
    #[error(
        "protocol version mismatch: this client speaks {client}, the peer {server}; update Gleam on both"
    )]
    Version {
        /// Ours.
        client: u32,
        /// The peer's.
        server: u32,
    },
    /// The peer refused to start a session.
    #[error("the peer refused the session: {0}")]
    Refused(String),
    /// The peer broke the protocol (an undecodable frame, a reply to nothing, a wrong reply kind).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The session is over: the connection was lost or closed. Every later call fails the same way.
    #[error("the session with the GPU peer ended: {0}")]
    Lost(String),
}

impl ClientError {
    /// The CUDA result an application sees for this failure: connecting failures are "no device";
    /// a lost session is "device unavailable" (every later call returns it, like a sticky error).
    pub fn cuda_result(&self) -> CUresult {
        match self {
            Self::Lost(_) | Self::Protocol(_) => CUresult::DEVICE_UNAVAILABLE,
            _ => CUresult::NO_DEVICE,
        }
    }
}

/// A reply as the reader task hands it over: the decoded message and its bulk bytes (a view of the
/// reader's buffer, so handing it over costs no copy).
#[derive(Debug)]
pub struct Answer {
    /// The CUDA result.
    pub result: CUresult,
    /// The out-values.
    pub reply: Reply,
    /// The bulk bytes (device-to-host data), empty for most replies.
    pub bulk: Bytes,
}

/// A request whose reply has not been collected yet.
#[must_use = "a pending request must be waited for"]
pub struct Pending {
    slot: Arc<Slot>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").finish_non_exhaustive()
    }
}

impl Pending {
    /// Blocks until the reply arrives (or the session ends).
    pub fn wait(self) -> Result<Answer, ClientError> {
        match self.slot.wait(gleam_protocol::tuning::spin_budget(), None) {
            Some(outcome) => outcome,
            None => Err(ClientError::Lost("the session ended".into())),
        }
    }

    /// As [`Pending::wait`], giving up after `timeout`.
    pub fn wait_timeout(self, timeout: Duration) -> Result<Answer, ClientError> {
        let deadline = Instant::now().checked_add(timeout);
        let spin = gleam_protocol::tuning::spin_budget().min(timeout);
        match self.slot.wait(spin, deadline) {
            Some(outcome) => outcome,
            None => Err(ClientError::Lost(format!("no reply within {timeout:?}"))),
        }
    }
}

/// Bytes and datagrams a session moved over the network (see [`Client::wire_stats`]).
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct WireStats {
    /// UDP payload bytes sent.
    pub sent_bytes: u64,
    /// UDP datagrams sent.
    pub sent_datagrams: u64,
    /// UDP payload bytes received.
    pub received_bytes: u64,
    /// UDP datagrams received.
    pub received_datagrams: u64,
    /// The session connection's datagram size (path MTU discovery's current answer).
    pub mtu: u16,
}

impl WireStats {
    /// As a JSON object.
    pub fn to_json(&self) -> String {
        format!(
            r#"{{"sent_bytes":{},"sent_datagrams":{},"received_bytes":{},"received_datagrams":{},"mtu":{}}}"#,
            self.sent_bytes,
            self.sent_datagrams,
            self.received_bytes,
            self.received_datagrams,
            self.mtu
        )
    }
}

/// An established session with a serving peer.
pub struct Client {
    shared: Arc<Shared>,
    hello: ServerHello,
    blocking: bool,
    peer_addr: SocketAddr,
    lifeline: quinn::Connection,
    endpoint: quinn::Endpoint,
    // Last, so the tasks stop after everything else is dropped.
    runtime: tokio::runtime::Runtime,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.hello.server)
            .field("peer", &self.peer_addr)
            .field("blocking", &self.blocking)
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects to `peer` at `addr` as `identity`, proves membership with `secret`, and starts a session.
    ///
    /// Fails within [`CONNECT_TIMEOUT`] if the peer does not answer.
    pub fn connect(
        peer: PeerId,
        addr: SocketAddr,
        identity: &Identity,
        secret: &MeshSecret,
    ) -> Result<Self, ClientError> {
        Self::connect_with_timeout(peer, addr, identity, secret, CONNECT_TIMEOUT)
    }

    /// [`Client::connect`] with an explicit time limit.
    pub fn connect_with_timeout(
        peer: PeerId,
        addr: SocketAddr,
        identity: &Identity,
        secret: &MeshSecret,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        Self::connect_any(peer, &[addr], identity, secret, timeout)
    }

    /// [`Client::connect`] to a peer known by several addresses (best first): they are tried happy-eyeballs
    /// style, the first to complete the handshake wins.
    pub fn connect_any(
        peer: PeerId,
        addrs: &[SocketAddr],
        identity: &Identity,
        secret: &MeshSecret,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        let first = addrs
            .first()
            .copied()
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("gleam-client")
            .enable_all()
            .build()
            .map_err(|e| ClientError::Endpoint(e.to_string()))?;
        let config =
            client_config(identity, peer, ALPN_CUDA).map_err(|e| ClientError::Tls(Arc::new(e)))?;
        let endpoint = runtime
            .block_on(async { gleam_auth::dial::client_endpoint() })
            .map_err(|e| ClientError::Endpoint(e.to_string()))?;
        let secret = secret.clone();
        let pace = gleam_auth::dial::Pace {
            stagger: gleam_auth::dial::Pace::default().stagger,
            attempt_timeout: timeout,
        };
        let establish = async {
            let dialed = gleam_auth::dial::dial(&endpoint, &config, peer, addrs, pace)
                .await
                .map_err(|e| ClientError::Unreachable {
                    peer,
                    addr: first,
                    reason: e.reasons(),
                })?;
            let addr = dialed.addr;
            let lifeline = dialed.conn;
            authenticate_as_client(&lifeline, &secret)
                .await
                .map_err(|e| ClientError::Auth(Arc::new(e)))?;
            let (port, token) = ask_for_session(&lifeline).await?;
            // The session process listens at the same address, on its own port.
            let mut session_addr = addr;
            session_addr.set_port(port);
            let connection = endpoint
                .connect_with(
                    config.clone(),
                    session_addr,
                    &gleam_auth::tls::server_name(peer),
                )
                .map_err(|e| unreachable(peer, session_addr, e))?
                .await
                .map_err(|e| unreachable(peer, session_addr, e))?;
            let (mut send, recv) = connection
                .open_bi()
                .await
                .map_err(|e| unreachable(peer, session_addr, e))?;
            let mut opening = Vec::new();
            frame::encode(&StreamOpen::Attach { token }, &[], &mut opening).map_err(lost_frame)?;
            send.write_all(&opening)
                .await
                .map_err(|e| ClientError::Lost(e.to_string()))?;
            Ok::<_, ClientError>((addr, lifeline, connection, send, recv))
        };
        let (addr, lifeline, connection, send, recv) = runtime
            .block_on(async { tokio::time::timeout(timeout, establish).await })
            .map_err(|_| ClientError::Timeout {
                peer,
                addr: first,
                timeout,
            })??;

        let shared = Arc::new(Shared::new(connection.clone(), runtime.handle().clone()));
        shared.add_lane(Lane::CONTROL, send, recv);
        runtime.spawn(watch_lifeline(lifeline.clone(), shared.clone()));
        runtime.spawn(watch_session(connection, shared.clone()));

        let hello = Call::Hello(ClientHello {
            protocol: PROTOCOL_VERSION,
            client: describe_self(),
        });
        let answer = shared
            .submit(0, hello, &[], true)?
            .ok_or_else(|| ClientError::Protocol("hello has no waiter".into()))?
            .wait_timeout(timeout)?;
        let hello = match answer.reply {
            Reply::Hello(server) => server,
            other if !answer.result.is_success() => {
                debug!(?other, "hello refused");
                return Err(ClientError::Protocol(format!(
                    "the peer refused the session: {}",
                    answer.result
                )));
            }
            other => {
                return Err(ClientError::Protocol(format!(
                    "expected a hello reply, got {other:?}"
                )));
            }
        };
        if hello.protocol != PROTOCOL_VERSION {
            return Err(ClientError::Version {
                client: PROTOCOL_VERSION,
                server: hello.protocol,
            });
        }
        let blocking = std::env::var("CUDA_LAUNCH_BLOCKING").is_ok_and(|v| v.trim() == "1");
        let peer_addr = canonical(addr);
        debug!(%peer, addr = %peer_addr, backend = %hello.backend, devices = hello.devices.len(), blocking,
            "session established");
        Ok(Self {
            shared,
            hello,
            blocking,
            peer_addr,
            lifeline,
            endpoint,
            runtime,
        })
    }

    /// The address the peer answered on.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// What the server said about itself and its devices at connect.
    pub fn hello(&self) -> &ServerHello {
        &self.hello
    }

    /// Whether every call waits for its reply (`CUDA_LAUNCH_BLOCKING=1`).
    pub fn is_blocking(&self) -> bool {
        self.blocking
    }

    /// Whether the session has ended.
    pub fn is_lost(&self) -> bool {
        self.shared.lost.load(Ordering::Acquire)
    }

    /// Queues one request with its bulk bytes (copied into the frame, so the caller may reuse them at
    /// once); returns the waiter when `expects_reply`.
    pub fn submit(
        &self,
        ctx: u64,
        call: Call,
        bulk: &[u8],
        expects_reply: bool,
    ) -> Result<Option<Pending>, ClientError> {
        sent::note(expects_reply);
        self.shared.submit(ctx, call, &[bulk], expects_reply)
    }

    /// Sends `call` (with `bulk` bytes) and blocks until its reply.
    pub fn call_with(&self, ctx: u64, call: Call, bulk: &[u8]) -> Result<Answer, ClientError> {
        match self.submit(ctx, call, bulk, true)? {
            Some(pending) => pending.wait(),
            None => Err(ClientError::Protocol(
                "a request expecting a reply has no waiter".into(),
            )),
        }
    }

    /// Sends `call` and blocks until its reply: the call's CUDA result and out-values.
    pub fn call(&self, ctx: u64, call: Call) -> Result<(CUresult, Reply), ClientError> {
        self.call_with(ctx, call, &[])
            .map(|answer| (answer.result, answer.reply))
    }

    /// Sends `call` fire-and-forget (its failure becomes the session's pending error), or, in blocking
    /// mode, waits and returns its result.
    pub fn send(&self, ctx: u64, call: Call) -> Result<CUresult, ClientError> {
        if self.blocking {
            return self.call(ctx, call).map(|(result, _)| result);
        }
        self.submit(ctx, call, &[], false)?;
        Ok(CUresult::SUCCESS)
    }

    /// Copies `src` to device address `dst`. The bytes are copied out of `src` before returning, so the
    /// caller may reuse the buffer at once. A synchronous copy (`stream: None`) waits for the last piece's
    /// reply; an asynchronous one is fire-and-forget (unless blocking). Large copies go by content
    /// ([`upload`]: only what the serving peer lacks crosses the network), smaller ones in
    /// [`COPY_CHUNK`] pieces.
    pub fn memcpy_htod(
        &self,
        ctx: u64,
        dst: u64,
        src: &[u8],
        stream: Option<u64>,
    ) -> Result<CUresult, ClientError> {
        let policy = upload::Policy::get();
        if policy.applies(src.len()) {
            return upload::upload(self, ctx, dst, src, stream, policy);
        }
        self.memcpy_htod_plain(ctx, dst, src, stream, true)
    }

    /// [`Client::memcpy_htod`] in [`COPY_CHUNK`] pieces, the bytes themselves; `last_part`: whether this
    /// is the copy's last part (then a synchronous copy waits for its last piece).
    fn memcpy_htod_plain(
        &self,
        ctx: u64,
        dst: u64,
        src: &[u8],
        stream: Option<u64>,
        last_part: bool,
    ) -> Result<CUresult, ClientError> {
        let chunks: Vec<&[u8]> = if src.is_empty() {
            vec![src]
        } else {
            src.chunks(COPY_CHUNK).collect()
        };
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            let call = Call::MemcpyHtoD {
                dst: dst + (i * COPY_CHUNK) as u64,
                stream,
            };
            let wait = self.blocking || (i == last && last_part && stream.is_none());
            if let Some(pending) = self.submit(ctx, call, chunk, wait)? {
                let result = pending.wait()?.result;
                if i == last || !result.is_success() {
                    return Ok(result);
                }
            }
        }
        Ok(CUresult::SUCCESS)
    }

    /// Copies `dst.len()` bytes from device address `src` into `dst`. All pieces are requested at once
    /// (pipelined: the link never waits for a request) and collected in order. With `stream`, the
    /// server waits for the stream first.
    pub fn memcpy_dtoh(
        &self,
        ctx: u64,
        dst: &mut [u8],
        src: u64,
        stream: Option<u64>,
    ) -> Result<CUresult, ClientError> {
        let len = dst.len();
        let pieces = len.div_ceil(COPY_CHUNK).max(1);
        let mut pending = Vec::with_capacity(pieces);
        for i in 0..pieces {
            let offset = i * COPY_CHUNK;
            let n = (len - offset).min(COPY_CHUNK);
            let call = Call::MemcpyDtoH {
                src: src + offset as u64,
                len: n as u64,
                stream,
            };
            let p = self.submit(ctx, call, &[], true)?.ok_or_else(|| {
                ClientError::Protocol("a request expecting a reply has no waiter".into())
            })?;
            pending.push((offset, n, p));
        }
        let mut first_error = None;
        for (offset, n, p) in pending {
            let answer = p.wait()?;
            if !answer.result.is_success() {
                first_error.get_or_insert(answer.result);
                continue;
            }
            match answer.reply {
                Reply::Data if answer.bulk.len() == n => {
                    dst[offset..offset + n].copy_from_slice(&answer.bulk);
                }
                Reply::Data => {
                    return Err(ClientError::Protocol(format!(
                        "asked for {n} bytes, got {}",
                        answer.bulk.len()
                    )));
                }
                other => {
                    return Err(ClientError::Protocol(format!(
                        "expected data, got {other:?}"
                    )));
                }
            }
        }
        Ok(first_error.unwrap_or(CUresult::SUCCESS))
    }

    /// What this session has put on the network and taken from it so far: UDP payload bytes and
    /// datagrams (QUIC and TLS overhead included) over the session connection and the lifeline together.
    pub fn wire_stats(&self) -> WireStats {
        let mut total = WireStats {
            mtu: self.shared.connection.stats().path.current_mtu,
            ..WireStats::default()
        };
        for connection in [&self.shared.connection, &self.lifeline] {
            let stats = connection.stats();
            total.sent_bytes += stats.udp_tx.bytes;
            total.sent_datagrams += stats.udp_tx.datagrams;
            total.received_bytes += stats.udp_rx.bytes;
            total.received_datagrams += stats.udp_rx.datagrams;
        }
        total
    }

    /// Ends the session in order: waits (briefly) for the server to finish queued work and free
    /// everything, then closes the connections.
    pub fn close(&self, timeout: Duration) {
        self.shared.closing.store(true, Ordering::Release);
        if !self.is_lost()
            && let Ok(Some(pending)) = self.submit(0, Call::Goodbye, &[], true)
        {
            let _ = pending.wait_timeout(timeout);
        }
        self.shared
            .fail_all(ClientError::Lost("the client closed the session".into()));
        let code = quinn::VarInt::from_u32(CLOSE_CLIENT_EXIT);
        self.shared.connection.close(code, b"client exit");
        self.lifeline.close(code, b"client exit");
        // Give the close frames a moment to leave (the process may be exiting right after). No `block_on`:
        // this may run from a library destructor, after the calling thread's tokio context is gone.
        let endpoint = self.endpoint.clone();
        let (done, idle) = std::sync::mpsc::sync_channel(1);
        self.runtime.spawn(async move {
            let _ = tokio::time::timeout(Duration::from_millis(200), endpoint.wait_idle()).await;
            let _ = done.try_send(());
        });
        let _ = idle.recv_timeout(Duration::from_millis(250));
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.shared
            .fail_all(ClientError::Lost("the client was dropped".into()));
        let code = quinn::VarInt::from_u32(CLOSE_CLIENT_EXIT);
        self.shared.connection.close(code, b"client exit");
        self.lifeline.close(code, b"client exit");
    }
}

/// State shared by the calling threads and the network tasks.
struct Shared {
    core: Mutex<Core>,
    /// Bytes submitted that quinn has not taken yet (backpressure).
    buffered: AtomicUsize,
    /// Wakes threads waiting for `buffered` to fall.
    drained: Condvar,
    drained_lock: Mutex<()>,
    /// Set once the session ended (fast path for callers).
    lost: AtomicBool,
    /// Set when this side ends the session, so the end is not reported as a failure.
    closing: AtomicBool,
    connection: quinn::Connection,
    runtime: tokio::runtime::Handle,
}

/// What the lock protects: numbering, lanes and waiters change together, so each lane's stream carries
/// its requests in seq order.
struct Core {
    sequencer: Sequencer,
    lanes: HashMap<Lane, Arc<LaneTx>>,
    waiters: HashMap<u64, Arc<Slot>>,
    lost: Option<ClientError>,
}

/// One lane's sending half.
struct LaneTx {
    /// No request was put in the batch yet (it holds only the opening frame).
    fresh: AtomicBool,
    state: Mutex<TxState>,
    /// Wakes the lane's writer task.
    flush: Notify,
}

struct TxState {
    send: quinn::SendStream,
    /// Fire-and-forget frames not yet handed to quinn (coalesced into one chunk).
    batch: BytesMut,
    /// Chunks handed over but not yet taken by quinn, in order.
    pending: Vec<Bytes>,
    failed: Option<String>,
}

impl TxState {
    /// Moves the batch to the pending chunks, and hands them to quinn until it takes no more.
    /// `Ready(Ok)` when everything was taken; `taken` counts the bytes quinn accepted.
    fn poll_flush(&mut self, cx: &mut Context<'_>, taken: &mut usize) -> Poll<Result<(), String>> {
        if let Some(err) = &self.failed {
            return Poll::Ready(Err(err.clone()));
        }
        if !self.batch.is_empty() {
            self.pending.push(self.batch.split().freeze());
        }
        while !self.pending.is_empty() {
            let written = {
                let fut = self.send.write_chunks(&mut self.pending);
                let fut = pin!(fut);
                fut.poll(cx)
            };
            match written {
                Poll::Ready(Ok(written)) => {
                    *taken += written.bytes;
                    self.pending.retain(|chunk| !chunk.is_empty());
                }
                Poll::Ready(Err(err)) => {
                    let err = err.to_string();
                    self.failed = Some(err.clone());
                    return Poll::Ready(Err(err));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl Shared {
    fn new(connection: quinn::Connection, runtime: tokio::runtime::Handle) -> Self {
        Self {
            core: Mutex::new(Core {
                sequencer: Sequencer::new(1),
                lanes: HashMap::new(),
                waiters: HashMap::new(),
                lost: None,
            }),
            buffered: AtomicUsize::new(0),
            drained: Condvar::new(),
            drained_lock: Mutex::new(()),
            lost: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            connection,
            runtime,
        }
    }

    fn core(&self) -> MutexGuard<'_, Core> {
        lock(&self.core)
    }

    /// Registers a lane's stream and starts its reader and writer tasks.
    fn add_lane(self: &Arc<Self>, lane: Lane, send: quinn::SendStream, recv: quinn::RecvStream) {
        let tx = Arc::new(LaneTx {
            fresh: AtomicBool::new(false),
            state: Mutex::new(TxState {
                send,
                batch: BytesMut::new(),
                pending: Vec::new(),
                failed: None,
            }),
            flush: Notify::new(),
        });
        self.core().lanes.insert(lane, tx.clone());
        self.runtime.spawn(lane_writer(tx, self.clone()));
        self.runtime.spawn(lane_reader(recv, self.clone()));
    }

    /// Opens the QUIC stream of a new lane (under the core lock, so the lane's first frame precedes any
    /// request on it).
    fn open_lane(
        self: &Arc<Self>,
        core: &mut Core,
        lane: Lane,
    ) -> Result<Arc<LaneTx>, ClientError> {
        if let Some(tx) = core.lanes.get(&lane) {
            return Ok(tx.clone());
        }
        let connection = self.connection.clone();
        // Opening needs stream credit, granted by the peer in advance (1024 streams); if none is left
        // this waits on the client's runtime for the peer to grant more.
        let opened = self
            .runtime
            .block_on(async move { connection.open_bi().await });
        let (send, recv) = opened.map_err(|e| ClientError::Lost(e.to_string()))?;
        // The lane's opening frame goes out with its first request.
        let mut opening = Vec::new();
        frame::encode(&StreamOpen::Lane { lane }, &[], &mut opening).map_err(lost_frame)?;
        // Counted like any request's bytes: the flush that hands them to quinn subtracts them.
        self.buffered.fetch_add(opening.len(), Ordering::AcqRel);
        let tx = Arc::new(LaneTx {
            fresh: AtomicBool::new(true),
            state: Mutex::new(TxState {
                send,
                batch: BytesMut::from(&opening[..]),
                pending: Vec::new(),
                failed: None,
            }),
            flush: Notify::new(),
        });
        core.lanes.insert(lane, tx.clone());
        self.runtime.spawn(lane_writer(tx.clone(), self.clone()));
        self.runtime.spawn(lane_reader(recv, self.clone()));
        Ok(tx)
    }

    /// Numbers, encodes and sends (or batches) one request; its bulk bytes are the `bulk` parts, in
    /// order.
    fn submit(
        self: &Arc<Self>,
        ctx: u64,
        call: Call,
        bulk: &[&[u8]],
        expects_reply: bool,
    ) -> Result<Option<Pending>, ClientError> {
        let bulk_len: usize = bulk.iter().map(|part| part.len()).sum();
        if self.lost.load(Ordering::Acquire) {
            return Err(self.lost_error());
        }
        self.wait_for_room();
        let ordering = call.ordering();
        let mut core = self.core();
        if let Some(err) = &core.lost {
            return Err(err.clone());
        }
        let (seq, lane, deps) = core.sequencer.next(ordering);
        let tx = self.open_lane(&mut core, lane)?;
        let request = Request {
            seq,
            ctx,
            expects_reply,
            deps,
            call,
        };
        let pending = expects_reply.then(|| {
            let slot = Arc::new(Slot::new());
            core.waiters.insert(seq, slot.clone());
            Pending { slot }
        });
        let mut state = lock(&tx.state);
        let mut head = Vec::with_capacity(64);
        if let Err(err) = frame::encode_head(&request, bulk_len, &mut head) {
            // The seq is taken: a gap would hold every later barrier back, so the session cannot go on.
            drop(state);
            drop(core);
            let err = ClientError::Protocol(format!("cannot encode request {seq}: {err}"));
            self.fail_all(err.clone());
            return Err(err);
        }
        // Whether this request starts a burst: then the writer task must be woken for it. A new lane's
        // batch already holds the opening frame, which is no burst of its own.
        let was_empty = (state.batch.is_empty() && state.pending.is_empty())
            || tx.fresh.swap(false, Ordering::AcqRel);
        state.batch.extend_from_slice(&head);
        for part in bulk {
            state.batch.extend_from_slice(part);
        }
        self.buffered
            .fetch_add(head.len() + bulk_len, Ordering::AcqRel);
        // The numbering lock is not needed to hand the lane's bytes to quinn.
        drop(core);
        if expects_reply || state.batch.len() >= BATCH_FLUSH {
            // Someone waits (or the batch is large): hand everything to quinn now, from this thread.
            let mut taken = 0;
            let flushed = state.poll_flush(&mut Context::from_waker(Waker::noop()), &mut taken);
            self.taken(taken);
            match flushed {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(err)) => {
                    drop(state);
                    let err = ClientError::Lost(err);
                    self.fail_all(err.clone());
                    return Err(err);
                }
                Poll::Pending => tx.flush.notify_one(),
            }
        } else if was_empty {
            // A fire-and-forget burst: the writer task hands the batch over shortly, coalesced.
            tx.flush.notify_one();
        }
        Ok(pending)
    }

    /// Waits while the client holds more than [`BUFFER_LIMIT`] bytes quinn has not taken.
    fn wait_for_room(&self) {
        if self.buffered.load(Ordering::Acquire) < BUFFER_LIMIT {
            return;
        }
        let mut guard = lock(&self.drained_lock);
        while self.buffered.load(Ordering::Acquire) >= BUFFER_LIMIT
            && !self.lost.load(Ordering::Acquire)
        {
            guard = self
                .drained
                .wait_timeout(guard, Duration::from_millis(50))
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// Quinn took `bytes` more.
    fn taken(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let before = self.buffered.fetch_sub(bytes, Ordering::AcqRel);
        if before >= BUFFER_LIMIT && before - bytes < BUFFER_LIMIT {
            let _guard = lock(&self.drained_lock);
            self.drained.notify_all();
        }
    }

    /// Hands a reply to its waiter.
    fn deliver(&self, reply: ReplyFrame, bulk: Bytes) -> Result<(), ClientError> {
        let slot = self.core().waiters.remove(&reply.seq);
        let Some(slot) = slot else {
            return Err(ClientError::Protocol(format!(
                "reply to unknown request {}",
                reply.seq
            )));
        };
        slot.deliver(Ok(Answer {
            result: reply.result,
            reply: reply.reply,
            bulk,
        }));
        Ok(())
    }

    /// Ends the session: every pending and later call fails with `err` (the first reason wins).
    fn fail_all(&self, err: ClientError) {
        let waiters: Vec<Arc<Slot>> = {
            let mut core = self.core();
            let err = core.lost.get_or_insert(err).clone();
            self.lost.store(true, Ordering::Release);
            core.waiters
                .drain()
                .map(|(_, slot)| {
                    slot.deliver(Err(err.clone()));
                    slot
                })
                .collect()
        };
        drop(waiters);
        let _guard = lock(&self.drained_lock);
        self.drained.notify_all();
    }

    fn lost_error(&self) -> ClientError {
        self.core()
            .lost
            .clone()
            .unwrap_or_else(|| ClientError::Lost("the session ended".into()))
    }

    /// Reports the end of the session (once, unless this side is closing it).
    fn end(&self, err: ClientError) {
        if !self.lost.load(Ordering::Acquire) && !self.closing.load(Ordering::Acquire) {
            warn!(reason = %err, "CUDA session ended");
        }
        self.fail_all(err);
        if let ClientError::Protocol(reason) = &self.lost_error() {
            self.connection
                .close(quinn::VarInt::from_u32(1), reason.as_bytes());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a thread panicked while holding it; the state stays consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Asks the peer for a session on the authenticated connection: where its process listens.
async fn ask_for_session(lifeline: &quinn::Connection) -> Result<(u16, [u8; 32]), ClientError> {
    let (mut send, mut recv) = lifeline
        .open_bi()
        .await
        .map_err(|e| ClientError::Lost(e.to_string()))?;
    let mut out = Vec::new();
    frame::encode(
        &Control::Open {
            protocol: PROTOCOL_VERSION,
        },
        &[],
        &mut out,
    )
    .map_err(lost_frame)?;
    send.write_all(&out)
        .await
        .map_err(|e| ClientError::Lost(e.to_string()))?;
    let mut frames = FrameReader::new();
    let control: Control = loop {
        if let Some(frame) = frames.next_frame().map_err(lost_frame)? {
            break frame
                .decode()
                .map_err(|e| ClientError::Protocol(format!("undecodable session offer: {e}")))?;
        }
        match recv.read_chunk(64 << 10, true).await {
            Ok(Some(chunk)) => frames.feed(&chunk.bytes),
            Ok(None) | Err(_) => return Err(ClientError::Lost(close_reason(lifeline))),
        }
    };
    match control {
        Control::Offer { port, token } => Ok((port, token)),
        Control::Refused { protocol, .. } if protocol != PROTOCOL_VERSION => {
            Err(ClientError::Version {
                client: PROTOCOL_VERSION,
                server: protocol,
            })
        }
        Control::Refused { reason, .. } => Err(ClientError::Refused(reason)),
        Control::Open { .. } => Err(ClientError::Protocol("expected a session offer".into())),
    }
}

/// One lane's writer: hands the lane's batch (and what quinn could not take) to quinn.
async fn lane_writer(tx: Arc<LaneTx>, shared: Arc<Shared>) {
    loop {
        tx.flush.notified().await;
        // A calling thread's inline flush polls quinn with a no-op waker, which replaces this task's: a
        // notification while quinn is full therefore re-polls, registering this task again (else a full
        // send window would never wake anyone, and a large copy stalled for good).
        let result = loop {
            let flushed = tokio::select! {
                biased;
                flushed = poll_fn(|cx| {
                    let mut taken = 0;
                    let flushed = lock(&tx.state).poll_flush(cx, &mut taken);
                    shared.taken(taken);
                    flushed
                }) => Some(flushed),
                () = tx.flush.notified() => None,
            };
            if let Some(result) = flushed {
                break result;
            }
        };
        if let Err(err) = result {
            let reason = match shared.connection.close_reason() {
                Some(_) => close_reason(&shared.connection),
                None => err,
            };
            shared.end(ClientError::Lost(reason));
            return;
        }
        if shared.lost.load(Ordering::Acquire) {
            return;
        }
    }
}

/// One lane's reader: routes replies to their waiters by `seq`.
async fn lane_reader(mut recv: quinn::RecvStream, shared: Arc<Shared>) {
    let mut frames = FrameReader::new();
    let err = 'lane: loop {
        loop {
            let frame = match frames.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(err) => break 'lane ClientError::Protocol(err.to_string()),
            };
            let reply: ReplyFrame = match frame.decode() {
                Ok(reply) => reply,
                Err(err) => {
                    break 'lane ClientError::Protocol(format!("undecodable reply: {err}"));
                }
            };
            if let Err(err) = shared.deliver(reply, frame.bulk) {
                break 'lane err;
            }
        }
        match recv.read_chunk(usize::MAX, true).await {
            Ok(Some(chunk)) => frames.feed(&chunk.bytes),
            Ok(None) if frames.is_mid_frame() => {
                break ClientError::Protocol("a reply stream ended inside a frame".into());
            }
            Ok(None) => break ClientError::Lost(close_reason(&shared.connection)),
            Err(_) => {
                // Let the connection record why it closed before reporting it.
                let conn = shared.connection.clone();
                let _ = tokio::time::timeout(Duration::from_millis(100), conn.closed()).await;
                break ClientError::Lost(close_reason(&shared.connection));
            }
        }
    };
    shared.end(err);
}

/// The session connection: its loss ends the session.
async fn watch_session(connection: quinn::Connection, shared: Arc<Shared>) {
    connection.closed().await;
    shared.end(ClientError::Lost(close_reason(&connection)));
}

/// The lifeline: the peer closes it with the reason when the session process dies.
async fn watch_lifeline(lifeline: quinn::Connection, shared: Arc<Shared>) {
    let err = lifeline.closed().await;
    if let quinn::ConnectionError::ApplicationClosed(close) = &err
        && close.error_code != quinn::VarInt::from_u32(0)
    {
        let reason = String::from_utf8_lossy(&close.reason).into_owned();
        shared.end(ClientError::Lost(format!(
            "the peer's session process failed: {reason}"
        )));
    }
}

fn unreachable(peer: PeerId, addr: SocketAddr, err: impl std::fmt::Display) -> ClientError {
    ClientError::Unreachable {
        peer,
        addr,
        reason: err.to_string(),
    }
}

/// A dual-stack socket sees IPv4 peers as IPv4-mapped IPv6 addresses; report them as IPv4.
fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::from((v4, v6.port())),
            None => addr,
        },
        SocketAddr::V4(_) => addr,
    }
}

fn lost_frame(err: FrameError) -> ClientError {
    ClientError::Lost(err.to_string())
}

fn close_reason(connection: &quinn::Connection) -> String {
    match connection.close_reason() {
        Some(quinn::ConnectionError::ApplicationClosed(close)) => {
            let reason = String::from_utf8_lossy(&close.reason);
            format!("the peer closed the session ({reason})")
        }
        Some(quinn::ConnectionError::TimedOut) => {
            "the peer stopped answering (network down or peer gone)".into()
        }
        Some(other) => other.to_string(),
        None => "the peer ended the session stream".into(),
    }
}

fn describe_self() -> String {
    let program = std::env::args()
        .next()
        .unwrap_or_else(|| "<unknown program>".into());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    format!("{program} (pid {}) on {host}", std::process::id())
}
