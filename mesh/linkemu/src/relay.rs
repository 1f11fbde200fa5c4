//! The IO layer: a UDP relay that pushes every datagram through a [`Link`] each way.
//!
//! One dedicated thread owns all sockets (non-blocking) and both links. It sleeps in `ppoll` with
//! nanosecond timeouts until shortly before the next delivery, then spins the last stretch, because
//! sub-millisecond delays are the whole point and async runtimes' timers tick in milliseconds.
//! Spinning is rationed (a quarter of the time at most) so that a steady packet stream does not
//! turn the relay into a busy loop; past the ration deliveries are slept to, typically 20-50 µs
//! late. [`DirectionStats`] reports how late datagrams actually left. Arrival times come from the
//! kernel's receive stamps, so a relay thread that was descheduled for a while still models the
//! queue as the datagrams really arrived instead of as one burst.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tracing::{debug, trace, warn};

use crate::config::LinkConfig;
use crate::link::{Link, LinkStats, Verdict};
use crate::sys;

/// Wake up a little before a delivery is due and spin the rest: `ppoll` itself can overshoot by
/// tens of microseconds on a loaded machine.
const SPIN_MARGIN: Duration = Duration::from_micros(100);
/// Longest sleep, so a stop request is noticed promptly.
const MAX_SLEEP: Duration = Duration::from_millis(10);
/// Datagrams read from one socket before giving the other direction a turn.
const RECV_BATCH: usize = 64;
/// Largest UDP payload.
const MAX_DATAGRAM: usize = 65_535;
const SOCKET_BUFFER: usize = 8 << 20;
/// A client's upstream socket is closed after this long without traffic either way.
const CLIENT_IDLE: Duration = Duration::from_secs(120);
/// More clients than this get dropped rather than exhaust file descriptors.
const MAX_CLIENTS: usize = 1024;
const STATS_LOG_EVERY: Duration = Duration::from_secs(5);
/// Spinning may take at most `1 / SPIN_SHARE` of each `SPIN_WINDOW`.
const SPIN_WINDOW: Duration = Duration::from_millis(10);
const SPIN_SHARE: u32 = 4;
/// Kernel arrival stamps older than this are clamped to it.
const MAX_STAMP_AGE: Duration = Duration::from_millis(200);

/// A UDP relay from `listen` to `upstream` through an emulated link.
///
/// Clients send to `listen`; each distinct client address gets its own socket towards `upstream`
/// (like a NAT), so the upstream's replies cross the `down` link back to the right client.
#[derive(Debug, Clone)]
pub struct Relay {
    /// Where clients send. Port 0 picks a free port; see [`RelayHandle::local_addr`].
    pub listen: SocketAddr,
    pub upstream: SocketAddr,
    /// Client → upstream.
    pub up: LinkConfig,
    /// Upstream → client.
    pub down: LinkConfig,
}

impl Relay {
    /// The same link both ways (the `down` RNG seed is offset so losses are independent).
    pub fn symmetric(listen: SocketAddr, upstream: SocketAddr, link: LinkConfig) -> Self {
        let down = LinkConfig {
            seed: link.seed.wrapping_add(1),
            ..link
        };
        Self {
            listen,
            upstream,
            up: link,
            down,
        }
    }

    /// Binds `listen` and starts the relay thread. The relay runs until the handle is dropped.
    pub fn spawn(self) -> Result<RelayHandle, RelayError> {
        let socket = UdpSocket::bind(self.listen).map_err(|source| RelayError::Bind {
            addr: self.listen,
            source,
        })?;
        socket.set_nonblocking(true).map_err(RelayError::Socket)?;
        sys::enlarge_buffers(&socket, SOCKET_BUFFER);
        sys::stamp_arrivals(&socket);
        let local_addr = socket.local_addr().map_err(RelayError::Socket)?;
        debug!(listen = %local_addr, upstream = %self.upstream, up = %self.up, down = %self.down, "link emulator relaying");

        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            stats: Mutex::new(RelayStats::default()),
        });
        let engine = Engine {
            listen: socket,
            upstream: self.upstream,
            up: Link::new(self.up),
            down: Link::new(self.down),
            clients: HashMap::new(),
            client_ids: HashMap::new(),
            next_client: 0,
            io: [IoStats::default(); 2],
            last_arrival: [Instant::now(); 2],
            spin: SpinBudget::new(Instant::now()),
            shared: Arc::clone(&shared),
            buf: vec![0; MAX_DATAGRAM].into_boxed_slice(),
        };
        let thread = std::thread::Builder::new()
            .name("gleam-linkemu".into())
            .spawn(move || engine.run())
            .map_err(RelayError::Thread)?;
        Ok(RelayHandle {
            local_addr,
            upstream: self.upstream,
            shared,
            thread: Some(thread),
        })
    }
}

/// A running [`Relay`]; dropping it stops the relay and joins its thread.
#[derive(Debug)]
pub struct RelayHandle {
    local_addr: SocketAddr,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl RelayHandle {
    /// The address clients send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Counters so far.
    pub fn stats(&self) -> RelayStats {
        *self
            .shared
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops the relay and returns its final counters.
    pub fn stop(mut self) -> RelayStats {
        self.shutdown();
        self.stats()
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            warn!("link emulator thread panicked");
        }
    }
}

impl Drop for RelayHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Counters of a relay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Client → upstream.
    pub up: DirectionStats,
    /// Upstream → client.
    pub down: DirectionStats,
    /// Clients seen since start.
    pub clients: u64,
}

/// Counters of one direction of a relay: the link model's, and how well the IO kept up with it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectionStats {
    pub link: LinkStats,
    /// Datagrams the link delivered but the socket refused.
    pub send_errors: u64,
    /// How late the worst datagram left compared with the model's delivery time.
    pub max_lateness: Duration,
    /// Sum over all delivered datagrams of their lateness; see [`DirectionStats::mean_lateness`].
    pub total_lateness: Duration,
}

impl DirectionStats {
    pub fn mean_lateness(&self) -> Duration {
        match u32::try_from(self.link.delivered_packets) {
            Ok(0) => Duration::ZERO,
            Ok(n) => self.total_lateness / n,
            Err(_) => Duration::from_secs_f64(
                self.total_lateness.as_secs_f64() / self.link.delivered_packets as f64,
            ),
        }
    }
}

impl std::fmt::Display for DirectionStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.link;
        write!(
            f,
            "{} pkts / {} B in, {} pkts / {} B out, {} lost, {} queue drops, {} send errors, \
             late by {:?} mean / {:?} max",
            s.offered_packets,
            s.offered_bytes,
            s.delivered_packets,
            s.delivered_bytes,
            s.lost_packets,
            s.overflow_packets,
            self.send_errors,
            self.mean_lateness(),
            self.max_lateness,
        )
    }
}

impl std::fmt::Display for RelayStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "up: {}; down: {}; {} clients",
            self.up, self.down, self.clients
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("cannot configure the relay socket")]
    Socket(#[source] io::Error),
    #[error("cannot start the relay thread")]
    Thread(#[source] io::Error),
}

#[derive(Debug)]
struct Shared {
    stop: AtomicBool,
    stats: Mutex<RelayStats>,
}

type ClientId = u64;

/// Accounts the time the relay thread busy-waits, per window.
struct SpinBudget {
    window_start: Instant,
    spent: Duration,
    /// When the current spin began, if spinning.
    since: Option<Instant>,
}

impl SpinBudget {
    fn new(now: Instant) -> Self {
        Self {
            window_start: now,
            spent: Duration::ZERO,
            since: None,
        }
    }

    fn allows(&mut self, now: Instant) -> bool {
        if now - self.window_start >= SPIN_WINDOW {
            self.window_start = now;
            self.spent = Duration::ZERO;
        }
        self.spent < SPIN_WINDOW / SPIN_SHARE
    }

    fn spinning(&mut self, now: Instant) {
        if let Some(since) = self.since.replace(now) {
            self.spent += now.saturating_duration_since(since);
        }
    }

    fn sleeping(&mut self, now: Instant) {
        if let Some(since) = self.since.take() {
            self.spent += now.saturating_duration_since(since);
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct IoStats {
    send_errors: u64,
    max_lateness: Duration,
    total_lateness: Duration,
}

impl IoStats {
    fn sent(&mut self, now: Instant, datagram_due: Instant, result: io::Result<usize>) {
        let late = now.saturating_duration_since(datagram_due);
        self.max_lateness = self.max_lateness.max(late);
        self.total_lateness += late;
        if let Err(err) = result {
            self.send_errors += 1;
            trace!(error = %err, "send failed");
        }
    }

    fn with(self, link: LinkStats) -> DirectionStats {
        DirectionStats {
            link,
            send_errors: self.send_errors,
            max_lateness: self.max_lateness,
            total_lateness: self.total_lateness,
        }
    }
}

/// When a datagram reached the kernel, from its `SO_TIMESTAMPNS` stamp, as an `Instant`; `now`
/// without a stamp. Arrivals are kept in order (per link), and a stamp older than
/// [`MAX_STAMP_AGE`] (the wall clock stepped, say) is not trusted further.
///
/// The wall clock is read before the monotonic one it is mapped onto: a preemption between the
/// two reads then makes the arrival later, never earlier (a datagram must never leave early).
fn arrival(now: Instant, stamp: Option<Duration>, last: &mut Instant) -> Instant {
    let mapped = stamp.and_then(|stamp| {
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).ok()?;
        let mono = Instant::now();
        let age = wall.saturating_sub(stamp).min(MAX_STAMP_AGE);
        mono.checked_sub(age)
    });
    let arrived = mapped.unwrap_or(now).max(*last);
    *last = arrived;
    arrived
}

/// What travels through either link: the datagram and whose it is.
type Payload = (ClientId, Box<[u8]>);

struct Client {
    addr: SocketAddr,
    /// Connected to the upstream.
    socket: UdpSocket,
    last_active: Instant,
}

/// Everything the relay thread owns.
struct Engine {
    listen: UdpSocket,
    upstream: SocketAddr,
    up: Link<Payload>,
    down: Link<Payload>,
    clients: HashMap<ClientId, Client>,
    client_ids: HashMap<SocketAddr, ClientId>,
    next_client: ClientId,
    /// Up, down.
    io: [IoStats; 2],
    /// Latest arrival handed to each link, up and down, so arrivals never go back in time.
    last_arrival: [Instant; 2],
    spin: SpinBudget,
    shared: Arc<Shared>,
    buf: Box<[u8]>,
}

impl Engine {
    fn run(mut self) {
        sys::tighten_timer_slack();
        let mut last_sweep = Instant::now();
        let mut last_log = last_sweep;
        while !self.shared.stop.load(Ordering::Relaxed) {
            let mut busy = self.receive_from_clients();
            busy |= self.receive_from_upstream();
            let sent = self.transmit(Instant::now());
            if busy || sent {
                self.publish_stats();
            }

            let now = Instant::now();
            if now - last_sweep >= Duration::from_secs(1) {
                self.expire_clients(now);
                last_sweep = now;
            }
            if now - last_log >= STATS_LOG_EVERY {
                debug!(stats = %self.stats(), "link emulator");
                last_log = now;
            }
            if busy {
                // A socket may hold more; read it before sleeping.
                continue;
            }
            self.wait(now);
        }
        self.publish_stats();
        debug!(stats = %self.stats(), "link emulator stopped");
    }

    /// Sleeps until a socket is readable or shortly before the next delivery, then returns;
    /// inside the spin margin it returns at once, so the caller busy-polls.
    ///
    /// The spin deliberately does not `sched_yield`: under EEVDF a yield hands the CPU to any
    /// busy neighbour for a whole slice (milliseconds late), while a thread that mostly sleeps
    /// and spins briefly keeps the lag credit that gets it scheduled promptly.
    ///
    /// Spinning is rationed by [`SpinBudget`]: past it (a steady high packet rate), short waits
    /// are slept too, a few tens of microseconds late, rather than turn the relay into a busy loop
    /// that the scheduler then preempts for milliseconds on a loaded machine.
    fn wait(&mut self, now: Instant) {
        let next = [self.up.poll_timeout(), self.down.poll_timeout()]
            .into_iter()
            .flatten()
            .min();
        let wait = next.map_or(MAX_SLEEP, |at| at.saturating_duration_since(now));
        let margin = if self.spin.allows(now) {
            SPIN_MARGIN
        } else {
            Duration::ZERO
        };
        if wait <= margin {
            self.spin.spinning(now);
            std::hint::spin_loop();
            return;
        }
        self.spin.sleeping(now);
        let sleep = (wait - margin).min(MAX_SLEEP);
        let mut fds = Vec::with_capacity(1 + self.clients.len());
        fds.push(self.listen.as_raw_fd());
        fds.extend(self.clients.values().map(|c| c.socket.as_raw_fd()));
        if let Err(err) = sys::wait_readable(&fds, sleep) {
            // Never expected; sleep instead of spinning on a broken poll.
            warn!(error = %err, "ppoll failed");
            std::thread::sleep(sleep);
        }
    }

    /// Reads datagrams from clients into the `up` link. True if any arrived.
    fn receive_from_clients(&mut self) -> bool {
        let mut any = false;
        for _ in 0..RECV_BATCH {
            let received = match sys::recv_stamped(&self.listen, &mut self.buf) {
                Ok(received) => received,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err) => {
                    // ICMP errors from earlier sends surface here; they concern one datagram.
                    trace!(error = %err, "recv from clients");
                    continue;
                }
            };
            any = true;
            let now = Instant::now();
            let Some(from) = received.from else {
                continue;
            };
            let Some(id) = self.client(from, now) else {
                continue;
            };
            let len = received.len;
            let payload = (id, Box::from(&self.buf[..len]));
            let arrived = arrival(now, received.stamp, &mut self.last_arrival[0]);
            if let Verdict::Dropped(reason) = self.up.handle_datagram(arrived, len, payload) {
                trace!(?reason, len, "up: dropped");
            }
        }
        any
    }

    /// Reads replies from the upstream into the `down` link. True if any arrived.
    fn receive_from_upstream(&mut self) -> bool {
        let mut any = false;
        for (&id, client) in &mut self.clients {
            for _ in 0..RECV_BATCH {
                let received = match sys::recv_stamped(&client.socket, &mut self.buf) {
                    Ok(received) => received,
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                    Err(err) => {
                        // Typically ECONNREFUSED: nothing listens upstream (yet).
                        trace!(client = %client.addr, error = %err, "recv from upstream");
                        continue;
                    }
                };
                any = true;
                let now = Instant::now();
                client.last_active = now;
                let len = received.len;
                let payload = (id, Box::from(&self.buf[..len]));
                let arrived = arrival(now, received.stamp, &mut self.last_arrival[1]);
                if let Verdict::Dropped(reason) = self.down.handle_datagram(arrived, len, payload) {
                    trace!(?reason, len, "down: dropped");
                }
            }
        }
        any
    }

    /// Sends every datagram due at `now`. True if any left.
    fn transmit(&mut self, now: Instant) -> bool {
        let mut any = false;
        while let Some(datagram) = self.up.poll_transmit(now) {
            any = true;
            let (id, bytes) = datagram.payload;
            let leaves = Instant::now();
            let sent = match self.clients.get(&id) {
                Some(client) => client.socket.send(&bytes),
                None => Err(io::ErrorKind::NotFound.into()),
            };
            self.io[0].sent(leaves, datagram.deliver_at, sent);
        }
        while let Some(datagram) = self.down.poll_transmit(now) {
            any = true;
            let (id, bytes) = datagram.payload;
            let leaves = Instant::now();
            let sent = match self.clients.get(&id) {
                Some(client) => self.listen.send_to(&bytes, client.addr),
                None => Err(io::ErrorKind::NotFound.into()),
            };
            self.io[1].sent(leaves, datagram.deliver_at, sent);
        }
        any
    }

    /// The client id for `addr`, opening its upstream socket on first sight.
    fn client(&mut self, addr: SocketAddr, now: Instant) -> Option<ClientId> {
        if let Some(&id) = self.client_ids.get(&addr) {
            if let Some(client) = self.clients.get_mut(&id) {
                client.last_active = now;
            }
            return Some(id);
        }
        if self.clients.len() >= MAX_CLIENTS {
            debug!(client = %addr, "too many clients; dropping");
            return None;
        }
        let socket = match self.upstream_socket() {
            Ok(socket) => socket,
            Err(err) => {
                warn!(client = %addr, error = %err, "cannot open a socket towards the upstream");
                return None;
            }
        };
        let id = self.next_client;
        self.next_client += 1;
        debug!(client = %addr, via = ?socket.local_addr().ok(), "new client");
        self.clients.insert(
            id,
            Client {
                addr,
                socket,
                last_active: now,
            },
        );
        self.client_ids.insert(addr, id);
        Some(id)
    }

    fn upstream_socket(&self) -> io::Result<UdpSocket> {
        let any: IpAddr = match self.upstream {
            SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
            SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
        };
        let socket = UdpSocket::bind((any, 0))?;
        socket.connect(self.upstream)?;
        socket.set_nonblocking(true)?;
        sys::enlarge_buffers(&socket, SOCKET_BUFFER);
        sys::stamp_arrivals(&socket);
        Ok(socket)
    }

    fn expire_clients(&mut self, now: Instant) {
        let client_ids = &mut self.client_ids;
        self.clients.retain(|_, client| {
            let keep = now - client.last_active < CLIENT_IDLE;
            if !keep {
                debug!(client = %client.addr, "client idle; closing its upstream socket");
                client_ids.remove(&client.addr);
            }
            keep
        });
    }

    fn stats(&self) -> RelayStats {
        RelayStats {
            up: self.io[0].with(self.up.stats()),
            down: self.io[1].with(self.down.stats()),
            clients: self.next_client,
        }
    }

    fn publish_stats(&self) {
        let stats = self.stats();
        *self
            .shared
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = stats;
    }
}
