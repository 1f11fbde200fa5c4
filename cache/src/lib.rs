//! Content-addressed storage for what a serving peer should not receive twice: module images and model
//! weights, named by their BLAKE3 hash.
//!
//! * [`BlobStore`]: a directory of immutable blobs, `blobs/<first 2 hex>/<64 hex>`, written atomically
//!   (temporary file, fsync, rename) and verified on read, with a byte budget enforced by evicting the least
//!   recently used blobs.
//! * [`ContentId`]: a blob's address.
//! * [`CacheDigest`]: a small summary of what a store holds, which peers gossip so the scheduler can place
//!   work where its content already is.

use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::SystemTime;

/// A blob's address: the BLAKE3 hash of its bytes.
#[derive(Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd)]
pub struct ContentId(pub [u8; 32]);

impl ContentId {
    /// The address of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    fn hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }
}

impl fmt::Display for ContentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

impl FromStr for ContentId {
    type Err = CacheError;

    fn from_str(s: &str) -> Result<Self, CacheError> {
        blake3::Hash::from_hex(s)
            .map(|h| Self(*h.as_bytes()))
            .map_err(|_| CacheError::BadContentId(s.to_owned()))
    }
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

/// A failure of the blob store.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The file system refused an operation.
    #[error("cache I/O error on {path}: {source}")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A stored blob no longer matches its address (disk corruption or tampering); it has been removed.
    #[error("cached blob {0} was corrupt and has been removed")]
    Corrupt(ContentId),
    /// A string that is not 64 hex digits was given as a content id.
    #[error("not a content id (64 hex digits expected): {0:?}")]
    BadContentId(String),
}

/// A directory of immutable, content-addressed blobs with a size budget.
#[derive(Debug)]
pub struct BlobStore {
    root: PathBuf,
    budget_bytes: u64,
}

impl BlobStore {
    /// Opens (creating if needed) the store in `root`, keeping at most `budget_bytes` of blobs.
    pub fn open(root: impl Into<PathBuf>, budget_bytes: u64) -> Result<Self, CacheError> {
        let root = root.into();
        let blobs = root.join("blobs");
        fs::create_dir_all(&blobs).map_err(|source| CacheError::Io {
            path: blobs,
            source,
        })?;
        Ok(Self { root, budget_bytes })
    }

    /// Stores `bytes` (a no-op if already present) and returns their address. May evict older blobs to
    /// stay within the budget; a blob larger than the whole budget is still stored.
    pub fn put(&self, bytes: &[u8]) -> Result<ContentId, CacheError> {
        let id = ContentId::of(bytes);
        let path = self.path_of(&id);
        if path.exists() {
            touch(&path);
            return Ok(id);
        }
        let dir = path.parent().unwrap_or(&self.root).to_path_buf();
        fs::create_dir_all(&dir).map_err(|source| CacheError::Io {
            path: dir.clone(),
            source,
        })?;
        let io_err = |source| CacheError::Io {
            path: path.clone(),
            source,
        };
        let mut tmp = tempfile_in(&dir).map_err(io_err)?;
        tmp.1.write_all(bytes).map_err(io_err)?;
        tmp.1.sync_all().map_err(io_err)?;
        fs::rename(&tmp.0, &path).map_err(io_err)?;
        self.evict_to_budget(Some(&id))?;
        Ok(id)
    }

    /// The blob's bytes, verified against its address; `None` when absent.
    pub fn get(&self, id: &ContentId) -> Result<Option<Vec<u8>>, CacheError> {
        let path = self.path_of(id);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(CacheError::Io { path, source }),
        };
        if ContentId::of(&bytes) != *id {
            let _ = fs::remove_file(&path);
            return Err(CacheError::Corrupt(*id));
        }
        touch(&path);
        Ok(Some(bytes))
    }

    /// Whether the blob is present (not verified).
    pub fn contains(&self, id: &ContentId) -> bool {
        self.path_of(id).exists()
    }

    /// Summary of the contents.
    pub fn digest(&self) -> Result<CacheDigest, CacheError> {
        let mut entries = self.entries()?;
        entries.sort_by_key(|entry| entry.0);
        let mut hasher = blake3::Hasher::new();
        let mut bytes = 0;
        for (id, size, _) in &entries {
            hasher.update(&id.0);
            bytes += size;
        }
        Ok(CacheDigest {
            blobs: entries.len() as u64,
            bytes,
            fingerprint: *hasher.finalize().as_bytes(),
        })
    }

    fn path_of(&self, id: &ContentId) -> PathBuf {
        let hex = id.hex();
        self.root.join("blobs").join(&hex[..2]).join(hex)
    }

    /// Every blob: (id, size, last use).
    fn entries(&self) -> Result<Vec<(ContentId, u64, SystemTime)>, CacheError> {
        let blobs = self.root.join("blobs");
        let mut out = Vec::new();
        let shards = fs::read_dir(&blobs).map_err(|source| CacheError::Io {
            path: blobs.clone(),
            source,
        })?;
        for shard in shards.flatten() {
            let Ok(files) = fs::read_dir(shard.path()) else {
                continue;
            };
            for file in files.flatten() {
                let name = file.file_name();
                let Some(id) = name.to_str().and_then(|n| n.parse::<ContentId>().ok()) else {
                    continue;
                };
                let Ok(meta) = file.metadata() else { continue };
                out.push((
                    id,
                    meta.len(),
                    meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                ));
            }
        }
        Ok(out)
    }

    fn evict_to_budget(&self, keep: Option<&ContentId>) -> Result<(), CacheError> {
        let mut entries = self.entries()?;
        let mut total: u64 = entries.iter().map(|e| e.1).sum();
        if total <= self.budget_bytes {
            return Ok(());
        }
        entries.sort_by_key(|e| e.2);
        for (id, size, _) in entries {
            if total <= self.budget_bytes {
                break;
            }
            if Some(&id) == keep {
                continue;
            }
            if fs::remove_file(self.path_of(&id)).is_ok() {
                tracing::debug!(%id, size, "evicted from the blob cache");
                total -= size;
            }
        }
        Ok(())
    }
}

/// Marks a blob as recently used (its mtime orders eviction).
fn touch(path: &Path) {
    if let Ok(file) = fs::File::options().append(true).open(path) {
        let _ = file.set_modified(SystemTime::now());
    }
}

/// A uniquely named temporary file in `dir` (same file system, so the final rename is atomic).
fn tempfile_in(dir: &Path) -> io::Result<(PathBuf, fs::File)> {
    for attempt in 0u32..100 {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path = dir.join(format!(".tmp-{}-{nanos}-{attempt}", std::process::id()));
        match fs::File::options().write(true).create_new(true).open(&path) {
            Ok(file) => return Ok((path, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::other("could not create a temporary file"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(budget: u64) -> (tempfile::TempDir, BlobStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path(), budget).unwrap();
        (dir, store)
    }

    #[test]
    fn put_get_round_trip_and_dedup() {
        let (_dir, store) = store(1 << 20);
        let id = store.put(b"weights").unwrap();
        assert_eq!(id, ContentId::of(b"weights"));
        assert_eq!(store.put(b"weights").unwrap(), id);
        assert_eq!(store.get(&id).unwrap().as_deref(), Some(&b"weights"[..]));
        assert_eq!(store.digest().unwrap().blobs, 1);
        assert_eq!(store.get(&ContentId::of(b"other")).unwrap(), None);
        assert_eq!(id.to_string().parse::<ContentId>().unwrap(), id);
    }

    #[test]
    fn corruption_is_detected_and_removed() {
        let (_dir, store) = store(1 << 20);
        let id = store.put(b"module image").unwrap();
        fs::write(store.path_of(&id), b"tampered").unwrap();
        assert!(matches!(store.get(&id), Err(CacheError::Corrupt(_))));
        assert!(!store.contains(&id));
    }

    #[test]
    fn budget_evicts_least_recently_used() {
        let (_dir, store) = store(250);
        let a = store.put(&[1u8; 100]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let b = store.put(&[2u8; 100]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        store.get(&a).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let c = store.put(&[3u8; 100]).unwrap();
        assert!(store.contains(&a) && store.contains(&c));
        assert!(!store.contains(&b), "b was least recently used");
        let digest = store.digest().unwrap();
        assert_eq!((digest.blobs, digest.bytes), (2, 200));
    }
}
