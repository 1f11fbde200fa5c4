//! Ordering: which requests of a session must run after which, so that requests can travel on several
//! QUIC streams (one per CUDA stream, "lanes") and still run with CUDA's semantics.
//!
//! CUDA orders work per stream; across streams only through events, the legacy default stream and calls
//! that synchronize the device. A session therefore needs no total order: each request names its
//! [`Lane`] (the CUDA stream it is ordered on; everything else, and the legacy default stream, on the
//! control lane) and its [`Deps`]:
//!
//! * requests of one lane run in the order they were made (a QUIC stream keeps that order);
//! * a *barrier* (work on the legacy default stream, device-wide synchronization, calls that change what
//!   other lanes' work will see) runs only after every earlier request of the session;
//! * a request on another lane runs after the control lane's latest request (so configuration calls and
//!   legacy-stream work made before it are in place), and a request naming an event runs after the
//!   latest request recording that event;
//! * a call that *blocks* the session until a stream's or an event's work ends (`cuStreamSynchronize`,
//!   `cuEventSynchronize`, a copy to host memory) needs nothing more: by the rules above, everything that
//!   work can wait for was handed to the GPU before it. Only a wait on a memory value
//!   (`cuStreamWaitValue*`, batch memory operations) can be released by any earlier request, of any
//!   lane; once a session queued one, its blocking calls become barriers. So a stream synchronization
//!   does not wait for the bytes of a large upload queued earlier on another stream.
//!
//! [`Sequencer`] is the client's half (it numbers requests and computes their lanes and dependencies);
//! [`Scheduler`] is the serving side's (it holds what arrived, per lane, and says what may run next).
//! Both are sans-IO.

use std::collections::{BTreeSet, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::api::ApiCall;
use crate::types::CU_STREAM_LEGACY;
use crate::wire::{Call, LaunchAttr};

/// A lane: one ordered sequence of requests, travelling on one QUIC stream.
#[derive(Clone, Copy, Debug, Deserialize, Eq, Hash, Ord, PartialEq, PartialOrd, Serialize)]
pub struct Lane(pub u64);

impl Lane {
    /// Calls ordered on no stream, and work on the legacy default stream.
    pub const CONTROL: Lane = Lane(0);
    /// Out-of-band messages ([`Call::HostFuncReturned`]): never a stream's lane (no stream handle is
    /// all ones), so nothing queued behind a stream's work or its backpressure holds them back.
    pub const SIGNALS: Lane = Lane(u64::MAX);

    /// The lane of work on CUDA stream `stream` (NULL and `CU_STREAM_LEGACY`: the control lane; the
    /// per-thread default stream and every created stream: a lane of their own).
    pub fn of_stream(stream: u64) -> Lane {
        if stream == 0 || stream == CU_STREAM_LEGACY {
            Lane::CONTROL
        } else {
            Lane(stream)
        }
    }

    /// Whether this lane carries uploads' chunks ([`crate::wire::upload_chunk_stream`]), which a client
    /// sends over its bulk connection.
    pub fn carries_bulk(self) -> bool {
        crate::wire::is_upload_chunk_stream(self.0)
    }
}

/// What must have run before a request may run.
#[derive(Clone, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct Deps {
    /// Every earlier request of the session (smaller `seq`) must have run.
    pub barrier: bool,
    /// These requests (by `seq`) must have run.
    pub after: Vec<u64>,
}

/// How one call is ordered, from the call alone.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Ordering {
    /// The CUDA stream it runs on, if it is stream-ordered.
    pub stream: Option<u64>,
    /// Whether it runs after everything before it (see the module docs).
    pub barrier: bool,
    /// Whether it blocks the session until a stream's or an event's work ends (a barrier once the
    /// session waits on memory values; see the module docs).
    pub blocks: bool,
    /// Whether it makes a stream wait for a value in memory, which any later-run request may write.
    pub waits_on_memory: bool,
    /// The event it records, if any.
    pub records: Option<u64>,
    /// Events whose latest record it must follow.
    pub waits: [Option<u64>; 2],
}

impl Call {
    /// The lane whose stream carries this call's reply, for a call that travelled on `lane`: its own,
    /// except a download that asked for its reply apart ([`Call::MemcpyDtoH`]'s `apart`).
    pub fn answer_lane(&self, lane: Lane) -> Lane {
        match self {
            Call::MemcpyDtoH {
                stream,
                apart: Some(stripe),
                ..
            } => Lane(crate::wire::bulk_stream(*stream, *stripe)),
            _ => lane,
        }
    }

    /// Whether this call's answer carries bytes of device memory (up to a [`crate::wire::COPY_CHUNK`] or
    /// a mirror's ranges), which take the link a while: the serving side runs such a call only while its
    /// replies in flight leave room, and every other lane goes on meanwhile.
    pub fn answers_with_bytes(&self) -> bool {
        match self {
            Call::MemcpyDtoH { .. } | Call::MirrorRead { .. } => true,
            Call::Memcpy3D { copy, .. } => matches!(copy.dst.place, crate::copy::Place::Host),
            _ => false,
        }
    }

    /// How this call is ordered against the session's other requests.
    pub fn ordering(&self) -> Ordering {
        let on = |stream: Option<u64>| Ordering {
            // A copy without a stream is the synchronous form: the legacy default stream.
            stream: Some(stream.unwrap_or(0)),
            ..Ordering::default()
        };
        match self {
            Call::Api(call) => api_ordering(call),
            Call::MemcpyHtoD { stream, .. } => on(*stream),
            // A cached upload's chunks travel ahead of its copy, on a lane of their own per copy stream
            // (bulk bytes, kept off the stream's lane and the control lane); the copy waits for the
            // upload's pseudo event, which each chunk records.
            Call::UploadChunk {
                upload,
                stream,
                stripe,
                ..
            } => Ordering {
                stream: Some(crate::wire::bulk_stream(*stream, *stripe)),
                records: Some(crate::wire::upload_event(*upload)),
                ..Ordering::default()
            },
            Call::UploadCopy {
                upload,
                stream,
                continues,
                ..
            } => {
                let waits = [Some(crate::wire::upload_event(*upload)), None];
                match stream {
                    None if *continues => Ordering {
                        waits,
                        ..Ordering::default()
                    },
                    _ => Ordering {
                        waits,
                        ..on(*stream)
                    },
                }
            }
            // Reading to the host blocks the session until the stream's work is done, which may need an
            // earlier request of another lane (a stream write releasing a wait): it runs after all of them.
            Call::MemcpyDtoH { stream, .. } => Ordering {
                blocks: true,
                ..on(*stream)
            },
            Call::LaunchKernel(launch) => on(Some(launch.stream)),
            Call::Memcpy3D { copy, stream } => Ordering {
                blocks: matches!(copy.dst.place, crate::copy::Place::Host),
                ..on(*stream)
            },
            // Mirror traffic keeps its place in the session's request order, as the client reasoned
            // about work in flight when it made it.
            Call::MirrorWrite { .. } | Call::MirrorRead { .. } => Ordering {
                barrier: true,
                ..Ordering::default()
            },
            // An event named by a launch attribute is recorded by the launch (at its start or end).
            // A host function is a point in its stream's order.
            Call::HostFunc { stream, .. } => on(Some(*stream)),
            Call::LaunchKernelEx { launch, attrs } => Ordering {
                records: attrs.iter().find_map(LaunchAttr::event),
                ..on(Some(launch.stream))
            },
            Call::Hello(_)
            | Call::ModuleLoad
            | Call::ModuleGetFunction { .. }
            | Call::LibraryLoad
            | Call::KernelGetFunction { .. }
            | Call::LoadImage { .. }
            | Call::UploadBegin { .. } => Ordering::default(),
            // Out of band: never numbered by the sequencer (see `Lane::SIGNALS`).
            Call::HostFuncReturned { .. } => Ordering::default(),
            // The session's end runs after everything the client sent before it.
            Call::Goodbye => Ordering {
                barrier: true,
                ..Ordering::default()
            },
        }
    }
}

fn api_ordering(call: &ApiCall) -> Ordering {
    crate::api::api_ordering(call)
}

/// The client's half: numbers requests and works out each one's lane and dependencies.
#[derive(Debug)]
pub struct Sequencer {
    next_seq: u64,
    /// The control lane's latest request.
    last_control: Option<u64>,
    /// Each event's latest recording request.
    last_record: HashMap<u64, u64>,
    /// A wait on a memory value was queued: blocking calls are barriers from then on.
    memory_waits: bool,
}

impl Default for Sequencer {
    fn default() -> Self {
        Self::new(1)
    }
}

impl Sequencer {
    /// A sequencer whose first request gets `first_seq`.
    pub fn new(first_seq: u64) -> Self {
        Self {
            next_seq: first_seq,
            last_control: None,
            last_record: HashMap::new(),
            memory_waits: false,
        }
    }

    /// Numbers the next request, made with `ordering`: its seq, lane and dependencies.
    pub fn next(&mut self, ordering: Ordering) -> (u64, Lane, Deps) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let stream = ordering.stream;
        let lane = stream.map_or(Lane::CONTROL, Lane::of_stream);
        let legacy = lane == Lane::CONTROL && stream.is_some();
        self.memory_waits |= ordering.waits_on_memory;
        let mut deps = Deps {
            barrier: ordering.barrier || legacy || (ordering.blocks && self.memory_waits),
            after: Vec::new(),
        };
        if lane != Lane::CONTROL
            && let Some(control) = self.last_control
        {
            deps.after.push(control);
        }
        for event in ordering.waits.into_iter().flatten() {
            if let Some(&recorded) = self.last_record.get(&event)
                && !deps.after.contains(&recorded)
            {
                deps.after.push(recorded);
            }
        }
        if let Some(event) = ordering.records {
            self.last_record.insert(event, seq);
        }
        if lane == Lane::CONTROL {
            self.last_control = Some(seq);
        }
        (seq, lane, deps)
    }

    /// The seq the next request will get.
    pub fn peek_seq(&self) -> u64 {
        self.next_seq
    }
}

/// The serving side's half: requests arrive per lane, in any interleaving of the lanes; [`Scheduler::pop`]
/// gives the next one whose dependencies have run, taking turns between lanes.
#[derive(Debug)]
pub struct Scheduler<T> {
    lanes: HashMap<Lane, VecDeque<Queued<T>>>,
    /// Every request with a seq below this has run.
    done_below: u64,
    /// Requests at or above `done_below` that have run.
    done_above: BTreeSet<u64>,
    /// Requests received and not yet run.
    waiting: usize,
    /// The lane of the request popped last.
    last: Option<Lane>,
}

#[derive(Debug)]
struct Queued<T> {
    seq: u64,
    deps: Deps,
    item: T,
}

/// Why the scheduler refused a request: the client broke the protocol.
#[derive(Clone, Debug, Eq, PartialEq, thiserror::Error)]
pub enum OrderError {
    /// A seq that was already received or run.
    #[error("request {0} arrived twice")]
    Duplicate(u64),
    /// A request of a lane with a seq not above the lane's previous one.
    #[error("request {seq} arrived on lane {lane} after request {previous}")]
    OutOfOrder {
        /// The lane.
        lane: u64,
        /// The offending seq.
        seq: u64,
        /// The lane's previous seq.
        previous: u64,
    },
    /// A dependency on a later request (it could never run).
    #[error("request {seq} depends on the later request {after}")]
    Forward {
        /// The request.
        seq: u64,
        /// Its dependency.
        after: u64,
    },
}

impl<T> Default for Scheduler<T> {
    fn default() -> Self {
        Self::new(1)
    }
}

impl<T> Scheduler<T> {
    /// A scheduler expecting the session's first request to be `first_seq`.
    pub fn new(first_seq: u64) -> Self {
        Self {
            lanes: HashMap::new(),
            done_below: first_seq,
            done_above: BTreeSet::new(),
            waiting: 0,
            last: None,
        }
    }

    /// A request arrived on `lane`.
    pub fn push(&mut self, lane: Lane, seq: u64, deps: Deps, item: T) -> Result<(), OrderError> {
        if self.has_run(seq) {
            return Err(OrderError::Duplicate(seq));
        }
        if let Some(&after) = deps.after.iter().find(|&&after| after >= seq) {
            return Err(OrderError::Forward { seq, after });
        }
        let queue = self.lanes.entry(lane).or_default();
        if let Some(last) = queue.back()
            && last.seq >= seq
        {
            return Err(if last.seq == seq {
                OrderError::Duplicate(seq)
            } else {
                OrderError::OutOfOrder {
                    lane: lane.0,
                    seq,
                    previous: last.seq,
                }
            });
        }
        queue.push_back(Queued { seq, deps, item });
        self.waiting += 1;
        Ok(())
    }

    /// The next request that may run, taken out; `None` if none may run yet. Among the lanes' first
    /// requests whose dependencies have run: the smallest seq, but not of the lane served last when
    /// another lane has one ready, so that a lane with a long queue (a large upload's chunks) holds
    /// another lane's request back by one request, not by its whole queue. Any choice among ready
    /// requests keeps CUDA's order, which the dependencies carry whole.
    pub fn pop(&mut self) -> Option<(Lane, u64, T)> {
        self.pop_if(|_| true)
    }

    /// [`Scheduler::pop`] among the requests `allowed` lets through: a lane whose next request it holds
    /// back waits (its later requests with it), and every other lane goes on.
    pub fn pop_if(&mut self, allowed: impl Fn(&T) -> bool) -> Option<(Lane, u64, T)> {
        let mut best: Option<(Lane, u64)> = None;
        let mut best_other: Option<(Lane, u64)> = None;
        for (lane, queue) in &self.lanes {
            let Some(q) = queue.front() else { continue };
            if !self.ready(q) || !allowed(&q.item) {
                continue;
            }
            if best.is_none_or(|(_, seq)| q.seq < seq) {
                best = Some((*lane, q.seq));
            }
            if Some(*lane) != self.last && best_other.is_none_or(|(_, seq)| q.seq < seq) {
                best_other = Some((*lane, q.seq));
            }
        }
        let (lane, _) = best_other.or(best)?;
        self.last = Some(lane);
        let queue = self.lanes.get_mut(&lane)?;
        let q = queue.pop_front()?;
        if queue.is_empty() {
            self.lanes.remove(&lane);
        }
        self.waiting -= 1;
        Some((lane, q.seq, q.item))
    }

    /// Records that request `seq` ran (call it once the request has been executed).
    pub fn done(&mut self, seq: u64) {
        if seq < self.done_below {
            return;
        }
        self.done_above.insert(seq);
        while self.done_above.remove(&self.done_below) {
            self.done_below += 1;
        }
    }

    /// Whether request `seq` has run.
    pub fn has_run(&self, seq: u64) -> bool {
        seq < self.done_below || self.done_above.contains(&seq)
    }

    /// Requests received and not yet popped.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Every request below this seq has run (what the session can acknowledge).
    pub fn done_below(&self) -> u64 {
        self.done_below
    }

    fn ready(&self, q: &Queued<T>) -> bool {
        (!q.deps.barrier || self.done_below >= q.seq)
            && q.deps.after.iter().all(|&after| self.has_run(after))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::args;
    use crate::types::CU_STREAM_PER_THREAD;

    const A: u64 = 0x5000;
    const B: u64 = 0x6000;
    const EVENT: u64 = 0x7000;

    fn launch(stream: u64) -> Ordering {
        Ordering {
            stream: Some(stream),
            ..Ordering::default()
        }
    }

    /// Runs everything the scheduler allows, in its order, after delivering the requests lane by lane
    /// in the given lane order (the worst interleaving for lanes delivered late).
    fn run(requests: &[(u64, Lane, Deps)], lane_order: &[Lane]) -> Vec<u64> {
        let mut s = Scheduler::new(1);
        let mut ran = Vec::new();
        for lane in lane_order {
            for (seq, l, deps) in requests {
                if l == lane {
                    s.push(*l, *seq, deps.clone(), *seq).unwrap();
                }
            }
            while let Some((_, seq, _)) = s.pop() {
                s.done(seq);
                ran.push(seq);
            }
        }
        ran
    }

    #[test]
    fn streams_get_lanes_and_the_legacy_stream_is_a_barrier_on_the_control_lane() {
        assert_eq!(Lane::of_stream(0), Lane::CONTROL);
        assert_eq!(Lane::of_stream(CU_STREAM_LEGACY), Lane::CONTROL);
        assert_eq!(
            Lane::of_stream(CU_STREAM_PER_THREAD),
            Lane(CU_STREAM_PER_THREAD)
        );
        assert_eq!(Lane::of_stream(A), Lane(A));
        let mut seq = Sequencer::new(1);
        let (s1, l1, d1) = seq.next(launch(A));
        assert_eq!((s1, l1, d1.barrier, d1.after.len()), (1, Lane(A), false, 0));
        let (s2, l2, d2) = seq.next(launch(0));
        assert_eq!((s2, l2, d2.barrier), (2, Lane::CONTROL, true));
        // Later work on another stream follows the control lane's latest request.
        let (_, _, d3) = seq.next(launch(B));
        assert_eq!(d3.after, [2]);
        // A call on no stream is on the control lane, not a barrier unless the list says so.
        let alloc = Call::Api(ApiCall::cuMemAlloc_v2(args::cuMemAlloc_v2 {
            dptr: (),
            bytesize: 8,
        }));
        let (_, l4, d4) = seq.next(alloc.ordering());
        assert_eq!((l4, d4.barrier), (Lane::CONTROL, false));
        let sync = Call::Api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {}));
        assert!(seq.next(sync.ordering()).2.barrier);
    }

    #[test]
    fn a_download_apart_is_answered_on_its_streams_bulk_lane_and_everything_else_on_its_own() {
        let dtoh = |stream, apart| Call::MemcpyDtoH {
            src: 0x1000,
            len: 4 << 20,
            stream,
            apart,
        };
        let own = Lane::of_stream(A);
        let bulk = dtoh(Some(A), Some(0)).answer_lane(own);
        assert!(bulk.carries_bulk() && bulk != own);
        assert_eq!(bulk, Lane(crate::wire::upload_chunk_stream(Some(A))));
        // Synchronous downloads: the synchronous uploads' chunk lane.
        let sync = dtoh(None, Some(0)).answer_lane(Lane::CONTROL);
        assert_eq!(sync, Lane(crate::wire::SYNC_UPLOAD_STREAM));
        assert_eq!(dtoh(Some(A), None).answer_lane(own), own);
        // Another stripe: another bulk lane of the same stream.
        for stream in [Some(A), None] {
            let lanes: Vec<Lane> = (0..crate::wire::MAX_STRIPES)
                .map(|stripe| dtoh(stream, Some(stripe)).answer_lane(own))
                .collect();
            for (stripe, lane) in lanes.iter().enumerate() {
                assert!(lane.carries_bulk(), "{lane:?}");
                assert_eq!(crate::wire::stripe_of(lane.0), stripe as u8);
                assert!(lanes[..stripe].iter().all(|other| other != lane));
            }
        }
        assert_eq!(Call::Goodbye.answer_lane(Lane::CONTROL), Lane::CONTROL);
    }

    #[test]
    fn a_lane_held_back_waits_and_the_others_go_on() {
        let mut sched = Scheduler::new(1);
        let mut seq = Sequencer::new(1);
        for (stream, item) in [(A, "a1"), (A, "a2"), (B, "b1"), (B, "b2")] {
            let (s, lane, deps) = seq.next(launch(stream));
            sched.push(lane, s, deps, item).unwrap();
        }
        // Lane A's head is held back: B's requests run, in order; A's wait, both.
        let hold_a = |item: &&str| !item.starts_with('a');
        assert_eq!(sched.pop_if(hold_a).map(|p| p.2), Some("b1"));
        sched.done(3);
        assert_eq!(sched.pop_if(hold_a).map(|p| p.2), Some("b2"));
        sched.done(4);
        assert_eq!(sched.pop_if(hold_a), None);
        assert_eq!(sched.pop().map(|p| p.2), Some("a1"));
        sched.done(1);
        assert_eq!(sched.pop().map(|p| p.2), Some("a2"));
    }

    #[test]
    fn event_waits_follow_the_latest_record() {
        let record = Call::Api(ApiCall::cuEventRecord(args::cuEventRecord {
            event: EVENT,
            stream: A,
        }));
        let wait = Call::Api(ApiCall::cuStreamWaitEvent(args::cuStreamWaitEvent {
            stream: B,
            event: EVENT,
            flags: 0,
        }));
        assert_eq!(record.ordering().records, Some(EVENT));
        assert_eq!(wait.ordering().waits, [Some(EVENT), None]);
        let mut seq = Sequencer::new(1);
        let (r, lr, _) = seq.next(record.ordering());
        assert_eq!(lr, Lane(A));
        let (_, lw, dw) = seq.next(wait.ordering());
        assert_eq!((lw, dw.after.clone()), (Lane(B), vec![r]));
        // The requests arrive lane B first: the wait runs only once the record has.
        let reqs = [(r, lr, Deps::default()), (2, lw, dw)];
        assert_eq!(run(&reqs, &[Lane(B), Lane(A)]), [1, 2]);
    }

    #[test]
    fn a_destroyed_event_outlives_the_waits_queued_before_its_destruction() {
        // Record on A, wait on B, destroy: B's wait must find the event even when lane A's record (and so
        // B's wait) arrives after the destroy on the control lane (a race the streams example hit).
        let record = Call::Api(ApiCall::cuEventRecord(args::cuEventRecord {
            event: EVENT,
            stream: A,
        }));
        let wait = Call::Api(ApiCall::cuStreamWaitEvent(args::cuStreamWaitEvent {
            stream: B,
            event: EVENT,
            flags: 0,
        }));
        let destroy = Call::Api(ApiCall::cuEventDestroy_v2(args::cuEventDestroy_v2 {
            event: EVENT,
        }));
        assert!(
            destroy.ordering().barrier,
            "destroying a handle is a barrier"
        );
        let mut seq = Sequencer::new(1);
        let reqs = vec![
            seq.next(record.ordering()),
            seq.next(wait.ordering()),
            seq.next(destroy.ordering()),
        ];
        for order in [
            vec![Lane(A), Lane::CONTROL, Lane(B)],
            vec![Lane::CONTROL, Lane(B), Lane(A)],
            vec![Lane(B), Lane::CONTROL, Lane(A)],
        ] {
            assert_eq!(run(&reqs, &order), [1, 2, 3], "{order:?}");
        }
    }

    #[test]
    fn a_stream_synchronization_runs_after_every_earlier_request() {
        // A wait on A that a write on B releases, then a synchronization of A: the executor blocks in the
        // synchronization, so the write (arriving late on its lane) must run before it.
        let wait = Call::Api(ApiCall::cuStreamWaitValue32_v2(
            args::cuStreamWaitValue32_v2 {
                stream: A,
                addr: 0x1000,
                value: 1,
                flags: 0,
            },
        ));
        let write = Call::Api(ApiCall::cuStreamWriteValue32_v2(
            args::cuStreamWriteValue32_v2 {
                stream: B,
                addr: 0x1000,
                value: 1,
                flags: 0,
            },
        ));
        let sync = Call::Api(ApiCall::cuStreamSynchronize(args::cuStreamSynchronize {
            stream: A,
        }));
        assert!(sync.ordering().blocks && !sync.ordering().barrier);
        assert!(wait.ordering().waits_on_memory);
        let mut seq = Sequencer::new(1);
        let reqs = vec![
            seq.next(wait.ordering()),
            seq.next(write.ordering()),
            seq.next(sync.ordering()),
        ];
        assert!(
            reqs[2].2.barrier,
            "a blocking call after a memory wait is a barrier"
        );
        assert_eq!(run(&reqs, &[Lane(A), Lane(B)]), [1, 2, 3]);
    }

    #[test]
    fn without_memory_waits_a_synchronization_waits_for_its_stream_and_events_only() {
        // A large upload's chunks queued on A before a launch and a synchronization of B: B's
        // synchronization needs none of A's requests (nothing B does can wait for them).
        let sync = |stream| {
            Call::Api(ApiCall::cuStreamSynchronize(args::cuStreamSynchronize {
                stream,
            }))
        };
        let event_sync = Call::Api(ApiCall::cuEventSynchronize(args::cuEventSynchronize {
            event: EVENT,
        }));
        let record = Call::Api(ApiCall::cuEventRecord(args::cuEventRecord {
            event: EVENT,
            stream: A,
        }));
        let mut seq = Sequencer::new(1);
        let mut reqs: Vec<_> = (0..3).map(|_| seq.next(launch(A))).collect();
        reqs.push(seq.next(launch(B)));
        reqs.push(seq.next(sync(B).ordering()));
        let (_, lane, deps) = &reqs[4];
        assert_eq!((*lane, deps.barrier, deps.after.len()), (Lane(B), false, 0));
        // Only B's lane arrived: B's launch and synchronization run.
        let mut s = Scheduler::new(1);
        for (q, lane, deps) in &reqs[3..] {
            s.push(*lane, *q, deps.clone(), ()).unwrap();
        }
        let mut ran = Vec::new();
        while let Some((_, q, ())) = s.pop() {
            s.done(q);
            ran.push(q);
        }
        assert_eq!(ran, [4, 5]);
        // An event's synchronization follows the event's record, not everything earlier.
        let (r, _, _) = seq.next(record.ordering());
        let (_, lane, deps) = seq.next(event_sync.ordering());
        assert_eq!(
            (lane, deps.barrier, deps.after),
            (Lane::CONTROL, false, vec![r])
        );
        // The synchronization of the legacy stream stays a barrier.
        assert!(seq.next(sync(0).ordering()).2.barrier);
    }

    #[test]
    fn a_lane_with_a_long_queue_holds_another_back_by_one_request() {
        // Lane A has ten chunks queued (seqs 1-10) when B's launch (11) arrives: B's runs second.
        let mut s = Scheduler::new(1);
        for q in 1..=10 {
            s.push(Lane(A), q, Deps::default(), ()).unwrap();
        }
        s.push(Lane(B), 11, Deps::default(), ()).unwrap();
        let mut ran = Vec::new();
        while let Some((_, q, ())) = s.pop() {
            s.done(q);
            ran.push(q);
        }
        assert_eq!(ran, [1, 11, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(s.done_below(), 12);
    }

    #[test]
    fn independent_lanes_do_not_wait_for_each_other() {
        // A big upload on A is still arriving while B runs its small calls.
        let mut seq = Sequencer::new(1);
        let reqs: Vec<_> = [A, B, A, B, B]
            .into_iter()
            .map(|s| seq.next(launch(s)))
            .collect();
        let mut s = Scheduler::new(1);
        for (q, lane, deps) in &reqs {
            if *lane == Lane(B) {
                s.push(*lane, *q, deps.clone(), ()).unwrap();
            }
        }
        let mut ran = Vec::new();
        while let Some((_, q, ())) = s.pop() {
            s.done(q);
            ran.push(q);
        }
        assert_eq!(ran, [2, 4, 5]);
        assert_eq!(s.done_below(), 1, "request 1 has not run");
    }

    #[test]
    fn barriers_wait_for_every_earlier_request_and_lanes_keep_their_order() {
        let mut seq = Sequencer::new(1);
        let reqs = vec![
            seq.next(launch(A)),
            seq.next(launch(B)),
            seq.next(launch(0)),
            seq.next(launch(A)),
            seq.next(launch(B)),
        ];
        for order in [
            vec![Lane::CONTROL, Lane(A), Lane(B)],
            vec![Lane(B), Lane::CONTROL, Lane(A)],
            vec![Lane(A), Lane(B), Lane::CONTROL],
        ] {
            let ran = run(&reqs, &order);
            assert_eq!(ran.len(), 5, "{order:?}");
            let pos = |s: u64| ran.iter().position(|&r| r == s).unwrap();
            // The legacy-stream barrier (3) after 1 and 2; A's and B's later work after it.
            assert!(pos(3) > pos(1) && pos(3) > pos(2), "{ran:?}");
            assert!(pos(4) > pos(3) && pos(5) > pos(3), "{ran:?}");
        }
    }

    #[test]
    fn broken_orderings_are_protocol_errors() {
        let mut s = Scheduler::new(1);
        s.push(Lane(A), 2, Deps::default(), ()).unwrap();
        assert!(matches!(
            s.push(Lane(A), 1, Deps::default(), ()),
            Err(OrderError::OutOfOrder { .. })
        ));
        assert!(matches!(
            s.push(Lane(A), 2, Deps::default(), ()),
            Err(OrderError::Duplicate(2))
        ));
        let forward = Deps {
            barrier: false,
            after: vec![9],
        };
        assert!(matches!(
            s.push(Lane(B), 3, forward, ()),
            Err(OrderError::Forward { .. })
        ));
        let (_, q, ()) = s.pop().unwrap();
        s.done(q);
        assert!(matches!(
            s.push(Lane(B), 2, Deps::default(), ()),
            Err(OrderError::Duplicate(2))
        ));
    }

    #[test]
    fn a_synchronous_cached_upload_keeps_its_bulk_off_the_control_lane() {
        use crate::wire::{SYNC_UPLOAD_STREAM, upload_event};
        let mut seq = Sequencer::default();
        let begin = |upload| Call::UploadBegin {
            upload,
            manifest: Vec::new(),
        };
        let chunk = |upload| Call::UploadChunk {
            upload,
            index: 0,
            stream: None,
            stripe: 0,
        };
        let copy = |upload, continues| Call::UploadCopy {
            upload,
            dst: 0,
            stream: None,
            continues,
        };
        let (b1, lane, _) = seq.next(begin(1).ordering());
        assert_eq!(lane, Lane::CONTROL);
        let (c1, lane, deps) = seq.next(chunk(1).ordering());
        assert_eq!(lane, Lane(SYNC_UPLOAD_STREAM));
        assert_ne!(
            lane,
            Lane::SIGNALS,
            "a synchronous upload's chunks are ordered, never signals"
        );
        assert_eq!(deps.after, [b1]);
        // The first segment's copy is the synchronous copy: after everything.
        let (_, lane, deps) = seq.next(copy(1, false).ordering());
        assert_eq!(lane, Lane::CONTROL);
        assert!(deps.barrier && deps.after.contains(&c1));
        let (b2, _, deps) = seq.next(begin(2).ordering());
        assert!(!deps.barrier);
        let (c2, _, deps) = seq.next(chunk(2).ordering());
        assert_eq!(deps.after, [b2]);
        // A later segment's copy follows its own chunks and the control lane, nothing else.
        let (_, lane, deps) = seq.next(copy(2, true).ordering());
        assert_eq!(lane, Lane::CONTROL);
        assert!(!deps.barrier);
        assert_eq!(deps.after, [c2]);
        assert_ne!(upload_event(2), 2);
    }

    #[test]
    fn an_asynchronous_cached_upload_sends_its_chunks_on_a_bulk_lane_and_copies_after_them() {
        use crate::wire::upload_chunk_stream;
        const S: u64 = 0x5555_0000_1000;
        let mut seq = Sequencer::default();
        let chunk = |index| Call::UploadChunk {
            upload: 7,
            index,
            stream: Some(S),
            stripe: 0,
        };
        let (c1, chunk_lane, _) = seq.next(chunk(0).ordering());
        let (c2, lane, _) = seq.next(chunk(1).ordering());
        assert_eq!(lane, chunk_lane);
        assert!(chunk_lane.carries_bulk());
        assert_ne!(chunk_lane, Lane(S), "chunks are off the copy stream's lane");
        let (_, lane, deps) = seq.next(
            Call::UploadCopy {
                upload: 7,
                dst: 0,
                stream: Some(S),
                continues: false,
            }
            .ordering(),
        );
        assert_eq!(lane, Lane(S));
        assert!(!lane.carries_bulk());
        assert!(
            deps.after.contains(&c2),
            "the copy follows its last chunk: {deps:?}"
        );
        assert!(c1 < c2);
        // Every stream's chunk lane is its own, and never one of the reserved lanes.
        for s in [0, 1, 2, S, u64::MAX, u64::MAX - 1, 1 << 62, 3 << 62] {
            let lane = Lane::of_stream(upload_chunk_stream(Some(s)));
            assert!(lane.carries_bulk());
            assert_ne!(lane, Lane::SIGNALS);
            assert_ne!(lane, Lane::CONTROL);
        }
        assert_ne!(
            upload_chunk_stream(Some(S)),
            upload_chunk_stream(Some(S + 0x100))
        );
        assert!(Lane::of_stream(upload_chunk_stream(None)).carries_bulk());
    }
}
