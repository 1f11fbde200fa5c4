//! Streams and events the server created for this process, so that fire-and-forget calls using them
//! (`cuEventRecord`, `cuStreamWaitEvent`, the destroy calls) are validated locally and a bad handle is
//! `CUDA_ERROR_INVALID_HANDLE` at the call, as the contract for deferred calls requires, rather than a
//! deferred error later.

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use gleam_protocol::types::{CU_STREAM_LEGACY, CU_STREAM_PER_THREAD, CUevent, CUresult, CUstream};

use crate::generated::fwd;
use crate::memory::per_thread;
use crate::{export, state};

#[derive(Default)]
struct Known {
    streams: HashSet<u64>,
    events: HashSet<u64>,
}

static KNOWN: Mutex<Option<Known>> = Mutex::new(None);

fn known<R>(f: impl FnOnce(&mut Known) -> R) -> R {
    let mut guard: MutexGuard<'_, Option<Known>> = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    f(guard.get_or_insert_with(Known::default))
}

/// A stream argument: NULL and the two special default streams, or one the server created.
pub fn check_stream(stream: CUstream) -> Result<(), CUresult> {
    let s = stream as u64;
    if s == 0
        || s == CU_STREAM_LEGACY
        || s == CU_STREAM_PER_THREAD
        || known(|k| k.streams.contains(&s))
    {
        Ok(())
    } else {
        Err(CUresult::INVALID_HANDLE)
    }
}

/// An event argument: one the server created.
pub fn check_event(event: CUevent) -> Result<(), CUresult> {
    if known(|k| k.events.contains(&(event as u64))) {
        Ok(())
    } else {
        Err(CUresult::INVALID_HANDLE)
    }
}

export! {
    fn cuStreamCreate(stream: *mut CUstream, flags: u32) {
        fwd::cuStreamCreate(stream, flags)?;
        let s = *stream as u64;
        known(|k| k.streams.insert(s));
        Ok(())
    }

    fn cuStreamCreateWithPriority(stream: *mut CUstream, flags: u32, priority: i32) {
        fwd::cuStreamCreateWithPriority(stream, flags, priority)?;
        let s = *stream as u64;
        known(|k| k.streams.insert(s));
        Ok(())
    }

    fn cuStreamDestroy_v2(stream: CUstream) {
        state::session()?;
        let s = stream as u64;
        if !known(|k| k.streams.remove(&s)) {
            return Err(CUresult::INVALID_HANDLE);
        }
        fwd::cuStreamDestroy_v2(stream)
    }

    fn cuEventCreate(event: *mut CUevent, flags: u32) {
        fwd::cuEventCreate(event, flags)?;
        let e = *event as u64;
        known(|k| k.events.insert(e));
        Ok(())
    }

    fn cuEventDestroy_v2(event: CUevent) {
        state::session()?;
        let e = event as u64;
        if !known(|k| k.events.remove(&e)) {
            return Err(CUresult::INVALID_HANDLE);
        }
        fwd::cuEventDestroy_v2(event)
    }

    fn cuEventRecord(event: CUevent, stream: CUstream) {
        state::session()?;
        check_event(event)?;
        check_stream(stream)?;
        fwd::cuEventRecord(event, stream)
    }

    fn cuEventRecord_ptsz(event: CUevent, stream: CUstream) {
        state::session()?;
        check_event(event)?;
        check_stream(stream)?;
        fwd::cuEventRecord(event, per_thread(stream))
    }

    fn cuEventRecordWithFlags(event: CUevent, stream: CUstream, flags: u32) {
        state::session()?;
        check_event(event)?;
        check_stream(stream)?;
        fwd::cuEventRecordWithFlags(event, stream, flags)
    }

    fn cuEventRecordWithFlags_ptsz(event: CUevent, stream: CUstream, flags: u32) {
        state::session()?;
        check_event(event)?;
        check_stream(stream)?;
        fwd::cuEventRecordWithFlags(event, per_thread(stream), flags)
    }

    fn cuStreamWaitEvent(stream: CUstream, event: CUevent, flags: u32) {
        state::session()?;
        check_stream(stream)?;
        check_event(event)?;
        fwd::cuStreamWaitEvent(stream, event, flags)
    }

    fn cuStreamWaitEvent_ptsz(stream: CUstream, event: *mut c_void, flags: u32) {
        state::session()?;
        check_stream(stream)?;
        check_event(event)?;
        fwd::cuStreamWaitEvent(per_thread(stream), event, flags)
    }
}
