//! [`FlatMemory`]: a simple [`GlobalMemory`] for tests and tools. Allocations live in one arena of 64-bit
//! atomic words, so concurrent blocks read, write and run atomics without locks; accesses outside every
//! allocation fault like on a GPU.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::{GlobalMemory, MemoryFault};

/// Device addresses handed out by [`FlatMemory`] start here (non-zero, like real device pointers).
pub const FLAT_BASE: u64 = 0x7_0000_0000;
/// Unallocated gap between allocations so that small overruns fault.
const GAP: u64 = 256;

#[derive(Debug)]
pub struct FlatMemory {
    words: Vec<AtomicU64>,
    /// `(start, end)` device addresses of each allocation, sorted.
    allocs: Vec<(u64, u64)>,
    top: u64,
}

impl FlatMemory {
    /// An arena of `capacity` bytes (allocations plus their gaps must fit).
    pub fn new(capacity: usize) -> FlatMemory {
        let words = (0..capacity.div_ceil(8))
            .map(|_| AtomicU64::new(0))
            .collect();
        FlatMemory {
            words,
            allocs: Vec::new(),
            top: FLAT_BASE + GAP,
        }
    }

    /// Allocates `size` zeroed bytes aligned to 256; `None` when the arena is full.
    pub fn alloc(&mut self, size: usize) -> Option<u64> {
        let start = self.top.div_ceil(256) * 256;
        let end = start.checked_add(size as u64)?;
        if end - FLAT_BASE > self.words.len() as u64 * 8 {
            return None;
        }
        self.allocs.push((start, end));
        self.top = end + GAP;
        Some(start)
    }

    fn check(&self, addr: u64, len: usize) -> Result<(), MemoryFault> {
        let fault = MemoryFault { addr, len };
        let end = addr.checked_add(len as u64).ok_or(fault)?;
        let i = self.allocs.partition_point(|&(s, _)| s <= addr);
        match i.checked_sub(1).map(|i| self.allocs[i]) {
            Some((_, e)) if end <= e => Ok(()),
            _ => Err(fault),
        }
    }

    fn byte_index(addr: u64) -> usize {
        (addr - FLAT_BASE) as usize
    }

    fn word(&self, byte: usize) -> &AtomicU64 {
        &self.words[byte / 8]
    }
}

impl GlobalMemory for FlatMemory {
    fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemoryFault> {
        self.check(addr, out.len())?;
        let mut b = Self::byte_index(addr);
        let mut i = 0;
        while i < out.len() {
            let w = self.word(b).load(Ordering::Relaxed).to_le_bytes();
            let o = b % 8;
            let n = (8 - o).min(out.len() - i);
            out[i..i + n].copy_from_slice(&w[o..o + n]);
            i += n;
            b += n;
        }
        Ok(())
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<(), MemoryFault> {
        self.check(addr, data.len())?;
        let mut b = Self::byte_index(addr);
        let mut i = 0;
        while i < data.len() {
            let o = b % 8;
            let n = (8 - o).min(data.len() - i);
            let word = self.word(b);
            if n == 8 {
                let mut w = [0u8; 8];
                w.copy_from_slice(&data[i..i + 8]);
                word.store(u64::from_le_bytes(w), Ordering::Relaxed);
            } else {
                let chunk = &data[i..i + n];
                // Partial word: merge so that neighbouring bytes written by other threads survive.
                let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                    let mut w = old.to_le_bytes();
                    w[o..o + n].copy_from_slice(chunk);
                    Some(u64::from_le_bytes(w))
                });
            }
            i += n;
            b += n;
        }
        Ok(())
    }

    fn atomic(
        &self,
        addr: u64,
        size: usize,
        op: &mut dyn FnMut(u64) -> u64,
    ) -> Result<u64, MemoryFault> {
        self.check(addr, size)?;
        if !(size == 4 || size == 8) || !addr.is_multiple_of(size as u64) {
            return Err(MemoryFault { addr, len: size });
        }
        let b = Self::byte_index(addr);
        let word = self.word(b);
        let shift = (b % 8) * 8;
        let mask = if size == 8 {
            u64::MAX
        } else {
            0xffff_ffffu64 << shift
        };
        let mut old_val = 0;
        let _ = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            let old = (w & mask) >> shift;
            old_val = old;
            let new = (op(old) << shift) & mask;
            Some((w & !mask) | new)
        });
        Ok(old_val)
    }
}
