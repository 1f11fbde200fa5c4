//! The session process: one client's session, on a QUIC endpoint of its own.
//!
//! `gleam session` runs [`run`] with the chosen backend. The process binds a UDP endpoint, announces its
//! port and a one-time token to its parent (which passes them to the client over the peer's own, already
//! authenticated connection), and admits exactly one connection: the client's, authenticated as the same
//! peer id, whose first stream presents the token. From then on the client talks to this process directly:
//! nothing relays its bytes. Beside it the client may open its bulk connection (`StreamOpen::Bulk`, the
//! same peer and token): its streams are lanes like the session connection's, on a congestion window of
//! their own; its loss alone does not end or suspend the session.
//!
//! Its threads:
//!
//! * the network thread runs a single-threaded tokio runtime: quinn's endpoint, one reader task per lane
//!   (QUIC stream) that decodes frames into the [`Inbox`], and one writer task per lane that flushes what the
//!   executor could not hand to quinn at once;
//! * beside it, [`ConnectionThreads`] drive a client's bulk connections past its first (striping:
//!   `GLEAM_BULK_STRIPES` on the client), so that one copy's connections are encrypted and decrypted
//!   on several cores;
//! * this thread is the executor: it takes the next request the [`Scheduler`] allows (per-lane order,
//!   barriers, event dependencies), runs it through the [`Session`] engine on the backend, and writes the
//!   answer to the request's lane itself (a reply goes to quinn without a thread hop unless quinn's send
//!   buffer is full).
//!
//! The executor spins briefly before sleeping when it runs out of work, on hosts with cores to spare
//! ([`gleam_protocol::tuning::spin_budget`]), so a synchronous client's next request finds it awake. For a
//! shorter while after each answer the network thread polls its socket rather than sleeping
//! ([`BusyPoll`]), so that request does not wait for a sleeping thread to read it either.
//!
//! The session outlives its connection: when the link goes silent, the process keeps its GPU state, runs
//! what it received, and keeps its replies ([`gleam_protocol::resume`]) for the grace window
//! ([`Options::grace`]). A client that comes back within it (authenticated as the same peer, presenting
//! the session's token) resumes the session on a new connection: each side sends again what the other
//! did not receive, so every request runs once and every reply arrives once. Past the window the session
//! ends and frees everything, as when the client leaves.

use std::collections::HashMap;
use std::future::poll_fn;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use gleam_auth::busy_poll::BusyPoll;
use gleam_auth::identity::{Identity, PeerId};
use gleam_auth::tls;
use gleam_protocol::frame::{self, FrameError, FrameReader, PieceReader, Pieces};
use gleam_protocol::order::{Lane, OrderError, Scheduler};
use gleam_protocol::resume::{Awaited, Frame, Marks, Misordered, Received, ReplyCache};
use gleam_protocol::wire::{Acks, CLOSE_RESUME_ABANDONED, Call, Request, Resumed, StreamOpen};
use gleam_server::backend::Backend;
use gleam_server::callbacks::HostCallbacks;
use gleam_server::session::{Answer, Session};
use quinn::VarInt;
use tokio::sync::{Notify, mpsc};
use tracing::{debug, error, info, warn};

use crate::{CLOSE_ENDED, CLOSE_PROTOCOL_VIOLATION};

/// Bulk connections one session connection may have at once (a client opens one per stripe; the bound
/// keeps a misbehaving one from making this process hold connections without end).
const MAX_BULK_CONNECTIONS: usize = gleam_protocol::wire::MAX_STRIPES as usize;
/// How long the client may take to attach after the session process announced itself.
pub const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the last replies (Goodbye's) may take to leave before the connection closes.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a session outlives a silent link by default, counted from the last time the client was
/// heard (`GLEAM_SESSION_GRACE` in seconds, or `gleam serve`/`gleam peer --session-grace`).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(15);
/// Reply bytes kept for resending (not yet acknowledged by the client) past which the executor waits for
/// acknowledgements before running more.
const REPLY_CACHE_LIMIT: usize = 96 << 20;
/// Reply bytes kept past which calls answered with device memory's bytes ([`Call::answers_with_bytes`])
/// wait, while other calls run: what a download keeps in flight. Acknowledgements come every
/// [`ACK_DELAY`] or so, in which loopback carries 8 MiB; the rest is headroom.
const ANSWER_BYTES_LIMIT: usize = 32 << 20;
/// How long an acknowledgement waits to gather more receipts (and how often a quiet side re-checks).
const ACK_DELAY: Duration = Duration::from_millis(5);
const ACK_TICK: Duration = Duration::from_millis(100);
/// Close code of a connection replaced by a resumed one.
pub const CLOSE_SUPERSEDED: VarInt = VarInt::from_u32(0x4743_0005);
/// Bulk bytes one lane may have received and not yet run; past it, the lane's reader stops reading and
/// QUIC flow control holds the client back. Per lane, so a lane waiting on another never starves it: the
/// request everything waits for is always at the head of its own lane.
const LANE_QUEUE_LIMIT: usize = 64 << 20;
/// Requests with at most this many bulk bytes get them copied into a buffer of their
/// own on arrival (see [`lane_reader`]); larger ones keep the pieces.
const COPY_SMALL_BULK: usize = 16 << 10;

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
    /// How long the session outlives a silent link (from the last time the client was heard).
    pub grace: Duration,
}

/// The grace window configured by `GLEAM_SESSION_GRACE` (seconds, fractions allowed), else
/// [`DEFAULT_GRACE`]; `None` if the variable is set but not a number of seconds.
pub fn configured_grace() -> Result<Duration, String> {
    match std::env::var("GLEAM_SESSION_GRACE") {
        Ok(text) => parse_grace(&text).ok_or_else(|| {
            format!("GLEAM_SESSION_GRACE={text:?} is not a number of seconds (e.g. 15)")
        }),
        Err(_) => Ok(DEFAULT_GRACE),
    }
}

/// Seconds (fractions allowed, up to a day) as a duration.
pub fn parse_grace(text: &str) -> Option<Duration> {
    let secs: f64 = text.trim().parse().ok()?;
    (secs.is_finite() && (0.0..=86_400.0).contains(&secs)).then(|| Duration::from_secs_f64(secs))
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

/// Serves one session: binds, calls `announce(port, token, grace)` (the parent reads it), waits for the
/// client, then executes its requests on `backend` until it leaves (or stays away past the grace window).
pub fn run<B: Backend>(
    backend: B,
    options: Options,
    announce: impl FnOnce(u16, &[u8; 32], Duration) -> io::Result<()>,
) -> ExitReason {
    let grace = options.grace;
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
    if let Err(err) = announce(port, &token, grace) {
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
        ExitReason::Ended => info!(
            readers_held_back_ms = shared.inbox.held_back_us.load(Ordering::Relaxed) / 1000,
            "session process done"
        ),
        other => error!(reason = %other, "session ended abnormally"),
    }
    reason
}

/// The executor: runs requests as the scheduler allows, answers on their lanes ([`Call::answer_lane`]).
/// A request that keeps the executor this long is logged (at debug level).
const SLOW_REQUEST: Duration = Duration::from_millis(2);

fn execute<B: Backend>(backend: B, shared: &Arc<Shared>) -> ExitReason {
    let mut session = Session::new(backend);
    // Answers made off this thread: host functions' (when their stream reaches them) and upload
    // announcements' (once the content cache was read).
    let out = Arc::downgrade(shared);
    let answer_elsewhere = Arc::new(move |lane, frame| {
        if let Some(shared) = out.upgrade() {
            let answer = Answer {
                frame,
                bulk: Vec::new(),
            };
            if let Err(err) = shared.answer(lane, answer) {
                debug!(%err, "an answer made off the executor could not be sent");
            }
        }
    });
    let callbacks = session.host_callbacks();
    let sink = answer_elsewhere.clone();
    callbacks.set_sink(Box::new(move |lane, frame| sink(lane, frame)));
    // The network side reports host functions' completions and the session's end.
    let _ = shared.callbacks.set(callbacks);
    session.answer_later_with(answer_elsewhere);
    // An upload's chunk counts as run once a chunk worker has placed it, not when this thread handed it
    // over: the copy waiting for it is not picked (to wait here) while other lanes have work.
    let inbox = Arc::downgrade(shared);
    session.settle_chunks_with(Arc::new(move |seq| {
        if let Some(shared) = inbox.upgrade() {
            shared.inbox.done_elsewhere(seq);
        }
    }));
    let spin = gleam_protocol::tuning::spin_budget();
    let reason = loop {
        // A call answered with device memory's bytes waits while the replies in flight fill the
        // reply cache: the link drains them at its pace, and meanwhile every other lane's calls run
        // (a large download never holds back another stream's synchronization).
        let room =
            |request: &Request| !(request.call.answers_with_bytes() && shared.outbox.is_full());
        let Some((lane, seq, (request, bulk))) = shared.inbox.next(spin, room) else {
            break ExitReason::Ended;
        };
        let (kind, started, bulk_len) = (request.call.kind(), Instant::now(), bulk.len());
        // Most answers go back on their request's lane; a large download's goes apart.
        let answer_lane = request.call.answer_lane(lane);
        let answer = session.handle_pieces(request, bulk);
        let took = started.elapsed();
        if took >= SLOW_REQUEST {
            // Every other lane waited this long: what holds small calls back behind bulk work.
            debug!(kind, ?lane, ?took, bulk = bulk_len, "slow request");
        } else {
            // Every request, for a timeline (`GLEAM_LOG=gleam_host=trace`).
            tracing::trace!(kind, ?lane, ?took, bulk = bulk_len, "request ran");
        }
        if !session.marks_run_later() {
            shared.inbox.done(seq);
        }
        if let Some(answer) = answer
            && let Err(err) = shared.answer(answer_lane, answer)
        {
            break ExitReason::Network(err);
        }
        // The reply cache is bounded: past its limit (which small replies alone reach, the bulk ones wait
        // above), wait for the client to acknowledge what it received (during a drop, until it resumes
        // or the session ends).
        if shared.outbox.is_overfull() {
            let waiting = Instant::now();
            while shared.outbox.is_overfull() && shared.ending().is_none() {
                shared.outbox.wait_for_room(Duration::from_millis(50));
            }
            debug!(took = ?waiting.elapsed(), "the reply cache was full: waited for acknowledgements");
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
    /// The client left, or stayed away past the grace window.
    ClientGone(String),
    /// The client never attached.
    NoClient(Duration),
    /// The client broke the protocol.
    Protocol(String),
    /// The network side failed.
    Network(String),
}

#[derive(Debug)]
struct Shared {
    inbox: Inbox,
    outbox: Outbox,
    /// The session's host functions in flight (set by the executor at start).
    callbacks: std::sync::OnceLock<Arc<HostCallbacks>>,
    end: Mutex<Option<End>>,
    ended: Notify,
    /// Keeps the network thread polling for a while after each answer
    /// ([`gleam_auth::busy_poll::ANSWER_LINGER`]): a synchronizing client's next request, and the
    /// executor's answer to it, then travel without waking a sleeping thread.
    busy: Arc<BusyPoll>,
    /// Connections given the network thread's runtime since the link was last down: the first two to
    /// arrive then are the session connection and the client's first bulk connection (which follows
    /// it); any other, a further stripe, is driven by a bulk thread ([`ConnectionThreads`]).
    on_network_thread: AtomicUsize,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            inbox: Inbox::default(),
            outbox: Outbox::default(),
            callbacks: std::sync::OnceLock::new(),
            end: Mutex::new(None),
            ended: Notify::new(),
            busy: BusyPoll::beside_spinning(
                gleam_protocol::tuning::spin_budget(),
                gleam_auth::busy_poll::ANSWER_LINGER,
            ),
            on_network_thread: AtomicUsize::new(0),
        }
    }
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

    /// Sends `answer` on `lane` ([`Outbox::send`]), keeping the network thread awake to carry it and to
    /// read the client's next request.
    fn answer(&self, lane: Lane, answer: Answer) -> Result<(), String> {
        self.busy.touch();
        self.outbox.send(lane, answer)
    }

    /// The client has every reply but those it still awaits: they leave the reply cache, and the
    /// executor is woken if that lets a call held back for room run.
    fn replies_received(&self, awaited: &Awaited) {
        if self.outbox.ack(awaited) {
            self.inbox.wake();
        }
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
    /// Something arrived that the client has not been told about.
    ack_due: Notify,
    /// Microseconds lane readers spent held back by [`LANE_QUEUE_LIMIT`] (the executor behind), all
    /// lanes together: for the session's last log line.
    held_back_us: AtomicU64,
}

#[derive(Debug, Default)]
struct InboxState {
    scheduler: Scheduler<(Request, Pieces)>,
    /// Bulk bytes queued per lane.
    queued: HashMap<Lane, usize>,
    closed: bool,
    /// The connection whose lanes may push (a resume fences the previous one's readers off).
    generation: u64,
    /// What arrived, per lane: acknowledged to the client, and where a resume picks up.
    received: Received,
}

/// Why a request was not taken.
#[derive(Debug, thiserror::Error)]
enum PushError {
    /// It came on a connection the session has left behind: the client sends it again.
    #[error("stale connection")]
    Stale,
    #[error(transparent)]
    Order(#[from] OrderError),
    #[error(transparent)]
    Misordered(#[from] Misordered),
}

impl InboxState {
    /// Takes the next runnable request off the scheduler, releasing its lane's quota.
    #[allow(clippy::type_complexity)]
    fn pop(
        &mut self,
        drained: &Notify,
        allowed: &impl Fn(&Request) -> bool,
    ) -> Option<(Lane, u64, (Request, Pieces))> {
        let next = self.scheduler.pop_if(|(request, _)| allowed(request))?;
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
    /// A request arrived on `lane` of connection `generation`.
    fn push(
        &self,
        lane: Lane,
        generation: u64,
        request: Request,
        bulk: Pieces,
    ) -> Result<(), PushError> {
        {
            let mut state = lock(&self.state);
            if state.generation != generation {
                return Err(PushError::Stale);
            }
            let (seq, deps, len) = (request.seq, request.deps.clone(), bulk.len());
            state.received.note(lane, seq)?;
            state.scheduler.push(lane, seq, deps, (request, bulk))?;
            *state.queued.entry(lane).or_default() += len;
        }
        if self.sleeping.load(Ordering::Acquire) {
            self.ready.notify_one();
        }
        self.ack_due.notify_one();
        Ok(())
    }

    /// An out-of-band signal arrived on `lane` of connection `generation` (acted on at once, never
    /// scheduled): noted, so that it is acknowledged and a resume does not send it again.
    fn note_signal(&self, lane: Lane, generation: u64, seq: u64) -> Result<(), PushError> {
        {
            let mut state = lock(&self.state);
            if state.generation != generation {
                return Err(PushError::Stale);
            }
            state.received.note(lane, seq)?;
        }
        self.ack_due.notify_one();
        Ok(())
    }

    /// The connection whose lanes may push now.
    fn generation(&self) -> u64 {
        lock(&self.state).generation
    }

    /// A new connection takes over: the previous one's readers push nothing more. Returns the new
    /// generation and what was received (where the client resumes).
    fn fence(&self) -> (u64, Marks) {
        let mut state = lock(&self.state);
        state.generation += 1;
        (state.generation, state.received.marks())
    }

    /// What was received, if anything arrived since the last acknowledgement.
    fn acks_due(&self) -> Option<Marks> {
        let mut state = lock(&self.state);
        state
            .received
            .take_changed()
            .then(|| state.received.marks())
    }

    /// Stops the executor once what may run now has run.
    fn close(&self) {
        lock(&self.state).closed = true;
        self.ready.notify_one();
        self.drained.notify_waiters();
    }

    /// Waits while `lane` has more than [`LANE_QUEUE_LIMIT`] bulk bytes queued (the executor is behind).
    async fn room(&self, lane: Lane) {
        let mut since: Option<Instant> = None;
        loop {
            let drained = self.drained.notified();
            let mut drained = pin!(drained);
            drained.as_mut().enable();
            {
                let state = lock(&self.state);
                if state.closed || state.queued.get(&lane).copied().unwrap_or(0) < LANE_QUEUE_LIMIT
                {
                    if let Some(since) = since {
                        let waited = since.elapsed().as_micros() as u64;
                        self.held_back_us.fetch_add(waited, Ordering::Relaxed);
                    }
                    return;
                }
            }
            since.get_or_insert_with(Instant::now);
            drained.await;
        }
    }

    /// The next request that may run and that `allowed` lets through, waiting (spinning first) until
    /// there is one; `None` once closed.
    #[allow(clippy::type_complexity)]
    fn next(
        &self,
        spin: Duration,
        allowed: impl Fn(&Request) -> bool,
    ) -> Option<(Lane, u64, (Request, Pieces))> {
        let started = Instant::now();
        loop {
            {
                let mut state = lock(&self.state);
                if let Some(next) = state.pop(&self.drained, &allowed) {
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
                    if let Some(next) = state.pop(&self.drained, &allowed) {
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

    /// Wakes the executor: what it held back may run now (the reply cache made room).
    fn wake(&self) {
        let _state = lock(&self.state);
        self.ready.notify_all();
    }

    /// [`Inbox::done`] from another thread (a chunk worker): wakes the executor, which may be asleep
    /// waiting for exactly this.
    fn done_elsewhere(&self, seq: u64) {
        lock(&self.state).scheduler.done(seq);
        self.ready.notify_all();
    }
}
/// Each lane's sending half, shared by the executor (which writes answers directly) and the lane's writer
/// task (which flushes what quinn could not take at once), with the lane's reply cache: every reply is
/// kept until the client acknowledges it, so a reply lost in a drop is sent again on resume.
#[derive(Debug, Default)]
struct Outbox {
    lanes: Mutex<HashMap<Lane, Arc<LaneOut>>>,
    /// Reply bytes kept, over every lane.
    cached: AtomicUsize,
    room: Condvar,
    room_lock: Mutex<()>,
}

#[derive(Debug, Default)]
struct LaneOut {
    state: Mutex<OutState>,
}

#[derive(Debug, Default)]
struct OutState {
    /// The lane's stream on the current connection; `None` while the link is down or before the client
    /// reopened the lane after a resume.
    send: Option<quinn::SendStream>,
    /// Wakes this stream's writer task (one per stream, so a stale writer never takes a wake-up).
    flush: Arc<Notify>,
    /// Chunks quinn has not taken yet, in order.
    pending: Vec<Bytes>,
    /// Replies the client may not have.
    cache: ReplyCache,
}

impl OutState {
    /// Hands pending chunks to quinn until it takes no more. `Ready(Ok)` when everything was taken (or
    /// there is no stream: the cache keeps the replies for the next connection).
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), String>> {
        let Some(send) = self.send.as_mut() else {
            self.pending.clear();
            return Poll::Ready(Ok(()));
        };
        while !self.pending.is_empty() {
            let written = {
                let fut = send.write_chunks(&mut self.pending);
                let fut = pin!(fut);
                fut.poll(cx)
            };
            match written {
                Poll::Ready(Ok(_)) => {
                    self.pending.retain(|chunk| !chunk.is_empty());
                }
                Poll::Ready(Err(err)) => {
                    // The connection is going: what was not sent stays in the cache.
                    self.send = None;
                    self.pending.clear();
                    return Poll::Ready(Err(err.to_string()));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl Outbox {
    fn lane(&self, lane: Lane) -> Arc<LaneOut> {
        lock(&self.lanes).entry(lane).or_default().clone()
    }

    /// Gives `lane` its stream on a new connection: what the client has not acknowledged goes first
    /// (after `first`, the resumed control lane's [`Resumed`] frame). Returns the writer's wake-up.
    fn attach(&self, lane: Lane, send: quinn::SendStream, first: Option<Bytes>) -> Arc<Notify> {
        let out = self.lane(lane);
        let mut state = lock(&out.state);
        state.send = Some(send);
        state.flush = Arc::new(Notify::new());
        state.pending = first.into_iter().collect();
        let again = state.cache.unacked();
        state.pending.extend(again);
        let flush = state.flush.clone();
        drop(state);
        flush.notify_one();
        flush
    }

    /// The link is down: every lane's stream is gone (the replies stay cached).
    fn detach_all(&self) {
        let lanes: Vec<Arc<LaneOut>> = lock(&self.lanes).values().cloned().collect();
        for out in lanes {
            let mut state = lock(&out.state);
            state.send = None;
            state.pending.clear();
            state.flush.notify_one();
        }
    }

    /// The client has every reply but those it still awaits. Returns whether that made room for calls
    /// answered with bytes ([`Outbox::is_full`] no longer).
    fn ack(&self, awaited: &Awaited) -> bool {
        let mut freed = 0;
        let lanes: Vec<Arc<LaneOut>> = lock(&self.lanes).values().cloned().collect();
        for out in lanes {
            freed += lock(&out.state).cache.ack(awaited);
        }
        if freed == 0 {
            return false;
        }
        let before = self.cached.fetch_sub(freed, Ordering::AcqRel);
        let crossed = |limit: usize| before >= limit && before - freed < limit;
        if crossed(REPLY_CACHE_LIMIT) {
            let _guard = lock(&self.room_lock);
            self.room.notify_all();
        }
        crossed(ANSWER_BYTES_LIMIT)
    }

    /// Replies in flight past [`ANSWER_BYTES_LIMIT`]: calls answered with bytes wait.
    fn is_full(&self) -> bool {
        self.cached.load(Ordering::Acquire) >= ANSWER_BYTES_LIMIT
    }

    /// Past [`REPLY_CACHE_LIMIT`]: the executor waits.
    fn is_overfull(&self) -> bool {
        self.cached.load(Ordering::Acquire) >= REPLY_CACHE_LIMIT
    }

    fn wait_for_room(&self, at_most: Duration) {
        let guard = lock(&self.room_lock);
        if self.is_overfull() {
            let _ = self.room.wait_timeout(guard, at_most);
        }
    }

    /// Writes `answer` on `lane`: kept in the lane's cache, and straight to quinn when it has room, else
    /// queued for the lane's writer. With the link down it is only kept.
    fn send(&self, lane: Lane, answer: Answer) -> Result<(), String> {
        let out = self.lane(lane);
        let mut head = Vec::with_capacity(64);
        frame::encode_head(&answer.frame, answer.bulk.len(), &mut head)
            .map_err(|e| e.to_string())?;
        // The answer's bytes are handed over as they are: no copy into a frame buffer.
        let frame = Frame {
            seq: answer.frame.seq,
            head: Bytes::from(head),
            // A large buffer goes back to the executor's pool once sent and acknowledged.
            bulk: gleam_server::recycle::REPLIES.bytes(answer.bulk),
        };
        let mut state = lock(&out.state);
        let before = state.cache.bytes();
        state.cache.keep(frame.clone());
        self.cached
            .fetch_add(state.cache.bytes() - before, Ordering::AcqRel);
        if state.send.is_none() {
            return Ok(());
        }
        let was_idle = state.pending.is_empty();
        state.pending.push(frame.head);
        if !frame.bulk.is_empty() {
            state.pending.push(frame.bulk);
        }
        if was_idle {
            // Nothing queued before: try now, without waking the network thread for it.
            let mut cx = Context::from_waker(Waker::noop());
            match state.poll_flush(&mut cx) {
                // A failed write is the link going down: the main loop sees it on the connection.
                Poll::Ready(_) => return Ok(()),
                Poll::Pending => {}
            }
        }
        let flush = state.flush.clone();
        drop(state);
        flush.notify_one();
        Ok(())
    }

    /// Flushes every lane and waits until the client has received it all (at the session's end: closing
    /// the connection drops whatever is not yet acknowledged, Goodbye's answer included).
    async fn flush_all(&self) {
        let lanes: Vec<Arc<LaneOut>> = lock(&self.lanes).values().cloned().collect();
        let mut delivered = Vec::with_capacity(lanes.len());
        for out in lanes {
            let _ = poll_fn(|cx| lock(&out.state).poll_flush(cx)).await;
            let mut state = lock(&out.state);
            if let Some(send) = state.send.as_mut() {
                let _ = send.finish();
                delivered.push(send.stopped());
            }
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
    let bulk_threads = Arc::new(ConnectionThreads::default());
    runtime.block_on(async move {
        let (endpoint, server) = match bind(&options) {
            Ok(bound) => bound,
            Err(err) => {
                let _ = port_tx.send(Err(err));
                return;
            }
        };
        let port = endpoint.local_addr().map(|a| a.port()).unwrap_or(0);
        let _ = port_tx.send(Ok(port));
        tokio::spawn(shared.busy.clone().run());
        let (arrivals_tx, mut arrivals) = mpsc::channel(4);
        let acceptor = tokio::spawn(accept(
            endpoint.clone(),
            server,
            options.client,
            token,
            arrivals_tx,
            (shared.clone(), bulk_threads),
        ));
        // A bulk connection admitted before the attach (its handshake may finish first) waits for it.
        let mut early_bulk = Vec::new();
        let first = tokio::time::timeout(options.attach_timeout, async {
            loop {
                match arrivals.recv().await? {
                    Arrival::Attach(link) => return Some(link),
                    Arrival::Resume(link, _) => {
                        link.conn
                            .close(CLOSE_PROTOCOL_VIOLATION, b"no session to resume yet");
                    }
                    Arrival::Bulk(conn) if early_bulk.len() < MAX_BULK_CONNECTIONS => {
                        early_bulk.push(conn);
                    }
                    Arrival::Bulk(conn) => {
                        conn.close(CLOSE_PROTOCOL_VIOLATION, b"too many bulk connections");
                    }
                }
            }
        })
        .await;
        let link = match first {
            Ok(Some(link)) => link,
            Ok(None) => return,
            Err(_) => {
                acceptor.abort();
                shared.end(End::NoClient(options.attach_timeout));
                endpoint.close(CLOSE_ENDED, b"no client");
                return;
            }
        };
        info!(client = %options.client, remote = %link.conn.remote_address(), "client attached");
        let conn = connect(&shared, link, None);
        for bulk in &early_bulk {
            tokio::spawn(serve_bulk(
                bulk.clone(),
                shared.inbox.generation(),
                shared.clone(),
            ));
        }
        let last = drive(conn, early_bulk, &mut arrivals, &shared, options.grace).await;
        acceptor.abort();
        // Let the last answers (Goodbye's) leave before closing.
        let _ = tokio::time::timeout(DRAIN_TIMEOUT, shared.outbox.flush_all()).await;
        let (code, reason) = match shared.ending() {
            Some(End::Protocol(why)) => (CLOSE_PROTOCOL_VIOLATION, why),
            _ => (CLOSE_ENDED, "session ended".to_owned()),
        };
        if let Some(conn) = last {
            conn.close(code, reason.as_bytes());
        }
        endpoint.close(code, reason.as_bytes());
        let _ = tokio::time::timeout(Duration::from_millis(500), endpoint.wait_idle()).await;
    });
}

/// Binds the session's endpoint on `options.bind`, at a port of `GLEAM_SESSION_PORTS` (`LO-HI`, for a
/// firewall that opens only those) or any free one. An address that cannot be bound (a host without IPv6,
/// an address that went away) falls back to every address of its family. Returns the endpoint and its
/// server config.
fn bind(options: &Options) -> Result<(quinn::Endpoint, quinn::ServerConfig), String> {
    let server = tls::session_server_config(&options.identity).map_err(|e| format!("TLS: {e}"))?;
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
                Ok(endpoint) => return Ok((endpoint, server.clone())),
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

/// A connection that presented the session's token on its first stream.
struct Link {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    frames: FrameReader,
}

/// What the acceptor hands the session.
enum Arrival {
    /// The client's first connection.
    Attach(Link),
    /// A connection resuming the session, with the replies the client awaits.
    Resume(Link, Awaited),
    /// The client's bulk connection ([`StreamOpen::Bulk`]): more lanes, on a congestion window of their
    /// own.
    Bulk(quinn::Connection),
}

/// Threads beside the network thread that drive a session's further bulk connections, past its first
/// (a quinn connection's driver encrypts what it sends and decrypts what it receives): a copy striped
/// over several bulk connections ([`gleam_protocol::wire::bulk_stream`]) is then encrypted and
/// decrypted on several cores. The socket stays the network thread's; only the connections' work
/// moves. The first bulk connection stays on the network thread: with one stripe (the default) the
/// session runs as it did before stripes.
/// Started at the first such connection: a session with one stripe (the default) never starts them.
#[derive(Default)]
struct ConnectionThreads(std::sync::OnceLock<Option<tokio::runtime::Runtime>>);

impl ConnectionThreads {
    /// The threads' runtime, started now if it is not yet: one thread per stripe past the first a client
    /// may use, as the host's cores allow (at least one). `None` if it cannot be started.
    fn handle(&self) -> Option<tokio::runtime::Handle> {
        let runtime = self.0.get_or_init(Self::start).as_ref()?;
        Some(runtime.handle().clone())
    }

    fn start() -> Option<tokio::runtime::Runtime> {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = cores
            .saturating_sub(1)
            .clamp(1, usize::from(gleam_protocol::wire::MAX_STRIPES) - 1);
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("gleam-session-bulk")
            .enable_all()
            .build()
            .inspect_err(
                |err| warn!(%err, "no bulk connection threads: the network thread drives them"),
            )
            .ok()
    }
}

impl Drop for ConnectionThreads {
    fn drop(&mut self) {
        if let Some(Some(runtime)) = self.0.take() {
            // The connections are closed by now; their drivers need not finish. (Also allowed where
            // blocking is not, as on the network thread's runtime.)
            runtime.shutdown_background();
        }
    }
}

/// Admits connections for the whole session: authenticated as `client`, their first stream presenting
/// `token` (the first connection attaches, later ones resume). Anything else is refused. The first two
/// connections to arrive while the link is down (the session connection and the first bulk one) are
/// driven on this, the network thread; any other one, a further stripe, on `bulk_threads`.
async fn accept(
    endpoint: quinn::Endpoint,
    server: quinn::ServerConfig,
    client: PeerId,
    token: [u8; 32],
    arrivals: mpsc::Sender<Arrival>,
    (shared, bulk_threads): (Arc<Shared>, Arc<ConnectionThreads>),
) {
    while let Some(incoming) = endpoint.accept().await {
        let on_bulk_thread = (shared.on_network_thread.fetch_add(1, Ordering::AcqRel) >= 2)
            .then(|| bulk_threads.handle())
            .flatten();
        // Fitted to the path (loopback datagrams for a client on this machine). quinn spawns the
        // connection's driver on the runtime it is accepted in.
        let accepted = {
            let _on = on_bulk_thread.as_ref().map(tokio::runtime::Handle::enter);
            tls::accept(incoming, &server)
        };
        let incoming = match accepted {
            Ok(connecting) => connecting,
            Err(err) => {
                debug!(error = %err, "a connection to the session endpoint was refused");
                continue;
            }
        };
        let arrivals = arrivals.clone();
        // Each on its own task: a connection that stalls mid-handshake holds up no other.
        tokio::spawn(async move {
            if let Some(arrival) = admit(incoming, client, &token).await {
                let _ = arrivals.send(arrival).await;
            }
        });
    }
}

/// One incoming connection: the peer's identity, then its first stream's opening frame.
async fn admit(incoming: quinn::Connecting, client: PeerId, token: &[u8; 32]) -> Option<Arrival> {
    let conn = match incoming.await {
        Ok(conn) => conn,
        Err(err) => {
            debug!(error = %err, "a connection to the session endpoint failed its handshake");
            return None;
        }
    };
    match tls::remote_peer_id(&conn) {
        Ok(peer) if peer == client => {}
        Ok(peer) => {
            warn!(%peer, expected = %client, "refused a connection from another peer");
            conn.close(CLOSE_PROTOCOL_VIOLATION, b"not this session's client");
            return None;
        }
        Err(err) => {
            warn!(error = %err, "refused a connection without a peer certificate");
            conn.close(CLOSE_PROTOCOL_VIOLATION, b"no peer certificate");
            return None;
        }
    }
    let first = tokio::time::timeout(ATTACH_TIMEOUT, conn.accept_bi()).await;
    let Ok(Ok((send, mut recv))) = first else {
        conn.close(CLOSE_PROTOCOL_VIOLATION, b"no stream opened");
        return None;
    };
    let mut frames = FrameReader::new();
    let opening = tokio::time::timeout(ATTACH_TIMEOUT, read_opening(&mut recv, &mut frames)).await;
    let link = |conn, send, recv, frames| Link {
        conn,
        send,
        recv,
        frames,
    };
    match opening {
        Ok(Ok(StreamOpen::Attach { token: presented })) if constant_time_eq(&presented, token) => {
            // The session's client: its full flow-control credit (a few KiB until now).
            tls::grant_credit(&conn);
            Some(Arrival::Attach(link(conn, send, recv, frames)))
        }
        Ok(Ok(StreamOpen::Bulk { token: presented })) if constant_time_eq(&presented, token) => {
            tls::grant_credit(&conn);
            // Finishing its opening stream tells the client it is admitted; it carries nothing more.
            let mut send = send;
            let _ = send.finish();
            drop(recv);
            Some(Arrival::Bulk(conn))
        }
        Ok(Ok(StreamOpen::Resume {
            token: presented,
            replies,
        })) if constant_time_eq(&presented, token) => {
            // As above, on the connection a reconnecting client resumes on.
            tls::grant_credit(&conn);
            Some(Arrival::Resume(link(conn, send, recv, frames), replies))
        }
        Ok(Ok(_)) => {
            warn!("refused a connection without the session's token");
            conn.close(CLOSE_PROTOCOL_VIOLATION, b"wrong session token");
            None
        }
        Ok(Err(err)) => {
            conn.close(CLOSE_PROTOCOL_VIOLATION, err.as_bytes());
            None
        }
        Err(_) => {
            conn.close(CLOSE_PROTOCOL_VIOLATION, b"no stream opening in time");
            None
        }
    }
}

/// Makes `link` the session's connection: its first stream carries the control lane (after the
/// [`Resumed`] frame when it resumes, with the replies the client awaits); starts its tasks.
fn connect(shared: &Arc<Shared>, link: Link, resumed: Option<Awaited>) -> quinn::Connection {
    let Link {
        conn,
        send,
        recv,
        frames,
    } = link;
    let (generation, first) = match resumed {
        None => (shared.inbox.generation(), None),
        Some(replies) => {
            // Readers of the previous connection push nothing from here on: what was received is final.
            let (generation, received) = shared.inbox.fence();
            shared.outbox.detach_all();
            shared.replies_received(&replies);
            let mut first = Vec::new();
            if let Err(err) = frame::encode(&Resumed { received }, &[], &mut first) {
                shared.end(End::Network(format!(
                    "cannot encode the resume answer: {err}"
                )));
            }
            (generation, Some(Bytes::from(first)))
        }
    };
    start_lane(shared, Lane::CONTROL, generation, send, recv, frames, first);
    tokio::spawn(send_acks(conn.clone(), generation, shared.clone()));
    conn
}

/// Starts a lane's reader and writer on the current connection.
fn start_lane(
    shared: &Arc<Shared>,
    lane: Lane,
    generation: u64,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    frames: FrameReader,
    first: Option<Bytes>,
) {
    let flush = shared.outbox.attach(lane, send, first);
    tokio::spawn(lane_writer(lane, flush, shared.clone()));
    // From here on the lane's bytes are read where they arrived: requests' bulk bytes travel to the
    // executor (and an upload's chunks to their workers) in quinn's buffers, never copied on this thread.
    match PieceReader::after(frames.into_buffered()) {
        Ok(frames) => {
            tokio::spawn(lane_reader(recv, frames, lane, generation, shared.clone()));
        }
        Err(err) => shared.end(End::Protocol(format!("request {err}"))),
    }
}

/// Serves the session's connections until the session ends: the lanes the client opens, its
/// acknowledgements, and, when the link drops, the grace window and the connection that resumes within
/// it; `bulk` are the client's bulk connections so far (closed when a resume replaces the session
/// connection). Returns the last connection, to close.
async fn drive(
    conn: quinn::Connection,
    mut bulk: Vec<quinn::Connection>,
    arrivals: &mut mpsc::Receiver<Arrival>,
    shared: &Arc<Shared>,
    grace: Duration,
) -> Option<quinn::Connection> {
    let mut current = Some(conn);
    // While the link is down: when the session gives up on the client.
    let mut give_up: Option<tokio::time::Instant> = None;
    loop {
        let ended = shared.ended.notified();
        let mut ended = pin!(ended);
        // Registered before looking, so an end between the look and the wait still wakes us.
        ended.as_mut().enable();
        // (The endpoint's close, after this returns, closes the bulk connections too.)
        if shared.ending().is_some() {
            return current;
        }
        let conn = current.clone();
        let streams = async {
            match &conn {
                Some(conn) => tokio::select! {
                    biased;
                    bi = conn.accept_bi() => bi.map(|(send, recv)| Stream::Bi(send, recv)),
                    uni = conn.accept_uni() => uni.map(Stream::Uni),
                },
                None => std::future::pending().await,
            }
        };
        let deadline = async {
            match give_up {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = ended => return current,
            arrival = arrivals.recv() => match arrival {
                Some(Arrival::Resume(link, replies)) => {
                    if let Some(old) = current.take() {
                        old.close(CLOSE_SUPERSEDED, b"the session resumed on a new connection");
                    }
                    for conn in bulk.drain(..) {
                        conn.close(CLOSE_SUPERSEDED, b"the session resumed on a new connection");
                    }
                    let away = give_up.map(|_| "after a drop").unwrap_or("before this side saw the drop");
                    info!(remote = %link.conn.remote_address(), away, "session resumed");
                    current = Some(connect(shared, link, Some(replies)));
                    give_up = None;
                }
                Some(Arrival::Attach(link)) => {
                    link.conn.close(CLOSE_PROTOCOL_VIOLATION, b"already attached: resume instead");
                }
                Some(Arrival::Bulk(conn)) if bulk.len() >= MAX_BULK_CONNECTIONS => {
                    conn.close(CLOSE_PROTOCOL_VIOLATION, b"too many bulk connections");
                }
                Some(Arrival::Bulk(conn)) if current.is_some() => {
                    debug!(remote = %conn.remote_address(), "bulk connection attached");
                    tokio::spawn(serve_bulk(conn.clone(), shared.inbox.generation(), shared.clone()));
                    bulk.push(conn);
                }
                Some(Arrival::Bulk(conn)) => {
                    conn.close(CLOSE_SUPERSEDED, b"the link is down: resume first");
                }
                None => {
                    shared.end(End::Network("the session endpoint closed".into()));
                    return current;
                }
            },
            stream = streams => match stream {
                Ok(Stream::Bi(send, recv)) => {
                    if let Some(conn) = &conn {
                        tokio::spawn(open_lane(send, recv, shared.inbox.generation(), shared.clone(), conn.clone()));
                    }
                }
                Ok(Stream::Uni(recv)) => {
                    tokio::spawn(read_acks(recv, shared.clone()));
                }
                Err(err) => {
                    current = None;
                    // The client's next connection is the resumed session connection.
                    shared.on_network_thread.store(0, Ordering::Release);
                    match &err {
                        // A resume attempt the client gave up: it tries again (below, as a drop).
                        quinn::ConnectionError::ApplicationClosed(close)
                            if close.error_code == VarInt::from_u32(CLOSE_RESUME_ABANDONED) => {
                            shared.outbox.detach_all();
                            give_up = Some(tokio::time::Instant::now() + grace);
                            warn!("the client abandoned a resume: waiting for its next attempt");
                        }
                        // The client closed the session (it exited, or found us breaking the protocol).
                        quinn::ConnectionError::ApplicationClosed(_) => {
                            shared.end(End::ClientGone(err.to_string()));
                            return None;
                        }
                        // This side closed it: the session is ending.
                        quinn::ConnectionError::LocallyClosed => return None,
                        _ => {
                            shared.outbox.detach_all();
                            // The grace window counts from the last time the client was heard: a timed-out
                            // connection heard nothing for the idle timeout already.
                            let quiet = match err {
                                quinn::ConnectionError::TimedOut => {
                                    Duration::from_millis(u64::from(tls::IDLE_TIMEOUT_MS))
                                }
                                _ => Duration::ZERO,
                            };
                            let left = grace.saturating_sub(quiet);
                            warn!(error = %err, grace_left_ms = left.as_millis() as u64,
                                "lost the client's connection: the session waits for it to come back");
                            give_up = Some(tokio::time::Instant::now() + left);
                        }
                    }
                }
            },
            () = deadline => {
                shared.end(End::ClientGone(format!(
                    "the client did not come back within the grace window ({grace:?})"
                )));
                return None;
            }
        }
    }
}

/// The client's bulk connection: every stream it opens is a lane, served like the session connection's
/// (the generation fences its readers off when the session resumes, as theirs). Its loss is not the
/// session's: the session connection's fate decides, and the client resumes on a drop.
async fn serve_bulk(conn: quinn::Connection, generation: u64, shared: Arc<Shared>) {
    loop {
        match conn.accept_bi().await {
            Ok((send, recv)) => {
                tokio::spawn(open_lane(
                    send,
                    recv,
                    generation,
                    shared.clone(),
                    conn.clone(),
                ));
            }
            Err(err) => {
                debug!(error = %err, "bulk connection closed");
                return;
            }
        }
    }
}

/// A stream the client opened.
enum Stream {
    /// A lane.
    Bi(quinn::SendStream, quinn::RecvStream),
    /// Its acknowledgements.
    Uni(quinn::RecvStream),
}

/// A lane stream the client opened: reads its opening, then serves it (unless a resume superseded its
/// connection meanwhile).
async fn open_lane(
    send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    generation: u64,
    shared: Arc<Shared>,
    conn: quinn::Connection,
) {
    let mut frames = FrameReader::new();
    match read_opening(&mut recv, &mut frames).await {
        Ok(StreamOpen::Lane { lane }) if lane != Lane::CONTROL => {
            if shared.inbox.generation() == generation {
                start_lane(&shared, lane, generation, send, recv, frames, None);
            }
        }
        Ok(_) => shared.end(End::Protocol(
            "a second attach or a second control lane".into(),
        )),
        // The connection went down while the lane opened: the client opens it again on resume.
        Err(_) if conn.close_reason().is_some() => {}
        Err(err) => shared.end(End::Protocol(err)),
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
    mut frames: PieceReader,
    lane: Lane,
    generation: u64,
    shared: Arc<Shared>,
) {
    let why = 'lane: loop {
        while let Some(frame) = frames.next_frame() {
            let request: Request = match frame.decode() {
                Ok(request) => request,
                Err(err) => break 'lane End::Protocol(format!("malformed request: {err}")),
            };
            // Out of band: the executor may be blocked waiting for the stream this releases. Noted as
            // received (signals are numbered on their own lane), so a resume sends it again only if
            // it did not arrive.
            if let Call::HostFuncReturned { id } = request.call {
                match shared.inbox.note_signal(lane, generation, request.seq) {
                    Ok(()) => {}
                    Err(PushError::Stale) => return,
                    Err(err) => break 'lane End::Protocol(err.to_string()),
                }
                if let Some(callbacks) = shared.callbacks.get() {
                    callbacks.returned(id);
                }
                continue;
            }
            // A small request's bytes are copied out: as pieces they would keep whole received packets
            // alive while the request waits.
            let bulk = if !frame.bulk.is_empty() && frame.bulk.len() <= COPY_SMALL_BULK {
                Pieces::from(Bytes::from(frame.bulk.to_vec()))
            } else {
                frame.bulk
            };
            match shared.inbox.push(lane, generation, request, bulk) {
                Ok(()) => {}
                // A resume took over: the client sends this again on the new connection.
                Err(PushError::Stale) => return,
                Err(err) => break 'lane End::Protocol(err.to_string()),
            }
        }
        // Backpressure: stop reading while this lane's queue is full (QUIC flow control then holds
        // the client).
        shared.inbox.room(lane).await;
        match recv.read_chunk(usize::MAX, true).await {
            Ok(Some(chunk)) => match frames.feed(chunk.bytes) {
                Ok(()) => {}
                Err(err @ (FrameError::HeaderTooLarge(_) | FrameError::BulkTooLarge(_))) => {
                    break End::Protocol(format!("request {err}"));
                }
                Err(err) => break End::Protocol(err.to_string()),
            },
            Ok(None) if frames.is_mid_frame() => {
                break End::Protocol("a stream ended inside a frame".into());
            }
            // The client finished this lane; the session goes on.
            Ok(None) => return,
            // The connection is going (the session's main loop handles that), or the client reset the
            // stream: a partial frame is dropped and comes again on resume.
            Err(err) => {
                debug!(lane = lane.0, error = %err, "lane stream ended");
                return;
            }
        }
    };
    if let End::Protocol(why) = &why {
        warn!(lane = lane.0, %why, "protocol violation: ending the session");
    }
    shared.end(why);
}

/// One lane's writer on one connection: flushes whatever the executor left pending (at the session's
/// end, `flush_all` takes over). Ends with its stream.
async fn lane_writer(lane: Lane, flush: Arc<Notify>, shared: Arc<Shared>) {
    let Some(out) = lock(&shared.outbox.lanes).get(&lane).cloned() else {
        return;
    };
    loop {
        flush.notified().await;
        if shared.ending().is_some() {
            return;
        }
        let result = poll_fn(|cx| {
            let mut state = lock(&out.state);
            if !Arc::ptr_eq(&state.flush, &flush) || state.send.is_none() {
                // The stream this writer served is gone.
                return Poll::Ready(Err(String::new()));
            }
            state.poll_flush(cx)
        })
        .await;
        if result.is_err() {
            return;
        }
    }
}

/// Sends the client, now and then, what arrived (so it can forget what it kept for resending), on a
/// unidirectional stream of this connection.
async fn send_acks(conn: quinn::Connection, generation: u64, shared: Arc<Shared>) {
    let Ok(mut send) = conn.open_uni().await else {
        return;
    };
    let mut out = Vec::new();
    loop {
        tokio::select! {
            () = shared.inbox.ack_due.notified() => {
                // Gather what arrives meanwhile into the same acknowledgement.
                tokio::time::sleep(ACK_DELAY).await;
            }
            () = tokio::time::sleep(ACK_TICK) => {}
        }
        if shared.ending().is_some() || shared.inbox.generation() != generation {
            return;
        }
        let Some(through) = shared.inbox.acks_due() else {
            continue;
        };
        out.clear();
        if frame::encode(&Acks { through }, &[], &mut out).is_err()
            || send.write_all(&out).await.is_err()
        {
            return;
        }
    }
}

/// Applies the client's acknowledgements of replies.
async fn read_acks(mut recv: quinn::RecvStream, shared: Arc<Shared>) {
    let mut frames = FrameReader::new();
    loop {
        loop {
            match frames.next_frame() {
                Ok(Some(frame)) => match frame.decode::<Awaited>() {
                    Ok(awaited) => shared.replies_received(&awaited),
                    Err(err) => {
                        shared.end(End::Protocol(format!("malformed acknowledgement: {err}")));
                        return;
                    }
                },
                Ok(None) => break,
                Err(err) => {
                    shared.end(End::Protocol(format!("acknowledgement stream: {err}")));
                    return;
                }
            }
        }
        match recv.read_chunk(64 << 10, true).await {
            Ok(Some(chunk)) => frames.feed(&chunk.bytes),
            Ok(None) | Err(_) => return,
        }
    }
}

/// Whether a presented session token is the session's (compared in constant time).
pub fn tokens_match(a: &[u8; 32], b: &[u8; 32]) -> bool {
    constant_time_eq(a, b)
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
