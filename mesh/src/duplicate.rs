//! Two devices with one identity (a copied config directory): noticed, reported, and settled in favour
//! of the one that was there first. Sans-IO: the daemon supplies the facts.
//!
//! Every daemon run has a [`Run`] (a random nonce and its start time), sent as the first message on each
//! mesh link ([`LinkMessage::Hello`]). When a peer already linked to id X gets a second link from X:
//!
//! * same run: a reconnection (or both sides dialled at once): the usual link rules apply;
//! * another run, and the old link no longer answers: X restarted; the new run replaces the old;
//! * another run, and the old link still answers: two devices hold X's key. The run that started first
//!   keeps the place in the mesh (every peer decides the same way), the other is refused with a
//!   [`CLOSE_DUPLICATE_ID`] close that says why, and the one kept is told ([`LinkMessage::Duplicate`]).
//!
//! Both devices log it as an error, and `gleam peers list` shows it on both.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// QUIC application close code: "another device holds this identity in the mesh".
pub const CLOSE_DUPLICATE_ID: quinn::VarInt = quinn::VarInt::from_u32(0x4741_0004);

/// One run of a daemon.
#[derive(Clone, Copy, Debug, Deserialize, Eq, Hash, PartialEq, Serialize)]
pub struct Run {
    /// Random per run: two devices never share it.
    pub nonce: u64,
    /// When the run started, ms since the Unix epoch (by its own clock).
    pub started_ms: u64,
}

impl Run {
    /// A fresh run starting at `started_ms`.
    pub fn new(started_ms: u64) -> Self {
        Self {
            nonce: rand::random(),
            started_ms,
        }
    }
}

/// What a second link from a linked peer id means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The same run: keep whichever link the link rules prefer.
    SameRun,
    /// The old run is gone: the new link replaces the old.
    Restarted,
    /// Two live runs: a duplicate identity. `keep_existing` says which one keeps the place.
    Duplicate {
        /// True: the run already linked keeps it and the newcomer is refused; false: the reverse.
        keep_existing: bool,
    },
}

/// Judges a new link from a peer id that already has a link (`existing`, which `existing_answers`
/// says still answers). A link whose run is unknown (no hello) is treated as an earlier Gleam's.
pub fn judge(existing: Option<Run>, existing_answers: bool, newcomer: Option<Run>) -> Verdict {
    match (existing, newcomer) {
        (Some(old), Some(new)) if old == new => Verdict::SameRun,
        (_, _) if !existing_answers => Verdict::Restarted,
        (Some(old), Some(new)) => Verdict::Duplicate {
            // The earlier start keeps it; at the same millisecond, the one already here.
            keep_existing: old.started_ms <= new.started_ms,
        },
        // Unknown runs cannot be told apart: the old rule (the newer link wins).
        _ => Verdict::Restarted,
    }
}

/// Control messages on a mesh link (a uni stream each, after [`TAG_LINK`]).
#[derive(Clone, Debug, Deserialize, PartialEq, Serialize)]
pub enum LinkMessage {
    /// The sender's run; the first thing on every link.
    Hello(Run),
    /// Sent to the device that keeps an identity: another device (at `addr`) presented it too and was
    /// refused.
    Duplicate {
        /// Where the refused device connected from.
        addr: SocketAddr,
    },
}

/// First byte of a uni stream carrying a [`LinkMessage`].
pub const TAG_LINK: u8 = 2;

/// Addresses among `advertised` (mDNS records under our own id) that are not this host's: another
/// device advertises our id.
pub fn foreign(advertised: &[SocketAddr], local_ips: &[std::net::IpAddr]) -> Vec<SocketAddr> {
    advertised
        .iter()
        .filter(|addr| !addr.ip().is_loopback() && !local_ips.contains(&addr.ip().to_canonical()))
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(nonce: u64, started_ms: u64) -> Option<Run> {
        Some(Run { nonce, started_ms })
    }

    #[test]
    fn the_same_run_reconnecting_is_not_a_duplicate() {
        assert_eq!(judge(run(1, 100), true, run(1, 100)), Verdict::SameRun);
        assert_eq!(judge(run(1, 100), false, run(1, 100)), Verdict::SameRun);
    }

    #[test]
    fn a_restart_replaces_the_dead_run_whatever_the_clocks_say() {
        assert_eq!(judge(run(1, 100), false, run(2, 200)), Verdict::Restarted);
        // A new run with an earlier clock (the device's clock was fixed): still a restart.
        assert_eq!(judge(run(1, 100), false, run(2, 50)), Verdict::Restarted);
        assert_eq!(judge(None, false, run(2, 50)), Verdict::Restarted);
    }

    #[test]
    fn two_live_runs_are_a_duplicate_and_the_earlier_keeps_the_identity() {
        assert_eq!(
            judge(run(1, 100), true, run(2, 200)),
            Verdict::Duplicate {
                keep_existing: true
            }
        );
        // The copy got here first (this peer restarted), but the original started earlier: every peer
        // settles on the same device.
        assert_eq!(
            judge(run(2, 200), true, run(1, 100)),
            Verdict::Duplicate {
                keep_existing: false
            }
        );
        // Same millisecond: the one already linked.
        assert_eq!(
            judge(run(2, 100), true, run(1, 100)),
            Verdict::Duplicate {
                keep_existing: true
            }
        );
        // A peer of an earlier Gleam (no hello): the newer link wins, as before.
        assert_eq!(judge(None, true, run(1, 100)), Verdict::Restarted);
    }

    #[test]
    fn our_own_id_advertised_from_elsewhere_is_foreign() {
        let local: Vec<std::net::IpAddr> =
            vec!["10.0.0.1".parse().unwrap(), "fe80::1".parse().unwrap()];
        let ours: SocketAddr = "10.0.0.1:4747".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:4747".parse().unwrap();
        let other: SocketAddr = "10.0.0.7:4747".parse().unwrap();
        let lo: SocketAddr = "127.0.0.1:4747".parse().unwrap();
        assert!(foreign(&[ours, mapped, lo], &local).is_empty());
        assert_eq!(foreign(&[ours, other], &local), vec![other]);
    }
}
