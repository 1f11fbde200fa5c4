//! Where each peer can be reached, and when to dial it next (sans-IO: time comes in).
//!
//! A peer's addresses come from several places, each kept apart so one can change without losing the
//! others: mDNS (scoped link-local addresses included: mDNS knows the interface it heard them on),
//! `--seed`, and the peer's own gossiped state (whose link-local addresses arrive without an interface
//! and are expanded to every local interface that could reach them, see
//! [`gleam_auth::target::with_scopes`]). The address that last answered a dial, or that the peer's link
//! came from, is tried first next time ([`AddrBook::addrs`]).
//!
//! Dials that fail back off (0.5 s doubling to 2 s), so a peer that comes back is found within seconds.
//! A peer that refuses us (another mesh) is retried rarely (30 s doubling to 10 min), and only its first
//! refusal is worth a warning ([`RefusalLog`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gleam_auth::PeerId;
use gleam_auth::target::with_scopes;
use gleam_ratelimit::RateLimit;

/// Every address known of every peer, with dial pacing.
#[derive(Debug, Default)]
pub struct AddrBook {
    peers: HashMap<PeerId, Known>,
}

#[derive(Debug, Default)]
struct Known {
    mdns: Vec<SocketAddr>,
    seeds: Vec<SocketAddr>,
    gossip: Vec<SocketAddr>,
    /// What the peer's own state said (before scope expansion), to notice changes cheaply.
    gossip_raw: Vec<SocketAddr>,
    /// The address that last worked (dial winner or the source of an accepted link).
    good: Option<SocketAddr>,
    failures: u32,
    refusals: u32,
    next_dial: Option<Instant>,
    /// When the peer last answered (a link came up) or a source vouched for it.
    seen: Option<Instant>,
    /// Addresses where another device presented this peer's identity (see `duplicate`): never dialled.
    shunned: Vec<std::net::IpAddr>,
}

/// How a dial ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DialOutcome {
    /// A link came up through this address.
    Connected(SocketAddr),
    /// No address answered.
    Failed,
    /// The peer answered but is not in our mesh (or refused us).
    Refused,
    /// The peer answered but another device already holds its identity in the mesh.
    Duplicate,
}

impl AddrBook {
    /// mDNS advertises `peer` at `addrs` (replacing what mDNS said before).
    pub fn learn_mdns(&mut self, peer: PeerId, addrs: Vec<SocketAddr>, now: Instant) -> bool {
        let known = self.peers.entry(peer).or_default();
        known.seen = Some(now);
        let changed = known.mdns != addrs;
        if changed {
            known.mdns = addrs;
            known.fresh();
        }
        changed
    }

    /// mDNS withdrew `peer` (goodbye or expiry): its mDNS addresses go; the peer stays known while
    /// other sources name it.
    pub fn forget_mdns(&mut self, peer: &PeerId) {
        if let Some(known) = self.peers.get_mut(peer) {
            known.mdns.clear();
            if known.is_empty() {
                self.peers.remove(peer);
            }
        }
    }

    /// A `--seed` address (kept for the daemon's lifetime).
    pub fn learn_seed(&mut self, peer: PeerId, addrs: Vec<SocketAddr>) {
        let known = self.peers.entry(peer).or_default();
        for addr in addrs {
            if !known.seeds.contains(&addr) {
                known.seeds.push(addr);
            }
        }
    }

    /// The addresses `peer` gossips for itself; link-local ones are expanded to our interfaces.
    pub fn learn_gossip(&mut self, peer: PeerId, addrs: &[SocketAddr], now: Instant) -> bool {
        let known = self.peers.entry(peer).or_default();
        known.seen = Some(now);
        if known.gossip_raw == addrs {
            return false;
        }
        known.gossip_raw = addrs.to_vec();
        known.gossip = addrs.iter().copied().flat_map(with_scopes).collect();
        known.fresh();
        true
    }

    /// Every address of `peer`, best first: the one that worked last, then mDNS, seeds, gossip.
    pub fn addrs(&self, peer: &PeerId) -> Vec<SocketAddr> {
        self.collect(peer, true)
    }

    /// The addresses of `peer` that something authenticated vouches for: the one that worked last,
    /// seeds (the user's), and what mesh members gossip over their authenticated links. Not mDNS:
    /// anyone on the LAN can advertise any id there (a copied config directory does), so while a link
    /// to the peer is up such a claim is neither shown nor handed out to clients.
    pub fn vouched_addrs(&self, peer: &PeerId) -> Vec<SocketAddr> {
        self.collect(peer, false)
    }

    fn collect(&self, peer: &PeerId, with_mdns: bool) -> Vec<SocketAddr> {
        let Some(known) = self.peers.get(peer) else {
            return Vec::new();
        };
        let mut out: Vec<SocketAddr> = Vec::new();
        let mdns: &[SocketAddr] = if with_mdns { &known.mdns } else { &[] };
        let all = known
            .good
            .iter()
            .chain(mdns)
            .chain(&known.seeds)
            .chain(&known.gossip);
        for addr in all {
            let shunned = known.shunned.contains(&addr.ip());
            if !out.contains(addr) && dialable(addr) && !shunned {
                out.push(*addr);
            }
        }
        out
    }

    /// Whether anything is known of `peer`.
    pub fn contains(&self, peer: &PeerId) -> bool {
        self.peers.contains_key(peer)
    }

    /// Peers with an address whose next dial is due, apart from those `skip` rejects (linked, dialling).
    pub fn due(&self, now: Instant, mut skip: impl FnMut(&PeerId) -> bool) -> Vec<PeerId> {
        let mut due: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(peer, known)| {
                known.next_dial.is_none_or(|at| now >= at) && !known.is_empty() && !skip(peer)
            })
            .map(|(peer, _)| *peer)
            .collect();
        due.sort();
        due
    }

    /// A dial of `peer` starts: no other until it ends (or [`DIAL_GUARD`] passes).
    pub fn dialling(&mut self, peer: &PeerId, now: Instant) {
        if let Some(known) = self.peers.get_mut(peer) {
            known.next_dial = Some(now + DIAL_GUARD);
        }
    }

    /// A dial of `peer` ended (or a link from it came up: [`DialOutcome::Connected`]).
    pub fn dialled(&mut self, peer: PeerId, outcome: DialOutcome, now: Instant) {
        let known = self.peers.entry(peer).or_default();
        match outcome {
            DialOutcome::Connected(addr) => {
                known.shunned.retain(|ip| *ip != addr.ip());
                known.good = Some(addr);
                known.failures = 0;
                known.refusals = 0;
                known.next_dial = None;
                known.seen = Some(now);
            }
            DialOutcome::Failed => {
                known.failures = known.failures.saturating_add(1);
                let backoff = DIAL_BACKOFF * 2u32.pow(known.failures.min(3) - 1);
                known.next_dial = Some(now + backoff);
            }
            DialOutcome::Refused => {
                known.refusals = known.refusals.saturating_add(1);
                let backoff = REFUSED_BACKOFF * 2u32.pow(known.refusals.min(6) - 1);
                known.next_dial = Some(now + backoff.min(MAX_REFUSED_BACKOFF));
            }
            DialOutcome::Duplicate => known.next_dial = Some(now + DUPLICATE_BACKOFF),
        }
    }

    /// Another device presented `peer`'s identity from `ip` and was refused: do not dial `peer` there
    /// (until a link from there is accepted again, e.g. after the original left for good).
    pub fn shun(&mut self, peer: PeerId, ip: std::net::IpAddr) {
        let known = self.peers.entry(peer).or_default();
        if !known.shunned.contains(&ip) {
            known.shunned.push(ip);
        }
        if known.good.is_some_and(|good| good.ip() == ip) {
            known.good = None;
        }
    }

    /// The link to `peer` went down: dial again soon (the next dial is the judge of whether it is back).
    pub fn link_lost(&mut self, peer: &PeerId, now: Instant) {
        if let Some(known) = self.peers.get_mut(peer) {
            known.next_dial = Some(known.next_dial.map_or(now, |at| at.max(now)));
        }
    }

    /// Forgets peers no source has vouched for within [`FORGET_AFTER`] whose dials keep failing (only
    /// the address of an old link, or an old gossip, names them); returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<PeerId> {
        let stale: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(_, known)| {
                known.mdns.is_empty()
                    && known.seeds.is_empty()
                    && known.failures > 0
                    && known
                        .seen
                        .is_none_or(|seen| now.saturating_duration_since(seen) > FORGET_AFTER)
            })
            .map(|(peer, _)| *peer)
            .collect();
        for peer in &stale {
            self.peers.remove(peer);
        }
        stale
    }
}

impl Known {
    /// New addresses: dial them now rather than after the backoff of the old ones.
    fn fresh(&mut self) {
        self.failures = 0;
        if self.refusals == 0 {
            self.next_dial = None;
        }
    }

    fn is_empty(&self) -> bool {
        self.mdns.is_empty()
            && self.seeds.is_empty()
            && self.gossip.is_empty()
            && self.good.is_none()
    }
}

/// A link-local IPv6 address without its interface cannot be dialled (the kernel would not know
/// which link to use).
fn dialable(addr: &SocketAddr) -> bool {
    match addr {
        SocketAddr::V6(v6) => !(gleam_auth::target::needs_scope(v6.ip()) && v6.scope_id() == 0),
        SocketAddr::V4(_) => true,
    }
}

/// Logs a peer's refusals (another mesh, a duplicate identity) once loudly and then quietly: a device of
/// another mesh on the same LAN must not fill the log forever. Shared by the accept loop and the actor.
///
/// Anyone who can reach the port can present a fresh identity per connection, so "once per peer" alone
/// bounds nothing: the peers remembered are capped ([`MAX_REMEMBERED`]) and all warnings together are
/// rate-limited ([`REFUSAL_WARNINGS`] per [`REFUSAL_INTERVAL`]; the rest are counted in the next one).
#[derive(Debug)]
pub struct RefusalLog {
    warned: Mutex<HashMap<PeerId, Instant>>,
    flood: RateLimit,
}

impl Default for RefusalLog {
    fn default() -> Self {
        Self {
            warned: Mutex::default(),
            flood: RateLimit::new(REFUSAL_WARNINGS, REFUSAL_INTERVAL),
        }
    }
}

impl RefusalLog {
    /// Whether this refusal of `peer` deserves a warning: the first one, and then one per
    /// [`REWARN_AFTER`], within the overall budget.
    pub fn should_warn(&self, peer: PeerId, now: Instant) -> bool {
        let mut warned = self
            .warned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if warned
            .get(&peer)
            .is_some_and(|at| now.saturating_duration_since(*at) < REWARN_AFTER)
        {
            return false;
        }
        if warned.len() >= MAX_REMEMBERED {
            warned.retain(|_, at| now.saturating_duration_since(*at) < REWARN_AFTER);
            if warned.len() >= MAX_REMEMBERED {
                // A flood of identities: forgetting them costs at most a repeated (rate-limited) warning.
                warned.clear();
            }
        }
        warned.insert(peer, now);
        drop(warned);
        match self.flood.admit_at(now) {
            Some(0) => true,
            Some(suppressed) => {
                tracing::warn!(
                    suppressed,
                    "refusal warnings about {suppressed} other peers were not logged (too many refusals)"
                );
                true
            }
            None => false,
        }
    }
}

/// Most refusing peers remembered for [`RefusalLog`].
pub const MAX_REMEMBERED: usize = 4096;
/// Refusal warnings logged per [`REFUSAL_INTERVAL`], all peers together.
pub const REFUSAL_WARNINGS: u32 = 20;
/// See [`REFUSAL_WARNINGS`].
pub const REFUSAL_INTERVAL: Duration = Duration::from_secs(60);

/// A dial in flight blocks the next for at most this long.
pub const DIAL_GUARD: Duration = Duration::from_secs(10);
/// The first retry after a failed dial; doubles up to 4x.
pub const DIAL_BACKOFF: Duration = Duration::from_millis(500);
/// The first retry after a peer refused us (another mesh); doubles up to [`MAX_REFUSED_BACKOFF`].
pub const REFUSED_BACKOFF: Duration = Duration::from_secs(30);
/// The longest wait between dials of a peer that refuses us.
pub const MAX_REFUSED_BACKOFF: Duration = Duration::from_secs(600);
/// Retry of a peer that refused us because another device holds our identity in the mesh.
pub const DUPLICATE_BACKOFF: Duration = Duration::from_secs(10);
/// A peer named by nothing but old links and gossip, failing all that time, is forgotten after this.
pub const FORGET_AFTER: Duration = Duration::from_secs(600);
/// A refusing peer is warned about again after this long.
pub const REWARN_AFTER: Duration = Duration::from_secs(3600);

#[cfg(test)]
mod tests {
    use std::net::{Ipv6Addr, SocketAddrV6};

    use super::*;

    fn peer(i: u8) -> PeerId {
        PeerId::from_bytes([i; 16])
    }

    fn v4(last: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, last], 4747))
    }

    #[test]
    fn the_address_that_worked_comes_first_then_mdns_seeds_gossip() {
        let t0 = Instant::now();
        let mut book = AddrBook::default();
        book.learn_gossip(peer(1), &[v4(3)], t0);
        book.learn_seed(peer(1), vec![v4(2)]);
        book.learn_mdns(peer(1), vec![v4(1), v4(2)], t0);
        assert_eq!(book.addrs(&peer(1)), vec![v4(1), v4(2), v4(3)]);
        book.dialled(peer(1), DialOutcome::Connected(v4(3)), t0);
        assert_eq!(book.addrs(&peer(1)), vec![v4(3), v4(1), v4(2)]);
        // mDNS withdraws: the others remain.
        book.forget_mdns(&peer(1));
        assert_eq!(book.addrs(&peer(1)), vec![v4(3), v4(2)]);
    }

    #[test]
    fn an_mdns_claim_alone_is_not_vouched_for() {
        let t0 = Instant::now();
        let mut book = AddrBook::default();
        book.learn_gossip(peer(1), &[v4(3)], t0);
        book.learn_seed(peer(1), vec![v4(2)]);
        // A copy of peer 1's identity advertises itself at .9.
        book.learn_mdns(peer(1), vec![v4(9)], t0);
        assert_eq!(book.addrs(&peer(1)), vec![v4(9), v4(2), v4(3)]);
        assert_eq!(book.vouched_addrs(&peer(1)), vec![v4(2), v4(3)]);
        book.dialled(peer(1), DialOutcome::Connected(v4(3)), t0);
        assert_eq!(book.vouched_addrs(&peer(1)), vec![v4(3), v4(2)]);
    }

    #[test]
    fn gossiped_link_local_addresses_get_an_interface_and_bare_ones_are_never_dialled() {
        let t0 = Instant::now();
        let mut book = AddrBook::default();
        let bare = SocketAddr::V6(SocketAddrV6::new(
            "fe80::1".parse::<Ipv6Addr>().unwrap(),
            4747,
            0,
            0,
        ));
        book.learn_gossip(peer(1), &[bare, v4(1)], t0);
        let addrs = book.addrs(&peer(1));
        assert!(addrs.contains(&v4(1)));
        assert!(!addrs.contains(&bare), "{addrs:?}");
        assert!(addrs.iter().all(dialable));
        // An mDNS address with its scope is kept as it is.
        let scoped = SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().unwrap(), 4747, 0, 1));
        book.learn_mdns(peer(1), vec![scoped], t0);
        assert_eq!(book.addrs(&peer(1))[0], scoped);
    }

    #[test]
    fn failed_dials_back_off_to_2s_and_new_addresses_reset_it() {
        let t0 = Instant::now();
        let mut book = AddrBook::default();
        book.learn_mdns(peer(1), vec![v4(1)], t0);
        assert_eq!(book.due(t0, |_| false), vec![peer(1)]);
        book.dialling(&peer(1), t0);
        assert!(book.due(t0 + Duration::from_secs(1), |_| false).is_empty());
        let mut now = t0;
        let mut waits = Vec::new();
        for _ in 0..5 {
            book.dialled(peer(1), DialOutcome::Failed, now);
            let next = book.peers[&peer(1)].next_dial.unwrap();
            waits.push(next - now);
            now = next;
        }
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, vec![500, 1000, 2000, 2000, 2000]);
        book.learn_mdns(peer(1), vec![v4(2)], now);
        assert_eq!(book.due(now, |_| false), vec![peer(1)]);
        assert!(book.due(now, |p| *p == peer(1)).is_empty());
    }

    #[test]
    fn refusing_peers_are_retried_rarely_and_warned_about_once() {
        let t0 = Instant::now();
        let mut book = AddrBook::default();
        book.learn_mdns(peer(9), vec![v4(9)], t0);
        let log = RefusalLog::default();
        let mut now = t0;
        let mut warnings = 0;
        let mut dials = 0;
        // A day of an outsider on the LAN.
        while now < t0 + Duration::from_secs(86_400) {
            if book.due(now, |_| false).contains(&peer(9)) {
                dials += 1;
                book.dialled(peer(9), DialOutcome::Refused, now);
                if log.should_warn(peer(9), now) {
                    warnings += 1;
                }
                // Its periodic mDNS announcements do not reset the backoff.
                book.learn_mdns(peer(9), vec![v4(9)], now);
            }
            now += Duration::from_secs(1);
        }
        assert!((23..=25).contains(&warnings), "{warnings}: one per hour");
        // After 30, 60, 120, 240, 480 s, every 600 s.
        assert!((140..=150).contains(&dials), "{dials} dials");
    }

    #[test]
    fn a_flood_of_fresh_identities_is_warned_about_a_few_times_a_minute_in_bounded_memory() {
        let t0 = Instant::now();
        let log = RefusalLog::default();
        let mut warnings = 0u32;
        // 100,000 refusals of distinct identities over 10 minutes.
        for i in 0..100_000u32 {
            let now = t0 + Duration::from_millis(u64::from(i) * 6);
            let mut id = [0u8; 16];
            id[..4].copy_from_slice(&i.to_le_bytes());
            if log.should_warn(PeerId::from_bytes(id), now) {
                warnings += 1;
            }
            let remembered = log.warned.lock().unwrap().len();
            assert!(
                remembered <= MAX_REMEMBERED,
                "{remembered} peers remembered"
            );
        }
        assert!(
            (REFUSAL_WARNINGS * 10..=REFUSAL_WARNINGS * 11).contains(&warnings),
            "{warnings} warnings"
        );
    }

    #[test]
    fn addresses_of_a_refused_copy_are_not_dialled() {
        let t0 = Instant::now();
        let mut book = AddrBook::default();
        book.learn_mdns(peer(1), vec![v4(1), v4(2)], t0);
        book.shun(peer(1), v4(2).ip());
        assert_eq!(book.addrs(&peer(1)), vec![v4(1)]);
        book.dialled(peer(1), DialOutcome::Connected(v4(2)), t0);
        assert_eq!(book.addrs(&peer(1)), vec![v4(2), v4(1)]);
    }

    #[test]
    fn peers_only_old_links_name_are_forgotten_after_10_min_of_failures() {
        let t0 = Instant::now();
        let mut book = AddrBook::default();
        book.dialled(peer(1), DialOutcome::Connected(v4(1)), t0);
        book.learn_mdns(peer(2), vec![v4(2)], t0);
        book.dialled(peer(1), DialOutcome::Failed, t0);
        book.dialled(peer(2), DialOutcome::Failed, t0);
        assert!(book.expire(t0 + Duration::from_secs(60)).is_empty());
        assert_eq!(book.expire(t0 + FORGET_AFTER * 2), vec![peer(1)]);
        assert!(book.contains(&peer(2)), "mDNS still names it");
    }
}
