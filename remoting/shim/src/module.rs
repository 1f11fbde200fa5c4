//! Modules, libraries, functions and kernel launches; plus the per-thread-stream variants of stream and
//! event calls.
//!
//! Module images are sized on the client ([`gleam_fatbin`]) and shipped whole. A function handle
//! arrives with its [`FunctionInfo`] (parameter layout and attributes), cached here, so a launch is packed,
//! validated (handle, block and grid dimensions, dynamic shared memory) and sent fire-and-forget, and
//! `cuFuncGetAttribute` needs no round trip.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::os::unix::ffi::OsStrExt;
use std::sync::{Arc, Mutex, MutexGuard};

use gleam_fatbin as image;
use gleam_protocol::registry::{Kind, Owner};
use gleam_protocol::types::{
    CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE, CU_LAUNCH_PARAM_END, CUfunction,
    CUkernel, CUlibrary, CUmodule, CUresult, CUstream,
};
use gleam_protocol::wire::{Call, FunctionInfo, Launch, Reply};

use crate::{context, device, forward, handles, put, state};

#[derive(Default)]
struct Caches {
    /// Layout and attributes of every function (and launched kernel) handle seen.
    functions: HashMap<u64, Arc<FunctionInfo>>,
}

static CACHES: Mutex<Option<Caches>> = Mutex::new(None);

fn with_caches<R>(f: impl FnOnce(&mut Caches) -> R) -> R {
    let mut guard: MutexGuard<'_, Option<Caches>> = CACHES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    f(guard.get_or_insert_with(Caches::default))
}

// CUfunction_attribute ids used for local answers and validation.
const FUNC_MAX_THREADS_PER_BLOCK: usize = 0;
const FUNC_MAX_DYNAMIC_SHARED: usize = 8;
// Device attribute ids of the launch limits.
const MAX_BLOCK_DIM_X: u32 = 2;
const MAX_GRID_DIM_X: u32 = 5;
/// The largest `extra`/`kernelParams` buffer CUDA accepts (CUDA 12.1+, Volta+).
const MAX_PARAM_BYTES: usize = 32_764;

/// A synchronous call in the current context: the server's reply, once its result is a success.
fn call(call: Call) -> Result<Reply, CUresult> {
    call_with(call, &[])
}

/// [`call`] with bulk bytes (a module image).
fn call_with(call: Call, bulk: &[u8]) -> Result<Reply, CUresult> {
    let session = state::session()?;
    // An image in mirrored memory is read here, holding no lock (a fault inside the client would wait
    // for the client).
    // SAFETY: `bulk` is a valid slice.
    let staged = crate::managed::overlaps(bulk.as_ptr() as u64, bulk.len() as u64)
        .then(|| unsafe { crate::managed::staged(bulk.as_ptr(), bulk.len()) });
    let bulk = staged.as_deref().unwrap_or(bulk);
    let answer = session
        .client
        .call_with(context::current(), call, bulk)
        .map_err(state::lost)?;
    answer.result.result()?;
    Ok(answer.reply)
}

/// Ships a module image, returns the handle.
fn load_module(image: &[u8]) -> Result<u64, CUresult> {
    match call_with(Call::ModuleLoad, image)? {
        Reply::Module { handle } => {
            handles::record(Kind::Module, handle, &Owner::in_context(context::current()));
            Ok(handle)
        }
        other => Err(state::mismatch("cuModuleLoadData", &other)),
    }
}

fn load_library(image: &[u8]) -> Result<u64, CUresult> {
    match call_with(Call::LibraryLoad, image)? {
        Reply::Library { handle } => {
            handles::record(Kind::Library, handle, &Owner::default());
            Ok(handle)
        }
        other => Err(state::mismatch("cuLibraryLoadData", &other)),
    }
}

/// The bytes of the image at `image` (a fatbin wrapper is followed to its fatbin), sized on the client.
///
/// # Safety
/// `image` is a module image as `cuModuleLoadData` requires; the slice is used before the call returns.
unsafe fn image_bytes<'a>(image: *const c_void) -> Result<&'a [u8], CUresult> {
    // SAFETY: the application passed a module image, as cuModuleLoadData requires; its extent is what
    // its headers (or the PTX text's NUL) say.
    unsafe {
        let start = image::unwrap_fatbin_wrapper(image).map_err(bad_image)?;
        let len = image::image_size(start).map_err(bad_image)?;
        Ok(std::slice::from_raw_parts(start.cast::<u8>(), len))
    }
}

/// `cuModuleLoadData` and its variants: ships the image at `image`, writes the handle to `module`.
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

fn bad_image(err: image::ImageError) -> CUresult {
    tracing::warn!(%err, "cannot load module image");
    match err {
        image::ImageError::Null => CUresult::INVALID_VALUE,
        _ => CUresult::INVALID_IMAGE,
    }
}

unsafe fn read_file(path: *const c_char) -> Result<Vec<u8>, CUresult> {
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

/// Dead functions' layouts are dropped (a handle value may be reused for another function).
pub fn forget_functions(died: &[(Kind, u64)]) {
    with_caches(|c| {
        for (kind, handle) in died {
            if matches!(kind, Kind::Function | Kind::Kernel) {
                c.functions.remove(handle);
            }
        }
    });
}

fn cache_function(handle: u64, info: FunctionInfo) {
    with_caches(|c| c.functions.insert(handle, Arc::new(info)));
}

/// The layout of a launchable handle: a function, or a kernel (fetched once with `KernelGetFunction`).
fn function_info(handle: u64) -> Result<Arc<FunctionInfo>, CUresult> {
    // A dead or made-up handle is refused whatever the cache still holds.
    handles::check(Kind::Function, handle)?;
    if let Some(info) = with_caches(|c| c.functions.get(&handle).cloned()) {
        return Ok(info);
    }
    // Only a kernel (from `cuLibraryGetKernel`) may be launched without its function fetched first.
    handles::check(Kind::Kernel, handle)?;
    let (_, info) = kernel_get_function(handle)?;
    let info = Arc::new(info);
    with_caches(|c| c.functions.insert(handle, info.clone()));
    Ok(info)
}

/// `CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK` of a launchable handle, from its cached layout.
pub(crate) fn max_threads_per_block(func: CUfunction) -> Result<i32, CUresult> {
    let info = function_info(func as u64)?;
    match info.attributes.get(FUNC_MAX_THREADS_PER_BLOCK) {
        Some(&max) => Ok(max),
        None => {
            let mut max = 0;
            // SAFETY: a valid out-pointer; forwarded as the listed call.
            unsafe {
                forward::cuFuncGetAttribute(&raw mut max, FUNC_MAX_THREADS_PER_BLOCK as i32, func)
            }?;
            Ok(max)
        }
    }
}

fn kernel_get_function(kernel: u64) -> Result<(u64, FunctionInfo), CUresult> {
    handles::check(Kind::Kernel, kernel)?;
    match call(Call::KernelGetFunction { kernel })? {
        Reply::Function { handle, info } => {
            let owner = Owner {
                ctx: context::current(),
                kernel: Some(kernel),
                ..Owner::default()
            };
            handles::record(Kind::Function, handle, &owner);
            Ok((handle, info))
        }
        other => Err(state::mismatch("cuKernelGetFunction", &other)),
    }
}

/// Packs `kernelParams` per the layout, or takes `extra`'s buffer.
unsafe fn pack_params(
    info: &FunctionInfo,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<Vec<u8>, CUresult> {
    match (params.is_null(), extra.is_null()) {
        (false, false) => Err(CUresult::INVALID_VALUE),
        (false, true) => {
            let mut buf = vec![0u8; info.params_bytes()];
            for (i, slot) in info.params.iter().enumerate() {
                // SAFETY: kernelParams holds one pointer per parameter of the kernel.
                let value = unsafe { *params.add(i) };
                if value.is_null() {
                    return Err(CUresult::INVALID_VALUE);
                }
                let (offset, size) = (slot.offset as usize, slot.size as usize);
                // SAFETY: each points to a value of the parameter's size.
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
        (true, true) if info.params.is_empty() => Ok(Vec::new()),
        (true, true) => Err(CUresult::INVALID_VALUE),
    }
}

/// Validates a launch against the function's and the device's limits, packs it and sends it.
#[allow(clippy::too_many_arguments)]
unsafe fn launch(
    f: CUfunction,
    grid: [u32; 3],
    block: [u32; 3],
    shared_mem_bytes: u32,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<(), CUresult> {
    let session = state::session()?;
    let info = function_info(f as u64)?;
    handles::check(Kind::Stream, stream as u64)?;
    if grid.contains(&0) || block.contains(&0) {
        return Err(CUresult::INVALID_VALUE);
    }
    let threads = block.iter().map(|&d| u64::from(d)).product::<u64>();
    let attr = |i: usize| info.attributes.get(i).copied().filter(|&v| v > 0);
    if attr(FUNC_MAX_THREADS_PER_BLOCK).is_some_and(|max| threads > max as u64) {
        return Err(CUresult::INVALID_VALUE);
    }
    if attr(FUNC_MAX_DYNAMIC_SHARED).is_some_and(|max| u64::from(shared_mem_bytes) > max as u64) {
        return Err(CUresult::INVALID_VALUE);
    }
    let dev = context::device_of(0).unwrap_or(0);
    for axis in 0..3 {
        let limit = |base: u32| {
            device::attribute(dev, base + axis as u32)
                .ok()
                .filter(|&v| v > 0)
        };
        if limit(MAX_BLOCK_DIM_X).is_some_and(|max| u64::from(block[axis]) > max as u64)
            || limit(MAX_GRID_DIM_X).is_some_and(|max| u64::from(grid[axis]) > max as u64)
        {
            return Err(CUresult::INVALID_VALUE);
        }
    }
    // SAFETY: forwarded.
    let params = unsafe { pack_params(&info, params, extra)? };
    let call = Call::LaunchKernel(Launch {
        function: f as u64,
        grid,
        block,
        shared_mem_bytes,
        stream: stream as u64,
        params,
    });
    // Mirrored memory the host wrote reaches the device before the kernel runs.
    crate::managed::around("cuLaunchKernel", || {
        session
            .client
            .send(context::current(), call)
            .map_err(state::lost)?
            .result()
    })
}

/// Reads a `CUlaunchConfig` and refuses the attributes Gleam cannot honour (clusters).
unsafe fn launch_ex(
    config: *const c_void,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    per_thread_stream: bool,
) -> Result<(), CUresult> {
    if config.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: a valid CUlaunchConfig, as the C API requires.
    let c = unsafe { config.cast::<LaunchConfig>().read_unaligned() };
    if c.num_attrs > 0 && c.attrs.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    for i in 0..c.num_attrs as usize {
        // SAFETY: `attrs` holds `numAttrs` entries.
        let a = unsafe { c.attrs.add(i).read_unaligned() };
        const CLUSTER_DIMENSION: u32 = 4;
        const CLUSTER_SCHEDULING_POLICY: u32 = 5;
        match a.id {
            CLUSTER_DIMENSION => {
                let dims = [a.value[0], a.value[1], a.value[2]];
                if dims.iter().any(|&d| d > 1) {
                    tracing::warn!(
                        ?dims,
                        "cuLaunchKernelEx: thread block clusters are not supported yet"
                    );
                    return Err(CUresult::NOT_SUPPORTED);
                }
            }
            CLUSTER_SCHEDULING_POLICY => {}
            other => tracing::debug!(
                attribute = other,
                "cuLaunchKernelEx: launch attribute ignored"
            ),
        }
    }
    let stream = if per_thread_stream {
        gleam_protocol::api::per_thread(c.stream)
    } else {
        c.stream
    };
    // SAFETY: forwarded.
    unsafe {
        launch(
            f,
            [c.grid[0], c.grid[1], c.grid[2]],
            [c.block[0], c.block[1], c.block[2]],
            c.shared_mem_bytes,
            stream,
            params,
            extra,
        )
    }
}

/// `CUlaunchConfig`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LaunchConfig {
    grid: [u32; 3],
    block: [u32; 3],
    shared_mem_bytes: u32,
    stream: CUstream,
    attrs: *const LaunchAttribute,
    num_attrs: u32,
}

/// `CUlaunchAttribute`: an id, padding, and a 64-byte value union.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LaunchAttribute {
    id: u32,
    pad: u32,
    value: [u32; 16],
}

pub unsafe fn cuModuleLoad(module: *mut CUmodule, fname: *const c_char) -> Result<(), CUresult> {
    if module.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: a NUL-terminated path, as the C API requires.
    let bytes = unsafe { read_file(fname)? };
    let handle = load_module(&bytes)?;
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
    match call(Call::ModuleGetFunction { module, name })? {
        Reply::Function { handle, info } => {
            let owner = Owner {
                ctx: handles::lock().module_context(module),
                module: Some(module),
                ..Owner::default()
            };
            handles::record(Kind::Function, handle, &owner);
            cache_function(handle, info);
            // SAFETY: the caller's out-pointer, non-NULL.
            unsafe { put(hfunc, handle as CUfunction) }
        }
        other => Err(state::mismatch("cuModuleGetFunction", &other)),
    }
}

pub unsafe fn cuModuleGetLoadingMode(mode: *mut u32) -> Result<(), CUresult> {
    // CU_MODULE_LAZY_LOADING, the default of current drivers.
    // SAFETY: the caller's out-pointer (NULL is refused).
    unsafe { put(mode, 2) }
}

pub unsafe fn cuFuncGetAttribute(
    value: *mut i32,
    attrib: i32,
    func: CUfunction,
) -> Result<(), CUresult> {
    if value.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let cached = with_caches(|c| c.functions.get(&(func as u64)).cloned());
    let local = cached.and_then(|info| {
        usize::try_from(attrib)
            .ok()
            .and_then(|i| info.attributes.get(i).copied())
    });
    match local {
        // SAFETY: the caller's out-pointer, non-NULL.
        Some(v) => unsafe { put(value, v) },
        // SAFETY: forwarded under the same contract.
        None => unsafe { forward::cuFuncGetAttribute(value, attrib, func) },
    }
}

#[allow(clippy::too_many_arguments)]
pub unsafe fn cuLibraryLoadData(
    library: *mut CUlibrary,
    code: *const c_void,
    jit_options: *mut u32,
    jit_values: *mut *mut c_void,
    num_jit_options: u32,
    library_options: *mut u32,
    library_values: *mut *mut c_void,
    num_library_options: u32,
) -> Result<(), CUresult> {
    let _ = (
        jit_options,
        jit_values,
        num_jit_options,
        library_options,
        library_values,
        num_library_options,
    );
    if library.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::session()?;
    // SAFETY: the application's image, as the C API requires.
    let bytes = unsafe { image_bytes(code)? };
    let handle = load_library(bytes)?;
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(library, handle as CUlibrary) }
}

#[allow(clippy::too_many_arguments)]
pub unsafe fn cuLibraryLoadFromFile(
    library: *mut CUlibrary,
    file_name: *const c_char,
    jit_options: *mut u32,
    jit_values: *mut *mut c_void,
    num_jit_options: u32,
    library_options: *mut u32,
    library_values: *mut *mut c_void,
    num_library_options: u32,
) -> Result<(), CUresult> {
    let _ = (
        jit_options,
        jit_values,
        num_jit_options,
        library_options,
        library_values,
        num_library_options,
    );
    if library.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::session()?;
    // SAFETY: a NUL-terminated path, as the C API requires.
    let bytes = unsafe { read_file(file_name)? };
    let handle = load_library(&bytes)?;
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(library, handle as CUlibrary) }
}

pub unsafe fn cuKernelGetFunction(
    pfunc: *mut CUfunction,
    kernel: CUkernel,
) -> Result<(), CUresult> {
    if pfunc.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let (handle, info) = kernel_get_function(kernel as u64)?;
    cache_function(handle, info);
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(pfunc, handle as CUfunction) }
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
            f,
            [gx, gy, gz],
            [bx, by, bz],
            shared_mem_bytes,
            stream,
            params,
            extra,
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
    let no_extra = std::ptr::null_mut();
    // SAFETY: as above.
    unsafe {
        launch(
            f,
            [gx, gy, gz],
            [bx, by, bz],
            shared_mem_bytes,
            stream,
            params,
            no_extra,
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

pub unsafe fn cuStreamIsCapturing(stream: CUstream, status: *mut u32) -> Result<(), CUresult> {
    let _ = stream;
    state::session()?;
    // Capture is not forwarded yet, so no stream is ever capturing (CU_STREAM_CAPTURE_STATUS_NONE).
    // SAFETY: the caller's out-pointer (NULL is refused).
    unsafe { put(status, 0) }
}
