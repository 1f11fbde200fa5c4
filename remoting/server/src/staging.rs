//! Staging memory for uploads: page-aligned host buffers that the backend may page-lock, so that the
//! copy to the device runs at the bus's rate rather than through the driver's own pageable-memory staging
//! (which copies every byte once more, on the executor).
//!
//! [`StagingBuf`] is a zero-initialised, page-aligned byte buffer of a fixed capacity whose length may
//! change within it; [`HostPin`] is the backend's page-locking of one, undone when the buffer is dropped
//! (before its memory is freed); [`DeviceRead`] is a copy from it that the device may still be running
//! (a stream's copy from page-locked memory returns at once): the buffer's bytes are not written again,
//! nor its memory freed, before it ran.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use memmap2::MmapMut;

/// Host pages: buffers start on one and span whole ones (what page-locking works in).
pub const PAGE: usize = 4096;

/// A transparent huge page (x86-64, aarch64 with 4 KiB pages).
const HUGE_PAGE: usize = 2 << 20;

/// Whether staging buffers ask for transparent huge pages (`GLEAM_STAGING_HUGE_PAGES=off`: never; read
/// once). A fresh 64 MiB buffer is 16,384 small pages, each faulted in as the filler first writes it and
/// each page-locked after: with huge pages, 32 of each. Kernels whose setting is `madvise` (a common
/// default) give them only to mappings that ask.
fn huge_pages() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        !std::env::var("GLEAM_STAGING_HUGE_PAGES")
            .is_ok_and(|v| gleam_protocol::tuning::turned_off(&v))
    })
}

/// Work that runs once, when dropped: what [`HostPin`] and [`DeviceRead`] are made of.
struct OnDrop(Option<Box<dyn FnOnce() + Send + Sync>>);

impl OnDrop {
    fn new(work: impl FnOnce() + Send + Sync + 'static) -> Self {
        Self(Some(Box::new(work)))
    }
}

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(work) = self.0.take() {
            work();
        }
    }
}

/// A page-locking of host memory by the backend, undone when dropped.
pub struct HostPin {
    _unpin: OnDrop,
}

impl HostPin {
    /// A pin that `unpin` undoes.
    pub fn new(unpin: impl FnOnce() + Send + Sync + 'static) -> Self {
        Self {
            _unpin: OnDrop::new(unpin),
        }
    }
}

impl std::fmt::Debug for HostPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostPin")
    }
}

/// Page-locks host pages from any of the session's threads (the backend's, made on the executor for the
/// context current there): lets a filler thread lock a staging buffer it has just filled from the content
/// cache, so that the executor does not spend the milliseconds (1-9 ms per 64 MiB measured on the H100)
/// when it copies.
pub type PinAnywhere = Arc<dyn Fn(&mut [u8]) -> Option<HostPin> + Send + Sync>;

/// The device's pending read of a buffer (a stream-ordered copy from page-locked memory): dropping it
/// waits until the device has run it.
pub struct DeviceRead {
    _wait: OnDrop,
}

impl DeviceRead {
    /// A read that `wait` waits for.
    pub fn new(wait: impl FnOnce() + Send + Sync + 'static) -> Self {
        Self {
            _wait: OnDrop::new(wait),
        }
    }
}

impl std::fmt::Debug for DeviceRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceRead")
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
    /// Waited for before the bytes are written again, the pin undone or the mapping dropped.
    reading: Option<DeviceRead>,
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
        #[cfg(target_os = "linux")]
        if capacity >= HUGE_PAGE && huge_pages() {
            // Best effort: a kernel without transparent huge pages keeps small ones.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        Self {
            map: Some(map),
            len,
            pin: None,
            reading: None,
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
        self.settle();
        self.map.as_deref_mut().unwrap_or_default()
    }

    /// Keeps `read` (a copy from this buffer the device may still be running) until the buffer is
    /// written again or dropped, which wait for it.
    pub fn set_reading(&mut self, read: DeviceRead) {
        self.settle();
        self.reading = Some(read);
    }

    /// Waits until the device has run every copy from this buffer ([`StagingBuf::set_reading`]).
    pub fn settle(&mut self) {
        drop(self.reading.take());
    }

    /// Whether a copy from it may still be running.
    pub fn is_being_read(&self) -> bool {
        self.reading.is_some()
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
        // Not written while the device reads it (the pool's owner settles it first; this is the net).
        self.settle();
        let len = self.len;
        self.map
            .as_deref_mut()
            .map_or(&mut [], |map| &mut map[..len])
    }
}

impl Drop for StagingBuf {
    fn drop(&mut self) {
        // The device is done with it, then it is unlocked, then unmapped.
        self.settle();
        drop(self.pin.take());
    }
}

impl std::fmt::Debug for StagingBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("pinned", &self.is_pinned())
            .field("being_read", &self.is_being_read())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
    fn a_pending_device_read_is_waited_for_before_a_write_and_before_the_pin_goes() {
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut buf = StagingBuf::zeroed(PAGE);
        let log = |what: &'static str| {
            let order = order.clone();
            move || order.lock().unwrap().push(what)
        };
        buf.set_pin(HostPin::new(log("unpinned")));
        buf.set_reading(DeviceRead::new(log("first read done")));
        assert!(buf.is_being_read());
        // Reading its bytes does not wait; writing them does.
        assert_eq!(buf[0], 0);
        assert!(order.lock().unwrap().is_empty());
        buf[0] = 1;
        assert_eq!(*order.lock().unwrap(), ["first read done"]);
        assert!(!buf.is_being_read());
        buf.set_reading(DeviceRead::new(log("second read done")));
        drop(buf);
        assert_eq!(
            *order.lock().unwrap(),
            ["first read done", "second read done", "unpinned"]
        );
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
