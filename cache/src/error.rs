//! The two kinds of failure: the local store's ([`CacheError`]) and a peer's malformed or lying
//! input ([`DecodeError`]).

use std::io;
use std::path::PathBuf;

use crate::ContentId;

/// A failure of the local blob store.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The file system refused an operation.
    #[error(
        "content cache: {action} {path}: {source} (check the permissions and free space of the cache \
         directory, or run `gleam cache clear`)"
    )]
    Io {
        /// What the store was doing.
        action: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// Bytes written through a [`BlobWriter`](crate::BlobWriter) do not hash to the id they were
    /// promised to have; nothing was stored.
    #[error(
        "content cache: the bytes written hash to {actual}, not to the expected {expected}; nothing was stored"
    )]
    HashMismatch {
        /// The id the caller expected.
        expected: ContentId,
        /// The id of the bytes actually written.
        actual: ContentId,
    },
    /// A payload's destination buffer does not have the manifest's length.
    #[error("content cache: the buffer holds {actual} bytes but the manifest describes {expected}")]
    BufferLength {
        /// The manifest's length.
        expected: u64,
        /// The buffer's length.
        actual: u64,
    },
    /// A string that is not 64 hex digits was given as a content id.
    #[error("not a content id (64 hex digits expected): {0:?}")]
    BadContentId(String),
}

impl CacheError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io {
            action,
            path,
            source,
        }
    }
}

/// Input from a peer (an encoded chunk or a manifest) that cannot be accepted. The peer is at fault:
/// drop the input, and fetch the chunk again or end the session.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Fewer bytes than the format's fixed part.
    #[error("truncated {what}: {got} bytes, at least {needed} expected")]
    Truncated {
        /// The kind of input.
        what: &'static str,
        /// Bytes needed.
        needed: usize,
        /// Bytes received.
        got: usize,
    },
    /// An encoded chunk names a codec this build does not know.
    #[error("unknown chunk codec {0}")]
    UnknownCodec(u8),
    /// A declared size above what this build accepts.
    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// The size declared.
        what: &'static str,
        /// Its value.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// zstd refused the compressed body.
    #[error("chunk body is not valid zstd data: {0}")]
    Zstd(#[source] io::Error),
    /// The decoded length differs from the declared or expected one.
    #[error("chunk decodes to {actual} bytes, {expected} expected")]
    Length {
        /// The length expected.
        expected: u64,
        /// The length obtained.
        actual: u64,
    },
    /// The decoded bytes are not the chunk that was asked for.
    #[error("chunk decodes to content {actual}, not the expected {expected}")]
    HashMismatch {
        /// The id asked for.
        expected: ContentId,
        /// The id of what arrived.
        actual: ContentId,
    },
    /// A manifest does not start with the manifest magic, or has an unknown version.
    #[error("not a Gleam manifest (bad magic or version)")]
    NotManifest,
    /// A manifest's chunk list does not match its length and chunk size.
    #[error(
        "manifest of {len} bytes in chunks of {chunk_size} should list {expected} chunks, not {listed}"
    )]
    ChunkCount {
        /// The payload length.
        len: u64,
        /// The chunk size.
        chunk_size: u32,
        /// Chunks implied by the two.
        expected: u64,
        /// Chunks listed.
        listed: u64,
    },
}
