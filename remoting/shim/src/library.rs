//! Libraries and kernels (`cuLibrary*`, `cuKernel*`), kept on the client and loaded on the serving peer
//! only when first used, as NVIDIA's driver loads lazily.
//!
//! `cuLibraryLoadData` reads the image, picks what the serving device runs ([`Image::for_peer`]) and
//! returns a client-side handle without a round trip; `cuLibraryGetKernel` checks the name against the
//! kernels the client read from that code and returns a client-side kernel handle, again locally. The image
//! is sent (or found on the peer by its hash) the first time the library is really needed: a kernel of it
//! launched, its function or an attribute asked for, a global looked up, its module asked for. From then
//! on the client handle stands for the peer's library (or kernel) handle: every call that takes one
//! translates it ([`Translate`]), including the calls that accept a `CUkernel` in place of a `CUfunction`.
//!
//! `CUDA_MODULE_LOADING=EAGER` loads each library on the peer at `cuLibraryLoadData` instead
//! ([`loading_mode`]).
//!
//! Client handles are tagged in their top 16 bits (no user-space address has them set), so they can never
//! be mistaken for a handle of the peer.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, OnceLock};

use gleam_protocol::api::{Array, SurfObject, TexObject};
use gleam_protocol::api::{CStr as CStrArg, Context, Event, Function, Kernel, Library, Module};
use gleam_protocol::api::{Graph, GraphExec, In, InOut, LaunchConfig, OptOut, Out, Plain, Stream};
use gleam_protocol::api::{MemHandle, MemPool, One, OneSize, PtrValue};
use gleam_protocol::registry::{Kind, Owner};
use gleam_protocol::types::{CUfunction, CUkernel, CUlibrary, CUmodule, CUresult};
use gleam_protocol::wire::ParamSlot;

use crate::images::{self, Image, Target};
use crate::{forward, handles, module, put, state};

const TAG_MASK: u64 = 0xffff << 48;
/// Top bits of a client-side library handle.
const LIBRARY_TAG: u64 = 0xc1b0 << 48;
/// Top bits of a client-side kernel handle.
const KERNEL_TAG: u64 = 0xc4e0 << 48;

/// `CUmoduleLoadingMode`.
const EAGER_LOADING: u32 = 1;
const LAZY_LOADING: u32 = 2;

/// `CUDA_MODULE_LOADING` (read once): `EAGER` loads every library on the peer when it is loaded, anything
/// else (the default, `LAZY`) when it is first used.
pub fn loading_mode() -> u32 {
    static MODE: OnceLock<u32> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("CUDA_MODULE_LOADING") {
        Ok(v) if v.eq_ignore_ascii_case("EAGER") => EAGER_LOADING,
        _ => LAZY_LOADING,
    })
}

/// A library as the client holds it.
#[derive(Debug)]
struct LibraryEntry {
    image: Arc<Image>,
    /// The peer's library, once loaded (the lock is held while loading, so it loads once).
    server: Mutex<Option<u64>>,
    /// Kernels handed out, by name (the same handle every time, as the driver does).
    kernels: Mutex<HashMap<String, u64>>,
}

/// A kernel as the client holds it.
#[derive(Debug)]
pub struct KernelEntry {
    library: u64,
    name: CString,
    /// The parameter layout read from the library's code.
    pub params: Arc<Vec<ParamSlot>>,
    /// The peer's kernel, once resolved.
    server: OnceLock<u64>,
    /// `cuKernelGetAttribute` answers, by (attribute, device).
    attributes: Mutex<HashMap<(i32, i32), i32>>,
}

impl KernelEntry {
    /// The kernel's name.
    pub fn name(&self) -> &CStr {
        &self.name
    }
}

/// Kernel `handle`'s attributes were set through `cuFuncSetAttribute`: asked again next time.
pub fn attributes_changed(handle: u64) {
    if let Ok(k) = kernel(handle) {
        lock(&k.attributes).clear();
    }
}

#[derive(Debug, Default)]
struct Libraries {
    libraries: HashMap<u64, Arc<LibraryEntry>>,
    kernels: HashMap<u64, Arc<KernelEntry>>,
    next: u64,
}

static LIBRARIES: LazyLock<Mutex<Libraries>> = LazyLock::new(Mutex::default);

fn libraries() -> MutexGuard<'static, Libraries> {
    LIBRARIES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether `handle` is a client-side kernel handle.
pub fn is_client_kernel(handle: u64) -> bool {
    handle & TAG_MASK == KERNEL_TAG
}

fn is_client_library(handle: u64) -> bool {
    handle & TAG_MASK == LIBRARY_TAG
}

fn library(handle: u64) -> Result<Arc<LibraryEntry>, CUresult> {
    libraries()
        .libraries
        .get(&handle)
        .cloned()
        .ok_or(CUresult::INVALID_HANDLE)
}

/// The client-side kernel `handle`.
pub fn kernel(handle: u64) -> Result<Arc<KernelEntry>, CUresult> {
    libraries()
        .kernels
        .get(&handle)
        .cloned()
        .ok_or(CUresult::INVALID_HANDLE)
}

/// The peer's library for client library `handle`, loading it there first if needed.
fn server_library(lib: &LibraryEntry) -> Result<u64, CUresult> {
    let mut server = lock(&lib.server);
    if let Some(handle) = *server {
        return Ok(handle);
    }
    let handle = images::load(&lib.image, true)?;
    handles::record(Kind::Library, handle, &Owner::default());
    *server = Some(handle);
    Ok(handle)
}

/// The peer's kernel for client kernel `handle`, loading its library there first if needed.
pub fn server_kernel(handle: u64) -> Result<u64, CUresult> {
    let k = kernel(handle)?;
    if let Some(&server) = k.server.get() {
        return Ok(server);
    }
    let lib = library(k.library)?;
    let server_lib = server_library(&lib)?;
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer, a live library of the peer, and a NUL-terminated name.
    unsafe { forward::cuLibraryGetKernel(&raw mut out, server_lib as CUlibrary, k.name.as_ptr()) }?;
    Ok(*k.server.get_or_init(|| out as u64))
}

/// Handles the application passes that stand for a handle of the peer: translated before a call is sent.
pub trait Translate: gleam_protocol::api::Arg {
    /// The request value the peer gets for the application's `request`.
    fn translate(request: Self::Request) -> Result<Self::Request, CUresult>;
}

macro_rules! as_is {
    ($($t:ty),*) => {$(
        impl Translate for $t {
            fn translate(request: Self::Request) -> Result<Self::Request, CUresult> {
                Ok(request)
            }
        }
    )*};
}

as_is!(
    i32,
    u32,
    i64,
    u64,
    usize,
    f32,
    u8,
    u16,
    Context,
    Module,
    Stream,
    Event,
    CStrArg,
    LaunchConfig,
    Graph,
    GraphExec,
    MemPool,
    MemHandle,
    PtrValue,
    Array,
    TexObject,
    SurfObject,
    One,
    OneSize
);

impl<T: gleam_protocol::api::Value> Translate for Out<T>
where
    T::C: Default,
{
    fn translate(request: ()) -> Result<(), CUresult> {
        Ok(request)
    }
}

impl<T: gleam_protocol::api::Value> Translate for OptOut<T>
where
    T::C: Default,
{
    fn translate(request: bool) -> Result<bool, CUresult> {
        Ok(request)
    }
}

impl<T: gleam_protocol::api::Value> Translate for In<T>
where
    T::C: Default,
{
    fn translate(request: Box<T::W>) -> Result<Box<T::W>, CUresult> {
        Ok(request)
    }
}

impl<T: gleam_protocol::api::Value> Translate for gleam_protocol::api::InOpt<T> {
    fn translate(request: Option<Box<T::W>>) -> Result<Option<Box<T::W>>, CUresult> {
        Ok(request)
    }
}

impl<T: Plain> Translate for InOut<T> {
    fn translate(request: T) -> Result<T, CUresult> {
        Ok(request)
    }
}

impl Translate for Kernel {
    fn translate(handle: u64) -> Result<u64, CUresult> {
        if is_client_kernel(handle) {
            server_kernel(handle)
        } else {
            Ok(handle)
        }
    }
}

/// CUDA accepts a `CUkernel` wherever a `CUfunction` goes.
impl Translate for Function {
    fn translate(handle: u64) -> Result<u64, CUresult> {
        <Kernel as Translate>::translate(handle)
    }
}

impl Translate for Library {
    fn translate(handle: u64) -> Result<u64, CUresult> {
        if is_client_library(handle) {
            server_library(&*library(handle)?)
        } else {
            Ok(handle)
        }
    }
}

/// `cuLibraryLoadData`'s work on the image `original` (exactly its extent).
fn load(original: &[u8]) -> Result<u64, CUresult> {
    let image = Arc::new(Image::for_peer(original, Target::of_session()?)?);
    let entry = Arc::new(LibraryEntry {
        image,
        server: Mutex::new(None),
        kernels: Mutex::new(HashMap::new()),
    });
    if loading_mode() == EAGER_LOADING {
        server_library(&entry)?;
    }
    let mut all = libraries();
    all.next += 1;
    let handle = LIBRARY_TAG | all.next;
    all.libraries.insert(handle, entry);
    Ok(handle)
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
    // JIT options apply where the code is compiled (the peer), and none is needed to load correctly;
    // library options (CU_LIBRARY_BINARY_IS_PRESERVED...) only promise the caller's memory stays.
    let _ = (jit_options, jit_values, num_jit_options);
    let _ = (library_options, library_values, num_library_options);
    if library.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::session()?;
    // SAFETY: the application's image, as the C API requires; read before the call returns.
    let original = unsafe { module::image_bytes(code)? };
    let handle = load(original)?;
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
    let _ = (jit_options, jit_values, num_jit_options);
    let _ = (library_options, library_values, num_library_options);
    if library.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::session()?;
    // SAFETY: a NUL-terminated path, as the C API requires.
    let bytes = unsafe { module::read_file(file_name)? };
    let extent = gleam_fatbin::image_size_in(&bytes).map_err(|_| CUresult::INVALID_IMAGE)?;
    let handle = load(&bytes[..extent])?;
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(library, handle as CUlibrary) }
}

pub unsafe fn cuLibraryGetKernel(
    kernel: *mut CUkernel,
    library: CUlibrary,
    name: *const c_char,
) -> Result<(), CUresult> {
    if kernel.is_null() || name.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::session()?;
    let lib = self::library(library as u64)?;
    // SAFETY: a NUL-terminated name, as the C API requires.
    let name = unsafe { CStr::from_ptr(name) };
    let text = name.to_str().map_err(|_| CUresult::NOT_FOUND)?;
    let handle = kernel_handle(library as u64, &lib, text)?;
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(kernel, handle as CUkernel) }
}

/// The client kernel `name` of `lib` (made on first request).
fn kernel_handle(lib_handle: u64, lib: &LibraryEntry, name: &str) -> Result<u64, CUresult> {
    if let Some(&handle) = lock(&lib.kernels).get(name) {
        return Ok(handle);
    }
    let found = lib.image.kernels()?.get(name).ok_or(CUresult::NOT_FOUND)?;
    let params = found
        .params
        .iter()
        .map(|p| ParamSlot {
            offset: p.offset,
            size: p.size,
        })
        .collect();
    let entry = Arc::new(KernelEntry {
        library: lib_handle,
        name: CString::new(name).map_err(|_| CUresult::NOT_FOUND)?,
        params: Arc::new(params),
        server: OnceLock::new(),
        attributes: Mutex::new(HashMap::new()),
    });
    let mut kernels = lock(&lib.kernels);
    if let Some(&handle) = kernels.get(name) {
        return Ok(handle);
    }
    let mut all = libraries();
    all.next += 1;
    let handle = KERNEL_TAG | all.next;
    all.kernels.insert(handle, entry);
    kernels.insert(name.to_owned(), handle);
    Ok(handle)
}

pub unsafe fn cuLibraryGetKernelCount(count: *mut u32, lib: CUlibrary) -> Result<(), CUresult> {
    state::session()?;
    let lib = library(lib as u64)?;
    let n = u32::try_from(lib.image.kernels()?.len()).unwrap_or(u32::MAX);
    // SAFETY: the caller's out-pointer (NULL is refused).
    unsafe { put(count, n) }
}

pub unsafe fn cuLibraryEnumerateKernels(
    kernels: *mut CUkernel,
    num_kernels: u32,
    lib: CUlibrary,
) -> Result<(), CUresult> {
    if kernels.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::session()?;
    let handle = lib as u64;
    let entry = library(handle)?;
    let names: Vec<String> = entry.image.kernels()?.by_name.keys().cloned().collect();
    if (num_kernels as usize) < names.len() {
        return Err(CUresult::INVALID_VALUE);
    }
    for (i, name) in names.iter().enumerate() {
        let k = kernel_handle(handle, &entry, name)?;
        // SAFETY: the caller's array holds `num_kernels` entries, at least `names.len()`.
        unsafe { kernels.add(i).write_unaligned(k as CUkernel) };
    }
    Ok(())
}

pub unsafe fn cuLibraryUnload(library: CUlibrary) -> Result<(), CUresult> {
    state::session()?;
    let handle = library as u64;
    let lib = self::library(handle)?;
    let server = *lock(&lib.server);
    if let Some(server) = server {
        // SAFETY: a live library of the peer; the registry drops its kernels and modules.
        unsafe { forward::cuLibraryUnload(server as CUlibrary) }?;
    }
    // Locks in the order every path takes them: the library's kernels, then the table.
    let dead: Vec<u64> = lock(&lib.kernels).values().copied().collect();
    let mut all = libraries();
    all.libraries.remove(&handle);
    for k in &dead {
        all.kernels.remove(k);
    }
    drop(all);
    module::forget_kernels(&dead);
    Ok(())
}

pub unsafe fn cuLibraryGetModule(
    module: *mut CUmodule,
    library: CUlibrary,
) -> Result<(), CUresult> {
    if module.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::session()?;
    let handle = library as u64;
    let server = <Library as Translate>::translate(handle)?;
    // SAFETY: the caller's out-pointer (checked) and a live library of the peer.
    unsafe { forward::cuLibraryGetModule(module, server as CUlibrary) }?;
    if let Ok(lib) = self::library(handle) {
        // SAFETY: written by the successful call above.
        let m = unsafe { *module } as u64;
        module::remember_image(m, lib.image.clone());
    }
    Ok(())
}

pub unsafe fn cuKernelGetLibrary(lib: *mut CUlibrary, kernel: CUkernel) -> Result<(), CUresult> {
    state::session()?;
    let k = self::kernel(kernel as u64)?;
    // SAFETY: the caller's out-pointer (NULL is refused).
    unsafe { put(lib, k.library as CUlibrary) }
}

pub unsafe fn cuKernelGetName(name: *mut *const c_char, kernel: CUkernel) -> Result<(), CUresult> {
    state::session()?;
    let k = self::kernel(kernel as u64)?;
    // SAFETY: the caller's out-pointer (NULL is refused); the name lives as long as the kernel.
    unsafe { put(name, k.name.as_ptr()) }
}

pub unsafe fn cuKernelGetParamInfo(
    kernel: CUkernel,
    index: usize,
    offset: *mut usize,
    size: *mut usize,
) -> Result<(), CUresult> {
    state::session()?;
    let k = self::kernel(kernel as u64)?;
    // SAFETY: the caller's out-pointers.
    unsafe { module::param_info(&k.params, index, offset, size) }
}

pub unsafe fn cuKernelGetAttribute(
    value: *mut i32,
    attrib: i32,
    kernel: CUkernel,
    dev: i32,
) -> Result<(), CUresult> {
    if value.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::device(dev)?;
    let handle = kernel as u64;
    let Ok(k) = self::kernel(handle) else {
        // A kernel of the peer's (not one the client handed out): asked there.
        // SAFETY: forwarded under the same contract.
        return unsafe { forward::cuKernelGetAttribute(value, attrib, kernel, dev) };
    };
    if let Some(&v) = lock(&k.attributes).get(&(attrib, dev)) {
        // SAFETY: the caller's out-pointer, non-NULL.
        return unsafe { put(value, v) };
    }
    let server = server_kernel(handle)?;
    let mut v = 0;
    // SAFETY: a valid out-pointer and a live kernel of the peer.
    unsafe { forward::cuKernelGetAttribute(&raw mut v, attrib, server as CUkernel, dev) }?;
    lock(&k.attributes).insert((attrib, dev), v);
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(value, v) }
}

pub unsafe fn cuKernelSetAttribute(
    attrib: i32,
    value: i32,
    kernel: CUkernel,
    dev: i32,
) -> Result<(), CUresult> {
    state::device(dev)?;
    let handle = kernel as u64;
    let server = <Kernel as Translate>::translate(handle)?;
    // SAFETY: a live kernel of the peer; the other arguments are plain values.
    unsafe { forward::cuKernelSetAttribute(attrib, value, server as CUkernel, dev) }?;
    if let Ok(k) = self::kernel(handle) {
        // What depends on the value set (the maximum dynamic shared memory, the carveout...) is asked
        // again next time.
        lock(&k.attributes).clear();
    }
    module::attributes_changed(handle);
    Ok(())
}

/// A client kernel's parameter layout and the peer's kernel.
pub type Resolved = (Arc<Vec<ParamSlot>>, u64);

/// The client kernel behind a function argument, if it is one, resolved on the peer.
pub fn launchable_kernel(func: CUfunction) -> Option<Result<Resolved, CUresult>> {
    let handle = func as u64;
    if !is_client_kernel(handle) {
        return None;
    }
    Some(kernel(handle).and_then(|k| Ok((k.params.clone(), server_kernel(handle)?))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_handles_are_tagged_apart_from_addresses() {
        assert!(is_client_kernel(KERNEL_TAG | 5));
        assert!(!is_client_kernel(LIBRARY_TAG | 5));
        assert!(is_client_library(LIBRARY_TAG | 1));
        // Handles of the peer: user-space addresses (real driver) and the emu's namespaces.
        for h in [
            0x5555_5555_0000u64,
            0x7fff_ffff_f000,
            0x0b00_0000_0010,
            0,
            1,
            2,
        ] {
            assert!(!is_client_kernel(h) && !is_client_library(h));
        }
    }
}
