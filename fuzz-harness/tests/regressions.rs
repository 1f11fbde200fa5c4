//! Bugs the fuzzers found, each pinned by a test that fails (or crashes) without its fix.

use std::ffi::c_void;

/// `len` readable bytes ending right before an inaccessible page: reading past them faults.
fn before_guard_page(bytes: &[u8]) -> *const u8 {
    let page = 4096;
    assert!(bytes.len() <= page);
    // SAFETY: a fresh anonymous mapping of two pages; the second made inaccessible; never unmapped
    // (a few pages for the test's lifetime).
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            2 * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        let guard = p.cast::<u8>().add(page);
        assert_eq!(
            libc::mprotect(guard.cast::<c_void>(), page, libc::PROT_NONE),
            0
        );
        let start = guard.sub(bytes.len());
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), start, bytes.len());
        start
    }
}

/// fatbin target: sizing the PTX image `""` (one NUL byte) read four bytes, three past its end.
#[test]
fn ptx_images_shorter_than_a_magic_number_are_read_only_to_their_nul() {
    for text in [&b"\0"[..], b"a\0", b".v\0"] {
        let image = before_guard_page(text);
        // SAFETY: a NUL-terminated image, as cuModuleLoadData requires.
        let size = unsafe { gleam_fatbin::image_size(image.cast()) };
        assert_eq!(size, Ok(text.len()));
        // SAFETY: as above.
        let unwrapped = unsafe { gleam_fatbin::unwrap_fatbin_wrapper(image.cast()) };
        assert_eq!(unwrapped, Ok(image.cast()));
    }
}
