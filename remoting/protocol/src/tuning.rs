//! How a thread that waits for the other end of a session waits: the client waiting for a reply, the
//! session process waiting for the next request.

use std::sync::OnceLock;
use std::time::Duration;

/// Default of [`spin_budget`]: a LAN round trip (up to a millisecond or so) with margin, so a thread
/// waiting for a reply over the LAN, or a session waiting for a synchronizing client's next request,
/// stays awake.
const DEFAULT_SPIN: Duration = Duration::from_millis(2);
/// Hosts with fewer cores do not spin by default.
const SPIN_MIN_CORES: usize = 4;

/// How long a waiting thread spins before parking: `GLEAM_SPIN_US` microseconds if set, else
/// [`DEFAULT_SPIN`] on hosts with at least [`SPIN_MIN_CORES`] cores and none on smaller ones, where a
/// spinning thread would take the core that the awaited reply needs (CUDA's own "auto" scheduling makes
/// the same choice).
///
/// Waking a parked thread costs microseconds, far more from a deep idle state: with one millisecond
/// between requests, every hop of a round trip would pay it.
pub fn spin_budget() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        let configured = std::env::var("GLEAM_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok());
        match configured {
            Some(us) => Duration::from_micros(us.min(1_000_000)),
            None => {
                let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
                if cores >= SPIN_MIN_CORES {
                    DEFAULT_SPIN
                } else {
                    Duration::ZERO
                }
            }
        }
    })
}
