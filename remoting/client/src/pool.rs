//! The buffers of requests' bulk bytes, reused across requests.
//!
//! A large copy's bytes are copied once on this side, out of the caller's buffer (which the caller may
//! reuse as soon as the call returns) into a buffer that stays with the request until the serving side
//! acknowledges it (it is sent again after a resume). A fresh buffer for each 4-8 MiB piece costs a page
//! fault per page on that copy, which made it several times slower than the copy itself (7 ms per
//! 8 MiB on the H200 host): [`copy`] writes into buffers of [`REQUESTS`], used before, their pages
//! resident.

use bytes::Bytes;
use gleam_cache::CHUNK_SIZE;
use gleam_protocol::recycle::Recycler;

/// Bulk parts from this size on get a buffer of their own ([`copy`]); smaller ones are copied into
/// their lane's batch with the frames around them.
pub(crate) const OWN_BUFFER_FROM: usize = 64 << 10;

/// Idle buffers kept at most, each at most a chunk (8 MiB): 64 MiB, what a lane's upload has in flight
/// at about 1 GB/s between the copy and the serving side's acknowledgement, with room to spare. A larger
/// buffer (a module image's) is freed when it comes back.
static REQUESTS: Recycler = Recycler::new(8, CHUNK_SIZE as usize);

/// `part` copied into a buffer of its own, from [`REQUESTS`] where one fits; it goes back there once
/// every view of it is dropped.
pub(crate) fn copy(part: &[u8]) -> Bytes {
    let mut buf = REQUESTS.buffer(part.len());
    buf.extend_from_slice(part);
    REQUESTS.bytes(buf)
}
