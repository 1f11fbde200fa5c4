//! Out-of-band messages: requests the serving peer acts on as they arrive, outside the session's order.
//!
//! Such a message is not numbered by the session's [`gleam_protocol::order::Sequencer`] (the peer never
//! schedules it) and travels on its own lane ([`Lane::SIGNALS`]), so neither a long transfer queued on
//! another lane nor the peer's per-lane backpressure holds it back: the message it carries may be exactly
//! what the peer's executor is blocked waiting for (a host function's completion, which a stream
//! synchronization waits on). Signals are numbered on their lane instead (1, 2, ...): the peer says which
//! ones arrived, so after a network drop each is sent again only if it was lost, and acted on once.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use gleam_protocol::order::{Deps, Lane};
use gleam_protocol::wire::{Call, Request};

use crate::engine::Moved;
use crate::{Client, ClientError, Link, Shared, lock};

impl Client {
    /// Sends `call` out of band (see the module docs), at once. Only calls the peer handles out of band
    /// may be sent this way (today [`Call::HostFuncReturned`]); anything else ends the session as a
    /// protocol violation.
    pub fn signal(&self, call: Call) -> Result<(), ClientError> {
        match &self.link {
            Link::Network(network) => network.shared.signal(call),
            // No calling thread is ever blocked inside the in-process peer waiting for a signal (it runs
            // one request at a time, on the caller's thread): the message goes in order like any other.
            Link::InProcess(link) => link.submit(0, call, &[], false).map(drop),
        }
    }
}

impl Shared {
    fn signal(self: &Arc<Self>, call: Call) -> Result<(), ClientError> {
        if self.lost.load(Ordering::Acquire) {
            return Err(self.lost_error());
        }
        let mut core = self.core();
        core.session.check()?;
        // With the link down the signal is kept with the lane's other frames and goes on resume: no wait.
        let tx = self.open_lane(&mut core, Lane::SIGNALS);
        let seq = core.session.next_signal();
        let request = Request {
            seq,
            ctx: 0,
            expects_reply: false,
            deps: Deps::default(),
            call,
        };
        // Queued under the numbering lock, so signals enter their lane in the order of their numbers.
        let mut state = lock(&tx.state);
        let mut moved = Moved::default();
        state
            .queue(&request, 0, &mut moved)
            .map_err(|e| ClientError::Protocol(format!("cannot encode a signal: {e}")))?;
        core.session.signal_sent(seq);
        drop(core);
        self.flush_now(&tx, state, moved);
        Ok(())
    }
}
