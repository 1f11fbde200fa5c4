//! [`Handles`]: the registry of every handle the real backend handed out in a session.
//!
//! NVIDIA's driver trusts the handles it is given: a made-up `CUstream` or `CUmodule` is dereferenced and
//! the session process dies of SIGSEGV. CUDA promises `CUDA_ERROR_INVALID_HANDLE` instead (and
//! `CUDA_ERROR_INVALID_CONTEXT` for a context), so [`RealBackend`](super::real::RealBackend) only passes
//! the driver handles it has seen the driver return, in this session, and that have not died since.
//!
//! * [`HandleArg`] says, per argument type of the declaration list, what the registry does with it: a
//!   handle ([`Context`], [`Stream`], ...) is checked before the call ([`HandleArg::check`]); an
//!   [`Out`] of a handle is registered after it ([`HandleArg::register`]); plain values and strings are
//!   left alone. [`Admit`] and [`Register`], generated for every listed call's [`args`]/[`outs`] struct,
//!   apply those per argument, so a call added to the list is covered without further code.
//! * [`Effect`] is what a listed call destroys (contexts, modules, libraries, streams, events, primary
//!   context retains), applied by [`Handles::apply`] after the call succeeded, with CUDA's cascades:
//!   functions die with their module, kernels and library modules with their library, and modules,
//!   functions, streams, events, arrays and texture and surface objects with their context (libraries
//!   and kernels are context-independent). A texture or surface object does not die with the array it
//!   reads: CUDA leaves destroying it to the application (using it after its array died is the
//!   application's error, which a backend reports as a fault of the kernel).
//! * Descriptors passed by pointer ([`In`]) may name handles too: the array of a resource descriptor is
//!   checked like a handle argument ([`Embedded`]).
//!
//! Device pointers are not handles: the driver validates them itself.

use std::collections::{HashMap, HashSet};

use tracing::debug;

use crate::api::{
    ApiCall, ApiReply, Arg, Array, CStr, Context, Event, Function, Graph, GraphExec, In, InOpt,
    InOut, Kernel, LaunchConfig, LaunchConfigValue, Library, MemHandle, MemPool, Module, OptOut,
    Out, Plain, PtrValue, Stream, SurfObject, TexObject, Value, args, outs,
};
use crate::descriptors::{
    CUDA_ARRAY_DESCRIPTOR, CUDA_ARRAY3D_DESCRIPTOR, CUDA_RESOURCE_DESC, CUDA_RESOURCE_VIEW_DESC,
    CUDA_TEXTURE_DESC, Resource,
};
use crate::types::CUresult;

/// `CU_STREAM_LEGACY`.
const STREAM_LEGACY: u64 = 1;
/// `CU_STREAM_PER_THREAD`.
const STREAM_PER_THREAD: u64 = 2;

/// What a call's effect killed, from [`Handles::apply`].
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct Died {
    /// Every handle that died, the one destroyed and those that died with it.
    pub handles: Vec<(Kind, u64)>,
    /// Contexts whose contents (memory included) are gone: destroyed, released for the last time, or
    /// reset (a reset primary context itself stays).
    pub emptied_contexts: Vec<u64>,
}

impl Died {
    /// Whether nothing died.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty() && self.emptied_contexts.is_empty()
    }
}

/// The kinds of handle the registry knows.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Kind {
    Context,
    Module,
    Function,
    Stream,
    Event,
    Library,
    Kernel,
    Array,
    TexObject,
    SurfObject,
    Graph,
    GraphExec,
    /// `CUmemoryPool`: a device's, not a context's.
    MemPool,
    /// `CUmemGenericAllocationHandle` (`cuMemCreate`): reference-counted, a device's.
    MemHandle,
}

/// Where a handle created by a call belongs, gathered from the call's in-arguments and the current context.
#[derive(Clone, Copy, Debug, Default)]
pub struct Owner {
    /// The context a module, function, stream or event is created in (0 = unknown: never cascaded).
    pub ctx: u64,
    /// The library a kernel or module comes from.
    pub library: Option<u64>,
    /// The module a function comes from.
    pub module: Option<u64>,
    /// The kernel a function comes from.
    pub kernel: Option<u64>,
}

impl Owner {
    /// Handles created with `ctx` current.
    pub fn in_context(ctx: u64) -> Self {
        Self {
            ctx,
            ..Self::default()
        }
    }
}

/// What a function handle was obtained from (it dies with it).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum FunctionSource {
    /// `cuModuleGetFunction`.
    Module(u64),
    /// `cuKernelGetFunction`.
    Kernel(u64),
}

#[derive(Clone, Copy, Debug)]
struct ModuleEntry {
    ctx: u64,
    /// `Some` for `cuLibraryGetModule`'s modules, which belong to the library (never unloaded by us).
    library: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
struct FunctionEntry {
    ctx: u64,
    source: FunctionSource,
}

#[derive(Clone, Copy, Debug)]
struct Primary {
    ctx: u64,
    /// This session's retains (each session is its own process, so the process's count).
    retains: u32,
}

/// Every live handle of one session, by kind, with what each belongs to.
#[derive(Debug, Default)]
pub struct Handles {
    /// Context -> the device it is the primary context of (`None`: made by `cuCtxCreate`).
    contexts: HashMap<u64, Option<i32>>,
    primaries: HashMap<i32, Primary>,
    modules: HashMap<u64, ModuleEntry>,
    functions: HashMap<u64, FunctionEntry>,
    libraries: HashSet<u64>,
    /// Kernel -> its library.
    kernels: HashMap<u64, u64>,
    /// Stream -> its context.
    streams: HashMap<u64, u64>,
    /// Event -> its context.
    events: HashMap<u64, u64>,
    /// Context made by `cuCtxCreate` -> its device (primary contexts: in `contexts`).
    created_on: HashMap<u64, i32>,
    /// Array -> its context.
    arrays: HashMap<u64, u64>,
    /// Texture object -> its context.
    tex_objects: HashMap<u64, u64>,
    /// Surface object -> its context.
    surf_objects: HashMap<u64, u64>,
    /// Graphs (context-independent; they live until destroyed).
    graphs: HashSet<u64>,
    /// Executable graphs (until destroyed).
    graph_execs: HashSet<u64>,
    /// Memory pools (default pools once a call returned them, and created ones).
    pools: HashSet<u64>,
    /// Physical allocations -> references (`cuMemCreate` and each `cuMemRetainAllocationHandle` add one,
    /// each `cuMemRelease` drops one; the handle is invalid at zero).
    mem_handles: HashMap<u64, u32>,
}

impl Handles {
    /// Whether `handle` may be passed to the driver where a `kind` is expected. The error is what CUDA
    /// returns for a handle that is not (or no longer) valid.
    pub fn check(&self, kind: Kind, handle: u64) -> Result<(), CUresult> {
        let known = match kind {
            // NULL means "the current context" (or is rejected by the driver itself, which is safe).
            Kind::Context => handle == 0 || self.contexts.contains_key(&handle),
            Kind::Stream => {
                matches!(handle, 0 | STREAM_LEGACY | STREAM_PER_THREAD)
                    || self.streams.contains_key(&handle)
            }
            Kind::Event => self.events.contains_key(&handle),
            Kind::Module => self.modules.contains_key(&handle),
            // CUDA 12+ accepts a CUkernel wherever a CUfunction goes.
            Kind::Function => {
                self.functions.contains_key(&handle) || self.kernels.contains_key(&handle)
            }
            Kind::Library => self.libraries.contains(&handle),
            Kind::Kernel => self.kernels.contains_key(&handle),
            Kind::Array => self.arrays.contains_key(&handle),
            Kind::TexObject => self.tex_objects.contains_key(&handle),
            Kind::SurfObject => self.surf_objects.contains_key(&handle),
            Kind::Graph => self.graphs.contains(&handle),
            Kind::GraphExec => self.graph_execs.contains(&handle),
            Kind::MemPool => self.pools.contains(&handle),
            Kind::MemHandle => self.mem_handles.contains_key(&handle),
        };
        if known {
            Ok(())
        } else {
            debug!(?kind, handle, "refusing an unknown handle");
            Err(match kind {
                Kind::Context => CUresult::INVALID_CONTEXT,
                _ => CUresult::INVALID_HANDLE,
            })
        }
    }

    /// Records a handle the driver just returned. NULL is never a live handle.
    pub fn register(&mut self, kind: Kind, handle: u64, owner: &Owner) {
        if handle == 0 {
            return;
        }
        match kind {
            Kind::Context => {
                self.contexts.entry(handle).or_insert(None);
            }
            Kind::Module => {
                self.modules.insert(
                    handle,
                    ModuleEntry {
                        ctx: owner.ctx,
                        library: owner.library,
                    },
                );
            }
            Kind::Function => {
                let source = match (owner.module, owner.kernel) {
                    (Some(m), _) => FunctionSource::Module(m),
                    (None, Some(k)) => FunctionSource::Kernel(k),
                    // A function from nowhere dies only with its context.
                    (None, None) => FunctionSource::Module(0),
                };
                self.add_function(handle, owner.ctx, source);
            }
            Kind::Stream => {
                self.streams.insert(handle, owner.ctx);
            }
            Kind::Event => {
                self.events.insert(handle, owner.ctx);
            }
            Kind::Library => {
                self.libraries.insert(handle);
            }
            Kind::Kernel => {
                self.kernels.insert(handle, owner.library.unwrap_or(0));
            }
            Kind::Array => {
                self.arrays.insert(handle, owner.ctx);
            }
            Kind::TexObject => {
                self.tex_objects.insert(handle, owner.ctx);
            }
            Kind::SurfObject => {
                self.surf_objects.insert(handle, owner.ctx);
            }
            Kind::Graph => {
                self.graphs.insert(handle);
            }
            Kind::GraphExec => {
                self.graph_execs.insert(handle);
            }
            Kind::MemPool => {
                self.pools.insert(handle);
            }
            Kind::MemHandle => {
                let refs = self.mem_handles.entry(handle).or_insert(0);
                *refs = refs.saturating_add(1);
            }
        }
    }

    /// Records a module loaded by `cuModuleLoadData` in context `ctx`.
    pub fn add_module(&mut self, module: u64, ctx: u64) {
        self.register(Kind::Module, module, &Owner::in_context(ctx));
    }

    /// The context a live module was loaded in (0 = unknown).
    pub fn module_context(&self, module: u64) -> u64 {
        self.modules.get(&module).map_or(0, |m| m.ctx)
    }

    /// Records a function obtained in context `ctx`.
    pub fn add_function(&mut self, function: u64, ctx: u64, source: FunctionSource) {
        if function != 0 {
            self.functions
                .insert(function, FunctionEntry { ctx, source });
        }
    }

    /// Records a library loaded by `cuLibraryLoadData`.
    pub fn add_library(&mut self, library: u64) {
        self.register(Kind::Library, library, &Owner::default());
    }

    /// Applies what a successful call did (`reply`: a `sync` call's reply, which gives the primary context
    /// a retain returned), and says what died, so that state kept beside the registry (a backend's
    /// objects, the shim's allocations and context-local storage) can follow the same rules.
    pub fn apply(&mut self, effect: Effect, reply: Option<&ApiReply>) -> Died {
        if effect == Effect::None {
            return Died::default();
        }
        let before = self.every_handle();
        let emptied_contexts = match effect {
            Effect::None => Vec::new(),
            Effect::PrimaryRetain(dev) => {
                if let Some(ApiReply::cuDevicePrimaryCtxRetain(out)) = reply {
                    self.retain_primary(dev, out.pctx);
                }
                Vec::new()
            }
            Effect::PrimaryRelease(dev) => self.release_primary(dev).into_iter().collect(),
            Effect::PrimaryReset(dev) => match self.primaries.get(&dev) {
                // The context stays (and stays retained); everything in it is gone.
                Some(p) => {
                    let ctx = p.ctx;
                    self.destroy_in_context(ctx);
                    vec![ctx]
                }
                None => Vec::new(),
            },
            Effect::Destroy(Kind::Context, ctx) => {
                self.destroy_context(ctx);
                vec![ctx]
            }
            Effect::Destroy(Kind::Module, module) => {
                self.unload_module(module);
                Vec::new()
            }
            Effect::Destroy(Kind::Library, library) => {
                self.unload_library(library);
                Vec::new()
            }
            Effect::Destroy(Kind::Stream, stream) => {
                self.streams.remove(&stream);
                Vec::new()
            }
            Effect::Destroy(Kind::Event, event) => {
                self.events.remove(&event);
                Vec::new()
            }
            Effect::Destroy(Kind::Array, array) => {
                self.arrays.remove(&array);
                Vec::new()
            }
            Effect::Destroy(Kind::TexObject, object) => {
                self.tex_objects.remove(&object);
                Vec::new()
            }
            Effect::Destroy(Kind::SurfObject, object) => {
                self.surf_objects.remove(&object);
                Vec::new()
            }
            Effect::Destroy(Kind::Graph, graph) => {
                self.graphs.remove(&graph);
                Vec::new()
            }
            Effect::Destroy(Kind::GraphExec, exec) => {
                self.graph_execs.remove(&exec);
                Vec::new()
            }
            Effect::Destroy(Kind::MemPool, pool) => {
                self.pools.remove(&pool);
                Vec::new()
            }
            Effect::Destroy(Kind::MemHandle, handle) => {
                if let Some(refs) = self.mem_handles.get_mut(&handle) {
                    *refs -= 1;
                    if *refs == 0 {
                        self.mem_handles.remove(&handle);
                    }
                }
                Vec::new()
            }
            Effect::Destroy(Kind::Function | Kind::Kernel, handle) => {
                debug!(
                    handle,
                    "functions and kernels are not destroyed by a call of their own"
                );
                Vec::new()
            }
        };
        let after = self.every_handle();
        Died {
            handles: before.difference(&after).copied().collect(),
            emptied_contexts,
        }
    }

    /// Every live handle with its kind.
    fn every_handle(&self) -> HashSet<(Kind, u64)> {
        let tagged = |kind: Kind, handles: &mut dyn Iterator<Item = u64>| {
            handles.map(move |h| (kind, h)).collect::<Vec<_>>()
        };
        [
            tagged(Kind::Context, &mut self.contexts.keys().copied()),
            tagged(Kind::Module, &mut self.modules.keys().copied()),
            tagged(Kind::Function, &mut self.functions.keys().copied()),
            tagged(Kind::Stream, &mut self.streams.keys().copied()),
            tagged(Kind::Event, &mut self.events.keys().copied()),
            tagged(Kind::Library, &mut self.libraries.iter().copied()),
            tagged(Kind::Kernel, &mut self.kernels.keys().copied()),
            tagged(Kind::Array, &mut self.arrays.keys().copied()),
            tagged(Kind::TexObject, &mut self.tex_objects.keys().copied()),
            tagged(Kind::SurfObject, &mut self.surf_objects.keys().copied()),
            tagged(Kind::Graph, &mut self.graphs.iter().copied()),
            tagged(Kind::GraphExec, &mut self.graph_execs.iter().copied()),
            tagged(Kind::MemPool, &mut self.pools.iter().copied()),
            tagged(Kind::MemHandle, &mut self.mem_handles.keys().copied()),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// Records the device a context created by `cuCtxCreate` belongs to (primary contexts know theirs).
    pub fn set_context_device(&mut self, ctx: u64, dev: i32) {
        if self.contexts.contains_key(&ctx) {
            self.created_on.insert(ctx, dev);
        }
    }

    /// The device of a live context, if known.
    pub fn context_device(&self, ctx: u64) -> Option<i32> {
        self.created_on
            .get(&ctx)
            .copied()
            .or_else(|| self.contexts.get(&ctx).copied().flatten())
    }

    fn retain_primary(&mut self, dev: i32, ctx: u64) {
        if ctx == 0 {
            return;
        }
        let p = self
            .primaries
            .entry(dev)
            .or_insert(Primary { ctx, retains: 0 });
        // The driver returns the same handle each time; if it did not, the newest one is the primary.
        p.ctx = ctx;
        p.retains = p.retains.saturating_add(1);
        self.contexts.insert(ctx, Some(dev));
    }

    /// The last release destroys the primary context, "regardless of how many threads it is current to".
    fn release_primary(&mut self, dev: i32) -> Option<u64> {
        let p = self.primaries.get_mut(&dev)?;
        p.retains = p.retains.saturating_sub(1);
        if p.retains > 0 {
            return None;
        }
        let ctx = p.ctx;
        self.primaries.remove(&dev);
        self.destroy_context(ctx);
        Some(ctx)
    }

    fn destroy_context(&mut self, ctx: u64) {
        if ctx == 0 {
            return;
        }
        self.destroy_in_context(ctx);
        self.created_on.remove(&ctx);
        if let Some(Some(dev)) = self.contexts.remove(&ctx) {
            self.primaries.remove(&dev);
        }
    }

    /// Everything created in `ctx` dies (libraries and kernels are context-independent and stay).
    fn destroy_in_context(&mut self, ctx: u64) {
        self.modules.retain(|_, m| m.ctx != ctx);
        self.functions.retain(|_, f| f.ctx != ctx);
        self.streams.retain(|_, &mut c| c != ctx);
        self.events.retain(|_, &mut c| c != ctx);
        self.arrays.retain(|_, &mut c| c != ctx);
        self.tex_objects.retain(|_, &mut c| c != ctx);
        self.surf_objects.retain(|_, &mut c| c != ctx);
        self.drop_orphan_functions();
    }

    fn unload_module(&mut self, module: u64) {
        self.modules.remove(&module);
        self.drop_orphan_functions();
    }

    fn unload_library(&mut self, library: u64) {
        self.libraries.remove(&library);
        self.kernels.retain(|_, &mut l| l != library);
        self.modules.retain(|_, m| m.library != Some(library));
        self.drop_orphan_functions();
    }

    /// Functions whose module or kernel is gone die with it.
    fn drop_orphan_functions(&mut self) {
        let (modules, kernels) = (&self.modules, &self.kernels);
        self.functions.retain(|_, f| match f.source {
            FunctionSource::Module(0) => true,
            FunctionSource::Module(m) => modules.contains_key(&m),
            FunctionSource::Kernel(k) => kernels.contains_key(&k),
        });
    }

    /// Modules this session loaded itself (not a library's), to unload at shutdown.
    pub fn loaded_modules(&self) -> Vec<u64> {
        self.modules
            .iter()
            .filter(|(_, m)| m.library.is_none())
            .map(|(&h, _)| h)
            .collect()
    }

    /// Arrays this session created and that are alive.
    pub fn arrays(&self) -> Vec<u64> {
        self.arrays.keys().copied().collect()
    }

    /// Texture and surface objects this session created and that are alive.
    pub fn objects(&self) -> (Vec<u64>, Vec<u64>) {
        (
            self.tex_objects.keys().copied().collect(),
            self.surf_objects.keys().copied().collect(),
        )
    }

    /// Graphs and executable graphs this session made (to destroy at shutdown).
    pub fn graphs(&self) -> (Vec<u64>, Vec<u64>) {
        (
            self.graphs.iter().copied().collect(),
            self.graph_execs.iter().copied().collect(),
        )
    }

    /// Libraries this session loaded.
    pub fn libraries(&self) -> Vec<u64> {
        self.libraries.iter().copied().collect()
    }

    /// Contexts this session created with `cuCtxCreate` (primary contexts are released instead).
    pub fn created_contexts(&self) -> Vec<u64> {
        self.contexts
            .iter()
            .filter(|(_, primary)| primary.is_none())
            .map(|(&c, _)| c)
            .collect()
    }

    /// This session's primary context retains, by device.
    pub fn primary_retains(&self) -> Vec<(i32, u32)> {
        self.primaries
            .iter()
            .map(|(&dev, p)| (dev, p.retains))
            .collect()
    }

    /// Forgets everything (the session is over).
    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

/// What a listed call does to the registry if it succeeds, from its tags in the declaration list
/// (`destroys(arg)`, `retains-primary(dev)`...), applied by [`Handles::apply`].
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Effect {
    /// Nothing.
    None,
    /// A handle of this kind dies (with what dies with it).
    Destroy(Kind, u64),
    /// The primary context of this device is retained once more.
    PrimaryRetain(i32),
    /// ... released once (the last release destroys it).
    PrimaryRelease(i32),
    /// ... reset: everything in it is gone, the context stays.
    PrimaryReset(i32),
}

impl Effect {
    /// What `call` does if it succeeds.
    pub fn of(call: &ApiCall) -> Self {
        crate::api::effect_of(call)
    }
}

/// What the registry does with one argument type of the declaration list.
pub trait HandleArg: Arg {
    /// Before the call: refuse an unknown handle, and note handles that own what the call creates.
    fn check(handles: &Handles, request: &Self::Request, owner: &mut Owner)
    -> Result<(), CUresult>;
    /// After a successful call: record a handle it returned.
    fn register(handles: &mut Handles, reply: &Self::Reply, owner: &Owner);
}

/// A handle marker type of [`crate::api`].
pub trait HandleKind {
    /// Its kind.
    const KIND: Kind;
}

/// What an out-pointer may point to: a handle is registered, a plain value is not.
pub trait OutValue: Value {
    /// Records `value` if it is a handle.
    fn register(handles: &mut Handles, value: &Self::W, owner: &Owner);
}

impl<T: Plain> HandleArg for T {
    fn check(_: &Handles, _: &T, _: &mut Owner) -> Result<(), CUresult> {
        Ok(())
    }
    fn register(_: &mut Handles, _: &(), _: &Owner) {}
}

impl<T: Plain> OutValue for T {
    fn register(_: &mut Handles, _: &T, _: &Owner) {}
}

/// C structs an out-pointer may point to (`CUmemAllocationProp`...): not handles.
macro_rules! struct_out_values {
    ($($t:ident),*) => {$(
        impl OutValue for crate::types::$t {
            fn register(_: &mut Handles, _: &Self, _: &Owner) {}
        }
    )*};
}

struct_out_values!(
    CUmemLocation,
    CUmemAllocationProp,
    CUmemPoolProps,
    CUmemAccessDesc,
    CUexecAffinityParam
);

/// A descriptor passed by pointer ([`In`]): the handles inside it are checked like handle arguments.
pub trait Embedded {
    /// Refuses the descriptor if a handle in it is not live.
    fn check_embedded(&self, handles: &Handles) -> Result<(), CUresult>;
}

macro_rules! no_embedded_handles {
    ($($t:ty),*) => {$(
        impl Embedded for $t {
            fn check_embedded(&self, _: &Handles) -> Result<(), CUresult> {
                Ok(())
            }
        }
    )*};
}

no_embedded_handles!(
    CUDA_ARRAY_DESCRIPTOR,
    CUDA_ARRAY3D_DESCRIPTOR,
    CUDA_TEXTURE_DESC,
    CUDA_RESOURCE_VIEW_DESC,
    crate::types::CUmemLocation,
    crate::types::CUmemAllocationProp,
    crate::types::CUmemPoolProps,
    crate::types::CUmemAccessDesc,
    crate::types::CUexecAffinityParam,
    u64,
    [u64; 5],
    [i32; 5],
    [u32; 5],
    crate::api::AttrValue,
    crate::api::MemOpParams
);

impl Embedded for CUDA_RESOURCE_DESC {
    fn check_embedded(&self, handles: &Handles) -> Result<(), CUresult> {
        match self.resource() {
            Some(Resource::Array(array)) => handles.check(Kind::Array, array),
            // No mipmapped array is ever created (they are not offered), so none is live.
            Some(Resource::Mipmapped(_)) => Err(CUresult::INVALID_HANDLE),
            Some(Resource::Linear(_) | Resource::Pitch2D(_)) => Ok(()),
            // The driver rejects an unknown type without dereferencing anything.
            None => Ok(()),
        }
    }
}

impl<T: Value> HandleArg for In<T>
where
    T::C: Default,
    T::W: Embedded,
{
    fn check(handles: &Handles, request: &Box<T::W>, _: &mut Owner) -> Result<(), CUresult> {
        request.check_embedded(handles)
    }
    fn register(_: &mut Handles, _: &(), _: &Owner) {}
}

impl<T: Value> HandleArg for InOpt<T>
where
    T::W: Embedded,
{
    fn check(
        handles: &Handles,
        request: &Option<Box<T::W>>,
        _: &mut Owner,
    ) -> Result<(), CUresult> {
        request
            .as_ref()
            .map_or(Ok(()), |r| r.check_embedded(handles))
    }
    fn register(_: &mut Handles, _: &(), _: &Owner) {}
}

impl HandleArg for CStr {
    fn check(_: &Handles, _: &String, _: &mut Owner) -> Result<(), CUresult> {
        Ok(())
    }
    fn register(_: &mut Handles, _: &(), _: &Owner) {}
}

impl<T: OutValue> HandleArg for Out<T>
where
    T::C: Default,
{
    fn check(_: &Handles, _: &(), _: &mut Owner) -> Result<(), CUresult> {
        Ok(())
    }
    fn register(handles: &mut Handles, reply: &T::W, owner: &Owner) {
        T::register(handles, reply, owner);
    }
}

impl<T: OutValue> HandleArg for OptOut<T>
where
    T::C: Default,
{
    fn check(_: &Handles, _: &bool, _: &mut Owner) -> Result<(), CUresult> {
        Ok(())
    }
    fn register(handles: &mut Handles, reply: &T::W, owner: &Owner) {
        T::register(handles, reply, owner);
    }
}

impl<T: Plain> HandleArg for InOut<T> {
    fn check(_: &Handles, _: &T, _: &mut Owner) -> Result<(), CUresult> {
        Ok(())
    }
    fn register(_: &mut Handles, _: &T, _: &Owner) {}
}

/// The stream of a launch configuration, and events its attributes name, are handles.
impl HandleArg for LaunchConfig {
    fn check(handles: &Handles, config: &LaunchConfigValue, _: &mut Owner) -> Result<(), CUresult> {
        handles.check(Kind::Stream, config.stream)?;
        for event in config
            .attrs
            .iter()
            .filter_map(crate::wire::LaunchAttr::event)
        {
            handles.check(Kind::Event, event)?;
        }
        Ok(())
    }
    fn register(_: &mut Handles, _: &(), _: &Owner) {}
}

macro_rules! handle_kinds {
    ($($ty:ident, $note:expr;)*) => {$(
        impl HandleKind for $ty {
            const KIND: Kind = Kind::$ty;
        }

        impl HandleArg for $ty {
            fn check(handles: &Handles, &handle: &u64, owner: &mut Owner) -> Result<(), CUresult> {
                handles.check(Self::KIND, handle)?;
                let note: fn(&mut Owner, u64) = $note;
                note(owner, handle);
                Ok(())
            }
            fn register(_: &mut Handles, _: &(), _: &Owner) {}
        }

        impl OutValue for $ty {
            fn register(handles: &mut Handles, &handle: &u64, owner: &Owner) {
                handles.register(Self::KIND, handle, owner);
            }
        }
    )*};
}

// Each handle argument may own what the call creates.
handle_kinds! {
    // A call given an explicit context creates in it (NULL: the current one).
    Context, |o, h| if h != 0 { o.ctx = h };
    Module, |o, h| o.module = Some(h);
    Function, |_, _| {};
    Stream, |_, _| {};
    Event, |_, _| {};
    Library, |o, h| o.library = Some(h);
    Kernel, |o, h| o.kernel = Some(h);
    Array, |_, _| {};
    TexObject, |_, _| {};
    SurfObject, |_, _| {};
    Graph, |_, _| {};
    GraphExec, |_, _| {};
    MemPool, |_, _| {};
    MemHandle, |_, _| {};
}

impl HandleArg for crate::api::One {
    fn check(_: &Handles, _: &(), _: &mut Owner) -> Result<(), CUresult> {
        Ok(())
    }
    fn register(_: &mut Handles, _: &(), _: &Owner) {}
}

impl HandleArg for crate::api::OneSize {
    fn check(_: &Handles, _: &(), _: &mut Owner) -> Result<(), CUresult> {
        Ok(())
    }
    fn register(_: &mut Handles, _: &(), _: &Owner) {}
}

impl HandleArg for PtrValue {
    fn check(_: &Handles, _: &u64, _: &mut Owner) -> Result<(), CUresult> {
        Ok(())
    }
    fn register(_: &mut Handles, _: &(), _: &Owner) {}
}

/// A listed call's request, checked against the registry before the driver sees it.
pub trait Admit {
    /// Refuses the call if a handle argument is unknown; otherwise what it creates will belong to `owner`.
    fn admit(&self, handles: &Handles, owner: &mut Owner) -> Result<(), CUresult>;
}

/// A listed call's successful reply, whose handles are recorded.
pub trait Register {
    /// Records the handles the driver returned.
    fn register(&self, handles: &mut Handles, owner: &Owner);
}

/// Generates [`Admit`] and [`Register`] for every listed call, and for the [`ApiCall`]/[`ApiReply`]
/// enums that carry them.
macro_rules! handle_rules {
    ($($mode:ident fn $name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {
        $(
            impl Admit for args::$name {
                fn admit(&self, handles: &Handles, owner: &mut Owner) -> Result<(), CUresult> {
                    let _ = (&handles, &owner);
                    $(<$ty as HandleArg>::check(handles, &self.$arg, owner)?;)*
                    Ok(())
                }
            }

            impl Register for outs::$name {
                fn register(&self, handles: &mut Handles, owner: &Owner) {
                    let _ = (&handles, owner);
                    $(<$ty as HandleArg>::register(handles, &self.$arg, owner);)*
                }
            }
        )*

        impl Admit for ApiCall {
            fn admit(&self, handles: &Handles, owner: &mut Owner) -> Result<(), CUresult> {
                match self {
                    $(Self::$name(args) => args.admit(handles, owner),)*
                }
            }
        }

        impl Register for ApiReply {
            fn register(&self, handles: &mut Handles, owner: &Owner) {
                match self {
                    $(Self::$name(outs) => outs.register(handles, owner),)*
                }
            }
        }
    };
}

cuda_api!(handle_rules);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::LISTED;

    const CTX: u64 = 0x1000;
    const OTHER_CTX: u64 = 0x2000;

    /// A registry with the primary context of device 0 retained once and current.
    fn primed() -> Handles {
        let mut h = Handles::default();
        let reply = ApiReply::cuDevicePrimaryCtxRetain(outs::cuDevicePrimaryCtxRetain {
            pctx: CTX,
            dev: (),
        });
        create(&mut h, 0, &reply);
        h.apply(Effect::PrimaryRetain(0), Some(&reply));
        h
    }

    /// Registers what a listed call's reply returned, as the backend does after success.
    fn create(h: &mut Handles, current: u64, reply: &ApiReply) {
        let owner = Owner::in_context(current);
        match reply {
            ApiReply::cuDevicePrimaryCtxRetain(o) => o.register(h, &owner),
            ApiReply::cuCtxCreate_v2(o) => o.register(h, &owner),
            ApiReply::cuStreamCreate(o) => o.register(h, &owner),
            ApiReply::cuEventCreate(o) => o.register(h, &owner),
            other => panic!("not a creating reply: {other:?}"),
        }
    }

    fn stream(h: &mut Handles, ctx: u64, stream: u64) {
        create(
            h,
            ctx,
            &ApiReply::cuStreamCreate(outs::cuStreamCreate { stream, flags: () }),
        );
    }

    fn event(h: &mut Handles, ctx: u64, event: u64) {
        create(
            h,
            ctx,
            &ApiReply::cuEventCreate(outs::cuEventCreate { event, flags: () }),
        );
    }

    fn sync(stream: u64) -> args::cuStreamSynchronize {
        args::cuStreamSynchronize { stream }
    }

    fn admit<A: Admit>(h: &Handles, a: &A) -> Result<(), CUresult> {
        a.admit(h, &mut Owner::in_context(CTX))
    }

    #[test]
    fn unknown_handles_are_refused_with_cudas_codes() {
        let h = primed();
        assert_eq!(admit(&h, &sync(0xdead)), Err(CUresult::INVALID_HANDLE));
        assert_eq!(
            admit(&h, &args::cuEventQuery { event: 0xdead }),
            Err(CUresult::INVALID_HANDLE)
        );
        assert_eq!(
            admit(&h, &args::cuModuleUnload { module: 0xdead }),
            Err(CUresult::INVALID_HANDLE)
        );
        assert_eq!(
            admit(
                &h,
                &args::cuFuncGetAttribute {
                    value: (),
                    attrib: 0,
                    func: 0xdead
                }
            ),
            Err(CUresult::INVALID_HANDLE)
        );
        assert_eq!(
            admit(&h, &args::cuLibraryUnload { library: 0xdead }),
            Err(CUresult::INVALID_HANDLE)
        );
        assert_eq!(
            admit(
                &h,
                &args::cuKernelGetAttribute {
                    value: (),
                    attrib: 0,
                    kernel: 0xdead,
                    dev: 0
                }
            ),
            Err(CUresult::INVALID_HANDLE)
        );
        assert_eq!(
            admit(&h, &args::cuCtxDestroy_v2 { ctx: 0xdead }),
            Err(CUresult::INVALID_CONTEXT)
        );
        // NULL is never a module, event, ...
        assert_eq!(
            admit(&h, &args::cuEventQuery { event: 0 }),
            Err(CUresult::INVALID_HANDLE)
        );
        // Plain values, strings and out-pointers are not checked; device pointers are the driver's.
        assert_eq!(
            admit(
                &h,
                &args::cuMemsetD8_v2 {
                    dst: 0xdead,
                    value: 1,
                    n: 4
                }
            ),
            Ok(())
        );
    }

    #[test]
    fn stream_sentinels_and_null_context_are_always_valid() {
        let h = Handles::default();
        for s in [0, STREAM_LEGACY, STREAM_PER_THREAD] {
            assert_eq!(admit(&h, &sync(s)), Ok(()), "stream {s}");
        }
        assert_eq!(admit(&h, &sync(3)), Err(CUresult::INVALID_HANDLE));
        assert_eq!(admit(&h, &args::cuCtxSynchronize_v2 { ctx: 0 }), Ok(()));
        assert_eq!(
            admit(&h, &args::cuCtxSynchronize_v2 { ctx: CTX }),
            Err(CUresult::INVALID_CONTEXT)
        );
    }

    #[test]
    fn every_argument_of_a_call_is_checked() {
        let mut h = primed();
        stream(&mut h, CTX, 0x10);
        event(&mut h, CTX, 0x20);
        let wait = |stream, event| args::cuStreamWaitEvent {
            stream,
            event,
            flags: 0,
        };
        assert_eq!(admit(&h, &wait(0x10, 0x20)), Ok(()));
        assert_eq!(admit(&h, &wait(0x11, 0x20)), Err(CUresult::INVALID_HANDLE));
        assert_eq!(admit(&h, &wait(0x10, 0x21)), Err(CUresult::INVALID_HANDLE));
        // Kinds are not interchangeable: an event is not a stream.
        assert_eq!(admit(&h, &wait(0x20, 0x10)), Err(CUresult::INVALID_HANDLE));
        let elapsed = |start, end| args::cuEventElapsedTime { ms: (), start, end };
        assert_eq!(admit(&h, &elapsed(0x20, 0x20)), Ok(()));
        assert_eq!(
            admit(&h, &elapsed(0x20, 0x21)),
            Err(CUresult::INVALID_HANDLE)
        );
    }

    #[test]
    fn destroyed_handles_are_refused() {
        let mut h = primed();
        stream(&mut h, CTX, 0x10);
        event(&mut h, CTX, 0x20);
        h.apply(
            Effect::Destroy(Kind::Stream, 0x10),
            Some(&ApiReply::cuStreamDestroy_v2(Default::default())),
        );
        h.apply(
            Effect::Destroy(Kind::Event, 0x20),
            Some(&ApiReply::cuEventDestroy_v2(Default::default())),
        );
        assert_eq!(admit(&h, &sync(0x10)), Err(CUresult::INVALID_HANDLE));
        assert_eq!(
            admit(&h, &args::cuEventQuery { event: 0x20 }),
            Err(CUresult::INVALID_HANDLE)
        );
        // The driver may hand the same value out again: it is valid again.
        stream(&mut h, CTX, 0x10);
        assert_eq!(admit(&h, &sync(0x10)), Ok(()));
    }

    #[test]
    fn functions_die_with_their_module() {
        let mut h = primed();
        h.add_module(0x100, CTX);
        h.add_module(0x200, CTX);
        h.add_function(0x101, CTX, FunctionSource::Module(0x100));
        h.add_function(0x201, CTX, FunctionSource::Module(0x200));
        assert_eq!(h.check(Kind::Function, 0x101), Ok(()));
        h.apply(
            Effect::Destroy(Kind::Module, 0x100),
            Some(&ApiReply::cuModuleUnload(Default::default())),
        );
        assert_eq!(
            h.check(Kind::Function, 0x101),
            Err(CUresult::INVALID_HANDLE)
        );
        assert_eq!(h.check(Kind::Module, 0x100), Err(CUresult::INVALID_HANDLE));
        assert_eq!(h.check(Kind::Function, 0x201), Ok(()));
        assert_eq!(h.loaded_modules(), [0x200]);
    }

    /// `cuLibraryGetKernel` / `cuLibraryGetModule` register through their `Out` arguments, owned by the
    /// library named in their in-arguments; unloading the library takes them all.
    #[test]
    fn kernels_and_library_modules_die_with_their_library() {
        let mut h = primed();
        h.add_library(0x300);
        let mut owner = Owner::in_context(CTX);
        args::cuLibraryGetKernel {
            kernel: (),
            library: 0x300,
            name: "k".into(),
        }
        .admit(&h, &mut owner)
        .unwrap();
        outs::cuLibraryGetKernel {
            kernel: 0x301,
            library: (),
            name: (),
        }
        .register(&mut h, &owner);
        let mut owner = Owner::in_context(CTX);
        args::cuLibraryGetModule {
            module: (),
            library: 0x300,
        }
        .admit(&h, &mut owner)
        .unwrap();
        outs::cuLibraryGetModule {
            module: 0x302,
            library: (),
        }
        .register(&mut h, &owner);
        h.add_function(0x303, CTX, FunctionSource::Module(0x302));
        h.add_function(0x304, CTX, FunctionSource::Kernel(0x301));

        // A kernel stands where a function is expected, not the other way round.
        assert_eq!(h.check(Kind::Function, 0x301), Ok(()));
        assert_eq!(h.check(Kind::Kernel, 0x304), Err(CUresult::INVALID_HANDLE));
        // A library's module is not the session's to unload at shutdown.
        assert!(h.loaded_modules().is_empty());

        h.apply(
            Effect::Destroy(Kind::Library, 0x300),
            Some(&ApiReply::cuLibraryUnload(Default::default())),
        );
        for (kind, handle) in [
            (Kind::Library, 0x300),
            (Kind::Kernel, 0x301),
            (Kind::Function, 0x301),
            (Kind::Module, 0x302),
            (Kind::Function, 0x303),
            (Kind::Function, 0x304),
        ] {
            assert_eq!(
                h.check(kind, handle),
                Err(CUresult::INVALID_HANDLE),
                "{kind:?} {handle:#x}"
            );
        }
    }

    #[test]
    fn everything_in_a_context_dies_with_it() {
        let mut h = primed();
        create(
            &mut h,
            CTX,
            &ApiReply::cuCtxCreate_v2(outs::cuCtxCreate_v2 {
                pctx: OTHER_CTX,
                flags: (),
                dev: (),
            }),
        );
        assert_eq!(h.created_contexts(), [OTHER_CTX]);
        for ctx in [CTX, OTHER_CTX] {
            h.add_module(ctx + 1, ctx);
            h.add_function(ctx + 2, ctx, FunctionSource::Module(ctx + 1));
            stream(&mut h, ctx, ctx + 3);
            event(&mut h, ctx, ctx + 4);
        }
        h.add_library(0x300);
        h.register(
            Kind::Kernel,
            0x301,
            &Owner {
                library: Some(0x300),
                ..Owner::in_context(OTHER_CTX)
            },
        );

        h.apply(
            Effect::Destroy(Kind::Context, OTHER_CTX),
            Some(&ApiReply::cuCtxDestroy_v2(Default::default())),
        );
        assert_eq!(
            h.check(Kind::Context, OTHER_CTX),
            Err(CUresult::INVALID_CONTEXT)
        );
        for (kind, offset) in [
            (Kind::Module, 1),
            (Kind::Function, 2),
            (Kind::Stream, 3),
            (Kind::Event, 4),
        ] {
            assert_eq!(
                h.check(kind, OTHER_CTX + offset),
                Err(CUresult::INVALID_HANDLE),
                "{kind:?}"
            );
            assert_eq!(h.check(kind, CTX + offset), Ok(()), "{kind:?}");
        }
        // Libraries and kernels are context-independent.
        assert_eq!(h.check(Kind::Library, 0x300), Ok(()));
        assert_eq!(h.check(Kind::Kernel, 0x301), Ok(()));
        assert!(h.created_contexts().is_empty());
    }

    #[test]
    fn primary_context_dies_with_its_last_release_and_is_emptied_by_reset() {
        let mut h = primed();
        let retain = ApiReply::cuDevicePrimaryCtxRetain(outs::cuDevicePrimaryCtxRetain {
            pctx: CTX,
            dev: (),
        });
        h.apply(Effect::PrimaryRetain(0), Some(&retain));
        assert_eq!(h.primary_retains(), [(0, 2)]);
        stream(&mut h, CTX, 0x10);

        let reset = ApiReply::cuDevicePrimaryCtxReset_v2(Default::default());
        h.apply(Effect::PrimaryReset(0), Some(&reset));
        assert_eq!(admit(&h, &sync(0x10)), Err(CUresult::INVALID_HANDLE));
        assert_eq!(h.check(Kind::Context, CTX), Ok(()));

        stream(&mut h, CTX, 0x10);
        let release = ApiReply::cuDevicePrimaryCtxRelease_v2(Default::default());
        h.apply(Effect::PrimaryRelease(0), Some(&release));
        assert_eq!(h.check(Kind::Context, CTX), Ok(()));
        assert_eq!(admit(&h, &sync(0x10)), Ok(()));
        h.apply(Effect::PrimaryRelease(0), Some(&release));
        assert_eq!(h.check(Kind::Context, CTX), Err(CUresult::INVALID_CONTEXT));
        assert_eq!(admit(&h, &sync(0x10)), Err(CUresult::INVALID_HANDLE));
        assert!(h.primary_retains().is_empty());
        // A release without a retain changes nothing (the driver reports it).
        h.apply(Effect::PrimaryRelease(0), Some(&release));
        // Retained again: alive again.
        h.apply(Effect::PrimaryRetain(0), Some(&retain));
        assert_eq!(h.check(Kind::Context, CTX), Ok(()));
        assert!(h.created_contexts().is_empty());
    }

    #[test]
    fn null_handles_are_never_registered() {
        let mut h = Handles::default();
        h.register(Kind::Event, 0, &Owner::default());
        h.add_module(0, CTX);
        h.add_function(0, CTX, FunctionSource::Module(1));
        assert_eq!(h.check(Kind::Event, 0), Err(CUresult::INVALID_HANDLE));
        assert_eq!(h.check(Kind::Module, 0), Err(CUresult::INVALID_HANDLE));
        assert_eq!(h.check(Kind::Function, 0), Err(CUresult::INVALID_HANDLE));
    }

    #[test]
    fn an_explicit_context_argument_owns_what_the_call_creates() {
        let mut h = primed();
        let mut owner = Owner::in_context(0);
        args::cuCtxSynchronize_v2 { ctx: CTX }
            .admit(&h, &mut owner)
            .unwrap();
        assert_eq!(owner.ctx, CTX);
        let mut owner = Owner::in_context(CTX);
        args::cuCtxSynchronize_v2 { ctx: 0 }
            .admit(&h, &mut owner)
            .unwrap();
        assert_eq!(owner.ctx, CTX, "NULL = the current context");
        h.clear();
        assert_eq!(h.check(Kind::Context, CTX), Err(CUresult::INVALID_CONTEXT));
    }

    /// The listed calls that destroy handles (or may: a primary context release).
    const DESTROYING: &[&str] = &[
        "cuDevicePrimaryCtxRelease_v2",
        "cuDevicePrimaryCtxReset_v2",
        "cuCtxDestroy_v2",
        "cuModuleUnload",
        "cuLibraryUnload",
        "cuStreamDestroy_v2",
        "cuEventDestroy_v2",
        "cuArrayDestroy",
        "cuTexObjectDestroy",
        "cuSurfObjectDestroy",
        "cuGraphExecDestroy",
        "cuGraphDestroy",
    ];

    /// A listed call that destroys something must have an [`Effect`] (a tag in the declaration list), or
    /// its handles would outlive it.
    #[test]
    fn every_destroying_call_has_an_effect() {
        for name in LISTED {
            let destroys = ["Destroy", "Unload", "Release", "Reset", "Free"]
                .iter()
                .any(|w| name.contains(w));
            // Memory frees take device pointers, which are not handles (pools and physical allocations
            // are checked below).
            // Resetting the persisting L2 lines touches no handle.
            let resets_cache = *name == "cuCtxResetPersistingL2Cache";
            if destroys && !name.starts_with("cuMem") && !resets_cache {
                assert!(DESTROYING.contains(name), "{name} destroys handles");
            }
        }
        let calls = [
            ApiCall::cuDevicePrimaryCtxRelease_v2(args::cuDevicePrimaryCtxRelease_v2 { dev: 1 }),
            ApiCall::cuDevicePrimaryCtxReset_v2(args::cuDevicePrimaryCtxReset_v2 { dev: 1 }),
            ApiCall::cuCtxDestroy_v2(args::cuCtxDestroy_v2 { ctx: 7 }),
            ApiCall::cuModuleUnload(args::cuModuleUnload { module: 7 }),
            ApiCall::cuLibraryUnload(args::cuLibraryUnload { library: 7 }),
            ApiCall::cuStreamDestroy_v2(args::cuStreamDestroy_v2 { stream: 7 }),
            ApiCall::cuEventDestroy_v2(args::cuEventDestroy_v2 { event: 7 }),
            ApiCall::cuArrayDestroy(args::cuArrayDestroy { array: 7 }),
            ApiCall::cuTexObjectDestroy(args::cuTexObjectDestroy { object: 7 }),
            ApiCall::cuSurfObjectDestroy(args::cuSurfObjectDestroy { object: 7 }),
            ApiCall::cuGraphExecDestroy(args::cuGraphExecDestroy { exec: 7 }),
            ApiCall::cuGraphDestroy(args::cuGraphDestroy { graph: 7 }),
        ];
        let names: Vec<_> = calls.iter().map(ApiCall::name).collect();
        assert_eq!(names, DESTROYING);
        for call in &calls {
            assert_ne!(Effect::of(call), Effect::None, "{}", call.name());
        }
        assert_eq!(Effect::of(&calls[5]), Effect::Destroy(Kind::Stream, 7));
        for call in [
            ApiCall::cuMemPoolDestroy(args::cuMemPoolDestroy { pool: 7 }),
            ApiCall::cuMemRelease(args::cuMemRelease { handle: 7 }),
        ] {
            assert_ne!(Effect::of(&call), Effect::None, "{}", call.name());
        }
        assert_eq!(Effect::of(&calls[1]), Effect::PrimaryReset(1));
        assert_eq!(Effect::of(&calls[11]), Effect::Destroy(Kind::Graph, 7));
    }

    #[test]
    fn graphs_live_until_destroyed() {
        let mut h = Handles::default();
        let end = ApiReply::cuStreamEndCapture(outs::cuStreamEndCapture {
            graph: 0x60,
            ..Default::default()
        });
        end.register(&mut h, &Owner::default());
        let exec = ApiReply::cuGraphInstantiateWithFlags(outs::cuGraphInstantiateWithFlags {
            exec: 0x61,
            ..Default::default()
        });
        exec.register(&mut h, &Owner::default());
        assert_eq!(h.check(Kind::Graph, 0x60), Ok(()));
        assert_eq!(h.check(Kind::GraphExec, 0x61), Ok(()));
        // A graph is not an executable graph, nor the reverse.
        assert_eq!(
            h.check(Kind::GraphExec, 0x60),
            Err(CUresult::INVALID_HANDLE)
        );
        let died = h.apply(Effect::Destroy(Kind::Graph, 0x60), None);
        assert_eq!(died.handles, [(Kind::Graph, 0x60)]);
        assert_eq!(h.check(Kind::Graph, 0x60), Err(CUresult::INVALID_HANDLE));
        assert_eq!(h.check(Kind::GraphExec, 0x61), Ok(()));
        assert_eq!(h.graphs(), (vec![], vec![0x61]));
    }

    /// Arrays and texture and surface objects belong to their context; a resource descriptor's array is
    /// checked like a handle argument; objects outlive the array they read (CUDA leaves that to the
    /// application).
    #[test]
    fn arrays_and_objects_die_with_their_context_and_descriptors_are_checked() {
        use crate::descriptors::{CUDA_RESOURCE_DESC, LinearResource, Resource};
        let mut h = primed();
        let owner = Owner::in_context(CTX);
        outs::cuArray3DCreate_v2 {
            array: 0x500,
            desc: (),
        }
        .register(&mut h, &owner);
        let tex = |res: Resource| args::cuTexObjectCreate {
            object: (),
            res_desc: Box::new(CUDA_RESOURCE_DESC::new(res)),
            tex_desc: Box::default(),
            view_desc: None,
        };
        assert_eq!(admit(&h, &tex(Resource::Array(0x500))), Ok(()));
        assert_eq!(
            admit(&h, &tex(Resource::Array(0x501))),
            Err(CUresult::INVALID_HANDLE)
        );
        assert_eq!(
            admit(&h, &tex(Resource::Mipmapped(0x500))),
            Err(CUresult::INVALID_HANDLE)
        );
        // Linear memory is a device pointer: the driver's to check.
        let linear = Resource::Linear(LinearResource {
            devPtr: 0xdead,
            ..Default::default()
        });
        assert_eq!(admit(&h, &tex(linear)), Ok(()));
        outs::cuTexObjectCreate {
            object: 7,
            ..Default::default()
        }
        .register(&mut h, &owner);
        outs::cuSurfObjectCreate {
            object: 8,
            ..Default::default()
        }
        .register(&mut h, &owner);
        let died = h.apply(
            Effect::Destroy(Kind::Array, 0x500),
            Some(&ApiReply::cuArrayDestroy(Default::default())),
        );
        assert_eq!(died.handles, [(Kind::Array, 0x500)]);
        assert_eq!(h.check(Kind::TexObject, 7), Ok(()));
        h.apply(
            Effect::Destroy(Kind::Context, CTX),
            Some(&ApiReply::cuCtxDestroy_v2(Default::default())),
        );
        assert_eq!(h.check(Kind::TexObject, 7), Err(CUresult::INVALID_HANDLE));
        assert_eq!(h.check(Kind::SurfObject, 8), Err(CUresult::INVALID_HANDLE));
    }

    /// Pools die by `cuMemPoolDestroy` only (they are a device's, not a context's); physical allocations
    /// are counted: `cuMemCreate` and each `cuMemRetainAllocationHandle` add a reference, each
    /// `cuMemRelease` drops one, and the handle is refused once none is left.
    #[test]
    fn pools_and_physical_allocations_follow_their_own_calls() {
        let mut h = primed();
        let mut owner = Owner::in_context(CTX);
        outs::cuDeviceGetDefaultMemPool {
            pool_out: 0x900,
            dev: (),
        }
        .register(&mut h, &owner);
        let free_async = |pool| args::cuMemPoolTrimTo {
            pool,
            min_bytes_to_keep: 0,
        };
        assert_eq!(admit(&h, &free_async(0x900)), Ok(()));
        assert_eq!(admit(&h, &free_async(0x901)), Err(CUresult::INVALID_HANDLE));
        // A context's end leaves pools alone.
        h.apply(Effect::PrimaryReset(0), None);
        assert_eq!(h.check(Kind::MemPool, 0x900), Ok(()));
        let destroy = ApiCall::cuMemPoolDestroy(args::cuMemPoolDestroy { pool: 0x900 });
        assert_eq!(Effect::of(&destroy), Effect::Destroy(Kind::MemPool, 0x900));
        h.apply(Effect::of(&destroy), None);
        assert_eq!(h.check(Kind::MemPool, 0x900), Err(CUresult::INVALID_HANDLE));

        args::cuMemCreate {
            handle: (),
            size: 1 << 21,
            prop: Box::default(),
            flags: 0,
        }
        .admit(&h, &mut owner)
        .unwrap();
        outs::cuMemCreate {
            handle: 0xa10,
            ..Default::default()
        }
        .register(&mut h, &owner);
        outs::cuMemRetainAllocationHandle {
            handle: 0xa10,
            addr: (),
        }
        .register(&mut h, &owner);
        let map = |handle| args::cuMemMap {
            ptr: 0,
            size: 0,
            offset: 0,
            handle,
            flags: 0,
        };
        assert_eq!(admit(&h, &map(0xa10)), Ok(()));
        assert_eq!(admit(&h, &map(0xa11)), Err(CUresult::INVALID_HANDLE));
        let release = ApiCall::cuMemRelease(args::cuMemRelease { handle: 0xa10 });
        assert_eq!(
            Effect::of(&release),
            Effect::Destroy(Kind::MemHandle, 0xa10)
        );
        h.apply(Effect::of(&release), None);
        assert_eq!(admit(&h, &map(0xa10)), Ok(()), "one reference left");
        let died = h.apply(Effect::of(&release), None);
        assert_eq!(died.handles, [(Kind::MemHandle, 0xa10)]);
        assert_eq!(admit(&h, &map(0xa10)), Err(CUresult::INVALID_HANDLE));
    }

    #[test]
    fn handle_markers_name_their_kind() {
        assert_eq!(<Stream as HandleKind>::KIND, Kind::Stream);
        assert_eq!(<Kernel as HandleKind>::KIND, Kind::Kernel);
        assert_eq!(<Context as HandleKind>::KIND, Kind::Context);
    }
}
