//! Memory: the client's allocation table, copies in every direction, host allocations, pointer queries.
//!
//! Device pointers are the server's values (identity), recorded here at allocation so that `cuMemFree` is
//! validated locally, `cuMemGetAddressRange` and `cuPointerGetAttribute(s)` need no round trip, and a
//! unified `cuMemcpy` knows its direction. Classification uses only this table, never address ranges: a
//! client host pointer may equal a live device pointer of the server. Managed and page-locked host
//! memory are mirrored ([`crate::managed`], [`crate::hostmem`]): copies from and to them move only what
//! the other side lacks.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use gleam_protocol::types::{CUresult, CUstream};

use crate::{context, forward, handles, managed, put, state};

/// What an address range of the table is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Device memory (a server address).
    Device,
    /// Host memory from `cuMemHostAlloc`/`cuMemAllocHost` (flags as given).
    Host {
        /// `CU_MEMHOSTALLOC_*` flags.
        flags: u32,
    },
}

/// One allocation.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    /// First address.
    pub base: u64,
    /// Length in bytes.
    pub size: u64,
    /// Device or host.
    pub kind: Kind,
    /// The context current when it was allocated.
    pub ctx: u64,
}

static TABLE: Mutex<BTreeMap<u64, Region>> = Mutex::new(BTreeMap::new());

fn table() -> MutexGuard<'static, BTreeMap<u64, Region>> {
    TABLE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The allocation containing `ptr`, if any.
pub fn lookup(ptr: u64) -> Option<Region> {
    let table = table();
    let (_, region) = table.range(..=ptr).next_back()?;
    (ptr < region.base + region.size.max(1)).then_some(*region)
}

fn record(base: u64, size: u64, kind: Kind) {
    table().insert(
        base,
        Region {
            base,
            size,
            kind,
            ctx: context::current(),
        },
    );
}

/// Removes the allocation starting exactly at `base` if it is of the wanted kind.
fn unrecord(base: u64, device: bool) -> Result<Region, CUresult> {
    let mut table = table();
    match table.get(&base) {
        Some(r) if (r.kind == Kind::Device) == device => {
            let region = *r;
            table.remove(&base);
            Ok(region)
        }
        _ => Err(CUresult::INVALID_VALUE),
    }
}

/// `ctx` lost everything it held: its device allocations are gone (the server's driver freed them).
pub fn context_emptied(ctx: u64) {
    table().retain(|_, r| !(r.ctx == ctx && r.kind == Kind::Device));
}

/// Host bytes of a copy source (`n` may be 0, then `src` may be NULL).
unsafe fn host_slice<'a>(src: *const c_void, n: usize) -> Result<&'a [u8], CUresult> {
    if n == 0 {
        return Ok(&[]);
    }
    if src.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the caller promised `n` readable bytes at `src`.
    Ok(unsafe { std::slice::from_raw_parts(src.cast::<u8>(), n) })
}

unsafe fn host_slice_mut<'a>(dst: *mut c_void, n: usize) -> Result<&'a mut [u8], CUresult> {
    if n == 0 {
        return Ok(&mut []);
    }
    if dst.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the caller promised `n` writable bytes at `dst`.
    Ok(unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), n) })
}

/// Host to device; `stream: None` for the synchronous copy.
pub unsafe fn htod(
    dst: u64,
    src: *const c_void,
    n: usize,
    stream: Option<u64>,
) -> Result<(), CUresult> {
    let session = state::session()?;
    if let Some(s) = stream {
        handles::check(gleam_protocol::registry::Kind::Stream, s)?;
    }
    // SAFETY: forwarded.
    let bytes = unsafe { host_slice(src, n)? };
    if dst == 0 && n > 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    // From mirrored memory: the server's copy has the bytes once the host's writes are pushed.
    if let Some(m) = managed::containing(src as u64, n as u64) {
        managed::flush_range(src as u64, n as u64)?;
        let from = m.device + (src as u64 - m.host);
        // SAFETY: plain values.
        return unsafe {
            match stream {
                // From page-locked memory the synchronous copy is complete when it returns: the host may
                // write the source again at once.
                None => forward::cuMemcpyDtoD_v2(dst, from, n).and_then(|()| managed::complete()),
                Some(s) => forward::cuMemcpyDtoDAsync_v2(dst, from, n, s as CUstream),
            }
        };
    }
    // Partly mirrored (odd, but legal): read here, holding no lock, so that faults resolve.
    // SAFETY: `bytes` is the application's source, `n` readable bytes.
    let staged =
        managed::overlaps(src as u64, n as u64).then(|| unsafe { managed::staged(src.cast(), n) });
    let bytes = staged.as_deref().unwrap_or(bytes);
    managed::before_work()?;
    session
        .client
        .memcpy_htod(context::current(), dst, bytes, stream)
        .map_err(state::lost)?
        .result()?;
    if stream.is_none() {
        managed::after_sync()?;
    }
    Ok(())
}

/// Device to host; waits for the data (the asynchronous form too: its completion is observable only
/// after a synchronization, and returning earlier with the data already there is allowed).
pub unsafe fn dtoh(
    dst: *mut c_void,
    src: u64,
    n: usize,
    stream: Option<u64>,
) -> Result<(), CUresult> {
    let session = state::session()?;
    if let Some(s) = stream {
        handles::check(gleam_protocol::registry::Kind::Stream, s)?;
    }
    // SAFETY: forwarded.
    let bytes = unsafe { host_slice_mut(dst, n)? };
    if src == 0 && n > 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    managed::before_work()?;
    let mirrored = managed::containing(dst as u64, n as u64);
    if mirrored.is_some() || managed::overlaps(dst as u64, n as u64) {
        // Into mirrored memory: the server's copy is written in stream order too, and the bytes are
        // installed here without faults (nor pushed back).
        if let Some(m) = mirrored {
            // What the host wrote there goes first, so that the copy lands on top of it.
            managed::flush_range(dst as u64, n as u64)?;
            let to = m.device + (dst as u64 - m.host);
            // SAFETY: plain values.
            unsafe {
                match stream {
                    None => forward::cuMemcpyDtoD_v2(to, src, n)?,
                    Some(s) => forward::cuMemcpyDtoDAsync_v2(to, src, n, s as CUstream)?,
                }
            }
        }
        let mut staged = vec![0u8; n];
        session
            .client
            .memcpy_dtoh(context::current(), &mut staged, src, stream)
            .map_err(state::lost)?
            .result()?;
        // The synchronization first (it may make every mirror stale), then the fresh bytes.
        managed::after_sync()?;
        if mirrored.is_none() || !managed::install(dst as u64, &staged) {
            // Written here, holding no lock: faults resolve.
            bytes.copy_from_slice(&staged);
        }
    } else {
        session
            .client
            .memcpy_dtoh(context::current(), bytes, src, stream)
            .map_err(state::lost)?
            .result()?;
    }
    // The data came after the stream's (or the legacy stream's) earlier work.
    managed::after_sync()
}

/// `cuMemcpy`/`cuMemcpyAsync`: the direction comes from the allocation table.
unsafe fn unified(dst: u64, src: u64, n: usize, stream: Option<CUstream>) -> Result<(), CUresult> {
    state::session()?;
    let on_device = |p: u64| lookup(p).is_some_and(|r| r.kind == Kind::Device);
    // Mirrored memory on one side: the other side decides (copies from and to it are optimized there);
    // on both: a device-to-device copy of the server's copies, the source pushed first.
    if let (Some(d), Some(s)) = (managed::lookup(dst), managed::lookup(src)) {
        managed::flush_range(src, n as u64)?;
        managed::flush_range(dst, n as u64)?;
        let (to, from) = (d.device + (dst - d.host), s.device + (src - s.host));
        // SAFETY: plain values.
        return unsafe {
            match stream {
                None => forward::cuMemcpyDtoD_v2(to, from, n).and_then(|()| managed::complete()),
                Some(st) => forward::cuMemcpyDtoDAsync_v2(to, from, n, st),
            }
        };
    }
    // SAFETY: forwarded; the table says which side each pointer lives on.
    unsafe {
        match (on_device(dst), on_device(src), stream) {
            (true, true, None) => forward::cuMemcpyDtoD_v2(dst, src, n),
            (true, true, Some(s)) => forward::cuMemcpyDtoDAsync_v2(dst, src, n, s),
            (true, false, s) => htod(dst, src as *const c_void, n, s.map(|s| s as u64)),
            (false, true, s) => dtoh(dst as *mut c_void, src, n, s.map(|s| s as u64)),
            (false, false, _) => {
                // Host to host: ordered after nothing on the device, so done here.
                let from = host_slice(src as *const c_void, n)?;
                let to = host_slice_mut(dst as *mut c_void, n)?;
                to.copy_from_slice(from);
                Ok(())
            }
        }
    }
}

/// Bytes written for each `CUpointer_attribute` (booleans are C `bool`s).
fn attribute_size(attribute: u32) -> Option<usize> {
    Some(match attribute {
        1 | 3 | 4 | 7 | 11 | 12 | 14 | 17 | 18 | 19 | 20 => 8,
        2 | 9 | 16 | 22 => 4,
        5 => 16,
        6 | 8 | 10 | 13 | 15 | 21 => 1,
        _ => return None,
    })
}

/// Writes one pointer attribute of `ptr` (`region` = its allocation) into `data`.
unsafe fn pointer_attribute(
    data: *mut c_void,
    attribute: u32,
    ptr: u64,
    region: Option<Region>,
    lenient: bool,
) -> Result<(), CUresult> {
    let size = attribute_size(attribute).ok_or(CUresult::INVALID_VALUE)?;
    if data.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let mut value = [0u8; 16];
    let mut set = |bytes: &[u8]| value[..bytes.len()].copy_from_slice(bytes);
    match (region, attribute) {
        (None, _) if !lenient => return Err(CUresult::INVALID_VALUE),
        // Unknown pointers in cuPointerGetAttributes: zeros, except the ordinal (-2 = not a device).
        (None, 9) => set(&(-2i32).to_le_bytes()),
        (None, _) => {}
        (Some(r), 1) => set(&r.ctx.to_le_bytes()),
        (Some(r), 2) => set(&(if r.kind == Kind::Device { 2u32 } else { 1 }).to_le_bytes()),
        (Some(r), 3) if r.kind == Kind::Device => set(&ptr.to_le_bytes()),
        (Some(r), 4) if r.kind != Kind::Device => set(&ptr.to_le_bytes()),
        (Some(_), 3 | 4) if !lenient => return Err(CUresult::INVALID_VALUE),
        (Some(_), 3 | 4) => {}
        (Some(r), 7 | 20) => set(&r.base.to_le_bytes()),
        (Some(_), 8 | 10 | 15 | 21) => set(&[0]),
        (Some(r), 6 | 13) => set(&[u8::from(r.kind == Kind::Device)]),
        (Some(r), 9) => set(&context::device_of(r.ctx).unwrap_or(0).to_le_bytes()),
        (Some(r), 11 | 19) => set(&r.base.to_le_bytes()),
        (Some(r), 12 | 18) => set(&r.size.to_le_bytes()),
        (Some(_), 16) => set(&3u32.to_le_bytes()),
        (Some(_), _) if !lenient => return Err(CUresult::NOT_SUPPORTED),
        (Some(_), _) => {}
    }
    // SAFETY: the caller's buffer holds the attribute's C type, `size` bytes.
    unsafe { std::ptr::copy_nonoverlapping(value.as_ptr(), data.cast::<u8>(), size) };
    Ok(())
}

pub unsafe fn cuMemAlloc_v2(dptr: *mut u64, bytesize: usize) -> Result<(), CUresult> {
    if bytesize == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: forwarded under the same contract; `dptr` was written on success.
    let base = unsafe {
        forward::cuMemAlloc_v2(dptr, bytesize)?;
        *dptr
    };
    record(base, bytesize as u64, Kind::Device);
    Ok(())
}

pub unsafe fn cuMemAllocAsync(
    dptr: *mut u64,
    bytesize: usize,
    stream: CUstream,
) -> Result<(), CUresult> {
    // SAFETY: as above.
    let base = unsafe {
        forward::cuMemAllocAsync(dptr, bytesize, stream)?;
        *dptr
    };
    record(base, bytesize as u64, Kind::Device);
    Ok(())
}

pub unsafe fn cuMemAllocPitch_v2(
    dptr: *mut u64,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: u32,
) -> Result<(), CUresult> {
    // SAFETY: as above; both out-pointers were written on success.
    let (base, pitch) = unsafe {
        forward::cuMemAllocPitch_v2(dptr, pitch, width, height, element_size)?;
        (*dptr, *pitch)
    };
    record(
        base,
        (pitch as u64).saturating_mul(height as u64),
        Kind::Device,
    );
    Ok(())
}

pub unsafe fn cuMemFree_v2(dptr: u64) -> Result<(), CUresult> {
    state::session()?;
    if let Some(freed) = managed::free(dptr, false) {
        return freed;
    }
    unrecord(dptr, true)?;
    // SAFETY: plain values.
    unsafe { forward::cuMemFree_v2(dptr) }
}

pub unsafe fn cuMemFreeAsync(dptr: u64, stream: CUstream) -> Result<(), CUresult> {
    state::session()?;
    unrecord(dptr, true)?;
    // SAFETY: plain values (the stream is checked by the forwarder).
    unsafe { forward::cuMemFreeAsync(dptr, stream) }
}

pub unsafe fn cuMemGetAddressRange_v2(
    base: *mut u64,
    size: *mut usize,
    dptr: u64,
) -> Result<(), CUresult> {
    state::session()?;
    if let Some(m) = managed::lookup(dptr).filter(|m| dptr >= m.host && dptr < m.host + m.len) {
        // SAFETY: the caller's out-pointers, each NULL (not wanted) or writable.
        unsafe {
            if !base.is_null() {
                put(base, m.host)?;
            }
            if !size.is_null() {
                put(size, m.len as usize)?;
            }
        }
        return Ok(());
    }
    let Some(region) = lookup(dptr).filter(|r| r.kind == Kind::Device) else {
        // Not an allocation of this process's table (a module global, say): the server knows. Either
        // out-pointer may be NULL here, as in CUDA.
        let (mut b, mut n) = (0u64, 0usize);
        // SAFETY: valid out-pointers to locals; the caller's, each NULL or writable.
        unsafe {
            forward::cuMemGetAddressRange_v2(&raw mut b, &raw mut n, dptr)?;
            if !base.is_null() {
                put(base, b)?;
            }
            if !size.is_null() {
                put(size, n)?;
            }
        }
        return Ok(());
    };
    // SAFETY: the caller's out-pointers, each NULL (not wanted) or writable.
    unsafe {
        if !base.is_null() {
            put(base, region.base)?;
        }
        if !size.is_null() {
            put(size, region.size as usize)?;
        }
    }
    Ok(())
}

pub unsafe fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: u32,
    ptr: u64,
) -> Result<(), CUresult> {
    state::session()?;
    if let Some(answer) = crate::hostmem::pointer_attribute(attribute, ptr) {
        let (bytes, n) = answer?;
        if data.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        // SAFETY: the caller's buffer holds the attribute's C type, `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), data.cast::<u8>(), n) };
        return Ok(());
    }
    // SAFETY: the caller's attribute buffer, as the C API requires.
    unsafe { pointer_attribute(data, attribute, ptr, lookup(ptr), false) }
}

pub unsafe fn cuPointerGetAttributes(
    count: u32,
    attributes: *mut u32,
    data: *mut *mut c_void,
    ptr: u64,
) -> Result<(), CUresult> {
    state::session()?;
    if count > 0 && (attributes.is_null() || data.is_null()) {
        return Err(CUresult::INVALID_VALUE);
    }
    let region = lookup(ptr);
    for i in 0..count as usize {
        // SAFETY: `attributes` and `data` hold `count` entries each (checked non-NULL above).
        let (attribute, out) = unsafe { (*attributes.add(i), *data.add(i)) };
        if out.is_null() {
            continue;
        }
        if let Some(answer) = crate::hostmem::pointer_attribute(attribute, ptr) {
            // Attributes that do not apply read as zeros here, as for unknown pointers.
            let (bytes, n) = answer.unwrap_or(([0; 16], attribute_size(attribute).unwrap_or(0)));
            // SAFETY: the caller's buffer for this attribute.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.cast::<u8>(), n) };
            continue;
        }
        // SAFETY: the caller's buffer for this attribute.
        unsafe { pointer_attribute(out, attribute, ptr, region, true)? };
    }
    Ok(())
}

pub unsafe fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> Result<(), CUresult> {
    // SAFETY: the application's source buffer, as the C API requires.
    unsafe { htod(dst, src, n, None) }
}

pub unsafe fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    n: usize,
    stream: CUstream,
) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe { htod(dst, src, n, Some(stream as u64)) }
}

pub unsafe fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> Result<(), CUresult> {
    // SAFETY: the application's destination buffer, as the C API requires.
    unsafe { dtoh(dst, src, n, None) }
}

pub unsafe fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    n: usize,
    stream: CUstream,
) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe { dtoh(dst, src, n, Some(stream as u64)) }
}

pub unsafe fn cuMemcpy(dst: u64, src: u64, n: usize) -> Result<(), CUresult> {
    // SAFETY: the application's buffers, as the C API requires.
    unsafe { unified(dst, src, n, None) }
}

pub unsafe fn cuMemcpyAsync(
    dst: u64,
    src: u64,
    n: usize,
    stream: CUstream,
) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe { unified(dst, src, n, Some(stream)) }
}
