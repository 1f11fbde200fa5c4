//! Driver-level micro-benchmark: the same unmodified program runs against NVIDIA's driver (locally) and
//! against Gleam's shim (`gleam run -- ...`), so their figures can be compared side by side.
//!
//! Measures, on device 0:
//! * `sync_rtt_us`: the mean (and median) time of `cuCtxSynchronize` on an idle context — for Gleam, one
//!   round trip to the serving peer;
//! * `launches_per_s`: empty-kernel launches per second (N launches, then one synchronize);
//! * `launch_cpu_us`: this process's CPU time (user + system, every thread: for Gleam the shim's writer
//!   and network threads too) per launch, for bursts of 1k, 10k, 100k and 200k launches each followed by
//!   one synchronize (`GLEAM_BENCH_BURSTS`, comma-separated, changes the sizes);
//! * `query_ns`: wall time per call of the state queries a framework makes thousands of times per step
//!   (PyTorch: `cuCtxGetDevice`, `cuDevicePrimaryCtxGetState`, `cuCtxGetCurrent`), each answered on the
//!   client by Gleam;
//! * `htod_mib_s` / `dtoh_mib_s`: throughput of one synchronous 256 MiB copy from/to pageable host memory.
//!   The timed upload repeats the bytes of an untimed first one: through Gleam the content cache answers
//!   it (the bytes' ids cross, not the bytes);
//! * `htod_cold_mib_s`: one synchronous 256 MiB upload of bytes nobody saw before (random, incompressible,
//!   seeded by the clock): through Gleam every byte crosses the transport, encrypted.
//!
//! Prints one JSON object on stdout. `GLEAM_BENCH_COPY_MIB` changes the copy size, `GLEAM_BENCH_LAUNCHES`
//! the launch count.

use std::ffi::{CString, c_void};
use std::time::Instant;

use cudarc::driver::sys;

#[path = "common/mod.rs"]
mod common;

/// An empty kernel with one pointer parameter, in PTX (JIT-compiled by the driver, or interpreted by emu).
const EMPTY_PTX: &str = r#"
.version 8.0
.target sm_75
.address_size 64

.visible .entry empty(
    .param .u64 empty_param_0
)
{
    ret;
}
"#;

fn check(what: &str, r: sys::CUresult) {
    if r != sys::CUresult::CUDA_SUCCESS {
        eprintln!("bench_driver: {what} failed: {r:?}");
        std::process::exit(1);
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU time this process has used so far (user + system, all threads), in microseconds.
fn cpu_us() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &raw mut usage);
        usage
    };
    let us = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
    us(usage.ru_utime) + us(usage.ru_stime)
}

fn main() {
    let bursts: Vec<usize> = std::env::var("GLEAM_BENCH_BURSTS")
        .unwrap_or_else(|_| "1000,10000,100000,200000".into())
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    let copy_mib = env_usize("GLEAM_BENCH_COPY_MIB", 256);
    let launches = env_usize("GLEAM_BENCH_LAUNCHES", 20_000);
    let syncs = env_usize("GLEAM_BENCH_SYNCS", 2_000);

    // SAFETY: raw driver calls with valid out-pointers and buffers that outlive each call; every result
    // is checked before the next call relies on it.
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

        // Warm up: first calls may connect, JIT or allocate lazily.
        for _ in 0..50 {
            check("cuCtxSynchronize", sys::cuCtxSynchronize());
        }

        // 1. Synchronous round trip.
        let mut samples = Vec::with_capacity(syncs);
        for _ in 0..syncs {
            let t = Instant::now();
            check("cuCtxSynchronize", sys::cuCtxSynchronize());
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let mean_rtt = samples.iter().sum::<f64>() / samples.len() as f64;
        samples.sort_by(f64::total_cmp);
        let median_rtt = samples[samples.len() / 2];

        // 2. Launch rate.
        let mut module = std::ptr::null_mut();
        let ptx = CString::new(EMPTY_PTX).expect("no NUL in PTX");
        check(
            "cuModuleLoadData",
            sys::cuModuleLoadData(&raw mut module, ptx.as_ptr().cast::<c_void>()),
        );
        let mut func = std::ptr::null_mut();
        let name = CString::new("empty").expect("no NUL");
        check(
            "cuModuleGetFunction",
            sys::cuModuleGetFunction(&raw mut func, module, name.as_ptr()),
        );
        let mut arg: u64 = 0;
        let mut params = [(&raw mut arg).cast::<c_void>()];
        let mut launch = |n: usize| {
            for _ in 0..n {
                check(
                    "cuLaunchKernel",
                    sys::cuLaunchKernel(
                        func,
                        1,
                        1,
                        1,
                        1,
                        1,
                        1,
                        0,
                        std::ptr::null_mut(),
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    ),
                );
            }
            check("cuCtxSynchronize", sys::cuCtxSynchronize());
        };
        launch(100);
        let t = Instant::now();
        launch(launches);
        let launches_per_s = launches as f64 / t.elapsed().as_secs_f64();
        // Client CPU per launch, by burst size (flat is the goal: no per-burst cost that grows).
        let launch_cpu_us: Vec<String> = bursts
            .iter()
            .map(|&n| {
                let before = cpu_us();
                launch(n);
                format!("\"{n}\": {:.3}", (cpu_us() - before) / n.max(1) as f64)
            })
            .collect();

        // 3. State queries (`GLEAM_BENCH_QUERIES` calls of each).
        let queries = env_usize("GLEAM_BENCH_QUERIES", 200_000);
        let per_call_ns = |f: &mut dyn FnMut()| {
            let t = Instant::now();
            for _ in 0..queries {
                f();
            }
            t.elapsed().as_secs_f64() * 1e9 / queries.max(1) as f64
        };
        let mut out_dev = 0;
        let (mut flags, mut active) = (0u32, 0i32);
        let mut current = std::ptr::null_mut();
        let query_ns = [
            (
                "cuCtxGetDevice",
                per_call_ns(&mut || check("cuCtxGetDevice", sys::cuCtxGetDevice(&raw mut out_dev))),
            ),
            (
                "cuDevicePrimaryCtxGetState",
                per_call_ns(&mut || {
                    check(
                        "cuDevicePrimaryCtxGetState",
                        sys::cuDevicePrimaryCtxGetState(dev, &raw mut flags, &raw mut active),
                    );
                }),
            ),
            (
                "cuCtxGetCurrent",
                per_call_ns(&mut || {
                    check("cuCtxGetCurrent", sys::cuCtxGetCurrent(&raw mut current));
                }),
            ),
        ]
        .map(|(name, ns)| format!("\"{name}\": {ns:.1}"));

        // 4. Bulk copies from/to pageable host memory.
        let bytes = copy_mib << 20;
        let host: Vec<u8> = (0..bytes).map(|i| (i * 7 + 3) as u8).collect();
        let mut back = vec![0u8; bytes];
        let mut dptr = 0;
        check("cuMemAlloc", sys::cuMemAlloc_v2(&raw mut dptr, bytes));
        check(
            "cuMemcpyHtoD",
            sys::cuMemcpyHtoD_v2(dptr, host.as_ptr().cast::<c_void>(), bytes),
        );
        let t = Instant::now();
        check(
            "cuMemcpyHtoD",
            sys::cuMemcpyHtoD_v2(dptr, host.as_ptr().cast::<c_void>(), bytes),
        );
        let htod_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        check(
            "cuMemcpyDtoH",
            sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast::<c_void>(), dptr, bytes),
        );
        let dtoh_s = t.elapsed().as_secs_f64();
        if back != host {
            eprintln!("bench_driver: the copied data came back different");
            std::process::exit(1);
        }
        let fresh = fresh_bytes(bytes);
        let t = Instant::now();
        check(
            "cuMemcpyHtoD",
            sys::cuMemcpyHtoD_v2(dptr, fresh.as_ptr().cast::<c_void>(), bytes),
        );
        let htod_cold_s = t.elapsed().as_secs_f64();
        check(
            "cuMemcpyDtoH",
            sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast::<c_void>(), dptr, bytes),
        );
        if back != fresh {
            eprintln!("bench_driver: the fresh upload came back different");
            std::process::exit(1);
        }
        check("cuMemFree", sys::cuMemFree_v2(dptr));
        check("cuModuleUnload", sys::cuModuleUnload(module));
        check(
            "cuDevicePrimaryCtxRelease",
            sys::cuDevicePrimaryCtxRelease_v2(dev),
        );

        let mib = copy_mib as f64;
        println!(
            "{{\"sync_rtt_us\": {mean_rtt:.2}, \"sync_rtt_median_us\": {median_rtt:.2}, \
             \"launches_per_s\": {launches_per_s:.0}, \"launch_cpu_us\": {{{}}}, \"query_ns\": {{{}}}, \
             \"htod_mib_s\": {:.1}, \"dtoh_mib_s\": {:.1}, \"htod_cold_mib_s\": {:.1}, \
             \"copy_mib\": {copy_mib}}}",
            launch_cpu_us.join(", "),
            query_ns.join(", "),
            mib / htod_s,
            mib / dtoh_s,
            mib / htod_cold_s
        );
    }
}

/// `len` random bytes, new to any content cache: seeded by the clock and the process id.
fn fresh_bytes(len: usize) -> Vec<u8> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut rng = common::SplitMix64::new(nanos ^ (u64::from(std::process::id()) << 32));
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(len);
    out
}
