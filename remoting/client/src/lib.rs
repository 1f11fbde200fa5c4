//! The client side of a CUDA session: one authenticated QUIC connection to a serving peer, one ordered
//! command stream on it.
//!
//! [`Client::connect`] dials the peer (TLS pinned to its [`PeerId`], then the mesh-secret proof), opens the
//! command stream and exchanges [`Call::Hello`]. From then on a small background tokio runtime owns the
//! connection: a writer task drains the queue of encoded request frames and coalesces whatever is queued
//! into one `write_all_chunks`, and a reader task routes each [`ReplyFrame`] to the thread waiting for its
//! `seq`. Callers never touch async code:
//!
//! * [`Client::call`] sends a request and blocks the calling thread until its reply;
//! * [`Client::send`] queues a fire-and-forget request (ordered with everything else), or waits for it
//!   when the session runs in blocking mode (`CUDA_LAUNCH_BLOCKING=1`);
//! * [`Client::memcpy_htod`] / [`Client::memcpy_dtoh`] split bulk copies into [`COPY_CHUNK`] pieces
//!   (device-to-host pieces all requested at once, collected in order).
//!
//! A thread waiting for a reply spins briefly before parking ([`gleam_protocol::tuning::spin_budget`]; `GLEAM_SPIN_US`), and so
//! does the session process waiting for the next request, on hosts with cores to spare.
//!
//! If the connection is lost (QUIC idle timeout with keep-alives on, the server's session process died,
//! a protocol violation), every pending and later call fails with [`ClientError::Lost`] within seconds,
//! never hangs.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, mpsc};
use std::thread::Thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gleam_auth::identity::{Identity, MeshSecret, PeerId};
use gleam_auth::proof::{AuthError, authenticate_as_client};
use gleam_auth::tls::{ALPN_CUDA, TlsError, client_config};
use tokio::sync::mpsc as tokio_mpsc;
use tracing::{debug, warn};

use gleam_protocol::frame::{self, FrameError, FrameReader};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{
    COPY_CHUNK, Call, ClientHello, PROTOCOL_VERSION, Reply, ReplyFrame, Request, ServerHello,
};

/// How long [`Client::connect`] may take in all (handshake, authentication, hello).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The writer stops coalescing queued frames into one write once it holds this many bytes.
const COALESCE_BYTES: usize = 1 << 20;
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

/// What a waiter receives: the reply, or why none will come.
type Outcome = Result<Answer, ClientError>;

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

/// State shared by the calling threads and the background tasks.
struct Shared {
    /// Assigns sequence numbers and queues frames in that order (one lock, so the queue is in seq order).
    queue: Mutex<Queue>,
    /// Threads waiting for a reply, by seq; `lost` once the session ended.
    waiters: Mutex<Waiters>,
    /// Set once the session ended (fast path for callers).
    lost: AtomicBool,
    /// Set when this side ends the session, so the end is not reported as a failure.
    closing: AtomicBool,
}

struct Queue {
    next_seq: u64,
    frames: tokio_mpsc::UnboundedSender<Bytes>,
    /// Initial capacity of a frame buffer (most requests are small).
    frame_hint: usize,
}

#[derive(Default)]
struct Waiters {
    pending: HashMap<u64, Arc<Slot>>,
    lost: Option<ClientError>,
}

/// Where one reply is handed from the reader task to the waiting thread.
///
/// The waiter spins briefly before parking: a reply usually comes back within one LAN round trip,
/// and waking a parked thread costs several microseconds more than noticing a flag (like the CUDA
/// driver, which spins in `cuCtxSynchronize` by default). Delivering to a thread that is not parked
/// costs the reader an atomic swap, no syscall.
struct Slot {
    state: AtomicU8,
    outcome: Mutex<Option<Outcome>>,
    /// The thread that parked waiting for this slot.
    thread: OnceLock<Thread>,
}

/// No outcome yet, nobody parked.
const SLOT_EMPTY: u8 = 0;
/// The waiter is (about to be) parked and must be unparked.
const SLOT_PARKED: u8 = 1;
/// The outcome is in place.
const SLOT_READY: u8 = 2;

impl Slot {
    fn new() -> Self {
        Self {
            state: AtomicU8::new(SLOT_EMPTY),
            outcome: Mutex::new(None),
            thread: OnceLock::new(),
        }
    }

    /// Hands over the outcome. Each slot is delivered at most once (whoever removes it from
    /// [`Waiters::pending`] delivers it); a second delivery is ignored.
    fn deliver(&self, outcome: Outcome) {
        {
            let mut slot = self
                .outcome
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if slot.is_some() {
                return;
            }
            *slot = Some(outcome);
        }
        if self.state.swap(SLOT_READY, Ordering::AcqRel) == SLOT_PARKED
            && let Some(thread) = self.thread.get()
        {
            thread.unpark();
        }
    }

    fn take(&self) -> Option<Outcome> {
        self.outcome
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// Waits until the outcome is delivered, or until `deadline`.
    fn wait(&self, spin: Duration, deadline: Option<Instant>) -> Option<Outcome> {
        if !spin.is_zero() {
            let start = Instant::now();
            let mut polls = 0u32;
            while self.state.load(Ordering::Acquire) != SLOT_READY {
                std::hint::spin_loop();
                polls = polls.wrapping_add(1);
                // Reading the clock costs more than a poll of the flag; look at it now and then.
                if polls.is_multiple_of(64) && start.elapsed() >= spin {
                    break;
                }
            }
        }
        if self.state.load(Ordering::Acquire) != SLOT_READY {
            let _ = self.thread.set(std::thread::current());
            // Only park if no outcome arrived meanwhile; an unpark that comes before `park` makes
            // `park` return at once, so no wake-up is lost.
            if self
                .state
                .compare_exchange(SLOT_EMPTY, SLOT_PARKED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                while self.state.load(Ordering::Acquire) != SLOT_READY {
                    match deadline {
                        None => std::thread::park(),
                        Some(deadline) => {
                            let now = Instant::now();
                            if now >= deadline {
                                return None;
                            }
                            std::thread::park_timeout(deadline - now);
                        }
                    }
                }
            }
        }
        self.take()
    }
}

impl Shared {
    fn waiters(&self) -> MutexGuard<'_, Waiters> {
        // A poisoned lock only means a thread panicked while holding it; the map is still consistent.
        self.waiters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Ends the session: every pending and later call fails with `err` (the first reason wins).
    fn fail_all(&self, err: ClientError) {
        let mut waiters = self.waiters();
        let err = waiters.lost.get_or_insert(err).clone();
        self.lost.store(true, Ordering::Release);
        for (_, slot) in waiters.pending.drain() {
            slot.deliver(Err(err.clone()));
        }
    }

    fn lost_error(&self) -> ClientError {
        self.waiters()
            .lost
            .clone()
            .unwrap_or_else(|| ClientError::Lost("the session ended".into()))
    }
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

/// An established session with a serving peer.
pub struct Client {
    shared: Arc<Shared>,
    hello: ServerHello,
    blocking: bool,
    connection: quinn::Connection,
    endpoint: quinn::Endpoint,
    // Last, so the tasks stop after everything else is dropped.
    runtime: tokio::runtime::Runtime,
}

impl Client {
    /// Connects to `peer` at `addr` as `identity`, proves membership with `secret`, and says hello.
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

    /// Connects to `peer` at whichever of `addrs` answers first (tried in order, happy-eyeballs style:
    /// [`gleam_auth::dial::dial`]), then as [`Client::connect`]. [`Client::peer_addr`] says which one.
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
        let handshake = async {
            let dialed = gleam_auth::dial::dial(&endpoint, &config, peer, addrs, pace)
                .await
                .map_err(|e| ClientError::Unreachable {
                    peer,
                    addr: first,
                    reason: e.reasons(),
                })?;
            let addr = dialed.addr;
            let connection = dialed.conn;
            authenticate_as_client(&connection, &secret)
                .await
                .map_err(|e| ClientError::Auth(Arc::new(e)))?;
            let (mut send, mut recv) = connection
                .open_bi()
                .await
                .map_err(|e| unreachable(peer, addr, e))?;
            let hello = Request {
                seq: 1,
                ctx: 0,
                expects_reply: true,
                call: Call::Hello(ClientHello {
                    protocol: PROTOCOL_VERSION,
                    client: describe_self(),
                }),
            };
            let mut out = Vec::new();
            frame::encode(&hello, &[], &mut out).map_err(lost_frame)?;
            send.write_all(&out)
                .await
                .map_err(|e| ClientError::Lost(e.to_string()))?;
            let mut reader = FrameReader::new();
            let frame: ReplyFrame = loop {
                if let Some(frame) = reader.next_frame().map_err(lost_frame)? {
                    break frame
                        .decode()
                        .map_err(|e| ClientError::Protocol(e.to_string()))?;
                }
                match recv.read_chunk(usize::MAX, true).await {
                    Ok(Some(chunk)) => reader.feed(&chunk.bytes),
                    Ok(None) => return Err(ClientError::Lost(close_reason(&connection))),
                    Err(e) => return Err(ClientError::Lost(e.to_string())),
                }
            };
            let server = match frame.reply {
                Reply::Hello(server) => server,
                other if !frame.result.is_success() => {
                    debug!(?other, "hello refused");
                    return Err(ClientError::Protocol(format!(
                        "the peer refused the session: {}",
                        frame.result
                    )));
                }
                other => {
                    return Err(ClientError::Protocol(format!(
                        "expected a hello reply, got {other:?}"
                    )));
                }
            };
            if server.protocol != PROTOCOL_VERSION {
                return Err(ClientError::Version {
                    client: PROTOCOL_VERSION,
                    server: server.protocol,
                });
            }
            Ok((connection, send, recv, reader, server))
        };
        let (connection, send, recv, replies, hello) = runtime
            .block_on(async { tokio::time::timeout(timeout, handshake).await })
            .map_err(|_| ClientError::Timeout {
                peer,
                addr: first,
                timeout,
            })??;
        let addr = canonical(connection.remote_address());

        let (frames, queued) = tokio_mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                next_seq: 2,
                frames,
                frame_hint: 128,
            }),
            waiters: Mutex::new(Waiters::default()),
            lost: AtomicBool::new(false),
            closing: AtomicBool::new(false),
        });
        runtime.spawn(writer(send, queued, shared.clone(), connection.clone()));
        runtime.spawn(reader(recv, replies, shared.clone(), connection.clone()));
        let blocking = std::env::var("CUDA_LAUNCH_BLOCKING").is_ok_and(|v| v.trim() == "1");
        debug!(%peer, %addr, backend = %hello.backend, devices = hello.devices.len(), blocking, "session established");
        Ok(Self {
            shared,
            hello,
            blocking,
            connection,
            endpoint,
            runtime,
        })
    }

    /// The address this session reached the peer at (the first of those given that answered).
    pub fn peer_addr(&self) -> SocketAddr {
        canonical(self.connection.remote_address())
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
        if self.is_lost() {
            return Err(self.shared.lost_error());
        }
        sent::note(expects_reply);
        let mut request = Request {
            seq: 0,
            ctx,
            expects_reply,
            call,
        };
        let mut queue = self.shared.queue();
        request.seq = queue.next_seq;
        // Encoded straight into the buffer the writer will send.
        let mut encoded = Vec::with_capacity(queue.frame_hint + bulk.len());
        if let Err(err) = frame::encode(&request, bulk, &mut encoded) {
            return Err(ClientError::Protocol(format!(
                "cannot encode request: {err}"
            )));
        }
        let pending = if expects_reply {
            let slot = Arc::new(Slot::new());
            let mut waiters = self.shared.waiters();
            if let Some(err) = &waiters.lost {
                return Err(err.clone());
            }
            waiters.pending.insert(request.seq, slot.clone());
            Some(Pending { slot })
        } else {
            None
        };
        queue.next_seq += 1;
        if queue.frames.send(Bytes::from(encoded)).is_err() {
            drop(queue);
            self.shared
                .fail_all(ClientError::Lost("the connection's writer stopped".into()));
            return Err(self.shared.lost_error());
        }
        Ok(pending)
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

    /// Copies `src` to device address `dst` in [`COPY_CHUNK`] pieces. The bytes are copied out of `src`
    /// before returning, so the caller may reuse the buffer at once. A synchronous copy (`stream: None`)
    /// waits for the last piece's reply; an asynchronous one is fire-and-forget (unless blocking).
    pub fn memcpy_htod(
        &self,
        ctx: u64,
        dst: u64,
        src: &[u8],
        stream: Option<u64>,
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
            let wait = self.blocking || (i == last && stream.is_none());
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

    /// Ends the session in order: waits (briefly) for the server to finish queued work and free
    /// everything, then closes the connection.
    pub fn close(&self, timeout: Duration) {
        self.shared.closing.store(true, Ordering::Release);
        if !self.is_lost()
            && let Ok(Some(pending)) = self.submit(0, Call::Goodbye, &[], true)
        {
            let _ = pending.wait_timeout(timeout);
        }
        self.shared
            .fail_all(ClientError::Lost("the client closed the session".into()));
        self.connection
            .close(quinn::VarInt::from_u32(CLOSE_CLIENT_EXIT), b"client exit");
        // Give the close frame a moment to leave (the process may be exiting right after). No `block_on`:
        // this may run from a library destructor, after the calling thread's tokio context is gone.
        let endpoint = self.endpoint.clone();
        let (done, idle) = mpsc::sync_channel(1);
        self.runtime.spawn(async move {
            let _ = tokio::time::timeout(Duration::from_millis(200), endpoint.wait_idle()).await;
            let _ = done.try_send(());
        });
        let _ = idle.recv_timeout(Duration::from_millis(250));
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.hello.server)
            .field("remote", &self.connection.remote_address())
            .field("blocking", &self.blocking)
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.shared
            .fail_all(ClientError::Lost("the client was dropped".into()));
        self.connection
            .close(quinn::VarInt::from_u32(CLOSE_CLIENT_EXIT), b"client exit");
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
        None => "the peer ended the command stream".into(),
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

/// Drains the frame queue onto the stream, coalescing whatever is already queued into one write.
async fn writer(
    mut send: quinn::SendStream,
    mut queued: tokio_mpsc::UnboundedReceiver<Bytes>,
    shared: Arc<Shared>,
    connection: quinn::Connection,
) {
    let mut batch: Vec<Bytes> = Vec::new();
    while let Some(first) = queued.recv().await {
        let mut bytes = first.len();
        batch.push(first);
        while bytes < COALESCE_BYTES {
            match queued.try_recv() {
                Ok(frame) => {
                    bytes += frame.len();
                    batch.push(frame);
                }
                Err(_) => break,
            }
        }
        if let Err(err) = send.write_all_chunks(&mut batch).await {
            let reason = match connection.close_reason() {
                Some(_) => close_reason(&connection),
                None => err.to_string(),
            };
            warn!(%reason, "CUDA session lost while sending");
            shared.fail_all(ClientError::Lost(reason));
            return;
        }
        batch.clear();
    }
    // Every sender is gone: the client was dropped. Finish the stream so the server sees a clean end.
    let _ = send.finish();
}

/// Routes replies to their waiters by `seq`. `frames` may already hold bytes read after the hello.
async fn reader(
    mut recv: quinn::RecvStream,
    mut frames: FrameReader,
    shared: Arc<Shared>,
    connection: quinn::Connection,
) {
    let err = 'session: loop {
        loop {
            let frame = match frames.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(err) => break 'session ClientError::Protocol(err.to_string()),
            };
            let reply: ReplyFrame = match frame.decode() {
                Ok(reply) => reply,
                Err(err) => {
                    break 'session ClientError::Protocol(format!("undecodable reply: {err}"));
                }
            };
            let waiter = shared.waiters().pending.remove(&reply.seq);
            let Some(slot) = waiter else {
                break 'session ClientError::Protocol(format!(
                    "reply to unknown request {}",
                    reply.seq
                ));
            };
            slot.deliver(Ok(Answer {
                result: reply.result,
                reply: reply.reply,
                bulk: frame.bulk,
            }));
        }
        match recv.read_chunk(usize::MAX, true).await {
            Ok(Some(chunk)) => frames.feed(&chunk.bytes),
            Ok(None) if frames.is_mid_frame() => {
                break ClientError::Protocol("the reply stream ended inside a frame".into());
            }
            Ok(None) => break ClientError::Lost(close_reason(&connection)),
            Err(_) => {
                // Let the connection record why it closed before reporting it.
                let _ = tokio::time::timeout(Duration::from_millis(100), connection.closed()).await;
                break ClientError::Lost(close_reason(&connection));
            }
        }
    };
    if !shared.lost.load(Ordering::Acquire) && !shared.closing.load(Ordering::Acquire) {
        warn!(reason = %err, "CUDA session ended");
    }
    shared.fail_all(err);
    if let ClientError::Protocol(reason) = &shared.lost_error() {
        connection.close(quinn::VarInt::from_u32(1), reason.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parked_waiter_is_woken_and_an_early_outcome_is_kept() {
        // Delivered before anyone waits: no park at all.
        let slot = Slot::new();
        slot.deliver(Err(ClientError::Lost("early".into())));
        assert!(
            matches!(slot.wait(Duration::ZERO, None), Some(Err(ClientError::Lost(r))) if r == "early")
        );

        // Delivered while the waiter is parked (no spin), from another thread.
        let slot = Arc::new(Slot::new());
        let late = slot.clone();
        let deliverer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            late.deliver(Err(ClientError::Lost("late".into())));
            // A second delivery is ignored.
            late.deliver(Err(ClientError::Lost("again".into())));
        });
        assert!(
            matches!(slot.wait(Duration::ZERO, None), Some(Err(ClientError::Lost(r))) if r == "late")
        );
        deliverer.join().unwrap();

        // Delivered during the spin.
        let slot = Arc::new(Slot::new());
        let soon = slot.clone();
        let deliverer =
            std::thread::spawn(move || soon.deliver(Err(ClientError::Lost("soon".into()))));
        assert!(matches!(
            slot.wait(Duration::from_millis(500), None),
            Some(Err(_))
        ));
        deliverer.join().unwrap();

        // Nothing comes: the deadline ends the wait.
        let slot = Slot::new();
        let t = Instant::now();
        assert!(
            slot.wait(
                Duration::from_millis(1),
                Some(Instant::now() + Duration::from_millis(30))
            )
            .is_none()
        );
        assert!(t.elapsed() >= Duration::from_millis(30));
    }
}
