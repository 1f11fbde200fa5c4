//! `cuGetExportTable`: the driver's private tables that cudart (and every static cudart copy inside
//! cuBLAS, cuDNN...) asks for by UUID. They cannot be forwarded (their arguments point into client
//! memory), so the ones cudart needs are implemented here in terms of the public, remoted calls:
//!
//! * CUDART_INTERFACE: module loading from fatbin wrappers and headers (-> `cuModuleLoadData`), the primary
//!   context of a device (-> `cuDevicePrimaryCtxRetain`), and no-op slots;
//! * TOOLS_TLS and TOOLS_RUNTIME_CALLBACK_HOOKS: no tool attached (zeroed buffers);
//! * CONTEXT_LOCAL_STORAGE: a client-side map keyed by (context, key), since the values are client
//!   pointers;
//! * CONTEXT_CHECKS: constants.
//!
//! Every other UUID is logged (once each) and refused with `CUDA_ERROR_NOT_SUPPORTED`. Not implemented yet:
//! INTEGRITY_CHECK (`D4082055-...`), whose hash static cudart verifies before its first call, so programs
//! built with nvcc's runtime API fail there (`cudaErrorNotSupported`) for now; driver-API programs
//! (cudarc, `-lcuda`) do not use it.

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use gleam_protocol::types::{CUcontext, CUmodule, CUresult};

use crate::{context, exports, put, state};

/// A table: pointer-sized slots (slot 0 usually the table's byte size).
#[repr(C)]
struct Table<const N: usize>([*const (); N]);

// SAFETY: the tables are immutable arrays of function addresses and integers.
unsafe impl<const N: usize> Sync for Table<N> {}

fn uuid(text: &str) -> [u8; 16] {
    let hex: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).take(16).enumerate() {
        let digit = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
        out[i] = digit(pair[0]) << 4 | digit(pair[1]);
    }
    out
}

const CUDART_INTERFACE: &str = "6BD5FB6C-5BF4-E74A-8987-D93912FD9DF9";
const TOOLS_TLS: &str = "42D85A81-23F6-CB47-8298-F6E78A3AECDC";
const TOOLS_RUNTIME_CALLBACK_HOOKS: &str = "A094798C-2E74-2E74-93F2-0800200C0A66";
const CONTEXT_LOCAL_STORAGE: &str = "C693336E-1121-DF11-A8C3-68F355D89593";
const CONTEXT_CHECKS: &str = "263E8860-7CD2-6143-92F6-BBD5006DFA7E";

extern "C" fn zero() -> u32 {
    0
}

unsafe extern "C" fn get_module_from_cubin(
    module: *mut CUmodule,
    wrapper: *const c_void,
) -> CUresult {
    // SAFETY: forwarded to the public (guarded) call with the same contract.
    unsafe { exports::cuModuleLoadData(module, wrapper) }
}

unsafe extern "C" fn get_module_from_cubin_ext1(
    module: *mut CUmodule,
    wrapper: *const c_void,
    arg3: *mut c_void,
    arg4: *mut c_void,
    arg5: u32,
) -> CUresult {
    // SAFETY: as above.
    unsafe { load_without_extras(module, wrapper, arg3, arg4, arg5) }
}

unsafe extern "C" fn get_module_from_cubin_ext2(
    header: *const c_void,
    module: *mut CUmodule,
    arg3: *mut c_void,
    arg4: *mut c_void,
    arg5: u32,
) -> CUresult {
    // SAFETY: as above.
    unsafe { load_without_extras(module, header, arg3, arg4, arg5) }
}

/// The `_ext` loaders' work: their extra arguments (unknown meaning) must be empty.
unsafe fn load_without_extras(
    module: *mut CUmodule,
    image: *const c_void,
    arg3: *mut c_void,
    arg4: *mut c_void,
    arg5: u32,
) -> CUresult {
    if !arg3.is_null() || !arg4.is_null() || arg5 != 0 {
        return CUresult::NOT_SUPPORTED;
    }
    // SAFETY: forwarded to the public call with the same contract.
    unsafe { exports::cuModuleLoadData(module, image) }
}

unsafe extern "C" fn primary_context(pctx: *mut CUcontext, dev: i32) -> CUresult {
    // SAFETY: as above.
    unsafe { exports::cuDevicePrimaryCtxRetain(pctx, dev) }
}

extern "C" fn noop_usize(_: usize) -> CUresult {
    CUresult::SUCCESS
}

extern "C" fn load_compilers() -> CUresult {
    CUresult::SUCCESS
}

static mut HOOK_BUFFER_1: [usize; 1024] = [0; 1024];
static mut HOOK_BUFFER_2: [usize; 14] = [0; 14];

unsafe extern "C" fn hook_buffer_1(ptr: *mut *mut c_void, size: *mut usize) -> CUresult {
    // SAFETY: out-pointers from cudart; the buffer is static and stays zero (no tool attached).
    unsafe { hand_out(&raw mut HOOK_BUFFER_1, ptr, size) }
}

unsafe extern "C" fn hook_buffer_2(ptr: *mut *mut c_void, size: *mut usize) -> CUresult {
    // SAFETY: as above.
    unsafe { hand_out(&raw mut HOOK_BUFFER_2, ptr, size) }
}

/// Writes a hook buffer's address and length (in slots) to cudart's out-pointers (either may be NULL).
unsafe fn hand_out<const N: usize>(
    buffer: *mut [usize; N],
    ptr: *mut *mut c_void,
    size: *mut usize,
) -> CUresult {
    // SAFETY: the caller passes cudart's out-pointers, each NULL or writable.
    unsafe {
        if !ptr.is_null() {
            *ptr = buffer.cast();
        }
        if !size.is_null() {
            *size = N;
        }
    }
    CUresult::SUCCESS
}

type Destructor = Option<unsafe extern "C" fn(CUcontext, *mut c_void, *mut c_void)>;

/// Context-local storage: (context, key) -> (value, destructor).
type Storage = HashMap<(u64, u64), (usize, Destructor)>;
static STORAGE: Mutex<Option<Storage>> = Mutex::new(None);

fn storage() -> MutexGuard<'static, Option<Storage>> {
    STORAGE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn storage_ctx(ctx: CUcontext) -> u64 {
    if ctx.is_null() {
        context::current()
    } else {
        ctx as u64
    }
}

unsafe extern "C" fn cls_put(
    ctx: CUcontext,
    key: *mut c_void,
    value: *mut c_void,
    dtor: Destructor,
) -> CUresult {
    crate::guard("context-local storage: put", || {
        storage()
            .get_or_insert_with(HashMap::new)
            .insert((storage_ctx(ctx), key as u64), (value as usize, dtor));
        Ok(())
    })
}

/// `ctx` was destroyed or reset: its context-local values die, their destructors called as the driver
/// calls them.
pub fn context_emptied(ctx: u64) {
    let dying: Vec<(u64, usize, Destructor)> = {
        let mut storage = storage();
        let Some(map) = storage.as_mut() else {
            return;
        };
        let keys: Vec<(u64, u64)> = map.keys().filter(|(c, _)| *c == ctx).copied().collect();
        keys.into_iter()
            .filter_map(|k| map.remove(&k).map(|(value, dtor)| (k.1, value, dtor)))
            .collect()
    };
    for (key, value, dtor) in dying {
        if let Some(dtor) = dtor {
            // SAFETY: the destructor cudart registered for this value, called once with its context,
            // key and value, outside our lock (it may call back into the driver).
            unsafe { dtor(ctx as CUcontext, key as *mut c_void, value as *mut c_void) };
        }
    }
}

unsafe extern "C" fn cls_delete(ctx: CUcontext, key: *mut c_void) -> CUresult {
    crate::guard("context-local storage: delete", || {
        match storage()
            .as_mut()
            .and_then(|m| m.remove(&(storage_ctx(ctx), key as u64)))
        {
            Some(_) => Ok(()),
            None => Err(CUresult::INVALID_HANDLE),
        }
    })
}

unsafe extern "C" fn cls_get(
    value: *mut *mut c_void,
    ctx: CUcontext,
    key: *mut c_void,
) -> CUresult {
    crate::guard("context-local storage: get", || {
        if value.is_null() {
            return Err(CUresult::INVALID_VALUE);
        }
        let found = storage()
            .as_ref()
            .and_then(|m| m.get(&(storage_ctx(ctx), key as u64)).map(|(v, _)| *v))
            .ok_or(CUresult::INVALID_HANDLE)?;
        // SAFETY: cudart's out-pointer, checked non-NULL.
        unsafe { *value = found as *mut c_void };
        Ok(())
    })
}

unsafe extern "C" fn context_check(
    _ctx: CUcontext,
    out: *mut u32,
    _unused: *mut *mut c_void,
) -> CUresult {
    if !out.is_null() {
        // SAFETY: cudart's out-pointer.
        unsafe { *out = 0 };
    }
    CUresult::SUCCESS
}

/// The table for `id`, if Gleam implements it.
fn table_for(id: [u8; 16]) -> Option<*const c_void> {
    const W: usize = std::mem::size_of::<usize>();
    static CUDART: Table<13> = Table([
        (13 * W) as *const (),
        get_module_from_cubin as *const (),
        primary_context as *const (),
        std::ptr::null(),
        std::ptr::null(),
        std::ptr::null(),
        get_module_from_cubin_ext1 as *const (),
        noop_usize as *const (),
        get_module_from_cubin_ext2 as *const (),
        std::ptr::null(),
        std::ptr::null(),
        std::ptr::null(),
        load_compilers as *const (),
    ]);
    // Sizes as measured on driver 580 (pytorch-driver-surface.md): 24 bytes, 3 slots.
    static TLS: Table<3> = Table([(3 * W) as *const (), zero as *const (), zero as *const ()]);
    static HOOKS: Table<7> = Table([
        (7 * W) as *const (),
        zero as *const (),
        hook_buffer_1 as *const (),
        zero as *const (),
        zero as *const (),
        zero as *const (),
        hook_buffer_2 as *const (),
    ]);
    // No size slot: slot 0 is a function.
    static CLS: Table<4> = Table([
        cls_put as *const (),
        cls_delete as *const (),
        cls_get as *const (),
        zero as *const (),
    ]);
    // 120 bytes (15 slots) on driver 580; only slots 2 and 3 are known to be called.
    static CHECKS: Table<15> = Table([
        (15 * W) as *const (),
        zero as *const (),
        context_check as *const (),
        zero as *const (),
        zero as *const (),
        zero as *const (),
        zero as *const (),
        zero as *const (),
        zero as *const (),
        zero as *const (),
        zero as *const (),
        zero as *const (),
        zero as *const (),
        zero as *const (),
        zero as *const (),
    ]);
    let table: *const c_void = match id {
        x if x == uuid(CUDART_INTERFACE) => (&raw const CUDART).cast::<c_void>(),
        x if x == uuid(TOOLS_TLS) => (&raw const TLS).cast::<c_void>(),
        x if x == uuid(TOOLS_RUNTIME_CALLBACK_HOOKS) => (&raw const HOOKS).cast::<c_void>(),
        x if x == uuid(CONTEXT_LOCAL_STORAGE) => (&raw const CLS).cast::<c_void>(),
        x if x == uuid(CONTEXT_CHECKS) => (&raw const CHECKS).cast::<c_void>(),
        _ => return None,
    };
    Some(table)
}

static REPORTED: Mutex<Option<HashSet<[u8; 16]>>> = Mutex::new(None);

pub unsafe fn cuGetExportTable(
    table: *mut *const c_void,
    id: *const c_void,
) -> Result<(), CUresult> {
    state::init_logging();
    if table.is_null() || id.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: a CUuuid (16 bytes), non-NULL.
    let id = unsafe { id.cast::<[u8; 16]>().read_unaligned() };
    match table_for(id) {
        // SAFETY: the caller's out-pointer, non-NULL.
        Some(t) => unsafe { put(table, t) },
        None => {
            let mut reported = REPORTED
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if reported.get_or_insert_with(HashSet::new).insert(id) {
                let hex: String = id.iter().map(|b| format!("{b:02X}")).collect();
                tracing::warn!(uuid = %hex, "cuGetExportTable: unknown table requested; refused");
            }
            Err(CUresult::NOT_SUPPORTED)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_tables_are_served_and_sized() {
        let t = table_for(uuid(CUDART_INTERFACE)).unwrap().cast::<usize>();
        // SAFETY: a static table of 13 slots.
        unsafe {
            assert_eq!(*t, 13 * 8);
            assert_ne!(*t.add(1), 0);
            assert_eq!(*t.add(3), 0);
        }
        assert!(table_for([0; 16]).is_none());
        assert_eq!(
            uuid("6BD5FB6C-5BF4")[..6],
            [0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4]
        );
    }

    #[test]
    fn context_local_storage_round_trips() {
        let (ctx, key, value) = (
            0x1000 as CUcontext,
            0x2000 as *mut c_void,
            0x3000 as *mut c_void,
        );
        let mut out = std::ptr::null_mut();
        // SAFETY: plain values; the table functions only store them.
        unsafe {
            assert_eq!(cls_get(&raw mut out, ctx, key), CUresult::INVALID_HANDLE);
            assert_eq!(cls_put(ctx, key, value, None), CUresult::SUCCESS);
            assert_eq!(cls_get(&raw mut out, ctx, key), CUresult::SUCCESS);
            assert_eq!(out, value);
            assert_eq!(cls_delete(ctx, key), CUresult::SUCCESS);
            assert_eq!(cls_get(&raw mut out, ctx, key), CUresult::INVALID_HANDLE);
        }
    }
}
