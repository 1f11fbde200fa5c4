//! Stream memory operations: a stream waits for, or writes, a 32/64-bit value in device memory. They are
//! forwarded without waiting (`deferred`); what can be checked here is checked at the call, as the driver
//! does (the address's alignment, the flags, a batch's operations), so a malformed call fails where it is
//! made rather than at the next synchronization. A batch travels as its operations, one message each, in
//! order: the peer's stream runs them in the same order.

use std::ffi::c_void;

use gleam_protocol::api::{MemOp, MemOpParams};
use gleam_protocol::types::CUresult;

use crate::forward;

/// The pre-CUDA-12 names (`cuStreamWaitValue32` without `_v2`, and their `_ptsz` forms): NVIDIA's
/// 580 driver answers every one `CUDA_ERROR_NOT_SUPPORTED` (measured on the H200 with
/// `tools/gpu/v1_names.c`), since CUDA 12 took the v1 stream memory operations out; so does Gleam.
macro_rules! removed_v1 {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        pub unsafe fn $name($($arg: $ty),*) -> Result<(), CUresult> {
            let _ = ($($arg),*);
            tracing::debug!(call = stringify!($name), "a v1 stream memory operation: CUDA 12 removed them");
            Err(CUresult::NOT_SUPPORTED)
        }
    )*};
}

removed_v1! {
    cuStreamWaitValue32(stream: *mut c_void, addr: u64, value: u32, flags: u32);
    cuStreamWaitValue32_ptsz(stream: *mut c_void, addr: u64, value: u32, flags: u32);
    cuStreamWaitValue64(stream: *mut c_void, addr: u64, value: u64, flags: u32);
    cuStreamWaitValue64_ptsz(stream: *mut c_void, addr: u64, value: u64, flags: u32);
    cuStreamWriteValue32(stream: *mut c_void, addr: u64, value: u32, flags: u32);
    cuStreamWriteValue32_ptsz(stream: *mut c_void, addr: u64, value: u32, flags: u32);
    cuStreamWriteValue64(stream: *mut c_void, addr: u64, value: u64, flags: u32);
    cuStreamWriteValue64_ptsz(stream: *mut c_void, addr: u64, value: u64, flags: u32);
    cuStreamBatchMemOp(stream: *mut c_void, count: u32, ops: *mut c_void, flags: u32);
    cuStreamBatchMemOp_ptsz(stream: *mut c_void, count: u32, ops: *mut c_void, flags: u32);
}

/// Most operations one `cuStreamBatchMemOp` may carry (CUDA documents "less than 256").
const MAX_BATCH: u32 = 256;

pub unsafe fn cuStreamWaitValue32_v2(
    stream: *mut c_void,
    addr: u64,
    value: u32,
    flags: u32,
) -> Result<(), CUresult> {
    MemOp::wait(addr, value.into(), false, flags)?;
    // SAFETY: forwarded under the same contract.
    unsafe { forward::cuStreamWaitValue32_v2(stream, addr, value, flags) }
}

pub unsafe fn cuStreamWaitValue64_v2(
    stream: *mut c_void,
    addr: u64,
    value: u64,
    flags: u32,
) -> Result<(), CUresult> {
    MemOp::wait(addr, value, true, flags)?;
    // SAFETY: as above.
    unsafe { forward::cuStreamWaitValue64_v2(stream, addr, value, flags) }
}

pub unsafe fn cuStreamWriteValue32_v2(
    stream: *mut c_void,
    addr: u64,
    value: u32,
    flags: u32,
) -> Result<(), CUresult> {
    MemOp::write(addr, value.into(), false, flags)?;
    // SAFETY: as above.
    unsafe { forward::cuStreamWriteValue32_v2(stream, addr, value, flags) }
}

pub unsafe fn cuStreamWriteValue64_v2(
    stream: *mut c_void,
    addr: u64,
    value: u64,
    flags: u32,
) -> Result<(), CUresult> {
    MemOp::write(addr, value, true, flags)?;
    // SAFETY: as above.
    unsafe { forward::cuStreamWriteValue64_v2(stream, addr, value, flags) }
}

pub unsafe fn cuStreamBatchMemOp_v2(
    stream: *mut c_void,
    count: u32,
    ops: *const MemOpParams,
    flags: u32,
) -> Result<(), CUresult> {
    if flags != 0 || count == 0 || count >= MAX_BATCH || ops.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let mut batch = Vec::with_capacity(count as usize);
    for i in 0..count as usize {
        // SAFETY: the caller's array holds `count` entries (read unaligned: C callers may pack it
        // anywhere).
        batch.push(unsafe { ops.add(i).read_unaligned() });
    }
    // All of it is checked before any of it is sent.
    for op in &batch {
        MemOp::try_from(*op)?;
    }
    for op in &batch {
        // SAFETY: forwarded one operation at a time; `op` lives across the call.
        unsafe { forward::cuStreamBatchMemOp_v2(stream, 1, op, 0)? };
    }
    Ok(())
}
