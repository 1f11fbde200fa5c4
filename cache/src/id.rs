//! [`ContentId`]: the BLAKE3 address of a blob.

use std::fmt;
use std::str::FromStr;

use crate::CacheError;

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
