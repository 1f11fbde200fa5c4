//! Hostile modules and runaway kernels end in errors within bounded memory and time (issue 11).
//!
//! This binary counts the heap bytes each test thread holds (a counting global allocator) and refuses any
//! allocation that would take a thread past its cap, so a regression shows as a failed test (or an abort
//! naming the allocation), never as a machine brought to its knees.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use common::{Arg, Gpu, fixture};
use gleam_ptx::{ExecError, FlatMemory, LaunchConfig, LaunchOptions, Limits, Module, StopReason};

struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
    /// Refuse allocations past this many live bytes on this thread (0: no cap).
    static CAP: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every allocation is delegated to `System` unchanged; the wrapper only counts sizes (and may
// refuse, returning null as the contract allows).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.with(Cell::get).saturating_add(layout.size());
        let cap = CAP.with(Cell::get);
        if cap != 0 && live > cap {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's `layout` contract is passed on as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.with(|l| l.set(live));
            PEAK.with(|p| p.set(p.get().max(live)));
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this `layout` (see `alloc`).
        unsafe { System.dealloc(ptr, layout) };
        LIVE.with(|l| l.set(l.get().saturating_sub(layout.size())));
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` with at most `cap` more heap bytes on this thread; returns its result and the peak it reached
/// above what the thread held before.
fn bounded<T>(cap: usize, f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    CAP.with(|c| c.set(base + cap));
    let r = f();
    CAP.with(|c| c.set(0));
    (r, PEAK.with(Cell::get) - base)
}

const HEAD: &str = ".version 8.0\n.target sm_80\n.address_size 64\n";

/// Functions that each call the next `fanout` times, `depth` deep, and a kernel calling the first.
fn call_tree(depth: usize, fanout: usize) -> String {
    let mut s = String::from(HEAD);
    s.push_str(&format!(".func f{depth}()\n{{\n ret;\n}}\n"));
    for d in (0..depth).rev() {
        s.push_str(&format!(".func f{d}()\n{{\n"));
        for _ in 0..fanout {
            s.push_str(&format!(" call f{};\n", d + 1));
        }
        s.push_str(" ret;\n}\n");
    }
    s.push_str(".visible .entry k()\n{\n call f0;\n ret;\n}\n");
    s
}

#[test]
fn exponential_inlining_is_refused_without_expanding() {
    // 16 deep, 8 calls each: 8^16 inlined calls, from under 2 KB of text.
    let src = call_tree(15, 8);
    assert!(src.len() < 2048, "{} bytes", src.len());
    let start = Instant::now();
    let (m, peak) = bounded(16 << 20, || Module::parse(&src));
    let m = m.expect("the module parses; its kernel is refused");
    let why = m.kernel("k").unwrap().unsupported().expect("refused");
    assert!(why.to_string().contains("after inlining"), "{why}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert!(peak < 1 << 20, "peak {peak} bytes");
    // The same tree, small enough, still inlines (8^3 calls).
    let m = Module::parse(&call_tree(3, 8)).unwrap();
    assert!(m.kernel("k").unwrap().unsupported().is_none());
}

#[test]
fn recursion_is_refused_without_expanding() {
    // Self-recursion with 8 calls per level would take 8^16 steps to reach the depth limit.
    let mut src = String::from(HEAD);
    src.push_str(".func r()\n{\n");
    for _ in 0..8 {
        src.push_str(" call r;\n");
    }
    src.push_str(" ret;\n}\n.visible .entry k()\n{\n call r;\n ret;\n}\n");
    let start = Instant::now();
    let (m, _) = bounded(16 << 20, || Module::parse(&src));
    let why = m
        .unwrap()
        .kernel("k")
        .unwrap()
        .unsupported()
        .cloned()
        .unwrap();
    assert!(why.to_string().contains("recursion"), "{why}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
fn module_instruction_budget_is_shared_by_kernels() {
    // Each kernel alone fits; together they do not.
    let mut src = call_tree(3, 8);
    for i in 0..4 {
        src.push_str(&format!(
            ".visible .entry k{i}()\n{{\n call f0;\n ret;\n}}\n"
        ));
    }
    let limits = Limits {
        max_module_instructions: 3000,
        ..Limits::default()
    };
    let e = Module::parse_with(&src, &limits).unwrap_err();
    assert!(e.expected.contains("max_module_instructions"), "{e}");
    assert_eq!(e.limit, Some("max_module_instructions"));
    assert!(Module::parse(&src).is_ok());
    let per_kernel = Limits {
        max_kernel_instructions: 100,
        ..Limits::default()
    };
    let m = Module::parse_with(&src, &per_kernel).unwrap();
    assert!(m.kernel("k2").unwrap().unsupported().is_some());
}

#[test]
fn large_initialized_globals_are_budgeted_before_allocation() {
    // 189 bytes of text declaring 6 GiB of initialized data.
    let mut src = String::from(HEAD);
    for n in "abcdef".chars() {
        src.push_str(&format!(".global .align 1 .b8 {n}[1073741823] = {{1}};\n"));
    }
    let (r, peak) = bounded(64 << 20, || Module::parse(&src));
    let e = r.unwrap_err();
    assert!(e.expected.contains("max_global_bytes"), "{e}");
    assert_eq!(e.limit, Some("max_global_bytes"));
    assert!(peak < 1 << 20, "peak {peak} bytes");
    // Allowed by a larger budget, the data is still not materialised: only the initialised prefix is kept.
    let limits = Limits {
        max_global_bytes: 8 << 30,
        ..Limits::default()
    };
    let (m, peak) = bounded(64 << 20, || Module::parse_with(&src, &limits));
    let m = m.unwrap();
    assert!(peak < 1 << 20, "peak {peak} bytes");
    assert_eq!(m.globals().len(), 6);
    for g in m.globals() {
        assert_eq!((g.size, g.init.as_slice()), (1073741823, &[1u8][..]));
    }
}

#[test]
fn initializers_longer_than_the_variable_are_errors() {
    let src = format!("{HEAD}.global .b32 x[2] = {{1, 2, 3}};\n");
    assert_eq!(Module::parse(&src).unwrap_err().limit, None);
    let src = format!("{HEAD}.global .b32 x[] = {{1, 2, 3}};\n");
    let m = Module::parse(&src).unwrap();
    assert_eq!(m.globals()[0].size, 12);
    let tight = Limits {
        max_global_bytes: 8,
        ..Limits::default()
    };
    assert!(Module::parse_with(&src, &tight).is_err());
}

/// `n` small kernels.
fn many_kernels(n: usize) -> String {
    let mut s = String::from(HEAD);
    for i in 0..n {
        s.push_str(&format!(
            ".visible .entry k{i}(.param .u32 p)\n{{\n ret;\n}}\n"
        ));
    }
    s
}

fn parse_time(src: &str) -> Duration {
    (0..2)
        .map(|_| {
            let t = Instant::now();
            Module::parse(src).unwrap();
            t.elapsed()
        })
        .min()
        .unwrap()
}

#[test]
fn many_kernels_parse_in_linear_time() {
    let small = many_kernels(5_000);
    let large = many_kernels(40_000);
    let (ts, tl) = (parse_time(&small), parse_time(&large));
    println!("5k kernels: {ts:?}, 40k kernels: {tl:?}");
    // 8x the kernels: linear is 8x the time, quadratic 64x. Allow for noise on a shared machine.
    assert!(tl < ts * 24, "5k kernels {ts:?}, 40k kernels {tl:?}");
    let m = Module::parse(&large).unwrap();
    assert_eq!(m.kernels().count(), 40_000);
    assert!(m.kernel("k39999").is_some());
    let e = Module::parse_with(
        &small,
        &Limits {
            max_kernels: 100,
            ..Limits::default()
        },
    )
    .unwrap_err();
    assert!(e.expected.contains("max_kernels"), "{e}");
    assert_eq!(e.limit, Some("max_kernels"));
}

/// A kernel body of `lines` instructions in nvcc's style.
fn long_kernel(lines: usize) -> String {
    let mut s = String::from(HEAD);
    s.push_str(
        ".visible .entry k(.param .u64 p)\n{\n .reg .b32 %r<8>;\n .reg .b64 %rd<4>;\n .reg .pred %p<2>;\n",
    );
    s.push_str(" ld.param.u64 %rd1, [p];\n");
    for i in 0..lines {
        match i % 4 {
            0 => s.push_str("\tadd.s32 \t%r2, %r1, 12345;\n"),
            1 => s.push_str("\tld.global.u32 \t%r3, [%rd1+4];\n"),
            2 => s.push_str("\tsetp.lt.u32 \t%p1, %r2, %r3;\n"),
            _ => s.push_str("\tselp.b32 \t%r1, %r2, %r3, %p1;\n"),
        }
    }
    s.push_str(" st.global.u32 [%rd1], %r1;\n ret;\n}\n");
    s
}

#[test]
fn parser_memory_is_proportional_to_the_input() {
    let src = long_kernel(40_000);
    let (m, peak) = bounded(512 << 20, || Module::parse(&src));
    m.unwrap();
    let ratio = peak as f64 / src.len() as f64;
    println!(
        "{} bytes of PTX: peak {peak} bytes ({ratio:.1}x)",
        src.len()
    );
    // Tokens are not stored: what remains is the syntax tree and the compiled program.
    assert!(
        ratio < 14.0,
        "peak {peak} bytes for {} bytes of PTX",
        src.len()
    );
}

#[test]
fn token_limit_is_an_error() {
    let src = long_kernel(1000);
    let limits = Limits {
        max_tokens: 500,
        ..Limits::default()
    };
    let (r, peak) = bounded(16 << 20, || Module::parse_with(&src, &limits));
    let e = r.unwrap_err();
    assert!(e.expected.contains("max_tokens"), "{e}");
    assert_eq!(e.limit, Some("max_tokens"));
    assert!(peak < 256 << 10, "peak {peak}");
    // Junk is refused at its first token, whatever follows.
    let junk = "a,".repeat(1 << 20);
    let (r, peak) = bounded(16 << 20, || Module::parse(&junk));
    assert!(r.is_err());
    assert!(peak < 64 << 10, "peak {peak}");
}

#[test]
fn every_limit_at_every_small_value_is_an_error_not_a_panic() {
    let texts: Vec<String> = ["vecadd.ptx", "call.ptx", "warp.ptx", "ops.ptx", "misc.ptx"]
        .iter()
        .map(|n| fixture(n))
        .chain([call_tree(4, 3), many_kernels(20)])
        .collect();
    for text in &texts {
        for v in (0..64).chain([100, 1000, 5000]) {
            let limits = [
                Limits {
                    max_tokens: v,
                    ..Limits::default()
                },
                Limits {
                    max_kernels: v,
                    ..Limits::default()
                },
                Limits {
                    max_global_bytes: v as u64,
                    ..Limits::default()
                },
                Limits {
                    max_kernel_instructions: v,
                    ..Limits::default()
                },
                Limits {
                    max_module_instructions: v,
                    ..Limits::default()
                },
            ];
            for l in limits {
                if let Ok(m) = Module::parse_with(text, &l) {
                    for k in m.kernels() {
                        let _ = (k.param_bytes(), k.unsupported());
                    }
                }
            }
        }
    }
}

#[test]
fn token_mutations_under_tight_limits_error_without_panics() {
    let text = fixture("call.ptx");
    let tokens: Vec<&str> = text
        .split_inclusive(|c: char| c.is_whitespace() || ",;[]{}()".contains(c))
        .collect();
    let replacements = [
        "", "}", "{", "call f;", "[", ".func", "=", "{1,2}", "-1", "é",
    ];
    let limits = Limits {
        max_tokens: 400,
        max_kernels: 2,
        max_global_bytes: 64,
        max_kernel_instructions: 40,
        max_module_instructions: 60,
    };
    let mut seed: u64 = 0x2545_F491_4F6C_DD1D;
    for _ in 0..2000 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let at = (seed >> 33) as usize % tokens.len();
        let with = replacements[(seed >> 20) as usize % replacements.len()];
        let mutated: String = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| if i == at { with } else { *t })
            .collect();
        let _ = Module::parse_with(&mutated, &limits);
    }
}

/// A kernel whose threads never finish.
const FOREVER: &str = ".version 8.0\n.target sm_80\n.address_size 64\n\
    .visible .entry forever(.param .u64 p)\n{\n .reg .b32 %r<2>;\n mov.u32 %r1, 0;\n\
    $L_top:\n add.s32 %r1, %r1, 1;\n bra $L_top;\n}\n";

fn forever(opts: &LaunchOptions) -> (Result<gleam_ptx::LaunchStats, ExecError>, Duration) {
    let m = Module::parse(FOREVER).unwrap();
    let g = Gpu::new(&m);
    let params = common::pack(&m, "forever", &[Arg::U64(0)]);
    let cfg = LaunchConfig {
        grid: [8, 1, 1],
        block: [64, 1, 1],
        dynamic_shared_bytes: 0,
    };
    let t = Instant::now();
    let r = gleam_ptx::launch_with(&m, "forever", &cfg, &params, &g.symbols, &g.mem, opts);
    (r, t.elapsed())
}

#[test]
fn a_kernel_that_never_ends_stops_at_its_deadline() {
    let (r, took) = forever(&LaunchOptions {
        deadline: Some(Instant::now() + Duration::from_millis(100)),
        ..LaunchOptions::default()
    });
    assert_eq!(r.unwrap_err(), ExecError::Stopped(StopReason::Deadline));
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[test]
fn a_kernel_that_never_ends_stops_when_cancelled() {
    let flag = AtomicBool::new(false);
    let (r, took) = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            flag.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        forever(&LaunchOptions {
            cancel: Some(&flag),
            ..LaunchOptions::default()
        })
    });
    assert_eq!(r.unwrap_err(), ExecError::Stopped(StopReason::Cancelled));
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[test]
fn a_kernel_that_never_ends_stops_at_its_instruction_budget() {
    let (r, _) = forever(&LaunchOptions {
        max_thread_instructions: Some(10_000_000),
        ..LaunchOptions::default()
    });
    assert_eq!(
        r.unwrap_err(),
        ExecError::Stopped(StopReason::Budget(10_000_000))
    );
}

#[test]
fn a_budget_the_kernel_fits_in_changes_nothing() {
    let m = Module::parse(&fixture("vecadd.ptx")).unwrap();
    let mut g = Gpu::new(&m);
    let n = 1000u32;
    let a = g.upload(&common::f32_bytes(&vec![1.5; n as usize]));
    let b = g.upload(&common::f32_bytes(&vec![2.0; n as usize]));
    let c = g.upload(&vec![0u8; 4 * n as usize]);
    let k = m.kernels().next().unwrap().name().to_string();
    let params = common::pack(
        &m,
        &k,
        &[Arg::U64(a), Arg::U64(b), Arg::U64(c), Arg::U32(n)],
    );
    let cfg = LaunchConfig {
        grid: [4, 1, 1],
        block: [256, 1, 1],
        dynamic_shared_bytes: 0,
    };
    let flag = AtomicBool::new(false);
    let stats = gleam_ptx::launch_with(
        &m,
        &k,
        &cfg,
        &params,
        &HashMap::new(),
        &g.mem,
        &LaunchOptions {
            cancel: Some(&flag),
            deadline: Some(Instant::now() + Duration::from_secs(60)),
            max_thread_instructions: Some(1 << 40),
            textures: None,
        },
    )
    .unwrap();
    assert!(stats.thread_instructions > 0);
    assert_eq!(
        common::to_f32(&g.download(c, 4 * n as usize)),
        vec![3.5; n as usize]
    );
    let _ = FlatMemory::new(0);
}

#[test]
fn a_grid_of_many_tiny_blocks_stops_at_its_deadline() {
    let src = format!("{HEAD}.visible .entry tiny()\n{{\n ret;\n}}\n");
    let m = Module::parse(&src).unwrap();
    let g = Gpu::new(&m);
    let cfg = LaunchConfig {
        grid: [i32::MAX as u32, 65535, 1],
        block: [1, 1, 1],
        dynamic_shared_bytes: 0,
    };
    let t = Instant::now();
    let r = gleam_ptx::launch_with(
        &m,
        "tiny",
        &cfg,
        &[],
        &g.symbols,
        &g.mem,
        &LaunchOptions {
            deadline: Some(Instant::now() + Duration::from_millis(100)),
            ..LaunchOptions::default()
        },
    );
    assert_eq!(r.unwrap_err(), ExecError::Stopped(StopReason::Deadline));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}
