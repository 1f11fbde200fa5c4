//! Host callbacks (`cuLaunchHostFunc`, `cuStreamAddCallback`): the client's function runs on the client,
//! in its stream's order.
//!
//! A [`Call::HostFunc`](gleam_protocol::wire::Call::HostFunc) request becomes a [`CallbackPoint`] the
//! backend places in the stream. When the stream reaches it, [`CallbackPoint::reached`] answers the
//! request (the client's callback thread then runs the function), and the stream stays held until the
//! client says the function returned ([`HostCallbacks::returned`], from the network side as the message
//! arrives: the executor may itself be blocked in a synchronization waiting for that stream). A backend
//! holds the stream either by blocking a thread of its own ([`CallbackPoint::wait_returned`]: the real
//! driver's callback thread) or by a hook ([`CallbackPoint::on_returned`]: the emu's stream dependency).
//!
//! When the session ends ([`HostCallbacks::cancel_all`]) every held stream is let go, so neither a
//! client that left nor the session's own shutdown waits for a function that will never return.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use gleam_protocol::order::Lane;
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{Reply, ReplyFrame};
use tracing::debug;

/// Where an answer made outside the executor goes: the reply `frame` on `lane`.
pub type ReplySink = Box<dyn Fn(Lane, ReplyFrame) + Send + Sync>;

/// Callbacks one client may have waiting at once (each is a small entry; this bounds what it can make us
/// hold).
pub const MAX_PENDING: usize = 1 << 16;

/// The session's host callbacks in flight.
#[derive(Default)]
pub struct HostCallbacks {
    state: Mutex<State>,
    sink: Mutex<Option<Arc<ReplySink>>>,
}

impl std::fmt::Debug for HostCallbacks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCallbacks")
            .field("pending", &lock(&self.state).pending.len())
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    /// Callbacks placed in a stream whose function has not returned yet, by id.
    pending: HashMap<u64, Arc<Latch>>,
    /// The session ended: nothing is held any more.
    closed: bool,
}

/// Why a host callback cannot be placed.
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
pub enum CallbackError {
    /// This session process cannot send an answer outside the executor (no sink was set).
    #[error("host callbacks are not available in this session")]
    Unavailable,
    /// The id is already in use.
    #[error("host callback {0} is already pending")]
    Duplicate(u64),
    /// Too many callbacks are waiting.
    #[error("more than {MAX_PENDING} host callbacks are pending")]
    TooMany,
}

impl CallbackError {
    /// The CUDA result the client's callback sees.
    pub fn cuda_result(self) -> CUresult {
        match self {
            Self::Unavailable => CUresult::NOT_SUPPORTED,
            Self::Duplicate(_) => CUresult::INVALID_VALUE,
            Self::TooMany => CUresult::OUT_OF_MEMORY,
        }
    }
}

impl HostCallbacks {
    /// Sets where answers go (the session process's lanes). Without one, host callbacks are refused.
    pub fn set_sink(&self, sink: ReplySink) {
        *lock(&self.sink) = Some(Arc::new(sink));
    }

    /// A new point for request `seq` (answered on `lane`), callback `id`.
    pub fn point(&self, seq: u64, lane: Lane, id: u64) -> Result<CallbackPoint, CallbackError> {
        let sink = lock(&self.sink).clone().ok_or(CallbackError::Unavailable)?;
        let latch = Arc::new(Latch::default());
        let mut state = lock(&self.state);
        if state.closed {
            latch.open();
        } else {
            if state.pending.len() >= MAX_PENDING {
                return Err(CallbackError::TooMany);
            }
            if state.pending.contains_key(&id) {
                return Err(CallbackError::Duplicate(id));
            }
            state.pending.insert(id, latch.clone());
        }
        Ok(CallbackPoint {
            seq,
            lane,
            id,
            latch,
            sink,
        })
    }

    /// The client's function for callback `id` returned: its stream goes on. An unknown id (already
    /// returned, never placed, or refused) is ignored.
    pub fn returned(&self, id: u64) {
        let latch = lock(&self.state).pending.remove(&id);
        match latch {
            Some(latch) => latch.open(),
            None => debug!(id, "a host callback returned that is not pending: ignored"),
        }
    }

    /// The session is ending: every held stream goes on, and later points hold nothing.
    pub fn cancel_all(&self) {
        let latches: Vec<Arc<Latch>> = {
            let mut state = lock(&self.state);
            state.closed = true;
            state.pending.drain().map(|(_, latch)| latch).collect()
        };
        for latch in latches {
            latch.open();
        }
    }

    /// Callbacks placed whose function has not returned.
    pub fn pending(&self) -> usize {
        lock(&self.state).pending.len()
    }

    /// Forgets callback `id`: the backend could not place it, so it holds nothing, and a stray
    /// completion is ignored.
    pub fn withdraw(&self, id: u64) {
        lock(&self.state).pending.remove(&id);
    }
}

/// A place in a stream where the client's function runs (see the module docs).
pub struct CallbackPoint {
    seq: u64,
    lane: Lane,
    id: u64,
    latch: Arc<Latch>,
    sink: Arc<ReplySink>,
}

impl std::fmt::Debug for CallbackPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallbackPoint")
            .field("seq", &self.seq)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl CallbackPoint {
    /// The stream reached the point: the client runs its function, which gets `status`.
    pub fn reached(&self, status: CUresult) {
        (self.sink)(
            self.lane,
            ReplyFrame {
                seq: self.seq,
                result: status,
                reply: Reply::Empty,
            },
        );
    }

    /// Blocks until the client's function returned (or the session ended).
    pub fn wait_returned(&self) {
        self.latch.wait();
    }

    /// Runs `then` once the client's function returned (or the session ended): at once if it already
    /// has, else on the thread that learns it.
    pub fn on_returned(&self, then: impl FnOnce() + Send + 'static) {
        self.latch.then(Box::new(then));
    }
}

/// Opens once; threads wait for it, hooks run when it opens.
#[derive(Default)]
struct Latch {
    state: Mutex<LatchState>,
    opened: Condvar,
}

#[derive(Default)]
struct LatchState {
    open: bool,
    hooks: Vec<Box<dyn FnOnce() + Send>>,
}

impl Latch {
    fn open(&self) {
        let hooks = {
            let mut state = lock(&self.state);
            state.open = true;
            std::mem::take(&mut state.hooks)
        };
        self.opened.notify_all();
        for hook in hooks {
            hook();
        }
    }

    fn wait(&self) {
        let mut state = lock(&self.state);
        while !state.open {
            state = self
                .opened
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    fn then(&self, hook: Box<dyn FnOnce() + Send>) {
        let mut state = lock(&self.state);
        if state.open {
            drop(state);
            hook();
        } else {
            state.hooks.push(hook);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a thread panicked while holding it; the state stays consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// The answers a sink sent: (lane, seq, status).
    type Sent = Arc<Mutex<Vec<(Lane, u64, CUresult)>>>;

    fn callbacks() -> (Arc<HostCallbacks>, Sent) {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let cb = Arc::new(HostCallbacks::default());
        let log = sent.clone();
        cb.set_sink(Box::new(move |lane, frame| {
            lock(&log).push((lane, frame.seq, frame.result));
        }));
        (cb, sent)
    }

    #[test]
    fn a_point_answers_when_reached_and_holds_until_returned() {
        let (cb, sent) = callbacks();
        let point = cb.point(9, Lane(5), 1).unwrap();
        let released = Arc::new(AtomicBool::new(false));
        let r = released.clone();
        point.on_returned(move || r.store(true, Ordering::Release));
        point.reached(CUresult::SUCCESS);
        assert_eq!(*lock(&sent), [(Lane(5), 9, CUresult::SUCCESS)]);
        assert!(!released.load(Ordering::Acquire));
        assert_eq!(cb.pending(), 1);
        let waiter = std::thread::spawn(move || point.wait_returned());
        cb.returned(1);
        waiter.join().unwrap();
        assert!(released.load(Ordering::Acquire));
        assert_eq!(cb.pending(), 0);
        // A second completion of the same id, or of one never placed, changes nothing.
        cb.returned(1);
        cb.returned(77);
    }

    #[test]
    fn ids_are_unique_and_a_sink_is_needed() {
        let (cb, _) = callbacks();
        let _p = cb.point(1, Lane(5), 3).unwrap();
        assert_eq!(
            cb.point(2, Lane(5), 3).unwrap_err(),
            CallbackError::Duplicate(3)
        );
        let bare = Arc::new(HostCallbacks::default());
        assert_eq!(
            bare.point(1, Lane(5), 1).unwrap_err(),
            CallbackError::Unavailable
        );
    }

    #[test]
    fn the_end_of_the_session_lets_every_stream_go() {
        let (cb, _) = callbacks();
        let a = cb.point(1, Lane(5), 1).unwrap();
        let b = cb.point(2, Lane(6), 2).unwrap();
        let waiter = std::thread::spawn(move || a.wait_returned());
        cb.cancel_all();
        waiter.join().unwrap();
        b.wait_returned();
        // After the end, a new point holds nothing.
        let c = cb.point(3, Lane(5), 3).unwrap();
        c.wait_returned();
        assert_eq!(cb.pending(), 0);
    }

    #[test]
    fn a_withdrawn_point_holds_nothing() {
        let (cb, _) = callbacks();
        let p = cb.point(1, Lane(5), 4).unwrap();
        drop(p);
        cb.withdraw(4);
        assert_eq!(cb.pending(), 0);
        assert!(cb.point(2, Lane(5), 4).is_ok(), "the id is free again");
    }
}
