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
//! A [`Sequencer`](gleam_protocol::order::Sequencer) numbers every request and works out what it must
//! follow (per-lane order, barriers, event records); the serving side's scheduler keeps exactly that
//! order.
//!
//! Bulk travels apart: beside the session connection the client opens a bulk connection to the session
//! process ([`StreamOpen::Bulk`]), with a congestion window of its own (and its own controller, on a LAN
//! a delay target that keeps the queue the upload builds at the bottleneck short: see
//! [`gleam_auth::tls::bulk_transport_config_to`]), and the lanes carrying cached uploads' chunks (one per
//! copy stream, [`Lane::carries_bulk`]) open there; the copy itself stays on its stream's lane and waits
//! for its chunks by the upload's pseudo event. Downloads from [`DOWNLOAD_APART`] bytes on come back on
//! the same lanes: the request travels on its stream's lane, its reply on the bulk connection.
//! `GLEAM_BULK_CONNECTION=off` keeps everything on one connection. `GLEAM_BULK_STRIPES=N` opens N bulk
//! connections ([`BulkDialer`]), each with lanes of its own ([`gleam_protocol::wire::bulk_stream`]) and,
//! past the first, driven by a thread of its own at both ends: a large upload's segments and a large
//! download's pieces take turns across them, so one copy is encrypted and decrypted on several cores.
//!
//! Sending costs no thread hop: the calling thread encodes its frame and hands it to quinn itself
//! (quinn's driver then sends it). Fire-and-forget requests are coalesced per lane: they accumulate in the
//! lane's batch and the lane's writer task hands the batch to quinn as one chunk shortly after, so a burst
//! of launches costs one segment, not one per launch; a request that waits for its reply flushes its lane
//! at once. What quinn cannot take yet is bounded per lane ([`BUFFER_LIMIT`]): past it, callers of that
//! lane wait, and only they: a lane full of a large upload never holds back another lane's calls. Replies are
//! read by one task per lane and handed to the waiting thread through a slot (spin, then park;
//! parked at once after a burst of [`LONG_WAIT_POSTS`] fire-and-forget requests).
//!
//! A session survives network drops ([`gleam_protocol::resume`]): every request frame is kept until the
//! serving side acknowledges it (a reply acknowledges its lane's requests up to it; acknowledgements come
//! on a stream of their own for the rest), bounded by [`RETAIN_LIMIT`] per lane and [`SESSION_RETAIN_LIMIT`]
//! in all. When the link goes silent past
//! QUIC's idle timeout, calls wait, and the client dials the peer again (every address it knows, from
//! whatever interface now works), asks to resume its session ([`Control::Resume`]) and, on the session
//! process's own endpoint, tells it which replies it has; each side then sends again what the other has
//! not: each request runs once, each reply arrives once, and the GPU state is untouched.
//!
//! The protocol logic itself (numbering, waiters, batches, what is kept until acknowledged, what a
//! resume sends again) is sans-IO, in `engine`: its `Session` and `LaneOut` take events
//! and say what to send, and are tested there against a simulated link that drops at any byte. This file
//! is the thin layer around them: locks, quinn streams, tasks, and the threads' waits.
//!
//! [`Client::in_process`] is the other transport: a serving peer inside this process (a [`LocalPeer`]), which
//! executes each request on the calling thread; the shim's fuzz target drives the C exports through it.
//!
//! If the session is lost for good (the link stayed down past the session's grace window, the peer
//! restarted, the session process died, a protocol violation), every pending and later call fails with
//! [`ClientError::Lost`], never hangs: at the end of the window, or within a round trip of reaching a
//! peer that no longer has the session.

mod engine;
pub mod in_process;
mod pool;
mod signal;
mod slot;
pub mod upload;

use std::collections::HashMap;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use gleam_auth::busy_poll::{BusyPoll, Hold};
use gleam_auth::identity::{Identity, MeshSecret, PeerId};
use gleam_auth::proof::{AuthError, authenticate_as_client};
use gleam_auth::tls::{ALPN_CUDA, TlsError, client_config};
use gleam_protocol::frame::{self, FrameError, FrameReader, PieceReader, Pieces};
use gleam_protocol::order::Lane;
use gleam_protocol::resume::{Marks, mark_of};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{
    Acks, CLOSE_RESUME_ABANDONED, COPY_CHUNK, Call, ClientHello, Control, PROTOCOL_VERSION, Reply,
    ReplyFrame, Request, Resumed, ServerHello, StreamOpen, bulk_stream, stripe_of,
};
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::engine::{AckPoll, Delivery, LaneOut, Moved};
pub use crate::in_process::LocalPeer;
use crate::slot::{Outcome, Slot};

/// How long [`Client::connect`] may take in all (handshake, authentication, session start, hello).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes of one lane that quinn has not taken yet; past it, a thread submitting on that lane waits for
/// the network to catch up (threads of other lanes go on).
pub const BUFFER_LIMIT: usize = 32 << 20;
/// Bytes of one lane's requests sent and not yet acknowledged by the serving side (kept to send again
/// after a drop); past it, a thread submitting on that lane waits for acknowledgements.
pub const RETAIN_LIMIT: usize = 128 << 20;
/// Unacknowledged bytes of all lanes together: the bound on what the client keeps, whatever the number
/// of streams. Past it, every submitting thread waits.
pub const SESSION_RETAIN_LIMIT: usize = 4 * RETAIN_LIMIT;
/// Downloads from this size on come back over the bulk connection, apart from the session connection
/// ([`Call::MemcpyDtoH`]'s `apart`): 2 ms of a 1 Gbit/s link, which another stream's small calls would
/// otherwise wait for.
pub const DOWNLOAD_APART: usize = 256 << 10;
/// One attempt to resume a session (dial, authenticate, reach the session process) may take this long.
const RESUME_ATTEMPT: Duration = Duration::from_secs(3);
/// How long one attempt waits for the peer's handshake: short, so that once the link is back a fresh
/// attempt reaches the peer soon (a long one waits out QUIC's growing retransmission intervals).
const RESUME_DIAL: Duration = Duration::from_secs(1);
/// Pause between attempts to resume.
const RESUME_PAUSE: Duration = Duration::from_millis(200);
/// The client keeps trying this much past the serving side's grace window (the two ends see the drop at
/// slightly different times; a peer reached after its window answers "gone" at once).
const RESUME_MARGIN: Duration = Duration::from_millis(500);
/// How long an acknowledgement of replies waits to gather more, and how often a quiet client re-checks.
const ACK_DELAY: Duration = Duration::from_millis(5);
const ACK_TICK: Duration = Duration::from_millis(100);
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
    /// The bulk bytes (device-to-host data), empty for most replies: as they arrived, in pieces, so the
    /// network thread never copies them (the waiting thread copies them once, to where they go).
    pub bulk: Pieces,
}

/// A request whose reply has not been collected yet.
#[must_use = "a pending request must be waited for"]
pub struct Pending {
    slot: Arc<Slot>,
    /// How long the waiting thread spins before it parks ([`spin_for`]).
    spin: Duration,
    /// Keeps the network thread polling while this thread spins, so the reply is read as it arrives.
    hot: Option<Hold>,
}

/// Fire-and-forget requests ahead of a reply from which its waiter parks at once instead of spinning:
/// the reply cannot come before the serving peer has run them all (256 kernel launches take half a
/// millisecond or more, beyond a LAN round trip), and spinning through that wait would cost the client as
/// much CPU as the wait lasts (a 1,000-launch burst and its synchronize: 3.6 µs of CPU per launch with a
/// 2 ms spin, against 1.4 without, on the development machine). Waking a parked thread costs microseconds.
pub const LONG_WAIT_POSTS: u64 = 256;

/// The client's busy poll: hot only while a thread spins for its reply (no linger), where waiters spin
/// at all ([`gleam_protocol::tuning::spin_budget`]) and `GLEAM_BUSY_POLL` allows it. No linger: once the
/// reply is in, the application goes on submitting, and a runtime thread that polls through that burst
/// would hand each launch to quinn as it comes, taking the lane's lock from the submitting thread each
/// time, where a sleeping one wakes to a coalesced batch.
fn client_busy_poll() -> Arc<BusyPoll> {
    BusyPoll::beside_spinning(gleam_protocol::tuning::spin_budget(), Duration::ZERO)
}

/// The spin before parking for a reply that follows `posted` fire-and-forget requests.
fn spin_for(posted: u64) -> Duration {
    if posted >= LONG_WAIT_POSTS {
        Duration::ZERO
    } else {
        gleam_protocol::tuning::spin_budget()
    }
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").finish_non_exhaustive()
    }
}

impl Pending {
    /// Blocks until the reply arrives (or the session ends).
    pub fn wait(self) -> Result<Answer, ClientError> {
        let spin = self.spin;
        match self.spin_then_park(spin, None) {
            Some(outcome) => outcome,
            None => Err(ClientError::Lost("the session ended".into())),
        }
    }

    /// As [`Pending::wait`], giving up after `timeout`.
    pub fn wait_timeout(self, timeout: Duration) -> Result<Answer, ClientError> {
        let deadline = Instant::now().checked_add(timeout);
        let spin = self.spin.min(timeout);
        match self.spin_then_park(spin, deadline) {
            Some(outcome) => outcome,
            None => Err(ClientError::Lost(format!("no reply within {timeout:?}"))),
        }
    }

    /// Spins for `spin`, then lets the network thread sleep and parks until `deadline`.
    fn spin_then_park(mut self, spin: Duration, deadline: Option<Instant>) -> Option<Outcome> {
        self.slot.spin(spin);
        drop(self.hot.take());
        self.slot.wait(deadline)
    }
}

/// Bytes and datagrams a session moved over the network (see [`Client::wire_stats`]).
#[derive(Clone, Debug, Default, Eq, PartialEq)]
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
    /// Of `sent_bytes`, those sent over the bulk connections (uploads' chunks).
    pub bulk_sent_bytes: u64,
    /// Of `received_bytes`, those received over the bulk connections (large downloads).
    pub bulk_received_bytes: u64,
    /// Per bulk connection (stripe 0 first): bytes sent and received.
    pub bulk_stripes: Vec<(u64, u64)>,
}

impl WireStats {
    /// As a JSON object.
    pub fn to_json(&self) -> String {
        format!(
            r#"{{"sent_bytes":{},"sent_datagrams":{},"received_bytes":{},"received_datagrams":{},"mtu":{},"bulk_sent_bytes":{},"bulk_received_bytes":{},"bulk_stripes":[{}]}}"#,
            self.sent_bytes,
            self.sent_datagrams,
            self.received_bytes,
            self.received_datagrams,
            self.mtu,
            self.bulk_sent_bytes,
            self.bulk_received_bytes,
            self.bulk_stripes
                .iter()
                .map(|(sent, received)| format!("[{sent},{received}]"))
                .collect::<Vec<_>>()
                .join(",")
        )
    }
}

/// An established session with a serving peer.
pub struct Client {
    hello: ServerHello,
    blocking: bool,
    link: Link,
}

/// How requests reach the serving peer.
enum Link {
    /// Over QUIC: production.
    Network(Network),
    /// To a peer in this process ([`in_process`]): harnesses.
    InProcess(in_process::InProcess),
}

/// A session's connections to a peer across the network, and the tasks that serve them.
struct Network {
    shared: Arc<Shared>,
    peer_addr: SocketAddr,
    endpoint: quinn::Endpoint,
    // Last, so the tasks stop after everything else is dropped.
    runtime: tokio::runtime::Runtime,
    /// Drives the bulk connections ([`BulkDialer`]); held for as long as the session (dropped last).
    _bulk_runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.hello.server)
            .field("peer", &self.peer_addr())
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
        let (bulk_runtime, bulk_dialer) = match BulkDialer::start(&endpoint, &runtime) {
            Some((runtime, dialer)) => (runtime, Some(dialer)),
            None => (None, None),
        };
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
            let offer = ask_for_session(
                &lifeline,
                &Control::Open {
                    protocol: PROTOCOL_VERSION,
                },
            )
            .await?;
            let Offer {
                port,
                token,
                session,
                grace,
            } = offer.map_err(ClientError::Refused)?;
            // The session process listens at the same address, on its own port.
            let mut session_addr = addr;
            session_addr.set_port(port);
            let connection = endpoint
                .connect_with(
                    fitted(&config, session_addr),
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
            let resume = Resume {
                peer,
                addrs: std::iter::once(addr)
                    .chain(addrs.iter().copied().filter(|a| *a != addr))
                    .collect(),
                config: config.clone(),
                secret: secret.clone(),
                endpoint: endpoint.clone(),
                bulk: bulk_dialer.clone(),
                session,
                token,
                grace,
            };
            Ok::<_, ClientError>((addr, session_addr, lifeline, connection, send, recv, resume))
        };
        let (addr, session_addr, lifeline, connection, send, recv, resume) = runtime
            .block_on(async { tokio::time::timeout(timeout, establish).await })
            .map_err(|_| ClientError::Timeout {
                peer,
                addr: first,
                timeout,
            })??;

        let shared = Arc::new(Shared::new(
            connection.clone(),
            lifeline.clone(),
            runtime.handle().clone(),
        ));
        let _ = shared.resume.set(resume);
        runtime.spawn(shared.busy.clone().run());
        shared.add_lane(Lane::CONTROL, send, recv);
        shared.start_connection_tasks(0, &connection, &lifeline);
        // The bulk connections are made while the hello goes; the session is handed out with them, so
        // that an upload right at the start already travels on them.
        let bulk = bulk_dialer.map(|dialer| {
            let (done, bulk) = std::sync::mpsc::sync_channel(1);
            let token = shared.resume.get().map(|r| r.token).unwrap_or_default();
            let config = config.clone();
            runtime.spawn(async move {
                let attached = dialer
                    .connect(config, peer, session_addr, token, BULK_ATTACH_TIMEOUT)
                    .await;
                let _ = done.send(attached);
            });
            bulk
        });

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
        if let Some(bulk) = bulk {
            shared.install_bulk(bulk.recv_timeout(BULK_ATTACH_TIMEOUT + Duration::from_secs(1)));
        }
        let peer_addr = canonical(addr);
        debug!(%peer, addr = %peer_addr, backend = %hello.backend, devices = hello.devices.len(),
            "session established");
        Ok(Self::new(
            hello,
            Link::Network(Network {
                shared,
                peer_addr,
                endpoint,
                runtime,
                _bulk_runtime: bulk_runtime,
            }),
        ))
    }

    /// A session greeted by its peer, over `link`; blocking if `CUDA_LAUNCH_BLOCKING=1`.
    fn new(hello: ServerHello, link: Link) -> Self {
        let blocking = std::env::var("CUDA_LAUNCH_BLOCKING").is_ok_and(|v| v.trim() == "1");
        Self {
            hello,
            blocking,
            link,
        }
    }

    /// The address the peer answered on (`None` for a peer in this process).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        match &self.link {
            Link::Network(network) => Some(network.peer_addr),
            Link::InProcess(_) => None,
        }
    }

    /// What the server said about itself and its devices at connect.
    pub fn hello(&self) -> &ServerHello {
        &self.hello
    }

    /// Whether every call waits for its reply (`CUDA_LAUNCH_BLOCKING=1`).
    pub fn is_blocking(&self) -> bool {
        self.blocking
    }

    /// How many requests this session has numbered, of every thread. Two equal readings around a
    /// waited call that sent `n` requests, `n` apart, say that nothing else reached the peer meanwhile.
    pub fn requests_numbered(&self) -> u64 {
        match &self.link {
            Link::Network(network) => network.shared.numbered.load(Ordering::Acquire),
            Link::InProcess(link) => link.numbered.load(Ordering::Acquire),
        }
    }

    /// Whether the session has ended.
    pub fn is_lost(&self) -> bool {
        match &self.link {
            Link::Network(network) => network.shared.lost.load(Ordering::Acquire),
            Link::InProcess(link) => link.is_lost(),
        }
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
        match &self.link {
            Link::Network(network) => network.shared.submit(ctx, call, &[bulk], expects_reply),
            Link::InProcess(link) => link.submit(ctx, call, bulk, expects_reply),
        }
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
        if let Link::Network(network) = &self.link
            && policy.applies(src.len())
        {
            return upload::upload(self, network, ctx, dst, src, stream, policy);
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
    /// server waits for the stream first. From [`DOWNLOAD_APART`] bytes on, the bytes come back over the
    /// bulk connection.
    pub fn memcpy_dtoh(
        &self,
        ctx: u64,
        dst: &mut [u8],
        src: u64,
        stream: Option<u64>,
    ) -> Result<CUresult, ClientError> {
        let len = dst.len();
        // A large download comes back apart, over the bulk connections (see `Call::MemcpyDtoH`), its
        // pieces taking turns.
        let stripes = match &self.link {
            Link::Network(network) if len >= DOWNLOAD_APART => {
                network.shared.open_download_lanes(stream)?
            }
            _ => 0,
        };
        let pieces = len.div_ceil(COPY_CHUNK).max(1);
        let mut pending = Vec::with_capacity(pieces);
        for i in 0..pieces {
            let offset = i * COPY_CHUNK;
            let n = (len - offset).min(COPY_CHUNK);
            let call = Call::MemcpyDtoH {
                src: src + offset as u64,
                len: n as u64,
                stream,
                apart: (stripes > 0).then(|| (i % usize::from(stripes)) as u8),
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
                Reply::Data if answer.bulk.copy_to_slice(&mut dst[offset..offset + n]) => {}
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
        let Link::Network(network) = &self.link else {
            return WireStats::default();
        };
        let (connection, lifeline) = network.shared.connections();
        let mut total = WireStats {
            mtu: connection.stats().path.current_mtu,
            ..WireStats::default()
        };
        let bulk = lock(&network.shared.bulk).clone();
        for connection in [&connection, &lifeline].into_iter().chain(&bulk) {
            let stats = connection.stats();
            total.sent_bytes += stats.udp_tx.bytes;
            total.sent_datagrams += stats.udp_tx.datagrams;
            total.received_bytes += stats.udp_rx.bytes;
            total.received_datagrams += stats.udp_rx.datagrams;
        }
        for stripe in &bulk {
            let stats = stripe.stats();
            total.bulk_sent_bytes += stats.udp_tx.bytes;
            total.bulk_received_bytes += stats.udp_rx.bytes;
            total
                .bulk_stripes
                .push((stats.udp_tx.bytes, stats.udp_rx.bytes));
        }
        total
    }

    /// Ends the session in order: waits (briefly) for the server to finish queued work and free
    /// everything, then closes the connections.
    pub fn close(&self, timeout: Duration) {
        match &self.link {
            Link::Network(network) => network.close(timeout),
            Link::InProcess(link) => link.close(),
        }
    }
}

impl Network {
    /// [`Client::close`] over the network.
    fn close(&self, timeout: Duration) {
        self.shared.closing.store(true, Ordering::Release);
        // While the link is down there is nobody to say goodbye to: the serving side frees the session
        // at the end of its grace window.
        if !self.shared.lost.load(Ordering::Acquire)
            && !self.shared.suspended.load(Ordering::Acquire)
            && let Ok(Some(pending)) = self.shared.submit(0, Call::Goodbye, &[], true)
        {
            let _ = pending.wait_timeout(timeout);
        }
        self.shared
            .fail_all(ClientError::Lost("the client closed the session".into()));
        self.shared.close_connections();
        // Give the close frames a moment to leave (the process may be exiting right after). No `block_on`:
        // this may run from a library destructor, after the calling thread's tokio context is gone.
        let endpoints: Vec<quinn::Endpoint> = std::iter::once(self.endpoint.clone())
            .chain(
                self.shared
                    .resume
                    .get()
                    .and_then(|r| r.bulk.as_ref())
                    .into_iter()
                    .flat_map(BulkDialer::endpoints),
            )
            .collect();
        let (done, idle) = std::sync::mpsc::sync_channel(1);
        self.runtime.spawn(async move {
            let idle = async {
                for endpoint in endpoints {
                    endpoint.wait_idle().await;
                }
            };
            let _ = tokio::time::timeout(Duration::from_millis(200), idle).await;
            let _ = done.try_send(());
        });
        let _ = idle.recv_timeout(Duration::from_millis(250));
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        self.shared
            .fail_all(ClientError::Lost("the client was dropped".into()));
        self.shared.close_connections();
    }
}

/// State shared by the calling threads and the network tasks.
struct Shared {
    core: Mutex<Core>,
    /// Bytes of all lanes (see [`Backlog`]): `buffered` tells an upload whether the network waits;
    /// `retained` is bounded by [`SESSION_RETAIN_LIMIT`].
    total: Backlog,
    /// Wakes threads waiting for a backlog to fall, or for the link to come back.
    drained: Condvar,
    drained_lock: Mutex<()>,
    /// Requests numbered so far, of every thread (see [`Client::requests_numbered`]).
    numbered: AtomicU64,
    /// Set once the session ended (fast path for callers).
    lost: AtomicBool,
    /// Set when this side ends the session, so the end is not reported as a failure.
    closing: AtomicBool,
    /// Set while the link is down and the session is being resumed: submitting threads wait.
    suspended: AtomicBool,
    /// The session connection and the lifeline (replaced on resume).
    connections: Mutex<(quinn::Connection, quinn::Connection)>,
    /// The bulk connection ([`StreamOpen::Bulk`]), once attached: the lanes that carry bulk bytes open
    /// on it. Until then, without one (`GLEAM_BULK_CONNECTION=off`, or it could not be made) and after a
    /// resume, every lane opens on the session connection.
    bulk: Mutex<Vec<quinn::Connection>>,
    /// How to resume the session (from the peer's offer).
    resume: OnceLock<Resume>,
    /// A reply arrived that the serving side has not been told about.
    ack_due: Notify,
    /// Keeps the runtime's thread polling while a thread spins for its reply ([`client_busy_poll`]).
    busy: Arc<BusyPoll>,
    runtime: tokio::runtime::Handle,
}

/// What the client needs to resume its session after a drop.
struct Resume {
    peer: PeerId,
    /// The address that answered first, then the others.
    addrs: Vec<SocketAddr>,
    config: quinn::ClientConfig,
    secret: MeshSecret,
    endpoint: quinn::Endpoint,
    /// Makes the bulk connections (`None`: `GLEAM_BULK_CONNECTION=off`, or no thread for them).
    bulk: Option<BulkDialer>,
    session: u64,
    token: [u8; 32],
    /// The session's grace window, counted from the last time the peer heard from us.
    grace: Duration,
}

/// What the lock protects: numbering, lanes and waiters change together, so each lane's stream carries
/// its requests in seq order.
struct Core {
    session: engine::Session<Arc<Slot>>,
    lanes: HashMap<Lane, Arc<LaneTx>>,
}

/// What a lane (or the whole session) holds, for backpressure. Changed under the lane's lock.
#[derive(Default)]
struct Backlog {
    /// Bytes submitted that quinn has not taken yet.
    buffered: AtomicUsize,
    /// Bytes of requests kept until the serving side acknowledges them.
    retained: AtomicUsize,
}

/// One lane's sending half.
struct LaneTx {
    backlog: Backlog,
    state: Mutex<LaneOut<quinn::SendStream>>,
    /// Wakes the lane's writer task.
    flush: Notify,
}

impl Shared {
    fn new(
        connection: quinn::Connection,
        lifeline: quinn::Connection,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        Self {
            core: Mutex::new(Core {
                session: engine::Session::new(),
                lanes: HashMap::new(),
            }),
            total: Backlog::default(),
            drained: Condvar::new(),
            drained_lock: Mutex::new(()),
            numbered: AtomicU64::new(0),
            lost: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            suspended: AtomicBool::new(false),
            connections: Mutex::new((connection, lifeline)),
            bulk: Mutex::new(Vec::new()),
            resume: OnceLock::new(),
            ack_due: Notify::new(),
            busy: client_busy_poll(),
            runtime,
        }
    }

    fn core(&self) -> MutexGuard<'_, Core> {
        lock(&self.core)
    }

    /// The current session connection and lifeline.
    fn connections(&self) -> (quinn::Connection, quinn::Connection) {
        lock(&self.connections).clone()
    }

    fn connection(&self) -> quinn::Connection {
        lock(&self.connections).0.clone()
    }

    /// The connection a new `lane` opens on: for lanes that carry bulk bytes, the bulk connection of
    /// the lane's stripe ([`gleam_protocol::wire::stripe_of`]).
    fn connection_for(&self, lane: Lane) -> quinn::Connection {
        if let Some(stripe) = bulk_connection_of(&lock(&self.bulk), lane) {
            return stripe.clone();
        }
        self.connection()
    }

    /// The bulk connections attached (0 without any: bulk lanes then travel on the session connection).
    pub(crate) fn stripes(&self) -> usize {
        lock(&self.bulk).len()
    }

    /// The first bulk connection's statistics (its path, the frames it sent), if there is one.
    pub(crate) fn bulk_stats(&self) -> Option<quinn::ConnectionStats> {
        lock(&self.bulk).first().map(quinn::Connection::stats)
    }

    /// The stripe upload number `upload`'s chunks travel on: consecutive segments of a large copy
    /// (each its own upload) take turns, so the connections carry them at once.
    pub(crate) fn stripe_for(&self, upload: u64) -> u8 {
        (upload % self.stripes().max(1) as u64) as u8
    }

    /// Makes `attached` (from [`BulkDialer::connect`], or why there is none) the session's bulk
    /// connections and watches them. Best effort: without one, bulk lanes open on the session
    /// connection.
    fn install_bulk(
        self: &Arc<Self>,
        attached: Result<Result<Vec<quinn::Connection>, String>, std::sync::mpsc::RecvTimeoutError>,
    ) {
        let stripes = match attached {
            Ok(Ok(stripes)) => stripes,
            Ok(Err(err)) => {
                warn!(error = %err, "no bulk connection: uploads share the session connection");
                return;
            }
            Err(_) => {
                warn!("no bulk connection in time: uploads share the session connection");
                return;
            }
        };
        {
            let core = self.core();
            // A resume meanwhile moved every lane to its new connections: these are not needed.
            if core.session.generation() != 0 || core.session.lost().is_some() {
                for conn in &stripes {
                    conn.close(quinn::VarInt::from_u32(CLOSE_CLIENT_EXIT), b"not needed");
                }
                return;
            }
            *lock(&self.bulk) = stripes.clone();
        }
        debug!(
            stripes = stripes.len(),
            rtt_us = ?stripes.iter().map(|c| c.rtt().as_micros()).collect::<Vec<_>>(),
            "bulk connections attached"
        );
        // Losing one is losing the link (a resume follows); its close by the session process is the end.
        for conn in stripes {
            self.runtime.spawn(watch_session(conn, 0, self.clone()));
        }
    }

    /// Closes every connection of the session: this client is leaving.
    fn close_connections(&self) {
        let code = quinn::VarInt::from_u32(CLOSE_CLIENT_EXIT);
        let (connection, lifeline) = self.connections();
        connection.close(code, b"client exit");
        lifeline.close(code, b"client exit");
        // Kept (closed) for their counters: `wire_stats` after the close still counts their bytes.
        for bulk in &*lock(&self.bulk) {
            bulk.close(code, b"client exit");
        }
    }

    /// Registers the control lane's stream and starts its reader and writer tasks.
    fn add_lane(self: &Arc<Self>, lane: Lane, send: quinn::SendStream, recv: quinn::RecvStream) {
        let tx = Arc::new(LaneTx {
            backlog: Backlog::default(),
            state: Mutex::new(LaneOut::attached(lane, send)),
            flush: Notify::new(),
        });
        self.core().lanes.insert(lane, tx.clone());
        self.runtime.spawn(lane_writer(tx, self.clone()));
        self.runtime
            .spawn(lane_reader(recv, PieceReader::new(), 0, self.clone()));
    }

    /// Starts the tasks that watch a (new) connection and its lifeline, and exchange acknowledgements.
    fn start_connection_tasks(
        self: &Arc<Self>,
        generation: u64,
        connection: &quinn::Connection,
        lifeline: &quinn::Connection,
    ) {
        self.runtime
            .spawn(watch_session(connection.clone(), generation, self.clone()));
        self.runtime
            .spawn(watch_lifeline(lifeline.clone(), generation, self.clone()));
        self.runtime
            .spawn(send_acks(connection.clone(), generation, self.clone()));
        self.runtime
            .spawn(read_acks(connection.clone(), generation, self.clone()));
    }

    /// Opens the lanes that carry `stream`'s downloads apart (its bulk lanes, one on each bulk
    /// connection), and announces them at once: the serving side answers there, and holds the answers
    /// until the lane arrives. Returns how many there are: 0 without a bulk connection (downloads stay
    /// on their lane).
    fn open_download_lanes(self: &Arc<Self>, stream: Option<u64>) -> Result<u8, ClientError> {
        let stripes = self.stripes() as u8;
        for stripe in 0..stripes {
            let lane = Lane(bulk_stream(stream, stripe));
            let tx = {
                let mut core = self.core();
                core.session.check()?;
                self.open_lane(&mut core, lane)
            };
            self.flush_now(&tx, lock(&tx.state), Moved::default());
        }
        Ok(stripes)
    }

    /// Opens the QUIC stream of a new lane (under the core lock, so the lane's first frame precedes any
    /// request on it). With the link down the lane starts without a stream: the resume opens it.
    fn open_lane(self: &Arc<Self>, core: &mut Core, lane: Lane) -> Arc<LaneTx> {
        if let Some(tx) = core.lanes.get(&lane) {
            return tx.clone();
        }
        let connection = self.connection_for(lane);
        // Opening needs stream credit, granted by the peer in advance (1024 streams); if none is left
        // this waits on the client's runtime for the peer to grant more.
        let opened = self
            .runtime
            .block_on(async move { connection.open_bi().await });
        let (send, recv) = match opened {
            Ok((send, recv)) => (Some(send), Some(recv)),
            Err(err) => {
                debug!(lane = lane.0, error = %err, "lane opened while the link is down");
                (None, None)
            }
        };
        // The lane's opening frame goes out with its first request; it is counted like any request's
        // bytes (the flush that hands them to quinn subtracts them).
        let mut moved = Moved::default();
        let tx = Arc::new(LaneTx {
            backlog: Backlog::default(),
            state: Mutex::new(LaneOut::opening(lane, send, &mut moved)),
            flush: Notify::new(),
        });
        self.account(&tx, &moved);
        core.lanes.insert(lane, tx.clone());
        self.runtime.spawn(lane_writer(tx.clone(), self.clone()));
        if let Some(recv) = recv {
            let generation = core.session.generation();
            self.runtime.spawn(lane_reader(
                recv,
                PieceReader::new(),
                generation,
                self.clone(),
            ));
        }
        tx
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
        // A new lane is not opened on a link that is down.
        self.wait_for_room(None)?;
        // A large last part is copied into a buffer of its own (warm, from the pool), before any lock is
        // taken: it travels to quinn as it is, and is kept with its request for resending.
        let (bulk, owned) = match bulk.split_last() {
            Some((last, rest)) if last.len() >= pool::OWN_BUFFER_FROM => {
                (rest, Some(pool::copy(last)))
            }
            _ => (bulk, None),
        };
        let ordering = call.ordering();
        let lane = ordering.stream.map_or(Lane::CONTROL, Lane::of_stream);
        let tx = {
            let mut core = self.core();
            core.session.check()?;
            self.open_lane(&mut core, lane)
        };
        // Waits for room on this lane only (lanes stay once opened), before taking a number.
        self.wait_for_room(Some(&tx))?;
        let mut core = self.core();
        let slot = expects_reply.then(|| Arc::new(Slot::new()));
        let numbered = core.session.submit(ordering, slot.clone())?;
        self.numbered.fetch_add(1, Ordering::AcqRel);
        debug_assert_eq!(numbered.lane, lane, "the lane opened is the lane numbered");
        let seq = numbered.seq;
        let request = Request {
            seq,
            ctx,
            expects_reply,
            deps: numbered.deps,
            call,
        };
        let pending = slot.map(|slot| {
            let spin = spin_for(numbered.posted_before.unwrap_or(0));
            Pending {
                slot,
                spin,
                // Taken before the request goes, so the network thread is awake when it leaves.
                hot: if spin.is_zero() {
                    None
                } else {
                    self.busy.hold()
                },
            }
        });
        // The lane's lock is taken before the numbering lock is let go, so that the lane's frames are
        // in the order of their numbers.
        let mut state = lock(&tx.state);
        let mut moved = Moved::default();
        // The head goes straight into the batch (which is left as it was on failure).
        let queued = match state.queue(&request, bulk_len, &mut moved) {
            Ok(queued) => queued,
            Err(err) => {
                // The seq is taken: a gap would hold every later barrier back, so the session cannot
                // go on.
                drop(state);
                drop(core);
                let err = ClientError::Protocol(format!("cannot encode request {seq}: {err}"));
                self.fail_all(err.clone());
                return Err(err);
            }
        };
        // Copying a chunk's megabytes into the batch needs only the lane: every other thread's calls
        // (another stream's launch, its synchronization) take the numbering lock, and must not wait for
        // this copy (measured on the H100 over the 1 Gbit/s link: each 8 MiB chunk of an upload held
        // the other stream's loop back by 1-2 ms, once per chunk).
        drop(core);
        for part in bulk {
            state.append(part, &mut moved);
        }
        let sealed = owned.is_some();
        if let Some(owned) = owned {
            state.append_owned(owned, &mut moved);
        }
        if expects_reply || sealed || state.is_batch_full() {
            // Someone waits (or the batch is large): hand everything to quinn now, from this thread.
            self.flush_now(&tx, state, moved);
        } else {
            self.account(&tx, &moved);
            drop(state);
            if queued.starts_burst {
                // A fire-and-forget burst: the writer task hands the batch over shortly, coalesced.
                tx.flush.notify_one();
            }
        }
        Ok(pending)
    }

    /// Hands lane `tx`'s batch and pending chunks to quinn from the calling thread (`state` is its
    /// locked sending half, `moved` what the caller changed there); what quinn cannot take yet is left to
    /// the lane's writer. A failed write is the link going down: the requests are kept and go again on
    /// resume.
    fn flush_now(
        &self,
        tx: &LaneTx,
        mut state: MutexGuard<'_, LaneOut<quinn::SendStream>>,
        mut moved: Moved,
    ) {
        let flushed = state.poll_transmit(&mut Context::from_waker(Waker::noop()), &mut moved);
        // Counted under the lane's lock: a reply acknowledging these frames finds them counted.
        self.account(tx, &moved);
        drop(state);
        if flushed.is_pending() {
            tx.flush.notify_one();
        }
    }

    /// Waits while lane `tx` (if given) holds more than [`BUFFER_LIMIT`] bytes quinn has not taken or
    /// more than [`RETAIN_LIMIT`] unacknowledged bytes, while the session holds more than
    /// [`SESSION_RETAIN_LIMIT`], or while the link is down (until it is resumed, or the session is lost).
    fn wait_for_room(&self, tx: Option<&LaneTx>) -> Result<(), ClientError> {
        let full = || {
            tx.is_some_and(|tx| {
                tx.backlog.buffered.load(Ordering::Acquire) >= BUFFER_LIMIT
                    || tx.backlog.retained.load(Ordering::Acquire) >= RETAIN_LIMIT
            }) || self.total.retained.load(Ordering::Acquire) >= SESSION_RETAIN_LIMIT
                || self.suspended.load(Ordering::Acquire)
        };
        if !full() {
            return Ok(());
        }
        let mut guard = lock(&self.drained_lock);
        while full() && !self.lost.load(Ordering::Acquire) {
            guard = self
                .drained
                .wait_timeout(guard, Duration::from_millis(50))
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
        drop(guard);
        if self.lost.load(Ordering::Acquire) {
            return Err(self.lost_error());
        }
        Ok(())
    }

    /// Accounts for what a change to lane `tx` moved (called under the lane's lock, so a reply
    /// acknowledging frames finds them counted); wakes the submitters a fall below a limit lets go on.
    fn account(&self, tx: &LaneTx, moved: &Moved) {
        // Additions first: the session's totals are shared, and must never seem to fall below zero.
        if moved.queued > 0 {
            tx.backlog
                .buffered
                .fetch_add(moved.queued, Ordering::AcqRel);
            self.total
                .buffered
                .fetch_add(moved.queued, Ordering::AcqRel);
        }
        if moved.kept > 0 {
            tx.backlog.retained.fetch_add(moved.kept, Ordering::AcqRel);
            self.total.retained.fetch_add(moved.kept, Ordering::AcqRel);
        }
        let crossed =
            |before: usize, fell: usize, limit: usize| before >= limit && before - fell < limit;
        let mut wake = false;
        let gone = moved.taken + moved.dropped;
        if gone > 0 {
            self.total.buffered.fetch_sub(gone, Ordering::AcqRel);
            let before = tx.backlog.buffered.fetch_sub(gone, Ordering::AcqRel);
            wake |= crossed(before, gone, BUFFER_LIMIT);
        }
        let freed = moved.freed;
        if freed > 0 {
            let lane_before = tx.backlog.retained.fetch_sub(freed, Ordering::AcqRel);
            let total_before = self.total.retained.fetch_sub(freed, Ordering::AcqRel);
            wake |= crossed(lane_before, freed, RETAIN_LIMIT)
                || crossed(total_before, freed, SESSION_RETAIN_LIMIT);
        }
        if wake {
            self.wake_submitters();
        }
    }

    /// Lane `tx`'s serving side acknowledged its requests up to `through`.
    fn acked(&self, tx: &LaneTx, through: u64) {
        let mut state = lock(&tx.state);
        let mut moved = Moved::default();
        state.handle_ack(through, &mut moved);
        self.account(tx, &moved);
    }

    fn wake_submitters(&self) {
        let _guard = lock(&self.drained_lock);
        self.drained.notify_all();
    }

    /// Hands a reply that came on connection `generation` (on any lane) to its waiter. `Ok(false)`: the
    /// connection was left behind (the reply comes again on the new one).
    fn deliver(
        &self,
        generation: u64,
        reply: ReplyFrame,
        bulk: Pieces,
    ) -> Result<bool, ClientError> {
        let (slot, tx) = {
            let mut core = self.core();
            match core.session.handle_reply(generation, reply.seq)? {
                Delivery::Stale => return Ok(false),
                // Acknowledges the request's lane, not the one the reply came on (a download's
                // reply comes apart).
                Delivery::To { waiter, lane } => (waiter, core.lanes.get(&lane).cloned()),
            }
        };
        // A reply says its request, and every earlier one of the request's lane, arrived.
        if let Some(tx) = tx {
            self.acked(&tx, reply.seq);
        }
        slot.deliver(Ok(Answer {
            result: reply.result,
            reply: reply.reply,
            bulk,
        }));
        self.ack_due.notify_one();
        Ok(true)
    }

    /// Ends the session: every pending and later call fails with `err` (the first reason wins).
    fn fail_all(&self, err: ClientError) {
        let waiters: Vec<Arc<Slot>> = {
            let mut core = self.core();
            let (err, waiters) = core.session.fail(err);
            self.lost.store(true, Ordering::Release);
            for slot in &waiters {
                slot.deliver(Err(err.clone()));
            }
            waiters
        };
        drop(waiters);
        self.wake_submitters();
    }

    fn lost_error(&self) -> ClientError {
        self.core()
            .session
            .lost()
            .cloned()
            .unwrap_or_else(|| ClientError::Lost("the session ended".into()))
    }

    /// Reports the end of the session (once, unless this side is closing it).
    fn end(&self, err: ClientError) {
        if !self.lost.load(Ordering::Acquire) && !self.closing.load(Ordering::Acquire) {
            warn!(reason = %err, "CUDA session ended");
        }
        self.fail_all(err);
        if let ClientError::Protocol(reason) = &self.lost_error() {
            self.connection()
                .close(quinn::VarInt::from_u32(1), reason.as_bytes());
        }
    }

    /// Connection `generation` went silent for `quiet` (or failed): calls wait while the session is
    /// resumed on a new connection, within the session's grace window.
    fn suspend(self: &Arc<Self>, generation: u64, quiet: Duration, why: String) {
        {
            let core = self.core();
            if !core.session.is_current(generation) || core.session.lost().is_some() {
                return;
            }
        }
        let Some(resume) = self.resume.get() else {
            self.end(ClientError::Lost(why));
            return;
        };
        if self.closing.load(Ordering::Acquire) || resume.grace <= quiet {
            self.end(ClientError::Lost(why));
            return;
        }
        if self.suspended.swap(true, Ordering::AcqRel) {
            return;
        }
        let window = resume.grace - quiet;
        warn!(reason = %why, window_ms = window.as_millis() as u64,
            "lost the link to the GPU peer: calls wait while the session is resumed");
        self.runtime
            .spawn(reconnect(self.clone(), window + RESUME_MARGIN, why));
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a thread panicked while holding it; the state stays consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the peer answered to a request for a session.
struct Offer {
    port: u16,
    token: [u8; 32],
    session: u64,
    grace: Duration,
}

/// Asks the peer for a session (`request`: open one, or resume one) on the authenticated connection:
/// where its process listens, or why there is none (`Err` inside: refused, or gone).
async fn ask_for_session(
    lifeline: &quinn::Connection,
    request: &Control,
) -> Result<Result<Offer, String>, ClientError> {
    let (mut send, mut recv) = lifeline
        .open_bi()
        .await
        .map_err(|e| ClientError::Lost(e.to_string()))?;
    let mut out = Vec::new();
    frame::encode(request, &[], &mut out).map_err(lost_frame)?;
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
        Control::Offer {
            port,
            token,
            session,
            grace_ms,
        } => Ok(Ok(Offer {
            port,
            token,
            session,
            grace: Duration::from_millis(grace_ms),
        })),
        Control::Refused { protocol, .. } if protocol != PROTOCOL_VERSION => {
            Err(ClientError::Version {
                client: PROTOCOL_VERSION,
                server: protocol,
            })
        }
        Control::Refused { reason, .. } | Control::Gone { reason } => Ok(Err(reason)),
        Control::Open { .. } | Control::Resume { .. } => {
            Err(ClientError::Protocol("expected a session offer".into()))
        }
    }
}

/// Whether sessions get a bulk connection: `GLEAM_BULK_CONNECTION=off` keeps every lane on the session
/// connection (for comparison).
fn bulk_connection_enabled() -> bool {
    !std::env::var("GLEAM_BULK_CONNECTION").is_ok_and(|v| gleam_protocol::tuning::turned_off(&v))
}

/// How long the session process may take to admit the bulk connections.
const BULK_ATTACH_TIMEOUT: Duration = Duration::from_secs(5);

/// How many bulk connections a session stripes its large copies over: `GLEAM_BULK_STRIPES` (1 to
/// [`MAX_STRIPES`](gleam_protocol::wire::MAX_STRIPES)), by default 1. One QUIC connection is encrypted
/// and decrypted by one thread at each end, which at Ethernet's 1500-byte datagrams tops out below a
/// 10 Gbit/s link (H200 host, loopback at 1452-byte datagrams: downloads 468 MiB/s on one, 907 on two,
/// 1121 on four); several carry one copy's segments and pieces at once, each on a thread of its own.
fn bulk_stripes() -> Result<u8, String> {
    let max = gleam_protocol::wire::MAX_STRIPES;
    match std::env::var("GLEAM_BULK_STRIPES") {
        Err(_) => Ok(1),
        Ok(text) => match text.trim().parse::<u8>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(format!(
                "GLEAM_BULK_STRIPES={text:?} is not a number of connections from 1 to {max}"
            )),
        },
    }
}

/// Makes a session's bulk connections ([`StreamOpen::Bulk`]). The first (stripe 0) comes from the
/// session's own endpoint and runtime; the others from an endpoint whose connections are driven by
/// threads of their own (the `gleam-bulk` runtime, a thread per extra stripe): a quinn connection is
/// encrypted and decrypted by the thread that drives it, so several stripes work in parallel.
#[derive(Clone, Debug)]
struct BulkDialer {
    /// Stripe 0's: the session's endpoint and runtime.
    first: (quinn::Endpoint, tokio::runtime::Handle),
    /// The other stripes': an endpoint made on the `gleam-bulk` runtime (quinn runs an endpoint's
    /// and a connection's driver on the runtime it is made on).
    others: Option<(quinn::Endpoint, tokio::runtime::Handle)>,
    stripes: u8,
}

impl BulkDialer {
    /// The dialer, and the runtime of the stripes past the first (none for one stripe); `None` when
    /// bulk connections are turned off (`GLEAM_BULK_CONNECTION=off`: bulk lanes share the session
    /// connection).
    fn start(
        endpoint: &quinn::Endpoint,
        runtime: &tokio::runtime::Runtime,
    ) -> Option<(Option<tokio::runtime::Runtime>, Self)> {
        if !bulk_connection_enabled() {
            return None;
        }
        let stripes = bulk_stripes()
            .inspect_err(|err| warn!("{err}: one bulk connection"))
            .unwrap_or(1);
        let first = (endpoint.clone(), runtime.handle().clone());
        let others = (stripes > 1)
            .then(|| {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(usize::from(stripes - 1))
                    .thread_name("gleam-bulk")
                    .enable_all()
                    .build()
                    .inspect_err(|err| warn!(%err, "no threads for more bulk connections: one"))
                    .ok()?;
                let endpoint = runtime
                    .block_on(async { gleam_auth::dial::client_endpoint() })
                    .inspect_err(|err| warn!(%err, "no endpoint for more bulk connections: one"))
                    .ok()?;
                Some((runtime, endpoint))
            })
            .flatten();
        let (runtime, others) = match others {
            Some((runtime, endpoint)) => {
                let handle = runtime.handle().clone();
                (Some(runtime), Some((endpoint, handle)))
            }
            None => (None, None),
        };
        let stripes = if others.is_some() { stripes } else { 1 };
        Some((
            runtime,
            Self {
                first,
                others,
                stripes,
            },
        ))
    }

    /// The endpoints the bulk connections come from (for the close's wait).
    fn endpoints(&self) -> impl Iterator<Item = quinn::Endpoint> + use<> {
        self.others
            .as_ref()
            .map(|(endpoint, _)| endpoint.clone())
            .into_iter()
    }

    /// Opens the bulk connections to the session process at `addr` at once, each admitted within
    /// `within`, stripe 0 first (the session process drives the first one on its network thread and the
    /// others on threads of their own); those that were (at least one), or why none was.
    async fn connect(
        &self,
        config: quinn::ClientConfig,
        peer: PeerId,
        addr: SocketAddr,
        token: [u8; 32],
        within: Duration,
    ) -> Result<Vec<quinn::Connection>, String> {
        let dial = |(endpoint, runtime): &(quinn::Endpoint, tokio::runtime::Handle)| {
            runtime.spawn(connect_bulk(
                endpoint.clone(),
                config.clone(),
                peer,
                addr,
                token,
                within,
            ))
        };
        let mut made = Vec::new();
        let mut why = String::from("no bulk connection was asked for");
        let mut take = |dialed: Result<
            Result<quinn::Connection, String>,
            tokio::task::JoinError,
        >| {
            match dialed {
                Ok(Ok(conn)) => made.push(conn),
                Ok(Err(err)) => why = err,
                Err(err) => why = err.to_string(),
            }
        };
        // Stripe 0 first, so that it arrives first and the session process drives it on its network
        // thread; the others then at once.
        take(dial(&self.first).await);
        if let Some(others) = &self.others {
            let dials: Vec<_> = (1..self.stripes).map(|_| dial(others)).collect();
            for dialed in dials {
                take(dialed.await);
            }
        }
        if made.is_empty() { Err(why) } else { Ok(made) }
    }
}

/// `config` with its transport fitted to the path to `addr` (loopback datagrams to a peer on this
/// machine: `gleam_auth::tls::fit_to_path`).
fn fitted(config: &quinn::ClientConfig, addr: SocketAddr) -> quinn::ClientConfig {
    let mut config = config.clone();
    config.transport_config(Arc::new(gleam_auth::tls::transport_config_to(addr)));
    config
}

/// Opens the session's bulk connection ([`StreamOpen::Bulk`]) to the session process at `addr`, with
/// [`gleam_auth::tls::bulk_transport_config`]; done once the session process
/// admitted it (it finishes the opening stream, or closes the connection), within `within`.
async fn connect_bulk(
    endpoint: quinn::Endpoint,
    mut config: quinn::ClientConfig,
    peer: PeerId,
    addr: SocketAddr,
    token: [u8; 32],
    within: Duration,
) -> Result<quinn::Connection, String> {
    config.transport_config(Arc::new(gleam_auth::tls::bulk_transport_config_to(addr)));
    let attach = async {
        let conn = endpoint
            .connect_with(config, addr, &gleam_auth::tls::server_name(peer))
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        let mut opening = Vec::new();
        frame::encode(&StreamOpen::Bulk { token }, &[], &mut opening).map_err(|e| e.to_string())?;
        send.write_all(&opening).await.map_err(|e| e.to_string())?;
        recv.read_to_end(0).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(conn)
    };
    tokio::time::timeout(within, attach)
        .await
        .map_err(|_| format!("not admitted within {within:?}"))?
}

/// The bulk connection `lane` travels on, of those a session has (`bulk`, stripe 0 first): its stripe's
/// ([`stripe_of`]; with fewer connections than stripes, they share). `None` for a lane that carries no
/// bulk bytes, or without bulk connections: it travels on the session connection.
fn bulk_connection_of(bulk: &[quinn::Connection], lane: Lane) -> Option<&quinn::Connection> {
    if !lane.carries_bulk() || bulk.is_empty() {
        return None;
    }
    bulk.get(usize::from(stripe_of(lane.0)) % bulk.len())
}

/// Why one attempt to resume did not.
enum Attempt {
    /// The peer answered: the session is no more.
    Gone(String),
    /// Try again (the peer was not reached, or the attempt broke off).
    Failed(String),
}

/// Resumes the session until `window` passes: then, or when the peer says the session is gone, the
/// session is lost.
async fn reconnect(shared: Arc<Shared>, window: Duration, why: String) {
    let Some(resume) = shared.resume.get() else {
        return;
    };
    let started = Instant::now();
    let deadline = started + window;
    let mut attempts = 0u32;
    loop {
        if shared.lost.load(Ordering::Acquire) {
            return;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            shared.end(ClientError::Lost(format!(
                "the GPU peer stayed unreachable past the session's grace window ({:.1} s): {why}",
                resume.grace.as_secs_f64()
            )));
            return;
        }
        attempts += 1;
        match tokio::time::timeout(left.min(RESUME_ATTEMPT), resume_once(&shared, resume)).await {
            Ok(Ok(())) => {
                info!(
                    attempts,
                    after_ms = started.elapsed().as_millis() as u64,
                    stripes = shared.stripes(),
                    "CUDA session resumed on a new connection"
                );
                return;
            }
            Ok(Err(Attempt::Gone(reason))) => {
                shared.end(ClientError::Lost(format!(
                    "the GPU peer no longer has this session: {reason}"
                )));
                return;
            }
            Ok(Err(Attempt::Failed(reason))) => debug!(attempts, %reason, "resume attempt failed"),
            Err(_) => debug!(attempts, "resume attempt timed out"),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::sleep(RESUME_PAUSE.min(left)).await;
    }
}

/// One attempt: dial the peer, ask to resume, reach the session process, exchange marks, and switch every
/// lane to the new connection.
async fn resume_once(shared: &Arc<Shared>, resume: &Resume) -> Result<(), Attempt> {
    let failed = |e: &dyn std::fmt::Display| Attempt::Failed(e.to_string());
    let pace = gleam_auth::dial::Pace {
        stagger: gleam_auth::dial::Pace::default().stagger,
        attempt_timeout: RESUME_DIAL,
    };
    let dialed = gleam_auth::dial::dial(
        &resume.endpoint,
        &resume.config,
        resume.peer,
        &resume.addrs,
        pace,
    )
    .await
    .map_err(|e| Attempt::Failed(e.reasons()))?;
    let lifeline = dialed.conn;
    let mut attempt = Attempting(vec![lifeline.clone()]);
    authenticate_as_client(&lifeline, &resume.secret)
        .await
        .map_err(|e| failed(&e))?;
    let request = Control::Resume {
        protocol: PROTOCOL_VERSION,
        session: resume.session,
        token: resume.token,
    };
    let offer = match ask_for_session(&lifeline, &request).await {
        Ok(Ok(offer)) => offer,
        Ok(Err(reason)) => return Err(Attempt::Gone(reason)),
        Err(err @ ClientError::Version { .. }) => return Err(Attempt::Gone(err.to_string())),
        Err(err) => return Err(failed(&err)),
    };
    let mut session_addr = dialed.addr;
    session_addr.set_port(offer.port);
    let connection = resume
        .endpoint
        .connect_with(
            fitted(&resume.config, session_addr),
            session_addr,
            &gleam_auth::tls::server_name(resume.peer),
        )
        .map_err(|e| failed(&e))?
        .await
        .map_err(|e| failed(&e))?;
    attempt.0.push(connection.clone());
    let (mut send, mut recv) = connection.open_bi().await.map_err(|e| failed(&e))?;
    // From here on, replies on earlier connections are not delivered: the marks sent are final.
    let (generation, replies, lanes) = {
        let mut core = shared.core();
        let (generation, replies) = core.session.begin_resume();
        let lanes: Vec<Lane> = core
            .lanes
            .keys()
            .copied()
            .filter(|&l| l != Lane::CONTROL)
            .collect();
        (generation, replies, lanes)
    };
    let mut opening = Vec::new();
    frame::encode(
        &StreamOpen::Resume {
            token: resume.token,
            replies,
        },
        &[],
        &mut opening,
    )
    .map_err(|e| failed(&e))?;
    send.write_all(&opening).await.map_err(|e| failed(&e))?;
    let mut frames = FrameReader::new();
    let resumed: Resumed = loop {
        if let Some(frame) = frames.next_frame().map_err(|e| failed(&e))? {
            break frame
                .decode()
                .map_err(|e| Attempt::Failed(format!("undecodable answer to the resume: {e}")))?;
        }
        match recv.read_chunk(64 << 10, true).await {
            Ok(Some(chunk)) => frames.feed(&chunk.bytes),
            Ok(None) | Err(_) => return Err(Attempt::Failed(close_reason(&connection))),
        }
    };
    // The session process has taken the new connection: new bulk connections may join it (best
    // effort: without them, the bulk lanes resume on the session connection).
    let bulk = match &resume.bulk {
        Some(dialer) => {
            let made = dialer
                .connect(
                    resume.config.clone(),
                    resume.peer,
                    session_addr,
                    resume.token,
                    RESUME_DIAL,
                )
                .await;
            match made {
                Ok(bulk) => {
                    attempt.0.extend(bulk.iter().cloned());
                    bulk
                }
                Err(err) => {
                    debug!(error = %err, "the resumed session has no bulk connection");
                    Vec::new()
                }
            }
        }
        None => Vec::new(),
    };
    let mut streams = HashMap::new();
    for lane in lanes {
        let on = bulk_connection_of(&bulk, lane).unwrap_or(&connection);
        let (send, recv) = on.open_bi().await.map_err(|e| failed(&e))?;
        streams.insert(lane, (send, recv));
    }
    switch(
        shared,
        generation,
        &resumed.received,
        (connection, lifeline, bulk),
        (
            send,
            recv,
            PieceReader::after(frames.into_buffered()).map_err(|e| failed(&e))?,
        ),
        streams,
    )?;
    attempt.0.clear();
    Ok(())
}

/// An attempt's connections, closed as abandoned unless it succeeds (dropped, a quinn connection closes
/// with code 0, which the session process would take for this client's exit).
struct Attempting(Vec<quinn::Connection>);

impl Drop for Attempting {
    fn drop(&mut self) {
        for connection in &self.0 {
            connection.close(
                quinn::VarInt::from_u32(CLOSE_RESUME_ABANDONED),
                b"resume attempt abandoned",
            );
        }
    }
}

/// Moves every lane to the new connection: its stream starts with the requests the session process has
/// not received, then what was not sent yet.
fn switch(
    shared: &Arc<Shared>,
    generation: u64,
    received: &Marks,
    (connection, lifeline, bulk): (quinn::Connection, quinn::Connection, Vec<quinn::Connection>),
    control: (quinn::SendStream, quinn::RecvStream, PieceReader),
    mut streams: HashMap<Lane, (quinn::SendStream, quinn::RecvStream)>,
) -> Result<(), Attempt> {
    let core = shared.core();
    if !core.session.is_current(generation) {
        return Err(Attempt::Failed("a newer resume attempt took over".into()));
    }
    if core
        .lanes
        .keys()
        .any(|&l| l != Lane::CONTROL && !streams.contains_key(&l))
    {
        // A lane was opened meanwhile: the next attempt opens it too.
        return Err(Attempt::Failed(
            "a lane was opened during the resume".into(),
        ));
    }
    let mut control = Some(control);
    let mut readers = Vec::new();
    for (&lane, tx) in &core.lanes {
        let (send, recv, frames) = if lane == Lane::CONTROL {
            let Some(control) = control.take() else {
                continue;
            };
            control
        } else {
            let Some((send, recv)) = streams.remove(&lane) else {
                continue;
            };
            (send, recv, PieceReader::new())
        };
        let mut state = lock(&tx.state);
        let mut moved = Moved::default();
        state.resume(send, mark_of(received, lane), &mut moved);
        // The counts change under the lane's lock, so an acknowledgement never finds them behind.
        shared.account(tx, &moved);
        drop(state);
        readers.push((recv, frames));
        tx.flush.notify_one();
    }
    *lock(&shared.connections) = (connection.clone(), lifeline.clone());
    // Every lane now travels on the new connections; the old bulk connections are left behind (the
    // session process closes them too).
    let old = std::mem::replace(&mut *lock(&shared.bulk), bulk.clone());
    for old in old {
        old.close(
            quinn::VarInt::from_u32(CLOSE_CLIENT_EXIT),
            b"superseded by the resumed connection",
        );
    }
    drop(core);
    for bulk in bulk {
        shared
            .runtime
            .spawn(watch_session(bulk, generation, shared.clone()));
    }
    for (recv, frames) in readers {
        shared
            .runtime
            .spawn(lane_reader(recv, frames, generation, shared.clone()));
    }
    shared.start_connection_tasks(generation, &connection, &lifeline);
    shared.suspended.store(false, Ordering::Release);
    shared.wake_submitters();
    Ok(())
}

/// One lane's writer: hands the lane's batch (and what quinn could not take) to quinn, on whichever
/// connection is current.
async fn lane_writer(tx: Arc<LaneTx>, shared: Arc<Shared>) {
    loop {
        tx.flush.notified().await;
        // A calling thread's inline flush polls quinn with a no-op waker, which replaces this task's: a
        // notification while quinn is full therefore re-polls, registering this task again (else a full
        // send window would never wake anyone, and a large copy stalled for good).
        let _ = loop {
            let flushed = tokio::select! {
                biased;
                flushed = poll_fn(|cx| {
                    let mut moved = Moved::default();
                    let mut state = lock(&tx.state);
                    let flushed = state.poll_transmit(cx, &mut moved);
                    // Counted under the lane's lock: a reply acknowledging these frames finds them
                    // counted.
                    shared.account(&tx, &moved);
                    flushed
                }) => Some(flushed),
                () = tx.flush.notified() => None,
            };
            if let Some(result) = flushed {
                break result;
            }
        };
        // A failed write is the link going down: the connection's watcher starts the resume.
        if shared.lost.load(Ordering::Acquire) {
            return;
        }
    }
}

/// One lane's reader on one connection: routes replies to their waiters by `seq` (a lane may carry
/// replies to other lanes' requests: downloads apart).
async fn lane_reader(
    mut recv: quinn::RecvStream,
    mut frames: PieceReader,
    generation: u64,
    shared: Arc<Shared>,
) {
    let err = 'lane: loop {
        loop {
            let Some(frame) = frames.next_frame() else {
                break;
            };
            let reply: ReplyFrame = match frame.decode() {
                Ok(reply) => reply,
                Err(err) => {
                    break 'lane ClientError::Protocol(format!("undecodable reply: {err}"));
                }
            };
            match shared.deliver(generation, reply, frame.bulk) {
                Ok(true) => {}
                // A resume left this connection behind.
                Ok(false) => return,
                Err(err) => break 'lane err,
            }
        }
        match recv.read_chunk(usize::MAX, true).await {
            Ok(Some(chunk)) => {
                if let Err(err) = frames.feed(chunk.bytes) {
                    break ClientError::Protocol(err.to_string());
                }
            }
            Ok(None) if frames.is_mid_frame() => {
                break ClientError::Protocol("a reply stream ended inside a frame".into());
            }
            // The stream ended or the connection is going: the connection's watcher decides what
            // happens (a resume sends the missing replies again; a partial frame is dropped).
            Ok(None) | Err(_) => return,
        }
    };
    shared.end(err);
}

/// The session connection: the serving side closing it ends the session; losing it starts a resume.
async fn watch_session(connection: quinn::Connection, generation: u64, shared: Arc<Shared>) {
    let err = connection.closed().await;
    match err {
        quinn::ConnectionError::ApplicationClosed(_) => {
            // The session process closes it when the session ends (or this client broke the protocol);
            // a connection it left behind for a resumed one is no longer watched.
            if shared.core().session.is_current(generation) {
                shared.end(ClientError::Lost(close_reason(&connection)));
            }
        }
        quinn::ConnectionError::LocallyClosed => {}
        quinn::ConnectionError::TimedOut => shared.suspend(
            generation,
            Duration::from_millis(u64::from(gleam_auth::tls::IDLE_TIMEOUT_MS)),
            close_reason(&connection),
        ),
        other => shared.suspend(generation, Duration::ZERO, other.to_string()),
    }
}

/// The lifeline: the peer closes it with the reason when the session process dies. It may also drop
/// with the link (the resume brings a new one).
async fn watch_lifeline(lifeline: quinn::Connection, generation: u64, shared: Arc<Shared>) {
    let err = lifeline.closed().await;
    if let quinn::ConnectionError::ApplicationClosed(close) = &err
        && close.error_code != quinn::VarInt::from_u32(0)
        && shared.core().session.is_current(generation)
    {
        let reason = String::from_utf8_lossy(&close.reason).into_owned();
        shared.end(ClientError::Lost(format!(
            "the peer's session process failed: {reason}"
        )));
    }
}

/// Tells the serving side, now and then, which replies arrived (so it can forget them), on this
/// connection's unidirectional stream.
async fn send_acks(connection: quinn::Connection, generation: u64, shared: Arc<Shared>) {
    let Ok(mut send) = connection.open_uni().await else {
        return;
    };
    let mut out = Vec::new();
    loop {
        tokio::select! {
            () = shared.ack_due.notified() => tokio::time::sleep(ACK_DELAY).await,
            () = tokio::time::sleep(ACK_TICK) => {}
        }
        let through = match shared.core().session.poll_acks(generation) {
            AckPoll::Stop => return,
            AckPoll::Quiet => continue,
            AckPoll::Send(awaited) => awaited,
        };
        out.clear();
        if frame::encode(&through, &[], &mut out).is_err() || send.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// Applies the serving side's acknowledgements of requests (it opens one unidirectional stream).
async fn read_acks(connection: quinn::Connection, generation: u64, shared: Arc<Shared>) {
    let Ok(mut recv) = connection.accept_uni().await else {
        return;
    };
    let mut frames = FrameReader::new();
    loop {
        loop {
            let acks = match frames.next_frame() {
                Ok(Some(frame)) => match frame.decode::<Acks>() {
                    Ok(acks) => acks,
                    Err(err) => {
                        shared.end(ClientError::Protocol(format!(
                            "undecodable acknowledgement: {err}"
                        )));
                        return;
                    }
                },
                Ok(None) => break,
                Err(err) => {
                    shared.end(ClientError::Protocol(err.to_string()));
                    return;
                }
            };
            for (lane, through) in acks.through {
                let tx = {
                    let core = shared.core();
                    if !core.session.is_current(generation) {
                        return;
                    }
                    core.lanes.get(&lane).cloned()
                };
                if let Some(tx) = tx {
                    shared.acked(&tx, through);
                }
            }
        }
        match recv.read_chunk(64 << 10, true).await {
            Ok(Some(chunk)) => frames.feed(&chunk.bytes),
            Ok(None) | Err(_) => return,
        }
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
