//! Managed memory and host memory the device maps: the exports, over the mirrors of [`crate::managed`].
//!
//! * `cuMemAllocManaged`: a mirror of the server's managed allocation, at its address.
//! * `cuMemHostAlloc`/`cuMemAllocHost`: CUDA makes every page-locked allocation accessible to the device
//!   at its host address (unified addressing), so each is a mirror of a host allocation of the server's,
//!   at that allocation's address. `GLEAM_PINNED_MEMORY=local` keeps them in this process only (faster
//!   staging buffers, but a kernel dereferencing one faults: `cuMemHostGetDevicePointer` is refused).
//! * `cuMemHostRegister`: a mirror of the application's range, whose device address is the server's host
//!   allocation (`CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM` is 0, as CUDA allows).
//! * `cuMemAdvise`/`cuMemPrefetchAsync`: recorded for `cuMemRangeGetAttribute(s)`, acted on as hints (a
//!   prefetch to the CPU reads the range back eagerly, one to the device pushes what the host wrote), and
//!   forwarded so that the server's driver migrates its copy too.
//! * `cuPointerGetAttribute(s)` on mirrored memory ([`pointer_attribute`]).

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard, OnceLock};

use gleam_protocol::types::{CUmemLocation, CUresult, CUstream};

use crate::managed::{self, Advice, MirrorInfo, MirrorKind};
use crate::{context, device, forward, put, state};

/// `CU_MEM_ATTACH_GLOBAL`, `CU_MEM_ATTACH_HOST`.
const ATTACH_GLOBAL: u32 = 1;
const ATTACH_HOST: u32 = 2;
/// `CU_MEMHOSTALLOC_*`.
const HOST_ALLOC_FLAGS: u32 = 0x7;
/// `CU_MEMHOSTREGISTER_*`: PORTABLE, DEVICEMAP, IOMEMORY, READ_ONLY.
const REGISTER_FLAGS: u32 = 0xf;
const REGISTER_IOMEMORY: u32 = 0x4;
/// `CU_DEVICE_CPU` and `CU_DEVICE_INVALID`.
const DEVICE_CPU: i32 = -1;
const DEVICE_INVALID: i32 = -2;
/// `CUmemLocationType`.
const LOCATION_INVALID: u32 = 0;
const LOCATION_DEVICE: u32 = 1;
const LOCATION_HOST: u32 = 2;
const LOCATION_HOST_NUMA: u32 = 3;
const LOCATION_HOST_NUMA_CURRENT: u32 = 4;
/// Device attributes consulted.
const ATTR_MANAGED_MEMORY: u32 = 83;
const ATTR_CAN_MAP_HOST_MEMORY: u32 = 19;

/// Host allocations kept in this process only (`GLEAM_PINNED_MEMORY=local`, or a server that cannot map
/// host memory): base -> (length, flags).
static LOCAL: Mutex<BTreeMap<u64, (u64, u32)>> = Mutex::new(BTreeMap::new());

fn local() -> MutexGuard<'static, BTreeMap<u64, (u64, u32)>> {
    LOCAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The local host allocation holding `p`: (base, length, flags).
fn local_at(p: u64) -> Option<(u64, u64, u32)> {
    let l = local();
    let (&base, &(len, flags)) = l.range(..=p).next_back()?;
    (p < base + len.max(1)).then_some((base, len, flags))
}

/// Whether page-locked host memory is mirrored (the default) or kept local.
pub fn pinned_mirrored() -> bool {
    static MIRRORED: OnceLock<bool> = OnceLock::new();
    *MIRRORED.get_or_init(|| match std::env::var("GLEAM_PINNED_MEMORY") {
        Ok(v) if v.trim() == "local" => {
            tracing::warn!(
                "GLEAM_PINNED_MEMORY=local: page-locked host memory stays in this process; kernels \
                 cannot dereference it (cuMemHostGetDevicePointer is refused)"
            );
            false
        }
        _ => true,
    })
}

/// The current context's device (0 without one).
fn current_device() -> i32 {
    context::device_of(0).unwrap_or(0)
}

fn supports(attr: u32) -> bool {
    device::server_attribute(current_device(), attr).unwrap_or(0) != 0
}

pub unsafe fn cuMemAllocManaged(
    dptr: *mut u64,
    bytesize: usize,
    flags: u32,
) -> Result<(), CUresult> {
    state::session()?;
    if dptr.is_null() || bytesize == 0 || !matches!(flags, ATTACH_GLOBAL | ATTACH_HOST) {
        return Err(CUresult::INVALID_VALUE);
    }
    if !supports(ATTR_MANAGED_MEMORY) {
        return Err(CUresult::NOT_SUPPORTED);
    }
    let ctx = context::current();
    if ctx == 0 {
        return Err(CUresult::INVALID_CONTEXT);
    }
    let addr = managed::alloc(MirrorKind::Managed { flags }, bytesize, ctx)?;
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(dptr, addr) }
}

/// A page-locked allocation kept in this process only.
fn local_alloc(bytes: usize, flags: u32) -> Result<u64, CUresult> {
    // SAFETY: an anonymous private mapping; page-aligned as page-locked memory is.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUresult::OUT_OF_MEMORY);
    }
    local().insert(p as u64, (bytes as u64, flags));
    Ok(p as u64)
}

fn host_alloc(bytes: usize, flags: u32) -> Result<u64, CUresult> {
    state::session()?;
    if bytes == 0 || flags & !HOST_ALLOC_FLAGS != 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let ctx = context::current();
    if ctx == 0 {
        return Err(CUresult::INVALID_CONTEXT);
    }
    if !pinned_mirrored() {
        return local_alloc(bytes, flags);
    }
    if !supports(ATTR_CAN_MAP_HOST_MEMORY) {
        // The serving device cannot map host memory: a local allocation, which it would not reach either.
        return local_alloc(bytes, flags);
    }
    managed::alloc(MirrorKind::Host { flags }, bytes, ctx)
}

pub unsafe fn cuMemHostAlloc(pp: *mut u64, bytesize: usize, flags: u32) -> Result<(), CUresult> {
    if pp.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let p = host_alloc(bytesize, flags)?;
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(pp, p) }
}

pub unsafe fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) -> Result<(), CUresult> {
    if pp.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let p = host_alloc(bytesize, 0)?;
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(pp, p as *mut c_void) }
}

pub unsafe fn cuMemFreeHost(p: u64) -> Result<(), CUresult> {
    state::session()?;
    // NULL is freed with success, as NVIDIA's driver does (measured on driver 580).
    if p == 0 {
        return Ok(());
    }
    if let Some(freed) = managed::free(p, true) {
        return freed;
    }
    let len = local().remove(&p).map(|(len, _)| len);
    match len {
        Some(len) => {
            // SAFETY: the mapping `local_alloc` made for exactly this range.
            unsafe { libc::munmap(p as *mut c_void, len as usize) };
            Ok(())
        }
        None => Err(CUresult::INVALID_VALUE),
    }
}

pub unsafe fn cuMemHostGetDevicePointer_v2(
    pdptr: *mut u64,
    p: u64,
    flags: u32,
) -> Result<(), CUresult> {
    state::session()?;
    if pdptr.is_null() || flags != 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let device = match managed::lookup(p) {
        Some(m)
            if !matches!(m.kind, MirrorKind::Managed { .. })
                && p >= m.host
                && p < m.host + m.len =>
        {
            m.device + (p - m.host)
        }
        _ if local_at(p).is_some() => {
            tracing::warn!(
                "cuMemHostGetDevicePointer: this page-locked memory is kept local \
                 (GLEAM_PINNED_MEMORY=local); the GPU peer cannot reach it"
            );
            return Err(CUresult::NOT_SUPPORTED);
        }
        _ => return Err(CUresult::INVALID_VALUE),
    };
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(pdptr, device) }
}

pub unsafe fn cuMemHostGetFlags(flags: *mut u32, p: *mut c_void) -> Result<(), CUresult> {
    state::session()?;
    let p = p as u64;
    let f = match managed::lookup(p) {
        Some(MirrorInfo {
            kind: MirrorKind::Host { flags },
            host,
            len,
            ..
        }) if p >= host && p < host + len => flags,
        _ => local_at(p)
            .map(|(_, _, f)| f)
            .ok_or(CUresult::INVALID_VALUE)?,
    };
    // SAFETY: the caller's out-pointer (NULL is refused by `put`).
    unsafe { put(flags, f) }
}

pub unsafe fn cuMemHostRegister(
    p: *mut c_void,
    bytesize: usize,
    flags: u32,
) -> Result<(), CUresult> {
    state::session()?;
    if p.is_null() || bytesize == 0 || flags & !REGISTER_FLAGS != 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    if flags & REGISTER_IOMEMORY != 0 {
        tracing::warn!(
            "cuMemHostRegister: I/O memory (CU_MEMHOSTREGISTER_IOMEMORY) cannot be mirrored to a GPU peer"
        );
        return Err(CUresult::NOT_SUPPORTED);
    }
    if local_at(p as u64).is_some() || managed::overlaps(p as u64, bytesize as u64) {
        return Err(CUresult::HOST_MEMORY_ALREADY_REGISTERED);
    }
    let ctx = context::current();
    if ctx == 0 {
        return Err(CUresult::INVALID_CONTEXT);
    }
    if !supports(ATTR_CAN_MAP_HOST_MEMORY) {
        return Err(CUresult::NOT_SUPPORTED);
    }
    managed::register(p as u64, bytesize, flags, ctx).map(drop)
}

pub unsafe fn cuMemHostRegister_v2(
    p: *mut c_void,
    bytesize: usize,
    flags: u32,
) -> Result<(), CUresult> {
    // SAFETY: the same call.
    unsafe { cuMemHostRegister(p, bytesize, flags) }
}

pub unsafe fn cuMemHostUnregister(p: *mut c_void) -> Result<(), CUresult> {
    state::session()?;
    if p.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    managed::unregister(p as u64)
}

// --- Advice and prefetching ----------------------------------------------------------------------

/// `CU_MEM_ADVISE_*`.
const ADVISE_SET_READ_MOSTLY: u32 = 1;
const ADVISE_UNSET_READ_MOSTLY: u32 = 2;
const ADVISE_SET_PREFERRED_LOCATION: u32 = 3;
const ADVISE_UNSET_PREFERRED_LOCATION: u32 = 4;
const ADVISE_SET_ACCESSED_BY: u32 = 5;
const ADVISE_UNSET_ACCESSED_BY: u32 = 6;

/// A device ordinal of the session, or the CPU.
fn check_location(device: i32) -> Result<(), CUresult> {
    if device == DEVICE_CPU || state::device(device).is_ok() {
        Ok(())
    } else {
        Err(CUresult::INVALID_DEVICE)
    }
}

/// The range must be managed memory.
fn managed_range(ptr: u64, count: usize) -> Result<(), CUresult> {
    match managed::containing(ptr, count as u64) {
        Some(m) if count > 0 && matches!(m.kind, MirrorKind::Managed { .. }) => Ok(()),
        _ => Err(CUresult::INVALID_VALUE),
    }
}

fn accessed_bit(device: i32) -> u64 {
    1u64 << ((device + 1).clamp(0, 63) as u32)
}

pub unsafe fn cuMemAdvise(
    ptr: u64,
    count: usize,
    advice: u32,
    device: i32,
) -> Result<(), CUresult> {
    state::session()?;
    managed_range(ptr, count)?;
    let edit: fn(&mut Advice, i32) = match advice {
        ADVISE_SET_READ_MOSTLY => |a, _| a.read_mostly = true,
        ADVISE_UNSET_READ_MOSTLY => |a, _| a.read_mostly = false,
        ADVISE_SET_PREFERRED_LOCATION => |a, d| a.preferred = Some(d),
        ADVISE_UNSET_PREFERRED_LOCATION => |a, _| a.preferred = None,
        ADVISE_SET_ACCESSED_BY => |a, d| a.accessed_by |= accessed_bit(d),
        ADVISE_UNSET_ACCESSED_BY => |a, d| a.accessed_by &= !accessed_bit(d),
        _ => return Err(CUresult::INVALID_VALUE),
    };
    if !matches!(advice, ADVISE_SET_READ_MOSTLY | ADVISE_UNSET_READ_MOSTLY) {
        check_location(device)?;
    }
    managed::advise(ptr, count as u64, |a| edit(a, device))?;
    // SAFETY: plain values, checked above.
    unsafe { forward::cuMemAdvise(ptr, count, advice, device) }
}

/// The `CU_DEVICE_CPU`-or-ordinal form of a `CUmemLocation`.
fn location_device(location: CUmemLocation) -> Result<i32, CUresult> {
    match location.kind {
        LOCATION_DEVICE => Ok(location.id),
        // Host NUMA nodes are this machine's; the server's memory has its own.
        LOCATION_HOST | LOCATION_HOST_NUMA | LOCATION_HOST_NUMA_CURRENT => Ok(DEVICE_CPU),
        _ => Err(CUresult::INVALID_VALUE),
    }
}

pub unsafe fn cuMemAdvise_v2(
    ptr: u64,
    count: usize,
    advice: u32,
    location: CUmemLocation,
) -> Result<(), CUresult> {
    let device = if matches!(advice, ADVISE_SET_READ_MOSTLY | ADVISE_UNSET_READ_MOSTLY) {
        0
    } else {
        location_device(location)?
    };
    // SAFETY: the same call in its first form.
    unsafe { cuMemAdvise(ptr, count, advice, device) }
}

pub unsafe fn cuMemPrefetchAsync(
    ptr: u64,
    count: usize,
    device: i32,
    stream: CUstream,
) -> Result<(), CUresult> {
    state::session()?;
    managed_range(ptr, count)?;
    check_location(device)?;
    managed::advise(ptr, count as u64, |a| a.last_prefetch = Some(device))?;
    // SAFETY: plain values and a stream the forwarder checks. Forwarded first: the server's driver
    // migrates its copy in stream order.
    unsafe { forward::cuMemPrefetchAsync(ptr, count, device, stream)? };
    if device == DEVICE_CPU {
        managed::prefetch_host(ptr, count as u64)
    } else {
        managed::flush_range(ptr, count as u64)
    }
}

pub unsafe fn cuMemPrefetchAsync_v2(
    ptr: u64,
    count: usize,
    location: CUmemLocation,
    flags: u32,
    stream: CUstream,
) -> Result<(), CUresult> {
    if flags != 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let device = location_device(location)?;
    // SAFETY: the same call in its first form.
    unsafe { cuMemPrefetchAsync(ptr, count, device, stream) }
}

/// `CU_MEM_RANGE_ATTRIBUTE_*`.
const RANGE_READ_MOSTLY: u32 = 1;
const RANGE_PREFERRED_LOCATION: u32 = 2;
const RANGE_ACCESSED_BY: u32 = 3;
const RANGE_LAST_PREFETCH_LOCATION: u32 = 4;
const RANGE_PREFERRED_LOCATION_TYPE: u32 = 5;
const RANGE_PREFERRED_LOCATION_ID: u32 = 6;
const RANGE_LAST_PREFETCH_LOCATION_TYPE: u32 = 7;
const RANGE_LAST_PREFETCH_LOCATION_ID: u32 = 8;

/// The value every page agrees on, if they all do.
fn uniform(pages: &[Advice], f: impl Fn(&Advice) -> Option<i32>) -> Option<i32> {
    let first = f(pages.first()?)?;
    pages.iter().all(|a| f(a) == Some(first)).then_some(first)
}

/// `(type, id)` of a location given as a device ordinal or `CU_DEVICE_CPU`.
fn location_of(device: Option<i32>) -> (u32, i32) {
    match device {
        Some(DEVICE_CPU) => (LOCATION_HOST, 0),
        Some(d) => (LOCATION_DEVICE, d),
        None => (LOCATION_INVALID, 0),
    }
}

/// The 32-bit values one range attribute answers with (`slots` of them for ACCESSED_BY).
fn range_attribute(pages: &[Advice], attribute: u32, slots: usize) -> Result<Vec<i32>, CUresult> {
    let preferred = uniform(pages, |a| a.preferred);
    let prefetched = uniform(pages, |a| a.last_prefetch);
    let one = |v: i32| Ok(vec![v]);
    match attribute {
        RANGE_READ_MOSTLY => one(i32::from(pages.iter().all(|a| a.read_mostly))),
        RANGE_PREFERRED_LOCATION => one(preferred.unwrap_or(DEVICE_INVALID)),
        RANGE_LAST_PREFETCH_LOCATION => one(prefetched.unwrap_or(DEVICE_INVALID)),
        RANGE_PREFERRED_LOCATION_TYPE => one(location_of(preferred).0 as i32),
        RANGE_PREFERRED_LOCATION_ID => one(location_of(preferred).1),
        RANGE_LAST_PREFETCH_LOCATION_TYPE => one(location_of(prefetched).0 as i32),
        RANGE_LAST_PREFETCH_LOCATION_ID => one(location_of(prefetched).1),
        RANGE_ACCESSED_BY => {
            let all = pages.iter().fold(u64::MAX, |acc, a| acc & a.accessed_by);
            let mut out: Vec<i32> = (0..64)
                .filter(|&bit| all & (1u64 << bit) != 0)
                .map(|bit| bit - 1)
                .take(slots)
                .collect();
            out.resize(slots, DEVICE_INVALID);
            Ok(out)
        }
        _ => Err(CUresult::INVALID_VALUE),
    }
}

/// Answers one range attribute into the caller's `data` of `size` bytes.
unsafe fn write_range_attribute(
    data: *mut c_void,
    size: usize,
    attribute: u32,
    pages: &[Advice],
) -> Result<(), CUresult> {
    if data.is_null() || size == 0 || !size.is_multiple_of(4) {
        return Err(CUresult::INVALID_VALUE);
    }
    if attribute != RANGE_ACCESSED_BY && size != 4 {
        return Err(CUresult::INVALID_VALUE);
    }
    let values = range_attribute(pages, attribute, size / 4)?;
    for (i, v) in values.iter().enumerate() {
        // SAFETY: the caller's buffer of `size` bytes holds `size / 4` 32-bit values.
        unsafe { data.cast::<i32>().add(i).write_unaligned(*v) };
    }
    Ok(())
}

pub unsafe fn cuMemRangeGetAttribute(
    data: *mut c_void,
    size: usize,
    attribute: u32,
    ptr: u64,
    count: usize,
) -> Result<(), CUresult> {
    state::session()?;
    if count == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let pages = managed::advice(ptr, count as u64)?;
    // SAFETY: the caller's buffer.
    unsafe { write_range_attribute(data, size, attribute, &pages) }
}

pub unsafe fn cuMemRangeGetAttributes(
    data: *mut *mut c_void,
    sizes: *mut usize,
    attributes: *mut u32,
    n: usize,
    ptr: u64,
    count: usize,
) -> Result<(), CUresult> {
    state::session()?;
    if n == 0 || data.is_null() || sizes.is_null() || attributes.is_null() || count == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let pages = managed::advice(ptr, count as u64)?;
    for i in 0..n {
        // SAFETY: the caller's arrays of `n` entries each.
        let (d, size, attribute) = unsafe { (*data.add(i), *sizes.add(i), *attributes.add(i)) };
        // SAFETY: the caller's buffer for this attribute.
        unsafe { write_range_attribute(d, size, attribute, &pages)? };
    }
    Ok(())
}

// --- Pointer attributes -------------------------------------------------------------------------------

/// `CU_MEMORYTYPE_HOST`, `CU_MEMORYTYPE_DEVICE`.
const MEMORYTYPE_HOST: u32 = 1;
const MEMORYTYPE_DEVICE: u32 = 2;

/// One `CUpointer_attribute` of mirrored or local page-locked memory, as `(bytes, size)`; `None` if `ptr`
/// is neither (the caller answers), `Some(Err)` for an attribute that does not apply.
pub fn pointer_attribute(attribute: u32, ptr: u64) -> Option<Result<([u8; 16], usize), CUresult>> {
    let mut out = [0u8; 16];
    // Every value is written at its attribute's full width (zeros above what `set` wrote).
    let width = crate::memory::attribute_size(attribute);
    let mut set = |bytes: &[u8]| {
        out[..bytes.len()].copy_from_slice(bytes);
        width.unwrap_or(bytes.len())
    };
    if let Some((base, len, _)) = local_at(ptr) {
        let size = match attribute {
            1 => set(&context::current().to_le_bytes()),
            2 => set(&MEMORYTYPE_HOST.to_le_bytes()),
            3 => return Some(Err(CUresult::INVALID_VALUE)),
            4 => set(&ptr.to_le_bytes()),
            6 | 8 | 10 | 15 | 21 => set(&[0]),
            13 => set(&[1]),
            9 => set(&current_device().to_le_bytes()),
            7 | 20 | 11 | 19 => set(&base.to_le_bytes()),
            12 | 18 => set(&len.to_le_bytes()),
            16 => set(&3u32.to_le_bytes()),
            _ => return Some(Err(CUresult::NOT_SUPPORTED)),
        };
        return Some(Ok((out, size)));
    }
    let m = managed::lookup(ptr)?;
    // Registered and host memory may be named by its device address as well as its host address.
    let offset = if ptr >= m.host && ptr < m.host + m.len {
        ptr - m.host
    } else {
        ptr - m.device
    };
    let managed = matches!(m.kind, MirrorKind::Managed { .. });
    let size = match attribute {
        1 => set(&m.ctx.to_le_bytes()),
        2 => set(&(if managed {
            MEMORYTYPE_DEVICE
        } else {
            MEMORYTYPE_HOST
        })
        .to_le_bytes()),
        3 => set(&(m.device + offset).to_le_bytes()),
        4 => set(&(m.host + offset).to_le_bytes()),
        6 | 10 | 15 | 21 => set(&[0]),
        8 => set(&[u8::from(managed)]),
        13 => set(&[1]),
        9 => set(&context::device_of(m.ctx).unwrap_or(0).to_le_bytes()),
        7 | 20 => set(&m.host.to_le_bytes()),
        11 | 19 => set(&(if ptr >= m.host && ptr < m.host + m.len {
            m.host
        } else {
            m.device
        })
        .to_le_bytes()),
        12 | 18 => set(&m.len.to_le_bytes()),
        16 => set(&3u32.to_le_bytes()),
        _ => return Some(Err(CUresult::NOT_SUPPORTED)),
    };
    Some(Ok((out, size)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(
        read_mostly: bool,
        preferred: Option<i32>,
        accessed: u64,
        prefetch: Option<i32>,
    ) -> Advice {
        Advice {
            read_mostly,
            preferred,
            accessed_by: accessed,
            last_prefetch: prefetch,
        }
    }

    #[test]
    fn range_attributes_need_every_page_to_agree() {
        let same = [
            page(true, Some(0), accessed_bit(0) | accessed_bit(-1), Some(-1)),
            page(true, Some(0), accessed_bit(0), Some(-1)),
        ];
        assert_eq!(range_attribute(&same, RANGE_READ_MOSTLY, 1), Ok(vec![1]));
        assert_eq!(
            range_attribute(&same, RANGE_PREFERRED_LOCATION, 1),
            Ok(vec![0])
        );
        assert_eq!(
            range_attribute(&same, RANGE_LAST_PREFETCH_LOCATION, 1),
            Ok(vec![-1])
        );
        assert_eq!(
            range_attribute(&same, RANGE_LAST_PREFETCH_LOCATION_TYPE, 1),
            Ok(vec![LOCATION_HOST as i32])
        );
        // Only device 0 is accessed-by on every page; the rest is CU_DEVICE_INVALID.
        assert_eq!(
            range_attribute(&same, RANGE_ACCESSED_BY, 3),
            Ok(vec![0, -2, -2])
        );
        let mixed = [
            page(true, Some(0), 0, None),
            page(false, Some(-1), 0, Some(0)),
        ];
        assert_eq!(range_attribute(&mixed, RANGE_READ_MOSTLY, 1), Ok(vec![0]));
        assert_eq!(
            range_attribute(&mixed, RANGE_PREFERRED_LOCATION, 1),
            Ok(vec![-2])
        );
        assert_eq!(
            range_attribute(&mixed, RANGE_PREFERRED_LOCATION_TYPE, 1),
            Ok(vec![LOCATION_INVALID as i32])
        );
        assert_eq!(
            range_attribute(&mixed, RANGE_LAST_PREFETCH_LOCATION, 1),
            Ok(vec![-2])
        );
        assert_eq!(range_attribute(&mixed, 99, 1), Err(CUresult::INVALID_VALUE));
    }
}
