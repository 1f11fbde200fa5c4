//! The CUDA driver API, described once.
//!
//! [`cuda_api!`](crate::cuda_api) is the declaration list of every driver call Gleam forwards mechanically:
//! its C name, its C arguments in order, and whether the caller must wait for it. It takes the name of a
//! "generator" macro and hands it the whole list, ZLUDA style, so each consumer stamps out what it needs
//! from the same source of truth:
//!
//! * [`crate::wire`] generates the wire messages: one request struct in [`args`] and one reply struct in
//!   [`outs`] per call, and the [`ApiCall`]/[`ApiReply`] enums;
//! * the shim (`gleam-shim`) generates its `#[no_mangle] extern "C"` exports;
//! * the server generates its dispatch and the calls into NVIDIA's driver.
//!
//! Calls that need judgement (copies with host buffers, module images, kernel launches, anything answered
//! on the client such as `cuGetProcAddress` or device attributes) are written by hand and are not listed.
//!
//! Each argument's type says how it travels (the [`Arg`] trait): a plain value goes in the request; an
//! [`Out<T>`] is a C pointer the driver writes through, so it travels in the reply; handles ([`Stream`],
//! [`Event`], ...) are C pointers carried as their `u64` value, identical on both sides; [`CStr`] is a
//! NUL-terminated string.
//!
//! The mode before each `fn` is `sync` (the caller waits for the reply, so the result and out values are
//! real) or `deferred` (fire-and-forget: the client returns `CUDA_SUCCESS` after local validation; a failure
//! on the server becomes the session's pending error, returned by the next `sync` call, exactly as CUDA
//! reports errors of asynchronous work).

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

/// The declaration list. `cuda_api!(my_generator)` expands to `my_generator! { <the list> }`, where the list
/// is a sequence of `sync|deferred fn cuName(arg: Type, ...);` items. Types are paths through `$crate`, so the
/// list expands correctly in any crate.
#[macro_export]
macro_rules! cuda_api {
    ($generator:ident) => {
        $crate::cuda_api_list! { $generator }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! cuda_api_list {
    ($g:ident) => { $g! {
        // --- Contexts ----------------------------------------------------------------------------------
        sync fn cuDevicePrimaryCtxRetain(pctx: $crate::api::Out<$crate::api::Context>, dev: i32);
        deferred fn cuDevicePrimaryCtxRelease_v2(dev: i32);
        sync fn cuDevicePrimaryCtxReset_v2(dev: i32);
        sync fn cuDevicePrimaryCtxSetFlags_v2(dev: i32, flags: u32);
        sync fn cuDevicePrimaryCtxGetState(dev: i32, flags: $crate::api::Out<u32>, active: $crate::api::Out<i32>);
        sync fn cuCtxCreate_v2(pctx: $crate::api::Out<$crate::api::Context>, flags: u32, dev: i32);
        sync fn cuCtxDestroy_v2(ctx: $crate::api::Context);
        sync fn cuCtxSynchronize();
        sync fn cuCtxSynchronize_v2(ctx: $crate::api::Context);
        deferred fn cuCtxSetLimit(limit: u32, value: usize);
        sync fn cuCtxGetLimit(pvalue: $crate::api::Out<usize>, limit: u32);
        deferred fn cuCtxSetCacheConfig(config: u32);
        sync fn cuCtxGetCacheConfig(pconfig: $crate::api::Out<u32>);
        sync fn cuCtxGetStreamPriorityRange(least: $crate::api::Out<i32>, greatest: $crate::api::Out<i32>);
        sync fn cuCtxGetFlags(flags: $crate::api::Out<u32>);
        sync fn cuCtxSetFlags(flags: u32);
        sync fn cuCtxGetApiVersion(ctx: $crate::api::Context, version: $crate::api::Out<u32>);

        // --- Memory ------------------------------------------------------------------------------------
        sync fn cuMemAlloc_v2(dptr: $crate::api::Out<u64>, bytesize: usize);
        sync fn cuMemAllocPitch_v2(dptr: $crate::api::Out<u64>, pitch: $crate::api::Out<usize>, width: usize, height: usize, element_size: u32);
        deferred fn cuMemFree_v2(dptr: u64);
        sync fn cuMemGetInfo_v2(free: $crate::api::Out<usize>, total: $crate::api::Out<usize>);
        sync fn cuMemGetAddressRange_v2(base: $crate::api::Out<u64>, size: $crate::api::Out<usize>, dptr: u64);
        deferred fn cuMemcpyDtoD_v2(dst: u64, src: u64, bytes: usize);
        deferred fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, bytes: usize, stream: $crate::api::Stream);
        deferred fn cuMemsetD8_v2(dst: u64, value: u8, n: usize);
        deferred fn cuMemsetD16_v2(dst: u64, value: u16, n: usize);
        deferred fn cuMemsetD32_v2(dst: u64, value: u32, n: usize);
        deferred fn cuMemsetD8Async(dst: u64, value: u8, n: usize, stream: $crate::api::Stream);
        deferred fn cuMemsetD16Async(dst: u64, value: u16, n: usize, stream: $crate::api::Stream);
        deferred fn cuMemsetD32Async(dst: u64, value: u32, n: usize, stream: $crate::api::Stream);
        sync fn cuMemAllocAsync(dptr: $crate::api::Out<u64>, bytesize: usize, stream: $crate::api::Stream);
        deferred fn cuMemFreeAsync(dptr: u64, stream: $crate::api::Stream);

        // --- Modules and functions ---------------------------------------------------------------------
        deferred fn cuModuleUnload(module: $crate::api::Module);
        sync fn cuModuleGetGlobal_v2(dptr: $crate::api::Out<u64>, bytes: $crate::api::Out<usize>, module: $crate::api::Module, name: $crate::api::CStr);
        sync fn cuFuncGetAttribute(value: $crate::api::Out<i32>, attrib: i32, func: $crate::api::Function);
        deferred fn cuFuncSetAttribute(func: $crate::api::Function, attrib: i32, value: i32);
        deferred fn cuFuncSetCacheConfig(func: $crate::api::Function, config: u32);
        deferred fn cuFuncSetSharedMemConfig(func: $crate::api::Function, config: u32);
        sync fn cuOccupancyMaxActiveBlocksPerMultiprocessor(num_blocks: $crate::api::Out<i32>, func: $crate::api::Function, block_size: i32, dynamic_smem: usize);
        sync fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(num_blocks: $crate::api::Out<i32>, func: $crate::api::Function, block_size: i32, dynamic_smem: usize, flags: u32);
        sync fn cuOccupancyAvailableDynamicSMemPerBlock(dynamic_smem: $crate::api::Out<usize>, func: $crate::api::Function, num_blocks: i32, block_size: i32);
        sync fn cuLibraryUnload(library: $crate::api::Library);
        sync fn cuLibraryGetKernel(kernel: $crate::api::Out<$crate::api::Kernel>, library: $crate::api::Library, name: $crate::api::CStr);
        sync fn cuLibraryGetModule(module: $crate::api::Out<$crate::api::Module>, library: $crate::api::Library);
        sync fn cuLibraryGetGlobal(dptr: $crate::api::Out<u64>, bytes: $crate::api::Out<usize>, library: $crate::api::Library, name: $crate::api::CStr);
        sync fn cuKernelGetAttribute(value: $crate::api::Out<i32>, attrib: i32, kernel: $crate::api::Kernel, dev: i32);
        deferred fn cuKernelSetAttribute(attrib: i32, value: i32, kernel: $crate::api::Kernel, dev: i32);

        // --- Streams -----------------------------------------------------------------------------------
        sync fn cuStreamCreate(stream: $crate::api::Out<$crate::api::Stream>, flags: u32);
        sync fn cuStreamCreateWithPriority(stream: $crate::api::Out<$crate::api::Stream>, flags: u32, priority: i32);
        deferred fn cuStreamDestroy_v2(stream: $crate::api::Stream);
        sync fn cuStreamSynchronize(stream: $crate::api::Stream);
        sync fn cuStreamQuery(stream: $crate::api::Stream);
        deferred fn cuStreamWaitEvent(stream: $crate::api::Stream, event: $crate::api::Event, flags: u32);
        sync fn cuStreamGetPriority(stream: $crate::api::Stream, priority: $crate::api::Out<i32>);
        sync fn cuStreamGetFlags(stream: $crate::api::Stream, flags: $crate::api::Out<u32>);

        // --- Events ------------------------------------------------------------------------------------
        sync fn cuEventCreate(event: $crate::api::Out<$crate::api::Event>, flags: u32);
        deferred fn cuEventRecord(event: $crate::api::Event, stream: $crate::api::Stream);
        deferred fn cuEventRecordWithFlags(event: $crate::api::Event, stream: $crate::api::Stream, flags: u32);
        sync fn cuEventSynchronize(event: $crate::api::Event);
        sync fn cuEventQuery(event: $crate::api::Event);
        sync fn cuEventElapsedTime(ms: $crate::api::Out<f32>, start: $crate::api::Event, end: $crate::api::Event);
        sync fn cuEventElapsedTime_v2(ms: $crate::api::Out<f32>, start: $crate::api::Event, end: $crate::api::Event);
        deferred fn cuEventDestroy_v2(event: $crate::api::Event);
    } };
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

crate::cuda_api!(api_wire);

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
