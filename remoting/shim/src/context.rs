//! Contexts: the current-context stack is thread-local on the client, as in the real driver; each request
//! carries the calling thread's current context, and the server makes it current before executing.
//!
//! Context handles come from the server (`cuDevicePrimaryCtxRetain`, `cuCtxCreate_v2`) and live in the
//! session's registry ([`crate::handles`]), which knows each one's device, so `cuCtxGetDevice` needs no
//! round trip.

use std::cell::RefCell;
use std::ffi::c_void;

use gleam_protocol::types::{CUcontext, CUresult};

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
    set_current(ctx as u64);
    Ok(())
}

pub unsafe fn cuCtxPushCurrent_v2(ctx: CUcontext) -> Result<(), CUresult> {
    state::session()?;
    if ctx.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    let _ = STACK.try_with(|s| s.borrow_mut().push(ctx as u64));
    Ok(())
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
    handles::lock().set_context_device(ctx, dev);
    // A created context becomes current on the calling thread.
    let _ = STACK.try_with(|s| s.borrow_mut().push(ctx));
    Ok(())
}

pub unsafe fn cuCtxDestroy_v2(ctx: CUcontext) -> Result<(), CUresult> {
    if ctx.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: forwarded; the registry drops the context and everything in it.
    unsafe { forward::cuCtxDestroy_v2(ctx)? };
    let ctx = ctx as u64;
    let _ = STACK.try_with(|s| s.borrow_mut().retain(|&c| c != ctx));
    Ok(())
}
