//! Buffers for the bulk bytes of requests, reused across requests.
//!
//! A large copy's bytes are copied once on this side, out of the caller's buffer (which the caller may
//! reuse as soon as the call returns) into a buffer that stays with the request until the serving side
//! acknowledges it (it is sent again after a resume). A fresh buffer for each 4-8 MiB piece costs a page
//! fault per page on that copy, which made it several times slower than the copy itself (7 ms per
//! 8 MiB on the H200 host): [`BulkPool`] hands out buffers that were used before, their pages resident.

use std::sync::{Mutex, OnceLock};

use bytes::Bytes;

/// Bulk parts from this size on get a buffer of their own ([`BulkPool::copy`]); smaller ones are
/// copied into their lane's batch with the frames around them.
pub(crate) const OWN_BUFFER_FROM: usize = 64 << 10;

/// Idle bytes the pool keeps at most: what a lane's upload has in flight at about 1 GB/s between the
/// copy and the serving side's acknowledgement, with room to spare. Beyond it, buffers are freed.
const IDLE_LIMIT: usize = 64 << 20;

/// Free buffers, by capacity.
#[derive(Debug, Default)]
pub(crate) struct BulkPool {
    free: Mutex<Idle>,
}

#[derive(Debug, Default)]
struct Idle {
    buffers: Vec<Vec<u8>>,
    bytes: usize,
}

impl BulkPool {
    /// The process's pool.
    pub fn global() -> &'static BulkPool {
        static POOL: OnceLock<BulkPool> = OnceLock::new();
        POOL.get_or_init(BulkPool::default)
    }

    /// `part` copied into a buffer of the pool, which goes back to the pool once every view of it is
    /// dropped.
    pub fn copy(&'static self, part: &[u8]) -> Bytes {
        let mut buf = self.take(part.len());
        buf.extend_from_slice(part);
        Bytes::from_owner(Pooled { buf, pool: self })
    }

    /// An empty buffer with room for `len` bytes: a free one of at least that capacity (and not more
    /// than twice it, so that small parts do not hold large buffers), else a new one.
    fn take(&self, len: usize) -> Vec<u8> {
        let mut idle = lock(&self.free);
        let fits = idle
            .buffers
            .iter()
            .position(|b| b.capacity() >= len && b.capacity() / 2 <= len);
        match fits {
            Some(i) => {
                let buf = idle.buffers.swap_remove(i);
                idle.bytes -= buf.capacity();
                buf
            }
            None => Vec::with_capacity(len),
        }
    }

    /// Takes `buf` back, unless the pool holds enough already.
    fn give(&self, mut buf: Vec<u8>) {
        let mut idle = lock(&self.free);
        if idle.bytes + buf.capacity() > IDLE_LIMIT {
            return;
        }
        buf.clear();
        idle.bytes += buf.capacity();
        idle.buffers.push(buf);
    }

    /// Idle bytes held (for tests).
    #[cfg(test)]
    fn idle_bytes(&self) -> usize {
        lock(&self.free).bytes
    }
}

/// A buffer lent out by a [`BulkPool`]: the owner of a [`Bytes`] view of it.
struct Pooled {
    buf: Vec<u8>,
    pool: &'static BulkPool,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_and_are_reused() {
        let pool: &'static BulkPool = Box::leak(Box::default());
        let a = pool.copy(&[7; 100_000]);
        assert_eq!(&a[..], &[7; 100_000][..]);
        let at = a.as_ptr();
        let view = a.slice(10..20);
        drop(a);
        // A view keeps the buffer lent out.
        assert_eq!(pool.idle_bytes(), 0);
        drop(view);
        assert!(pool.idle_bytes() >= 100_000);
        // The same buffer serves the next part of a fitting size, with only the new bytes.
        let b = pool.copy(&[1; 90_000]);
        assert_eq!(b.as_ptr(), at);
        assert_eq!(&b[..], &[1; 90_000][..]);
        // A part far smaller than every idle buffer gets a new one.
        drop(b);
        let c = pool.copy(&[2; 1000]);
        assert_ne!(c.as_ptr(), at);
    }

    #[test]
    fn the_pool_keeps_at_most_its_limit() {
        let pool: &'static BulkPool = Box::leak(Box::default());
        let parts: Vec<Bytes> = (0..10).map(|_| pool.copy(&vec![0; 16 << 20])).collect();
        drop(parts);
        assert!(pool.idle_bytes() <= IDLE_LIMIT);
        assert!(pool.idle_bytes() >= IDLE_LIMIT - (16 << 20));
    }
}
