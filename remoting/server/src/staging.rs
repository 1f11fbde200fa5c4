//! Staging memory for uploads: page-aligned host buffers that the backend may page-lock, so that the
//! copy to the device runs at the bus's rate rather than through the driver's own pageable-memory staging
//! (which copies every byte once more, on the executor).
//!
//! [`StagingBuf`] is a zero-initialised, page-aligned byte buffer of a fixed capacity whose length may
//! change within it; [`HostPin`] is the backend's page-locking of one, undone when the buffer is dropped
//! (before its memory is freed).

use std::ops::{Deref, DerefMut};

use memmap2::MmapMut;

/// Host pages: buffers start on one and span whole ones (what page-locking works in).
pub const PAGE: usize = 4096;

/// A page-locking of host memory by the backend, undone when dropped.
pub struct HostPin(Option<Box<dyn FnOnce() + Send + Sync>>);

impl HostPin {
    /// A pin that `unpin` undoes.
    pub fn new(unpin: impl FnOnce() + Send + Sync + 'static) -> Self {
        Self(Some(Box::new(unpin)))
    }
}

impl Drop for HostPin {
    fn drop(&mut self) {
        if let Some(unpin) = self.0.take() {
            unpin();
        }
    }
}

impl std::fmt::Debug for HostPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostPin")
    }
}

/// A page-aligned, zero-initialised byte buffer, optionally page-locked. The default is empty.
///
/// An anonymous mapping, not a heap allocation: its pages are zeroed by the kernel as they are first
/// touched (by whichever thread fills them), where an over-aligned `alloc_zeroed` writes every byte
/// at once on the allocating thread (~40 ms for 64 MiB on the session's executor).
#[derive(Default)]
pub struct StagingBuf {
    /// `None` for the empty buffer.
    map: Option<MmapMut>,
    len: usize,
    /// Dropped before the mapping is.
    pin: Option<HostPin>,
}

impl StagingBuf {
    /// `len` zero bytes (capacity rounded up to whole pages).
    ///
    /// # Panics
    /// If the memory cannot be mapped (as `vec![0; len]` would abort when it cannot be allocated).
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return Self::default();
        }
        let capacity = len.div_ceil(PAGE) * PAGE;
        let map = MmapMut::map_anon(capacity)
            .unwrap_or_else(|err| panic!("cannot map {capacity} bytes of staging memory: {err}"));
        Self {
            map: Some(map),
            len,
            pin: None,
        }
    }

    /// The bytes it can hold without a new allocation.
    pub fn capacity(&self) -> usize {
        self.map.as_ref().map_or(0, |map| map.len())
    }

    /// Sets the length to `len` (at most the capacity: `false`, and nothing changes, if it is more).
    /// Bytes past the old length keep whatever they held: callers overwrite every byte before use.
    pub fn set_len(&mut self, len: usize) -> bool {
        if len > self.capacity() {
            return false;
        }
        self.len = len;
        true
    }

    /// The whole capacity (page-aligned, whole pages), for page-locking.
    pub fn pages_mut(&mut self) -> &mut [u8] {
        self.map.as_deref_mut().unwrap_or_default()
    }

    /// Keeps `pin` (the backend's page-locking of [`StagingBuf::pages_mut`]) until the buffer is dropped.
    pub fn set_pin(&mut self, pin: HostPin) {
        self.pin = Some(pin);
    }

    /// Whether the backend page-locked it.
    pub fn is_pinned(&self) -> bool {
        self.pin.is_some()
    }
}

impl Deref for StagingBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.map.as_deref().map_or(&[], |map| &map[..self.len])
    }
}

impl DerefMut for StagingBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        self.map
            .as_deref_mut()
            .map_or(&mut [], |map| &mut map[..len])
    }
}

impl Drop for StagingBuf {
    fn drop(&mut self) {
        // Unlocked before it is unmapped.
        drop(self.pin.take());
    }
}

impl std::fmt::Debug for StagingBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("pinned", &self.is_pinned())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn a_buffer_is_zeroed_aligned_and_resizable_within_its_pages() {
        let mut buf = StagingBuf::zeroed(10_000);
        assert_eq!(buf.len(), 10_000);
        assert_eq!(buf.capacity(), 3 * PAGE);
        assert!(buf.iter().all(|&b| b == 0));
        assert_eq!(buf.pages_mut().as_ptr() as usize % PAGE, 0);
        buf[9_999] = 7;
        assert!(buf.set_len(3 * PAGE));
        assert_eq!(buf[9_999], 7);
        assert!(!buf.set_len(3 * PAGE + 1));
        assert_eq!(buf.len(), 3 * PAGE);
        assert!(StagingBuf::default().is_empty());
        assert!(StagingBuf::zeroed(0).is_empty());
    }

    #[test]
    fn the_pin_is_undone_when_the_buffer_goes() {
        let undone = Arc::new(AtomicBool::new(false));
        let mut buf = StagingBuf::zeroed(PAGE);
        let flag = undone.clone();
        buf.set_pin(HostPin::new(move || flag.store(true, Ordering::SeqCst)));
        assert!(buf.is_pinned());
        drop(buf);
        assert!(undone.load(Ordering::SeqCst));
    }
}
