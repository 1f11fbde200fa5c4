//! Sum of 2^18 u32 values (wrapping) with warp shuffles and one atomicAdd per block.
//! The wrapping sum does not depend on the order of the atomics, so the result is exact.

#[path = "common/mod.rs"]
mod common;

use std::process::ExitCode;

use cudarc::driver::{CudaContext, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

const N: u32 = 1 << 18;
const THREADS: u32 = 256;
const BLOCKS: u32 = 64;

fn run() -> Result<bool, DriverError> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let module = ctx.load_module(Ptx::from_src(include_str!("kernels/reduce.ptx")))?;
    let reduce_sum = module.load_function("reduce_sum")?;

    let mut rng = common::SplitMix64::new(3);
    let input: Vec<u32> = (0..N).map(|_| rng.next_u32()).collect();
    let in_dev = stream.clone_htod(&input)?;
    let mut out_dev = stream.alloc_zeros::<u32>(1)?;

    // A grid-stride loop: fewer blocks than elements / THREADS on purpose.
    let cfg = LaunchConfig {
        grid_dim: (BLOCKS, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&reduce_sum);
    launch.arg(&in_dev).arg(&mut out_dev).arg(&N);
    // SAFETY: matches reduce_sum(const unsigned*, unsigned*, unsigned); out holds one zeroed u32.
    unsafe { launch.launch(cfg) }?;
    let got = stream.clone_dtoh(&out_dev)?[0];

    let want = input.iter().fold(0u32, |acc, &v| acc.wrapping_add(v));
    println!("reduce: n={N} grid={BLOCKS} block={THREADS}");
    println!("reduce: sum={got} (0x{got:08x})");
    println!(
        "reduce: checksum={:016x}",
        common::checksum(&input, u32::to_le_bytes)
    );
    if got != want {
        eprintln!("reduce: got {got}, want {want}");
    }
    Ok(got == want)
}

fn main() -> ExitCode {
    common::finish("reduce", run())
}
