//! [`ContentId`]: the BLAKE3 address of a blob.

use std::fmt;
use std::str::FromStr;

use crate::CacheError;

/// The runs [`ContentId::of_parts`] hashes at a time: a power of two of BLAKE3's 1 KiB chunks, so every
/// run but the last ends on a subtree boundary, and small enough to stay in the core's cache.
const GATHER: usize = 64 << 10;

/// A blob's address: the BLAKE3 hash of its bytes.
///
/// BLAKE3 rather than a faster non-cryptographic hash: a peer that chooses its inputs must not be
/// able to make two contents share an address and so poison another client's cache.
#[derive(Clone, Copy, Eq, Hash, Ord, PartialEq, PartialOrd)]
pub struct ContentId(pub [u8; 32]);

impl ContentId {
    /// The address of `bytes` (one thread; see [`Manifest::of`](crate::Manifest::of) for large
    /// payloads).
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    /// The address of the bytes of `parts`, in order, as if they were one slice (one thread): a chunk
    /// as the network delivered it, a packet's worth a part. Small parts are gathered into runs of
    /// [`GATHER`] bytes first, so BLAKE3 hashes many of its 1 KiB chunks at once (SIMD), as it does
    /// on one large slice.
    pub fn of_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut hasher = blake3::Hasher::new();
        let mut run = Vec::with_capacity(GATHER);
        for part in parts {
            if run.is_empty() && part.len() >= GATHER {
                hasher.update(part);
                continue;
            }
            let mut part = part;
            while !part.is_empty() {
                let n = (GATHER - run.len()).min(part.len());
                run.extend_from_slice(&part[..n]);
                part = &part[n..];
                if run.len() == GATHER {
                    hasher.update(&run);
                    run.clear();
                }
            }
        }
        hasher.update(&run);
        Self(*hasher.finalize().as_bytes())
    }

    /// The 32 bytes of the hash.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The 64 lowercase hex digits that name the blob's file.
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }
}

impl From<blake3::Hash> for ContentId {
    fn from(hash: blake3::Hash) -> Self {
        Self(*hash.as_bytes())
    }
}

impl fmt::Display for ContentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ContentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentId({})", &self.to_hex()[..16])
    }
}

impl FromStr for ContentId {
    type Err = CacheError;

    fn from_str(s: &str) -> Result<Self, CacheError> {
        blake3::Hash::from_hex(s)
            .map(Self::from)
            .map_err(|_| CacheError::BadContentId(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_hash_as_the_whole() {
        let all: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        for cut in [1, 1000, 5_999, 6_000, GATHER, GATHER + 1, all.len()] {
            assert_eq!(
                ContentId::of_parts(all.chunks(cut)),
                ContentId::of(&all),
                "parts of {cut}"
            );
        }
        assert_eq!(ContentId::of_parts([]), ContentId::of(&[]));
    }
}
