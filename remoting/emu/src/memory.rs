//! Device memory: a fake device address range backed by host memory.
//!
//! [`DeviceMemory`] hands out 256-byte-aligned addresses from [`VA_BASE`] up (first fit over a free-range
//! list, so freed ranges are reused but never while live), caps the total at the configured size, and
//! implements [`gleam_ptx::GlobalMemory`] for the interpreter. Each allocation is a slice of `AtomicU64`
//! words: kernels on several streams (and the blocks of one kernel, which run on several OS threads) may
//! touch the same memory at once, as on a GPU, and word-sized atomics make that well defined in Rust
//! without locks. Partial-word writes merge their bytes with a compare-and-swap, so byte stores by
//! different threads into one word never lose each other's bytes.
//!
//! Virtual memory management (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`...) is modelled as on a
//! GPU: a *physical allocation* is storage with no address; a *reservation* is a range of the address
//! space with no storage; a *mapping* places (part of) a physical allocation at an address of a
//! reservation, with no access until `cuMemSetAccess` grants it. One physical allocation may be mapped at
//! several addresses (they alias), and a copy or kernel may run across the boundary between two adjacent
//! mappings (pools that grow by mapping more chunks rely on it). Physical memory counts against the
//! device's capacity from `cuMemCreate` until it is both released and unmapped.

use std::alloc::Layout;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use gleam_protocol::types::{CUmemAllocationProp, CUresult};
use gleam_ptx::{GlobalMemory, MemoryFault};

/// First device address handed out (looks like a device pointer on a real GPU).
pub const VA_BASE: u64 = 0x7f00_0000_0000;
/// Size of the fake device address range.
pub const VA_SPAN: u64 = 1 << 40;
/// Alignment of every allocation (what `cuMemAlloc` guarantees).
pub const ALLOC_ALIGN: u64 = 256;
/// Largest alignment an allocation may ask for (module globals declare theirs).
pub const MAX_ALIGN: u64 = 64 << 10;
/// Unmapped bytes left after each allocation, so that small overruns fault instead of hitting a neighbour.
const GUARD: u64 = 256;
/// Largest piece a device-to-device copy or memset stages through the host at once.
const STAGE: usize = 1 << 20;
/// Granularity of virtual memory management (`cuMemGetAllocationGranularity`, minimum and recommended):
/// 2 MiB, what NVIDIA's GPUs report, so programs size their chunks here as they would there.
pub const GRANULARITY: u64 = 2 << 20;
/// Handles of physical allocations (`CUmemGenericAllocationHandle`) start here.
const PHYSICAL_HANDLE_BASE: u64 = 0x0a11_0000_0000;

/// `CU_MEM_ACCESS_FLAGS_PROT_*` bits: read, and write (read-write is 3).
pub const ACCESS_READ: u8 = 1;
/// See [`ACCESS_READ`].
pub const ACCESS_READ_WRITE: u8 = 3;
const ACCESS_WRITE_BIT: u8 = 2;

/// Host memory standing in for device memory: what an allocation, or a physical allocation of virtual
/// memory management, owns.
struct Storage {
    words: Box<[AtomicU64]>,
}

/// A piece of a range: the block, the offset in it, the offset in the range, the length.
type Piece = (Arc<Block>, usize, usize, usize);

/// One live range of the address space with storage behind it: an allocation, or a mapping.
struct Block {
    base: u64,
    /// Size in bytes (accesses beyond it fault).
    size: u64,
    /// Bytes this block owns in the address range (size rounded up, plus the guard); 0 for a mapping,
    /// whose addresses belong to its reservation.
    reserved: u64,
    /// The context that allocated it (freed with the context; mappings belong to the device).
    ctx: u64,
    storage: Arc<Storage>,
    /// Index of the block's first word in `storage` (mappings may start inside a physical allocation).
    first_word: usize,
    /// `CU_MEM_ACCESS_FLAGS_PROT_*`: read-write for allocations; none for a mapping until granted.
    access: AtomicU8,
    /// For a mapping, the physical allocation mapped.
    mapping: Option<u64>,
}

impl Block {
    fn contains(&self, addr: u64, len: usize) -> bool {
        addr >= self.base
            && addr
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.base + self.size)
    }

    fn words(&self) -> &[AtomicU64] {
        &self.storage.words[self.first_word..]
    }

    /// Whether the device may access it so (`write`: store or atomic; else load).
    fn allows(&self, write: bool) -> bool {
        let access = self.access.load(Ordering::Relaxed);
        if write {
            access & ACCESS_WRITE_BIT != 0
        } else {
            access & ACCESS_READ != 0
        }
    }

    fn read(&self, offset: usize, out: &mut [u8]) {
        let mut done = 0;
        while done < out.len() {
            let pos = offset + done;
            let (word, byte) = (pos / 8, pos % 8);
            let n = (8 - byte).min(out.len() - done);
            let bytes = self.words()[word].load(Ordering::Relaxed).to_le_bytes();
            out[done..done + n].copy_from_slice(&bytes[byte..byte + n]);
            done += n;
        }
    }

    fn write(&self, offset: usize, data: &[u8]) {
        let mut done = 0;
        while done < data.len() {
            let pos = offset + done;
            let (word, byte) = (pos / 8, pos % 8);
            let n = (8 - byte).min(data.len() - done);
            let part = &data[done..done + n];
            if n == 8 {
                let mut b = [0u8; 8];
                b.copy_from_slice(part);
                self.words()[word].store(u64::from_le_bytes(b), Ordering::Relaxed);
            } else {
                // Merge the bytes into the word atomically: a neighbour's concurrent byte store survives.
                let merge = |old: u64| {
                    let mut b = old.to_le_bytes();
                    b[byte..byte + n].copy_from_slice(part);
                    Some(u64::from_le_bytes(b))
                };
                let _ =
                    self.words()[word].fetch_update(Ordering::Relaxed, Ordering::Relaxed, merge);
            }
            done += n;
        }
    }

    fn fill(&self, offset: usize, pattern: &[u8], count: usize) {
        // One staging buffer of whole patterns, written again and again.
        let per_chunk = (STAGE / pattern.len()).clamp(1, count.max(1));
        let chunk: Vec<u8> = pattern
            .iter()
            .copied()
            .cycle()
            .take(per_chunk * pattern.len())
            .collect();
        let mut written = 0;
        while written < count {
            let n = per_chunk.min(count - written);
            self.write(
                offset + written * pattern.len(),
                &chunk[..n * pattern.len()],
            );
            written += n;
        }
    }

    /// Atomic read-modify-write of a naturally aligned 4- or 8-byte value; returns the old value.
    fn atomic(&self, offset: usize, size: usize, op: &mut dyn FnMut(u64) -> u64) -> u64 {
        let word = &self.words()[offset / 8];
        if size == 8 {
            let mut old = 0;
            let _ = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                old = w;
                Some(op(w))
            });
            return old;
        }
        let shift = (offset % 8) * 8;
        let mask = 0xffff_ffffu64 << shift;
        let mut old = 0;
        let _ = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            old = (w & mask) >> shift;
            let new = op(old) & 0xffff_ffff;
            Some((w & !mask) | (new << shift))
        });
        old
    }
}

/// Zero-filled words straight from the allocator: large allocations come from fresh zero pages, so memory
/// is only committed when touched, and failure is an error rather than an abort.
fn zeroed_words(n: usize) -> Option<Box<[AtomicU64]>> {
    if n == 0 {
        return Some(Box::new([]));
    }
    let layout = Layout::array::<AtomicU64>(n).ok()?;
    // SAFETY: `layout` has a non-zero size. All-zero bytes are a valid `AtomicU64`. The pointer comes from
    // the global allocator with exactly the layout `Box<[AtomicU64]>` of length `n` frees with.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<AtomicU64>();
        if ptr.is_null() {
            return None;
        }
        Some(Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, n)))
    }
}

/// A physical allocation of virtual memory management (`cuMemCreate`).
struct Physical {
    storage: Arc<Storage>,
    size: u64,
    prop: CUmemAllocationProp,
    /// References to the handle: `cuMemCreate` and each `cuMemRetainAllocationHandle` add one, each
    /// `cuMemRelease` drops one.
    refs: u32,
    /// Live mappings of it.
    maps: u32,
}

#[derive(Default)]
struct Table {
    live: BTreeMap<u64, Arc<Block>>,
    /// Free ranges of the address space: start -> length, coalesced.
    free: BTreeMap<u64, u64>,
    /// Bytes counted against the capacity (sizes rounded up to [`ALLOC_ALIGN`], physical allocations).
    used: u64,
    /// Address reservations: start -> length.
    reservations: BTreeMap<u64, u64>,
    /// Physical allocations by handle, until released and unmapped.
    physical: HashMap<u64, Physical>,
    next_physical: u64,
}

impl Table {
    fn find(&self, addr: u64) -> Option<&Arc<Block>> {
        self.live
            .range(..=addr)
            .next_back()
            .map(|(_, b)| b)
            .filter(|b| addr < b.base + b.size.max(1))
    }

    /// The blocks covering `[addr, addr + len)` back to back, with the offset into the first one; a gap
    /// (or a length past the address space) is a fault.
    fn span(&self, addr: u64, len: usize) -> Option<(Vec<Arc<Block>>, usize)> {
        let end = addr.checked_add(len as u64)?;
        let first = self.find(addr)?;
        let offset = (addr - first.base) as usize;
        let mut blocks = vec![first.clone()];
        let mut covered = first.base + first.size;
        while covered < end {
            let next = self.live.get(&covered)?;
            covered += next.size;
            blocks.push(next.clone());
        }
        Some((blocks, offset))
    }

    /// The mappings tiling `[ptr, ptr + size)` exactly (each whole, back to back), or `None`.
    fn mappings_tiling(&self, ptr: u64, size: u64) -> Option<Vec<Arc<Block>>> {
        let end = ptr.checked_add(size)?;
        let mut at = ptr;
        let mut blocks = Vec::new();
        while at < end {
            let block = self.live.get(&at)?;
            block.mapping?;
            at += block.size;
            blocks.push(block.clone());
        }
        (at == end && !blocks.is_empty()).then_some(blocks)
    }

    /// Takes `[start, start + len)` out of the free list if it lies inside one free range.
    fn take_range(&mut self, start: u64, len: u64) -> bool {
        let Some((&fstart, &flen)) = self.free.range(..=start).next_back() else {
            return false;
        };
        let (Some(end), Some(fend)) = (start.checked_add(len), fstart.checked_add(flen)) else {
            return false;
        };
        if end > fend {
            return false;
        }
        self.free.remove(&fstart);
        if start > fstart {
            self.free.insert(fstart, start - fstart);
        }
        if end < fend {
            self.free.insert(end, fend - end);
        }
        true
    }

    /// The first free range that holds `len` bytes at a multiple of `align`: its start.
    fn first_fit(&self, len: u64, align: u64) -> Option<u64> {
        self.free.iter().find_map(|(&start, &flen)| {
            let base = start.checked_next_multiple_of(align)?;
            let end = base.checked_add(len)?;
            (end <= start + flen).then_some(base)
        })
    }

    fn release_range(&mut self, start: u64, len: u64) {
        let mut start = start;
        let mut len = len;
        if let Some((&prev, &plen)) = self.free.range(..start).next_back()
            && prev + plen == start
        {
            self.free.remove(&prev);
            start = prev;
            len += plen;
        }
        if let Some(&nlen) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += nlen;
        }
        self.free.insert(start, len);
    }
}

/// The emulated device's memory. Shared (behind an `Arc`) by the backend and its stream workers.
pub struct DeviceMemory {
    /// Distinguishes instances in the per-thread lookup cache.
    id: u64,
    capacity: u64,
    table: RwLock<Table>,
    /// Bumped on every free, so that cached lookups of freed blocks are never trusted.
    generation: AtomicU64,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory").finish_non_exhaustive()
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The last block this thread touched: (memory id, generation, block). Kernels hit the same buffer
    /// again and again, so this skips the table lock, and any shared reference count, on almost every
    /// access. A stale entry (generation changed) is never used; [`clear_thread_cache`] drops it so an
    /// idle thread does not keep a freed block's host memory alive.
    static LAST_HIT: RefCell<Option<(u64, u64, Arc<Block>)>> = const { RefCell::new(None) };
}

impl DeviceMemory {
    /// Memory of `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        let mut table = Table::default();
        table.free.insert(VA_BASE, VA_SPAN);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            capacity,
            table: RwLock::new(table),
            generation: AtomicU64::new(0),
        }
    }

    /// Total bytes (`cuMemGetInfo`'s `total`).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// `(free, total)` as `cuMemGetInfo` reports them.
    pub fn info(&self) -> (u64, u64) {
        let used = self.read_table().used;
        (self.capacity.saturating_sub(used), self.capacity)
    }

    /// Allocates `size` bytes aligned to `align` (at least [`ALLOC_ALIGN`]) for context `ctx`.
    pub fn alloc(&self, size: u64, align: u64, ctx: u64) -> Result<u64, CUresult> {
        if size == 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        // Alignments come from PTX the client sent: anything beyond a page is refused, not obeyed.
        let align = align
            .max(ALLOC_ALIGN)
            .checked_next_power_of_two()
            .filter(|&a| a <= MAX_ALIGN)
            .ok_or(CUresult::INVALID_VALUE)?;
        let charged = size
            .checked_next_multiple_of(ALLOC_ALIGN)
            .ok_or(CUresult::OUT_OF_MEMORY)?;
        let reserved = charged.checked_add(GUARD).ok_or(CUresult::OUT_OF_MEMORY)?;
        let words = usize::try_from(size.div_ceil(8)).map_err(|_| CUresult::OUT_OF_MEMORY)?;
        let mut table = self.write_table();
        if table
            .used
            .checked_add(charged)
            .is_none_or(|total| total > self.capacity)
        {
            return Err(CUresult::OUT_OF_MEMORY);
        }
        let base = table
            .first_fit(reserved, align)
            .ok_or(CUresult::OUT_OF_MEMORY)?;
        let words = zeroed_words(words).ok_or(CUresult::OUT_OF_MEMORY)?;
        table.take_range(base, reserved);
        table.used += charged;
        let block = Arc::new(Block {
            base,
            size,
            reserved,
            ctx,
            storage: Arc::new(Storage { words }),
            first_word: 0,
            access: AtomicU8::new(ACCESS_READ_WRITE),
            mapping: None,
        });
        table.live.insert(base, block);
        Ok(base)
    }

    /// Frees the allocation starting exactly at `ptr` (not a mapping: those are unmapped).
    pub fn free(&self, ptr: u64) -> Result<(), CUresult> {
        let mut table = self.write_table();
        if table.live.get(&ptr).is_none_or(|b| b.mapping.is_some()) {
            return Err(CUresult::INVALID_VALUE);
        }
        let block = table.live.remove(&ptr).ok_or(CUresult::INVALID_VALUE)?;
        self.forget(&mut table, &block);
        Ok(())
    }

    /// Frees every allocation of context `ctx`; `None`: everything, virtual memory management included.
    pub fn free_all(&self, ctx: Option<u64>) {
        let mut table = self.write_table();
        let doomed: Vec<u64> = table
            .live
            .values()
            .filter(|b| b.mapping.is_none() && ctx.is_none_or(|c| b.ctx == c))
            .map(|b| b.base)
            .collect();
        for base in doomed {
            if let Some(block) = table.live.remove(&base) {
                self.forget(&mut table, &block);
            }
        }
        if ctx.is_none() {
            table.live.clear();
            for (base, len) in std::mem::take(&mut table.reservations) {
                table.release_range(base, len);
            }
            let physical: u64 = table.physical.values().map(|p| p.size).sum();
            table.physical.clear();
            table.used -= physical;
            self.generation.fetch_add(1, Ordering::Release);
            clear_thread_cache();
        }
    }

    fn forget(&self, table: &mut Table, block: &Block) {
        clear_thread_cache();
        table.used -= block.size.next_multiple_of(ALLOC_ALIGN);
        table.release_range(block.base, block.reserved);
        self.generation.fetch_add(1, Ordering::Release);
    }

    // --- Virtual memory management ----------------------------------------------------------------------

    /// `cuMemCreate`: a physical allocation of `size` bytes (a multiple of [`GRANULARITY`]).
    pub fn create_physical(&self, size: u64, prop: CUmemAllocationProp) -> Result<u64, CUresult> {
        if size == 0 || !size.is_multiple_of(GRANULARITY) {
            return Err(CUresult::INVALID_VALUE);
        }
        let words = usize::try_from(size / 8).map_err(|_| CUresult::OUT_OF_MEMORY)?;
        let mut table = self.write_table();
        if table
            .used
            .checked_add(size)
            .is_none_or(|total| total > self.capacity)
        {
            return Err(CUresult::OUT_OF_MEMORY);
        }
        let words = zeroed_words(words).ok_or(CUresult::OUT_OF_MEMORY)?;
        table.used += size;
        table.next_physical += 1;
        let handle = PHYSICAL_HANDLE_BASE | (table.next_physical << 4);
        table.physical.insert(
            handle,
            Physical {
                storage: Arc::new(Storage { words }),
                size,
                prop,
                refs: 1,
                maps: 0,
            },
        );
        Ok(handle)
    }

    /// `cuMemRelease`: drops one reference; the memory goes once no reference and no mapping is left.
    pub fn release_physical(&self, handle: u64) -> Result<(), CUresult> {
        let mut table = self.write_table();
        let p = table
            .physical
            .get_mut(&handle)
            .filter(|p| p.refs > 0)
            .ok_or(CUresult::INVALID_VALUE)?;
        p.refs -= 1;
        Self::drop_physical_if_unused(&mut table, handle);
        Ok(())
    }

    fn drop_physical_if_unused(table: &mut Table, handle: u64) {
        if table
            .physical
            .get(&handle)
            .is_some_and(|p| p.refs == 0 && p.maps == 0)
            && let Some(p) = table.physical.remove(&handle)
        {
            table.used -= p.size;
        }
    }

    /// `cuMemRetainAllocationHandle`: the physical allocation mapped at `addr`, with one more reference.
    pub fn retain_physical(&self, addr: u64) -> Result<u64, CUresult> {
        let mut table = self.write_table();
        let handle = table
            .find(addr)
            .and_then(|b| b.mapping)
            .ok_or(CUresult::INVALID_VALUE)?;
        let p = table
            .physical
            .get_mut(&handle)
            .ok_or(CUresult::INVALID_VALUE)?;
        p.refs += 1;
        Ok(handle)
    }

    /// `cuMemGetAllocationPropertiesFromHandle`.
    pub fn physical_properties(&self, handle: u64) -> Result<CUmemAllocationProp, CUresult> {
        self.read_table()
            .physical
            .get(&handle)
            .filter(|p| p.refs > 0)
            .map(|p| p.prop)
            .ok_or(CUresult::INVALID_VALUE)
    }

    /// `cuMemAddressReserve`: `size` bytes of address space (a multiple of the host page), aligned to
    /// `align` (a power of two; 0 and anything below the granularity mean the granularity), at `hint` if
    /// that range is free.
    pub fn reserve(&self, size: u64, align: u64, hint: u64) -> Result<u64, CUresult> {
        if size == 0 || !size.is_multiple_of(4096) || (align != 0 && !align.is_power_of_two()) {
            return Err(CUresult::INVALID_VALUE);
        }
        let align = align.max(GRANULARITY);
        let mut table = self.write_table();
        let base = if hint != 0 && hint.is_multiple_of(align) && table.take_range(hint, size) {
            hint
        } else {
            let base = table
                .first_fit(size, align)
                .ok_or(CUresult::OUT_OF_MEMORY)?;
            table.take_range(base, size);
            base
        };
        table.reservations.insert(base, size);
        Ok(base)
    }

    /// `cuMemAddressFree`: the whole reservation at `ptr`, which must have nothing mapped any more.
    pub fn address_free(&self, ptr: u64, size: u64) -> Result<(), CUresult> {
        let mut table = self.write_table();
        if table.reservations.get(&ptr) != Some(&size) {
            return Err(CUresult::INVALID_VALUE);
        }
        if table.live.range(ptr..ptr + size).next().is_some() {
            tracing::warn!(
                ptr,
                size,
                "cuMemAddressFree of a reservation that still has mappings: unmap them first"
            );
            return Err(CUresult::INVALID_VALUE);
        }
        table.reservations.remove(&ptr);
        table.release_range(ptr, size);
        Ok(())
    }

    /// `cuMemMap`: bytes `[offset, offset + size)` of physical allocation `handle` at `ptr`, inside a
    /// reservation and over nothing mapped; every figure a multiple of [`GRANULARITY`]. No access yet.
    pub fn map(&self, ptr: u64, size: u64, offset: u64, handle: u64) -> Result<(), CUresult> {
        let aligned = |v: u64| v.is_multiple_of(GRANULARITY);
        if size == 0 || !aligned(ptr) || !aligned(size) || !aligned(offset) {
            return Err(CUresult::INVALID_VALUE);
        }
        let end = ptr.checked_add(size).ok_or(CUresult::INVALID_VALUE)?;
        let mut table = self.write_table();
        let inside = table
            .reservations
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&base, &len)| end <= base + len);
        let overlaps = table.find(ptr).is_some() || table.live.range(ptr..end).next().is_some();
        if !inside || overlaps {
            return Err(CUresult::INVALID_VALUE);
        }
        let p = table
            .physical
            .get_mut(&handle)
            .filter(|p| p.refs > 0)
            .ok_or(CUresult::INVALID_HANDLE)?;
        if offset.checked_add(size).is_none_or(|e| e > p.size) {
            return Err(CUresult::INVALID_VALUE);
        }
        p.maps += 1;
        let block = Arc::new(Block {
            base: ptr,
            size,
            reserved: 0,
            ctx: 0,
            storage: p.storage.clone(),
            first_word: (offset / 8) as usize,
            access: AtomicU8::new(0),
            mapping: Some(handle),
        });
        table.live.insert(ptr, block);
        Ok(())
    }

    /// `cuMemUnmap`: the mappings that exactly make up `[ptr, ptr + size)`.
    pub fn unmap(&self, ptr: u64, size: u64) -> Result<(), CUresult> {
        let mut table = self.write_table();
        let blocks = table
            .mappings_tiling(ptr, size)
            .ok_or(CUresult::INVALID_VALUE)?;
        for block in blocks {
            table.live.remove(&block.base);
            if let Some(handle) = block.mapping {
                if let Some(p) = table.physical.get_mut(&handle) {
                    p.maps -= 1;
                }
                Self::drop_physical_if_unused(&mut table, handle);
            }
        }
        clear_thread_cache();
        self.generation.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// `cuMemSetAccess` for the device: `flags` (0, [`ACCESS_READ`] or [`ACCESS_READ_WRITE`]) on the
    /// mappings that exactly make up `[ptr, ptr + size)`.
    pub fn set_access(&self, ptr: u64, size: u64, flags: u32) -> Result<(), CUresult> {
        let flags = match flags {
            0 => 0,
            1 => ACCESS_READ,
            3 => ACCESS_READ_WRITE,
            _ => return Err(CUresult::INVALID_VALUE),
        };
        let table = self.read_table();
        let blocks = table
            .mappings_tiling(ptr, size)
            .ok_or(CUresult::INVALID_VALUE)?;
        for block in blocks {
            block.access.store(flags, Ordering::Release);
        }
        Ok(())
    }

    /// `cuMemGetAccess` for the device: the flags of the mapping holding `ptr`.
    pub fn access(&self, ptr: u64) -> Result<u32, CUresult> {
        let table = self.read_table();
        let block = table
            .find(ptr)
            .filter(|b| b.mapping.is_some())
            .ok_or(CUresult::INVALID_VALUE)?;
        Ok(u32::from(block.access.load(Ordering::Acquire)))
    }

    /// Number of live allocations.
    pub fn live_allocations(&self) -> usize {
        self.read_table().live.len()
    }

    /// `cuMemGetAddressRange`: the base and size of the allocation containing `ptr`.
    pub fn address_range(&self, ptr: u64) -> Option<(u64, u64)> {
        self.read_table().find(ptr).map(|b| (b.base, b.size))
    }

    /// Whether `[addr, addr + len)` is device memory the device may read (or, with `write`, write):
    /// one allocation, or adjacent mappings.
    pub fn check(&self, addr: u64, len: u64, write: bool) -> Result<(), CUresult> {
        let len = usize::try_from(len).map_err(|_| CUresult::INVALID_VALUE)?;
        let table = self.read_table();
        let (blocks, _) = table.span(addr, len).ok_or(CUresult::INVALID_VALUE)?;
        if blocks.iter().all(|b| b.allows(write)) {
            Ok(())
        } else {
            Err(CUresult::INVALID_VALUE)
        }
    }

    /// Host bytes to device memory.
    pub fn write_bytes(&self, dst: u64, data: &[u8]) -> Result<(), MemoryFault> {
        if data.is_empty() {
            return Ok(());
        }
        match self.with_block(dst, data.len(), true, |block, offset| {
            block.write(offset, data);
        }) {
            Ok(()) => Ok(()),
            // Across adjacent mappings.
            Err(fault) => {
                for (block, offset, at, n) in self.pieces(dst, data.len(), true).ok_or(fault)? {
                    block.write(offset, &data[at..at + n]);
                }
                Ok(())
            }
        }
    }

    /// Device memory to host bytes.
    pub fn read_bytes(&self, src: u64, out: &mut [u8]) -> Result<(), MemoryFault> {
        if out.is_empty() {
            return Ok(());
        }
        let len = out.len();
        match self.with_block(src, len, false, |block, offset| block.read(offset, out)) {
            Ok(()) => Ok(()),
            Err(fault) => {
                for (block, offset, at, n) in self.pieces(src, len, false).ok_or(fault)? {
                    block.read(offset, &mut out[at..at + n]);
                }
                Ok(())
            }
        }
    }

    /// Device-to-device copy (ranges may overlap: staged through the host in pieces, in the safe order).
    pub fn copy(&self, dst: u64, src: u64, len: u64) -> Result<(), MemoryFault> {
        let n = usize::try_from(len).map_err(|_| MemoryFault {
            addr: src,
            len: usize::MAX,
        })?;
        if n == 0 {
            return Ok(());
        }
        // Both ranges are checked whole before a byte moves.
        self.pieces(src, n, false)
            .ok_or(MemoryFault { addr: src, len: n })?;
        self.pieces(dst, n, true)
            .ok_or(MemoryFault { addr: dst, len: n })?;
        let mut stage = vec![0u8; STAGE.min(n)];
        let pieces: Vec<usize> = (0..n).step_by(STAGE).collect();
        // Copy backwards when the destination starts inside the source, so no byte is read after being
        // overwritten.
        let backwards = dst > src && dst < src + len;
        let order: Box<dyn Iterator<Item = &usize>> = if backwards {
            Box::new(pieces.iter().rev())
        } else {
            Box::new(pieces.iter())
        };
        for &at in order {
            let m = STAGE.min(n - at);
            self.read_bytes(src + at as u64, &mut stage[..m])?;
            self.write_bytes(dst + at as u64, &stage[..m])?;
        }
        Ok(())
    }

    /// `cuMemsetD8/16/32`: `count` copies of `pattern` (1, 2 or 4 bytes) at `dst`, which is aligned to the
    /// pattern (so every piece of a range across mappings starts on a whole pattern).
    pub fn fill(&self, dst: u64, pattern: &[u8], count: u64) -> Result<(), MemoryFault> {
        let bytes = count
            .checked_mul(pattern.len() as u64)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or(MemoryFault {
                addr: dst,
                len: usize::MAX,
            })?;
        if bytes == 0 {
            return Ok(());
        }
        let pieces = self.pieces(dst, bytes, true).ok_or(MemoryFault {
            addr: dst,
            len: bytes,
        })?;
        for (block, offset, _, n) in pieces {
            block.fill(offset, pattern, n / pattern.len());
        }
        Ok(())
    }

    /// The pieces of `[addr, addr + len)`, each `(block, offset in the block, offset in the range,
    /// length)`, if the range is covered back to back by blocks that allow the access.
    fn pieces(&self, addr: u64, len: usize, write: bool) -> Option<Vec<Piece>> {
        let (blocks, first_offset) = self.read_table().span(addr, len)?;
        let mut pieces = Vec::with_capacity(blocks.len());
        let mut at = 0;
        let mut offset = first_offset;
        for block in blocks {
            if !block.allows(write) {
                return None;
            }
            let n = (block.size as usize - offset).min(len - at);
            pieces.push((block, offset, at, n));
            at += n;
            offset = 0;
        }
        Some(pieces)
    }

    /// Runs `f` on the block holding `[addr, addr + len)` and the offset of `addr` in it, if the block
    /// allows the access. The fast path borrows the thread's cached block: no lock, no reference count
    /// traffic shared between threads.
    fn with_block<R>(
        &self,
        addr: u64,
        len: usize,
        write: bool,
        f: impl FnOnce(&Block, usize) -> R,
    ) -> Result<R, MemoryFault> {
        let generation = self.generation.load(Ordering::Acquire);
        let mut f = Some(f);
        let hit = LAST_HIT.with(|last| {
            let last = last.borrow();
            let (id, g, block) = last.as_ref()?;
            if *id != self.id || *g != generation || !block.contains(addr, len) {
                return None;
            }
            if !block.allows(write) {
                return None;
            }
            let f = f.take()?;
            Some(f(block, (addr - block.base) as usize))
        });
        if let Some(r) = hit {
            return Ok(r);
        }
        let (block, offset) = self.lookup(addr, len, write)?;
        let f = f.ok_or(MemoryFault { addr, len })?;
        Ok(f(&block, offset))
    }

    /// The block holding `[addr, addr + len)` and the offset of `addr` in it, if it allows the access
    /// (slow path; caches the block).
    fn lookup(
        &self,
        addr: u64,
        len: usize,
        write: bool,
    ) -> Result<(Arc<Block>, usize), MemoryFault> {
        let fault = MemoryFault { addr, len };
        let generation = self.generation.load(Ordering::Acquire);
        let block = self.read_table().find(addr).cloned().ok_or(fault)?;
        if !block.contains(addr, len) || !block.allows(write) {
            return Err(fault);
        }
        LAST_HIT.with(|last| {
            *last.borrow_mut() = Some((self.id, generation, block.clone()));
        });
        let offset = (addr - block.base) as usize;
        Ok((block, offset))
    }

    fn read_table(&self) -> std::sync::RwLockReadGuard<'_, Table> {
        // A panic while holding the lock cannot leave the table inconsistent in a way that matters more
        // than losing the session, so a poisoned lock is used as is.
        self.table
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write_table(&self) -> std::sync::RwLockWriteGuard<'_, Table> {
        self.table
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Drops this thread's cached block (called after each stream job and on free), so that no idle thread
/// keeps freed host memory alive.
pub fn clear_thread_cache() {
    let _ = LAST_HIT.try_with(|last| last.borrow_mut().take());
}

impl GlobalMemory for DeviceMemory {
    fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemoryFault> {
        self.read_bytes(addr, out)
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<(), MemoryFault> {
        self.write_bytes(addr, data)
    }

    fn atomic(
        &self,
        addr: u64,
        size: usize,
        op: &mut dyn FnMut(u64) -> u64,
    ) -> Result<u64, MemoryFault> {
        let fault = MemoryFault { addr, len: size };
        if !(size == 4 || size == 8) || !addr.is_multiple_of(size as u64) {
            return Err(fault);
        }
        self.with_block(addr, size, true, |block, offset| {
            block.atomic(offset, size, op)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_word_writes_and_reads() {
        let mem = DeviceMemory::new(1 << 20);
        let p = mem.alloc(37, 0, 1).unwrap();
        assert_eq!(p % ALLOC_ALIGN, 0);
        let data: Vec<u8> = (0..37).collect();
        mem.write_bytes(p, &data).unwrap();
        let mut back = vec![0u8; 35];
        mem.read_bytes(p + 1, &mut back).unwrap();
        assert_eq!(back, data[1..36]);
        assert!(mem.read_bytes(p + 30, &mut [0u8; 8]).is_err());
    }

    #[test]
    fn atomics_on_halves_of_a_word() {
        let mem = DeviceMemory::new(1 << 20);
        let p = mem.alloc(16, 0, 1).unwrap();
        mem.atomic(p + 4, 4, &mut |v| v + 7).unwrap();
        mem.atomic(p, 4, &mut |v| v + 1).unwrap();
        let old = mem.atomic(p + 4, 4, &mut |v| v * 2).unwrap();
        assert_eq!(old, 7);
        let mut b = [0u8; 8];
        mem.read_bytes(p, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b[0..4].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 14);
        assert!(mem.atomic(p + 2, 4, &mut |v| v).is_err());
    }

    #[test]
    fn freed_blocks_are_not_reachable_through_the_cache() {
        let mem = Arc::new(DeviceMemory::new(1 << 20));
        let p = mem.alloc(64, 0, 1).unwrap();
        mem.write_bytes(p, &[1; 8]).unwrap(); // cached on this thread
        let other = mem.clone();
        // Freed on another thread: this thread's cache entry is stale, never trusted.
        std::thread::spawn(move || other.free(p).unwrap())
            .join()
            .unwrap();
        assert_eq!(
            mem.read_bytes(p, &mut [0; 8]),
            Err(MemoryFault { addr: p, len: 8 })
        );
        assert!(mem.atomic(p, 4, &mut |v| v).is_err());
    }

    #[test]
    fn freed_ranges_coalesce_and_are_reused() {
        let mem = DeviceMemory::new(1 << 20);
        let a = mem.alloc(1000, 0, 1).unwrap();
        let b = mem.alloc(1000, 0, 1).unwrap();
        assert!(b >= a + 1000);
        mem.free(a).unwrap();
        mem.free(b).unwrap();
        assert_eq!(mem.read_table().free.len(), 1);
        assert_eq!(mem.alloc(1000, 0, 1).unwrap(), a);
    }
}
