//! The session's mirrored allocations: memory that the client also maps at its own address and keeps
//! coherent by writing and reading bytes directly ([`Call::MirrorWrite`](gleam_protocol::wire::Call) and
//! `MirrorRead`): managed memory (`cuMemAllocManaged`) and host memory the device maps
//! (`cuMemHostAlloc`).
//!
//! A backend serves those reads and writes with plain loads and stores on the server (the real backend
//! with the CPU, on memory that NVIDIA's driver makes CPU-accessible), so an address the client names
//! must lie inside an allocation of this kind that this session made and has not freed: [`Mirrors`]
//! knows them from the calls that create and free them, and refuses anything else before a backend sees
//! it. A free is recorded before it executes (whatever its outcome, the client has let go), and the
//! allocations of a context that lost its memory go with it.

use std::collections::BTreeMap;

use gleam_protocol::api::{ApiCall, ApiReply};
use gleam_protocol::copy::{Copy3D, Place};
use gleam_protocol::registry::{Handles, Kind};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::COPY_CHUNK;

#[derive(Clone, Copy, Debug)]
struct Mirror {
    len: u64,
    ctx: u64,
}

/// The mirrored allocations of one session, by server address.
#[derive(Debug, Default)]
pub struct Mirrors {
    live: BTreeMap<u64, Mirror>,
}

/// What a call about to execute will add, if it succeeds.
#[derive(Clone, Copy, Debug)]
pub struct Adding {
    len: u64,
}

impl Mirrors {
    /// Before `call` executes: frees let go of their allocation now; allocations say their size.
    pub fn before(&mut self, call: &ApiCall) -> Option<Adding> {
        match call {
            ApiCall::cuMemAllocManaged(a) => Some(Adding {
                len: a.bytesize as u64,
            }),
            ApiCall::cuMemHostAlloc(a) => Some(Adding {
                len: a.bytesize as u64,
            }),
            ApiCall::cuMemFree_v2(a) => {
                self.live.remove(&a.dptr);
                None
            }
            ApiCall::cuMemFreeAsync(a) => {
                self.live.remove(&a.dptr);
                None
            }
            ApiCall::cuMemFreeHost(a) => {
                self.live.remove(&a.p);
                None
            }
            _ => None,
        }
    }

    /// After a call that [`Mirrors::before`] said adds an allocation succeeded, made in context `ctx`.
    pub fn after(&mut self, adding: Adding, reply: &ApiReply, ctx: u64) {
        let base = match reply {
            ApiReply::cuMemAllocManaged(o) => o.dptr,
            ApiReply::cuMemHostAlloc(o) => o.pp,
            _ => return,
        };
        if base != 0 && adding.len > 0 {
            self.live.insert(
                base,
                Mirror {
                    len: adding.len,
                    ctx,
                },
            );
        }
    }

    /// Context `ctx` lost everything it held.
    pub fn emptied(&mut self, ctx: u64) {
        self.live.retain(|_, m| m.ctx != ctx);
    }

    /// Forgets everything (the session is over).
    pub fn clear(&mut self) {
        self.live.clear();
    }

    /// Whether `[addr, addr + len)` lies inside one live mirrored allocation.
    pub fn check(&self, addr: u64, len: u64) -> Result<(), CUresult> {
        let inside = self
            .live
            .range(..=addr)
            .next_back()
            .is_some_and(|(&base, m)| addr.checked_add(len).is_some_and(|end| end <= base + m.len));
        if inside {
            Ok(())
        } else {
            tracing::warn!(
                addr,
                len,
                "refusing a mirror access outside this session's mirrored allocations"
            );
            Err(CUresult::INVALID_VALUE)
        }
    }
}

/// Checks what the session engine can about a [`Copy3D`] before a backend sees it: live array handles and
/// stream, host bytes that match the copy, and a host destination that fits a reply frame.
pub fn check_copy(
    copy: &Copy3D,
    bulk: &[u8],
    stream: Option<u64>,
    handles: &Handles,
) -> Result<(), CUresult> {
    if let Some(s) = stream {
        handles.check(Kind::Stream, s)?;
    }
    for side in [&copy.src, &copy.dst] {
        if let Place::Array(a) = side.place {
            handles.check(Kind::Array, a)?;
        }
    }
    let packed = copy.packed_bytes().ok_or(CUresult::INVALID_VALUE)?;
    let host_src = copy.src.place == Place::Host;
    if host_src && packed != bulk.len() as u64 || !host_src && !bulk.is_empty() {
        return Err(CUresult::INVALID_VALUE);
    }
    if copy.dst.place == Place::Host && packed > COPY_CHUNK as u64 {
        return Err(CUresult::INVALID_VALUE);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gleam_protocol::api::{args, outs};

    #[test]
    fn mirrors_follow_their_allocations_and_contexts() {
        let mut m = Mirrors::default();
        let alloc = ApiCall::cuMemAllocManaged(args::cuMemAllocManaged {
            dptr: (),
            bytesize: 4096,
            flags: 1,
        });
        let adding = m.before(&alloc).unwrap();
        m.after(
            adding,
            &ApiReply::cuMemAllocManaged(outs::cuMemAllocManaged {
                dptr: 0x10000,
                ..Default::default()
            }),
            7,
        );
        assert_eq!(m.check(0x10000, 4096), Ok(()));
        assert_eq!(m.check(0x10ff0, 16), Ok(()));
        assert_eq!(m.check(0x10ff0, 17), Err(CUresult::INVALID_VALUE));
        assert_eq!(m.check(0xfff0, 32), Err(CUresult::INVALID_VALUE));
        m.emptied(8);
        assert_eq!(m.check(0x10000, 1), Ok(()));
        m.emptied(7);
        assert_eq!(m.check(0x10000, 1), Err(CUresult::INVALID_VALUE));

        let host = ApiCall::cuMemHostAlloc(args::cuMemHostAlloc {
            pp: (),
            bytesize: 100,
            flags: 2,
        });
        let adding = m.before(&host).unwrap();
        m.after(
            adding,
            &ApiReply::cuMemHostAlloc(outs::cuMemHostAlloc {
                pp: 0x20000,
                ..Default::default()
            }),
            7,
        );
        assert_eq!(m.check(0x20000, 100), Ok(()));
        // Freed before the free executes.
        m.before(&ApiCall::cuMemFreeHost(args::cuMemFreeHost { p: 0x20000 }));
        assert_eq!(m.check(0x20000, 1), Err(CUresult::INVALID_VALUE));
    }
}
