//! The session process: one client's session, on a QUIC endpoint of its own.
//!
//! `gleam session` runs [`run`] with the chosen backend. The process binds a UDP endpoint, announces its
//! port and a one-time token to its parent (which passes them to the client over the peer's own, already
//! authenticated connection), and admits exactly one connection: the client's, authenticated as the same
//! peer id, whose first stream presents the token. From then on the client talks to this process directly:
//! nothing relays its bytes.
//!
//! Two threads:
//!
//! * the network thread runs a single-threaded tokio runtime: quinn's endpoint, one reader task per lane
//!   (QUIC stream) that decodes frames into the [`Inbox`], and one writer task per lane that flushes what the
//!   executor could not hand to quinn at once;
//! * this thread is the executor: it takes the next request the [`Scheduler`] allows (per-lane order,
//!   barriers, event dependencies), runs it through the [`Session`] engine on the backend, and writes the
//!   answer to the request's lane itself (a reply goes to quinn without a thread hop unless quinn's send
//!   buffer is full).
//!
//! The executor spins briefly before sleeping when it runs out of work, on hosts with cores to spare
//! ([`gleam_protocol::tuning::spin_budget`]), so a synchronous client's next request finds it awake.

use std::collections::HashMap;
use std::future::poll_fn;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use gleam_auth::identity::{Identity, PeerId};
use gleam_auth::tls;
use gleam_protocol::frame::{self, FrameError, FrameReader};
use gleam_protocol::order::{Lane, OrderError, Scheduler};
use gleam_protocol::wire::{Call, Request, StreamOpen};
use gleam_server::backend::Backend;
use gleam_server::callbacks::HostCallbacks;
use gleam_server::session::{Answer, Session};
use quinn::VarInt;
use tokio::sync::Notify;
use tracing::{debug, error, info, warn};

use crate::{CLOSE_ENDED, CLOSE_PROTOCOL_VIOLATION};

/// How long the client may take to attach after the session process announced itself.
pub const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the last replies (Goodbye's) may take to leave before the connection closes.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// Bulk bytes one lane may have received and not yet run; past it, the lane's reader stops reading and
/// QUIC flow control holds the client back. Per lane, so a lane waiting on another never starves it: the
/// request everything waits for is always at the head of its own lane.
const LANE_QUEUE_LIMIT: usize = 64 << 20;

/// What the session process needs to know.
#[derive(Debug)]
pub struct Options {
    /// The address to listen on (the parent's local address for the client: the client dials it).
    pub bind: IpAddr,
    /// This peer's identity (the session endpoint presents the same certificate as the peer).
    pub identity: Identity,
    /// The only peer the session admits (authenticated by the parent's mesh proof).
    pub client: PeerId,
    /// How long to wait for the client.
    pub attach_timeout: Duration,
}

/// How a session process ended (its exit code tells the parent).
#[derive(Debug, thiserror::Error)]
pub enum ExitReason {
    /// The client said goodbye, or left.
    #[error("session ended")]
    Ended,
    /// The client never attached.
    #[error("the client did not attach within {0:?}")]
    NoClient(Duration),
    /// The client broke the protocol (an oversized or undecodable frame, a misordered request).
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The network side failed (the endpoint could not be bound, the connection was lost).
    #[error("network: {0}")]
    Network(String),
}

/// Exit code: the client broke the protocol.
pub const EXIT_PROTOCOL: u8 = 3;
/// Exit code: the network side failed.
pub const EXIT_NETWORK: u8 = 5;
/// Exit code: the backend could not be created (used by `gleam session`).
pub const EXIT_BACKEND: u8 = 6;
/// Exit code: the client never attached.
pub const EXIT_NO_CLIENT: u8 = 7;

impl ExitReason {
    /// The process's exit code for this reason.
    pub fn code(&self) -> u8 {
        match self {
            Self::Ended => 0,
            Self::Protocol(_) => EXIT_PROTOCOL,
            Self::Network(_) => EXIT_NETWORK,
            Self::NoClient(_) => EXIT_NO_CLIENT,
        }
    }

    /// What an exit code of a session process means, for the parent's log and the client's close reason.
    pub fn describe_code(code: i32) -> &'static str {
        match code {
            0 => "session ended",
            c if c == i32::from(EXIT_PROTOCOL) => "the client broke the protocol",
            c if c == i32::from(EXIT_NETWORK) => "the session's network endpoint failed",
            c if c == i32::from(EXIT_BACKEND) => "the GPU backend could not start",
            c if c == i32::from(EXIT_NO_CLIENT) => "the client never attached",
            _ => "session process failed",
        }
    }
}

/// Serves one session: binds, calls `announce(port, token)` (the parent reads it), waits for the client,
/// then executes its requests on `backend` until it leaves.
pub fn run<B: Backend>(
    backend: B,
    options: Options,
    announce: impl FnOnce(u16, &[u8; 32]) -> io::Result<()>,
) -> ExitReason {
    let token: [u8; 32] = rand::random();
    let shared = Arc::new(Shared::default());
    let (port_tx, port_rx) = std::sync::mpsc::sync_channel(1);
    let net = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("gleam-session-net".into())
            .spawn(move || network(options, token, shared, port_tx))
    };
    let net = match net {
        Ok(net) => net,
        Err(err) => return ExitReason::Network(format!("cannot start the network thread: {err}")),
    };
    let port = match port_rx.recv() {
        Ok(Ok(port)) => port,
        Ok(Err(err)) => return ExitReason::Network(err),
        Err(_) => return ExitReason::Network("the network thread ended at start".into()),
    };
    if let Err(err) = announce(port, &token) {
        shared.end(End::Network(format!(
            "cannot tell the parent our port: {err}"
        )));
    }
    let reason = execute(backend, &shared);
    shared.end(End::Executor);
    let _ = net.join();
    let reason = match reason {
        ExitReason::Ended => shared.outcome(),
        other => other,
    };
    match &reason {
        ExitReason::Ended => info!("session process done"),
        other => error!(reason = %other, "session ended abnormally"),
    }
    reason
}

/// The executor: runs requests as the scheduler allows, answers on their lanes.
fn execute<B: Backend>(backend: B, shared: &Arc<Shared>) -> ExitReason {
    let mut session = Session::new(backend);
    // Host functions are answered when their stream reaches them, from whatever thread that is; the
    // network side reports their completions and the session's end.
    let callbacks = session.host_callbacks();
    let out = Arc::downgrade(shared);
    callbacks.set_sink(Box::new(move |lane, frame| {
        if let Some(shared) = out.upgrade() {
            let answer = Answer {
                frame,
                bulk: Vec::new(),
            };
            if let Err(err) = shared.outbox.send(lane, answer) {
                debug!(%err, "a host function's answer could not be sent");
            }
        }
    }));
    let _ = shared.callbacks.set(callbacks);
    let spin = gleam_protocol::tuning::spin_budget();
    let reason = loop {
        let Some((lane, seq, (request, bulk))) = shared.inbox.next(spin) else {
            break ExitReason::Ended;
        };
        let answer = session.handle(request, &bulk);
        shared.inbox.done(seq);
        if let Some(answer) = answer
            && let Err(err) = shared.outbox.send(lane, answer)
        {
            break ExitReason::Network(err);
        }
        if session.is_closed() {
            break ExitReason::Ended;
        }
    };
    session.finish();
    reason
}

/// Why the session is ending, as the network side sees it.
#[derive(Clone, Debug)]
enum End {
    /// The executor finished (goodbye, or it stopped for a reason it returns itself).
    Executor,
    /// The client left or the connection was lost.
    ClientGone(String),
    /// The client never attached.
    NoClient(Duration),
    /// The client broke the protocol.
    Protocol(String),
    /// The network side failed.
    Network(String),
}

#[derive(Debug, Default)]
struct Shared {
    inbox: Inbox,
    outbox: Outbox,
    /// The session's host functions in flight (set by the executor at start).
    callbacks: std::sync::OnceLock<Arc<HostCallbacks>>,
    end: Mutex<Option<End>>,
    ended: Notify,
}

impl Shared {
    /// Ends the session (the first reason wins): the executor stops taking requests, the network side
    /// flushes and closes.
    fn end(&self, why: End) {
        {
            let mut end = lock(&self.end);
            if end.is_none() {
                *end = Some(why);
            }
        }
        self.inbox.close();
        // A stream held for a client function must not keep the executor from ending.
        if let Some(callbacks) = self.callbacks.get() {
            callbacks.cancel_all();
        }
        self.ended.notify_waiters();
        self.ended.notify_one();
    }

    fn ending(&self) -> Option<End> {
        lock(&self.end).clone()
    }

    /// The exit reason when the executor ended without one of its own.
    fn outcome(&self) -> ExitReason {
        match self.ending() {
            None | Some(End::Executor) => ExitReason::Ended,
            Some(End::ClientGone(why)) => {
                info!(%why, "the client left");
                ExitReason::Ended
            }
            Some(End::NoClient(after)) => ExitReason::NoClient(after),
            Some(End::Protocol(why)) => ExitReason::Protocol(why),
            Some(End::Network(why)) => ExitReason::Network(why),
        }
    }
}

/// Requests received and not yet run, ordered by the [`Scheduler`]; the executor waits here.
#[derive(Debug, Default)]
struct Inbox {
    state: Mutex<InboxState>,
    ready: Condvar,
    /// Wakes lane readers held back by [`LANE_QUEUE_LIMIT`].
    drained: Notify,
    /// The executor is (about to be) asleep on `ready`.
    sleeping: AtomicBool,
}

#[derive(Debug, Default)]
struct InboxState {
    scheduler: Scheduler<(Request, Bytes)>,
    /// Bulk bytes queued per lane.
    queued: HashMap<Lane, usize>,
    closed: bool,
}

impl InboxState {
    /// Takes the next runnable request off the scheduler, releasing its lane's quota.
    #[allow(clippy::type_complexity)]
    fn pop(&mut self, drained: &Notify) -> Option<(Lane, u64, (Request, Bytes))> {
        let next = self.scheduler.pop()?;
        if let Some(queued) = self.queued.get_mut(&next.0) {
            let was_full = *queued >= LANE_QUEUE_LIMIT;
            *queued -= next.2.1.len();
            if was_full && *queued < LANE_QUEUE_LIMIT {
                drained.notify_waiters();
            }
        }
        Some(next)
    }
}

impl Inbox {
    /// A request arrived on `lane`.
    fn push(&self, lane: Lane, request: Request, bulk: Bytes) -> Result<(), OrderError> {
        {
            let mut state = lock(&self.state);
            let (seq, deps, len) = (request.seq, request.deps.clone(), bulk.len());
            state.scheduler.push(lane, seq, deps, (request, bulk))?;
            *state.queued.entry(lane).or_default() += len;
        }
        if self.sleeping.load(Ordering::Acquire) {
            self.ready.notify_one();
        }
        Ok(())
    }

    /// Stops the executor once what may run now has run.
    fn close(&self) {
        lock(&self.state).closed = true;
        self.ready.notify_one();
        self.drained.notify_waiters();
    }

    /// Waits while `lane` has more than [`LANE_QUEUE_LIMIT`] bulk bytes queued (the executor is behind).
    async fn room(&self, lane: Lane) {
        loop {
            let drained = self.drained.notified();
            let mut drained = pin!(drained);
            drained.as_mut().enable();
            {
                let state = lock(&self.state);
                if state.closed || state.queued.get(&lane).copied().unwrap_or(0) < LANE_QUEUE_LIMIT
                {
                    return;
                }
            }
            drained.await;
        }
    }

    /// The next request that may run, waiting (spinning first) until there is one; `None` once closed.
    #[allow(clippy::type_complexity)]
    fn next(&self, spin: Duration) -> Option<(Lane, u64, (Request, Bytes))> {
        let started = Instant::now();
        loop {
            {
                let mut state = lock(&self.state);
                if let Some(next) = state.pop(&self.drained) {
                    return Some(next);
                }
                if state.closed {
                    return None;
                }
                if started.elapsed() >= spin {
                    self.sleeping.store(true, Ordering::Release);
                    // Re-checked under the lock before sleeping: a push in between sees `sleeping`.
                    state = self
                        .ready
                        .wait_timeout(state, Duration::from_millis(100))
                        .map_or_else(|e| e.into_inner().0, |(s, _)| s);
                    self.sleeping.store(false, Ordering::Release);
                    if let Some(next) = state.pop(&self.drained) {
                        return Some(next);
                    }
                    if state.closed {
                        return None;
                    }
                    continue;
                }
            }
            std::hint::spin_loop();
        }
    }

    fn done(&self, seq: u64) {
        lock(&self.state).scheduler.done(seq);
    }
}

/// Each lane's sending half, shared by the executor (which writes answers directly) and the lane's writer
/// task (which flushes what quinn could not take at once).
#[derive(Debug, Default)]
struct Outbox {
    lanes: Mutex<HashMap<Lane, Arc<LaneTx>>>,
}

#[derive(Debug)]
struct LaneTx {
    state: Mutex<TxState>,
    /// Wakes the lane's writer task when data is left pending.
    flush: Notify,
}

#[derive(Debug)]
struct TxState {
    send: quinn::SendStream,
    /// Chunks quinn has not taken yet, in order.
    pending: Vec<Bytes>,
    failed: Option<String>,
}

impl TxState {
    /// Hands pending chunks to quinn until it takes no more. `Ready(Ok)` when everything was taken.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), String>> {
        if let Some(err) = &self.failed {
            return Poll::Ready(Err(err.clone()));
        }
        while !self.pending.is_empty() {
            let written = {
                let fut = self.send.write_chunks(&mut self.pending);
                let fut = pin!(fut);
                fut.poll(cx)
            };
            match written {
                Poll::Ready(Ok(_)) => {
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

impl Outbox {
    fn add(&self, lane: Lane, send: quinn::SendStream) -> Arc<LaneTx> {
        let tx = Arc::new(LaneTx {
            state: Mutex::new(TxState {
                send,
                pending: Vec::new(),
                failed: None,
            }),
            flush: Notify::new(),
        });
        lock(&self.lanes).insert(lane, tx.clone());
        tx
    }

    /// Writes `answer` on `lane`: straight to quinn when it has room, else queued for the lane's writer.
    fn send(&self, lane: Lane, answer: Answer) -> Result<(), String> {
        let Some(tx) = lock(&self.lanes).get(&lane).cloned() else {
            return Err(format!("no stream for lane {}", lane.0));
        };
        let mut head = Vec::with_capacity(64);
        frame::encode_head(&answer.frame, answer.bulk.len(), &mut head)
            .map_err(|e| e.to_string())?;
        let mut state = lock(&tx.state);
        let was_idle = state.pending.is_empty();
        state.pending.push(Bytes::from(head));
        if !answer.bulk.is_empty() {
            // The answer's bytes are handed over as they are: no copy into a frame buffer.
            state.pending.push(Bytes::from(answer.bulk));
        }
        if was_idle {
            // Nothing queued before: try now, without waking the network thread for it.
            let mut cx = Context::from_waker(Waker::noop());
            match state.poll_flush(&mut cx) {
                Poll::Ready(Ok(())) => return Ok(()),
                Poll::Ready(Err(err)) => return Err(err),
                Poll::Pending => {}
            }
        }
        drop(state);
        tx.flush.notify_one();
        Ok(())
    }

    /// Flushes every lane and waits until the client has received it all (at the session's end: closing
    /// the connection drops whatever is not yet acknowledged, Goodbye's answer included).
    async fn flush_all(&self) {
        let lanes: Vec<Arc<LaneTx>> = lock(&self.lanes).values().cloned().collect();
        let mut delivered = Vec::with_capacity(lanes.len());
        for tx in lanes {
            let _ = poll_fn(|cx| lock(&tx.state).poll_flush(cx)).await;
            let mut state = lock(&tx.state);
            let _ = state.send.finish();
            delivered.push(state.send.stopped());
        }
        for stopped in delivered {
            let _ = stopped.await;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a thread panicked while holding it; the state stays consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The network thread: binds, admits the client, runs the lanes until the session ends.
fn network(
    options: Options,
    token: [u8; 32],
    shared: Arc<Shared>,
    port_tx: std::sync::mpsc::SyncSender<Result<u16, String>>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            let _ = port_tx.send(Err(format!("cannot start the async runtime: {err}")));
            return;
        }
    };
    runtime.block_on(async move {
        let endpoint = match bind(&options) {
            Ok(endpoint) => endpoint,
            Err(err) => {
                let _ = port_tx.send(Err(err));
                return;
            }
        };
        let port = endpoint.local_addr().map(|a| a.port()).unwrap_or(0);
        let _ = port_tx.send(Ok(port));
        let attached = tokio::time::timeout(
            options.attach_timeout,
            admit(&endpoint, options.client, &token, &shared),
        )
        .await;
        let conn = match attached {
            Ok(Some(conn)) => conn,
            Ok(None) => return,
            Err(_) => {
                shared.end(End::NoClient(options.attach_timeout));
                endpoint.close(CLOSE_ENDED, b"no client");
                return;
            }
        };
        serve(&conn, &shared).await;
        // Let the last answers (Goodbye's) leave before closing.
        let _ = tokio::time::timeout(DRAIN_TIMEOUT, shared.outbox.flush_all()).await;
        let (code, reason) = match shared.ending() {
            Some(End::Protocol(why)) => (CLOSE_PROTOCOL_VIOLATION, why),
            _ => (CLOSE_ENDED, "session ended".to_owned()),
        };
        conn.close(code, reason.as_bytes());
        let _ = tokio::time::timeout(Duration::from_millis(500), endpoint.wait_idle()).await;
    });
}

/// Binds the session's endpoint on `options.bind`, at a port of `GLEAM_SESSION_PORTS` (`LO-HI`, for a
/// firewall that opens only those) or any free one. An address that cannot be bound (a host without IPv6,
/// an address that went away) falls back to every address of its family.
fn bind(options: &Options) -> Result<quinn::Endpoint, String> {
    let server = tls::server_config(&options.identity).map_err(|e| format!("TLS: {e}"))?;
    let ports = match std::env::var("GLEAM_SESSION_PORTS") {
        Ok(text) => session_ports(&text).ok_or_else(|| {
            format!("GLEAM_SESSION_PORTS={text:?} is not LO-HI (e.g. 47100-47199)")
        })?,
        Err(_) => 0..=0,
    };
    let on = |ip: IpAddr| {
        let mut last = None;
        for port in ports.clone() {
            match tls::endpoint(SocketAddr::new(ip, port), Some(server.clone())) {
                Ok(endpoint) => return Ok(endpoint),
                Err(err) => last = Some(err),
            }
        }
        Err(last.map_or_else(|| "no port to try".to_owned(), |e| e.to_string()))
    };
    let wildcard = |ip: IpAddr| match ip {
        IpAddr::V4(_) => IpAddr::from(std::net::Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::from(std::net::Ipv6Addr::UNSPECIFIED),
    };
    on(options.bind)
        .or_else(|_| on(wildcard(options.bind)))
        // A host without IPv6 cannot bind `::`; IPv4 clients still reach an IPv4 socket.
        .or_else(|_| on(IpAddr::from(std::net::Ipv4Addr::UNSPECIFIED)))
        .map_err(|e| {
            format!(
                "cannot bind a session endpoint on {} ({:?}): {e}",
                options.bind, ports
            )
        })
}

/// `LO-HI` (or one port) as a range of ports.
fn session_ports(text: &str) -> Option<std::ops::RangeInclusive<u16>> {
    let (lo, hi) = text.split_once('-').unwrap_or((text, text));
    let (lo, hi) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
    (lo <= hi && lo > 0).then_some(lo..=hi)
}

/// Waits for the client's connection: authenticated as `client`, its first stream presenting `token`.
/// Anything else is refused. `None` if the session ended meanwhile.
async fn admit(
    endpoint: &quinn::Endpoint,
    client: PeerId,
    token: &[u8; 32],
    shared: &Arc<Shared>,
) -> Option<quinn::Connection> {
    loop {
        let incoming = endpoint.accept().await?;
        let conn = match incoming.await {
            Ok(conn) => conn,
            Err(err) => {
                debug!(error = %err, "a connection to the session endpoint failed its handshake");
                continue;
            }
        };
        match tls::remote_peer_id(&conn) {
            Ok(peer) if peer == client => {}
            Ok(peer) => {
                warn!(%peer, expected = %client, "refused a connection from another peer");
                conn.close(CLOSE_PROTOCOL_VIOLATION, b"not this session's client");
                continue;
            }
            Err(err) => {
                warn!(error = %err, "refused a connection without a peer certificate");
                conn.close(CLOSE_PROTOCOL_VIOLATION, b"no peer certificate");
                continue;
            }
        }
        let first = tokio::time::timeout(ATTACH_TIMEOUT, conn.accept_bi()).await;
        let Ok(Ok((send, recv))) = first else {
            conn.close(CLOSE_PROTOCOL_VIOLATION, b"no stream opened");
            continue;
        };
        let mut frames = FrameReader::new();
        let mut recv = recv;
        match read_opening(&mut recv, &mut frames).await {
            Ok(StreamOpen::Attach { token: presented }) if constant_time_eq(&presented, token) => {
                // The session's client: its full flow-control credit (a few KiB until now).
                tls::grant_credit(&conn);
                let tx = shared.outbox.add(Lane::CONTROL, send);
                tokio::spawn(lane_writer(tx, shared.clone()));
                tokio::spawn(lane_reader(recv, frames, Lane::CONTROL, shared.clone()));
                info!(client = %client, remote = %conn.remote_address(), "client attached");
                return Some(conn);
            }
            Ok(_) => {
                warn!("refused a connection without the session's token");
                conn.close(CLOSE_PROTOCOL_VIOLATION, b"wrong session token");
            }
            Err(err) => {
                conn.close(CLOSE_PROTOCOL_VIOLATION, err.as_bytes());
            }
        }
    }
}

/// Serves the attached connection's lanes until the session ends or the client goes.
async fn serve(conn: &quinn::Connection, shared: &Arc<Shared>) {
    loop {
        let ended = shared.ended.notified();
        let mut ended = pin!(ended);
        // Registered before looking, so an end between the look and the wait still wakes us.
        ended.as_mut().enable();
        if shared.ending().is_some() {
            return;
        }
        tokio::select! {
            biased;
            () = ended => return,
            stream = conn.accept_bi() => match stream {
                Ok((send, mut recv)) => {
                    let mut frames = FrameReader::new();
                    match read_opening(&mut recv, &mut frames).await {
                        Ok(StreamOpen::Lane { lane }) if lane != Lane::CONTROL => {
                            let tx = shared.outbox.add(lane, send);
                            tokio::spawn(lane_writer(tx, shared.clone()));
                            tokio::spawn(lane_reader(recv, frames, lane, shared.clone()));
                        }
                        Ok(_) => shared.end(End::Protocol("a second attach or a second control lane".into())),
                        Err(err) => shared.end(End::Protocol(err)),
                    }
                }
                Err(err) => {
                    shared.end(End::ClientGone(err.to_string()));
                    return;
                }
            },
        }
    }
}

/// Reads a stream's first frame.
async fn read_opening(
    recv: &mut quinn::RecvStream,
    frames: &mut FrameReader,
) -> Result<StreamOpen, String> {
    loop {
        if let Some(frame) = frames.next_frame().map_err(|e| e.to_string())? {
            return frame
                .decode::<StreamOpen>()
                .map_err(|e| format!("bad stream opening: {e}"));
        }
        match recv.read_chunk(usize::MAX, true).await {
            Ok(Some(chunk)) => frames.feed(&chunk.bytes),
            Ok(None) => return Err("stream ended before its opening".into()),
            Err(err) => return Err(err.to_string()),
        }
    }
}

/// One lane's reader: frames in, requests to the inbox.
async fn lane_reader(
    mut recv: quinn::RecvStream,
    mut frames: FrameReader,
    lane: Lane,
    shared: Arc<Shared>,
) {
    let why = 'lane: loop {
        loop {
            let frame = match frames.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(err @ (FrameError::HeaderTooLarge(_) | FrameError::BulkTooLarge(_))) => {
                    break 'lane End::Protocol(format!("request {err}"));
                }
                Err(err) => break 'lane End::Protocol(err.to_string()),
            };
            let request: Request = match frame.decode() {
                Ok(request) => request,
                Err(err) => break 'lane End::Protocol(format!("malformed request: {err}")),
            };
            // Out of band: the executor may be blocked waiting for the stream this releases.
            if let Call::HostFuncReturned { id } = request.call {
                if let Some(callbacks) = shared.callbacks.get() {
                    callbacks.returned(id);
                }
                continue;
            }
            if let Err(err) = shared.inbox.push(lane, request, frame.bulk) {
                break 'lane End::Protocol(err.to_string());
            }
        }
        // Backpressure: stop reading while this lane's queue is full (QUIC flow control then holds
        // the client).
        shared.inbox.room(lane).await;
        match recv.read_chunk(usize::MAX, true).await {
            Ok(Some(chunk)) => frames.feed(&chunk.bytes),
            Ok(None) if frames.is_mid_frame() => {
                break End::Protocol("a stream ended inside a frame".into());
            }
            // The client finished this lane; the session goes on.
            Ok(None) => return,
            Err(err) => break End::ClientGone(err.to_string()),
        }
    };
    if let End::Protocol(why) = &why {
        warn!(lane = lane.0, %why, "protocol violation: ending the session");
    }
    shared.end(why);
}

/// One lane's writer: flushes whatever the executor left pending (at the session's end, `flush_all`
/// takes over).
async fn lane_writer(tx: Arc<LaneTx>, shared: Arc<Shared>) {
    loop {
        tx.flush.notified().await;
        if shared.ending().is_some() {
            return;
        }
        if let Err(err) = poll_fn(|cx| lock(&tx.state).poll_flush(cx)).await {
            shared.end(End::ClientGone(err));
            return;
        }
    }
}

/// Compares two tokens in time independent of where they differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The code a session process exits with for `reason`, and the close code its parent may use.
pub fn close_code(reason: &ExitReason) -> VarInt {
    match reason {
        ExitReason::Protocol(_) => CLOSE_PROTOCOL_VIOLATION,
        _ => CLOSE_ENDED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_in_constant_time_and_correctly() {
        let a = [7u8; 32];
        let mut b = a;
        assert!(constant_time_eq(&a, &b));
        b[31] ^= 1;
        assert!(!constant_time_eq(&a, &b));
    }

    #[test]
    fn exit_codes_round_trip_their_meaning() {
        for (reason, text) in [
            (ExitReason::Ended, "session ended"),
            (
                ExitReason::Protocol("x".into()),
                "the client broke the protocol",
            ),
            (
                ExitReason::Network("x".into()),
                "the session's network endpoint failed",
            ),
            (
                ExitReason::NoClient(ATTACH_TIMEOUT),
                "the client never attached",
            ),
        ] {
            assert_eq!(ExitReason::describe_code(i32::from(reason.code())), text);
        }
    }
}

#[cfg(test)]
mod port_tests {
    use super::session_ports;

    #[test]
    fn session_ports_are_a_range_or_one_port() {
        assert_eq!(session_ports("47100-47199"), Some(47100..=47199));
        assert_eq!(session_ports("47100"), Some(47100..=47100));
        assert_eq!(session_ports("47199-47100"), None);
        assert_eq!(session_ports("0-10"), None);
        assert_eq!(session_ports("a-b"), None);
    }
}
