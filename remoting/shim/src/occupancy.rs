//! `cuOccupancyMaxPotentialBlockSize(WithFlags)`: the block size that maximizes occupancy.
//!
//! The driver's version takes a *client* callback (dynamic shared memory as a function of the block size),
//! so it cannot be forwarded as is. It is computed here instead: for each candidate block size (multiples of
//! the warp size, largest first) the callback runs locally and the peer answers the occupancy of that size
//! (`cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags`); the size with the most resident threads per
//! multiprocessor wins, the largest on ties, as CUDA's own helper chooses.

use std::ffi::c_void;

use gleam_protocol::types::{CUfunction, CUresult};

use crate::{context, device, forward, module, put};

/// `CUoccupancyB2DSize`: dynamic shared memory bytes for a block size.
type BlockSizeToSmem = Option<unsafe extern "C" fn(block_size: i32) -> usize>;

/// The application's `CUoccupancyB2DSize` (a C function pointer, or NULL).
///
/// # Safety
/// `callback` is NULL or a function with `CUoccupancyB2DSize`'s signature.
unsafe fn block_size_to_smem(callback: *mut c_void) -> BlockSizeToSmem {
    // SAFETY: a nullable C function pointer has the layout of `Option<fn>` (NULL is `None`); the caller
    // vouches for the signature.
    unsafe { std::mem::transmute::<*mut c_void, BlockSizeToSmem>(callback) }
}

const DEVICE_WARP_SIZE: u32 = 10;
/// `CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK`.
const DEVICE_MAX_THREADS_PER_BLOCK: u32 = 1;
const DEVICE_MULTIPROCESSOR_COUNT: u32 = 16;

pub unsafe fn cuOccupancyMaxPotentialBlockSize(
    min_grid_size: *mut i32,
    block_size: *mut i32,
    func: CUfunction,
    smem_of: *mut c_void,
    dynamic_smem: usize,
    block_size_limit: i32,
) -> Result<(), CUresult> {
    // SAFETY: the application's arguments, as the C API requires them.
    unsafe {
        let smem_of = block_size_to_smem(smem_of);
        potential_block_size(
            min_grid_size,
            block_size,
            func,
            smem_of,
            dynamic_smem,
            block_size_limit,
            0,
        )
    }
}

pub unsafe fn cuOccupancyMaxPotentialBlockSizeWithFlags(
    min_grid_size: *mut i32,
    block_size: *mut i32,
    func: CUfunction,
    smem_of: *mut c_void,
    dynamic_smem: usize,
    block_size_limit: i32,
    flags: u32,
) -> Result<(), CUresult> {
    // SAFETY: as above.
    unsafe {
        let smem_of = block_size_to_smem(smem_of);
        potential_block_size(
            min_grid_size,
            block_size,
            func,
            smem_of,
            dynamic_smem,
            block_size_limit,
            flags,
        )
    }
}

/// # Safety
/// The pointers are as the C API requires; `smem_of`, if set, is callable.
unsafe fn potential_block_size(
    min_grid_size: *mut i32,
    block_size: *mut i32,
    func: CUfunction,
    smem_of: BlockSizeToSmem,
    dynamic_smem: usize,
    block_size_limit: i32,
    flags: u32,
) -> Result<(), CUresult> {
    if min_grid_size.is_null() || block_size.is_null() || block_size_limit < 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let max_threads = module::max_threads_per_block(func)?;
    let mut dev = 0;
    // SAFETY: a valid out-pointer.
    unsafe { context::cuCtxGetDevice(&raw mut dev) }?;
    let warp = device::attribute(dev, DEVICE_WARP_SIZE)?.max(1);
    let sms = device::attribute(dev, DEVICE_MULTIPROCESSOR_COUNT)?;

    // The device's block size limit bounds the walk too: the function's comes from the serving peer, and
    // a peer that answered 2^31 would have the application walk 67 million candidates.
    let device_max = device::attribute(dev, DEVICE_MAX_THREADS_PER_BLOCK)?;
    let max_threads = max_threads.min(device_max);
    let limit = match block_size_limit {
        0 => max_threads,
        limit => limit.min(max_threads),
    };
    let mut best: Option<(i32, i32)> = None; // (block size, blocks per SM)
    let mut candidate = if limit >= warp {
        limit - limit % warp
    } else {
        limit
    };
    while candidate > 0 {
        let smem = match smem_of {
            // SAFETY: the application's callback, called as CUDA calls it.
            Some(f) => unsafe { f(candidate) },
            None => dynamic_smem,
        };
        let mut blocks = 0;
        // SAFETY: a valid out-pointer; forwarded as the listed call.
        unsafe {
            forward::cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
                &raw mut blocks,
                func,
                candidate,
                smem,
                flags,
            )
        }?;
        let better = match best {
            None => true,
            Some((size, resident)) => blocks * candidate > resident * size,
        };
        if better {
            best = Some((candidate, blocks));
        }
        candidate -= warp;
    }
    let (size, blocks) = best.ok_or(CUresult::INVALID_VALUE)?;
    // SAFETY: checked non-NULL above.
    unsafe {
        put(block_size, size)?;
        put(min_grid_size, blocks * sms)?;
    }
    Ok(())
}
