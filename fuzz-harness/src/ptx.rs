//! Target `ptx`: PTX text from a client, through the parser and compiler and, when it compiles, into a
//! launch.
//!
//! The text is parsed with [`LIMITS`] (small, so that a few kilobytes of input can reach every limit).
//! For a module that parses, its globals are placed in a [`FlatMemory`] arena with their initial values,
//! and up to [`MAX_KERNELS`] kernels are launched on one block with every pointer-sized parameter
//! pointing at a buffer of the arena, under a budget of [`BUDGET`] thread-instructions (and a deadline as a
//! backstop). Errors of any kind are fine; a panic, a hang or an allocation out of proportion is a bug.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use gleam_ptx::{
    ExecError, FlatMemory, GlobalMemory, LaunchConfig, LaunchOptions, Limits, Module, StopReason,
};

/// What a fuzzed module may cost: a few kilobytes of text can reach each of these.
pub const LIMITS: Limits = Limits {
    max_tokens: 1 << 16,
    max_kernels: 64,
    max_global_bytes: 64 << 10,
    max_kernel_instructions: 1 << 15,
    max_module_instructions: 1 << 17,
};
/// Kernels launched per module.
pub const MAX_KERNELS: usize = 4;
/// Thread-instructions one launch may execute.
pub const BUDGET: u64 = 1 << 17;
/// Bytes of the arena the globals and buffers live in.
const ARENA: usize = 256 << 10;
/// Bytes of the buffer each pointer parameter points at.
const BUFFER: usize = 4096;
/// A launch stops at this deadline if the budget has not stopped it (it should have, long before).
const DEADLINE: Duration = Duration::from_secs(5);

/// Runs one input. Panics only on a bug.
pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(module) = Module::parse_with(text, &LIMITS) else {
        return;
    };
    let mut arena = FlatMemory::new(ARENA);
    let mut symbols = HashMap::new();
    let mut inits = Vec::new();
    for global in module.globals() {
        // Declared sizes are bounded by LIMITS.max_global_bytes, so every global fits the arena.
        let addr = arena
            .alloc(global.size.max(1))
            .expect("globals within Limits::max_global_bytes fit the arena");
        assert!(
            global.init.len() <= global.size.max(1),
            "global {} holds {} initial bytes for a size of {}",
            global.name,
            global.init.len(),
            global.size
        );
        symbols.insert(global.name.clone(), addr);
        inits.push((addr, &global.init));
    }
    let buffers: Vec<u64> = (0..4).filter_map(|_| arena.alloc(BUFFER)).collect();
    for (addr, init) in inits {
        arena
            .write(addr, init)
            .expect("a global's initial value fits its allocation");
    }

    for kernel in module.kernels().take(MAX_KERNELS) {
        // Queries a client makes of every function.
        let _ = (
            kernel.static_shared_bytes(),
            kernel.local_bytes_per_thread(),
            kernel.num_regs(),
            kernel.unsupported(),
        );
        let mut params = vec![0u8; kernel.param_bytes()];
        for (i, param) in kernel.params().iter().enumerate() {
            let end = param.offset.checked_add(param.size);
            assert!(
                end.is_some_and(|end| end <= params.len()),
                "parameter {} of {} lies outside the parameter buffer",
                param.name,
                kernel.name()
            );
            if param.size == 8 {
                let addr = buffers[i % buffers.len()];
                params[param.offset..param.offset + 8].copy_from_slice(&addr.to_le_bytes());
            } else {
                for (j, b) in params[param.offset..param.offset + param.size]
                    .iter_mut()
                    .enumerate()
                {
                    *b = (i * 31 + j) as u8;
                }
            }
        }
        let threads = kernel.max_threads_per_block().clamp(1, 64);
        let cfg = LaunchConfig {
            // One block: the interpreter runs it on this thread (more would start a thread per core for
            // every launch, which costs more than the kernel).
            grid: [1, 1, 1],
            block: [threads, 1, 1],
            dynamic_shared_bytes: 256,
        };
        let opts = LaunchOptions {
            deadline: Some(Instant::now() + DEADLINE),
            max_thread_instructions: Some(BUDGET),
            ..LaunchOptions::default()
        };
        let result = gleam_ptx::launch_with(
            &module,
            kernel.name(),
            &cfg,
            &params,
            &symbols,
            &arena,
            &opts,
        );
        assert!(
            !matches!(result, Err(ExecError::Stopped(StopReason::Deadline))),
            "kernel {} ran {DEADLINE:?} without reaching its budget of {BUDGET} thread-instructions",
            kernel.name()
        );
    }
}
