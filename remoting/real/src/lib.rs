//! [`RealBackend`]: sessions executed by NVIDIA's driver on a real GPU.
//!
//! The driver library is found and loaded through cudarc's dynamic loading (after
//! [`is_culib_present`](cudarc::driver::sys::is_culib_present), since cudarc panics when it is absent), but
//! every function is called through Gleam's own integer-typed C signatures: enums are plain `i32`/`u32`
//! ([`Arg::C`]), so a value from the network that CUDA does not define is passed to
//! the driver, which rejects it, instead of being undefined behaviour in Rust. Each listed call's symbol is
//! resolved on first use and cached.
//!
//! The driver dereferences whatever handle it is given, so a made-up one would crash the session process:
//! every handle argument is first checked by the session engine against the session's registry
//! (`gleam_protocol::registry`) of the
//! handles the driver returned and that are still alive, and an unknown one gets CUDA's
//! `CUDA_ERROR_INVALID_HANDLE` (`CUDA_ERROR_INVALID_CONTEXT` for a context) without reaching the driver.
//!
//! The server refuses a library that exports `gleam_shim_marker`: that is Gleam's own shim, found because
//! the server inherited a client's `LD_LIBRARY_PATH`, and serving through it would loop.

mod copies;
#[cfg(test)]
mod scenario_tests;

use std::borrow::Cow;
use std::cell::OnceCell;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};

use tracing::{debug, warn};

use gleam_fatbin::ImageKind;
use gleam_protocol::api::{ApiCall, ApiReply, Arg, CLaunchAttribute, CLaunchConfig, args, outs};
use gleam_protocol::copy::Copy3D;
use gleam_protocol::registry::{Effect, Handles, Kind};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{DeviceInfo, FunctionInfo, Launch, LaunchAttr, ParamSlot};
use gleam_server::backend::{ApiBackend, Backend};
use gleam_server::callbacks::CallbackPoint;
use gleam_server::staging::{DeviceRead, HostPin, PinAnywhere};

/// One past the last `CUdevice_attribute` of CUDA 13.0 (`CU_DEVICE_ATTRIBUTE_MAX`).
pub const DEVICE_ATTRIBUTE_END: i32 =
    cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX as i32;
/// `CUfunction_attribute` ids reported in [`FunctionInfo::attributes`] (0 = MAX_THREADS_PER_BLOCK ..=
/// 10 = MAX_DYNAMIC_SHARED_SIZE_BYTES).
const FUNCTION_ATTRIBUTES: i32 = 11;
/// Upper bound on kernel parameters probed with `cuFuncGetParamInfo` (the 32 KiB limit allows at most
/// this many 1-byte parameters).
const MAX_PARAMS: usize = 32_768;
/// The symbol Gleam's shim exports so that a server never loads it as the real driver.
const SHIM_MARKER: &[u8] = b"gleam_shim_marker\0";

/// Why the real driver cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum RealError {
    /// No `libcuda.so` could be loaded.
    #[error("NVIDIA's driver library (libcuda.so) is not installed")]
    NoLibrary,
    /// The library found is Gleam's shim.
    #[error(
        "the libcuda.so found is Gleam's own shim (LD_LIBRARY_PATH points at a client's shim directory); \
         start the server without it"
    )]
    ShimLibrary,
    /// The library lacks a function Gleam needs.
    #[error("libcuda.so lacks {0}: the driver is too old")]
    MissingSymbol(&'static str),
    /// A driver call failed.
    #[error("{call} failed: {result}")]
    Driver {
        /// The C name of the call.
        call: &'static str,
        /// What it returned.
        result: CUresult,
    },
    /// The driver works but reports no device.
    #[error("the driver reports no CUDA device")]
    NoDevice,
}

/// Checks whether a real GPU can serve: the driver loads, is not Gleam's shim, and reports a device.
/// Returns the device count.
pub fn probe() -> Result<usize, RealError> {
    let driver = Driver::load()?;
    driver.init()?;
    let count = driver.device_count()?;
    if count == 0 {
        return Err(RealError::NoDevice);
    }
    Ok(count)
}

type Ptr = *mut c_void;
/// `cuLaunchKernelEx(const CUlaunchConfig*, CUfunction, void**, void**)`.
type LaunchKernelEx = unsafe extern "C" fn(*const c_void, Ptr, *mut Ptr, *mut Ptr) -> CUresult;

/// `cuStreamAddCallback(CUstream, CUstreamCallback, void*, unsigned)`.
type AddCallback =
    unsafe extern "C" fn(Ptr, unsafe extern "C" fn(Ptr, CUresult, Ptr), Ptr, c_uint) -> CUresult;

/// The driver reached a host callback's point in its stream: answer the client, then hold the stream
/// until its function returned.
unsafe extern "C" fn reach_point(_stream: Ptr, status: CUresult, point: Ptr) {
    // SAFETY: `point` is the box `host_callback` handed to the driver, which calls back exactly once.
    let point = unsafe { Box::from_raw(point.cast::<CallbackPoint>()) };
    // No panic may unwind into the driver.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        point.reached(status);
        point.wait_returned();
    }));
}

/// The hand-written calls' entry points, resolved once at start (all exist in every driver Gleam supports,
/// except `cuFuncGetParamInfo`, new in 12.4).
struct Driver {
    lib: &'static libloading::Library,
    init: unsafe extern "C" fn(c_uint) -> CUresult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CUresult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CUresult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CUresult,
    device_get_uuid: unsafe extern "C" fn(*mut [u8; 16], c_int) -> CUresult,
    device_total_mem: unsafe extern "C" fn(*mut usize, c_int) -> CUresult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CUresult,
    device_get_pci_bus_id: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CUresult,
    ctx_set_current: unsafe extern "C" fn(Ptr) -> CUresult,
    ctx_push_current: unsafe extern "C" fn(Ptr) -> CUresult,
    ctx_pop_current: unsafe extern "C" fn(*mut Ptr) -> CUresult,
    ctx_destroy: unsafe extern "C" fn(Ptr) -> CUresult,
    primary_ctx_release: unsafe extern "C" fn(c_int) -> CUresult,
    memcpy_htod: unsafe extern "C" fn(u64, *const c_void, usize) -> CUresult,
    memcpy_htod_async: unsafe extern "C" fn(u64, *const c_void, usize, Ptr) -> CUresult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> CUresult,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, u64, usize, Ptr) -> CUresult,
    stream_synchronize: unsafe extern "C" fn(Ptr) -> CUresult,
    event_create: unsafe extern "C" fn(*mut Ptr, c_uint) -> CUresult,
    event_record: unsafe extern "C" fn(Ptr, Ptr) -> CUresult,
    event_synchronize: unsafe extern "C" fn(Ptr) -> CUresult,
    event_destroy: unsafe extern "C" fn(Ptr) -> CUresult,
    mem_host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult,
    mem_host_unregister: unsafe extern "C" fn(*mut c_void) -> CUresult,
    module_load_data: unsafe extern "C" fn(*mut Ptr, *const c_void) -> CUresult,
    module_unload: unsafe extern "C" fn(Ptr) -> CUresult,
    module_get_function: unsafe extern "C" fn(*mut Ptr, Ptr, *const c_char) -> CUresult,
    func_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, Ptr) -> CUresult,
    func_get_param_info:
        Option<unsafe extern "C" fn(Ptr, usize, *mut usize, *mut usize) -> CUresult>,
    library_load_data: unsafe extern "C" fn(
        *mut Ptr,
        *const c_void,
        *mut c_int,
        *mut Ptr,
        c_uint,
        *mut c_int,
        *mut Ptr,
        c_uint,
    ) -> CUresult,
    library_unload: unsafe extern "C" fn(Ptr) -> CUresult,
    kernel_get_function: unsafe extern "C" fn(*mut Ptr, Ptr) -> CUresult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        Ptr,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Ptr,
        *mut Ptr,
        *mut Ptr,
    ) -> CUresult,
}

impl Driver {
    fn load() -> Result<Self, RealError> {
        // SAFETY: `is_culib_present` only tries to dlopen the candidate names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(RealError::NoLibrary);
        }
        // SAFETY: present (checked above), so `culib` returns instead of panicking. Loading runs the
        // library's initialisers, as any CUDA program does.
        let lib = unsafe { cudarc::driver::sys::culib() };
        // SAFETY: only the symbol's presence is checked; it is never dereferenced.
        if unsafe { lib.get::<*const c_void>(SHIM_MARKER) }.is_ok() {
            return Err(RealError::ShimLibrary);
        }
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the type is the documented C signature of the symbol, with integer enums.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|_| RealError::MissingSymbol($name))?
            };
        }
        Ok(Self {
            lib,
            init: sym!("cuInit"),
            driver_get_version: sym!("cuDriverGetVersion"),
            device_get_count: sym!("cuDeviceGetCount"),
            device_get_name: sym!("cuDeviceGetName"),
            device_get_uuid: sym!("cuDeviceGetUuid_v2"),
            device_total_mem: sym!("cuDeviceTotalMem_v2"),
            device_get_attribute: sym!("cuDeviceGetAttribute"),
            device_get_pci_bus_id: sym!("cuDeviceGetPCIBusId"),
            ctx_set_current: sym!("cuCtxSetCurrent"),
            ctx_push_current: sym!("cuCtxPushCurrent_v2"),
            ctx_pop_current: sym!("cuCtxPopCurrent_v2"),
            ctx_destroy: sym!("cuCtxDestroy_v2"),
            primary_ctx_release: sym!("cuDevicePrimaryCtxRelease_v2"),
            memcpy_htod: sym!("cuMemcpyHtoD_v2"),
            memcpy_htod_async: sym!("cuMemcpyHtoDAsync_v2"),
            memcpy_dtoh: sym!("cuMemcpyDtoH_v2"),
            memcpy_dtoh_async: sym!("cuMemcpyDtoHAsync_v2"),
            stream_synchronize: sym!("cuStreamSynchronize"),
            event_create: sym!("cuEventCreate"),
            event_record: sym!("cuEventRecord"),
            event_synchronize: sym!("cuEventSynchronize"),
            event_destroy: sym!("cuEventDestroy_v2"),
            mem_host_register: sym!("cuMemHostRegister_v2"),
            mem_host_unregister: sym!("cuMemHostUnregister"),
            module_load_data: sym!("cuModuleLoadData"),
            module_unload: sym!("cuModuleUnload"),
            module_get_function: sym!("cuModuleGetFunction"),
            func_get_attribute: sym!("cuFuncGetAttribute"),
            // SAFETY: as in `sym!`.
            func_get_param_info: unsafe { lib.get(b"cuFuncGetParamInfo\0") }.ok().map(|s| *s),
            library_load_data: sym!("cuLibraryLoadData"),
            library_unload: sym!("cuLibraryUnload"),
            kernel_get_function: sym!("cuKernelGetFunction"),
            launch_kernel: sym!("cuLaunchKernel"),
        })
    }

    fn init(&self) -> Result<(), RealError> {
        // SAFETY: plain call with the documented signature.
        check("cuInit", unsafe { (self.init)(0) })
    }

    fn device_count(&self) -> Result<usize, RealError> {
        let mut count = 0;
        // SAFETY: valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            (self.device_get_count)(&raw mut count)
        })?;
        Ok(usize::try_from(count).unwrap_or(0))
    }
}

fn check(call: &'static str, result: CUresult) -> Result<(), RealError> {
    result
        .result()
        .map_err(|result| RealError::Driver { call, result })
}

/// Generates the cache of listed calls' entry points and their `ApiBackend` methods.
macro_rules! real_api {
    ($($mode:ident fn $name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {
        /// Entry points of the listed calls, resolved on first use (`None` = the driver lacks it).
        #[allow(non_snake_case)]
        #[derive(Default)]
        struct ApiFns {
            $($name: OnceCell<Option<unsafe extern "C" fn($(<$ty as Arg>::C),*) -> CUresult>>,)*
        }

        #[allow(non_snake_case)]
        impl ApiBackend for RealBackend {
            $(
                #[allow(unused_variables)]
                fn $name(&mut self, args: args::$name) -> Result<outs::$name, CUresult> {
                    let lib = self.driver.lib;
                    let f = *self.api.$name.get_or_init(|| {
                        // SAFETY: the type is the call's C signature from the declaration list.
                        let f = unsafe { lib.get(concat!(stringify!($name), "\0").as_bytes()) }
                            .ok()
                            .map(|s| *s);
                        if f.is_none() {
                            warn!(call = stringify!($name), "the driver lacks this call");
                        }
                        f
                    });
                    let f = f.ok_or(CUresult::NOT_SUPPORTED)?;
                    $(let mut $arg = <$ty as Arg>::slot(args.$arg);)*
                    // SAFETY: the session engine checked every handle against the session's registry
                    // (the driver does not validate handles); other in-values are plain integers from
                    // the client (the driver validates them); out-pointers point into the slots above,
                    // which outlive the call.
                    let result = unsafe { f($(<$ty as Arg>::slot_c(&mut $arg)),*) };
                    result.result()?;
                    Ok(outs::$name { $($arg: <$ty as Arg>::slot_reply($arg),)* })
                }
            )*

            fn api(&mut self, call: ApiCall) -> Result<ApiReply, CUresult> {
                let effect = Effect::of(&call);
                let ends_context =
                    matches!(effect, Effect::Destroy(Kind::Context, _) | Effect::PrimaryReset(_))
                        || matches!(call, ApiCall::cuDevicePrimaryCtxRelease_v2(_));
                // Their events die with the context; a filler may be page-locking in it.
                let contexts = ends_context.then(|| {
                    self.settle_reads();
                    self.contexts.clone()
                });
                let _no_pinning = contexts
                    .as_ref()
                    .map(|c| c.write().unwrap_or_else(PoisonError::into_inner));
                let reply = match call {
                    $(ApiCall::$name(a) => self.$name(a).map(ApiReply::$name),)*
                }?;
                self.track(effect, &reply);
                Ok(reply)
            }
        }
    };
}

gleam_protocol::cuda_api!(real_api);

/// A session on NVIDIA's driver.
pub struct RealBackend {
    driver: Driver,
    api: ApiFns,
    copies: copies::CopyFns,
    /// `cuLaunchKernelEx`, resolved on first use (`None`: the driver lacks it).
    launch_kernel_ex: OnceCell<Option<LaunchKernelEx>>,
    /// The context current on this (the only executing) thread, as far as we know; `None` = unknown.
    current: Option<u64>,
    /// Where device-to-host copies land before they become a reply (allocated at the first one).
    staging: Option<Staging>,
    /// Copies from upload staging the device may still be running ([`Backend::device_read`]), settled
    /// before a context (whose events they are) can go.
    reads: Vec<Weak<PendingRead>>,
    /// Held (shared) while another thread has a context current to page-lock staging
    /// ([`Backend::pin_anywhere`]), and exclusively while a context may go.
    contexts: Arc<RwLock<()>>,
}

/// A recorded event after a copy from page-locked staging: waited for and destroyed once, by the
/// staging buffer's next writer (on any thread) or by the backend before the event's context goes.
struct PendingRead {
    event: Mutex<Option<usize>>,
    synchronize: unsafe extern "C" fn(Ptr) -> CUresult,
    destroy: unsafe extern "C" fn(Ptr) -> CUresult,
}

impl PendingRead {
    fn settle(&self) {
        let mut event = self.event.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(e) = event.take() {
            // SAFETY: an event this backend recorded, not destroyed yet (taken once, under the lock),
            // whose context is still alive (the backend settles every read before a context goes).
            unsafe {
                let _ = (self.synchronize)(e as Ptr);
                let _ = (self.destroy)(e as Ptr);
            }
        }
    }
}

/// Bytes of page-locked staging for device-to-host copies: one client piece
/// ([`gleam_protocol::wire::COPY_CHUNK`]); larger copies go through it in turns.
const STAGING_BYTES: usize = gleam_protocol::wire::COPY_CHUNK;

/// A buffer of this process's own, page-locked with `cuMemHostRegister` when the driver allows it.
///
/// Why: a device-to-host copy into pageable memory goes through the driver's own bounce buffers, a
/// fraction of the copy engine's rate (1.1 GiB/s on the H200 against tens of GiB/s into page-locked
/// memory), and a fresh reply buffer was zero-filled first. Registration is only a speed-up: the memory is
/// ours, so if the registering context goes away the buffer is merely pageable again and copies stay
/// correct (the synchronous copy, or the async one followed by a stream synchronization, as before).
struct Staging {
    /// Holds the page-aligned `len` bytes at `start` (registration wants whole pages).
    buf: Vec<u8>,
    start: usize,
    len: usize,
    registered: bool,
}

/// The host page size registration works in.
const PAGE: usize = 4096;

impl Staging {
    fn new(driver: &Driver, len: usize) -> Self {
        let buf = vec![0u8; len + PAGE];
        let start = buf.as_ptr().align_offset(PAGE).min(PAGE);
        let mut staging = Self {
            buf,
            start,
            len,
            registered: false,
        };
        let at = staging.bytes().as_mut_ptr().cast();
        // SAFETY: the buffer is ours and outlives the registration (undone in `release`). Flag 1 =
        // PORTABLE: page-locked for every context, not only the current one.
        let result = unsafe { (driver.mem_host_register)(at, len, 1) };
        if !result.is_success() {
            debug!(?result, "device-to-host staging stays pageable");
        }
        staging.registered = result.is_success();
        staging
    }

    /// The staging bytes.
    fn bytes(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }

    fn release(&mut self, driver: &Driver) {
        if std::mem::take(&mut self.registered) {
            let at = self.bytes().as_mut_ptr().cast();
            // SAFETY: registered by `new`; a failure (its context is gone) leaves plain memory.
            let _ = unsafe { (driver.mem_host_unregister)(at) };
        }
    }
}

/// `cuMemHostRegister` of `pages` (in the calling thread's current context), undone when the pin drops.
fn page_lock(
    register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult,
    unregister: unsafe extern "C" fn(*mut c_void) -> CUresult,
    pages: &mut [u8],
) -> Option<HostPin> {
    let at = pages.as_mut_ptr().cast::<c_void>();
    // SAFETY: `pages` is valid for its length; the caller keeps it allocated until the pin is dropped.
    // PORTABLE: copies in any of the session's contexts see it page-locked.
    let result = unsafe { register(at, pages.len(), 1) };
    if !result.is_success() {
        debug!(?result, "upload staging stays pageable");
        return None;
    }
    let addr = at as usize;
    Some(HostPin::new(move || {
        // SAFETY: registered above and not yet unregistered; a failure (its context is gone) leaves
        // plain memory.
        let _ = unsafe { unregister(addr as *mut c_void) };
    }))
}

impl Drop for RealBackend {
    fn drop(&mut self) {
        self.settle_reads();
        if let Some(staging) = &mut self.staging {
            staging.release(&self.driver);
        }
    }
}

impl std::fmt::Debug for RealBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealBackend")
            .field("current", &self.current)
            .finish_non_exhaustive()
    }
}

impl RealBackend {
    /// Loads the driver and initialises it. Fails if there is no usable driver or device.
    pub fn new() -> Result<Self, RealError> {
        let driver = Driver::load()?;
        driver.init()?;
        if driver.device_count()? == 0 {
            return Err(RealError::NoDevice);
        }
        Ok(Self {
            driver,
            api: ApiFns::default(),
            copies: copies::CopyFns::default(),
            launch_kernel_ex: OnceCell::new(),
            current: None,
            staging: None,
            reads: Vec::new(),
            contexts: Arc::default(),
        })
    }

    /// Waits for every copy from upload staging still pending ([`Backend::device_read`]).
    fn settle_reads(&mut self) {
        for read in self.reads.drain(..) {
            if let Some(read) = read.upgrade() {
                read.settle();
            }
        }
    }

    /// Bookkeeping after a listed call succeeded: the driver's current context.
    fn track(&mut self, effect: Effect, reply: &ApiReply) {
        match (effect, reply) {
            // cuCtxCreate makes the new context current.
            (_, ApiReply::cuCtxCreate_v2(out)) => self.current = Some(out.pctx),
            (_, ApiReply::cuCtxCreate_v3(out)) => self.current = Some(out.pctx),
            // The driver's current context may have changed behind our back.
            (Effect::Destroy(Kind::Context, _) | Effect::PrimaryReset(_), _) => self.current = None,
            _ => {}
        }
    }

    fn device_info(&self, dev: c_int) -> Result<DeviceInfo, CUresult> {
        let d = &self.driver;
        let mut name = [0 as c_char; 256];
        // SAFETY: buffer and length match; the driver NUL-terminates within them.
        unsafe { (d.device_get_name)(name.as_mut_ptr(), name.len() as c_int, dev) }.result()?;
        let mut uuid = [0u8; 16];
        // SAFETY: CUuuid is 16 bytes.
        unsafe { (d.device_get_uuid)(&raw mut uuid, dev) }.result()?;
        let mut total_mem = 0usize;
        // SAFETY: valid out-pointer.
        unsafe { (d.device_total_mem)(&raw mut total_mem, dev) }.result()?;
        let mut attributes = vec![0; DEVICE_ATTRIBUTE_END.max(1) as usize];
        for id in 1..DEVICE_ATTRIBUTE_END {
            let mut value = 0;
            // SAFETY: valid out-pointer; an id the driver does not know is an error, kept as 0.
            if unsafe { (d.device_get_attribute)(&raw mut value, id, dev) }.is_success() {
                attributes[id as usize] = value;
            }
        }
        let mut bus = [0 as c_char; 32];
        // SAFETY: buffer and length match.
        unsafe { (d.device_get_pci_bus_id)(bus.as_mut_ptr(), bus.len() as c_int, dev) }.result()?;
        Ok(DeviceInfo {
            name: c_string(&name),
            uuid,
            total_mem: total_mem as u64,
            attributes,
            pci_bus_id: c_string(&bus),
        })
    }

    fn function_info(&self, func: Ptr) -> FunctionInfo {
        let d = &self.driver;
        let mut params = Vec::new();
        if let Some(param_info) = d.func_get_param_info {
            for index in 0..MAX_PARAMS {
                let (mut offset, mut size) = (0usize, 0usize);
                // SAFETY: valid out-pointers; past the last parameter the driver returns INVALID_VALUE.
                if !unsafe { param_info(func, index, &raw mut offset, &raw mut size) }.is_success()
                {
                    break;
                }
                let (Ok(offset), Ok(size)) = (u32::try_from(offset), u32::try_from(size)) else {
                    break;
                };
                params.push(ParamSlot { offset, size });
            }
        }
        let attributes = (0..FUNCTION_ATTRIBUTES)
            .map(|attr| {
                let mut value = 0;
                // SAFETY: valid out-pointer.
                let r = unsafe { (d.func_get_attribute)(&raw mut value, attr, func) };
                if r.is_success() { value } else { 0 }
            })
            .collect();
        FunctionInfo { params, attributes }
    }
}

/// The text of a NUL-terminated C buffer.
fn c_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl Backend for RealBackend {
    fn describe(&mut self) -> Result<(i32, String, Vec<DeviceInfo>), CUresult> {
        let mut version = 0;
        // SAFETY: valid out-pointer.
        unsafe { (self.driver.driver_get_version)(&raw mut version) }.result()?;
        let mut count = 0;
        // SAFETY: valid out-pointer.
        unsafe { (self.driver.device_get_count)(&raw mut count) }.result()?;
        let devices = (0..count)
            .map(|dev| self.device_info(dev))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((version, "cuda".to_owned(), devices))
    }

    fn set_current_context(&mut self, ctx: u64) -> Result<(), CUresult> {
        if self.current == Some(ctx) {
            return Ok(());
        }
        // SAFETY: NULL or a live context of this session (checked by the session engine).
        unsafe { (self.driver.ctx_set_current)(ctx as Ptr) }.result()?;
        self.current = Some(ctx);
        Ok(())
    }

    fn memcpy_htod(&mut self, dst: u64, data: &[u8], stream: Option<u64>) -> Result<(), CUresult> {
        let d = &self.driver;
        match stream {
            // SAFETY: `data` is valid for its length.
            None => unsafe { (d.memcpy_htod)(dst, data.as_ptr().cast(), data.len()) },
            // SAFETY: as above, and the stream is live; from pageable memory the async copy returns only
            // once the bytes are staged, so `data` may be freed after the call.
            Some(s) => unsafe {
                (d.memcpy_htod_async)(dst, data.as_ptr().cast(), data.len(), s as Ptr)
            },
        }
        .result()
    }

    fn pin_host(&mut self, pages: &mut [u8]) -> Option<HostPin> {
        let d = &self.driver;
        page_lock(d.mem_host_register, d.mem_host_unregister, pages)
    }

    fn pin_anywhere(&mut self) -> Option<PinAnywhere> {
        let ctx = self.current.filter(|&ctx| ctx != 0)?;
        let d = &self.driver;
        let (push, pop, register, unregister) = (
            d.ctx_push_current,
            d.ctx_pop_current,
            d.mem_host_register,
            d.mem_host_unregister,
        );
        let contexts = self.contexts.clone();
        Some(Arc::new(move |pages: &mut [u8]| {
            // The context does not go while it is current here.
            let _live = contexts.read().unwrap_or_else(PoisonError::into_inner);
            // Pushed and popped, not set: the calling thread's own context (if it is the executor,
            // running a filler's job inline) is current again afterwards.
            // SAFETY: a live context of this session (ending one waits for the lock held above).
            unsafe { push(ctx as Ptr) }.result().ok()?;
            let pin = page_lock(register, unregister, pages);
            let mut popped: Ptr = std::ptr::null_mut();
            // SAFETY: pops the context pushed above; a valid out-pointer.
            let _ = unsafe { pop(&raw mut popped) };
            pin
        }))
    }

    fn device_read(&mut self, stream: u64) -> Option<DeviceRead> {
        let d = &self.driver;
        let mut event: Ptr = std::ptr::null_mut();
        // CU_EVENT_DISABLE_TIMING: the cheapest event to record and wait for.
        // SAFETY: a valid out-pointer.
        let made = unsafe { (d.event_create)(&raw mut event, 2) }.result();
        // SAFETY: the event was just made; the stream is live (the copy on it just succeeded).
        let recorded =
            made.and_then(|()| unsafe { (d.event_record)(event, stream as Ptr) }.result());
        if recorded.is_err() {
            debug!(
                ?recorded,
                "no event after a copy from staging: waiting for its stream"
            );
            if !event.is_null() {
                // SAFETY: made above, not recorded.
                let _ = unsafe { (d.event_destroy)(event) };
            }
            // SAFETY: as above.
            let _ = unsafe { (d.stream_synchronize)(stream as Ptr) };
            return None;
        }
        let read = Arc::new(PendingRead {
            event: Mutex::new(Some(event as usize)),
            synchronize: d.event_synchronize,
            destroy: d.event_destroy,
        });
        self.reads.retain(|r| r.strong_count() > 0);
        self.reads.push(Arc::downgrade(&read));
        Some(DeviceRead::new(move || read.settle()))
    }

    fn memcpy_dtoh(
        &mut self,
        src: u64,
        len: usize,
        stream: Option<u64>,
    ) -> Result<Vec<u8>, CUresult> {
        let d = &self.driver;
        let staging = self
            .staging
            .get_or_insert_with(|| Staging::new(d, STAGING_BYTES));
        // Written into a buffer an earlier reply gave back, not into fresh pages.
        let mut out = gleam_server::recycle::REPLIES.buffer(len);
        let mut offset = 0;
        // At least one copy, so that a zero-byte one is still checked by the driver.
        loop {
            let bytes = staging.bytes();
            let n = (len - offset).min(bytes.len());
            let at = bytes.as_mut_ptr().cast::<c_void>();
            let from = src + offset as u64;
            match stream {
                // SAFETY: the staging buffer holds `n` bytes.
                None => unsafe { (d.memcpy_dtoh)(at, from, n) }.result()?,
                Some(s) => {
                    // SAFETY: as above; the stream is synchronised before the buffer is read or reused.
                    unsafe { (d.memcpy_dtoh_async)(at, from, n, s as Ptr) }.result()?;
                    // SAFETY: a live stream (the session engine checked it).
                    unsafe { (d.stream_synchronize)(s as Ptr) }.result()?;
                }
            }
            out.extend_from_slice(&staging.bytes()[..n]);
            offset += n;
            if offset >= len {
                return Ok(out);
            }
        }
    }

    fn memcpy3d(
        &mut self,
        copy: &Copy3D,
        host: &[u8],
        stream: Option<u64>,
    ) -> Result<Vec<u8>, CUresult> {
        copies::memcpy3d(self.driver.lib, &self.copies, copy, host, stream)
    }

    fn mirror_write(&mut self, addr: u64, data: &[u8]) -> Result<(), CUresult> {
        // SAFETY: the session engine checked the range against the session's mirrored allocations.
        unsafe { copies::mirror_write(addr, data) };
        Ok(())
    }

    fn mirror_read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>, CUresult> {
        // SAFETY: as above.
        Ok(unsafe { copies::mirror_read(addr, len) })
    }

    fn module_load(&mut self, image: &[u8]) -> Result<u64, CUresult> {
        let image = checked_image(image)?;
        let mut module: Ptr = std::ptr::null_mut();
        // SAFETY: `checked_image` made sure the driver's reading (headers' extent, or up to the NUL)
        // stays inside the buffer.
        unsafe { (self.driver.module_load_data)(&raw mut module, image.as_ptr().cast()) }
            .result()?;
        Ok(module as u64)
    }

    fn module_get_function(
        &mut self,
        module: u64,
        name: &str,
    ) -> Result<(u64, FunctionInfo), CUresult> {
        let name = std::ffi::CString::new(name).map_err(|_| CUresult::NOT_FOUND)?;
        let mut func: Ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer, NUL-terminated name and a live module.
        unsafe { (self.driver.module_get_function)(&raw mut func, module as Ptr, name.as_ptr()) }
            .result()?;
        Ok((func as u64, self.function_info(func)))
    }

    fn library_load(&mut self, image: &[u8]) -> Result<u64, CUresult> {
        let image = checked_image(image)?;
        let mut library: Ptr = std::ptr::null_mut();
        let (no_opts, no_values) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: as in `module_load`; no JIT or library options.
        unsafe {
            (self.driver.library_load_data)(
                &raw mut library,
                image.as_ptr().cast(),
                no_opts,
                no_values,
                0,
                no_opts,
                no_values,
                0,
            )
        }
        .result()?;
        Ok(library as u64)
    }

    fn kernel_get_function(&mut self, kernel: u64) -> Result<(u64, FunctionInfo), CUresult> {
        let mut func: Ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer and a live kernel.
        unsafe { (self.driver.kernel_get_function)(&raw mut func, kernel as Ptr) }.result()?;
        Ok((func as u64, self.function_info(func)))
    }

    fn host_callback(&mut self, stream: u64, point: CallbackPoint) -> Result<(), CUresult> {
        // `cuStreamAddCallback` rather than `cuLaunchHostFunc`: the driver calls it even after a fault,
        // with the status, which the client's function needs (a `cuLaunchHostFunc` function is then not
        // called, and its stream would wait for an answer that never comes). The driver runs it on its
        // own callback thread, which it holds until the client's function returned.
        // SAFETY: the documented signature of the symbol.
        let add = *unsafe { self.driver.lib.get::<AddCallback>(b"cuStreamAddCallback\0") }
            .map_err(|_| CUresult::NOT_SUPPORTED)?;
        let point = Box::into_raw(Box::new(point));
        // SAFETY: the stream is live (checked by the session engine); the driver calls `reach_point`
        // once with `point`, which stays valid until then.
        let added = unsafe { add(stream as Ptr, reach_point, point.cast(), 0) };
        if let Err(err) = added.result() {
            // SAFETY: refused, so the driver will never call back with it: ours again.
            drop(unsafe { Box::from_raw(point) });
            return Err(err);
        }
        Ok(())
    }

    fn launch(&mut self, launch: &Launch) -> Result<(), CUresult> {
        let [gx, gy, gz] = launch.grid;
        let [bx, by, bz] = launch.block;
        let mut len = launch.params.len();
        // `extra` = {BUFFER_POINTER, buf, BUFFER_SIZE, &len, END}: the driver copies the packed buffer.
        let mut extra: [Ptr; 5] = [
            1 as Ptr,
            launch.params.as_ptr() as Ptr,
            2 as Ptr,
            (&raw mut len).cast(),
            std::ptr::null_mut(),
        ];
        let extra_ptr = if launch.params.is_empty() {
            std::ptr::null_mut()
        } else {
            extra.as_mut_ptr()
        };
        // SAFETY: `extra` and what it points to live until the call returns (the driver copies the
        // parameters at launch); function and stream are live (checked above); the driver validates
        // the dimensions.
        unsafe {
            (self.driver.launch_kernel)(
                launch.function as Ptr,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                launch.shared_mem_bytes,
                launch.stream as Ptr,
                std::ptr::null_mut(),
                extra_ptr,
            )
        }
        .result()
    }

    fn launch_ex(&mut self, launch: &Launch, attrs: &[LaunchAttr]) -> Result<(), CUresult> {
        let lib = self.driver.lib;
        let f = *self.launch_kernel_ex.get_or_init(|| {
            // SAFETY: the documented C signature of cuLaunchKernelEx (CUDA 11.8+).
            unsafe { lib.get::<LaunchKernelEx>(b"cuLaunchKernelEx\0") }
                .ok()
                .map(|s| *s)
        });
        let f = f.ok_or(CUresult::NOT_SUPPORTED)?;
        let c_attrs: Vec<CLaunchAttribute> = attrs
            .iter()
            .map(|a| CLaunchAttribute {
                id: a.id,
                pad: 0,
                value: a.value,
            })
            .collect();
        let config = CLaunchConfig {
            grid: launch.grid,
            block: launch.block,
            shared_mem_bytes: launch.shared_mem_bytes,
            stream: launch.stream as Ptr,
            attrs: if c_attrs.is_empty() {
                std::ptr::null()
            } else {
                c_attrs.as_ptr()
            },
            num_attrs: u32::try_from(c_attrs.len()).map_err(|_| CUresult::INVALID_VALUE)?,
        };
        let mut len = launch.params.len();
        let mut extra: [Ptr; 5] = [
            1 as Ptr,
            launch.params.as_ptr() as Ptr,
            2 as Ptr,
            (&raw mut len).cast(),
            std::ptr::null_mut(),
        ];
        let extra_ptr = if launch.params.is_empty() {
            std::ptr::null_mut()
        } else {
            extra.as_mut_ptr()
        };
        // SAFETY: the configuration, its attributes and `extra` live until the call returns (the driver
        // copies what it keeps); function, stream and events named by attributes are live (checked by
        // the session engine); the driver validates the values.
        unsafe {
            f(
                (&raw const config).cast(),
                launch.function as Ptr,
                std::ptr::null_mut(),
                extra_ptr,
            )
        }
        .result()
    }

    fn shutdown(&mut self, handles: &Handles) {
        self.settle_reads();
        let contexts = self.contexts.clone();
        let _no_pinning = contexts.write().unwrap_or_else(PoisonError::into_inner);
        let modules = handles.loaded_modules();
        let libraries = handles.libraries();
        let contexts = handles.created_contexts();
        // Best effort: the process exits next, which frees whatever remains. Only live handles are
        // released: the registry dropped those that died with their context or library.
        let (graphs, execs) = handles.graphs();
        for exec in execs {
            let _ = ApiBackend::cuGraphExecDestroy(self, args::cuGraphExecDestroy { exec });
        }
        for graph in graphs {
            let _ = ApiBackend::cuGraphDestroy(self, args::cuGraphDestroy { graph });
        }
        let d = &self.driver;
        for &m in &modules {
            // SAFETY: a live module this session loaded.
            let _ = unsafe { (d.module_unload)(m as Ptr) };
        }
        for &l in &libraries {
            // SAFETY: a live library this session loaded.
            let _ = unsafe { (d.library_unload)(l as Ptr) };
        }
        for &c in &contexts {
            // SAFETY: a live context this session created.
            let _ = unsafe { (d.ctx_destroy)(c as Ptr) };
        }
        for (dev, n) in handles.primary_retains() {
            for _ in 0..n {
                // SAFETY: releases a retain this session made.
                let _ = unsafe { (d.primary_ctx_release)(dev) };
            }
        }
        debug!(
            modules = modules.len(),
            libraries = libraries.len(),
            contexts = contexts.len(),
            "real backend released the session's resources"
        );
        self.current = None;
    }
}

/// An image from the network, made safe to hand to the driver, which takes only a pointer: a binary
/// (ELF cubin, fatbin) must hold everything its headers announce, and PTX text must end with a NUL
/// inside the buffer (added if missing). A fatbin *wrapper* holds a pointer, which cannot travel.
fn checked_image(image: &[u8]) -> Result<Cow<'_, [u8]>, CUresult> {
    if image.is_empty() {
        return Err(CUresult::INVALID_IMAGE);
    }
    match gleam_fatbin::classify(image) {
        ImageKind::Ptx if image.contains(&0) => Ok(Cow::Borrowed(image)),
        ImageKind::Ptx => Ok(Cow::Owned([image, &[0]].concat())),
        ImageKind::Elf | ImageKind::Fatbin => match gleam_fatbin::image_size_in(image) {
            Ok(_) => Ok(Cow::Borrowed(image)),
            Err(err) => {
                warn!(error = %err, "refusing a malformed module image");
                Err(CUresult::INVALID_IMAGE)
            }
        },
        ImageKind::FatbinWrapper => Err(CUresult::INVALID_IMAGE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // CUDA 13.0 defines attributes up to well past 130; the sentinel must not be an old version's.
    const _: () = assert!(DEVICE_ATTRIBUTE_END > 130);

    #[test]
    fn images_are_checked_before_the_driver_sees_them() {
        assert_eq!(&*checked_image(b".version 8.0").unwrap(), b".version 8.0\0");
        assert_eq!(
            &*checked_image(b".version 8.0\0").unwrap(),
            b".version 8.0\0"
        );
        assert_eq!(checked_image(b"").unwrap_err(), CUresult::INVALID_IMAGE);
        // Headers that announce more than the buffer holds.
        assert_eq!(
            checked_image(b"\x7fELF\x02").unwrap_err(),
            CUresult::INVALID_IMAGE
        );
        let mut fatbin = 0xBA55ED50u32.to_le_bytes().to_vec();
        fatbin.extend([1, 0, 16, 0]);
        fatbin.extend(1000u64.to_le_bytes());
        assert_eq!(checked_image(&fatbin).unwrap_err(), CUresult::INVALID_IMAGE);
        let wrapper = 0x466243B1u32.to_le_bytes();
        assert_eq!(
            checked_image(&wrapper).unwrap_err(),
            CUresult::INVALID_IMAGE
        );
    }

    #[test]
    fn c_strings_stop_at_nul() {
        let buf: Vec<c_char> = b"H200\0junk".iter().map(|&b| b as c_char).collect();
        assert_eq!(c_string(&buf), "H200");
    }

    /// Without a GPU (CI), probing reports why instead of panicking.
    #[test]
    fn probe_never_panics() {
        match probe() {
            Ok(n) => assert!(n > 0),
            Err(err) => assert!(!err.to_string().is_empty()),
        }
    }

    /// `data[i] += 1` for `i < n`.
    const ADD_ONE: &str = include_str!("../tests/fixtures/add_one.ptx");

    /// On a GPU machine: a whole session through the engine and NVIDIA's driver. Without a GPU (CI)
    /// there is nothing to run it on.
    #[test]
    #[ignore = "needs a GPU: run on the GPU machine with --ignored"]
    fn session_on_a_real_gpu() {
        use gleam_protocol::api::{ApiReply, args};
        use gleam_protocol::wire::{
            COPY_CHUNK, Call, ClientHello, PROTOCOL_VERSION, Reply, ReplyFrame, Request,
        };
        use gleam_server::session::Session;

        let backend = match RealBackend::new() {
            Ok(b) => b,
            Err(why) => panic!("this test needs a GPU and NVIDIA's driver: {why}"),
        };
        let mut s = Session::new(backend);
        let seq = std::cell::Cell::new(0);
        let mut ctx = 0;
        let call_with =
            |s: &mut Session<RealBackend>, ctx: u64, c: Call, reply: bool, bulk: &[u8]| {
                seq.set(seq.get() + 1);
                let request = Request {
                    seq: seq.get(),
                    ctx,
                    expects_reply: reply,
                    deps: Default::default(),
                    call: c,
                };
                s.handle(request, bulk)
            };
        let call = |s: &mut Session<RealBackend>, ctx: u64, c: Call, reply: bool| {
            call_with(s, ctx, c, reply, &[]).map(|answer| -> ReplyFrame { answer.frame })
        };
        let r = call(
            &mut s,
            0,
            Call::Hello(ClientHello {
                protocol: PROTOCOL_VERSION,
                client: "real test".into(),
            }),
            true,
        )
        .unwrap();
        let Reply::Hello(hello) = r.reply else {
            panic!("{:?} {:?}", r.result, r.reply)
        };
        eprintln!(
            "driver {} devices {:?}",
            hello.driver_version,
            hello
                .devices
                .iter()
                .map(|d| (&d.name, &d.pci_bus_id, d.total_mem))
                .collect::<Vec<_>>()
        );
        assert!(hello.driver_version >= 12040);
        let d0 = &hello.devices[0];
        assert_eq!(d0.attributes.len(), DEVICE_ATTRIBUTE_END as usize);
        assert!(d0.attributes[1] >= 1024, "MAX_THREADS_PER_BLOCK");
        assert_eq!(d0.attributes[10], 32, "WARP_SIZE");
        assert!(d0.attributes[75] >= 7, "COMPUTE_CAPABILITY_MAJOR");

        let r = call(
            &mut s,
            0,
            Call::Api(ApiCall::cuDevicePrimaryCtxRetain(
                args::cuDevicePrimaryCtxRetain { pctx: (), dev: 0 },
            )),
            true,
        )
        .unwrap();
        if let Reply::Api(ApiReply::cuDevicePrimaryCtxRetain(o)) = r.reply {
            ctx = o.pctx;
        }
        assert_ne!(ctx, 0, "{:?}", r.result);

        // Out of memory is an error, not a crash.
        let r = call(
            &mut s,
            ctx,
            Call::Api(ApiCall::cuMemAlloc_v2(args::cuMemAlloc_v2 {
                dptr: (),
                bytesize: 1 << 50,
            })),
            true,
        )
        .unwrap();
        assert_eq!(r.result, CUresult::OUT_OF_MEMORY);

        let n = 1_000_000u32;
        let bytes = n as usize * 4;
        let r = call(
            &mut s,
            ctx,
            Call::Api(ApiCall::cuMemAlloc_v2(args::cuMemAlloc_v2 {
                dptr: (),
                bytesize: bytes,
            })),
            true,
        )
        .unwrap();
        let Reply::Api(ApiReply::cuMemAlloc_v2(out)) = r.reply else {
            panic!("{:?}", r.result)
        };
        let ptr = out.dptr;
        let input: Vec<u8> = (0..n).flat_map(u32::to_le_bytes).collect();
        for (i, piece) in input.chunks(COPY_CHUNK).enumerate() {
            let last = (i + 1) * COPY_CHUNK >= input.len();
            let r = call_with(
                &mut s,
                ctx,
                Call::MemcpyHtoD {
                    dst: ptr + (i * COPY_CHUNK) as u64,
                    stream: None,
                },
                last,
                piece,
            );
            if let Some(r) = r {
                assert_eq!(r.frame.result, CUresult::SUCCESS);
            }
        }
        let r = call_with(&mut s, ctx, Call::ModuleLoad, true, ADD_ONE.as_bytes())
            .unwrap()
            .frame;
        let Reply::Module { handle: module } = r.reply else {
            panic!("{:?}", r.result)
        };
        let r = call(
            &mut s,
            ctx,
            Call::ModuleGetFunction {
                module,
                name: "add_one".into(),
            },
            true,
        )
        .unwrap();
        let Reply::Function {
            handle: function,
            info,
        } = r.reply
        else {
            panic!("{:?}", r.result)
        };
        assert_eq!(
            info.params,
            [
                ParamSlot { offset: 0, size: 8 },
                ParamSlot { offset: 8, size: 4 }
            ]
        );
        assert!(info.attributes[0] >= 128, "{:?}", info.attributes);
        let r = call(
            &mut s,
            ctx,
            Call::ModuleGetFunction {
                module,
                name: "missing".into(),
            },
            true,
        )
        .unwrap();
        assert_eq!(r.result, CUresult::NOT_FOUND);

        let mut params = ptr.to_le_bytes().to_vec();
        params.extend(n.to_le_bytes());
        for _ in 0..3 {
            let l = Launch {
                function,
                grid: [n.div_ceil(256), 1, 1],
                block: [256, 1, 1],
                shared_mem_bytes: 0,
                stream: 0,
                params: params.clone(),
            };
            assert!(call(&mut s, ctx, Call::LaunchKernel(l), false).is_none());
        }
        // Too many threads per block: the deferred error is reported by the next sync call.
        let l = Launch {
            function,
            grid: [1, 1, 1],
            block: [4096, 1, 1],
            shared_mem_bytes: 0,
            stream: 0,
            params: params.clone(),
        };
        call(&mut s, ctx, Call::LaunchKernel(l), false);
        let r = call(
            &mut s,
            ctx,
            Call::Api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {})),
            true,
        )
        .unwrap();
        assert_eq!(r.result, CUresult::INVALID_VALUE);
        let r = call(
            &mut s,
            ctx,
            Call::Api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {})),
            true,
        )
        .unwrap();
        assert_eq!(r.result, CUresult::SUCCESS);

        let mut back = Vec::new();
        while back.len() < bytes {
            let len = (bytes - back.len()).min(COPY_CHUNK);
            let r = call_with(
                &mut s,
                ctx,
                Call::MemcpyDtoH {
                    src: ptr + back.len() as u64,
                    len: len as u64,
                    stream: None,
                    apart: None,
                },
                true,
                &[],
            )
            .unwrap();
            let Reply::Data = r.frame.reply else {
                panic!("{:?}", r.frame.result)
            };
            back.extend(r.bulk);
        }
        for (i, w) in back.chunks_exact(4).enumerate() {
            assert_eq!(
                u32::from_le_bytes(w.try_into().unwrap()),
                i as u32 + 3,
                "element {i}"
            );
        }

        // Streams and async copies through the generated calls.
        let r = call(
            &mut s,
            ctx,
            Call::Api(ApiCall::cuStreamCreate(args::cuStreamCreate {
                stream: (),
                flags: 1,
            })),
            true,
        )
        .unwrap();
        let Reply::Api(ApiReply::cuStreamCreate(o)) = r.reply else {
            panic!("{:?}", r.result)
        };
        let stream = o.stream;
        call_with(
            &mut s,
            ctx,
            Call::MemcpyHtoD {
                dst: ptr,
                stream: Some(stream),
            },
            false,
            &[7; 64],
        );
        let r = call_with(
            &mut s,
            ctx,
            Call::MemcpyDtoH {
                src: ptr,
                len: 64,
                stream: Some(stream),
                apart: None,
            },
            true,
            &[],
        )
        .unwrap();
        assert!(
            matches!(r.frame.reply, Reply::Data) && r.bulk == [7; 64],
            "{:?}",
            r.frame.result
        );

        // Made-up and dead handles get CUDA's error codes instead of crashing the session process.
        const BOGUS: u64 = 0xdead_beef_0000;
        macro_rules! expect {
            ($ctx:expr, $call:expr, $want:expr $(,)?) => {{
                let c: ApiCall = $call;
                let name = c.name();
                let r = call(&mut s, $ctx, Call::Api(c), true).unwrap();
                assert_eq!(r.result, $want, "{name}");
            }};
        }
        expect!(
            ctx,
            ApiCall::cuStreamSynchronize(args::cuStreamSynchronize { stream: BOGUS }),
            CUresult::INVALID_HANDLE,
        );
        expect!(
            ctx,
            ApiCall::cuEventQuery(args::cuEventQuery { event: BOGUS }),
            CUresult::INVALID_HANDLE,
        );
        expect!(
            ctx,
            ApiCall::cuModuleGetGlobal_v2(args::cuModuleGetGlobal_v2 {
                dptr: true,
                bytes: true,
                module: BOGUS,
                name: "g".into(),
            }),
            CUresult::INVALID_HANDLE,
        );
        expect!(
            ctx,
            ApiCall::cuFuncGetAttribute(args::cuFuncGetAttribute {
                value: (),
                attrib: 0,
                func: BOGUS,
            }),
            CUresult::INVALID_HANDLE,
        );
        expect!(
            ctx,
            ApiCall::cuLibraryUnload(args::cuLibraryUnload { library: BOGUS }),
            CUresult::INVALID_HANDLE,
        );
        // A context that is not one is CUDA_ERROR_INVALID_CONTEXT, as the driver documents.
        expect!(
            ctx,
            ApiCall::cuCtxSynchronize_v2(args::cuCtxSynchronize_v2 { ctx: BOGUS }),
            CUresult::INVALID_CONTEXT,
        );
        expect!(
            ctx,
            ApiCall::cuCtxDestroy_v2(args::cuCtxDestroy_v2 { ctx: BOGUS }),
            CUresult::INVALID_CONTEXT,
        );
        // ... also as the request's current context; the session's own context still works after.
        expect!(
            BOGUS,
            ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {}),
            CUresult::INVALID_CONTEXT,
        );
        expect!(
            ctx,
            ApiCall::cuCtxSynchronize_v2(args::cuCtxSynchronize_v2 { ctx: 0 }),
            CUresult::SUCCESS,
        );
        // Hand-written calls: module, kernel, function and stream arguments.
        let r = call(
            &mut s,
            ctx,
            Call::ModuleGetFunction {
                module: BOGUS,
                name: "add_one".into(),
            },
            true,
        )
        .unwrap();
        assert_eq!(r.result, CUresult::INVALID_HANDLE);
        let r = call(&mut s, ctx, Call::KernelGetFunction { kernel: BOGUS }, true).unwrap();
        assert_eq!(r.result, CUresult::INVALID_HANDLE);
        let r = call(
            &mut s,
            ctx,
            Call::MemcpyDtoH {
                src: ptr,
                len: 4,
                stream: Some(BOGUS),
                apart: None,
            },
            true,
        )
        .unwrap();
        assert_eq!(r.result, CUresult::INVALID_HANDLE);
        // A fire-and-forget launch of a bogus function: its error is the next sync call's.
        let bogus_launch = Launch {
            function: BOGUS,
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_mem_bytes: 0,
            stream: 0,
            params: params.clone(),
        };
        assert!(call(&mut s, ctx, Call::LaunchKernel(bogus_launch), false).is_none());
        expect!(
            ctx,
            ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {}),
            CUresult::INVALID_HANDLE,
        );
        // The stream sentinels are streams.
        for sentinel in [0, 1, 2] {
            expect!(
                ctx,
                ApiCall::cuStreamSynchronize(args::cuStreamSynchronize { stream: sentinel }),
                CUresult::SUCCESS,
            );
        }

        // Dead handles: a destroyed stream, and a function whose module was unloaded.
        call(
            &mut s,
            ctx,
            Call::Api(ApiCall::cuStreamDestroy_v2(args::cuStreamDestroy_v2 {
                stream,
            })),
            false,
        );
        expect!(
            ctx,
            ApiCall::cuStreamQuery(args::cuStreamQuery { stream }),
            CUresult::INVALID_HANDLE,
        );
        call(
            &mut s,
            ctx,
            Call::Api(ApiCall::cuModuleUnload(args::cuModuleUnload { module })),
            false,
        );
        expect!(
            ctx,
            ApiCall::cuFuncGetAttribute(args::cuFuncGetAttribute {
                value: (),
                attrib: 0,
                func: function,
            }),
            CUresult::INVALID_HANDLE,
        );
        let l = Launch {
            function,
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_mem_bytes: 0,
            stream: 0,
            params,
        };
        call(&mut s, ctx, Call::LaunchKernel(l), false);
        expect!(
            ctx,
            ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {}),
            CUresult::INVALID_HANDLE,
        );

        let r = call(&mut s, ctx, Call::Goodbye, true).unwrap();
        assert_eq!(r.result, CUresult::SUCCESS);
    }
}
