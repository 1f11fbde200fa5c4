//! Modules, functions and kernel launches.
//!
//! A module image is sized on the client ([`gleam_fatbin`]), reduced to what the serving device runs and
//! loaded on the peer by content ([`images`]). The client keeps each module's image, from which it reads
//! every kernel's parameter layout: a launch copies exactly that many bytes from `kernelParams`, whatever
//! the peer says; the [`FunctionInfo`] the peer returns with a function is only a cross-check (a mismatch is
//! refused and logged) and the source of its attributes, cached so that `cuFuncGetAttribute` needs no round
//! trip. A launch is validated locally (handle, dimensions against the device, dynamic shared memory) and
//! sent fire-and-forget. Library kernels (`CUkernel`, [`library`]) launch the same way.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::os::unix::ffi::OsStrExt;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use gleam_fatbin as fatbin;
use gleam_protocol::api::LaunchConfigValue;
use gleam_protocol::registry::{Kind, Owner};
use gleam_protocol::types::{
    CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE, CU_LAUNCH_PARAM_END, CUfunction,
    CUkernel, CUmodule, CUresult, CUstream,
};
use gleam_protocol::wire::{Call, FunctionInfo, Launch, LaunchAttr, ParamSlot, Reply};

use crate::images::{self, Image, Target};
use crate::{context, forward, handles, library, put, state};

/// What the client knows of a launchable handle (a function, or a client-side kernel).
#[derive(Clone, Debug)]
struct Launchable {
    /// The handle the peer knows (a function, or a kernel in its place).
    server: u64,
    /// The parameter layout read on the client from the image (`Err`: the image could not be read, so
    /// `kernelParams` cannot be packed).
    params: Result<Arc<Vec<ParamSlot>>, CUresult>,
    /// `cuFuncGetAttribute` values, by attribute id (empty: ask the peer).
    attributes: Vec<i32>,
    /// The kernel's name.
    name: Option<Arc<CString>>,
    /// The module it comes from (0: a kernel of a library).
    module: u64,
}

/// An occupancy question: (function or kernel, block size, dynamic shared memory, flags).
type OccupancyKey = (u64, i32, usize, u32);

#[derive(Default)]
struct Caches {
    /// `cuOccupancyMaxActiveBlocksPerMultiprocessor(WithFlags)` answers: a pure function of the question
    /// and of the function's attributes (when those are set, its answers are dropped).
    occupancy: HashMap<OccupancyKey, i32>,
    /// Every launchable handle seen, by the handle the application holds.
    functions: HashMap<u64, Arc<Launchable>>,
    /// The image of every module loaded or obtained from a library, by module handle.
    modules: HashMap<u64, Arc<Image>>,
    /// `cuKernelGetFunction` answers, by (client kernel, context): the driver gives the same function
    /// each time (PyTorch asks 585 times in a ResNet-50 run).
    kernel_functions: HashMap<(u64, u64), u64>,
}

static CACHES: LazyLock<Mutex<Caches>> = LazyLock::new(Mutex::default);

fn caches() -> MutexGuard<'static, Caches> {
    CACHES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

// CUfunction_attribute ids used for local answers and validation.
const FUNC_MAX_THREADS_PER_BLOCK: usize = 0;
const FUNC_MAX_DYNAMIC_SHARED: usize = 8;
/// `CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`.
const FUNC_CARVEOUT: i32 = 9;
/// `CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH` .. `CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE`:
/// the cluster settings (width, height, depth, non-portable sizes, scheduling policy).
const FUNC_CLUSTER_SETTINGS: std::ops::RangeInclusive<i32> = 11..=15;

/// Whether `cuFuncSetAttribute` may change attribute `attrib`: CUDA lets an application set the dynamic
/// shared memory limit, the carveout and the cluster settings; every other attribute is read-only.
fn settable(attrib: i32) -> bool {
    attrib == FUNC_MAX_DYNAMIC_SHARED as i32
        || attrib == FUNC_CARVEOUT
        || FUNC_CLUSTER_SETTINGS.contains(&attrib)
}
// Device attribute ids of the launch limits.
const MAX_THREADS_PER_BLOCK: u32 = 1;
const MAX_BLOCK_DIM_X: u32 = 2;
const MAX_GRID_DIM_X: u32 = 5;
/// The largest `extra`/`kernelParams` buffer CUDA accepts (CUDA 12.1+, Volta+).
const MAX_PARAM_BYTES: usize = fatbin::kernels::MAX_PARAM_BYTES as usize;
/// `CU_FUNCTION_LOADING_STATE_LOADED`.
const FUNCTION_LOADED: u32 = 1;

/// A synchronous call in the current context: the server's reply, once its result is a success.
fn call(call: Call) -> Result<Reply, CUresult> {
    let session = state::session()?;
    let answer = session
        .client
        .call_with(context::current(), call, &[])
        .map_err(state::lost)?;
    answer.result.result()?;
    Ok(answer.reply)
}

/// The bytes of the image at `image` (a fatbin wrapper is followed to its fatbin), sized on the client.
///
/// # Safety
/// `image` is a module image as `cuModuleLoadData` requires; the slice is used before the call returns.
pub(crate) unsafe fn image_bytes<'a>(image: *const c_void) -> Result<&'a [u8], CUresult> {
    // SAFETY: the application passed a module image, as cuModuleLoadData requires; its extent is what
    // its headers (or the PTX text's NUL) say.
    unsafe {
        let start = fatbin::unwrap_fatbin_wrapper(image).map_err(bad_image)?;
        let len = fatbin::image_size(start).map_err(bad_image)?;
        Ok(std::slice::from_raw_parts(start.cast::<u8>(), len))
    }
}

fn bad_image(err: fatbin::ImageError) -> CUresult {
    tracing::warn!(%err, "cannot load module image");
    match err {
        fatbin::ImageError::Null => CUresult::INVALID_VALUE,
        _ => CUresult::INVALID_IMAGE,
    }
}

/// The contents of the file at `path`.
///
/// # Safety
/// `path` is NULL or NUL-terminated.
pub(crate) unsafe fn read_file(path: *const c_char) -> Result<Vec<u8>, CUresult> {
    if path.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: a NUL-terminated path, as the C API requires.
    let path = unsafe { CStr::from_ptr(path) };
    let path = std::path::Path::new(std::ffi::OsStr::from_bytes(path.to_bytes()));
    std::fs::read(path).map_err(|err| {
        tracing::debug!(path = %path.display(), %err, "cannot read module file");
        CUresult::FILE_NOT_FOUND
    })
}

/// Loads `original` (one image, exactly its extent) as a module of the current context.
fn load_module(original: &[u8]) -> Result<u64, CUresult> {
    let image = Arc::new(Image::for_peer(original, Target::of_session()?)?);
    let handle = images::load(&image, false)?;
    handles::record(Kind::Module, handle, &Owner::in_context(context::current()));
    remember_image(handle, image);
    Ok(handle)
}

/// `module` holds `image` (a loaded module, or a library's module).
pub(crate) fn remember_image(module: u64, image: Arc<Image>) {
    caches().modules.insert(module, image);
}

/// `cuModuleLoadData` and its variants.
unsafe fn load_image(module: *mut CUmodule, image: *const c_void) -> Result<(), CUresult> {
    if module.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // No session: NOT_INITIALIZED, before the image is read.
    state::session()?;
    // SAFETY: the application passed a module image and an out-pointer, as cuModuleLoadData requires.
    unsafe {
        let bytes = image_bytes(image)?;
        put(module, load_module(bytes)? as CUmodule)
    }
}

/// Dead handles' layouts and images are dropped (a handle value may be reused later).
pub fn forget_functions(died: &[(Kind, u64)]) {
    let mut c = caches();
    for (kind, handle) in died {
        match kind {
            Kind::Function | Kind::Kernel => {
                c.functions.remove(handle);
                c.occupancy.retain(|k, _| k.0 != *handle);
                c.kernel_functions.retain(|_, f| f != handle);
            }
            Kind::Module => {
                c.modules.remove(handle);
            }
            _ => {}
        }
    }
}

/// Client kernels of an unloaded library.
pub fn forget_kernels(kernels: &[u64]) {
    let mut c = caches();
    c.kernel_functions.retain(|(k, _), _| !kernels.contains(k));
    for k in kernels {
        c.functions.remove(k);
        c.occupancy.retain(|key, _| key.0 != *k);
    }
}

/// A kernel's attributes were set: what was cached of them is asked again.
pub fn attributes_changed(handle: u64) {
    let mut c = caches();
    if let Some(f) = c.functions.get_mut(&handle) {
        Arc::make_mut(f).attributes.clear();
    }
    c.occupancy.retain(|k, _| k.0 != handle);
}

/// Occupancy, asked of the peer once per question (PyTorch asks it before launches: 340 times in a
/// ResNet-50 run).
fn occupancy(
    num_blocks: *mut i32,
    func: CUfunction,
    block_size: i32,
    dynamic_smem: usize,
    flags: u32,
) -> Result<(), CUresult> {
    if num_blocks.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let key = (func as u64, block_size, dynamic_smem, flags);
    let known = caches().occupancy.get(&key).copied();
    let n = match known {
        Some(n) => {
            if !library::is_client_kernel(key.0) {
                handles::check(Kind::Function, key.0)?;
            }
            n
        }
        None => {
            let mut n = 0;
            // SAFETY: a valid out-pointer; the function is translated and checked on the way.
            unsafe {
                forward::cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
                    &raw mut n,
                    func,
                    block_size,
                    dynamic_smem,
                    flags,
                )
            }?;
            caches().occupancy.insert(key, n);
            n
        }
    };
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(num_blocks, n) }
}

pub unsafe fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
    num_blocks: *mut i32,
    func: CUfunction,
    block_size: i32,
    dynamic_smem: usize,
) -> Result<(), CUresult> {
    // CU_OCCUPANCY_DEFAULT.
    occupancy(num_blocks, func, block_size, dynamic_smem, 0)
}

pub unsafe fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
    num_blocks: *mut i32,
    func: CUfunction,
    block_size: i32,
    dynamic_smem: usize,
    flags: u32,
) -> Result<(), CUresult> {
    occupancy(num_blocks, func, block_size, dynamic_smem, flags)
}

/// Refuses a function whose parameter layout on the peer differs from the one read on the client: either
/// the peer is lying, or the two read different code. Neither may be launched.
fn cross_check(name: &str, client: &[ParamSlot], server: &FunctionInfo) -> Result<(), CUresult> {
    // A driver without cuFuncGetParamInfo (before 12.4) reports no layout: nothing to compare.
    if server.params.is_empty() || server.params == client {
        return Ok(());
    }
    tracing::error!(
        kernel = name,
        client = ?client,
        peer = ?server.params,
        "the serving peer reports another parameter layout than the kernel's code: refused"
    );
    Err(CUresult::INVALID_IMAGE)
}

/// The client-side layout of kernel `name` in `image`.
fn layout_in(image: Option<&Image>, name: &str) -> Result<Arc<Vec<ParamSlot>>, CUresult> {
    let image = image.ok_or(CUresult::INVALID_IMAGE)?;
    let kernel = image.kernels()?.get(name).ok_or(CUresult::NOT_FOUND)?;
    Ok(Arc::new(
        kernel
            .params
            .iter()
            .map(|p| ParamSlot {
                offset: p.offset,
                size: p.size,
            })
            .collect(),
    ))
}

/// What the client knows to launch `handle` (a function, or a client kernel, resolved on the peer here).
fn launchable(handle: u64) -> Result<Arc<Launchable>, CUresult> {
    if let Some(f) = caches().functions.get(&handle).cloned() {
        if !library::is_client_kernel(handle) {
            // A dead or made-up handle is refused whatever the cache still holds.
            handles::check(Kind::Function, handle)?;
        }
        return Ok(f);
    }
    match library::launchable_kernel(handle as CUfunction) {
        Some(resolved) => {
            let (params, server) = resolved?;
            let k = library::kernel(handle)?;
            let entry = Arc::new(Launchable {
                server,
                params: Ok(params),
                attributes: Vec::new(),
                name: Some(Arc::new(k.name().to_owned())),
                module: 0,
            });
            caches().functions.insert(handle, entry.clone());
            Ok(entry)
        }
        None => {
            handles::check(Kind::Function, handle)?;
            // A kernel of the peer (never from a client library) used as a function: its layout is
            // unknown here, so only `extra` launches can be packed.
            Ok(Arc::new(Launchable {
                server: handle,
                params: Err(CUresult::INVALID_HANDLE),
                attributes: Vec::new(),
                name: None,
                module: 0,
            }))
        }
    }
}

/// `CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK` of a launchable handle.
pub(crate) fn max_threads_per_block(func: CUfunction) -> Result<i32, CUresult> {
    let mut max = 0;
    // SAFETY: a valid out-pointer.
    unsafe { cuFuncGetAttribute(&raw mut max, FUNC_MAX_THREADS_PER_BLOCK as i32, func) }?;
    Ok(max)
}

/// Packs `kernelParams` per the client's layout, or takes `extra`'s buffer.
///
/// # Safety
/// `params` and `extra` are what the application passed to a launch call.
unsafe fn pack_params(
    f: &Launchable,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<Vec<u8>, CUresult> {
    match (params.is_null(), extra.is_null()) {
        (false, false) => Err(CUresult::INVALID_VALUE),
        (false, true) => {
            let layout = f.params.as_ref().map_err(|_| {
                tracing::error!(
                    kernel = ?f.name,
                    "launch refused: the kernel's parameter layout could not be read from its image"
                );
                CUresult::INVALID_VALUE
            })?;
            let mut total = 0usize;
            for slot in layout.iter() {
                let end = (slot.offset as usize)
                    .checked_add(slot.size as usize)
                    .ok_or(CUresult::INVALID_VALUE)?;
                total = total.max(end);
            }
            if total > MAX_PARAM_BYTES {
                return Err(CUresult::INVALID_VALUE);
            }
            let mut buf = vec![0u8; total];
            for (i, slot) in layout.iter().enumerate() {
                // SAFETY: kernelParams holds one pointer per parameter of the kernel.
                let value = unsafe { *params.add(i) };
                if value.is_null() {
                    return Err(CUresult::INVALID_VALUE);
                }
                let (offset, size) = (slot.offset as usize, slot.size as usize);
                // SAFETY: each points to a value of the parameter's size (its declared type's).
                let bytes = unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) };
                buf[offset..offset + size].copy_from_slice(bytes);
            }
            Ok(buf)
        }
        (true, false) => {
            let (mut buffer, mut size) = (std::ptr::null::<u8>(), None);
            // The list is key/value pairs up to END; a handful of entries at most.
            for i in (0..16).step_by(2) {
                // SAFETY: `extra` is an END-terminated key/value array.
                let key = unsafe { *extra.add(i) } as usize;
                match key {
                    CU_LAUNCH_PARAM_END => break,
                    // SAFETY: the value follows its key.
                    CU_LAUNCH_PARAM_BUFFER_POINTER => buffer = unsafe { *extra.add(i + 1) }.cast(),
                    CU_LAUNCH_PARAM_BUFFER_SIZE => {
                        // SAFETY: BUFFER_SIZE's value points to a size_t.
                        let p = unsafe { *extra.add(i + 1) }.cast::<usize>();
                        if p.is_null() {
                            return Err(CUresult::INVALID_VALUE);
                        }
                        // SAFETY: non-NULL, and BUFFER_SIZE's value points to a size_t.
                        size = Some(unsafe { p.read_unaligned() });
                    }
                    _ => return Err(CUresult::INVALID_VALUE),
                }
            }
            match (buffer.is_null(), size) {
                (false, Some(size)) if size <= MAX_PARAM_BYTES => {
                    // SAFETY: the buffer holds `size` bytes.
                    Ok(unsafe { std::slice::from_raw_parts(buffer, size) }.to_vec())
                }
                _ => Err(CUresult::INVALID_VALUE),
            }
        }
        (true, true) => match &f.params {
            Ok(layout) if layout.is_empty() => Ok(Vec::new()),
            _ => Err(CUresult::INVALID_VALUE),
        },
    }
}

/// A launch as the application described it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LaunchArgs {
    pub f: CUfunction,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub stream: CUstream,
    pub params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
}

/// Validates a launch against the function's and the device's limits and packs it.
///
/// # Safety
/// `a.params` / `a.extra` are what the application passed.
pub(crate) unsafe fn prepare(a: &LaunchArgs) -> Result<Launch, CUresult> {
    let f = launchable(a.f as u64)?;
    handles::check(Kind::Stream, a.stream as u64)?;
    // NVIDIA's driver answers an impossible configuration (a zero dimension, too many threads, a dimension
    // over its limit) with CUDA_ERROR_INVALID_VALUE, to driver-API programs and to the CUDA runtime alike
    // (measured on the H200 with examples/cuda/launch_errors.cu: the runtime reports cudaErrorInvalidValue).
    let config = CUresult::INVALID_VALUE;
    if a.grid.contains(&0) || a.block.contains(&0) {
        return Err(config);
    }
    // Three u32 dimensions can overflow a u64 product (fuzz target shim: a debug build panicked).
    let threads = a
        .block
        .iter()
        .fold(1u64, |n, &d| n.saturating_mul(u64::from(d)));
    let dev = context::device_of(0).unwrap_or(0);
    // The serving device's own limits (none of these attributes is overridden here), looked up once.
    let info = state::device(dev).ok();
    let device_limit = |id: u32| {
        info.and_then(|info| info.attributes.get(id as usize).copied())
            .filter(|&v| v > 0)
    };
    if device_limit(MAX_THREADS_PER_BLOCK).is_some_and(|max| threads > max as u64) {
        return Err(config);
    }
    for axis in 0..3 {
        if device_limit(MAX_BLOCK_DIM_X + axis as u32).is_some_and(|m| a.block[axis] > m as u32)
            || device_limit(MAX_GRID_DIM_X + axis as u32).is_some_and(|m| a.grid[axis] > m as u32)
        {
            return Err(config);
        }
    }
    let attr = |i: usize| f.attributes.get(i).copied().filter(|&v| v > 0);
    // More threads than this kernel can run (its registers, `__launch_bounds__`): "too many resources
    // requested for launch".
    if attr(FUNC_MAX_THREADS_PER_BLOCK).is_some_and(|max| threads > max as u64) {
        return Err(CUresult::LAUNCH_OUT_OF_RESOURCES);
    }
    if attr(FUNC_MAX_DYNAMIC_SHARED).is_some_and(|max| u64::from(a.shared_mem_bytes) > max as u64) {
        return Err(config);
    }
    // SAFETY: forwarded.
    let params = unsafe { pack_params(&f, a.params, a.extra)? };
    Ok(Launch {
        function: f.server,
        grid: a.grid,
        block: a.block,
        shared_mem_bytes: a.shared_mem_bytes,
        stream: a.stream as u64,
        params,
    })
}

/// Validates, packs and sends a launch (fire-and-forget), with its launch attributes if any.
///
/// # Safety
/// As [`prepare`].
unsafe fn launch(a: &LaunchArgs, attrs: Vec<LaunchAttr>) -> Result<(), CUresult> {
    let session = state::session()?;
    // SAFETY: forwarded.
    let launch = unsafe { prepare(a)? };
    for event in attrs.iter().filter_map(LaunchAttr::event) {
        handles::check(Kind::Event, event)?;
    }
    let call = if attrs.is_empty() {
        Call::LaunchKernel(launch)
    } else {
        Call::LaunchKernelEx { launch, attrs }
    };
    // Mirrored memory the host wrote reaches the device before the kernel runs.
    let sent = crate::managed::around("cuLaunchKernel", || {
        session
            .client
            .send(context::current(), call)
            .map_err(state::lost)?
            .result()
    });
    context::launched_one(a.f as u64);
    sent
}

/// `cuLaunchKernelEx`: the configuration's attributes go to the serving driver as given (cluster
/// dimensions, cooperative, priority, programmatic launch...); it judges them.
unsafe fn launch_ex(
    config: *const c_void,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    per_thread_stream: bool,
) -> Result<(), CUresult> {
    // SAFETY: a valid CUlaunchConfig, as the C API requires.
    let c = unsafe { LaunchConfigValue::read(config)? };
    let stream = c.stream as CUstream;
    let stream = if per_thread_stream {
        gleam_protocol::api::per_thread(stream)
    } else {
        stream
    };
    // `CU_LAUNCH_ATTRIBUTE_IGNORE` entries say nothing.
    let attrs = c.attrs.into_iter().filter(|a| a.id != 0).collect();
    // SAFETY: forwarded.
    unsafe {
        launch(
            &LaunchArgs {
                f,
                grid: c.grid,
                block: c.block,
                shared_mem_bytes: c.shared_mem_bytes,
                stream,
                params,
                extra,
            },
            attrs,
        )
    }
}

/// Writes parameter `index` of `params` (`CUDA_ERROR_INVALID_VALUE` past the last).
///
/// # Safety
/// `offset` and `size` are NULL or valid for writes.
pub(crate) unsafe fn param_info(
    params: &[ParamSlot],
    index: usize,
    offset: *mut usize,
    size: *mut usize,
) -> Result<(), CUresult> {
    let p = params.get(index).ok_or(CUresult::INVALID_VALUE)?;
    if offset.is_null() && size.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the caller's out-pointers, each written only if non-NULL.
    unsafe {
        if !offset.is_null() {
            offset.write_unaligned(p.offset as usize);
        }
        if !size.is_null() {
            size.write_unaligned(p.size as usize);
        }
    }
    Ok(())
}

pub unsafe fn cuModuleLoad(module: *mut CUmodule, fname: *const c_char) -> Result<(), CUresult> {
    if module.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::session()?;
    // SAFETY: a NUL-terminated path, as the C API requires.
    let bytes = unsafe { read_file(fname)? };
    let extent = fatbin::image_size_in(&bytes).map_err(bad_image)?;
    let handle = load_module(&bytes[..extent])?;
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(module, handle as CUmodule) }
}

pub unsafe fn cuModuleLoadData(
    module: *mut CUmodule,
    image: *const c_void,
) -> Result<(), CUresult> {
    // SAFETY: the application's image and out-pointer, as the C API requires.
    unsafe { load_image(module, image) }
}

pub unsafe fn cuModuleLoadDataEx(
    module: *mut CUmodule,
    image: *const c_void,
    num_options: u32,
    options: *mut u32,
    values: *mut *mut c_void,
) -> Result<(), CUresult> {
    // JIT options (log buffers, optimisation level) apply on the server's side; none is needed to
    // load correctly, so they are not forwarded.
    let _ = (num_options, options, values);
    // SAFETY: as above.
    unsafe { load_image(module, image) }
}

pub unsafe fn cuModuleLoadFatBinary(
    module: *mut CUmodule,
    fat_cubin: *const c_void,
) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe { load_image(module, fat_cubin) }
}

/// Records a function the peer returned, with the client's layout for it (cross-checked).
fn record_function(
    handle: u64,
    info: FunctionInfo,
    params: Result<Arc<Vec<ParamSlot>>, CUresult>,
    name: &str,
    module: u64,
) -> Result<(), CUresult> {
    if let Ok(layout) = &params {
        cross_check(name, layout, &info)?;
    } else {
        tracing::error!(
            kernel = name,
            "the kernel's parameter layout cannot be read from its image: it can be launched only with `extra`"
        );
    }
    let entry = Launchable {
        server: handle,
        params,
        attributes: info.attributes,
        name: CString::new(name).ok().map(Arc::new),
        module,
    };
    caches().functions.insert(handle, Arc::new(entry));
    Ok(())
}

pub unsafe fn cuModuleGetFunction(
    hfunc: *mut CUfunction,
    hmod: CUmodule,
    name: *const c_char,
) -> Result<(), CUresult> {
    if hfunc.is_null() || name.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::session()?;
    let module = hmod as u64;
    handles::check(Kind::Module, module)?;
    // SAFETY: a NUL-terminated name, as the C API requires.
    let name = unsafe { CStr::from_ptr(name) };
    let name = name.to_str().map_err(|_| CUresult::NOT_FOUND)?.to_owned();
    let image = caches().modules.get(&module).cloned();
    let params = layout_in(image.as_deref(), &name);
    if params == Err(CUresult::NOT_FOUND) {
        // The code the client holds has no such kernel: the driver's answer, without a round trip.
        return Err(CUresult::NOT_FOUND);
    }
    let reply = call(Call::ModuleGetFunction {
        module,
        name: name.clone(),
    })?;
    let Reply::Function { handle, info } = reply else {
        return Err(state::mismatch("cuModuleGetFunction", &reply));
    };
    let owner = Owner {
        ctx: handles::lock().module_context(module),
        module: Some(module),
        ..Owner::default()
    };
    handles::record(Kind::Function, handle, &owner);
    record_function(handle, info, params, &name, module)?;
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(hfunc, handle as CUfunction) }
}

/// The kernel names of module `hmod`, from its image.
fn module_kernels(hmod: CUmodule) -> Result<Vec<String>, CUresult> {
    state::session()?;
    handles::check(Kind::Module, hmod as u64)?;
    let image = caches()
        .modules
        .get(&(hmod as u64))
        .cloned()
        .ok_or(CUresult::INVALID_HANDLE)?;
    Ok(image.kernels()?.by_name.keys().cloned().collect())
}

pub unsafe fn cuModuleGetFunctionCount(count: *mut u32, hmod: CUmodule) -> Result<(), CUresult> {
    let n = u32::try_from(module_kernels(hmod)?.len()).unwrap_or(u32::MAX);
    // SAFETY: the caller's out-pointer (NULL is refused).
    unsafe { put(count, n) }
}

pub unsafe fn cuModuleEnumerateFunctions(
    functions: *mut CUfunction,
    num: u32,
    hmod: CUmodule,
) -> Result<(), CUresult> {
    if functions.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let names = module_kernels(hmod)?;
    if (num as usize) < names.len() {
        return Err(CUresult::INVALID_VALUE);
    }
    for (i, name) in names.iter().enumerate() {
        let name = CString::new(name.as_str()).map_err(|_| CUresult::NOT_FOUND)?;
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: a valid out-pointer, a live module and a NUL-terminated name.
        unsafe { cuModuleGetFunction(&raw mut f, hmod, name.as_ptr()) }?;
        // SAFETY: the caller's array holds `num` entries, at least `names.len()`.
        unsafe { functions.add(i).write_unaligned(f) };
    }
    Ok(())
}

pub unsafe fn cuModuleGetLoadingMode(mode: *mut u32) -> Result<(), CUresult> {
    // SAFETY: the caller's out-pointer (NULL is refused).
    unsafe { put(mode, library::loading_mode()) }
}

pub unsafe fn cuFuncGetAttribute(
    value: *mut i32,
    attrib: i32,
    func: CUfunction,
) -> Result<(), CUresult> {
    if value.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let handle = func as u64;
    if library::is_client_kernel(handle) {
        // A kernel in place of a function: its attribute on the current context's device.
        let dev = context::device_of(0)?;
        // SAFETY: forwarded under the same contract.
        return unsafe { library::cuKernelGetAttribute(value, attrib, func as CUkernel, dev) };
    }
    let cached = caches().functions.get(&handle).cloned();
    let local = cached.and_then(|f| {
        usize::try_from(attrib)
            .ok()
            .and_then(|i| f.attributes.get(i).copied())
    });
    match local {
        Some(v) => {
            handles::check(Kind::Function, handle)?;
            // SAFETY: the caller's out-pointer, non-NULL.
            unsafe { put(value, v) }
        }
        // SAFETY: forwarded under the same contract.
        None => unsafe { forward::cuFuncGetAttribute(value, attrib, func) },
    }
}

pub unsafe fn cuFuncSetAttribute(
    func: CUfunction,
    attrib: i32,
    value: i32,
) -> Result<(), CUresult> {
    // Refused here, at once, as NVIDIA's driver refuses it: the set below is not waited for, and a value
    // cached for a read-only attribute (the block size limit, say) would answer every later query.
    if !settable(attrib) {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: forwarded under the same contract (a client kernel is translated on the way).
    unsafe { forward::cuFuncSetAttribute(func, attrib, value) }?;
    let handle = func as u64;
    if library::is_client_kernel(handle) {
        // The kernel's cached attributes are asked again.
        library::attributes_changed(handle);
        attributes_changed(handle);
        return Ok(());
    }
    let mut c = caches();
    c.occupancy.retain(|k, _| k.0 != handle);
    if let Some(f) = c.functions.get_mut(&handle) {
        let f = Arc::make_mut(f);
        match usize::try_from(attrib)
            .ok()
            .and_then(|i| f.attributes.get_mut(i))
        {
            // The driver reports what was set (a failure on the peer is reported later, as deferred).
            Some(slot) => *slot = value,
            None => f.attributes.clear(),
        }
    }
    Ok(())
}

/// The launchable entry of `func` for the function queries below.
fn function_entry(func: CUfunction) -> Result<Arc<Launchable>, CUresult> {
    state::session()?;
    let handle = func as u64;
    if library::is_client_kernel(handle) {
        let k = library::kernel(handle)?;
        return Ok(Arc::new(Launchable {
            server: 0,
            params: Ok(k.params.clone()),
            attributes: Vec::new(),
            name: Some(Arc::new(k.name().to_owned())),
            module: 0,
        }));
    }
    handles::check(Kind::Function, handle)?;
    caches()
        .functions
        .get(&handle)
        .cloned()
        .ok_or(CUresult::INVALID_HANDLE)
}

pub unsafe fn cuFuncGetName(name: *mut *const c_char, func: CUfunction) -> Result<(), CUresult> {
    if name.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let handle = func as u64;
    if library::is_client_kernel(handle) {
        // SAFETY: forwarded under the same contract.
        return unsafe { library::cuKernelGetName(name, func as CUkernel) };
    }
    let f = function_entry(func)?;
    let text = f.name.as_ref().ok_or(CUresult::INVALID_HANDLE)?;
    // SAFETY: the caller's out-pointer, non-NULL; the name lives in the cache until the function dies.
    unsafe { put(name, text.as_ptr()) }
}

pub unsafe fn cuFuncGetParamInfo(
    func: CUfunction,
    index: usize,
    offset: *mut usize,
    size: *mut usize,
) -> Result<(), CUresult> {
    let f = function_entry(func)?;
    let params = f.params.as_ref().map_err(|&e| e)?;
    // SAFETY: the caller's out-pointers.
    unsafe { param_info(params, index, offset, size) }
}

pub unsafe fn cuFuncGetModule(module: *mut CUmodule, func: CUfunction) -> Result<(), CUresult> {
    let f = function_entry(func)?;
    if f.module == 0 {
        return Err(CUresult::NOT_FOUND);
    }
    // SAFETY: the caller's out-pointer (NULL is refused).
    unsafe { put(module, f.module as CUmodule) }
}

pub unsafe fn cuFuncIsLoaded(state: *mut u32, func: CUfunction) -> Result<(), CUresult> {
    function_entry(func)?;
    // Functions are loaded when the client first obtains them.
    // SAFETY: the caller's out-pointer (NULL is refused).
    unsafe { put(state, FUNCTION_LOADED) }
}

pub unsafe fn cuFuncLoad(func: CUfunction) -> Result<(), CUresult> {
    function_entry(func).map(drop)
}

pub unsafe fn cuKernelGetFunction(
    pfunc: *mut CUfunction,
    kernel: CUkernel,
) -> Result<(), CUresult> {
    if pfunc.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::session()?;
    let handle = kernel as u64;
    let k = library::kernel(handle)?;
    let ctx = context::current();
    let known = caches().kernel_functions.get(&(handle, ctx)).copied();
    if let Some(f) = known
        && handles::check(Kind::Function, f).is_ok()
    {
        // SAFETY: the caller's out-pointer, non-NULL.
        return unsafe { put(pfunc, f as CUfunction) };
    }
    let server = library::server_kernel(handle)?;
    let reply = call(Call::KernelGetFunction { kernel: server })?;
    let Reply::Function { handle: f, info } = reply else {
        return Err(state::mismatch("cuKernelGetFunction", &reply));
    };
    let owner = Owner {
        ctx: context::current(),
        kernel: Some(server),
        ..Owner::default()
    };
    handles::record(Kind::Function, f, &owner);
    let name = k.name().to_string_lossy().into_owned();
    record_function(f, info, Ok(k.params.clone()), &name, 0)?;
    caches().kernel_functions.insert((handle, ctx), f);
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(pfunc, f as CUfunction) }
}

#[allow(clippy::too_many_arguments)]
pub unsafe fn cuLaunchKernel(
    f: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared_mem_bytes: u32,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<(), CUresult> {
    // SAFETY: the application's parameter arrays, as the C API requires.
    unsafe {
        launch(
            &LaunchArgs {
                f,
                grid: [gx, gy, gz],
                block: [bx, by, bz],
                shared_mem_bytes,
                stream,
                params,
                extra,
            },
            Vec::new(),
        )
    }
}

#[allow(clippy::too_many_arguments)]
pub unsafe fn cuLaunchCooperativeKernel(
    f: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared_mem_bytes: u32,
    stream: CUstream,
    params: *mut *mut c_void,
) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe {
        launch(
            &LaunchArgs {
                f,
                grid: [gx, gy, gz],
                block: [bx, by, bz],
                shared_mem_bytes,
                stream,
                params,
                extra: std::ptr::null_mut(),
            },
            vec![cooperative()],
        )
    }
}

pub unsafe fn cuLaunchKernelEx(
    config: *const c_void,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<(), CUresult> {
    // SAFETY: the application's launch configuration and parameters, as the C API requires.
    unsafe { launch_ex(config, f, params, extra, false) }
}

pub unsafe fn cuLaunchKernelEx_ptsz(
    config: *const c_void,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<(), CUresult> {
    // SAFETY: as above; the configuration's stream is the one mapped to the per-thread stream.
    unsafe { launch_ex(config, f, params, extra, true) }
}

/// `CU_LAUNCH_ATTRIBUTE_COOPERATIVE` = 1: every block resident at once (`cuLaunchCooperativeKernel`).
fn cooperative() -> LaunchAttr {
    let mut value = [0u32; 16];
    value[0] = 1;
    LaunchAttr {
        id: LaunchAttr::COOPERATIVE,
        value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(v: &[(u32, u32)]) -> Vec<ParamSlot> {
        v.iter()
            .map(|&(offset, size)| ParamSlot { offset, size })
            .collect()
    }

    #[test]
    fn a_peer_reporting_another_layout_is_refused() {
        let client = slots(&[(0, 8), (8, 4)]);
        let honest = FunctionInfo {
            params: client.clone(),
            attributes: vec![],
        };
        assert_eq!(cross_check("k", &client, &honest), Ok(()));
        // A driver without cuFuncGetParamInfo says nothing: accepted, the client's layout is used.
        assert_eq!(cross_check("k", &client, &FunctionInfo::default()), Ok(()));
        let greedy = FunctionInfo {
            params: slots(&[(0, 8), (8, 4096)]),
            attributes: vec![],
        };
        assert_eq!(
            cross_check("k", &client, &greedy),
            Err(CUresult::INVALID_IMAGE)
        );
    }

    #[test]
    fn kernel_params_are_packed_by_the_client_layout_only() {
        let f = Launchable {
            server: 1,
            params: Ok(Arc::new(slots(&[(0, 8), (8, 4)]))),
            attributes: vec![],
            name: None,
            module: 0,
        };
        let (a, b) = (0x1122_3344_5566_7788u64, 0x99aa_bbccu32);
        let mut ptrs = [
            (&raw const a).cast_mut().cast::<c_void>(),
            (&raw const b).cast_mut().cast(),
        ];
        // SAFETY: two parameter pointers to values of the layout's sizes.
        let buf = unsafe { pack_params(&f, ptrs.as_mut_ptr(), std::ptr::null_mut()) }.unwrap();
        assert_eq!(buf.len(), 12);
        assert_eq!(&buf[..8], &a.to_le_bytes());
        assert_eq!(&buf[8..], &b.to_le_bytes());
        // Without a layout, kernelParams cannot be packed at all.
        let unknown = Launchable {
            params: Err(CUresult::INVALID_IMAGE),
            ..f
        };
        // SAFETY: as above; nothing is read.
        let refused = unsafe { pack_params(&unknown, ptrs.as_mut_ptr(), std::ptr::null_mut()) };
        assert_eq!(refused, Err(CUresult::INVALID_VALUE));
    }
}
