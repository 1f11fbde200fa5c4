//! The peer daemon (`gleam peer`): one QUIC endpoint, mDNS discovery, SWIM membership, link
//! probes, a Unix control socket, and CUDA sessions handed to the binary's handler.
//!
//! Ownership and data flow:
//!
//! * [`Daemon::run`] owns everything mutable in one actor loop (`Actor`): the [`Gossip`]
//!   instance, the [`MeshView`], the mesh links, the [`AddrBook`] and our own state.
//! * Spawned tasks never touch that state; they send `Event`s to the loop:
//!   - the accept loop: every incoming connection is handshaken and authenticated
//!     ([`gleam_auth::proof`]); `gleam-mesh/1` ones become mesh links, `gleam-cuda/1` ones go to the
//!     [`SessionHandler`];
//!   - dial tasks (towards peers found by mDNS, seeds or gossip), which try every address of a peer
//!     ([`gleam_auth::dial`]);
//!   - per-link readers: QUIC datagrams and uni streams carry foca packets and link messages
//!     ([`LinkMessage`]), bidi streams carry bandwidth probes and liveness echoes;
//!   - foca timers, probe results, mDNS events and control requests.
//!
//! Links: the first link from a peer is used at once. A second link from a linked peer waits for its
//! hello, which names the daemon run behind it: the same run (a reconnection or a dial race), a
//! restart (the old link no longer answers), or a second device with the same identity, which the
//! [`duplicate`](crate::duplicate) rules settle.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use foca::Timer;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, error, info, warn};

use crate::addrs::{AddrBook, DialOutcome, RefusalLog};
use crate::control::{BestPeer, MAX_LINE, PeerRow, Request, Response};
use crate::discovery::{Advertisement, Discovery, DiscoveryError, DiscoveryEvent};
use crate::duplicate::{self, CLOSE_DUPLICATE_ID, LinkMessage, Run, TAG_LINK, Verdict};
use crate::gossip::{Gossip, Member, Output};
use crate::probe::{self, LossMeter, ProbeReport, Prober, STREAM_PROBE};
use crate::select::{self, Candidate};
use crate::state::{
    CacheDigest, GpuSummary, LinkQuality, LinkReport, Load, MeshView, PROTOCOL_VERSION, PeerState,
};
use gleam_auth::Chain;
use gleam_auth::dial::{self, Pace};
use gleam_auth::identity::{Identity, MeshSecret, PeerId};
use gleam_auth::proof::{AuthError, authenticate_as_client, authenticate_as_server};
use gleam_auth::target::{PeerAddr, display_addr};
use gleam_auth::tls::{self, ALPN_CUDA, ALPN_MESH};

pub use gleam_auth::target::DEFAULT_PORT;

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
    /// Its permission bits (0600 by default: only this user; the system service uses 0660 so the
    /// `gleam` group may ask it too).
    pub control_socket_mode: u32,
    /// Advertise and browse with mDNS.
    pub mdns: bool,
    /// Restrict mDNS (and the addresses this device advertises) to these interfaces (empty: all).
    pub interfaces: Vec<String>,
    /// Peers to connect to without discovery.
    pub seeds: Vec<PeerAddr>,
    /// Host name shown to others.
    pub host: String,
    /// How often each link's bandwidth is probed at most (slow links less often: probes never take
    /// more than [`probe::SHARE_PERCENT`] % of a link).
    pub probe_interval: Duration,
}

impl DaemonConfig {
    /// Defaults for a daemon whose control socket is `control_socket`.
    pub fn new(control_socket: PathBuf) -> Self {
        Self {
            listen: SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, DEFAULT_PORT)),
            control_socket,
            control_socket_mode: 0o600,
            mdns: true,
            interfaces: Vec::new(),
            seeds: Vec::new(),
            host: host_name(),
            probe_interval: Duration::from_secs(1),
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

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The handler and the device are closures and trait objects: not shown.
        f.debug_struct("Daemon")
            .field("peer_id", &self.identity.peer_id())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
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
        let control = bind_control(&config.control_socket, config.control_socket_mode)?;
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
        let local = self.local_addr()?;
        let boot = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(1);
        let (events, inbox) = mpsc::unbounded_channel();
        let sessions = Arc::new(Sessions::default());
        let refusals = Arc::new(RefusalLog::default());

        let gpus = self.device.gpus();
        let discovery = match self.config.mdns {
            true => {
                let (tx, mut rx) = mpsc::unbounded_channel();
                let ad = Advertisement {
                    id: me,
                    port: local.port(),
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
            refusals.clone(),
        ));
        tokio::spawn(control_loop(self.control, events.clone(), sessions.clone()));

        let own = PeerState {
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
        let mut actor = Actor {
            me,
            run: Run::new(boot),
            identity: self.identity,
            secret: self.secret,
            endpoint: self.endpoint,
            local,
            interfaces: self.config.interfaces.clone(),
            gossip: Gossip::new(
                Member { id: me, boot },
                boot ^ u64::from_le_bytes(seed_bytes(me)),
            ),
            view: MeshView::default(),
            links: HashMap::new(),
            pending: HashMap::new(),
            book: AddrBook::default(),
            dialing: HashSet::new(),
            events,
            device: self.device,
            sessions,
            refusals,
            own,
            local_ips: Vec::new(),
            probe_interval: self.config.probe_interval,
            last_publish: None,
            last_addr_check: None,
            warnings: Vec::new(),
            traffic: HashMap::new(),
        };
        for seed in &self.config.seeds {
            actor.book.learn_seed(seed.id, seed.addrs.clone());
        }
        // Real load, cache and address figures from the first answer on, not placeholders.
        actor.refresh_addrs(Instant::now());
        actor.refresh_own_state();
        info!(peer = %me, port = local.port(), "gleam peer running");
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
    #[error(
        "cannot listen on {addr} (another `gleam peer` or program on that UDP port? --listen picks another)"
    )]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// Another daemon answers on the control socket.
    #[error("a Gleam daemon is already running (control socket {})", .0.display())]
    AlreadyRunning(PathBuf),
    /// The control socket could not be created.
    #[error("cannot create the control socket {}", path.display())]
    Control {
        path: PathBuf,
        source: std::io::Error,
    },
    /// mDNS could not start.
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    /// Other I/O.
    #[error("I/O error")]
    Io(#[source] std::io::Error),
    /// The TLS configuration could not be built.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
}

/// Messages to the actor loop.
enum Event {
    Checked {
        pending: usize,
        answers: bool,
    },
    Closed {
        peer: PeerId,
        stable_id: usize,
        /// The other side closed it as a duplicate identity, with this reason.
        duplicate: Option<String>,
    },
    Control(Request, oneshot::Sender<Response>),
    DialDone {
        peer: PeerId,
        outcome: DialOutcome,
    },
    Discovery(DiscoveryEvent),
    LinkMessage {
        peer: PeerId,
        stable_id: usize,
        message: LinkMessage,
    },
    MeshLink {
        peer: PeerId,
        conn: quinn::Connection,
        dialer: PeerId,
    },
    Packet {
        peer: PeerId,
        stable_id: usize,
        data: Bytes,
    },
    Probed {
        peer: PeerId,
        stable_id: usize,
        report: Option<ProbeReport>,
        cost: Duration,
    },
    Timer(Timer<Member>),
}

/// Counts CUDA sessions and their mean duration, and keeps their connections so the traffic they
/// carry can be read.
#[derive(Debug, Default)]
struct Sessions {
    active: AtomicU32,
    done: AtomicU64,
    mean_secs: Mutex<f32>,
    conns: Mutex<Vec<(PeerId, quinn::Connection)>>,
}

impl Sessions {
    fn started(&self, peer: PeerId, conn: &quinn::Connection) {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((peer, conn.clone()));
    }

    /// A program of this device runs on its GPU directly: counted, with no connection to read.
    fn started_local(&self) {
        self.active.fetch_add(1, Ordering::Relaxed);
    }

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

    /// The open session connections (closed ones are dropped).
    fn open(&self) -> Vec<(PeerId, quinn::Connection)> {
        let mut conns = self.conns.lock().unwrap_or_else(PoisonError::into_inner);
        conns.retain(|(_, conn)| conn.close_reason().is_none());
        conns.clone()
    }
}

struct Link {
    conn: quinn::Connection,
    dialer: PeerId,
    run: Option<Run>,
    meter: LossMeter,
    quality: LinkQuality,
    prober: Prober,
    connected: Instant,
    last_announce: Option<Instant>,
}

/// A second link from a linked peer, held until its hello (and maybe a liveness check of the first)
/// says what it is.
struct Pending {
    peer: PeerId,
    conn: quinn::Connection,
    dialer: PeerId,
    run: Option<Run>,
    since: Instant,
    checking: bool,
}

struct Actor {
    me: PeerId,
    run: Run,
    identity: Arc<Identity>,
    secret: Arc<MeshSecret>,
    endpoint: quinn::Endpoint,
    local: SocketAddr,
    interfaces: Vec<String>,
    gossip: Gossip,
    view: MeshView,
    links: HashMap<PeerId, Link>,
    pending: HashMap<usize, Pending>,
    book: AddrBook,
    dialing: HashSet<PeerId>,
    events: mpsc::UnboundedSender<Event>,
    device: Arc<dyn DeviceInfo>,
    sessions: Arc<Sessions>,
    refusals: Arc<RefusalLog>,
    own: PeerState,
    local_ips: Vec<IpAddr>,
    probe_interval: Duration,
    last_publish: Option<Instant>,
    last_addr_check: Option<Instant>,
    /// Problems shown on this device's row of `gleam peers list`, with when they last happened.
    warnings: Vec<(String, Instant)>,
    /// Bytes seen on each served session connection at the last tick (by stable id).
    traffic: HashMap<usize, (Instant, u64)>,
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
            debug!(error = %Chain(&err), "leave");
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
        let now = Instant::now();
        match event {
            Event::Checked { pending, answers } => self.settle(pending, answers),
            Event::Closed {
                peer,
                stable_id,
                duplicate,
            } => {
                self.pending.remove(&stable_id);
                if self
                    .links
                    .get(&peer)
                    .is_some_and(|link| link.conn.stable_id() == stable_id)
                {
                    debug!(%peer, "mesh link closed");
                    self.links.remove(&peer);
                    self.book.link_lost(&peer, now);
                }
                if let Some(reason) = duplicate {
                    self.book.dialled(peer, DialOutcome::Duplicate, now);
                    let text = format!(
                        "peer {peer} refused this device: another device already uses this device's \
                         identity ({}) in the mesh ({reason}). This config directory was probably \
                         copied from that device: remove identity.key from it and restart `gleam peer` \
                         to get a new identity",
                        self.me
                    );
                    if self.refusals.should_warn(peer, now) {
                        error!("{text}");
                    } else {
                        debug!("{text}");
                    }
                    self.warn_user(
                        "another device uses this device's identity in the mesh; this one \
                                    was refused (remove identity.key here and restart gleam peer)",
                    );
                }
            }
            Event::Control(request, reply) => {
                let _ = reply.send(self.answer(request));
            }
            Event::DialDone { peer, outcome } => {
                self.dialing.remove(&peer);
                if !matches!(outcome, DialOutcome::Connected(_)) && !self.links.contains_key(&peer)
                {
                    self.book.dialled(peer, outcome, now);
                }
            }
            Event::Discovery(DiscoveryEvent::Found {
                id,
                addrs,
                protocol,
            }) => {
                if id == self.me {
                    self.own_id_advertised(&addrs, now);
                } else if protocol != PROTOCOL_VERSION {
                    debug!(peer = %id, protocol, "ignoring a peer with another protocol version");
                } else if self.book.learn_mdns(id, addrs, now) {
                    self.dial_if_due(id, now);
                }
            }
            Event::Discovery(DiscoveryEvent::Lost { id }) => {
                debug!(peer = %id, "mDNS: peer withdrew");
                self.book.forget_mdns(&id);
            }
            Event::LinkMessage {
                peer,
                stable_id,
                message,
            } => self.link_message(peer, stable_id, message),
            Event::MeshLink { peer, conn, dialer } => self.add_link(peer, conn, dialer),
            Event::Packet {
                peer,
                stable_id,
                data,
            } => {
                // Only the link in use speaks for a peer (a pending one may be an impostor).
                let current = self
                    .links
                    .get(&peer)
                    .is_some_and(|link| link.conn.stable_id() == stable_id);
                if current && let Err(err) = self.gossip.handle_data_from(peer, &data) {
                    debug!(error = %Chain(&err), "dropping a gossip packet");
                }
            }
            Event::Probed {
                peer,
                stable_id,
                report,
                cost,
            } => {
                if let Some(link) = self.links.get_mut(&peer)
                    && link.conn.stable_id() == stable_id
                {
                    link.prober.on_probe_done(now, report, cost);
                }
            }
            Event::Timer(timer) => {
                if let Err(err) = self.gossip.handle_timer(timer) {
                    debug!(error = %Chain(&err), "gossip timer");
                }
            }
        }
    }

    fn tick(&mut self) {
        let now = Instant::now();
        if self
            .last_addr_check
            .is_none_or(|at| now.duration_since(at) >= ADDR_CHECK_EVERY)
        {
            self.refresh_addrs(now);
        }
        self.sample_sessions(now);
        self.refresh_own_state();
        let due = self
            .last_publish
            .is_none_or(|last| now.duration_since(last) >= PUBLISH_EVERY);
        if due {
            self.last_publish = Some(now);
            if let Err(err) = self.gossip.publish(&self.own) {
                warn!(error = %Chain(&err), "cannot publish our state");
            }
        }
        for peer in self.view.expire(now) {
            debug!(%peer, "peer state went stale");
        }
        for peer in self.book.expire(now) {
            debug!(%peer, "forgot a peer nothing names any more");
        }
        // A peer we are linked to but that is not a member (declared down while its link stayed
        // up, or its announce was lost): ask it in again.
        for (peer, link) in &mut self.links {
            if link
                .last_announce
                .is_none_or(|at| now.duration_since(at) >= REANNOUNCE_EVERY)
            {
                link.last_announce = Some(now);
                match self.gossip.announce_if_absent(*peer) {
                    Ok(true) => debug!(%peer, "linked but not a member: announcing"),
                    Ok(false) => {}
                    Err(err) => debug!(error = %Chain(&err), "announce"),
                }
            }
        }
        // Pending links whose hello never came: judge them as an earlier Gleam's.
        let silent: Vec<usize> = self
            .pending
            .iter()
            .filter(|(_, pending)| {
                !pending.checking && now.duration_since(pending.since) >= HELLO_TIMEOUT
            })
            .map(|(id, _)| *id)
            .collect();
        for id in silent {
            self.check_existing(id);
        }
        // (Re)dial peers we know an address of but have no link to.
        let me = self.me;
        let due = self.book.due(now, |peer| {
            *peer == me || self.links.contains_key(peer) || self.dialing.contains(peer)
        });
        for peer in due {
            self.dial(peer, now);
        }
        self.start_probes(now);
    }

    /// This host's addresses (what we advertise, and how we tell our own id advertised elsewhere).
    fn refresh_addrs(&mut self, now: Instant) {
        self.last_addr_check = Some(now);
        let Ok(interfaces) = if_addrs::get_if_addrs() else {
            return;
        };
        self.local_ips = interfaces.iter().map(if_addrs::Interface::ip).collect();
        let port = self.local.port();
        let mut addrs: Vec<SocketAddr> = match self.local.ip() {
            ip if !ip.is_unspecified() => vec![SocketAddr::new(ip, port)],
            listen => interfaces
                .iter()
                .filter(|iface| !iface.is_loopback())
                .filter(|iface| self.interfaces.is_empty() || self.interfaces.contains(&iface.name))
                // A v4 socket serves no IPv6; a dual-stack `[::]` one serves both.
                .filter(|iface| listen.is_ipv6() || iface.ip().is_ipv4())
                .map(|iface| match iface.ip() {
                    IpAddr::V6(v6) if gleam_auth::target::needs_scope(&v6) => SocketAddr::V6(
                        std::net::SocketAddrV6::new(v6, port, 0, iface.index.unwrap_or(0)),
                    ),
                    ip => SocketAddr::new(ip, port),
                })
                .collect(),
        };
        // IPv4 first (no scope to get wrong), then IPv6; deterministic within each.
        addrs.sort_by_key(|addr| (addr.is_ipv6(), *addr));
        addrs.dedup();
        if self.own.addrs != addrs {
            self.own.addrs = addrs;
            self.own.version += 1;
            self.last_publish = None;
        }
    }

    /// mDNS resolved our own id: addresses that are not ours mean another device advertises it.
    fn own_id_advertised(&mut self, addrs: &[SocketAddr], now: Instant) {
        let foreign = duplicate::foreign(addrs, &self.local_ips);
        if foreign.is_empty() {
            return;
        }
        let shown: Vec<String> = foreign.iter().map(display_addr).collect();
        let text = format!(
            "mDNS shows this device's id {} advertised from {}, which is not this device: another device \
             may be using a copy of this config directory (identity.key); the mesh keeps the device that \
             was there first",
            self.me,
            shown.join(", ")
        );
        if self.refusals.should_warn(self.me, now) {
            warn!("{text}");
        } else {
            debug!("{text}");
        }
        self.warn_user(&format!(
            "another device ({}) advertises this device's identity",
            shown.join(", ")
        ));
    }

    fn warn_user(&mut self, text: &str) {
        let now = Instant::now();
        match self.warnings.iter_mut().find(|(known, _)| known == text) {
            Some((_, at)) => *at = now,
            None => self.warnings.push((text.to_owned(), now)),
        }
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
                let bandwidth = link.prober.bandwidth_bps().unwrap_or(0);
                let measured = probe::link_quality(&link.conn, &mut link.meter, bandwidth);
                link.quality = measured;
                // Publish RTT and bandwidth to 2 significant digits (RTT in 100 us steps at least),
                // so jitter does not bump the version each tick.
                let mut quality = measured;
                quality.rtt_us = two_digits(u64::from(quality.rtt_us.div_ceil(100) * 100))
                    .try_into()
                    .unwrap_or(u32::MAX);
                quality.loss = (quality.loss * 100.0).round() / 100.0;
                quality.bandwidth_bps = two_digits(quality.bandwidth_bps);
                LinkReport {
                    peer: *peer,
                    quality,
                }
            })
            .collect();
        state.links.sort_by_key(|link| link.peer);
        state.truncate_to_limits();
        if state != self.own {
            // Load, sessions, GPUs go out at once; link figures alone wait for the next periodic
            // publication (on a slow link, gossip must not become traffic of its own).
            let links_only = PeerState {
                links: self.own.links.clone(),
                ..state.clone()
            } == self.own;
            state.version = self.own.version + 1;
            self.own = state;
            if !links_only {
                self.last_publish = None;
            }
        }
    }

    /// Traffic of the CUDA sessions we serve is a measurement of the link to each client.
    fn sample_sessions(&mut self, now: Instant) {
        let conns = self.sessions.open();
        let mut seen = HashSet::new();
        for (peer, conn) in conns {
            let id = conn.stable_id();
            seen.insert(id);
            let stats = conn.stats();
            let bytes = stats.udp_tx.bytes + stats.udp_rx.bytes;
            if let Some((at, before)) = self.traffic.insert(id, (now, bytes)) {
                let secs = now.duration_since(at).as_secs_f64();
                let bps = (bytes.saturating_sub(before) as f64 * 8.0 / secs.max(1e-3)) as u64;
                // Only a busy interval says anything about the link.
                if bps >= TRAFFIC_MIN_BPS
                    && let Some(link) = self.links.get_mut(&peer)
                {
                    link.prober.on_traffic(now, bps);
                }
            }
        }
        self.traffic.retain(|id, _| seen.contains(id));
    }

    fn dial_if_due(&mut self, peer: PeerId, now: Instant) {
        let me = self.me;
        let due = self.book.due(now, |candidate| {
            *candidate != peer
                || *candidate == me
                || self.links.contains_key(candidate)
                || self.dialing.contains(candidate)
        });
        if due.contains(&peer) {
            self.dial(peer, now);
        }
    }

    fn dial(&mut self, peer: PeerId, now: Instant) {
        let addrs = self.book.addrs(&peer);
        if addrs.is_empty() {
            return;
        }
        let config = match tls::client_config(&self.identity, peer, ALPN_MESH) {
            Ok(config) => config,
            Err(err) => {
                warn!(error = %Chain(&err), "cannot build a client config");
                return;
            }
        };
        self.book.dialling(&peer, now);
        self.dialing.insert(peer);
        let endpoint = self.endpoint.clone();
        let secret = self.secret.clone();
        let events = self.events.clone();
        let refusals = self.refusals.clone();
        let me = self.me;
        tokio::spawn(async move {
            let pace = Pace {
                stagger: DIAL_STAGGER,
                attempt_timeout: HANDSHAKE_TIMEOUT,
            };
            let outcome = match dial::dial(&endpoint, &config, peer, &addrs, pace).await {
                Err(err) => {
                    debug!(%peer, error = %Chain(&err), "dial failed");
                    DialOutcome::Failed
                }
                Ok(dialed) => match authenticate_as_client(&dialed.conn, &secret).await {
                    Ok(_) => {
                        let _ = events.send(Event::MeshLink {
                            peer,
                            conn: dialed.conn,
                            dialer: me,
                        });
                        DialOutcome::Connected(dialed.addr)
                    }
                    Err(err @ (AuthError::Refused { .. } | AuthError::SecretMismatch { .. })) => {
                        let addr = display_addr(&dialed.addr);
                        // A device of another mesh on the LAN: say so once, not every retry.
                        if refusals.should_warn(peer, Instant::now()) {
                            warn!(%peer, %addr, error = %Chain(&err), "cannot join this peer (it is in another mesh); retrying rarely");
                        } else {
                            debug!(%peer, %addr, error = %Chain(&err), "cannot join this peer");
                        }
                        DialOutcome::Refused
                    }
                    Err(err) => {
                        debug!(%peer, error = %Chain(&err), "authentication failed");
                        DialOutcome::Failed
                    }
                },
            };
            let _ = events.send(Event::DialDone { peer, outcome });
        });
    }

    fn add_link(&mut self, peer: PeerId, conn: quinn::Connection, dialer: PeerId) {
        let now = Instant::now();
        let remote = canonical(conn.remote_address());
        if peer == self.me {
            // Our own key on the other end: this daemon through another address of ours, or a copy
            // of our config directory on another device.
            if remote.ip().is_loopback() || self.local_ips.contains(&remote.ip()) {
                conn.close(CLOSE_DUPLICATE, b"connected to itself");
                return;
            }
            let text = format!(
                "a device at {} presents this device's identity ({}): its config directory is a copy of \
                 this one. It was refused; remove identity.key there and restart its `gleam peer`",
                display_addr(&remote),
                self.me
            );
            if self.refusals.should_warn(self.me, now) {
                error!("{text}");
            } else {
                debug!("{text}");
            }
            self.warn_user(&format!(
                "another device ({}) uses this device's identity",
                display_addr(&remote)
            ));
            conn.close(
                CLOSE_DUPLICATE_ID,
                format!(
                    "this identity is already in use by the device at {}",
                    self.own.host
                )
                .as_bytes(),
            );
            return;
        }
        spawn_link_readers(conn.clone(), peer, self.events.clone());
        send_link_message(&conn, &LinkMessage::Hello(self.run));
        let existing_alive = self
            .links
            .get(&peer)
            .is_some_and(|link| link.conn.close_reason().is_none());
        if existing_alive {
            // Judged when its hello arrives (see `link_message`).
            debug!(%peer, remote = %display_addr(&remote), "second mesh link: waiting for its hello");
            self.pending.insert(
                conn.stable_id(),
                Pending {
                    peer,
                    conn,
                    dialer,
                    run: None,
                    since: now,
                    checking: false,
                },
            );
            return;
        }
        self.adopt(peer, conn, dialer, None, now);
    }

    /// Makes `conn` the link to `peer`.
    fn adopt(
        &mut self,
        peer: PeerId,
        conn: quinn::Connection,
        dialer: PeerId,
        run: Option<Run>,
        now: Instant,
    ) {
        let remote = canonical(conn.remote_address());
        debug!(%peer, remote = %display_addr(&remote), "mesh link up");
        self.book.dialled(peer, DialOutcome::Connected(remote), now);
        if let Some(old) = self.links.insert(
            peer,
            Link {
                conn,
                dialer,
                run,
                meter: LossMeter::default(),
                quality: LinkQuality::default(),
                prober: Prober::new(now, FIRST_PROBE_AFTER, self.probe_interval),
                connected: now,
                last_announce: Some(now),
            },
        ) {
            old.conn
                .close(CLOSE_DUPLICATE, b"replaced by a newer mesh link");
        }
        if let Err(err) = self.gossip.announce(peer) {
            debug!(error = %Chain(&err), "announce");
        }
        self.last_publish = None;
    }

    fn link_message(&mut self, peer: PeerId, stable_id: usize, message: LinkMessage) {
        match message {
            LinkMessage::Hello(run) => {
                if let Some(link) = self.links.get_mut(&peer)
                    && link.conn.stable_id() == stable_id
                {
                    link.run = Some(run);
                    return;
                }
                let Some(pending) = self.pending.get_mut(&stable_id) else {
                    return;
                };
                pending.run = Some(run);
                let existing_run = self.links.get(&peer).and_then(|link| link.run);
                if existing_run == Some(run) {
                    self.settle_same_run(stable_id);
                } else {
                    self.check_existing(stable_id);
                }
            }
            LinkMessage::Duplicate { addr } => {
                let current = self
                    .links
                    .get(&peer)
                    .is_some_and(|link| link.conn.stable_id() == stable_id);
                if !current {
                    return;
                }
                let text = format!(
                    "peer {peer} reports a device at {} using this device's identity ({}); it was \
                     refused and this device keeps its place. If that device's config directory is a \
                     copy of this one, remove identity.key there and restart its `gleam peer`",
                    display_addr(&addr),
                    self.me
                );
                if self.refusals.should_warn(self.me, Instant::now()) {
                    error!("{text}");
                } else {
                    debug!("{text}");
                }
                self.warn_user(&format!(
                    "another device ({}) uses this device's identity",
                    display_addr(&addr)
                ));
            }
        }
    }

    /// The same run linked twice (a dial race, or a reconnection): both sides keep the link dialled
    /// by the smaller id during a race; otherwise the newer link wins (the old one may be dead but not
    /// yet timed out).
    fn settle_same_run(&mut self, pending: usize) {
        let Some(new) = self.pending.remove(&pending) else {
            return;
        };
        let now = Instant::now();
        if let Some(existing) = self.links.get(&new.peer) {
            let preferred = self.me.min(new.peer);
            let race = existing.connected.elapsed() < DIAL_RACE_WINDOW;
            if race && existing.dialer == preferred && new.dialer != preferred {
                new.conn.close(CLOSE_DUPLICATE, b"duplicate mesh link");
                return;
            }
        }
        self.adopt(new.peer, new.conn, new.dialer, new.run, now);
    }

    /// Asks the existing link of a pending one's peer whether it still answers.
    fn check_existing(&mut self, pending: usize) {
        let Some(new) = self.pending.get_mut(&pending) else {
            return;
        };
        new.checking = true;
        let Some(existing) = self.links.get(&new.peer) else {
            // The old link went away meanwhile.
            self.settle(pending, false);
            return;
        };
        let conn = existing.conn.clone();
        let events = self.events.clone();
        tokio::spawn(async move {
            let answers = matches!(
                tokio::time::timeout(LIVENESS_TIMEOUT, echo(&conn)).await,
                Ok(Ok(()))
            );
            let _ = events.send(Event::Checked { pending, answers });
        });
    }

    /// Settles a pending link once we know whether the existing one still answers.
    fn settle(&mut self, pending: usize, answers: bool) {
        let Some(new) = self.pending.get(&pending) else {
            return;
        };
        let peer = new.peer;
        let existing_run = self.links.get(&peer).and_then(|link| link.run);
        let answers = answers && self.links.contains_key(&peer);
        match duplicate::judge(existing_run, answers, new.run) {
            Verdict::SameRun => self.settle_same_run(pending),
            Verdict::Restarted => {
                let Some(new) = self.pending.remove(&pending) else {
                    return;
                };
                debug!(%peer, "the peer restarted: its new run replaces the old link");
                self.adopt(peer, new.conn, new.dialer, new.run, Instant::now());
            }
            Verdict::Duplicate { keep_existing } => {
                let Some(new) = self.pending.remove(&pending) else {
                    return;
                };
                let Some(existing) = self.links.get(&peer) else {
                    return;
                };
                let (kept, refused) = match keep_existing {
                    true => (existing.conn.clone(), new.conn.clone()),
                    false => (new.conn.clone(), existing.conn.clone()),
                };
                let kept_addr = canonical(kept.remote_address());
                let refused_addr = canonical(refused.remote_address());
                let text = format!(
                    "two devices present peer id {peer}: one at {} and one at {}. Keeping the one that \
                     joined the mesh first ({}) and refusing the other. A copied config directory \
                     (identity.key) is the usual cause: on the copy, remove identity.key and restart \
                     `gleam peer` to get a new identity",
                    display_addr(&kept_addr),
                    display_addr(&refused_addr),
                    display_addr(&kept_addr),
                );
                if self.refusals.should_warn(peer, Instant::now()) {
                    error!("{text}");
                } else {
                    debug!("{text}");
                }
                self.book.shun(peer, refused_addr.ip());
                refused.close(
                    CLOSE_DUPLICATE_ID,
                    format!(
                        "another device ({}) holds this identity in the mesh since earlier",
                        display_addr(&kept_addr)
                    )
                    .as_bytes(),
                );
                send_link_message(&kept, &LinkMessage::Duplicate { addr: refused_addr });
                if !keep_existing {
                    self.adopt(peer, new.conn, new.dialer, new.run, Instant::now());
                }
            }
        }
    }

    fn start_probes(&mut self, now: Instant) {
        // Do not disturb running work: no probes while we serve sessions (their traffic measures
        // the links they use).
        if self.sessions.active.load(Ordering::Relaxed) > 0 {
            return;
        }
        for (peer, link) in &mut self.links {
            let Some(bytes) = link.prober.poll_probe(now) else {
                continue;
            };
            let conn = link.conn.clone();
            let events = self.events.clone();
            let peer = *peer;
            tokio::spawn(async move {
                let started = Instant::now();
                let result =
                    tokio::time::timeout(PROBE_TIMEOUT, probe::measure_bandwidth(&conn, bytes))
                        .await;
                let report = match result {
                    Ok(Ok(report)) => Some(report),
                    Ok(Err(err)) => {
                        debug!(%peer, error = %Chain(&err), "probe failed");
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
                    report,
                    cost: started.elapsed(),
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
                        let now = Instant::now();
                        // A peer's own addresses: a way to reach it even where mDNS does not.
                        if self.book.learn_gossip(state.id, &state.addrs, now)
                            && !self.links.contains_key(&state.id)
                        {
                            self.dial_if_due(state.id, now);
                        }
                        self.view.apply(state, now);
                    }
                }
            }
        }
    }

    fn send_packet(&mut self, peer: PeerId, data: Bytes) {
        let Some(link) = self.links.get(&peer) else {
            // No link yet: the packet is lost (SWIM copes); make sure we dial.
            self.dial_if_due(peer, Instant::now());
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
                            bandwidth_bps: link.and_then(|link| link.prober.bandwidth_bps()),
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
                    let is_self = choice.id == self.own.id;
                    let state = match is_self {
                        true => Some(&self.own),
                        false => self.view.state(&choice.id),
                    };
                    let link = self.links.get(&choice.id).filter(|_| !is_self);
                    BestPeer {
                        id: choice.id,
                        addrs: self.addrs_of(&choice.id),
                        expected_secs: choice.expected.as_secs_f64(),
                        host: state.map(|state| state.host.clone()).unwrap_or_default(),
                        rtt_us: link.map(|link| rtt_us(&link.conn)),
                        bandwidth_bps: link.and_then(|link| link.prober.bandwidth_bps()),
                        emulated: state
                            .is_some_and(|state| state.gpus.iter().all(|gpu| gpu.emulated)),
                        is_self,
                        loss: link.map_or(0.0, |link| link.quality.loss),
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

    /// Every address of `peer` worth trying from here, best first: the one our link uses, then the
    /// others the book knows (link-local ones with our interface); while a link is up, only those
    /// something authenticated vouches for ([`AddrBook::vouched_addrs`]). For ourselves: loopback.
    fn addrs_of(&self, peer: &PeerId) -> Vec<SocketAddr> {
        if *peer == self.me {
            return self.own_loopback_addr().into_iter().collect();
        }
        let link = self
            .links
            .get(peer)
            .map(|link| canonical(link.conn.remote_address()));
        let known = match link {
            Some(_) => self.book.vouched_addrs(peer),
            None => self.book.addrs(peer),
        };
        let mut addrs: Vec<SocketAddr> = link.into_iter().collect();
        for addr in known {
            if !addrs.contains(&addr) {
                addrs.push(addr);
            }
        }
        addrs
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
        let ip: IpAddr = match self.local.ip() {
            // Unspecified (`[::]` is dual-stack, `0.0.0.0` v4): loopback v4 reaches both.
            ip if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
            ip => ip,
        };
        Some(canonical(SocketAddr::new(ip, self.local.port())))
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
                rtt_us: link.map(|link| rtt_us(&link.conn)),
                bandwidth_bps: link.and_then(|link| link.prober.bandwidth_bps()),
                loss: link.map_or(0.0, |link| link.quality.loss),
                cache: state.cache.clone(),
                addrs: match is_self {
                    true => state.addrs.clone(),
                    false => self.addrs_of(&state.id),
                },
                warnings: match is_self {
                    true => self
                        .warnings
                        .iter()
                        .filter(|(_, at)| at.elapsed() < WARNING_SHOWN_FOR)
                        .map(|(text, _)| text.clone())
                        .collect(),
                    false => Vec::new(),
                },
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

fn rtt_us(conn: &quinn::Connection) -> u32 {
    u32::try_from(conn.rtt().as_micros()).unwrap_or(u32::MAX)
}

/// `bps` rounded to two significant digits.
fn two_digits(bps: u64) -> u64 {
    let mut scale = 1;
    while bps / scale >= 100 {
        scale *= 10;
    }
    (bps + scale / 2) / scale * scale
}

async fn accept_loop(
    endpoint: quinn::Endpoint,
    secret: Arc<MeshSecret>,
    events: mpsc::UnboundedSender<Event>,
    handler: SessionHandler,
    sessions: Arc<Sessions>,
    refusals: Arc<RefusalLog>,
) {
    while let Some(incoming) = endpoint.accept().await {
        let secret = secret.clone();
        let events = events.clone();
        let handler = handler.clone();
        let sessions = sessions.clone();
        let refusals = refusals.clone();
        tokio::spawn(async move {
            let remote = canonical(incoming.remote_address());
            let conn = match tokio::time::timeout(HANDSHAKE_TIMEOUT, incoming).await {
                Ok(Ok(conn)) => conn,
                Ok(Err(err)) => {
                    info!(remote = %display_addr(&remote), error = %Chain(&err), "handshake failed");
                    return;
                }
                Err(_) => {
                    info!(remote = %display_addr(&remote), "handshake timed out");
                    return;
                }
            };
            let alpn = alpn_of(&conn);
            let peer = match authenticate_as_server(&conn, &secret).await {
                Ok(peer) => peer,
                Err(err) => {
                    let who = match &err {
                        AuthError::SecretMismatch { peer } | AuthError::TimedOut { peer } => {
                            Some(*peer)
                        }
                        _ => None,
                    };
                    // Another mesh's device on the LAN keeps trying: say so once, then quietly.
                    match who {
                        Some(peer) if refusals.should_warn(peer, Instant::now()) => {
                            warn!(%peer, remote = %display_addr(&remote), error = %Chain(&err), "refusing peer");
                        }
                        _ => {
                            debug!(remote = %display_addr(&remote), error = %Chain(&err), "refusing peer");
                        }
                    }
                    return;
                }
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
                    info!(%peer, remote = %display_addr(&remote), "CUDA session starts");
                    sessions.started(peer, &conn);
                    let started = Instant::now();
                    let watched = conn.clone();
                    let sessions = sessions.clone();
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

/// Sends a [`LinkMessage`] on its own uni stream (reliable, unlike a datagram).
fn send_link_message(conn: &quinn::Connection, message: &LinkMessage) {
    let Ok(body) = postcard::to_allocvec(message) else {
        return;
    };
    let conn = conn.clone();
    tokio::spawn(async move {
        if let Ok(mut send) = conn.open_uni().await {
            let mut framed = Vec::with_capacity(body.len() + 1);
            framed.push(TAG_LINK);
            framed.extend_from_slice(&body);
            let _ = send.write_all(&framed).await;
            let _ = send.finish();
        }
    });
}

/// One round trip on a fresh bidi stream: proves the other side of `conn` is alive now.
async fn echo(conn: &quinn::Connection) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let (mut send, mut recv) = conn.open_bi().await?;
    let nonce: [u8; 8] = rand::random();
    send.write_all(&[STREAM_ECHO]).await?;
    send.write_all(&nonce).await?;
    send.finish()?;
    let mut back = [0u8; 8];
    recv.read_exact(&mut back).await?;
    match back == nonce {
        true => Ok(()),
        false => Err("echo mismatch".into()),
    }
}

/// Reads gossip datagrams and streams, link messages, and answers probes and echoes, until the link
/// closes.
fn spawn_link_readers(conn: quinn::Connection, peer: PeerId, events: mpsc::UnboundedSender<Event>) {
    let stable_id = conn.stable_id();
    let datagrams = conn.clone();
    let tx = events.clone();
    tokio::spawn(async move {
        while let Ok(datagram) = datagrams.read_datagram().await {
            if datagram.first() == Some(&TAG_GOSSIP)
                && tx
                    .send(Event::Packet {
                        peer,
                        stable_id,
                        data: datagram.slice(1..),
                    })
                    .is_err()
            {
                return;
            }
        }
        let duplicate = match datagrams.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(close))
                if close.error_code == CLOSE_DUPLICATE_ID =>
            {
                Some(String::from_utf8_lossy(&close.reason).into_owned())
            }
            _ => None,
        };
        let _ = tx.send(Event::Closed {
            peer,
            stable_id,
            duplicate,
        });
    });
    let streams = conn.clone();
    let tx = events;
    tokio::spawn(async move {
        while let Ok(mut recv) = streams.accept_uni().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let Ok(data) = recv.read_to_end(MAX_GOSSIP_STREAM).await else {
                    return;
                };
                let event = match data.first() {
                    Some(&TAG_GOSSIP) => Event::Packet {
                        peer,
                        stable_id,
                        data: Bytes::from(data).slice(1..),
                    },
                    Some(&TAG_LINK) => match postcard::from_bytes::<LinkMessage>(&data[1..]) {
                        Ok(message) => Event::LinkMessage {
                            peer,
                            stable_id,
                            message,
                        },
                        Err(err) => {
                            debug!(%peer, error = %Chain(&err), "malformed link message");
                            return;
                        }
                    },
                    _ => return,
                };
                let _ = tx.send(event);
            });
        }
    });
    tokio::spawn(async move {
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            tokio::spawn(async move {
                let mut kind = [0u8; 1];
                if recv.read_exact(&mut kind).await.is_err() {
                    return;
                }
                match kind[0] {
                    STREAM_PROBE => {
                        if let Err(err) = probe::serve_probe(send, recv).await {
                            debug!(%peer, error = %Chain(&err), "serving a probe");
                        }
                    }
                    STREAM_ECHO => {
                        let mut nonce = [0u8; 8];
                        if recv.read_exact(&mut nonce).await.is_ok() {
                            let _ = send.write_all(&nonce).await;
                            let _ = send.finish();
                        }
                    }
                    _ => {}
                }
            });
        }
    });
}

fn bind_control(path: &std::path::Path, mode: u32) -> Result<UnixListener, DaemonError> {
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
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o777))
        .map_err(control_err)?;
    Ok(listener)
}

async fn control_loop(
    listener: UnixListener,
    events: mpsc::UnboundedSender<Event>,
    sessions: Arc<Sessions>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (events, sessions) = (events.clone(), sessions.clone());
        tokio::spawn(async move {
            if let Err(err) = serve_control(stream, events, &sessions).await {
                debug!(error = %Chain(&err), "control request");
            }
        });
    }
}

async fn serve_control(
    stream: UnixStream,
    events: mpsc::UnboundedSender<Event>,
    sessions: &Sessions,
) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = tokio::io::BufReader::new(read.take(MAX_LINE));
    let mut line = String::new();
    tokio::time::timeout(CONTROL_TIMEOUT, reader.read_line(&mut line))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    let request = serde_json::from_str::<Request>(&line);
    if let Ok(Request::LocalSession) = request {
        return serve_local_session(reader, write, sessions).await;
    }
    let response = match request {
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

/// Counts a program of this device that runs on its GPU directly, until its `gleam run` closes the
/// connection (or dies: the kernel closes it then).
async fn serve_local_session(
    mut reader: tokio::io::BufReader<tokio::io::Take<tokio::net::unix::OwnedReadHalf>>,
    mut write: tokio::net::unix::OwnedWriteHalf,
    sessions: &Sessions,
) -> std::io::Result<()> {
    sessions.started_local();
    let started = Instant::now();
    info!("a program of this device runs on its GPU directly");
    let mut out = serde_json::to_vec(&Response::LocalSession).map_err(std::io::Error::other)?;
    out.push(b'\n');
    let answered = write.write_all(&out).await;
    if answered.is_ok() {
        // Nothing more is expected: whatever comes (within the line limit) is skipped until the end.
        let mut sink = Vec::new();
        let _ = reader.read_to_end(&mut sink).await;
    }
    info!("the program on this device's GPU ended");
    sessions.finished(started.elapsed());
    answered
}

/// IPv4 peers reach a dual-stack socket as IPv4-mapped IPv6 addresses; show them as IPv4. Every
/// other address is kept whole: a link-local IPv6 address keeps its interface (scope id).
fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::from((v4, v6.port())),
            None => addr,
        },
        SocketAddr::V4(_) => addr,
    }
}

/// This host's name (`gethostname`, which needs no /proc: services may run with a restricted one).
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its length; gethostname writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let len = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    match rc == 0 && len > 0 {
        true => String::from_utf8_lossy(&buf[..len]).into_owned(),
        false => "unknown".into(),
    }
}

fn seed_bytes(id: PeerId) -> [u8; 8] {
    let mut seed = [0; 8];
    seed.copy_from_slice(&id.as_bytes()[..8]);
    seed
}

const ADDR_CHECK_EVERY: Duration = Duration::from_secs(2);
const CLOSE_DUPLICATE: quinn::VarInt = quinn::VarInt::from_u32(0x4741_0002);
const CLOSE_PROTOCOL: quinn::VarInt = quinn::VarInt::from_u32(0x4741_0003);
const CLOSE_SHUTDOWN: quinn::VarInt = quinn::VarInt::from_u32(0x4741_0000);
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);
const DIAL_RACE_WINDOW: Duration = Duration::from_secs(2);
/// Next address after this long without an answer (a LAN handshake takes a few ms).
const DIAL_STAGGER: Duration = Duration::from_millis(150);
const FIRST_PROBE_AFTER: Duration = Duration::from_millis(300);
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);
/// A second link whose hello has not come by then is judged without it.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// How long an existing link has to answer an echo to count as alive.
const LIVENESS_TIMEOUT: Duration = Duration::from_secs(1);
const MAX_GOSSIP_STREAM: usize = 64 * 1024;
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Our state is re-published this often even unchanged (a view drops a peer silent for 10 s).
const PUBLISH_EVERY: Duration = Duration::from_secs(3);
/// How often a linked peer that is not a member is asked in again.
const REANNOUNCE_EVERY: Duration = Duration::from_secs(1);
/// Second byte kind on a bidi stream: an echo (liveness check).
const STREAM_ECHO: u8 = 2;
const TAG_GOSSIP: u8 = 1;
const TICK: Duration = Duration::from_millis(250);
/// Session traffic below this rate says nothing about a link's capacity.
const TRAFFIC_MIN_BPS: u64 = 1_000_000;
/// A warning stays on this device's row this long after it last happened.
const WARNING_SHOWN_FOR: Duration = Duration::from_secs(600);

/// Round trip to this device's own endpoint, as the policy sees it (loopback QUIC: tens of µs).
const LOOPBACK_RTT: Duration = Duration::from_micros(100);
/// Copy throughput to this device's own endpoint (loopback QUIC measured ~4 Gbit/s on an H200 host).
const LOOPBACK_BPS: u64 = 4_000_000_000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_keeps_the_scope_of_link_local_addresses() {
        let scoped = SocketAddr::V6(std::net::SocketAddrV6::new(
            "fe80::1".parse().unwrap(),
            4747,
            0,
            3,
        ));
        assert_eq!(canonical(scoped), scoped);
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:4747".parse().unwrap();
        assert_eq!(canonical(mapped), "10.0.0.1:4747".parse().unwrap());
    }

    #[test]
    fn published_bandwidth_has_two_significant_digits() {
        assert_eq!(two_digits(0), 0);
        assert_eq!(two_digits(99), 99);
        assert_eq!(two_digits(1_234_567), 1_200_000);
        assert_eq!(two_digits(1_250_000), 1_300_000);
        assert_eq!(two_digits(987_654_321), 990_000_000);
    }
}
