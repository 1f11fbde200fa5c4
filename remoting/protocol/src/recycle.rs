//! Large bulk buffers are reused: a piece of a copy (4-8 MiB) is written into memory a previous one
//! freed, not into fresh pages. The serving side's replies (device-to-host data) and the client's
//! requests (host-to-device data) each have a pool.
//!
//! Writing a fresh 4 MiB buffer costs a page fault (and the kernel's zeroing) per page: 2.9-3.0 ms per
//! piece on the development machine, against 0.26 ms into memory already mapped, and the allocator
//! gives freed memory of that size back to the kernel. A piece's bytes live on after they were written
//! (kept for resending until the other side acknowledges them, and in quinn until sent), so a buffer
//! comes back when its last [`Bytes`] goes: [`Recycler::bytes`] hands them out with an owner that
//! returns the buffer to the pool, [`Recycler::buffer`] takes one.

use std::sync::{Mutex, PoisonError};

use bytes::Bytes;

/// Buffers of at least this many bytes are reused.
pub const RECYCLE_FROM: usize = 1 << 20;

/// A pool of large byte buffers.
#[derive(Debug)]
pub struct Recycler {
    free: Mutex<Vec<Vec<u8>>>,
    keep: usize,
    largest: usize,
}

impl Recycler {
    /// A pool keeping up to `keep` buffers, each of at most `largest` bytes (a larger one, such as a
    /// module image's, is freed when it comes back).
    pub const fn new(keep: usize, largest: usize) -> Self {
        Self {
            free: Mutex::new(Vec::new()),
            keep,
            largest,
        }
    }

    /// An empty buffer with room for `len` bytes: a returned one where one is large enough.
    pub fn buffer(&self, len: usize) -> Vec<u8> {
        if len >= RECYCLE_FROM {
            let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
            let fits = (0..free.len())
                .filter(|&i| free[i].capacity() >= len)
                .min_by_key(|&i| free[i].capacity());
            if let Some(i) = fits {
                let mut buf = free.swap_remove(i);
                buf.clear();
                return buf;
            }
        }
        Vec::with_capacity(len)
    }

    /// `bytes` as [`Bytes`]; a large buffer comes back to this pool when the last of them goes.
    pub fn bytes(&'static self, bytes: Vec<u8>) -> Bytes {
        if !(RECYCLE_FROM..=self.largest).contains(&bytes.capacity()) {
            return Bytes::from(bytes);
        }
        Bytes::from_owner(Returned {
            buf: bytes,
            to: self,
        })
    }

    fn give_back(&self, buf: Vec<u8>) {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        if free.len() < self.keep {
            free.push(buf);
        }
    }
}

/// A buffer on loan as [`Bytes`], returned when dropped.
struct Returned {
    buf: Vec<u8>,
    to: &'static Recycler,
}

impl AsRef<[u8]> for Returned {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Returned {
    fn drop(&mut self) {
        self.to.give_back(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_buffer_comes_back_when_its_last_bytes_go_and_is_handed_out_again() {
        static POOL: Recycler = Recycler::new(2, usize::MAX);
        let mut buf = POOL.buffer(RECYCLE_FROM);
        buf.extend_from_slice(&vec![7; RECYCLE_FROM]);
        let at = buf.as_ptr();
        let bytes = POOL.bytes(buf);
        let part = bytes.slice(10..20);
        drop(bytes);
        // Still lent out: a slice holds it.
        let other = POOL.buffer(RECYCLE_FROM);
        assert_ne!(other.as_ptr(), at);
        drop(other);
        assert_eq!(&part[..], &[7; 10]);
        drop(part);
        let again = POOL.buffer(RECYCLE_FROM);
        assert_eq!(again.as_ptr(), at);
        assert!(again.is_empty());
        // Small ones are neither kept nor taken from the pool.
        let small = POOL.bytes(vec![1; 100]);
        drop(small);
        assert!(POOL.free.lock().unwrap().is_empty());
    }

    #[test]
    fn the_pool_keeps_only_so_many() {
        static POOL: Recycler = Recycler::new(2, usize::MAX);
        let lent: Vec<Bytes> = (0..3)
            .map(|_| POOL.bytes(Vec::with_capacity(RECYCLE_FROM)))
            .collect();
        drop(lent);
        assert_eq!(POOL.free.lock().unwrap().len(), 2);
    }

    #[test]
    fn a_buffer_past_the_largest_kept_is_freed() {
        static POOL: Recycler = Recycler::new(2, 2 * RECYCLE_FROM);
        drop(POOL.bytes(Vec::with_capacity(4 * RECYCLE_FROM)));
        assert!(POOL.free.lock().unwrap().is_empty());
        drop(POOL.bytes(Vec::with_capacity(2 * RECYCLE_FROM)));
        assert_eq!(POOL.free.lock().unwrap().len(), 1);
    }
}
