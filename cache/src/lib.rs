//! Gleam's content cache: what a serving peer should not receive twice (model weights, module
//! images), named by BLAKE3 hash, kept on disk across runs and shared by the session processes.
//!
//! The main types, top down:
//!
//! * [`BlobStore`]: a persistent directory of immutable blobs shared by threads and processes: a
//!   size limit with least-recently-used eviction, every read verified (a corrupt blob is removed
//!   and reported as a miss), atomic crash-safe writes, [`Stats`] and [`BlobStore::clear`], and
//!   [`CacheDigest`], the summary peers gossip.
//! * [`Manifest`]: a large payload as the ids of its fixed-size chunks ([`CHUNK_SIZE`]); a store's
//!   [`Plan`] says which chunks it lacks, [`BlobStore::read_payload`] assembles the rest.
//! * [`Encoder`] / [`Decoder`]: a chunk's wire form, zstd-compressed (optionally byte-shuffled)
//!   when that pays, decided chunk by chunk, verified against its id on decode.
//! * [`ContentId`]: a blob's address.
//!
//! How a transfer uses them: the client computes the payload's [`Manifest`] and announces it; the
//! server asks its store for a [`Plan`] and requests the missing chunks; the client sends each as
//! an [`Encoded`] chunk; the server decodes it ([`Decoder::decode_into`], straight into the
//! payload buffer), stores it ([`BlobStore::put`]) and reads the rest from the store
//! ([`BlobStore::read_payload`]), fetching whatever turns out absent or corrupt there.

mod codec;
mod error;
mod id;
mod manifest;
pub mod parallel;
mod store;

pub use codec::{
    ChunkHeader, Codec, Compression, Decoder, Encoded, Encoder, HEADER_LEN, decode_chunk,
    encode_chunk,
};
pub use error::{CacheError, DecodeError};
pub use id::ContentId;
pub use manifest::{CHUNK_SIZE, MAX_CHUNK_SIZE, Manifest};
pub use store::{BlobStore, BlobWriter, CacheDigest, Cleared, DEFAULT_LIMIT, Plan, Stats};
