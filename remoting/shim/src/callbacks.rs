//! Host functions (`cuLaunchHostFunc`, `cuStreamAddCallback`): the application's function runs here, in
//! its stream's order on the peer.
//!
//! The call sends a [`Call::HostFunc`] request and returns at once: the calling thread never waits. The
//! peer answers that request only when the stream reaches the function, and holds the stream from then
//! on. A callback thread of this process, one per stream with functions in flight, takes the answer, runs
//! the function, and then tells the peer it returned ([`Call::HostFuncReturned`], out of band), which
//! lets the stream go on. So later work in the stream waits for the function, `cuStreamSynchronize` and
//! `cuCtxSynchronize` return only after it returned, and a function on one stream never holds another
//! stream back. Functions of one stream are queued to its thread in the order their requests were
//! numbered (the queue's lock is held across the send), which is the order the peer's stream reaches them.
//!
//! The status a `cuStreamAddCallback` function gets is the peer's: `CUDA_SUCCESS`, or the context's
//! error. As CUDA documents, a `cuLaunchHostFunc` function is not called when the context has failed.
//! If the session is lost before the stream got there, stream callbacks still run, with the session's
//! error, and host functions do not (nothing of that stream will run any more).
//!
//! Not offered: host functions in stream capture (a graph's host node would call back into this process
//! at every launch of the graph); the call fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and
//! invalidates the capture, as any call illegal in a capture does.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use gleam_client::Pending;
use gleam_protocol::order::Lane;
use gleam_protocol::registry::Kind;
use gleam_protocol::types::{CUresult, CUstream};
use gleam_protocol::wire::Call;

use crate::{context, forward, handles, state};

/// `CUhostFn`.
type HostFn = unsafe extern "C" fn(*mut c_void);
/// `CUstreamCallback`.
type StreamCallback = unsafe extern "C" fn(CUstream, CUresult, *mut c_void);

/// A stream's callback thread exits after this long without functions to run (a new one starts with
/// the next).
const IDLE: Duration = Duration::from_secs(2);
/// `CU_STREAM_CAPTURE_STATUS_NONE`.
const CAPTURE_NONE: u32 = 0;

/// What to call.
#[derive(Clone, Copy)]
enum Function {
    /// `cuLaunchHostFunc`: `f(userData)`.
    Host(HostFn),
    /// `cuStreamAddCallback`: `f(stream, status, userData)`.
    Stream(StreamCallback, CUstream),
}

/// A function waiting for its stream.
struct Queued {
    pending: Pending,
    id: u64,
    function: Function,
    data: *mut c_void,
}

// SAFETY: the application hands `userData` (and its stream handle) to CUDA to be passed to its function
// on a thread of the driver's choosing; nothing here dereferences them.
unsafe impl Send for Queued {}

/// The queue of each stream (by lane: 0 and `CU_STREAM_LEGACY` are one stream) with a callback thread.
static QUEUES: Mutex<Option<HashMap<u64, Sender<Queued>>>> = Mutex::new(None);
/// Callback ids, unique in the process (so in its session).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn queues() -> MutexGuard<'static, Option<HashMap<u64, Sender<Queued>>>> {
    QUEUES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub unsafe fn cuLaunchHostFunc(
    hStream: CUstream,
    fn_: *mut c_void,
    userData: *mut c_void,
) -> Result<(), CUresult> {
    if fn_.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the application passes a `CUhostFn`, a C function of this signature.
    let f = unsafe { std::mem::transmute::<*mut c_void, HostFn>(fn_) };
    place(hStream, Function::Host(f), userData)
}

pub unsafe fn cuStreamAddCallback(
    hStream: CUstream,
    callback: *mut c_void,
    userData: *mut c_void,
    flags: u32,
) -> Result<(), CUresult> {
    // "flags: reserved for future use, must be 0".
    if callback.is_null() || flags != 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the application passes a `CUstreamCallback`, a C function of this signature.
    let f = unsafe { std::mem::transmute::<*mut c_void, StreamCallback>(callback) };
    place(hStream, Function::Stream(f, hStream), userData)
}

/// Sends the function's request and queues it to its stream's callback thread.
fn place(stream: CUstream, function: Function, data: *mut c_void) -> Result<(), CUresult> {
    let session = state::session()?;
    let ctx = context::current();
    if ctx == 0 {
        return Err(CUresult::INVALID_CONTEXT);
    }
    handles::check(Kind::Stream, stream as u64)?;
    if capturing(stream)? {
        return refused_in_capture(stream);
    }
    let key = Lane::of_stream(stream as u64).0;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    // Held until the function is queued: the thread takes functions in the order the peer reaches them.
    let mut queues = queues();
    let queues = queues.get_or_insert_with(HashMap::new);
    let tx = match queues.get(&key) {
        Some(tx) => tx.clone(),
        None => {
            let (tx, rx) = mpsc::channel();
            std::thread::Builder::new()
                .name("gleam-callbacks".into())
                .spawn(move || serve(key, &rx))
                .map_err(|err| {
                    tracing::error!(%err, "cannot start a thread for host functions");
                    CUresult::OUT_OF_MEMORY
                })?;
            queues.insert(key, tx.clone());
            tx
        }
    };
    let call = Call::HostFunc {
        stream: stream as u64,
        id,
    };
    let pending = session
        .client
        .submit(ctx, call, &[], true)
        .map_err(state::lost)?
        .ok_or(CUresult::UNKNOWN)?;
    let queued = Queued {
        pending,
        id,
        function,
        data,
    };
    // The thread exits only after taking its queue out of the map, under this lock: it is alive.
    tx.send(queued).map_err(|_| CUresult::UNKNOWN)
}

/// Whether `stream` is in a capture (asked of the peer only while some capture is in progress: a stream
/// may have joined one).
fn capturing(stream: CUstream) -> Result<bool, CUresult> {
    if !crate::capture::any_capturing() {
        return Ok(false);
    }
    let (mut status, mut id) = (CAPTURE_NONE, 0u64);
    // SAFETY: our own out-values.
    unsafe { forward::cuStreamGetCaptureInfo(stream, &raw mut status, &raw mut id) }?;
    Ok(status != CAPTURE_NONE)
}

/// A host function in a capture: the peer refuses it and invalidates the capture; the call fails with
/// its answer.
fn refused_in_capture(stream: CUstream) -> Result<(), CUresult> {
    tracing::error!(
        "a host function (cuLaunchHostFunc/cuStreamAddCallback) queued on a capturing stream: graphs \
         with host nodes are not supported by Gleam; the capture is invalidated"
    );
    let session = state::session()?;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let call = Call::HostFunc {
        stream: stream as u64,
        id,
    };
    let answer = session
        .client
        .call(context::current(), call)
        .map_err(state::lost)?;
    answer.0.result()?;
    // The peer placed it after all (the stream left its capture meanwhile): let the stream go on.
    let _ = session.client.signal(Call::HostFuncReturned { id });
    Err(CUresult::STREAM_CAPTURE_UNSUPPORTED)
}

/// A stream's callback thread: runs its functions as the peer's stream reaches them.
fn serve(key: u64, rx: &Receiver<Queued>) {
    loop {
        let queued = match rx.recv_timeout(IDLE) {
            Ok(queued) => queued,
            Err(RecvTimeoutError::Timeout) => {
                // Under the lock no function can be queued: leave if none was meanwhile.
                let mut queues = queues();
                match rx.try_recv() {
                    Ok(queued) => queued,
                    Err(_) => {
                        if let Some(q) = queues.as_mut() {
                            q.remove(&key);
                        }
                        return;
                    }
                }
            }
            Err(RecvTimeoutError::Disconnected) => return,
        };
        run(queued);
    }
}

/// Waits for the stream to reach the function, runs it, and lets the stream go on.
fn run(queued: Queued) {
    let Queued {
        pending,
        id,
        function,
        data,
    } = queued;
    let (status, held) = match pending.wait() {
        Ok(answer) => (answer.result, true),
        Err(err) => (state::lost(err), false),
    };
    // At teardown (the library's destructor closed the session) nothing of the application's runs.
    if !crate::DEINITIALIZED.load(Ordering::Acquire) {
        match function {
            // SAFETY: the application's function and argument, called as CUDA calls them.
            Function::Host(f) if status.is_success() => unsafe { f(data) },
            Function::Host(_) => {}
            // SAFETY: as above.
            Function::Stream(f, stream) => unsafe { f(stream, status, data) },
        }
    }
    if held && let Ok(session) = state::session() {
        // A lost session lets nothing wait for this any more.
        let _ = session.client.signal(Call::HostFuncReturned { id });
    }
}
