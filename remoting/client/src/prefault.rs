//! Faulting in a large device-to-host destination ahead of the data, on a thread of its own.
//!
//! A program's fresh buffer (a `calloc`, a new `Vec`) has no pages yet: the first write to each 4 KiB
//! page traps into the kernel, which zeroes a page for it. For a large copy that costs as much as the
//! copy itself (on the development machine's VM, 71% of the client's CPU in a 512 MiB device-to-host copy
//! went to zeroing pages). NVIDIA's driver pays it on the calling thread; here a helper faults the
//! destination in (`MADV_POPULATE_WRITE`, in order, so the first pieces are ready first) while the
//! pieces are still crossing the network, and the calling thread's copies find the pages there.

/// Copies at least this large get their destination faulted in ahead.
pub(crate) const PREFAULT_MIN: usize = 8 << 20;

/// Hosts with fewer cores do not fault ahead: the helper would take a core the transfer needs (on the
/// 2-core development machine a 256 MiB copy fell from 521-618 to 229-332 MiB/s with it).
const PREFAULT_MIN_CORES: usize = 8;

/// Whether large copies fault their destination in ahead: on hosts with [`PREFAULT_MIN_CORES`] cores or
/// more, unless `GLEAM_PREFAULT=off`.
pub(crate) fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| {
        let off =
            std::env::var("GLEAM_PREFAULT").is_ok_and(|v| gleam_protocol::tuning::turned_off(&v));
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        !off && cores >= PREFAULT_MIN_CORES
    })
}

/// How much is faulted in per system call (so the helper stays just ahead of the copies).
const STEP: usize = 2 << 20;

/// Faults in the whole pages of `range` for writing, without changing their contents; stops at the first
/// error (a kernel before 5.14 has no `MADV_POPULATE_WRITE`: the copies then fault as they go).
pub(crate) fn populate_for_writing(start: usize, len: usize) {
    let page = page_size();
    let first = start.div_ceil(page) * page;
    let end = (start + len) / page * page;
    let mut at = first;
    while at < end {
        let n = (end - at).min(STEP);
        // SAFETY: `[at, at + n)` lies within a buffer the caller holds exclusively for the copy being
        // made into it; MADV_POPULATE_WRITE only maps its pages in writable, as a write would, and leaves
        // their contents as they are.
        let rc = unsafe { libc::madvise(at as *mut libc::c_void, n, libc::MADV_POPULATE_WRITE) };
        if rc != 0 {
            return;
        }
        at += n;
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .unwrap_or(4096)
}
