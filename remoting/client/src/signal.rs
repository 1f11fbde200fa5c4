//! Out-of-band messages: requests the serving peer acts on as they arrive, outside the session's order.
//!
//! Such a message takes no sequence number (it is sent with seq 0, which the peer's scheduler would
//! refuse) and travels on its own lane ([`Lane::SIGNALS`]), so neither a long transfer queued on another
//! lane nor the peer's per-lane backpressure holds it back: the message it carries may be exactly what
//! the peer's executor is blocked waiting for (a host function's completion, which a stream
//! synchronization waits on).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};

use gleam_protocol::frame;
use gleam_protocol::order::{Deps, Lane};
use gleam_protocol::wire::{Call, Request};

use crate::{Client, ClientError, Shared, lock};

impl Client {
    /// Sends `call` out of band (see the module docs), at once. Only calls the peer handles out of band
    /// may be sent this way (today [`Call::HostFuncReturned`]); anything else ends the session as a
    /// protocol violation.
    pub fn signal(&self, call: Call) -> Result<(), ClientError> {
        self.shared.signal(call)
    }
}

impl Shared {
    fn signal(self: &Arc<Self>, call: Call) -> Result<(), ClientError> {
        if self.lost.load(Ordering::Acquire) {
            return Err(self.lost_error());
        }
        let request = Request {
            seq: 0,
            ctx: 0,
            expects_reply: false,
            deps: Deps::default(),
            call,
        };
        let mut head = Vec::with_capacity(32);
        frame::encode_head(&request, 0, &mut head)
            .map_err(|e| ClientError::Protocol(format!("cannot encode a signal: {e}")))?;
        let tx = {
            let mut core = self.core();
            if let Some(err) = &core.lost {
                return Err(err.clone());
            }
            self.open_lane(&mut core, Lane::SIGNALS)?
        };
        let mut state = lock(&tx.state);
        tx.fresh.store(false, Ordering::Release);
        state.batch.extend_from_slice(&head);
        self.buffered.fetch_add(head.len(), Ordering::AcqRel);
        let mut taken = 0;
        let flushed = state.poll_flush(&mut Context::from_waker(Waker::noop()), &mut taken);
        self.taken(taken);
        match flushed {
            Poll::Ready(Ok(())) => Ok(()),
            Poll::Ready(Err(err)) => {
                drop(state);
                let err = ClientError::Lost(err);
                self.fail_all(err.clone());
                Err(err)
            }
            Poll::Pending => {
                tx.flush.notify_one();
                Ok(())
            }
        }
    }
}
