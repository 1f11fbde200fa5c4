//! The page machinery against an in-process fake server: real mappings, real protection faults, real
//! resolver thread; the server's memory is a map of byte vectors.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::*;

/// The server: allocations by address, and what crossed the "network".
#[derive(Default)]
struct Fake {
    memory: Mutex<BTreeMap<u64, Vec<u8>>>,
    next: AtomicU64,
    written: AtomicUsize,
    read: AtomicUsize,
    reads: AtomicUsize,
}

impl Fake {
    fn with<R>(&self, addr: u64, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let mut mem = self.memory.lock().unwrap();
        let (&base, bytes) = mem.range_mut(..=addr).next_back().unwrap();
        f(&mut bytes[(addr - base) as usize..])
    }

    /// What a kernel would do: write `data` at `addr` of the server's copy.
    fn device_writes(&self, addr: u64, data: &[u8]) {
        self.with(addr, |b| b[..data.len()].copy_from_slice(data));
    }

    fn device_reads(&self, addr: u64, n: usize) -> Vec<u8> {
        self.with(addr, |b| b[..n].to_vec())
    }
}

impl Remote for Fake {
    fn alloc(&self, _: MirrorKind, len: usize) -> Result<(u64, u64), CUresult> {
        // Addresses far from anything the test process maps, carved out of one region 512 bytes apart
        // at least, as NVIDIA's driver carves small managed allocations out of a shared chunk.
        let base = 0x5a5a_0000_0000
            + self
                .next
                .fetch_add((len as u64).div_ceil(512) * 512, Ordering::Relaxed);
        self.memory.lock().unwrap().insert(base, vec![0; len]);
        // Registered memory's device address differs from any host address; the others are identities.
        Ok((base, base))
    }

    fn free(&self, _: MirrorKind, addr: u64) {
        self.memory.lock().unwrap().remove(&addr);
    }

    fn write(&self, runs: Vec<MirrorRun>, bytes: Vec<u8>) -> Result<(), CUresult> {
        // As the server does it (`MirrorRun::writes`); `written` counts the bytes stored.
        let mut at = 0;
        for r in runs {
            let n = r.bulk_len(&bytes[at..]).unwrap();
            for (off, data) in r.writes(&bytes[at..at + n]).unwrap() {
                self.with(r.addr + off as u64, |b| {
                    b[..data.len()].copy_from_slice(data);
                });
                self.written.fetch_add(data.len(), Ordering::Relaxed);
            }
            at += n;
        }
        assert_eq!(at, bytes.len());
        Ok(())
    }

    fn read(&self, ranges: Vec<MirrorRange>) -> Result<(Vec<bool>, Vec<u8>), CUresult> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let mut fresh = Vec::new();
        let mut out = Vec::new();
        for r in ranges {
            let bytes = self.device_reads(r.addr, r.len as usize);
            let same = r.hash == Some(mirror_hash(&bytes));
            if !same {
                out.extend_from_slice(&bytes);
            }
            fresh.push(!same);
        }
        self.read.fetch_add(out.len(), Ordering::Relaxed);
        Ok((fresh, out))
    }
}

/// One test at a time: the page table, the fault handler and the remote are process-wide.
static SERIAL: Mutex<()> = Mutex::new(());

fn fake() -> (std::sync::MutexGuard<'static, ()>, Arc<Fake>) {
    let guard = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let f = Arc::new(Fake::default());
    set_remote(f.clone());
    (guard, f)
}

fn counters(f: &Fake) -> (usize, usize) {
    (
        f.written.swap(0, Ordering::Relaxed),
        f.read.swap(0, Ordering::Relaxed),
    )
}

#[test]
fn only_changed_bytes_travel_and_device_writes_come_back_lazily() {
    let (_g, f) = fake();
    let page = page_size();
    let len = 8 * page;
    let p = alloc(MirrorKind::Managed { flags: 1 }, len, 7).unwrap();
    let host = p as *mut u8;
    // A fresh allocation reads as the server's (zeros): no bytes cross, the hash says so.
    // SAFETY: our mirror, `len` bytes.
    assert_eq!(unsafe { *host.add(3 * page) }, 0);
    assert_eq!(counters(&f), (0, 0));

    // The host writes three bytes in two pages; a launch pushes exactly those bytes.
    // SAFETY: as above.
    unsafe {
        *host.add(10) = 1;
        *host.add(11) = 2;
        *host.add(5 * page + 7) = 3;
    }
    before_work().unwrap();
    assert_eq!(counters(&f).0, 3);
    assert_eq!(f.device_reads(p, 12)[10..], [1, 2]);
    assert_eq!(f.device_reads(p + 5 * page as u64 + 7, 1), [3]);
    // Nothing more to push until the host writes again.
    before_work().unwrap();
    assert_eq!(counters(&f).0, 0);

    // The device writes page 6; after a synchronization the host sees it, fetching only what changed.
    f.device_writes(p + 6 * page as u64, &[9; 100]);
    synced(Some(submitted()), None).unwrap();
    // SAFETY: as above.
    let seen = unsafe { std::slice::from_raw_parts(host, len) }.to_vec();
    assert_eq!(seen[6 * page..6 * page + 100], [9; 100]);
    assert_eq!(seen[10..12], [1, 2]);
    let (_, read) = counters(&f);
    assert_eq!(
        read, page,
        "one changed page travels; the others hash the same"
    );

    // No work since the last full synchronization: another one drops nothing.
    synced(Some(submitted()), None).unwrap();
    // SAFETY: as above.
    let _ = unsafe { host.add(6 * page).read_volatile() };
    assert_eq!(counters(&f), (0, 0));
    assert!(free(p, false).unwrap().is_ok());
}

#[test]
fn host_and_device_writes_to_one_page_merge() {
    let (_g, f) = fake();
    let page = page_size();
    let p = alloc(MirrorKind::Managed { flags: 1 }, page, 7).unwrap();
    let host = p as *mut u8;
    before_work().unwrap(); // a kernel is launched...
    // ...and while it runs, the host writes the first half of the page and the kernel the second.
    // SAFETY: our mirror.
    unsafe { std::ptr::write_bytes(host, 1, page / 2) };
    f.device_writes(p + (page / 2) as u64, &vec![2; page / 2]);
    synced(Some(submitted()), None).unwrap();
    // SAFETY: as above.
    let seen = unsafe { std::slice::from_raw_parts(host, page) };
    assert!(seen[..page / 2].iter().all(|&b| b == 1), "host writes kept");
    assert!(
        seen[page / 2..].iter().all(|&b| b == 2),
        "device writes seen"
    );
    assert!(f.device_reads(p, page)[..page / 2].iter().all(|&b| b == 1));
    free(p, false).unwrap().unwrap();
}

#[test]
fn faults_from_many_threads_resolve() {
    let (_g, f) = fake();
    let page = page_size();
    let len = 64 * page;
    let p = alloc(MirrorKind::Host { flags: 0 }, len, 7).unwrap();
    for i in 0..64u64 {
        f.device_writes(p + i * page as u64, &[i as u8 + 1]);
    }
    let threads: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                let host = p as *mut u8;
                let mut sum = 0u64;
                for i in (t..64).step_by(8) {
                    // SAFETY: our mirror.
                    unsafe {
                        sum += u64::from(*host.add(i * page));
                        *host.add(i * page + 1) = 0xee;
                    }
                }
                sum
            })
        })
        .collect();
    let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(total, (1..=64).sum::<u64>());
    before_work().unwrap();
    for i in 0..64u64 {
        assert_eq!(f.device_reads(p + i * page as u64, 2), [i as u8 + 1, 0xee]);
    }
    assert_eq!(free(p, true).map(|r| r.is_ok()), Some(true));
}

#[test]
fn registered_memory_keeps_its_address_and_its_neighbours() {
    let (_g, f) = fake();
    let page = page_size();
    // A buffer that starts and ends inside pages it shares with other data.
    let mut backing = vec![0u8; 6 * page];
    let base = backing.as_mut_ptr() as usize;
    let start = base.div_ceil(page) * page + 100;
    let len = 3 * page;
    let before = start - 1;
    let after = start + len;
    // SAFETY: inside `backing`.
    unsafe {
        *(before as *mut u8) = 0x11;
        *(after as *mut u8) = 0x22;
        std::ptr::write_bytes(start as *mut u8, 5, len);
    }
    let device = register(start as u64, len, 0, 7).unwrap();
    // The server's copy starts as the application's bytes.
    assert!(f.device_reads(device, len).iter().all(|&b| b == 5));
    // SAFETY: inside `backing`, still the same memory.
    unsafe {
        assert_eq!(*(before as *const u8), 0x11);
        *(before as *mut u8) = 0x12; // a neighbour on a shared page: never pushed
        *((start + len - 1) as *mut u8) = 6; // the last registered byte, on a shared page
        *((start + page) as *mut u8) = 7; // an interior page
    }
    counters(&f);
    before_work().unwrap();
    assert_eq!(counters(&f).0, 2);
    assert_eq!(f.device_reads(device + len as u64 - 1, 1), [6]);
    assert_eq!(f.device_reads(device + page as u64, 1), [7]);
    // The device writes the first byte (a shared page) and one interior byte.
    f.device_writes(device, &[8]);
    f.device_writes(device + 2 * page as u64, &[9]);
    synced(Some(submitted()), None).unwrap();
    // SAFETY: as above.
    unsafe {
        assert_eq!(*(start as *const u8), 8);
        assert_eq!(*((start + 2 * page) as *const u8), 9);
        assert_eq!(*(before as *const u8), 0x12);
        assert_eq!(*(after as *const u8), 0x22);
    }
    assert_eq!(
        lookup(start as u64 + 5).map(|m| m.device),
        Some(device),
        "looked up by host address"
    );
    assert_eq!(lookup(device + 5).map(|m| m.host), Some(start as u64));
    unregister(start as u64).unwrap();
    // Plain memory again, with the latest bytes.
    // SAFETY: as above.
    unsafe {
        *((start + 2 * page) as *mut u8) = 10;
        assert_eq!(*((start + page) as *const u8), 7);
    }
    assert!(lookup(start as u64).is_none());
    drop(backing);
}

/// `cudaHostRegister(malloc(n))`: the buffer shares its first and last pages with the allocator's other
/// blocks, which stay usable by this and other threads while and after it is registered. (Where the
/// allocator puts the mirror's own bookkeeping is not controllable here; `tests/cuda/unified_textures.cu`
/// is the program in which it landed on the buffer's last page and registration deadlocked.)
#[test]
fn registering_a_heap_buffer_leaves_its_heap_neighbours_usable() {
    let (_g, f) = fake();
    let (done, finished) = std::sync::mpsc::channel();
    // On its own thread, so that a deadlock fails the test instead of hanging it.
    std::thread::spawn(move || {
        for n in [12_000, 5000, 100] {
            let mut buffer = vec![2u8; n];
            let p = buffer.as_mut_ptr() as u64;
            let device = register(p, n, 0, 7).unwrap();
            assert!(f.device_reads(device, n).iter().all(|&b| b == 2));
            // Allocations next to it still work, and the buffer is still the application's.
            let neighbours: Vec<Vec<u8>> = (0..64).map(|i| vec![i; 100]).collect();
            buffer[n - 1] = 3;
            before_work().unwrap();
            assert_eq!(f.device_reads(device + n as u64 - 1, 1), [3]);
            unregister(p).unwrap();
            drop(neighbours);
            drop(buffer);
        }
        done.send(()).unwrap();
    });
    finished
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("registration of heap buffers finished");
}

#[test]
fn diffs_are_byte_exact() {
    assert_eq!(diff(&[1, 2, 3, 4], &[1, 2, 3, 4]), []);
    assert_eq!(diff(&[1, 9, 3, 9], &[1, 2, 3, 4]), [(1, 1), (3, 1)]);
    let a = vec![0u8; 100];
    let mut b = a.clone();
    b[17..40].fill(1);
    assert_eq!(diff(&b, &a), [(17, 23)]);
}

#[test]
fn calls_are_classified_for_coherence() {
    assert_eq!(classify("cuCtxSynchronize"), CallKind::Sync(true));
    assert_eq!(classify("cuStreamSynchronize"), CallKind::Sync(false));
    assert_eq!(classify("cuEventQuery"), CallKind::Sync(false));
    assert_eq!(classify("cuMemGetInfo_v2"), CallKind::Query);
    assert_eq!(classify("cuMemsetD8Async"), CallKind::Work);
    assert_eq!(classify("cuLaunchKernel"), CallKind::Work);
}

#[test]
fn a_forked_child_gets_a_private_unprotected_copy() {
    let (_g, _f) = fake();
    let page = page_size();
    let p = alloc(MirrorKind::Host { flags: 0 }, 2 * page, 7).unwrap();
    let host = p as *mut u8;
    // SAFETY: our mirror.
    unsafe { *host = 5 };
    before_work().unwrap();
    synced(Some(submitted()), None).unwrap();
    // Both pages are now inaccessible in this process. In a child, where no resolver runs, they must be
    // plain memory holding the bytes this process had, and the child's writes its own.
    // SAFETY: the child touches memory and exits, nothing else.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: as above; `_exit` skips everything a forked child of a test must not run.
        unsafe {
            let ok = *host == 5 && {
                *host.add(page) = 9;
                *host.add(page) == 9
            };
            libc::_exit(if ok { 0 } else { 1 });
        }
    }
    assert!(pid > 0);
    let mut status = 0;
    // SAFETY: our child.
    unsafe { libc::waitpid(pid, &raw mut status, 0) };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{status:#x}"
    );
    // SAFETY: our mirror, still coherent here.
    unsafe {
        assert_eq!(*host.add(page), 0, "the child's write is its own");
        assert_eq!(*host, 5);
    }
    free(p, true).unwrap().unwrap();
}

#[test]
fn scattered_host_writes_during_device_work_leave_the_devices_bytes_alone() {
    let (_g, f) = fake();
    let page = page_size();
    let p = alloc(MirrorKind::Managed { flags: 1 }, page, 7).unwrap();
    let host = p as *mut u8;
    // SAFETY: our mirror.
    let _ = unsafe { host.read_volatile() };
    before_work().unwrap(); // a kernel runs from here on...
    // ...writing the high half of every word, while the host writes the low byte of each.
    for w in 0..page / 4 {
        f.device_writes(p + (4 * w + 2) as u64, &[0xab, 0xcd]);
        // SAFETY: as above.
        unsafe { host.add(4 * w).write_volatile((w & 0xff) as u8) };
    }
    counters(&f);
    before_work().unwrap();
    // Only the host's changed bytes were stored (one per word, the zero ones unchanged).
    let (written, _) = counters(&f);
    assert_eq!(written, (1..page / 4).filter(|w| w & 0xff != 0).count());
    let server = f.device_reads(p, page);
    for w in 0..page / 4 {
        assert_eq!(server[4 * w], (w & 0xff) as u8);
        assert_eq!(server[4 * w + 2..4 * w + 4], [0xab, 0xcd], "word {w}");
    }
    free(p, false).unwrap().unwrap();
}

/// cudarc's `test_unified_slice_copy_to_views`: small managed allocations one after another. The server
/// carves them out of one chunk, so each is asked for as whole pages, and each gets its own.
#[test]
fn small_allocations_get_pages_of_their_own() {
    let (_g, f) = fake();
    let page = page_size();
    let a = alloc(MirrorKind::Managed { flags: 1 }, 8, 7).unwrap();
    let b = alloc(MirrorKind::Managed { flags: 1 }, 8, 7).unwrap();
    let c = alloc(MirrorKind::Host { flags: 0 }, 24, 7).unwrap();
    assert!(
        a.is_multiple_of(page as u64)
            && b.is_multiple_of(page as u64)
            && c.is_multiple_of(page as u64)
    );
    assert!(a.abs_diff(b) >= page as u64 && b.abs_diff(c) >= page as u64);
    // SAFETY: mirrors of 8 bytes just allocated.
    unsafe {
        (a as *mut u64).write(1);
        (b as *mut u64).write(2);
    }
    before_work().unwrap();
    assert_eq!(f.device_reads(a, 8), 1u64.to_ne_bytes());
    assert_eq!(f.device_reads(b, 8), 2u64.to_ne_bytes());
    for p in [a, b] {
        assert_eq!(free(p, false), Some(Ok(())));
    }
    assert_eq!(free(c, true), Some(Ok(())));
}

/// A device-to-host copy of a few bytes into a page-locked buffer (`tensor.item()`), as `dtoh` makes it:
/// the device-side copy into the server's copy, the touched pages read back whole from it, the
/// synchronization, the install. The next read faults nothing and fetches nothing, the rest of the page
/// is what the device left there, and the host's own writes to a writable page are kept.
#[test]
fn a_copy_read_back_by_whole_pages_leaves_nothing_stale() {
    let (_g, f) = fake();
    let page = page_size();
    let p = alloc(MirrorKind::Host { flags: 0 }, 3 * page, 7).unwrap();
    let host = p as *mut u8;
    let at = p + page as u64 + 100;
    let copy = |value: u8| {
        before_work().unwrap(); // the copy is device work
        let span = page_span(at, 4).unwrap();
        assert_eq!(
            (span.host, span.len),
            (p + page as u64, page),
            "its one page, whole"
        );
        f.device_writes(at, &[value; 4]); // the device-side copy into the server's copy
        let back = f.device_reads(span.device, span.len);
        after_copy_into(&span).unwrap();
        assert!(install_span(&span, &back, at, 4));
    };
    // The device wrote elsewhere in the page meanwhile.
    f.device_writes(p + page as u64 + 2000, &[5; 8]);
    copy(1);
    let reads = f.reads.load(Ordering::Relaxed);
    // SAFETY: our mirror.
    let seen = unsafe { std::slice::from_raw_parts(host.add(page), page) }.to_vec();
    assert_eq!(seen[100..104], [1; 4]);
    assert_eq!(
        seen[2000..2008],
        [5; 8],
        "the page's other bytes are the server's"
    );
    assert_eq!(
        f.reads.load(Ordering::Relaxed),
        reads,
        "no fault fetched the page"
    );

    // Written by the host since (dirty): the next copy installs only its own bytes there.
    // SAFETY: as above.
    unsafe { *host.add(page + 3000) = 9 };
    f.device_writes(p + page as u64 + 2000, &[6; 8]);
    counters(&f);
    copy(2);
    assert_eq!(
        counters(&f).0,
        1,
        "the copy's device work pushed the host's byte first"
    );
    // SAFETY: as above.
    let seen = unsafe { std::slice::from_raw_parts(host.add(page), page) }.to_vec();
    assert_eq!(seen[100..104], [2; 4]);
    assert_eq!(seen[3000], 9, "the host's write is kept");
    // The copy's bytes are not pushed back as host writes.
    before_work().unwrap();
    assert_eq!(counters(&f).0, 0);
    assert_eq!(f.device_reads(p + page as u64 + 3000, 1), [9]);
    free(p, true).unwrap().unwrap();
}
