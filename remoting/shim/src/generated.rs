//! The exports generated from the declaration list ([`gleam_protocol::cuda_api!`]).
//!
//! For every listed call, [`fwd`] holds a Rust function that marshals the C arguments
//! ([`Arg::to_request`]), sends the call with the thread's current context, and for `sync` calls (or any
//! call in blocking mode) waits and writes the reply's out-values back ([`Arg::write_reply`]); `deferred`
//! calls return `CUDA_SUCCESS` once queued. The C export of each call simply runs its `fwd` function,
//! except for the calls listed in `manual!` below, whose exports are hand-written (they validate or record
//! something locally, then call `fwd`).

use gleam_protocol::api::{ApiCall, ApiReply, Arg, args};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{Call, Reply};

use crate::{context, state};

/// Sends one listed call (the body of every generated `fwd` function).
fn forward(call: ApiCall) -> Result<Option<ApiReply>, CUresult> {
    let session = state::session()?;
    let ctx = context::current();
    let client = &session.client;
    if call.is_sync() || client.is_blocking() {
        let name = call.name();
        let (result, reply) = client.call(ctx, Call::Api(call)).map_err(state::lost)?;
        result.result()?;
        match reply {
            Reply::Api(reply) => Ok(Some(reply)),
            Reply::Empty => Ok(None),
            other => Err(state::mismatch(name, &other)),
        }
    } else {
        client
            .send(ctx, Call::Api(call))
            .map_err(state::lost)?
            .result()?;
        Ok(None)
    }
}

macro_rules! shim_api {
    ($($mode:ident fn $name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {
        /// One forwarding function per listed call (see the module docs).
        #[allow(clippy::too_many_arguments, unused_variables)]
        pub mod fwd {
            use super::*;
            $(
                #[doc = concat!("Forwards `", stringify!($name), "`.")]
                pub unsafe fn $name($($arg: <$ty as Arg>::C),*) -> Result<(), CUresult> {
                    let request = args::$name {
                        // SAFETY: the application's arguments, as the C API requires them.
                        $($arg: unsafe { <$ty as Arg>::to_request($arg) }?,)*
                    };
                    match forward(ApiCall::$name(request))? {
                        Some(ApiReply::$name(outs)) => {
                            // SAFETY: `to_request` accepted each argument above.
                            $(unsafe { <$ty as Arg>::write_reply($arg, outs.$arg) };)*
                            Ok(())
                        }
                        None => Ok(()),
                        Some(other) => Err(state::mismatch(stringify!($name), &Reply::Api(other))),
                    }
                }
            )*
        }

        $(manual! { $name ($($arg: $ty),*) })*
    };
}

/// Emits the C export of a listed call unless it is hand-written elsewhere.
macro_rules! manual {
    // Hand-written in context.rs.
    (cuDevicePrimaryCtxRetain $($rest:tt)*) => {};
    (cuCtxCreate_v2 $($rest:tt)*) => {};
    (cuCtxDestroy_v2 $($rest:tt)*) => {};
    // Hand-written in memory.rs (the allocation table).
    (cuMemAlloc_v2 $($rest:tt)*) => {};
    (cuMemAllocPitch_v2 $($rest:tt)*) => {};
    (cuMemAllocAsync $($rest:tt)*) => {};
    (cuMemFree_v2 $($rest:tt)*) => {};
    (cuMemFreeAsync $($rest:tt)*) => {};
    (cuMemGetAddressRange_v2 $($rest:tt)*) => {};
    // Hand-written in handles.rs (streams and events validated locally).
    (cuStreamCreate $($rest:tt)*) => {};
    (cuStreamCreateWithPriority $($rest:tt)*) => {};
    (cuStreamDestroy_v2 $($rest:tt)*) => {};
    (cuEventCreate $($rest:tt)*) => {};
    (cuEventDestroy_v2 $($rest:tt)*) => {};
    (cuEventRecord $($rest:tt)*) => {};
    (cuEventRecordWithFlags $($rest:tt)*) => {};
    (cuStreamWaitEvent $($rest:tt)*) => {};
    // Hand-written in module.rs (function and kernel caches).
    (cuFuncGetAttribute $($rest:tt)*) => {};
    (cuLibraryGetKernel $($rest:tt)*) => {};
    ($name:ident ($($arg:ident: $ty:ty),*)) => {
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        #[doc = concat!("`", stringify!($name), "`, forwarded to the peer.")]
        pub unsafe extern "C" fn $name($($arg: <$ty as Arg>::C),*) -> CUresult {
            // SAFETY: forwarded C contract.
            crate::guard(stringify!($name), move || unsafe { fwd::$name($($arg),*) })
        }
    };
}

gleam_protocol::cuda_api!(shim_api);
