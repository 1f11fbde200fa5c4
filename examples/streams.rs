//! Several streams, events, async copies and cross-stream waits.
//!
//! Four worker streams each upload a chunk and run `scale_add` (y = 1.5 x + 0.25); the default
//! stream waits on each worker's event and runs `saxpy` (z = 2 y + z) per chunk; worker 1 waits
//! on an event of the default stream and runs `scale_add` again (w = -0.5 z + 1) on every chunk,
//! then the chunks are copied back. The elapsed time between two timing events goes to stderr
//! only, so stdout stays deterministic.

#[path = "common/mod.rs"]
mod common;

use std::process::ExitCode;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

const STREAMS: usize = 4;
const CHUNK: u32 = 8192;
const THREADS: u32 = 256;

fn run() -> Result<bool, DriverError> {
    let ctx = CudaContext::new(0)?;
    let main_stream = ctx.default_stream();
    let workers = (0..STREAMS)
        .map(|_| ctx.new_stream())
        .collect::<Result<Vec<_>, _>>()?;
    let module = ctx.load_module(Ptx::from_src(include_str!("kernels/streams.ptx")))?;
    let scale_add = module.load_function("scale_add")?;
    let saxpy = module.load_function("saxpy")?;

    let (a, b) = (1.5f32, 0.25f32);
    let alpha = 2.0f32;
    let (c, d) = (-0.5f32, 1.0f32);
    let n = CHUNK as usize;
    let mut rng = common::SplitMix64::new(4);
    let xs: Vec<Vec<f32>> = (0..STREAMS)
        .map(|_| (0..n).map(|_| rng.next_f32()).collect())
        .collect();
    let zs: Vec<Vec<f32>> = (0..STREAMS)
        .map(|_| (0..n).map(|_| rng.next_f32()).collect())
        .collect();
    let cfg = LaunchConfig {
        grid_dim: (CHUNK.div_ceil(THREADS), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };

    let start = main_stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;

    // Stage 1, on each worker: upload x, y = a x + b.
    let mut ys: Vec<CudaSlice<f32>> = Vec::with_capacity(STREAMS);
    let mut done = Vec::with_capacity(STREAMS);
    for (worker, x) in workers.iter().zip(&xs) {
        let x_dev = worker.clone_htod(x)?;
        let mut y_dev = worker.alloc_zeros::<f32>(n)?;
        let mut launch = worker.launch_builder(&scale_add);
        launch
            .arg(&x_dev)
            .arg(&mut y_dev)
            .arg(&a)
            .arg(&b)
            .arg(&CHUNK);
        // SAFETY: matches scale_add(const float*, float*, float, float, unsigned).
        unsafe { launch.launch(cfg) }?;
        done.push(worker.record_event(None)?);
        ys.push(y_dev);
    }

    // Stage 2, on the default stream after each worker's event: z = alpha y + z.
    let mut z_devs: Vec<CudaSlice<f32>> = Vec::with_capacity(STREAMS);
    for ((event, y_dev), z) in done.iter().zip(&ys).zip(&zs) {
        main_stream.wait(event)?;
        let mut z_dev = main_stream.clone_htod(z)?;
        let mut launch = main_stream.launch_builder(&saxpy);
        launch.arg(&alpha).arg(y_dev).arg(&mut z_dev).arg(&CHUNK);
        // SAFETY: matches saxpy(float, const float*, float*, unsigned).
        unsafe { launch.launch(cfg) }?;
        z_devs.push(z_dev);
    }
    let stage2 = main_stream.record_event(None)?;

    // Stage 3, on worker 1 after the default stream: w = c z + d, then download.
    let tail = &workers[1];
    tail.wait(&stage2)?;
    let mut results = Vec::with_capacity(STREAMS);
    for z_dev in &z_devs {
        let mut w_dev = tail.alloc_zeros::<f32>(n)?;
        let mut launch = tail.launch_builder(&scale_add);
        launch
            .arg(z_dev)
            .arg(&mut w_dev)
            .arg(&c)
            .arg(&d)
            .arg(&CHUNK);
        // SAFETY: as in stage 1.
        unsafe { launch.launch(cfg) }?;
        results.push(tail.clone_dtoh(&w_dev)?);
    }
    main_stream.join(tail)?;
    let end = main_stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    main_stream.synchronize()?;
    eprintln!("streams: elapsed {:.3} ms", start.elapsed_ms(&end)?);

    let got: Vec<f32> = results.concat();
    let want: Vec<f32> = xs
        .iter()
        .zip(&zs)
        .flat_map(|(x, z)| x.iter().zip(z))
        .map(|(&x, &z)| {
            let y = a.mul_add(x, b);
            let z = alpha.mul_add(y, z);
            c.mul_add(z, d)
        })
        .collect();

    println!("streams: {STREAMS} worker streams x {CHUNK} elements, 3 stages");
    println!(
        "streams: w[0]={:?} w[{}]={:?}",
        got[0],
        got.len() - 1,
        got[got.len() - 1]
    );
    println!(
        "streams: checksum={:016x}",
        common::checksum(&got, f32::to_le_bytes)
    );
    Ok(common::compare_f32("streams", &got, &want))
}

fn main() -> ExitCode {
    common::finish("streams", run())
}
