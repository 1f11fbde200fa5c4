//! Which peer should run a job: the one with the smallest expected completion time.
//!
//! Pure policy (sans-IO): [`choose`] takes candidates and a [`JobHint`] and returns a decision.
//! Expected completion = transfer (bytes / bandwidth + RTT) + queue (queue length x mean job
//! time) + compute (the hint, stretched by the GPU's current utilization).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use gleam_auth::identity::PeerId;

/// What the caller knows about the job it wants to place.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Serialize)]
pub struct JobHint {
    /// Bytes the job will move between client and peer (weights, inputs, outputs).
    pub bytes: u64,
    /// Seconds the job would take on an idle GPU.
    pub compute_secs: f64,
    /// Device memory it needs, in bytes (0 when unknown).
    pub memory: u64,
}

impl Default for JobHint {
    fn default() -> Self {
        Self {
            bytes: 64 << 20,
            compute_secs: 1.0,
            memory: 0,
        }
    }
}

/// One peer as the policy sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// The peer.
    pub id: PeerId,
    /// Whether it serves a GPU (real or emulated) at all.
    pub has_gpu: bool,
    /// Whether its only GPUs are Gleam's emulated device (kernels interpreted on the CPU).
    pub emulated: bool,
    /// Round-trip time from here; `None` when not connected.
    pub rtt: Option<Duration>,
    /// Probed bandwidth from here in bits per second; `None` when not measured yet.
    pub bandwidth_bps: Option<u64>,
    /// Recent loss fraction on the link.
    pub loss: f64,
    /// GPU utilization, 0.0 to 1.0.
    pub utilization: f64,
    /// Free device memory in bytes.
    pub free_memory: u64,
    /// Jobs waiting for its GPU.
    pub queue_len: u32,
    /// Mean job duration there, in seconds (0 when unknown).
    pub mean_job_secs: f64,
}

/// The chosen peer and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// The winner.
    pub id: PeerId,
    /// Its expected completion time.
    pub expected: Duration,
}

/// Picks the candidate with the smallest [`expected_completion`]; ties go to the lower RTT,
/// then the lower id, so the result is deterministic.
pub fn choose(candidates: &[Candidate], hint: &JobHint) -> Option<Choice> {
    candidates
        .iter()
        .filter_map(|candidate| {
            let expected = expected_completion(candidate, hint)?;
            Some((
                expected,
                candidate.rtt.unwrap_or(Duration::MAX),
                candidate.id,
            ))
        })
        .min()
        .map(|(expected, _, id)| Choice { id, expected })
}

/// The expected completion time of `hint` on `candidate`, or `None` when it cannot run there
/// (no GPU, not reachable, not enough free memory).
pub fn expected_completion(candidate: &Candidate, hint: &JobHint) -> Option<Duration> {
    let rtt = candidate.rtt?;
    if !candidate.has_gpu || (hint.memory > 0 && candidate.free_memory < hint.memory) {
        return None;
    }
    let bandwidth = candidate
        .bandwidth_bps
        .filter(|bps| *bps > 0)
        .unwrap_or(UNMEASURED_BPS) as f64;
    // Lost packets are resent: goodput shrinks with the loss rate.
    let goodput = bandwidth * (1.0 - candidate.loss.clamp(0.0, 0.9));
    let transfer = hint.bytes as f64 * 8.0 / goodput + rtt.as_secs_f64();
    let mean_job = match candidate.mean_job_secs {
        secs if secs > 0.0 => secs,
        _ => hint.compute_secs,
    };
    let queue = f64::from(candidate.queue_len) * mean_job;
    let idle_share = (1.0 - candidate.utilization.clamp(0.0, 1.0)).max(MIN_IDLE_SHARE);
    let slowdown = if candidate.emulated {
        EMULATION_SLOWDOWN
    } else {
        1.0
    };
    let compute = hint.compute_secs.max(0.0) * slowdown / idle_share;
    Duration::try_from_secs_f64(transfer + queue + compute).ok()
}

/// Assumed bandwidth before the first probe: pessimistic, so measured links win ties.
const UNMEASURED_BPS: u64 = 100_000_000;
/// How much longer a job takes on the emulated device than on a real GPU: the PTX interpreter runs a few
/// hundred million thread-instructions per second, a GPU some hundred billion. Any real GPU beats it.
const EMULATION_SLOWDOWN: f64 = 1000.0;
/// A fully busy GPU still gives a job some share (time slicing).
const MIN_IDLE_SHARE: f64 = 0.05;

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(id: u8) -> Candidate {
        Candidate {
            id: PeerId::from_bytes([id; 16]),
            has_gpu: true,
            emulated: false,
            rtt: Some(Duration::from_micros(500)),
            bandwidth_bps: Some(10_000_000_000),
            loss: 0.0,
            utilization: 0.0,
            free_memory: 80 << 30,
            queue_len: 0,
            mean_job_secs: 0.0,
        }
    }

    #[test]
    fn faster_link_wins_for_big_transfers() {
        let mut slow = candidate(1);
        slow.bandwidth_bps = Some(20_000_000);
        let fast = candidate(2);
        let hint = JobHint {
            bytes: 100 << 20,
            compute_secs: 1.0,
            memory: 0,
        };
        let choice = choose(&[slow.clone(), fast.clone()], &hint).unwrap();
        assert_eq!(choice.id, fast.id);
        // 100 MiB at 10 Gbit/s ~ 84 ms, plus 1 s compute.
        let expected = choice.expected.as_secs_f64();
        assert!((expected - 1.0844).abs() < 0.01, "{expected}");
        // Over 20 Mbit/s the transfer alone is ~42 s.
        let slow_time = expected_completion(&slow, &hint).unwrap().as_secs_f64();
        assert!(slow_time > 40.0, "{slow_time}");
    }

    #[test]
    fn busy_or_queued_peers_lose_to_idle_ones_on_compute_heavy_jobs() {
        let mut busy = candidate(1);
        busy.utilization = 0.9;
        let mut queued = candidate(2);
        queued.queue_len = 3;
        queued.mean_job_secs = 2.0;
        let idle = candidate(3);
        let hint = JobHint {
            bytes: 1 << 20,
            compute_secs: 5.0,
            memory: 0,
        };
        assert_eq!(
            choose(&[busy.clone(), queued.clone(), idle.clone()], &hint)
                .unwrap()
                .id,
            idle.id
        );
        // Busy: 5 s / 0.1 idle share = 50 s; queued: 6 s queue + 5 s.
        let busy_time = expected_completion(&busy, &hint).unwrap().as_secs_f64();
        let queued_time = expected_completion(&queued, &hint).unwrap().as_secs_f64();
        assert!((busy_time - 50.0).abs() < 0.1, "{busy_time}");
        assert!((queued_time - 11.0).abs() < 0.1, "{queued_time}");
        assert_eq!(
            choose(&[busy, queued.clone()], &hint).unwrap().id,
            queued.id
        );
    }

    #[test]
    fn ineligible_peers_are_skipped() {
        let mut no_gpu = candidate(1);
        no_gpu.has_gpu = false;
        let mut unreachable = candidate(2);
        unreachable.rtt = None;
        let mut small = candidate(3);
        small.free_memory = 1 << 30;
        let hint = JobHint {
            memory: 8 << 30,
            ..JobHint::default()
        };
        assert_eq!(choose(&[no_gpu, unreachable, small.clone()], &hint), None);
        assert_eq!(
            choose(&[small.clone()], &JobHint::default()).unwrap().id,
            small.id
        );
        assert_eq!(choose(&[], &hint), None);
    }

    #[test]
    fn unmeasured_links_are_pessimistic_and_ties_break_on_rtt_then_id() {
        let mut unmeasured = candidate(1);
        unmeasured.bandwidth_bps = None;
        let measured = candidate(2);
        assert_eq!(
            choose(&[unmeasured, measured.clone()], &JobHint::default())
                .unwrap()
                .id,
            measured.id
        );

        let a = candidate(5);
        let mut b = candidate(4);
        b.rtt = Some(Duration::from_micros(400));
        // b's lower RTT also lowers its time, so it wins.
        assert_eq!(
            choose(&[a.clone(), b.clone()], &JobHint::default())
                .unwrap()
                .id,
            b.id
        );
        let c = candidate(3);
        assert_eq!(
            choose(&[a, c.clone()], &JobHint::default()).unwrap().id,
            c.id,
            "equal: lower id"
        );
    }

    #[test]
    fn a_real_gpu_far_away_beats_an_emulated_one_nearby() {
        let mut near = candidate(1);
        near.emulated = true;
        near.rtt = Some(Duration::from_micros(50));
        near.bandwidth_bps = Some(4_000_000_000);
        let mut far = candidate(2);
        far.rtt = Some(Duration::from_millis(5));
        far.bandwidth_bps = Some(100_000_000);
        let choice = choose(&[near, far.clone()], &JobHint::default()).unwrap();
        assert_eq!(choice.id, far.id);
    }
}
