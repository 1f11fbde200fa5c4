//! c = a + b on the GPU with cudarc's safe driver API, checked bit for bit against the CPU.
//!
//! Run: `cargo run --example vector_add` (real driver), or through Gleam with
//! `gleam run --peer ... -- target/debug/examples/vector_add`. The output is deterministic.

#[path = "common/mod.rs"]
mod common;

use std::process::ExitCode;

use cudarc::driver::{CudaContext, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

const N: u32 = 1 << 16;
const THREADS: u32 = 256;

fn run() -> Result<bool, DriverError> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let module = ctx.load_module(Ptx::from_src(include_str!("kernels/vector_add.ptx")))?;
    let vector_add = module.load_function("vector_add")?;

    let mut rng = common::SplitMix64::new(1);
    let a: Vec<f32> = (0..N).map(|_| rng.next_f32()).collect();
    let b: Vec<f32> = (0..N).map(|_| rng.next_f32()).collect();

    let a_dev = stream.clone_htod(&a)?;
    let b_dev = stream.clone_htod(&b)?;
    let mut c_dev = stream.alloc_zeros::<f32>(N as usize)?;

    let cfg = LaunchConfig {
        grid_dim: (N.div_ceil(THREADS), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&vector_add);
    launch.arg(&a_dev).arg(&b_dev).arg(&mut c_dev).arg(&N);
    // SAFETY: the argument list matches vector_add(const float*, const float*, float*, unsigned)
    // and every buffer holds N elements.
    unsafe { launch.launch(cfg) }?;

    let c = stream.clone_dtoh(&c_dev)?;
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();

    println!("vector_add: n={N} grid={} block={THREADS}", cfg.grid_dim.0);
    println!(
        "vector_add: c[0]={:?} c[{}]={:?}",
        c[0],
        N - 1,
        c[N as usize - 1]
    );
    println!(
        "vector_add: checksum={:016x}",
        common::checksum(&c, f32::to_le_bytes)
    );
    Ok(common::compare_f32("vector_add", &c, &want))
}

fn main() -> ExitCode {
    common::finish("vector_add", run())
}
