//! Managed memory and host allocations on the emulated device.
//!
//! Both are device memory here: the client maps the same addresses in its own process and keeps them
//! coherent with direct reads and writes (the session's mirror calls), so on this side `cuMemAllocManaged`
//! and `cuMemHostAlloc` allocate like `cuMemAlloc`, aligned to [`MIRROR_ALIGN`] so that no two of them
//! share a page of the client (whose pages may be as large as 64 KiB). `cuMemHostGetDevicePointer` is the
//! identity, as on a device with unified addressing. Advice, prefetches and stream attachment are checked
//! as CUDA checks them and otherwise change nothing: every byte is already where kernels read it.

use std::collections::BTreeMap;

use gleam_protocol::types::CUresult;

use crate::memory::DeviceMemory;

/// Alignment of managed and host allocations: the largest page size a client may have.
pub const MIRROR_ALIGN: u64 = 64 << 10;

/// `CU_MEM_ATTACH_*`.
const ATTACH_GLOBAL: u32 = 1;
const ATTACH_HOST: u32 = 2;
const ATTACH_SINGLE: u32 = 4;
/// `CU_MEMHOSTALLOC_PORTABLE | DEVICEMAP | WRITECOMBINED`.
const HOST_ALLOC_FLAGS: u32 = 0x7;
/// `CU_DEVICE_CPU`.
const DEVICE_CPU: i32 = -1;

#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Kind {
    Managed,
    Host { flags: u32 },
}

#[derive(Clone, Copy, Debug)]
struct Allocation {
    len: u64,
    ctx: u64,
    kind: Kind,
}

/// The managed and host allocations of a session.
#[derive(Debug, Default)]
pub struct Mirrored {
    live: BTreeMap<u64, Allocation>,
}

impl Mirrored {
    /// `cuMemAllocManaged`.
    pub fn alloc_managed(
        &mut self,
        mem: &DeviceMemory,
        bytes: usize,
        flags: u32,
        ctx: u64,
    ) -> Result<u64, CUresult> {
        if bytes == 0 || !matches!(flags, ATTACH_GLOBAL | ATTACH_HOST) {
            return Err(CUresult::INVALID_VALUE);
        }
        self.alloc(mem, bytes, ctx, Kind::Managed)
    }

    /// `cuMemHostAlloc`.
    pub fn alloc_host(
        &mut self,
        mem: &DeviceMemory,
        bytes: usize,
        flags: u32,
        ctx: u64,
    ) -> Result<u64, CUresult> {
        if bytes == 0 || flags & !HOST_ALLOC_FLAGS != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        self.alloc(mem, bytes, ctx, Kind::Host { flags })
    }

    fn alloc(
        &mut self,
        mem: &DeviceMemory,
        bytes: usize,
        ctx: u64,
        kind: Kind,
    ) -> Result<u64, CUresult> {
        let len = bytes as u64;
        let base = mem.alloc(len, MIRROR_ALIGN, ctx)?;
        self.live.insert(base, Allocation { len, ctx, kind });
        Ok(base)
    }

    fn containing(&self, ptr: u64, len: u64) -> Option<(u64, &Allocation)> {
        let (&base, a) = self.live.range(..=ptr).next_back()?;
        let end = ptr.checked_add(len.max(1))?;
        (end <= base + a.len).then_some((base, a))
    }

    /// `cuMemHostGetDevicePointer`: the identity for a host allocation (unified addressing).
    pub fn device_pointer(&self, p: u64, flags: u32) -> Result<u64, CUresult> {
        match self.containing(p, 1) {
            Some((_, a)) if flags == 0 && matches!(a.kind, Kind::Host { .. }) => Ok(p),
            _ => Err(CUresult::INVALID_VALUE),
        }
    }

    /// `cuMemFreeHost`: the base of a host allocation only.
    pub fn free_host(&mut self, mem: &DeviceMemory, p: u64) -> Result<(), CUresult> {
        match self.live.get(&p) {
            Some(a) if matches!(a.kind, Kind::Host { .. }) => {
                self.live.remove(&p);
                mem.free(p)
            }
            _ => Err(CUresult::INVALID_VALUE),
        }
    }

    /// Before `cuMemFree` of `p`: host memory is freed with `cuMemFreeHost` only; a managed allocation is
    /// forgotten.
    pub fn before_free(&mut self, p: u64) -> Result<(), CUresult> {
        match self.live.get(&p).map(|a| a.kind) {
            Some(Kind::Host { .. }) => Err(CUresult::INVALID_VALUE),
            Some(Kind::Managed) => {
                self.live.remove(&p);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// `cuMemAdvise`: the advice and device are checked; the range must be managed memory.
    pub fn advise(&self, ptr: u64, count: usize, advice: u32, device: i32) -> Result<(), CUresult> {
        if !(1..=6).contains(&advice) {
            return Err(CUresult::INVALID_VALUE);
        }
        self.managed_range(ptr, count)?;
        // Read-mostly advice names no device; the others name the device or the CPU.
        if !matches!(advice, 1 | 2) && device != 0 && device != DEVICE_CPU {
            return Err(CUresult::INVALID_DEVICE);
        }
        Ok(())
    }

    /// `cuMemPrefetchAsync`: to the device or the CPU; the range must be managed memory.
    pub fn prefetch(&self, ptr: u64, count: usize, device: i32) -> Result<(), CUresult> {
        self.managed_range(ptr, count)?;
        if device != 0 && device != DEVICE_CPU {
            return Err(CUresult::INVALID_DEVICE);
        }
        Ok(())
    }

    /// `cuStreamAttachMemAsync`: `dptr` is a managed allocation's base; `length` 0 or its size.
    pub fn attach(&self, dptr: u64, length: usize, flags: u32) -> Result<(), CUresult> {
        if !matches!(flags, ATTACH_GLOBAL | ATTACH_HOST | ATTACH_SINGLE) {
            return Err(CUresult::INVALID_VALUE);
        }
        match self.live.get(&dptr) {
            Some(a) if a.kind == Kind::Managed && (length == 0 || length as u64 == a.len) => Ok(()),
            _ => Err(CUresult::INVALID_VALUE),
        }
    }

    fn managed_range(&self, ptr: u64, count: usize) -> Result<(), CUresult> {
        match self.containing(ptr, count as u64) {
            Some((_, a)) if count > 0 && a.kind == Kind::Managed => Ok(()),
            _ => Err(CUresult::INVALID_VALUE),
        }
    }

    /// Context `ctx` lost its memory.
    pub fn emptied(&mut self, ctx: u64) {
        self.live.retain(|_, a| a.ctx != ctx);
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.live.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_page_aligned_and_checked() {
        let mem = DeviceMemory::new(16 << 20);
        let mut m = Mirrored::default();
        let a = m.alloc_managed(&mem, 100, ATTACH_GLOBAL, 1).unwrap();
        let b = m.alloc_managed(&mem, 100, ATTACH_HOST, 1).unwrap();
        assert_eq!(a % MIRROR_ALIGN, 0);
        assert!(b >= a + MIRROR_ALIGN);
        assert_eq!(
            m.alloc_managed(&mem, 0, ATTACH_GLOBAL, 1),
            Err(CUresult::INVALID_VALUE)
        );
        assert_eq!(m.alloc_managed(&mem, 8, 3, 1), Err(CUresult::INVALID_VALUE));
        let h = m.alloc_host(&mem, 64, 2, 1).unwrap();
        assert_eq!(m.device_pointer(h + 8, 0), Ok(h + 8));
        assert_eq!(m.device_pointer(a, 0), Err(CUresult::INVALID_VALUE));
        assert_eq!(m.device_pointer(h, 1), Err(CUresult::INVALID_VALUE));
        assert_eq!(m.before_free(h), Err(CUresult::INVALID_VALUE));
        assert_eq!(m.free_host(&mem, a), Err(CUresult::INVALID_VALUE));
        m.free_host(&mem, h).unwrap();
        assert_eq!(m.advise(a, 100, 1, 0), Ok(()));
        assert_eq!(m.advise(a, 101, 1, 0), Err(CUresult::INVALID_VALUE));
        assert_eq!(m.advise(a, 10, 3, 5), Err(CUresult::INVALID_DEVICE));
        assert_eq!(m.prefetch(a, 100, DEVICE_CPU), Ok(()));
        assert_eq!(m.attach(a, 0, ATTACH_SINGLE), Ok(()));
        assert_eq!(
            m.attach(a + 8, 0, ATTACH_SINGLE),
            Err(CUresult::INVALID_VALUE)
        );
        m.emptied(1);
        assert_eq!(m.prefetch(a, 100, 0), Err(CUresult::INVALID_VALUE));
    }
}
