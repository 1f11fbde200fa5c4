//! Stream capture and graphs on the emu backend: work queued on a capturing stream is recorded instead
//! of run; the graph it ends as replays the recorded steps, in order, on the stream it is launched on.
//!
//! * `cuStreamBeginCapture_v2` puts a created (or per-thread) stream in capture mode; the legacy stream
//!   cannot capture, as on a GPU.
//! * Kernel launches, memsets and device-to-device copies queued on a capturing stream become steps.
//!   Host copies cannot be captured here: a graph replays them from host memory at each launch, which a
//!   remote peer cannot read (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, the capture invalidated).
//! * An event recorded on a capturing stream and waited for by another stream brings that stream into
//!   the capture (fork/join): its work joins the same steps. Steps are replayed one after the other, so
//!   branches that could run in parallel on a GPU run in sequence, which is one of their valid orders.
//! * Synchronizing or querying a capturing stream is illegal during capture: the call fails with
//!   `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and the capture is invalidated, so `cuStreamEndCapture`
//!   returns `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
//! * `cuGraphInstantiateWithFlags` snapshots a graph's steps; `cuGraphLaunch` queues them as one job (or,
//!   on a capturing stream, appends them to that capture, as a child graph).

use std::collections::HashMap;
use std::sync::Arc;

use gleam_protocol::types::CUresult;

use crate::memory::DeviceMemory;
use crate::streams::StreamKey;

/// One recorded operation, replayable any number of times.
pub type Op = Arc<dyn Fn(&DeviceMemory) -> Result<(), CUresult> + Send + Sync>;

/// A step of a graph: what it is (for error messages) and what it does.
#[derive(Clone)]
pub struct Step {
    /// What the step is, e.g. "kernel add_one".
    pub what: Arc<str>,
    /// What it does.
    pub op: Op,
}

impl std::fmt::Debug for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.what)
    }
}

/// `CUstreamCaptureStatus`.
pub const STATUS_NONE: u32 = 0;
pub const STATUS_ACTIVE: u32 = 1;
pub const STATUS_INVALIDATED: u32 = 2;

#[derive(Debug)]
struct Capture {
    id: u64,
    origin: StreamKey,
    steps: Vec<Step>,
    invalidated: bool,
}

/// The captures in progress, the graphs they made and the executable graphs.
#[derive(Debug, Default)]
pub struct Captures {
    /// Capturing stream -> the graph its capture builds.
    by_stream: HashMap<StreamKey, u64>,
    /// Graph being built -> its capture.
    active: HashMap<u64, Capture>,
    /// Event recorded in a capture -> that capture's graph.
    events: HashMap<u64, u64>,
    /// Finished graphs.
    graphs: HashMap<u64, Arc<Vec<Step>>>,
    /// Executable graphs.
    execs: HashMap<u64, Arc<Vec<Step>>>,
    next_id: u64,
    /// `cuThreadExchangeStreamCaptureMode`'s mode (the session's calls run on one thread).
    mode: u32,
}

impl Captures {
    /// Starts capturing on `key` into graph `graph`.
    pub fn begin(&mut self, key: StreamKey, graph: u64) -> Result<(), CUresult> {
        if key == StreamKey::Legacy {
            return Err(CUresult::STREAM_CAPTURE_UNSUPPORTED);
        }
        if self.by_stream.contains_key(&key) {
            return Err(CUresult::ILLEGAL_STATE);
        }
        self.next_id += 1;
        self.by_stream.insert(key, graph);
        self.active.insert(
            graph,
            Capture {
                id: self.next_id,
                origin: key,
                steps: Vec::new(),
                invalidated: false,
            },
        );
        Ok(())
    }

    /// Ends the capture begun on `key`: the graph, or why there is none.
    pub fn end(&mut self, key: StreamKey) -> Result<u64, CUresult> {
        let graph = *self.by_stream.get(&key).ok_or(CUresult::ILLEGAL_STATE)?;
        let origin = self.active.get(&graph).map(|c| c.origin);
        if origin != Some(key) {
            // Only the stream that began a capture ends it.
            return Err(CUresult::STREAM_CAPTURE_UNMATCHED);
        }
        self.by_stream.retain(|_, g| *g != graph);
        self.events.retain(|_, g| *g != graph);
        let capture = self.active.remove(&graph).ok_or(CUresult::ILLEGAL_STATE)?;
        if capture.invalidated {
            return Err(CUresult::STREAM_CAPTURE_INVALIDATED);
        }
        self.graphs.insert(graph, Arc::new(capture.steps));
        Ok(graph)
    }

    /// The capture `key` is in, if any: (status, id, graph being built).
    pub fn info(&self, key: StreamKey) -> (u32, u64, u64) {
        match self
            .by_stream
            .get(&key)
            .and_then(|g| self.active.get(g).map(|c| (c, *g)))
        {
            Some((c, graph)) if c.invalidated => (STATUS_INVALIDATED, c.id, graph),
            Some((c, graph)) => (STATUS_ACTIVE, c.id, graph),
            None => (STATUS_NONE, 0, 0),
        }
    }

    /// Whether `key` is capturing.
    pub fn capturing(&self, key: StreamKey) -> bool {
        self.by_stream.contains_key(&key)
    }

    /// Records `step` if `key` is capturing; `Ok(false)` if it is not (then run it).
    pub fn record(&mut self, key: StreamKey, step: Step) -> Result<bool, CUresult> {
        let Some(graph) = self.by_stream.get(&key) else {
            return Ok(false);
        };
        let capture = self.active.get_mut(graph).ok_or(CUresult::ILLEGAL_STATE)?;
        if capture.invalidated {
            return Err(CUresult::STREAM_CAPTURE_INVALIDATED);
        }
        capture.steps.push(step);
        Ok(true)
    }

    /// Something illegal during capture happened on `key`: its capture is invalidated.
    pub fn invalidate(&mut self, key: StreamKey) -> CUresult {
        if let Some(c) = self
            .by_stream
            .get(&key)
            .and_then(|g| self.active.get_mut(g))
        {
            c.invalidated = true;
        }
        CUresult::STREAM_CAPTURE_UNSUPPORTED
    }

    /// `cuEventRecord` on a capturing stream: the event marks a point of that capture. `Ok(false)` if
    /// `key` is not capturing.
    pub fn record_event(&mut self, key: StreamKey, event: u64) -> Result<bool, CUresult> {
        match self.by_stream.get(&key) {
            Some(&graph) => {
                self.events.insert(event, graph);
                Ok(true)
            }
            None => {
                self.events.remove(&event);
                Ok(false)
            }
        }
    }

    /// `cuEventQuery`, `cuEventSynchronize` or `cuEventElapsedTime` on `event`: an event last recorded in
    /// a capture in progress marks a point of a graph, not work that completes, so asking about it is
    /// illegal during capture (`CUDA_ERROR_CAPTURED_EVENT`) and invalidates that capture.
    pub fn query_event(&mut self, event: u64) -> Result<(), CUresult> {
        let Some(graph) = self.events.get(&event) else {
            return Ok(());
        };
        if let Some(c) = self.active.get_mut(graph) {
            c.invalidated = true;
        }
        Err(CUresult::CAPTURED_EVENT)
    }

    /// `cuStreamWaitEvent` on an event recorded in a capture: `key` joins that capture. `Ok(false)` if
    /// the event belongs to no capture.
    pub fn wait_event(&mut self, key: StreamKey, event: u64) -> Result<bool, CUresult> {
        let Some(&graph) = self.events.get(&event) else {
            return Ok(false);
        };
        match self.by_stream.get(&key) {
            Some(&g) if g == graph => {}
            // A stream of another capture cannot merge into this one.
            Some(_) => return Err(CUresult::STREAM_CAPTURE_MERGE),
            None => {
                self.by_stream.insert(key, graph);
            }
        }
        Ok(true)
    }

    /// `cuThreadExchangeStreamCaptureMode`.
    pub fn exchange_mode(&mut self, mode: u32) -> Result<u32, CUresult> {
        if mode > 2 {
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(std::mem::replace(&mut self.mode, mode))
    }

    /// `cuGraphInstantiateWithFlags`: exec `exec` of graph `graph`.
    pub fn instantiate(&mut self, graph: u64, exec: u64) -> Result<(), CUresult> {
        let steps = self
            .graphs
            .get(&graph)
            .cloned()
            .ok_or(CUresult::INVALID_HANDLE)?;
        self.execs.insert(exec, steps);
        Ok(())
    }

    /// The steps of graph `graph` (captured: one node per step, each depending on the one before).
    pub fn graph(&self, graph: u64) -> Result<Arc<Vec<Step>>, CUresult> {
        self.graphs
            .get(&graph)
            .cloned()
            .ok_or(CUresult::INVALID_HANDLE)
    }

    /// How many edges graph `graph` has: a chain's, one between neighbours.
    pub fn edges(&self, graph: u64) -> Result<usize, CUresult> {
        Ok(self.graph(graph)?.len().saturating_sub(1))
    }

    /// The steps of executable graph `exec`.
    pub fn exec(&self, exec: u64) -> Result<Arc<Vec<Step>>, CUresult> {
        self.execs
            .get(&exec)
            .cloned()
            .ok_or(CUresult::INVALID_HANDLE)
    }

    /// Appends `steps` to the capture `key` is in (a graph launched into a capture).
    pub fn record_all(&mut self, key: StreamKey, steps: &[Step]) -> Result<bool, CUresult> {
        for step in steps {
            if !self.record(key, step.clone())? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// A graph or executable graph was destroyed.
    pub fn forget(&mut self, handle: u64) {
        self.graphs.remove(&handle);
        self.execs.remove(&handle);
    }

    /// A stream is gone: it leaves any capture (a capture it began is abandoned).
    pub fn stream_gone(&mut self, key: StreamKey) {
        if let Some(graph) = self.by_stream.remove(&key)
            && self.active.get(&graph).is_some_and(|c| c.origin == key)
        {
            self.active.remove(&graph);
            self.by_stream.retain(|_, g| *g != graph);
        }
    }

    /// Forgets everything (the session is over).
    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(name: &str) -> Step {
        Step {
            what: name.into(),
            op: Arc::new(|_| Ok(())),
        }
    }

    const A: StreamKey = StreamKey::Created(0xa);
    const B: StreamKey = StreamKey::Created(0xb);

    #[test]
    fn a_capture_records_in_order_and_ends_as_a_graph() {
        let mut c = Captures::default();
        assert_eq!(
            c.begin(StreamKey::Legacy, 1),
            Err(CUresult::STREAM_CAPTURE_UNSUPPORTED)
        );
        c.begin(A, 1).unwrap();
        assert_eq!(c.begin(A, 2), Err(CUresult::ILLEGAL_STATE));
        assert_eq!(c.info(A).0, STATUS_ACTIVE);
        assert!(c.record(A, step("one")).unwrap());
        assert!(!c.record(B, step("elsewhere")).unwrap());
        // Fork to B through an event, work there, join back.
        assert!(c.record_event(A, 0xe1).unwrap());
        assert!(c.wait_event(B, 0xe1).unwrap());
        assert!(c.record(B, step("two")).unwrap());
        assert!(c.record_event(B, 0xe2).unwrap());
        assert!(c.wait_event(A, 0xe2).unwrap());
        // Only the origin ends it.
        assert_eq!(c.end(B), Err(CUresult::STREAM_CAPTURE_UNMATCHED));
        assert_eq!(c.end(A), Ok(1));
        assert_eq!(c.info(B).0, STATUS_NONE);
        c.instantiate(1, 100).unwrap();
        let steps = c.exec(100).unwrap();
        let names: Vec<&str> = steps.iter().map(|s| &*s.what).collect();
        assert_eq!(names, ["one", "two"]);
        // A graph launched into another capture joins it.
        c.begin(B, 2).unwrap();
        assert!(c.record_all(B, &steps).unwrap());
        assert_eq!(c.end(B), Ok(2));
        c.instantiate(2, 200).unwrap();
        assert_eq!(c.exec(200).unwrap().len(), 2);
    }

    #[test]
    fn asking_about_a_captured_event_invalidates_the_capture() {
        let mut c = Captures::default();
        assert_eq!(c.query_event(0xe1), Ok(()));
        c.begin(A, 1).unwrap();
        assert!(c.record_event(A, 0xe1).unwrap());
        assert_eq!(c.query_event(0xe2), Ok(()));
        assert_eq!(c.query_event(0xe1), Err(CUresult::CAPTURED_EVENT));
        assert_eq!(c.info(A).0, STATUS_INVALIDATED);
        assert_eq!(c.end(A), Err(CUresult::STREAM_CAPTURE_INVALIDATED));
        // Once the capture is over, the event is an ordinary one again.
        assert_eq!(c.query_event(0xe1), Ok(()));
    }

    #[test]
    fn an_illegal_call_invalidates_the_capture() {
        let mut c = Captures::default();
        c.begin(A, 1).unwrap();
        assert_eq!(c.invalidate(A), CUresult::STREAM_CAPTURE_UNSUPPORTED);
        assert_eq!(c.info(A).0, STATUS_INVALIDATED);
        assert_eq!(
            c.record(A, step("late")),
            Err(CUresult::STREAM_CAPTURE_INVALIDATED)
        );
        assert_eq!(c.end(A), Err(CUresult::STREAM_CAPTURE_INVALIDATED));
        assert_eq!(c.info(A).0, STATUS_NONE);
        assert_eq!(c.instantiate(1, 5), Err(CUresult::INVALID_HANDLE));
        assert_eq!(c.exchange_mode(1), Ok(0));
        assert_eq!(c.exchange_mode(0), Ok(1));
        assert_eq!(c.exchange_mode(3), Err(CUresult::INVALID_VALUE));
    }
}
