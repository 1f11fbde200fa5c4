//! Streams and events: everything travels through the generated forwarders ([`crate::forward`]); only the
//! CUDA 3.x names of the destroy calls, which binaries built against old headers still call, are
//! written here (same semantics as their `_v2`).

use gleam_protocol::types::{CUevent, CUresult, CUstream};

use crate::forward;

pub unsafe fn cuStreamDestroy(stream: CUstream) -> Result<(), CUresult> {
    // SAFETY: the same call under its CUDA 3.x name (the stream is checked by the forwarder).
    unsafe { forward::cuStreamDestroy_v2(stream) }
}

pub unsafe fn cuEventDestroy(event: CUevent) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe { forward::cuEventDestroy_v2(event) }
}
