//! The C exports: one `#[no_mangle] extern "C"` function for every entry point of NVIDIA's driver,
//! generated from the declaration list ([`gleam_protocol::cuda_exports!`]).
//!
//! Every export runs its body inside [`crate::guard`] (no panic crosses the C ABI; calls after the
//! library's teardown return `CUDA_ERROR_DEINITIALIZED`). The body depends on the export's mode:
//!
//! * `sync`/`deferred`: the generated forwarder in [`crate::forward`];
//! * `local`/`hand` (and forwarded calls marked `by-hand`): the hand-written function of the same name,
//!   found through [`crate::hand`];
//! * `per_thread`: its base call, with a NULL stream meaning the per-thread default stream;
//! * `alias`: its base call (an older version of an entry point with the same contract);
//! * `stub`: `CUDA_ERROR_NOT_SUPPORTED`, with the name logged once.

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::Mutex;

use gleam_protocol::api::CType;
use gleam_protocol::types::CUresult;

/// Un-guarded bodies of the implemented exports, by name (what `per_thread` forms call).
macro_rules! body {
    (stub $name:ident ($($arg:ident: $ty:ty),*)) => {};
    (local $name:ident ($($arg:ident: $ty:ty),*)) => { body!(hand $name ($($arg: $ty),*)); };
    (hand $name:ident ($($arg:ident: $ty:ty),*)) => {
        #[allow(clippy::too_many_arguments)]
        pub(crate) unsafe fn $name($($arg: <$ty as CType>::C),*) -> Result<(), CUresult> {
            // SAFETY: the application's arguments, passed on under the same C contract.
            unsafe { crate::hand::$name($($arg),*) }
        }
    };
    (sync $name:ident ($($arg:ident: $ty:ty),*)) => { body!(forward $name ($($arg: $ty),*)); };
    (deferred $name:ident ($($arg:ident: $ty:ty),*)) => { body!(forward $name ($($arg: $ty),*)); };
    (forward $name:ident ($($arg:ident: $ty:ty),*)) => {
        #[allow(clippy::too_many_arguments)]
        pub(crate) unsafe fn $name($($arg: <$ty as CType>::C),*) -> Result<(), CUresult> {
            // SAFETY: as above.
            unsafe { crate::forward::$name($($arg),*) }
        }
    };
    (alias $name:ident ($($arg:ident: $ty:ty),*) => $base:ident($($e:expr),*)) => {
        body!(per_thread $name ($($arg: $ty),*) => $base($($e),*));
    };
    (per_thread $name:ident ($($arg:ident: $ty:ty),*) => $base:ident($($e:expr),*)) => {
        #[allow(clippy::too_many_arguments)]
        pub(crate) unsafe fn $name($($arg: <$ty as CType>::C),*) -> Result<(), CUresult> {
            // SAFETY: as above; only a NULL stream is replaced.
            unsafe { $base($($e),*) }
        }
    };
}

/// The C export itself.
macro_rules! export {
    (stub $name:ident ($($arg:ident: $ty:ty),*)) => {
        #[unsafe(no_mangle)]
        #[doc = concat!("`", stringify!($name), "`: not supported by Gleam yet.")]
        #[allow(clippy::too_many_arguments, unused_variables)]
        pub unsafe extern "C" fn $name($($arg: <$ty as CType>::C),*) -> CUresult {
            crate::guard(stringify!($name), || Err(not_supported(stringify!($name))))
        }
    };
    ($mode:ident $name:ident ($($arg:ident: $ty:ty),*)) => {
        #[unsafe(no_mangle)]
        #[doc = concat!("`", stringify!($name), "`.")]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "C" fn $name($($arg: <$ty as CType>::C),*) -> CUresult {
            // SAFETY: the caller keeps the C contract of the CUDA function this implements.
            crate::guard(stringify!($name), move || unsafe { imp::$name($($arg),*) })
        }
    };
}

macro_rules! exports {
    ($($mode:ident fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(=> $base:ident($($e:expr),*))?;)*) => {
        /// Un-guarded bodies, by export name.
        #[allow(non_snake_case)]
        pub(crate) mod imp {
            use super::*;
            $(body!($mode $name ($($arg: $ty),*) $(=> $base($($e),*))?);)*
        }

        $(export!($mode $name ($($arg: $ty),*));)*

        /// The address of this library's export `name` (for `cuGetProcAddress`).
        pub fn address(name: &str) -> Option<*mut c_void> {
            match name {
                $(stringify!($name) => Some($name as *mut c_void),)*
                _ => None,
            }
        }
    };
}

gleam_protocol::cuda_exports!(exports);

/// What every stub does: log its name once, return `CUDA_ERROR_NOT_SUPPORTED`.
fn not_supported(name: &'static str) -> CUresult {
    crate::trace::unimplemented(name);
    static LOGGED: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let mut logged = LOGGED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if logged.get_or_insert_with(HashSet::new).insert(name) {
        tracing::warn!(
            call = name,
            "not supported by Gleam yet: returning CUDA_ERROR_NOT_SUPPORTED"
        );
    }
    CUresult::NOT_SUPPORTED
}
