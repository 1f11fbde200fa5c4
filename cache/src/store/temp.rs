//! Blobs being written: files in `<root>/tmp`, each `flock`ed by its writer for as long as it
//! writes, so that a file nobody holds is known to be abandoned (its writer died) and can go.

use std::fs::{self, File, TryLockError};
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use crate::CacheError;

const SUFFIX: &str = ".part";

/// A temporary file being filled; removed on drop unless [`persist`](Self::persist)ed.
#[derive(Debug)]
pub(super) struct TempBlob {
    path: PathBuf,
    file: File,
    kept: bool,
}

impl TempBlob {
    /// A new, locked, empty file in `dir`.
    pub fn create(dir: &Path) -> Result<Self, CacheError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        for _ in 0..16 {
            let seq = SEQ.fetch_add(1, Ordering::Relaxed);
            let name = format!("{}-{nanos:x}-{seq}{SUFFIX}", std::process::id());
            let path = dir.join(name);
            let file = match File::options().write(true).create_new(true).open(&path) {
                Ok(file) => file,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(CacheError::io("creating", &path)(e)),
            };
            // A cleaner that saw the file before this lock may hold it, or have removed it already:
            // either way that name is lost, take another.
            let locked = match file.try_lock() {
                Ok(()) => true,
                Err(TryLockError::WouldBlock) => false,
                Err(TryLockError::Error(e)) => return Err(CacheError::io("locking", &path)(e)),
            };
            let linked = file.metadata().is_ok_and(|m| m.nlink() > 0);
            if locked && linked {
                return Ok(Self {
                    path,
                    file,
                    kept: false,
                });
            }
        }
        Err(CacheError::io("creating a temporary file in", dir)(
            io::Error::other("every name tried was taken or removed at once"),
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write_all(&mut self, bytes: &[u8]) -> Result<(), CacheError> {
        self.file
            .write_all(bytes)
            .map_err(CacheError::io("writing", &self.path))
    }

    pub fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.file.write(bytes)
    }

    /// Makes the contents durable and stamps the file as just used (its mtime orders eviction).
    pub fn finish(&mut self) -> Result<(), CacheError> {
        self.file
            .set_modified(SystemTime::now())
            .and_then(|()| self.file.sync_data())
            .map_err(CacheError::io("syncing", &self.path))
    }

    /// The file now lives elsewhere (renamed): do not remove it on drop.
    pub fn persist(mut self) {
        self.kept = true;
    }
}

impl Drop for TempBlob {
    fn drop(&mut self) {
        if !self.kept {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Removes the temporary files in `dir` whose writers are gone; returns how many.
pub(super) fn clean_abandoned(dir: &Path) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.to_str().is_some_and(|p| p.ends_with(SUFFIX)) {
            continue;
        }
        let Ok(file) = File::open(&path) else {
            continue;
        };
        if file.try_lock().is_err() {
            continue; // its writer is alive
        }
        // Same inode still at that path (names are never reused): it is abandoned.
        let ours = file.metadata().ok().map(|m| (m.dev(), m.ino()));
        let there = fs::symlink_metadata(&path).ok().map(|m| (m.dev(), m.ino()));
        if ours.is_some() && ours == there && fs::remove_file(&path).is_ok() {
            tracing::debug!(path = %path.display(), "removed an abandoned partial blob");
            removed += 1;
        }
    }
    removed
}
