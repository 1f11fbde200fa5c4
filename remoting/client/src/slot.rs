//! Where one reply is handed from the network task to the thread waiting for it.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crate::{Answer, ClientError};

/// What a waiter receives: the reply, or why none will come.
pub(crate) type Outcome = Result<Answer, ClientError>;

/// Where one reply is handed from the reader task to the waiting thread.
///
/// The waiter spins briefly before parking: a reply usually comes back within one LAN round trip,
/// and waking a parked thread costs several microseconds more than noticing a flag (like the CUDA
/// driver, which spins in `cuCtxSynchronize` by default). Delivering to a thread that is not parked
/// costs the reader an atomic swap, no syscall.
pub(crate) struct Slot {
    state: AtomicU8,
    outcome: Mutex<Option<Outcome>>,
    /// The thread that parked waiting for this slot.
    thread: OnceLock<Thread>,
}

/// No outcome yet, nobody parked.
const SLOT_EMPTY: u8 = 0;
/// The waiter is (about to be) parked and must be unparked.
const SLOT_PARKED: u8 = 1;
/// The outcome is in place.
const SLOT_READY: u8 = 2;

impl Slot {
    pub(crate) fn new() -> Self {
        Self {
            state: AtomicU8::new(SLOT_EMPTY),
            outcome: Mutex::new(None),
            thread: OnceLock::new(),
        }
    }

    /// Hands over the outcome. Each slot is delivered at most once (by whoever takes it from the
    /// session's waiters); a second delivery is ignored.
    pub(crate) fn deliver(&self, outcome: Outcome) {
        {
            let mut slot = self
                .outcome
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if slot.is_some() {
                return;
            }
            *slot = Some(outcome);
        }
        if self.state.swap(SLOT_READY, Ordering::AcqRel) == SLOT_PARKED
            && let Some(thread) = self.thread.get()
        {
            thread.unpark();
        }
    }

    fn take(&self) -> Option<Outcome> {
        self.outcome
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// Spins until the outcome is delivered or `spin` has passed.
    pub(crate) fn spin(&self, spin: Duration) {
        if spin.is_zero() {
            return;
        }
        let start = Instant::now();
        let mut polls = 0u32;
        while self.state.load(Ordering::Acquire) != SLOT_READY {
            std::hint::spin_loop();
            polls = polls.wrapping_add(1);
            // Reading the clock costs more than a poll of the flag; look at it now and then.
            if polls.is_multiple_of(64) && start.elapsed() >= spin {
                break;
            }
        }
    }

    /// Waits parked (after [`Slot::spin`], if the caller spins first) until the outcome is delivered, or
    /// until `deadline`.
    pub(crate) fn wait(&self, deadline: Option<Instant>) -> Option<Outcome> {
        if self.state.load(Ordering::Acquire) != SLOT_READY {
            let _ = self.thread.set(std::thread::current());
            // Only park if no outcome arrived meanwhile; an unpark that comes before `park` makes
            // `park` return at once, so no wake-up is lost.
            if self
                .state
                .compare_exchange(SLOT_EMPTY, SLOT_PARKED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                while self.state.load(Ordering::Acquire) != SLOT_READY {
                    match deadline {
                        None => std::thread::park(),
                        Some(deadline) => {
                            let now = Instant::now();
                            if now >= deadline {
                                return None;
                            }
                            std::thread::park_timeout(deadline - now);
                        }
                    }
                }
            }
        }
        self.take()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_parked_waiter_is_woken_and_an_early_outcome_is_kept() {
        // Delivered before anyone waits: no park at all.
        let slot = Slot::new();
        slot.deliver(Err(ClientError::Lost("early".into())));
        assert!(matches!(slot.wait(None), Some(Err(ClientError::Lost(r))) if r == "early"));

        // Delivered while the waiter is parked (no spin), from another thread.
        let slot = Arc::new(Slot::new());
        let late = slot.clone();
        let deliverer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            late.deliver(Err(ClientError::Lost("late".into())));
            // A second delivery is ignored.
            late.deliver(Err(ClientError::Lost("again".into())));
        });
        assert!(matches!(slot.wait(None), Some(Err(ClientError::Lost(r))) if r == "late"));
        deliverer.join().unwrap();

        // Delivered during the spin.
        let slot = Arc::new(Slot::new());
        let soon = slot.clone();
        let deliverer =
            std::thread::spawn(move || soon.deliver(Err(ClientError::Lost("soon".into()))));
        slot.spin(Duration::from_millis(500));
        assert!(matches!(slot.wait(None), Some(Err(_))));
        deliverer.join().unwrap();

        // Nothing comes: the deadline ends the wait.
        let slot = Slot::new();
        let t = Instant::now();
        slot.spin(Duration::from_millis(1));
        assert!(
            slot.wait(Some(Instant::now() + Duration::from_millis(30)))
                .is_none()
        );
        assert!(t.elapsed() >= Duration::from_millis(30));
    }
}
