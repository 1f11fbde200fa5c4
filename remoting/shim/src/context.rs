//! Contexts: the current-context stack is thread-local on the client, as in the real driver; each request
//! carries the calling thread's current context, and the server makes it current before executing.
//!
//! Context handles come from the server (`cuDevicePrimaryCtxRetain`, `cuCtxCreate_v2`/`_v3`) and live in
//! the session's registry ([`crate::handles`]), which knows each one's device, so `cuCtxGetDevice` needs
//! no round trip. The older exports (`cuCtxPushCurrent`, the primary context calls without `_v2`...)
//! are what binaries built against old headers call: same semantics, same code (`cuCtxDestroy` is the
//! list's alias of its `_v2`). The pre-3.2 `cuCtxCreate` is the exception: it asks for a context of
//! 32-bit device pointers, which NVIDIA's driver refuses on a 64-bit system. `cuCtxCreate_v4` takes its parameters as a struct of pointers, read here.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};

use gleam_protocol::registry::Kind;
use gleam_protocol::types::{CUcontext, CUctxCreateParams, CUexecAffinityParam, CUresult};

use crate::{forward, handles, put, state};

thread_local! {
    /// This thread's context stack; the last entry is current.
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// The calling thread's current context (0 = none).
pub fn current() -> u64 {
    STACK
        .try_with(|s| s.borrow().last().copied().unwrap_or(0))
        .unwrap_or(0)
}

/// The device of `ctx` (the current context when 0).
pub fn device_of(ctx: u64) -> Result<i32, CUresult> {
    let ctx = if ctx == 0 { current() } else { ctx };
    if ctx == 0 {
        return Err(CUresult::INVALID_CONTEXT);
    }
    let handles = handles::lock();
    handles.check(gleam_protocol::registry::Kind::Context, ctx)?;
    // A live context whose device the registry does not know (none should exist) is on device 0.
    Ok(handles.context_device(ctx).unwrap_or(0))
}

fn set_current(ctx: u64) {
    let _ = STACK.try_with(|s| {
        let mut s = s.borrow_mut();
        match (s.last_mut(), ctx) {
            // Unbinding: the context below becomes current again.
            (Some(_), 0) => {
                s.pop();
            }
            (Some(top), ctx) => *top = ctx,
            (None, 0) => {}
            (None, ctx) => s.push(ctx),
        }
    });
}

pub unsafe fn cuCtxGetCurrent(pctx: *mut CUcontext) -> Result<(), CUresult> {
    state::session()?;
    // SAFETY: the caller's out-pointer (NULL is refused by `put`).
    unsafe { put(pctx, current() as *mut c_void) }
}

pub unsafe fn cuCtxSetCurrent(ctx: CUcontext) -> Result<(), CUresult> {
    state::session()?;
    if !ctx.is_null() {
        handles::check(Kind::Context, ctx as u64)?;
    }
    set_current(ctx as u64);
    Ok(())
}

pub unsafe fn cuCtxPushCurrent_v2(ctx: CUcontext) -> Result<(), CUresult> {
    state::session()?;
    if ctx.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    handles::check(Kind::Context, ctx as u64)?;
    let _ = STACK.try_with(|s| s.borrow_mut().push(ctx as u64));
    Ok(())
}

pub unsafe fn cuCtxPushCurrent(ctx: CUcontext) -> Result<(), CUresult> {
    // SAFETY: the same call under its CUDA 3.x name.
    unsafe { cuCtxPushCurrent_v2(ctx) }
}

pub unsafe fn cuCtxPopCurrent(pctx: *mut CUcontext) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe { cuCtxPopCurrent_v2(pctx) }
}

pub unsafe fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> Result<(), CUresult> {
    state::session()?;
    let popped = STACK
        .try_with(|s| s.borrow_mut().pop())
        .ok()
        .flatten()
        .ok_or(CUresult::INVALID_CONTEXT)?;
    if !pctx.is_null() {
        // SAFETY: the caller's out-pointer, non-NULL.
        unsafe { put(pctx, popped as *mut c_void)? };
    }
    Ok(())
}

pub unsafe fn cuCtxGetDevice(device: *mut i32) -> Result<(), CUresult> {
    state::session()?;
    if device.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(device, device_of(0)?) }
}

pub unsafe fn cuCtxGetDevice_v2(device: *mut i32, ctx: CUcontext) -> Result<(), CUresult> {
    state::session()?;
    if device.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: as above.
    unsafe { put(device, device_of(ctx as u64)?) }
}

pub unsafe fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: i32) -> Result<(), CUresult> {
    state::device(dev)?;
    // SAFETY: forwarded under the same contract; the registry records the context and its device.
    unsafe { forward::cuDevicePrimaryCtxRetain(pctx, dev) }
}

pub unsafe fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: u32, dev: i32) -> Result<(), CUresult> {
    state::device(dev)?;
    // SAFETY: forwarded under the same contract; `pctx` was written on success.
    let ctx = unsafe {
        forward::cuCtxCreate_v2(pctx, flags, dev)?;
        *pctx as u64
    };
    created(ctx, dev);
    Ok(())
}

/// `cuCtxCreate` as exported before CUDA 3.2 (binaries built against 3.1 headers; `cuGetProcAddress`
/// for versions below 3020): a context for the v1 calls' 32-bit device pointers. Measured on NVIDIA's
/// 580 driver (H200), it answers `CUDA_ERROR_OUT_OF_MEMORY` and creates nothing; so does Gleam, after
/// the checks every creation makes.
pub unsafe fn cuCtxCreate(pctx: *mut CUcontext, flags: u32, dev: i32) -> Result<(), CUresult> {
    if pctx.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::device(dev)?;
    let _ = flags;
    Err(CUresult::OUT_OF_MEMORY)
}

/// A context was created on this thread: it belongs to `dev`, and it is current here now.
fn created(ctx: u64, dev: i32) {
    handles::lock().set_context_device(ctx, dev);
    let _ = STACK.try_with(|s| s.borrow_mut().push(ctx));
}

/// `cuCtxCreate_v3`: with execution affinity parameters. There is one kind of affinity (an SM count),
/// so at most one parameter means anything; none is `cuCtxCreate_v2`.
pub unsafe fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    params: *const CUexecAffinityParam,
    num_params: i32,
    flags: u32,
    dev: i32,
) -> Result<(), CUresult> {
    state::device(dev)?;
    match num_params {
        // SAFETY: as cuCtxCreate_v2.
        0 => unsafe { cuCtxCreate_v2(pctx, flags, dev) },
        1 => {
            // SAFETY: forwarded; `params` holds one parameter (NULL is refused), `pctx` was written.
            let ctx = unsafe {
                forward::cuCtxCreate_v3(pctx, params, 1, flags, dev)?;
                *pctx as u64
            };
            created(ctx, dev);
            Ok(())
        }
        _ => Err(CUresult::INVALID_VALUE),
    }
}

/// `cuCtxCreate_v4`: the parameters of `_v3` in a struct, plus CUDA-in-graphics sharing, which needs a
/// graphics context on the borrowing device and is not offered.
pub unsafe fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    params: *const CUctxCreateParams,
    flags: u32,
    dev: i32,
) -> Result<(), CUresult> {
    if params.is_null() {
        // SAFETY: as cuCtxCreate_v2.
        return unsafe { cuCtxCreate_v2(pctx, flags, dev) };
    }
    // SAFETY: non-NULL, and the C API requires a valid CUctxCreateParams behind it.
    let p = unsafe { params.read_unaligned() };
    if !p.cig_params.is_null() {
        tracing::warn!(
            "cuCtxCreate_v4 with CUDA-in-graphics parameters: a context shared with a graphics API needs              that API's context on the GPU's machine; refused with CUDA_ERROR_NOT_SUPPORTED"
        );
        return Err(CUresult::NOT_SUPPORTED);
    }
    if p.num_exec_affinity_params > 0 && p.exec_affinity_params.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the affinity parameters as the application gave them (count and pointer checked above).
    unsafe {
        cuCtxCreate_v3(
            pctx,
            p.exec_affinity_params,
            p.num_exec_affinity_params,
            flags,
            dev,
        )
    }
}

pub unsafe fn cuCtxDestroy_v2(ctx: CUcontext) -> Result<(), CUresult> {
    if ctx.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: forwarded; the registry drops the context and everything in it.
    unsafe { forward::cuCtxDestroy_v2(ctx)? };
    let ctx = ctx as u64;
    let _ = STACK.try_with(|s| s.borrow_mut().retain(|&c| c != ctx));
    attachments().remove(&ctx);
    Ok(())
}

/// Usage counts of `cuCtxAttach`/`cuCtxDetach` (CUDA 2.x), beyond the creation's own.
fn attachments() -> MutexGuard<'static, HashMap<u64, u32>> {
    static ATTACHED: LazyLock<Mutex<HashMap<u64, u32>>> = LazyLock::new(Mutex::default);
    ATTACHED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `cuCtxAttach` (deprecated since CUDA 4.0): one more use of the current context, which it returns.
pub unsafe fn cuCtxAttach(pctx: *mut CUcontext, flags: u32) -> Result<(), CUresult> {
    state::session()?;
    if flags != 0 || pctx.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let ctx = current();
    if ctx == 0 {
        return Err(CUresult::INVALID_CONTEXT);
    }
    handles::check(Kind::Context, ctx)?;
    *attachments().entry(ctx).or_insert(0) += 1;
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(pctx, ctx as *mut c_void) }
}

/// `cuCtxDetach` (deprecated since CUDA 4.0): one use less; the last one (creation included) destroys
/// the context.
pub unsafe fn cuCtxDetach(ctx: CUcontext) -> Result<(), CUresult> {
    state::session()?;
    let handle = ctx as u64;
    handles::check(Kind::Context, handle)?;
    let mut attached = attachments();
    match attached.get_mut(&handle) {
        Some(n) if *n > 0 => {
            *n -= 1;
            Ok(())
        }
        _ => {
            drop(attached);
            // SAFETY: a live context (checked above).
            unsafe { cuCtxDestroy_v2(ctx) }
        }
    }
}

/// `CU_LIMIT_STACK_SIZE`: the driver raises it by itself when a launch needs more stack.
const LIMIT_STACK_SIZE: u32 = 0;

/// Limits read from the server, by (context, limit). A limit changes through `cuCtxSetLimit` (the driver
/// may round the value, so a set drops the entry rather than storing it), and the stack size also when a
/// launch needs more than it ("the driver automatically increases the per-thread stack size for each
/// kernel launch as needed"): that happens at the first launch of a function (or of an executable graph,
/// or at its instantiation) needing more, so a cached stack size is dropped at each first launch
/// ([`launched_one`]). GPT-2 in fp16 through PyTorch waited for 769 round trips of limits (measured on the
/// H200 through `gleam trace`: `CU_LIMIT_CIG_ENABLED`, read again and again).
static LIMITS: LazyLock<Mutex<HashMap<(u64, u32), usize>>> = LazyLock::new(Mutex::default);

fn limits() -> MutexGuard<'static, HashMap<(u64, u32), usize>> {
    LIMITS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub unsafe fn cuCtxGetLimit(value: *mut usize, limit: u32) -> Result<(), CUresult> {
    if value.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let ctx = current();
    let known = limits().get(&(ctx, limit)).copied();
    let v = match known {
        Some(v) => v,
        None => {
            // A set or a launch of another thread sent while this read travels may change the value:
            // the reading is kept only if none was ([`CHANGES`]).
            let changes = CHANGES.load(Ordering::Acquire);
            let mut v = 0usize;
            // SAFETY: a valid out-pointer to a local.
            unsafe { forward::cuCtxGetLimit(&raw mut v, limit)? };
            tracing::debug!(limit, value = v, "context limit read from the peer");
            let mut limits = limits();
            if ctx != 0 && CHANGES.load(Ordering::Acquire) == changes {
                if limit == LIMIT_STACK_SIZE {
                    STACK_CACHED.store(true, Ordering::Release);
                }
                limits.insert((ctx, limit), v);
            }
            v
        }
    };
    // SAFETY: the caller's out-pointer, non-NULL.
    unsafe { put(value, v) }
}

pub unsafe fn cuCtxSetLimit(limit: u32, value: usize) -> Result<(), CUresult> {
    // SAFETY: plain values, forwarded under the same contract.
    let set = unsafe { forward::cuCtxSetLimit(limit, value) };
    // After the set is sent: a read sent before it, answered with the old value, is then not kept.
    CHANGES.fetch_add(1, Ordering::AcqRel);
    limits().remove(&(current(), limit));
    set
}

/// Stream priority ranges read from the server, by context: a property of the context's device, which
/// nothing changes (cuDNN reads it again for its handles; PyTorch once).
static PRIORITY_RANGES: LazyLock<Mutex<HashMap<u64, (i32, i32)>>> = LazyLock::new(Mutex::default);

fn priority_ranges() -> MutexGuard<'static, HashMap<u64, (i32, i32)>> {
    PRIORITY_RANGES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub unsafe fn cuCtxGetStreamPriorityRange(
    least: *mut i32,
    greatest: *mut i32,
) -> Result<(), CUresult> {
    let ctx = current();
    let known = priority_ranges().get(&ctx).copied();
    let (l, g) = match known {
        Some(range) => range,
        None => {
            let (mut l, mut g) = (0i32, 0i32);
            // SAFETY: valid out-pointers to locals (both wanted, whatever the caller asked for).
            unsafe { forward::cuCtxGetStreamPriorityRange(&raw mut l, &raw mut g)? };
            if ctx != 0 {
                priority_ranges().insert(ctx, (l, g));
            }
            (l, g)
        }
    };
    // Either pointer may be NULL: that value is not wanted.
    if !least.is_null() {
        // SAFETY: the caller's out-pointer, non-NULL.
        unsafe { put(least, l)? };
    }
    if !greatest.is_null() {
        // SAFETY: as above.
        unsafe { put(greatest, g)? };
    }
    Ok(())
}

/// The context was destroyed or reset: its limits are the driver's defaults again.
pub fn context_emptied(ctx: u64) {
    CHANGES.fetch_add(1, Ordering::AcqRel);
    priority_ranges().remove(&ctx);
    limits().retain(|&(c, _), _| c != ctx);
    launched().retain(|&(c, _)| c != ctx);
}

/// Counts what may change a limit (sets, launches, a context's end), bumped after it was sent and before
/// the cache entry goes: a read whose request left before the change may come back with the old value,
/// and keeps it only if the count did not move meanwhile.
static CHANGES: AtomicU64 = AtomicU64::new(0);

/// Whether a stack size may be cached (the launch path's fast check).
static STACK_CACHED: AtomicBool = AtomicBool::new(false);
/// (context, function or executable graph) launched since the stack size was cached.
static LAUNCHED: LazyLock<Mutex<HashSet<(u64, u64)>>> = LazyLock::new(Mutex::default);

fn launched() -> MutexGuard<'static, HashSet<(u64, u64)>> {
    LAUNCHED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A launch of `what` (a function, a kernel, an executable graph) in the current context was sent: the
/// first one may raise the stack size, so the cached value goes.
pub fn launched_one(what: u64) {
    CHANGES.fetch_add(1, Ordering::AcqRel);
    if !STACK_CACHED.load(Ordering::Acquire) {
        return;
    }
    let ctx = current();
    if launched().insert((ctx, what)) {
        stack_may_change(ctx);
    }
}

/// Drops the cached stack size of `ctx` (an instantiation or a first launch, sent, may raise it).
pub fn stack_may_change(ctx: u64) {
    CHANGES.fetch_add(1, Ordering::AcqRel);
    let mut limits = limits();
    limits.remove(&(ctx, LIMIT_STACK_SIZE));
    if !limits.keys().any(|&(_, l)| l == LIMIT_STACK_SIZE) {
        STACK_CACHED.store(false, Ordering::Release);
    }
}
