//! The LAN benchmark's workloads (issue 12; run by `scripts/bench/lan.sh`), one per invocation, as an
//! unmodified driver-API program: the same binary runs on NVIDIA's driver and through `gleam run`.
//!
//! ```text
//! bench_workloads launch-storm   # 10,000 small launches, a stream sync every 100
//! bench_workloads weights        # upload W MiB of weights, then 50 matmuls on them, one result read back
//! bench_workloads two-streams    # a U MiB upload on one stream beside a launch-and-sync loop on another
//!                                # (BENCH_DIRECTION=down: a U MiB download)
//! ```
//!
//! Each prints one JSON object: the workload's wall time (`time_s`, connection and module load excluded),
//! how many times it waited for the GPU (`syncs`), the bytes that must cross the link whatever the
//! transport (`must_cross_bytes`: uploads and read-backs, no protocol), and a checksum of the results so
//! that runs in different modes can be compared. Sizes come from the environment, so that the emu backend
//! (kernels interpreted on the CPU) runs a scaled-down version: `BENCH_LAUNCHES` (10000), `BENCH_SYNC_EVERY`
//! (100), `BENCH_WEIGHTS_MIB` (512), `BENCH_MATMULS` (50), `BENCH_MATMUL_N` (512), `BENCH_UPLOAD_MIB` (1024),
//! `BENCH_LOOP_ITERS` (200), `BENCH_SEED` (1; the weights' content: the same seed is the same bytes, what a
//! warm cache can recognise).

use std::ffi::{CString, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;

use cudarc::driver::sys;

/// `add1(float *p, u32 n)`: one thread per element adds 1; `matmul(a, b, c, n)`: naive n x n product.
const PTX: &str = r#"
.version 8.0
.target sm_75
.address_size 64

.visible .entry add1(.param .u64 p, .param .u32 n)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [p];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r5, 4;
    add.s64 %rd4, %rd2, %rd3;
    ld.global.f32 %f1, [%rd4];
    add.f32 %f2, %f1, 0f3F800000;
    st.global.f32 [%rd4], %f2;
DONE:
    ret;
}

.visible .entry matmul(.param .u64 a, .param .u64 b, .param .u64 c, .param .u32 n)
{
    .reg .pred %p<3>;
    .reg .b32 %r<16>;
    .reg .f32 %f<5>;
    .reg .b64 %rd<16>;
    ld.param.u64 %rd1, [a];
    ld.param.u64 %rd2, [b];
    ld.param.u64 %rd3, [c];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %ctaid.y;
    mov.u32 %r3, %ntid.y;
    mov.u32 %r4, %tid.y;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    mov.u32 %r6, %ctaid.x;
    mov.u32 %r7, %ntid.x;
    mov.u32 %r8, %tid.x;
    mad.lo.s32 %r9, %r6, %r7, %r8;
    setp.ge.u32 %p1, %r5, %r1;
    setp.ge.u32 %p2, %r9, %r1;
    or.pred %p1, %p1, %p2;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd4, %rd1;
    cvta.to.global.u64 %rd5, %rd2;
    cvta.to.global.u64 %rd6, %rd3;
    mov.f32 %f1, 0f00000000;
    mov.u32 %r10, 0;
LOOP:
    mad.lo.s32 %r11, %r5, %r1, %r10;
    mul.wide.u32 %rd7, %r11, 4;
    add.s64 %rd8, %rd4, %rd7;
    ld.global.f32 %f2, [%rd8];
    mad.lo.s32 %r12, %r10, %r1, %r9;
    mul.wide.u32 %rd9, %r12, 4;
    add.s64 %rd10, %rd5, %rd9;
    ld.global.f32 %f3, [%rd10];
    fma.rn.f32 %f1, %f2, %f3, %f1;
    add.s32 %r10, %r10, 1;
    setp.lt.u32 %p2, %r10, %r1;
    @%p2 bra LOOP;
    mad.lo.s32 %r13, %r5, %r1, %r9;
    mul.wide.u32 %rd11, %r13, 4;
    add.s64 %rd12, %rd6, %rd11;
    st.global.f32 [%rd12], %f1;
DONE:
    ret;
}
"#;

/// `CU_STREAM_NON_BLOCKING`: the benchmark's streams never wait for the legacy stream.
const NON_BLOCKING: u32 = 1;

fn main() {
    let workload = std::env::args().nth(1).unwrap_or_default();
    // SAFETY: raw driver calls with valid out-pointers and buffers that outlive each call; every result
    // is checked before the next call relies on it.
    let gpu = unsafe { Gpu::open() };
    let result = match workload.as_str() {
        // SAFETY: the context is current on this thread and the kernels are loaded (each workload).
        "launch-storm" => unsafe { launch_storm(&gpu) },
        // SAFETY: as above.
        "weights" => unsafe { weights(&gpu) },
        // SAFETY: as above.
        "two-streams" => unsafe { two_streams(&gpu) },
        _ => {
            eprintln!("usage: bench_workloads launch-storm|weights|two-streams");
            std::process::exit(2);
        }
    };
    println!("{result}");
}

fn check(what: &str, r: sys::CUresult) {
    if r != sys::CUresult::CUDA_SUCCESS {
        eprintln!("bench_workloads: {what} failed: {r:?}");
        std::process::exit(1);
    }
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The context and the two kernels, loaded before any timing starts.
struct Gpu {
    ctx: sys::CUcontext,
    add1: sys::CUfunction,
    matmul: sys::CUfunction,
}

// SAFETY: driver handles are plain tokens, usable from any thread once the context is current there.
unsafe impl Send for Gpu {}
// SAFETY: as above.
unsafe impl Sync for Gpu {}

impl Gpu {
    unsafe fn open() -> Self {
        // SAFETY: see `main`.
        unsafe {
            check("cuInit", sys::cuInit(0));
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&raw mut dev, 0));
            let mut ctx = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&raw mut ctx, dev),
            );
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
            let mut module = std::ptr::null_mut();
            let ptx = CString::new(PTX).expect("no NUL in PTX");
            check(
                "cuModuleLoadData",
                sys::cuModuleLoadData(&raw mut module, ptx.as_ptr().cast::<c_void>()),
            );
            let function = |name: &str| {
                let mut f = std::ptr::null_mut();
                let name = CString::new(name).expect("no NUL");
                check(
                    "cuModuleGetFunction",
                    sys::cuModuleGetFunction(&raw mut f, module, name.as_ptr()),
                );
                f
            };
            let (add1, matmul) = (function("add1"), function("matmul"));
            check("cuCtxSynchronize", sys::cuCtxSynchronize());
            Self { ctx, add1, matmul }
        }
    }

    unsafe fn stream(&self) -> sys::CUstream {
        let mut s = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&raw mut s, NON_BLOCKING)
        });
        s
    }

    unsafe fn alloc(&self, bytes: usize) -> sys::CUdeviceptr {
        let mut p = 0;
        // SAFETY: a valid out-pointer.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&raw mut p, bytes)
        });
        p
    }

    /// `add1` over `n` floats at `p` on `stream`.
    unsafe fn add1(&self, p: sys::CUdeviceptr, n: u32, stream: sys::CUstream) {
        let (mut p, mut n_arg) = (p, n);
        let mut params = [
            (&raw mut p).cast::<c_void>(),
            (&raw mut n_arg).cast::<c_void>(),
        ];
        // SAFETY: the parameters match the kernel's and outlive the call (copied at launch).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.add1,
                n.div_ceil(128),
                1,
                1,
                128,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        });
    }
}

/// Reads `n` floats at `p` back and sums them (the run's checksum).
unsafe fn read_sum(p: sys::CUdeviceptr, n: usize) -> f64 {
    let mut back = vec![0f32; n];
    // SAFETY: `back` holds exactly `n` floats.
    check("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast::<c_void>(), p, n * 4)
    });
    back.iter().map(|&v| f64::from(v)).sum()
}

/// 10,000 launches of a 256-element kernel, a stream synchronisation every 100.
unsafe fn launch_storm(gpu: &Gpu) -> String {
    let launches = env("BENCH_LAUNCHES", 10_000);
    let every = env("BENCH_SYNC_EVERY", 100).max(1);
    // SAFETY: see `main`.
    unsafe {
        let stream = gpu.stream();
        let p = gpu.alloc(256 * 4);
        check("cuMemsetD32", sys::cuMemsetD32_v2(p, 0, 256));
        check("cuCtxSynchronize", sys::cuCtxSynchronize());
        let t = Instant::now();
        let mut syncs = 0;
        for i in 1..=launches {
            gpu.add1(p, 256, stream);
            if i % every == 0 {
                check("cuStreamSynchronize", sys::cuStreamSynchronize(stream));
                syncs += 1;
            }
        }
        check("cuStreamSynchronize", sys::cuStreamSynchronize(stream));
        let time = t.elapsed().as_secs_f64();
        let sum = read_sum(p, 256);
        format!(
            "{{\"workload\": \"launch-storm\", \"time_s\": {time:.6}, \"syncs\": {}, \"must_cross_bytes\": 0, \
             \"launches\": {launches}, \"checksum\": {sum}}}",
            syncs + 1
        )
    }
}

/// Uploads `BENCH_WEIGHTS_MIB` of weights (content from `BENCH_SEED`), then `BENCH_MATMULS` products of
/// n x n matrices taken from them, and reads one result back.
unsafe fn weights(gpu: &Gpu) -> String {
    let bytes = env("BENCH_WEIGHTS_MIB", 512) << 20;
    let matmuls = env("BENCH_MATMULS", 50);
    let n = env("BENCH_MATMUL_N", 512);
    let seed = env("BENCH_SEED", 1) as u32;
    assert!(
        2 * n * n * 4 <= bytes,
        "the weights must hold two n x n matrices"
    );
    // Weights that look like a model's: small floats, deterministic in the seed.
    let mut state = seed.wrapping_mul(0x9E37_79B9) | 1;
    let host: Vec<f32> = (0..bytes / 4)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state % 2001) as f32 / 1000.0 - 1.0
        })
        .collect();
    // SAFETY: see `main`.
    unsafe {
        let w = gpu.alloc(bytes);
        let c = gpu.alloc(n * n * 4);
        let t = Instant::now();
        check(
            "cuMemcpyHtoD",
            sys::cuMemcpyHtoD_v2(w, host.as_ptr().cast::<c_void>(), bytes),
        );
        let upload = t.elapsed().as_secs_f64();
        let (mut a, mut b, mut cc, mut nn) = (w, w + (n * n * 4) as u64, c, n as u32);
        let mut params = [
            (&raw mut a).cast::<c_void>(),
            (&raw mut b).cast::<c_void>(),
            (&raw mut cc).cast::<c_void>(),
            (&raw mut nn).cast::<c_void>(),
        ];
        let blocks = (n as u32).div_ceil(16);
        for _ in 0..matmuls {
            check(
                "cuLaunchKernel",
                sys::cuLaunchKernel(
                    gpu.matmul,
                    blocks,
                    blocks,
                    1,
                    16,
                    16,
                    1,
                    0,
                    std::ptr::null_mut(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
            );
        }
        let sum = read_sum(c, n * n);
        let time = t.elapsed().as_secs_f64();
        format!(
            "{{\"workload\": \"weights\", \"time_s\": {time:.6}, \"upload_s\": {upload:.6}, \"syncs\": 2, \
             \"must_cross_bytes\": {}, \"weights_bytes\": {bytes}, \"checksum\": {sum}}}",
            bytes + n * n * 4
        )
    }
}

/// A `BENCH_UPLOAD_MIB` upload on one stream (its own thread) beside a loop of one launch and one stream
/// synchronisation on another: the loop's latency idle, then during the upload. `BENCH_DIRECTION=down`:
/// a download of as many bytes instead.
unsafe fn two_streams(gpu: &Gpu) -> String {
    let bytes = env("BENCH_UPLOAD_MIB", 1024) << 20;
    let down = std::env::var("BENCH_DIRECTION").is_ok_and(|d| d == "down");
    let iters = env("BENCH_LOOP_ITERS", 200);
    // Bytes no cache has seen and no compressor shrinks: the upload crosses the link in full.
    let mut state = u64::from(std::process::id()) << 32
        | u64::from(
            std::time::UNIX_EPOCH
                .elapsed()
                .map_or(1, |d| d.subsec_nanos()),
        )
        | 1;
    let mut host: Vec<u8> = (0..bytes / 8)
        .flat_map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()
        })
        .collect();
    // SAFETY: see `main`.
    unsafe {
        let (up_stream, loop_stream) = (gpu.stream(), gpu.stream());
        let dst = gpu.alloc(bytes);
        if down {
            check(
                "cuMemcpyHtoD",
                sys::cuMemcpyHtoD_v2(dst, host.as_ptr().cast::<c_void>(), bytes),
            );
        }
        let p = gpu.alloc(256 * 4);
        check("cuMemsetD32", sys::cuMemsetD32_v2(p, 0, 256));
        check("cuCtxSynchronize", sys::cuCtxSynchronize());
        let sample = |out: &mut Vec<f64>| {
            let t = Instant::now();
            gpu.add1(p, 256, loop_stream);
            check("cuStreamSynchronize", sys::cuStreamSynchronize(loop_stream));
            out.push(t.elapsed().as_secs_f64() * 1e6);
        };
        let mut idle = Vec::with_capacity(iters);
        for _ in 0..iters {
            sample(&mut idle);
        }
        let done = Arc::new(AtomicBool::new(false));
        let start = Arc::new(Barrier::new(2));
        let trace = std::env::var_os("BENCH_TRACE_SAMPLES").is_some();
        let t = Instant::now();
        let upload = std::thread::scope(|scope| {
            let (done2, start2, host) = (Arc::clone(&done), Arc::clone(&start), &mut host);
            let (ctx, up) = (gpu.ctx as usize, up_stream as usize);
            let uploader = scope.spawn(move || {
                check(
                    "cuCtxSetCurrent",
                    sys::cuCtxSetCurrent(ctx as sys::CUcontext),
                );
                start2.wait();
                let t = Instant::now();
                if down {
                    check(
                        "cuMemcpyDtoHAsync",
                        sys::cuMemcpyDtoHAsync_v2(
                            host.as_mut_ptr().cast::<c_void>(),
                            dst,
                            bytes,
                            up as sys::CUstream,
                        ),
                    );
                } else {
                    check(
                        "cuMemcpyHtoDAsync",
                        sys::cuMemcpyHtoDAsync_v2(
                            dst,
                            host.as_ptr().cast::<c_void>(),
                            bytes,
                            up as sys::CUstream,
                        ),
                    );
                }
                check(
                    "cuStreamSynchronize",
                    sys::cuStreamSynchronize(up as sys::CUstream),
                );
                done2.store(true, Ordering::Release);
                t.elapsed().as_secs_f64()
            });
            start.wait();
            let mut busy = Vec::new();
            while !done.load(Ordering::Acquire) {
                sample(&mut busy);
                if trace {
                    eprintln!(
                        "busy {:.3} ms {:.1} us",
                        t.elapsed().as_secs_f64() * 1e3,
                        busy[busy.len() - 1]
                    );
                }
            }
            (uploader.join().expect("the uploader thread"), busy)
        });
        let time = t.elapsed().as_secs_f64();
        let (upload_s, mut busy) = upload;
        let (idle_p50, idle_p99) = percentiles(&mut idle);
        let (busy_p50, busy_p99) = percentiles(&mut busy);
        let sum = read_sum(p, 256);
        format!(
            "{{\"workload\": \"two-streams\", \"direction\": \"{}\", \"time_s\": {time:.6}, \
             \"upload_s\": {upload_s:.6}, \"syncs\": {}, \"must_cross_bytes\": {bytes}, \"idle_p50_us\": {idle_p50:.1}, \
             \"idle_p99_us\": {idle_p99:.1}, \"busy_p50_us\": {busy_p50:.1}, \"busy_p99_us\": {busy_p99:.1}, \
             \"busy_samples\": {}, \"checksum\": {sum}}}",
            if down { "down" } else { "up" },
            busy.len() + 1,
            busy.len()
        )
    }
}

/// The median and the 99th percentile of `samples` (0 for none).
fn percentiles(samples: &mut [f64]) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}
