//! The bound on host bytes held by queued copies.
//!
//! An asynchronous host-to-device copy returns at once, but its bytes must wait in the session's memory
//! until its stream reaches it. A stream can be held for long (behind slow kernels, a host function, a
//! wait on a memory value), so without a bound a client could make the peer hold any amount of memory.
//! [`CopyBacklog`] counts the bytes of the copies queued and not yet run; a copy that would take the count
//! over the budget waits for earlier ones to run, as a real driver's asynchronous copy from pageable
//! memory waits for staging space. If none runs for [`CopyBacklog::stall`] (the stream is held by
//! something the client would only release later), the copy is refused with
//! `CUDA_ERROR_OUT_OF_MEMORY` and a logged reason rather than waiting forever.
//!
//! A copy larger than the whole budget is let in once nothing else is queued: the bound is
//! `max(budget, one copy)`, and one copy is bounded by the wire's frame limit.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use gleam_protocol::types::CUresult;

/// Host bytes queued in copies, bounded.
#[derive(Debug)]
pub struct CopyBacklog {
    budget: u64,
    stall: Duration,
    state: Mutex<State>,
    ran: Condvar,
}

#[derive(Debug, Default)]
struct State {
    held: u64,
    /// Copies that ran (or were dropped) so far: progress, which resets a waiting copy's stall clock.
    released: u64,
}

/// One queued copy's share of the backlog, given back when dropped (the copy ran, or was skipped).
#[derive(Debug)]
pub struct Admission {
    backlog: Arc<CopyBacklog>,
    bytes: u64,
}

impl CopyBacklog {
    /// A backlog of at most `budget` bytes, whose copies give up after `stall` without progress.
    pub fn new(budget: u64, stall: Duration) -> Arc<Self> {
        Arc::new(Self {
            budget,
            stall,
            state: Mutex::new(State::default()),
            ran: Condvar::new(),
        })
    }

    /// The bytes queued now.
    pub fn held(&self) -> u64 {
        self.lock().held
    }

    /// Takes room for a copy of `bytes`, waiting while the backlog is full. `abandoned` is looked at as
    /// it waits: when it says so (the session ended, or a fault skips queued work) the wait ends with
    /// its error.
    pub fn admit(
        self: &Arc<Self>,
        bytes: u64,
        abandoned: impl Fn() -> Option<CUresult>,
    ) -> Result<Admission, CUresult> {
        let mut state = self.lock();
        let mut progress = (state.released, Instant::now());
        loop {
            let fits = state.held.saturating_add(bytes) <= self.budget || state.held == 0;
            if fits {
                state.held += bytes;
                return Ok(Admission {
                    backlog: self.clone(),
                    bytes,
                });
            }
            if let Some(err) = abandoned() {
                return Err(err);
            }
            if state.released != progress.0 {
                progress = (state.released, Instant::now());
            }
            let waited = progress.1.elapsed();
            if waited >= self.stall {
                tracing::warn!(
                    queued = state.held,
                    budget = self.budget,
                    bytes,
                    "an asynchronous copy refused: its stream holds {} MiB of queued copies and none \
                     ran for {:?} (raise GLEAM_EMU_QUEUED_COPY_BYTES if the program means it)",
                    state.held >> 20,
                    self.stall
                );
                return Err(CUresult::OUT_OF_MEMORY);
            }
            // Wake now and then to look at `abandoned` too.
            let nap = (self.stall - waited).min(Duration::from_millis(50));
            state = self
                .ran
                .wait_timeout(state, nap)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut state = self.backlog.lock();
        state.held -= self.bytes;
        state.released += 1;
        drop(state);
        self.backlog.ran.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_wait_for_room_and_give_up_without_progress() {
        let backlog = CopyBacklog::new(100, Duration::from_millis(200));
        let first = backlog.admit(60, || None).unwrap();
        let second = backlog.admit(40, || None).unwrap();
        assert_eq!(backlog.held(), 100);
        // Full, and nothing runs: refused after the stall.
        let started = Instant::now();
        assert_eq!(
            backlog.admit(1, || None).unwrap_err(),
            CUresult::OUT_OF_MEMORY
        );
        assert!(started.elapsed() >= Duration::from_millis(200));
        // One runs while the third waits: it gets in.
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(first);
        });
        let third = backlog.admit(50, || None).unwrap();
        releaser.join().unwrap();
        assert_eq!(backlog.held(), 90);
        drop((second, third));
        assert_eq!(backlog.held(), 0);
        // Larger than the budget: in once alone.
        let big = backlog.admit(1000, || None).unwrap();
        assert_eq!(backlog.held(), 1000);
        drop(big);
        // An abandoned session stops the wait at once.
        let _held = backlog.admit(100, || None).unwrap();
        let started = Instant::now();
        assert_eq!(
            backlog
                .admit(1, || Some(CUresult::LAUNCH_FAILED))
                .unwrap_err(),
            CUresult::LAUNCH_FAILED
        );
        assert!(started.elapsed() < Duration::from_millis(150));
    }
}
