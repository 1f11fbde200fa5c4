//! Streams and events: real asynchrony on a bounded pool of host threads.
//!
//! Every stream is an ordered queue of work items. A queued item first waits for its dependencies (each
//! a [`Signal`] reaching a value), then runs its job, then advances the stream's own signal to the item's
//! ticket. That one mechanism gives:
//!
//! * in-stream order (a queue's items run one at a time, in order);
//! * CUDA's legacy default stream semantics: work on it depends on everything already queued on the
//!   blocking streams, and work queued on a blocking stream depends on everything already queued on it
//!   (non-blocking streams, flag 1, take part in neither);
//! * events: recording queues a marker that advances the event's signal (stamping the host time), and
//!   `cuStreamWaitEvent` queues an item that depends on the event's signal reaching its last record;
//! * host synchronisation: wait for a signal to reach the ticket handed out last.
//!
//! Queues are not threads. A pool of at most [`worker_bound`] worker threads (the host's parallelism,
//! at least 4, at most 32; `GLEAM_EMU_STREAM_WORKERS` overrides) runs the items whose dependencies are
//! met, highest stream priority first, so 10,000 streams cost 10,000 small queues and a handful of
//! threads. Dependencies only ever name work queued earlier, so waiting items never hold a worker and the
//! pool cannot deadlock, whatever its size. Workers are started on demand and run at a lower scheduling
//! priority (`nice` +10, inherited by the threads a kernel launch spreads over), so kernels never slow the
//! control path of this or any other session on the host.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use gleam_protocol::types::{CU_STREAM_LEGACY, CU_STREAM_PER_THREAD, CUresult};

/// Streams one session may create (each is a small queue; this bounds what a client can make us hold).
pub const MAX_STREAMS: usize = 1 << 16;

/// Niceness of worker threads: below the session's control thread and every other session's.
const WORKER_NICE: i32 = 10;

/// How many worker threads run stream work: the host's parallelism, at least 4 (so a few streams make
/// progress side by side even on a small host, as concurrent kernels do on a GPU) and at most 32 (each
/// kernel launch already spreads its blocks over every core); `GLEAM_EMU_STREAM_WORKERS` overrides.
pub fn worker_bound() -> usize {
    if let Some(n) = std::env::var("GLEAM_EMU_STREAM_WORKERS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return n.min(1024);
    }
    std::thread::available_parallelism()
        .map_or(4, std::num::NonZeroUsize::get)
        .clamp(4, 32)
}

/// A monotonic counter that threads can wait on; remembers when it last advanced. Signals made by
/// [`Streams::signal`] also wake the stream workers when they advance (work may be waiting for them).
#[derive(Default)]
pub struct Signal {
    state: Mutex<(u64, Option<Instant>)>,
    changed: Condvar,
    pool: Weak<Pool>,
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

    /// Raises the value to `to` (never lowers it) and wakes waiters, host threads and stream workers.
    pub fn advance_to(&self, to: u64) {
        self.advance_quietly(to);
        if let Some(pool) = self.pool.upgrade() {
            pool.wake();
        }
    }

    /// [`Self::advance_to`] without waking the pool's workers: for a worker that holds the pool's lock
    /// and wakes them itself.
    fn advance_quietly(&self, to: u64) {
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

    fn reached(&self, target: u64) -> bool {
        self.value() >= target
    }

    fn lock(&self) -> MutexGuard<'_, (u64, Option<Instant>)> {
        // Nobody panics while holding it (jobs run outside the lock), so poison is harmless.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A job run by a stream worker.
pub type Job = Box<dyn FnOnce() + Send + 'static>;

/// A dependency: `signal` must reach the value.
pub type Dep = (Arc<Signal>, u64);

/// A condition on device memory an item waits for (`cuStreamWaitValue32`): evaluated by the workers
/// whenever they look for work, and at least every [`POLL`] while any item waits on one, since memory
/// changes without any signal advancing (a host copy, a kernel of another stream).
pub type Gate = Arc<dyn Fn() -> bool + Send + Sync>;

/// How often a gated item is looked at again when nothing else wakes the workers.
const POLL: std::time::Duration = std::time::Duration::from_micros(500);

/// One item of a stream's queue.
struct Work {
    deps: Vec<Dep>,
    job: Option<Job>,
    ticket: u64,
    /// Signals to raise once the stream itself has reached `ticket` (event records): whoever sees one of
    /// them complete also sees the stream's work up to here complete, as `cuStreamQuery` must.
    completes: Vec<Dep>,
    /// Runs only once this holds, too.
    gate: Option<Gate>,
}

/// One queue of the pool.
struct Queue {
    items: VecDeque<Work>,
    priority: i32,
    done: Arc<Signal>,
    /// A worker is running this queue's head item.
    running: bool,
    /// Destroyed: dropped once drained.
    closed: bool,
}

#[derive(Default)]
struct PoolState {
    queues: HashMap<u64, Queue>,
    /// Queues with items and no worker on them, by (priority, id): the only ones a worker looks at, so
    /// idle streams cost nothing.
    waiting: BTreeSet<(i32, u64)>,
    next_queue: u64,
    /// Workers started and not exited.
    workers: usize,
    /// Workers waiting for work.
    idle: usize,
    /// Set by [`Streams::shutdown`]: workers exit once every queue is drained.
    stopping: bool,
    /// Queued items with a gate: while there are any, one idle worker polls.
    gated: usize,
    /// An idle worker is polling the gates.
    polling: bool,
    handles: Vec<JoinHandle<()>>,
}

impl PoolState {
    /// The queue whose head item may run now, highest priority (lowest number) first. While stopping,
    /// dependencies are not waited for: the work is being skipped, and a signal that nothing will raise
    /// any more (one a client was to raise) must not keep the pool from draining.
    fn pick(&self) -> Option<u64> {
        self.waiting.iter().map(|&(_, id)| id).find(|id| {
            self.queues.get(id).is_some_and(|q| {
                q.items.front().is_some_and(|w| {
                    self.stopping
                        || (w.deps.iter().all(|(s, t)| s.reached(*t))
                            && w.gate.as_ref().is_none_or(|open| open()))
                })
            })
        })
    }

    fn pending(&self) -> bool {
        !self.waiting.is_empty() || self.queues.values().any(|q| q.running)
    }

    /// Queues `work` on queue `id` (back if there is no such queue).
    fn push(&mut self, id: u64, work: Work) -> Result<(), Work> {
        let Some(q) = self.queues.get_mut(&id) else {
            return Err(work);
        };
        if work.gate.is_some() {
            self.gated += 1;
        }
        q.items.push_back(work);
        if !q.running {
            self.waiting.insert((q.priority, id));
        }
        Ok(())
    }
}

/// The worker pool of one backend: its queues and threads.
struct Pool {
    state: Mutex<PoolState>,
    /// Workers wait here for runnable work.
    ready: Condvar,
    bound: usize,
}

impl Pool {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Something changed (work queued or finished, a signal advanced): idle workers look again. Taking
    /// the lock orders this after any worker's check-then-wait, so no wake-up is lost.
    fn wake(&self) {
        let _state = self.lock();
        self.ready.notify_all();
    }

    /// Starts a worker if all are busy and the bound allows.
    fn grow(self: &Arc<Self>, state: &mut PoolState) {
        if state.idle > 0 || state.workers >= self.bound {
            return;
        }
        let pool = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("emu-stream".into())
            .spawn(move || worker(&pool));
        match spawned {
            Ok(handle) => {
                state.workers += 1;
                state.handles.push(handle);
            }
            // Existing workers (if any) still drain the queues; with none, synchronisation would hang,
            // so that case is reported loudly.
            Err(e) => tracing::error!(
                workers = state.workers,
                "cannot start a stream worker thread: {e}"
            ),
        }
    }
}

/// A worker: runs runnable items until the pool stops and every queue is drained.
fn worker(pool: &Weak<Pool>) {
    lower_priority();
    let Some(pool) = pool.upgrade() else { return };
    let mut state = pool.lock();
    loop {
        let Some(id) = state.pick() else {
            if state.stopping && !state.pending() {
                break;
            }
            state.idle += 1;
            if state.gated > 0 && !state.polling {
                // Gates change with memory, which raises no signal: look again shortly.
                state.polling = true;
                state = pool
                    .ready
                    .wait_timeout(state, POLL)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
                state.polling = false;
            } else {
                state = pool
                    .ready
                    .wait(state)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            state.idle -= 1;
            continue;
        };
        let Some(queue) = state.queues.get_mut(&id) else {
            continue;
        };
        let Some(work) = queue.items.pop_front() else {
            continue;
        };
        queue.running = true;
        let gated = work.gate.is_some();
        let (done, priority) = (queue.done.clone(), queue.priority);
        state.waiting.remove(&(priority, id));
        if gated {
            state.gated -= 1;
        }
        // Other runnable queues may be waiting for a worker.
        if state.pick().is_some() {
            pool.ready.notify_one();
            pool.grow(&mut state);
        }
        drop(state);

        // A panicking job must not take the worker (and the queue's waiters) with it.
        if let Some(job) = work.job
            && std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err()
        {
            tracing::error!("a job on an emulated stream panicked");
        }
        crate::memory::clear_thread_cache();
        // The item's own signals (events it records) first: whoever the stream's progress wakes (a
        // stream synchronisation) must find them complete, as CUDA promises. Both advance under the
        // pool's lock, which work of other streams is picked under: a stream waiting for one of these
        // events cannot run (and be synchronised) before this stream shows the item done, so a query
        // of this stream after it is never NOT_READY for an item already complete.
        state = pool.lock();
        for (completed, target) in &work.completes {
            completed.advance_quietly(*target);
        }
        done.advance_quietly(work.ticket);
        if let Some(queue) = state.queues.get_mut(&id) {
            queue.running = false;
            // Its priority may have changed meanwhile (`cuStreamSetAttribute`).
            let priority = queue.priority;
            if !queue.items.is_empty() {
                state.waiting.insert((priority, id));
            } else if queue.closed {
                state.queues.remove(&id);
            }
        }
        pool.ready.notify_all();
    }
    state.workers -= 1;
    pool.ready.notify_all();
}

/// Lowers the calling thread's scheduling priority (Linux threads each have their own nice value, and
/// threads they start inherit it).
fn lower_priority() {
    // SAFETY: plain syscalls on the calling thread; a failure only leaves the priority as it was.
    unsafe {
        let tid = libc::gettid();
        let current = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
        let _ = libc::setpriority(
            libc::PRIO_PROCESS,
            tid as libc::id_t,
            (current + WORKER_NICE).min(19),
        );
    }
}

/// `CU_STREAM_NON_BLOCKING`.
pub const STREAM_NON_BLOCKING: u32 = 0x1;

/// One stream, as the backend sees it.
pub struct Stream {
    /// Flags it was created with.
    pub flags: u32,
    /// Its priority (clamped to the device's range).
    pub priority: i32,
    /// The context it belongs to (0: the legacy and per-thread streams, which serve every context).
    pub ctx: u64,
    /// `cuStreamGetId`: unique in the session.
    pub id: u64,
    queue: u64,
    /// Tickets handed out (the last queued item's ticket).
    submitted: u64,
    done: Arc<Signal>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("flags", &self.flags)
            .field("priority", &self.priority)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Stream {
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
    /// `CU_STREAM_PER_THREAD` (the server sees one ordered channel: one blocking stream).
    PerThread,
    /// A created stream.
    Created(u64),
    /// Gleam's own queue for context-wide markers (`cuCtxRecordEvent`); takes part in no implicit
    /// synchronisation.
    Markers,
}

/// All streams of the device.
pub struct Streams {
    pool: Arc<Pool>,
    streams: HashMap<StreamKey, Stream>,
    /// Created streams (the bound [`MAX_STREAMS`] applies to them).
    created: usize,
    next_id: u64,
    /// `cuCtxWaitEvent`: every item queued later in the context waits for these.
    context_waits: Vec<(u64, Dep)>,
    /// Destroyed streams whose queued work has not finished: it still runs, so a device-wide wait
    /// (`cuCtxSynchronize`, `cuMemFree`) and the legacy stream (for a blocking one) still wait for it.
    retiring: Vec<Stream>,
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streams")
            .field("streams", &self.streams.len())
            .finish_non_exhaustive()
    }
}

impl Default for Streams {
    fn default() -> Self {
        Self::new(worker_bound())
    }
}

impl Streams {
    /// Streams run by at most `workers` threads.
    pub fn new(workers: usize) -> Self {
        Self {
            pool: Arc::new(Pool {
                state: Mutex::new(PoolState::default()),
                ready: Condvar::new(),
                bound: workers.max(1),
            }),
            streams: HashMap::new(),
            created: 0,
            next_id: 16,
            context_waits: Vec::new(),
            retiring: Vec::new(),
        }
    }

    /// A fresh signal whose advances wake the workers (for events).
    pub fn signal(&self) -> Arc<Signal> {
        Arc::new(Signal {
            pool: Arc::downgrade(&self.pool),
            ..Signal::default()
        })
    }

    /// Worker threads running now (at most [`worker_bound`]).
    pub fn worker_threads(&self) -> usize {
        self.pool.lock().workers
    }

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

    /// The stream a key names, starting the legacy or per-thread stream on first use.
    pub fn stream(&mut self, key: StreamKey) -> Result<&Stream, CUresult> {
        self.ensure(key)?;
        self.streams.get(&key).ok_or(CUresult::INVALID_HANDLE)
    }

    /// Creates stream `handle`.
    pub fn create(
        &mut self,
        handle: u64,
        flags: u32,
        priority: i32,
        ctx: u64,
    ) -> Result<(), CUresult> {
        if self.created >= MAX_STREAMS {
            tracing::warn!(
                "a session asked for more than {MAX_STREAMS} streams: refused with CUDA_ERROR_OUT_OF_MEMORY"
            );
            return Err(CUresult::OUT_OF_MEMORY);
        }
        let stream = self.open(flags, priority, ctx);
        self.streams.insert(StreamKey::Created(handle), stream);
        self.created += 1;
        Ok(())
    }

    fn open(&mut self, flags: u32, priority: i32, ctx: u64) -> Stream {
        let done = self.signal();
        let mut state = self.pool.lock();
        state.next_queue += 1;
        let queue = state.next_queue;
        state.queues.insert(
            queue,
            Queue {
                items: VecDeque::new(),
                priority,
                done: done.clone(),
                running: false,
                closed: false,
            },
        );
        drop(state);
        self.next_id += 1;
        Stream {
            flags,
            priority,
            ctx,
            id: self.next_id,
            queue,
            submitted: 0,
            done,
        }
    }

    /// Destroys a created stream: its queued work still completes.
    pub fn destroy(&mut self, handle: u64) -> Result<(), CUresult> {
        let stream = self
            .streams
            .remove(&StreamKey::Created(handle))
            .ok_or(CUresult::INVALID_HANDLE)?;
        self.created -= 1;
        self.close(stream.queue);
        self.retiring.retain(Stream::pending);
        if stream.pending() {
            self.retiring.push(stream);
        }
        Ok(())
    }

    fn close(&self, queue: u64) {
        let mut state = self.pool.lock();
        let drained = match state.queues.get_mut(&queue) {
            Some(q) => {
                q.closed = true;
                !q.running && q.items.is_empty()
            }
            None => false,
        };
        if drained {
            state.queues.remove(&queue);
        }
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

    /// Queues `job` on `key` after `extra` dependencies (plus the implicit ones of the legacy stream and of
    /// `cuCtxWaitEvent` in context `ctx`).
    pub fn enqueue(
        &mut self,
        key: StreamKey,
        ctx: u64,
        extra: Vec<Dep>,
        job: Option<Job>,
    ) -> Result<(), CUresult> {
        self.enqueue_work(key, ctx, extra, job, Vec::new(), None)
            .map(drop)
    }

    /// Queues an item on `key` that completes once `gate` holds (after everything queued before it), so
    /// later work on `key` waits for it, without holding a worker meanwhile.
    pub fn enqueue_gate(&mut self, key: StreamKey, ctx: u64, gate: Gate) -> Result<(), CUresult> {
        self.enqueue_work(key, ctx, Vec::new(), None, Vec::new(), Some(gate))
            .map(drop)
    }

    /// Queues a marker that raises `signal` to `target` once everything queued on `key` before it is done
    /// (an event record). Returns the marker's own completion (see [`Event::marker`]).
    pub fn enqueue_signal(
        &mut self,
        key: StreamKey,
        ctx: u64,
        signal: Arc<Signal>,
        target: u64,
    ) -> Result<Dep, CUresult> {
        self.enqueue_work(key, ctx, Vec::new(), None, vec![(signal, target)], None)
    }

    /// `cuCtxRecordEvent`: raises `signal` to `target` once everything queued so far in context `ctx`
    /// (its streams, and the legacy and per-thread streams it uses) is done. Returns the marker's own
    /// completion (see [`Event::marker`]).
    pub fn enqueue_context_signal(
        &mut self,
        ctx: u64,
        signal: Arc<Signal>,
        target: u64,
    ) -> Result<Dep, CUresult> {
        let deps = self
            .streams
            .values()
            .filter(|s| (s.ctx == ctx || s.ctx == 0) && s.pending())
            .map(|s| (s.done.clone(), s.submitted))
            .collect();
        self.enqueue_work(
            StreamKey::Markers,
            ctx,
            deps,
            None,
            vec![(signal, target)],
            None,
        )
    }

    /// `cuCtxWaitEvent`: everything queued later in context `ctx` waits for `signal` to reach `target`.
    pub fn context_wait(&mut self, ctx: u64, signal: Arc<Signal>, target: u64) {
        self.context_waits.retain(|(_, (s, t))| !s.reached(*t));
        self.context_waits.push((ctx, (signal, target)));
    }

    fn enqueue_work(
        &mut self,
        key: StreamKey,
        ctx: u64,
        extra: Vec<Dep>,
        job: Option<Job>,
        completes: Vec<Dep>,
        gate: Option<Gate>,
    ) -> Result<Dep, CUresult> {
        self.ensure(key)?;
        let mut deps = self.implicit_deps(key);
        deps.extend(extra);
        if key != StreamKey::Markers && !self.context_waits.is_empty() {
            self.context_waits.retain(|(_, (s, t))| !s.reached(*t));
            let stream_ctx = self.streams.get(&key).map_or(0, |s| s.ctx);
            let ctx = if stream_ctx == 0 { ctx } else { stream_ctx };
            deps.extend(
                self.context_waits
                    .iter()
                    .filter(|(c, _)| *c == ctx)
                    .map(|(_, dep)| dep.clone()),
            );
        }
        // Already met: nothing to check at run time.
        deps.retain(|(s, t)| !s.reached(*t));
        let stream = self.streams.get_mut(&key).ok_or(CUresult::INVALID_HANDLE)?;
        stream.submitted += 1;
        let work = Work {
            deps,
            job,
            ticket: stream.submitted,
            completes,
            gate,
        };
        let queue = stream.queue;
        let queued = (stream.done.clone(), stream.submitted);
        let mut state = self.pool.lock();
        if let Err(work) = state.push(queue, work) {
            // Only possible after a failed shutdown; never hang a waiter on it.
            drop(state);
            tracing::error!("stream queue {key:?} is gone");
            stream.done.advance_to(stream.submitted);
            for (completed, target) in work.completes {
                completed.advance_to(target);
            }
            return Err(CUresult::LAUNCH_FAILED);
        }
        self.pool.grow(&mut state);
        self.pool.ready.notify_one();
        Ok(queued)
    }

    /// Sets the priority of the stream `key` names: work it queues from now on is served by it.
    pub fn set_priority(&mut self, key: StreamKey, priority: i32) -> Result<(), CUresult> {
        self.ensure(key)?;
        let stream = self.streams.get_mut(&key).ok_or(CUresult::INVALID_HANDLE)?;
        stream.priority = priority;
        let id = stream.queue;
        let mut state = self.pool.lock();
        if let Some(q) = state.queues.get_mut(&id) {
            let old = std::mem::replace(&mut q.priority, priority);
            if state.waiting.remove(&(old, id)) {
                state.waiting.insert((priority, id));
            }
        }
        Ok(())
    }

    /// Memory may have changed outside any stream (a synchronous host copy): gated items are looked at
    /// again now rather than at the next poll.
    pub fn memory_changed(&self) {
        if self.pool.lock().gated > 0 {
            self.pool.wake();
        }
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
        for stream in self.streams.values().chain(&self.retiring) {
            stream.done.wait_for(stream.submitted);
        }
    }

    /// Lets every queue drain (the backend's jobs skip their work once the session is cancelled), stops
    /// the workers and joins them. The streams can be used again afterwards.
    pub fn shutdown(&mut self) {
        let handles = {
            let mut state = self.pool.lock();
            state.stopping = true;
            self.pool.ready.notify_all();
            std::mem::take(&mut state.handles)
        };
        for handle in handles {
            if handle.join().is_err() {
                tracing::error!("a stream worker panicked");
            }
        }
        self.retiring.clear();
        let mut state = self.pool.lock();
        state.queues.clear();
        state.waiting.clear();
        state.gated = 0;
        state.stopping = false;
        drop(state);
        self.streams.clear();
        self.created = 0;
        self.context_waits.clear();
    }

    /// Starts the legacy, per-thread or marker queue on first use.
    fn ensure(&mut self, key: StreamKey) -> Result<(), CUresult> {
        if self.streams.contains_key(&key) {
            return Ok(());
        }
        let stream = match key {
            StreamKey::Legacy | StreamKey::PerThread => self.open(0, 0, 0),
            StreamKey::Markers => self.open(STREAM_NON_BLOCKING, 0, 0),
            StreamKey::Created(_) => return Err(CUresult::INVALID_HANDLE),
        };
        self.streams.insert(key, stream);
        Ok(())
    }

    /// What an item queued on `key` now must wait for besides its own queue's order.
    fn implicit_deps(&self, key: StreamKey) -> Vec<Dep> {
        let blocking = self.streams.get(&key).is_none_or(Stream::blocking);
        if !blocking || key == StreamKey::Markers {
            return Vec::new();
        }
        if key != StreamKey::Legacy {
            // A blocking stream waits for the legacy stream only.
            return self
                .streams
                .get(&StreamKey::Legacy)
                .filter(|s| s.pending())
                .map(|s| vec![(s.done.clone(), s.submitted)])
                .unwrap_or_default();
        }
        self.streams
            .iter()
            .filter(|(k, s)| {
                **k != key
                    && s.pending()
                    && (key == StreamKey::Legacy && s.blocking() || **k == StreamKey::Legacy)
            })
            .map(|(_, s)| s)
            .chain(self.retiring.iter().filter(|s| s.pending() && s.blocking()))
            .map(|s| (s.done.clone(), s.submitted))
            .collect()
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// `CU_EVENT_BLOCKING_SYNC`.
pub const EVENT_BLOCKING_SYNC: u32 = 0x1;
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
    /// The last record's item: its stream's progress and the item's ticket. A finished item raises its
    /// events' signals a moment before its stream's progress (so that whoever synchronises the stream
    /// finds them complete); a host thread waiting for the event waits for both, so that the stream
    /// it recorded on shows the record done too (a query of that stream right after is not NOT_READY).
    pub marker: Option<Dep>,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").finish_non_exhaustive()
    }
}

impl Event {
    /// A fresh, never recorded event that advances `signal` (from [`Streams::signal`]).
    pub fn new(flags: u32, ctx: u64, signal: Arc<Signal>) -> Self {
        Self {
            flags,
            ctx,
            records: 0,
            signal,
            marker: None,
        }
    }

    /// Whether its last record has completed (true if never recorded, as CUDA says).
    pub fn complete(&self) -> bool {
        self.signal.value() >= self.records
            && self
                .marker
                .as_ref()
                .is_none_or(|(done, ticket)| done.reached(*ticket))
    }

    /// Blocks until its last record has completed (`cuEventSynchronize`).
    pub fn wait(&self) {
        self.signal.wait_for(self.records);
        if let Some((done, ticket)) = &self.marker {
            done.wait_for(*ticket);
        }
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    /// Many streams, each with queued work, run on the bounded pool: the work all completes, in each
    /// stream's order, and the threads never exceed the bound.
    #[test]
    fn ten_thousand_streams_share_a_bounded_pool() {
        let mut streams = Streams::new(4);
        let order = Arc::new(Mutex::new(HashMap::<u64, Vec<u32>>::new()));
        let ran = Arc::new(AtomicUsize::new(0));
        for h in 1..=10_000u64 {
            let handle = h << 8;
            streams.create(handle, 0, 0, 7).unwrap();
            for step in 0..2u32 {
                let (order, ran) = (order.clone(), ran.clone());
                let job: Job = Box::new(move || {
                    order.lock().unwrap().entry(handle).or_default().push(step);
                    ran.fetch_add(1, Ordering::Relaxed);
                });
                streams
                    .enqueue(StreamKey::Created(handle), 7, Vec::new(), Some(job))
                    .unwrap();
            }
            assert!(streams.worker_threads() <= 4);
        }
        streams.synchronize_all();
        assert_eq!(ran.load(Ordering::Relaxed), 20_000);
        assert!(order.lock().unwrap().values().all(|v| v == &[0, 1]));
        assert!(streams.worker_threads() <= 4);
    }

    /// A destroyed stream's queued work still runs, and a device-wide wait and the legacy stream wait
    /// for it (`cuMemFree` after `cuStreamDestroy` must not free memory a queued copy still reads: the
    /// `shim` fuzz target found the emu faulting there).
    #[test]
    fn a_destroyed_streams_queued_work_is_still_waited_for() {
        for wait in ["synchronize_all", "legacy"] {
            let mut streams = Streams::new(2);
            let gate = streams.signal();
            streams.create(0x100, 0, 0, 1).unwrap();
            let ran = Arc::new(AtomicUsize::new(0));
            let r = ran.clone();
            streams
                .enqueue(
                    StreamKey::Created(0x100),
                    1,
                    vec![(gate.clone(), 1)],
                    Some(Box::new(move || {
                        r.fetch_add(1, Ordering::Relaxed);
                    })),
                )
                .unwrap();
            streams.destroy(0x100).unwrap();
            let opener = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                gate.advance_to(1);
            });
            match wait {
                "synchronize_all" => streams.synchronize_all(),
                _ => {
                    streams
                        .enqueue(StreamKey::Legacy, 1, Vec::new(), None)
                        .unwrap();
                    streams.synchronize(StreamKey::Legacy);
                }
            }
            assert_eq!(
                ran.load(Ordering::Relaxed),
                1,
                "{wait} returned before the work ran"
            );
            opener.join().unwrap();
        }
    }

    /// An item waiting for a signal holds no worker: with one worker, a later runnable stream still runs.
    #[test]
    fn waiting_work_does_not_hold_a_worker() {
        let mut streams = Streams::new(1);
        let gate = streams.signal();
        streams.create(0x100, 1, 0, 1).unwrap();
        streams.create(0x200, 1, 0, 1).unwrap();
        streams
            .enqueue(StreamKey::Created(0x100), 1, vec![(gate.clone(), 1)], None)
            .unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        streams
            .enqueue(
                StreamKey::Created(0x200),
                1,
                Vec::new(),
                Some(Box::new(move || {
                    r.fetch_add(1, Ordering::Relaxed);
                })),
            )
            .unwrap();
        streams.synchronize(StreamKey::Created(0x200));
        assert_eq!(ran.load(Ordering::Relaxed), 1);
        assert!(streams.busy(StreamKey::Created(0x100)));
        gate.advance_to(1);
        streams.synchronize(StreamKey::Created(0x100));
        assert!(!streams.busy(StreamKey::Created(0x100)));
    }

    /// An item waiting on a gate holds no worker, and runs once the gate opens, even though nothing
    /// signals the change (the workers poll).
    #[test]
    fn gated_work_waits_without_a_worker_and_runs_once_the_gate_opens() {
        let mut streams = Streams::new(1);
        let open = Arc::new(std::sync::atomic::AtomicBool::new(false));
        streams.create(0x100, 1, 0, 1).unwrap();
        streams.create(0x200, 1, 0, 1).unwrap();
        let o = open.clone();
        streams
            .enqueue_gate(
                StreamKey::Created(0x100),
                1,
                Arc::new(move || o.load(Ordering::Acquire)),
            )
            .unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        let after: Job = Box::new(move || {
            r.fetch_add(1, Ordering::Relaxed);
        });
        streams
            .enqueue(StreamKey::Created(0x100), 1, Vec::new(), Some(after))
            .unwrap();
        // The only worker still serves another stream.
        streams
            .enqueue(StreamKey::Created(0x200), 1, Vec::new(), None)
            .unwrap();
        streams.synchronize(StreamKey::Created(0x200));
        std::thread::sleep(Duration::from_millis(20));
        assert!(streams.busy(StreamKey::Created(0x100)));
        assert_eq!(ran.load(Ordering::Relaxed), 0);
        open.store(true, Ordering::Release);
        streams.synchronize(StreamKey::Created(0x100));
        assert_eq!(ran.load(Ordering::Relaxed), 1);
    }

    /// A stream's priority can change while it has work queued.
    #[test]
    fn a_new_priority_applies_to_queued_work() {
        let mut streams = Streams::new(1);
        let gate = streams.signal();
        let log = Arc::new(Mutex::new(Vec::new()));
        for h in [0x100, 0x200, 0x300] {
            streams.create(h, 1, 0, 1).unwrap();
        }
        let g = gate.clone();
        streams
            .enqueue(
                StreamKey::Created(0x300),
                1,
                Vec::new(),
                Some(Box::new(move || g.wait_for(1))),
            )
            .unwrap();
        for (h, name) in [(0x100, "first queued"), (0x200, "raised")] {
            let log = log.clone();
            streams
                .enqueue(
                    StreamKey::Created(h),
                    1,
                    Vec::new(),
                    Some(Box::new(move || log.lock().unwrap().push(name))),
                )
                .unwrap();
        }
        streams.set_priority(StreamKey::Created(0x200), -5).unwrap();
        assert_eq!(streams.get(0x200).unwrap().priority, -5);
        std::thread::sleep(Duration::from_millis(20));
        gate.advance_to(1);
        streams.synchronize_all();
        assert_eq!(*log.lock().unwrap(), ["raised", "first queued"]);
    }

    /// Higher-priority streams (lower numbers) are served first when both are ready.
    #[test]
    fn priorities_order_ready_streams() {
        let mut streams = Streams::new(1);
        let gate = streams.signal();
        let log = Arc::new(Mutex::new(Vec::new()));
        streams.create(0x100, 1, 0, 1).unwrap();
        streams.create(0x200, 1, -5, 1).unwrap();
        // Hold the only worker until both streams have work queued.
        streams.create(0x300, 1, -5, 1).unwrap();
        let g = gate.clone();
        streams
            .enqueue(
                StreamKey::Created(0x300),
                1,
                Vec::new(),
                Some(Box::new(move || g.wait_for(1))),
            )
            .unwrap();
        for (h, name) in [(0x100, "low"), (0x200, "high")] {
            let log = log.clone();
            streams
                .enqueue(
                    StreamKey::Created(h),
                    1,
                    Vec::new(),
                    Some(Box::new(move || log.lock().unwrap().push(name))),
                )
                .unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
        gate.advance_to(1);
        streams.synchronize_all();
        assert_eq!(*log.lock().unwrap(), ["high", "low"]);
    }

    /// Shutting down never waits for a signal nothing will raise.
    #[test]
    fn shutdown_drains_work_whose_dependency_never_comes() {
        let mut streams = Streams::new(2);
        let never = streams.signal();
        streams.create(0x100, 1, 0, 1).unwrap();
        streams
            .enqueue(StreamKey::Created(0x100), 1, vec![(never, 1)], None)
            .unwrap();
        streams.shutdown();
        assert_eq!(streams.worker_threads(), 0);
    }

    #[test]
    fn streams_beyond_the_budget_are_refused() {
        let mut streams = Streams::new(1);
        streams.created = MAX_STREAMS;
        assert_eq!(
            streams.create(1 << 20, 0, 0, 1),
            Err(CUresult::OUT_OF_MEMORY)
        );
        streams.created = 0;
    }
}
