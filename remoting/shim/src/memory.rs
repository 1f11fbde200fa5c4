//! Memory: the client's allocation table, copies in every direction, host allocations, pointer queries.
//!
//! Device pointers are the server's values (identity), recorded here at allocation so that `cuMemFree` is
//! validated locally, `cuMemGetAddressRange` and `cuPointerGetAttribute(s)` need no round trip, and a
//! unified `cuMemcpy` knows its direction. Classification uses only this table, never address ranges: a
//! client host pointer may equal a live device pointer of the server. Managed and page-locked host
//! memory are mirrored ([`crate::managed`], [`crate::hostmem`]): copies from and to them move only what
//! the other side lacks.
//!
//! Memory pools and virtual memory management keep the same identity: an allocation from a pool is
//! recorded with its pool; `cuMemAddressReserve` records the reserved range (beside the table: nothing is
//! there yet), and each `cuMemMap` records the mapped range in the table as device memory, so copies and
//! pointer queries treat it as the server does, and `cuMemFree` refuses it.
//!
//! A copy checks its device range before it touches a host byte, as NVIDIA's driver does: an oversized
//! count (up to `SIZE_MAX`) is `CUDA_ERROR_INVALID_VALUE`, never a read past the application's buffer.
//! The range comes from the mirrors (managed and page-locked memory), this table (allocations, mappings,
//! and module globals recorded when
//! `cuModuleGetGlobal`/`cuLibraryGetGlobal` return them), else from the server (`cuMemGetAddressRange`:
//! device memory this table does not know).

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use gleam_protocol::api::ApiReply;
use gleam_protocol::registry::Owner;
use gleam_protocol::types::{
    CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, CUmemAccessDesc, CUmemLocation,
    CUmemoryPool, CUresult, CUstream,
};

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
    /// A `cuMemMap` of physical allocation `handle` (device memory, unmapped rather than freed).
    Mapped {
        /// The `CUmemGenericAllocationHandle` mapped.
        handle: u64,
    },
    /// A module global (device memory the application did not allocate and cannot free), as
    /// `cuModuleGetGlobal`/`cuLibraryGetGlobal` returned it; gone with its module or library.
    Global {
        /// The module or library handle it belongs to.
        holder: u64,
    },
}

impl Kind {
    /// Whether the range is device memory (the server's).
    pub fn is_device(self) -> bool {
        matches!(
            self,
            Kind::Device | Kind::Mapped { .. } | Kind::Global { .. }
        )
    }
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
    /// The memory pool it came from (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`), if any.
    pub pool: Option<u64>,
    /// `CU_POINTER_ATTRIBUTE_ACCESS_FLAGS` of the device: read-write, except for mappings, which start
    /// with none until `cuMemSetAccess`.
    pub access: u8,
}

static TABLE: Mutex<BTreeMap<u64, Region>> = Mutex::new(BTreeMap::new());
/// Address reservations (`cuMemAddressReserve`): start -> length.
static RESERVED: Mutex<BTreeMap<u64, u64>> = Mutex::new(BTreeMap::new());
/// Each device's current memory pool, once known (`None`/absent: ask the server).
static CURRENT_POOL: Mutex<Option<HashMap<i32, u64>>> = Mutex::new(None);

/// A poisoned lock only means a thread panicked while holding it; the maps stay consistent.
fn locked<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn table() -> MutexGuard<'static, BTreeMap<u64, Region>> {
    TABLE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The allocation containing `ptr`, if any.
pub fn lookup(ptr: u64) -> Option<Region> {
    let table = table();
    let (_, region) = table.range(..=ptr).next_back()?;
    (ptr < region.base.saturating_add(region.size.max(1))).then_some(*region)
}

fn record(base: u64, size: u64, kind: Kind, pool: Option<u64>) {
    let access = match kind {
        Kind::Mapped { .. } => 0,
        _ => 3,
    };
    table().insert(
        base,
        Region {
            base,
            size,
            kind,
            ctx: context::current(),
            pool,
            access,
        },
    );
}

/// Removes the allocation starting exactly at `base` if it is of the wanted kind (`device`: memory from
/// an allocation call, which a free call frees; else host memory; mappings are unmapped instead, module
/// globals go with their module).
fn unrecord(base: u64, device: bool) -> Result<Region, CUresult> {
    let mut table = table();
    let wanted = |kind: Kind| {
        if device {
            kind == Kind::Device
        } else {
            matches!(kind, Kind::Host { .. })
        }
    };
    match table.get(&base) {
        Some(r) if wanted(r.kind) => {
            let region = *r;
            table.remove(&base);
            Ok(region)
        }
        _ => Err(CUresult::INVALID_VALUE),
    }
}

/// `ctx` lost everything it held: its device allocations are gone (the server's driver freed them).
/// Mappings belong to the device, not to a context, and stay.
pub fn context_emptied(ctx: u64) {
    table().retain(|_, r| !(r.ctx == ctx && matches!(r.kind, Kind::Device | Kind::Global { .. })));
}

/// A listed call returned a module global's address: records its range (see the module documentation).
/// `owner` is what the call was admitted with (it names the module or library).
pub fn note_global(reply: &ApiReply, owner: &Owner) {
    let (base, size, holder) = match reply {
        ApiReply::cuModuleGetGlobal_v2(o) => (o.dptr, o.bytes, owner.module),
        ApiReply::cuLibraryGetGlobal(o) => (o.dptr, o.bytes, owner.library),
        _ => return,
    };
    // `bytes` is 0 when the application passed NULL for it (and `dptr` when it passed NULL for that):
    // then the size is unknown here, and the server is asked when a copy needs it.
    let Some(holder) = holder.filter(|_| base != 0 && size != 0) else {
        return;
    };
    // An allocation already recorded at this address is the better description.
    table().entry(base).or_insert(Region {
        base,
        size: size as u64,
        kind: Kind::Global { holder },
        ctx: context::current(),
        pool: None,
        access: 3,
    });
}

/// Modules and libraries died: their globals' ranges go with them.
pub fn holders_died(died: &[(gleam_protocol::registry::Kind, u64)]) {
    use gleam_protocol::registry::Kind as Handle;
    let gone: Vec<u64> = died
        .iter()
        .filter(|(kind, _)| matches!(kind, Handle::Module | Handle::Library))
        .map(|&(_, handle)| handle)
        .collect();
    if !gone.is_empty() {
        table().retain(|_, r| !matches!(r.kind, Kind::Global { holder } if gone.contains(&holder)));
    }
}

/// The length of the run of mappings that starts with `first`: one reservation mapped piece by piece
/// is one contiguous range of device memory, and a copy may cross from one piece into the next.
fn mapped_run(first: Region) -> u64 {
    let table = table();
    let mut end = first.base.saturating_add(first.size);
    for (&base, r) in table.range(end..) {
        if base != end || !matches!(r.kind, Kind::Mapped { .. }) {
            break;
        }
        end = base.saturating_add(r.size);
    }
    end - first.base
}

/// Checks that `[ptr, ptr + n)` lies in one range of device memory, before a copy touches any host byte
/// (`n` = 0 checks nothing, as CUDA's zero-byte copies succeed).
pub(crate) fn check_device_range(ptr: u64, n: usize) -> Result<(), CUresult> {
    if n == 0 {
        return Ok(());
    }
    if ptr == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let end = ptr.checked_add(n as u64).ok_or(CUresult::INVALID_VALUE)?;
    // Mirrored memory (managed, page-locked, registered) is device memory too, at its host address or,
    // when registered, at its device address.
    if let Some(m) = managed::lookup(ptr) {
        let base = if (m.host..m.host.saturating_add(m.len)).contains(&ptr) {
            m.host
        } else {
            m.device
        };
        return match end > base.saturating_add(m.len) {
            true => Err(CUresult::INVALID_VALUE),
            false => Ok(()),
        };
    }
    let (base, size) = match lookup(ptr) {
        Some(r) if matches!(r.kind, Kind::Mapped { .. }) => (r.base, mapped_run(r)),
        Some(r) if r.kind.is_device() => (r.base, r.size),
        // Host memory is not mapped into the remote device.
        Some(_) => return Err(CUresult::INVALID_VALUE),
        None => {
            // Device memory this table does not know: the server's driver does. Any other error is the
            // session's (a deferred error of an earlier call, reported instead, as by any waiting call).
            let (mut base, mut size) = (0u64, 0usize);
            // SAFETY: valid out-pointers to locals.
            unsafe { forward::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, ptr) }
                .map_err(|err| match err {
                    CUresult::NOT_FOUND | CUresult::INVALID_VALUE => CUresult::INVALID_VALUE,
                    other => other,
                })?;
            (base, size as u64)
        }
    };
    if end > base.saturating_add(size) {
        return Err(CUresult::INVALID_VALUE);
    }
    Ok(())
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
    // Before the source is read: a count larger than the destination must not read past the source.
    check_device_range(dst, n)?;
    // SAFETY: forwarded; the destination holds `n` bytes, so the caller's `n` is the copy's size.
    let bytes = unsafe { host_slice(src, n)? };
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
    check_device_range(src, n)?;
    // SAFETY: forwarded; the source holds `n` bytes, so the caller's `n` is the copy's size.
    let bytes = unsafe { host_slice_mut(dst, n)? };
    managed::before_work()?;
    let mirrored = managed::containing(dst as u64, n as u64);
    let pieces = n.div_ceil(gleam_protocol::wire::COPY_CHUNK).max(1) as u64;
    // (Below, `before`: the requests numbered when the copy's own began, for [`idle`].)
    if let Some(m) = mirrored {
        // Into one mirror: the server's copy is written in stream order too, then the whole pages the
        // copy touches are read back from it ([`managed::PageSpan`]) and installed here without faults
        // (nor pushed back). What the host wrote there goes first, so that the copy lands on top of it.
        managed::flush_range(dst as u64, n as u64)?;
        let before = session.client.requests_numbered();
        let to = m.device + (dst as u64 - m.host);
        // SAFETY: plain values.
        unsafe {
            match stream {
                None => forward::cuMemcpyDtoD_v2(to, src, n)?,
                Some(s) => forward::cuMemcpyDtoDAsync_v2(to, src, n, s as CUstream)?,
            }
        }
        let span = managed::page_span(dst as u64, n as u64);
        let (from, len) = span.map_or((src, n), |s| (s.device, s.len));
        let mut staged = vec![0u8; len];
        session
            .client
            .memcpy_dtoh(context::current(), &mut staged, from, stream)
            .map_err(state::lost)?
            .result()?;
        if let Some(s) = stream {
            // The device-side copy, then the read-back's pieces.
            let expected =
                before + 1 + len.div_ceil(gleam_protocol::wire::COPY_CHUNK).max(1) as u64;
            idle::copied_back(s, expected, session.client.requests_numbered());
        }
        // The synchronization first (it may make every other page stale), then the fresh bytes. This is
        // the copy's one synchronization point: another would make the installed pages stale again.
        let Some(span) = span else {
            return managed::after_sync();
        };
        managed::after_copy_into(&span)?;
        if !managed::install_span(&span, &staged, dst as u64, n) {
            // Freed meanwhile: written here, holding no lock, so that faults resolve.
            let at = (dst as u64 - span.host) as usize;
            bytes.copy_from_slice(&staged[at..at + n]);
        }
        return Ok(());
    }
    let before = session.client.requests_numbered();
    if managed::overlaps(dst as u64, n as u64) {
        // Partly into mirrored memory: written here, holding no lock, so that faults resolve, after the
        // synchronization (which may make the mirrors' pages stale).
        let mut staged = vec![0u8; n];
        session
            .client
            .memcpy_dtoh(context::current(), &mut staged, src, stream)
            .map_err(state::lost)?
            .result()?;
        if let Some(s) = stream {
            idle::copied_back(s, before + pieces, session.client.requests_numbered());
        }
        managed::after_sync()?;
        bytes.copy_from_slice(&staged);
        return Ok(());
    }
    session
        .client
        .memcpy_dtoh(context::current(), bytes, src, stream)
        .map_err(state::lost)?
        .result()?;
    if let Some(s) = stream {
        idle::copied_back(s, before + pieces, session.client.requests_numbered());
    }
    // The data came after the stream's (or the legacy stream's) earlier work.
    managed::after_sync()
}

/// `cuStreamSynchronize` right after a device-to-host copy on the same stream (`tensor.item()`, a
/// result read back, into pageable or page-locked memory): the copy's reply said that everything before
/// it on the stream had finished, and if no request of any thread has left since, the stream is still
/// idle and the answer is known here. One round trip per read-back instead of two (measured on the H200:
/// `item()` through Gleam 0.31 ms before, 0.19 ms after).
mod idle {
    use std::sync::Mutex;

    /// (context, stream, requests numbered when the copy's reply came).
    static IDLE: Mutex<Option<(u64, u64, u64)>> = Mutex::new(None);

    fn slot() -> std::sync::MutexGuard<'static, Option<(u64, u64, u64)>> {
        IDLE.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A copy from `stream` came back; `expected` requests were numbered if nothing but the copy left
    /// since it started, `now` were.
    pub fn copied_back(stream: u64, expected: u64, now: u64) {
        *slot() = (expected == now).then(|| (super::context::current(), stream, now));
    }

    /// Whether `stream` of the current context is known to be idle with `now` requests numbered.
    pub fn known(stream: u64, now: u64) -> bool {
        *slot() == Some((super::context::current(), stream, now))
    }
}

/// `cuStreamSynchronize`: answered here when the stream is known to be idle ([`idle`]), else waited for.
pub unsafe fn cuStreamSynchronize(stream: CUstream) -> Result<(), CUresult> {
    let session = state::session()?;
    if idle::known(stream as u64, session.client.requests_numbered()) {
        handles::check(gleam_protocol::registry::Kind::Stream, stream as u64)?;
        // Nothing completes now that had not when the copy came back, and that was a synchronization
        // point for the mirrors already: another would make the pages it installed stale again.
        return Ok(());
    }
    // SAFETY: a plain handle, forwarded under the same contract.
    unsafe { forward::cuStreamSynchronize(stream) }
}

/// `cuMemcpy`/`cuMemcpyAsync`: the direction comes from the allocation table.
unsafe fn unified(dst: u64, src: u64, n: usize, stream: Option<CUstream>) -> Result<(), CUresult> {
    state::session()?;
    let on_device = |p: u64| lookup(p).is_some_and(|r| r.kind.is_device());
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
                // Host to host: ordered after nothing on the device, so done here. The ranges may
                // overlap (fuzz target shim: two slices of them were undefined behaviour), so no slices:
                // a memmove of the `n` bytes the caller promised at each.
                if n == 0 {
                    return Ok(());
                }
                if src == 0 || dst == 0 {
                    return Err(CUresult::INVALID_VALUE);
                }
                std::ptr::copy(src as *const u8, dst as *mut u8, n);
                Ok(())
            }
        }
    }
}

/// Bytes written for each `CUpointer_attribute`. The "booleans" (sync memops, is managed, IPC capable,
/// mapped, RDMA capable, HW decompress capable) are C `int`s, written whole: cudart's
/// `cudaPointerGetAttributes` reads `CU_POINTER_ATTRIBUTE_IS_MANAGED` into an uninitialised `int`, so
/// writing one byte left garbage above it and pinned or device memory read as managed, at random.
pub(crate) fn attribute_size(attribute: u32) -> Option<usize> {
    Some(match attribute {
        1 | 3 | 4 | 7 | 11 | 12 | 14 | 17 | 18 | 19 | 20 => 8,
        2 | 6 | 8 | 9 | 10 | 13 | 15 | 16 | 21 | 22 => 4,
        5 => 16,
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
        (Some(r), 2) => set(&(if r.kind.is_device() { 2u32 } else { 1 }).to_le_bytes()),
        (Some(r), 3) if r.kind.is_device() => set(&ptr.to_le_bytes()),
        (Some(r), 4) if !r.kind.is_device() => set(&ptr.to_le_bytes()),
        (Some(_), 3 | 4) if !lenient => return Err(CUresult::INVALID_VALUE),
        (Some(_), 3 | 4) => {}
        (Some(r), 7 | 20) => set(&r.base.to_le_bytes()),
        (Some(_), 8 | 10 | 15 | 21) => set(&[0]),
        (Some(r), 6 | 13) => set(&[u8::from(r.kind.is_device())]),
        (Some(r), 9) => set(&context::device_of(r.ctx).unwrap_or(0).to_le_bytes()),
        (Some(r), 11 | 19) => set(&r.base.to_le_bytes()),
        (Some(r), 12 | 18) => set(&r.size.to_le_bytes()),
        (Some(r), 16) => set(&u32::from(r.access).to_le_bytes()),
        (
            Some(Region {
                pool: Some(pool), ..
            }),
            17,
        ) => set(&pool.to_le_bytes()),
        (Some(_), _) if !lenient => return Err(CUresult::NOT_SUPPORTED),
        (Some(_), _) => {}
    }
    tracing::trace!(ptr, attribute, value = ?&value[..size], known = region.is_some(), "pointer attribute");
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
    record(base, bytesize as u64, Kind::Device, None);
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
    let pool = context::device_of(0).ok().and_then(current_pool);
    record(base, bytesize as u64, Kind::Device, pool);
    Ok(())
}

pub unsafe fn cuMemAllocFromPoolAsync(
    dptr: *mut u64,
    bytesize: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> Result<(), CUresult> {
    // SAFETY: as above (the pool and stream are checked by the forwarder).
    let base = unsafe {
        forward::cuMemAllocFromPoolAsync(dptr, bytesize, pool, stream)?;
        *dptr
    };
    record(base, bytesize as u64, Kind::Device, Some(pool as u64));
    Ok(())
}

/// Device `dev`'s current pool (what `cuMemAllocAsync` allocates from): known from this process's own
/// calls, or asked of the server once.
fn current_pool(dev: i32) -> Option<u64> {
    if let Some(&pool) = locked(&CURRENT_POOL)
        .get_or_insert_with(HashMap::new)
        .get(&dev)
    {
        return Some(pool);
    }
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer to a local.
    unsafe { forward::cuDeviceGetMemPool(&raw mut pool, dev) }.ok()?;
    locked(&CURRENT_POOL)
        .get_or_insert_with(HashMap::new)
        .insert(dev, pool as u64);
    Some(pool as u64)
}

pub unsafe fn cuDeviceSetMemPool(dev: i32, pool: CUmemoryPool) -> Result<(), CUresult> {
    // SAFETY: plain values (the pool is checked by the forwarder).
    unsafe { forward::cuDeviceSetMemPool(dev, pool)? };
    locked(&CURRENT_POOL)
        .get_or_insert_with(HashMap::new)
        .insert(dev, pool as u64);
    Ok(())
}

pub unsafe fn cuMemSetMemPool(
    location: *const CUmemLocation,
    kind: u32,
    pool: CUmemoryPool,
) -> Result<(), CUresult> {
    // SAFETY: forwarded under the same contract (a NULL location is refused).
    unsafe { forward::cuMemSetMemPool(location, kind, pool)? };
    // SAFETY: the forwarder read it successfully.
    let location = unsafe { location.read_unaligned() };
    if location.kind == CU_MEM_LOCATION_TYPE_DEVICE && kind == CU_MEM_ALLOCATION_TYPE_PINNED {
        locked(&CURRENT_POOL)
            .get_or_insert_with(HashMap::new)
            .insert(location.id, pool as u64);
    }
    Ok(())
}

pub unsafe fn cuMemPoolDestroy(pool: CUmemoryPool) -> Result<(), CUresult> {
    // SAFETY: forwarded (the pool is checked by the forwarder).
    unsafe { forward::cuMemPoolDestroy(pool)? };
    // A device whose current pool this was is back on its default pool: ask again when it matters.
    locked(&CURRENT_POOL)
        .get_or_insert_with(HashMap::new)
        .retain(|_, p| *p != pool as u64);
    Ok(())
}

/// `CU_MEMPOOL_ATTR_REUSE_*` (1 to 3) are C `int`s; the others `cuuint64_t`s.
fn pool_attribute_bytes(attr: u32) -> usize {
    if (1..=3).contains(&attr) { 4 } else { 8 }
}

pub unsafe fn cuMemPoolGetAttribute(
    pool: CUmemoryPool,
    attr: u32,
    value: *mut u64,
) -> Result<(), CUresult> {
    if value.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let mut v = 0u64;
    // SAFETY: a valid out-pointer to a local (the driver writes 4 or 8 bytes of it).
    unsafe { forward::cuMemPoolGetAttribute(pool, attr, &raw mut v)? };
    let n = pool_attribute_bytes(attr);
    // SAFETY: the caller's buffer holds the attribute's C type, `n` bytes.
    unsafe { std::ptr::copy_nonoverlapping(v.to_le_bytes().as_ptr(), value.cast::<u8>(), n) };
    Ok(())
}

pub unsafe fn cuMemPoolSetAttribute(
    pool: CUmemoryPool,
    attr: u32,
    value: *const u64,
) -> Result<(), CUresult> {
    if value.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let mut bytes = [0u8; 8];
    let n = pool_attribute_bytes(attr);
    // SAFETY: the caller's value holds the attribute's C type, `n` bytes.
    unsafe { std::ptr::copy_nonoverlapping(value.cast::<u8>(), bytes.as_mut_ptr(), n) };
    let v = u64::from_le_bytes(bytes);
    // SAFETY: a valid pointer to a local.
    unsafe { forward::cuMemPoolSetAttribute(pool, attr, &raw const v) }
}

/// Sends an array of access descriptors one at a time (each names one device; the driver applies them
/// in order, so this is the same), through `send`.
unsafe fn each_access(
    map: *const CUmemAccessDesc,
    count: usize,
    mut send: impl FnMut(*const CUmemAccessDesc) -> Result<(), CUresult>,
) -> Result<(), CUresult> {
    if count == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    if map.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    for i in 0..count {
        // SAFETY: the caller's array holds `count` descriptors.
        send(unsafe { map.add(i) })?;
    }
    Ok(())
}

pub unsafe fn cuMemPoolSetAccess(
    pool: CUmemoryPool,
    map: *const CUmemAccessDesc,
    count: usize,
) -> Result<(), CUresult> {
    // SAFETY: each descriptor of the caller's array, forwarded alone.
    unsafe { each_access(map, count, |d| forward::cuMemPoolSetAccess(pool, d, 1)) }
}

pub unsafe fn cuMemSetAccess(
    ptr: u64,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe { each_access(desc, count, |d| forward::cuMemSetAccess(ptr, size, d, 1))? };
    // The access the device now has, for pointer queries: the last descriptor naming a device wins.
    for i in 0..count {
        // SAFETY: as above.
        let d = unsafe { desc.add(i).read_unaligned() };
        if d.location.kind != CU_MEM_LOCATION_TYPE_DEVICE {
            continue;
        }
        let end = ptr.saturating_add(size as u64);
        for r in table().range_mut(ptr..end).map(|(_, r)| r) {
            if matches!(r.kind, Kind::Mapped { .. }) {
                r.access = u8::try_from(d.flags).unwrap_or(0);
            }
        }
    }
    Ok(())
}

pub unsafe fn cuMemAddressReserve(
    ptr: *mut u64,
    size: usize,
    alignment: usize,
    addr: u64,
    flags: u64,
) -> Result<(), CUresult> {
    // SAFETY: forwarded under the same contract; `ptr` was written on success.
    let base = unsafe {
        forward::cuMemAddressReserve(ptr, size, alignment, addr, flags)?;
        *ptr
    };
    locked(&RESERVED).insert(base, size as u64);
    Ok(())
}

pub unsafe fn cuMemAddressFree(ptr: u64, size: usize) -> Result<(), CUresult> {
    state::session()?;
    // SAFETY: plain values.
    unsafe { forward::cuMemAddressFree(ptr, size)? };
    locked(&RESERVED).remove(&ptr);
    let end = ptr.saturating_add(size as u64);
    table()
        .retain(|&base, r| !(base >= ptr && base < end && matches!(r.kind, Kind::Mapped { .. })));
    Ok(())
}

pub unsafe fn cuMemMap(
    ptr: u64,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> Result<(), CUresult> {
    // SAFETY: plain values (the handle is checked by the forwarder).
    unsafe { forward::cuMemMap(ptr, size, offset, handle, flags)? };
    record(ptr, size as u64, Kind::Mapped { handle }, None);
    Ok(())
}

pub unsafe fn cuMemUnmap(ptr: u64, size: usize) -> Result<(), CUresult> {
    state::session()?;
    // SAFETY: plain values.
    unsafe { forward::cuMemUnmap(ptr, size)? };
    let end = ptr.saturating_add(size as u64);
    table()
        .retain(|&base, r| !(base >= ptr && base < end && matches!(r.kind, Kind::Mapped { .. })));
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
        None,
    );
    Ok(())
}

pub unsafe fn cuMemFree_v2(dptr: u64) -> Result<(), CUresult> {
    state::session()?;
    // NVIDIA's driver answers a NULL pointer with success, and cuBLAS's runtime relies on it: its
    // `cublasCreate` frees NULL once and gives up on an error (measured on driver 580).
    if dptr == 0 {
        return Ok(());
    }
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

/// `cuStreamAttachMemAsync`: for managed memory the length must be 0 or the whole allocation. The
/// server's copy of a small mirror spans whole pages ([`managed::alloc`]), so the application's whole
/// length becomes 0 there: the same request, in the server's terms.
pub unsafe fn cuStreamAttachMemAsync(
    stream: CUstream,
    dptr: u64,
    length: usize,
    flags: u32,
) -> Result<(), CUresult> {
    let whole = managed::lookup(dptr).is_some_and(|m| m.host == dptr && m.len == length as u64);
    let length = if whole { 0 } else { length };
    // SAFETY: plain values, forwarded under the same contract.
    unsafe { forward::cuStreamAttachMemAsync(stream, dptr, length, flags) }
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
    let Some(region) = lookup(dptr).filter(|r| r.kind.is_device()) else {
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
