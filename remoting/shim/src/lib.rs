//! Gleam's `libcuda.so.1`: the CUDA driver API of NVIDIA's 580 driver, executed on a peer's GPU.
//!
//! Built as `libgleamcuda.so` (SONAME `libcuda.so.1`, only `cu*` symbols exported); `gleam run` puts it in
//! front of the program as `libcuda.so.1`, `libcuda.so` and `libcuda.so.13`. [`exports`] generates one C
//! export per entry point of the declaration list (`gleam-protocol`'s `driver-api.list`), each a
//! [`guard`]ed call of:
//!
//! * a **forwarder** ([`forward`], generated): marshals the arguments, checks handles locally
//!   ([`handles`]), sends the call; `sync` ones wait for the reply, `deferred` ones are fire-and-forget;
//! * a **hand-written** function of the same name ([`hand`]): answered locally from what the server said
//!   at connect ([`device`], [`context`], [`proc`], [`export_table`], [`occupancy`]), or forwarded with
//!   judgement ([`memory`]: copies and the allocation table; [`module`]: images, functions and launches;
//!   [`hostmem`] and [`managed`]: managed and mapped host memory, mirrored; [`arrays`]: 2D/3D copies);
//! * or **not supported yet** (`CUDA_ERROR_NOT_SUPPORTED`, the name logged once).
//!
//! The session itself ([`state::Session`], a [`gleam_client::Client`]) is opened by `cuInit` from
//! `GLEAM_PEER` and `GLEAM_CONFIG_DIR`. No panic crosses the C ABI ([`guard`]); after the library's
//! destructor ran every call returns `CUDA_ERROR_DEINITIALIZED`; a `fork()`ed child is refused, as NVIDIA's
//! driver refuses it.

// The CUDA names (functions and their parameters) are kept as NVIDIA spells them.
#![allow(non_snake_case)]
// Every export is `unsafe extern "C"` with the C contract of the CUDA function it implements.
#![allow(clippy::missing_safety_doc)]

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};

use gleam_protocol::types::CUresult;

pub mod arrays;
pub mod callbacks;
pub mod capture;
pub mod context;
pub mod device;
pub mod export_table;
pub mod exports;
pub mod fills;
pub mod forward;
pub mod handles;
pub mod hostmem;
pub mod images;
pub mod integrity;
pub mod library;
pub mod managed;
pub mod memops;
pub mod memory;
pub mod module;
pub mod occupancy;
pub mod primary;
pub mod proc;
pub mod state;
pub mod tensor;
pub mod trace;

/// Every hand-written export (`local`, `hand` and `by-hand` in the declaration list), by its CUDA name.
pub mod hand {
    pub use crate::arrays::{
        cuMemcpy2D_v2, cuMemcpy2DAsync_v2, cuMemcpy2DUnaligned_v2, cuMemcpy3D_v2,
        cuMemcpy3DAsync_v2, cuMemcpyAtoA_v2, cuMemcpyAtoD_v2, cuMemcpyAtoH_v2,
        cuMemcpyAtoHAsync_v2, cuMemcpyDtoA_v2, cuMemcpyHtoA_v2, cuMemcpyHtoAAsync_v2,
    };
    pub use crate::callbacks::{cuLaunchHostFunc, cuStreamAddCallback};
    pub use crate::capture::{
        cuGraphGetEdges, cuGraphGetEdges_v2, cuGraphGetNodes, cuGraphGetRootNodes,
        cuGraphInstantiate_v2, cuGraphInstantiateWithFlags, cuGraphLaunch, cuStreamBeginCapture,
        cuStreamBeginCapture_v2, cuStreamEndCapture, cuStreamGetCaptureInfo_v2,
        cuStreamGetCaptureInfo_v3, cuStreamIsCapturing,
    };
    pub use crate::context::{
        cuCtxAttach, cuCtxCreate, cuCtxCreate_v2, cuCtxCreate_v3, cuCtxCreate_v4, cuCtxDestroy_v2,
        cuCtxDetach, cuCtxGetCurrent, cuCtxGetDevice, cuCtxGetDevice_v2, cuCtxGetLimit,
        cuCtxGetStreamPriorityRange, cuCtxPopCurrent, cuCtxPopCurrent_v2, cuCtxPushCurrent,
        cuCtxPushCurrent_v2, cuCtxSetCurrent, cuCtxSetLimit, cuDevicePrimaryCtxRetain,
    };
    pub use crate::device::{
        cuDeviceComputeCapability, cuDeviceGet, cuDeviceGetAttribute, cuDeviceGetByPCIBusId,
        cuDeviceGetCount, cuDeviceGetName, cuDeviceGetPCIBusId, cuDeviceGetProperties,
        cuDeviceGetUuid, cuDeviceGetUuid_v2, cuDeviceTotalMem_v2, cuDriverGetVersion,
        cuGetErrorName, cuGetErrorString, cuInit,
    };
    pub use crate::export_table::cuGetExportTable;
    pub use crate::fills::{
        cuMemsetD2D8_v2, cuMemsetD2D8Async, cuMemsetD2D16_v2, cuMemsetD2D16Async, cuMemsetD2D32_v2,
        cuMemsetD2D32Async,
    };
    pub use crate::hostmem::{
        cuMemAdvise, cuMemAdvise_v2, cuMemAllocHost_v2, cuMemAllocManaged, cuMemFreeHost,
        cuMemHostAlloc, cuMemHostGetDevicePointer_v2, cuMemHostGetFlags, cuMemHostRegister,
        cuMemHostRegister_v2, cuMemHostUnregister, cuMemPrefetchAsync, cuMemPrefetchAsync_v2,
        cuMemRangeGetAttribute, cuMemRangeGetAttributes,
    };
    pub use crate::library::{
        cuKernelGetAttribute, cuKernelGetLibrary, cuKernelGetName, cuKernelGetParamInfo,
        cuKernelSetAttribute, cuLibraryEnumerateKernels, cuLibraryGetKernel,
        cuLibraryGetKernelCount, cuLibraryGetModule, cuLibraryLoadData, cuLibraryLoadFromFile,
        cuLibraryUnload,
    };
    pub use crate::memops::{
        cuStreamBatchMemOp, cuStreamBatchMemOp_ptsz, cuStreamBatchMemOp_v2, cuStreamWaitValue32,
        cuStreamWaitValue32_ptsz, cuStreamWaitValue32_v2, cuStreamWaitValue64,
        cuStreamWaitValue64_ptsz, cuStreamWaitValue64_v2, cuStreamWriteValue32,
        cuStreamWriteValue32_ptsz, cuStreamWriteValue32_v2, cuStreamWriteValue64,
        cuStreamWriteValue64_ptsz, cuStreamWriteValue64_v2,
    };
    pub use crate::memory::{
        cuDeviceSetMemPool, cuMemAddressFree, cuMemAddressReserve, cuMemAlloc_v2, cuMemAllocAsync,
        cuMemAllocFromPoolAsync, cuMemAllocPitch_v2, cuMemFree_v2, cuMemFreeAsync,
        cuMemGetAddressRange_v2, cuMemMap, cuMemPoolDestroy, cuMemPoolGetAttribute,
        cuMemPoolSetAccess, cuMemPoolSetAttribute, cuMemSetAccess, cuMemSetMemPool, cuMemUnmap,
        cuMemcpy, cuMemcpyAsync, cuMemcpyDtoH_v2, cuMemcpyDtoHAsync_v2, cuMemcpyHtoD_v2,
        cuMemcpyHtoDAsync_v2, cuPointerGetAttribute, cuPointerGetAttributes,
        cuStreamAttachMemAsync, cuStreamSynchronize,
    };
    pub use crate::module::{
        cuFuncGetAttribute, cuFuncGetModule, cuFuncGetName, cuFuncGetParamInfo, cuFuncIsLoaded,
        cuFuncLoad, cuFuncSetAttribute, cuKernelGetFunction, cuLaunchCooperativeKernel,
        cuLaunchKernel, cuLaunchKernelEx, cuLaunchKernelEx_ptsz, cuModuleEnumerateFunctions,
        cuModuleGetFunction, cuModuleGetFunctionCount, cuModuleGetLoadingMode, cuModuleLoad,
        cuModuleLoadData, cuModuleLoadDataEx, cuModuleLoadFatBinary,
        cuOccupancyMaxActiveBlocksPerMultiprocessor,
        cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags,
    };
    pub use crate::occupancy::{
        cuOccupancyMaxPotentialBlockSize, cuOccupancyMaxPotentialBlockSizeWithFlags,
    };
    pub use crate::primary::{cuDevicePrimaryCtxGetState, cuDevicePrimaryCtxSetFlags_v2};
    pub use crate::proc::{cuGetProcAddress, cuGetProcAddress_v2};
    pub use crate::tensor::{
        cuTensorMapEncodeIm2col, cuTensorMapEncodeIm2colWide, cuTensorMapEncodeTiled,
    };
}

/// The server refuses to load a library exporting this symbol as "the real driver": finding it means the
/// server inherited a client's `LD_LIBRARY_PATH` and would forward to itself.
#[unsafe(no_mangle)]
pub static gleam_shim_marker: u32 = 0x474c_4d31;

/// Set by the library's destructor: from then on every call returns `CUDA_ERROR_DEINITIALIZED`.
static DEINITIALIZED: AtomicBool = AtomicBool::new(false);

/// Runs one export's body: refuses calls after teardown, and turns a panic into `CUDA_ERROR_UNKNOWN`
/// (logged) instead of unwinding into C. With `gleam trace` on, counts the call ([`trace`]).
pub(crate) fn guard(name: &'static str, body: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    if DEINITIALIZED.load(Ordering::Acquire) {
        return CUresult::DEINITIALIZED;
    }
    let tracing_on = trace::enabled();
    if tracing_on {
        trace::begin();
    }
    let result = match catch_unwind(AssertUnwindSafe(body)) {
        // `GLEAM_LOG=gleamcuda=trace` lists every call in order with its result: what a new workload
        // does just before it fails. Logging itself may panic at exit (thread-locals already gone), so it
        // stays inside the guard too.
        Ok(Ok(())) => {
            let _ = catch_unwind(|| tracing::trace!(call = name, "ok"));
            CUresult::SUCCESS
        }
        Ok(Err(err)) => {
            let _ = catch_unwind(|| tracing::trace!(call = name, %err, "call failed"));
            err
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(std::string::ToString::to_string)
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            let _ = catch_unwind(AssertUnwindSafe(|| {
                tracing::error!(call = name, panic = %what, "internal error in Gleam's libcuda (a bug)");
            }));
            CUresult::UNKNOWN
        }
    };
    if tracing_on {
        trace::end(name, result);
    }
    result
}

thread_local! {
    /// Destroyed with the thread's other thread-local storage: after that, logging (which uses
    /// thread-local buffers) must not run. The CUDA runtime tears down from `exit()`, after the main
    /// thread's thread-local storage is gone.
    static ALIVE: Alive = const { Alive };
}

struct Alive;

impl Drop for Alive {
    fn drop(&mut self) {}
}

/// Whether this thread may log: its thread-local storage is alive and the library is not torn down.
/// Every log line goes through this check (a filter of the subscriber [`state::init_logging`] installs).
pub(crate) fn logging_safe() -> bool {
    !DEINITIALIZED.load(Ordering::Acquire) && ALIVE.try_with(|_| ()).is_ok()
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
    // From here on nothing logs: thread-local storage may be gone already.
    DEINITIALIZED.store(true, Ordering::Release);
    // Never unwind out of a destructor: a failure to say goodbye only costs the server an idle timeout.
    let _ = catch_unwind(state::shutdown);
    let _ = catch_unwind(trace::write_report);
}

#[used]
#[unsafe(link_section = ".fini_array")]
static ON_UNLOAD: extern "C" fn() = on_unload;

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use gleam_protocol::api::EXPORTS;

    /// The declaration list names exactly the exports of NVIDIA's 580 driver.
    #[test]
    fn every_driver_export_is_declared_once() {
        let listed: BTreeSet<&str> = EXPORTS.iter().map(|(name, _)| *name).collect();
        assert_eq!(listed.len(), EXPORTS.len(), "a name is listed twice");
        let driver: BTreeSet<&str> = include_str!("../libcuda-580-exports.txt")
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let missing: Vec<_> = driver.difference(&listed).collect();
        let extra: Vec<_> = listed.difference(&driver).collect();
        assert!(missing.is_empty(), "not in driver-api.list: {missing:?}");
        assert!(extra.is_empty(), "not exports of the 580 driver: {extra:?}");
        for (name, _) in EXPORTS {
            assert!(
                super::exports::address(name).is_some(),
                "{name} is not exported"
            );
        }
    }
}
