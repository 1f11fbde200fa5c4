//! What each peer tells the mesh about itself ([`PeerState`]) and the local view of everyone's
//! state ([`MeshView`]). Both are sans-IO: time comes in as a parameter.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use gleam_auth::identity::PeerId;

/// The version of Gleam's mesh protocol (mDNS TXT `v`, gossip state).
pub const PROTOCOL_VERSION: u32 = 1;

/// One peer's versioned state, disseminated through foca's custom broadcasts.
///
/// A state replaces another of the same peer when its `(boot, version)` is greater: `boot`
/// identifies the daemon run, `version` bumps on every change within a run.
#[derive(Clone, Debug, Deserialize, PartialEq, Serialize)]
pub struct PeerState {
    /// Whose state this is.
    pub id: PeerId,
    /// The daemon run (its start time in ms since the Unix epoch).
    pub boot: u64,
    /// Bumped on every change within a run.
    pub version: u64,
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol: u32,
    /// Human-readable host name (display only).
    pub host: String,
    /// Addresses the peer can be reached at (its QUIC port included).
    pub addrs: Vec<SocketAddr>,
    /// The peer's GPUs (empty when it serves none).
    pub gpus: Vec<GpuSummary>,
    /// Current load.
    pub load: Load,
    /// What the peer has cached.
    pub cache: CacheDigest,
    /// The peer's measurements of its links to other peers.
    pub links: Vec<LinkReport>,
}

impl PeerState {
    /// Whether `self` replaces `other` (same peer, later run or later version).
    pub fn is_newer_than(&self, other: &Self) -> bool {
        (self.boot, self.version) > (other.boot, other.version)
    }

    /// Total GPU memory over all GPUs, in bytes (saturating: the figures come from other peers, and a
    /// hostile one's overflowing sum once panicked `gleam peers list`, found by the `gossip` fuzz target).
    pub fn total_memory(&self) -> u64 {
        self.gpus
            .iter()
            .fold(0u64, |sum, gpu| sum.saturating_add(gpu.total_memory))
    }

    /// Caps variable-length fields so an encoded state always fits one gossip packet.
    pub fn truncate_to_limits(&mut self) {
        truncate_chars(&mut self.host, MAX_TEXT);
        self.addrs.truncate(MAX_ADDRS);
        self.gpus.truncate(MAX_GPUS);
        for gpu in &mut self.gpus {
            truncate_chars(&mut gpu.model, MAX_TEXT);
        }
        self.links.truncate(MAX_LINKS);
    }

    /// Makes a state another peer sent safe to keep and to show: within the limits of
    /// [`Self::truncate_to_limits`], and with figures JSON can carry and the policy can use (a NaN
    /// utilization once made every `gleam peers list` answer undecodable): utilization and loss within
    /// 0..=1, a job time finite and not negative, anything else 0 (unknown).
    pub fn sanitize(&mut self) {
        self.truncate_to_limits();
        self.load.utilization = fraction(self.load.utilization);
        if !(self.load.mean_job_secs.is_finite() && self.load.mean_job_secs >= 0.0) {
            self.load.mean_job_secs = 0.0;
        }
        for link in &mut self.links {
            link.quality.loss = fraction(link.quality.loss);
        }
    }
}

/// `x` within 0..=1 (NaN: 0).
fn fraction(x: f32) -> f32 {
    if x.is_nan() { 0.0 } else { x.clamp(0.0, 1.0) }
}

/// Static facts about one GPU.
#[derive(Clone, Debug, Deserialize, PartialEq, Serialize)]
pub struct GpuSummary {
    /// Marketing name, e.g. "NVIDIA H200".
    pub model: String,
    /// Device memory in bytes.
    pub total_memory: u64,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// True for Gleam's emulated device (no real GPU behind it).
    pub emulated: bool,
}

/// How busy a peer is.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Serialize)]
pub struct Load {
    /// GPU utilization, 0.0 to 1.0.
    pub utilization: f32,
    /// Free device memory over all GPUs, in bytes.
    pub free_memory: u64,
    /// CUDA sessions being served now.
    pub active_sessions: u32,
    /// Jobs waiting for the GPU.
    pub queue_len: u32,
    /// Mean duration of recent sessions, in seconds (0 when unknown).
    pub mean_job_secs: f32,
}

/// A summary of a peer's content cache, enough to tell whether two caches differ and how much
/// they hold.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Serialize)]
pub struct CacheDigest {
    /// Number of cached objects.
    pub entries: u64,
    /// Bytes cached.
    pub bytes: u64,
    /// Hash over the sorted content addresses (all zero when empty or unknown); hex text in JSON.
    #[serde(with = "hex_bytes")]
    pub digest: [u8; 16],
}

/// `[u8; 16]` as 32 hex digits in human-readable formats (JSON), raw bytes in compact ones (postcard).
mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(bytes: &[u8; 16], serializer: S) -> Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            serializer.serialize_str(&text)
        } else {
            serde::Serialize::serialize(bytes, serializer)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<[u8; 16], D::Error> {
        if !deserializer.is_human_readable() {
            return <[u8; 16]>::deserialize(deserializer);
        }
        let text = String::deserialize(deserializer)?;
        let mut out = [0u8; 16];
        if text.len() != 32 || !text.is_ascii() {
            return Err(D::Error::custom("expected 32 hex digits"));
        }
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
                .map_err(|_| D::Error::custom("expected 32 hex digits"))?;
        }
        Ok(out)
    }
}

/// One peer's measurement of its link to another.
#[derive(Clone, Debug, Deserialize, PartialEq, Serialize)]
pub struct LinkReport {
    /// The other end.
    pub peer: PeerId,
    /// Quality as measured by the reporting peer.
    pub quality: LinkQuality,
}

/// Measured quality of a link, from QUIC statistics and bandwidth probes.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Serialize)]
pub struct LinkQuality {
    /// Smoothed round-trip time in microseconds.
    pub rtt_us: u32,
    /// Bandwidth from the last probe, in bits per second (0 when not measured yet).
    pub bandwidth_bps: u64,
    /// Fraction of packets lost recently, 0.0 to 1.0.
    pub loss: f32,
}

/// The local view of the mesh: the latest state of every live member.
///
/// Membership (up/down) comes from foca; states come from broadcasts. A member whose state has
/// not been refreshed for [`MeshView::STALE_AFTER`] is dropped too, as a safety net.
#[derive(Debug, Default)]
pub struct MeshView {
    peers: BTreeMap<PeerId, ViewEntry>,
}

#[derive(Debug)]
struct ViewEntry {
    state: PeerState,
    updated: Instant,
}

impl MeshView {
    /// A member that sent nothing new for this long is dropped (states are re-broadcast every
    /// second, so this only triggers when foca missed a failure).
    pub const STALE_AFTER: Duration = Duration::from_secs(10);

    /// Applies a received state; returns whether it was news.
    pub fn apply(&mut self, state: PeerState, now: Instant) -> bool {
        match self.peers.get_mut(&state.id) {
            Some(entry) if !state.is_newer_than(&entry.state) => {
                // Same or older: still proves the peer is alive.
                if state == entry.state {
                    entry.updated = now;
                }
                false
            }
            Some(entry) => {
                *entry = ViewEntry {
                    state,
                    updated: now,
                };
                true
            }
            None => {
                self.peers.insert(
                    state.id,
                    ViewEntry {
                        state,
                        updated: now,
                    },
                );
                true
            }
        }
    }

    /// Forgets a member (foca declared it down, or it left).
    pub fn remove(&mut self, id: &PeerId) -> Option<PeerState> {
        self.peers.remove(id).map(|entry| entry.state)
    }

    /// Drops members not refreshed within [`Self::STALE_AFTER`]; returns their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<PeerId> {
        let stale: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(_, entry)| now.saturating_duration_since(entry.updated) > Self::STALE_AFTER)
            .map(|(id, _)| *id)
            .collect();
        for id in &stale {
            self.peers.remove(id);
        }
        stale
    }

    /// The state of one member.
    pub fn state(&self, id: &PeerId) -> Option<&PeerState> {
        self.peers.get(id).map(|entry| &entry.state)
    }

    /// All known states, ordered by peer id.
    pub fn states(&self) -> impl Iterator<Item = &PeerState> {
        self.peers.values().map(|entry| &entry.state)
    }

    /// The (boot, version) last seen of a peer.
    pub fn version_of(&self, id: &PeerId) -> Option<(u64, u64)> {
        self.state(id).map(|state| (state.boot, state.version))
    }
}

fn truncate_chars(text: &mut String, max: usize) {
    if let Some((index, _)) = text.char_indices().nth(max) {
        text.truncate(index);
    }
}

const MAX_ADDRS: usize = 8;
const MAX_GPUS: usize = 8;
const MAX_LINKS: usize = 16;
const MAX_TEXT: usize = 48;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn state(id: u8, boot: u64, version: u64) -> PeerState {
        PeerState {
            id: PeerId::from_bytes([id; 16]),
            boot,
            version,
            protocol: PROTOCOL_VERSION,
            host: format!("host{id}"),
            addrs: vec![SocketAddr::from(([10, 0, 0, id], 4747))],
            gpus: vec![GpuSummary {
                model: "NVIDIA H200".into(),
                total_memory: 141 << 30,
                compute_capability: (9, 0),
                emulated: false,
            }],
            load: Load {
                free_memory: 100 << 30,
                ..Load::default()
            },
            cache: CacheDigest::default(),
            links: Vec::new(),
        }
    }

    #[test]
    fn total_memory_saturates_on_hostile_figures() {
        let mut s = state(1, 1, 1);
        s.gpus.push(s.gpus[0].clone());
        s.gpus[1].total_memory = u64::MAX;
        assert_eq!(s.total_memory(), u64::MAX);
    }

    #[test]
    fn newer_versions_replace_older_ones_and_restarts_win() {
        let t0 = Instant::now();
        let mut view = MeshView::default();
        assert!(view.apply(state(1, 100, 5), t0));
        assert!(!view.apply(state(1, 100, 4), t0), "older version");
        assert!(!view.apply(state(1, 100, 5), t0), "same version");
        assert!(view.apply(state(1, 100, 6), t0));
        assert!(
            view.apply(state(1, 200, 0), t0),
            "a restart beats any version of the old run"
        );
        assert!(!view.apply(state(1, 100, 99), t0), "the old run is gone");
        assert_eq!(
            view.version_of(&PeerId::from_bytes([1; 16])),
            Some((200, 0))
        );
        assert_eq!(view.states().count(), 1);
    }

    #[test]
    fn stale_members_expire_on_a_virtual_clock() {
        let t0 = Instant::now();
        let mut view = MeshView::default();
        view.apply(state(1, 1, 1), t0);
        view.apply(state(2, 1, 1), t0);
        // Peer 2 keeps re-broadcasting the same state; peer 1 goes silent.
        let later = t0 + MeshView::STALE_AFTER / 2;
        view.apply(state(2, 1, 1), later);
        assert!(view.expire(later).is_empty());
        let expired = view.expire(t0 + MeshView::STALE_AFTER + Duration::from_millis(1));
        assert_eq!(expired, vec![PeerId::from_bytes([1; 16])]);
        assert_eq!(
            view.states().map(|s| s.id).collect::<Vec<_>>(),
            vec![PeerId::from_bytes([2; 16])]
        );
        assert!(view.remove(&PeerId::from_bytes([2; 16])).is_some());
        assert_eq!(view.states().count(), 0);
    }

    #[test]
    fn cache_digests_are_hex_in_json_and_bytes_in_gossip() {
        let mut digest = [0u8; 16];
        digest[0] = 0xab;
        digest[15] = 0x01;
        let cache = CacheDigest {
            entries: 2,
            bytes: 26,
            digest,
        };
        let json = serde_json::to_value(&cache).unwrap();
        assert_eq!(json["digest"], "ab000000000000000000000000000001");
        assert_eq!(serde_json::from_value::<CacheDigest>(json).unwrap(), cache);
        let bin = postcard::to_allocvec(&cache).unwrap();
        assert_eq!(postcard::from_bytes::<CacheDigest>(&bin).unwrap(), cache);
        assert!(bin.len() < 24, "{} bytes", bin.len());
        assert!(
            serde_json::from_str::<CacheDigest>(r#"{"entries":0,"bytes":0,"digest":"xyz"}"#)
                .is_err()
        );
    }

    #[test]
    fn sanitized_states_carry_only_figures_json_can_hold() {
        let mut s = state(7, 1, 1);
        s.load.utilization = f32::NAN;
        s.load.mean_job_secs = f32::NEG_INFINITY;
        s.links = vec![LinkReport {
            peer: PeerId::from_bytes([1; 16]),
            quality: LinkQuality {
                rtt_us: 1,
                bandwidth_bps: 1,
                loss: f32::INFINITY,
            },
        }];
        s.sanitize();
        assert_eq!(s.load.utilization, 0.0);
        assert_eq!(s.load.mean_job_secs, 0.0);
        assert_eq!(s.links[0].quality.loss, 1.0);
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<PeerState>(&json).unwrap(), s);
    }

    #[test]
    fn truncated_state_fits_a_gossip_packet() {
        let mut big = state(7, 1, 1);
        big.host = "h".repeat(1000);
        big.gpus = vec![big.gpus[0].clone(); 20];
        big.addrs = vec![SocketAddr::from(([0xfe80, 0, 0, 0, 0, 0, 0, 1], 4747)); 30];
        big.links = (0..100u8)
            .map(|i| LinkReport {
                peer: PeerId::from_bytes([i; 16]),
                quality: LinkQuality {
                    rtt_us: u32::MAX,
                    bandwidth_bps: u64::MAX,
                    loss: 1.0,
                },
            })
            .collect();
        big.truncate_to_limits();
        let encoded = postcard::to_allocvec(&big).unwrap();
        assert!(encoded.len() <= 1000, "{} bytes", encoded.len());
    }
}
