//! Stream capture and CUDA graphs: the capture happens where the work runs (the serving driver records
//! what the application queues on a capturing stream), so these calls are forwarded; a captured graph
//! then replays with one `cuGraphLaunch` message.
//!
//! `cuStreamIsCapturing` is asked around every allocation and launch by PyTorch, so the client mirrors
//! which streams it put in capture mode and answers it locally while no capture is in progress. During
//! a capture the peer answers: a stream may have joined it (by waiting for an event recorded in it), and
//! an illegal call may have invalidated it, which only the peer knows.

use std::collections::HashSet;
use std::ffi::{c_char, c_void};
use std::sync::{Mutex, MutexGuard};

use gleam_protocol::types::{CUresult, CUstream};

use crate::{context, forward, put, state};

/// `CUstreamCaptureStatus`.
const CAPTURE_NONE: u32 = 0;
/// `CU_STREAM_CAPTURE_MODE_GLOBAL`.
const MODE_GLOBAL: u32 = 0;

/// Streams in capture mode (as the application names them).
static CAPTURING: Mutex<Option<HashSet<u64>>> = Mutex::new(None);

fn capturing() -> MutexGuard<'static, Option<HashSet<u64>>> {
    CAPTURING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub unsafe fn cuStreamBeginCapture(stream: CUstream) -> Result<(), CUresult> {
    // SAFETY: forwarded; the first version of the call captures in global mode.
    unsafe { cuStreamBeginCapture_v2(stream, MODE_GLOBAL) }
}

pub unsafe fn cuStreamBeginCapture_v2(stream: CUstream, mode: u32) -> Result<(), CUresult> {
    // SAFETY: forwarded under the same contract.
    unsafe { forward::cuStreamBeginCapture_v2(stream, mode) }?;
    capturing()
        .get_or_insert_with(HashSet::new)
        .insert(stream as u64);
    Ok(())
}

pub unsafe fn cuStreamEndCapture(
    stream: CUstream,
    graph: *mut *mut c_void,
) -> Result<(), CUresult> {
    // SAFETY: forwarded under the same contract.
    let ended = unsafe { forward::cuStreamEndCapture(stream, graph) };
    // Capture ends whatever the outcome (an invalidated capture ends with an error).
    if let Some(s) = capturing().as_mut() {
        s.remove(&(stream as u64));
    }
    ended
}

/// Whether any stream of this process is in capture mode.
pub(crate) fn any_capturing() -> bool {
    capturing().as_ref().is_some_and(|s| !s.is_empty())
}

pub unsafe fn cuStreamIsCapturing(stream: CUstream, status: *mut u32) -> Result<(), CUresult> {
    state::session()?;
    crate::handles::check(gleam_protocol::registry::Kind::Stream, stream as u64)?;
    if status.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    if any_capturing() {
        let mut id = 0u64;
        // SAFETY: forwarded; `status` is the caller's (non-NULL) out-pointer, `id` ours.
        return unsafe { forward::cuStreamGetCaptureInfo(stream, status, &raw mut id) };
    }
    // SAFETY: the caller's out-pointer (NULL is refused).
    unsafe { put(status, CAPTURE_NONE) }
}

pub unsafe fn cuStreamGetCaptureInfo_v2(
    stream: CUstream,
    status: *mut u32,
    id: *mut u64,
    graph: *mut *mut c_void,
    deps: *mut u64,
    num_deps: *mut usize,
) -> Result<(), CUresult> {
    if !deps.is_null() {
        // The dependency array lives in the serving driver's memory; nothing Gleam runs asks for it yet.
        tracing::warn!(
            "cuStreamGetCaptureInfo: the capture's dependency nodes are not available through Gleam"
        );
        return Err(CUresult::NOT_SUPPORTED);
    }
    // SAFETY: forwarded under the same contract (a NULL out-pointer stays NULL on the peer).
    unsafe { forward::cuStreamGetCaptureInfo_v2(stream, status, id, graph, deps, num_deps) }
}

#[allow(clippy::too_many_arguments)]
pub unsafe fn cuStreamGetCaptureInfo_v3(
    stream: CUstream,
    status: *mut u32,
    id: *mut u64,
    graph: *mut *mut c_void,
    deps: *mut *const *mut c_void,
    edge_data: *mut *const c_void,
    num_deps: *mut usize,
) -> Result<(), CUresult> {
    if !edge_data.is_null() {
        if deps.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        tracing::warn!(
            "cuStreamGetCaptureInfo: the capture's dependency edges are not available through Gleam"
        );
        return Err(CUresult::NOT_SUPPORTED);
    }
    // SAFETY: the same query without edge data.
    unsafe { cuStreamGetCaptureInfo_v2(stream, status, id, graph, deps.cast(), num_deps) }
}

/// `cuGraphGetNodes`, `cuGraphGetRootNodes`: the count (what PyTorch asks after a capture, to warn of
/// an empty graph). Node handles are pointers into the serving driver, and no node call goes through
/// Gleam yet, so asking for the array is refused, with a log line.
pub unsafe fn cuGraphGetNodes(
    graph: *mut c_void,
    nodes: *mut u64,
    num: *mut usize,
) -> Result<(), CUresult> {
    node_arrays_unavailable("cuGraphGetNodes", [nodes])?;
    // SAFETY: forwarded under the same contract with no array.
    unsafe { forward::cuGraphGetNodes(graph, nodes, num) }
}

pub unsafe fn cuGraphGetRootNodes(
    graph: *mut c_void,
    nodes: *mut u64,
    num: *mut usize,
) -> Result<(), CUresult> {
    node_arrays_unavailable("cuGraphGetRootNodes", [nodes])?;
    // SAFETY: as cuGraphGetNodes.
    unsafe { forward::cuGraphGetRootNodes(graph, nodes, num) }
}

/// `cuGraphGetEdges`: the count, as [`cuGraphGetNodes`].
pub unsafe fn cuGraphGetEdges(
    graph: *mut c_void,
    from: *mut u64,
    to: *mut u64,
    num: *mut usize,
) -> Result<(), CUresult> {
    node_arrays_unavailable("cuGraphGetEdges", [from, to])?;
    // SAFETY: as cuGraphGetNodes.
    unsafe { forward::cuGraphGetEdges(graph, from, to, num) }
}

/// `cuGraphGetEdges_v2` (what CUDA 13's runtime calls): with edge data, also refused when asked for.
pub unsafe fn cuGraphGetEdges_v2(
    graph: *mut c_void,
    from: *mut u64,
    to: *mut u64,
    edge_data: *mut u64,
    num: *mut usize,
) -> Result<(), CUresult> {
    node_arrays_unavailable("cuGraphGetEdges", [from, to, edge_data])?;
    // SAFETY: as cuGraphGetNodes.
    unsafe { forward::cuGraphGetEdges_v2(graph, from, to, edge_data, num) }
}

fn node_arrays_unavailable<const N: usize>(
    call: &str,
    arrays: [*mut u64; N],
) -> Result<(), CUresult> {
    if arrays.iter().all(|a| a.is_null()) {
        return Ok(());
    }
    tracing::warn!(
        call,
        "graph node handles are not available through Gleam (only the count is): refused with CUDA_ERROR_NOT_SUPPORTED"
    );
    Err(CUresult::NOT_SUPPORTED)
}

/// `cuGraphInstantiateWithFlags`: instantiating may raise the stack size ([`context::launched_one`]).
pub unsafe fn cuGraphInstantiateWithFlags(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    flags: u64,
) -> Result<(), CUresult> {
    // SAFETY: forwarded under the same contract.
    let made = unsafe { forward::cuGraphInstantiateWithFlags(exec, graph, flags) };
    context::stack_may_change(context::current());
    made
}

/// `cuGraphLaunch`: one message; its first launch may raise the stack size.
pub unsafe fn cuGraphLaunch(exec: *mut c_void, stream: *mut c_void) -> Result<(), CUresult> {
    // SAFETY: forwarded under the same contract.
    let sent = unsafe { forward::cuGraphLaunch(exec, stream) };
    context::launched_one(exec as u64);
    sent
}

pub unsafe fn cuGraphInstantiate_v2(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    error_node: *mut *mut c_void,
    log: *mut c_char,
    log_size: usize,
) -> Result<(), CUresult> {
    // SAFETY: the optional diagnostics out-pointers, written only if given.
    unsafe {
        if !error_node.is_null() {
            error_node.write_unaligned(std::ptr::null_mut());
        }
        if !log.is_null() && log_size > 0 {
            log.write(0);
        }
    }
    // SAFETY: forwarded with no flags, which is what this version instantiates with.
    unsafe { cuGraphInstantiateWithFlags(exec, graph, 0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captures_in_progress_are_mirrored() {
        assert!(!any_capturing());
        capturing().get_or_insert_with(HashSet::new).insert(0x77);
        assert!(any_capturing());
        capturing().as_mut().unwrap().remove(&0x77);
        assert!(!any_capturing());
    }
}
