//! The real backend's 2D/3D copies and mirrored-memory accesses.
//!
//! A [`Copy3D`] becomes one `CUDA_MEMCPY3D` for `cuMemcpy3D_v2` (or `cuMemcpy3DAsync_v2`): host sides
//! point into the request's bulk bytes (packed, so their pitch is the row width) or into the reply's
//! buffer. Mirrored memory (managed memory and `cuMemHostAlloc` memory) is CPU-accessible in this
//! process, so the client's reads and writes of it are plain loads and stores here, at addresses the
//! session engine has checked against the session's mirrored allocations.

use std::cell::OnceCell;
use std::ffi::c_void;

use gleam_protocol::copy::{Copy3D, Place, Side};
use gleam_protocol::descriptors::{
    CU_MEMORYTYPE_ARRAY, CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST, CUDA_MEMCPY3D,
};
use gleam_protocol::types::CUresult;

type Memcpy3D = unsafe extern "C" fn(*const CUDA_MEMCPY3D) -> CUresult;
type Memcpy3DAsync = unsafe extern "C" fn(*const CUDA_MEMCPY3D, *mut c_void) -> CUresult;
type StreamSync = unsafe extern "C" fn(*mut c_void) -> CUresult;

/// The driver entry points copies use, resolved on first use.
#[derive(Default)]
pub(crate) struct CopyFns {
    memcpy3d: OnceCell<Option<Memcpy3D>>,
    memcpy3d_async: OnceCell<Option<Memcpy3DAsync>>,
    stream_sync: OnceCell<Option<StreamSync>>,
}

/// Resolves `name` in the driver as a function of type `T` (`None` if the driver lacks it).
///
/// # Safety
/// `T` must be the C signature of the symbol.
unsafe fn symbol<T: Copy>(lib: &libloading::Library, name: &[u8]) -> Option<T> {
    // SAFETY: the caller promised the type.
    unsafe { lib.get::<T>(name) }.ok().map(|s| *s)
}

/// One side of a `CUDA_MEMCPY3D`: (memory type, host, device, array, x, y, z, pitch, height).
struct CSide {
    kind: u32,
    host: *mut c_void,
    device: u64,
    array: *mut c_void,
    x: usize,
    y: usize,
    z: usize,
    pitch: usize,
    height: usize,
}

fn c_side(side: &Side, host: *mut c_void) -> CSide {
    let (kind, device, array) = match side.place {
        Place::Host => (CU_MEMORYTYPE_HOST, 0, std::ptr::null_mut()),
        Place::Device(d) => (CU_MEMORYTYPE_DEVICE, d, std::ptr::null_mut()),
        Place::Array(a) => (CU_MEMORYTYPE_ARRAY, 0, a as *mut c_void),
    };
    CSide {
        kind,
        host: if side.place == Place::Host {
            host
        } else {
            std::ptr::null_mut()
        },
        device,
        array,
        x: side.x_bytes as usize,
        y: side.y as usize,
        z: side.z as usize,
        pitch: side.pitch as usize,
        height: side.height as usize,
    }
}

/// `cuMemcpy3D_v2`/`cuMemcpy3DAsync_v2` of a canonical copy.
pub(crate) fn memcpy3d(
    lib: &libloading::Library,
    fns: &CopyFns,
    copy: &Copy3D,
    host: &[u8],
    stream: Option<u64>,
) -> Result<Vec<u8>, CUresult> {
    let to_host = copy.dst.place == Place::Host;
    let packed = usize::try_from(copy.packed_bytes().ok_or(CUresult::INVALID_VALUE)?)
        .map_err(|_| CUresult::INVALID_VALUE)?;
    let mut out = if to_host {
        vec![0u8; packed]
    } else {
        Vec::new()
    };
    let s = c_side(&copy.src, host.as_ptr().cast_mut().cast());
    let d = c_side(&copy.dst, out.as_mut_ptr().cast());
    let desc = CUDA_MEMCPY3D {
        srcXInBytes: s.x,
        srcY: s.y,
        srcZ: s.z,
        srcLOD: 0,
        srcMemoryType: s.kind,
        srcHost: s.host,
        srcDevice: s.device,
        srcArray: s.array,
        reserved0: std::ptr::null_mut(),
        srcPitch: s.pitch,
        srcHeight: s.height,
        dstXInBytes: d.x,
        dstY: d.y,
        dstZ: d.z,
        dstLOD: 0,
        dstMemoryType: d.kind,
        dstHost: d.host,
        dstDevice: d.device,
        dstArray: d.array,
        reserved1: std::ptr::null_mut(),
        dstPitch: d.pitch,
        dstHeight: d.height,
        WidthInBytes: copy.width_bytes as usize,
        Height: copy.height as usize,
        Depth: copy.depth as usize,
    };
    match stream {
        None => {
            let f = *fns.memcpy3d.get_or_init(|| {
                // SAFETY: the C signature of cuMemcpy3D_v2.
                unsafe { symbol(lib, b"cuMemcpy3D_v2\0") }
            });
            let f = f.ok_or(CUresult::NOT_SUPPORTED)?;
            // SAFETY: the host sides point into `host` (the packed source, exactly the bytes the copy
            // reads: the session engine checked its length) and `out` (exactly the bytes it writes); the
            // array handles are live (checked by the session engine); the driver validates the rest.
            unsafe { f(&raw const desc) }.result()?;
        }
        Some(stream) => {
            let f = *fns.memcpy3d_async.get_or_init(|| {
                // SAFETY: the C signature of cuMemcpy3DAsync_v2.
                unsafe { symbol(lib, b"cuMemcpy3DAsync_v2\0") }
            });
            let sync = *fns.stream_sync.get_or_init(|| {
                // SAFETY: the C signature of cuStreamSynchronize.
                unsafe { symbol(lib, b"cuStreamSynchronize\0") }
            });
            let (f, sync) = (
                f.ok_or(CUresult::NOT_SUPPORTED)?,
                sync.ok_or(CUresult::NOT_SUPPORTED)?,
            );
            // SAFETY: as above, and the stream is live. From pageable memory (`host` is a plain buffer)
            // the driver has staged the source bytes when the call returns; a host destination is only
            // read after the stream is synchronised below.
            unsafe { f(&raw const desc, stream as *mut c_void) }.result()?;
            if to_host {
                // SAFETY: a live stream.
                unsafe { sync(stream as *mut c_void) }.result()?;
            }
        }
    }
    Ok(out)
}

/// Stores `data` at `addr` of a mirrored allocation.
///
/// # Safety
/// `[addr, addr + data.len())` lies inside a live managed or `cuMemHostAlloc` allocation of this process
/// (the session engine checks it against the session's mirrored allocations).
pub(crate) unsafe fn mirror_write(addr: u64, data: &[u8]) {
    // SAFETY: the caller's promise; the driver maps both kinds of memory for the CPU in this process. The
    // device may access the same memory concurrently, as CUDA's coherence model allows.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
}

/// Loads `len` bytes at `addr` of a mirrored allocation.
///
/// # Safety
/// As for [`mirror_write`].
pub(crate) unsafe fn mirror_read(addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), len) };
    out
}
