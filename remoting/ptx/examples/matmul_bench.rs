//! Runs a 256x256 tiled f32 matmul (16x16 tiles in shared memory, PTX in nvcc 13 style) through the
//! interpreter and prints the throughput in thread-instructions per second.
//!
//! `cargo run --release -p gleam-ptx --example matmul_bench [N] [repeats] [watchdog]`
//!
//! With `watchdog`, every launch runs under a cancel flag, a deadline and an instruction budget (none of
//! which fires), to measure what checking them costs.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use gleam_ptx::{FlatMemory, GlobalMemory, LaunchConfig, LaunchOptions, Module};

const PTX: &str = include_str!("../tests/fixtures/matmul.ptx");

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(256);
    let repeats: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(3);
    let watchdog = args.next().is_some_and(|a| a == "watchdog");
    if n == 0 || !n.is_multiple_of(16) {
        return Err("N must be a positive multiple of 16".into());
    }
    let module = Module::parse(PTX)?;
    let kernel = module.kernel("matmul").ok_or("no matmul kernel")?;
    let mut mem = FlatMemory::new(3 * n * n * 4 + 4096);
    let a: Vec<f32> = (0..n * n)
        .map(|i| ((i * 7) % 13) as f32 * 0.25 - 1.0)
        .collect();
    let b: Vec<f32> = (0..n * n)
        .map(|i| ((i * 5) % 11) as f32 * 0.125 + 0.5)
        .collect();
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let da = mem.alloc(n * n * 4).ok_or("arena")?;
    let db = mem.alloc(n * n * 4).ok_or("arena")?;
    let dc = mem.alloc(n * n * 4).ok_or("arena")?;
    mem.write(da, &bytes(&a))?;
    mem.write(db, &bytes(&b))?;
    let mut params = vec![0u8; kernel.param_bytes()];
    for (p, v) in kernel.params().iter().zip([da, db, dc]) {
        params[p.offset..p.offset + 8].copy_from_slice(&v.to_le_bytes());
    }
    let last = &kernel.params()[3];
    params[last.offset..last.offset + 4].copy_from_slice(&(n as u32).to_le_bytes());
    let t = (n / 16) as u32;
    let cfg = LaunchConfig {
        grid: [t, t, 1],
        block: [16, 16, 1],
        dynamic_shared_bytes: 0,
    };
    let symbols = HashMap::new();
    let mut best = f64::MAX;
    let mut stats = Default::default();
    let cancel = AtomicBool::new(false);
    for _ in 0..repeats.max(1) {
        let opts = if watchdog {
            LaunchOptions {
                cancel: Some(&cancel),
                deadline: Some(Instant::now() + Duration::from_secs(3600)),
                max_thread_instructions: Some(u64::MAX / 2),
                textures: None,
            }
        } else {
            LaunchOptions::default()
        };
        let start = Instant::now();
        stats = gleam_ptx::launch_with(&module, "matmul", &cfg, &params, &symbols, &mem, &opts)?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    // Spot-check one element against the CPU.
    let mut c0 = [0u8; 4];
    mem.read(dc + 4 * (n as u64 + 1), &mut c0)?;
    let mut s = 0f32;
    for k in 0..n {
        s = a[n + k].mul_add(b[k * n + 1], s);
    }
    let ok = f32::from_le_bytes(c0) == s;
    println!(
        "matmul {n}x{n}{}: {} thread-instructions, {} warp steps, best of {repeats}: {:.3} s, {:.1} M thread-instr/s, check {}",
        if watchdog { " (watchdog)" } else { "" },
        stats.thread_instructions,
        stats.warp_steps,
        best,
        stats.thread_instructions as f64 / best / 1e6,
        if ok { "ok" } else { "FAILED" }
    );
    if ok {
        Ok(())
    } else {
        Err("result mismatch".into())
    }
}
