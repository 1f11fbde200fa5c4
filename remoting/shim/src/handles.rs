//! This process's view of the session's handles: the same [`Handles`] registry, with the same rules, that
//! the server keeps, fed by the same calls (the generated forwarders and the hand-written loaders).
//!
//! A fire-and-forget call cannot report an error later, so `cuEventRecord` with a destroyed event or
//! `cuLaunchKernel` on a made-up stream must fail at the call: they are checked here, without a round
//! trip. When a context dies (destroyed, or the primary context released for the last time or reset),
//! what the shim keeps beside the registry follows: that context's allocations and context-local storage.

use std::sync::{LazyLock, Mutex, MutexGuard};

use gleam_protocol::registry::{Died, Handles, Kind, Owner};
use gleam_protocol::types::CUresult;

static HANDLES: LazyLock<Mutex<Handles>> = LazyLock::new(|| Mutex::new(Handles::default()));

/// The registry. (A poisoned lock only means a thread panicked while holding it; the maps stay
/// consistent.)
pub fn lock() -> MutexGuard<'static, Handles> {
    HANDLES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether `handle` is a live handle of `kind` (CUDA's error if not).
pub fn check(kind: Kind, handle: u64) -> Result<(), CUresult> {
    lock().check(kind, handle)
}

/// Records a handle a hand-written call obtained (module, function, library...), owned as `owner` says.
pub fn record(kind: Kind, handle: u64, owner: &Owner) {
    lock().register(kind, handle, owner);
}

/// Handles died (and contexts lost everything they held): drop what the shim keeps for them.
pub fn died(died: &Died) {
    crate::module::forget_functions(&died.handles);
    crate::memory::holders_died(&died.handles);
    for &ctx in &died.emptied_contexts {
        crate::memory::context_emptied(ctx);
        crate::managed::context_emptied(ctx);
        crate::export_table::context_emptied(ctx);
        crate::context::context_emptied(ctx);
    }
}
