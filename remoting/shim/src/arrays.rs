//! 2D and 3D copies and the array copies: the application's descriptor becomes a canonical
//! [`Copy3D`], its host side packed here (a source) or unpacked here (a destination) with the
//! application's pitches, in frame-sized pieces ([`copy::pieces`]).
//!
//! Which side of a `CU_MEMORYTYPE_UNIFIED` pointer is host memory comes from what this process knows: a
//! device allocation ([`crate::memory::lookup`]) or a device address of mirrored memory is the device's;
//! a host address of mirrored memory is flushed and then used as the device's (both copies agree after
//! the flush; a destination is read back at the next synchronization); anything else is host memory.
//! Copies between two host sides are done here.

use std::ffi::c_void;

use gleam_protocol::copy::{self, Copy3D, Place, Side};
use gleam_protocol::descriptors::{
    CU_MEMORYTYPE_ARRAY, CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST, CU_MEMORYTYPE_UNIFIED,
    CUDA_MEMCPY2D, CUDA_MEMCPY3D,
};
use gleam_protocol::registry::Kind;
use gleam_protocol::types::{CUarray, CUresult, CUstream};
use gleam_protocol::wire::{Call, Reply};

use crate::{context, handles, managed, memory, state};

/// One side of an application's copy, before packing.
#[derive(Clone, Copy, Debug)]
struct AppSide {
    kind: u32,
    host: u64,
    device: u64,
    array: u64,
    x: u64,
    y: u64,
    z: u64,
    pitch: u64,
    height: u64,
}

/// Where one side really is.
#[derive(Clone, Copy, Debug)]
enum Resolved {
    /// The application's memory at this address (row pitch, rows per slice).
    Host { base: u64, pitch: u64, height: u64 },
    /// Canonical: device or array.
    Remote(Side),
}

/// Whether a unified address is the device's. Mirrored memory counts as the device's (pushed first).
fn on_device(ptr: u64) -> bool {
    memory::lookup(ptr).is_some_and(|r| r.kind == memory::Kind::Device)
        || managed::lookup(ptr).is_some()
}

fn resolve(s: &AppSide) -> Result<Resolved, CUresult> {
    let device = |base: u64| {
        // A host address of mirrored memory: its device address (the same, except for registered memory).
        let base = match managed::lookup(base) {
            Some(m) if base >= m.host && base < m.host + m.len => m.device + (base - m.host),
            _ => base,
        };
        Resolved::Remote(Side::device(base, s.x, s.y, s.z, s.pitch, s.height))
    };
    Ok(match s.kind {
        CU_MEMORYTYPE_HOST => Resolved::Host {
            base: s.host,
            pitch: s.pitch,
            height: s.height,
        },
        CU_MEMORYTYPE_DEVICE => device(s.device),
        CU_MEMORYTYPE_ARRAY => {
            handles::check(Kind::Array, s.array)?;
            Resolved::Remote(Side::array(s.array, s.x, s.y, s.z))
        }
        CU_MEMORYTYPE_UNIFIED if on_device(s.device) => device(s.device),
        CU_MEMORYTYPE_UNIFIED => Resolved::Host {
            base: s.device,
            pitch: s.pitch,
            height: s.height,
        },
        _ => return Err(CUresult::INVALID_VALUE),
    })
}

/// The address of byte `x` of row `y` of slice `z` of a host side.
fn host_at(base: u64, pitch: u64, height: u64, x: u64, y: u64, z: u64) -> u64 {
    base + z * pitch * height + y * pitch + x
}

/// Performs a 3D copy as the application described it. `stream: None` is synchronous.
fn memcpy(
    src: AppSide,
    dst: AppSide,
    width: u64,
    height: u64,
    depth: u64,
    stream: Option<u64>,
) -> Result<(), CUresult> {
    let session = state::session()?;
    if let Some(s) = stream {
        handles::check(Kind::Stream, s)?;
    }
    let (rs, rd) = (resolve(&src)?, resolve(&dst)?);
    if width == 0 || height == 0 || depth == 0 {
        return Ok(());
    }
    // Both sides here: CUDA's rules for pitches, then a plain copy.
    if let (
        Resolved::Host {
            base: sb,
            pitch: sp,
            height: sh,
        },
        Resolved::Host {
            base: db,
            pitch: dp,
            height: dh,
        },
    ) = (rs, rd)
    {
        let rows_fit = |x: u64, pitch: u64| height == 1 && depth == 1 || pitch >= x + width;
        if !rows_fit(src.x, sp) || !rows_fit(dst.x, dp) || sb == 0 || db == 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        for z in 0..depth {
            for y in 0..height {
                let from = host_at(sb, sp, sh, src.x, src.y + y, src.z + z);
                let to = host_at(db, dp, dh, dst.x, dst.y + y, dst.z + z);
                // SAFETY: the application's buffers, as the C API requires; `copy` allows overlap.
                unsafe { std::ptr::copy(from as *const u8, to as *mut u8, width as usize) };
            }
        }
        return Ok(());
    }
    let canonical = |r: Resolved| match r {
        Resolved::Host { .. } => Side::host(width, height),
        Resolved::Remote(side) => side,
    };
    let whole = Copy3D {
        src: canonical(rs),
        dst: canonical(rd),
        width_bytes: width,
        height,
        depth,
    };
    // Mirrored memory named by its host address on either side: the server's copy must hold the host's
    // latest bytes first (and a synchronous copy must be complete when it returns).
    let mut mirrored = false;
    for s in [&src, &dst] {
        if matches!(s.kind, CU_MEMORYTYPE_DEVICE | CU_MEMORYTYPE_UNIFIED)
            && let Some(m) = managed::lookup(s.device)
        {
            managed::flush_range(m.host, m.len)?;
            mirrored = true;
        }
    }
    managed::before_work()?;
    let ctx = context::current();
    let client = &session.client;
    let pieces = copy::pieces(&whole);
    // Host bytes of the source, packed in order; each piece takes its share.
    let packed_src = match rs {
        Resolved::Host {
            base,
            pitch,
            height: h,
        } => {
            if base == 0 {
                return Err(CUresult::INVALID_VALUE);
            }
            let mut out = Vec::with_capacity((width * height * depth) as usize);
            for z in 0..depth {
                for y in 0..height {
                    let from = host_at(base, pitch, h, src.x, src.y + y, src.z + z);
                    // SAFETY: the application's source rows, as the C API requires (read here, holding
                    // no lock, so that faults on mirrored memory resolve).
                    out.extend_from_slice(unsafe {
                        std::slice::from_raw_parts(from as *const u8, width as usize)
                    });
                }
            }
            out
        }
        Resolved::Remote(_) => Vec::new(),
    };
    let mut received = Vec::new();
    let mut at = 0usize;
    let last = pieces.len() - 1;
    let mut pending = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        let n = piece.packed_bytes().unwrap_or(0) as usize;
        let bulk: &[u8] = if piece.src.place == Place::Host {
            let b = &packed_src[at..at + n];
            at += n;
            b
        } else {
            &[]
        };
        let to_host = piece.dst.place == Place::Host;
        let wait = to_host || client.is_blocking() || (stream.is_none() && i == last);
        let call = Call::Memcpy3D {
            copy: *piece,
            stream,
        };
        if let Some(p) = client.submit(ctx, call, bulk, wait).map_err(state::lost)? {
            pending.push(p);
        }
    }
    let mut first_error = None;
    for p in pending {
        let answer = p.wait().map_err(state::lost)?;
        if !answer.result.is_success() {
            first_error.get_or_insert(answer.result);
            continue;
        }
        match answer.reply {
            Reply::Data => answer
                .bulk
                .iter()
                .for_each(|piece| received.extend_from_slice(piece)),
            Reply::Empty => {}
            other => return Err(state::mismatch("cuMemcpy3D", &other)),
        }
    }
    if let Some(err) = first_error {
        return Err(err);
    }
    if let Resolved::Host {
        base,
        pitch,
        height: h,
    } = rd
    {
        if received.len() as u64 != width * height * depth || base == 0 {
            return Err(CUresult::UNKNOWN);
        }
        let mut off = 0usize;
        for z in 0..depth {
            for y in 0..height {
                let to = host_at(base, pitch, h, dst.x, dst.y + y, dst.z + z);
                // SAFETY: the application's destination rows, written holding no lock.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        received[off..].as_ptr(),
                        to as *mut u8,
                        width as usize,
                    );
                }
                off += width as usize;
            }
        }
    }
    if stream.is_none() {
        if mirrored {
            managed::complete()?;
        }
        managed::after_sync()?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn side2d(
    kind: u32,
    host: *const c_void,
    device: u64,
    array: *mut c_void,
    x: usize,
    y: usize,
    pitch: usize,
    height: usize,
) -> AppSide {
    AppSide {
        kind,
        host: host as u64,
        device,
        array: array as u64,
        x: x as u64,
        y: y as u64,
        z: 0,
        pitch: pitch as u64,
        height: height as u64,
    }
}

unsafe fn copy2d(p: *const c_void, stream: Option<u64>) -> Result<(), CUresult> {
    if p.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the application's CUDA_MEMCPY2D, as the C API requires.
    let c = unsafe { p.cast::<CUDA_MEMCPY2D>().read_unaligned() };
    let src = side2d(
        c.srcMemoryType,
        c.srcHost,
        c.srcDevice,
        c.srcArray,
        c.srcXInBytes,
        c.srcY,
        c.srcPitch,
        c.Height,
    );
    let dst = side2d(
        c.dstMemoryType,
        c.dstHost,
        c.dstDevice,
        c.dstArray,
        c.dstXInBytes,
        c.dstY,
        c.dstPitch,
        c.Height,
    );
    memcpy(src, dst, c.WidthInBytes as u64, c.Height as u64, 1, stream)
}

unsafe fn copy3d(p: *const c_void, stream: Option<u64>) -> Result<(), CUresult> {
    if p.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the application's CUDA_MEMCPY3D, as the C API requires.
    let c = unsafe { p.cast::<CUDA_MEMCPY3D>().read_unaligned() };
    // Mipmap levels of arrays exist only for mipmapped arrays, which are not offered.
    if c.srcLOD != 0 || c.dstLOD != 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let src = AppSide {
        kind: c.srcMemoryType,
        host: c.srcHost as u64,
        device: c.srcDevice,
        array: c.srcArray as u64,
        x: c.srcXInBytes as u64,
        y: c.srcY as u64,
        z: c.srcZ as u64,
        pitch: c.srcPitch as u64,
        height: c.srcHeight as u64,
    };
    let dst = AppSide {
        kind: c.dstMemoryType,
        host: c.dstHost as u64,
        device: c.dstDevice,
        array: c.dstArray as u64,
        x: c.dstXInBytes as u64,
        y: c.dstY as u64,
        z: c.dstZ as u64,
        pitch: c.dstPitch as u64,
        height: c.dstHeight as u64,
    };
    memcpy(
        src,
        dst,
        c.WidthInBytes as u64,
        c.Height as u64,
        c.Depth as u64,
        stream,
    )
}

pub unsafe fn cuMemcpy2D_v2(p: *const c_void) -> Result<(), CUresult> {
    // SAFETY: the application's descriptor.
    unsafe { copy2d(p, None) }
}

pub unsafe fn cuMemcpy2DUnaligned_v2(p: *const c_void) -> Result<(), CUresult> {
    // SAFETY: as above (no pitch restrictions apply beyond the rows fitting).
    unsafe { copy2d(p, None) }
}

pub unsafe fn cuMemcpy2DAsync_v2(p: *const c_void, stream: CUstream) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe { copy2d(p, Some(stream as u64)) }
}

pub unsafe fn cuMemcpy3D_v2(p: *const c_void) -> Result<(), CUresult> {
    // SAFETY: the application's descriptor.
    unsafe { copy3d(p, None) }
}

pub unsafe fn cuMemcpy3DAsync_v2(p: *const c_void, stream: CUstream) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe { copy3d(p, Some(stream as u64)) }
}

/// A 1D stretch of an array as a copy side: byte `offset` of its dense layout. The array copies address
/// 1D arrays; for others the offset counts through rows as the layout lays them out, so a stretch is
/// one row's worth at most.
fn array_side(array: CUarray, offset: usize) -> AppSide {
    AppSide {
        kind: CU_MEMORYTYPE_ARRAY,
        host: 0,
        device: 0,
        array: array as u64,
        x: offset as u64,
        y: 0,
        z: 0,
        pitch: 0,
        height: 0,
    }
}

fn linear_side(kind: u32, host: u64, device: u64) -> AppSide {
    AppSide {
        kind,
        host,
        device,
        array: 0,
        x: 0,
        y: 0,
        z: 0,
        pitch: 0,
        height: 0,
    }
}

pub unsafe fn cuMemcpyHtoA_v2(
    dst: CUarray,
    offset: usize,
    src: *const c_void,
    n: usize,
) -> Result<(), CUresult> {
    let s = linear_side(CU_MEMORYTYPE_HOST, src as u64, 0);
    memcpy(s, array_side(dst, offset), n as u64, 1, 1, None)
}

pub unsafe fn cuMemcpyHtoAAsync_v2(
    dst: CUarray,
    offset: usize,
    src: *const c_void,
    n: usize,
    stream: CUstream,
) -> Result<(), CUresult> {
    let s = linear_side(CU_MEMORYTYPE_HOST, src as u64, 0);
    memcpy(
        s,
        array_side(dst, offset),
        n as u64,
        1,
        1,
        Some(stream as u64),
    )
}

pub unsafe fn cuMemcpyAtoH_v2(
    dst: *mut c_void,
    src: CUarray,
    offset: usize,
    n: usize,
) -> Result<(), CUresult> {
    let d = linear_side(CU_MEMORYTYPE_HOST, dst as u64, 0);
    memcpy(array_side(src, offset), d, n as u64, 1, 1, None)
}

pub unsafe fn cuMemcpyAtoHAsync_v2(
    dst: *mut c_void,
    src: CUarray,
    offset: usize,
    n: usize,
    stream: CUstream,
) -> Result<(), CUresult> {
    let d = linear_side(CU_MEMORYTYPE_HOST, dst as u64, 0);
    memcpy(
        array_side(src, offset),
        d,
        n as u64,
        1,
        1,
        Some(stream as u64),
    )
}

pub unsafe fn cuMemcpyDtoA_v2(
    dst: CUarray,
    offset: usize,
    src: u64,
    n: usize,
) -> Result<(), CUresult> {
    let s = linear_side(CU_MEMORYTYPE_DEVICE, 0, src);
    memcpy(s, array_side(dst, offset), n as u64, 1, 1, None)
}

pub unsafe fn cuMemcpyAtoD_v2(
    dst: u64,
    src: CUarray,
    offset: usize,
    n: usize,
) -> Result<(), CUresult> {
    let d = linear_side(CU_MEMORYTYPE_DEVICE, 0, dst);
    memcpy(array_side(src, offset), d, n as u64, 1, 1, None)
}

pub unsafe fn cuMemcpyAtoA_v2(
    dst: CUarray,
    dst_offset: usize,
    src: CUarray,
    src_offset: usize,
    n: usize,
) -> Result<(), CUresult> {
    memcpy(
        array_side(src, src_offset),
        array_side(dst, dst_offset),
        n as u64,
        1,
        1,
        None,
    )
}
