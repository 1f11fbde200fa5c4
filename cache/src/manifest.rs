//! Chunked payloads: a [`Manifest`] lists the BLAKE3 ids of a payload's fixed-size chunks.
//!
//! Chunks are cut at fixed offsets, so a buffer changed in place yields a manifest that differs
//! only in the chunks that hold the changed bytes ([`Manifest::changed_since`]); identical chunks,
//! within a payload or across payloads, share one id and are stored and sent once.

use std::ops::Range;

use crate::{ContentId, DecodeError, parallel};

/// The chunk size [`Manifest::of`] uses: 8 MiB.
///
/// Large enough that per-chunk costs vanish (one file, one fsync, one 32-byte id on the wire and one
/// zstd frame per chunk: a 512 MiB payload is 64 chunks and a 2 KiB manifest) and that BLAKE3 and
/// zstd run at full speed; small enough that a partly changed buffer resends little, that two cores
/// get several chunks of even a 32 MiB tensor to hash and compress in parallel, and that one chunk
/// is ~10 ms of zstd work, short against a link's round trip budget. The crate's `throughput`
/// example measures the trade-off.
pub const CHUNK_SIZE: u32 = 8 << 20;

/// The largest chunk size a manifest may declare (and so the largest chunk a peer may make this
/// side decode into memory).
pub const MAX_CHUNK_SIZE: u32 = 64 << 20;

const MAGIC: [u8; 4] = *b"GLMF";
const VERSION: u8 = 1;
/// Magic, version, 3 reserved zero bytes, length (u64), chunk size (u32), chunk count (u32).
const HEADER_LEN: usize = 24;

/// A payload described by the ids of its fixed-size chunks (the last one may be shorter).
///
/// Its own id ([`Manifest::id`]) is the BLAKE3 of its [encoding](Manifest::encode), so a payload can
/// be announced with one id once the manifest itself is in the peer's store.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct Manifest {
    len: u64,
    chunk_size: u32,
    chunks: Vec<ContentId>,
}

impl Manifest {
    /// The manifest of `data` in chunks of [`CHUNK_SIZE`], hashed on every core.
    pub fn of(data: &[u8]) -> Self {
        Self::with_chunk_size(data, CHUNK_SIZE)
    }

    /// The manifest of `data` in chunks of `chunk_size` bytes.
    ///
    /// # Panics
    /// If `chunk_size` is 0 or above [`MAX_CHUNK_SIZE`] (a programming error: sizes are constants).
    pub fn with_chunk_size(data: &[u8], chunk_size: u32) -> Self {
        assert!(
            (1..=MAX_CHUNK_SIZE).contains(&chunk_size),
            "chunk size {chunk_size} outside 1..={MAX_CHUNK_SIZE}"
        );
        let chunks = parallel::map(data.chunks(chunk_size as usize).collect(), |c| {
            ContentId::of(c)
        });
        Self {
            len: data.len() as u64,
            chunk_size,
            chunks,
        }
    }

    /// The payload's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the payload is empty (no chunks).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size of every chunk but possibly the last.
    pub fn chunk_size(&self) -> u32 {
        self.chunk_size
    }

    /// The chunk ids, in payload order.
    pub fn chunks(&self) -> &[ContentId] {
        &self.chunks
    }

    /// Where chunk `index` lies in the payload.
    ///
    /// # Panics
    /// If `index` is not below `chunks().len()`.
    pub fn chunk_range(&self, index: usize) -> Range<u64> {
        assert!(index < self.chunks.len(), "chunk {index} out of range");
        let start = index as u64 * u64::from(self.chunk_size);
        start..(start + u64::from(self.chunk_size)).min(self.len)
    }

    /// The indices of the chunks that `older` (the manifest of an earlier version of the same
    /// buffer) does not have at the same place: the only ones a peer holding `older` may lack.
    pub fn changed_since(&self, older: &Manifest) -> Vec<usize> {
        if older.chunk_size != self.chunk_size {
            return (0..self.chunks.len()).collect();
        }
        self.chunks
            .iter()
            .enumerate()
            .filter(|(i, id)| older.chunks.get(*i) != Some(id))
            .map(|(i, _)| i)
            .collect()
    }

    /// The manifest's own address: BLAKE3 of its encoding.
    pub fn id(&self) -> ContentId {
        ContentId::of(&self.encode())
    }

    /// The manifest's wire and storage form: a 24-byte header, then the 32-byte chunk ids.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + 32 * self.chunks.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&[VERSION, 0, 0, 0]);
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.chunk_size.to_le_bytes());
        out.extend_from_slice(&(self.chunks.len() as u32).to_le_bytes());
        for id in &self.chunks {
            out.extend_from_slice(&id.0);
        }
        out
    }

    /// Parses [`encode`](Self::encode)'s form, from a peer or the store. Allocates no more than the
    /// input's size.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let Some((header, ids)) = bytes.split_first_chunk::<HEADER_LEN>() else {
            return Err(DecodeError::Truncated {
                what: "manifest",
                needed: HEADER_LEN,
                got: bytes.len(),
            });
        };
        if header[..4] != MAGIC || header[4..8] != [VERSION, 0, 0, 0] {
            return Err(DecodeError::NotManifest);
        }
        let len = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
        let chunk_size = u32::from_le_bytes(header[16..20].try_into().expect("4 bytes"));
        let listed = u32::from_le_bytes(header[20..24].try_into().expect("4 bytes"));
        if chunk_size == 0 || chunk_size > MAX_CHUNK_SIZE {
            return Err(DecodeError::TooLarge {
                what: "manifest chunk size",
                len: chunk_size.into(),
                max: MAX_CHUNK_SIZE.into(),
            });
        }
        let expected = len.div_ceil(u64::from(chunk_size));
        if expected != u64::from(listed) || ids.len() as u64 != 32 * u64::from(listed) {
            return Err(DecodeError::ChunkCount {
                len,
                chunk_size,
                expected,
                listed: ids.len() as u64 / 32,
            });
        }
        let chunks = ids
            .chunks_exact(32)
            .map(|id| ContentId(id.try_into().expect("32 bytes")))
            .collect();
        Ok(Self {
            len,
            chunk_size,
            chunks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn chunks_are_cut_at_fixed_offsets() {
        let data = pattern(10_000);
        let m = Manifest::with_chunk_size(&data, 4096);
        assert_eq!(m.len(), 10_000);
        assert_eq!(m.chunks().len(), 3);
        assert_eq!(m.chunk_range(2), 8192..10_000);
        for (i, id) in m.chunks().iter().enumerate() {
            let r = m.chunk_range(i);
            assert_eq!(*id, ContentId::of(&data[r.start as usize..r.end as usize]));
        }
        assert!(Manifest::of(&[]).chunks().is_empty());
    }

    #[test]
    fn a_change_in_place_renews_only_its_chunks() {
        let old = pattern(5 * 1000 + 7);
        let mut new = old.clone();
        new[2500] ^= 1; // chunk 2
        new[4999] ^= 1; // chunk 4
        let (a, b) = (
            Manifest::with_chunk_size(&old, 1000),
            Manifest::with_chunk_size(&new, 1000),
        );
        assert_eq!(b.changed_since(&a), vec![2, 4]);
        assert_ne!(a.id(), b.id());
        // Growing the buffer adds its new tail chunk and renews the old, shorter last chunk.
        let mut grown = old.clone();
        grown.extend_from_slice(&[9; 1500]);
        let c = Manifest::with_chunk_size(&grown, 1000);
        assert_eq!(c.changed_since(&a), vec![5, 6]);
    }

    #[test]
    fn encoding_round_trips_and_rejects_lies() {
        let m = Manifest::with_chunk_size(&pattern(3000), 1024);
        let bytes = m.encode();
        assert_eq!(Manifest::decode(&bytes).unwrap(), m);
        assert!(matches!(
            Manifest::decode(&bytes[..10]),
            Err(DecodeError::Truncated { .. })
        ));
        assert!(matches!(
            Manifest::decode(&bytes[..bytes.len() - 32]),
            Err(DecodeError::ChunkCount { .. })
        ));
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert!(matches!(
            Manifest::decode(&bad),
            Err(DecodeError::NotManifest)
        ));
        let mut huge = bytes.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            Manifest::decode(&huge),
            Err(DecodeError::ChunkCount { .. })
        ));
        let mut zero = bytes;
        zero[16..20].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            Manifest::decode(&zero),
            Err(DecodeError::TooLarge { .. })
        ));
    }
}
