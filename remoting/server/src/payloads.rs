//! Host-to-device payloads by content: what a serving peer has been sent once, it is not sent again.
//!
//! A client announces a large copy's payload by its [`Manifest`] ([`Call::UploadBegin`]); [`Payloads`]
//! stages it in a buffer of its length, fills every chunk it can (the peer's content cache, verified;
//! a chunk already received in this session and not yet written there; a repeat of a chunk of the same
//! payload) and says which chunks it lacks. The client sends those, encoded ([`Call::UploadChunk`]); each
//! is decoded, checked against its id and copied into the staging buffer by the session's chunk workers
//! (a few threads), not by the executor: while chunks are decoded and hashed, the executor runs other
//! streams' calls (on the emu backend an 8 MiB chunk held it 4-13 ms). The copy ([`Call::UploadCopy`])
//! waits for its chunks, takes the complete buffer, then hands it to a writer thread that keeps the
//! chunks it received in the content cache, off the session's executor, and recycles the buffer: a
//! received byte is copied once on this side (into staging), never for the cache.
//!
//! Staging is bounded ([`MAX_UPLOAD`] per payload, [`MAX_STAGED`] per session): past it an announcement
//! is refused and the client copies the plain way. The cache is best effort: a store that cannot be
//! opened or written only means that chunks are sent again next time.
//!
//! [`Call::UploadBegin`]: gleam_protocol::wire::Call::UploadBegin
//! [`Call::UploadChunk`]: gleam_protocol::wire::Call::UploadChunk
//! [`Call::UploadCopy`]: gleam_protocol::wire::Call::UploadCopy

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use gleam_cache::{BlobStore, ChunkHeader, Codec, ContentId, Decoder, HEADER_LEN, Manifest};
use gleam_protocol::frame::Pieces;
use gleam_protocol::types::CUresult;
use tracing::{debug, warn};

use crate::images::content_cache;
use crate::staging::{DeviceRead, HostPin, PinAnywhere, StagingBuf};
use crate::workers::Workers;

/// The largest payload one announcement may stage (clients split larger copies).
pub const MAX_UPLOAD: u64 = 256 << 20;
/// What one session may have staged at once.
pub const MAX_STAGED: u64 = 1 << 30;
/// Chunks waiting for the cache writers, at most: past it, copies wait for the disk. 32 chunks of 8 MiB:
/// four 64 MiB segments, the most a client announces at once (a buffer's bytes stay held until its
/// last chunk is written).
const WRITE_QUEUE: usize = 32;
/// Staging buffers kept for reuse (a fresh one costs a page fault per page as it fills, and page-locking
/// it more); at most 4 x 64 MiB held by an idle session: a client keeps a few segments announced ahead
/// of the one it copies.
const POOL: usize = 4;
/// Payloads from this size on are copied from page-locked memory where the backend offers it.
const PIN_FROM: usize = 8 << 20;

/// Page-locks a staging buffer's pages ([`Backend::pin_host`](crate::backend::Backend::pin_host)).
pub type Pinner<'a> = dyn FnMut(&mut [u8]) -> Option<HostPin> + 'a;

/// Whether large uploads are staged in page-locked memory (`GLEAM_UPLOAD_PINNED=off`: never; read once).
fn pinned_staging() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        !std::env::var("GLEAM_UPLOAD_PINNED").is_ok_and(|v| gleam_protocol::tuning::turned_off(&v))
    })
}
/// How long the end of a session waits for the cache writes it queued.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// Told the chunks an announced payload lacks, once the filler has read the store ([`Payloads::begin_then`]).
pub type AnswerLater = Box<dyn FnOnce(Vec<u32>) + Send>;

/// A session's staged uploads and its link to the content cache.
#[derive(Debug)]
pub struct Payloads {
    /// `None` until first needed; `Some(None)` when there is no store.
    store: Option<Option<Arc<BlobStore>>>,
    uploads: HashMap<u64, Staged>,
    staged: u64,
    /// Decodes and checks chunks (started at the first chunk).
    worker: Option<Workers<ChunkJob>>,
    writer: Option<Writer>,
    /// Fills announced payloads from the store (started at the first announcement answered later).
    filler: Option<Workers<FillJob>>,
    /// Staging buffers for reuse.
    pool: Arc<Mutex<Vec<StagingBuf>>>,
}

impl Default for Payloads {
    /// The payloads of a session process, with the process's content cache ([`use_content_cache`]).
    ///
    /// [`use_content_cache`]: crate::images::use_content_cache
    fn default() -> Self {
        Self {
            store: None,
            uploads: HashMap::new(),
            staged: 0,
            worker: None,
            writer: None,
            filler: None,
            pool: Arc::default(),
        }
    }
}

/// One announced payload being staged.
#[derive(Debug)]
struct Staged {
    manifest: Manifest,
    /// Its bytes, shared with the chunk worker while chunks are decoded into it.
    buf: Arc<SharedBuf>,
    /// Per chunk: whether its bytes are in `buf` (or on their way there, in the chunk worker).
    filled: Vec<bool>,
    unfilled: usize,
    /// The chunks decoded from the wire (for the content cache).
    received: Vec<usize>,
    /// Where each chunk that occurs more than once occurs.
    repeats: HashMap<ContentId, Vec<usize>>,
    /// Microseconds the executor waited for room in the chunk workers' queue, for its log line.
    handoff_us: u64,
}

/// A staged payload's bytes, and what the chunk worker has still to do for it.
#[derive(Debug, Default)]
struct SharedBuf {
    bytes: Mutex<StagingBuf>,
    progress: Mutex<Progress>,
    settled: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct Progress {
    /// Chunks handed to the worker and not yet in place.
    pending: usize,
    /// Chunks that were not what the upload announced.
    wrong: Vec<usize>,
    /// Chunks the filler put in place from the store, not yet marked in [`Staged::filled`].
    found: Vec<usize>,
    /// Microseconds the chunk workers spent on this payload: checking chunks (decoding them too, if
    /// compressed), and copying them into place (the buffer's lock included): for its log line.
    check_us: u64,
    place_us: u64,
}

impl Staged {
    fn range(&self, index: usize) -> std::ops::Range<usize> {
        let r = self.manifest.chunk_range(index);
        r.start as usize..r.end as usize
    }

    /// Marks chunk `index` in place (not its repeats).
    fn mark(&mut self, index: usize) {
        if !self.filled[index] {
            self.filled[index] = true;
            self.unfilled -= 1;
        }
    }

    /// Marks what the filler put in place since last asked.
    fn absorb_found(&mut self) {
        let found = std::mem::take(&mut lock(&self.buf.progress).found);
        for index in found {
            self.mark(index);
        }
    }

    /// Chunk `index` is (or is about to be) in place: marks it and every unfilled repeat of it, and
    /// returns where those repeats go (the chunk's bytes are to be copied there).
    fn fill(&mut self, index: usize) -> Vec<Range<usize>> {
        if !self.filled[index] {
            self.filled[index] = true;
            self.unfilled -= 1;
        }
        let id = self.manifest.chunks()[index];
        let Some(repeats) = self.repeats.get(&id).cloned() else {
            return Vec::new();
        };
        let mut to = Vec::new();
        for j in repeats {
            if !self.filled[j] {
                self.filled[j] = true;
                self.unfilled -= 1;
                to.push(self.range(j));
            }
        }
        to
    }
}

/// Copies `bytes[from]` to the start of each range in `to`.
fn copy_repeats(bytes: &mut [u8], from: &Range<usize>, to: &[Range<usize>]) {
    for range in to {
        bytes.copy_within(from.clone(), range.start);
    }
}

impl Payloads {
    /// A session's payloads with `store` as the content cache (`None`: none; chunks are then sent
    /// every time).
    pub fn with_store(store: Option<Arc<BlobStore>>) -> Self {
        Self {
            store: Some(store),
            ..Self::default()
        }
    }

    fn store(&mut self) -> Option<Arc<BlobStore>> {
        self.store.get_or_insert_with(content_cache).clone()
    }

    /// Stages the payload `manifest` (encoded) describes as `upload`, filled from what this peer holds;
    /// returns the indices of the chunks to send (one per distinct missing chunk).
    pub fn begin(&mut self, upload: u64, manifest: &[u8]) -> Result<Vec<u32>, CUresult> {
        // Without a callback the answer is always made here.
        Ok(self
            .begin_then(upload, manifest, None, None)?
            .unwrap_or_default())
    }

    /// [`Payloads::begin`], reading the store off the caller's thread when `answer` is given: then
    /// `Ok(None)` is returned at once and `answer` is told the missing chunks once the filler thread has
    /// read and verified what the store holds (so the session's executor runs other calls, and the
    /// previous segment's copy, meanwhile). The upload's copy waits for that fill. With `pin`, the filler
    /// then page-locks a large staging buffer that the store held whole and that is not locked yet, after
    /// answering (the client's copy is on its way meanwhile), so that the copy finds it locked.
    pub fn begin_then(
        &mut self,
        upload: u64,
        manifest: &[u8],
        answer: Option<AnswerLater>,
        pin: Option<PinAnywhere>,
    ) -> Result<Option<Vec<u32>>, CUresult> {
        let manifest = Manifest::decode(manifest).map_err(|err| {
            debug!(upload, %err, "refused an upload announcement");
            CUresult::INVALID_VALUE
        })?;
        if manifest.len() > MAX_UPLOAD {
            debug!(upload, len = manifest.len(), "refused an oversized upload");
            return Err(CUresult::INVALID_VALUE);
        }
        // A number reused replaces the unfinished upload it named.
        self.forget(upload);
        if self.staged + manifest.len() > MAX_STAGED {
            debug!(
                upload,
                staged = self.staged,
                "too much staged: the client copies this one the plain way"
            );
            return Err(CUresult::OUT_OF_MEMORY);
        }
        let chunks = manifest.chunks().len();
        let len = manifest.len() as usize;
        let buf = self.staging(len);
        let mut places: HashMap<ContentId, Vec<usize>> = HashMap::new();
        for (index, id) in manifest.chunks().iter().enumerate() {
            places.entry(*id).or_default().push(index);
        }
        places.retain(|_, at| at.len() > 1);
        let shared = Arc::new(SharedBuf {
            bytes: Mutex::new(buf),
            ..SharedBuf::default()
        });
        let mut staged = Staged {
            buf: shared.clone(),
            received: Vec::new(),
            repeats: places,
            handoff_us: 0,
            filled: vec![false; chunks],
            unfilled: chunks,
            manifest,
        };
        let mut bytes = lock(&shared.bytes);
        // Chunks received in this session and still on their way to the store.
        if let Some(writer) = &self.writer {
            let queued = writer.queued();
            for index in 0..chunks {
                if staged.filled[index] {
                    continue;
                }
                if let Some((buf, from)) = queued.get(&staged.manifest.chunks()[index]) {
                    let range = staged.range(index);
                    if from.len() == range.len() {
                        bytes[range.clone()].copy_from_slice(&buf[from.clone()]);
                        copy_repeats(&mut bytes[..], &range, &staged.fill(index));
                    }
                }
            }
        }
        let store = if staged.unfilled > 0 {
            self.store()
        } else {
            None
        };
        self.staged += len as u64;
        let (Some(store), Some(answer)) = (store.clone(), answer) else {
            // Answered here: the store (if any) is read on this thread.
            let filling = std::time::Instant::now();
            if let Some(store) = store {
                let wanted: Vec<usize> = (0..chunks).filter(|&i| !staged.filled[i]).collect();
                for index in read_from_store(&store, &staged.manifest, &mut bytes[..], &wanted) {
                    staged.mark(index);
                }
            }
            drop(bytes);
            let missing = missing_chunks(&staged.manifest, &staged.filled);
            log_staged(upload, &staged.manifest, &missing, filling);
            self.uploads.insert(upload, staged);
            return Ok(Some(missing));
        };
        drop(bytes);
        // The fill counts as work in flight on the buffer: the copy settles it first.
        lock(&shared.progress).pending += 1;
        let job = FillJob {
            upload,
            buf: shared,
            manifest: staged.manifest.clone(),
            filled: staged.filled.clone(),
            store,
            answer,
            pin: pin.filter(|_| len >= PIN_FROM && pinned_staging()),
        };
        self.uploads.insert(upload, staged);
        self.filler.get_or_insert_with(fillers).run(job);
        Ok(None)
    }

    /// Hands chunk `index` of `upload` (its wire form, in the pieces the network delivered) to the chunk
    /// worker, which decodes it into place and checks it; what can be refused at once (an unknown upload
    /// or chunk, a malformed header, a raw body of the wrong length) is refused here. The copy fails if
    /// the chunk turns out wrong.
    pub fn chunk(
        &mut self,
        upload: u64,
        index: u32,
        wire: impl Into<Pieces>,
    ) -> Result<(), CUresult> {
        self.chunk_then(upload, index, wire, Settled::none())
    }

    /// [`Payloads::chunk`], and `settled` fires once the chunk is in place or refused (at once when it
    /// is refused on arrival or was already there; else from the chunk worker, after the upload's copy
    /// would find it there).
    pub fn chunk_then(
        &mut self,
        upload: u64,
        index: u32,
        wire: impl Into<Pieces>,
        settled: Settled,
    ) -> Result<(), CUresult> {
        let wire = wire.into();
        let staged = self
            .uploads
            .get_mut(&upload)
            .ok_or(CUresult::INVALID_VALUE)?;
        let index = index as usize;
        if index >= staged.filled.len() {
            return Err(CUresult::INVALID_VALUE);
        }
        staged.absorb_found();
        if staged.filled[index] {
            return Ok(());
        }
        let range = staged.range(index);
        let refuse = |err: &dyn std::fmt::Display| {
            warn!(upload, index, %err, "refused a chunk that is not what the upload announced");
            CUresult::INVALID_VALUE
        };
        let Some(head) = wire.first_chunk::<HEADER_LEN>() else {
            return Err(refuse(&"a chunk shorter than its header"));
        };
        let raw = match ChunkHeader::parse_head(head) {
            Ok(header) if header.codec == Codec::Raw => {
                if wire.len() - HEADER_LEN != range.len() || header.raw_len as usize != range.len()
                {
                    return Err(refuse(&"a raw chunk of the wrong length"));
                }
                Some(HEADER_LEN)
            }
            Ok(header) if header.raw_len as usize == range.len() => None,
            Ok(_) => return Err(refuse(&"a compressed chunk of the wrong length")),
            Err(err) => return Err(refuse(&err)),
        };
        let job = ChunkJob {
            upload,
            buf: staged.buf.clone(),
            index,
            id: staged.manifest.chunks()[index],
            range,
            repeats: staged.fill(index),
            wire,
            raw,
            _settled: settled,
        };
        staged.received.push(index);
        lock(&staged.buf.progress).pending += 1;
        let handing = std::time::Instant::now();
        self.worker.get_or_insert_with(chunk_workers).run(job);
        staged.handoff_us += handing.elapsed().as_micros() as u64;
        Ok(())
    }

    /// Hands the complete payload of `upload` to `copy` (which copies it to the device), then forgets
    /// the upload and keeps the chunks it received in the content cache. Fails without calling `copy`
    /// if the upload is unknown, chunks are still missing, or one was not what was announced.
    pub fn copy(
        &mut self,
        upload: u64,
        copy: impl FnOnce(&[u8]) -> Result<(), CUresult>,
    ) -> Result<(), CUresult> {
        self.copy_page_locked(upload, None, |bytes, _| copy(bytes).map(|()| None))
    }

    /// [`Payloads::copy`], page-locking a large payload's staging buffer first with `pin`
    /// ([`Backend::pin_host`](crate::backend::Backend::pin_host)) unless it is already. `copy` is told
    /// whether the bytes it gets are page-locked, and returns the device's read of them if it may still be
    /// running ([`Backend::device_read`](crate::backend::Backend::device_read)): the buffer is then not
    /// reused before that read ran.
    ///
    /// Why here and not when the buffer is made: by now its pages are resident, faulted in (and zeroed
    /// by the kernel) by the threads that filled it, in parallel; locking a fresh buffer's pages would
    /// fault every one of them on this thread, the session's executor. A buffer stays locked in the pool.
    pub fn copy_page_locked(
        &mut self,
        upload: u64,
        pin: Option<&mut Pinner<'_>>,
        copy: impl FnOnce(&[u8], bool) -> Result<Option<DeviceRead>, CUresult>,
    ) -> Result<(), CUresult> {
        let mut staged = self
            .uploads
            .remove(&upload)
            .ok_or(CUresult::INVALID_VALUE)?;
        self.staged -= staged.manifest.len();
        let settling = std::time::Instant::now();
        let (wrong, check_us, place_us) = staged.buf.settle();
        let settle_us = settling.elapsed().as_micros() as u64;
        staged.absorb_found();
        let mut buf = std::mem::take(&mut *lock(&staged.buf.bytes));
        if staged.unfilled > 0 {
            warn!(
                upload,
                missing = staged.unfilled,
                "an upload was copied before all its chunks arrived"
            );
            self.recycle(buf);
            return Err(CUresult::INVALID_VALUE);
        }
        if !wrong.is_empty() {
            warn!(
                upload,
                ?wrong,
                "refused chunks that are not what the upload announced: the copy fails"
            );
            self.recycle(buf);
            return Err(CUresult::INVALID_VALUE);
        }
        if let Some(pin) =
            pin.filter(|_| buf.len() >= PIN_FROM && !buf.is_pinned() && pinned_staging())
        {
            lock_pages(upload, &mut buf, pin, "copy");
        }
        let copying = std::time::Instant::now();
        let copied = copy(&buf, buf.is_pinned()).map(|read| {
            if let Some(read) = read {
                buf.set_reading(read);
            }
        });
        // Where a payload's time went on this side: the executor's waits (for room in the workers'
        // queue, for the last chunks to be placed), the workers' work, the copy (a page-locking here
        // has its own line, from `lock_pages`).
        debug!(
            upload,
            bytes = buf.len(),
            received = staged.received.len(),
            handoff_us = staged.handoff_us,
            settle_us,
            check_us,
            place_us,
            copy_us = copying.elapsed().as_micros() as u64,
            "upload copied"
        );
        let received: Vec<(ContentId, Range<usize>)> = staged
            .received
            .iter()
            .map(|&i| (staged.manifest.chunks()[i], staged.range(i)))
            .collect();
        match self.store() {
            Some(store) if !received.is_empty() => {
                let pool = self.pool.clone();
                self.writer
                    .get_or_insert_with(|| Writer::start(store, pool))
                    .put(buf, received);
            }
            _ => self.recycle(buf),
        }
        copied
    }

    /// Forgets `upload` without copying it (its copy will not run).
    pub fn discard(&mut self, upload: u64) {
        if let Some(old) = self.uploads.remove(&upload) {
            self.staged -= old.manifest.len();
            // The worker may still have chunks of it: they find the buffer gone and stop.
            let buf = std::mem::take(&mut *lock(&old.buf.bytes));
            self.recycle(buf);
        }
    }

    /// Keeps `buf` for reuse if it is among the [`POOL`] largest buffers at hand.
    fn recycle(&self, buf: StagingBuf) {
        let mut pool = lock(&self.pool);
        pool.push(buf);
        keep_largest(&mut pool);
    }

    /// A staging buffer of `len` bytes: the smallest pooled one that holds it, else a fresh one (its
    /// pages are faulted in as it is filled; [`Payloads::copy_page_locked`] locks it).
    fn staging(&mut self, len: usize) -> StagingBuf {
        let mut pool = lock(&self.pool);
        // The writer thread returns every buffer it took: the surplus goes here, on this thread (the one
        // the backend's context is current on, where a page-locked buffer is unlocked).
        keep_largest(&mut pool);
        let fits = (0..pool.len())
            .filter(|&i| pool[i].capacity() >= len)
            .min_by_key(|&i| pool[i].capacity());
        if let Some(i) = fits {
            // Needs no clearing: every chunk is written before the copy. Its last copy may still be
            // reading it (a stream's copy from page-locked memory): waited for here, on this thread,
            // with the pool free for the writer.
            let mut buf = pool.swap_remove(i);
            drop(pool);
            buf.settle();
            buf.set_len(len);
            return buf;
        }
        StagingBuf::zeroed(len)
    }

    /// Drops every unfinished upload and waits (boundedly) until the queued chunks are in the content
    /// cache, so that the client's next session finds them.
    pub fn finish(&mut self) {
        self.uploads.clear();
        self.staged = 0;
        if let Some(writer) = &self.writer {
            writer.flush(FLUSH_TIMEOUT);
        }
    }

    fn forget(&mut self, upload: u64) {
        self.discard(upload);
    }
}

impl SharedBuf {
    /// One piece of work in flight on this payload is done.
    fn done_one(&self) {
        lock(&self.progress).pending -= 1;
        self.settled.notify_all();
    }

    /// Waits until the chunk worker is done with this payload; returns the chunks that were wrong,
    /// and the workers' time on it (checking, placing; microseconds).
    fn settle(&self) -> (Vec<usize>, u64, u64) {
        let mut progress = lock(&self.progress);
        while progress.pending > 0 {
            progress = self
                .settled
                .wait(progress)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        let wrong = std::mem::take(&mut progress.wrong);
        (wrong, progress.check_us, progress.place_us)
    }
}

/// Drops the smallest pooled buffers past [`POOL`]. The largest are kept: a copy's first segments are
/// small (the client doubles them up to 64 MiB) and the rest large; a pool that kept the first buffers it
/// got would hold buffers too small for the later segments, and each of those would be a fresh buffer
/// (faulted in as it fills, then page-locked: 3-20 ms per 64 MiB on the H200 host).
fn keep_largest(pool: &mut Vec<StagingBuf>) {
    while pool.len() > POOL {
        let smallest = (0..pool.len()).min_by_key(|&i| pool[i].capacity());
        smallest.map(|i| pool.swap_remove(i));
    }
}

/// One chunk for the worker: its wire form, where it goes, and what it must hash to.
struct ChunkJob {
    upload: u64,
    buf: Arc<SharedBuf>,
    index: usize,
    id: ContentId,
    range: Range<usize>,
    /// Where its repeats go once it is in place.
    repeats: Vec<Range<usize>>,
    /// As the network delivered it: a raw body is hashed and placed from its pieces, never gathered.
    wire: Pieces,
    /// A raw chunk's body offset (`None`: compressed, decoded and checked by the decoder).
    raw: Option<usize>,
    /// Fires when the job is dropped: after [`place`] has counted it.
    _settled: Settled,
}

/// What to do once a chunk is in place (or refused): fires once, when dropped, so also when a worker
/// drops a job it could not run. The session process marks the chunk's request as run then, not when the
/// executor handed it over: the copy that waits for the chunk becomes ready only when it would not wait,
/// and the executor runs other streams' calls meanwhile.
#[derive(Default)]
pub struct Settled(Option<Box<dyn FnOnce() + Send>>);

impl Settled {
    /// Runs `then` when dropped.
    pub fn new(then: impl FnOnce() + Send + 'static) -> Self {
        Self(Some(Box::new(then)))
    }

    /// Nothing to do.
    pub fn none() -> Self {
        Self(None)
    }
}

impl std::fmt::Debug for Settled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Settled").field(&self.0.is_some()).finish()
    }
}

impl Drop for Settled {
    fn drop(&mut self) {
        if let Some(then) = self.0.take() {
            then();
        }
    }
}

/// Chunks queued for the chunk workers at most (8 MiB each): a client sending faster than the workers
/// keep up waits (its chunks' bytes are held here until then).
const CHUNK_QUEUE: usize = 4;
/// Chunk workers at most (fewer on a smaller machine): a raw chunk's hash runs at a few GB/s per core.
const CHUNK_THREADS: usize = 4;

/// The session's chunk workers: decode chunks and check them against their ids, off the executor, then
/// copy them into their staging buffers. Each works on its own chunk: hashing and decompressing are done
/// outside the buffer's lock, which is held only for the copy into place.
fn chunk_workers() -> Workers<ChunkJob> {
    Workers::start(
        "gleam-chunks",
        gleam_cache::parallel::cores().min(CHUNK_THREADS),
        CHUNK_QUEUE,
        || (Decoder::new(), Scratch::default()),
        |(decoder, scratch), job| place(decoder, scratch, &job),
    )
}

/// A chunk worker's buffers, kept between chunks (warm: no page faults per chunk).
#[derive(Default)]
struct Scratch {
    /// A compressed chunk's wire form in one slice.
    wire: Vec<u8>,
    /// Its decoded bytes.
    decoded: Vec<u8>,
}

/// A checked chunk's bytes, as [`place`] copies them into place.
enum Body<'a> {
    /// A raw chunk's wire pieces, from byte `from` on.
    Raw { from: usize },
    /// A compressed chunk, decoded.
    Decoded(&'a [u8]),
}

/// Decodes one chunk, checks it, and copies it into place; then tells whoever waits for its upload.
fn place(decoder: &mut Decoder, scratch: &mut Scratch, job: &ChunkJob) {
    // Whatever happens, the copy waiting for this chunk must hear of it: a panic counts as a wrong chunk.
    let checking = std::time::Instant::now();
    let mut placing = None;
    let right = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // Outside the buffer's lock: other workers place other chunks of the same upload meanwhile.
        // A raw body goes into place from the wire's pieces (from where it starts); a compressed one is
        // decoded first.
        let body = match job.raw {
            Some(at) => {
                if ContentId::of_parts(job.wire.iter_from(at)) != job.id {
                    return false;
                }
                Body::Raw { from: at }
            }
            None => {
                let wire = match job.wire.as_contiguous() {
                    Some(wire) => wire,
                    None => {
                        job.wire.gather_into(&mut scratch.wire);
                        &scratch.wire
                    }
                };
                // The length was checked against the header on arrival.
                scratch.decoded.resize(job.range.len(), 0);
                match decoder.decode_into(&job.id, wire, &mut scratch.decoded) {
                    Ok(()) => Body::Decoded(&scratch.decoded),
                    Err(err) => {
                        warn!(upload = job.upload, index = job.index, %err, "refused a chunk that is not what the upload announced");
                        return false;
                    }
                }
            }
        };
        placing = Some(std::time::Instant::now());
        let mut bytes = lock(&job.buf.bytes);
        // A buffer taken away (the upload was discarded or replaced) is not written.
        if bytes.len() >= job.range.end {
            let place = &mut bytes[job.range.clone()];
            // Either has the range's length: checked on arrival (raw) or decoded (compressed).
            match body {
                Body::Raw { from } => {
                    job.wire.copy_from_to(from, place);
                }
                Body::Decoded(decoded) => place.copy_from_slice(decoded),
            }
            copy_repeats(&mut bytes[..], &job.range, &job.repeats);
        }
        true
    }))
    .unwrap_or(false);
    let done = std::time::Instant::now();
    let placed_from = placing.unwrap_or(done);
    let mut progress = lock(&job.buf.progress);
    progress.check_us += placed_from.duration_since(checking).as_micros() as u64;
    progress.place_us += done.duration_since(placed_from).as_micros() as u64;
    progress.pending -= 1;
    if !right {
        progress.wrong.push(job.index);
    }
    drop(progress);
    job.buf.settled.notify_all();
}

/// The chunks to ask for: the first place of each distinct id not in place.
fn missing_chunks(manifest: &Manifest, filled: &[bool]) -> Vec<u32> {
    let mut asked = std::collections::HashSet::new();
    manifest
        .chunks()
        .iter()
        .enumerate()
        .filter(|&(index, id)| !filled[index] && asked.insert(*id))
        .map(|(index, _)| index as u32)
        .collect()
}

/// Reads the chunks `wanted` from the store into `bytes` (each distinct id once, in parallel, every one
/// verified), copying each one found to its other places in `wanted`; returns every index of `wanted`
/// now in place. A store that fails to read only means the chunks are asked for.
fn read_from_store(
    store: &BlobStore,
    manifest: &Manifest,
    bytes: &mut [u8],
    wanted: &[usize],
) -> Vec<usize> {
    let mut first: HashMap<ContentId, usize> = HashMap::new();
    let (mut distinct, mut repeats) = (Vec::new(), Vec::new());
    for &index in wanted {
        match first.entry(manifest.chunks()[index]) {
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(index);
                distinct.push(index);
            }
            std::collections::hash_map::Entry::Occupied(e) => repeats.push((*e.get(), index)),
        }
    }
    let found = match store.read_chunks(manifest, bytes, &distinct) {
        Ok(found) => found,
        Err(err) => {
            warn!(%err, "content cache read failed: the client sends the chunks");
            return Vec::new();
        }
    };
    let range = |index: usize| {
        let r = manifest.chunk_range(index);
        r.start as usize..r.end as usize
    };
    let mut placed = found.clone();
    let found: std::collections::HashSet<usize> = found.into_iter().collect();
    for (from, to) in repeats {
        if found.contains(&from) {
            copy_repeats(bytes, &range(from), &[range(to)]);
            placed.push(to);
        }
    }
    placed
}

/// The debug line of an announcement answered: how long filling it from the store took.
fn log_staged(upload: u64, manifest: &Manifest, missing: &[u32], filling: std::time::Instant) {
    debug!(
        upload,
        bytes = manifest.len(),
        chunks = manifest.chunks().len(),
        missing = missing.len(),
        fill_us = filling.elapsed().as_micros() as u64,
        "upload staged"
    );
}

/// One announced payload for the filler: what is in place already, and whom to tell what is missing.
struct FillJob {
    upload: u64,
    buf: Arc<SharedBuf>,
    manifest: Manifest,
    filled: Vec<bool>,
    store: Arc<BlobStore>,
    answer: AnswerLater,
    /// Page-locks the staging buffer once the answer is out.
    pin: Option<PinAnywhere>,
}

/// Announcements queued for the fillers at most (a client keeps a few ahead; more wait on the executor).
const FILL_QUEUE: usize = 4;
/// Payloads filled at once at most: each fill reads and verifies its chunks on as many threads, so two
/// keep a machine of 16 cores busy with 64 MiB segments of 8 MiB chunks.
const FILL_THREADS: usize = 2;

/// The session's fillers: read announced payloads' chunks from the content cache into their staging
/// buffers (verifying each, on every core), off the executor.
fn fillers() -> Workers<FillJob> {
    Workers::start(
        "gleam-fill",
        gleam_cache::parallel::cores().min(FILL_THREADS),
        FILL_QUEUE,
        || (),
        |(), job| fill(job),
    )
}

/// Fills one payload from the store, records what it placed, then answers.
fn fill(job: FillJob) {
    let FillJob {
        upload,
        buf,
        manifest,
        mut filled,
        store,
        answer,
        pin,
    } = job;
    let started = std::time::Instant::now();
    let wanted: Vec<usize> = (0..filled.len()).filter(|&i| !filled[i]).collect();
    // A panic counts as nothing found: the chunks are asked for, and the answer still goes out.
    let placed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut bytes = lock(&buf.bytes);
        // A buffer taken away (the upload was discarded or replaced) is not filled.
        if bytes.len() as u64 != manifest.len() {
            return Vec::new();
        }
        read_from_store(&store, &manifest, &mut bytes[..], &wanted)
    }))
    .unwrap_or_default();
    for &index in &placed {
        filled[index] = true;
    }
    let missing = missing_chunks(&manifest, &filled);
    log_staged(upload, &manifest, &missing, started);
    lock(&buf.progress).found.extend(placed);
    // The locking counts as work in flight on the buffer, as the fill did: the copy waits for it. Done
    // when this guard goes, whatever happens in between.
    let done = DoneOne(&buf);
    // Only a payload the store held whole: its pages are resident (the fill wrote them all), so locking
    // costs 3-6 ms per 64 MiB (H200). A payload still to arrive would have every page faulted in by the
    // locking, on this thread (16-32 ms measured), with the buffer's lock held: the chunk workers wait,
    // then the executor waits for room in their queue. Such a buffer is locked at its copy, once filled.
    let Some(pin) = pin.filter(|_| missing.is_empty()) else {
        drop(done);
        answer(missing);
        return;
    };
    answer(missing);
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut bytes = lock(&buf.bytes);
        // Taken away meanwhile, or a pooled buffer (locked already).
        if bytes.len() as u64 != manifest.len() || bytes.is_pinned() {
            return;
        }
        lock_pages(upload, &mut bytes, |pages| pin(pages), "filler");
    }));
    drop(done);
}

/// Page-locks `buf` with `pin`, and logs what that cost; `by`: who locked it (the filler, or the copy
/// on the executor).
fn lock_pages(
    upload: u64,
    buf: &mut StagingBuf,
    pin: impl FnOnce(&mut [u8]) -> Option<HostPin>,
    by: &'static str,
) {
    let locking = std::time::Instant::now();
    if let Some(locked) = pin(buf.pages_mut()) {
        buf.set_pin(locked);
    }
    debug!(
        upload,
        by,
        capacity = buf.capacity(),
        pinned = buf.is_pinned(),
        lock_us = locking.elapsed().as_micros() as u64,
        "staging page-locked"
    );
}

/// Marks one piece of work on a payload done when dropped ([`SharedBuf::done_one`]).
struct DoneOne<'a>(&'a SharedBuf);

impl Drop for DoneOne<'_> {
    fn drop(&mut self) {
        self.0.done_one();
    }
}

/// The threads that write received chunks to the content cache, off the session's executor (a commit
/// costs a file write and an fsync), then return their staging buffers to the pool. Several, each on
/// its own chunk: a disk takes several syncs at once far faster than one after another (8 MiB blobs on
/// the development VM: 343 MiB/s from one thread, 867 MiB/s from four), and a copy waits for the
/// writers once [`WRITE_QUEUE`] chunks are queued.
#[derive(Debug)]
struct Writer {
    threads: Workers<Job>,
    /// Chunks queued and not yet committed, by id: where they are. Empty once everything queued is in
    /// the store (or failed to be): [`Writer::flush`] waits for that.
    queued: Arc<(Mutex<Queued>, Condvar)>,
}

type Queued = HashMap<ContentId, (Arc<StagingBuf>, Range<usize>)>;

/// Store this chunk of this buffer (the buffer goes back to the pool with its last chunk).
struct Job(Arc<StagingBuf>, ContentId, Range<usize>);

/// Cache writer threads at most (fewer on a smaller machine).
const WRITE_THREADS: usize = 4;

impl Writer {
    fn start(store: Arc<BlobStore>, pool: Arc<Mutex<Vec<StagingBuf>>>) -> Self {
        let queued = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
        let threads = {
            let queued = queued.clone();
            Workers::start(
                "gleam-cache-writer",
                gleam_cache::parallel::cores().min(WRITE_THREADS),
                WRITE_QUEUE,
                || (),
                move |(), job| write(&store, &queued, &pool, job),
            )
        };
        Self { threads, queued }
    }

    fn queued(&self) -> MutexGuard<'_, Queued> {
        lock(&self.queued.0)
    }

    fn put(&self, buf: StagingBuf, chunks: Vec<(ContentId, Range<usize>)>) {
        let buf = Arc::new(buf);
        {
            let mut queued = self.queued();
            for (id, range) in &chunks {
                queued.insert(*id, (buf.clone(), range.clone()));
            }
        }
        for (id, range) in chunks {
            self.threads.run(Job(buf.clone(), id, range));
        }
    }

    /// Waits (at most `timeout`) until every chunk queued so far is in the store.
    fn flush(&self, timeout: Duration) {
        let (queued, written) = &*self.queued;
        let (guard, waited) = written
            .wait_timeout_while(lock(queued), timeout, |queued| !queued.is_empty())
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        drop(guard);
        if waited.timed_out() {
            warn!("the content cache writers did not finish in time");
        }
    }
}

fn write(
    store: &BlobStore,
    queued: &(Mutex<Queued>, Condvar),
    pool: &Mutex<Vec<StagingBuf>>,
    Job(buf, id, range): Job,
) {
    if let Err(err) = store.put_verified(id, &buf[range]) {
        warn!(%id, %err, "cannot keep a chunk in the content cache");
    }
    let (queued, written) = queued;
    let mut queued = lock(queued);
    // Unless a later upload queued the same chunk again.
    if queued
        .get(&id)
        .is_some_and(|(theirs, _)| Arc::ptr_eq(theirs, &buf))
    {
        queued.remove(&id);
    }
    // The buffer's last chunk: back to the pool, before a flush may see the queue empty. Which buffers
    // stay is decided on the executor (`Payloads::staging`, `keep_largest`), where a page-locked one is
    // also unlocked.
    if let Ok(buf) = Arc::try_unwrap(buf) {
        lock(pool).push(buf);
    }
    if queued.is_empty() {
        written.notify_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use gleam_cache::{Compression, Encoder};

    fn data(len: usize, seed: u64) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect()
    }

    /// How an announcement is answered: on the caller's thread, or by the filler thread.
    #[derive(Clone, Copy, Debug)]
    enum Answering {
        Now,
        Later,
    }
    use Answering::{Later, Now};

    /// Announces `bytes` and waits for the answer: the chunks to send.
    fn announce(payloads: &mut Payloads, id: u64, manifest: &Manifest, how: Answering) -> Vec<u32> {
        match how {
            Now => payloads.begin(id, &manifest.encode()).unwrap(),
            Later => {
                let (tx, rx) = std::sync::mpsc::channel();
                let answer: AnswerLater = Box::new(move |missing| tx.send(missing).unwrap());
                match payloads
                    .begin_then(id, &manifest.encode(), Some(answer), None)
                    .unwrap()
                {
                    Some(missing) => missing,
                    None => rx.recv_timeout(Duration::from_secs(10)).unwrap(),
                }
            }
        }
    }

    /// Sends what `payloads` asks for, as a client does; returns the chunks sent and the payload.
    fn upload_as(
        how: Answering,
        payloads: &mut Payloads,
        id: u64,
        bytes: &[u8],
        chunk: u32,
    ) -> (Vec<u32>, Vec<u8>) {
        let manifest = Manifest::with_chunk_size(bytes, chunk);
        let missing = announce(payloads, id, &manifest, how);
        send_chunks(
            payloads,
            id,
            &manifest,
            bytes,
            &missing,
            Compression::default(),
        );
        let mut got = Vec::new();
        payloads
            .copy(id, |bytes| {
                got = bytes.to_vec();
                Ok(())
            })
            .unwrap();
        (missing, got)
    }

    /// Sends chunks `indices` of `bytes` (announced as `manifest`) for upload `id`, as a client does.
    fn send_chunks(
        payloads: &mut Payloads,
        id: u64,
        manifest: &Manifest,
        bytes: &[u8],
        indices: &[u32],
        compression: Compression,
    ) {
        let mut encoder = Encoder::new(compression);
        for &index in indices {
            let r = manifest.chunk_range(index as usize);
            let wire = encoder
                .encode(&bytes[r.start as usize..r.end as usize])
                .to_wire();
            payloads.chunk(id, index, Bytes::from(wire)).unwrap();
        }
    }

    fn upload(payloads: &mut Payloads, id: u64, bytes: &[u8], chunk: u32) -> (Vec<u32>, Vec<u8>) {
        upload_as(Now, payloads, id, bytes, chunk)
    }

    #[test]
    fn the_cache_writers_keep_every_received_chunk_and_a_flush_waits_for_them() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(BlobStore::open(dir.path(), 1 << 30).unwrap());
        let mut payloads = Payloads::with_store(Some(store.clone()));
        // More chunks than the writers' queue holds, so that copies also wait for room.
        let uploads: Vec<Vec<u8>> = (0..12).map(|i| data(16 * 4096, 100 + i)).collect();
        for (i, bytes) in uploads.iter().enumerate() {
            let (missing, got) = upload(&mut payloads, i as u64, bytes, 4096);
            assert_eq!(missing.len(), 16);
            assert_eq!(&got, bytes);
        }
        payloads.finish();
        assert!(payloads.writer.as_ref().unwrap().queued().is_empty());
        for bytes in &uploads {
            for id in Manifest::with_chunk_size(bytes, 4096).chunks() {
                assert!(store.contains(id), "chunk {id} was not kept");
            }
        }
        // Every buffer the writers held came back (the pool is trimmed on the executor's next take).
        assert!(!lock(&payloads.pool).is_empty());
        let held = lock(&payloads.pool)
            .iter()
            .all(|buf| buf.capacity() >= 16 * 4096);
        assert!(held);
    }

    #[test]
    fn a_second_upload_of_the_same_bytes_sends_nothing() {
        for how in [Now, Later] {
            let dir = tempfile::tempdir().unwrap();
            let store = Arc::new(BlobStore::open(dir.path(), 1 << 30).unwrap());
            let bytes = data(10_000, 1);
            let mut first = Payloads::with_store(Some(store.clone()));
            let (sent, got) = upload_as(how, &mut first, 1, &bytes, 1024);
            assert_eq!(sent.len(), 10);
            assert_eq!(got, bytes);
            // Within the session (the writes may still be queued) and in another session after them.
            let (sent, got) = upload_as(how, &mut first, 2, &bytes, 1024);
            assert!(sent.is_empty(), "{sent:?}");
            assert_eq!(got, bytes);
            first.finish();
            let mut second = Payloads::with_store(Some(store));
            let (sent, got) = upload_as(how, &mut second, 1, &bytes, 1024);
            assert!(sent.is_empty());
            assert_eq!(got, bytes);
        }
    }

    #[test]
    fn a_changed_chunk_is_the_only_one_sent_and_repeats_are_sent_once() {
        for how in [Now, Later] {
            let dir = tempfile::tempdir().unwrap();
            let store = Arc::new(BlobStore::open(dir.path(), 1 << 30).unwrap());
            let mut payloads = Payloads::with_store(Some(store));
            let mut bytes = data(8192, 2);
            upload_as(how, &mut payloads, 1, &bytes, 1024);
            bytes[5000] ^= 1;
            let (sent, got) = upload_as(how, &mut payloads, 2, &bytes, 1024);
            assert_eq!(sent, vec![4]);
            assert_eq!(got, bytes);
            // Eight equal chunks: one is asked for, the others filled from it.
            let same = data(1024, 3).repeat(8);
            let (sent, got) = upload_as(how, &mut payloads, 3, &same, 1024);
            assert_eq!(sent, vec![0]);
            assert_eq!(got, same);
        }
    }

    #[test]
    fn each_chunk_says_once_when_it_is_in_place_or_refused() {
        use std::sync::mpsc::channel;
        let mut payloads = Payloads::with_store(None);
        let bytes = data(4096, 5);
        let manifest = Manifest::with_chunk_size(&bytes, 1024);
        assert_eq!(
            payloads.begin(9, &manifest.encode()).unwrap(),
            vec![0, 1, 2, 3]
        );
        let mut encoder = Encoder::new(Compression::OFF);
        let (told, heard) = channel();
        let settled = |seq: u64| {
            let told = told.clone();
            Settled::new(move || told.send(seq).unwrap())
        };
        let wire = |i: usize, encoder: &mut Encoder| {
            Bytes::from(encoder.encode(&bytes[i * 1024..(i + 1) * 1024]).to_wire())
        };
        for i in 0..4 {
            let chunk = wire(i, &mut encoder);
            payloads
                .chunk_then(9, i as u32, chunk, settled(10 + i as u64))
                .unwrap();
        }
        // A repeat of a placed chunk, and a chunk refused on arrival: told at once.
        payloads
            .chunk_then(9, 0, wire(0, &mut encoder), settled(20))
            .ok();
        assert_eq!(
            payloads.chunk_then(9, 9, Bytes::from_static(b"junk"), settled(21)),
            Err(CUresult::INVALID_VALUE)
        );
        let mut seqs: Vec<u64> = (0..6)
            .map(|_| heard.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        seqs.sort_unstable();
        assert_eq!(seqs, [10, 11, 12, 13, 20, 21]);
        assert!(heard.try_recv().is_err(), "each is told once");
        // Everything told is in place: the copy finds the payload whole.
        let mut got = Vec::new();
        payloads
            .copy(9, |b| {
                got = b.to_vec();
                Ok(())
            })
            .unwrap();
        assert_eq!(got, bytes);
    }

    #[test]
    fn corrupt_or_foreign_chunks_are_refused_and_the_copy_fails() {
        let mut payloads = Payloads::with_store(None);
        let bytes = data(4096, 4);
        let manifest = Manifest::with_chunk_size(&bytes, 1024);
        assert_eq!(
            payloads.begin(7, &manifest.encode()).unwrap(),
            vec![0, 1, 2, 3]
        );
        let mut encoder = Encoder::new(Compression::OFF);
        // Chunk 1's bytes sent as chunk 0: accepted raw, found out at the copy.
        let wire =
            |bytes: &[u8], encoder: &mut Encoder| Bytes::from(encoder.encode(bytes).to_wire());
        let wrong = wire(&bytes[1024..2048], &mut encoder);
        assert_eq!(payloads.chunk(7, 0, wrong.clone()), Ok(()));
        for i in 1..4 {
            let right = wire(&bytes[i * 1024..(i + 1) * 1024], &mut encoder);
            payloads.chunk(7, i as u32, right).unwrap();
        }
        assert_eq!(
            payloads.copy(7, |_| panic!("a wrong chunk was copied")),
            Err(CUresult::INVALID_VALUE)
        );
        // Compressed chunks are checked by the worker as they are decoded: found out at the copy too.
        payloads.begin(7, &manifest.encode()).unwrap();
        let squeezed = Encoder::new(Compression::default())
            .encode_as(&bytes[1024..2048], Codec::Zstd)
            .to_wire();
        assert_eq!(payloads.chunk(7, 0, Bytes::from(squeezed)), Ok(()));
        for i in 1..4 {
            let right = wire(&bytes[i * 1024..(i + 1) * 1024], &mut encoder);
            payloads.chunk(7, i as u32, right).unwrap();
        }
        assert_eq!(
            payloads.copy(7, |_| panic!("a wrong compressed chunk was copied")),
            Err(CUresult::INVALID_VALUE)
        );
        // Lengths, headers and numbers are refused at once.
        payloads.begin(7, &manifest.encode()).unwrap();
        assert_eq!(
            payloads.chunk(7, 0, wrong.slice(..500)),
            Err(CUresult::INVALID_VALUE)
        );
        assert_eq!(
            payloads.chunk(7, 0, Bytes::from_static(b"junk")),
            Err(CUresult::INVALID_VALUE)
        );
        assert_eq!(
            payloads.chunk(7, 9, wrong.clone()),
            Err(CUresult::INVALID_VALUE)
        );
        assert_eq!(payloads.chunk(8, 0, wrong), Err(CUresult::INVALID_VALUE));
        assert_eq!(
            payloads.copy(7, |_| panic!("an incomplete upload was copied")),
            Err(CUresult::INVALID_VALUE)
        );
        assert_eq!(payloads.staged, 0);
        assert_eq!(
            payloads.begin(1, b"not a manifest"),
            Err(CUresult::INVALID_VALUE)
        );
    }

    #[test]
    fn a_discarded_upload_with_chunks_in_the_worker_is_dropped_cleanly() {
        let mut payloads = Payloads::with_store(None);
        let bytes = data(64 << 10, 9);
        let manifest = Manifest::with_chunk_size(&bytes, 1024);
        payloads.begin(3, &manifest.encode()).unwrap();
        let mut encoder = Encoder::new(Compression::default());
        for i in 0..64 {
            let wire = encoder.encode(&bytes[i * 1024..(i + 1) * 1024]).to_wire();
            payloads.chunk(3, i as u32, Bytes::from(wire)).unwrap();
        }
        // Replaced while the worker may still be decoding into it: the new one is whole and right.
        payloads.begin(3, &manifest.encode()).unwrap();
        for i in 0..64 {
            let wire = encoder.encode(&bytes[i * 1024..(i + 1) * 1024]).to_wire();
            payloads.chunk(3, i as u32, Bytes::from(wire)).unwrap();
        }
        let mut got = Vec::new();
        payloads
            .copy(3, |b| {
                got = b.to_vec();
                Ok(())
            })
            .unwrap();
        assert_eq!(got, bytes);
        assert_eq!(payloads.staged, 0);
    }

    #[test]
    fn a_corrupt_blob_in_the_store_is_asked_for_again() {
        for how in [Now, Later] {
            let dir = tempfile::tempdir().unwrap();
            let store = Arc::new(BlobStore::open(dir.path(), 1 << 30).unwrap());
            let bytes = data(4096, 5);
            let mut first = Payloads::with_store(Some(store.clone()));
            upload_as(how, &mut first, 1, &bytes, 1024);
            first.finish();
            // Flip a byte of chunk 2's file.
            let id = ContentId::of(&bytes[2048..3072]).to_hex();
            let path = dir.path().join("blobs").join(&id[..2]).join(&id);
            let mut blob = std::fs::read(&path).unwrap();
            blob[10] ^= 0xff;
            std::fs::write(&path, blob).unwrap();
            let mut second = Payloads::with_store(Some(store.clone()));
            let (sent, got) = upload_as(how, &mut second, 1, &bytes, 1024);
            assert_eq!(sent, vec![2]);
            assert_eq!(got, bytes);
            assert_eq!(store.stats().unwrap().corrupt, 1);
        }
    }

    #[test]
    fn a_copy_waits_for_the_fill_and_a_discarded_fill_still_answers() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(BlobStore::open(dir.path(), 1 << 30).unwrap());
        let bytes = data(64 << 10, 6);
        let mut first = Payloads::with_store(Some(store.clone()));
        upload(&mut first, 1, &bytes, 4096);
        first.finish();
        let manifest = Manifest::with_chunk_size(&bytes, 4096);
        let mut payloads = Payloads::with_store(Some(store));
        let (tx, rx) = std::sync::mpsc::channel();
        let answer = |tx: std::sync::mpsc::Sender<Vec<u32>>| -> AnswerLater {
            Box::new(move |missing| tx.send(missing).unwrap())
        };
        // Copied before the answer was read: the copy finds the whole payload in place.
        let begun = payloads.begin_then(1, &manifest.encode(), Some(answer(tx.clone())), None);
        assert_eq!(begun, Ok(None));
        let mut got = Vec::new();
        payloads
            .copy(1, |b| {
                got = b.to_vec();
                Ok(())
            })
            .unwrap();
        assert_eq!(got, bytes);
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)).unwrap(),
            Vec::<u32>::new()
        );
        // Replaced (the number reused) and discarded while filling: each announcement is answered.
        for _ in 0..2 {
            let begun = payloads.begin_then(2, &manifest.encode(), Some(answer(tx.clone())), None);
            assert_eq!(begun, Ok(None));
        }
        payloads.discard(2);
        for _ in 0..2 {
            rx.recv_timeout(Duration::from_secs(10)).unwrap();
        }
        assert_eq!(payloads.copy(2, |_| Ok(())), Err(CUresult::INVALID_VALUE));
        payloads.finish();
    }

    #[test]
    fn a_buffer_the_device_may_still_read_is_not_refilled_before_that_read_ran() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let mut pin = |_: &mut [u8]| Some(HostPin::new(|| {}));
        let mut payloads = Payloads::with_store(None);
        let read_done = Arc::new(AtomicBool::new(false));
        let (first, second) = (data(PIN_FROM, 1), data(PIN_FROM, 2));
        let stage = |payloads: &mut Payloads, id: u64, bytes: &[u8]| {
            let manifest = Manifest::with_chunk_size(bytes, 1 << 20);
            let missing = payloads.begin(id, &manifest.encode()).unwrap();
            send_chunks(payloads, id, &manifest, bytes, &missing, Compression::OFF);
        };
        stage(&mut payloads, 1, &first);
        let done = read_done.clone();
        payloads
            .copy_page_locked(1, Some(&mut pin), |got, pinned| {
                assert!(pinned);
                assert_eq!(got, &first[..]);
                // The device reads these bytes later (a stream's copy from page-locked memory).
                Ok(Some(DeviceRead::new(move || {
                    done.store(true, Ordering::SeqCst);
                })))
            })
            .unwrap();
        assert!(
            !read_done.load(Ordering::SeqCst),
            "the copy's return does not wait for the device"
        );
        // The next payload of that size takes the same buffer: only after the device read it.
        stage(&mut payloads, 2, &second);
        assert!(read_done.load(Ordering::SeqCst));
        payloads
            .copy_page_locked(2, Some(&mut pin), |got, _| {
                assert_eq!(got, &second[..]);
                Ok(None)
            })
            .unwrap();
    }

    #[test]
    fn the_filler_page_locks_a_payload_the_store_held_whole_after_answering_and_the_copy_waits_for_it()
     {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::mpsc::channel;
        for cached in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let store = Arc::new(BlobStore::open(dir.path(), 1 << 30).unwrap());
            let bytes = data(PIN_FROM, 9);
            let manifest = Manifest::with_chunk_size(&bytes, 1 << 20);
            if cached {
                let mut first = Payloads::with_store(Some(store.clone()));
                upload(&mut first, 1, &bytes, 1 << 20);
                first.finish();
            }
            let (answered_tx, answered) = channel();
            let (go_tx, go) = channel::<()>();
            let go = Mutex::new(go);
            let (pins, unpins) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
            let (p, u) = (pins.clone(), unpins.clone());
            let executor = std::thread::current().id();
            let anywhere: PinAnywhere = Arc::new(move |pages: &mut [u8]| {
                assert_ne!(std::thread::current().id(), executor);
                // Held until the test has seen the answer: the answer does not wait for the locking.
                lock(&go).recv().unwrap();
                p.fetch_add(1, Ordering::SeqCst);
                assert_eq!(pages.len() % crate::staging::PAGE, 0);
                let u = u.clone();
                Some(HostPin::new(move || {
                    u.fetch_add(1, Ordering::SeqCst);
                }))
            });
            let mut payloads = Payloads::with_store(Some(store));
            let answer: AnswerLater = Box::new(move |missing| answered_tx.send(missing).unwrap());
            let begun = payloads.begin_then(2, &manifest.encode(), Some(answer), Some(anywhere));
            assert_eq!(begun, Ok(None));
            let missing = answered.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(missing.is_empty(), cached, "{missing:?}");
            assert_eq!(pins.load(Ordering::SeqCst), 0);
            // Lets the filler's locking go on, where it locks (else its pinner is gone).
            let _ = go_tx.send(());
            let on_executor_pins = Arc::new(AtomicUsize::new(0));
            send_chunks(
                &mut payloads,
                2,
                &manifest,
                &bytes,
                &missing,
                Compression::OFF,
            );
            let mut on_executor = |_: &mut [u8]| -> Option<HostPin> {
                assert!(!cached, "the filler has locked it already");
                on_executor_pins.fetch_add(1, Ordering::SeqCst);
                Some(HostPin::new(|| {}))
            };
            payloads
                .copy_page_locked(2, Some(&mut on_executor), |got, pinned| {
                    assert!(pinned, "the copy waits for the filler's locking");
                    assert_eq!(got, &bytes[..]);
                    Ok(None)
                })
                .unwrap();
            assert_eq!(pins.load(Ordering::SeqCst), usize::from(cached));
            assert_eq!(
                on_executor_pins.load(Ordering::SeqCst),
                usize::from(!cached)
            );
            drop(payloads);
            assert_eq!(unpins.load(Ordering::SeqCst), usize::from(cached));
        }
    }

    #[test]
    fn large_payloads_are_copied_page_locked_and_unlocked_when_dropped() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (pins, unpins) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let big = data(PIN_FROM + 4096, 7);
        let small = data(PIN_FROM - 1, 8);
        let mut pin = |pages: &mut [u8]| {
            assert_eq!(pages.as_ptr() as usize % crate::staging::PAGE, 0);
            assert_eq!(
                pages.len(),
                big.len().div_ceil(crate::staging::PAGE) * crate::staging::PAGE
            );
            // Locked once filled: the payload is in place.
            assert_eq!(&pages[..big.len()], &big[..]);
            pins.fetch_add(1, Ordering::SeqCst);
            let unpins = unpins.clone();
            Some(HostPin::new(move || {
                unpins.fetch_add(1, Ordering::SeqCst);
            }))
        };
        let mut payloads = Payloads::with_store(None);
        for (round, bytes) in [&big, &big, &small].into_iter().enumerate() {
            let manifest = Manifest::with_chunk_size(bytes, 1 << 20);
            let id = round as u64 + 1;
            let missing = payloads.begin(id, &manifest.encode()).unwrap();
            send_chunks(
                &mut payloads,
                id,
                &manifest,
                bytes,
                &missing,
                Compression::OFF,
            );
            payloads
                .copy_page_locked(id, Some(&mut pin), |got, pinned| {
                    assert_eq!(got, &bytes[..]);
                    // The small one too: it reuses the large one's locked buffer.
                    assert!(pinned);
                    Ok(None)
                })
                .unwrap();
        }
        // The second large payload and the small one reused the first's buffer, locked once.
        assert_eq!(pins.load(Ordering::SeqCst), 1);
        assert_eq!(unpins.load(Ordering::SeqCst), 0);
        drop(payloads);
        assert_eq!(unpins.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_pool_keeps_the_largest_buffers() {
        let payloads = Payloads::with_store(None);
        // A copy's segments grow, then the largest repeat: the pool must end up holding those.
        for mib in [1, 2, 4, 8, 8, 3] {
            payloads.recycle(StagingBuf::zeroed(mib << 20));
        }
        let mut kept: Vec<usize> = lock(&payloads.pool)
            .iter()
            .map(|buf| buf.capacity() >> 20)
            .collect();
        kept.sort_unstable();
        assert_eq!(kept.len(), POOL);
        assert_eq!(kept, [3, 4, 8, 8]);
    }

    #[test]
    fn staging_is_bounded() {
        let mut payloads = Payloads::with_store(None);
        let big = |len: u64| {
            // A manifest of `len` bytes without the bytes: equal chunks of zeros.
            let zero = ContentId::of(&vec![0u8; 8 << 20]);
            let chunks = len.div_ceil(8 << 20) as usize;
            let mut m = Vec::new();
            m.extend_from_slice(b"GLMF");
            m.extend_from_slice(&[1, 0, 0, 0]);
            m.extend_from_slice(&len.to_le_bytes());
            m.extend_from_slice(&(8u32 << 20).to_le_bytes());
            m.extend_from_slice(&(chunks as u32).to_le_bytes());
            for _ in 0..chunks {
                m.extend_from_slice(zero.as_bytes());
            }
            m
        };
        assert_eq!(
            payloads.begin(1, &big(MAX_UPLOAD + 1)),
            Err(CUresult::INVALID_VALUE)
        );
        for upload in 0..(MAX_STAGED / MAX_UPLOAD) {
            payloads.begin(upload, &big(MAX_UPLOAD)).unwrap();
        }
        assert_eq!(
            payloads.begin(99, &big(MAX_UPLOAD)),
            Err(CUresult::OUT_OF_MEMORY)
        );
        // Reusing a number frees what it held.
        payloads.begin(0, &big(MAX_UPLOAD)).unwrap();
        payloads.finish();
        assert_eq!(payloads.staged, 0);
    }
}
