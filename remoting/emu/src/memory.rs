//! Device memory: a fake device address range backed by host memory.
//!
//! [`DeviceMemory`] hands out 256-byte-aligned addresses from [`VA_BASE`] up (first fit over a free-range
//! list, so freed ranges are reused but never while live), caps the total at the configured size, and
//! implements [`gleam_ptx::GlobalMemory`] for the interpreter. Each allocation is a slice of `AtomicU64`
//! words: kernels on several streams (and the blocks of one kernel, which run on several OS threads) may
//! touch the same memory at once, as on a GPU, and word-sized atomics make that well defined in Rust
//! without locks. Partial-word writes merge their bytes with a compare-and-swap, so byte stores by
//! different threads into one word never lose each other's bytes.

use std::alloc::Layout;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use gleam_protocol::types::CUresult;
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

/// One live allocation.
struct Block {
    base: u64,
    /// Requested size in bytes (accesses beyond it fault).
    size: u64,
    /// Bytes reserved in the address range (size rounded up, plus the guard).
    reserved: u64,
    /// The context that allocated it (freed with the context).
    ctx: u64,
    words: Box<[AtomicU64]>,
}

impl Block {
    fn contains(&self, addr: u64, len: usize) -> bool {
        addr >= self.base
            && addr
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.base + self.size)
    }

    fn read(&self, offset: usize, out: &mut [u8]) {
        let mut done = 0;
        while done < out.len() {
            let pos = offset + done;
            let (word, byte) = (pos / 8, pos % 8);
            let n = (8 - byte).min(out.len() - done);
            let bytes = self.words[word].load(Ordering::Relaxed).to_le_bytes();
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
                self.words[word].store(u64::from_le_bytes(b), Ordering::Relaxed);
            } else {
                // Merge the bytes into the word atomically: a neighbour's concurrent byte store survives.
                let merge = |old: u64| {
                    let mut b = old.to_le_bytes();
                    b[byte..byte + n].copy_from_slice(part);
                    Some(u64::from_le_bytes(b))
                };
                let _ = self.words[word].fetch_update(Ordering::Relaxed, Ordering::Relaxed, merge);
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
        let word = &self.words[offset / 8];
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

#[derive(Default)]
struct Table {
    live: BTreeMap<u64, Arc<Block>>,
    /// Free ranges of the address space: start -> length, coalesced.
    free: BTreeMap<u64, u64>,
    /// Bytes counted against the capacity (sizes rounded up to [`ALLOC_ALIGN`]).
    used: u64,
}

impl Table {
    fn find(&self, addr: u64) -> Option<&Arc<Block>> {
        self.live
            .range(..=addr)
            .next_back()
            .map(|(_, b)| b)
            .filter(|b| addr < b.base + b.size.max(1))
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
        let (start, len, base) = table
            .free
            .iter()
            .find_map(|(&start, &len)| {
                let base = start.checked_next_multiple_of(align)?;
                let end = base.checked_add(reserved)?;
                (end <= start + len).then_some((start, len, base))
            })
            .ok_or(CUresult::OUT_OF_MEMORY)?;
        let words = zeroed_words(words).ok_or(CUresult::OUT_OF_MEMORY)?;
        table.free.remove(&start);
        if base > start {
            table.free.insert(start, base - start);
        }
        if base + reserved < start + len {
            table
                .free
                .insert(base + reserved, start + len - base - reserved);
        }
        table.used += charged;
        let block = Arc::new(Block {
            base,
            size,
            reserved,
            ctx,
            words,
        });
        table.live.insert(base, block);
        Ok(base)
    }

    /// Frees the allocation starting exactly at `ptr`.
    pub fn free(&self, ptr: u64) -> Result<(), CUresult> {
        let mut table = self.write_table();
        let block = table.live.remove(&ptr).ok_or(CUresult::INVALID_VALUE)?;
        self.forget(&mut table, &block);
        Ok(())
    }

    /// Frees every allocation of context `ctx` (`None`: all of them).
    pub fn free_all(&self, ctx: Option<u64>) {
        let mut table = self.write_table();
        let doomed: Vec<u64> = table
            .live
            .values()
            .filter(|b| ctx.is_none_or(|c| b.ctx == c))
            .map(|b| b.base)
            .collect();
        for base in doomed {
            if let Some(block) = table.live.remove(&base) {
                self.forget(&mut table, &block);
            }
        }
    }

    fn forget(&self, table: &mut Table, block: &Block) {
        clear_thread_cache();
        table.used -= block.size.next_multiple_of(ALLOC_ALIGN);
        table.release_range(block.base, block.reserved);
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// Number of live allocations.
    pub fn live_allocations(&self) -> usize {
        self.read_table().live.len()
    }

    /// `cuMemGetAddressRange`: the base and size of the allocation containing `ptr`.
    pub fn address_range(&self, ptr: u64) -> Option<(u64, u64)> {
        self.read_table().find(ptr).map(|b| (b.base, b.size))
    }

    /// Whether `[addr, addr + len)` lies inside one allocation.
    pub fn check(&self, addr: u64, len: u64) -> Result<(), CUresult> {
        let len = usize::try_from(len).map_err(|_| CUresult::INVALID_VALUE)?;
        self.lookup(addr, len)
            .map(|_| ())
            .map_err(|_| CUresult::INVALID_VALUE)
    }

    /// Host bytes to device memory.
    pub fn write_bytes(&self, dst: u64, data: &[u8]) -> Result<(), MemoryFault> {
        if data.is_empty() {
            return Ok(());
        }
        self.with_block(dst, data.len(), |block, offset| block.write(offset, data))
    }

    /// Device memory to host bytes.
    pub fn read_bytes(&self, src: u64, out: &mut [u8]) -> Result<(), MemoryFault> {
        if out.is_empty() {
            return Ok(());
        }
        self.with_block(src, out.len(), |block, offset| block.read(offset, out))
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
        let (sblock, soff) = self.lookup(src, n)?;
        let (dblock, doff) = self.lookup(dst, n)?;
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
            sblock.read(soff + at, &mut stage[..m]);
            dblock.write(doff + at, &stage[..m]);
        }
        Ok(())
    }

    /// `cuMemsetD8/16/32`: `count` copies of `pattern` (1, 2 or 4 bytes) at `dst`.
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
        let (block, offset) = self.lookup(dst, bytes)?;
        block.fill(offset, pattern, bytes / pattern.len());
        Ok(())
    }

    /// Runs `f` on the block holding `[addr, addr + len)` and the offset of `addr` in it. The fast path
    /// borrows the thread's cached block: no lock, no reference count traffic shared between threads.
    fn with_block<R>(
        &self,
        addr: u64,
        len: usize,
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
            let f = f.take()?;
            Some(f(block, (addr - block.base) as usize))
        });
        if let Some(r) = hit {
            return Ok(r);
        }
        let (block, offset) = self.lookup(addr, len)?;
        let f = f.ok_or(MemoryFault { addr, len })?;
        Ok(f(&block, offset))
    }

    /// The block holding `[addr, addr + len)` and the offset of `addr` in it (slow path; caches the block).
    fn lookup(&self, addr: u64, len: usize) -> Result<(Arc<Block>, usize), MemoryFault> {
        let fault = MemoryFault { addr, len };
        let generation = self.generation.load(Ordering::Acquire);
        let block = self.read_table().find(addr).cloned().ok_or(fault)?;
        if !block.contains(addr, len) {
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
        self.with_block(addr, size, |block, offset| block.atomic(offset, size, op))
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
