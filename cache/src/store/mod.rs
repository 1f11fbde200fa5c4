//! [`BlobStore`]: the persistent, size-limited, verified store that several processes share.
//!
//! Layout under the store's root:
//!
//! * `blobs/<2 hex>/<64 hex>`: one immutable file per blob, named by its BLAKE3 id, holding the raw
//!   bytes (so it can be read straight into a payload buffer). Its mtime is its last use.
//! * `tmp/*.part`: blobs being written, each locked by its writer; committed by an atomic rename
//!   after `fsync`, removed when abandoned (see [`temp`]).
//! * `state`: counters and the lock that serializes commits, evictions and removals across
//!   processes (see [`state`]).
//!
//! Readers take no lock: a blob file is complete from the moment its name exists, and on Linux a
//! reader that has opened one keeps reading it even if eviction unlinks it meanwhile.

mod state;
mod temp;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use self::state::{State, StateFile};
use self::temp::TempBlob;
use crate::{CacheError, ContentId, Manifest, parallel};

/// The size limit of a store that has never been given one: 64 GiB.
pub const DEFAULT_LIMIT: u64 = 64 << 30;

/// A directory of immutable, content-addressed blobs with a size limit, shared by threads and
/// processes.
///
/// * Every read is verified against the blob's id; a corrupt blob is removed and reported as a miss
///   (`Ok(None)` / `Ok(false)`), so the caller fetches it again. Corrupt bytes are never returned.
/// * Writes go to a locked temporary file, are synced, then renamed into place under the store's
///   lock: a blob is either absent or complete, whoever crashes when. Two writers of one blob both
///   succeed and it is stored (and counted) once.
/// * When a commit takes the store over its limit, the least recently used blobs (by file mtime,
///   which every read and re-put refreshes) are evicted until the store is back to 90% of the limit,
///   so that a full store does not rescan its directory on every commit.
/// * A blob's data is synced before its rename, its directory entry is not: a power loss may forget
///   the last blobs committed, never expose a torn one.
/// * [`plan`](Self::plan) and [`contains`](Self::contains) are advisory: another process may evict
///   a blob, or find it corrupt, between them and the read. Reads report that as a miss; a caller
///   fetches what a read misses.
///
/// Costs measured on the 2-core development VM (the `throughput` example): a commit is dominated by
/// its `fsync` (~4-5 ms on that disk), a read by BLAKE3 (~3-7 GB/s per core); opening is ~60 µs.
#[derive(Debug)]
pub struct BlobStore {
    root: PathBuf,
    state: StateFile,
    boot: [u8; 16],
    /// Counts not yet added to the shared record (which a read updates only if it is free).
    pending: Pending,
}

#[derive(Debug, Default)]
struct Pending {
    hits: AtomicU64,
    misses: AtomicU64,
}

/// What a store holds and how it has served, from its shared record.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Stats {
    /// Blobs stored.
    pub blobs: u64,
    /// Their total size in bytes.
    pub bytes: u64,
    /// The size limit in bytes.
    pub limit: u64,
    /// Reads that found their blob, since the store was created or cleared.
    pub hits: u64,
    /// Reads that did not (corrupt blobs included).
    pub misses: u64,
    /// Blobs found corrupt and removed.
    pub corrupt: u64,
    /// Blobs evicted to respect the limit.
    pub evicted: u64,
}

/// What [`BlobStore::clear`] removed.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Cleared {
    /// Blobs removed.
    pub blobs: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// What a store holds, in brief: gossiped between peers.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct CacheDigest {
    /// Number of blobs.
    pub blobs: u64,
    /// Their total size in bytes.
    pub bytes: u64,
    /// BLAKE3 over the sorted ids: equal digests mean equal contents.
    pub fingerprint: [u8; 32],
}

/// Which chunks of a payload a store lacks.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct Plan {
    /// Indices of the chunks to fetch, in payload order (a chunk id listed twice appears twice).
    pub missing: Vec<usize>,
    /// Their total length.
    pub missing_bytes: u64,
    /// The length of the chunks present.
    pub present_bytes: u64,
}

impl Plan {
    /// Whether nothing needs fetching.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty()
    }
}

impl BlobStore {
    /// Opens (creating if needed) the store in `root` and sets its size limit to `limit` bytes,
    /// for every process using it.
    pub fn open(root: impl Into<PathBuf>, limit: u64) -> Result<Self, CacheError> {
        Self::open_with(root.into(), Some(limit))
    }

    /// Opens (creating if needed) the store in `root`, keeping the size limit it was last given
    /// ([`DEFAULT_LIMIT`] if none): for tools that inspect a store other processes use.
    pub fn open_recorded(root: impl Into<PathBuf>) -> Result<Self, CacheError> {
        Self::open_with(root.into(), None)
    }

    fn open_with(root: PathBuf, limit: Option<u64>) -> Result<Self, CacheError> {
        for dir in [root.join("blobs"), root.join("tmp")] {
            fs::create_dir_all(&dir).map_err(CacheError::io("creating", &dir))?;
        }
        let store = Self {
            state: StateFile::open(root.join("state"))?,
            root,
            boot: state::boot_id(),
            pending: Pending::default(),
        };
        let mut guard = store.lock()?;
        if let Some(limit) = limit {
            guard.state.limit = limit;
        }
        guard.save()?;
        drop(guard);
        let cleaned = temp::clean_abandoned(&store.root.join("tmp"));
        if cleaned > 0 {
            tracing::info!(
                root = %store.root.display(),
                cleaned,
                "content cache: removed partial blobs left by writers that died"
            );
        }
        Ok(store)
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Stores `bytes` (only refreshing their last use if present) and returns their id. May evict
    /// older blobs; a blob larger than the whole limit is still stored, until the next commit.
    pub fn put(&self, bytes: &[u8]) -> Result<ContentId, CacheError> {
        let id = ContentId::of(bytes);
        self.put_known(id, bytes)?;
        Ok(id)
    }

    /// Stores `bytes` under `id`, which the caller already computed from them (a [`Decoder`] verified
    /// them against it), sparing a second hash. Reads verify every blob all the same.
    ///
    /// [`Decoder`]: crate::Decoder
    pub fn put_verified(&self, id: ContentId, bytes: &[u8]) -> Result<(), CacheError> {
        debug_assert_eq!(id, ContentId::of(bytes), "put_verified given a wrong id");
        self.put_known(id, bytes)
    }

    /// A writer for one blob whose bytes arrive in pieces; nothing is visible until
    /// [`BlobWriter::commit`]. Write large slices: each write is a system call.
    pub fn writer(&self) -> Result<BlobWriter<'_>, CacheError> {
        Ok(BlobWriter {
            store: self,
            temp: TempBlob::create(&self.root.join("tmp"))?,
            hasher: blake3::Hasher::new(),
            len: 0,
        })
    }

    /// The blob's bytes, verified; `None` when absent or found corrupt (then removed).
    pub fn get(&self, id: &ContentId) -> Result<Option<Vec<u8>>, CacheError> {
        let path = self.blob_path(id);
        let Some(mut file) = self.open_blob(&path)? else {
            return Ok(None);
        };
        let mut bytes = Vec::with_capacity(file.metadata().map_or(0, |m| m.len() as usize));
        file.read_to_end(&mut bytes)
            .map_err(CacheError::io("reading", &path))?;
        if ContentId::of(&bytes) != *id {
            self.drop_corrupt(id, &file)?;
            return Ok(None);
        }
        self.hit(&file);
        Ok(Some(bytes))
    }

    /// Reads the blob into `dst`, verified; `false` when absent, found corrupt (then removed) or
    /// not of `dst`'s length. On `false`, `dst` holds garbage.
    pub fn read_into(&self, id: &ContentId, dst: &mut [u8]) -> Result<bool, CacheError> {
        let path = self.blob_path(id);
        let Some(mut file) = self.open_blob(&path)? else {
            return Ok(false);
        };
        let len = file
            .metadata()
            .map_err(CacheError::io("reading", &path))?
            .len();
        if len != dst.len() as u64 {
            // A blob of the wrong length is corrupt, or the caller's length (a peer's manifest)
            // is wrong: only the hash can tell.
            if hash_file(&mut file).map_err(CacheError::io("reading", &path))? != *id {
                self.drop_corrupt(id, &file)?;
            } else {
                tracing::debug!(%id, len, wanted = dst.len(), "blob asked for with a wrong length");
                self.miss();
            }
            return Ok(false);
        }
        // Read and hashed piece by piece, each hashed while it is still in the core's cache: one pass
        // over memory rather than two (a read, then a hash of the whole chunk from memory).
        let mut hasher = blake3::Hasher::new();
        for piece in dst.chunks_mut(VERIFY_PIECE) {
            file.read_exact(piece)
                .map_err(CacheError::io("reading", &path))?;
            hasher.update(piece);
        }
        if ContentId::from(hasher.finalize()) != *id {
            self.drop_corrupt(id, &file)?;
            return Ok(false);
        }
        self.hit(&file);
        Ok(true)
    }

    /// Whether a blob is present under `id` (not verified, not counted as a hit or a miss).
    pub fn contains(&self, id: &ContentId) -> bool {
        self.blob_path(id).is_file()
    }

    /// Stores `data` as chunks of [`CHUNK_SIZE`](crate::CHUNK_SIZE) (in parallel; chunks already
    /// present are only refreshed) and its manifest as a blob of its own, so it can later be found
    /// by [`Manifest::id`].
    pub fn put_payload(&self, data: &[u8]) -> Result<Manifest, CacheError> {
        self.put_payload_chunked(data, crate::CHUNK_SIZE)
    }

    /// [`put_payload`](Self::put_payload) with another chunk size.
    ///
    /// # Panics
    /// If `chunk_size` is 0 or above [`MAX_CHUNK_SIZE`](crate::MAX_CHUNK_SIZE).
    pub fn put_payload_chunked(
        &self,
        data: &[u8],
        chunk_size: u32,
    ) -> Result<Manifest, CacheError> {
        let manifest = Manifest::with_chunk_size(data, chunk_size);
        let mut seen = HashSet::new();
        let unique: Vec<(ContentId, &[u8])> = manifest
            .chunks()
            .iter()
            .zip(data.chunks(manifest.chunk_size() as usize))
            .filter(|(id, _)| seen.insert(**id))
            .map(|(id, chunk)| (*id, chunk))
            .collect();
        parallel::map(unique, |(id, chunk)| self.put_known(id, chunk))
            .into_iter()
            .collect::<Result<Vec<()>, _>>()?;
        self.put(&manifest.encode())?;
        Ok(manifest)
    }

    /// The manifest stored under `id`, if present and intact.
    pub fn manifest(&self, id: &ContentId) -> Result<Option<Manifest>, CacheError> {
        Ok(self.get(id)?.and_then(|bytes| {
            Manifest::decode(&bytes)
                .inspect_err(|e| tracing::debug!(%id, "blob is not a manifest: {e}"))
                .ok()
        }))
    }

    /// Which of `manifest`'s chunks this store lacks (by presence and length, not verified: a
    /// chunk may still turn out corrupt or be evicted before it is read, which
    /// [`read_payload`](Self::read_payload) reports).
    pub fn plan(&self, manifest: &Manifest) -> Plan {
        let mut plan = Plan::default();
        for (index, id) in manifest.chunks().iter().enumerate() {
            let range = manifest.chunk_range(index);
            let len = range.end - range.start;
            let present =
                fs::metadata(self.blob_path(id)).is_ok_and(|m| m.is_file() && m.len() == len);
            if present {
                plan.present_bytes += len;
            } else {
                plan.missing.push(index);
                plan.missing_bytes += len;
            }
        }
        plan
    }

    /// Fills `dst` (the payload's buffer, of the manifest's length) with every chunk this store
    /// has, verified, in parallel; returns the indices of the chunks it could not supply, which
    /// the caller must fetch (their part of `dst` holds garbage).
    pub fn read_payload(
        &self,
        manifest: &Manifest,
        dst: &mut [u8],
    ) -> Result<Vec<usize>, CacheError> {
        if dst.len() as u64 != manifest.len() {
            return Err(CacheError::BufferLength {
                expected: manifest.len(),
                actual: dst.len() as u64,
            });
        }
        let jobs: Vec<_> = manifest
            .chunks()
            .iter()
            .zip(dst.chunks_mut(manifest.chunk_size().max(1) as usize))
            .enumerate()
            .collect();
        let results = parallel::map(jobs, |(index, (id, slice))| {
            self.read_into(id, slice).map(|hit| (!hit).then_some(index))
        });
        let mut missing = Vec::new();
        for result in results {
            missing.extend(result?);
        }
        Ok(missing)
    }

    /// Reads the chunks `which` (indices into `manifest`) of the payload into their places in `dst`
    /// (the payload's buffer, of the manifest's length), verified, in parallel; returns the indices it
    /// supplied. The others are absent or were found corrupt (then removed), and their part of `dst`
    /// holds garbage.
    pub fn read_chunks(
        &self,
        manifest: &Manifest,
        dst: &mut [u8],
        which: &[usize],
    ) -> Result<Vec<usize>, CacheError> {
        if dst.len() as u64 != manifest.len() {
            return Err(CacheError::BufferLength {
                expected: manifest.len(),
                actual: dst.len() as u64,
            });
        }
        let wanted: HashSet<usize> = which.iter().copied().collect();
        let jobs: Vec<_> = manifest
            .chunks()
            .iter()
            .zip(dst.chunks_mut(manifest.chunk_size().max(1) as usize))
            .enumerate()
            .filter(|(index, _)| wanted.contains(index))
            .collect();
        let results = parallel::map(jobs, |(index, (id, slice))| {
            self.read_into(id, slice).map(|hit| hit.then_some(index))
        });
        let mut found = Vec::new();
        for result in results {
            found.extend(result?);
        }
        Ok(found)
    }

    /// The shared counters (exact: recounted from the directory if a writer died mid-change).
    pub fn stats(&self) -> Result<Stats, CacheError> {
        let mut guard = self.lock()?;
        guard.save()?;
        let s = guard.state;
        Ok(Stats {
            blobs: s.blobs,
            bytes: s.bytes,
            limit: s.limit,
            hits: s.hits,
            misses: s.misses,
            corrupt: s.corrupt,
            evicted: s.evicted,
        })
    }

    /// Removes every blob and resets the counters (the limit stays). Writes in flight complete
    /// after it, and readers that already opened a blob finish reading it.
    pub fn clear(&self) -> Result<Cleared, CacheError> {
        let mut guard = self.lock()?;
        guard.begin()?;
        let mut cleared = Cleared::default();
        let entries = self.walk()?;
        let (mut left_blobs, mut left_bytes) = (0, 0);
        for entry in entries {
            match fs::remove_file(self.blob_path(&entry.id)) {
                Ok(()) => {
                    cleared.blobs += 1;
                    cleared.bytes += entry.len;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(id = %entry.id, "content cache: cannot remove blob: {e}");
                    left_blobs += 1;
                    left_bytes += entry.len;
                }
            }
        }
        if let Ok(shards) = fs::read_dir(self.root.join("blobs")) {
            for shard in shards.flatten() {
                let _ = fs::remove_dir(shard.path()); // only the empty ones go
            }
        }
        guard.state = State {
            bytes: left_bytes,
            blobs: left_blobs,
            limit: guard.state.limit,
            ..State::default()
        };
        guard.end()?;
        Ok(cleared)
    }

    /// A summary of the contents for gossip (walks the directory).
    pub fn digest(&self) -> Result<CacheDigest, CacheError> {
        let mut entries = self.walk()?;
        entries.sort_unstable_by_key(|e| e.id);
        let mut hasher = blake3::Hasher::new();
        let mut bytes = 0;
        for entry in &entries {
            hasher.update(&entry.id.0);
            bytes += entry.len;
        }
        Ok(CacheDigest {
            blobs: entries.len() as u64,
            bytes,
            fingerprint: *hasher.finalize().as_bytes(),
        })
    }

    fn blob_path(&self, id: &ContentId) -> PathBuf {
        let hex = id.to_hex();
        self.root.join("blobs").join(&hex[..2]).join(hex)
    }

    /// Stores bytes whose id the caller computed from them.
    fn put_known(&self, id: ContentId, bytes: &[u8]) -> Result<(), CacheError> {
        if self.refresh(&id, bytes.len() as u64) {
            return Ok(());
        }
        let mut temp = TempBlob::create(&self.root.join("tmp"))?;
        temp.write_all(bytes)?;
        self.commit(temp, id, bytes.len() as u64)
    }

    /// Marks a present blob of the right length as just used; `false` if there is none.
    fn refresh(&self, id: &ContentId, len: u64) -> bool {
        let Ok(file) = File::open(self.blob_path(id)) else {
            return false;
        };
        file.metadata().is_ok_and(|m| m.len() == len)
            && file.set_modified(SystemTime::now()).is_ok()
    }

    /// Moves a written temporary file into place as blob `id`, under the lock, then evicts if the
    /// store went over its limit.
    fn commit(&self, mut temp: TempBlob, id: ContentId, len: u64) -> Result<(), CacheError> {
        temp.finish()?;
        let mut guard = self.lock()?;
        let path = self.blob_path(&id);
        let old = fs::metadata(&path).ok().map(|m| m.len());
        if old == Some(len) {
            // Another writer committed it first.
            drop(temp);
            self.refresh(&id, len);
            return guard.save();
        }
        guard.begin()?;
        let shard = path.parent().expect("blob paths have a shard directory");
        fs::create_dir_all(shard).map_err(CacheError::io("creating", shard))?;
        fs::rename(temp.path(), &path).map_err(CacheError::io("renaming into", &path))?;
        temp.persist();
        let s = &mut guard.state;
        match old {
            // A blob of the wrong length was there, so corrupt: replaced. Its size may have changed
            // since it was counted, so recount (rare).
            Some(_) => self.recount(s)?,
            None => {
                s.bytes += len;
                s.blobs += 1;
            }
        }
        if s.bytes > s.limit {
            self.evict(&mut guard.state, &id)?;
        }
        guard.end()
    }

    /// Removes least recently used blobs (never `keep`) until the store is within 90% of its limit.
    /// Called under the lock.
    ///
    /// A blob a reader used since the walk is spared in the first pass. When readers keep every
    /// candidate in use, a second pass, on a fresh walk, evicts by last use regardless: the limit is
    /// a bound, and a reader that already opened an evicted blob still reads all of it.
    fn evict(&self, state: &mut State, keep: &ContentId) -> Result<(), CacheError> {
        for spare_recently_used in [true, false] {
            let mut entries = self.walk()?;
            // The walk is exact: correct the record with it.
            state.bytes = entries.iter().map(|e| e.len).sum();
            state.blobs = entries.len() as u64;
            if state.bytes <= state.limit {
                return Ok(());
            }
            let target = state.limit - state.limit / 10;
            entries.sort_unstable_by_key(|e| (e.used, e.id));
            for entry in entries {
                if state.bytes <= target {
                    return Ok(());
                }
                if entry.id == *keep {
                    continue;
                }
                let path = self.blob_path(&entry.id);
                if spare_recently_used
                    && fs::metadata(&path).and_then(|m| m.modified()).ok() != Some(entry.used)
                {
                    continue;
                }
                match fs::remove_file(&path) {
                    Ok(()) => {
                        tracing::debug!(id = %entry.id, len = entry.len, "content cache: evicted");
                        state.evicted += 1;
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => {
                        tracing::warn!(id = %entry.id, "content cache: cannot evict: {e}");
                        continue;
                    }
                }
                state.bytes -= entry.len;
                state.blobs -= 1;
            }
            if state.bytes <= state.limit {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Sets the record's blob count and size from the directory.
    fn recount(&self, state: &mut State) -> Result<(), CacheError> {
        let entries = self.walk()?;
        tracing::debug!(
            root = %self.root.display(),
            blobs = entries.len(),
            "content cache: recounted the blobs"
        );
        state.bytes = entries.iter().map(|e| e.len).sum();
        state.blobs = entries.len() as u64;
        Ok(())
    }

    /// Every blob file: id, length, last use. Also removes temporary files an older version of
    /// this store left in the shard directories.
    fn walk(&self) -> Result<Vec<Entry>, CacheError> {
        let blobs = self.root.join("blobs");
        let shards = fs::read_dir(&blobs).map_err(CacheError::io("listing", &blobs))?;
        let mut out = Vec::new();
        for shard in shards.flatten() {
            let Ok(files) = fs::read_dir(shard.path()) else {
                continue;
            };
            for file in files.flatten() {
                let Ok(meta) = file.metadata() else { continue };
                let name = file.file_name();
                let Some(name) = name.to_str() else { continue };
                let Ok(id) = name.parse::<ContentId>() else {
                    remove_if_old_leftover(&file.path(), name, &meta);
                    continue;
                };
                if meta.is_file() && shard.file_name().to_str() == Some(&name[..2]) {
                    out.push(Entry {
                        id,
                        len: meta.len(),
                        used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    });
                }
            }
        }
        Ok(out)
    }

    /// The blob file, or `None` (a miss, counted) when absent.
    fn open_blob(&self, path: &Path) -> Result<Option<File>, CacheError> {
        match File::open(path) {
            Ok(file) => Ok(Some(file)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.miss();
                Ok(None)
            }
            Err(e) => Err(CacheError::io("opening", path)(e)),
        }
    }

    /// Removes the corrupt blob that `file` (open on it) holds, unless another writer has already
    /// replaced it; counts a miss.
    fn drop_corrupt(&self, id: &ContentId, file: &File) -> Result<(), CacheError> {
        let path = self.blob_path(id);
        tracing::warn!(%id, "content cache: blob failed verification, removing it");
        let ours = file.metadata().map(|m| (m.dev(), m.ino())).ok();
        self.pending.misses.fetch_add(1, Ordering::Relaxed);
        let mut guard = self.lock()?;
        guard.state.corrupt += 1;
        if let Ok(meta) = fs::metadata(&path)
            && Some((meta.dev(), meta.ino())) == ours
        {
            guard.begin()?;
            fs::remove_file(&path).map_err(CacheError::io("removing", &path))?;
            // Its size may have changed since it was counted: recount (rare).
            self.recount(&mut guard.state)?;
            return guard.end();
        }
        guard.save()
    }

    fn hit(&self, file: &File) {
        // Refresh the last use through the open file: the inode that was read, whatever the path
        // holds now.
        let _ = file.set_modified(SystemTime::now());
        self.pending.hits.fetch_add(1, Ordering::Relaxed);
        self.flush_if_free();
    }

    fn miss(&self) {
        self.pending.misses.fetch_add(1, Ordering::Relaxed);
        self.flush_if_free();
    }

    /// Adds the pending counts to the shared record if nobody holds its lock now: a reader never
    /// waits for an eviction.
    fn flush_if_free(&self) {
        if let Some(locked) = self.state.try_lock()
            && let Ok(mut guard) = self.guard(locked)
        {
            let _ = guard.save();
        }
    }

    /// Takes the lock and reads the record, recounting the blobs when it cannot be trusted.
    fn lock(&self) -> Result<Guard<'_>, CacheError> {
        self.guard(self.state.lock()?)
    }

    fn guard<'a>(&'a self, locked: state::Locked<'a>) -> Result<Guard<'a>, CacheError> {
        let mut state = match locked.read()? {
            Some(state) if !state.dirty && state.boot == self.boot => state,
            found => {
                let mut state = found.unwrap_or(State {
                    limit: DEFAULT_LIMIT,
                    ..State::default()
                });
                self.recount(&mut state)?;
                state.dirty = false;
                state.boot = self.boot;
                state
            }
        };
        state.hits += self.pending.hits.swap(0, Ordering::Relaxed);
        state.misses += self.pending.misses.swap(0, Ordering::Relaxed);
        Ok(Guard { locked, state })
    }
}

impl Drop for BlobStore {
    fn drop(&mut self) {
        let pending =
            self.pending.hits.load(Ordering::Relaxed) + self.pending.misses.load(Ordering::Relaxed);
        if pending > 0
            && let Ok(mut guard) = self.lock()
        {
            let _ = guard.save();
        }
    }
}

/// The locked shared record, being changed.
struct Guard<'a> {
    locked: state::Locked<'a>,
    state: State,
}

impl Guard<'_> {
    fn save(&mut self) -> Result<(), CacheError> {
        self.locked.write(&self.state)
    }

    /// Marks the record dirty before the blobs change.
    fn begin(&mut self) -> Result<(), CacheError> {
        self.state.dirty = true;
        self.save()
    }

    /// Records the change as complete.
    fn end(&mut self) -> Result<(), CacheError> {
        self.state.dirty = false;
        self.save()
    }
}

/// One blob file found by a walk.
struct Entry {
    id: ContentId,
    len: u64,
    used: SystemTime,
}

/// A blob being written in pieces; see [`BlobStore::writer`]. Dropped without a commit, it leaves
/// nothing behind.
#[derive(Debug)]
pub struct BlobWriter<'a> {
    store: &'a BlobStore,
    temp: TempBlob,
    hasher: blake3::Hasher,
    len: u64,
}

impl BlobWriter<'_> {
    /// Makes the blob visible and returns its id; if `expected` is given and the bytes do not hash
    /// to it, stores nothing and fails.
    pub fn commit(self, expected: Option<&ContentId>) -> Result<ContentId, CacheError> {
        let id = ContentId::from(self.hasher.finalize());
        if let Some(expected) = expected
            && *expected != id
        {
            return Err(CacheError::HashMismatch {
                expected: *expected,
                actual: id,
            });
        }
        self.store.commit(self.temp, id, self.len)?;
        Ok(id)
    }
}

impl Write for BlobWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.temp.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// How much of a blob [`BlobStore::read_into`] reads before hashing it: small enough to be hashed from
/// the core's own cache (L2), large enough that a read is a few system calls per chunk.
const VERIFY_PIECE: usize = 256 << 10;

/// BLAKE3 of a file's contents from its current position, in blocks.
fn hash_file(file: &mut File) -> io::Result<ContentId> {
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0; 1 << 20];
    loop {
        match file.read(&mut buf)? {
            0 => return Ok(hasher.finalize().into()),
            n => {
                hasher.update(&buf[..n]);
            }
        }
    }
}

/// Temporary files of the previous store layout (`.tmp-*` beside the blobs), once surely dead.
fn remove_if_old_leftover(path: &Path, name: &str, meta: &fs::Metadata) {
    let old = meta
        .modified()
        .ok()
        .and_then(|m| m.elapsed().ok())
        .is_some_and(|age| age > Duration::from_secs(3600));
    if name.starts_with(".tmp-") && old {
        let _ = fs::remove_file(path);
    }
}
