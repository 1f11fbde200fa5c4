//! 2D memsets (`cuMemsetD2D8/16/32` and their async forms): forwarded without waiting, after the checks
//! the driver makes at the call (an aligned address and pitch, rows that fit the pitch), so a malformed
//! fill fails where it is made rather than at the next synchronization.

use gleam_protocol::copy::fill_2d_span;
use gleam_protocol::types::{CUresult, CUstream};

use crate::forward;

macro_rules! fills {
    ($($sync:ident, $async_:ident: $t:ty;)*) => {$(
        pub unsafe fn $sync(
            dst: u64,
            pitch: usize,
            value: $t,
            width: usize,
            height: usize,
        ) -> Result<(), CUresult> {
            fill_2d_span(dst, pitch, size_of::<$t>(), width, height)?;
            // SAFETY: forwarded under the same contract.
            unsafe { forward::$sync(dst, pitch, value, width, height) }
        }

        pub unsafe fn $async_(
            dst: u64,
            pitch: usize,
            value: $t,
            width: usize,
            height: usize,
            stream: CUstream,
        ) -> Result<(), CUresult> {
            fill_2d_span(dst, pitch, size_of::<$t>(), width, height)?;
            // SAFETY: forwarded under the same contract.
            unsafe { forward::$async_(dst, pitch, value, width, height, stream) }
        }
    )*};
}

fills! {
    cuMemsetD2D8_v2, cuMemsetD2D8Async: u8;
    cuMemsetD2D16_v2, cuMemsetD2D16Async: u16;
    cuMemsetD2D32_v2, cuMemsetD2D32Async: u32;
}
