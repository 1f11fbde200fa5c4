//! The store's shared record: counters in a small file whose `flock` serializes every change to
//! the set of blobs (commits, evictions, removals) across threads and processes.
//!
//! The record is advisory and self-healing: a change sets its `dirty` flag before touching the
//! blobs and clears it after, so a process killed in between leaves the flag set and the next
//! holder of the lock recounts the blobs from the directory. A checksum catches a torn or foreign
//! file, and the kernel's boot id a record that a power loss left stale.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::CacheError;

const MAGIC: [u8; 8] = *b"GLMCACH1";
const LEN: usize = 96;

/// The contents of the state file.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub(super) struct State {
    /// A change to the blobs may be half done: recount before trusting `bytes` and `blobs`.
    pub dirty: bool,
    pub bytes: u64,
    pub blobs: u64,
    pub limit: u64,
    pub hits: u64,
    pub misses: u64,
    pub corrupt: u64,
    pub evicted: u64,
    /// Identifies the boot during which the record was written.
    pub boot: [u8; 16],
}

impl State {
    fn encode(&self) -> [u8; LEN] {
        let mut out = [0u8; LEN];
        out[..8].copy_from_slice(&MAGIC);
        let fields = [
            u64::from(self.dirty),
            self.bytes,
            self.blobs,
            self.limit,
            self.hits,
            self.misses,
            self.corrupt,
            self.evicted,
        ];
        for (slot, value) in out[8..72].chunks_exact_mut(8).zip(fields) {
            slot.copy_from_slice(&value.to_le_bytes());
        }
        out[72..88].copy_from_slice(&self.boot);
        let check = blake3::hash(&out[..88]);
        out[88..].copy_from_slice(&check.as_bytes()[..8]);
        out
    }

    fn decode(bytes: &[u8; LEN]) -> Option<Self> {
        if bytes[..8] != MAGIC || blake3::hash(&bytes[..88]).as_bytes()[..8] != bytes[88..] {
            return None;
        }
        let mut fields = bytes[8..72]
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
        let mut next = || fields.next().expect("8 fields");
        Some(Self {
            dirty: next() != 0,
            bytes: next(),
            blobs: next(),
            limit: next(),
            hits: next(),
            misses: next(),
            corrupt: next(),
            evicted: next(),
            boot: bytes[72..88].try_into().expect("16 bytes"),
        })
    }
}

/// The state file, opened once per store handle.
#[derive(Debug)]
pub(super) struct StateFile {
    path: PathBuf,
    // `flock` excludes other open files, not other threads using this one: the mutex does that.
    file: Mutex<File>,
}

impl StateFile {
    pub fn open(path: PathBuf) -> Result<Self, CacheError> {
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(CacheError::io("opening", &path))?;
        Ok(Self {
            path,
            file: Mutex::new(file),
        })
    }

    /// Waits for the lock.
    pub fn lock(&self) -> Result<Locked<'_>, CacheError> {
        let file = self
            .file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        file.lock().map_err(CacheError::io("locking", &self.path))?;
        Ok(Locked {
            file,
            path: &self.path,
        })
    }

    /// The lock if nobody holds it now.
    pub fn try_lock(&self) -> Option<Locked<'_>> {
        let file = self.file.try_lock().ok()?;
        file.try_lock().ok()?;
        Some(Locked {
            file,
            path: &self.path,
        })
    }
}

/// The state file, locked; unlocked on drop.
pub(super) struct Locked<'a> {
    file: MutexGuard<'a, File>,
    path: &'a Path,
}

impl Locked<'_> {
    /// The record, or `None` when the file is new, torn or not ours.
    pub fn read(&self) -> Result<Option<State>, CacheError> {
        let mut buf = [0u8; LEN];
        match self.file.read_exact_at(&mut buf, 0) {
            Ok(()) => Ok(State::decode(&buf)),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(None),
            Err(e) => Err(CacheError::io("reading", self.path)(e)),
        }
    }

    pub fn write(&self, state: &State) -> Result<(), CacheError> {
        self.file
            .write_all_at(&state.encode(), 0)
            .map_err(CacheError::io("writing", self.path))
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

/// Identifies this boot of the machine (all zero where the kernel does not say).
pub(super) fn boot_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(text) = fs::read("/proc/sys/kernel/random/boot_id") {
        id.copy_from_slice(&blake3::hash(&text).as_bytes()[..16]);
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_and_detects_damage() {
        let state = State {
            dirty: true,
            bytes: 1 << 40,
            blobs: 7,
            limit: 99,
            hits: 1,
            misses: 2,
            corrupt: 3,
            evicted: 4,
            boot: [5; 16],
        };
        let bytes = state.encode();
        assert_eq!(State::decode(&bytes), Some(state));
        for at in [0, 20, 80, 95] {
            let mut torn = bytes;
            torn[at] ^= 1;
            assert_eq!(State::decode(&torn), None, "byte {at}");
        }
    }
}
