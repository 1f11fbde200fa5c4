//! Host-to-device payloads by content: what a serving peer has been sent once, it is not sent again.
//!
//! A client announces a large copy's payload by its [`Manifest`] ([`Call::UploadBegin`]); [`Payloads`]
//! stages it in a buffer of its length, fills every chunk it can (the peer's content cache, verified;
//! a chunk already received in this session and not yet written there; a repeat of a chunk of the same
//! payload) and says which chunks it lacks. The client sends those, encoded ([`Call::UploadChunk`]); each
//! is decoded straight into the staging buffer and checked against its id. The copy
//! ([`Call::UploadCopy`]) takes the complete buffer, then hands it to a writer thread that keeps the
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
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use gleam_cache::{BlobStore, ChunkHeader, Codec, ContentId, Decoder, Manifest};
use gleam_protocol::types::CUresult;
use tracing::{debug, warn};

use crate::images::content_cache;

/// The largest payload one announcement may stage (clients split larger copies).
pub const MAX_UPLOAD: u64 = 256 << 20;
/// What one session may have staged at once.
pub const MAX_STAGED: u64 = 1 << 30;
/// Staging buffers waiting for the writer thread, at most (each up to [`MAX_UPLOAD`]): past it, copies
/// wait for the disk.
const WRITE_QUEUE: usize = 4;
/// Staging buffers kept for reuse (a fresh one costs a page fault per page as it fills); at most
/// 2 x 64 MiB held by an idle session.
const POOL: usize = 2;
/// How long the end of a session waits for the cache writes it queued.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// A session's staged uploads and its link to the content cache.
#[derive(Debug)]
pub struct Payloads {
    /// `None` until first needed; `Some(None)` when there is no store.
    store: Option<Option<Arc<BlobStore>>>,
    uploads: HashMap<u64, Staged>,
    staged: u64,
    decoder: Decoder,
    writer: Option<Writer>,
    /// Staging buffers for reuse.
    pool: Arc<Mutex<Vec<Vec<u8>>>>,
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
            decoder: Decoder::new(),
            writer: None,
            pool: Arc::default(),
        }
    }
}

/// One announced payload being staged.
#[derive(Debug)]
struct Staged {
    manifest: Manifest,
    buf: Vec<u8>,
    /// Per chunk: whether its bytes are in `buf`.
    filled: Vec<bool>,
    unfilled: usize,
    /// The chunks decoded from the wire (for the content cache).
    received: Vec<usize>,
    /// The chunks received raw and not yet checked against their ids.
    unverified: Vec<usize>,
    /// Where each chunk that occurs more than once occurs.
    repeats: HashMap<ContentId, Vec<usize>>,
}

impl Staged {
    fn range(&self, index: usize) -> std::ops::Range<usize> {
        let r = self.manifest.chunk_range(index);
        r.start as usize..r.end as usize
    }

    /// Chunk `index` is in place: copies it to every unfilled repeat of it.
    fn filled(&mut self, index: usize) {
        if !self.filled[index] {
            self.filled[index] = true;
            self.unfilled -= 1;
        }
        let id = self.manifest.chunks()[index];
        let from = self.range(index);
        let Some(repeats) = self.repeats.get(&id) else {
            return;
        };
        for &j in repeats {
            if !self.filled[j] {
                let to = self.range(j).start;
                self.buf.copy_within(from.clone(), to);
                self.filled[j] = true;
                self.unfilled -= 1;
            }
        }
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
        // A reused buffer of the same length needs no clearing (every chunk is written before use); a
        // fresh one is zeroed lazily, by the kernel.
        let buf = match lock(&self.pool).pop() {
            Some(mut buf) => {
                buf.truncate(len);
                buf.resize(len, 0);
                buf
            }
            None => vec![0; len],
        };
        let mut places: HashMap<ContentId, Vec<usize>> = HashMap::new();
        for (index, id) in manifest.chunks().iter().enumerate() {
            places.entry(*id).or_default().push(index);
        }
        places.retain(|_, at| at.len() > 1);
        let mut staged = Staged {
            buf,
            received: Vec::new(),
            unverified: Vec::new(),
            repeats: places,
            filled: vec![false; chunks],
            unfilled: chunks,
            manifest,
        };
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
                        staged.buf[range].copy_from_slice(&buf[from.clone()]);
                        staged.filled(index);
                    }
                }
            }
        }
        if staged.unfilled > 0
            && let Some(store) = self.store()
        {
            let wanted: Vec<usize> = (0..chunks).filter(|&i| !staged.filled[i]).collect();
            match store.read_chunks(&staged.manifest, &mut staged.buf, &wanted) {
                Ok(found) => {
                    for index in found {
                        staged.filled(index);
                    }
                }
                Err(err) => warn!(%err, "content cache read failed: the client sends the chunks"),
            }
        }
        let mut missing = Vec::new();
        let mut asked = std::collections::HashSet::new();
        for (index, id) in staged.manifest.chunks().iter().enumerate() {
            if !staged.filled[index] && asked.insert(*id) {
                missing.push(index as u32);
            }
        }
        debug!(
            upload,
            bytes = staged.buf.len(),
            chunks,
            missing = missing.len(),
            "upload staged"
        );
        self.staged += staged.buf.len() as u64;
        self.uploads.insert(upload, staged);
        Ok(missing)
    }

    /// Decodes chunk `index` of `upload` from its wire form into place, checks it, and queues it for
    /// the content cache.
    pub fn chunk(&mut self, upload: u64, index: u32, wire: &[u8]) -> Result<(), CUresult> {
        let staged = self
            .uploads
            .get_mut(&upload)
            .ok_or(CUresult::INVALID_VALUE)?;
        let index = index as usize;
        if index >= staged.filled.len() {
            return Err(CUresult::INVALID_VALUE);
        }
        if staged.filled[index] {
            return Ok(());
        }
        let id = staged.manifest.chunks()[index];
        let range = staged.range(index);
        let refuse = |err: &dyn std::fmt::Display| {
            warn!(upload, index, %err, "refused a chunk that is not what the upload announced");
            CUresult::INVALID_VALUE
        };
        match ChunkHeader::parse(wire) {
            // A raw chunk is only copied here; its hash is checked with the others' at the copy, on
            // every core, rather than one chunk at a time on the session's only executor thread.
            Ok((header, body)) if header.codec == Codec::Raw && body.len() == range.len() => {
                staged.buf[range].copy_from_slice(body);
                staged.unverified.push(index);
            }
            Ok(_) => {
                if let Err(err) = self.decoder.decode_into(&id, wire, &mut staged.buf[range]) {
                    return Err(refuse(&err));
                }
            }
            Err(err) => return Err(refuse(&err)),
        }
        staged.filled(index);
        staged.received.push(index);
        Ok(())
    }

    /// Hands the complete payload of `upload` to `copy` (which copies it to the device), then forgets
    /// the upload and keeps the chunks it received in the content cache. Fails without calling `copy`
    /// if the upload is unknown or chunks are still missing.
    pub fn copy(
        &mut self,
        upload: u64,
        copy: impl FnOnce(&[u8]) -> Result<(), CUresult>,
    ) -> Result<(), CUresult> {
        let staged = self
            .uploads
            .remove(&upload)
            .ok_or(CUresult::INVALID_VALUE)?;
        self.staged -= staged.buf.len() as u64;
        if staged.unfilled > 0 {
            warn!(
                upload,
                missing = staged.unfilled,
                "an upload was copied before all its chunks arrived"
            );
            self.recycle(staged.buf);
            return Err(CUresult::INVALID_VALUE);
        }
        let checks: Vec<(usize, ContentId, &[u8])> = staged
            .unverified
            .iter()
            .map(|&i| (i, staged.manifest.chunks()[i], &staged.buf[staged.range(i)]))
            .collect();
        let wrong: Vec<usize> = gleam_cache::parallel::map(checks, |(i, id, bytes)| {
            (ContentId::of(bytes) != id).then_some(i)
        })
        .into_iter()
        .flatten()
        .collect();
        if !wrong.is_empty() {
            warn!(
                upload,
                ?wrong,
                "refused chunks that are not what the upload announced: the copy fails"
            );
            self.recycle(staged.buf);
            return Err(CUresult::INVALID_VALUE);
        }
        let copied = copy(&staged.buf);
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
                    .put(staged.buf, received);
            }
            _ => self.recycle(staged.buf),
        }
        copied
    }

    /// Forgets `upload` without copying it (its copy will not run).
    pub fn discard(&mut self, upload: u64) {
        if let Some(old) = self.uploads.remove(&upload) {
            self.staged -= old.buf.len() as u64;
            self.recycle(old.buf);
        }
    }

    fn recycle(&self, buf: Vec<u8>) {
        let mut pool = lock(&self.pool);
        if pool.len() < POOL {
            pool.push(buf);
        }
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

/// The thread that writes received chunks to the content cache, off the session's executor (a commit
/// costs a file write and an fsync), then returns their staging buffers to the pool.
#[derive(Debug)]
struct Writer {
    jobs: Option<SyncSender<Job>>,
    /// Chunks queued and not yet committed, by id: where they are.
    queued: Arc<Mutex<Queued>>,
    thread: Option<JoinHandle<()>>,
}

type Queued = HashMap<ContentId, (Arc<Vec<u8>>, Range<usize>)>;

enum Job {
    /// Store these chunks of this buffer.
    Put(Arc<Vec<u8>>, Vec<(ContentId, Range<usize>)>),
    Flush(SyncSender<()>),
}

impl Writer {
    fn start(store: Arc<BlobStore>, pool: Arc<Mutex<Vec<Vec<u8>>>>) -> Self {
        let (jobs, rx) = sync_channel(WRITE_QUEUE);
        let queued = Arc::new(Mutex::new(HashMap::new()));
        let thread = {
            let queued = queued.clone();
            std::thread::Builder::new()
                .name("gleam-cache-writer".into())
                .spawn(move || write_chunks(&store, &rx, &queued, &pool))
                .inspect_err(|err| warn!(%err, "cannot start the content cache writer"))
                .ok()
        };
        Self {
            jobs: thread.is_some().then_some(jobs),
            queued,
            thread,
        }
    }

    fn queued(&self) -> MutexGuard<'_, Queued> {
        lock(&self.queued)
    }

    fn put(&self, buf: Vec<u8>, chunks: Vec<(ContentId, Range<usize>)>) {
        let Some(jobs) = &self.jobs else { return };
        let buf = Arc::new(buf);
        {
            let mut queued = self.queued();
            for (id, range) in &chunks {
                queued.insert(*id, (buf.clone(), range.clone()));
            }
        }
        if let Err(err) = jobs.send(Job::Put(buf, chunks))
            && let Job::Put(_, chunks) = err.0
        {
            let mut queued = self.queued();
            for (id, _) in chunks {
                queued.remove(&id);
            }
        }
    }

    fn flush(&self, timeout: Duration) {
        let Some(jobs) = &self.jobs else { return };
        let (done, wait) = sync_channel(1);
        if jobs.send(Job::Flush(done)).is_ok() && wait.recv_timeout(timeout).is_err() {
            warn!("the content cache writer did not finish in time");
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn write_chunks(
    store: &BlobStore,
    jobs: &Receiver<Job>,
    queued: &Mutex<Queued>,
    pool: &Mutex<Vec<Vec<u8>>>,
) {
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Put(buf, chunks) => {
                for (id, range) in chunks {
                    if let Err(err) = store.put_verified(id, &buf[range]) {
                        warn!(%id, %err, "cannot keep a chunk in the content cache");
                    }
                    let mut queued = lock(queued);
                    // Unless a later upload queued the same chunk again.
                    if queued
                        .get(&id)
                        .is_some_and(|(theirs, _)| Arc::ptr_eq(theirs, &buf))
                    {
                        queued.remove(&id);
                    }
                }
                if let Ok(buf) = Arc::try_unwrap(buf) {
                    let mut pool = lock(pool);
                    if pool.len() < POOL {
                        pool.push(buf);
                    }
                }
            }
            Job::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
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

    /// Sends what `payloads` asks for, as a client does; returns the chunks sent and the payload.
    fn upload(payloads: &mut Payloads, id: u64, bytes: &[u8], chunk: u32) -> (Vec<u32>, Vec<u8>) {
        let manifest = Manifest::with_chunk_size(bytes, chunk);
        let missing = payloads.begin(id, &manifest.encode()).unwrap();
        let mut encoder = Encoder::new(Compression::default());
        for &index in &missing {
            let r = manifest.chunk_range(index as usize);
            let wire = encoder
                .encode(&bytes[r.start as usize..r.end as usize])
                .to_wire();
            payloads.chunk(id, index, &wire).unwrap();
        }
        let mut got = Vec::new();
        payloads
            .copy(id, |bytes| {
                got = bytes.to_vec();
                Ok(())
            })
            .unwrap();
        (missing, got)
    }

    #[test]
    fn a_second_upload_of_the_same_bytes_sends_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(BlobStore::open(dir.path(), 1 << 30).unwrap());
        let bytes = data(10_000, 1);
        let mut first = Payloads::with_store(Some(store.clone()));
        let (sent, got) = upload(&mut first, 1, &bytes, 1024);
        assert_eq!(sent.len(), 10);
        assert_eq!(got, bytes);
        // Within the session (the writes may still be queued) and in another session after them.
        let (sent, got) = upload(&mut first, 2, &bytes, 1024);
        assert!(sent.is_empty(), "{sent:?}");
        assert_eq!(got, bytes);
        first.finish();
        let mut second = Payloads::with_store(Some(store));
        let (sent, got) = upload(&mut second, 1, &bytes, 1024);
        assert!(sent.is_empty());
        assert_eq!(got, bytes);
    }

    #[test]
    fn a_changed_chunk_is_the_only_one_sent_and_repeats_are_sent_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(BlobStore::open(dir.path(), 1 << 30).unwrap());
        let mut payloads = Payloads::with_store(Some(store));
        let mut bytes = data(8192, 2);
        upload(&mut payloads, 1, &bytes, 1024);
        bytes[5000] ^= 1;
        let (sent, got) = upload(&mut payloads, 2, &bytes, 1024);
        assert_eq!(sent, vec![4]);
        assert_eq!(got, bytes);
        // Eight equal chunks: one is asked for, the others filled from it.
        let same = data(1024, 3).repeat(8);
        let (sent, got) = upload(&mut payloads, 3, &same, 1024);
        assert_eq!(sent, vec![0]);
        assert_eq!(got, same);
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
        let wrong = encoder.encode(&bytes[1024..2048]).to_wire();
        assert_eq!(payloads.chunk(7, 0, &wrong), Ok(()));
        for i in 1..4 {
            let right = encoder.encode(&bytes[i * 1024..(i + 1) * 1024]).to_wire();
            payloads.chunk(7, i as u32, &right).unwrap();
        }
        assert_eq!(
            payloads.copy(7, |_| panic!("a wrong chunk was copied")),
            Err(CUresult::INVALID_VALUE)
        );
        payloads.begin(7, &manifest.encode()).unwrap();
        // Compressed chunks are checked on arrival; so are lengths and headers.
        let squeezed = Encoder::new(Compression::default())
            .encode_as(&bytes[1024..2048], Codec::Zstd)
            .to_wire();
        assert_eq!(
            payloads.chunk(7, 0, &squeezed),
            Err(CUresult::INVALID_VALUE)
        );
        assert_eq!(
            payloads.chunk(7, 0, &wrong[..500]),
            Err(CUresult::INVALID_VALUE)
        );
        assert_eq!(payloads.chunk(7, 0, b"junk"), Err(CUresult::INVALID_VALUE));
        assert_eq!(payloads.chunk(7, 9, &wrong), Err(CUresult::INVALID_VALUE));
        assert_eq!(payloads.chunk(8, 0, &wrong), Err(CUresult::INVALID_VALUE));
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
    fn a_corrupt_blob_in_the_store_is_asked_for_again() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(BlobStore::open(dir.path(), 1 << 30).unwrap());
        let bytes = data(4096, 5);
        let mut first = Payloads::with_store(Some(store.clone()));
        upload(&mut first, 1, &bytes, 1024);
        first.finish();
        // Flip a byte of chunk 2's file.
        let id = ContentId::of(&bytes[2048..3072]).to_hex();
        let path = dir.path().join("blobs").join(&id[..2]).join(&id);
        let mut blob = std::fs::read(&path).unwrap();
        blob[10] ^= 0xff;
        std::fs::write(&path, blob).unwrap();
        let mut second = Payloads::with_store(Some(store.clone()));
        let (sent, got) = upload(&mut second, 1, &bytes, 1024);
        assert_eq!(sent, vec![2]);
        assert_eq!(got, bytes);
        assert_eq!(store.stats().unwrap().corrupt, 1);
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
