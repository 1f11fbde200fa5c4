//! Gleam's `libcuda.so.1`: the CUDA driver API of NVIDIA's 580 driver, executed on a peer's GPU.
//!
//! Built as `libgleamcuda.so` (SONAME `libcuda.so.1`, only `cu*` symbols exported); `gleam run` puts it in
//! front of the program as `libcuda.so.1`, `libcuda.so` and `libcuda.so.13`. Every export is one of:
//!
//! * **generated** from the declaration list [`gleam_protocol::cuda_api!`] ([`generated`]): the arguments
//!   are marshalled through [`gleam_protocol::api::Arg`] and the call goes to the peer, `sync` ones waiting
//!   for the reply, `deferred` ones fire-and-forget;
//! * **hand-written**: answered locally from what the server said at connect ([`device`], [`context`],
//!   [`proc`], [`export_table`]), or forwarded with judgement ([`memory`]: copies and the allocation table;
//!   [`module`]: images, functions and launches; [`handles`]: streams and events checked locally);
//! * a **stub** ([`stubs`], generated data) returning `CUDA_ERROR_NOT_SUPPORTED` and logging its name once.
//!
//! The session itself ([`state::Session`], a [`gleam_client::Client`]) is opened by `cuInit` from
//! `GLEAM_PEER` and `GLEAM_CONFIG_DIR`. No panic crosses the C ABI ([`guard`]); after the library's
//! destructor ran every call returns `CUDA_ERROR_DEINITIALIZED`; a `fork()`ed child is refused, as NVIDIA's
//! driver refuses it.

#![allow(non_snake_case)]
// Every export is `unsafe extern "C"` with the C contract of the CUDA function it implements.
#![allow(clippy::missing_safety_doc)]

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};

use gleam_protocol::types::CUresult;

pub mod context;
pub mod device;
pub mod export_table;
pub mod generated;
pub mod handles;
pub mod memory;
pub mod module;
pub mod occupancy;
pub mod proc;
pub mod state;
#[rustfmt::skip] // generated data, compared byte for byte by `stubs_are_current`
pub mod stubs;

/// The server refuses to load a library exporting this symbol as "the real driver": finding it means the
/// server inherited a client's `LD_LIBRARY_PATH` and would forward to itself.
#[unsafe(no_mangle)]
pub static gleam_shim_marker: u32 = 0x474c_4d31;

/// Set by the library's destructor: from then on every call returns `CUDA_ERROR_DEINITIALIZED`.
static DEINITIALIZED: AtomicBool = AtomicBool::new(false);

/// Runs one export's body: refuses calls after teardown, and turns a panic into `CUDA_ERROR_UNKNOWN`
/// (logged) instead of unwinding into C.
pub(crate) fn guard(name: &'static str, body: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    if DEINITIALIZED.load(Ordering::Acquire) {
        return CUresult::DEINITIALIZED;
    }
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUresult::SUCCESS,
        Ok(Err(err)) => {
            tracing::trace!(call = name, %err, "call failed");
            err
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(call = name, panic = %what, "internal error in Gleam's libcuda (a bug)");
            CUresult::UNKNOWN
        }
    }
}

/// Defines hand-written exports: `export! { fn cuName(a: T, ...) { body returning Result<(), CUresult> } }`.
/// Each becomes a `#[no_mangle] unsafe extern "C" fn` whose body runs inside [`guard`]; the names are
/// collected in the module's `EXPORTED` list (the stub generator and the export test read it).
macro_rules! export {
    ($(fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block)*) => {
        $(
            #[unsafe(no_mangle)]
            #[allow(clippy::too_many_arguments, unused_unsafe)]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> gleam_protocol::types::CUresult {
                $crate::guard(stringify!($name), move || -> Result<(), gleam_protocol::types::CUresult> {
                    unsafe { $body }
                })
            }
        )*
        /// The exports this module defines by hand.
        pub const EXPORTED: &[&str] = &[$(stringify!($name)),*];
    };
}
pub(crate) use export;

/// Every hand-written export, from each module's `EXPORTED` list.
pub fn hand_written() -> Vec<&'static str> {
    [
        context::EXPORTED,
        device::EXPORTED,
        export_table::EXPORTED,
        handles::EXPORTED,
        memory::EXPORTED,
        module::EXPORTED,
        occupancy::EXPORTED,
        proc::EXPORTED,
    ]
    .concat()
}

/// Writes `value` through `out` if it is not NULL; a NULL out-pointer is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, value: T) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: non-NULL, and the caller promised it is valid.
    unsafe { out.write_unaligned(value) };
    Ok(())
}

/// The library destructor: closes the session in order while the process can still send, then refuses
/// every later call (cudart calls cuLibraryUnload and friends after our destructors ran).
extern "C" fn on_unload() {
    // Never unwind out of a destructor: a failure to say goodbye only costs the server an idle timeout.
    let _ = catch_unwind(state::shutdown);
    DEINITIALIZED.store(true, Ordering::Release);
}

#[used]
#[unsafe(link_section = ".fini_array")]
static ON_UNLOAD: extern "C" fn() = on_unload;

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// The stub list is generated data: the driver's exports minus everything implemented.
    /// `GLEAM_REGEN_STUBS=1 cargo test -p gleam-shim stubs_are_current` rewrites `src/stubs.rs`.
    #[test]
    fn stubs_are_current() {
        let implemented: BTreeSet<&str> = gleam_protocol::api::LISTED
            .iter()
            .copied()
            .chain(super::hand_written())
            .collect();
        let exports: BTreeSet<&str> = super::proc::EXPORTS
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let extra: Vec<_> = implemented.difference(&exports).collect();
        assert!(
            extra.is_empty(),
            "implemented but not a 580 export: {extra:?}"
        );
        let stubs: Vec<&str> = exports.difference(&implemented).copied().collect();
        let mut text = String::from(
            "//! Every driver export Gleam does not implement yet: each returns `CUDA_ERROR_NOT_SUPPORTED` and\n\
             //! logs its name once. GENERATED by `GLEAM_REGEN_STUBS=1 cargo test -p gleam-shim stubs_are_current`\n\
             //! from `libcuda-580-exports.txt` minus the implemented calls; do not edit.\n\n\
             use std::collections::HashSet;\nuse std::sync::Mutex;\n\n\
             use gleam_protocol::types::CUresult;\n\n\
             static LOGGED: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);\n\n\
             /// What every stub does.\n\
             fn not_supported(name: &'static str) -> CUresult {\n\
             \x20   let mut logged = LOGGED.lock().unwrap_or_else(|e| e.into_inner());\n\
             \x20   if logged.get_or_insert_with(HashSet::new).insert(name) {\n\
             \x20       tracing::warn!(call = name, \"not supported by Gleam yet: returning CUDA_ERROR_NOT_SUPPORTED\");\n\
             \x20   }\n\
             \x20   CUresult::NOT_SUPPORTED\n\
             }\n\n\
             macro_rules! stubs {\n\
             \x20   ($($name:ident)*) => {\n\
             \x20       $(\n\
             \x20           #[unsafe(no_mangle)]\n\
             \x20           #[doc = concat!(\"`\", stringify!($name), \"`: not supported yet.\")]\n\
             \x20           pub extern \"C\" fn $name() -> CUresult {\n\
             \x20               not_supported(stringify!($name))\n\
             \x20           }\n\
             \x20       )*\n\
             \x20       /// The stubbed names.\n\
             \x20       pub const STUBS: &[&str] = &[$(stringify!($name)),*];\n\
             \x20   };\n\
             }\n\nstubs! {\n",
        );
        for name in &stubs {
            text.push_str("    ");
            text.push_str(name);
            text.push('\n');
        }
        text.push_str("}\n");
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/src/stubs.rs");
        let current = std::fs::read_to_string(path).unwrap_or_default();
        if current != text {
            if std::env::var_os("GLEAM_REGEN_STUBS").is_some() {
                std::fs::write(path, &text).unwrap();
            } else {
                panic!(
                    "src/stubs.rs is stale: run GLEAM_REGEN_STUBS=1 cargo test -p gleam-shim stubs_are_current"
                );
            }
        }
    }
}
