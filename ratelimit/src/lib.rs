//! `gleam-ratelimit`: bounds what a peer logs about network input.
//!
//! A peer logs a warning when a client or another device does something wrong (a request before `Hello`,
//! a failed mesh proof...). Logged once per event, a hostile or broken sender decides how much the peer
//! writes: 200,000 requests before `Hello` once wrote 31 MB of warnings. A [`RateLimit`] lets the first
//! `burst` events of each `interval` through and counts the rest; the first event let through after a
//! suppressed stretch carries that count, and [`RateLimit::take_suppressed`] hands over what is left for a
//! final summary (at the end of a session, say). So a flood costs at most `burst` lines per interval.
//!
//! ```
//! use std::time::Duration;
//! use gleam_ratelimit::RateLimit;
//!
//! static REFUSED: RateLimit = RateLimit::new(10, Duration::from_secs(60));
//!
//! fn refuse(peer: &str) {
//!     if let Some(suppressed) = REFUSED.admit() {
//!         // tracing::warn!(peer, suppressed, "refusing peer");
//!         let _ = (peer, suppressed);
//!     }
//! }
//! # refuse("p");
//! ```
//!
//! No IO and no clock of its own beyond [`Instant::now`]; [`RateLimit::admit_at`] takes the time for tests.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Lets the first `burst` events of every `interval` through; counts the others.
#[derive(Debug)]
pub struct RateLimit {
    burst: u32,
    interval: Duration,
    window: Mutex<Option<Window>>,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    /// When the current interval began (at the first event after the previous one ended).
    start: Instant,
    /// Events let through in it.
    admitted: u32,
    /// Events suppressed and not yet reported.
    suppressed: u64,
}

impl RateLimit {
    /// A limit of `burst` events per `interval` (a `burst` of 0 suppresses everything: only counts).
    pub const fn new(burst: u32, interval: Duration) -> Self {
        Self {
            burst,
            interval,
            window: Mutex::new(None),
        }
    }

    /// One event now: `Some(n)` if it should be logged, `n` being the events suppressed since the last one
    /// logged (include it in the message when non-zero); `None` if it should not.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    /// [`RateLimit::admit`] at time `now` (never earlier than a previous call's).
    pub fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut window = self.lock();
        let current = match &mut *window {
            Some(w) if now.saturating_duration_since(w.start) < self.interval => w,
            other => {
                let suppressed = other.map_or(0, |w| w.suppressed);
                other.insert(Window {
                    start: now,
                    admitted: 0,
                    suppressed,
                })
            }
        };
        if current.admitted < self.burst {
            current.admitted += 1;
            Some(std::mem::take(&mut current.suppressed))
        } else {
            current.suppressed += 1;
            None
        }
    }

    /// The events suppressed and not yet reported (reported now: the count starts again from 0).
    pub fn take_suppressed(&self) -> u64 {
        self.lock()
            .as_mut()
            .map_or(0, |w| std::mem::take(&mut w.suppressed))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Window>> {
        // The state is two counters: a panic elsewhere cannot leave it inconsistent.
        self.window.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn the_first_burst_passes_then_a_count_then_a_summary() {
        let limit = RateLimit::new(3, MINUTE);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(limit.admit_at(at(0)), Some(0));
        assert_eq!(limit.admit_at(at(1)), Some(0));
        assert_eq!(limit.admit_at(at(2)), Some(0));
        for s in 3..1003 {
            assert_eq!(limit.admit_at(at(s % 60)), None);
        }
        // A new interval: the first event carries the count of the suppressed ones.
        assert_eq!(limit.admit_at(at(61)), Some(1000));
        assert_eq!(limit.admit_at(at(62)), Some(0));
        assert_eq!(limit.admit_at(at(63)), Some(0));
        assert_eq!(limit.admit_at(at(64)), None);
        assert_eq!(limit.admit_at(at(65)), None);
        // What is left goes to a final summary, once.
        assert_eq!(limit.take_suppressed(), 2);
        assert_eq!(limit.take_suppressed(), 0);
        // A quiet stretch longer than the interval starts afresh.
        assert_eq!(limit.admit_at(at(1000)), Some(0));
    }

    #[test]
    fn a_flood_costs_at_most_burst_lines_per_interval() {
        let limit = RateLimit::new(10, Duration::from_secs(1));
        let t0 = Instant::now();
        let mut logged = 0;
        let mut counted = 0;
        // 200,000 events over 10 seconds.
        for i in 0..200_000u64 {
            if let Some(suppressed) = limit.admit_at(t0 + Duration::from_micros(i * 50)) {
                logged += 1;
                counted += suppressed;
            }
        }
        counted += limit.take_suppressed();
        assert!(logged <= 10 * 10, "{logged} lines");
        assert_eq!(logged + counted, 200_000, "every event logged or counted");
    }

    #[test]
    fn zero_burst_only_counts() {
        let limit = RateLimit::new(0, MINUTE);
        for _ in 0..5 {
            assert_eq!(limit.admit(), None);
        }
        assert_eq!(limit.take_suppressed(), 5);
    }

    #[test]
    fn usable_as_a_static_from_many_threads() {
        static LIMIT: RateLimit = RateLimit::new(5, MINUTE);
        let admitted: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| (0..100).filter(|_| LIMIT.admit().is_some()).count()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, 5);
        assert_eq!(LIMIT.take_suppressed(), 395);
    }
}
