//! [`EmuBackend`]: contexts, memory, modules, streams, events and launches of one session.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gleam_protocol::api::{MemOp, args, outs};
use gleam_protocol::copy::Copy3D;
use gleam_protocol::registry::{Died, Handles, Kind};
use gleam_protocol::types::{
    CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, CUmemAllocationProp, CUmemLocation,
    CUresult,
};
use gleam_protocol::wire::{DeviceInfo, FunctionInfo, Launch, LaunchAttr, ParamSlot};
use gleam_ptx::{ExecError, LaunchConfig, LaunchOptions, StopReason};
use gleam_server::backend::{ApiBackend, Backend};
use gleam_server::callbacks::CallbackPoint;

use crate::arrays::Objects;
use crate::attrs::{self, Attr, StreamAttrs};
use crate::backlog::{Admission, CopyBacklog};
use crate::capture::{Captures, Op, STATUS_NONE, Step};
use crate::device::{self, Resources, func_attr};
use crate::managed::Mirrored;
use crate::memory::{ALLOC_ALIGN, DeviceMemory, GRANULARITY};
use crate::pools::{self, Pools};
use crate::streams::{
    EVENT_BLOCKING_SYNC, EVENT_DISABLE_TIMING, EVENT_INTERPROCESS, Event, Job, STREAM_NON_BLOCKING,
    StreamKey, Streams,
};
use crate::{EmuConfig, image};

/// State shared with the stream workers.
struct Shared {
    mem: DeviceMemory,
    /// The sticky error (0 = none): the first fault of asynchronous work.
    sticky: AtomicU32,
    /// Set while shutting down: queued work is skipped rather than run for a client that has left.
    cancelled: AtomicBool,
    /// Tells running kernels to stop: set by a sticky error (the context is lost) and at shutdown.
    stop_kernels: AtomicBool,
    /// The kernel watchdog.
    kernel_timeout: Option<Duration>,
    /// Memory pools (stream-ordered frees return memory from the workers).
    pools: Mutex<Pools>,
    /// Host bytes of queued asynchronous copies, bounded.
    backlog: Arc<CopyBacklog>,
}

impl Shared {
    /// Whether queued work should be skipped (after a fault, or when the session ends).
    fn skip_work(&self) -> bool {
        self.sticky().is_some() || self.cancelled.load(Ordering::Acquire)
    }

    fn sticky(&self) -> Option<CUresult> {
        match self.sticky.load(Ordering::Acquire) {
            0 => None,
            code => Some(CUresult(code)),
        }
    }

    /// Records `err` unless an earlier fault already did (the first one is what CUDA reports), and stops
    /// the kernels still running: their context is lost.
    fn set_sticky(&self, err: CUresult) {
        let _ = self
            .sticky
            .compare_exchange(0, err.0, Ordering::AcqRel, Ordering::Acquire);
        self.stop_kernels.store(true, Ordering::Release);
    }

    fn pools(&self) -> MutexGuard<'_, Pools> {
        self.pools
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Handle namespaces: each kind of object gets its own range, so a handle of the wrong kind is never found.
/// None is 0, 1 or 2 (the stream sentinels).
mod kind {
    pub const CONTEXT: u64 = 0x0c70_0000_0000;
    pub const MODULE: u64 = 0x0d00_0000_0000;
    pub const FUNCTION: u64 = 0x0f00_0000_0000;
    pub const STREAM: u64 = 0x0500_0000_0000;
    pub const EVENT: u64 = 0x0e00_0000_0000;
    pub const LIBRARY: u64 = 0x0b00_0000_0000;
    pub const GRAPH: u64 = 0x0a00_0000_0000;
    pub const GRAPH_EXEC: u64 = 0x0ae0_0000_0000;
}

/// `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`.
const GRAPH_AUTO_FREE_ON_LAUNCH: u64 = 0x1;
/// `CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH`.
const GRAPH_DEVICE_LAUNCH: u64 = 0x4;
/// `CU_EXEC_AFFINITY_TYPE_SM_COUNT`.
const EXEC_AFFINITY_SM_COUNT: u32 = 0;
/// `CU_MEM_ALLOCATION_TYPE_MANAGED` (pools of managed memory).
const ALLOCATION_TYPE_MANAGED: u32 = 2;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, the one exportable handle type a program may ask for.
const HANDLE_TYPE_POSIX_FD: u32 = 1;

/// The primary context of device 0 (exists from the start, like the driver's).
const PRIMARY: u64 = kind::CONTEXT | 0x10;

/// Limits (`CUlimit`) a context holds, by id, with their defaults.
const LIMIT_DEFAULTS: [usize; 10] = [1024, 1 << 20, 8 << 20, 2, 2048, 64, 0, 0, 0, 0];
/// Limits `cuCtxSetLimit` accepts here (stack, printf FIFO, heap, CDP depth and launches, L2 fetch).
const SETTABLE_LIMITS: usize = 6;
/// Valid bits of context flags (scheduling, map host, lmem resize, coredump, sync memops).
const CTX_FLAGS_MASK: u32 = 0xff;

struct Context {
    flags: u32,
    limits: [usize; 10],
    cache_config: u32,
    shared_mem_config: u32,
    /// `cuCtxGetId`: unique in the session, never reused.
    id: u64,
}

impl Context {
    fn new(flags: u32, id: u64) -> Self {
        Self {
            flags,
            limits: LIMIT_DEFAULTS,
            cache_config: 0,
            shared_mem_config: 0,
            id,
        }
    }
}

struct LoadedModule {
    ptx: Arc<gleam_ptx::Module>,
    symbols: Arc<HashMap<String, u64>>,
    /// Module globals: name -> (address, size).
    globals: HashMap<String, (u64, u64)>,
    ptx_version: i32,
    const_bytes: u32,
    /// Functions handed out: name -> handle (the same handle every time, as the driver does).
    functions: HashMap<String, u64>,
}

struct Function {
    module: u64,
    name: String,
    params: Vec<ParamSlot>,
    param_bytes: usize,
    resources: Resources,
    local_bytes: u32,
    carveout: i32,
}

/// The GPU-less backend of one session. See the crate documentation for how errors of asynchronous work
/// are reported.
pub struct EmuBackend {
    shared: Arc<Shared>,
    streams: Streams,
    events: HashMap<u64, Event>,
    contexts: HashMap<u64, Context>,
    primary_refs: u32,
    /// `cuDevicePrimaryCtxReset` destroyed the primary context: it can be made current, but work in it
    /// fails with `CONTEXT_IS_DESTROYED` until it is retained again (measured on NVIDIA's 580 driver).
    primary_reset: bool,
    current: u64,
    modules: HashMap<u64, LoadedModule>,
    functions: HashMap<u64, Function>,
    /// Library -> the module it loaded (a library's kernels are that module's functions).
    libraries: HashMap<u64, u64>,
    /// Arrays, texture and surface objects.
    objects: Objects,
    /// Managed and host allocations.
    mirrored: Mirrored,
    /// Stream captures, graphs and executable graphs.
    captures: Captures,
    /// Attributes given to streams (`cuStreamSetAttribute`); a stream not here has the defaults.
    stream_attrs: HashMap<StreamKey, StreamAttrs>,
    next_handle: u64,
    next_context_id: u64,
}

impl std::fmt::Debug for EmuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmuBackend").finish_non_exhaustive()
    }
}

impl EmuBackend {
    /// A fresh device with `config.memory_bytes` of memory and only the primary context.
    pub fn new(config: EmuConfig) -> Self {
        let mut contexts = HashMap::new();
        contexts.insert(PRIMARY, Context::new(0, 1));
        tracing::info!(
            memory_bytes = config.memory_bytes,
            kernel_timeout = ?config.kernel_timeout,
            stream_workers = crate::streams::worker_bound(),
            "emu backend: {} (compute capability {}.{})",
            device::NAME,
            device::CC.0,
            device::CC.1
        );
        Self {
            shared: Arc::new(Shared {
                mem: DeviceMemory::new(config.memory_bytes),
                sticky: AtomicU32::new(0),
                cancelled: AtomicBool::new(false),
                stop_kernels: AtomicBool::new(false),
                kernel_timeout: config.kernel_timeout,
                pools: Mutex::new(Pools::new()),
                backlog: CopyBacklog::new(config.queued_copy_bytes, config.queued_copy_stall),
            }),
            streams: Streams::default(),
            events: HashMap::new(),
            contexts,
            primary_refs: 0,
            primary_reset: false,
            current: 0,
            modules: HashMap::new(),
            functions: HashMap::new(),
            libraries: HashMap::new(),
            objects: Objects::default(),
            mirrored: Mirrored::default(),
            captures: Captures::default(),
            stream_attrs: HashMap::new(),
            next_handle: 1,
            next_context_id: 1,
        }
    }

    /// The device memory (tests and diagnostics).
    pub fn memory(&self) -> &DeviceMemory {
        &self.shared.mem
    }

    /// The sticky error, if asynchronous work has faulted.
    pub fn sticky_error(&self) -> Option<CUresult> {
        self.shared.sticky()
    }

    fn handle(&mut self, kind: u64) -> u64 {
        self.next_handle += 1;
        kind | (self.next_handle << 4)
    }

    /// Every call starts here: a sticky error is returned before anything else.
    fn check(&self) -> Result<(), CUresult> {
        self.shared.sticky().map_or(Ok(()), Err)
    }

    /// `cuMemAllocAsync` (`pool` 0: the device's current pool) and `cuMemAllocFromPoolAsync`. The memory
    /// exists from now on, which is also valid for the stream's later work.
    fn pool_alloc(&mut self, pool: u64, bytesize: usize, stream: u64) -> Result<u64, CUresult> {
        let ctx = self.ctx()?;
        self.streams.resolve(stream)?;
        self.shared
            .pools()
            .alloc(pool, bytesize as u64, ctx, &self.shared.mem)
    }

    /// The current context, for calls that need one.
    fn ctx(&self) -> Result<u64, CUresult> {
        self.check()?;
        if self.current == PRIMARY && self.primary_reset {
            Err(CUresult::CONTEXT_IS_DESTROYED)
        } else if self.current != 0 && self.contexts.contains_key(&self.current) {
            Ok(self.current)
        } else {
            Err(CUresult::INVALID_CONTEXT)
        }
    }

    fn create_context(&mut self, flags: u32) -> Result<u64, CUresult> {
        if flags & !CTX_FLAGS_MASK != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        let handle = self.handle(kind::CONTEXT);
        self.next_context_id += 1;
        self.contexts
            .insert(handle, Context::new(flags, self.next_context_id));
        // Not made current here: the session engine makes each call's context current from the client's
        // own view (the shim pushes the new context on the creating thread).
        Ok(handle)
    }

    fn ctx_mut(&mut self) -> Result<&mut Context, CUresult> {
        let c = self.ctx()?;
        self.contexts.get_mut(&c).ok_or(CUresult::INVALID_CONTEXT)
    }

    fn device(dev: i32) -> Result<(), CUresult> {
        if dev == 0 {
            Ok(())
        } else {
            Err(CUresult::INVALID_DEVICE)
        }
    }

    /// Queues `f` on `stream` (or records it, if the stream is capturing); its failure becomes the sticky
    /// error, and it is skipped after a fault.
    fn submit(
        &mut self,
        stream: u64,
        what: &'static str,
        f: impl Fn(&DeviceMemory) -> Result<(), CUresult> + Send + Sync + 'static,
    ) -> Result<(), CUresult> {
        self.submit_steps(
            stream,
            vec![Step {
                what: what.into(),
                op: Arc::new(f),
            }],
        )
    }

    /// Queues `steps` on `stream` as one job run in order (or records them into its capture).
    fn submit_steps(&mut self, stream: u64, steps: Vec<Step>) -> Result<(), CUresult> {
        let key = self.streams.resolve(stream)?;
        if self.captures.record_all(key, &steps)? {
            return Ok(());
        }
        let shared = self.shared.clone();
        let job: Job = Box::new(move || {
            for step in &steps {
                if shared.skip_work() {
                    return;
                }
                if let Err(e) = (step.op)(&shared.mem) {
                    tracing::error!("{} failed on the device: {e}", step.what);
                    shared.set_sticky(e);
                    return;
                }
            }
        });
        self.streams
            .enqueue(key, self.current, Vec::new(), Some(job))
    }

    /// Room in the backlog for a queued copy of `bytes` host bytes (see [`CopyBacklog`]); it is given
    /// back when the job holding the admission is dropped, run or skipped.
    fn admit_copy(&self, bytes: usize) -> Result<Admission, CUresult> {
        let shared = &self.shared;
        shared.backlog.admit(bytes as u64, || {
            shared
                .skip_work()
                .then(|| shared.sticky().unwrap_or(CUresult::CONTEXT_IS_DESTROYED))
        })
    }

    /// Refuses what cannot happen on a capturing stream (and invalidates its capture).
    fn not_capturing(&mut self, stream: u64) -> Result<(), CUresult> {
        let key = self.streams.resolve(stream)?;
        if self.captures.capturing(key) {
            return Err(self.captures.invalidate(key));
        }
        Ok(())
    }

    /// Waits for `stream` (None: the legacy stream, as synchronous copies do), then reports a fault.
    fn sync_stream(&self, stream: Option<u64>) -> Result<(), CUresult> {
        let key = match stream {
            Some(s) => self.streams.resolve(s)?,
            None => StreamKey::Legacy,
        };
        self.streams.synchronize(key);
        self.synchronized();
        self.check()
    }

    /// The host has synchronised with (part of) the device: pools give back what they keep above
    /// their release threshold.
    fn synchronized(&self) {
        self.shared.pools().synchronized(&self.shared.mem);
    }

    /// Frees everything context `ctx` owns (after letting queued work finish).
    /// A context lost everything it held: its device memory. (Its streams, events and modules are the
    /// session registry's business: they die by its rules and reach [`Backend::forget`].)
    fn destroy_resources(&mut self, ctx: u64) {
        self.streams.synchronize_all();
        self.shared.mem.free_all(Some(ctx));
        self.shared.pools().forget_freed(&self.shared.mem);
    }

    fn unload(&mut self, module: u64) {
        if let Some(m) = self.modules.remove(&module) {
            self.functions.retain(|_, f| f.module != module);
            self.libraries.retain(|_, &mut lm| lm != module);
            for (addr, _) in m.globals.values() {
                let _ = self.shared.mem.free(*addr);
            }
        }
    }

    fn load_module(&mut self, image: &[u8]) -> Result<u64, CUresult> {
        let ctx = self.ctx()?;
        let sm = (device::CC.0 * 10 + device::CC.1) as u32;
        let text = image::ptx_of(image, sm).map_err(|e| {
            match &e {
                image::ImageError::NoPtx(_) => tracing::error!("module load: {e}"),
                _ => tracing::warn!("module load: {e}"),
            }
            e.code()
        })?;
        // What a module may cost the interpreter: the defaults, with module data bounded by the device's
        // memory (where it will be placed).
        let limits = gleam_ptx::Limits {
            max_global_bytes: self.shared.mem.capacity(),
            ..gleam_ptx::Limits::default()
        };
        let ptx = gleam_ptx::Module::parse_with(&text, &limits).map_err(|e| match e.limit {
            Some(limit) => {
                tracing::warn!(
                    "module load: refused, the module goes over the interpreter's budget ({limit}): {e}"
                );
                CUresult::OUT_OF_MEMORY
            }
            None => {
                tracing::warn!("module load: the PTX interpreter cannot parse this module: {e}");
                CUresult::INVALID_PTX
            }
        })?;
        // What ptxas would refuse: the interpreter would otherwise try to provide it from host memory.
        for k in ptx.kernels() {
            if k.static_shared_bytes() > device::SHARED_PER_BLOCK as usize {
                tracing::warn!(
                    "module load: kernel {} uses {} bytes of static shared memory (limit {})",
                    k.name(),
                    k.static_shared_bytes(),
                    device::SHARED_PER_BLOCK
                );
                return Err(CUresult::INVALID_PTX);
            }
            if k.local_bytes_per_thread() > device::LOCAL_PER_THREAD as usize {
                tracing::warn!(
                    "module load: kernel {} uses {} bytes of local memory per thread (limit {})",
                    k.name(),
                    k.local_bytes_per_thread(),
                    device::LOCAL_PER_THREAD
                );
                return Err(CUresult::INVALID_PTX);
            }
        }
        let mut symbols = HashMap::new();
        let mut globals: HashMap<String, (u64, u64)> = HashMap::new();
        let mut const_bytes = 0u32;
        for g in ptx.globals() {
            let placed = self
                .shared
                .mem
                .alloc(g.size.max(1) as u64, g.align as u64, ctx)
                .and_then(|addr| {
                    let init = &g.init[..g.init.len().min(g.size)];
                    match self.shared.mem.write_bytes(addr, init) {
                        Ok(()) => Ok(addr),
                        Err(_) => {
                            let _ = self.shared.mem.free(addr);
                            Err(CUresult::INVALID_IMAGE)
                        }
                    }
                });
            let addr = match placed {
                Ok(addr) => addr,
                Err(e) => {
                    tracing::warn!(
                        "module load: cannot place global {} ({} bytes): {e}",
                        g.name,
                        g.size
                    );
                    for (a, _) in globals.values() {
                        let _ = self.shared.mem.free(*a);
                    }
                    return Err(e);
                }
            };
            if g.space == gleam_ptx::StateSpace::Const {
                const_bytes = const_bytes.saturating_add(u32::try_from(g.size).unwrap_or(u32::MAX));
            }
            symbols.insert(g.name.clone(), addr);
            globals.insert(g.name.clone(), (addr, g.size as u64));
        }
        let handle = self.handle(kind::MODULE);
        let kernels: Vec<&str> = ptx.kernels().map(gleam_ptx::Kernel::name).collect();
        tracing::debug!(
            module = handle,
            ?kernels,
            globals = globals.len(),
            "module loaded"
        );
        for k in ptx.kernels() {
            if let Some(why) = k.unsupported() {
                tracing::warn!(
                    "kernel {} cannot run on the emu backend ({why}); launching it will fail",
                    k.name()
                );
            }
        }
        self.modules.insert(
            handle,
            LoadedModule {
                ptx_version: ptx_version(&text),
                ptx: Arc::new(ptx),
                symbols: Arc::new(symbols),
                globals,
                const_bytes,
                functions: HashMap::new(),
            },
        );
        Ok(handle)
    }

    fn get_function(&mut self, module: u64, name: &str) -> Result<u64, CUresult> {
        self.check()?;
        let m = self.modules.get(&module).ok_or(CUresult::INVALID_HANDLE)?;
        if let Some(&f) = m.functions.get(name) {
            return Ok(f);
        }
        let k = m.ptx.kernel(name).ok_or(CUresult::NOT_FOUND)?;
        let static_shared = k.static_shared_bytes() as u32;
        let function = Function {
            module,
            name: name.to_owned(),
            params: k
                .params()
                .iter()
                .map(|p| ParamSlot {
                    offset: p.offset as u32,
                    size: p.size as u32,
                })
                .collect(),
            param_bytes: k.param_bytes(),
            resources: Resources {
                max_threads: k
                    .max_threads_per_block()
                    .clamp(1, device::MAX_THREADS_PER_BLOCK),
                regs: k.num_regs(),
                static_shared,
                max_dynamic_shared: device::SHARED_PER_BLOCK.saturating_sub(static_shared),
            },
            local_bytes: k.local_bytes_per_thread() as u32,
            carveout: -1,
        };
        let handle = self.handle(kind::FUNCTION);
        self.functions.insert(handle, function);
        if let Some(m) = self.modules.get_mut(&module) {
            m.functions.insert(name.to_owned(), handle);
        }
        Ok(handle)
    }

    fn function(&self, f: u64) -> Result<&Function, CUresult> {
        self.check()?;
        self.functions.get(&f).ok_or(CUresult::INVALID_HANDLE)
    }

    /// `cuFuncGetAttribute` values, indexed by attribute id.
    fn function_attributes(&self, f: &Function) -> Vec<i32> {
        let m = self.modules.get(&f.module);
        let mut a = vec![0i32; device::FUNC_ATTRIBUTE_END];
        a[func_attr::MAX_THREADS_PER_BLOCK as usize] = f.resources.max_threads as i32;
        a[func_attr::SHARED_SIZE_BYTES as usize] = f.resources.static_shared as i32;
        a[func_attr::CONST_SIZE_BYTES as usize] = m.map_or(0, |m| m.const_bytes as i32);
        a[func_attr::LOCAL_SIZE_BYTES as usize] = f.local_bytes as i32;
        a[func_attr::NUM_REGS as usize] = f.resources.regs as i32;
        a[func_attr::PTX_VERSION as usize] = m.map_or(0, |m| m.ptx_version);
        a[func_attr::BINARY_VERSION as usize] = device::CC.0 * 10 + device::CC.1;
        a[func_attr::CACHE_MODE_CA as usize] = 0;
        a[func_attr::MAX_DYNAMIC_SHARED_SIZE_BYTES as usize] =
            f.resources.max_dynamic_shared as i32;
        a[func_attr::PREFERRED_SHARED_MEMORY_CARVEOUT as usize] = f.carveout;
        a
    }

    fn function_info(&self, handle: u64) -> Result<FunctionInfo, CUresult> {
        let f = self.function(handle)?;
        Ok(FunctionInfo {
            params: f.params.clone(),
            attributes: self.function_attributes(f),
        })
    }

    fn func_attribute(&self, func: u64, attrib: i32) -> Result<i32, CUresult> {
        let f = self.function(func)?;
        usize::try_from(attrib)
            .ok()
            .and_then(|i| self.function_attributes(f).get(i).copied())
            .ok_or(CUresult::INVALID_VALUE)
    }

    fn set_func_attribute(&mut self, func: u64, attrib: i32, value: i32) -> Result<(), CUresult> {
        self.check()?;
        let f = self
            .functions
            .get_mut(&func)
            .ok_or(CUresult::INVALID_HANDLE)?;
        match attrib {
            func_attr::MAX_DYNAMIC_SHARED_SIZE_BYTES => {
                let limit =
                    device::SHARED_PER_BLOCK_OPTIN.saturating_sub(f.resources.static_shared);
                let v = u32::try_from(value).map_err(|_| CUresult::INVALID_VALUE)?;
                if v > limit {
                    return Err(CUresult::INVALID_VALUE);
                }
                f.resources.max_dynamic_shared = v;
            }
            func_attr::PREFERRED_SHARED_MEMORY_CARVEOUT => {
                if !(-1..=100).contains(&value) {
                    return Err(CUresult::INVALID_VALUE);
                }
                f.carveout = value;
            }
            _ => return Err(CUresult::INVALID_VALUE),
        }
        Ok(())
    }

    fn memset(
        &mut self,
        dst: u64,
        pattern: Vec<u8>,
        n: usize,
        stream: u64,
    ) -> Result<(), CUresult> {
        self.ctx()?;
        if !dst.is_multiple_of(pattern.len() as u64) {
            return Err(CUresult::INVALID_VALUE);
        }
        let bytes = (n as u64)
            .checked_mul(pattern.len() as u64)
            .ok_or(CUresult::INVALID_VALUE)?;
        if bytes == 0 {
            self.streams.resolve(stream)?;
            return Ok(());
        }
        self.shared.mem.check(dst, bytes, true)?;
        self.submit(stream, "memset", move |mem| {
            mem.fill(dst, &pattern, n as u64)
                .map_err(|_| CUresult::ILLEGAL_ADDRESS)
        })
    }

    /// `cuMemsetD2D8/16/32` and their async forms: `height` rows of `width` elements of `pattern`, rows
    /// `pitch` bytes apart.
    fn memset2d(
        &mut self,
        dst: u64,
        pitch: usize,
        pattern: Vec<u8>,
        (width, height): (usize, usize),
        stream: u64,
    ) -> Result<(), CUresult> {
        self.ctx()?;
        let span = gleam_protocol::copy::fill_2d_span(dst, pitch, pattern.len(), width, height)?;
        if span == 0 {
            self.streams.resolve(stream)?;
            return Ok(());
        }
        self.shared.mem.check(dst, span as u64, true)?;
        self.submit(stream, "2D memset", move |mem| {
            for r in 0..height {
                mem.fill(dst + (r * pitch) as u64, &pattern, width as u64)
                    .map_err(|_| CUresult::ILLEGAL_ADDRESS)?;
            }
            Ok(())
        })
    }

    /// `cuMemcpyPeer`: both contexts are of the one device, so a device-to-device copy.
    fn peer_copy(
        &mut self,
        (dst, dst_ctx): (u64, u64),
        (src, src_ctx): (u64, u64),
        bytes: usize,
        stream: u64,
    ) -> Result<(), CUresult> {
        self.ctx()?;
        for ctx in [dst_ctx, src_ctx] {
            if !self.contexts.contains_key(&ctx) {
                return Err(CUresult::INVALID_CONTEXT);
            }
        }
        self.dtod(dst, src, bytes, stream)
    }

    fn dtod(&mut self, dst: u64, src: u64, bytes: usize, stream: u64) -> Result<(), CUresult> {
        self.ctx()?;
        if bytes == 0 {
            self.streams.resolve(stream)?;
            return Ok(());
        }
        self.shared.mem.check(dst, bytes as u64, true)?;
        self.shared.mem.check(src, bytes as u64, false)?;
        self.submit(stream, "device-to-device copy", move |mem| {
            mem.copy(dst, src, bytes as u64)
                .map_err(|_| CUresult::ILLEGAL_ADDRESS)
        })
    }

    fn create_stream(&mut self, flags: u32, priority: i32) -> Result<u64, CUresult> {
        let ctx = self.ctx()?;
        if flags & !STREAM_NON_BLOCKING != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        let (least, greatest) = device::STREAM_PRIORITIES;
        let priority = priority.clamp(greatest, least);
        let handle = self.handle(kind::STREAM);
        self.streams.create(handle, flags, priority, ctx)?;
        Ok(handle)
    }

    /// The context of a stream: a created stream's own, the current one for the legacy and per-thread
    /// streams.
    fn stream_context(&self, stream: u64) -> Result<u64, CUresult> {
        self.check()?;
        match self.streams.resolve(stream)? {
            StreamKey::Created(h) => self
                .streams
                .get(h)
                .map(|s| s.ctx)
                .ok_or(CUresult::INVALID_HANDLE),
            _ => self.ctx(),
        }
    }

    fn record_event(&mut self, event: u64, stream: u64) -> Result<(), CUresult> {
        self.ctx()?;
        let key = self.streams.resolve(stream)?;
        if !self.events.contains_key(&event) {
            return Err(CUresult::INVALID_HANDLE);
        }
        // In a capture, the event marks a point of the graph, for other streams to fork from.
        if self.captures.record_event(key, event)? {
            return Ok(());
        }
        let e = self
            .events
            .get_mut(&event)
            .ok_or(CUresult::INVALID_HANDLE)?;
        e.records += 1;
        let (signal, target) = (e.signal.clone(), e.records);
        // Not skipped after a fault: waiters on the event must still wake up.
        let marker = self
            .streams
            .enqueue_signal(key, self.current, signal, target)?;
        if let Some(e) = self.events.get_mut(&event) {
            e.marker = Some(marker);
        }
        Ok(())
    }

    /// The priority of the stream `key` names.
    fn stream_priority(&mut self, key: StreamKey) -> Result<i32, CUresult> {
        Ok(match key {
            StreamKey::Created(h) => self.streams.get(h).map_or(0, |s| s.priority),
            _ => self.streams.stream(key)?.priority,
        })
    }

    /// Applies a checked attribute to the stream `key` names.
    fn set_stream_attr(&mut self, key: StreamKey, attr: Attr) -> Result<(), CUresult> {
        match attr {
            Attr::Priority(p) => {
                let (least, greatest) = device::STREAM_PRIORITIES;
                self.streams.set_priority(key, p.clamp(greatest, least))
            }
            other => {
                self.stream_attrs.entry(key).or_default().set(other);
                Ok(())
            }
        }
    }

    /// A stream memory operation (`cuStreamWaitValue32`, `cuStreamWriteValue64`, an entry of
    /// `cuStreamBatchMemOp`...), in `stream`'s order. A wait holds no worker while its value is not there
    /// (the workers poll it); in a capture it becomes a step that polls when the graph replays.
    fn mem_op(&mut self, stream: u64, op: MemOp) -> Result<(), CUresult> {
        self.ctx()?;
        let key = self.streams.resolve(stream)?;
        match op {
            MemOp::Write {
                address,
                value,
                wide,
                ..
            } => {
                let len = if wide { 8 } else { 4 };
                self.shared.mem.check(address, len as u64, true)?;
                let bytes = value.to_le_bytes();
                self.submit(stream, "stream write value", move |mem| {
                    mem.write_bytes(address, &bytes[..len])
                        .map_err(|_| CUresult::ILLEGAL_ADDRESS)
                })
            }
            MemOp::Wait { address, wide, .. } => {
                let len = if wide { 8 } else { 4 };
                self.shared.mem.check(address, len as u64, false)?;
                let shared = self.shared.clone();
                // Open once the value is there; also once work is being skipped (after a fault, or
                // the session is over), so that nothing waits for it forever.
                let open = move || {
                    let mut bytes = [0u8; 8];
                    let read = shared.mem.read_bytes(address, &mut bytes[..len]);
                    crate::memory::clear_thread_cache();
                    if read.is_err() {
                        tracing::error!(
                            "a stream's wait on the value at {address:#x}: the memory is gone"
                        );
                        shared.set_sticky(CUresult::ILLEGAL_ADDRESS);
                    }
                    shared.skip_work() || op.satisfied_by(u64::from_le_bytes(bytes))
                };
                if self.captures.capturing(key) {
                    let shared = self.shared.clone();
                    let step = Step {
                        what: "stream wait value".into(),
                        op: Arc::new(move |_| {
                            while !open() {
                                std::thread::sleep(Duration::from_micros(200));
                            }
                            match shared.sticky() {
                                Some(e) if !shared.cancelled.load(Ordering::Acquire) => Err(e),
                                _ => Ok(()),
                            }
                        }),
                    };
                    self.captures.record(key, step)?;
                    return Ok(());
                }
                self.streams.enqueue_gate(key, self.current, Arc::new(open))
            }
            // Memory is coherent here, and a stream's work runs in its order: nothing to flush or fence
            // beyond what the stream already does.
            MemOp::Barrier { .. } | MemOp::FlushRemoteWrites => Ok(()),
        }
    }

    fn elapsed(&mut self, start: u64, end: u64) -> Result<f32, CUresult> {
        self.check()?;
        self.captures.query_event(start)?;
        self.captures.query_event(end)?;
        let s = self.events.get(&start).ok_or(CUresult::INVALID_HANDLE)?;
        let e = self.events.get(&end).ok_or(CUresult::INVALID_HANDLE)?;
        e.elapsed_since(s)
    }

    fn validate_launch(&self, launch: &Launch) -> Result<(), CUresult> {
        let f = self.function(launch.function)?;
        let [bx, by, bz] = launch.block;
        let in_limits =
            |dims: [u32; 3], max: [u32; 3]| dims.iter().zip(max).all(|(&d, m)| d >= 1 && d <= m);
        if !in_limits(launch.block, device::MAX_BLOCK_DIM)
            || !in_limits(launch.grid, device::MAX_GRID_DIM)
        {
            return Err(CUresult::INVALID_VALUE);
        }
        let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
        if threads > u64::from(device::MAX_THREADS_PER_BLOCK) {
            return Err(CUresult::INVALID_VALUE);
        }
        // More threads than the kernel's own limit (`.maxntid`): "too many resources requested".
        if threads > u64::from(f.resources.max_threads) {
            return Err(CUresult::LAUNCH_OUT_OF_RESOURCES);
        }
        if launch.shared_mem_bytes > f.resources.max_dynamic_shared {
            return Err(CUresult::INVALID_VALUE);
        }
        if launch.params.len() < f.param_bytes {
            tracing::warn!(
                "launch of {}: {} parameter bytes, the kernel takes {}",
                f.name,
                launch.params.len(),
                f.param_bytes
            );
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(())
    }
}

/// A location that names the device (device 0, the only one).
fn device_location(location: &CUmemLocation) -> Result<(), CUresult> {
    match (location.kind, location.id) {
        (CU_MEM_LOCATION_TYPE_DEVICE, 0) => Ok(()),
        (CU_MEM_LOCATION_TYPE_DEVICE, _) => Err(CUresult::INVALID_DEVICE),
        _ => Err(CUresult::INVALID_VALUE),
    }
}

/// The (location, allocation type) of the `cuMem{Get,Set}{Default,}MemPool` calls: device memory of
/// device 0; host locations and managed memory are not emulated.
fn pool_location(location: &CUmemLocation, kind: u32) -> Result<(), CUresult> {
    match (location.kind, kind) {
        (CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ALLOCATION_TYPE_PINNED) => device_location(location),
        (_, ALLOCATION_TYPE_MANAGED) | (2..=4, CU_MEM_ALLOCATION_TYPE_PINNED) => {
            Err(CUresult::NOT_SUPPORTED)
        }
        _ => Err(CUresult::INVALID_VALUE),
    }
}

/// What `cuMemCreate` and `cuMemGetAllocationGranularity` accept: pinned device memory of device 0,
/// exportable (as declared) at most as a POSIX file descriptor.
fn allocation_prop(prop: &CUmemAllocationProp) -> Result<(), CUresult> {
    if prop.kind != CU_MEM_ALLOCATION_TYPE_PINNED
        || prop.requested_handle_types & !HANDLE_TYPE_POSIX_FD != 0
    {
        return Err(CUresult::INVALID_VALUE);
    }
    device_location(&prop.location)
}

/// `CU_FUNC_ATTRIBUTE_PTX_VERSION`: major * 10 + minor of the module's `.version`.
fn ptx_version(text: &str) -> i32 {
    text.lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix(".version"))
        .and_then(|v| {
            let (major, minor) = v.trim().split_once('.')?;
            let minor = minor.split(|c: char| !c.is_ascii_digit()).next()?;
            Some(major.parse::<i32>().ok()? * 10 + minor.parse::<i32>().ok()?)
        })
        .unwrap_or(0)
}

/// The `CUresult` a failed launch leaves behind.
fn launch_error(e: &ExecError) -> CUresult {
    match e {
        ExecError::MemoryFault { .. } => CUresult::ILLEGAL_ADDRESS,
        ExecError::Misaligned { .. } => CUresult::MISALIGNED_ADDRESS,
        ExecError::Stopped(StopReason::Deadline | StopReason::Budget(_)) => {
            CUresult::LAUNCH_TIMEOUT
        }
        _ => CUresult::LAUNCH_FAILED,
    }
}

#[allow(non_snake_case)]
impl ApiBackend for EmuBackend {
    // --- Contexts -------------------------------------------------------------------------------------

    fn cuDevicePrimaryCtxRetain(
        &mut self,
        a: args::cuDevicePrimaryCtxRetain,
    ) -> Result<outs::cuDevicePrimaryCtxRetain, CUresult> {
        self.check()?;
        Self::device(a.dev)?;
        self.primary_refs += 1;
        self.primary_reset = false;
        Ok(outs::cuDevicePrimaryCtxRetain {
            pctx: PRIMARY,
            ..Default::default()
        })
    }

    fn cuDevicePrimaryCtxRelease_v2(
        &mut self,
        a: args::cuDevicePrimaryCtxRelease_v2,
    ) -> Result<outs::cuDevicePrimaryCtxRelease_v2, CUresult> {
        self.check()?;
        Self::device(a.dev)?;
        if self.primary_refs == 0 {
            return Err(CUresult::INVALID_CONTEXT);
        }
        self.primary_refs -= 1;
        if self.primary_refs == 0 {
            // The last release destroys the primary context's resources, as the driver does.
            self.destroy_resources(PRIMARY);
        }
        Ok(Default::default())
    }

    fn cuDevicePrimaryCtxReset_v2(
        &mut self,
        a: args::cuDevicePrimaryCtxReset_v2,
    ) -> Result<outs::cuDevicePrimaryCtxReset_v2, CUresult> {
        self.check()?;
        Self::device(a.dev)?;
        self.destroy_resources(PRIMARY);
        let (flags, id) = self
            .contexts
            .get(&PRIMARY)
            .map_or((0, 1), |c| (c.flags, c.id));
        self.contexts.insert(PRIMARY, Context::new(flags, id));
        self.primary_reset = true;
        Ok(Default::default())
    }

    fn cuDevicePrimaryCtxSetFlags_v2(
        &mut self,
        a: args::cuDevicePrimaryCtxSetFlags_v2,
    ) -> Result<outs::cuDevicePrimaryCtxSetFlags_v2, CUresult> {
        self.check()?;
        Self::device(a.dev)?;
        if a.flags & !CTX_FLAGS_MASK != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        if let Some(c) = self.contexts.get_mut(&PRIMARY) {
            c.flags = a.flags;
        }
        Ok(Default::default())
    }

    fn cuDevicePrimaryCtxGetState(
        &mut self,
        a: args::cuDevicePrimaryCtxGetState,
    ) -> Result<outs::cuDevicePrimaryCtxGetState, CUresult> {
        self.check()?;
        Self::device(a.dev)?;
        Ok(outs::cuDevicePrimaryCtxGetState {
            flags: self.contexts.get(&PRIMARY).map_or(0, |c| c.flags),
            active: i32::from(self.primary_refs > 0),
            ..Default::default()
        })
    }

    fn cuCtxCreate_v2(
        &mut self,
        a: args::cuCtxCreate_v2,
    ) -> Result<outs::cuCtxCreate_v2, CUresult> {
        self.check()?;
        Self::device(a.dev)?;
        Ok(outs::cuCtxCreate_v2 {
            pctx: self.create_context(a.flags)?,
            ..Default::default()
        })
    }

    fn cuCtxCreate_v3(
        &mut self,
        a: args::cuCtxCreate_v3,
    ) -> Result<outs::cuCtxCreate_v3, CUresult> {
        self.check()?;
        Self::device(a.dev)?;
        if a.num_params < 0 || a.params.kind != EXEC_AFFINITY_SM_COUNT {
            return Err(CUresult::INVALID_VALUE);
        }
        // The device reports no execution affinity support (cuDeviceGetExecAffinitySupport): limiting a
        // context to some of the host's cores is not emulated.
        if a.num_params > 0 {
            return Err(CUresult::UNSUPPORTED_EXEC_AFFINITY);
        }
        Ok(outs::cuCtxCreate_v3 {
            pctx: self.create_context(a.flags)?,
            ..Default::default()
        })
    }

    fn cuCtxDestroy_v2(
        &mut self,
        a: args::cuCtxDestroy_v2,
    ) -> Result<outs::cuCtxDestroy_v2, CUresult> {
        self.check()?;
        if a.ctx == PRIMARY || !self.contexts.contains_key(&a.ctx) {
            return Err(CUresult::INVALID_CONTEXT);
        }
        self.destroy_resources(a.ctx);
        self.contexts.remove(&a.ctx);
        if self.current == a.ctx {
            self.current = 0;
        }
        Ok(Default::default())
    }

    fn cuCtxSynchronize(
        &mut self,
        _: args::cuCtxSynchronize,
    ) -> Result<outs::cuCtxSynchronize, CUresult> {
        self.ctx()?;
        self.streams.synchronize_all();
        self.synchronized();
        self.check()?;
        Ok(Default::default())
    }

    fn cuCtxSynchronize_v2(
        &mut self,
        a: args::cuCtxSynchronize_v2,
    ) -> Result<outs::cuCtxSynchronize_v2, CUresult> {
        self.check()?;
        if a.ctx == 0 {
            self.ctx()?;
        } else if !self.contexts.contains_key(&a.ctx) {
            return Err(CUresult::INVALID_CONTEXT);
        }
        self.streams.synchronize_all();
        self.synchronized();
        self.check()?;
        Ok(Default::default())
    }

    fn cuCtxSetLimit(&mut self, a: args::cuCtxSetLimit) -> Result<outs::cuCtxSetLimit, CUresult> {
        let c = self.ctx_mut()?;
        let limit = a.limit as usize;
        if limit >= SETTABLE_LIMITS {
            return Err(CUresult::UNSUPPORTED_LIMIT);
        }
        c.limits[limit] = a.value;
        Ok(Default::default())
    }

    fn cuCtxGetLimit(&mut self, a: args::cuCtxGetLimit) -> Result<outs::cuCtxGetLimit, CUresult> {
        let c = self.ctx_mut()?;
        let v = *c
            .limits
            .get(a.limit as usize)
            .ok_or(CUresult::UNSUPPORTED_LIMIT)?;
        Ok(outs::cuCtxGetLimit {
            pvalue: v,
            ..Default::default()
        })
    }

    fn cuCtxSetCacheConfig(
        &mut self,
        a: args::cuCtxSetCacheConfig,
    ) -> Result<outs::cuCtxSetCacheConfig, CUresult> {
        let c = self.ctx_mut()?;
        if a.config > 3 {
            return Err(CUresult::INVALID_VALUE);
        }
        c.cache_config = a.config;
        Ok(Default::default())
    }

    fn cuCtxGetCacheConfig(
        &mut self,
        _: args::cuCtxGetCacheConfig,
    ) -> Result<outs::cuCtxGetCacheConfig, CUresult> {
        let c = self.ctx_mut()?;
        Ok(outs::cuCtxGetCacheConfig {
            pconfig: c.cache_config,
        })
    }

    fn cuCtxGetStreamPriorityRange(
        &mut self,
        _: args::cuCtxGetStreamPriorityRange,
    ) -> Result<outs::cuCtxGetStreamPriorityRange, CUresult> {
        self.ctx()?;
        let (least, greatest) = device::STREAM_PRIORITIES;
        Ok(outs::cuCtxGetStreamPriorityRange { least, greatest })
    }

    fn cuCtxGetFlags(&mut self, _: args::cuCtxGetFlags) -> Result<outs::cuCtxGetFlags, CUresult> {
        let c = self.ctx_mut()?;
        Ok(outs::cuCtxGetFlags { flags: c.flags })
    }

    fn cuCtxSetFlags(&mut self, a: args::cuCtxSetFlags) -> Result<outs::cuCtxSetFlags, CUresult> {
        let c = self.ctx_mut()?;
        if a.flags & !CTX_FLAGS_MASK != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        c.flags = a.flags;
        Ok(Default::default())
    }

    fn cuCtxGetId(&mut self, a: args::cuCtxGetId) -> Result<outs::cuCtxGetId, CUresult> {
        self.check()?;
        let ctx = if a.ctx == 0 { self.ctx()? } else { a.ctx };
        let c = self.contexts.get(&ctx).ok_or(CUresult::INVALID_CONTEXT)?;
        Ok(outs::cuCtxGetId {
            id: c.id,
            ..Default::default()
        })
    }

    fn cuCtxGetSharedMemConfig(
        &mut self,
        _: args::cuCtxGetSharedMemConfig,
    ) -> Result<outs::cuCtxGetSharedMemConfig, CUresult> {
        let c = self.ctx_mut()?;
        Ok(outs::cuCtxGetSharedMemConfig {
            config: c.shared_mem_config,
        })
    }

    fn cuCtxSetSharedMemConfig(
        &mut self,
        a: args::cuCtxSetSharedMemConfig,
    ) -> Result<outs::cuCtxSetSharedMemConfig, CUresult> {
        let c = self.ctx_mut()?;
        // CU_SHARED_MEM_CONFIG_DEFAULT_BANK_SIZE, FOUR_BYTE_BANK_SIZE, EIGHT_BYTE_BANK_SIZE.
        if a.config > 2 {
            return Err(CUresult::INVALID_VALUE);
        }
        c.shared_mem_config = a.config;
        Ok(Default::default())
    }

    fn cuCtxGetExecAffinity(
        &mut self,
        a: args::cuCtxGetExecAffinity,
    ) -> Result<outs::cuCtxGetExecAffinity, CUresult> {
        self.ctx()?;
        if a.type_ != EXEC_AFFINITY_SM_COUNT {
            return Err(CUresult::INVALID_VALUE);
        }
        // Every context may use the whole device.
        Ok(outs::cuCtxGetExecAffinity {
            affinity: gleam_protocol::types::CUexecAffinityParam {
                kind: EXEC_AFFINITY_SM_COUNT,
                value: device::multiprocessors().unsigned_abs(),
            },
            ..Default::default()
        })
    }

    fn cuCtxRecordEvent(
        &mut self,
        a: args::cuCtxRecordEvent,
    ) -> Result<outs::cuCtxRecordEvent, CUresult> {
        self.check()?;
        let ctx = if a.ctx == 0 { self.ctx()? } else { a.ctx };
        let e = self
            .events
            .get_mut(&a.event)
            .ok_or(CUresult::INVALID_HANDLE)?;
        if e.ctx != ctx {
            return Err(CUresult::INVALID_HANDLE);
        }
        e.records += 1;
        let (signal, target) = (e.signal.clone(), e.records);
        let marker = self.streams.enqueue_context_signal(ctx, signal, target)?;
        if let Some(e) = self.events.get_mut(&a.event) {
            e.marker = Some(marker);
        }
        Ok(Default::default())
    }

    fn cuCtxWaitEvent(
        &mut self,
        a: args::cuCtxWaitEvent,
    ) -> Result<outs::cuCtxWaitEvent, CUresult> {
        self.check()?;
        let ctx = if a.ctx == 0 { self.ctx()? } else { a.ctx };
        let e = self.events.get(&a.event).ok_or(CUresult::INVALID_HANDLE)?;
        if e.records > 0 {
            let (signal, target) = (e.signal.clone(), e.records);
            self.streams.context_wait(ctx, signal, target);
        }
        Ok(Default::default())
    }

    fn cuCtxResetPersistingL2Cache(
        &mut self,
        _: args::cuCtxResetPersistingL2Cache,
    ) -> Result<outs::cuCtxResetPersistingL2Cache, CUresult> {
        // No cache lines persist here (no L2 is emulated), so there is nothing to reset.
        self.ctx()?;
        Ok(Default::default())
    }

    fn cuDeviceCanAccessPeer(
        &mut self,
        a: args::cuDeviceCanAccessPeer,
    ) -> Result<outs::cuDeviceCanAccessPeer, CUresult> {
        Self::device(a.dev)?;
        Self::device(a.peer_dev)?;
        // One device: there is no peer to access (a device is not its own peer).
        Ok(outs::cuDeviceCanAccessPeer {
            can_access: 0,
            ..Default::default()
        })
    }

    fn cuDeviceGetP2PAttribute(
        &mut self,
        a: args::cuDeviceGetP2PAttribute,
    ) -> Result<outs::cuDeviceGetP2PAttribute, CUresult> {
        Self::device(a.src_dev)?;
        Self::device(a.dst_dev)?;
        // Source and destination must be two different devices, and there is only one.
        Err(CUresult::INVALID_DEVICE)
    }

    fn cuCtxEnablePeerAccess(
        &mut self,
        a: args::cuCtxEnablePeerAccess,
    ) -> Result<outs::cuCtxEnablePeerAccess, CUresult> {
        self.ctx()?;
        if a.flags != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        if !self.contexts.contains_key(&a.peer_ctx) {
            return Err(CUresult::INVALID_CONTEXT);
        }
        // Its context is on this same device, which cuDeviceCanAccessPeer says is no peer.
        Err(CUresult::INVALID_DEVICE)
    }

    fn cuCtxDisablePeerAccess(
        &mut self,
        a: args::cuCtxDisablePeerAccess,
    ) -> Result<outs::cuCtxDisablePeerAccess, CUresult> {
        self.ctx()?;
        if !self.contexts.contains_key(&a.peer_ctx) {
            return Err(CUresult::INVALID_CONTEXT);
        }
        // Never enabled (it cannot be).
        Err(CUresult::PEER_ACCESS_NOT_ENABLED)
    }

    fn cuProfilerStart(
        &mut self,
        _: args::cuProfilerStart,
    ) -> Result<outs::cuProfilerStart, CUresult> {
        // No profiler is attached to the interpreter: as on a GPU without one, starting it does nothing.
        self.ctx()?;
        Ok(Default::default())
    }

    fn cuProfilerStop(
        &mut self,
        _: args::cuProfilerStop,
    ) -> Result<outs::cuProfilerStop, CUresult> {
        self.ctx()?;
        Ok(Default::default())
    }

    fn cuCtxGetApiVersion(
        &mut self,
        a: args::cuCtxGetApiVersion,
    ) -> Result<outs::cuCtxGetApiVersion, CUresult> {
        self.check()?;
        let ctx = if a.ctx == 0 { self.ctx()? } else { a.ctx };
        if !self.contexts.contains_key(&ctx) {
            return Err(CUresult::INVALID_CONTEXT);
        }
        Ok(outs::cuCtxGetApiVersion {
            version: 3020,
            ..Default::default()
        })
    }

    // --- Memory ---------------------------------------------------------------------------------------

    fn cuMemAlloc_v2(&mut self, a: args::cuMemAlloc_v2) -> Result<outs::cuMemAlloc_v2, CUresult> {
        let ctx = self.ctx()?;
        let dptr = self.shared.mem.alloc(a.bytesize as u64, ALLOC_ALIGN, ctx)?;
        Ok(outs::cuMemAlloc_v2 {
            dptr,
            ..Default::default()
        })
    }

    fn cuMemAllocPitch_v2(
        &mut self,
        a: args::cuMemAllocPitch_v2,
    ) -> Result<outs::cuMemAllocPitch_v2, CUresult> {
        let ctx = self.ctx()?;
        if !matches!(a.element_size, 4 | 8 | 16) || a.width == 0 || a.height == 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        // Rows aligned like textures (TEXTURE_PITCH_ALIGNMENT is 32; the driver uses 512 for speed).
        let pitch = a
            .width
            .checked_next_multiple_of(512)
            .ok_or(CUresult::INVALID_VALUE)?;
        let bytes = pitch.checked_mul(a.height).ok_or(CUresult::OUT_OF_MEMORY)?;
        let dptr = self.shared.mem.alloc(bytes as u64, ALLOC_ALIGN, ctx)?;
        Ok(outs::cuMemAllocPitch_v2 {
            dptr,
            pitch,
            ..Default::default()
        })
    }

    fn cuMemFree_v2(&mut self, a: args::cuMemFree_v2) -> Result<outs::cuMemFree_v2, CUresult> {
        self.ctx()?;
        if self.shared.mem.address_range(a.dptr).map(|r| r.0) != Some(a.dptr) {
            return Err(CUresult::INVALID_VALUE);
        }
        self.mirrored.before_free(a.dptr)?;
        // cuMemFree synchronises with the device: nothing still queued may touch the memory.
        self.streams.synchronize_all();
        // Memory from a pool goes back to its pool.
        let pool = self.shared.pools().begin_free(a.dptr)?;
        match pool {
            Some(pool) => self
                .shared
                .pools()
                .finish_free(pool, a.dptr, &self.shared.mem),
            None => self.shared.mem.free(a.dptr)?,
        }
        Ok(Default::default())
    }

    fn cuDeviceGetExecAffinitySupport(
        &mut self,
        a: args::cuDeviceGetExecAffinitySupport,
    ) -> Result<outs::cuDeviceGetExecAffinitySupport, CUresult> {
        self.check()?;
        Self::device(a.dev)?;
        // CU_EXEC_AFFINITY_TYPE_SM_COUNT is the only affinity type; the interpreter's "multiprocessors"
        // cannot be partitioned, so it is not supported.
        const SM_COUNT: u32 = 0;
        if a.type_ != SM_COUNT {
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(outs::cuDeviceGetExecAffinitySupport {
            pi: 0,
            ..Default::default()
        })
    }

    fn cuMemGetInfo_v2(
        &mut self,
        _: args::cuMemGetInfo_v2,
    ) -> Result<outs::cuMemGetInfo_v2, CUresult> {
        self.ctx()?;
        let (free, total) = self.shared.mem.info();
        Ok(outs::cuMemGetInfo_v2 {
            free: free as usize,
            total: total as usize,
        })
    }

    fn cuMemGetAddressRange_v2(
        &mut self,
        a: args::cuMemGetAddressRange_v2,
    ) -> Result<outs::cuMemGetAddressRange_v2, CUresult> {
        self.ctx()?;
        let (base, size) = self
            .shared
            .mem
            .address_range(a.dptr)
            .ok_or(CUresult::NOT_FOUND)?;
        Ok(outs::cuMemGetAddressRange_v2 {
            base,
            size: size as usize,
            ..Default::default()
        })
    }

    fn cuMemcpyDtoD_v2(
        &mut self,
        a: args::cuMemcpyDtoD_v2,
    ) -> Result<outs::cuMemcpyDtoD_v2, CUresult> {
        self.dtod(a.dst, a.src, a.bytes, 0)?;
        Ok(Default::default())
    }

    fn cuMemcpyDtoDAsync_v2(
        &mut self,
        a: args::cuMemcpyDtoDAsync_v2,
    ) -> Result<outs::cuMemcpyDtoDAsync_v2, CUresult> {
        self.dtod(a.dst, a.src, a.bytes, a.stream)?;
        Ok(Default::default())
    }

    fn cuMemsetD8_v2(&mut self, a: args::cuMemsetD8_v2) -> Result<outs::cuMemsetD8_v2, CUresult> {
        self.memset(a.dst, vec![a.value], a.n, 0)?;
        Ok(Default::default())
    }

    fn cuMemsetD16_v2(
        &mut self,
        a: args::cuMemsetD16_v2,
    ) -> Result<outs::cuMemsetD16_v2, CUresult> {
        self.memset(a.dst, a.value.to_le_bytes().to_vec(), a.n, 0)?;
        Ok(Default::default())
    }

    fn cuMemsetD32_v2(
        &mut self,
        a: args::cuMemsetD32_v2,
    ) -> Result<outs::cuMemsetD32_v2, CUresult> {
        self.memset(a.dst, a.value.to_le_bytes().to_vec(), a.n, 0)?;
        Ok(Default::default())
    }

    fn cuMemsetD2D8_v2(
        &mut self,
        a: args::cuMemsetD2D8_v2,
    ) -> Result<outs::cuMemsetD2D8_v2, CUresult> {
        self.memset2d(a.dst, a.pitch, vec![a.value], (a.width, a.height), 0)?;
        Ok(Default::default())
    }

    fn cuMemsetD2D8Async(
        &mut self,
        a: args::cuMemsetD2D8Async,
    ) -> Result<outs::cuMemsetD2D8Async, CUresult> {
        self.memset2d(a.dst, a.pitch, vec![a.value], (a.width, a.height), a.stream)?;
        Ok(Default::default())
    }

    fn cuMemsetD2D16_v2(
        &mut self,
        a: args::cuMemsetD2D16_v2,
    ) -> Result<outs::cuMemsetD2D16_v2, CUresult> {
        self.memset2d(
            a.dst,
            a.pitch,
            a.value.to_le_bytes().to_vec(),
            (a.width, a.height),
            0,
        )?;
        Ok(Default::default())
    }

    fn cuMemsetD2D16Async(
        &mut self,
        a: args::cuMemsetD2D16Async,
    ) -> Result<outs::cuMemsetD2D16Async, CUresult> {
        self.memset2d(
            a.dst,
            a.pitch,
            a.value.to_le_bytes().to_vec(),
            (a.width, a.height),
            a.stream,
        )?;
        Ok(Default::default())
    }

    fn cuMemsetD2D32_v2(
        &mut self,
        a: args::cuMemsetD2D32_v2,
    ) -> Result<outs::cuMemsetD2D32_v2, CUresult> {
        self.memset2d(
            a.dst,
            a.pitch,
            a.value.to_le_bytes().to_vec(),
            (a.width, a.height),
            0,
        )?;
        Ok(Default::default())
    }

    fn cuMemsetD2D32Async(
        &mut self,
        a: args::cuMemsetD2D32Async,
    ) -> Result<outs::cuMemsetD2D32Async, CUresult> {
        self.memset2d(
            a.dst,
            a.pitch,
            a.value.to_le_bytes().to_vec(),
            (a.width, a.height),
            a.stream,
        )?;
        Ok(Default::default())
    }

    fn cuMemcpyPeer(&mut self, a: args::cuMemcpyPeer) -> Result<outs::cuMemcpyPeer, CUresult> {
        self.peer_copy((a.dst, a.dst_ctx), (a.src, a.src_ctx), a.bytes, 0)?;
        Ok(Default::default())
    }

    fn cuMemcpyPeerAsync(
        &mut self,
        a: args::cuMemcpyPeerAsync,
    ) -> Result<outs::cuMemcpyPeerAsync, CUresult> {
        self.peer_copy((a.dst, a.dst_ctx), (a.src, a.src_ctx), a.bytes, a.stream)?;
        Ok(Default::default())
    }

    fn cuMemsetD8Async(
        &mut self,
        a: args::cuMemsetD8Async,
    ) -> Result<outs::cuMemsetD8Async, CUresult> {
        self.memset(a.dst, vec![a.value], a.n, a.stream)?;
        Ok(Default::default())
    }

    fn cuMemsetD16Async(
        &mut self,
        a: args::cuMemsetD16Async,
    ) -> Result<outs::cuMemsetD16Async, CUresult> {
        self.memset(a.dst, a.value.to_le_bytes().to_vec(), a.n, a.stream)?;
        Ok(Default::default())
    }

    fn cuMemsetD32Async(
        &mut self,
        a: args::cuMemsetD32Async,
    ) -> Result<outs::cuMemsetD32Async, CUresult> {
        self.memset(a.dst, a.value.to_le_bytes().to_vec(), a.n, a.stream)?;
        Ok(Default::default())
    }

    fn cuMemAllocAsync(
        &mut self,
        a: args::cuMemAllocAsync,
    ) -> Result<outs::cuMemAllocAsync, CUresult> {
        Ok(outs::cuMemAllocAsync {
            dptr: self.pool_alloc(0, a.bytesize, a.stream)?,
            ..Default::default()
        })
    }

    fn cuMemAllocFromPoolAsync(
        &mut self,
        a: args::cuMemAllocFromPoolAsync,
    ) -> Result<outs::cuMemAllocFromPoolAsync, CUresult> {
        Ok(outs::cuMemAllocFromPoolAsync {
            dptr: self.pool_alloc(a.pool, a.bytesize, a.stream)?,
            ..Default::default()
        })
    }

    fn cuMemFreeAsync(
        &mut self,
        a: args::cuMemFreeAsync,
    ) -> Result<outs::cuMemFreeAsync, CUresult> {
        self.ctx()?;
        let key = self.streams.resolve(a.stream)?;
        let dptr = a.dptr;
        if self.shared.mem.address_range(dptr).map(|r| r.0) != Some(dptr) {
            return Err(CUresult::INVALID_VALUE);
        }
        // Taken out of its pool's outstanding allocations now, so a second free is refused at once; the
        // memory goes back to the pool (or, from cuMemAlloc, to the device) when the stream gets there,
        // so a later allocation never gets memory that earlier work may still use. Never skipped: after a
        // fault or at the session's end, memory still has to go back.
        let pool = self.shared.pools().begin_free(dptr)?;
        let shared = self.shared.clone();
        let job: Job = Box::new(move || match pool {
            Some(pool) => shared.pools().finish_free(pool, dptr, &shared.mem),
            None => {
                if shared.mem.free(dptr).is_err() {
                    tracing::warn!(dptr, "cuMemFreeAsync: the memory was already freed");
                }
            }
        });
        self.streams
            .enqueue(key, self.current, Vec::new(), Some(job))?;
        Ok(Default::default())
    }

    // --- Memory pools ---------------------------------------------------------------------------------

    fn cuDeviceGetDefaultMemPool(
        &mut self,
        a: args::cuDeviceGetDefaultMemPool,
    ) -> Result<outs::cuDeviceGetDefaultMemPool, CUresult> {
        self.check()?;
        Self::device(a.dev)?;
        Ok(outs::cuDeviceGetDefaultMemPool {
            pool_out: self.shared.pools().default_pool(),
            ..Default::default()
        })
    }

    fn cuDeviceGetMemPool(
        &mut self,
        a: args::cuDeviceGetMemPool,
    ) -> Result<outs::cuDeviceGetMemPool, CUresult> {
        self.check()?;
        Self::device(a.dev)?;
        Ok(outs::cuDeviceGetMemPool {
            pool: self.shared.pools().current(),
            ..Default::default()
        })
    }

    fn cuDeviceSetMemPool(
        &mut self,
        a: args::cuDeviceSetMemPool,
    ) -> Result<outs::cuDeviceSetMemPool, CUresult> {
        self.check()?;
        Self::device(a.dev)?;
        self.shared.pools().set_current(a.pool)?;
        Ok(Default::default())
    }

    fn cuMemGetDefaultMemPool(
        &mut self,
        a: args::cuMemGetDefaultMemPool,
    ) -> Result<outs::cuMemGetDefaultMemPool, CUresult> {
        self.check()?;
        pool_location(&a.location, a.type_)?;
        Ok(outs::cuMemGetDefaultMemPool {
            pool_out: self.shared.pools().default_pool(),
            ..Default::default()
        })
    }

    fn cuMemGetMemPool(
        &mut self,
        a: args::cuMemGetMemPool,
    ) -> Result<outs::cuMemGetMemPool, CUresult> {
        self.check()?;
        pool_location(&a.location, a.type_)?;
        Ok(outs::cuMemGetMemPool {
            pool: self.shared.pools().current(),
            ..Default::default()
        })
    }

    fn cuMemSetMemPool(
        &mut self,
        a: args::cuMemSetMemPool,
    ) -> Result<outs::cuMemSetMemPool, CUresult> {
        self.check()?;
        pool_location(&a.location, a.type_)?;
        self.shared.pools().set_current(a.pool)?;
        Ok(Default::default())
    }

    fn cuMemPoolCreate(
        &mut self,
        a: args::cuMemPoolCreate,
    ) -> Result<outs::cuMemPoolCreate, CUresult> {
        self.check()?;
        Ok(outs::cuMemPoolCreate {
            pool: self.shared.pools().create(*a.props)?,
            ..Default::default()
        })
    }

    fn cuMemPoolDestroy(
        &mut self,
        a: args::cuMemPoolDestroy,
    ) -> Result<outs::cuMemPoolDestroy, CUresult> {
        self.check()?;
        self.shared.pools().destroy(a.pool, &self.shared.mem)?;
        Ok(Default::default())
    }

    fn cuMemPoolGetAttribute(
        &mut self,
        a: args::cuMemPoolGetAttribute,
    ) -> Result<outs::cuMemPoolGetAttribute, CUresult> {
        self.check()?;
        Ok(outs::cuMemPoolGetAttribute {
            value: self.shared.pools().attribute(a.pool, a.attr)?,
            ..Default::default()
        })
    }

    fn cuMemPoolSetAttribute(
        &mut self,
        a: args::cuMemPoolSetAttribute,
    ) -> Result<outs::cuMemPoolSetAttribute, CUresult> {
        self.check()?;
        // An `int` attribute arrives in the low half of the value.
        let value = if pools::attribute_is_int(a.attr) {
            *a.value & 0xffff_ffff
        } else {
            *a.value
        };
        self.shared.pools().set_attribute(a.pool, a.attr, value)?;
        Ok(Default::default())
    }

    fn cuMemPoolTrimTo(
        &mut self,
        a: args::cuMemPoolTrimTo,
    ) -> Result<outs::cuMemPoolTrimTo, CUresult> {
        self.check()?;
        self.shared
            .pools()
            .trim_to(a.pool, a.min_bytes_to_keep as u64, &self.shared.mem)?;
        Ok(Default::default())
    }

    fn cuMemPoolGetAccess(
        &mut self,
        a: args::cuMemPoolGetAccess,
    ) -> Result<outs::cuMemPoolGetAccess, CUresult> {
        self.check()?;
        Ok(outs::cuMemPoolGetAccess {
            flags: self.shared.pools().access(a.pool, &a.location)?,
            ..Default::default()
        })
    }

    fn cuMemPoolSetAccess(
        &mut self,
        a: args::cuMemPoolSetAccess,
    ) -> Result<outs::cuMemPoolSetAccess, CUresult> {
        self.check()?;
        self.shared
            .pools()
            .set_access(a.pool, &a.map.location, a.map.flags)?;
        Ok(Default::default())
    }

    // --- Virtual memory management --------------------------------------------------------------------

    fn cuMemGetAllocationGranularity(
        &mut self,
        a: args::cuMemGetAllocationGranularity,
    ) -> Result<outs::cuMemGetAllocationGranularity, CUresult> {
        self.check()?;
        allocation_prop(&a.prop)?;
        // CU_MEM_ALLOC_GRANULARITY_MINIMUM and _RECOMMENDED: the same here.
        if a.option > 1 {
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(outs::cuMemGetAllocationGranularity {
            granularity: GRANULARITY as usize,
            ..Default::default()
        })
    }

    fn cuMemCreate(&mut self, a: args::cuMemCreate) -> Result<outs::cuMemCreate, CUresult> {
        self.ctx()?;
        allocation_prop(&a.prop)?;
        if a.flags != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(outs::cuMemCreate {
            handle: self.shared.mem.create_physical(a.size as u64, *a.prop)?,
            ..Default::default()
        })
    }

    fn cuMemRelease(&mut self, a: args::cuMemRelease) -> Result<outs::cuMemRelease, CUresult> {
        self.check()?;
        self.shared.mem.release_physical(a.handle)?;
        Ok(Default::default())
    }

    fn cuMemRetainAllocationHandle(
        &mut self,
        a: args::cuMemRetainAllocationHandle,
    ) -> Result<outs::cuMemRetainAllocationHandle, CUresult> {
        self.check()?;
        Ok(outs::cuMemRetainAllocationHandle {
            handle: self.shared.mem.retain_physical(a.addr)?,
            ..Default::default()
        })
    }

    fn cuMemGetAllocationPropertiesFromHandle(
        &mut self,
        a: args::cuMemGetAllocationPropertiesFromHandle,
    ) -> Result<outs::cuMemGetAllocationPropertiesFromHandle, CUresult> {
        self.check()?;
        Ok(outs::cuMemGetAllocationPropertiesFromHandle {
            prop: self.shared.mem.physical_properties(a.handle)?,
            ..Default::default()
        })
    }

    fn cuMemAddressReserve(
        &mut self,
        a: args::cuMemAddressReserve,
    ) -> Result<outs::cuMemAddressReserve, CUresult> {
        self.check()?;
        if a.flags != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(outs::cuMemAddressReserve {
            ptr: self
                .shared
                .mem
                .reserve(a.size as u64, a.alignment as u64, a.addr)?,
            ..Default::default()
        })
    }

    fn cuMemAddressFree(
        &mut self,
        a: args::cuMemAddressFree,
    ) -> Result<outs::cuMemAddressFree, CUresult> {
        self.check()?;
        self.shared.mem.address_free(a.ptr, a.size as u64)?;
        Ok(Default::default())
    }

    fn cuMemMap(&mut self, a: args::cuMemMap) -> Result<outs::cuMemMap, CUresult> {
        self.check()?;
        if a.flags != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        self.shared
            .mem
            .map(a.ptr, a.size as u64, a.offset as u64, a.handle)?;
        Ok(Default::default())
    }

    fn cuMemUnmap(&mut self, a: args::cuMemUnmap) -> Result<outs::cuMemUnmap, CUresult> {
        self.check()?;
        // Unmapping waits for the device, as cuMemFree does: queued work may still use the range.
        self.streams.synchronize_all();
        self.shared.mem.unmap(a.ptr, a.size as u64)?;
        Ok(Default::default())
    }

    fn cuMemSetAccess(
        &mut self,
        a: args::cuMemSetAccess,
    ) -> Result<outs::cuMemSetAccess, CUresult> {
        self.check()?;
        device_location(&a.desc.location)?;
        self.shared
            .mem
            .set_access(a.ptr, a.size as u64, a.desc.flags)?;
        Ok(Default::default())
    }

    fn cuMemGetAccess(
        &mut self,
        a: args::cuMemGetAccess,
    ) -> Result<outs::cuMemGetAccess, CUresult> {
        self.check()?;
        device_location(&a.location)?;
        Ok(outs::cuMemGetAccess {
            flags: u64::from(self.shared.mem.access(a.ptr)?),
            ..Default::default()
        })
    }

    // --- Modules and functions ------------------------------------------------------------------------

    fn cuModuleUnload(
        &mut self,
        a: args::cuModuleUnload,
    ) -> Result<outs::cuModuleUnload, CUresult> {
        self.check()?;
        if !self.modules.contains_key(&a.module) {
            return Err(CUresult::INVALID_HANDLE);
        }
        // Kernels of the module may still be queued: let them finish before its globals go.
        self.streams.synchronize_all();
        self.unload(a.module);
        Ok(Default::default())
    }

    fn cuModuleGetGlobal_v2(
        &mut self,
        a: args::cuModuleGetGlobal_v2,
    ) -> Result<outs::cuModuleGetGlobal_v2, CUresult> {
        self.check()?;
        // One of the out-pointers (not both) may be NULL.
        if !a.dptr && !a.bytes {
            return Err(CUresult::INVALID_VALUE);
        }
        let m = self
            .modules
            .get(&a.module)
            .ok_or(CUresult::INVALID_HANDLE)?;
        let &(dptr, size) = m.globals.get(&a.name).ok_or(CUresult::NOT_FOUND)?;
        Ok(outs::cuModuleGetGlobal_v2 {
            dptr,
            bytes: size as usize,
            ..Default::default()
        })
    }

    fn cuFuncGetAttribute(
        &mut self,
        a: args::cuFuncGetAttribute,
    ) -> Result<outs::cuFuncGetAttribute, CUresult> {
        Ok(outs::cuFuncGetAttribute {
            value: self.func_attribute(a.func, a.attrib)?,
            ..Default::default()
        })
    }

    fn cuFuncSetAttribute(
        &mut self,
        a: args::cuFuncSetAttribute,
    ) -> Result<outs::cuFuncSetAttribute, CUresult> {
        self.set_func_attribute(a.func, a.attrib, a.value)?;
        Ok(Default::default())
    }

    fn cuFuncSetCacheConfig(
        &mut self,
        a: args::cuFuncSetCacheConfig,
    ) -> Result<outs::cuFuncSetCacheConfig, CUresult> {
        self.function(a.func)?;
        if a.config > 3 {
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(Default::default())
    }

    fn cuFuncSetSharedMemConfig(
        &mut self,
        a: args::cuFuncSetSharedMemConfig,
    ) -> Result<outs::cuFuncSetSharedMemConfig, CUresult> {
        self.function(a.func)?;
        if a.config > 2 {
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(Default::default())
    }

    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
        &mut self,
        a: args::cuOccupancyMaxActiveBlocksPerMultiprocessor,
    ) -> Result<outs::cuOccupancyMaxActiveBlocksPerMultiprocessor, CUresult> {
        let f = self.function(a.func)?;
        let block = u32::try_from(a.block_size).map_err(|_| CUresult::INVALID_VALUE)?;
        let n = device::max_active_blocks(&f.resources, block, a.dynamic_smem as u64);
        Ok(outs::cuOccupancyMaxActiveBlocksPerMultiprocessor {
            num_blocks: n as i32,
            ..Default::default()
        })
    }

    fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
        &mut self,
        a: args::cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags,
    ) -> Result<outs::cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags, CUresult> {
        let f = self.function(a.func)?;
        // Flags: 0 = default, 1 = disable caching override; neither changes this model.
        if a.flags > 1 {
            return Err(CUresult::INVALID_VALUE);
        }
        let block = u32::try_from(a.block_size).map_err(|_| CUresult::INVALID_VALUE)?;
        let n = device::max_active_blocks(&f.resources, block, a.dynamic_smem as u64);
        Ok(outs::cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags {
            num_blocks: n as i32,
            ..Default::default()
        })
    }

    fn cuOccupancyAvailableDynamicSMemPerBlock(
        &mut self,
        a: args::cuOccupancyAvailableDynamicSMemPerBlock,
    ) -> Result<outs::cuOccupancyAvailableDynamicSMemPerBlock, CUresult> {
        let f = self.function(a.func)?;
        let blocks = u32::try_from(a.num_blocks).map_err(|_| CUresult::INVALID_VALUE)?;
        let block = u32::try_from(a.block_size).map_err(|_| CUresult::INVALID_VALUE)?;
        let n = device::available_dynamic_shared(&f.resources, blocks, block);
        Ok(outs::cuOccupancyAvailableDynamicSMemPerBlock {
            dynamic_smem: n as usize,
            ..Default::default()
        })
    }

    fn cuLibraryUnload(
        &mut self,
        a: args::cuLibraryUnload,
    ) -> Result<outs::cuLibraryUnload, CUresult> {
        self.check()?;
        let module = self
            .libraries
            .remove(&a.library)
            .ok_or(CUresult::INVALID_HANDLE)?;
        self.streams.synchronize_all();
        self.unload(module);
        Ok(Default::default())
    }

    fn cuLibraryGetKernel(
        &mut self,
        a: args::cuLibraryGetKernel,
    ) -> Result<outs::cuLibraryGetKernel, CUresult> {
        self.check()?;
        let module = *self
            .libraries
            .get(&a.library)
            .ok_or(CUresult::INVALID_HANDLE)?;
        // A kernel is its function here: CUDA accepts a CUkernel wherever a CUfunction goes.
        let kernel = self.get_function(module, &a.name)?;
        Ok(outs::cuLibraryGetKernel {
            kernel,
            ..Default::default()
        })
    }

    fn cuLibraryGetModule(
        &mut self,
        a: args::cuLibraryGetModule,
    ) -> Result<outs::cuLibraryGetModule, CUresult> {
        self.check()?;
        let module = *self
            .libraries
            .get(&a.library)
            .ok_or(CUresult::INVALID_HANDLE)?;
        Ok(outs::cuLibraryGetModule {
            module,
            ..Default::default()
        })
    }

    fn cuLibraryGetGlobal(
        &mut self,
        a: args::cuLibraryGetGlobal,
    ) -> Result<outs::cuLibraryGetGlobal, CUresult> {
        self.check()?;
        if !a.dptr && !a.bytes {
            return Err(CUresult::INVALID_VALUE);
        }
        let module = *self
            .libraries
            .get(&a.library)
            .ok_or(CUresult::INVALID_HANDLE)?;
        let m = self.modules.get(&module).ok_or(CUresult::INVALID_HANDLE)?;
        let &(dptr, size) = m.globals.get(&a.name).ok_or(CUresult::NOT_FOUND)?;
        Ok(outs::cuLibraryGetGlobal {
            dptr,
            bytes: size as usize,
            ..Default::default()
        })
    }

    fn cuKernelGetAttribute(
        &mut self,
        a: args::cuKernelGetAttribute,
    ) -> Result<outs::cuKernelGetAttribute, CUresult> {
        Self::device(a.dev)?;
        Ok(outs::cuKernelGetAttribute {
            value: self.func_attribute(a.kernel, a.attrib)?,
            ..Default::default()
        })
    }

    fn cuKernelSetAttribute(
        &mut self,
        a: args::cuKernelSetAttribute,
    ) -> Result<outs::cuKernelSetAttribute, CUresult> {
        Self::device(a.dev)?;
        self.set_func_attribute(a.kernel, a.attrib, a.value)?;
        Ok(Default::default())
    }

    fn cuKernelSetCacheConfig(
        &mut self,
        a: args::cuKernelSetCacheConfig,
    ) -> Result<outs::cuKernelSetCacheConfig, CUresult> {
        Self::device(a.dev)?;
        self.function(a.kernel)?;
        // CU_FUNC_CACHE_PREFER_NONE .. PREFER_EQUAL: a preference the interpreter has no cache to apply.
        if a.config > 3 {
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(Default::default())
    }

    // --- Stream capture and graphs ---------------------------------------------------------------------

    fn cuStreamBeginCapture_v2(
        &mut self,
        a: args::cuStreamBeginCapture_v2,
    ) -> Result<outs::cuStreamBeginCapture_v2, CUresult> {
        self.ctx()?;
        if a.mode > 2 {
            return Err(CUresult::INVALID_VALUE);
        }
        let key = self.streams.resolve(a.stream)?;
        let graph = self.handle(kind::GRAPH);
        self.captures.begin(key, graph)?;
        Ok(Default::default())
    }

    fn cuStreamEndCapture(
        &mut self,
        a: args::cuStreamEndCapture,
    ) -> Result<outs::cuStreamEndCapture, CUresult> {
        self.check()?;
        let key = self.streams.resolve(a.stream)?;
        Ok(outs::cuStreamEndCapture {
            graph: self.captures.end(key)?,
            ..Default::default()
        })
    }

    fn cuStreamGetCaptureInfo(
        &mut self,
        a: args::cuStreamGetCaptureInfo,
    ) -> Result<outs::cuStreamGetCaptureInfo, CUresult> {
        self.check()?;
        let key = self.streams.resolve(a.stream)?;
        let (status, id, _) = self.captures.info(key);
        Ok(outs::cuStreamGetCaptureInfo {
            status,
            id,
            ..Default::default()
        })
    }

    fn cuStreamGetCaptureInfo_v2(
        &mut self,
        a: args::cuStreamGetCaptureInfo_v2,
    ) -> Result<outs::cuStreamGetCaptureInfo_v2, CUresult> {
        self.check()?;
        let key = self.streams.resolve(a.stream)?;
        let (status, id, graph) = self.captures.info(key);
        let active = status != STATUS_NONE;
        Ok(outs::cuStreamGetCaptureInfo_v2 {
            status,
            id: if active { id } else { 0 },
            graph: if active { graph } else { 0 },
            // Steps run in order: at most the last one is a dependency of the next.
            deps: 0,
            num_deps: 0,
            ..Default::default()
        })
    }

    fn cuThreadExchangeStreamCaptureMode(
        &mut self,
        a: args::cuThreadExchangeStreamCaptureMode,
    ) -> Result<outs::cuThreadExchangeStreamCaptureMode, CUresult> {
        Ok(outs::cuThreadExchangeStreamCaptureMode {
            mode: self.captures.exchange_mode(a.mode)?,
        })
    }

    fn cuGraphInstantiateWithFlags(
        &mut self,
        a: args::cuGraphInstantiateWithFlags,
    ) -> Result<outs::cuGraphInstantiateWithFlags, CUresult> {
        self.ctx()?;
        // Flags: auto-free on launch, upload, device launch, use node priority: none changes a replay here.
        // A graph launched from the device cannot free memory on launch (CUDA refuses the pair).
        if a.flags & !0xf != 0
            || a.flags & (GRAPH_AUTO_FREE_ON_LAUNCH | GRAPH_DEVICE_LAUNCH)
                == GRAPH_AUTO_FREE_ON_LAUNCH | GRAPH_DEVICE_LAUNCH
        {
            return Err(CUresult::INVALID_VALUE);
        }
        let exec = self.handle(kind::GRAPH_EXEC);
        self.captures.instantiate(a.graph, exec)?;
        Ok(outs::cuGraphInstantiateWithFlags {
            exec,
            ..Default::default()
        })
    }

    fn cuGraphLaunch(&mut self, a: args::cuGraphLaunch) -> Result<outs::cuGraphLaunch, CUresult> {
        self.ctx()?;
        let steps = self.captures.exec(a.exec)?;
        self.submit_steps(a.stream, steps.to_vec())?;
        Ok(Default::default())
    }

    // The graph queries answer counts (node handles stay on the peer: the shim asks with NULL arrays). A
    // captured graph here is a chain: one node per step, one root, an edge between neighbours.
    fn cuGraphGetNodes(
        &mut self,
        a: args::cuGraphGetNodes,
    ) -> Result<outs::cuGraphGetNodes, CUresult> {
        Ok(outs::cuGraphGetNodes {
            num_nodes: self.captures.graph(a.graph)?.len(),
            ..Default::default()
        })
    }

    fn cuGraphGetRootNodes(
        &mut self,
        a: args::cuGraphGetRootNodes,
    ) -> Result<outs::cuGraphGetRootNodes, CUresult> {
        Ok(outs::cuGraphGetRootNodes {
            num_nodes: self.captures.graph(a.graph)?.len().min(1),
            ..Default::default()
        })
    }

    fn cuGraphGetEdges(
        &mut self,
        a: args::cuGraphGetEdges,
    ) -> Result<outs::cuGraphGetEdges, CUresult> {
        Ok(outs::cuGraphGetEdges {
            num_edges: self.captures.edges(a.graph)?,
            ..Default::default()
        })
    }

    fn cuGraphGetEdges_v2(
        &mut self,
        a: args::cuGraphGetEdges_v2,
    ) -> Result<outs::cuGraphGetEdges_v2, CUresult> {
        Ok(outs::cuGraphGetEdges_v2 {
            num_edges: self.captures.edges(a.graph)?,
            ..Default::default()
        })
    }

    fn cuGraphUpload(&mut self, a: args::cuGraphUpload) -> Result<outs::cuGraphUpload, CUresult> {
        self.ctx()?;
        self.captures.exec(a.exec)?;
        self.streams.resolve(a.stream)?;
        Ok(Default::default())
    }

    fn cuGraphExecDestroy(
        &mut self,
        a: args::cuGraphExecDestroy,
    ) -> Result<outs::cuGraphExecDestroy, CUresult> {
        self.captures.exec(a.exec)?;
        self.captures.forget(a.exec);
        Ok(Default::default())
    }

    fn cuGraphDestroy(
        &mut self,
        a: args::cuGraphDestroy,
    ) -> Result<outs::cuGraphDestroy, CUresult> {
        self.captures.forget(a.graph);
        Ok(Default::default())
    }

    // --- Streams --------------------------------------------------------------------------------------

    fn cuStreamCreate(
        &mut self,
        a: args::cuStreamCreate,
    ) -> Result<outs::cuStreamCreate, CUresult> {
        let stream = self.create_stream(a.flags, 0)?;
        Ok(outs::cuStreamCreate {
            stream,
            ..Default::default()
        })
    }

    fn cuStreamCreateWithPriority(
        &mut self,
        a: args::cuStreamCreateWithPriority,
    ) -> Result<outs::cuStreamCreateWithPriority, CUresult> {
        let stream = self.create_stream(a.flags, a.priority)?;
        Ok(outs::cuStreamCreateWithPriority {
            stream,
            ..Default::default()
        })
    }

    fn cuStreamDestroy_v2(
        &mut self,
        a: args::cuStreamDestroy_v2,
    ) -> Result<outs::cuStreamDestroy_v2, CUresult> {
        self.check()?;
        self.streams.destroy(a.stream)?;
        self.stream_attrs.remove(&StreamKey::Created(a.stream));
        Ok(Default::default())
    }

    fn cuStreamSynchronize(
        &mut self,
        a: args::cuStreamSynchronize,
    ) -> Result<outs::cuStreamSynchronize, CUresult> {
        self.check()?;
        self.not_capturing(a.stream)?;
        self.sync_stream(Some(a.stream))?;
        Ok(Default::default())
    }

    fn cuStreamQuery(&mut self, a: args::cuStreamQuery) -> Result<outs::cuStreamQuery, CUresult> {
        self.check()?;
        self.not_capturing(a.stream)?;
        let key = self.streams.resolve(a.stream)?;
        if self.streams.busy(key) {
            return Err(CUresult::NOT_READY);
        }
        self.check()?;
        Ok(Default::default())
    }

    fn cuStreamWaitEvent(
        &mut self,
        a: args::cuStreamWaitEvent,
    ) -> Result<outs::cuStreamWaitEvent, CUresult> {
        self.check()?;
        if a.flags > 1 {
            return Err(CUresult::INVALID_VALUE);
        }
        let key = self.streams.resolve(a.stream)?;
        let e = self.events.get(&a.event).ok_or(CUresult::INVALID_HANDLE)?;
        // An event recorded in a capture brings this stream into that capture.
        if self.captures.wait_event(key, a.event)? {
            return Ok(Default::default());
        }
        // Waiting for a never-recorded event waits for nothing.
        if e.records > 0 {
            let dep = (e.signal.clone(), e.records);
            self.streams.enqueue(key, self.current, vec![dep], None)?;
        }
        Ok(Default::default())
    }

    fn cuStreamGetPriority(
        &mut self,
        a: args::cuStreamGetPriority,
    ) -> Result<outs::cuStreamGetPriority, CUresult> {
        self.check()?;
        let key = self.streams.resolve(a.stream)?;
        let priority = match key {
            StreamKey::Created(h) => self.streams.get(h).map_or(0, |s| s.priority),
            _ => 0,
        };
        Ok(outs::cuStreamGetPriority {
            priority,
            ..Default::default()
        })
    }

    fn cuStreamGetFlags(
        &mut self,
        a: args::cuStreamGetFlags,
    ) -> Result<outs::cuStreamGetFlags, CUresult> {
        self.check()?;
        let key = self.streams.resolve(a.stream)?;
        let flags = match key {
            StreamKey::Created(h) => self.streams.get(h).map_or(0, |s| s.flags),
            _ => 0,
        };
        Ok(outs::cuStreamGetFlags {
            flags,
            ..Default::default()
        })
    }

    fn cuStreamGetCtx(
        &mut self,
        a: args::cuStreamGetCtx,
    ) -> Result<outs::cuStreamGetCtx, CUresult> {
        Ok(outs::cuStreamGetCtx {
            pctx: self.stream_context(a.stream)?,
            ..Default::default()
        })
    }

    fn cuStreamGetCtx_v2(
        &mut self,
        a: args::cuStreamGetCtx_v2,
    ) -> Result<outs::cuStreamGetCtx_v2, CUresult> {
        // No green contexts here: the green context is always NULL.
        Ok(outs::cuStreamGetCtx_v2 {
            pctx: self.stream_context(a.stream)?,
            green_ctx: 0,
            ..Default::default()
        })
    }

    fn cuStreamGetDevice(
        &mut self,
        a: args::cuStreamGetDevice,
    ) -> Result<outs::cuStreamGetDevice, CUresult> {
        self.stream_context(a.stream)?;
        Ok(outs::cuStreamGetDevice {
            device: 0,
            ..Default::default()
        })
    }

    fn cuStreamGetId(&mut self, a: args::cuStreamGetId) -> Result<outs::cuStreamGetId, CUresult> {
        self.check()?;
        let key = self.streams.resolve(a.stream)?;
        if key != StreamKey::Created(a.stream) {
            self.ctx()?;
        }
        Ok(outs::cuStreamGetId {
            id: self.streams.stream(key)?.id,
            ..Default::default()
        })
    }

    fn cuStreamGetAttribute(
        &mut self,
        a: args::cuStreamGetAttribute,
    ) -> Result<outs::cuStreamGetAttribute, CUresult> {
        self.check()?;
        let key = self.streams.resolve(a.stream)?;
        let priority = self.stream_priority(key)?;
        let attrs = self.stream_attrs.get(&key).copied().unwrap_or_default();
        Ok(outs::cuStreamGetAttribute {
            value: attrs.get(a.attr, priority)?.value(),
            ..Default::default()
        })
    }

    fn cuStreamSetAttribute(
        &mut self,
        a: args::cuStreamSetAttribute,
    ) -> Result<outs::cuStreamSetAttribute, CUresult> {
        self.check()?;
        let key = self.streams.resolve(a.stream)?;
        let limits = attrs::Limits {
            max_window: device::MAX_ACCESS_POLICY_WINDOW as u64,
            domains: device::MEM_SYNC_DOMAINS as u8,
        };
        let attr = Attr::parse(a.attr, &a.value, limits)?;
        self.set_stream_attr(key, attr)?;
        Ok(Default::default())
    }

    fn cuStreamCopyAttributes(
        &mut self,
        a: args::cuStreamCopyAttributes,
    ) -> Result<outs::cuStreamCopyAttributes, CUresult> {
        self.check()?;
        let (dst, src) = (self.streams.resolve(a.dst)?, self.streams.resolve(a.src)?);
        let attrs = self.stream_attrs.get(&src).copied().unwrap_or_default();
        let priority = self.stream_priority(src)?;
        self.stream_attrs.insert(dst, attrs);
        self.set_stream_attr(dst, Attr::Priority(priority))?;
        Ok(Default::default())
    }

    // --- Stream memory operations ---------------------------------------------------------------------

    fn cuStreamWaitValue32_v2(
        &mut self,
        a: args::cuStreamWaitValue32_v2,
    ) -> Result<outs::cuStreamWaitValue32_v2, CUresult> {
        self.mem_op(
            a.stream,
            MemOp::wait(a.addr, a.value.into(), false, a.flags)?,
        )?;
        Ok(Default::default())
    }

    fn cuStreamWaitValue64_v2(
        &mut self,
        a: args::cuStreamWaitValue64_v2,
    ) -> Result<outs::cuStreamWaitValue64_v2, CUresult> {
        self.mem_op(a.stream, MemOp::wait(a.addr, a.value, true, a.flags)?)?;
        Ok(Default::default())
    }

    fn cuStreamWriteValue32_v2(
        &mut self,
        a: args::cuStreamWriteValue32_v2,
    ) -> Result<outs::cuStreamWriteValue32_v2, CUresult> {
        self.mem_op(
            a.stream,
            MemOp::write(a.addr, a.value.into(), false, a.flags)?,
        )?;
        Ok(Default::default())
    }

    fn cuStreamWriteValue64_v2(
        &mut self,
        a: args::cuStreamWriteValue64_v2,
    ) -> Result<outs::cuStreamWriteValue64_v2, CUresult> {
        self.mem_op(a.stream, MemOp::write(a.addr, a.value, true, a.flags)?)?;
        Ok(Default::default())
    }

    fn cuStreamBatchMemOp_v2(
        &mut self,
        a: args::cuStreamBatchMemOp_v2,
    ) -> Result<outs::cuStreamBatchMemOp_v2, CUresult> {
        // One operation per message (`count` is always 1: `api::One`).
        if a.flags != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        self.mem_op(a.stream, MemOp::try_from(*a.ops)?)?;
        Ok(Default::default())
    }

    // --- Events ---------------------------------------------------------------------------------------

    fn cuEventCreate(&mut self, a: args::cuEventCreate) -> Result<outs::cuEventCreate, CUresult> {
        let ctx = self.ctx()?;
        // Blocking sync changes how a real host thread waits (sleeping rather than spinning); here every
        // wait sleeps on a condition variable, so all three flags are honoured as they are.
        let known = EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING | EVENT_INTERPROCESS;
        if a.flags & !known != 0
            || (a.flags & EVENT_INTERPROCESS != 0 && a.flags & EVENT_DISABLE_TIMING == 0)
        {
            return Err(CUresult::INVALID_VALUE);
        }
        let event = self.handle(kind::EVENT);
        self.events
            .insert(event, Event::new(a.flags, ctx, self.streams.signal()));
        Ok(outs::cuEventCreate {
            event,
            ..Default::default()
        })
    }

    fn cuEventRecord(&mut self, a: args::cuEventRecord) -> Result<outs::cuEventRecord, CUresult> {
        self.record_event(a.event, a.stream)?;
        Ok(Default::default())
    }

    fn cuEventRecordWithFlags(
        &mut self,
        a: args::cuEventRecordWithFlags,
    ) -> Result<outs::cuEventRecordWithFlags, CUresult> {
        if a.flags > 1 {
            return Err(CUresult::INVALID_VALUE);
        }
        self.record_event(a.event, a.stream)?;
        Ok(Default::default())
    }

    fn cuEventSynchronize(
        &mut self,
        a: args::cuEventSynchronize,
    ) -> Result<outs::cuEventSynchronize, CUresult> {
        self.check()?;
        if !self.events.contains_key(&a.event) {
            return Err(CUresult::INVALID_HANDLE);
        }
        self.captures.query_event(a.event)?;
        let e = self.events.get(&a.event).ok_or(CUresult::INVALID_HANDLE)?;
        e.wait();
        self.synchronized();
        self.check()?;
        Ok(Default::default())
    }

    fn cuEventQuery(&mut self, a: args::cuEventQuery) -> Result<outs::cuEventQuery, CUresult> {
        self.check()?;
        if !self.events.contains_key(&a.event) {
            return Err(CUresult::INVALID_HANDLE);
        }
        self.captures.query_event(a.event)?;
        let e = self.events.get(&a.event).ok_or(CUresult::INVALID_HANDLE)?;
        if !e.complete() {
            return Err(CUresult::NOT_READY);
        }
        Ok(Default::default())
    }

    fn cuEventElapsedTime(
        &mut self,
        a: args::cuEventElapsedTime,
    ) -> Result<outs::cuEventElapsedTime, CUresult> {
        Ok(outs::cuEventElapsedTime {
            ms: self.elapsed(a.start, a.end)?,
            ..Default::default()
        })
    }

    fn cuEventElapsedTime_v2(
        &mut self,
        a: args::cuEventElapsedTime_v2,
    ) -> Result<outs::cuEventElapsedTime_v2, CUresult> {
        Ok(outs::cuEventElapsedTime_v2 {
            ms: self.elapsed(a.start, a.end)?,
            ..Default::default()
        })
    }

    fn cuEventDestroy_v2(
        &mut self,
        a: args::cuEventDestroy_v2,
    ) -> Result<outs::cuEventDestroy_v2, CUresult> {
        self.check()?;
        // Pending records hold their own reference to the event's signal, so they still complete.
        self.events
            .remove(&a.event)
            .ok_or(CUresult::INVALID_HANDLE)?;
        Ok(Default::default())
    }

    // --- Managed and host memory (see `managed`) ---------------------------------------------------

    fn cuMemAllocManaged(
        &mut self,
        a: args::cuMemAllocManaged,
    ) -> Result<outs::cuMemAllocManaged, CUresult> {
        self.api_cuMemAllocManaged(a)
    }

    fn cuMemHostAlloc(
        &mut self,
        a: args::cuMemHostAlloc,
    ) -> Result<outs::cuMemHostAlloc, CUresult> {
        self.api_cuMemHostAlloc(a)
    }

    fn cuMemHostGetDevicePointer_v2(
        &mut self,
        a: args::cuMemHostGetDevicePointer_v2,
    ) -> Result<outs::cuMemHostGetDevicePointer_v2, CUresult> {
        self.ctx()?;
        Ok(outs::cuMemHostGetDevicePointer_v2 {
            pdptr: self.mirrored.device_pointer(a.p, a.flags)?,
            ..Default::default()
        })
    }

    fn cuMemFreeHost(&mut self, a: args::cuMemFreeHost) -> Result<outs::cuMemFreeHost, CUresult> {
        self.api_cuMemFreeHost(a)?;
        Ok(Default::default())
    }

    fn cuMemAdvise(&mut self, a: args::cuMemAdvise) -> Result<outs::cuMemAdvise, CUresult> {
        self.ctx()?;
        self.mirrored
            .advise(a.dev_ptr, a.count, a.advice, a.device)?;
        Ok(Default::default())
    }

    fn cuMemPrefetchAsync(
        &mut self,
        a: args::cuMemPrefetchAsync,
    ) -> Result<outs::cuMemPrefetchAsync, CUresult> {
        self.ctx()?;
        self.streams.resolve(a.stream)?;
        self.mirrored.prefetch(a.dev_ptr, a.count, a.dst_device)?;
        Ok(Default::default())
    }

    fn cuStreamAttachMemAsync(
        &mut self,
        a: args::cuStreamAttachMemAsync,
    ) -> Result<outs::cuStreamAttachMemAsync, CUresult> {
        self.ctx()?;
        self.streams.resolve(a.stream)?;
        self.mirrored.attach(a.dptr, a.length, a.flags)?;
        Ok(Default::default())
    }

    // --- Arrays, texture and surface objects (see `arrays`) -----------------------------------------

    fn cuArrayCreate_v2(
        &mut self,
        a: args::cuArrayCreate_v2,
    ) -> Result<outs::cuArrayCreate_v2, CUresult> {
        let d = *a.desc;
        let array = self.array_create(gleam_protocol::descriptors::CUDA_ARRAY3D_DESCRIPTOR {
            Width: d.Width,
            Height: d.Height,
            Depth: 0,
            Format: d.Format,
            NumChannels: d.NumChannels,
            Flags: 0,
        })?;
        Ok(outs::cuArrayCreate_v2 {
            array,
            ..Default::default()
        })
    }

    fn cuArray3DCreate_v2(
        &mut self,
        a: args::cuArray3DCreate_v2,
    ) -> Result<outs::cuArray3DCreate_v2, CUresult> {
        Ok(outs::cuArray3DCreate_v2 {
            array: self.array_create(*a.desc)?,
            ..Default::default()
        })
    }

    fn cuArrayDestroy(
        &mut self,
        a: args::cuArrayDestroy,
    ) -> Result<outs::cuArrayDestroy, CUresult> {
        self.array_destroy(a.array)?;
        Ok(Default::default())
    }

    fn cuArrayGetDescriptor_v2(
        &mut self,
        a: args::cuArrayGetDescriptor_v2,
    ) -> Result<outs::cuArrayGetDescriptor_v2, CUresult> {
        self.check()?;
        let d = self.objects.descriptor(a.array)?;
        // A 3D or layered array has no 2D descriptor.
        if d.Depth != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        Ok(outs::cuArrayGetDescriptor_v2 {
            desc: gleam_protocol::descriptors::CUDA_ARRAY_DESCRIPTOR {
                Width: d.Width,
                Height: d.Height,
                Format: d.Format,
                NumChannels: d.NumChannels,
            },
            ..Default::default()
        })
    }

    fn cuArray3DGetDescriptor_v2(
        &mut self,
        a: args::cuArray3DGetDescriptor_v2,
    ) -> Result<outs::cuArray3DGetDescriptor_v2, CUresult> {
        self.check()?;
        Ok(outs::cuArray3DGetDescriptor_v2 {
            desc: self.objects.descriptor(a.array)?,
            ..Default::default()
        })
    }

    fn cuTexObjectCreate(
        &mut self,
        a: args::cuTexObjectCreate,
    ) -> Result<outs::cuTexObjectCreate, CUresult> {
        self.ctx()?;
        let object = self.objects.create_texture(
            &self.shared.mem,
            *a.res_desc,
            *a.tex_desc,
            a.view_desc.map(|v| *v),
        )?;
        Ok(outs::cuTexObjectCreate {
            object,
            ..Default::default()
        })
    }

    fn cuTexObjectDestroy(
        &mut self,
        a: args::cuTexObjectDestroy,
    ) -> Result<outs::cuTexObjectDestroy, CUresult> {
        self.check()?;
        self.objects.destroy_texture(a.object)?;
        Ok(Default::default())
    }

    fn cuTexObjectGetResourceDesc(
        &mut self,
        a: args::cuTexObjectGetResourceDesc,
    ) -> Result<outs::cuTexObjectGetResourceDesc, CUresult> {
        self.check()?;
        Ok(outs::cuTexObjectGetResourceDesc {
            res_desc: self.objects.texture_descs(a.object)?.0,
            ..Default::default()
        })
    }

    fn cuTexObjectGetTextureDesc(
        &mut self,
        a: args::cuTexObjectGetTextureDesc,
    ) -> Result<outs::cuTexObjectGetTextureDesc, CUresult> {
        self.check()?;
        Ok(outs::cuTexObjectGetTextureDesc {
            tex_desc: self.objects.texture_descs(a.object)?.1,
            ..Default::default()
        })
    }

    fn cuTexObjectGetResourceViewDesc(
        &mut self,
        a: args::cuTexObjectGetResourceViewDesc,
    ) -> Result<outs::cuTexObjectGetResourceViewDesc, CUresult> {
        self.check()?;
        Ok(outs::cuTexObjectGetResourceViewDesc {
            view_desc: self.objects.texture_descs(a.object)?.2,
            ..Default::default()
        })
    }

    fn cuSurfObjectCreate(
        &mut self,
        a: args::cuSurfObjectCreate,
    ) -> Result<outs::cuSurfObjectCreate, CUresult> {
        self.ctx()?;
        Ok(outs::cuSurfObjectCreate {
            object: self.objects.create_surface(*a.res_desc)?,
            ..Default::default()
        })
    }

    fn cuSurfObjectDestroy(
        &mut self,
        a: args::cuSurfObjectDestroy,
    ) -> Result<outs::cuSurfObjectDestroy, CUresult> {
        self.check()?;
        self.objects.destroy_surface(a.object)?;
        Ok(Default::default())
    }

    fn cuSurfObjectGetResourceDesc(
        &mut self,
        a: args::cuSurfObjectGetResourceDesc,
    ) -> Result<outs::cuSurfObjectGetResourceDesc, CUresult> {
        self.check()?;
        Ok(outs::cuSurfObjectGetResourceDesc {
            res_desc: self.objects.surface_desc(a.object)?,
            ..Default::default()
        })
    }
}

// Managed and host memory, arrays, texture and surface objects (the work is in `managed` and `arrays`).
#[allow(non_snake_case)]
impl EmuBackend {
    fn api_cuMemAllocManaged(
        &mut self,
        a: args::cuMemAllocManaged,
    ) -> Result<outs::cuMemAllocManaged, CUresult> {
        let ctx = self.ctx()?;
        let dptr = self
            .mirrored
            .alloc_managed(&self.shared.mem, a.bytesize, a.flags, ctx)?;
        Ok(outs::cuMemAllocManaged {
            dptr,
            ..Default::default()
        })
    }

    fn api_cuMemHostAlloc(
        &mut self,
        a: args::cuMemHostAlloc,
    ) -> Result<outs::cuMemHostAlloc, CUresult> {
        let ctx = self.ctx()?;
        let pp = self
            .mirrored
            .alloc_host(&self.shared.mem, a.bytesize, a.flags, ctx)?;
        Ok(outs::cuMemHostAlloc {
            pp,
            ..Default::default()
        })
    }

    fn api_cuMemFreeHost(&mut self, a: args::cuMemFreeHost) -> Result<(), CUresult> {
        self.ctx()?;
        // Queued work may still read it.
        self.streams.synchronize_all();
        self.mirrored.free_host(&self.shared.mem, a.p)
    }

    fn array_create(
        &mut self,
        desc: gleam_protocol::descriptors::CUDA_ARRAY3D_DESCRIPTOR,
    ) -> Result<u64, CUresult> {
        let ctx = self.ctx()?;
        self.objects.create_array(&self.shared.mem, desc, ctx)
    }

    fn array_destroy(&mut self, array: u64) -> Result<(), CUresult> {
        self.check()?;
        // Kernels and copies still queued may read it.
        self.streams.synchronize_all();
        self.objects.destroy_array(&self.shared.mem, array)
    }
}

impl Backend for EmuBackend {
    fn describe(&mut self) -> Result<(i32, String, Vec<DeviceInfo>), CUresult> {
        let info = DeviceInfo {
            name: device::NAME.to_owned(),
            uuid: device::UUID,
            total_mem: self.shared.mem.capacity(),
            attributes: {
                let mut a = device::attributes();
                // KERNEL_EXEC_TIMEOUT: whether kernels have a run time limit.
                a[17] = i32::from(self.shared.kernel_timeout.is_some());
                a
            },
            pci_bus_id: device::PCI_BUS_ID.to_owned(),
        };
        Ok((device::DRIVER_VERSION, "emu".to_owned(), vec![info]))
    }

    fn set_current_context(&mut self, ctx: u64) -> Result<(), CUresult> {
        if ctx != 0 && !self.contexts.contains_key(&ctx) {
            return Err(CUresult::INVALID_CONTEXT);
        }
        self.current = ctx;
        Ok(())
    }

    fn memcpy_htod(&mut self, dst: u64, data: &[u8], stream: Option<u64>) -> Result<(), CUresult> {
        self.ctx()?;
        if data.is_empty() {
            return Ok(());
        }
        self.shared.mem.check(dst, data.len() as u64, true)?;
        match stream {
            None => {
                // Ordered after everything the legacy stream would wait for; done when we return.
                self.sync_stream(None)?;
                self.shared
                    .mem
                    .write_bytes(dst, data)
                    .map_err(|_| CUresult::INVALID_VALUE)?;
                // A stream may be waiting for a value this copy wrote.
                self.streams.memory_changed();
                Ok(())
            }
            Some(s) => {
                // A graph would copy from host memory at each launch: not from a remote client.
                self.not_capturing(s)?;
                self.streams.resolve(s)?;
                let admission = self.admit_copy(data.len())?;
                let data = data.to_vec();
                self.submit(s, "host-to-device copy", move |mem| {
                    let _held = &admission;
                    mem.write_bytes(dst, &data)
                        .map_err(|_| CUresult::ILLEGAL_ADDRESS)
                })
            }
        }
    }

    fn memcpy_dtoh(
        &mut self,
        src: u64,
        len: usize,
        stream: Option<u64>,
    ) -> Result<Vec<u8>, CUresult> {
        self.ctx()?;
        if len == 0 {
            return Ok(Vec::new());
        }
        self.shared.mem.check(src, len as u64, false)?;
        if let Some(s) = stream {
            self.not_capturing(s)?;
        }
        self.sync_stream(stream)?;
        let mut out = gleam_server::recycle::REPLIES.buffer(len);
        out.resize(len, 0);
        self.shared
            .mem
            .read_bytes(src, &mut out)
            .map_err(|_| CUresult::INVALID_VALUE)?;
        Ok(out)
    }

    fn memcpy3d(
        &mut self,
        copy: &Copy3D,
        host: &[u8],
        stream: Option<u64>,
    ) -> Result<Vec<u8>, CUresult> {
        self.ctx()?;
        let plan = self.objects.plan(copy)?;
        if copy.is_empty() {
            if let Some(s) = stream {
                self.streams.resolve(s)?;
            }
            return Ok(Vec::new());
        }
        plan.check(&self.shared.mem)?;
        match stream {
            // Synchronous, or to the host (whose bytes the reply carries): after the stream's work.
            None => {
                self.sync_stream(None)?;
                plan.run(&self.shared.mem, host)
                    .map_err(|_| CUresult::INVALID_VALUE)
            }
            Some(s) if plan.to_host() => {
                self.sync_stream(Some(s))?;
                plan.run(&self.shared.mem, host)
                    .map_err(|_| CUresult::INVALID_VALUE)
            }
            Some(s) => {
                self.streams.resolve(s)?;
                let admission = self.admit_copy(host.len())?;
                let host = host.to_vec();
                self.submit(s, "2D/3D copy", move |mem| {
                    let _held = &admission;
                    plan.run(mem, &host)
                        .map(drop)
                        .map_err(|_| CUresult::ILLEGAL_ADDRESS)
                })?;
                Ok(Vec::new())
            }
        }
    }

    fn mirror_write(&mut self, addr: u64, data: &[u8]) -> Result<(), CUresult> {
        self.shared
            .mem
            .write_bytes(addr, data)
            .map_err(|_| CUresult::INVALID_VALUE)
    }

    fn mirror_read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>, CUresult> {
        let mut out = vec![0u8; len];
        self.shared
            .mem
            .read_bytes(addr, &mut out)
            .map_err(|_| CUresult::INVALID_VALUE)?;
        Ok(out)
    }

    fn module_load(&mut self, image: &[u8]) -> Result<u64, CUresult> {
        self.load_module(image)
    }

    fn module_get_function(
        &mut self,
        module: u64,
        name: &str,
    ) -> Result<(u64, FunctionInfo), CUresult> {
        let f = self.get_function(module, name)?;
        Ok((f, self.function_info(f)?))
    }

    fn library_load(&mut self, image: &[u8]) -> Result<u64, CUresult> {
        // Libraries are context-independent in CUDA; here they belong to the primary context when no
        // context is current.
        let saved = self.current;
        if self.current == 0 {
            self.current = PRIMARY;
        }
        let loaded = self.load_module(image);
        self.current = saved;
        let module = loaded?;
        let library = self.handle(kind::LIBRARY);
        self.libraries.insert(library, module);
        Ok(library)
    }

    fn kernel_get_function(&mut self, kernel: u64) -> Result<(u64, FunctionInfo), CUresult> {
        Ok((kernel, self.function_info(kernel)?))
    }

    fn host_callback(&mut self, stream: u64, point: CallbackPoint) -> Result<(), CUresult> {
        self.ctx()?;
        let key = self.streams.resolve(stream)?;
        if self.captures.capturing(key) {
            // A captured host node would call back into the client at every launch of the graph, long
            // after this request was answered: not offered. Like any illegal call in a capture, it
            // invalidates the capture.
            tracing::warn!(
                "a host function queued on a capturing stream: refused (graphs with host nodes are not \
                 supported remotely)"
            );
            return Err(self.captures.invalidate(key));
        }
        // The stream answers the client when it gets here, then waits (holding no worker) for the
        // client's function to return.
        let released = self.streams.signal();
        let release = released.clone();
        point.on_returned(move || release.advance_to(1));
        let shared = self.shared.clone();
        let reach: Job = Box::new(move || {
            point.reached(shared.sticky().unwrap_or(CUresult::SUCCESS));
        });
        self.streams
            .enqueue(key, self.current, Vec::new(), Some(reach))?;
        self.streams
            .enqueue(key, self.current, vec![(released, 1)], None)
    }

    fn launch(&mut self, launch: &Launch) -> Result<(), CUresult> {
        self.ctx()?;
        self.validate_launch(launch)?;
        let f = self.function(launch.function)?;
        let m = self
            .modules
            .get(&f.module)
            .ok_or(CUresult::INVALID_HANDLE)?;
        let module = m.ptx.clone();
        let symbols = m.symbols.clone();
        let name = f.name.clone();
        let cfg = LaunchConfig {
            grid: launch.grid,
            block: launch.block,
            dynamic_shared_bytes: launch.shared_mem_bytes,
        };
        let params = launch.params.clone();
        let kernel = name.clone();
        let shared = self.shared.clone();
        // The texture and surface objects as they are now.
        let textures = self.objects.resolver();
        // Replayable: a captured launch runs again at every launch of its graph.
        let op: Op = Arc::new(move |mem: &DeviceMemory| {
            let started = Instant::now();
            let options = LaunchOptions {
                cancel: Some(&shared.stop_kernels),
                deadline: shared.kernel_timeout.map(|t| started + t),
                textures: Some(&*textures),
                ..LaunchOptions::default()
            };
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                gleam_ptx::launch_with(&module, &kernel, &cfg, &params, &symbols, mem, &options)
            }));
            match run {
                Ok(Ok(stats)) => {
                    tracing::trace!(
                        kernel = %kernel,
                        grid = ?cfg.grid,
                        block = ?cfg.block,
                        instructions = stats.thread_instructions,
                        ms = started.elapsed().as_millis() as u64,
                        "kernel done"
                    );
                    Ok(())
                }
                // Stopped because the context is already lost (a fault elsewhere) or the session ended:
                // that is already reported, or nobody is left to tell.
                Ok(Err(ExecError::Stopped(StopReason::Cancelled))) => {
                    tracing::debug!(kernel = %kernel, "kernel stopped: its context is going away");
                    Ok(())
                }
                Ok(Err(e)) => {
                    let code = launch_error(&e);
                    if code == CUresult::LAUNCH_TIMEOUT {
                        tracing::error!(
                            kernel = %kernel,
                            "kernel {kernel} ran past the emu backend's watchdog ({:?}, GLEAM_EMU_KERNEL_TIMEOUT) \
                             and was stopped -> {code}",
                            shared.kernel_timeout.unwrap_or_default()
                        );
                    } else {
                        tracing::error!(kernel = %kernel, "kernel {kernel} failed: {e} -> {code}");
                    }
                    Err(code)
                }
                Err(_) => {
                    tracing::error!(kernel = %kernel, "the PTX interpreter panicked running {kernel}");
                    Err(CUresult::LAUNCH_FAILED)
                }
            }
        });
        self.submit_steps(
            launch.stream,
            vec![Step {
                what: format!("kernel {name}").into(),
                op,
            }],
        )
    }

    fn launch_ex(&mut self, launch: &Launch, attrs: &[LaunchAttr]) -> Result<(), CUresult> {
        for a in attrs {
            let refused = match a.id {
                // Ignore, hints on caching, memory order, scheduling and priority: running kernels one
                // after the other on their stream already satisfies them.
                0 | 1 | 3 | 5 | 6 | 8 | 9 | 10 | 13 | 14 | 15 | 16 => false,
                // A cooperative launch needs every block resident at once (grid-wide sync).
                LaunchAttr::COOPERATIVE => a.value[0] != 0,
                // Thread block clusters (compute capability 9.0+).
                LaunchAttr::CLUSTER_DIMENSION => a.value[..3].iter().any(|&d| d > 1),
                // Events recorded from inside a kernel's execution.
                LaunchAttr::PROGRAMMATIC_EVENT | LaunchAttr::LAUNCH_COMPLETION_EVENT => true,
                _ => return Err(CUresult::INVALID_VALUE),
            };
            if refused {
                tracing::warn!(
                    attribute = a.id,
                    "launch attribute not supported by the emu backend"
                );
                return Err(CUresult::NOT_SUPPORTED);
            }
        }
        self.launch(launch)
    }

    fn forget(&mut self, died: &Died) {
        // Queued kernels may still use what dies (a module's code and globals): let them finish.
        self.streams.synchronize_all();
        for &(kind, handle) in &died.handles {
            match kind {
                Kind::Stream => {
                    self.captures.stream_gone(StreamKey::Created(handle));
                    self.stream_attrs.remove(&StreamKey::Created(handle));
                    let _ = self.streams.destroy(handle);
                }
                Kind::Event => {
                    self.events.remove(&handle);
                }
                Kind::Module => self.unload(handle),
                Kind::Function => {
                    self.functions.remove(&handle);
                }
                Kind::Library => {
                    if let Some(module) = self.libraries.remove(&handle) {
                        self.unload(module);
                    }
                }
                Kind::Array | Kind::TexObject | Kind::SurfObject => {
                    self.objects.forget(kind, handle);
                }
                Kind::Graph | Kind::GraphExec => self.captures.forget(handle),
                // A kernel is its module's function here; contexts, pools and physical allocations are
                // handled by their own calls.
                Kind::Kernel | Kind::Context | Kind::MemPool | Kind::MemHandle => {}
            }
        }
        for &ctx in &died.emptied_contexts {
            self.shared.mem.free_all(Some(ctx));
            self.mirrored.emptied(ctx);
        }
        if !died.emptied_contexts.is_empty() {
            self.shared.pools().forget_freed(&self.shared.mem);
        }
    }

    fn shutdown(&mut self, _: &Handles) {
        // Queued work is skipped and running kernels are stopped: nobody waits for them any more.
        self.shared.cancelled.store(true, Ordering::Release);
        self.shared.stop_kernels.store(true, Ordering::Release);
        self.streams.shutdown();
        self.shared.cancelled.store(false, Ordering::Release);
        self.shared.stop_kernels.store(false, Ordering::Release);
        self.shared.pools().clear();
        self.events.clear();
        self.functions.clear();
        self.libraries.clear();
        self.captures.clear();
        self.stream_attrs.clear();
        self.modules.clear();
        self.objects.clear();
        self.mirrored.clear();
        self.shared.mem.free_all(None);
        self.contexts.retain(|&c, _| c == PRIMARY);
        self.primary_refs = 0;
        self.current = 0;
        tracing::debug!("emu backend shut down");
    }
}

impl Drop for EmuBackend {
    fn drop(&mut self) {
        // Joins the stream workers, skipping what is still queued and stopping what runs.
        self.shared.cancelled.store(true, Ordering::Release);
        self.shared.stop_kernels.store(true, Ordering::Release);
        self.streams.shutdown();
    }
}
