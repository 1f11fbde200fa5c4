//! Tensor maps (`cuTensorMapEncode*`): the 128-byte descriptor Hopper's TMA units read is encoded by the
//! serving driver (its format is NVIDIA's), from the application's per-dimension arrays, read here for
//! exactly `rank` dimensions (the arrays have no other length) and padded for the wire. Encoding is a pure
//! function of its inputs, so answers are kept: a library that re-encodes the same map before every GEMM
//! pays the round trip once.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use gleam_protocol::types::CUresult;

use crate::{forward, put};

use gleam_protocol::api::TensorMap;
const TENSOR_MAP_ALIGN: usize = 64;
const MAX_RANK: u32 = 5;
/// Answers kept (a map is 128 bytes).
const CACHE_ENTRIES: usize = 4096;

static CACHE: Mutex<Option<HashMap<Vec<u64>, TensorMap>>> = Mutex::new(None);

fn cache() -> MutexGuard<'static, Option<HashMap<Vec<u64>, TensorMap>>> {
    CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The first `n` elements of the application's array, zero-padded to 5.
///
/// # Safety
/// `p` is NULL or points to at least `n` elements.
unsafe fn dims<T: Copy + Default>(p: *const [T; 5], n: u32) -> Result<[T; 5], CUresult> {
    let mut out = [T::default(); 5];
    if n == 0 {
        return Ok(out);
    }
    if p.is_null() || n > MAX_RANK {
        return Err(CUresult::INVALID_VALUE);
    }
    for (i, slot) in out.iter_mut().take(n as usize).enumerate() {
        // SAFETY: the caller's array holds `n` elements.
        *slot = unsafe { p.cast::<T>().add(i).read_unaligned() };
    }
    Ok(out)
}

/// Runs `encode` unless the same inputs were encoded before; writes the map to `out`.
fn encoded(
    out: *mut TensorMap,
    key: Vec<u64>,
    encode: impl FnOnce(*mut TensorMap) -> Result<(), CUresult>,
) -> Result<(), CUresult> {
    if out.is_null() || !(out as usize).is_multiple_of(TENSOR_MAP_ALIGN) {
        return Err(CUresult::INVALID_VALUE);
    }
    let known = cache().as_ref().and_then(|c| c.get(&key).copied());
    let map = match known {
        Some(map) => map,
        None => {
            let mut map = TensorMap::default();
            encode(&raw mut map)?;
            let mut cache = cache();
            let c = cache.get_or_insert_with(HashMap::new);
            if c.len() >= CACHE_ENTRIES {
                c.clear();
            }
            c.insert(key, map);
            map
        }
    };
    // SAFETY: the caller's tensor map, non-NULL and aligned.
    unsafe { put(out, map) }
}

fn key<const N: usize>(kind: u64, scalars: [u64; N], arrays: &[&[u64]]) -> Vec<u64> {
    let mut k = vec![kind];
    k.extend_from_slice(&scalars);
    for a in arrays {
        k.extend_from_slice(a);
    }
    k
}

fn wide<T: Copy + Into<i64>>(a: [T; 5]) -> [u64; 5] {
    a.map(|v| v.into() as u64)
}

#[allow(clippy::too_many_arguments)]
pub unsafe fn cuTensorMapEncodeTiled(
    tensor_map: *mut TensorMap,
    data_type: u32,
    rank: u32,
    address: u64,
    dims_p: *const [u64; 5],
    strides_p: *const [u64; 5],
    box_p: *const [u32; 5],
    element_strides_p: *const [u32; 5],
    interleave: u32,
    swizzle: u32,
    l2_promotion: u32,
    oob_fill: u32,
) -> Result<(), CUresult> {
    if rank == 0 || rank > MAX_RANK {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the application's arrays of `rank` (strides: `rank - 1`) elements.
    let (d, s, b, e) = unsafe {
        (
            dims(dims_p, rank)?,
            dims(strides_p, rank - 1)?,
            dims(box_p, rank)?,
            dims(element_strides_p, rank)?,
        )
    };
    let k = key(
        1,
        [
            u64::from(data_type),
            u64::from(rank),
            address,
            u64::from(interleave),
            u64::from(swizzle),
            u64::from(l2_promotion),
            u64::from(oob_fill),
        ],
        &[&d, &s, &wide(b), &wide(e)],
    );
    encoded(tensor_map, k, |out| {
        // SAFETY: local, padded arrays; the out-pointer is a local map.
        unsafe {
            forward::cuTensorMapEncodeTiled(
                out,
                data_type,
                rank,
                address,
                &raw const d,
                &raw const s,
                &raw const b,
                &raw const e,
                interleave,
                swizzle,
                l2_promotion,
                oob_fill,
            )
        }
    })
}

#[allow(clippy::too_many_arguments)]
pub unsafe fn cuTensorMapEncodeIm2col(
    tensor_map: *mut TensorMap,
    data_type: u32,
    rank: u32,
    address: u64,
    dims_p: *const [u64; 5],
    strides_p: *const [u64; 5],
    lower_p: *const [i32; 5],
    upper_p: *const [i32; 5],
    channels: u32,
    pixels: u32,
    element_strides_p: *const [u32; 5],
    interleave: u32,
    swizzle: u32,
    l2_promotion: u32,
    oob_fill: u32,
) -> Result<(), CUresult> {
    if !(3..=MAX_RANK).contains(&rank) {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the application's arrays of `rank`, `rank - 1` and `rank - 2` elements.
    let (d, s, lo, hi, e) = unsafe {
        (
            dims(dims_p, rank)?,
            dims(strides_p, rank - 1)?,
            dims(lower_p, rank - 2)?,
            dims(upper_p, rank - 2)?,
            dims(element_strides_p, rank)?,
        )
    };
    let k = key(
        2,
        [
            u64::from(data_type),
            u64::from(rank),
            address,
            u64::from(channels),
            u64::from(pixels),
            u64::from(interleave),
            u64::from(swizzle),
            u64::from(l2_promotion),
            u64::from(oob_fill),
        ],
        &[&d, &s, &wide(lo), &wide(hi), &wide(e)],
    );
    encoded(tensor_map, k, |out| {
        // SAFETY: local, padded arrays; the out-pointer is a local map.
        unsafe {
            forward::cuTensorMapEncodeIm2col(
                out,
                data_type,
                rank,
                address,
                &raw const d,
                &raw const s,
                &raw const lo,
                &raw const hi,
                channels,
                pixels,
                &raw const e,
                interleave,
                swizzle,
                l2_promotion,
                oob_fill,
            )
        }
    })
}

#[allow(clippy::too_many_arguments)]
pub unsafe fn cuTensorMapEncodeIm2colWide(
    tensor_map: *mut TensorMap,
    data_type: u32,
    rank: u32,
    address: u64,
    dims_p: *const [u64; 5],
    strides_p: *const [u64; 5],
    lower: i32,
    upper: i32,
    channels: u32,
    pixels: u32,
    element_strides_p: *const [u32; 5],
    interleave: u32,
    mode: u32,
    swizzle: u32,
    l2_promotion: u32,
    oob_fill: u32,
) -> Result<(), CUresult> {
    if !(3..=MAX_RANK).contains(&rank) {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: the application's arrays of `rank` and `rank - 1` elements.
    let (d, s, e) = unsafe {
        (
            dims(dims_p, rank)?,
            dims(strides_p, rank - 1)?,
            dims(element_strides_p, rank)?,
        )
    };
    let k = key(
        3,
        [
            u64::from(data_type),
            u64::from(rank),
            address,
            i64::from(lower) as u64,
            i64::from(upper) as u64,
            u64::from(channels),
            u64::from(pixels),
            u64::from(interleave),
            u64::from(mode),
            u64::from(swizzle),
            u64::from(l2_promotion),
            u64::from(oob_fill),
        ],
        &[&d, &s, &wide(e)],
    );
    encoded(tensor_map, k, |out| {
        // SAFETY: local, padded arrays; the out-pointer is a local map.
        unsafe {
            forward::cuTensorMapEncodeIm2colWide(
                out,
                data_type,
                rank,
                address,
                &raw const d,
                &raw const s,
                lower,
                upper,
                channels,
                pixels,
                &raw const e,
                interleave,
                mode,
                swizzle,
                l2_promotion,
                oob_fill,
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_rank_elements_are_read_and_padded() {
        let three = [7u64, 8, 9];
        // SAFETY: an array of 3 elements, read for 3.
        let d = unsafe { dims(three.as_ptr().cast::<[u64; 5]>(), 3) }.unwrap();
        assert_eq!(d, [7, 8, 9, 0, 0]);
        // Nothing is read for 0 elements, even through NULL.
        // SAFETY: not dereferenced.
        assert_eq!(unsafe { dims::<u64>(std::ptr::null(), 0) }, Ok([0; 5]));
        // SAFETY: NULL is checked.
        assert!(unsafe { dims::<u64>(std::ptr::null(), 2) }.is_err());
    }

    #[test]
    fn a_map_is_encoded_once_per_inputs_and_must_be_aligned() {
        let mut map = TensorMap::default();
        let mut calls = 0;
        for _ in 0..3 {
            encoded(&raw mut map, vec![99, 1, 2], |out| {
                calls += 1;
                // SAFETY: the local map `encoded` passes.
                unsafe { out.write(TensorMap([5; 16])) };
                Ok(())
            })
            .unwrap();
        }
        assert_eq!((calls, map), (1, TensorMap([5; 16])));
        let misaligned = (&raw mut map.0)
            .cast::<u8>()
            .wrapping_add(8)
            .cast::<TensorMap>();
        assert_eq!(
            encoded(misaligned, vec![98], |_| Ok(())),
            Err(CUresult::INVALID_VALUE)
        );
    }
}
