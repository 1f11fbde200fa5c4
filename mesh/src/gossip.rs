//! Membership, failure detection and state dissemination: foca (SWIM) driven sans-IO.
//!
//! [`Gossip`] wraps a `foca::Foca` whose members are [`Member`]s (a [`PeerId`] plus the daemon
//! run, so a restarted peer replaces its old self at once) and whose custom broadcasts carry
//! Gleam's [`PeerState`]. The caller moves bytes and timers: it feeds packets with
//! [`Gossip::handle_data`] and due timers with [`Gossip::handle_timer`], then drains
//! [`Gossip::poll`] for packets to send, timers to schedule and membership/state changes.

use std::collections::{HashMap, VecDeque};
use std::num::{NonZeroU8, NonZeroUsize};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use foca::{
    AccumulatingRuntime, BroadcastHandler, Foca, Invalidates, OwnedNotification, PostcardCodec,
    Timer,
};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use tracing::{debug, trace};

use crate::state::PeerState;
use gleam_auth::identity::PeerId;

/// A mesh member as foca sees it.
#[derive(Clone, Debug, Deserialize, Eq, Hash, PartialEq, Serialize)]
pub struct Member {
    /// The peer.
    pub id: PeerId,
    /// Its daemon run; a higher one replaces a lower one with the same id.
    pub boot: u64,
}

impl foca::Identity for Member {
    type Addr = PeerId;

    fn renew(&self) -> Option<Self> {
        // Declared down while alive (a partition, a saturated link, a long pause): come back at once
        // under a newer identity. The current time, not just +1, so the renewed identity also beats any
        // other run of this id the mesh saw meanwhile (see `duplicate`: the mesh settles which device
        // keeps an id; foca must not keep preferring a refused copy that started later).
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Some(Self {
            id: self.id,
            boot: self.boot.saturating_add(1).max(now),
        })
    }

    fn addr(&self) -> PeerId {
        self.id
    }

    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        self.boot > adversary.boot
    }
}

/// Something the driver must do or know after feeding [`Gossip`].
#[derive(Debug, PartialEq)]
pub enum Output {
    /// Send this packet to this peer (QUIC datagram, or a stream when too large).
    Send(PeerId, Bytes),
    /// Call [`Gossip::handle_timer`] with this timer after this delay.
    Schedule(Duration, Timer<Member>),
    /// A member came up.
    Up(Member),
    /// A member was declared down (or left).
    Down(Member),
    /// A state of a peer arrived: newer than any before, or a repeat of the latest (peers
    /// re-publish every second, which keeps them fresh in a [`crate::state::MeshView`]).
    State(PeerState),
}

/// The SWIM instance of one daemon.
pub struct Gossip {
    foca: Foca<Member, PostcardCodec, StdRng, StateBroadcasts>,
    runtime: AccumulatingRuntime<Member>,
    inbox: Arc<Mutex<Inbox>>,
}

impl Gossip {
    /// Starts a member; `seed` feeds foca's random member choice.
    pub fn new(me: Member, seed: u64) -> Self {
        let inbox = Arc::new(Mutex::new(Inbox {
            me: me.id,
            latest: HashMap::new(),
            received: VecDeque::new(),
        }));
        let handler = StateBroadcasts {
            inbox: inbox.clone(),
        };
        let foca = Foca::with_custom_broadcast(
            me,
            Self::config(),
            StdRng::seed_from_u64(seed),
            PostcardCodec,
            handler,
        );
        Self {
            foca,
            runtime: AccumulatingRuntime::new(),
            inbox,
        }
    }

    /// SWIM tuned for a small LAN mesh: every member is probed about once a second, a silent one
    /// is suspected within a probe period and declared down 1.2 s later, so a dead member leaves
    /// everyone's list in about 2-3 s (the target is 5 s). A falsely suspected member refutes
    /// the suspicion in that window.
    ///
    /// Coming back: a member declared down while alive (a partition, a throttled link) is told so
    /// (`notify_down_members`) when it next speaks, renews its identity ([`Member`]'s `renew`) and
    /// is let in again. It speaks again because the daemon announces to every linked peer that is
    /// not a member ([`Gossip::announce_if_absent`], each second), and foca itself announces to
    /// down members every few seconds, which it remembers for 10 minutes.
    pub fn config() -> foca::Config {
        let mut config = foca::Config::new_lan(std::num::NonZeroU32::MIN.saturating_add(7));
        config.probe_period = Duration::from_millis(500);
        config.probe_rtt = Duration::from_millis(200);
        config.suspect_to_down_after = Duration::from_millis(1200);
        config.remove_down_after = Some(Duration::from_secs(600));
        config.notify_down_members = true;
        config.periodic_announce_to_down_members = Some(foca::PeriodicParams {
            frequency: Duration::from_secs(3),
            num_members: NonZeroUsize::new(2).unwrap_or(NonZeroUsize::MIN),
        });
        config.max_transmissions = NonZeroU8::new(6).unwrap_or(NonZeroU8::MIN);
        // Updates also travel with every probe; gossiping each 0.5 s keeps a slow link quiet.
        config.periodic_gossip = Some(foca::PeriodicParams {
            frequency: Duration::from_millis(500),
            num_members: NonZeroUsize::new(3).unwrap_or(NonZeroUsize::MIN),
        });
        config.max_packet_size = NonZeroUsize::new(MAX_PACKET).unwrap_or(NonZeroUsize::MIN);
        config.periodic_announce = Some(foca::PeriodicParams {
            frequency: Duration::from_secs(5),
            num_members: NonZeroUsize::MIN,
        });
        config
    }

    /// Asks `peer` to let us in (after its connection is authenticated).
    pub fn announce(&mut self, peer: PeerId) -> Result<(), GossipError> {
        // foca routes by id only; the run number of the destination does not matter.
        self.foca
            .announce(Member { id: peer, boot: 0 }, &mut self.runtime)?;
        Ok(())
    }

    /// Announces to `peer` unless it is an active member already; returns whether it did. The daemon
    /// calls this for every peer it has a link to, so a member dropped while its link stayed up
    /// (a throttled or briefly cut link) comes back as soon as packets flow again.
    pub fn announce_if_absent(&mut self, peer: PeerId) -> Result<bool, GossipError> {
        if self.is_active(&peer) {
            return Ok(false);
        }
        self.announce(peer)?;
        Ok(true)
    }

    /// Feeds a packet that arrived over the authenticated link to `from`; refuses packets whose
    /// sender field names anyone else (a member must not speak for another).
    pub fn handle_data_from(&mut self, from: PeerId, data: &[u8]) -> Result<(), GossipError> {
        let header = foca::Codec::<Member>::decode_header(&mut PostcardCodec, data)
            .map_err(GossipError::Decode)?;
        if header.src.id != from {
            return Err(GossipError::Spoofed {
                claimed: header.src.id,
                link: from,
            });
        }
        self.handle_data(data)
    }

    /// Feeds a packet received from a member.
    pub fn handle_data(&mut self, data: &[u8]) -> Result<(), GossipError> {
        self.foca.handle_data(data, &mut self.runtime)?;
        Ok(())
    }

    /// Feeds a timer that came due.
    pub fn handle_timer(&mut self, timer: Timer<Member>) -> Result<(), GossipError> {
        self.foca.handle_timer(timer, &mut self.runtime)?;
        Ok(())
    }

    /// Disseminates our own state (call on change and periodically, so newcomers get it).
    pub fn publish(&mut self, state: &PeerState) -> Result<(), GossipError> {
        let data = postcard::to_allocvec(state).map_err(GossipError::Encode)?;
        self.foca.add_broadcast(&data)?;
        Ok(())
    }

    /// Tells the members we are leaving (graceful shutdown).
    pub fn leave(&mut self) -> Result<(), GossipError> {
        self.foca.leave_cluster(&mut self.runtime)?;
        Ok(())
    }

    /// Whether `peer` is currently an active (alive or suspect) member.
    pub fn is_active(&self, peer: &PeerId) -> bool {
        self.foca
            .iter_members()
            .any(|member| member.id().id == *peer)
    }

    /// The next thing to do, or `None` when drained; call after every `handle_*`.
    pub fn poll(&mut self) -> Option<Output> {
        if let Some((to, data)) = self.runtime.to_send() {
            return Some(Output::Send(to.id, data));
        }
        if let Some((after, timer)) = self.runtime.to_schedule() {
            return Some(Output::Schedule(after, timer));
        }
        while let Some(notification) = self.runtime.to_notify() {
            match notification {
                OwnedNotification::MemberUp(member) => return Some(Output::Up(member)),
                OwnedNotification::MemberDown(member) => return Some(Output::Down(member)),
                OwnedNotification::Rename(old, new) => {
                    debug!(peer = %new.id, old = old.boot, new = new.boot, "member restarted");
                }
                other => trace!(?other, "foca notification"),
            }
        }
        let mut inbox = self.inbox.lock().unwrap_or_else(PoisonError::into_inner);
        inbox.received.pop_front().map(Output::State)
    }
}

impl std::fmt::Debug for Gossip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gossip")
            .field("me", self.foca.identity())
            .finish_non_exhaustive()
    }
}

/// Foca failed to handle input (a malformed packet, an oversized broadcast).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GossipError {
    /// A packet did not decode.
    #[error("malformed gossip packet")]
    Decode(#[source] postcard::Error),
    /// A packet on the link to one peer claimed to come from another.
    #[error("gossip packet on the link to {link} claims to come from {claimed}")]
    Spoofed { claimed: PeerId, link: PeerId },
    /// Our own state could not be encoded.
    #[error("cannot encode peer state")]
    Encode(#[source] postcard::Error),
    /// foca refused the input.
    #[error("gossip state machine refused the input")]
    Foca(#[from] foca::Error),
}

/// Decides which received states are news (and so worth passing on) and queues them for
/// [`Gossip::poll`].
struct StateBroadcasts {
    inbox: Arc<Mutex<Inbox>>,
}

struct Inbox {
    me: PeerId,
    latest: HashMap<PeerId, (u64, u64)>,
    received: VecDeque<PeerState>,
}

impl BroadcastHandler<Member> for StateBroadcasts {
    type Key = StateKey;
    type Error = postcard::Error;

    fn receive_item(
        &mut self,
        data: &[u8],
        sender: Option<&Member>,
    ) -> Result<Option<StateKey>, postcard::Error> {
        let mut state: PeerState = postcard::from_bytes(data)?;
        // Another peer's figures: checked before anyone keeps or shows them.
        state.sanitize();
        let key = StateKey {
            id: state.id,
            version: (state.boot, state.version),
        };
        let mut inbox = self.inbox.lock().unwrap_or_else(PoisonError::into_inner);
        if sender.is_none() {
            // Our own state: always (re)disseminate it.
            inbox.latest.insert(key.id, key.version);
            return Ok(Some(key));
        }
        if key.id == inbox.me {
            return Ok(None);
        }
        match inbox.latest.get(&key.id) {
            Some(seen) if *seen > key.version => Ok(None),
            Some(seen) if *seen == key.version => {
                // Not news (so not passed on again), but proof that the peer is still
                // publishing: the view keeps it fresh.
                inbox.received.push_back(state);
                Ok(None)
            }
            _ => {
                inbox.latest.insert(key.id, key.version);
                inbox.received.push_back(state);
                Ok(Some(key))
            }
        }
    }
}

/// Identifies one version of one peer's state; a later version stops the dissemination of
/// earlier ones.
struct StateKey {
    id: PeerId,
    version: (u64, u64),
}

impl Invalidates for StateKey {
    fn invalidates(&self, other: &Self) -> bool {
        self.id == other.id && self.version >= other.version
    }
}

/// Fits a QUIC datagram on any path (quinn's minimum MTU is 1200 bytes, minus headers).
const MAX_PACKET: usize = 1100;

#[cfg(test)]
mod tests {
    use std::cmp::Reverse;
    use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

    use super::*;
    use crate::state::tests::state;

    /// An in-memory network of Gossip instances with a virtual clock.
    struct Sim {
        now: Duration,
        nodes: BTreeMap<PeerId, Node>,
        timers: BinaryHeap<Reverse<(Duration, u64, PeerId)>>,
        pending: HashMap<u64, Timer<Member>>,
        next_timer: u64,
        wire: VecDeque<(PeerId, PeerId, Bytes)>,
        /// Nodes cut off from everyone (packets to and from them are lost).
        cut: BTreeSet<PeerId>,
    }

    struct Node {
        gossip: Gossip,
        alive: bool,
        up: BTreeSet<PeerId>,
        states: BTreeMap<PeerId, PeerState>,
    }

    impl Sim {
        fn new(n: u8) -> Self {
            let mut sim = Self {
                now: Duration::ZERO,
                nodes: BTreeMap::new(),
                timers: BinaryHeap::new(),
                pending: HashMap::new(),
                next_timer: 0,
                wire: VecDeque::new(),
                cut: BTreeSet::new(),
            };
            for i in 1..=n {
                let id = PeerId::from_bytes([i; 16]);
                let gossip = Gossip::new(Member { id, boot: 1 }, u64::from(i));
                sim.nodes.insert(
                    id,
                    Node {
                        gossip,
                        alive: true,
                        up: BTreeSet::new(),
                        states: BTreeMap::new(),
                    },
                );
            }
            sim
        }

        fn id(i: u8) -> PeerId {
            PeerId::from_bytes([i; 16])
        }

        fn drain(&mut self, id: PeerId) {
            let Some(node) = self.nodes.get_mut(&id) else {
                return;
            };
            while let Some(output) = node.gossip.poll() {
                match output {
                    Output::Send(to, data) => self.wire.push_back((id, to, data)),
                    Output::Schedule(after, timer) => {
                        self.next_timer += 1;
                        self.pending.insert(self.next_timer, timer);
                        self.timers
                            .push(Reverse((self.now + after, self.next_timer, id)));
                    }
                    Output::Up(member) => {
                        node.up.insert(member.id);
                    }
                    Output::Down(member) => {
                        node.up.remove(&member.id);
                        node.states.remove(&member.id);
                    }
                    Output::State(state) => {
                        node.states.insert(state.id, state);
                    }
                }
            }
        }

        fn deliver(&mut self) {
            while let Some((from, to, data)) = self.wire.pop_front() {
                if self.cut.contains(&from) || self.cut.contains(&to) {
                    continue;
                }
                let node = self.nodes.get_mut(&to).unwrap();
                if node.alive {
                    node.gossip.handle_data(&data).unwrap();
                    self.drain(to);
                }
            }
        }

        /// Runs the virtual clock forward to `until`, delivering packets instantly.
        fn run_until(&mut self, until: Duration) {
            self.deliver();
            while let Some(Reverse((due, _, _))) = self.timers.peek() {
                if *due > until {
                    break;
                }
                let Reverse((due, token, id)) = self.timers.pop().unwrap();
                self.now = due;
                let timer = self.pending.remove(&token).unwrap();
                let node = self.nodes.get_mut(&id).unwrap();
                if node.alive {
                    node.gossip.handle_timer(timer).unwrap();
                    self.drain(id);
                    self.deliver();
                }
            }
            self.now = until;
        }

        fn publish(&mut self, i: u8, version: u64) {
            let id = Self::id(i);
            let mut own = state(i, 1, version);
            own.id = id;
            self.nodes
                .get_mut(&id)
                .unwrap()
                .gossip
                .publish(&own)
                .unwrap();
            self.drain(id);
        }

        /// Nodes 2..=n announce themselves to node 1 (as if they found it by mDNS).
        fn join_through_first(&mut self, n: u8) {
            for i in 2..=n {
                let id = Self::id(i);
                self.nodes
                    .get_mut(&id)
                    .unwrap()
                    .gossip
                    .announce(Self::id(1))
                    .unwrap();
                self.drain(id);
            }
        }
    }

    #[test]
    fn members_converge_and_a_dead_one_is_declared_down_within_5s() {
        let mut sim = Sim::new(4);
        // Node 1 is everyone's contact (as if found by mDNS); all publish a state.
        sim.join_through_first(4);
        for i in 1..=4 {
            sim.publish(i, 1);
        }
        sim.run_until(Duration::from_secs(3));
        for i in 1..=4u8 {
            let node = &sim.nodes[&Sim::id(i)];
            let others: BTreeSet<PeerId> = (1..=4).filter(|j| *j != i).map(Sim::id).collect();
            assert_eq!(node.up, others, "node {i} membership");
            assert_eq!(
                node.states.keys().copied().collect::<BTreeSet<_>>(),
                others,
                "node {i} states"
            );
        }

        // A newer state spreads; a stale one does not replace it.
        sim.publish(2, 5);
        sim.run_until(Duration::from_secs(4));
        for i in [1, 3, 4] {
            assert_eq!(
                sim.nodes[&Sim::id(i)].states[&Sim::id(2)].version,
                5,
                "node {i}"
            );
        }

        // Node 4 dies (no leave message): all others declare it down within 5 s.
        sim.nodes.get_mut(&Sim::id(4)).unwrap().alive = false;
        let died = sim.now;
        sim.run_until(died + Duration::from_secs(5));
        for i in 1..=3 {
            let node = &sim.nodes[&Sim::id(i)];
            assert!(!node.up.contains(&Sim::id(4)), "node {i} still sees node 4");
            assert!(!node.states.contains_key(&Sim::id(4)));
            assert!(node.gossip.is_active(&Sim::id(if i == 1 { 2 } else { 1 })));
        }
    }

    #[test]
    fn republished_states_are_reported_again_but_not_passed_on() {
        let mut sim = Sim::new(2);
        let (id1, id2) = (Sim::id(1), Sim::id(2));
        sim.nodes
            .get_mut(&id2)
            .unwrap()
            .gossip
            .announce(id1)
            .unwrap();
        sim.drain(id2);
        sim.run_until(Duration::from_secs(1));
        let mut seen = 0;
        for round in 0..3 {
            sim.publish(2, 7);
            sim.run_until(Duration::from_secs(2 + round));
            let node = sim.nodes.get_mut(&id1).unwrap();
            // Node 1 reports the repeat (the Sim driver stores it again).
            if node.states.remove(&id2).is_some() {
                seen += 1;
            }
        }
        assert_eq!(seen, 3, "each re-publication refreshes the receiver");
        // An older version is never reported.
        let mut old = state(2, 1, 3);
        old.id = id2;
        let data = postcard::to_allocvec(&old).unwrap();
        let mut handler = StateBroadcasts {
            inbox: sim.nodes[&id1].gossip.inbox.clone(),
        };
        let sender = Member { id: id2, boot: 1 };
        assert!(
            handler
                .receive_item(&data, Some(&sender))
                .unwrap()
                .is_none()
        );
        assert!(sim.nodes.get_mut(&id1).unwrap().gossip.poll().is_none());
    }

    #[test]
    fn a_leaving_member_is_dropped_at_once() {
        let mut sim = Sim::new(3);
        sim.join_through_first(3);
        sim.run_until(Duration::from_secs(2));
        assert_eq!(sim.nodes[&Sim::id(1)].up.len(), 2);
        let id3 = Sim::id(3);
        sim.nodes.get_mut(&id3).unwrap().gossip.leave().unwrap();
        sim.drain(id3);
        sim.deliver();
        sim.nodes.get_mut(&id3).unwrap().alive = false;
        sim.run_until(sim.now + Duration::from_millis(500));
        assert!(!sim.nodes[&Sim::id(1)].up.contains(&id3));
        assert!(!sim.nodes[&Sim::id(2)].up.contains(&id3));
    }

    /// What the daemon does each second: announce to every linked peer that is not a member.
    fn reannounce_over_links(sim: &mut Sim, n: u8) {
        for i in 1..=n {
            let id = Sim::id(i);
            for j in (1..=n).filter(|j| *j != i) {
                let node = sim.nodes.get_mut(&id).unwrap();
                if node.alive {
                    node.gossip.announce_if_absent(Sim::id(j)).unwrap();
                }
            }
            sim.drain(id);
        }
    }

    #[test]
    fn a_member_cut_off_long_enough_to_be_declared_down_comes_back_within_seconds() {
        let mut sim = Sim::new(3);
        sim.join_through_first(3);
        for i in 1..=3 {
            sim.publish(i, 1);
        }
        sim.run_until(Duration::from_secs(3));
        let id3 = Sim::id(3);
        assert!(sim.nodes[&Sim::id(1)].up.contains(&id3));

        // Cut node 3 off for 8 s (its links stay up: the daemon keeps announcing over them).
        sim.cut.insert(id3);
        let mut now = sim.now;
        let healed = now + Duration::from_secs(8);
        while now < healed {
            now += Duration::from_secs(1);
            sim.run_until(now);
            reannounce_over_links(&mut sim, 3);
        }
        assert!(
            !sim.nodes[&Sim::id(1)].up.contains(&id3),
            "declared down while cut off"
        );
        assert!(
            sim.nodes[&id3].up.is_empty(),
            "node 3 declared the others down"
        );

        // Healed: back in every list within 3 s, states included.
        sim.cut.clear();
        let mut back = None;
        while now < healed + Duration::from_secs(10) {
            now += Duration::from_millis(250);
            sim.run_until(now);
            if (now - healed).as_millis().is_multiple_of(1000) {
                reannounce_over_links(&mut sim, 3);
                for i in 1..=3 {
                    sim.publish(i, 2);
                }
            }
            let all_up = (1..=3u8).all(|i| sim.nodes[&Sim::id(i)].up.len() == 2);
            if all_up && back.is_none() {
                back = Some(now - healed);
            }
        }
        let back = back.expect("node 3 never came back");
        assert!(back <= Duration::from_secs(3), "came back after {back:?}");
        assert!(sim.nodes[&Sim::id(1)].states.contains_key(&id3));
        assert!(sim.nodes[&id3].states.contains_key(&Sim::id(1)));
    }

    #[test]
    fn garbage_packets_are_errors_not_panics() {
        let mut gossip = Gossip::new(
            Member {
                id: Sim::id(1),
                boot: 1,
            },
            1,
        );
        assert!(gossip.handle_data(&[0xff; 64]).is_err());
        assert!(gossip.handle_data(&[]).is_err());
        assert!(gossip.handle_data(&vec![0; 5000]).is_err());
        assert!(matches!(
            gossip.handle_data_from(Sim::id(2), &[0xff; 3]),
            Err(GossipError::Decode(_))
        ));
    }

    #[test]
    fn a_member_cannot_speak_for_another() {
        let mut a = Gossip::new(
            Member {
                id: Sim::id(1),
                boot: 1,
            },
            1,
        );
        let mut b = Gossip::new(
            Member {
                id: Sim::id(2),
                boot: 1,
            },
            2,
        );
        b.announce(Sim::id(1)).unwrap();
        let Some(Output::Send(to, packet)) = b.poll() else {
            panic!("no announce")
        };
        assert_eq!(to, Sim::id(1));
        // Arriving over the link to peer 3, B's packet is refused; over B's own link it is fine.
        let err = a.handle_data_from(Sim::id(3), &packet).unwrap_err();
        assert!(matches!(err, GossipError::Spoofed { .. }), "{err}");
        a.handle_data_from(Sim::id(2), &packet).unwrap();
        assert!(std::iter::from_fn(|| a.poll()).any(|out| out
            == Output::Up(Member {
                id: Sim::id(2),
                boot: 1
            })));
    }
}
