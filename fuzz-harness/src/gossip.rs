//! Target `gossip`: what the other members of a mesh send a daemon's SWIM instance.
//!
//! One [`Gossip`] member ([`me`]) has a link to three peers ([`peer`]) and has announced itself to them,
//! as a daemon does after authenticating its links. The input is a sequence of steps:
//!
//! * `0..=2, len u16, bytes`: a packet on the link from peer 0..2 ([`Gossip::handle_data_from`], which
//!   refuses packets whose sender field names anyone else);
//! * `3, ms u16`: time passes; every foca timer that came due fires, in order ([`Node::advance`]).
//!
//! After each step the outputs are handled as the daemon's `drain_gossip` does them: peers' states that
//! arrive from active members go into a [`MeshView`], departures leave it. At the end, the daemon's
//! control answers are built from the view (`gleam peers list`'s rows and `gleam run`'s choice of peer) and
//! must encode as JSON that the client decodes: a state gossiped by one member must not break the answer
//! for everyone. States kept are within the limits a member holds its own to. Packets the instance sends
//! must fit a link's gossip stream.

use std::time::{Duration, Instant};

use gleam_auth::identity::PeerId;
use gleam_mesh::control::{PeerRow, Response};
use gleam_mesh::gossip::{Gossip, Member, Output};
use gleam_mesh::select::{self, Candidate, JobHint};
use gleam_mesh::state::MeshView;

/// The member the fuzzer talks to.
pub fn me() -> Member {
    Member {
        id: PeerId::from_bytes([0xaa; 16]),
        boot: 1,
    }
}

/// The peers linked to [`me`].
pub fn peer(i: u8) -> PeerId {
    PeerId::from_bytes([i + 1; 16])
}

/// Timers waiting at once: foca keeps a handful per member; more means timers pile up without end.
const MAX_TIMERS: usize = 4096;
/// The most a kept state may hold once limited (48 four-byte characters of host and GPU model, eight
/// GPUs, eight addresses, sixteen link reports).
const MAX_KEPT: usize = 4096;
/// The largest gossip packet a link accepts (the daemon's `MAX_GOSSIP_STREAM`).
const MAX_SENT: usize = 64 * 1024;

/// Runs one input. Panics only on a bug.
pub fn run(data: &[u8]) {
    let mut node = Node::new();
    let mut rest = data;
    while let Some((&kind, tail)) = rest.split_first() {
        let Some((arg, tail)) = take_u16(tail) else {
            break;
        };
        rest = tail;
        match kind % 4 {
            sender @ 0..=2 => {
                let n = usize::from(arg).min(rest.len());
                let (packet, tail) = rest.split_at(n);
                rest = tail;
                node.packet(sender, packet);
            }
            _ => node.advance(arg),
        }
        node.outbox.clear();
    }
    node.answer_control();
}

/// The daemon's side of gossip, without the network: its SWIM instance, its view of the mesh and the
/// timers it has scheduled, on a virtual clock.
#[derive(Debug)]
pub struct Node {
    gossip: Gossip,
    view: MeshView,
    timers: Vec<(Instant, foca::Timer<Member>)>,
    now: Instant,
    /// Packets the instance sent since the outbox was last emptied.
    pub outbox: Vec<(PeerId, Vec<u8>)>,
}

impl Default for Node {
    fn default() -> Self {
        Self::new()
    }
}

impl Node {
    /// [`me`], announced to the three [`peer`]s.
    pub fn new() -> Self {
        let mut node = Self {
            gossip: Gossip::new(me(), 7),
            view: MeshView::default(),
            timers: Vec::new(),
            now: Instant::now(),
            outbox: Vec::new(),
        };
        for i in 0..3 {
            node.gossip.announce(peer(i)).expect("announcing to a peer");
        }
        node.drain();
        node
    }

    /// A packet on the link from peer `sender` (0..=2).
    pub fn packet(&mut self, sender: u8, packet: &[u8]) {
        // Errors are the expected answer to garbage (the daemon logs them at debug level).
        let _ = self.gossip.handle_data_from(peer(sender), packet);
        self.drain();
    }

    /// `ms` milliseconds pass: every timer that comes due fires, in order (including those they
    /// schedule for no later than the new time).
    pub fn advance(&mut self, ms: u16) {
        self.now += Duration::from_millis(u64::from(ms));
        loop {
            let now = self.now;
            let Some(next) = self
                .timers
                .iter()
                .enumerate()
                .filter(|(_, (at, _))| *at <= now)
                .min_by_key(|(_, (at, _))| *at)
                .map(|(i, _)| i)
            else {
                break;
            };
            let (_, timer) = self.timers.swap_remove(next);
            let _ = self.gossip.handle_timer(timer);
            self.drain();
        }
    }

    /// The daemon's `drain_gossip`.
    fn drain(&mut self) {
        while let Some(output) = self.gossip.poll() {
            match output {
                Output::Send(to, packet) => {
                    assert!(
                        packet.len() <= MAX_SENT,
                        "gossip sent a {} byte packet",
                        packet.len()
                    );
                    self.outbox.push((to, packet.to_vec()));
                }
                Output::Schedule(after, timer) => {
                    assert!(
                        self.timers.len() < MAX_TIMERS,
                        "{} foca timers pending",
                        self.timers.len()
                    );
                    // A timer for a later time than representable is never due.
                    if let Some(at) = self.now.checked_add(after) {
                        self.timers.push((at, timer));
                    }
                }
                Output::Up(_) => {}
                Output::Down(member) => {
                    self.view.remove(&member.id);
                }
                Output::State(state) => {
                    if state.id != me().id && self.gossip.is_active(&state.id) {
                        self.view.apply(state, self.now);
                    }
                }
            }
        }
    }

    /// The peers whose state the view holds.
    pub fn known(&self) -> usize {
        self.view.states().count()
    }

    /// What the control socket answers from the view: every row, and the best peer for a default job.
    /// The answers must reach the client intact.
    pub fn answer_control(&self) {
        for state in self.view.states() {
            let size = postcard::to_allocvec(state).map_or(0, |bytes| bytes.len());
            assert!(
                size <= MAX_KEPT,
                "a peer's state of {size} bytes was kept: {state:?}"
            );
        }
        answer_control(&self.view);
    }
}

fn take_u16(data: &[u8]) -> Option<(u16, &[u8])> {
    let (bytes, rest) = data.split_first_chunk::<2>()?;
    Some((u16::from_le_bytes(*bytes), rest))
}

/// What the control socket answers from `view`: every row, and the best peer for a default job. The
/// answers must reach the client intact.
fn answer_control(view: &MeshView) {
    let peers: Vec<PeerRow> = view
        .states()
        .map(|state| PeerRow {
            id: state.id,
            is_self: false,
            host: state.host.clone(),
            gpus: state.gpus.clone(),
            free_memory: state.load.free_memory,
            total_memory: state.total_memory(),
            utilization: state.load.utilization,
            active_sessions: state.load.active_sessions,
            queue_len: state.load.queue_len,
            rtt_us: Some(500),
            bandwidth_bps: None,
            loss: 0.0,
            cache: state.cache.clone(),
            addrs: state.addrs.clone(),
            warnings: Vec::new(),
        })
        .collect();
    crate::control::check_reaches_client(&Response::Peers { peers });

    let candidates: Vec<Candidate> = view
        .states()
        .map(|state| Candidate {
            id: state.id,
            has_gpu: !state.gpus.is_empty(),
            emulated: state.gpus.iter().all(|gpu| gpu.emulated),
            rtt: Some(Duration::from_micros(500)),
            bandwidth_bps: None,
            loss: 0.0,
            utilization: f64::from(state.load.utilization),
            free_memory: state.load.free_memory,
            queue_len: state.load.queue_len,
            mean_job_secs: f64::from(state.load.mean_job_secs),
        })
        .collect();
    let _ = select::choose(&candidates, &JobHint::default());
}
