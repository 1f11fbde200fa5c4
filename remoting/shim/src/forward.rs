//! The forwarded calls (`sync` and `deferred` in the declaration list), generated from
//! [`gleam_protocol::cuda_api!`].
//!
//! Each function marshals the C arguments ([`Arg::to_request`]), checks the handles among them against this
//! process's view of the session's handles ([`crate::handles`]) so a dead or made-up one is refused at the
//! call with CUDA's code (a deferred call could not report it later), sends the call with the thread's
//! current context, and for `sync` calls (or any call in blocking mode) waits and writes the reply's
//! out-values back ([`Arg::write_reply`]). Handles a call creates or destroys are recorded by the same
//! registry rules the server applies. Exports marked `by-hand` in the list call these from hand-written
//! code; all others are these.

use gleam_protocol::api::{ApiCall, ApiReply, Arg, CType, args};
use gleam_protocol::registry::{Admit, Effect, Owner, Register};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{Call, Reply};

use crate::library::Translate;
use crate::{context, handles, state};

/// Sends one listed call; the reply for `sync` calls (and every call in blocking mode). Mirrored memory is
/// kept coherent around it ([`crate::managed::around`]).
fn send(call: ApiCall) -> Result<Option<ApiReply>, CUresult> {
    crate::managed::around(call.name(), || send_now(call))
}

fn send_now(call: ApiCall) -> Result<Option<ApiReply>, CUresult> {
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

/// Frees the peer's host allocation `p`, the copy behind a mirror the application has let go of,
/// without waiting (unless in blocking mode). A waited-for request would find any error pending from an
/// earlier asynchronous call and report it *instead of executing*: the peer would keep the allocation
/// for the rest of the session, and the application's next call would not see its error. A
/// fire-and-forget request runs all the same and leaves that error where it was.
pub fn cuMemFreeHost_detached(p: u64) -> Result<(), CUresult> {
    let call = ApiCall::cuMemFreeHost(args::cuMemFreeHost { p });
    crate::managed::around(call.name(), || {
        let session = state::session()?;
        session
            .client
            .send(context::current(), Call::Api(call))
            .map_err(state::lost)?
            .result()
    })
}

/// Records what a call that went through did to the session's handles.
fn settle(effect: Effect, reply: Option<&ApiReply>) {
    let died = handles::lock().apply(effect, reply);
    if !died.is_empty() {
        handles::died(&died);
    }
}

macro_rules! forwarders {
    ($($mode:ident fn $name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {$(
        #[doc = concat!("Forwards `", stringify!($name), "`.")]
        #[allow(clippy::too_many_arguments, unused_variables)]
        pub unsafe fn $name($($arg: <$ty as CType>::C),*) -> Result<(), CUresult> {
            let request = args::$name {
                // SAFETY: the application's arguments, as the C API requires them. Client-side handles
                // (library kernels) become the peer's.
                $($arg: <$ty as Translate>::translate(unsafe { <$ty as Arg>::to_request($arg) }?)?,)*
            };
            let mut owner = Owner::in_context(context::current());
            request.admit(&handles::lock(), &mut owner)?;
            let call = ApiCall::$name(request);
            let effect = Effect::of(&call);
            match send(call)? {
                Some(ApiReply::$name(outs)) => {
                    outs.register(&mut handles::lock(), &owner);
                    let reply = ApiReply::$name(outs.clone());
                    crate::memory::note_global(&reply, &owner);
                    settle(effect, Some(&reply));
                    // SAFETY: `to_request` accepted each argument above.
                    $(unsafe { <$ty as Arg>::write_reply($arg, outs.$arg) };)*
                    Ok(())
                }
                None => {
                    settle(effect, None);
                    Ok(())
                }
                Some(other) => Err(state::mismatch(stringify!($name), &Reply::Api(other))),
            }
        }
    )*};
}

gleam_protocol::cuda_api!(forwarders);
