//! What executes a session's calls: NVIDIA's driver on a real GPU, or the GPU-less `emu` backend.
//!
//! [`ApiBackend`] has one method per call of the declaration list ([`gleam_protocol::cuda_api!`]), each taking the
//! call's [`args`] struct and returning its [`outs`] struct; every method defaults to
//! `CUDA_ERROR_NOT_SUPPORTED`, so a backend implements what it can. [`ApiBackend::api`] dispatches an
//! [`ApiCall`]. [`Backend`] adds the calls written by hand.

use gleam_protocol::api::{ApiCall, ApiReply, args, outs};
use gleam_protocol::copy::Copy3D;
use gleam_protocol::registry::{Died, Handles};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{DeviceInfo, FunctionInfo, Launch, LaunchAttr};

use crate::callbacks::CallbackPoint;
use crate::staging::{DeviceRead, HostPin, PinAnywhere};

macro_rules! api_backend {
    ($($mode:ident fn $name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {
        /// The listed driver calls, one method each (generated from the declaration list).
        #[allow(non_snake_case)]
        pub trait ApiBackend {
            $(
                #[doc = concat!("`", stringify!($name), "`.")]
                fn $name(&mut self, args: args::$name) -> Result<outs::$name, CUresult> {
                    let _ = args;
                    Err(CUresult::NOT_SUPPORTED)
                }
            )*

            /// Executes one listed call.
            fn api(&mut self, call: ApiCall) -> Result<ApiReply, CUresult> {
                match call {
                    $(ApiCall::$name(a) => self.$name(a).map(ApiReply::$name),)*
                }
            }
        }
    };
}

gleam_protocol::cuda_api!(api_backend);

/// A session's executor: the listed calls plus the ones with host buffers, images and launches.
///
/// Calls run in the session's order on one thread. Errors are CUDA's own codes; a sticky error (e.g.
/// `CUDA_ERROR_ILLEGAL_ADDRESS` from a kernel) must keep being returned by later calls, as a real context does.
/// The session engine has already checked every handle argument against the session's registry: a backend
/// only ever sees handles it gave out and that are still alive.
pub trait Backend: ApiBackend {
    /// Driver version (`cuDriverGetVersion`), backend name (`"cuda"`/`"emu"`) and the devices, once, at hello.
    fn describe(&mut self) -> Result<(i32, String, Vec<DeviceInfo>), CUresult>;
    /// Makes `ctx` current on the executing thread (0 = none), if it is not already.
    fn set_current_context(&mut self, ctx: u64) -> Result<(), CUresult>;
    /// `cuMemcpyHtoD_v2` (`stream: None`) or `cuMemcpyHtoDAsync_v2`.
    fn memcpy_htod(&mut self, dst: u64, data: &[u8], stream: Option<u64>) -> Result<(), CUresult>;
    /// Page-locks `pages` (page-aligned, whole pages) for faster copies from them to the device
    /// (`cuMemHostRegister`), until the returned pin is dropped, which must happen before the memory is
    /// freed and should happen on this thread; `None` where the backend cannot or need not (the memory
    /// stays pageable).
    fn pin_host(&mut self, pages: &mut [u8]) -> Option<HostPin> {
        let _ = pages;
        None
    }
    /// [`Backend::pin_host`] for the session's other threads, for the context current now (`None` where
    /// the backend cannot, or no context is current: staging is then locked on this thread, at its copy).
    fn pin_anywhere(&mut self) -> Option<PinAnywhere> {
        None
    }
    /// Called right after a copy on `stream` from page-locked memory ([`Backend::pin_host`]), which may
    /// still be queued or running when [`Backend::memcpy_htod`] returns: a read that waits until the
    /// device has run every copy queued on `stream` so far (`cuEventRecord`). `None` when nothing can be
    /// pending any more (the default: the backend's copies are done when they return; a backend that
    /// cannot make the fence waits for the stream instead).
    fn device_read(&mut self, stream: u64) -> Option<DeviceRead> {
        let _ = stream;
        None
    }
    /// `cuMemcpyDtoH_v2` or `cuMemcpyDtoHAsync_v2` (which must wait for the stream before returning data).
    fn memcpy_dtoh(
        &mut self,
        src: u64,
        len: usize,
        stream: Option<u64>,
    ) -> Result<Vec<u8>, CUresult>;
    /// `cuModuleLoadData` of a PTX, cubin or fatbin image.
    fn module_load(&mut self, image: &[u8]) -> Result<u64, CUresult>;
    /// `cuModuleGetFunction`, plus the function's parameter layout and attributes.
    fn module_get_function(
        &mut self,
        module: u64,
        name: &str,
    ) -> Result<(u64, FunctionInfo), CUresult>;
    /// `cuLibraryLoadData`.
    fn library_load(&mut self, image: &[u8]) -> Result<u64, CUresult> {
        let _ = image;
        Err(CUresult::NOT_SUPPORTED)
    }
    /// `cuKernelGetFunction`, plus the layout and attributes.
    fn kernel_get_function(&mut self, kernel: u64) -> Result<(u64, FunctionInfo), CUresult> {
        let _ = kernel;
        Err(CUresult::NOT_SUPPORTED)
    }
    /// `cuLaunchKernel` with a packed parameter buffer.
    fn launch(&mut self, launch: &Launch) -> Result<(), CUresult>;
    /// `cuMemcpy2D`/`cuMemcpy3D` (`stream: None`) or their async forms, and the array copies, in the
    /// canonical form (the session engine checked handles, stream and sizes; the geometry is the
    /// backend's to check, with [`Copy3D::check`]). `host` holds a host source's packed bytes; the result
    /// is a host destination's packed bytes (empty for other destinations). With a stream and a host
    /// destination, the backend waits for the stream before returning the bytes.
    fn memcpy3d(
        &mut self,
        copy: &Copy3D,
        host: &[u8],
        stream: Option<u64>,
    ) -> Result<Vec<u8>, CUresult> {
        let _ = (copy, host, stream);
        Err(CUresult::NOT_SUPPORTED)
    }
    /// Stores `data` at `addr` of a mirrored allocation (the session engine checked that the range lies
    /// inside one), in request order and without waiting for any stream.
    fn mirror_write(&mut self, addr: u64, data: &[u8]) -> Result<(), CUresult> {
        let _ = (addr, data);
        Err(CUresult::NOT_SUPPORTED)
    }
    /// Loads `len` bytes at `addr` of a mirrored allocation (checked likewise), without waiting for any
    /// stream.
    fn mirror_read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>, CUresult> {
        let _ = (addr, len);
        Err(CUresult::NOT_SUPPORTED)
    }
    /// `cuLaunchKernelEx` with launch attributes. A backend that honours none of them runs a launch
    /// without attributes and refuses any other.
    fn launch_ex(&mut self, launch: &Launch, attrs: &[LaunchAttr]) -> Result<(), CUresult> {
        if attrs.is_empty() {
            self.launch(launch)
        } else {
            Err(CUresult::NOT_SUPPORTED)
        }
    }
    /// `cuLaunchHostFunc`/`cuStreamAddCallback`: places `point` in `stream` (checked by the session
    /// engine). When the stream gets there, the backend calls [`CallbackPoint::reached`] with the status
    /// the client's function gets (`CUDA_SUCCESS`, or the context's error), and holds the stream's later
    /// work until the client's function returned ([`CallbackPoint::wait_returned`] or
    /// [`CallbackPoint::on_returned`]). Other streams go on meanwhile.
    fn host_callback(&mut self, stream: u64, point: CallbackPoint) -> Result<(), CUresult> {
        let _ = (stream, point);
        Err(CUresult::NOT_SUPPORTED)
    }
    /// These handles died (destroyed, or with what was destroyed, by CUDA's rules): drop what is kept for
    /// them.
    fn forget(&mut self, died: &Died) {
        let _ = died;
    }
    /// The session is over: free everything it holds (memory, modules, streams, events, contexts);
    /// `handles` are the live ones.
    fn shutdown(&mut self, handles: &Handles);
}
