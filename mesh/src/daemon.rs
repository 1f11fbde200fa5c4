//! The peer daemon (`gleam peer`): one QUIC endpoint, mDNS discovery, SWIM membership, link
//! probes, a Unix control socket, and CUDA sessions handed to the binary's handler.
//!
//! Ownership and data flow:
//!
//! * [`Daemon::run`] owns everything mutable in one actor loop (`Actor`): the [`Gossip`]
//!   instance, the [`MeshView`], the mesh connections, known addresses and our own state.
//! * Spawned tasks never touch that state; they send `Event`s to the loop:
//!   - the accept loop: every incoming connection is handshaken and authenticated
//!     ([`gleam_auth::proof`]); `gleam-mesh/1` ones become mesh links, `gleam-cuda/1` ones go to the
//!     [`SessionHandler`];
//!   - dial tasks (towards peers found by mDNS or given as seeds);
//!   - per-link readers: QUIC datagrams and uni streams carry foca packets, bidi streams carry
//!     bandwidth probes;
//!   - foca timers, probe results, mDNS events and control requests.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use foca::Timer;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::control::{BestPeer, MAX_LINE, PeerRow, Request, Response};
use crate::discovery::{Advertisement, Discovery, DiscoveryError, DiscoveryEvent};
use crate::gossip::{Gossip, Member, Output};
use crate::probe::{self, LossMeter, PROBE_BYTES, STREAM_PROBE};
use crate::select::{self, Candidate};
use crate::state::{
    CacheDigest, GpuSummary, LinkQuality, LinkReport, Load, MeshView, PROTOCOL_VERSION, PeerState,
};
use gleam_auth::identity::{Identity, MeshSecret, PeerId};
use gleam_auth::proof::{AuthError, authenticate_as_client, authenticate_as_server};
use gleam_auth::tls::{self, ALPN_CUDA, ALPN_MESH};

/// Serves one authenticated CUDA session (`gleam-cuda/1` connection) from `PeerId`. Called on the
/// daemon's runtime; it must return quickly (spawn the work).
pub type SessionHandler = Arc<dyn Fn(quinn::Connection, PeerId) + Send + Sync>;

/// What the daemon reports about the local GPU(s); the binary supplies it (the emu backend
/// reports an emulated device, the real backend queries the GPU).
pub trait DeviceInfo: Send + Sync + 'static {
    /// The GPUs served (empty: none).
    fn gpus(&self) -> Vec<GpuSummary>;

    /// Current load; sampled about once a second.
    fn load(&self) -> DeviceLoad {
        DeviceLoad::default()
    }

    /// What the local content cache holds.
    fn cache(&self) -> CacheDigest {
        CacheDigest::default()
    }
}

/// Load figures a [`DeviceInfo`] knows (sessions are counted by the daemon itself).
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceLoad {
    /// GPU utilization, 0.0 to 1.0.
    pub utilization: f32,
    /// Free device memory in bytes; `None` means all of it.
    pub free_memory: Option<u64>,
    /// Jobs waiting for the GPU.
    pub queue_len: u32,
}

/// How the daemon runs.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// UDP address of the QUIC endpoint (`[::]:4747` by default; port 0 picks one).
    pub listen: SocketAddr,
    /// The Unix control socket.
    pub control_socket: PathBuf,
    /// Advertise and browse with mDNS.
    pub mdns: bool,
    /// Restrict mDNS to these interfaces (empty: all).
    pub interfaces: Vec<String>,
    /// Peers to connect to without discovery.
    pub seeds: Vec<(PeerId, SocketAddr)>,
    /// Host name shown to others.
    pub host: String,
    /// How often each link's bandwidth is probed.
    pub probe_interval: Duration,
}

impl DaemonConfig {
    /// Defaults for a daemon whose control socket is `control_socket`.
    pub fn new(control_socket: PathBuf) -> Self {
        Self {
            listen: SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, DEFAULT_PORT)),
            control_socket,
            mdns: true,
            interfaces: Vec::new(),
            seeds: Vec::new(),
            host: host_name(),
            probe_interval: Duration::from_secs(10),
        }
    }
}

/// A bound, not yet running daemon (binding first surfaces port and socket errors early).
pub struct Daemon {
    config: DaemonConfig,
    identity: Arc<Identity>,
    secret: Arc<MeshSecret>,
    device: Arc<dyn DeviceInfo>,
    handler: SessionHandler,
    endpoint: quinn::Endpoint,
    control: UnixListener,
}

impl Daemon {
    /// Binds the QUIC endpoint and the control socket. Must be called inside a tokio runtime.
    pub fn bind(
        config: DaemonConfig,
        identity: Identity,
        secret: MeshSecret,
        device: Arc<dyn DeviceInfo>,
        handler: SessionHandler,
    ) -> Result<Self, DaemonError> {
        let server = tls::server_config(&identity)?;
        let endpoint = match tls::endpoint(config.listen, Some(server.clone())) {
            Ok(endpoint) => endpoint,
            // No IPv6 on this host: fall back to IPv4 on the same port.
            Err(_) if config.listen.ip().is_unspecified() && config.listen.is_ipv6() => {
                let v4 = SocketAddr::from(([0, 0, 0, 0], config.listen.port()));
                tls::endpoint(v4, Some(server))
                    .map_err(|source| DaemonError::Bind { addr: v4, source })?
            }
            Err(source) => {
                return Err(DaemonError::Bind {
                    addr: config.listen,
                    source,
                });
            }
        };
        let control = bind_control(&config.control_socket)?;
        Ok(Self {
            config,
            identity: Arc::new(identity),
            secret: Arc::new(secret),
            device,
            handler,
            endpoint,
            control,
        })
    }

    /// The QUIC endpoint's address.
    pub fn local_addr(&self) -> Result<SocketAddr, DaemonError> {
        self.endpoint.local_addr().map_err(DaemonError::Io)
    }

    /// This daemon's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.identity.peer_id()
    }

    /// Runs until `shutdown` completes, then leaves the mesh gracefully.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), DaemonError> {
        let me = self.identity.peer_id();
        let port = self.local_addr()?.port();
        let boot = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(1);
        let (events, inbox) = mpsc::unbounded_channel();
        let sessions = Arc::new(Sessions::default());

        let gpus = self.device.gpus();
        let discovery = match self.config.mdns {
            true => {
                let (tx, mut rx) = mpsc::unbounded_channel();
                let ad = Advertisement {
                    id: me,
                    port,
                    gpus: gpus.clone(),
                };
                let discovery = Discovery::start(&ad, &self.config.interfaces, tx)?;
                let forward = events.clone();
                tokio::spawn(async move {
                    while let Some(event) = rx.recv().await {
                        if forward.send(Event::Discovery(event)).is_err() {
                            return;
                        }
                    }
                });
                Some(discovery)
            }
            false => None,
        };

        tokio::spawn(accept_loop(
            self.endpoint.clone(),
            self.secret.clone(),
            events.clone(),
            self.handler.clone(),
            sessions.clone(),
        ));
        tokio::spawn(control_loop(self.control, events.clone()));

        let mut own = PeerState {
            id: me,
            boot,
            version: 0,
            protocol: PROTOCOL_VERSION,
            host: self.config.host.clone(),
            addrs: Vec::new(),
            gpus,
            load: Load::default(),
            cache: CacheDigest::default(),
            links: Vec::new(),
        };
        if !self.config.listen.ip().is_unspecified() {
            own.addrs
                .push(SocketAddr::new(self.config.listen.ip(), port));
        }
        let mut actor = Actor {
            me,
            identity: self.identity,
            secret: self.secret,
            endpoint: self.endpoint,
            gossip: Gossip::new(
                Member { id: me, boot },
                boot ^ u64::from_le_bytes(seed_bytes(me)),
            ),
            view: MeshView::default(),
            links: HashMap::new(),
            known: HashMap::new(),
            dialing: HashSet::new(),
            events,
            device: self.device,
            sessions,
            own,
            probe_interval: self.config.probe_interval,
            last_publish: None,
        };
        for (id, addr) in &self.config.seeds {
            actor.learn_addrs(*id, vec![*addr]);
        }
        // Real load and cache figures from the first answer on, not the placeholders above.
        actor.refresh_own_state();
        info!(peer = %me, %port, "gleam peer running");
        actor.run(inbox, shutdown).await;
        if let Some(discovery) = discovery {
            // mdns-sd blocks briefly while sending goodbyes.
            let _ = tokio::task::spawn_blocking(move || discovery.shutdown()).await;
        }
        let _ = std::fs::remove_file(&self.config.control_socket);
        Ok(())
    }
}

/// The daemon could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DaemonError {
    /// The QUIC port is taken or not allowed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// Another daemon answers on the control socket.
    #[error("a Gleam daemon is already running (control socket {0})")]
    AlreadyRunning(PathBuf),
    /// The control socket could not be created.
    #[error("control socket {path}: {source}")]
    Control {
        path: PathBuf,
        source: std::io::Error,
    },
    /// mDNS could not start.
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    /// Other I/O.
    #[error(transparent)]
    Io(std::io::Error),
    /// The TLS configuration could not be built.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
}

/// Messages to the actor loop.
enum Event {
    Closed {
        peer: PeerId,
        stable_id: usize,
    },
    Control(Request, oneshot::Sender<Response>),
    DialDone {
        peer: PeerId,
        refused: bool,
    },
    Discovery(DiscoveryEvent),
    MeshLink {
        peer: PeerId,
        conn: quinn::Connection,
        dialer: PeerId,
    },
    Packet {
        peer: PeerId,
        data: Bytes,
    },
    Probed {
        peer: PeerId,
        stable_id: usize,
        bps: Option<u64>,
    },
    Timer(Timer<Member>),
}

/// Counts CUDA sessions and their mean duration.
#[derive(Debug, Default)]
struct Sessions {
    active: AtomicU32,
    done: AtomicU64,
    mean_secs: Mutex<f32>,
}

impl Sessions {
    fn finished(&self, duration: Duration) {
        self.active.fetch_sub(1, Ordering::Relaxed);
        let n = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        let mut mean = self
            .mean_secs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Running mean over the first 20 sessions, then an exponential average.
        let weight = 1.0 / (n.min(20) as f32);
        *mean += (duration.as_secs_f32() - *mean) * weight;
    }
}

struct Link {
    conn: quinn::Connection,
    dialer: PeerId,
    meter: LossMeter,
    quality: LinkQuality,
    probing: bool,
    last_probe: Option<Instant>,
    connected: Instant,
}

#[derive(Default)]
struct Known {
    addrs: Vec<SocketAddr>,
    next_dial: Option<Instant>,
    failures: u32,
}

struct Actor {
    me: PeerId,
    identity: Arc<Identity>,
    secret: Arc<MeshSecret>,
    endpoint: quinn::Endpoint,
    gossip: Gossip,
    view: MeshView,
    links: HashMap<PeerId, Link>,
    known: HashMap<PeerId, Known>,
    dialing: HashSet<PeerId>,
    events: mpsc::UnboundedSender<Event>,
    device: Arc<dyn DeviceInfo>,
    sessions: Arc<Sessions>,
    own: PeerState,
    probe_interval: Duration,
    last_publish: Option<Instant>,
}

impl Actor {
    async fn run(
        &mut self,
        mut inbox: mpsc::UnboundedReceiver<Event>,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some(event) = inbox.recv() => self.handle(event),
                _ = tick.tick() => self.tick(),
            }
            self.drain_gossip();
        }
        info!("leaving the mesh");
        if let Err(err) = self.gossip.leave() {
            debug!(%err, "leave");
        }
        self.drain_gossip();
        // Give the leave packets a moment to go out before closing.
        tokio::time::sleep(Duration::from_millis(100)).await;
        for link in self.links.values() {
            link.conn.close(CLOSE_SHUTDOWN, b"peer shutting down");
        }
        self.endpoint.close(CLOSE_SHUTDOWN, b"peer shutting down");
        let _ = tokio::time::timeout(Duration::from_secs(1), self.endpoint.wait_idle()).await;
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Closed { peer, stable_id } => {
                if self
                    .links
                    .get(&peer)
                    .is_some_and(|link| link.conn.stable_id() == stable_id)
                {
                    debug!(%peer, "mesh link closed");
                    self.links.remove(&peer);
                }
            }
            Event::Control(request, reply) => {
                let _ = reply.send(self.answer(request));
            }
            Event::DialDone { peer, refused } => {
                self.dialing.remove(&peer);
                if !self.links.contains_key(&peer)
                    && let Some(known) = self.known.get_mut(&peer)
                {
                    known.failures += 1;
                    // A peer of another mesh will refuse us again: retry rarely (it may join).
                    let backoff = match refused {
                        true => REFUSED_BACKOFF,
                        false => DIAL_BACKOFF * 2u32.pow(known.failures.min(3)),
                    };
                    known.next_dial = Some(Instant::now() + backoff);
                }
            }
            Event::Discovery(DiscoveryEvent::Found {
                id,
                addrs,
                protocol,
            }) => {
                if id == self.me {
                    // Our own advertisement tells us our addresses as others see them (loopback
                    // is of no use to them).
                    let addrs: Vec<SocketAddr> = addrs
                        .into_iter()
                        .filter(|addr| !addr.ip().is_loopback())
                        .collect();
                    if self.own.addrs != addrs {
                        self.own.addrs = addrs;
                        self.own.version += 1;
                    }
                } else if protocol != PROTOCOL_VERSION {
                    debug!(peer = %id, protocol, "ignoring a peer with another protocol version");
                } else {
                    self.learn_addrs(id, addrs);
                }
            }
            Event::Discovery(DiscoveryEvent::Lost { id }) => {
                debug!(peer = %id, "mDNS: peer withdrew");
                self.known.remove(&id);
            }
            Event::MeshLink { peer, conn, dialer } => self.add_link(peer, conn, dialer),
            Event::Packet { peer, data } => {
                if let Err(err) = self.gossip.handle_data_from(peer, &data) {
                    debug!(%err, "dropping a gossip packet");
                }
            }
            Event::Probed {
                peer,
                stable_id,
                bps,
            } => {
                if let Some(link) = self.links.get_mut(&peer)
                    && link.conn.stable_id() == stable_id
                {
                    link.probing = false;
                    link.last_probe = Some(Instant::now());
                    if let Some(bps) = bps {
                        link.quality.bandwidth_bps = bps;
                    }
                }
            }
            Event::Timer(timer) => {
                if let Err(err) = self.gossip.handle_timer(timer) {
                    debug!(%err, "gossip timer");
                }
            }
        }
    }

    fn tick(&mut self) {
        let now = Instant::now();
        self.refresh_own_state();
        let due = self
            .last_publish
            .is_none_or(|last| now.duration_since(last) >= PUBLISH_EVERY);
        if due {
            self.last_publish = Some(now);
            if let Err(err) = self.gossip.publish(&self.own) {
                warn!(%err, "cannot publish our state");
            }
        }
        for peer in self.view.expire(now) {
            debug!(%peer, "peer state went stale");
        }
        // (Re)dial peers we know an address of but have no link to.
        let to_dial: Vec<PeerId> = self
            .known
            .iter()
            .filter(|(id, known)| {
                !self.links.contains_key(id)
                    && !self.dialing.contains(id)
                    && known.next_dial.is_none_or(|at| now >= at)
            })
            .map(|(id, _)| *id)
            .collect();
        for peer in to_dial {
            self.dial(peer);
        }
        self.start_probes(now);
    }

    fn refresh_own_state(&mut self) {
        let load = self.device.load();
        let total = self.own.total_memory();
        let mut state = self.own.clone();
        state.load = Load {
            utilization: load.utilization,
            free_memory: load.free_memory.unwrap_or(total),
            active_sessions: self.sessions.active.load(Ordering::Relaxed),
            queue_len: load.queue_len,
            mean_job_secs: *self
                .sessions
                .mean_secs
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        };
        state.cache = self.device.cache();
        state.links = self
            .links
            .iter_mut()
            .map(|(peer, link)| {
                let measured =
                    probe::link_quality(&link.conn, &mut link.meter, link.quality.bandwidth_bps);
                link.quality = measured;
                // Publish RTT coarsely (100 us steps) so jitter does not bump the version each tick.
                let mut quality = measured;
                quality.rtt_us = quality.rtt_us.div_ceil(100) * 100;
                quality.loss = (quality.loss * 100.0).round() / 100.0;
                LinkReport {
                    peer: *peer,
                    quality,
                }
            })
            .collect();
        state.links.sort_by_key(|link| link.peer);
        state.truncate_to_limits();
        if state != self.own {
            state.version = self.own.version + 1;
            self.own = state;
            self.last_publish = None;
        }
    }

    fn learn_addrs(&mut self, peer: PeerId, addrs: Vec<SocketAddr>) {
        let known = self.known.entry(peer).or_default();
        if known.addrs != addrs {
            known.addrs = addrs;
            known.next_dial = None;
            known.failures = 0;
        }
        if !self.links.contains_key(&peer) && !self.dialing.contains(&peer) {
            let ready = known.next_dial.is_none_or(|at| Instant::now() >= at);
            if ready {
                self.dial(peer);
            }
        }
    }

    fn dial(&mut self, peer: PeerId) {
        let Some(known) = self.known.get_mut(&peer) else {
            return;
        };
        if known.addrs.is_empty() {
            return;
        }
        let addrs = known.addrs.clone();
        // Pace retries even when the dial task never reports (it always does, but be safe).
        known.next_dial = Some(Instant::now() + DIAL_BACKOFF);
        self.dialing.insert(peer);
        let config = match tls::client_config(&self.identity, peer, ALPN_MESH) {
            Ok(config) => config,
            Err(err) => {
                warn!(%err, "cannot build a client config");
                return;
            }
        };
        let endpoint = self.endpoint.clone();
        let secret = self.secret.clone();
        let events = self.events.clone();
        let me = self.me;
        tokio::spawn(async move {
            let mut refused = false;
            for addr in addrs {
                match connect(&endpoint, config.clone(), addr, peer, &secret).await {
                    Ok(conn) => {
                        let _ = events.send(Event::MeshLink {
                            peer,
                            conn,
                            dialer: me,
                        });
                        break;
                    }
                    Err(DialError::Refused(err)) => {
                        warn!(%peer, %addr, %err, "cannot join this peer");
                        refused = true;
                        break;
                    }
                    Err(DialError::Other(err)) => debug!(%peer, %addr, %err, "dial failed"),
                }
            }
            let _ = events.send(Event::DialDone { peer, refused });
        });
    }

    fn add_link(&mut self, peer: PeerId, conn: quinn::Connection, dialer: PeerId) {
        if peer == self.me {
            conn.close(CLOSE_DUPLICATE, b"connected to itself");
            return;
        }
        if let Some(existing) = self.links.get(&peer)
            && existing.conn.close_reason().is_none()
        {
            // Both sides dialed at once: both keep the link dialed by the smaller id. Otherwise
            // the newer link wins: the old one may be dead (the peer restarted) but not yet timed
            // out.
            let preferred = self.me.min(peer);
            let race = existing.connected.elapsed() < DIAL_RACE_WINDOW;
            if race && existing.dialer == preferred && dialer != preferred {
                conn.close(CLOSE_DUPLICATE, b"duplicate mesh link");
                return;
            }
            existing.conn.close(CLOSE_DUPLICATE, b"duplicate mesh link");
        }
        debug!(%peer, remote = %conn.remote_address(), "mesh link up");
        if let Some(known) = self.known.get_mut(&peer) {
            known.failures = 0;
        }
        spawn_link_readers(conn.clone(), peer, self.events.clone());
        self.links.insert(
            peer,
            Link {
                conn,
                dialer,
                meter: LossMeter::default(),
                quality: LinkQuality::default(),
                probing: false,
                last_probe: None,
                connected: Instant::now(),
            },
        );
        if let Err(err) = self.gossip.announce(peer) {
            debug!(%err, "announce");
        }
        self.last_publish = None;
    }

    fn start_probes(&mut self, now: Instant) {
        // Do not disturb running work: no probes while we serve sessions.
        if self.sessions.active.load(Ordering::Relaxed) > 0 {
            return;
        }
        for (peer, link) in &mut self.links {
            let due = match link.last_probe {
                None => now.duration_since(link.connected) >= FIRST_PROBE_AFTER,
                Some(last) => now.duration_since(last) >= self.probe_interval,
            };
            if link.probing || !due {
                continue;
            }
            link.probing = true;
            let conn = link.conn.clone();
            let events = self.events.clone();
            let peer = *peer;
            tokio::spawn(async move {
                let result = tokio::time::timeout(
                    PROBE_TIMEOUT,
                    probe::measure_bandwidth(&conn, PROBE_BYTES),
                )
                .await;
                let bps = match result {
                    Ok(Ok(bps)) => Some(bps),
                    Ok(Err(err)) => {
                        debug!(%peer, %err, "probe failed");
                        None
                    }
                    Err(_) => {
                        debug!(%peer, "probe timed out");
                        None
                    }
                };
                let _ = events.send(Event::Probed {
                    peer,
                    stable_id: conn.stable_id(),
                    bps,
                });
            });
        }
    }

    fn drain_gossip(&mut self) {
        while let Some(output) = self.gossip.poll() {
            match output {
                Output::Send(peer, data) => self.send_packet(peer, data),
                Output::Schedule(after, timer) => {
                    let events = self.events.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(after).await;
                        let _ = events.send(Event::Timer(timer));
                    });
                }
                Output::Up(member) => info!(peer = %member.id, "peer joined"),
                Output::Down(member) => {
                    info!(peer = %member.id, "peer left or failed");
                    self.view.remove(&member.id);
                }
                Output::State(state) => {
                    if state.id != self.me && self.gossip.is_active(&state.id) {
                        self.view.apply(state, Instant::now());
                    }
                }
            }
        }
    }

    fn send_packet(&mut self, peer: PeerId, data: Bytes) {
        let Some(link) = self.links.get(&peer) else {
            // No link yet: the packet is lost (SWIM copes); make sure we dial.
            if self.known.contains_key(&peer) && !self.dialing.contains(&peer) {
                self.dial(peer);
            }
            return;
        };
        let mut framed = Vec::with_capacity(data.len() + 1);
        framed.push(TAG_GOSSIP);
        framed.extend_from_slice(&data);
        let fits = link
            .conn
            .max_datagram_size()
            .is_some_and(|max| framed.len() <= max);
        if fits && link.conn.send_datagram(Bytes::from(framed.clone())).is_ok() {
            return;
        }
        // Too large for a datagram on this path: a uni stream carries it.
        let conn = link.conn.clone();
        tokio::spawn(async move {
            if let Ok(mut send) = conn.open_uni().await {
                let _ = send.write_all(&framed).await;
                let _ = send.finish();
            }
        });
    }

    fn answer(&mut self, request: Request) -> Response {
        match request {
            Request::List => Response::Peers { peers: self.rows() },
            Request::Best { hint } => {
                let candidates: Vec<Candidate> = self
                    .view
                    .states()
                    .filter(|state| self.gossip.is_active(&state.id))
                    .map(|state| {
                        let link = self.links.get(&state.id);
                        Candidate {
                            id: state.id,
                            has_gpu: !state.gpus.is_empty(),
                            emulated: state.gpus.iter().all(|gpu| gpu.emulated),
                            rtt: link.map(|link| link.conn.rtt()),
                            bandwidth_bps: link
                                .map(|link| link.quality.bandwidth_bps)
                                .filter(|bps| *bps > 0),
                            loss: link.map_or(0.0, |link| f64::from(link.quality.loss)),
                            utilization: f64::from(state.load.utilization),
                            free_memory: state.load.free_memory,
                            queue_len: state.load.queue_len,
                            mean_job_secs: f64::from(state.load.mean_job_secs),
                        }
                    })
                    .chain(self.own_candidate())
                    .collect();
                let best = select::choose(&candidates, &hint).map(|choice| {
                    let mut addrs: Vec<SocketAddr> = if choice.id == self.own.id {
                        self.own_loopback_addr().into_iter().collect()
                    } else {
                        self.links
                            .get(&choice.id)
                            .map(|link| canonical(link.conn.remote_address()))
                            .into_iter()
                            .collect()
                    };
                    if let Some(state) = self.view.state(&choice.id) {
                        for addr in &state.addrs {
                            if !addrs.contains(addr) {
                                addrs.push(*addr);
                            }
                        }
                    }
                    BestPeer {
                        id: choice.id,
                        addrs,
                        expected_secs: choice.expected.as_secs_f64(),
                    }
                });
                Response::Best { best }
            }
            #[allow(unreachable_patterns)]
            _ => Response::Error {
                message: "unsupported request".into(),
            },
        }
    }

    /// This device as a place to run a job: over loopback, so transfers are cheap and the RTT is tiny
    /// (a GPU on this very device is usually the best choice unless it is busy).
    fn own_candidate(&self) -> Option<Candidate> {
        self.own_loopback_addr()?;
        Some(Candidate {
            id: self.own.id,
            has_gpu: !self.own.gpus.is_empty(),
            emulated: self.own.gpus.iter().all(|gpu| gpu.emulated),
            rtt: Some(LOOPBACK_RTT),
            bandwidth_bps: Some(LOOPBACK_BPS),
            loss: 0.0,
            utilization: f64::from(self.own.load.utilization),
            free_memory: self.own.load.free_memory,
            queue_len: self.own.load.queue_len,
            mean_job_secs: f64::from(self.own.load.mean_job_secs),
        })
    }

    /// Where a client on this device reaches this daemon's endpoint.
    fn own_loopback_addr(&self) -> Option<SocketAddr> {
        let local = self.endpoint.local_addr().ok()?;
        let ip: std::net::IpAddr = match local.ip() {
            // Unspecified (`[::]` is dual-stack, `0.0.0.0` v4): loopback v4 reaches both.
            ip if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
            ip => ip,
        };
        Some(canonical(SocketAddr::new(ip, local.port())))
    }

    fn rows(&self) -> Vec<PeerRow> {
        let row = |state: &PeerState, is_self: bool| {
            let link = self.links.get(&state.id).filter(|_| !is_self);
            PeerRow {
                id: state.id,
                is_self,
                host: state.host.clone(),
                gpus: state.gpus.clone(),
                free_memory: state.load.free_memory,
                total_memory: state.total_memory(),
                utilization: state.load.utilization,
                active_sessions: state.load.active_sessions,
                queue_len: state.load.queue_len,
                rtt_us: link
                    .map(|link| u32::try_from(link.conn.rtt().as_micros()).unwrap_or(u32::MAX)),
                bandwidth_bps: link
                    .map(|link| link.quality.bandwidth_bps)
                    .filter(|bps| *bps > 0),
                loss: link.map_or(0.0, |link| link.quality.loss),
                cache: state.cache.clone(),
                addrs: state.addrs.clone(),
            }
        };
        let mut rows = vec![row(&self.own, true)];
        rows.extend(
            self.view
                .states()
                .filter(|state| self.gossip.is_active(&state.id))
                .map(|state| row(state, false)),
        );
        rows
    }
}

enum DialError {
    /// The peer is not in our mesh (or we are not in its mesh).
    Refused(AuthError),
    Other(String),
}

async fn connect(
    endpoint: &quinn::Endpoint,
    config: quinn::ClientConfig,
    addr: SocketAddr,
    peer: PeerId,
    secret: &MeshSecret,
) -> Result<quinn::Connection, DialError> {
    let connecting = endpoint
        .connect_with(config, addr, &tls::server_name(peer))
        .map_err(|err| DialError::Other(err.to_string()))?;
    let conn = tokio::time::timeout(HANDSHAKE_TIMEOUT, connecting)
        .await
        .map_err(|_| DialError::Other("handshake timed out".to_owned()))?
        .map_err(|err| DialError::Other(err.to_string()))?;
    match authenticate_as_client(&conn, secret).await {
        Ok(_) => Ok(conn),
        Err(err @ (AuthError::Refused { .. } | AuthError::SecretMismatch { .. })) => {
            Err(DialError::Refused(err))
        }
        Err(err) => Err(DialError::Other(err.to_string())),
    }
}

async fn accept_loop(
    endpoint: quinn::Endpoint,
    secret: Arc<MeshSecret>,
    events: mpsc::UnboundedSender<Event>,
    handler: SessionHandler,
    sessions: Arc<Sessions>,
) {
    while let Some(incoming) = endpoint.accept().await {
        let secret = secret.clone();
        let events = events.clone();
        let handler = handler.clone();
        let sessions = sessions.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            let conn = match tokio::time::timeout(HANDSHAKE_TIMEOUT, incoming).await {
                Ok(Ok(conn)) => conn,
                Ok(Err(err)) => {
                    info!(%remote, %err, "handshake failed");
                    return;
                }
                Err(_) => {
                    info!(%remote, "handshake timed out");
                    return;
                }
            };
            let alpn = alpn_of(&conn);
            // auth logs refusals with the reason.
            let Ok(peer) = authenticate_as_server(&conn, &secret).await else {
                return;
            };
            match alpn.as_deref() {
                Some(ALPN_MESH) => {
                    let _ = events.send(Event::MeshLink {
                        peer,
                        conn,
                        dialer: peer,
                    });
                }
                Some(ALPN_CUDA) => {
                    info!(%peer, %remote, "CUDA session starts");
                    sessions.active.fetch_add(1, Ordering::Relaxed);
                    let started = Instant::now();
                    let watched = conn.clone();
                    tokio::spawn(async move {
                        let reason = watched.closed().await;
                        info!(%peer, %reason, "CUDA session ended");
                        sessions.finished(started.elapsed());
                    });
                    handler(conn, peer);
                }
                _ => conn.close(CLOSE_PROTOCOL, b"unknown ALPN"),
            }
        });
    }
}

fn alpn_of(conn: &quinn::Connection) -> Option<Vec<u8>> {
    conn.handshake_data()?
        .downcast::<quinn::crypto::rustls::HandshakeData>()
        .ok()?
        .protocol
}

/// Reads gossip datagrams and streams, and answers probes, until the link closes.
fn spawn_link_readers(conn: quinn::Connection, peer: PeerId, events: mpsc::UnboundedSender<Event>) {
    let datagrams = conn.clone();
    let tx = events.clone();
    tokio::spawn(async move {
        while let Ok(datagram) = datagrams.read_datagram().await {
            if datagram.first() == Some(&TAG_GOSSIP)
                && tx
                    .send(Event::Packet {
                        peer,
                        data: datagram.slice(1..),
                    })
                    .is_err()
            {
                return;
            }
        }
        let _ = tx.send(Event::Closed {
            peer,
            stable_id: datagrams.stable_id(),
        });
    });
    let streams = conn.clone();
    let tx = events;
    tokio::spawn(async move {
        while let Ok(mut recv) = streams.accept_uni().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                if let Ok(data) = recv.read_to_end(MAX_GOSSIP_STREAM).await
                    && data.first() == Some(&TAG_GOSSIP)
                {
                    let _ = tx.send(Event::Packet {
                        peer,
                        data: Bytes::from(data).slice(1..),
                    });
                }
            });
        }
    });
    tokio::spawn(async move {
        while let Ok((send, mut recv)) = conn.accept_bi().await {
            tokio::spawn(async move {
                let mut kind = [0u8; 1];
                if recv.read_exact(&mut kind).await.is_ok()
                    && kind[0] == STREAM_PROBE
                    && let Err(err) = probe::serve_probe(send, recv).await
                {
                    debug!(%peer, %err, "serving a probe");
                }
            });
        }
    });
}

fn bind_control(path: &std::path::Path) -> Result<UnixListener, DaemonError> {
    let control_err = |source| DaemonError::Control {
        path: path.to_owned(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(control_err)?;
    }
    if path.exists() {
        // A live daemon answers; a stale socket from a crash does not.
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(DaemonError::AlreadyRunning(path.to_owned()));
        }
        std::fs::remove_file(path).map_err(control_err)?;
    }
    let listener = UnixListener::bind(path).map_err(control_err)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(control_err)?;
    Ok(listener)
}

async fn control_loop(listener: UnixListener, events: mpsc::UnboundedSender<Event>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let events = events.clone();
        tokio::spawn(async move {
            if let Err(err) = serve_control(stream, events).await {
                debug!(%err, "control request");
            }
        });
    }
}

async fn serve_control(
    stream: UnixStream,
    events: mpsc::UnboundedSender<Event>,
) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = tokio::io::BufReader::new(read.take(MAX_LINE));
    let mut line = String::new();
    tokio::time::timeout(CONTROL_TIMEOUT, reader.read_line(&mut line))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    let response = match serde_json::from_str::<Request>(&line) {
        Ok(request) => {
            let (tx, rx) = oneshot::channel();
            if events.send(Event::Control(request, tx)).is_err() {
                return Ok(());
            }
            rx.await.unwrap_or(Response::Error {
                message: "daemon shutting down".into(),
            })
        }
        Err(err) => Response::Error {
            message: format!("bad request: {err}"),
        },
    };
    let mut out = serde_json::to_vec(&response).map_err(std::io::Error::other)?;
    out.push(b'\n');
    write.write_all(&out).await?;
    write.shutdown().await
}

/// IPv4 peers reach a dual-stack socket as IPv4-mapped IPv6 addresses; show them as IPv4.
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

fn seed_bytes(id: PeerId) -> [u8; 8] {
    let mut seed = [0; 8];
    seed.copy_from_slice(&id.as_bytes()[..8]);
    seed
}

/// The default QUIC port of `gleam peer`.
pub const DEFAULT_PORT: u16 = 4747;

const CLOSE_DUPLICATE: quinn::VarInt = quinn::VarInt::from_u32(0x4741_0002);
const CLOSE_PROTOCOL: quinn::VarInt = quinn::VarInt::from_u32(0x4741_0003);
const CLOSE_SHUTDOWN: quinn::VarInt = quinn::VarInt::from_u32(0x4741_0000);
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);
const REFUSED_BACKOFF: Duration = Duration::from_secs(30);
const DIAL_RACE_WINDOW: Duration = Duration::from_secs(2);
const DIAL_BACKOFF: Duration = Duration::from_millis(500);
const FIRST_PROBE_AFTER: Duration = Duration::from_millis(300);
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);
const MAX_GOSSIP_STREAM: usize = 64 * 1024;
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
const PUBLISH_EVERY: Duration = Duration::from_secs(1);
const TAG_GOSSIP: u8 = 1;
const TICK: Duration = Duration::from_millis(250);

/// Round trip to this device's own endpoint, as the policy sees it (loopback QUIC: tens of µs).
const LOOPBACK_RTT: Duration = Duration::from_micros(100);
/// Copy throughput to this device's own endpoint (loopback QUIC measured ~4 Gbit/s on an H200 host).
const LOOPBACK_BPS: u64 = 4_000_000_000;
