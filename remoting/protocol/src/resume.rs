//! Resuming a session on a new connection: what each side keeps until the other has it, and what it
//! sends again after a drop. Sans-IO: the transports (the client's lanes, the session process's outbox)
//! drive these with frames and acknowledgements.
//!
//! A session outlives its QUIC connection for a grace window. Whatever was in flight when the link went
//! down is lost with the connection, so both sides keep what they sent until the other side says it has
//! it:
//!
//! * the client keeps every request frame ([`Retained`], one per lane) until the serving side has
//!   *received* it: a received request lives in the session process, which survives the drop, and runs
//!   exactly once there;
//! * the serving side keeps every reply frame (its reply cache, a [`ReplyCache`] per lane) until the
//!   client has received it.
//!
//! Requests of one lane travel on one QUIC stream in seq order, so the serving side says what it
//! received with one number per lane ("everything up to seq S": [`Received`], [`Marks`]). Replies of a
//! lane may leave out of seq order (a host function's answer waits for its stream), so the client says
//! instead which replies it still waits for ([`Awaited`]). Acknowledgements travel while the link is up
//! (a reply acknowledges its lane's requests up to its seq; periodic [`crate::wire::Acks`] and
//! [`Awaited`] cover the rest), so what is kept stays small. On resume each side tells the other what it
//! has; each forgets that and sends again what is left: nothing twice, nothing lost.

use std::collections::{BTreeMap, HashMap, VecDeque};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::order::Lane;

/// Per lane, the seq of the last frame received (every earlier frame of the lane was received too).
pub type Marks = Vec<(Lane, u64)>;

/// One frame kept for sending again: its seq and its bytes (a head and an optional bulk part, so a
/// reply's data is kept without copying it).
#[derive(Clone, Debug)]
pub struct Frame {
    /// The request's seq (for a reply: the seq of the request it answers).
    pub seq: u64,
    /// The frame's bytes (or their first part).
    pub head: Bytes,
    /// The rest of the frame's bytes (may be empty).
    pub bulk: Bytes,
}

impl Frame {
    /// The frame's size in bytes.
    pub fn len(&self) -> usize {
        self.head.len() + self.bulk.len()
    }

    /// Whether the frame has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One lane's sent frames that the other side has not acknowledged yet, in seq order.
#[derive(Debug, Default)]
pub struct Retained {
    frames: VecDeque<Frame>,
    bytes: usize,
    /// Everything up to this seq is acknowledged (frames at or below it are not kept).
    acked: u64,
}

impl Retained {
    /// Keeps a frame just sent. Frames of a lane are sent in increasing seq order; a frame already
    /// acknowledged (a reply to a request the peer says it has the reply of) is not kept.
    pub fn keep(&mut self, frame: Frame) {
        if frame.seq <= self.acked {
            return;
        }
        debug_assert!(
            self.frames.back().is_none_or(|last| last.seq < frame.seq),
            "frames of a lane are kept in seq order"
        );
        self.bytes += frame.len();
        self.frames.push_back(frame);
    }

    /// The other side has every frame up to `through`: forget them. Returns the bytes freed.
    pub fn ack(&mut self, through: u64) -> usize {
        if through <= self.acked {
            return 0;
        }
        self.acked = through;
        let mut freed = 0;
        while let Some(front) = self.frames.front() {
            if front.seq > through {
                break;
            }
            freed += front.len();
            self.frames.pop_front();
        }
        self.bytes -= freed;
        freed
    }

    /// The frames to send again on a new connection, in order, as chunks for the stream.
    pub fn unacked(&self) -> Vec<Bytes> {
        let mut out = Vec::with_capacity(self.frames.len() * 2);
        for frame in &self.frames {
            out.push(frame.head.clone());
            if !frame.bulk.is_empty() {
                out.push(frame.bulk.clone());
            }
        }
        out
    }

    /// The seqs kept, oldest first.
    pub fn seqs(&self) -> impl Iterator<Item = u64> + '_ {
        self.frames.iter().map(|f| f.seq)
    }

    /// Bytes kept.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The acknowledged mark.
    pub fn acked(&self) -> u64 {
        self.acked
    }
}

/// Which replies the client still waits for: every request below `next` that asked for a reply and is
/// not in `waiting` has had it.
#[derive(Clone, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct Awaited {
    /// The seq the client's next request will get.
    pub next: u64,
    /// The requests whose replies it waits for, in increasing order.
    pub waiting: Vec<u64>,
}

impl Awaited {
    /// Whether the client has the reply to request `seq`.
    pub fn has(&self, seq: u64) -> bool {
        seq < self.next && self.waiting.binary_search(&seq).is_err()
    }
}

/// One lane's replies the client may not have yet, by seq.
#[derive(Debug, Default)]
pub struct ReplyCache {
    frames: BTreeMap<u64, Frame>,
    bytes: usize,
}

impl ReplyCache {
    /// Keeps a reply just sent.
    pub fn keep(&mut self, frame: Frame) {
        self.bytes += frame.len();
        if let Some(old) = self.frames.insert(frame.seq, frame) {
            self.bytes -= old.len();
        }
    }

    /// Forgets the replies the client has. Returns the bytes freed.
    pub fn ack(&mut self, awaited: &Awaited) -> usize {
        let mut freed = 0;
        self.frames.retain(|&seq, frame| {
            let gone = awaited.has(seq);
            if gone {
                freed += frame.len();
            }
            !gone
        });
        self.bytes -= freed;
        freed
    }

    /// The replies to send again on a new connection, as chunks for the stream.
    pub fn unacked(&self) -> Vec<Bytes> {
        let mut out = Vec::with_capacity(self.frames.len() * 2);
        for frame in self.frames.values() {
            out.push(frame.head.clone());
            if !frame.bulk.is_empty() {
                out.push(frame.bulk.clone());
            }
        }
        out
    }

    /// The seqs kept, in order.
    pub fn seqs(&self) -> impl Iterator<Item = u64> + '_ {
        self.frames.keys().copied()
    }

    /// Bytes kept.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// What one side received, per lane.
#[derive(Debug, Default)]
pub struct Received {
    lanes: HashMap<Lane, u64>,
    /// Changed since [`Received::take_changed`] last said so.
    changed: bool,
}

/// A frame arrived out of its lane's order: the other side resent something it need not have, or
/// skipped something. Either breaks exactly-once, so the session cannot go on.
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
#[error("frame {seq} arrived on lane {lane} after frame {last}")]
pub struct Misordered {
    /// The lane.
    pub lane: u64,
    /// The frame's seq.
    pub seq: u64,
    /// The lane's last seq received.
    pub last: u64,
}

impl Received {
    /// Frame `seq` of `lane` arrived.
    pub fn note(&mut self, lane: Lane, seq: u64) -> Result<(), Misordered> {
        let last = self.lanes.entry(lane).or_default();
        if seq <= *last {
            return Err(Misordered {
                lane: lane.0,
                seq,
                last: *last,
            });
        }
        *last = seq;
        self.changed = true;
        Ok(())
    }

    /// The marks to acknowledge or to resume with.
    pub fn marks(&self) -> Marks {
        let mut marks: Marks = self.lanes.iter().map(|(&l, &s)| (l, s)).collect();
        marks.sort_unstable();
        marks
    }

    /// The last seq received on `lane` (0: none).
    pub fn mark(&self, lane: Lane) -> u64 {
        self.lanes.get(&lane).copied().unwrap_or(0)
    }

    /// Whether anything arrived since the last call (an acknowledgement is due).
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }
}

/// A lane's mark among `marks` (0: nothing of it received).
pub fn mark_of(marks: &[(Lane, u64)], lane: Lane) -> u64 {
    marks
        .iter()
        .find(|(l, _)| *l == lane)
        .map_or(0, |&(_, s)| s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(seq: u64, len: usize) -> Frame {
        Frame {
            seq,
            head: Bytes::from(vec![seq as u8; len]),
            bulk: Bytes::new(),
        }
    }

    #[test]
    fn acknowledged_frames_are_forgotten_and_the_rest_resent_in_order() {
        let mut r = Retained::default();
        for seq in [2, 5, 7, 9] {
            r.keep(frame(seq, 10));
        }
        assert_eq!(r.bytes(), 40);
        assert_eq!(r.ack(5), 20);
        assert_eq!(r.ack(4), 0, "an older acknowledgement changes nothing");
        assert_eq!(r.seqs().collect::<Vec<_>>(), [7, 9]);
        let again = r.unacked();
        assert_eq!(again.len(), 2);
        assert_eq!(again[0][0], 7);
        assert_eq!(again[1][0], 9);
        // A frame at or below the mark is not kept (a reply the client already has).
        r.keep(frame(3, 10));
        assert_eq!(r.seqs().collect::<Vec<_>>(), [7, 9]);
        assert_eq!(r.ack(100), 20);
        assert_eq!(r.bytes(), 0);
        assert!(r.unacked().is_empty());
    }

    #[test]
    fn replies_are_forgotten_once_the_client_no_longer_waits_for_them_in_any_order() {
        let mut cache = ReplyCache::default();
        for seq in [4, 9, 6] {
            cache.keep(frame(seq, 10));
        }
        // The client waits for 6 (a host function's answer that left last) and for 12, sent after.
        let awaited = Awaited {
            next: 13,
            waiting: vec![6, 12],
        };
        assert!(awaited.has(4) && awaited.has(9) && !awaited.has(6) && !awaited.has(13));
        assert_eq!(cache.ack(&awaited), 20);
        assert_eq!(cache.seqs().collect::<Vec<_>>(), [6]);
        assert_eq!(cache.bytes(), 10);
        assert_eq!(cache.unacked().len(), 1);
    }

    #[test]
    fn replies_keep_their_bulk_bytes_without_a_copy() {
        let mut r = ReplyCache::default();
        let data = Bytes::from(vec![1u8; 4096]);
        r.keep(Frame {
            seq: 4,
            head: Bytes::from_static(b"head"),
            bulk: data.clone(),
        });
        assert_eq!(r.bytes(), 4100);
        let again = r.unacked();
        assert_eq!(again.len(), 2);
        assert_eq!(
            again[1].as_ptr(),
            data.as_ptr(),
            "the same bytes, not a copy"
        );
    }

    #[test]
    fn receipt_is_per_lane_and_in_order() {
        let mut got = Received::default();
        got.note(Lane(0), 1).unwrap();
        got.note(Lane(3), 2).unwrap();
        got.note(Lane(0), 4).unwrap();
        assert!(got.take_changed());
        assert!(!got.take_changed());
        assert_eq!(got.marks(), vec![(Lane(0), 4), (Lane(3), 2)]);
        assert_eq!(
            got.note(Lane(0), 4),
            Err(Misordered {
                lane: 0,
                seq: 4,
                last: 4
            })
        );
        assert_eq!(got.mark(Lane(9)), 0);
        assert_eq!(mark_of(&got.marks(), Lane(3)), 2);
        assert_eq!(mark_of(&got.marks(), Lane(9)), 0);
    }

    /// A deterministic pseudo-random generator for the drop simulation.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 33) % n
        }
    }

    /// One direction of a lane over a connection that can drop: frames in flight are lost with it.
    #[derive(Default)]
    struct Wire {
        in_flight: VecDeque<Frame>,
    }

    /// Requests on several lanes, replies to some of them, acknowledgements now and then, and drops at
    /// random points: after each resume, every request has been received exactly once and in order per
    /// lane, and every reply likewise, and what is retained is bounded by what is unacknowledged.
    #[test]
    fn drops_at_any_point_lose_nothing_and_duplicate_nothing() {
        for seed in 1..200u64 {
            let mut rng = Rng(seed);
            let lanes = [Lane(0), Lane(5), Lane(9)];
            // Client side.
            let mut sent: HashMap<Lane, Retained> = HashMap::new();
            let mut waiting: std::collections::BTreeSet<u64> = Default::default();
            let mut to_server: HashMap<Lane, Wire> = HashMap::new();
            // Server side.
            let mut got = Received::default();
            let mut executed: Vec<u64> = Vec::new();
            let mut reply_cache: HashMap<Lane, ReplyCache> = HashMap::new();
            // Replies made but not sent yet (host functions' answers leave when their stream gets there).
            let mut held: Vec<(Lane, u64)> = Vec::new();
            let mut to_client: HashMap<Lane, Wire> = HashMap::new();
            let mut delivered: Vec<u64> = Vec::new();
            let mut next_seq = 1u64;
            let wants_reply = |seq: u64| seq.is_multiple_of(3);
            let awaited = |next: u64, waiting: &std::collections::BTreeSet<u64>| Awaited {
                next,
                waiting: waiting.iter().copied().collect(),
            };

            for _step in 0..300 {
                match rng.below(12) {
                    // The client sends a request.
                    0..=3 => {
                        let lane = lanes[rng.below(3) as usize];
                        let f = frame(next_seq, 1 + rng.below(8) as usize);
                        if wants_reply(next_seq) {
                            waiting.insert(next_seq);
                        }
                        next_seq += 1;
                        sent.entry(lane).or_default().keep(f.clone());
                        to_server.entry(lane).or_default().in_flight.push_back(f);
                    }
                    // A frame reaches the server: it runs it (once) and maybe replies.
                    4 | 5 => {
                        let lane = lanes[rng.below(3) as usize];
                        if let Some(f) = to_server.entry(lane).or_default().in_flight.pop_front() {
                            got.note(lane, f.seq).expect("in order, once");
                            executed.push(f.seq);
                            if wants_reply(f.seq) {
                                held.push((lane, f.seq));
                            }
                        }
                    }
                    // A held reply leaves (any of them: not necessarily in seq order).
                    6 | 7 if !held.is_empty() => {
                        let (lane, seq) = held.swap_remove(rng.below(held.len() as u64) as usize);
                        let r = frame(seq, 3);
                        reply_cache.entry(lane).or_default().keep(r.clone());
                        to_client.entry(lane).or_default().in_flight.push_back(r);
                    }
                    // A reply reaches the client; a reply acknowledges its lane's requests up to it.
                    6..=9 => {
                        let lane = lanes[rng.below(3) as usize];
                        if let Some(r) = to_client.entry(lane).or_default().in_flight.pop_front() {
                            assert!(waiting.remove(&r.seq), "seed {seed}: reply {} twice", r.seq);
                            delivered.push(r.seq);
                            sent.entry(lane).or_default().ack(r.seq);
                        }
                    }
                    // Acknowledgements both ways (they may be stale: an ack in flight).
                    10 => {
                        for (lane, seq) in got.marks() {
                            sent.entry(lane).or_default().ack(seq);
                        }
                        let has = awaited(next_seq, &waiting);
                        for cache in reply_cache.values_mut() {
                            cache.ack(&has);
                        }
                    }
                    // The link drops: everything in flight is lost; then the resume.
                    _ => {
                        to_server.clear();
                        to_client.clear();
                        let server_marks = got.marks();
                        let has = awaited(next_seq, &waiting);
                        for lane in lanes {
                            let kept = sent.entry(lane).or_default();
                            kept.ack(mark_of(&server_marks, lane));
                            let wire = to_server.entry(lane).or_default();
                            for seq in kept.seqs() {
                                wire.in_flight.push_back(frame(seq, 1));
                            }
                            let cache = reply_cache.entry(lane).or_default();
                            cache.ack(&has);
                            let wire = to_client.entry(lane).or_default();
                            for seq in cache.seqs() {
                                wire.in_flight.push_back(frame(seq, 1));
                            }
                        }
                    }
                }
            }
            // Drain: one last resume, then everything arrives.
            let server_marks = got.marks();
            for lane in lanes {
                let kept = sent.entry(lane).or_default();
                kept.ack(mark_of(&server_marks, lane));
                let seqs: Vec<u64> = kept.seqs().collect();
                let wire = to_server.entry(lane).or_default();
                wire.in_flight.clear();
                for seq in seqs {
                    got.note(lane, seq).expect("in order, once");
                    executed.push(seq);
                    if wants_reply(seq) {
                        held.push((lane, seq));
                    }
                }
            }
            for (lane, seq) in held.drain(..) {
                reply_cache.entry(lane).or_default().keep(frame(seq, 3));
            }
            let has = awaited(next_seq, &waiting);
            for lane in lanes {
                let cache = reply_cache.entry(lane).or_default();
                cache.ack(&has);
                for seq in cache.seqs().collect::<Vec<_>>() {
                    assert!(waiting.remove(&seq), "seed {seed}: reply {seq} twice");
                    delivered.push(seq);
                }
            }
            assert!(waiting.is_empty(), "seed {seed}: replies lost: {waiting:?}");
            executed.sort_unstable();
            assert_eq!(
                executed,
                (1..next_seq).collect::<Vec<_>>(),
                "seed {seed}: every request ran exactly once"
            );
            delivered.sort_unstable();
            let want: Vec<u64> = (1..next_seq).filter(|&s| wants_reply(s)).collect();
            assert_eq!(delivered, want, "seed {seed}: every reply arrived once");
        }
    }
}
