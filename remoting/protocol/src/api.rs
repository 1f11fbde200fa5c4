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
/// Per-dimension arrays of a tensor map (rank at most 5, padded with zeros).
impl Plain for [u64; 5] {}
impl Plain for [u32; 5] {}
impl Plain for [i32; 5] {}
/// A `CUtensorMap`: 128 opaque bytes, 64-byte aligned (the driver refuses a map that is not).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct TensorMap(pub [u64; 16]);

impl Plain for TensorMap {}

/// A `CUstreamAttrValue` (= `CUlaunchAttributeValue`): a 64-byte union whose member the attribute id
/// names (an access-policy window, a synchronization policy, a priority, a memory sync domain or map).
/// Travels as its bytes; the window's base pointer is a device address, the same on both sides.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct AttrValue(pub [u64; 8]);

impl Plain for AttrValue {}

/// One `CUstreamBatchMemOpParams`: a 48-byte union, the operation in its first 4 bytes (wait or write a
/// 32/64-bit value at a device address, a memory barrier, a flush of remote writes).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct MemOpParams(pub [u64; 6]);

impl Plain for MemOpParams {}

/// Counts of array arguments that travel one element per message: 1 at the forwarder's C ABI (anything
/// else is `CUDA_ERROR_INVALID_VALUE`), nothing on the wire, and 1 for the serving driver, which so never
/// reads past the one element a message carries, whatever a client sends. The shim sends a longer array
/// one element per call.
macro_rules! one_element_count {
    ($($(#[$doc:meta])* $name:ident: $c:ty;)*) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub enum $name {}

        impl CType for $name {
            type C = $c;
        }

        impl Arg for $name {
            type C = $c;
            type Request = ();
            type Reply = ();
            type Slot = ();

            unsafe fn to_request(c: $c) -> Result<(), CUresult> {
                if c == 1 {
                    Ok(())
                } else {
                    Err(CUresult::INVALID_VALUE)
                }
            }
            unsafe fn write_reply(_: $c, _: ()) {}
            fn slot(_: ()) {}
            fn slot_c(_: &mut ()) -> $c {
                1
            }
            fn slot_reply(_: ()) {}
        }
    )*};
}

one_element_count! {
    /// An `unsigned int` count of one (`cuStreamBatchMemOp`'s `count`).
    One: u32;
    /// A `size_t` count of one (`cuMemSetAccess`'s and `cuMemPoolSetAccess`'s `count`).
    OneSize: usize;
}

/// A stream memory operation, as [`MemOpParams`] or the single-operation calls describe it, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemOp {
    /// Wait until the value at `address` compares with `value` as `flags` says.
    Wait {
        address: u64,
        value: u64,
        wide: bool,
        flags: u32,
    },
    /// Write `value` at `address`.
    Write {
        address: u64,
        value: u64,
        wide: bool,
        flags: u32,
    },
    /// `CU_STREAM_MEM_OP_BARRIER`: orders memory accesses (`CU_STREAM_MEMORY_BARRIER_TYPE_SYS` or `_GPU`).
    Barrier { flags: u32 },
    /// `CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES`.
    FlushRemoteWrites,
}

impl MemOp {
    /// `CUstreamBatchMemOpType` values.
    pub const WAIT_VALUE_32: u32 = 1;
    pub const WRITE_VALUE_32: u32 = 2;
    pub const FLUSH_REMOTE_WRITES: u32 = 3;
    pub const WAIT_VALUE_64: u32 = 4;
    pub const WRITE_VALUE_64: u32 = 5;
    pub const BARRIER: u32 = 6;
    /// `CU_STREAM_WAIT_VALUE_GEQ` / `_EQ` / `_AND` / `_NOR` (the low bits of a wait's flags).
    pub const WAIT_GEQ: u32 = 0;
    pub const WAIT_EQ: u32 = 1;
    pub const WAIT_AND: u32 = 2;
    pub const WAIT_NOR: u32 = 3;
    /// `CU_STREAM_WAIT_VALUE_FLUSH`.
    pub const WAIT_FLUSH: u32 = 1 << 30;
    /// `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER`.
    pub const WRITE_NO_MEMORY_BARRIER: u32 = 1;

    /// `cuStreamWaitValue32/64`: the address must be aligned to the value's size, the comparison known.
    pub fn wait(address: u64, value: u64, wide: bool, flags: u32) -> Result<Self, CUresult> {
        aligned(address, wide)?;
        if flags & !Self::WAIT_FLUSH > Self::WAIT_NOR {
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(Self::Wait {
            address,
            value,
            wide,
            flags,
        })
    }

    /// `cuStreamWriteValue32/64`.
    pub fn write(address: u64, value: u64, wide: bool, flags: u32) -> Result<Self, CUresult> {
        aligned(address, wide)?;
        if flags & !Self::WRITE_NO_MEMORY_BARRIER != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(Self::Write {
            address,
            value,
            wide,
            flags,
        })
    }

    /// Whether a wait is over when memory holds `current` (GEQ compares cyclically, as CUDA does:
    /// `(int32_t)(*addr - value) >= 0`).
    pub fn satisfied_by(&self, current: u64) -> bool {
        let Self::Wait {
            value, wide, flags, ..
        } = *self
        else {
            return true;
        };
        let mask = if wide { u64::MAX } else { u64::from(u32::MAX) };
        let (current, value) = (current & mask, value & mask);
        match flags & !Self::WAIT_FLUSH {
            Self::WAIT_GEQ if wide => current.wrapping_sub(value) as i64 >= 0,
            Self::WAIT_GEQ => (current as u32).wrapping_sub(value as u32) as i32 >= 0,
            Self::WAIT_EQ => current == value,
            Self::WAIT_AND => current & value != 0,
            _ => !(current | value) & mask != 0,
        }
    }
}

fn aligned(address: u64, wide: bool) -> Result<(), CUresult> {
    let align = if wide { 8 } else { 4 };
    if address == 0 || !address.is_multiple_of(align) {
        return Err(CUresult::INVALID_VALUE);
    }
    Ok(())
}

impl TryFrom<MemOpParams> for MemOp {
    type Error = CUresult;

    /// One entry of a `cuStreamBatchMemOp` array. Waits and writes: operation (u32), address (u64 at
    /// byte 8), value (u32 or u64 at byte 16), flags (u32 at byte 24). Barrier and flush: flags (u32 at
    /// byte 4).
    fn try_from(p: MemOpParams) -> Result<Self, CUresult> {
        let w = p.0;
        let operation = w[0] as u32;
        let short_flags = (w[0] >> 32) as u32;
        let (address, flags) = (w[1], w[3] as u32);
        match operation {
            Self::WAIT_VALUE_32 => Self::wait(address, w[2] & u64::from(u32::MAX), false, flags),
            Self::WAIT_VALUE_64 => Self::wait(address, w[2], true, flags),
            Self::WRITE_VALUE_32 => Self::write(address, w[2] & u64::from(u32::MAX), false, flags),
            Self::WRITE_VALUE_64 => Self::write(address, w[2], true, flags),
            Self::BARRIER if short_flags <= 1 => Ok(Self::Barrier { flags: short_flags }),
            Self::FLUSH_REMOTE_WRITES if short_flags == 0 => Ok(Self::FlushRemoteWrites),
            _ => Err(CUresult::INVALID_VALUE),
        }
    }
}

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

/// C structs that travel as themselves, their pointer fields cleared ([`crate::types::WireStruct`]).
macro_rules! wire_structs {
    ($($t:ident),* $(,)?) => {$(
        impl Value for crate::types::$t {
            type C = Self;
            type W = Self;
            fn to_wire(c: Self) -> Self {
                crate::types::WireStruct::cleared(c)
            }
            fn from_wire(w: Self) -> Self {
                crate::types::WireStruct::cleared(w)
            }
        }
    )*};
}

wire_structs!(
    CUmemLocation,
    CUmemAllocationProp,
    CUmemPoolProps,
    CUmemAccessDesc,
    CUexecAffinityParam,
);

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
    /// `CUgraph`.
    Graph;
    /// `CUgraphExec`.
    GraphExec;
    /// `CUmemoryPool`.
    MemPool;
}

/// `CUmemGenericAllocationHandle`: a physical allocation of virtual memory management (`cuMemCreate`). An
/// integer at the C ABI rather than a pointer, but as much a driver handle as the others: checked against
/// the registry before the driver sees it.
#[derive(Clone, Copy, Debug)]
pub enum MemHandle {}

impl Value for MemHandle {
    type C = u64;
    type W = u64;
    fn to_wire(c: u64) -> u64 {
        c
    }
    fn from_wire(w: u64) -> u64 {
        w
    }
}

impl CType for MemHandle {
    type C = u64;
}

impl Arg for MemHandle {
    type C = u64;
    type Request = u64;
    type Reply = ();
    type Slot = u64;

    unsafe fn to_request(c: u64) -> Result<u64, CUresult> {
        Ok(c)
    }
    unsafe fn write_reply(_: u64, _: ()) {}
    fn slot(request: u64) -> u64 {
        request
    }
    fn slot_c(slot: &mut u64) -> u64 {
        *slot
    }
    fn slot_reply(_: u64) {}
}

/// A device address the C API passes as `void*` (`cuMemRetainAllocationHandle`): travels as its value and
/// is never dereferenced by Gleam (the driver validates it).
#[derive(Clone, Copy, Debug)]
pub enum PtrValue {}

impl CType for PtrValue {
    type C = *mut c_void;
}

impl Arg for PtrValue {
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

/// An in-argument passed by pointer (`const T*`): the application's value is read at the call and travels
/// in the request; the driver is given a pointer to the server's copy. NULL is `CUDA_ERROR_INVALID_VALUE`.
/// Pointers inside `T` (Windows-only fields) never travel: [`Value::to_wire`] clears them.
#[derive(Clone, Copy, Debug)]
pub enum In<T> {
    #[doc(hidden)]
    _Never(std::convert::Infallible, std::marker::PhantomData<T>),
}

// Boxed in requests: descriptors (copies, resources, textures) are large, and most calls are small.
impl<T: Value> Arg for In<T>
where
    T::C: Default,
{
    type C = *const T::C;
    type Request = Box<T::W>;
    type Reply = ();
    type Slot = T::C;

    unsafe fn to_request(c: *const T::C) -> Result<Box<T::W>, CUresult> {
        if c.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        // SAFETY: non-NULL, and the C API requires a valid `T` behind it (read unaligned: C callers may
        // pack it anywhere).
        Ok(Box::new(T::to_wire(unsafe { c.read_unaligned() })))
    }
    unsafe fn write_reply(_: *const T::C, _: ()) {}
    fn slot(request: Box<T::W>) -> T::C {
        T::from_wire(*request)
    }
    fn slot_c(slot: &mut T::C) -> *const T::C {
        slot
    }
    fn slot_reply(_: T::C) {}
}

impl<T: Value> CType for In<T>
where
    T::C: Default,
{
    type C = *const T::C;
}

/// As [`In`], for an optional argument (a descriptor the application may omit): NULL travels as `None`
/// and reaches the driver as NULL.
#[derive(Clone, Copy, Debug)]
pub enum InOpt<T> {
    #[doc(hidden)]
    _Never(std::convert::Infallible, std::marker::PhantomData<T>),
}

impl<T: Value> Arg for InOpt<T> {
    type C = *const T::C;
    type Request = Option<Box<T::W>>;
    type Reply = ();
    type Slot = Option<T::C>;

    unsafe fn to_request(c: *const T::C) -> Result<Option<Box<T::W>>, CUresult> {
        // SAFETY: NULL or, as the C API requires, a valid `T` (read unaligned, as for `In`).
        Ok((!c.is_null()).then(|| Box::new(T::to_wire(unsafe { c.read_unaligned() }))))
    }
    unsafe fn write_reply(_: *const T::C, _: ()) {}
    fn slot(request: Option<Box<T::W>>) -> Option<T::C> {
        request.map(|r| T::from_wire(*r))
    }
    fn slot_c(slot: &mut Option<T::C>) -> *const T::C {
        slot.as_ref().map_or(std::ptr::null(), |v| v as *const T::C)
    }
    fn slot_reply(_: Option<T::C>) {}
}

impl<T: Value> CType for InOpt<T> {
    type C = *const T::C;
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

/// An in-out argument: the C side passes a `T*` whose value the driver reads and replaces
/// (`cuThreadExchangeStreamCaptureMode`); the value travels in the request and the new one in the reply.
#[derive(Clone, Copy, Debug)]
pub enum InOut<T> {
    #[doc(hidden)]
    _Never(std::convert::Infallible, std::marker::PhantomData<T>),
}

impl<T: Plain> Arg for InOut<T> {
    type C = *mut T;
    type Request = T;
    type Reply = T;
    type Slot = T;

    unsafe fn to_request(c: *mut T) -> Result<T, CUresult> {
        if c.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        // SAFETY: non-NULL, and the caller promised a valid `T*`.
        Ok(unsafe { c.read_unaligned() })
    }
    unsafe fn write_reply(c: *mut T, reply: T) {
        // SAFETY: `to_request` checked non-NULL.
        unsafe { c.write_unaligned(reply) }
    }
    fn slot(request: T) -> T {
        request
    }
    fn slot_c(slot: &mut T) -> *mut T {
        slot
    }
    fn slot_reply(slot: T) -> T {
        slot
    }
}

impl<T: Plain> CType for InOut<T> {
    type C = *mut T;
}

/// An optional out-argument: like [`Out<T>`], but the application may pass NULL when it does not want the
/// value (`cuModuleGetGlobal`'s `bytes`, "ignored if NULL"). Whether it was wanted travels in the request
/// (one byte), so the serving driver gets NULL exactly where the application passed NULL, and validates
/// the combination itself (e.g. both NULL).
#[derive(Clone, Copy, Debug)]
pub enum OptOut<T> {
    #[doc(hidden)]
    _Never(std::convert::Infallible, std::marker::PhantomData<T>),
}

impl<T: Value> Arg for OptOut<T>
where
    T::C: Default,
{
    type C = *mut T::C;
    type Request = bool;
    type Reply = T::W;
    type Slot = (bool, T::C);

    unsafe fn to_request(c: *mut T::C) -> Result<bool, CUresult> {
        Ok(!c.is_null())
    }
    unsafe fn write_reply(c: *mut T::C, reply: T::W) {
        if !c.is_null() {
            // SAFETY: non-NULL, and the caller promised a valid `T*` where one was passed.
            unsafe { c.write(T::from_wire(reply)) }
        }
    }
    fn slot(wanted: bool) -> (bool, T::C) {
        (wanted, T::C::default())
    }
    fn slot_c(slot: &mut (bool, T::C)) -> *mut T::C {
        if slot.0 {
            &raw mut slot.1
        } else {
            std::ptr::null_mut()
        }
    }
    fn slot_reply(slot: (bool, T::C)) -> T::W {
        T::to_wire(slot.1)
    }
}

/// A `const CUlaunchConfig*` (`cuOccupancyMaxActiveClusters`...): its dimensions, stream and attributes
/// travel by value, and the server rebuilds the structure for its driver.
#[derive(Clone, Copy, Debug)]
pub enum LaunchConfig {}

/// [`LaunchConfig`] on the wire.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct LaunchConfigValue {
    /// `gridDimX/Y/Z`.
    pub grid: [u32; 3],
    /// `blockDimX/Y/Z`.
    pub block: [u32; 3],
    /// `sharedMemBytes`.
    pub shared_mem_bytes: u32,
    /// `hStream`.
    pub stream: u64,
    /// `attrs[0..numAttrs]`.
    pub attrs: Vec<crate::wire::LaunchAttr>,
}

/// `CUlaunchConfig` at the C ABI.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CLaunchConfig {
    /// `gridDimX/Y/Z`.
    pub grid: [u32; 3],
    /// `blockDimX/Y/Z`.
    pub block: [u32; 3],
    /// `sharedMemBytes`.
    pub shared_mem_bytes: u32,
    /// `hStream`.
    pub stream: *mut c_void,
    /// `attrs`.
    pub attrs: *const CLaunchAttribute,
    /// `numAttrs`.
    pub num_attrs: u32,
}

/// `CUlaunchAttribute` at the C ABI: an id, 4 bytes of padding, a 64-byte value union.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CLaunchAttribute {
    /// `CUlaunchAttributeID`.
    pub id: u32,
    /// Padding.
    pub pad: u32,
    /// The value union.
    pub value: [u32; 16],
}

/// Most attributes one configuration may carry here (CUDA defines about twenty ids).
pub const MAX_LAUNCH_ATTRS: u32 = 64;

impl LaunchConfigValue {
    /// Reads the application's `CUlaunchConfig` (`CUDA_ERROR_INVALID_VALUE` for NULL, or too many
    /// attributes).
    ///
    /// # Safety
    /// `c` is NULL or points to a `CUlaunchConfig` whose `attrs` holds `numAttrs` entries.
    pub unsafe fn read(c: *const c_void) -> Result<Self, CUresult> {
        if c.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        // SAFETY: the caller's configuration.
        let c = unsafe { c.cast::<CLaunchConfig>().read_unaligned() };
        if c.num_attrs > MAX_LAUNCH_ATTRS || (c.num_attrs > 0 && c.attrs.is_null()) {
            return Err(CUresult::INVALID_VALUE);
        }
        let attrs = (0..c.num_attrs as usize)
            .map(|i| {
                // SAFETY: `attrs` holds `numAttrs` entries.
                let a = unsafe { c.attrs.add(i).read_unaligned() };
                crate::wire::LaunchAttr {
                    id: a.id,
                    value: a.value,
                }
            })
            .collect();
        Ok(Self {
            grid: c.grid,
            block: c.block,
            shared_mem_bytes: c.shared_mem_bytes,
            stream: c.stream as u64,
            attrs,
        })
    }
}

/// Where a [`LaunchConfig`] lives on the server while the driver reads it.
#[derive(Debug)]
pub struct LaunchConfigSlot {
    config: CLaunchConfig,
    attrs: Vec<CLaunchAttribute>,
}

impl Arg for LaunchConfig {
    type C = *const c_void;
    type Request = LaunchConfigValue;
    type Reply = ();
    type Slot = LaunchConfigSlot;

    unsafe fn to_request(c: *const c_void) -> Result<LaunchConfigValue, CUresult> {
        // SAFETY: forwarded contract.
        unsafe { LaunchConfigValue::read(c) }
    }
    unsafe fn write_reply(_: *const c_void, _: ()) {}
    fn slot(v: LaunchConfigValue) -> LaunchConfigSlot {
        let attrs: Vec<CLaunchAttribute> = v
            .attrs
            .iter()
            .map(|a| CLaunchAttribute {
                id: a.id,
                pad: 0,
                value: a.value,
            })
            .collect();
        LaunchConfigSlot {
            config: CLaunchConfig {
                grid: v.grid,
                block: v.block,
                shared_mem_bytes: v.shared_mem_bytes,
                stream: v.stream as *mut c_void,
                attrs: std::ptr::null(),
                num_attrs: u32::try_from(attrs.len()).unwrap_or(0),
            },
            attrs,
        }
    }
    fn slot_c(slot: &mut LaunchConfigSlot) -> *const c_void {
        slot.config.attrs = if slot.attrs.is_empty() {
            std::ptr::null()
        } else {
            slot.attrs.as_ptr()
        };
        (&raw const slot.config).cast()
    }
    fn slot_reply(_: LaunchConfigSlot) {}
}

impl CType for LaunchConfig {
    type C = *const c_void;
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
    /// Another name of an export (an older version with the same contract).
    Alias,
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

impl<T: Value> CType for OptOut<T>
where
    T::C: Default,
{
    type C = *mut T::C;
}

impl CType for CStr {
    type C = *const c_char;
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

    /// A struct passed by pointer travels by value, its Windows-only pointer cleared; the server's copy
    /// is what the driver is given a pointer to.
    #[test]
    fn in_structs_travel_by_value_without_their_pointers() {
        use crate::types::{CUmemAllocationProp, CUmemLocation};
        let prop = CUmemAllocationProp {
            kind: 1,
            requested_handle_types: 1,
            location: CUmemLocation { kind: 1, id: 0 },
            win32_handle_meta_data: 0xdead_beef,
            ..CUmemAllocationProp::default()
        };
        // SAFETY: a valid pointer to a local.
        let request =
            unsafe { <In<CUmemAllocationProp> as Arg>::to_request(&raw const prop) }.unwrap();
        assert_eq!(request.win32_handle_meta_data, 0);
        let bytes = postcard::to_allocvec(&request).unwrap();
        let back: Box<CUmemAllocationProp> = postcard::from_bytes(&bytes).unwrap();
        let mut slot = <In<CUmemAllocationProp> as Arg>::slot(back);
        let c = <In<CUmemAllocationProp> as Arg>::slot_c(&mut slot);
        // SAFETY: points into `slot`.
        let seen = unsafe { c.read() };
        assert_eq!((seen.kind, seen.location.kind), (1, 1));
        // SAFETY: NULL is refused before it is read.
        let null = unsafe { <In<CUmemAllocationProp> as Arg>::to_request(std::ptr::null()) };
        assert_eq!(null, Err(CUresult::INVALID_VALUE));
    }

    #[test]
    fn listed_names_are_unique() {
        let mut names = LISTED.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), LISTED.len());
    }
}

#[cfg(test)]
mod memop_tests {
    use super::*;

    #[test]
    fn one_element_counts_accept_one_and_send_nothing() {
        // SAFETY: plain integers.
        unsafe {
            assert!(One::to_request(1).is_ok());
            assert_eq!(One::to_request(2), Err(CUresult::INVALID_VALUE));
            assert!(OneSize::to_request(1).is_ok());
            assert_eq!(OneSize::to_request(0), Err(CUresult::INVALID_VALUE));
            assert_eq!(
                OneSize::to_request(usize::MAX),
                Err(CUresult::INVALID_VALUE)
            );
        }
        // Whatever a client sent, the serving driver is told 1.
        assert_eq!(OneSize::slot_c(&mut ()), 1);
        assert_eq!(One::slot_c(&mut ()), 1);
    }

    fn params(words: [u64; 6]) -> MemOpParams {
        MemOpParams(words)
    }

    #[test]
    fn batch_entries_parse_by_their_operation() {
        // WRITE_VALUE_32 of 21 at 0x1000, no flags.
        let write = params([2, 0x1000, 0xdead_0000_0015, 0, 0, 0]);
        assert_eq!(
            MemOp::try_from(write),
            Ok(MemOp::Write {
                address: 0x1000,
                value: 21,
                wide: false,
                flags: 0
            })
        );
        // WAIT_VALUE_64, EQ.
        let wait = params([4, 0x2000, 1 << 40, 1, 0, 0]);
        assert!(matches!(
            MemOp::try_from(wait),
            Ok(MemOp::Wait {
                wide: true,
                value: 0x100_0000_0000,
                flags: 1,
                ..
            })
        ));
        // A GPU-scope barrier carries its flags right after the operation.
        assert_eq!(
            MemOp::try_from(params([6 | (1 << 32), 0, 0, 0, 0, 0])),
            Ok(MemOp::Barrier { flags: 1 })
        );
        // Unknown operations, misaligned addresses, unknown flags.
        for bad in [
            params([77, 0x1000, 0, 0, 0, 0]),
            params([8, 0x1000, 0, 0, 0, 0]),
            params([1, 0x1002, 0, 0, 0, 0]),
            params([4, 0x1004, 0, 0, 0, 0]),
            params([2, 0x1000, 0, 2, 0, 0]),
            params([1, 0x1000, 0, 4, 0, 0]),
            params([6 | (2 << 32), 0, 0, 0, 0, 0]),
            params([3 | (1 << 32), 0, 0, 0, 0, 0]),
        ] {
            assert_eq!(
                MemOp::try_from(bad),
                Err(CUresult::INVALID_VALUE),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn waits_compare_as_cuda_says() {
        let wait = |value, wide, flags| MemOp::wait(0x1000, value, wide, flags).unwrap();
        // GEQ is cyclic: 0xfffffff0 is before 5, 6 is after.
        assert!(!wait(5, false, MemOp::WAIT_GEQ).satisfied_by(0xffff_fff0));
        assert!(wait(5, false, MemOp::WAIT_GEQ).satisfied_by(6));
        assert!(wait(5, false, MemOp::WAIT_GEQ).satisfied_by(5));
        assert!(wait(u64::MAX - 1, true, MemOp::WAIT_GEQ).satisfied_by(1));
        assert!(!wait(2, true, MemOp::WAIT_GEQ).satisfied_by(1));
        assert!(wait(7, false, MemOp::WAIT_EQ).satisfied_by(7));
        assert!(!wait(7, false, MemOp::WAIT_EQ).satisfied_by(8));
        assert!(wait(0x10, false, MemOp::WAIT_AND).satisfied_by(0x30));
        assert!(!wait(0x10, false, MemOp::WAIT_AND).satisfied_by(0x20));
        // NOR: ~(*addr | value) != 0, within the value's width.
        assert!(!wait(0xffff_fffe, false, MemOp::WAIT_NOR).satisfied_by(1));
        assert!(wait(0xffff_fffe, false, MemOp::WAIT_NOR).satisfied_by(2));
        assert!(!wait(u64::MAX - 1, true, MemOp::WAIT_NOR).satisfied_by(1));
        // The flush flag does not change the comparison.
        assert!(wait(7, false, MemOp::WAIT_EQ | MemOp::WAIT_FLUSH).satisfied_by(7));
        assert_eq!(
            MemOp::wait(0x1000, 0, false, 4),
            Err(CUresult::INVALID_VALUE)
        );
        assert_eq!(MemOp::write(0, 0, false, 0), Err(CUresult::INVALID_VALUE));
    }
}
