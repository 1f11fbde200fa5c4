//! Page faults on mirrored memory, taken off the faulting thread.
//!
//! Mirrored pages are protected (`mprotect`) while the client's copy may be out of date (no access) or
//! while writes must be noticed (read-only). An access then raises `SIGSEGV` on the thread that made it.
//! The handler may not take locks, allocate or do IO there (the thread may hold any lock, the allocator's
//! included), so it only posts the address in a free [`Slot`], wakes the resolver thread with a futex, and
//! waits on the slot's futex until the resolver has made the page accessible; then the access is retried.
//! The resolver does the work (the page table's lock, network round trips, allocation) on a thread that
//! holds nothing the faulting thread could be holding.
//!
//! Faults outside mirrored memory go to the handler that was installed before ours (Rust's stack
//! overflow handler, a runtime's, or the default action), and so does everything in a `fork()`ed child,
//! where no resolver runs: there the mirrored ranges are turned into private, unprotected copies. A
//! handler the application installs later takes ours out of the chain; [`ensure_handler`] puts ours back
//! in front (keeping theirs as the next one) whenever pages are about to be protected.
//!
//! Everything the handler reads lives in fixed arrays of atomics ([`RANGES`], [`SLOTS`]).

use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// How many mirrored ranges the handler can know at once.
pub(super) const MAX_RANGES: usize = 4096;
/// Faults in flight at once (more threads wait for a free slot).
const SLOTS_N: usize = 64;

/// A mirrored range `[start, end)` of the address space and the memfd behind it (for a forked child).
pub(super) struct Range {
    start: AtomicUsize,
    end: AtomicUsize,
    fd: AtomicI32,
}

#[allow(clippy::declare_interior_mutable_const)]
const RANGE_INIT: Range = Range {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    fd: AtomicI32::new(-1),
};

static RANGES: [Range; MAX_RANGES] = [RANGE_INIT; MAX_RANGES];
/// One past the highest slot of [`RANGES`] ever used (the handler scans up to it).
static RANGES_USED: AtomicUsize = AtomicUsize::new(0);
/// Serialises changes to [`RANGES`] (never taken by the handler).
static RANGES_LOCK: Mutex<()> = Mutex::new(());

const FREE: u32 = 0;
const CLAIMED: u32 = 1;
const POSTED: u32 = 2;
const DONE: u32 = 3;

struct Slot {
    state: AtomicU32,
    addr: AtomicUsize,
    write: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const SLOT_INIT: Slot = Slot {
    state: AtomicU32::new(FREE),
    addr: AtomicUsize::new(0),
    write: AtomicBool::new(false),
};

static SLOTS: [Slot; SLOTS_N] = [SLOT_INIT; SLOTS_N];
/// Bumped for every posted fault; the resolver sleeps on it.
static WAKE: AtomicU32 = AtomicU32::new(0);
/// The resolver thread's id (a fault there would wait for itself).
static RESOLVER_TID: AtomicI32 = AtomicI32::new(0);
/// Set in a forked child: no resolver runs there.
static CHILD: AtomicBool = AtomicBool::new(false);

/// The handler that was installed before ours, for faults that are not ours.
struct Previous(UnsafeCell<libc::sigaction>);
// SAFETY: written only under `HANDLER_LOCK` while ours is not yet (re)installed, read by the handler
// after installation (the `sigaction` call orders the write before any delivery of ours).
unsafe impl Sync for Previous {}
// SAFETY: an all-zero `sigaction` is SIG_DFL with no flags.
static PREVIOUS: Previous = Previous(UnsafeCell::new(unsafe { std::mem::zeroed() }));
static HANDLER_LOCK: Mutex<()> = Mutex::new(());

/// What resolves a fault: the mirror table's `resolve`.
pub(super) type Resolve = fn(addr: usize, write: bool);

/// Records `[start, end)` (backed by memfd `fd`) as mirrored; returns its slot for [`remove_range`].
pub(super) fn add_range(start: usize, end: usize, fd: i32) -> Option<usize> {
    let _guard = RANGES_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let i = RANGES
        .iter()
        .position(|r| r.start.load(Ordering::Acquire) == 0)?;
    let r = &RANGES[i];
    r.fd.store(fd, Ordering::Relaxed);
    r.end.store(end, Ordering::Relaxed);
    // Published last: the handler only trusts a slot whose start is set.
    r.start.store(start, Ordering::Release);
    RANGES_USED.fetch_max(i + 1, Ordering::AcqRel);
    Some(i)
}

/// Forgets a range recorded by [`add_range`].
pub(super) fn remove_range(slot: usize) {
    let _guard = RANGES_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let r = &RANGES[slot];
    r.start.store(0, Ordering::Release);
    r.end.store(0, Ordering::Relaxed);
    r.fd.store(-1, Ordering::Relaxed);
}

fn mirrored(addr: usize) -> bool {
    let used = RANGES_USED.load(Ordering::Acquire).min(MAX_RANGES);
    RANGES[..used].iter().any(|r| {
        let start = r.start.load(Ordering::Acquire);
        start != 0 && addr >= start && addr < r.end.load(Ordering::Relaxed)
    })
}

fn futex_wait(word: &AtomicU32, expected: u32) {
    // SAFETY: FUTEX_WAIT_PRIVATE on a live atomic word; returns at once if the word changed.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE_PRIVATE on a live atomic word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        );
    }
}

/// Writes `msg` to stderr without allocating or locking (async-signal-safe).
fn raw_stderr(msg: &[u8]) {
    // SAFETY: write(2) of a valid buffer.
    let _ = unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

/// Whether the faulting access was a write (x86-64 reports it; elsewhere a write faults once more after
/// the page became readable, which the resolver then handles as a write).
fn is_write(ctx: *mut c_void) -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        if ctx.is_null() {
            return false;
        }
        // SAFETY: the kernel passes a `ucontext_t` as the third argument of an SA_SIGINFO handler.
        let uc = unsafe { &*ctx.cast::<libc::ucontext_t>() };
        // Bit 1 of the page-fault error code: the access was a write.
        uc.uc_mcontext.gregs[libc::REG_ERR as usize] & 2 != 0
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        let _ = ctx;
        false
    }
}

extern "C" fn on_segv(sig: i32, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: errno is thread-local; saved and restored around the syscalls below.
    let errno = unsafe { *libc::__errno_location() };
    let addr = if info.is_null() {
        0
    } else {
        // SAFETY: the kernel passes a valid siginfo for SIGSEGV.
        unsafe { (*info).si_addr() as usize }
    };
    let ours = !CHILD.load(Ordering::Acquire) && addr != 0 && mirrored(addr);
    if ours {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        if tid == RESOLVER_TID.load(Ordering::Acquire) {
            raw_stderr(
                b"gleam: internal error: a fault on mirrored memory inside its own resolver\n",
            );
            // SAFETY: abort has no preconditions.
            unsafe { libc::abort() };
        }
        post_and_wait(addr, is_write(ctx));
    } else {
        chain(sig, info, ctx);
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

fn post_and_wait(addr: usize, write: bool) {
    let slot = loop {
        if let Some(s) = SLOTS.iter().find(|s| {
            s.state
                .compare_exchange(FREE, CLAIMED, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        }) {
            break s;
        }
        // Every slot busy: let the resolver make progress.
        // SAFETY: sched_yield has no preconditions.
        unsafe { libc::sched_yield() };
    };
    slot.addr.store(addr, Ordering::Relaxed);
    slot.write.store(write, Ordering::Relaxed);
    slot.state.store(POSTED, Ordering::Release);
    WAKE.fetch_add(1, Ordering::AcqRel);
    futex_wake(&WAKE);
    while slot.state.load(Ordering::Acquire) == POSTED {
        futex_wait(&slot.state, POSTED);
    }
    slot.state.store(FREE, Ordering::Release);
}

/// Hands a fault that is not ours to the previous handler (or the default action: the access is
/// retried and kills the process as it would have).
fn chain(sig: i32, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: see `Previous`.
    let prev = unsafe { &*PREVIOUS.0.get() };
    let handler = prev.sa_sigaction;
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // SAFETY: restoring the default action is async-signal-safe; the faulting instruction is
        // retried and takes it.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGSEGV, &raw const dfl, std::ptr::null_mut());
        }
    } else if prev.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: a handler installed with SA_SIGINFO has this signature.
        let f: extern "C" fn(i32, *mut libc::siginfo_t, *mut c_void) =
            unsafe { std::mem::transmute(handler) };
        f(sig, info, ctx);
    } else {
        // SAFETY: a plain handler takes the signal number.
        let f: extern "C" fn(i32) = unsafe { std::mem::transmute(handler) };
        f(sig);
    }
}

/// Makes sure our handler is the one installed, keeping whatever else was installed as the next one.
pub(super) fn ensure_handler() {
    let _guard = HANDLER_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // SAFETY: querying the current action.
    let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    unsafe { libc::sigaction(libc::SIGSEGV, std::ptr::null(), &raw mut current) };
    if current.sa_sigaction == on_segv as *const () as usize {
        return;
    }
    // SAFETY: ours is not installed, so the handler does not read PREVIOUS now.
    unsafe { *PREVIOUS.0.get() = current };
    // SAFETY: installing a handler with the SA_SIGINFO signature; on the alternate stack when the
    // thread has one (a stack overflow must still reach the previous handler).
    unsafe {
        let mut ours: libc::sigaction = std::mem::zeroed();
        ours.sa_sigaction = on_segv as *const () as usize;
        ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
        libc::sigemptyset(&raw mut ours.sa_mask);
        libc::sigaction(libc::SIGSEGV, &raw const ours, std::ptr::null_mut());
    }
}

unsafe extern "C" {
    fn pthread_atfork(
        prepare: Option<unsafe extern "C" fn()>,
        parent: Option<unsafe extern "C" fn()>,
        child: Option<unsafe extern "C" fn()>,
    ) -> i32;
}

/// In a forked child: every mirrored range becomes a private copy of what the memfd holds, readable and
/// writable, and faults are no longer ours (CUDA is unusable in a child; its memory stays readable).
unsafe extern "C" fn in_child() {
    CHILD.store(true, Ordering::Release);
    let used = RANGES_USED.load(Ordering::Acquire).min(MAX_RANGES);
    for r in &RANGES[..used] {
        let start = r.start.load(Ordering::Acquire);
        let (end, fd) = (r.end.load(Ordering::Relaxed), r.fd.load(Ordering::Relaxed));
        if start != 0 && fd >= 0 {
            // SAFETY: replaces our own mapping of this range with a private one of the same file.
            unsafe {
                libc::mmap(
                    start as *mut c_void,
                    end - start,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_FIXED,
                    fd,
                    0,
                );
            }
        }
    }
}

/// Installs the handler and starts the resolver thread (once). Without a resolver no page may be
/// protected: mirrored memory is then refused.
pub(super) fn start(resolve: Resolve) -> Result<(), gleam_protocol::types::CUresult> {
    static STARTED: OnceLock<bool> = OnceLock::new();
    let started = *STARTED.get_or_init(|| {
        // SAFETY: registering a child handler that only uses async-signal-safe calls.
        unsafe { pthread_atfork(None, None, Some(in_child)) };
        match std::thread::Builder::new()
            .name("gleam-faults".into())
            .spawn(move || resolver(resolve))
        {
            Ok(_) => true,
            Err(err) => {
                tracing::error!(%err, "cannot start the thread that resolves faults on mirrored memory");
                false
            }
        }
    });
    if !started {
        return Err(gleam_protocol::types::CUresult::OUT_OF_MEMORY);
    }
    ensure_handler();
    Ok(())
}

fn resolver(resolve: Resolve) {
    // SAFETY: gettid has no preconditions.
    RESOLVER_TID.store(unsafe { libc::gettid() }, Ordering::Release);
    loop {
        let seen = WAKE.load(Ordering::Acquire);
        let mut any = false;
        for slot in &SLOTS {
            if slot.state.load(Ordering::Acquire) == POSTED {
                any = true;
                resolve(
                    slot.addr.load(Ordering::Relaxed),
                    slot.write.load(Ordering::Relaxed),
                );
                slot.state.store(DONE, Ordering::Release);
                futex_wake(&slot.state);
            }
        }
        if !any {
            futex_wait(&WAKE, seen);
        }
    }
}
