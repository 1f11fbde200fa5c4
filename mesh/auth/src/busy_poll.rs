//! Keeping the thread that drives a session's connections awake through its round trips.
//!
//! A tokio runtime with nothing to run sleeps in `epoll_wait`. A datagram that arrives then waits for the
//! kernel to wake the thread, and a task woken from another thread (a request handed to quinn by the
//! application's thread, a reply by the session's executor) waits for an eventfd to do the same: a few
//! microseconds each from a shallow idle state, tens from a deep one. A synchronous round trip pays this
//! at every hop, on both ends. On the development machine a bare quinn round trip took 72-98 µs with its
//! runtimes sleeping and 34-63 µs with them polling; on an H100 host, Gleam's synchronous round trip
//! took 66 µs with both ends sleeping and 30 µs with both polling (measured with this module's first
//! policy, which also polled through bursts).
//!
//! [`BusyPoll`] keeps a runtime polling instead, only while a round trip is under way: its
//! [`BusyPoll::run`] task yields in a loop (each yield makes the runtime poll its sockets with a zero
//! timeout) while it is *hot*, and sleeps otherwise. It is hot while a [`Hold`] lives (the client: a
//! thread spinning for its reply) and for the linger after the last [`BusyPoll::touch`] or hold (the
//! serving side: [`ANSWER_LINGER`] after each answer, so a synchronizing client's next request finds it
//! awake). This is CUDA's own choice for a synchronizing thread, spinning on hosts with cores to spare,
//! applied to the thread that carries the bytes. `GLEAM_BUSY_POLL=off` turns it off ([`enabled`]).
//!
//! It stays cold through a burst of fire-and-forget calls, where nothing waits for it: a thread that
//! sleeps through a burst wakes to a batch of datagrams and frames and handles them together, where a
//! polling one would handle each as it comes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// How long the serving side keeps polling after an answer: a synchronizing client's turnaround (its
/// half of the round trip and the application's work between two calls) on a fast LAN or loopback, short
/// enough that a burst of launches after a synchronization finds the thread cold within it.
pub const ANSWER_LINGER: Duration = Duration::from_micros(250);

/// Keeps one tokio runtime polling its sockets while a round trip is under way (see the module doc).
#[derive(Debug)]
pub struct BusyPoll {
    /// Off: never hot, nothing polls.
    on: bool,
    origin: Instant,
    /// How long the runtime stays hot after the last touch or hold.
    linger: Duration,
    /// Until when (nanoseconds after `origin`) the runtime stays hot without a hold.
    until: AtomicU64,
    /// Holds alive.
    holds: AtomicUsize,
    /// Wakes the polling task when the runtime turns hot.
    wake: Notify,
}

/// Keeps a [`BusyPoll`] hot until dropped, then for its linger.
#[derive(Debug)]
#[must_use = "the runtime stays hot only while the hold lives"]
pub struct Hold(Arc<BusyPoll>);

impl BusyPoll {
    /// A busy poll that stays hot for `linger` after each touch or hold (zero: only while held).
    pub fn new(linger: Duration) -> Arc<Self> {
        Self::with(true, linger)
    }

    /// As configured for threads that spin `spin` for their replies: off where they do not spin (hosts
    /// with few cores) or `GLEAM_BUSY_POLL` says so ([`enabled`]), else [`BusyPoll::new`]`(linger)`.
    pub fn beside_spinning(spin: Duration, linger: Duration) -> Arc<Self> {
        if spin.is_zero() || !enabled() {
            Self::off()
        } else {
            Self::new(linger)
        }
    }

    /// One that never polls.
    pub fn off() -> Arc<Self> {
        Self::with(false, Duration::ZERO)
    }

    fn with(on: bool, linger: Duration) -> Arc<Self> {
        Arc::new(Self {
            on,
            origin: Instant::now(),
            linger,
            until: AtomicU64::new(0),
            holds: AtomicUsize::new(0),
            wake: Notify::new(),
        })
    }

    /// Whether it ever polls.
    pub fn is_on(&self) -> bool {
        self.on
    }

    /// Keeps the runtime hot for the linger from now. Costs a clock read and an atomic when already hot.
    pub fn touch(&self) {
        if !self.is_on() {
            return;
        }
        let now = self.now();
        let was = self
            .until
            .fetch_max(now + nanos(self.linger), Ordering::AcqRel);
        if was <= now && self.holds.load(Ordering::Acquire) == 0 {
            self.wake.notify_one();
        }
    }

    /// Keeps the runtime hot until the hold is dropped (and for the linger after); `None` when off.
    pub fn hold(self: &Arc<Self>) -> Option<Hold> {
        if !self.is_on() {
            return None;
        }
        if self.holds.fetch_add(1, Ordering::AcqRel) == 0
            && self.until.load(Ordering::Acquire) <= self.now()
        {
            self.wake.notify_one();
        }
        Some(Hold(self.clone()))
    }

    /// Whether the runtime should poll rather than sleep now.
    pub fn is_hot(&self) -> bool {
        self.holds.load(Ordering::Acquire) > 0 || self.now() < self.until.load(Ordering::Acquire)
    }

    /// The polling task, spawned once on the runtime it keeps awake: yields while hot, sleeps while
    /// cold. Returns at once when off; otherwise runs until the runtime drops it.
    pub async fn run(self: Arc<Self>) {
        if !self.is_on() {
            return;
        }
        loop {
            while self.is_hot() {
                tokio::task::yield_now().await;
            }
            // Registered before looking again, so a touch between the look and the wait still wakes it.
            let cold = self.wake.notified();
            let mut cold = std::pin::pin!(cold);
            cold.as_mut().enable();
            if !self.is_hot() {
                cold.await;
            }
        }
    }

    fn now(&self) -> u64 {
        nanos(self.origin.elapsed())
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        // The linger starts before the hold goes, so the runtime is never cold in between.
        let poll = &self.0;
        poll.until
            .fetch_max(poll.now() + nanos(poll.linger), Ordering::AcqRel);
        poll.holds.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Whether busy polling is wanted: not when `GLEAM_BUSY_POLL` is `off` (or `0`, `false`, `no`).
pub fn enabled() -> bool {
    !matches!(
        std::env::var("GLEAM_BUSY_POLL")
            .map(|v| v.trim().to_ascii_lowercase())
            .as_deref(),
        Ok("off" | "0" | "false" | "no")
    )
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU time of the calling thread.
    fn thread_cpu() -> Duration {
        // SAFETY: getrusage fills the struct it is given.
        let usage = unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &raw mut usage);
            usage
        };
        let time = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec.unsigned_abs())
                + Duration::from_micros(t.tv_usec.unsigned_abs())
        };
        time(usage.ru_utime) + time(usage.ru_stime)
    }

    /// The CPU time the runtime's (this) thread takes over `wait`, while this task sleeps in it.
    async fn cpu_over(wait: Duration) -> Duration {
        let before = thread_cpu();
        tokio::time::sleep(wait).await;
        thread_cpu().saturating_sub(before)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_runtime_polls_while_held_or_lingering_and_sleeps_otherwise() {
        let window = Duration::from_millis(100);
        let poll = BusyPoll::new(Duration::from_millis(20));
        tokio::spawn(poll.clone().run());
        assert!(!poll.is_hot(), "cold before any touch or hold");
        let idle = cpu_over(window).await;
        assert!(
            idle < window / 10,
            "a cold runtime sleeps: {idle:?} of CPU in {window:?}"
        );

        let hold = poll.hold().expect("a linger turns it on");
        let held = cpu_over(window).await;
        // Polling takes the thread's time (most of it, less on a loaded machine).
        assert!(
            held > window / 10,
            "a held runtime polls: {held:?} of CPU in {window:?}"
        );
        assert!(poll.is_hot(), "a hold outlives the linger");
        drop(hold);
        assert!(poll.is_hot(), "the linger follows the hold");
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(!poll.is_hot(), "cold once the linger passed");
        let after = cpu_over(window).await;
        assert!(
            after < window / 10,
            "it sleeps again: {after:?} of CPU in {window:?}"
        );

        poll.touch();
        assert!(poll.is_hot(), "a touch turns it hot for the linger");
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(!poll.is_hot());
    }

    #[test]
    fn off_is_never_hot() {
        let poll = BusyPoll::off();
        assert!(!poll.is_on());
        assert!(poll.hold().is_none());
        poll.touch();
        assert!(!poll.is_hot());
    }

    #[test]
    fn a_zero_linger_is_hot_only_while_held() {
        let poll = BusyPoll::new(Duration::ZERO);
        poll.touch();
        assert!(!poll.is_hot(), "a touch without linger keeps nothing awake");
        let hold = poll.hold().expect("on");
        assert!(poll.is_hot());
        drop(hold);
        assert!(!poll.is_hot());
    }
}
