//! Streams and events: real asynchrony on host threads.
//!
//! Every stream is an ordered queue drained by its own worker thread. A queued work item first waits
//! for its dependencies (each a [`Signal`] reaching a value), then runs its job, then advances the
//! stream's own signal to the item's ticket. That one mechanism gives:
//!
//! * in-stream order (one worker per queue);
//! * CUDA's legacy default stream semantics: work on it depends on everything already queued on the
//!   blocking streams, and work queued on a blocking stream depends on everything already queued on it
//!   (non-blocking streams, flag 1, take part in neither);
//! * events: recording queues a job that advances the event's signal (stamping the host time), and
//!   `cuStreamWaitEvent` queues an item that depends on the event's signal reaching its last record;
//! * host synchronisation: wait for a signal to reach the ticket handed out last.
//!
//! A destroyed stream's worker still drains its queue; workers are joined when the backend shuts down.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use gleam_protocol::types::{CU_STREAM_LEGACY, CU_STREAM_PER_THREAD, CUresult};

/// A monotonic counter that threads can wait on; remembers when it last advanced.
#[derive(Default)]
pub struct Signal {
    state: Mutex<(u64, Option<Instant>)>,
    changed: Condvar,
}

impl std::fmt::Debug for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signal").finish_non_exhaustive()
    }
}

impl Signal {
    /// The current value.
    pub fn value(&self) -> u64 {
        self.lock().0
    }

    /// When the signal last advanced (the host time an event completed).
    pub fn stamp(&self) -> Option<Instant> {
        self.lock().1
    }

    /// Raises the value to `to` (never lowers it) and wakes waiters.
    pub fn advance_to(&self, to: u64) {
        let mut state = self.lock();
        if to > state.0 {
            *state = (to, Some(Instant::now()));
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Blocks until the value reaches `target`.
    pub fn wait_for(&self, target: u64) {
        let mut state = self.lock();
        while state.0 < target {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, Option<Instant>)> {
        // Workers never panic while holding it (jobs run outside the lock), so poison is harmless.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A job run by a stream worker.
pub type Job = Box<dyn FnOnce() + Send + 'static>;

/// One item of a stream's queue.
struct Work {
    deps: Vec<(Arc<Signal>, u64)>,
    job: Option<Job>,
    ticket: u64,
    /// Signals to raise once the stream itself has reached `ticket` (event records): whoever sees one of
    /// them complete also sees the stream's work up to here complete, as `cuStreamQuery` must.
    completes: Vec<(Arc<Signal>, u64)>,
}

/// `CU_STREAM_NON_BLOCKING`.
pub const STREAM_NON_BLOCKING: u32 = 0x1;

/// One stream.
pub struct Stream {
    /// Flags it was created with.
    pub flags: u32,
    /// Its priority (clamped to the device's range).
    pub priority: i32,
    /// The context it belongs to.
    pub ctx: u64,
    queue: mpsc::Sender<Work>,
    /// Tickets handed out (the last queued item's ticket).
    submitted: u64,
    done: Arc<Signal>,
    worker: JoinHandle<()>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").finish_non_exhaustive()
    }
}

impl Stream {
    fn spawn(name: String, flags: u32, priority: i32, ctx: u64) -> Result<Self, CUresult> {
        let (queue, rx) = mpsc::channel::<Work>();
        let done = Arc::new(Signal::default());
        let signal = done.clone();
        let worker = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for work in rx {
                    for (dep, target) in &work.deps {
                        dep.wait_for(*target);
                    }
                    // A panicking job must not kill the worker: its waiters would hang forever.
                    if let Some(job) = work.job
                        && std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err()
                    {
                        tracing::error!("a job on an emulated stream panicked");
                    }
                    crate::memory::clear_thread_cache();
                    signal.advance_to(work.ticket);
                    for (completed, target) in &work.completes {
                        completed.advance_to(*target);
                    }
                }
            })
            .map_err(|e| {
                tracing::error!("cannot start a stream worker thread: {e}");
                CUresult::OUT_OF_MEMORY
            })?;
        Ok(Self {
            flags,
            priority,
            ctx,
            queue,
            submitted: 0,
            done,
            worker,
        })
    }

    fn blocking(&self) -> bool {
        self.flags & STREAM_NON_BLOCKING == 0
    }

    fn pending(&self) -> bool {
        self.done.value() < self.submitted
    }
}

/// Which queue a stream handle names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamKey {
    /// The legacy default stream (handle 0 or `CU_STREAM_LEGACY`).
    Legacy,
    /// `CU_STREAM_PER_THREAD` (one client thread here: one blocking stream).
    PerThread,
    /// A created stream.
    Created(u64),
}

/// All streams of the device.
#[derive(Default)]
pub struct Streams {
    streams: HashMap<StreamKey, Stream>,
    /// Workers of destroyed streams, still draining; joined at shutdown.
    retired: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streams").finish_non_exhaustive()
    }
}

impl Streams {
    /// The queue a handle names: sentinels always resolve; created handles must be live.
    pub fn resolve(&self, handle: u64) -> Result<StreamKey, CUresult> {
        match handle {
            0 | CU_STREAM_LEGACY => Ok(StreamKey::Legacy),
            CU_STREAM_PER_THREAD => Ok(StreamKey::PerThread),
            h if self.streams.contains_key(&StreamKey::Created(h)) => Ok(StreamKey::Created(h)),
            _ => Err(CUresult::INVALID_HANDLE),
        }
    }

    /// A created stream.
    pub fn get(&self, handle: u64) -> Option<&Stream> {
        self.streams.get(&StreamKey::Created(handle))
    }

    /// Creates stream `handle`.
    pub fn create(
        &mut self,
        handle: u64,
        flags: u32,
        priority: i32,
        ctx: u64,
    ) -> Result<(), CUresult> {
        let stream = Stream::spawn(format!("emu-stream-{handle:x}"), flags, priority, ctx)?;
        self.streams.insert(StreamKey::Created(handle), stream);
        Ok(())
    }

    /// Destroys a created stream: its queued work still completes.
    pub fn destroy(&mut self, handle: u64) -> Result<(), CUresult> {
        let stream = self
            .streams
            .remove(&StreamKey::Created(handle))
            .ok_or(CUresult::INVALID_HANDLE)?;
        // Dropping the sender ends the worker's loop once the queue is drained.
        drop(stream.queue);
        self.retired.push(stream.worker);
        Ok(())
    }

    /// Handles of the created streams of context `ctx`.
    pub fn of_context(&self, ctx: u64) -> Vec<u64> {
        self.streams
            .iter()
            .filter_map(|(key, s)| match key {
                StreamKey::Created(h) if s.ctx == ctx => Some(*h),
                _ => None,
            })
            .collect()
    }

    /// Queues `job` on `key` after `extra` dependencies (plus the implicit ones of the legacy stream).
    pub fn enqueue(
        &mut self,
        key: StreamKey,
        extra: Vec<(Arc<Signal>, u64)>,
        job: Option<Job>,
    ) -> Result<(), CUresult> {
        self.enqueue_work(key, extra, job, Vec::new())
    }

    /// Queues a marker that raises `signal` to `target` once everything queued on `key` before it is done
    /// (an event record).
    pub fn enqueue_signal(
        &mut self,
        key: StreamKey,
        signal: Arc<Signal>,
        target: u64,
    ) -> Result<(), CUresult> {
        self.enqueue_work(key, Vec::new(), None, vec![(signal, target)])
    }

    fn enqueue_work(
        &mut self,
        key: StreamKey,
        extra: Vec<(Arc<Signal>, u64)>,
        job: Option<Job>,
        completes: Vec<(Arc<Signal>, u64)>,
    ) -> Result<(), CUresult> {
        self.ensure(key)?;
        let mut deps = self.implicit_deps(key);
        deps.extend(extra);
        let stream = self.streams.get_mut(&key).ok_or(CUresult::INVALID_HANDLE)?;
        stream.submitted += 1;
        let work = Work {
            deps,
            job,
            ticket: stream.submitted,
            completes,
        };
        if let Err(mpsc::SendError(work)) = stream.queue.send(work) {
            // Only possible if the worker died; it never does (jobs catch panics), but never hang on it.
            tracing::error!("stream worker {key:?} is gone");
            stream.done.advance_to(stream.submitted);
            for (completed, target) in work.completes {
                completed.advance_to(target);
            }
            return Err(CUresult::LAUNCH_FAILED);
        }
        Ok(())
    }

    /// Blocks until everything queued on `key` so far (and what an item queued now would wait for) is done.
    pub fn synchronize(&self, key: StreamKey) {
        for (signal, target) in self.implicit_deps(key) {
            signal.wait_for(target);
        }
        if let Some(stream) = self.streams.get(&key) {
            stream.done.wait_for(stream.submitted);
        }
    }

    /// Whether work queued on `key` (or that it must wait for) is still outstanding.
    pub fn busy(&self, key: StreamKey) -> bool {
        self.streams.get(&key).is_some_and(Stream::pending)
    }

    /// Blocks until every stream is idle (`cuCtxSynchronize`).
    pub fn synchronize_all(&self) {
        for stream in self.streams.values() {
            stream.done.wait_for(stream.submitted);
        }
    }

    /// Stops every worker once its queue is drained and joins them all.
    pub fn shutdown(&mut self) {
        for (_, stream) in self.streams.drain() {
            drop(stream.queue);
            self.retired.push(stream.worker);
        }
        for worker in self.retired.drain(..) {
            if worker.join().is_err() {
                tracing::error!("a stream worker panicked");
            }
        }
    }

    /// Starts the legacy or per-thread stream on first use.
    fn ensure(&mut self, key: StreamKey) -> Result<(), CUresult> {
        if self.streams.contains_key(&key) {
            return Ok(());
        }
        let stream = match key {
            StreamKey::Legacy => Stream::spawn("emu-stream-legacy".into(), 0, 0, 0)?,
            StreamKey::PerThread => Stream::spawn("emu-stream-per-thread".into(), 0, 0, 0)?,
            StreamKey::Created(_) => return Err(CUresult::INVALID_HANDLE),
        };
        self.streams.insert(key, stream);
        Ok(())
    }

    /// What an item queued on `key` now must wait for besides its own queue's order.
    fn implicit_deps(&self, key: StreamKey) -> Vec<(Arc<Signal>, u64)> {
        let Some(this) = self.streams.get(&key) else {
            // Not started yet: a first item on it still orders against the others.
            return self.deps_of(key, true);
        };
        self.deps_of(key, this.blocking())
    }

    fn deps_of(&self, key: StreamKey, blocking: bool) -> Vec<(Arc<Signal>, u64)> {
        if !blocking {
            return Vec::new();
        }
        self.streams
            .iter()
            .filter(|(k, s)| {
                **k != key
                    && s.pending()
                    && (key == StreamKey::Legacy && s.blocking() || **k == StreamKey::Legacy)
            })
            .map(|(_, s)| (s.done.clone(), s.submitted))
            .collect()
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// `CU_EVENT_DISABLE_TIMING`.
pub const EVENT_DISABLE_TIMING: u32 = 0x2;
/// `CU_EVENT_INTERPROCESS`.
pub const EVENT_INTERPROCESS: u32 = 0x4;

/// One event.
pub struct Event {
    /// Creation flags.
    pub flags: u32,
    /// The context it belongs to.
    pub ctx: u64,
    /// Number of times it was recorded; its signal reaches `records` when the last record completes.
    pub records: u64,
    /// Advanced by the recording streams.
    pub signal: Arc<Signal>,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").finish_non_exhaustive()
    }
}

impl Event {
    /// A fresh, never recorded event.
    pub fn new(flags: u32, ctx: u64) -> Self {
        Self {
            flags,
            ctx,
            records: 0,
            signal: Arc::new(Signal::default()),
        }
    }

    /// Whether its last record has completed (true if never recorded, as CUDA says).
    pub fn complete(&self) -> bool {
        self.signal.value() >= self.records
    }

    /// `cuEventElapsedTime` from `start` to `self`, in milliseconds.
    pub fn elapsed_since(&self, start: &Event) -> Result<f32, CUresult> {
        if (self.flags | start.flags) & EVENT_DISABLE_TIMING != 0
            || self.records == 0
            || start.records == 0
        {
            return Err(CUresult::INVALID_HANDLE);
        }
        if !self.complete() || !start.complete() {
            return Err(CUresult::NOT_READY);
        }
        let (Some(t0), Some(t1)) = (start.signal.stamp(), self.signal.stamp()) else {
            return Err(CUresult::INVALID_HANDLE);
        };
        let ms = if t1 >= t0 {
            (t1 - t0).as_secs_f64() * 1e3
        } else {
            -((t0 - t1).as_secs_f64() * 1e3)
        };
        Ok(ms as f32)
    }
}
