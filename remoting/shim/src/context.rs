//! Contexts: the current-context stack is thread-local on the client, as in the real driver; each request
//! carries the calling thread's current context, and the server makes it current before executing.
//!
//! Context handles come from the server (`cuDevicePrimaryCtxRetain`, `cuCtxCreate_v2`); the device each
//! belongs to is recorded here so `cuCtxGetDevice` needs no round trip.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use gleam_protocol::types::{CUcontext, CUresult};

use crate::{export, generated::fwd, put, state};

thread_local! {
    /// This thread's context stack; the last entry is current.
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Device of each context handle the server gave out.
static DEVICES: Mutex<Option<HashMap<u64, i32>>> = Mutex::new(None);

fn devices() -> MutexGuard<'static, Option<HashMap<u64, i32>>> {
    DEVICES.lock().unwrap_or_else(|e| e.into_inner())
}

/// The calling thread's current context (0 = none).
pub fn current() -> u64 {
    STACK
        .try_with(|s| s.borrow().last().copied().unwrap_or(0))
        .unwrap_or(0)
}

/// Records that `ctx` belongs to `device`.
pub fn record(ctx: u64, device: i32) {
    devices()
        .get_or_insert_with(HashMap::new)
        .insert(ctx, device);
}

/// The device of `ctx` (the current context when 0).
pub fn device_of(ctx: u64) -> Result<i32, CUresult> {
    let ctx = if ctx == 0 { current() } else { ctx };
    if ctx == 0 {
        return Err(CUresult::INVALID_CONTEXT);
    }
    // A context we did not see created (none should exist) is taken to be on device 0.
    Ok(devices()
        .as_ref()
        .and_then(|m| m.get(&ctx).copied())
        .unwrap_or(0))
}

fn set_current(ctx: u64) {
    let _ = STACK.try_with(|s| {
        let mut s = s.borrow_mut();
        match (s.last_mut(), ctx) {
            (Some(top), 0) => {
                // Unbinding: the context below becomes current again.
                let _ = top;
                s.pop();
            }
            (Some(top), ctx) => *top = ctx,
            (None, 0) => {}
            (None, ctx) => s.push(ctx),
        }
    });
}

export! {
    fn cuCtxGetCurrent(pctx: *mut CUcontext) {
        state::session()?;
        put(pctx, current() as *mut c_void)
    }

    fn cuCtxSetCurrent(ctx: CUcontext) {
        state::session()?;
        set_current(ctx as u64);
        Ok(())
    }

    fn cuCtxPushCurrent_v2(ctx: CUcontext) {
        state::session()?;
        if ctx.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        let _ = STACK.try_with(|s| s.borrow_mut().push(ctx as u64));
        Ok(())
    }

    fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) {
        state::session()?;
        let popped = STACK
            .try_with(|s| s.borrow_mut().pop())
            .ok()
            .flatten()
            .ok_or(CUresult::INVALID_CONTEXT)?;
        if !pctx.is_null() {
            put(pctx, popped as *mut c_void)?;
        }
        Ok(())
    }

    fn cuCtxGetDevice(device: *mut i32) {
        state::session()?;
        if device.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        put(device, device_of(0)?)
    }

    fn cuCtxGetDevice_v2(device: *mut i32, ctx: CUcontext) {
        state::session()?;
        if device.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        put(device, device_of(ctx as u64)?)
    }

    fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: i32) {
        state::device(dev)?;
        fwd::cuDevicePrimaryCtxRetain(pctx, dev)?;
        record(*pctx as u64, dev);
        Ok(())
    }

    fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: u32, dev: i32) {
        state::device(dev)?;
        fwd::cuCtxCreate_v2(pctx, flags, dev)?;
        let ctx = *pctx as u64;
        record(ctx, dev);
        // A created context becomes current on the calling thread.
        let _ = STACK.try_with(|s| s.borrow_mut().push(ctx));
        Ok(())
    }

    fn cuCtxDestroy_v2(ctx: CUcontext) {
        if ctx.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        fwd::cuCtxDestroy_v2(ctx)?;
        let ctx = ctx as u64;
        let _ = STACK.try_with(|s| s.borrow_mut().retain(|&c| c != ctx));
        if let Some(m) = devices().as_mut() {
            m.remove(&ctx);
        }
        Ok(())
    }
}
