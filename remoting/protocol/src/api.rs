//! The CUDA driver API, described once.
//!
//! The declaration list, `driver-api.list` beside this crate, names every entry point of NVIDIA's driver
//! with its C signature and how it travels: answered locally, forwarded by hand-written code, forwarded
//! mechanically and waited for (`sync`), fire-and-forget (`deferred`), not implemented yet (`stub`), or the
//! per-thread-stream form of another. `build.rs` turns it into two macros that take the name of a
//! "generator" macro and hand it the list, ZLUDA style, so each consumer stamps out what it needs from the
//! same source of truth:
//!
//! * [`cuda_api!`](crate::cuda_api): the forwarded calls. [`crate::wire`] makes one request struct in
//!   [`args`] and one reply struct in [`outs`] per call and the [`ApiCall`]/[`ApiReply`] enums; the server
//!   makes its `ApiBackend` trait and dispatch; the real backend its calls into NVIDIA's driver;
//!   [`crate::registry`] the handle checks.
//! * [`cuda_exports!`](crate::cuda_exports): every export, from which the shim (`gleam-shim`) makes its
//!   `#[no_mangle] extern "C"` functions.
//!
//! and into [`EXPORTS`] (each export's [`Travel`]) and the registry's effects (what a call destroys).
//!
//! Each argument's type says how it travels (the [`Arg`] trait): a plain value goes in the request; an
//! [`Out<T>`] is a C pointer the driver writes through, so it travels in the reply; handles ([`Stream`],
//! [`Event`], ...) are C pointers carried as their `u64` value, identical on both sides; [`CStr`] is a
//! NUL-terminated string. [`CType`] gives every listed type its C ABI type.
//!
//! A `deferred` call returns `CUDA_SUCCESS` after local validation; a failure on the server becomes the
//! session's pending error, returned by the next call that waits, exactly as CUDA reports errors of
//! asynchronous work.

use std::ffi::{CString, c_char, c_void};
use std::fmt::Debug;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::types::CUresult;

/// How one C argument of a listed call crosses the wire.
pub trait Arg {
    /// The type at the C ABI (what the application passes to the shim, and the server to the driver).
    type C: Copy;
    /// What the request carries for this argument (`()` for out-arguments).
    type Request: Clone + Debug + Serialize + DeserializeOwned;
    /// What the reply carries for this argument (`()` for in-arguments).
    type Reply: Clone + Debug + Default + Serialize + DeserializeOwned;
    /// Server side: where the argument lives while the real driver is called.
    type Slot;

    /// Shim side: read the application's argument. A NULL out-pointer or string is `CUDA_ERROR_INVALID_VALUE`.
    ///
    /// # Safety
    /// `c` must be what the application passed for this argument (pointers valid as the C API requires).
    unsafe fn to_request(c: Self::C) -> Result<Self::Request, CUresult>;
    /// Shim side: hand the reply's value back to the application (writes through out-pointers).
    ///
    /// # Safety
    /// As for [`Arg::to_request`]; `to_request` succeeded for the same `c`.
    unsafe fn write_reply(c: Self::C, reply: Self::Reply);
    /// Server side: hold the request's value for the call.
    fn slot(request: Self::Request) -> Self::Slot;
    /// Server side: the C value to pass to the real driver (points into `slot` for out-arguments).
    fn slot_c(slot: &mut Self::Slot) -> Self::C;
    /// Server side: what the reply carries after the call.
    fn slot_reply(slot: Self::Slot) -> Self::Reply;
}

/// A value type: the same at the C ABI and on the wire (integers, floats, `CUdevice`, `CUdeviceptr`).
pub trait Plain: Copy + Clone + Debug + Default + Serialize + DeserializeOwned {}
impl Plain for i32 {}
impl Plain for u32 {}
impl Plain for i64 {}
impl Plain for u64 {}
impl Plain for usize {}
impl Plain for f32 {}
impl Plain for u8 {}
impl Plain for u16 {}

/// Something an out-pointer can point to: a plain value or a handle.
pub trait Value {
    /// The C type.
    type C: Copy;
    /// The wire type.
    type W: Clone + Debug + Default + Serialize + DeserializeOwned;
    /// C to wire.
    fn to_wire(c: Self::C) -> Self::W;
    /// Wire to C.
    fn from_wire(w: Self::W) -> Self::C;
}

impl<T: Plain> Value for T {
    type C = T;
    type W = T;
    fn to_wire(c: T) -> T {
        c
    }
    fn from_wire(w: T) -> T {
        w
    }
}

impl<T: Plain> Arg for T {
    type C = T;
    type Request = T;
    type Reply = ();
    type Slot = T;

    unsafe fn to_request(c: T) -> Result<T, CUresult> {
        Ok(c)
    }
    unsafe fn write_reply(_: T, _: ()) {}
    fn slot(request: T) -> T {
        request
    }
    fn slot_c(slot: &mut T) -> T {
        *slot
    }
    fn slot_reply(_: T) {}
}

macro_rules! handles {
    ($($(#[$doc:meta])* $name:ident;)*) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub enum $name {}

        impl Value for $name {
            type C = *mut c_void;
            type W = u64;
            fn to_wire(c: *mut c_void) -> u64 {
                c as u64
            }
            fn from_wire(w: u64) -> *mut c_void {
                w as *mut c_void
            }
        }

        impl CType for $name {
            type C = *mut c_void;
        }

        impl Arg for $name {
            type C = *mut c_void;
            type Request = u64;
            type Reply = ();
            type Slot = u64;

            unsafe fn to_request(c: *mut c_void) -> Result<u64, CUresult> {
                Ok(c as u64)
            }
            unsafe fn write_reply(_: *mut c_void, _: ()) {}
            fn slot(request: u64) -> u64 {
                request
            }
            fn slot_c(slot: &mut u64) -> *mut c_void {
                *slot as *mut c_void
            }
            fn slot_reply(_: u64) {}
        }
    )*};
}

handles! {
    /// `CUcontext`.
    Context;
    /// `CUmodule`.
    Module;
    /// `CUfunction`.
    Function;
    /// `CUstream` (NULL, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` pass through unchanged).
    Stream;
    /// `CUevent`.
    Event;
    /// `CUlibrary`.
    Library;
    /// `CUkernel`.
    Kernel;
    /// `CUarray`.
    Array;
    /// `CUtexObject` (an integer handle in C; the same 64 bits at the ABI).
    TexObject;
    /// `CUsurfObject` (an integer handle in C; the same 64 bits at the ABI).
    SurfObject;
}

/// An out-argument: the C side passes a `T*` that the driver writes; the value travels in the reply.
#[derive(Clone, Copy, Debug)]
pub enum Out<T> {
    #[doc(hidden)]
    _Never(std::convert::Infallible, std::marker::PhantomData<T>),
}

impl<T: Value> Arg for Out<T>
where
    T::C: Default,
{
    type C = *mut T::C;
    type Request = ();
    type Reply = T::W;
    type Slot = T::C;

    unsafe fn to_request(c: *mut T::C) -> Result<(), CUresult> {
        if c.is_null() {
            Err(CUresult::INVALID_VALUE)
        } else {
            Ok(())
        }
    }
    unsafe fn write_reply(c: *mut T::C, reply: T::W) {
        // SAFETY: `to_request` checked non-NULL; the caller promised a valid `T*`.
        unsafe { c.write(T::from_wire(reply)) }
    }
    fn slot(_: ()) -> T::C {
        T::C::default()
    }
    fn slot_c(slot: &mut T::C) -> *mut T::C {
        slot
    }
    fn slot_reply(slot: T::C) -> T::W {
        T::to_wire(slot)
    }
}

/// An in-argument passed by pointer: the C side passes a `const T*` (a descriptor struct); the value travels
/// in the request, and the server passes a pointer to its copy. A NULL pointer is `CUDA_ERROR_INVALID_VALUE`.
#[derive(Clone, Copy, Debug)]
pub enum In<T> {
    #[doc(hidden)]
    _Never(std::convert::Infallible, std::marker::PhantomData<T>),
}

// Descriptors are boxed in requests: they are large, and most calls are small.
impl<T: Plain> Arg for In<T> {
    type C = *const T;
    type Request = Box<T>;
    type Reply = ();
    type Slot = T;

    unsafe fn to_request(c: *const T) -> Result<Box<T>, CUresult> {
        if c.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        // SAFETY: non-NULL, and the caller promised a valid `T`.
        Ok(Box::new(unsafe { c.read_unaligned() }))
    }
    unsafe fn write_reply(_: *const T, _: ()) {}
    fn slot(request: Box<T>) -> T {
        *request
    }
    fn slot_c(slot: &mut T) -> *const T {
        slot
    }
    fn slot_reply(_: T) {}
}

/// As [`In`], for an optional argument: NULL travels as `None` and reaches the driver as NULL.
#[derive(Clone, Copy, Debug)]
pub enum InOpt<T> {
    #[doc(hidden)]
    _Never(std::convert::Infallible, std::marker::PhantomData<T>),
}

impl<T: Plain> Arg for InOpt<T> {
    type C = *const T;
    type Request = Option<Box<T>>;
    type Reply = ();
    type Slot = Option<T>;

    unsafe fn to_request(c: *const T) -> Result<Option<Box<T>>, CUresult> {
        // SAFETY: NULL or, as the caller promised, a valid `T`.
        Ok((!c.is_null()).then(|| Box::new(unsafe { c.read_unaligned() })))
    }
    unsafe fn write_reply(_: *const T, _: ()) {}
    fn slot(request: Option<Box<T>>) -> Option<T> {
        request.map(|r| *r)
    }
    fn slot_c(slot: &mut Option<T>) -> *const T {
        slot.as_ref().map_or(std::ptr::null(), |v| v as *const T)
    }
    fn slot_reply(_: Option<T>) {}
}

/// A NUL-terminated C string argument (`const char*`), e.g. a symbol name.
#[derive(Clone, Copy, Debug)]
pub enum CStr {}

impl Arg for CStr {
    type C = *const c_char;
    type Request = String;
    type Reply = ();
    type Slot = CString;

    unsafe fn to_request(c: *const c_char) -> Result<String, CUresult> {
        if c.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        // SAFETY: non-NULL, and the C API requires a NUL-terminated string.
        let s = unsafe { std::ffi::CStr::from_ptr(c) };
        s.to_str()
            .map(str::to_owned)
            .map_err(|_| CUresult::INVALID_VALUE)
    }
    unsafe fn write_reply(_: *const c_char, _: ()) {}
    fn slot(request: String) -> CString {
        // A name with an interior NUL cannot name anything: pass the part before it, which the driver rejects.
        CString::new(request).unwrap_or_else(|e| {
            let end = e.nul_position();
            let mut bytes = e.into_vec();
            bytes.truncate(end);
            CString::new(bytes).unwrap_or_default()
        })
    }
    fn slot_c(slot: &mut CString) -> *const c_char {
        slot.as_ptr()
    }
    fn slot_reply(_: CString) {}
}

include!(concat!(env!("OUT_DIR"), "/driver_api.rs"));

/// How an export of the declaration list travels (its mode in `driver-api.list`).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Travel {
    /// Answered on the client, never sent.
    Local,
    /// Forwarded with judgement by hand-written shim code.
    Hand,
    /// Forwarded mechanically; the caller waits for the reply.
    Sync,
    /// Forwarded mechanically, fire-and-forget.
    Deferred,
    /// Not implemented yet: `CUDA_ERROR_NOT_SUPPORTED`.
    Stub,
    /// The per-thread-default-stream form of another export.
    PerThread,
}

/// The C ABI type of an argument as the declaration list writes it: an [`Arg`] type of a forwarded call,
/// or a C type (integers, pointers, handle aliases, by-value structs) of any other export.
pub trait CType {
    /// The type at the C ABI.
    type C: Copy;
}

macro_rules! c_types {
    ($($t:ty),* $(,)?) => {$(
        impl CType for $t {
            type C = $t;
        }
    )*};
}

c_types!(
    i8,
    u8,
    i16,
    u16,
    i32,
    u32,
    i64,
    u64,
    usize,
    f32,
    f64,
    crate::types::CUmemLocation,
    crate::types::CUipcMemHandle,
    crate::types::CUipcEventHandle,
    crate::types::CUeglFrame,
);

impl<T> CType for *mut T {
    type C = *mut T;
}

impl<T> CType for *const T {
    type C = *const T;
}

impl<T: Value> CType for Out<T>
where
    T::C: Default,
{
    type C = *mut T::C;
}

impl CType for CStr {
    type C = *const c_char;
}

impl<T: Plain> CType for In<T> {
    type C = *const T;
}

impl<T: Plain> CType for InOpt<T> {
    type C = *const T;
}

/// The stream a `_ptsz` form of a call means: NULL (the default stream) is the per-thread default stream.
pub fn per_thread(stream: *mut c_void) -> *mut c_void {
    if stream.is_null() {
        crate::types::CU_STREAM_PER_THREAD as *mut c_void
    } else {
        stream
    }
}

/// Generates the wire structs of the declaration list (invoked once, by `cuda_api!(api_wire)` below).
macro_rules! api_wire {
    ($($mode:ident fn $name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {
        /// The request of each listed call: its in-arguments (out-arguments are `()`).
        #[allow(non_camel_case_types, missing_docs)]
        pub mod args {
            use super::*;
            $(
                #[derive(Clone, Debug, Deserialize, Serialize)]
                pub struct $name { $(pub $arg: <$ty as Arg>::Request,)* }
            )*
        }

        /// The reply of each listed call: its out-arguments (in-arguments are `()`).
        #[allow(non_camel_case_types, missing_docs)]
        pub mod outs {
            use super::*;
            $(
                #[derive(Clone, Debug, Default, Deserialize, Serialize)]
                pub struct $name { $(pub $arg: <$ty as Arg>::Reply,)* }
            )*
        }

        /// A listed call, as sent by the client.
        #[allow(non_camel_case_types, missing_docs)]
        #[derive(Clone, Debug, Deserialize, Serialize)]
        pub enum ApiCall { $($name(args::$name),)* }

        /// The reply to a listed `sync` call.
        #[allow(non_camel_case_types, missing_docs)]
        #[derive(Clone, Debug, Deserialize, Serialize)]
        pub enum ApiReply { $($name(outs::$name),)* }

        impl ApiCall {
            /// The C name of the call.
            pub fn name(&self) -> &'static str {
                match self { $(Self::$name(_) => stringify!($name),)* }
            }

            /// Whether the client waits for this call's reply (`sync`) or not (`deferred`).
            pub fn is_sync(&self) -> bool {
                match self { $(Self::$name(_) => api_wire!(@sync $mode),)* }
            }
        }

        /// The C names of every listed call.
        pub const LISTED: &[&str] = &[$(stringify!($name),)*];
    };
    (@sync sync) => { true };
    (@sync deferred) => { false };
}

cuda_api!(api_wire);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_args_travel_in_the_reply_only() {
        let call = ApiCall::cuMemAlloc_v2(args::cuMemAlloc_v2 {
            dptr: (),
            bytesize: 4096,
        });
        let bytes = postcard::to_allocvec(&call).unwrap();
        let back: ApiCall = postcard::from_bytes(&bytes).unwrap();
        assert!(matches!(
            back,
            ApiCall::cuMemAlloc_v2(args::cuMemAlloc_v2 { bytesize: 4096, .. })
        ));
        assert!(back.is_sync());
        assert_eq!(back.name(), "cuMemAlloc_v2");
        // Variant index + one varint: the out-pointer costs nothing on the wire.
        assert!(bytes.len() <= 4, "{bytes:?}");
    }

    #[test]
    fn listed_names_are_unique() {
        let mut names = LISTED.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), LISTED.len());
    }
}
