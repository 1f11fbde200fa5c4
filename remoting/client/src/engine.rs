//! The client's protocol logic, without IO: two state machines that take events (a request submitted,
//! a reply or an acknowledgement arrived, the link lost or resumed) and say what to send.
//!
//! - [`Session`]: what the whole session shares. It numbers requests ([`Sequencer`]), keeps the waiter
//!   of each request that expects a reply, matches replies to them ([`Session::handle_reply`]), says when
//!   the serving side must be told which replies arrived ([`Session::poll_acks`]), and fences off a
//!   connection left behind by a resume (its generation).
//! - [`LaneOut`]: one lane's outgoing bytes. Fire-and-forget frames coalesce in a batch; the batch and
//!   what the transport has not taken yet leave through [`LaneOut::poll_transmit`]; every request frame
//!   is kept ([`Retained`]) until the serving side acknowledges it, and a resume
//!   ([`LaneOut::resume`]) starts the new stream with exactly the frames the serving side lacks.
//!
//! The transport is a parameter ([`Transport`]): quinn's send stream in production, a simulated link in
//! the tests below, which drop the link in the middle of bursts and check that every request reaches the
//! serving side once, in its lane's order. The thin layer in `lib.rs` puts a lock around each machine (a
//! lane's megabytes are copied while other threads take numbers), runs quinn and wakes the threads.

use std::collections::HashMap;
use std::pin::pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use gleam_protocol::frame::{self, FrameError};
use gleam_protocol::order::{self, Deps, Lane, Sequencer};
use gleam_protocol::resume::{Awaited, Frame, Retained};
use gleam_protocol::wire::{Request, StreamOpen};

use crate::ClientError;

/// A lane's batch of fire-and-forget frames is handed to the transport at once when it reaches this size.
pub(crate) const BATCH_FLUSH: usize = 256 << 10;

/// What the session shares: numbering, waiters, the connection generation, loss. `W` is the waiter of a
/// request that expects a reply (the thin layer's slot, on which the calling thread waits).
#[derive(Debug)]
pub(crate) struct Session<W> {
    sequencer: Sequencer,
    /// Each request awaiting its reply: its lane and its waiter.
    waiters: HashMap<u64, (Lane, W)>,
    /// Fire-and-forget requests numbered since the last one awaiting a reply (see
    /// [`crate::LONG_WAIT_POSTS`]).
    posted_since_wait: u64,
    lost: Option<ClientError>,
    /// The connection whose replies are delivered (each resume attempt fences the previous ones off).
    generation: u64,
    /// A reply arrived since the serving side was last told which ones the client awaits.
    replies_changed: bool,
    /// The last seq given to an out-of-band signal (numbered on their own lane, so the serving side can
    /// say which ones arrived).
    signals: u64,
}

/// A request's place in the session, from [`Session::submit`].
#[derive(Clone, Debug, Eq, PartialEq)]
pub(crate) struct Numbered {
    pub seq: u64,
    pub lane: Lane,
    pub deps: Deps,
    /// For a request that expects a reply: the fire-and-forget requests numbered since the previous
    /// such request (its waiter's spin depends on it).
    pub posted_before: Option<u64>,
}

/// What a reply that arrived is for, from [`Session::handle_reply`].
#[derive(Debug)]
pub(crate) enum Delivery<W> {
    /// Hand it to this waiter. The serving side has received every request of `lane` (the request's,
    /// whichever stream the reply came on) up to the reply's.
    To { waiter: W, lane: Lane },
    /// It came on a connection a resume left behind: the new connection brings it again.
    Stale,
}

/// Whether to tell the serving side which replies arrived, from [`Session::poll_acks`].
#[derive(Debug, Eq, PartialEq)]
pub(crate) enum AckPoll {
    /// Send this.
    Send(Awaited),
    /// Nothing new since the last time.
    Quiet,
    /// That connection is left behind, or the session ended: stop acknowledging on it.
    Stop,
}

impl<W> Session<W> {
    pub fn new() -> Self {
        Self {
            sequencer: Sequencer::new(1),
            waiters: HashMap::new(),
            posted_since_wait: 0,
            lost: None,
            generation: 0,
            replies_changed: false,
            signals: 0,
        }
    }

    /// `Err` once the session ended: every later call fails the same way.
    pub fn check(&self) -> Result<(), ClientError> {
        match &self.lost {
            Some(err) => Err(err.clone()),
            None => Ok(()),
        }
    }

    pub fn lost(&self) -> Option<&ClientError> {
        self.lost.as_ref()
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Numbers a request that travels with `ordering`; `waiter` receives its reply, if it expects one.
    pub fn submit(
        &mut self,
        ordering: order::Ordering,
        waiter: Option<W>,
    ) -> Result<Numbered, ClientError> {
        self.check()?;
        let (seq, lane, deps) = self.sequencer.next(ordering);
        let posted_before = match waiter {
            Some(waiter) => {
                self.waiters.insert(seq, (lane, waiter));
                Some(std::mem::take(&mut self.posted_since_wait))
            }
            None => {
                self.posted_since_wait += 1;
                None
            }
        };
        Ok(Numbered {
            seq,
            lane,
            deps,
            posted_before,
        })
    }

    /// The seq the next out-of-band signal gets; [`Session::signal_sent`] takes it.
    pub fn next_signal(&self) -> u64 {
        self.signals + 1
    }

    pub fn signal_sent(&mut self, seq: u64) {
        self.signals = seq;
    }

    /// The reply to request `seq` arrived on connection `generation` (on its request's lane, or apart:
    /// see [`gleam_protocol::wire::Call::answer_lane`]). `Err`: the serving side answered a request that
    /// waits for nothing (a protocol violation).
    pub fn handle_reply(&mut self, generation: u64, seq: u64) -> Result<Delivery<W>, ClientError> {
        if generation != self.generation {
            return Ok(Delivery::Stale);
        }
        self.replies_changed = true;
        match self.waiters.remove(&seq) {
            Some((lane, waiter)) => Ok(Delivery::To { waiter, lane }),
            None => Err(ClientError::Protocol(format!(
                "reply to unknown request {seq}"
            ))),
        }
    }

    /// Whether connection `generation` should tell the serving side which replies arrived (so it can
    /// forget them).
    pub fn poll_acks(&mut self, generation: u64) -> AckPoll {
        if generation != self.generation || self.lost.is_some() {
            return AckPoll::Stop;
        }
        if !std::mem::take(&mut self.replies_changed) {
            return AckPoll::Quiet;
        }
        AckPoll::Send(self.awaited())
    }

    /// Whether connection `generation` is the current one (its acknowledgements and replies count).
    pub fn is_current(&self, generation: u64) -> bool {
        generation == self.generation
    }

    /// Starts a resume: replies on earlier connections are no longer delivered. Returns the new
    /// connection's generation and the replies the client still waits for (the serving side sends them
    /// again).
    pub fn begin_resume(&mut self) -> (u64, Awaited) {
        self.generation += 1;
        (self.generation, self.awaited())
    }

    /// Ends the session (the first reason wins); returns it and every waiter, to be failed with it.
    pub fn fail(&mut self, err: ClientError) -> (ClientError, Vec<W>) {
        let err = self.lost.get_or_insert(err).clone();
        (err, self.waiters.drain().map(|(_, (_, w))| w).collect())
    }

    /// The replies this client still waits for.
    fn awaited(&self) -> Awaited {
        let mut waiting: Vec<u64> = self.waiters.keys().copied().collect();
        waiting.sort_unstable();
        Awaited {
            next: self.sequencer.peek_seq(),
            waiting,
        }
    }
}

/// Where a lane's bytes go: a stream that takes chunks as it has room.
pub(crate) trait Transport {
    /// Takes what it can of `chunks`, from the front (advancing the chunks it takes part of); returns
    /// the bytes taken. `Err` is the link going down.
    fn poll_write_chunks(
        &mut self,
        cx: &mut Context<'_>,
        chunks: &mut [Bytes],
    ) -> Poll<Result<usize, String>>;
}

impl Transport for quinn::SendStream {
    fn poll_write_chunks(
        &mut self,
        cx: &mut Context<'_>,
        chunks: &mut [Bytes],
    ) -> Poll<Result<usize, String>> {
        pin!(self.write_chunks(chunks))
            .poll(cx)
            .map(|written| written.map(|w| w.bytes).map_err(|e| e.to_string()))
    }
}

/// One lane's outgoing bytes (see the module docs).
#[derive(Debug)]
pub(crate) struct LaneOut<T> {
    lane: Lane,
    /// Each stream of this lane starts with the lane's opening frame (every lane but the control lane,
    /// whose stream is announced by the session's attach or resume).
    announced: bool,
    /// The lane's stream on the current connection (`None` while the link is down).
    send: Option<T>,
    /// Frames not yet handed to the transport, coalesced into one chunk.
    batch: BytesMut,
    /// The requests in `batch`: seq and where its frame starts (a new lane's opening frame comes first).
    frames: Vec<(u64, usize)>,
    /// Chunks handed over but not yet taken by the transport, in order.
    pending: Vec<Bytes>,
    /// Requests sent that the serving side has not acknowledged.
    retained: Retained,
    /// The batch holds only the lane's opening frame (no burst of its own).
    fresh: bool,
}

/// What one change to a lane moved, for the thin layer's byte counts (backpressure).
#[derive(Debug, Default, Eq, PartialEq)]
pub(crate) struct Moved {
    /// Bytes newly waiting for the transport.
    pub queued: usize,
    /// Bytes the transport took.
    pub taken: usize,
    /// Bytes no longer to be handed to the transport on this connection (the link is down: the
    /// requests among them are kept).
    pub dropped: usize,
    /// Bytes of requests newly kept for resending.
    pub kept: usize,
    /// Bytes of requests the serving side acknowledged (no longer kept).
    pub freed: usize,
}

/// A request's frame head put in a lane's batch, from [`LaneOut::queue`].
#[derive(Debug, Eq, PartialEq)]
pub(crate) struct Queued {
    /// The batch held nothing to send before: a burst starts, and the writer must be woken for it.
    pub starts_burst: bool,
}

impl<T: Transport> LaneOut<T> {
    /// A lane whose stream is already open and announced (the control lane).
    pub fn attached(lane: Lane, send: T) -> Self {
        Self {
            lane,
            announced: false,
            send: Some(send),
            batch: BytesMut::new(),
            frames: Vec::new(),
            pending: Vec::new(),
            retained: Retained::default(),
            fresh: false,
        }
    }

    /// A new lane on stream `send` (`None`: the link is down, the resume opens it): its opening frame
    /// goes out with its first request. `moved` counts the opening's bytes as queued.
    pub fn opening(lane: Lane, send: Option<T>, moved: &mut Moved) -> Self {
        let batch = BytesMut::from(&opening_frame(lane)[..]);
        moved.queued += batch.len();
        Self {
            lane,
            announced: true,
            send,
            batch,
            frames: Vec::new(),
            pending: Vec::new(),
            retained: Retained::default(),
            fresh: true,
        }
    }

    /// Puts `request`'s frame head in the batch; its `bulk_len` bulk bytes must follow through
    /// [`LaneOut::append`] before anything else is queued. On failure the batch is as it was.
    pub fn queue(
        &mut self,
        request: &Request,
        bulk_len: usize,
        moved: &mut Moved,
    ) -> Result<Queued, FrameError> {
        let start = self.batch.len();
        frame::encode_head(request, bulk_len, &mut self.batch)?;
        let starts_burst = (start == 0 && self.pending.is_empty()) || self.fresh;
        self.fresh = false;
        self.frames.push((request.seq, start));
        moved.queued += self.batch.len() - start;
        Ok(Queued { starts_burst })
    }

    /// Appends bulk bytes of the request queued last.
    pub fn append(&mut self, part: &[u8], moved: &mut Moved) {
        self.batch.extend_from_slice(part);
        moved.queued += part.len();
    }

    /// Appends `part`, the last bulk bytes of the request queued last, as a buffer of its own: the batch
    /// so far (that request's head included) is sealed, and `part` follows it to the transport without
    /// being copied into the batch (it is kept with its request for resending).
    pub fn append_owned(&mut self, part: Bytes, moved: &mut Moved) {
        moved.queued += part.len();
        if let Some(chunk) = self.seal_with(part.clone(), moved) {
            self.pending.push(chunk);
        }
        self.pending.push(part);
    }

    /// Whether the batch is large enough to hand over now, without waiting for the writer.
    pub fn is_batch_full(&self) -> bool {
        self.batch.len() >= BATCH_FLUSH
    }

    /// Hands the batch and the chunks not yet taken to the transport, until it takes no more.
    /// `Ready(Ok)` when everything was taken, or the link is down (then the requests are kept for the
    /// resume); `Ready(Err)` when the link went down now (the stream is let go).
    pub fn poll_transmit(
        &mut self,
        cx: &mut Context<'_>,
        moved: &mut Moved,
    ) -> Poll<Result<(), String>> {
        if let Some(chunk) = self.seal(moved) {
            self.pending.push(chunk);
        }
        let Some(send) = self.send.as_mut() else {
            self.let_go_pending(moved);
            return Poll::Ready(Ok(()));
        };
        while !self.pending.is_empty() {
            match send.poll_write_chunks(cx, &mut self.pending) {
                Poll::Ready(Ok(taken)) => {
                    moved.taken += taken;
                    self.pending.retain(|chunk| !chunk.is_empty());
                }
                Poll::Ready(Err(err)) => {
                    // The connection is going: what was not sent is kept for the resume.
                    self.send = None;
                    self.let_go_pending(moved);
                    return Poll::Ready(Err(err));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }

    /// The serving side has every request of this lane up to `through`.
    pub fn handle_ack(&mut self, through: u64, moved: &mut Moved) {
        moved.freed += self.retained.ack(through);
    }

    /// Moves the lane to `send`, a stream of a new connection, on which the serving side has every
    /// request up to `received`: the stream starts with the lane's opening frame (if it has one), then
    /// the requests the serving side lacks, then what was not sent yet.
    pub fn resume(&mut self, send: T, received: u64, moved: &mut Moved) {
        // The batch (whose opening frame, if any, belonged to the old connection) is kept with the rest.
        if let Some(chunk) = self.seal(moved) {
            moved.dropped += chunk.len();
        }
        self.let_go_pending(moved);
        moved.freed += self.retained.ack(received);
        if self.announced {
            self.pending.push(opening_frame(self.lane));
        }
        self.pending.extend(self.retained.unacked());
        moved.queued += self.pending.iter().map(Bytes::len).sum::<usize>();
        self.send = Some(send);
        self.fresh = false;
    }

    /// The chunks not taken will not go on this connection (the requests among them are kept).
    fn let_go_pending(&mut self, moved: &mut Moved) {
        moved.dropped += self.pending.drain(..).map(|c| c.len()).sum::<usize>();
    }

    /// Moves the batch's requests to the kept frames; returns the batch's bytes as one chunk.
    fn seal(&mut self, moved: &mut Moved) -> Option<Bytes> {
        self.seal_with(Bytes::new(), moved)
    }

    /// [`LaneOut::seal`], the last request's frame ending with `last_bulk` (sent apart).
    fn seal_with(&mut self, last_bulk: Bytes, moved: &mut Moved) -> Option<Bytes> {
        if self.batch.is_empty() {
            return None;
        }
        let chunk = self.batch.split().freeze();
        let mut last_bulk = Some(last_bulk);
        for (i, &(seq, start)) in self.frames.iter().enumerate() {
            let end = self
                .frames
                .get(i + 1)
                .map_or(chunk.len(), |&(_, next)| next);
            let bulk = match i + 1 == self.frames.len() {
                true => last_bulk.take().unwrap_or_default(),
                false => Bytes::new(),
            };
            moved.kept += end - start + bulk.len();
            self.retained.keep(Frame {
                seq,
                head: chunk.slice(start..end),
                bulk,
            });
        }
        self.frames.clear();
        Some(chunk)
    }
}

/// The frame that starts a lane's stream.
fn opening_frame(lane: Lane) -> Bytes {
    let mut out = BytesMut::new();
    // Encoding a lane number cannot fail.
    let _ = frame::encode_head(&StreamOpen::Lane { lane }, 0, &mut out);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::task::Waker;

    use gleam_protocol::frame::FrameReader;
    use gleam_protocol::resume::{Received, mark_of};
    use gleam_protocol::wire::Call;

    use super::*;

    /// One direction of a simulated stream: takes at most `room` bytes per poll (then, until the test
    /// gives more room, nothing), and can be cut (the link goes down: what it took may or may not have
    /// arrived, as the test decides).
    #[derive(Debug, Default)]
    struct SimStream {
        /// Bytes taken, in order: what the serving side reads.
        wire: Vec<u8>,
        room: usize,
        cut: bool,
    }

    impl Transport for SimStream {
        fn poll_write_chunks(
            &mut self,
            _: &mut Context<'_>,
            chunks: &mut [Bytes],
        ) -> Poll<Result<usize, String>> {
            if self.cut {
                return Poll::Ready(Err("link down".into()));
            }
            if self.room == 0 {
                return Poll::Pending;
            }
            let mut taken = 0;
            for chunk in chunks.iter_mut() {
                let n = chunk.len().min(self.room - taken);
                self.wire.extend_from_slice(&chunk.split_to(n));
                taken += n;
                if taken == self.room {
                    break;
                }
            }
            self.room -= taken;
            Poll::Ready(Ok(taken))
        }
    }

    fn poll<T: Transport>(lane: &mut LaneOut<T>) -> (Poll<Result<(), String>>, Moved) {
        let mut moved = Moved::default();
        let polled = lane.poll_transmit(&mut Context::from_waker(Waker::noop()), &mut moved);
        (polled, moved)
    }

    fn request(seq: u64, deps: Deps, expects_reply: bool) -> Request {
        Request {
            seq,
            ctx: 0,
            expects_reply,
            deps,
            call: Call::Goodbye,
        }
    }

    /// The serving side of the simulation: reads each lane's stream, checks each request arrives once
    /// and in its lane's order ([`Received`] refuses anything else), and records what arrived.
    #[derive(Default)]
    struct SimServer {
        received: Received,
        /// Each lane's reader on the current connection, and whether its opening frame was read.
        readers: HashMap<Lane, (FrameReader, bool)>,
        arrived: BTreeMap<u64, (Lane, Vec<u8>)>,
    }

    impl SimServer {
        /// Reads the bytes of `lane`'s stream that arrived. Every stream but the control lane's starts
        /// with its lane's opening frame.
        fn read(&mut self, lane: Lane, bytes: &[u8]) {
            let (reader, opened) = self
                .readers
                .entry(lane)
                .or_insert_with(|| (FrameReader::new(), lane == Lane::CONTROL));
            reader.feed(bytes);
            while let Some(frame) = reader.next_frame().expect("well-formed frames") {
                if !*opened {
                    let open: StreamOpen = frame.decode().expect("an opening frame");
                    assert!(matches!(open, StreamOpen::Lane { lane: l } if l == lane));
                    *opened = true;
                    continue;
                }
                let request: Request = frame.decode().expect("a request");
                self.received
                    .note(lane, request.seq)
                    .expect("each request once, in its lane's order");
                let first = self
                    .arrived
                    .insert(request.seq, (lane, frame.bulk.to_vec()))
                    .is_none();
                assert!(first, "request {} arrived twice", request.seq);
            }
        }

        /// The link went down: a new connection starts every stream afresh (a partial frame is lost).
        fn reconnect(&mut self) {
            self.readers.clear();
        }
    }

    /// Bulk parts from this size on go in buffers of their own in the simulation.
    const OWNED_IN_TESTS: usize = 200;

    /// A client of the simulation: the session and its lanes over simulated streams.
    struct SimClient {
        session: Session<u64>,
        lanes: BTreeMap<Lane, LaneOut<SimStream>>,
        /// Everything every lane moved so far (each call adds to it).
        moved: Moved,
    }

    impl SimClient {
        fn new() -> Self {
            let mut lanes = BTreeMap::new();
            lanes.insert(
                Lane::CONTROL,
                LaneOut::attached(Lane::CONTROL, SimStream::default()),
            );
            Self {
                session: Session::new(),
                lanes,
                moved: Moved::default(),
            }
        }

        /// Submits a request on `stream` (`None`: the control lane) with `bulk` bytes.
        fn submit(&mut self, stream: Option<u64>, bulk: &[u8], expects_reply: bool) -> u64 {
            let ordering = order::Ordering {
                stream,
                ..order::Ordering::default()
            };
            let waiter = expects_reply.then_some(0);
            let numbered = self.session.submit(ordering, waiter).expect("session up");
            let moved = &mut self.moved;
            let lane = self.lanes.entry(numbered.lane).or_insert_with(|| {
                LaneOut::opening(numbered.lane, Some(SimStream::default()), moved)
            });
            let req = request(numbered.seq, numbered.deps, expects_reply);
            lane.queue(&req, bulk.len(), moved).expect("encodable");
            // Larger parts in buffers of their own, as the thin layer sends large ones: the tests cover
            // both forms, resumes included.
            if bulk.len() >= OWNED_IN_TESTS {
                lane.append_owned(Bytes::copy_from_slice(bulk), moved);
            } else {
                lane.append(bulk, moved);
            }
            numbered.seq
        }

        /// Gives every stream `room` bytes and polls every lane once.
        fn pump(&mut self, room: usize) {
            for lane in self.lanes.values_mut() {
                if let Some(send) = lane.send.as_mut() {
                    send.room = room;
                }
                let _ =
                    lane.poll_transmit(&mut Context::from_waker(Waker::noop()), &mut self.moved);
            }
        }

        /// The serving side acknowledges `lane`'s requests up to `through`.
        fn ack(&mut self, lane: Lane, through: u64) {
            let out = self.lanes.get_mut(&lane).expect("an open lane");
            out.handle_ack(through, &mut self.moved);
        }

        /// What each lane's stream carried since the last call (taken out of the simulated streams).
        fn drain_wires(&mut self) -> Vec<(Lane, Vec<u8>)> {
            self.lanes
                .iter_mut()
                .filter_map(|(&lane, out)| {
                    out.send
                        .as_mut()
                        .map(|s| (lane, std::mem::take(&mut s.wire)))
                })
                .collect()
        }

        fn cut(&mut self) {
            for lane in self.lanes.values_mut() {
                if let Some(send) = lane.send.as_mut() {
                    send.cut = true;
                }
            }
        }

        /// Resumes every lane on new streams, the serving side having received what `server` says.
        fn resume(&mut self, server: &SimServer) {
            let marks = server.received.marks();
            self.session.begin_resume();
            for (&lane, out) in &mut self.lanes {
                out.resume(SimStream::default(), mark_of(&marks, lane), &mut self.moved);
            }
        }

        /// Bytes waiting for a transport: what was queued, less what was taken or let go.
        fn buffered(&self) -> usize {
            self.moved.queued - self.moved.taken - self.moved.dropped
        }

        fn retained(&self) -> usize {
            self.moved.kept - self.moved.freed
        }
    }

    fn deliver(client: &mut SimClient, server: &mut SimServer) {
        for (lane, bytes) in client.drain_wires() {
            server.read(lane, &bytes);
        }
    }

    #[test]
    fn a_burst_is_coalesced_into_one_chunk_and_kept_until_acknowledged() {
        let mut client = SimClient::new();
        let mut server = SimServer::default();
        let seqs: Vec<u64> = (0..100)
            .map(|_| client.submit(Some(7), &[], false))
            .collect();
        assert_eq!(seqs, (1..=100).collect::<Vec<_>>());
        let lane = Lane::of_stream(7);
        assert!(
            client.lanes[&lane].pending.is_empty(),
            "nothing handed over yet"
        );
        client.pump(usize::MAX);
        assert_eq!(client.buffered(), 0);
        // One chunk: the opening frame and 100 requests, all kept.
        assert_eq!(client.lanes[&lane].retained.seqs().count(), 100);
        deliver(&mut client, &mut server);
        assert_eq!(server.arrived.len(), 100);
        client.ack(lane, 60);
        assert_eq!(client.lanes[&lane].retained.seqs().next(), Some(61));
        client.ack(lane, 100);
        assert_eq!(client.retained(), 0);
    }

    #[test]
    fn a_transport_without_room_keeps_the_rest_pending_in_order() {
        let mut client = SimClient::new();
        let mut server = SimServer::default();
        let bulk = vec![0xAB; 10_000];
        for _ in 0..5 {
            client.submit(Some(1), &bulk, false);
        }
        client.pump(3000);
        let lane = Lane::of_stream(1);
        assert!(!client.lanes[&lane].pending.is_empty());
        let (polled, _) = {
            let out = client.lanes.get_mut(&lane).unwrap();
            out.send.as_mut().unwrap().room = 0;
            poll(out)
        };
        assert!(polled.is_pending(), "a full transport is waited for");
        while client.buffered() > 0 {
            client.pump(4096);
            deliver(&mut client, &mut server);
        }
        assert_eq!(server.arrived.len(), 5);
        assert!(server.arrived.values().all(|(_, b)| *b == bulk));
    }

    /// The link goes down at every possible point of a mixed burst on three lanes; after the resume every
    /// request has reached the serving side exactly once, in its lane's order, with its bytes.
    #[test]
    fn a_resume_at_any_byte_sends_each_request_once() {
        let plan: Vec<(Option<u64>, usize, bool)> = (0..40u64)
            .map(|i| {
                let stream = match i % 3 {
                    0 => None,
                    1 => Some(11),
                    _ => Some(12),
                };
                (stream, (i as usize * 37) % 300, i % 5 == 0)
            })
            .collect();
        let total: usize = {
            let mut client = SimClient::new();
            for &(stream, len, reply) in &plan {
                client.submit(stream, &vec![1; len], reply);
            }
            client.moved.queued
        };
        for cut_after in (0..total).step_by(97) {
            let mut client = SimClient::new();
            let mut server = SimServer::default();
            let mut seqs = Vec::new();
            for (i, &(stream, len, reply)) in plan.iter().enumerate() {
                seqs.push(client.submit(stream, &vec![i as u8; len], reply));
                if i == plan.len() / 2 {
                    client.pump(cut_after / 3);
                    deliver(&mut client, &mut server);
                }
            }
            // Part of what is taken next arrives, then the link goes down.
            client.pump(cut_after / 3);
            for (lane, bytes) in client.drain_wires() {
                let arrived = &bytes[..bytes.len() / 2];
                server.read(lane, arrived);
            }
            client.cut();
            client.pump(usize::MAX);
            assert_eq!(client.buffered(), 0, "a cut link holds nothing back");
            server.reconnect();
            client.resume(&server);
            // A request submitted while resuming goes after what is sent again.
            seqs.push(client.submit(Some(11), b"late", false));
            client.pump(usize::MAX);
            deliver(&mut client, &mut server);
            assert_eq!(client.buffered(), 0);
            assert_eq!(
                server.arrived.keys().copied().collect::<Vec<_>>(),
                seqs,
                "cut after {cut_after} bytes"
            );
            for (i, &(_, len, _)) in plan.iter().enumerate() {
                assert_eq!(server.arrived[&seqs[i]].1, vec![i as u8; len]);
            }
            // The serving side acknowledges everything: nothing stays kept.
            let marks = server.received.marks();
            let lanes: Vec<Lane> = client.lanes.keys().copied().collect();
            for lane in lanes {
                client.ack(lane, mark_of(&marks, lane));
            }
            assert_eq!(client.retained(), 0);
        }
    }

    #[test]
    fn replies_reach_their_waiters_and_a_left_connection_is_fenced_off() {
        let mut session: Session<&str> = Session::new();
        let ordering = order::Ordering::default();
        let a = session.submit(ordering, Some("a")).unwrap();
        assert_eq!(a.posted_before, Some(0));
        for _ in 0..3 {
            assert_eq!(session.submit(ordering, None).unwrap().posted_before, None);
        }
        let b = session.submit(ordering, Some("b")).unwrap();
        assert_eq!(b.posted_before, Some(3));
        assert_eq!(session.poll_acks(0), AckPoll::Quiet);
        assert!(matches!(
            session.handle_reply(0, a.seq),
            Ok(Delivery::To {
                waiter: "a",
                lane: Lane::CONTROL
            })
        ));
        assert_eq!(
            session.poll_acks(0),
            AckPoll::Send(Awaited {
                next: b.seq + 1,
                waiting: vec![b.seq]
            })
        );
        assert_eq!(session.poll_acks(0), AckPoll::Quiet);
        assert!(session.handle_reply(0, a.seq).is_err(), "answered twice");
        // A resume: the old connection's replies are no longer taken; the new one's are.
        let (generation, awaited) = session.begin_resume();
        assert_eq!(awaited.waiting, vec![b.seq]);
        assert!(matches!(
            session.handle_reply(0, b.seq),
            Ok(Delivery::Stale)
        ));
        assert_eq!(session.poll_acks(0), AckPoll::Stop);
        assert!(matches!(
            session.handle_reply(generation, b.seq),
            Ok(Delivery::To { waiter: "b", .. })
        ));
    }

    #[test]
    fn a_lost_session_fails_every_waiter_and_every_later_request() {
        let mut session: Session<u32> = Session::new();
        let ordering = order::Ordering::default();
        session.submit(ordering, Some(1)).unwrap();
        session.submit(ordering, Some(2)).unwrap();
        let (err, mut waiters) = session.fail(ClientError::Lost("first".into()));
        waiters.sort_unstable();
        assert_eq!(waiters, [1, 2]);
        assert!(err.to_string().contains("first"));
        // The first reason stays.
        let (err, waiters) = session.fail(ClientError::Lost("second".into()));
        assert!(err.to_string().contains("first") && waiters.is_empty());
        assert!(session.submit(ordering, Some(3)).is_err());
        assert_eq!(session.poll_acks(0), AckPoll::Stop);
    }

    #[test]
    fn a_flush_with_the_link_down_keeps_each_request_and_not_the_lane_opening() {
        let lane = Lane::of_stream(3);
        let mut moved = Moved::default();
        let mut out: LaneOut<SimStream> = LaneOut::opening(lane, None, &mut moved);
        let opening = moved.queued;
        for seq in [3, 5, 8] {
            out.queue(&request(seq, Deps::default(), false), 4, &mut moved)
                .unwrap();
            out.append(b"data", &mut moved);
        }
        let queued = moved.queued;
        let (polled, moved) = poll(&mut out);
        assert!(matches!(polled, Poll::Ready(Ok(()))));
        // Nothing was handed over: every byte leaves the unsent count; the requests' are kept.
        assert_eq!((moved.taken, moved.dropped), (0, queued));
        assert_eq!(moved.kept, queued - opening);
        assert_eq!(out.retained.seqs().collect::<Vec<_>>(), [3, 5, 8]);
        // The serving side has 3: 5 and 8 go again, after the new stream's opening.
        let mut moved = Moved::default();
        out.resume(SimStream::default(), 3, &mut moved);
        assert_eq!(moved.freed, (queued - opening) / 3);
        assert_eq!(out.pending.len(), 3);
        assert_eq!(out.pending[0], opening_frame(lane));
    }
}
