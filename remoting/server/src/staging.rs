//! Staging memory for uploads: page-aligned host buffers that the backend may page-lock, so that the
//! copy to the device runs at the bus's rate rather than through the driver's own pageable-memory staging
//! (which copies every byte once more, on the executor).
//!
//! [`StagingBuf`] is a zero-initialised, page-aligned byte buffer of a fixed capacity whose length may
//! change within it; [`HostPin`] is the backend's page-locking of one, undone when the buffer is dropped
//! (before its memory is freed).

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Host pages: buffers start on one and span whole ones (what page-locking works in).
pub const PAGE: usize = 4096;

/// A page-locking of host memory by the backend, undone when dropped.
pub struct HostPin(Option<Box<dyn FnOnce() + Send>>);

impl HostPin {
    /// A pin that `unpin` undoes.
    pub fn new(unpin: impl FnOnce() + Send + 'static) -> Self {
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

/// A page-aligned, zero-initialised byte buffer (pages are zeroed lazily, by the kernel, as they are
/// first written), optionally page-locked. The default is empty.
#[derive(Default)]
pub struct StagingBuf {
    /// `None` for the empty buffer.
    ptr: Option<NonNull<u8>>,
    len: usize,
    capacity: usize,
    /// Dropped before the memory is freed.
    pin: Option<HostPin>,
}

// SAFETY: the buffer owns its memory exclusively, like a `Vec<u8>`; the pin's undo is `Send`.
unsafe impl Send for StagingBuf {}
// SAFETY: shared access only reads the bytes.
unsafe impl Sync for StagingBuf {}

impl StagingBuf {
    /// `len` zero bytes (capacity rounded up to whole pages).
    ///
    /// # Panics
    /// If the allocation fails (as `vec![0; len]` would).
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return Self::default();
        }
        let capacity = len.div_ceil(PAGE) * PAGE;
        let layout = Self::layout(capacity);
        // SAFETY: a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })
            .unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self {
            ptr: Some(ptr),
            len,
            capacity,
            pin: None,
        }
    }

    fn layout(capacity: usize) -> Layout {
        Layout::from_size_align(capacity, PAGE).expect("a staging buffer's size fits a layout")
    }

    /// The bytes it can hold without a new allocation.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the length to `len` (at most the capacity: `false`, and nothing changes, if it is more).
    /// Bytes past the old length keep whatever they held: callers overwrite every byte before use.
    pub fn set_len(&mut self, len: usize) -> bool {
        if len > self.capacity {
            return false;
        }
        self.len = len;
        true
    }

    /// The whole capacity (page-aligned, whole pages), for page-locking.
    pub fn pages_mut(&mut self) -> &mut [u8] {
        match self.ptr {
            // SAFETY: `capacity` bytes, allocated and zeroed by `zeroed`, owned by `self`.
            Some(ptr) => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), self.capacity) },
            None => &mut [],
        }
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
        match self.ptr {
            // SAFETY: `len <= capacity` bytes, allocated and initialised, owned by `self`.
            Some(ptr) => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), self.len) },
            None => &[],
        }
    }
}

impl DerefMut for StagingBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self.ptr {
            // SAFETY: as in `deref`, and `&mut self` is exclusive.
            Some(ptr) => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), self.len) },
            None => &mut [],
        }
    }
}

impl Drop for StagingBuf {
    fn drop(&mut self) {
        // Unlocked before it is freed.
        drop(self.pin.take());
        if let Some(ptr) = self.ptr.take() {
            // SAFETY: allocated by `zeroed` with this layout.
            unsafe { dealloc(ptr.as_ptr(), Self::layout(self.capacity)) };
        }
    }
}

impl std::fmt::Debug for StagingBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity)
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
