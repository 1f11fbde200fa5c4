//! Mirrored memory: ranges of this process that the serving peer's device reads and writes too.
//!
//! Managed memory (`cuMemAllocManaged`) and page-locked host memory (`cuMemHostAlloc`,
//! `cuMemAllocHost`) are usable by the host and by kernels at the same address. Across a network that
//! means two copies: the server's (an allocation of the same kind, made by the server's driver) and this
//! process's, mapped at the server's address (`MAP_FIXED_NOREPLACE`; an address already used here is
//! handed back and another allocation asked for). Registered memory (`cuMemHostRegister`) keeps the
//! application's address; its server copy is a host allocation at another address, which is the device
//! pointer CUDA hands out for it (`CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM` is 0).
//!
//! The two copies are kept coherent where CUDA promises coherence, moving only what changed:
//!
//! * Each page is **clean** (read-only: both copies agree), **dirty** (writable: the host wrote since;
//!   its content when it became writable, its *twin*, is kept), or **stale** (inaccessible: the device
//!   may have written it since the host last looked).
//! * Before any device work (a launch, a copy, any forwarded call that may read memory) dirty pages are
//!   pushed, as the bytes that differ from their twin ([`Call::MirrorWrite`], ordered before the work):
//!   bytes the device wrote meanwhile in the same page are not overwritten.
//! * At a synchronization that may complete device work (context, stream and event synchronization,
//!   successful queries, synchronous copies), if work was submitted since the last full synchronization,
//!   every clean page becomes stale. The next access faults, and the page, with its neighbours, is read
//!   back ([`Call::MirrorRead`]); a range whose content hashes to what this side holds costs no bytes.
//! * A fault is handed to a resolver thread ([`fault`]): the faulting thread may hold any lock.
//!
//! The pages of registered memory that it shares with other data (its first and last page, unless the
//! range is page-aligned) are never protected, since anything may touch them, the allocator included:
//! they are compared with a twin before device work and refreshed at synchronizations instead.
//!
//! Not exact (and documented so): communication through mirrored memory *while* a kernel runs (a kernel
//! waiting for a flag the host sets in managed memory, or the reverse) only becomes visible at the next
//! launch or synchronization; system calls given stale pages fail with `EFAULT` (the kernel does not
//! deliver the fault to us), so prefetch to the host first ([`prefetch_host`]).

mod fault;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};

use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{COPY_CHUNK, Call, MirrorRange, MirrorRun, Reply, mirror_hash};

use crate::state;

/// What a mirror is.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum MirrorKind {
    /// `cuMemAllocManaged` (`CU_MEM_ATTACH_*` flags).
    Managed { flags: u32 },
    /// `cuMemHostAlloc`/`cuMemAllocHost` (`CU_MEMHOSTALLOC_*` flags).
    Host { flags: u32 },
    /// `cuMemHostRegister` (`CU_MEMHOSTREGISTER_*` flags).
    Registered { flags: u32 },
}

/// `CU_MEMHOSTREGISTER_READ_ONLY`: the device never writes it.
const REGISTER_READ_ONLY: u32 = 0x08;

/// What the rest of the shim needs to know about a mirror.
#[derive(Clone, Copy, Debug)]
pub struct MirrorInfo {
    /// Its kind and flags.
    pub kind: MirrorKind,
    /// First byte, as the application sees it.
    pub host: u64,
    /// Byte count.
    pub len: u64,
    /// Device address of the first byte (the host address, except for registered memory).
    pub device: u64,
    /// The context it was allocated or registered in.
    pub ctx: u64,
}

/// How the page state talks to the server (the session's client; a fake in tests).
pub trait Remote: Send + Sync {
    /// Allocates the server's copy of a mirror of `len` bytes: `(server address, device address)`.
    fn alloc(&self, kind: MirrorKind, len: usize) -> Result<(u64, u64), CUresult>;
    /// Frees it.
    fn free(&self, kind: MirrorKind, addr: u64);
    /// Queues the runs' bytes for the server's copy (fire-and-forget, ordered with later requests).
    fn write(&self, runs: Vec<MirrorRun>, bytes: Vec<u8>) -> Result<(), CUresult>;
    /// Reads ranges of the server's copy: which ones differ from the given hashes, and their bytes.
    fn read(&self, ranges: Vec<MirrorRange>) -> Result<(Vec<bool>, Vec<u8>), CUresult>;
}

/// The session's client.
struct SessionRemote;

impl Remote for SessionRemote {
    fn alloc(&self, kind: MirrorKind, len: usize) -> Result<(u64, u64), CUresult> {
        let mut addr = 0u64;
        match kind {
            MirrorKind::Managed { flags } => {
                // SAFETY: a valid out-pointer.
                unsafe { crate::forward::cuMemAllocManaged(&raw mut addr, len, flags)? };
                Ok((addr, addr))
            }
            MirrorKind::Host { flags } | MirrorKind::Registered { flags } => {
                // The server's copy is always portable and mapped: it is what kernels access.
                let server_flags = match kind {
                    MirrorKind::Host { .. } => flags | 0x3,
                    _ => 0x3,
                };
                // SAFETY: a valid out-pointer.
                unsafe { crate::forward::cuMemHostAlloc(&raw mut addr, len, server_flags)? };
                let mut device = 0u64;
                // SAFETY: valid out-pointer; a host allocation just made.
                let got = unsafe {
                    crate::forward::cuMemHostGetDevicePointer_v2(&raw mut device, addr, 0)
                };
                if let Err(err) = got {
                    self.free(kind, addr);
                    return Err(err);
                }
                Ok((addr, device))
            }
        }
    }

    fn free(&self, kind: MirrorKind, addr: u64) {
        // Both go fire-and-forget (`cuMemFree` is deferred in the list): a free must run even when an
        // earlier asynchronous call's error is pending, which a waited-for request would report instead.
        let freed = match kind {
            // SAFETY: a plain value: an allocation of the server's made for a mirror.
            MirrorKind::Managed { .. } => unsafe { crate::forward::cuMemFree_v2(addr) },
            _ => crate::forward::cuMemFreeHost_detached(addr),
        };
        if let Err(err) = freed {
            tracing::debug!(addr, %err, "freeing the server's copy of mirrored memory failed");
        }
    }

    fn write(&self, runs: Vec<MirrorRun>, bytes: Vec<u8>) -> Result<(), CUresult> {
        let session = state::session()?;
        session
            .client
            .submit(0, Call::MirrorWrite { runs }, &bytes, false)
            .map_err(state::lost)?;
        Ok(())
    }

    fn read(&self, ranges: Vec<MirrorRange>) -> Result<(Vec<bool>, Vec<u8>), CUresult> {
        let session = state::session()?;
        let answer = session
            .client
            .call_with(0, Call::MirrorRead { ranges }, &[])
            .map_err(state::lost)?;
        answer.result.result()?;
        match answer.reply {
            Reply::Mirror { fresh } => Ok((fresh, answer.bulk.to_vec())),
            other => Err(state::mismatch("mirror read", &other)),
        }
    }
}

static REMOTE: RwLock<Option<Arc<dyn Remote>>> = RwLock::new(None);

fn remote() -> Arc<dyn Remote> {
    REMOTE
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
        .unwrap_or_else(|| Arc::new(SessionRemote))
}

/// Replaces the server (tests).
#[cfg(test)]
pub(crate) fn set_remote(r: Arc<dyn Remote>) {
    *REMOTE
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(r);
}

/// The system's page size.
pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(n).unwrap_or(4096)
    })
}

#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum State {
    Clean,
    Dirty,
    Stale,
    /// Shared with other data: never protected; compared with its twin and refreshed eagerly.
    Loose,
}

/// `cuMemAdvise` and `cuMemPrefetchAsync` as recorded for `cuMemRangeGetAttribute`.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Advice {
    /// `CU_MEM_ADVISE_SET_READ_MOSTLY`.
    pub read_mostly: bool,
    /// `CU_MEM_ADVISE_SET_PREFERRED_LOCATION`: a device ordinal, or -1 for the CPU.
    pub preferred: Option<i32>,
    /// `CU_MEM_ADVISE_SET_ACCESSED_BY`: bit 0 the CPU, bit d + 1 device d.
    pub accessed_by: u64,
    /// The last `cuMemPrefetchAsync` destination: a device ordinal, or -1 for the CPU.
    pub last_prefetch: Option<i32>,
}

#[derive(Clone, Copy, Debug)]
struct Page {
    state: State,
    /// Hash of the client's bytes of the page, when they are known to match the server's at some point.
    hash: Option<[u8; 16]>,
    /// Refresh eagerly at the next synchronization (`cuMemPrefetchAsync` to the CPU).
    wanted: bool,
    advice: Advice,
}

struct Mirror {
    kind: MirrorKind,
    host: usize,
    len: usize,
    server: u64,
    device: u64,
    ctx: u64,
    /// Page-aligned mapping of the application's view.
    start: usize,
    npages: usize,
    /// The same pages, always read-write, where the shim reads and installs bytes.
    alias: usize,
    fd: i32,
    /// Slot in the fault handler's range table.
    slot: usize,
    pages: Vec<Page>,
    twins: HashMap<usize, Box<[u8]>>,
    /// Pages fetched per fault, grown on sequential faults.
    window: usize,
    next_fault: usize,
}

impl Mirror {
    fn info(&self) -> MirrorInfo {
        MirrorInfo {
            kind: self.kind,
            host: self.host as u64,
            len: self.len as u64,
            device: self.device,
            ctx: self.ctx,
        }
    }

    fn map_len(&self) -> usize {
        self.npages * page_size()
    }

    /// The application's bytes of page `i`: `[from, to)` as offsets in the page.
    fn covered(&self, i: usize) -> (usize, usize) {
        let page = page_size();
        let at = self.start + i * page;
        let from = self.host.max(at) - at;
        let to = (self.host + self.len).min(at + page) - at;
        (from, to)
    }

    fn alias_page(&self, i: usize) -> &[u8] {
        let page = page_size();
        // SAFETY: the alias maps `npages` pages read-write for as long as the mirror lives; the shim
        // touches it only under the table's lock (the application may write the same memory through its
        // own view meanwhile, as through any shared mapping).
        unsafe { std::slice::from_raw_parts((self.alias + i * page) as *const u8, page) }
    }

    fn alias_page_mut(&mut self, i: usize) -> &mut [u8] {
        let page = page_size();
        // SAFETY: as above; `&mut self` keeps the shim's own accesses exclusive.
        unsafe { std::slice::from_raw_parts_mut((self.alias + i * page) as *mut u8, page) }
    }

    fn server_of(&self, addr: usize) -> u64 {
        self.server + (addr - self.host) as u64
    }

    fn hash_page(&self, i: usize) -> [u8; 16] {
        let (from, to) = self.covered(i);
        mirror_hash(&self.alias_page(i)[from..to])
    }

    /// Sets the application view's protection of pages `[first, first + n)`.
    fn protect(&self, first: usize, n: usize, prot: i32) {
        if n == 0 {
            return;
        }
        let page = page_size();
        // SAFETY: pages of our own mapping of the application's view.
        let r = unsafe {
            libc::mprotect(
                (self.start + first * page) as *mut libc::c_void,
                n * page,
                prot,
            )
        };
        if r != 0 {
            fault_message(b"gleam: mprotect of mirrored memory failed\n");
        }
    }

    /// Applies `prot` to every page in `pages` (sorted), one call per contiguous run.
    fn protect_each(&self, pages: &[usize], prot: i32) {
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j] == pages[j - 1] + 1 {
                j += 1;
            }
            self.protect(pages[i], j - i, prot);
            i = j;
        }
    }

    /// The pages of `span` in this mirror (empty if it lies elsewhere).
    fn pages_of(&self, span: Option<&PageSpan>) -> std::ops::Range<usize> {
        let Some(span) = span else { return 0..0 };
        let (lo, hi) = (span.host as usize, span.host as usize + span.len);
        let map_end = self.start + self.map_len();
        if hi <= self.start || lo >= map_end {
            return 0..0;
        }
        let page = page_size();
        (lo.max(self.start) - self.start) / page..(hi.min(map_end) - self.start).div_ceil(page)
    }

    fn device_writable(&self) -> bool {
        !matches!(self.kind, MirrorKind::Registered { flags } if flags & REGISTER_READ_ONLY != 0)
    }
}

/// Runs of bytes for the server, batched into frames.
struct Batch<'a> {
    remote: &'a dyn Remote,
    runs: Vec<MirrorRun>,
    bytes: Vec<u8>,
}

/// Runs per frame (each costs about a dozen bytes of the frame's header).
const RUNS_PER_FRAME: usize = 8192;
/// A page whose changes are more scattered than this travels as a masked run.
const RUNS_BEFORE_MASK: usize = 8;

impl Batch<'_> {
    fn add(&mut self, addr: u64, data: &[u8]) -> Result<(), CUresult> {
        for (k, piece) in data.chunks(COPY_CHUNK).enumerate() {
            let addr = addr + (k * COPY_CHUNK) as u64;
            if self.bytes.len() + piece.len() > COPY_CHUNK || self.runs.len() >= RUNS_PER_FRAME {
                self.send()?;
            }
            match self.runs.last_mut() {
                // Adjacent to the previous run: one run (no gap, so nothing of the device's is touched).
                Some(last) if !last.masked && last.addr + u64::from(last.len) == addr => {
                    last.len += piece.len() as u32;
                }
                _ => self.runs.push(MirrorRun {
                    addr,
                    len: piece.len() as u32,
                    masked: false,
                }),
            }
            self.bytes.extend_from_slice(piece);
        }
        Ok(())
    }

    /// The bytes of `now` that differ from `was` (at most a page), as one masked run: a bitmap of the
    /// bytes written, then those bytes. The others are not touched on the server.
    fn add_masked(&mut self, addr: u64, now: &[u8], was: &[u8]) -> Result<(), CUresult> {
        let mut mask = vec![0u8; now.len().div_ceil(8)];
        let mut picked = Vec::new();
        for (i, (&n, &w)) in now.iter().zip(was).enumerate() {
            if n != w {
                mask[i / 8] |= 1 << (i % 8);
                picked.push(n);
            }
        }
        if self.bytes.len() + mask.len() + picked.len() > COPY_CHUNK
            || self.runs.len() >= RUNS_PER_FRAME
        {
            self.send()?;
        }
        self.runs.push(MirrorRun {
            addr,
            len: now.len() as u32,
            masked: true,
        });
        self.bytes.extend_from_slice(&mask);
        self.bytes.extend_from_slice(&picked);
        Ok(())
    }

    fn send(&mut self) -> Result<(), CUresult> {
        if self.runs.is_empty() {
            return Ok(());
        }
        let runs = std::mem::take(&mut self.runs);
        let bytes = std::mem::take(&mut self.bytes);
        self.remote.write(runs, bytes)
    }
}

/// The byte runs where `now` differs from `was`: `(offset, len)`.
fn diff(now: &[u8], was: &[u8]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut i = 0;
    let n = now.len().min(was.len());
    while i < n {
        // Skip equal words fast.
        if i + 8 <= n && now[i..i + 8] == was[i..i + 8] {
            i += 8;
            continue;
        }
        if now[i] == was[i] {
            i += 1;
            continue;
        }
        let from = i;
        while i < n && now[i] != was[i] {
            i += 1;
        }
        runs.push((from, i - from));
    }
    runs
}

#[derive(Default)]
struct Table {
    mirrors: BTreeMap<usize, Mirror>,
    /// Device work submitted so far (a count), and how much of it is known complete (after a full
    /// synchronization): work is in flight, or completed unseen, while `submitted > completed`.
    submitted: u64,
    completed: u64,
}

impl Table {
    fn pending(&self) -> bool {
        self.submitted > self.completed
    }
}

impl Table {
    /// The mirror whose mapping holds `addr`.
    fn at_mut(&mut self, addr: usize) -> Option<&mut Mirror> {
        let (_, m) = self.mirrors.range_mut(..=addr).next_back()?;
        (addr < m.start + m.map_len()).then_some(m)
    }

    fn at(&self, addr: usize) -> Option<&Mirror> {
        let (_, m) = self.mirrors.range(..=addr).next_back()?;
        (addr < m.start + m.map_len()).then_some(m)
    }
}

static TABLE: Mutex<Table> = Mutex::new(Table {
    mirrors: BTreeMap::new(),
    submitted: 0,
    completed: 0,
});
/// Mirrors alive (the hooks do nothing when there are none).
static LIVE: AtomicUsize = AtomicUsize::new(0);
/// Dirty and loose pages (a flush has nothing to do when there are none).
static UNPUSHED: AtomicUsize = AtomicUsize::new(0);
static REPORTED: AtomicBool = AtomicBool::new(false);

fn table() -> MutexGuard<'static, Table> {
    TABLE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A message from the resolver, which must not take the locks `tracing` or Rust's stderr take.
fn fault_message(msg: &[u8]) {
    // SAFETY: write(2) of a valid buffer.
    let _ = unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

// --- Pushing, fetching, invalidating ------------------------------------------------------------

impl Mirror {
    /// Pushes the dirty and loose pages among `pages` (all when `None`). `quiet`: no device work is in
    /// flight, so the server's bytes the host did not change are still the twin's, and a page's changes
    /// may travel as one contiguous run; otherwise only the bytes that changed are written.
    fn push(
        &mut self,
        batch: &mut Batch<'_>,
        only: Option<(usize, usize)>,
        quiet: bool,
    ) -> Result<(), CUresult> {
        let (lo, hi) = only.unwrap_or((0, self.npages));
        let dirty: Vec<usize> = (lo..hi)
            .filter(|&i| self.pages[i].state == State::Dirty)
            .collect();
        // Read-only first, so that a write racing with the push faults and is seen.
        self.protect_each(&dirty, libc::PROT_READ);
        for i in lo..hi {
            let state = self.pages[i].state;
            if !matches!(state, State::Dirty | State::Loose) {
                continue;
            }
            let (from, to) = self.covered(i);
            let Some(twin) = self.twins.get(&i) else {
                continue;
            };
            let page_addr = self.start + i * page_size();
            let now = &self.alias_page(i)[from..to];
            let was = &twin[from..to];
            let runs = diff(now, was);
            if let (Some(&(first, _)), Some(&(last, n))) = (runs.first(), runs.last()) {
                let at = self.server_of(page_addr + from + first);
                if quiet {
                    batch.add(at, &now[first..last + n])?;
                } else if runs.len() <= RUNS_BEFORE_MASK {
                    for (off, n) in runs {
                        batch.add(self.server_of(page_addr + from + off), &now[off..off + n])?;
                    }
                } else {
                    batch.add_masked(at, &now[first..last + n], &was[first..last + n])?;
                }
            }
            if state == State::Dirty {
                self.twins.remove(&i);
                let hash = self.hash_page(i);
                let p = &mut self.pages[i];
                p.state = State::Clean;
                p.hash = Some(hash);
                UNPUSHED.fetch_sub(1, Ordering::AcqRel);
            } else {
                let copy = self.alias_page(i).to_vec();
                self.twins.insert(i, copy.into_boxed_slice());
            }
        }
        Ok(())
    }

    /// Reads pages from the server and installs them (through the alias, so the application never sees
    /// a page half written); stale pages become clean, loose ones stay loose.
    fn fetch(&mut self, remote: &dyn Remote, pages: &[usize]) -> Result<(), CUresult> {
        let mut at = 0;
        while at < pages.len() {
            // One request per frame's worth of bytes.
            let mut bytes = 0usize;
            let mut end = at;
            while end < pages.len() {
                let (from, to) = self.covered(pages[end]);
                if bytes + (to - from) > COPY_CHUNK && end > at {
                    break;
                }
                bytes += to - from;
                end += 1;
            }
            let group = &pages[at..end];
            let ranges = group
                .iter()
                .map(|&i| {
                    let (from, to) = self.covered(i);
                    let page_addr = self.start + i * page_size();
                    MirrorRange {
                        addr: self.server_of(page_addr + from),
                        len: (to - from) as u32,
                        hash: self.pages[i].hash,
                    }
                })
                .collect();
            let (fresh, data) = remote.read(ranges)?;
            if fresh.len() != group.len() {
                return Err(CUresult::UNKNOWN);
            }
            let mut off = 0;
            for (&i, &changed) in group.iter().zip(&fresh) {
                let (from, to) = self.covered(i);
                if changed {
                    let Some(src) = data.get(off..off + (to - from)) else {
                        return Err(CUresult::UNKNOWN);
                    };
                    self.alias_page_mut(i)[from..to].copy_from_slice(src);
                    off += to - from;
                    if self.pages[i].state == State::Loose
                        && let Some(twin) = self.twins.get_mut(&i)
                    {
                        twin[from..to].copy_from_slice(src);
                    }
                }
                let hash = if changed || self.pages[i].hash.is_none() {
                    self.hash_page(i)
                } else {
                    self.pages[i].hash.unwrap_or_default()
                };
                let p = &mut self.pages[i];
                p.hash = Some(hash);
                p.wanted = false;
                if p.state == State::Stale {
                    p.state = State::Clean;
                }
            }
            let now_clean: Vec<usize> = group
                .iter()
                .copied()
                .filter(|&i| self.pages[i].state == State::Clean)
                .collect();
            self.protect_each(&now_clean, libc::PROT_READ);
            at = end;
        }
        Ok(())
    }

    /// Makes clean pages `[i, i + n)` writable, keeping their twins.
    fn make_dirty(&mut self, first: usize, n: usize) {
        let mut made = Vec::new();
        for i in first..(first + n).min(self.npages) {
            if self.pages[i].state != State::Clean {
                continue;
            }
            let twin = self.alias_page(i).to_vec().into_boxed_slice();
            self.twins.insert(i, twin);
            self.pages[i].state = State::Dirty;
            made.push(i);
        }
        UNPUSHED.fetch_add(made.len(), Ordering::AcqRel);
        self.protect_each(&made, libc::PROT_READ | libc::PROT_WRITE);
    }

    /// The device may have written: clean pages become stale; loose and wanted ones are read back now.
    /// The pages of `installing` are left as they are: a copy's read-back installs them next.
    fn invalidate(
        &mut self,
        remote: &dyn Remote,
        installing: Option<&PageSpan>,
    ) -> Result<(), CUresult> {
        if !self.device_writable() {
            return Ok(());
        }
        let installed = self.pages_of(installing);
        let mut stale = Vec::new();
        let mut now = Vec::new();
        for (i, p) in self.pages.iter_mut().enumerate() {
            if installed.contains(&i) {
                continue;
            }
            match p.state {
                State::Clean if p.wanted => now.push(i),
                State::Clean => {
                    p.state = State::Stale;
                    stale.push(i);
                }
                State::Stale if p.wanted => now.push(i),
                State::Loose => now.push(i),
                _ => {}
            }
        }
        self.protect_each(&stale, libc::PROT_NONE);
        self.fetch(remote, &now)
    }
}

/// Sends what is dirty in every mirror, but for the pages of `leaving`.
fn push_all(
    t: &mut Table,
    remote: &dyn Remote,
    leaving: Option<&PageSpan>,
) -> Result<(), CUresult> {
    let mut batch = Batch {
        remote,
        runs: Vec::new(),
        bytes: Vec::new(),
    };
    let quiet = !t.pending();
    for m in t.mirrors.values_mut() {
        let left = m.pages_of(leaving);
        if left.is_empty() {
            m.push(&mut batch, None, quiet)?;
        } else {
            m.push(&mut batch, Some((0, left.start)), quiet)?;
            m.push(&mut batch, Some((left.end, m.npages)), quiet)?;
        }
    }
    batch.send()
}

// --- The hooks the rest of the shim calls -------------------------------------------------------

/// Before device work (a launch, a copy, a forwarded call that may touch memory): dirty pages go to the
/// server first, and the work is noted for the next synchronization.
pub fn before_work() -> Result<(), CUresult> {
    if LIVE.load(Ordering::Acquire) == 0 {
        return Ok(());
    }
    let mut t = table();
    if UNPUSHED.load(Ordering::Acquire) > 0 {
        push_all(&mut t, &*remote(), None)?;
    }
    t.submitted += 1;
    Ok(())
}

/// The work submitted so far: what a full synchronization sent now will have completed.
fn submitted() -> u64 {
    table().submitted
}

/// After a synchronization returned: if device work may have completed since the host last looked, the
/// host's copies become stale. `completes`: the work a full synchronization completed (see
/// [`submitted`]), `None` for a partial one (a stream, an event, a copy). `installing`: pages a copy's
/// read-back installs next, left alone.
fn synced(completes: Option<u64>, installing: Option<&PageSpan>) -> Result<(), CUresult> {
    if LIVE.load(Ordering::Acquire) == 0 {
        return Ok(());
    }
    let remote = remote();
    let mut t = table();
    if !t.pending() {
        return Ok(());
    }
    fault::ensure_handler();
    // Host writes made meanwhile are pushed before the pages are dropped; not those of `installing`,
    // whose read-back was taken before them: a page written since stays dirty and keeps them.
    push_all(&mut t, &*remote, installing)?;
    for m in t.mirrors.values_mut() {
        m.invalidate(&*remote, installing)?;
    }
    if let Some(upto) = completes {
        t.completed = t.completed.max(upto);
    }
    Ok(())
}

/// After a partial synchronization returned (a stream, an event, a synchronous copy): see [`synced`].
pub fn after_sync() -> Result<(), CUresult> {
    synced(None, None)
}

/// After a device-to-host copy into `span`'s mirror returned: as [`after_sync`], leaving the span's pages
/// to [`install_span`].
pub fn after_copy_into(span: &PageSpan) -> Result<(), CUresult> {
    synced(None, Some(span))
}

/// Waits until the legacy stream's work is done (a synchronous copy that the shim turned into a
/// device-side copy of mirrored memory must be complete when it returns, as CUDA's is), then treats that
/// as the synchronization it is.
pub fn complete() -> Result<(), CUresult> {
    // SAFETY: the legacy default stream.
    unsafe { crate::forward::cuStreamSynchronize(std::ptr::null_mut()) }
}

/// A synchronization point reached outside a call (a host callback about to run): as [`after_sync`].
pub fn sync_point() -> Result<(), CUresult> {
    after_sync()
}

/// What a forwarded call is to mirrored memory, by its name.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum CallKind {
    /// Reads state only.
    Query,
    /// May read or write memory on the device.
    Work,
    /// Waits for device work; `true` for the whole context.
    Sync(bool),
}

/// Classifies a listed call by its name.
pub fn classify(name: &str) -> CallKind {
    if name.starts_with("cuCtxSynchronize") {
        CallKind::Sync(true)
    } else if name.contains("Synchronize") || name == "cuStreamQuery" || name == "cuEventQuery" {
        CallKind::Sync(false)
    } else if name.contains("Get") {
        CallKind::Query
    } else {
        CallKind::Work
    }
}

/// Runs `call` (a forwarded call named `name`) with the mirrors kept coherent around it.
pub fn around<T>(name: &str, call: impl FnOnce() -> Result<T, CUresult>) -> Result<T, CUresult> {
    if LIVE.load(Ordering::Acquire) == 0 {
        return call();
    }
    let kind = classify(name);
    if kind == CallKind::Work {
        before_work()?;
    }
    let upto = (kind == CallKind::Sync(true)).then(submitted);
    let out = call()?;
    // In blocking mode (`CUDA_LAUNCH_BLOCKING=1`) work has completed when its call returns.
    let blocking = state::session_if_up().is_some_and(|s| s.client.is_blocking());
    match kind {
        CallKind::Sync(_) => synced(upto, None)?,
        CallKind::Work if blocking => synced(None, None)?,
        _ => {}
    }
    Ok(out)
}

// --- Faults ---------------------------------------------------------------------------------------

/// Pages made writable per write fault.
const WRITE_BLOCK: usize = 16;
/// Pages fetched per fault at first, and at most (a frame's worth).
const FETCH_FIRST: usize = 64;

fn fetch_max() -> usize {
    (COPY_CHUNK / page_size()).max(1)
}

fn resolve(addr: usize, write: bool) {
    let outcome = std::panic::catch_unwind(|| resolve_inner(addr, write));
    if !matches!(outcome, Ok(Ok(()))) {
        // The page must become accessible, or the application would fault forever: it keeps the bytes it
        // has, and the failure (a lost session, a sticky error) is what its CUDA calls report.
        let mut t = table();
        if let Some(m) = t.at_mut(addr) {
            let i = (addr - m.start) / page_size();
            if i >= m.pages.len() {
                return;
            }
            if m.pages[i].state == State::Stale {
                m.pages[i].state = State::Clean;
            }
            m.make_dirty(i, 1);
        }
        if !REPORTED.swap(true, Ordering::AcqRel) {
            fault_message(
                b"gleam: mirrored memory could not be read back from the GPU peer; the host keeps its own copy\n",
            );
        }
    }
}

fn resolve_inner(addr: usize, write: bool) -> Result<(), CUresult> {
    let remote = remote();
    let mut t = table();
    // Freed meanwhile: the access is retried and faults as it should.
    let Some(m) = t.at_mut(addr) else {
        return Ok(());
    };
    let i = (addr - m.start) / page_size();
    match m.pages[i].state {
        // Resolved by an earlier fault of another thread.
        State::Dirty | State::Loose => {}
        // A read-only page faults on writes only.
        State::Clean => m.make_dirty(i, WRITE_BLOCK),
        State::Stale => {
            let window = if i == m.next_fault {
                (m.window * 2).min(fetch_max())
            } else {
                FETCH_FIRST.min(fetch_max())
            };
            let pages: Vec<usize> = (i..(i + window).min(m.npages))
                .take_while(|&j| m.pages[j].state == State::Stale)
                .collect();
            m.window = window;
            m.next_fault = i + pages.len();
            m.fetch(&*remote, &pages)?;
            if write {
                m.make_dirty(i, WRITE_BLOCK);
            }
        }
    }
    Ok(())
}

// --- Creating and freeing mirrors -----------------------------------------------------------------

/// A memfd of `len` bytes with an alias view; `(fd, alias)`.
fn memfd(len: usize) -> Result<(i32, usize), CUresult> {
    // SAFETY: a NUL-terminated name; the flags are valid.
    let fd = unsafe { libc::memfd_create(c"gleam-mirror".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(CUresult::OUT_OF_MEMORY);
    }
    // SAFETY: our own fd.
    if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
        // SAFETY: as above.
        unsafe { libc::close(fd) };
        return Err(CUresult::OUT_OF_MEMORY);
    }
    // SAFETY: a new shared mapping of our memfd, placed by the kernel.
    let alias = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if alias == libc::MAP_FAILED {
        // SAFETY: as above.
        unsafe { libc::close(fd) };
        return Err(CUresult::OUT_OF_MEMORY);
    }
    Ok((fd, alias as usize))
}

fn release(fd: i32, alias: usize, len: usize) {
    // SAFETY: our alias mapping and memfd, no longer referenced.
    unsafe {
        libc::munmap(alias as *mut libc::c_void, len);
        libc::close(fd);
    }
}

/// Why an owned mapping could not be placed.
enum Place {
    /// The address is in use here: ask the server for another allocation.
    Taken,
    Failed(CUresult),
}

/// Maps a new owned mirror's application view at the server's address (inaccessible until fetched).
fn map_owned(addr: usize, len: usize) -> Result<(usize, usize, i32, usize), Place> {
    let page = page_size();
    if addr == 0 || !addr.is_multiple_of(page) {
        return Err(Place::Taken);
    }
    let map_len = len.div_ceil(page) * page;
    let (fd, alias) = memfd(map_len).map_err(Place::Failed)?;
    // SAFETY: a new mapping at a fixed address that must not replace anything (NOREPLACE).
    let view = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            map_len,
            libc::PROT_NONE,
            libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE,
            fd,
            0,
        )
    };
    if view == libc::MAP_FAILED || view as usize != addr {
        if view != libc::MAP_FAILED {
            // An old kernel took the flag as a hint and placed it elsewhere.
            // SAFETY: the mapping just made.
            unsafe { libc::munmap(view, map_len) };
        }
        release(fd, alias, map_len);
        return Err(Place::Taken);
    }
    Ok((addr, map_len, fd, alias))
}

fn insert(t: &mut Table, mut m: Mirror) -> Result<(), CUresult> {
    let Some(slot) = fault::add_range(m.start, m.start + m.map_len(), m.fd) else {
        tracing::error!("too many mirrored allocations at once");
        return Err(CUresult::OUT_OF_MEMORY);
    };
    m.slot = slot;
    t.mirrors.insert(m.start, m);
    LIVE.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

fn server_alloc(kind: MirrorKind, len: usize) -> Result<(u64, u64), CUresult> {
    remote().alloc(kind, len)
}

fn server_free(kind: MirrorKind, addr: u64) {
    remote().free(kind, addr);
}

/// Zero bytes' hash for a page of `n` bytes (what a fresh allocation holds on the emulated device).
fn zero_hash(n: usize) -> [u8; 16] {
    static FULL: OnceLock<[u8; 16]> = OnceLock::new();
    if n == page_size() {
        *FULL.get_or_init(|| mirror_hash(&vec![0u8; n]))
    } else {
        mirror_hash(&vec![0u8; n])
    }
}

/// `cuMemAllocManaged` / `cuMemHostAlloc`: a new allocation mirrored at the server's address.
pub fn alloc(kind: MirrorKind, len: usize, ctx: u64) -> Result<u64, CUresult> {
    if len == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    fault::start(resolve)?;
    // The server's driver carves small allocations out of shared chunks (measured: cudarc's unified
    // memory tests got 8-byte managed allocations 512 bytes apart), but this side maps whole pages: asked
    // for whole pages, the server hands out page-aligned addresses that no two mirrors share.
    let server_len = len.div_ceil(page_size()) * page_size();
    let mut rejected = Vec::new();
    let mut outcome = Err(CUresult::OUT_OF_MEMORY);
    for _ in 0..8 {
        let (server, device) = match server_alloc(kind, server_len) {
            Ok(a) => a,
            Err(err) => {
                outcome = Err(err);
                break;
            }
        };
        match map_owned(server as usize, len) {
            Ok((start, map_len, fd, alias)) => {
                let page = page_size();
                let npages = map_len / page;
                let mut m = Mirror {
                    kind,
                    host: start,
                    len,
                    server,
                    device,
                    ctx,
                    start,
                    npages,
                    alias,
                    fd,
                    slot: 0,
                    pages: Vec::with_capacity(npages),
                    twins: HashMap::new(),
                    window: FETCH_FIRST,
                    next_fault: usize::MAX,
                };
                for i in 0..npages {
                    let (from, to) = m.covered(i);
                    m.pages.push(Page {
                        state: State::Stale,
                        hash: Some(zero_hash(to - from)),
                        wanted: false,
                        advice: Advice::default(),
                    });
                }
                let mut t = table();
                match insert(&mut t, m) {
                    Ok(()) => outcome = Ok(server),
                    Err(err) => {
                        drop(t);
                        // SAFETY: the view just mapped.
                        unsafe { libc::munmap(start as *mut libc::c_void, map_len) };
                        release(fd, alias, map_len);
                        server_free(kind, server);
                        outcome = Err(err);
                    }
                }
                break;
            }
            Err(Place::Taken) => {
                tracing::debug!(
                    addr = server,
                    "the server's address is in use here; asking for another"
                );
                rejected.push(server);
            }
            Err(Place::Failed(err)) => {
                server_free(kind, server);
                outcome = Err(err);
                break;
            }
        }
    }
    for addr in rejected {
        server_free(kind, addr);
    }
    if outcome == Err(CUresult::OUT_OF_MEMORY) {
        tracing::warn!(
            len,
            "could not map mirrored memory at an address the GPU peer offered (in use here)"
        );
    }
    outcome
}

/// Frees the mirror that starts at `host` (`cuMemFree`, `cuMemFreeHost`); `None` if there is none of
/// a matching kind there.
pub fn free(host: u64, host_kind: bool) -> Option<Result<(), CUresult>> {
    let mut t = table();
    let start = t.at(host as usize).map(|m| m.start)?;
    let m = t.mirrors.get(&start)?;
    let matches = m.host == host as usize
        && match m.kind {
            MirrorKind::Managed { .. } => !host_kind,
            MirrorKind::Host { .. } => host_kind,
            MirrorKind::Registered { .. } => false,
        };
    if !matches {
        return None;
    }
    let m = t.mirrors.remove(&start)?;
    drop_mirror(&m);
    drop(t);
    server_free(m.kind, m.server);
    Some(Ok(()))
}

fn drop_mirror(m: &Mirror) {
    let dirty = m.pages.iter().filter(|p| p.state == State::Dirty).count()
        + m.pages.iter().filter(|p| p.state == State::Loose).count();
    UNPUSHED.fetch_sub(dirty, Ordering::AcqRel);
    LIVE.fetch_sub(1, Ordering::AcqRel);
    fault::remove_range(m.slot);
    if !matches!(m.kind, MirrorKind::Registered { .. }) {
        // SAFETY: our own view of the mirror, which the application has freed.
        unsafe { libc::munmap(m.start as *mut libc::c_void, m.map_len()) };
    }
    release(m.fd, m.alias, m.map_len());
}

/// Whether `[start, end)` is private anonymous memory (heap, stack, anonymous mappings): what a
/// registration may take over. File mappings and shared memory keep their semantics only as themselves.
fn anonymous_private(start: usize, end: usize) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let mut covered = start;
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms), Some(_), Some(_), Some(inode)) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            continue;
        };
        if hi <= covered || lo >= end {
            continue;
        }
        if lo > covered || inode != "0" || !perms.contains('p') || !perms.starts_with("rw") {
            return false;
        }
        covered = hi;
        if covered >= end {
            return true;
        }
    }
    covered >= end
}

/// `cuMemHostRegister`: mirrors the application's `[p, p + len)`; returns the device address.
pub fn register(p: u64, len: usize, flags: u32, ctx: u64) -> Result<u64, CUresult> {
    let page = page_size();
    let host = p as usize;
    if host == 0 || len == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let end = host.checked_add(len).ok_or(CUresult::INVALID_VALUE)?;
    let start = host - host % page;
    let map_end = end.div_ceil(page) * page;
    {
        let t = table();
        let overlaps = t
            .mirrors
            .range(..map_end)
            .next_back()
            .is_some_and(|(_, m)| m.start + m.map_len() > start);
        if overlaps {
            tracing::warn!(
                p,
                len,
                "cuMemHostRegister: the range shares pages with memory already registered or mirrored"
            );
            return Err(CUresult::HOST_MEMORY_ALREADY_REGISTERED);
        }
    }
    if !anonymous_private(start, map_end) {
        tracing::warn!(
            p,
            len,
            "cuMemHostRegister: only private anonymous memory (heap, stack, anonymous mappings) can be \
             mirrored to a remote GPU; this range is unmapped, read-only, shared or file-backed"
        );
        return Err(CUresult::NOT_SUPPORTED);
    }
    fault::start(resolve)?;
    let kind = MirrorKind::Registered { flags };
    let (server, device) = server_alloc(kind, len)?;
    let map_len = map_end - start;
    let (fd, alias) = match memfd(map_len) {
        Ok(x) => x,
        Err(err) => {
            server_free(kind, server);
            return Err(err);
        }
    };
    let npages = map_len / page;
    let mut m = Mirror {
        kind,
        host,
        len,
        server,
        device,
        ctx,
        start,
        npages,
        alias,
        fd,
        slot: 0,
        pages: Vec::with_capacity(npages),
        twins: HashMap::new(),
        window: FETCH_FIRST,
        next_fault: usize::MAX,
    };
    // Everything that allocates is done before the pages are protected: while they are, this thread
    // holds the table's lock, and the allocator may touch the pages the range shares with other data.
    let mut loose = Vec::new();
    for i in 0..npages {
        let (from, to) = m.covered(i);
        let shared = from > 0 || to < page;
        m.pages.push(Page {
            state: if shared { State::Loose } else { State::Clean },
            hash: None,
            wanted: false,
            advice: Advice::default(),
        });
        if shared {
            loose.push(i);
            m.twins.insert(i, vec![0u8; page].into_boxed_slice());
        }
    }
    let mut t = table();
    if let Err(err) = insert(&mut t, m) {
        drop(t);
        release(fd, alias, map_len);
        server_free(kind, server);
        return Err(err);
    }
    let undo = |t: &mut MutexGuard<'static, Table>| {
        if let Some(m) = t.mirrors.remove(&start) {
            drop_mirror_registered(&m);
        }
    };
    // Writes by other threads wait (they fault, and the resolver waits for this lock) while the pages
    // move to the memfd; their content stays readable throughout.
    // SAFETY: the application's own pages, checked above to be private anonymous memory; copying them
    // into the memfd through the alias, then moving a view of the memfd over them: the application sees
    // the same bytes at the same addresses throughout.
    let moved = unsafe {
        libc::mprotect(start as *mut libc::c_void, map_len, libc::PROT_READ) == 0 && {
            std::ptr::copy_nonoverlapping(start as *const u8, alias as *mut u8, map_len);
            let view = libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd,
                0,
            );
            view != libc::MAP_FAILED
                && libc::mremap(
                    view,
                    map_len,
                    map_len,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    start as *mut libc::c_void,
                ) != libc::MAP_FAILED
        }
    };
    if !moved {
        // SAFETY: the original pages are still in place (nothing replaced them).
        unsafe {
            libc::mprotect(
                start as *mut libc::c_void,
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
            );
        }
        undo(&mut t);
        drop(t);
        server_free(kind, server);
        return Err(CUresult::INVALID_VALUE);
    }
    let Some(mirror) = t.mirrors.get_mut(&start) else {
        return Err(CUresult::UNKNOWN);
    };
    // Pages shared with other data are never protected. They are writable again before their twins are
    // filled: a twin is heap memory and may itself lie in one of them (a write to a read-only page here
    // would wait for the fault resolver, which waits for the lock this thread holds). A write by another
    // thread before the fill is in the twin and in the first push below, which reads after it.
    mirror.protect_each(&loose, libc::PROT_READ | libc::PROT_WRITE);
    for &i in &loose {
        let page_bytes = mirror.alias_page(i).as_ptr();
        if let Some(twin) = mirror.twins.get_mut(&i) {
            // SAFETY: the alias page and the twin are both `page` bytes, distinct allocations.
            unsafe { std::ptr::copy_nonoverlapping(page_bytes, twin.as_mut_ptr(), page) };
        }
    }
    UNPUSHED.fetch_add(loose.len(), Ordering::AcqRel);
    for i in 0..npages {
        if mirror.pages[i].state == State::Clean {
            mirror.pages[i].hash = Some(mirror.hash_page(i));
        }
    }
    drop(t);
    // The server's copy starts as the application's bytes (read through the alias; a write racing with
    // this faults and is pushed as a difference later).
    let remote = remote();
    let mut batch = Batch {
        remote: &*remote,
        runs: Vec::new(),
        bytes: Vec::new(),
    };
    // SAFETY: the registered range, readable through the alias for as long as the mirror lives.
    let bytes = unsafe { std::slice::from_raw_parts((alias + (host - start)) as *const u8, len) };
    let pushed = batch.add(server, bytes).and_then(|()| batch.send());
    if let Err(err) = pushed {
        let _ = unregister(p);
        return Err(err);
    }
    Ok(device)
}

/// `cuMemHostUnregister`: the application's pages become plain private memory again, holding the latest
/// bytes (what the device wrote included).
pub fn unregister(p: u64) -> Result<(), CUresult> {
    let remote = remote();
    let mut t = table();
    let start = match t.at(p as usize) {
        Some(m) if m.host == p as usize && matches!(m.kind, MirrorKind::Registered { .. }) => {
            m.start
        }
        _ => return Err(CUresult::HOST_MEMORY_NOT_REGISTERED),
    };
    let mut m = t.mirrors.remove(&start).ok_or(CUresult::UNKNOWN)?;
    let stale: Vec<usize> = (0..m.npages)
        .filter(|&i| m.pages[i].state == State::Stale)
        .collect();
    if let Err(err) = m.fetch(&*remote, &stale) {
        tracing::warn!(%err, "cuMemHostUnregister: the device's last writes could not be read back");
    }
    let map_len = m.map_len();
    // SAFETY: block writes while the bytes move back to anonymous memory, then move that over the view.
    unsafe {
        libc::mprotect(start as *mut libc::c_void, map_len, libc::PROT_READ);
        let anon = libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if anon != libc::MAP_FAILED {
            std::ptr::copy_nonoverlapping(m.alias as *const u8, anon.cast::<u8>(), map_len);
            libc::mremap(
                anon,
                map_len,
                map_len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                start as *mut libc::c_void,
            );
        } else {
            // Out of memory: leave the memfd view in place, readable and writable.
            libc::mprotect(
                start as *mut libc::c_void,
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
            );
            m.fd = -1;
        }
    }
    drop_mirror_registered(&m);
    drop(t);
    server_free(m.kind, m.server);
    Ok(())
}

fn drop_mirror_registered(m: &Mirror) {
    let unpushed = m
        .pages
        .iter()
        .filter(|p| matches!(p.state, State::Dirty | State::Loose))
        .count();
    UNPUSHED.fetch_sub(unpushed, Ordering::AcqRel);
    LIVE.fetch_sub(1, Ordering::AcqRel);
    fault::remove_range(m.slot);
    if m.fd >= 0 {
        release(m.fd, m.alias, m.map_len());
    }
}

/// A context lost its memory: its mirrors go (managed and host memory is unmapped, as the driver frees
/// it; registered memory becomes plain memory again with the bytes the host holds).
pub fn context_emptied(ctx: u64) {
    let mut t = table();
    let doomed: Vec<usize> = t
        .mirrors
        .values()
        .filter(|m| m.ctx == ctx)
        .map(|m| m.start)
        .collect();
    for start in doomed {
        let Some(m) = t.mirrors.remove(&start) else {
            continue;
        };
        if matches!(m.kind, MirrorKind::Registered { .. }) {
            // SAFETY: as in `unregister`, without reading anything back (the server's copy is gone).
            unsafe {
                let len = m.map_len();
                let anon = libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                if anon != libc::MAP_FAILED {
                    std::ptr::copy_nonoverlapping(m.alias as *const u8, anon.cast::<u8>(), len);
                    libc::mremap(
                        anon,
                        len,
                        len,
                        libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                        m.start as *mut libc::c_void,
                    );
                }
            }
            drop_mirror_registered(&m);
        } else {
            drop_mirror(&m);
        }
    }
}

// --- Queries and targeted operations ---------------------------------------------------------------

/// The mirror holding `ptr`, by its host address or (registered memory) its device address.
pub fn lookup(ptr: u64) -> Option<MirrorInfo> {
    if LIVE.load(Ordering::Acquire) == 0 {
        return None;
    }
    let t = table();
    let p = ptr as usize;
    if let Some(m) = t.at(p).filter(|m| p >= m.host && p < m.host + m.len) {
        return Some(m.info());
    }
    t.mirrors
        .values()
        .find(|m| ptr >= m.device && ptr < m.device + m.len as u64)
        .map(Mirror::info)
}

/// The mirror holding all of `[ptr, ptr + len)` (host addresses).
pub fn containing(ptr: u64, len: u64) -> Option<MirrorInfo> {
    let m = lookup(ptr)?;
    (ptr >= m.host && ptr.checked_add(len)? <= m.host + m.len).then_some(m)
}

/// Whether `[ptr, ptr + len)` touches mirrored memory at all.
pub fn overlaps(ptr: u64, len: u64) -> bool {
    if LIVE.load(Ordering::Acquire) == 0 || len == 0 {
        return false;
    }
    let t = table();
    let end = ptr.saturating_add(len) as usize;
    t.mirrors
        .range(..end)
        .next_back()
        .is_some_and(|(_, m)| m.start + m.map_len() > ptr as usize)
}

/// Pushes the dirty bytes of `[ptr, ptr + len)` now (`cuMemPrefetchAsync` to the device, or before a
/// device-side copy out of it).
pub fn flush_range(ptr: u64, len: u64) -> Result<(), CUresult> {
    let remote = remote();
    let mut t = table();
    let quiet = !t.pending();
    let Some(m) = t.at_mut(ptr as usize) else {
        return Ok(());
    };
    let page = page_size();
    let lo = (ptr as usize).saturating_sub(m.start) / page;
    let hi = ((ptr + len) as usize - m.start)
        .div_ceil(page)
        .min(m.npages);
    let mut batch = Batch {
        remote: &*remote,
        runs: Vec::new(),
        bytes: Vec::new(),
    };
    m.push(&mut batch, Some((lo, hi)), quiet)?;
    batch.send()
}

/// `cuMemPrefetchAsync` to the CPU: the pages of `[ptr, ptr + len)` are read back now if no device work
/// is outstanding, else at the next synchronization (eagerly, instead of on first touch). Resident pages
/// are made writable too, so that system calls may read and write them.
pub fn prefetch_host(ptr: u64, len: u64) -> Result<(), CUresult> {
    let remote = remote();
    let mut t = table();
    let pending = t.pending();
    let Some(m) = t.at_mut(ptr as usize) else {
        return Ok(());
    };
    let page = page_size();
    let lo = (ptr as usize).saturating_sub(m.start) / page;
    let hi = ((ptr + len) as usize - m.start)
        .div_ceil(page)
        .min(m.npages);
    for p in &mut m.pages[lo..hi] {
        p.wanted = true;
    }
    if !pending {
        let stale: Vec<usize> = (lo..hi)
            .filter(|&i| m.pages[i].state == State::Stale)
            .collect();
        m.fetch(&*remote, &stale)?;
        m.make_dirty(lo, hi - lo);
    }
    Ok(())
}

/// Where a device-to-host copy into one mirror is read back from: the whole pages it touches, clipped to
/// the mirror, out of the server's copy once the copy has written it there. Installed whole
/// ([`install_span`]), they leave no page stale; the copy's bytes alone would leave a partly written
/// page stale, and the next read of it a fault and a round trip (`tensor.item()` reads its scalar through
/// a small page-locked buffer: measured on the emu backend, 431 µs per read-back before, see the commit).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct PageSpan {
    /// First byte, as the application sees it.
    pub host: u64,
    /// Bytes.
    pub len: usize,
    /// The server's device address of `host`.
    pub device: u64,
}

/// The [`PageSpan`] of a copy of `n` bytes into `[dst, dst + n)`, which lies inside one mirror; `None`
/// otherwise, or for an empty copy.
pub fn page_span(dst: u64, n: u64) -> Option<PageSpan> {
    let t = table();
    let m = t.at(dst as usize)?;
    let (mirror_lo, mirror_hi) = (m.host as u64, (m.host + m.len) as u64);
    let end = dst.checked_add(n)?;
    if n == 0 || dst < mirror_lo || end > mirror_hi {
        return None;
    }
    let page = page_size() as u64;
    let lo = (dst / page * page).max(mirror_lo);
    let hi = end.div_ceil(page).saturating_mul(page).min(mirror_hi);
    Some(PageSpan {
        host: lo,
        len: usize::try_from(hi - lo).ok()?,
        device: m.device + (lo - mirror_lo),
    })
}

/// Installs `bytes`, the server's copy of `span` read after a device-to-host copy into `[dst, dst + n)`
/// (which it holds) wrote it, without faults and without pushing them back: pages the host may have
/// written meanwhile (dirty ones) take the copy's bytes only; every other page takes the server's, and a
/// stale one wholly read back becomes clean. `false` if the span is not inside one mirror.
pub fn install_span(span: &PageSpan, bytes: &[u8], dst: u64, n: usize) -> bool {
    let mut t = table();
    let Some(m) = t.at_mut(span.host as usize) else {
        return false;
    };
    let (lo, hi) = (span.host as usize, span.host as usize + span.len);
    let (copy_lo, copy_hi) = (dst as usize, dst as usize + n);
    if lo < m.host || hi > m.host + m.len || bytes.len() != span.len {
        return false;
    }
    let page = page_size();
    let mut at = lo;
    let mut clean = Vec::new();
    while at < hi {
        let i = (at - m.start) / page;
        let page_start = m.start + i * page;
        let upto = (page_start + page).min(hi);
        let state = m.pages[i].state;
        let (from, to) = if state == State::Dirty {
            (at.max(copy_lo), upto.min(copy_hi))
        } else {
            (at, upto)
        };
        if from < to {
            let src = &bytes[from - lo..to - lo];
            let off = from - page_start;
            m.alias_page_mut(i)[off..off + src.len()].copy_from_slice(src);
            if let Some(twin) = m.twins.get_mut(&i) {
                twin[off..off + src.len()].copy_from_slice(src);
            }
        }
        let (covered_from, covered_to) = m.covered(i);
        let whole = from <= page_start + covered_from && to >= page_start + covered_to;
        if state == State::Stale && whole {
            m.pages[i].state = State::Clean;
            clean.push(i);
        }
        if m.pages[i].state == State::Clean {
            m.pages[i].hash = Some(m.hash_page(i));
            m.pages[i].wanted = false;
        }
        at = upto;
    }
    m.protect_each(&clean, libc::PROT_READ);
    true
}

/// Copies `[ptr, ptr + len)` of the application's memory, which may be mirrored, so that the client may
/// read it while holding its own locks (a fault there would wait for the client). Touching it here,
/// holding nothing, lets faults resolve.
///
/// # Safety
/// `ptr` is valid for reads of `len` bytes.
pub unsafe fn staged(ptr: *const u8, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: the caller's buffer of `len` readable bytes (faults on mirrored pages resolve, as no lock
    // is held here).
    unsafe { std::ptr::copy_nonoverlapping(ptr, out.as_mut_ptr(), len) };
    out
}

/// Records advice for `[ptr, ptr + len)`: `f` edits each page's.
pub fn advise(ptr: u64, len: u64, f: impl Fn(&mut Advice)) -> Result<(), CUresult> {
    let mut t = table();
    let m = t
        .at_mut(ptr as usize)
        .filter(|m| ptr as usize >= m.host && (ptr + len) as usize <= m.host + m.len)
        .ok_or(CUresult::INVALID_VALUE)?;
    let page = page_size();
    let lo = (ptr as usize - m.start) / page;
    let hi = ((ptr + len) as usize - m.start).div_ceil(page);
    for p in &mut m.pages[lo..hi] {
        f(&mut p.advice);
    }
    Ok(())
}

/// The advice of every page of `[ptr, ptr + len)`.
pub fn advice(ptr: u64, len: u64) -> Result<Vec<Advice>, CUresult> {
    let t = table();
    let m = t
        .at(ptr as usize)
        .filter(|m| {
            matches!(m.kind, MirrorKind::Managed { .. })
                && ptr as usize >= m.host
                && (ptr + len) as usize <= m.host + m.len
        })
        .ok_or(CUresult::INVALID_VALUE)?;
    let page = page_size();
    let lo = (ptr as usize - m.start) / page;
    let hi = ((ptr + len) as usize - m.start).div_ceil(page);
    Ok(m.pages[lo..hi].iter().map(|p| p.advice).collect())
}

#[cfg(test)]
mod tests;
