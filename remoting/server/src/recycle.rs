//! The session process's reply buffers ([`REPLIES`]): a device-to-host copy's pieces are written into
//! memory an earlier reply freed (see [`gleam_protocol::recycle`]).

pub use gleam_protocol::recycle::{RECYCLE_FROM, Recycler};

/// Buffers kept for reuse at most: 16 pieces of 4 MiB (64 MiB; the session process's reply cache holds
/// up to 96 MiB of replies the client has not acknowledged). An idle session keeps them.
const KEEP: usize = 16;

/// The session process's reply buffers.
pub static REPLIES: Recycler = Recycler::new(KEEP, usize::MAX);
