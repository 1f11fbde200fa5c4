//! Target `link`: what a linked peer sends on a mesh link besides gossip, and what the daemon does with
//! it: link messages (a uni stream after `TAG_LINK`, a postcard [`LinkMessage`]) and the answers to this
//! daemon's bandwidth probes, which go through [`probe::parse_reply`] into the link's [`Prober`] with
//! timings as the network would make them (an answer may take up to the daemon's 2 s probe timeout).
//!
//! The input is a sequence of steps (`kind` byte, then its arguments):
//! `0`: time passes (u16 ms); `1`: the daemon asks the prober whether to probe; `2`: the probe in flight
//! ends with a 24-byte answer, an elapsed time, the RTT and its cost (or fails, when none is in flight);
//! `3`: traffic measured at a u64 rate; `4`: a link message (u8 length, bytes).
//!
//! The prober must not panic on any answer, must size every probe within [`MIN_PROBE`]..=[`MAX_PROBE`],
//! and must never start a probe while one is in flight.

use std::time::{Duration, Instant};

use gleam_mesh::duplicate::LinkMessage;
use gleam_mesh::probe::{self, MAX_PROBE, MIN_PROBE, Prober};

/// The daemon gives up on a probe after this long.
const PROBE_TIMEOUT_MS: u64 = 2000;

/// Runs one input. Panics only on a bug.
pub fn run(data: &[u8]) {
    let mut now = Instant::now();
    let mut prober = Prober::new(now, Duration::from_secs(1), Duration::from_secs(1));
    let mut in_flight: Option<u32> = None;
    let mut input = Input(data);
    while let Some(kind) = input.u8() {
        match kind % 5 {
            0 => {
                let Some(ms) = input.u16() else { break };
                now += Duration::from_millis(u64::from(ms));
            }
            1 => {
                if let Some(size) = prober.poll_probe(now) {
                    assert!(
                        in_flight.is_none(),
                        "a probe started while one was in flight"
                    );
                    assert!(
                        (MIN_PROBE..=MAX_PROBE).contains(&size),
                        "probe of {size} bytes"
                    );
                    in_flight = Some(size);
                }
            }
            2 => {
                let (Some(reply), Some(elapsed), Some(rtt)) =
                    (input.array::<24>(), input.u16(), input.u16())
                else {
                    break;
                };
                let Some(size) = in_flight.take() else {
                    continue;
                };
                // The answer came `elapsed` ms after the start (at most the timeout), the connection's
                // RTT was `rtt` (a quarter of a millisecond each), the whole exchange cost `elapsed`.
                let elapsed = Duration::from_millis(u64::from(elapsed) % (PROBE_TIMEOUT_MS + 1));
                let rtt = Duration::from_micros(u64::from(rtt) * 250);
                now += elapsed;
                let report = probe::parse_reply(&reply, size, elapsed, rtt).ok();
                prober.on_probe_done(now, report, elapsed);
            }
            3 => {
                let Some(bps) = input.array::<8>() else { break };
                prober.on_traffic(now, u64::from_le_bytes(bps));
            }
            _ => {
                let Some(len) = input.u8() else { break };
                let Some(bytes) = input.take(usize::from(len)) else {
                    break;
                };
                if let Ok(message) = postcard::from_bytes::<LinkMessage>(bytes) {
                    // What the daemon does with one beyond bookkeeping: say it (the addresses end up
                    // in a log line and in `gleam peers list`).
                    let _ = format!("{message:?}");
                }
            }
        }
    }
}

struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn u8(&mut self) -> Option<u8> {
        self.array::<1>().map(|[b]| b)
    }

    fn u16(&mut self) -> Option<u16> {
        self.array::<2>().map(u16::from_le_bytes)
    }
}
