//! `cuDevicePrimaryCtxGetState`, answered on the client: the runtime and cuBLAS ask it thousands of times
//! per second (18,301 calls in a ResNet-50 run), and it only reads state this process itself changes.
//!
//! * `active`: whether this process holds a retain of the device's primary context (each client is its own
//!   process and session, so the serving driver's primary context is this process's alone); the session's
//!   registry counts retains ([`crate::handles`]).
//! * `flags`: asked of the peer once per device, then kept in step with `cuDevicePrimaryCtxSetFlags`.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use gleam_protocol::types::CUresult;

use crate::{forward, handles, put, state};

/// Primary-context flags by device, once known.
static FLAGS: Mutex<Option<HashMap<i32, u32>>> = Mutex::new(None);

fn flags() -> MutexGuard<'static, Option<HashMap<i32, u32>>> {
    FLAGS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub unsafe fn cuDevicePrimaryCtxGetState(
    dev: i32,
    flags_out: *mut u32,
    active_out: *mut i32,
) -> Result<(), CUresult> {
    if flags_out.is_null() || active_out.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    state::device(dev)?;
    let known = flags().as_ref().and_then(|f| f.get(&dev).copied());
    let value = match known {
        Some(v) => v,
        None => {
            let (mut v, mut active) = (0u32, 0i32);
            // SAFETY: valid out-pointers to locals.
            unsafe { forward::cuDevicePrimaryCtxGetState(dev, &raw mut v, &raw mut active) }?;
            flags().get_or_insert_with(HashMap::new).insert(dev, v);
            v
        }
    };
    let active = handles::lock()
        .primary_retains()
        .iter()
        .any(|&(d, n)| d == dev && n > 0);
    // SAFETY: the caller's out-pointers, checked non-NULL.
    unsafe {
        put(flags_out, value)?;
        put(active_out, i32::from(active))
    }
}

pub unsafe fn cuDevicePrimaryCtxSetFlags_v2(dev: i32, value: u32) -> Result<(), CUresult> {
    state::device(dev)?;
    // SAFETY: plain values, forwarded.
    unsafe { forward::cuDevicePrimaryCtxSetFlags_v2(dev, value) }?;
    flags().get_or_insert_with(HashMap::new).insert(dev, value);
    Ok(())
}
