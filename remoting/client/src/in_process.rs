//! A serving peer inside this process: the seam that lets a harness drive the client, and the shim above
//! it, without a network.
//!
//! The shim's fuzz target calls the C exports millions of times; over the real path (QUIC, the session
//! process) each waited call costs a round trip, which bounds it to tens of inputs a second. With
//! [`Client::in_process`] every request goes straight to a [`LocalPeer`] (in the harness: the serving
//! side's session engine over the emu backend) on the calling thread, in the order the calls were made,
//! numbered by the same [`Sequencer`] as on the network. Everything above the transport runs as in
//! production: the shim's argument checks, its handle registry and host-memory handling, the client's
//! copy splitting and waits, the engine's deferred and sticky errors. What it leaves out is covered
//! elsewhere: the wire (the `frames` fuzz target and the protocol tests), lanes and resumption (the
//! client's and the session process's tests), cached uploads, which need the network's content store
//! (every host-to-device copy goes the plain way here), and host functions (`cuLaunchHostFunc`), which the
//! serving side calls back over the network (refused here with an error).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use gleam_protocol::order::Sequencer;
use gleam_protocol::wire::{Call, ClientHello, PROTOCOL_VERSION, Reply, ReplyFrame, Request};

use crate::slot::Slot;
use crate::{Answer, Client, ClientError, Pending, lock};

/// A serving peer in this process.
pub trait LocalPeer: Send {
    /// Executes `request` (its frame's bulk bytes: `bulk`) before returning; the reply and its bulk bytes
    /// if the request expects one.
    fn handle(&mut self, request: Request, bulk: Bytes) -> Option<(ReplyFrame, Bytes)>;
}

/// The client's side of an in-process session.
pub(crate) struct InProcess {
    peer: Mutex<Engine>,
    /// Requests numbered so far (see [`Client::requests_numbered`]).
    pub(crate) numbered: AtomicU64,
}

struct Engine {
    peer: Box<dyn LocalPeer>,
    sequencer: Sequencer,
    /// Set once the session is over (closed by the client, or the peer broke the protocol).
    ended: Option<ClientError>,
}

impl InProcess {
    /// Queues (here: executes) one request; see [`Client::submit`].
    pub(crate) fn submit(
        &self,
        ctx: u64,
        call: Call,
        bulk: &[u8],
        expects_reply: bool,
    ) -> Result<Option<Pending>, ClientError> {
        if matches!(call, Call::HostFunc { .. }) {
            // Its stream would wait for the client's function, which the serving side calls back over the
            // network: here nobody would answer, and the stream would wait forever.
            return Err(ClientError::Protocol(
                "host functions need a peer across the network, not one in this process".into(),
            ));
        }
        let mut engine = lock(&self.peer);
        if let Some(err) = &engine.ended {
            return Err(err.clone());
        }
        let (seq, _, deps) = engine.sequencer.next(call.ordering());
        self.numbered.fetch_add(1, Ordering::AcqRel);
        let request = Request {
            seq,
            ctx,
            expects_reply,
            deps,
            call,
        };
        let answer = engine.peer.handle(request, Bytes::copy_from_slice(bulk));
        match (expects_reply, answer) {
            (false, None) => Ok(None),
            (true, Some((frame, bulk))) if frame.seq == seq => {
                let slot = std::sync::Arc::new(Slot::new());
                slot.deliver(Ok(Answer {
                    result: frame.result,
                    reply: frame.reply,
                    bulk: bulk.into(),
                }));
                Ok(Some(Pending {
                    slot,
                    spin: std::time::Duration::ZERO,
                    hot: None,
                }))
            }
            (expects, answer) => {
                let err = ClientError::Protocol(format!(
                    "the in-process peer answered request {seq} (reply expected: {expects}) with {:?}",
                    answer.map(|(frame, _)| frame)
                ));
                engine.ended = Some(err.clone());
                Err(err)
            }
        }
    }

    /// Whether the session has ended.
    pub(crate) fn is_lost(&self) -> bool {
        lock(&self.peer).ended.is_some()
    }

    /// Says goodbye (the peer frees everything) and ends the session.
    pub(crate) fn close(&self) {
        if !self.is_lost() {
            let _ = self.submit(0, Call::Goodbye, &[], true);
        }
        lock(&self.peer).ended = Some(ClientError::Lost("the client closed the session".into()));
    }
}

impl Client {
    /// A session with `peer`, a serving peer in this process (see the [module docs](self)): greets it as
    /// [`Client::connect`] greets a remote one.
    pub fn in_process(peer: Box<dyn LocalPeer>) -> Result<Self, ClientError> {
        let link = InProcess {
            peer: Mutex::new(Engine {
                peer,
                sequencer: Sequencer::new(1),
                ended: None,
            }),
            numbered: AtomicU64::new(0),
        };
        let hello = Call::Hello(ClientHello {
            protocol: PROTOCOL_VERSION,
            client: crate::describe_self(),
        });
        let answer = link
            .submit(0, hello, &[], true)?
            .ok_or_else(|| ClientError::Protocol("hello has no waiter".into()))?
            .wait()?;
        let hello = match answer.reply {
            Reply::Hello(server) if server.protocol == PROTOCOL_VERSION => server,
            Reply::Hello(server) => {
                return Err(ClientError::Version {
                    client: PROTOCOL_VERSION,
                    server: server.protocol,
                });
            }
            other => {
                return Err(ClientError::Protocol(format!(
                    "the in-process peer answered hello with {:?}: {other:?}",
                    answer.result
                )));
            }
        };
        Ok(Self::new(hello, crate::Link::InProcess(link)))
    }
}

#[cfg(test)]
mod tests {
    use gleam_protocol::types::CUresult;
    use gleam_protocol::wire::ServerHello;

    use super::*;

    /// What reached the peer: each request's number, whether it expected a reply, and its bulk bytes.
    type Seen = std::sync::Arc<Mutex<Vec<(u64, bool, Vec<u8>)>>>;

    /// A peer that records what reaches it and answers every waited request with its sequence number's
    /// bulk echoed back; `fire_and_forget_reply` makes it break the protocol.
    struct Echo {
        seen: Seen,
        fire_and_forget_reply: bool,
    }

    impl LocalPeer for Echo {
        fn handle(&mut self, request: Request, bulk: Bytes) -> Option<(ReplyFrame, Bytes)> {
            lock(&self.seen).push((request.seq, request.expects_reply, bulk.to_vec()));
            let reply = match request.call {
                Call::Hello(_) => Reply::Hello(ServerHello {
                    protocol: PROTOCOL_VERSION,
                    driver_version: 13000,
                    backend: "test".into(),
                    server: "echo".into(),
                    devices: Vec::new(),
                }),
                _ => Reply::Data,
            };
            (request.expects_reply || self.fire_and_forget_reply).then(|| {
                let frame = ReplyFrame {
                    seq: request.seq,
                    result: CUresult::SUCCESS,
                    reply,
                };
                (frame, bulk)
            })
        }
    }

    fn echo(fire_and_forget_reply: bool) -> (Client, Seen) {
        let seen = std::sync::Arc::default();
        let peer = Echo {
            seen: std::sync::Arc::clone(&seen),
            fire_and_forget_reply,
        };
        let client = Client::in_process(Box::new(peer)).expect("hello");
        (client, seen)
    }

    #[test]
    fn requests_reach_the_peer_numbered_in_order_with_their_bytes() {
        let (client, seen) = echo(false);
        assert_eq!(client.hello().server, "echo");
        assert_eq!(client.peer_addr(), None);
        client.send(0, Call::Goodbye).expect("fire and forget");
        let answer = client.call_with(0, Call::Goodbye, b"bulk").expect("waited");
        assert_eq!(answer.bulk.into_bytes(), &b"bulk"[..]);
        assert_eq!(client.requests_numbered(), 3, "hello and two requests");
        let seen = lock(&seen).clone();
        let order: Vec<(u64, bool)> = seen.iter().map(|(seq, e, _)| (*seq, *e)).collect();
        assert_eq!(order, [(1, true), (2, false), (3, true)]);
        assert_eq!(seen[2].2, b"bulk");
    }

    #[test]
    fn a_peer_that_breaks_the_protocol_ends_the_session_with_a_clear_error() {
        let (client, _) = echo(true);
        let err = client
            .send(0, Call::Goodbye)
            .expect_err("a reply to a fire-and-forget request");
        assert!(
            err.to_string()
                .contains("in-process peer answered request 2"),
            "{err}"
        );
        assert!(client.is_lost());
        assert!(client.call(0, Call::Goodbye).is_err(), "nothing more goes");
    }

    #[test]
    fn closing_says_goodbye_once_and_ends_the_session() {
        let (client, seen) = echo(false);
        client.close(std::time::Duration::from_secs(1));
        client.close(std::time::Duration::from_secs(1));
        assert!(client.is_lost());
        assert_eq!(lock(&seen).len(), 2, "hello and one goodbye");
        assert!(matches!(
            client.call(0, Call::Goodbye),
            Err(ClientError::Lost(_))
        ));
    }
}
