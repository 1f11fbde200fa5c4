//! C = A * B (128 x 128, f32) with a tiled shared-memory kernel, checked bit for bit against a
//! CPU reference that fuses multiply-adds in the kernel's order.

#[path = "common/mod.rs"]
mod common;

use std::process::ExitCode;

use cudarc::driver::{CudaContext, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

const N: i32 = 128;
const TILE: u32 = 16;

fn run() -> Result<bool, DriverError> {
    let n = N as usize;
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let module = ctx.load_module(Ptx::from_src(include_str!("kernels/matmul.ptx")))?;
    let matmul = module.load_function("matmul")?;

    let mut rng = common::SplitMix64::new(2);
    let a: Vec<f32> = (0..n * n).map(|_| rng.next_f32()).collect();
    let b: Vec<f32> = (0..n * n).map(|_| rng.next_f32()).collect();

    let a_dev = stream.clone_htod(&a)?;
    let b_dev = stream.clone_htod(&b)?;
    let mut c_dev = stream.alloc_zeros::<f32>(n * n)?;

    let blocks = (N as u32).div_ceil(TILE);
    let cfg = LaunchConfig {
        grid_dim: (blocks, blocks, 1),
        block_dim: (TILE, TILE, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&matmul);
    launch.arg(&a_dev).arg(&b_dev).arg(&mut c_dev).arg(&N);
    // SAFETY: matches matmul(const float*, const float*, float*, int); buffers hold n*n floats.
    unsafe { launch.launch(cfg) }?;
    let c = stream.clone_dtoh(&c_dev)?;

    // The kernel accumulates fmaf(A[row][k], B[k][col], acc) for k = 0, 1, ...: same here.
    let mut want = vec![0.0f32; n * n];
    for row in 0..n {
        for col in 0..n {
            let mut acc = 0.0f32;
            for k in 0..n {
                acc = a[row * n + k].mul_add(b[k * n + col], acc);
            }
            want[row * n + col] = acc;
        }
    }

    let trace: f32 = (0..n).map(|i| c[i * n + i]).sum();
    println!("matmul: n={N} grid={blocks}x{blocks} block={TILE}x{TILE}");
    println!(
        "matmul: C[0][0]={:?} C[{}][{}]={:?} trace={trace:?}",
        c[0],
        n - 1,
        n - 1,
        c[n * n - 1]
    );
    println!(
        "matmul: checksum={:016x}",
        common::checksum(&c, f32::to_le_bytes)
    );
    Ok(common::compare_f32("matmul", &c, &want))
}

fn main() -> ExitCode {
    common::finish("matmul", run())
}
