//! End-to-end kernels in the style nvcc 13 emits, run through the interpreter and checked against a CPU
//! reference.

mod common;

use common::*;
use gleam_ptx::{ExecError, Module};

#[test]
fn vecadd_with_tail_guard() {
    let m = Module::parse(&fixture("vecadd.ptx")).unwrap();
    let k = m.kernel("vecAdd").unwrap();
    assert_eq!(k.params().len(), 4);
    assert_eq!(k.params()[3].offset, 24);
    assert_eq!(k.param_bytes(), 28);
    assert_eq!(k.max_threads_per_block(), 1024);
    let n = 1000usize;
    let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let b: Vec<f32> = (0..n).map(|i| 1.0 / (i as f32 + 1.0)).collect();
    let mut g = Gpu::new(&m);
    let (da, db) = (g.upload(&f32_bytes(&a)), g.upload(&f32_bytes(&b)));
    let dc = g.upload(&vec![0u8; n * 4]);
    let stats = g
        .launch(
            &m,
            "vecAdd",
            [4, 1, 1],
            [256, 1, 1],
            0,
            &[Arg::U64(da), Arg::U64(db), Arg::U64(dc), Arg::U32(n as u32)],
        )
        .unwrap();
    let c = to_f32(&g.download(dc, n * 4));
    for i in 0..n {
        assert_eq!(c[i].to_bits(), (a[i] + b[i]).to_bits(), "index {i}");
    }
    assert_eq!(stats.blocks, 4);
    assert!(stats.thread_instructions > 1000 * 15);
}

#[test]
fn shared_memory_tree_reduction_with_barriers_and_float_atomics() {
    let m = Module::parse(&fixture("reduce.ptx")).unwrap();
    let k = m.kernel("reduceSum").unwrap();
    assert_eq!(k.static_shared_bytes(), 1024);
    assert_eq!(k.max_threads_per_block(), 256);
    let n = 3000usize;
    // Small integers keep every partial sum exact, so the order of atomics does not matter.
    let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let mut g = Gpu::new(&m);
    let dx = g.upload(&f32_bytes(&x));
    let dout = g.upload(&[0u8; 4]);
    let blocks = n.div_ceil(256) as u32;
    g.launch(
        &m,
        "reduceSum",
        [blocks, 1, 1],
        [256, 1, 1],
        0,
        &[Arg::U64(dx), Arg::U64(dout), Arg::U32(n as u32)],
    )
    .unwrap();
    let got = to_f32(&g.download(dout, 4))[0];
    assert_eq!(got, x.iter().sum::<f32>());
    // More threads than .maxntid is an invalid launch.
    let err = g
        .launch(
            &m,
            "reduceSum",
            [1, 1, 1],
            [512, 1, 1],
            0,
            &[Arg::U64(dx), Arg::U64(dout), Arg::U32(n as u32)],
        )
        .unwrap_err();
    assert!(matches!(err, ExecError::InvalidLaunch { .. }), "{err}");
}

#[test]
fn warp_shuffles_and_ballot() {
    let m = Module::parse(&fixture("warp.ptx")).unwrap();
    let n = 128usize;
    let x: Vec<u32> = (0..n as u32).map(|i| i * 3 + (i % 5)).collect();
    let mut g = Gpu::new(&m);
    let dx = g.upload(&u32_bytes(&x));
    let dw = g.upload(&vec![0u8; (n / 32) * 16]);
    let dup = g.upload(&vec![0u8; n * 4]);
    g.launch(
        &m,
        "warpReduce",
        [2, 1, 1],
        [64, 1, 1],
        0,
        &[Arg::U64(dx), Arg::U64(dw), Arg::U64(dup)],
    )
    .unwrap();
    let w = to_u32(&g.download(dw, (n / 32) * 16));
    for warp in 0..n / 32 {
        let lanes = &x[warp * 32..warp * 32 + 32];
        let sum: u32 = lanes.iter().sum();
        let ballot = lanes
            .iter()
            .enumerate()
            .fold(0u32, |b, (i, v)| b | ((v & 1) << i));
        assert_eq!(w[warp * 4], sum, "warp {warp} sum");
        assert_eq!(w[warp * 4 + 1], ballot, "warp {warp} ballot");
        assert_eq!(w[warp * 4 + 2], lanes[3], "warp {warp} idx");
        assert_eq!(
            w[warp * 4 + 3],
            lanes[0],
            "warp {warp} up at lane 0 keeps its own value"
        );
    }
    let up = to_u32(&g.download(dup, n * 4));
    for i in 0..n {
        let expect = if i % 32 == 0 { x[i] } else { x[i - 1] };
        assert_eq!(up[i], expect, "shfl.up at {i}");
    }
}

#[test]
fn tiled_matmul_matches_cpu_bit_for_bit() {
    let m = Module::parse(&fixture("matmul.ptx")).unwrap();
    assert_eq!(m.kernel("matmul").unwrap().static_shared_bytes(), 2048);
    let n = 48usize;
    let a: Vec<f32> = (0..n * n)
        .map(|i| ((i * 7) % 13) as f32 * 0.25 - 1.0)
        .collect();
    let b: Vec<f32> = (0..n * n)
        .map(|i| ((i * 5) % 11) as f32 * 0.125 + 0.5)
        .collect();
    let mut g = Gpu::new(&m);
    let (da, db) = (g.upload(&f32_bytes(&a)), g.upload(&f32_bytes(&b)));
    let dc = g.upload(&vec![0u8; n * n * 4]);
    let t = (n / 16) as u32;
    g.launch(
        &m,
        "matmul",
        [t, t, 1],
        [16, 16, 1],
        0,
        &[Arg::U64(da), Arg::U64(db), Arg::U64(dc), Arg::U32(n as u32)],
    )
    .unwrap();
    let c = to_f32(&g.download(dc, n * n * 4));
    for r in 0..n {
        for col in 0..n {
            let mut s = 0f32;
            for k in 0..n {
                s = a[r * n + k].mul_add(b[k * n + col], s);
            }
            assert_eq!(c[r * n + col].to_bits(), s.to_bits(), "C[{r}][{col}]");
        }
    }
}

#[test]
fn device_function_call_local_memory_and_const_bank() {
    let m = Module::parse(&fixture("call.ptx")).unwrap();
    assert_eq!(m.globals().len(), 1);
    assert_eq!(m.globals()[0].name, "coeffs");
    assert_eq!(m.globals()[0].size, 16);
    assert_eq!(&m.globals()[0].init[..4], &1f32.to_le_bytes());
    let k = m.kernel("callPoly").unwrap();
    assert!(k.local_bytes_per_thread() >= 64);
    let mut g = Gpu::new(&m);
    let out = g.upload(&[0u8; 64 * 4]);
    g.launch(
        &m,
        "callPoly",
        [1, 1, 1],
        [64, 1, 1],
        0,
        &[Arg::U64(out), Arg::U32(0)],
    )
    .unwrap();
    let got = to_f32(&g.download(out, 64 * 4));
    for t in 0..64u32 {
        let v = (t + (t * 7) % 16) as f32;
        let expect = 4f32.mul_add(v, 3.0).mul_add(v, 2.0).mul_add(v, 1.0);
        assert_eq!(got[t as usize].to_bits(), expect.to_bits(), "thread {t}");
    }
}

#[test]
fn dynamic_shared_memory_generic_addressing_and_f16() {
    let m = Module::parse(&fixture("dynshared.ptx")).unwrap();
    let n = 96usize;
    let h: Vec<u8> = (0..n)
        .flat_map(|i| {
            half::f16::from_f32(i as f32 * 0.5 - 3.0)
                .to_bits()
                .to_le_bytes()
        })
        .collect();
    let mut g = Gpu::new(&m);
    let din = g.upload(&h);
    let dout = g.upload(&vec![0u8; n * 4]);
    g.launch(
        &m,
        "reverseDyn",
        [1, 1, 1],
        [n as u32, 1, 1],
        (n * 4) as u32,
        &[Arg::U64(din), Arg::U64(dout)],
    )
    .unwrap();
    let got = to_f32(&g.download(dout, n * 4));
    for (i, v) in got.iter().enumerate() {
        let j = n - 1 - i;
        assert_eq!(*v, (j as f32 * 0.5 - 3.0) * 2.0, "index {i}");
    }
    // Too little dynamic shared memory: the out-of-range shared access is a memory fault.
    let err = g
        .launch(
            &m,
            "reverseDyn",
            [1, 1, 1],
            [n as u32, 1, 1],
            16,
            &[Arg::U64(din), Arg::U64(dout)],
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            ExecError::MemoryFault {
                space: "shared",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn out_of_bounds_global_access_is_a_memory_fault_with_line() {
    let m = Module::parse(&fixture("vecadd.ptx")).unwrap();
    let mut g = Gpu::new(&m);
    let small = g.upload(&[0u8; 16]);
    let err = g
        .launch(
            &m,
            "vecAdd",
            [1, 1, 1],
            [32, 1, 1],
            0,
            &[
                Arg::U64(small),
                Arg::U64(small),
                Arg::U64(small),
                Arg::U32(32),
            ],
        )
        .unwrap_err();
    match err {
        ExecError::MemoryFault { space, line, .. } => {
            assert_eq!(space, "global");
            assert!(line > 20, "line {line}");
        }
        e => panic!("unexpected {e}"),
    }
}

#[test]
fn missing_kernel_and_short_params_are_reported() {
    let m = Module::parse(&fixture("vecadd.ptx")).unwrap();
    let g = Gpu::new(&m);
    let cfg = gleam_ptx::LaunchConfig {
        grid: [1, 1, 1],
        block: [1, 1, 1],
        dynamic_shared_bytes: 0,
    };
    let e = gleam_ptx::launch(&m, "nope", &cfg, &[], &g.symbols, &g.mem).unwrap_err();
    assert_eq!(e, ExecError::NoSuchKernel("nope".into()));
    let e = gleam_ptx::launch(&m, "vecAdd", &cfg, &[0; 8], &g.symbols, &g.mem).unwrap_err();
    assert!(matches!(e, ExecError::InvalidLaunch { .. }));
}

#[test]
fn scalar_instruction_semantics() {
    let m = Module::parse(&fixture("ops.ptx")).unwrap();
    let mut g = Gpu::new(&m);
    let input: Vec<u32> = vec![
        (-7i32) as u32,
        3,
        2.5f32.to_bits(),
        f32::NAN.to_bits(),
        0x1234_5678,
        (-2.5f32).to_bits(),
        1.0e30f32.to_bits(),
        0xF0F0_F0F0,
    ];
    let din = g.upload(&u32_bytes(&input));
    let dout = g.upload(&[0u8; 192]);
    g.launch(
        &m,
        "ops",
        [1, 1, 1],
        [1, 1, 1],
        0,
        &[Arg::U64(din), Arg::U64(dout)],
    )
    .unwrap();
    let o = to_u32(&g.download(dout, 192));
    let f = |v: f32| v.to_bits();
    let expect: Vec<(usize, u32, &str)> = vec![
        (0, (-1i32) as u32, "rem.s32"),
        (1, (-2i32) as u32, "div.s32"),
        (2, (-4i32) as u32, "shr.s32"),
        (3, 0x7FFF_FFFC, "shr.u32"),
        (4, (-7i32) as u32, "min.s32"),
        (5, 0xFFFF_FFF9, "max.u32"),
        (6, (-2i32) as u32, "mul.hi.s32"),
        (7, 13, "popc"),
        (8, 3, "clz"),
        (9, 0x1E6A_2C48, "brev"),
        (10, 0x56, "bfe.u32"),
        (11, 0xFFFF_FFF0, "bfe.s32"),
        (12, 0x1234_AB78, "bfi"),
        (13, 0xF0F0_1256, "prmt"),
        (14, 0x1234_5678 ^ 0xF0F0_F0F0 ^ 0xFFFF_FFF9, "lop3 xor3"),
        (15, 1, "setp.nan"),
        (16, 0, "setp.lt NaN"),
        (17, 1, "setp.ltu NaN"),
        (18, 0, "setp.ne NaN"),
        (19, 1, "setp.neu NaN"),
        (20, (-2i32) as u32, "cvt.rni"),
        (21, (-3i32) as u32, "cvt.rmi"),
        (22, i32::MAX as u32, "cvt.rzi saturates"),
        (23, 0, "cvt.rzi.u32 of negative"),
        (24, 0x4100, "cvt.rn.f16.f32"),
        (25, f(1.0), "cvt.sat"),
        (26, f(1.0 / 3.0), "div.rn"),
        (27, f(2.5f32.sqrt()), "sqrt.rn"),
        (28, f(1.0), "add.rz"),
        (29, f(1.0) + 1, "add.rp"),
        (30, 0, "add.cc"),
        (31, 1, "addc"),
        (32, 0xFFFF_FFFF, "set.lt.u32.s32"),
        (33, 1, "testp.notanumber"),
        (34, f(-2.5), "copysign"),
        (35, (-16i32) as u32, "cvt.s32.s8"),
        (36, 79, "mad.lo"),
        (38, 0, "setp.and"),
        (39, 1, "setp.or"),
        (40, 0xF0F0_F0F0, "mov.b64 unpack hi"),
        (41, 0x1234_5678, "mov.b64 unpack lo"),
        (42, f(2.5f32.mul_add(2.5, -1.0)), "fma"),
        (43, f(2.5f32.exp2()), "ex2"),
        (44, f(-7.0), "cvt.rn.f32.s32"),
        (45, 28, "bfind"),
        (46, 0, "branch skipped"),
        (47, 0xF0F0_F0F0, "@!p store"),
    ];
    for (i, v, what) in expect {
        assert_eq!(o[i], v, "out[{i}] {what}: {:#x} vs {v:#x}", o[i]);
    }
}

#[test]
fn parse_errors_name_the_line() {
    let e = Module::parse(".version 9.0\n.target sm_90\n.address_size 64\n.visible .entry k(\n  .param .u64 p\n{\n ret;\n}\n")
        .unwrap_err();
    assert_eq!(e.line, 6, "{e}");
    let e = Module::parse(".version 9.0\n.address_size 32\n").unwrap_err();
    assert_eq!(e.line, 2);
    let e = Module::parse(".visible .entry k()\n{\n  .reg .b32 %r<2>;\n  mov.u32 %r1, ;\n}\n")
        .unwrap_err();
    assert_eq!(e.line, 4, "{e}");
}

#[test]
fn unsupported_instructions_are_reported_at_launch_with_their_line() {
    let src = ".version 9.0\n.target sm_90\n.address_size 64\n.visible .entry k(.param .u64 p)\n{\n\
               .reg .b32 %r<4>;\n  mov.u32 %r1, 1;\n  cp.async.ca.shared.global [%r1], [%r1], 4;\n  ret;\n}\n";
    let m = Module::parse(src).unwrap();
    let k = m.kernel("k").unwrap();
    assert!(k.unsupported().is_some());
    let g = Gpu::new(&m);
    let e = g
        .launch(&m, "k", [1, 1, 1], [1, 1, 1], 0, &[Arg::U64(0)])
        .unwrap_err();
    match e {
        ExecError::Unsupported { instruction, line } => {
            assert!(instruction.starts_with("cp.async"), "{instruction}");
            assert_eq!(line, 8);
        }
        e => panic!("unexpected {e}"),
    }
}

#[test]
fn trap_stops_the_launch() {
    let src = ".version 9.0\n.target sm_90\n.address_size 64\n.visible .entry k()\n{\n\
               .reg .pred %p<2>;\n  .reg .b32 %r<2>;\n  mov.u32 %r1, %tid.x;\n  setp.eq.s32 %p1, %r1, 5;\n\
               @%p1 trap;\n  ret;\n}\n";
    let m = Module::parse(src).unwrap();
    let g = Gpu::new(&m);
    let e = g.launch(&m, "k", [2, 1, 1], [8, 1, 1], 0, &[]).unwrap_err();
    assert!(
        matches!(
            e,
            ExecError::Trap {
                line: 10,
                block: [0, 0, 0],
                thread: [5, 0, 0]
            }
        ),
        "{e}"
    );
}

#[test]
fn every_checked_in_ptx_compiles_without_unsupported_instructions() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dirs = [
        root.join("tests/fixtures"),
        root.join("conformance/ptx"),
        root.join("../../examples/kernels"),
    ];
    let mut seen = 0;
    for d in dirs {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "ptx") {
                let text = std::fs::read_to_string(&p).unwrap();
                let m = Module::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                for k in m.kernels() {
                    assert!(
                        k.unsupported().is_none(),
                        "{} {}: {:?}",
                        p.display(),
                        k.name(),
                        k.unsupported()
                    );
                }
                seen += 1;
            }
        }
    }
    assert!(seen >= 7);
}

#[test]
fn struct_params_half_math_shared_atomics_votes() {
    let m = Module::parse(&fixture("misc.ptx")).unwrap();
    let k = m.kernel("misc").unwrap();
    assert_eq!(k.max_threads_per_block(), 32);
    let p: Vec<_> = k
        .params()
        .iter()
        .map(|p| (p.offset, p.size, p.align))
        .collect();
    assert_eq!(p, vec![(0, 24, 8), (24, 4, 4)]);
    assert_eq!(k.static_shared_bytes(), 16);
    let mut g = Gpu::new(&m);
    let out = g.upload(&[0u8; 32 * 64]);
    // The struct {u64 out; u32 a; f32 b; u32 c;} packed by hand into the first parameter.
    let mut params = vec![0u8; k.param_bytes()];
    params[0..8].copy_from_slice(&out.to_le_bytes());
    params[8..12].copy_from_slice(&10u32.to_le_bytes());
    params[12..16].copy_from_slice(&1.5f32.to_le_bytes());
    params[16..20].copy_from_slice(&100u32.to_le_bytes());
    params[24..28].copy_from_slice(&1000u32.to_le_bytes());
    let cfg = gleam_ptx::LaunchConfig {
        grid: [1, 1, 1],
        block: [32, 1, 1],
        dynamic_shared_bytes: 0,
    };
    gleam_ptx::launch(&m, "misc", &cfg, &params, &g.symbols, &g.mem).unwrap();
    let o = to_u32(&g.download(out, 32 * 64));
    let mut olds = Vec::new();
    for t in 0..32u32 {
        let r = &o[t as usize * 16..t as usize * 16 + 16];
        assert_eq!(r[0], 10 + 1 + 100 + 1000, "struct fields, thread {t}");
        let x = t as f32;
        let lo = u32::from(half::f16::from_f32(x * x + x).to_bits());
        assert_eq!(r[1], lo | 0x3A00 << 16, "fma.f16x2, thread {t}");
        assert_eq!(r[2], 0x4040_4040, "bf16x2, thread {t}");
        olds.push(r[3]);
        assert_eq!(r[4], 31, "red.shared.max");
        assert_eq!(r[5], if t == 0 { 0 } else { 7 }, "atom.cas");
        assert_eq!((r[6], r[7], r[8]), (0, 1, 0), "vote all/any/uni");
        if t < 16 {
            assert_eq!(r[9], 0xFFFF, "activemask in the divergent branch");
            assert_eq!(r[10], 120, "redux.sync.add");
        } else {
            assert_eq!((r[9], r[10]), (0, 0));
        }
        assert_eq!(r[11], 1, "clock advances");
        assert_eq!(r[12], (1u32 << t) - 1, "lanemask_lt");
    }
    olds.sort();
    assert_eq!(
        olds,
        (0..32).collect::<Vec<u32>>(),
        "atom.shared.add returns distinct old values"
    );
    // .reqntid 32 allows no more threads.
    let cfg = gleam_ptx::LaunchConfig {
        grid: [1, 1, 1],
        block: [64, 1, 1],
        dynamic_shared_bytes: 0,
    };
    assert!(gleam_ptx::launch(&m, "misc", &cfg, &params, &g.symbols, &g.mem).is_err());
}

#[test]
fn warps_are_time_sliced_so_spin_waits_on_shared_flags_finish() {
    let m = Module::parse(&fixture("spin.ptx")).unwrap();
    let mut g = Gpu::new(&m);
    let out = g.upload(&[0u8; 16]);
    g.launch(&m, "spin", [1, 1, 1], [64, 1, 1], 0, &[Arg::U64(out)])
        .unwrap();
    let o = to_u32(&g.download(out, 16));
    assert_eq!(o[0], 42, "flag seen by the spinning warp");
    // bytes of a as signed: 4, 3, 2, -1; of b unsigned: 4, 3, 2, 1.
    assert_eq!(o[1], 38, "dp4a.s32.u32");
    // halves of a unsigned: 3, 2; low bytes of b signed: 4, 3.
    assert_eq!(o[2], 18, "dp2a.lo.u32.s32");
    // Two packed-half atomic adds of {hi 2.0, lo 0.5} onto zero.
    assert_eq!(o[3], 0x4400_3C00, "atom.add.f16x2");
}

#[test]
fn min_max_order_signed_zeros_and_generic_param_loads_work() {
    let src = r#"
.version 9.0
.target sm_90
.address_size 64
.visible .entry k(
	.param .u64 .ptr .global .align 4 k_param_0,
	.param .align 4 .b8 k_param_1[12]
)
{
	.reg .b32 	%r<8>;
	.reg .b32 	%f<6>;
	.reg .b64 	%rd<6>;

	ld.param.u64 	%rd1, [k_param_0];
	cvta.to.global.u64 	%rd2, %rd1;
	min.f32 	%f1, 0f00000000, 0f80000000;
	max.f32 	%f2, 0f80000000, 0f00000000;
	min.f32 	%f3, 0f7FC00000, 0f40000000;
	st.global.v4.f32 	[%rd2], {%f1, %f2, %f3, %f3};
	mov.b64 	%rd3, k_param_1;
	cvta.param.u64 	%rd4, %rd3;
	ld.u32 	%r1, [%rd4+8];
	st.global.u32 	[%rd2+16], %r1;
	ret;
}
"#;
    let m = Module::parse(src).unwrap();
    let mut g = Gpu::new(&m);
    let out = g.upload(&[0u8; 20]);
    let k = m.kernel("k").unwrap();
    let mut params = vec![0u8; k.param_bytes()];
    params[..8].copy_from_slice(&out.to_le_bytes());
    params[16..20].copy_from_slice(&77u32.to_le_bytes());
    let cfg = gleam_ptx::LaunchConfig {
        grid: [1, 1, 1],
        block: [1, 1, 1],
        dynamic_shared_bytes: 0,
    };
    gleam_ptx::launch(&m, "k", &cfg, &params, &g.symbols, &g.mem).unwrap();
    let o = to_u32(&g.download(out, 20));
    assert_eq!(o[0], 0x8000_0000, "min(+0, -0) = -0");
    assert_eq!(o[1], 0, "max(-0, +0) = +0");
    assert_eq!(o[2], 2f32.to_bits(), "min(NaN, 2) = 2");
    assert_eq!(o[4], 77, "ld through cvta.param");
}

#[test]
fn intra_warp_spin_lock_makes_progress() {
    let m = Module::parse(&fixture("spinlock.ptx")).unwrap();
    let mut g = Gpu::new(&m);
    let lock = g.upload(&[0u8; 8]);
    g.launch(&m, "spinlock", [2, 1, 1], [64, 1, 1], 0, &[Arg::U64(lock)])
        .unwrap();
    let o = to_u32(&g.download(lock, 8));
    assert_eq!(
        o,
        vec![0, 128],
        "every thread took the lock once and released it"
    );
}

#[test]
fn barrier_reductions_counted_barriers_and_match() {
    let src = r#"
.version 9.0
.target sm_90
.address_size 64
.visible .entry k(
	.param .u64 .ptr .global .align 4 k_param_0
)
{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<12>;
	.reg .b64 	%rd<6>;

	ld.param.u64 	%rd1, [k_param_0];
	cvta.to.global.u64 	%rd2, %rd1;
	mov.u32 	%r1, %tid.x;
	mul.wide.u32 	%rd3, %r1, 16;
	add.s64 	%rd4, %rd2, %rd3;
	and.b32 	%r2, %r1, 3;
	setp.eq.s32 	%p1, %r2, 0;
	bar.red.popc.u32 	%r3, 0, %p1;
	setp.lt.u32 	%p2, %r1, 1000;
	bar.red.and.pred 	%p3, 0, %p2;
	selp.u32 	%r4, 1, 0, %p3;
	bar.red.or.pred 	%p3, 0, !%p2;
	selp.u32 	%r5, 1, 0, %p3;
	mov.u32 	%r6, 96;
	barrier.sync 	0, %r6;
	shr.u32 	%r7, %r1, 3;
	match.any.sync.b32 	%r8, %r7, -1;
	st.global.v4.u32 	[%rd4], {%r3, %r4, %r5, %r8};
	ret;
}
"#;
    let m = Module::parse(src).unwrap();
    let mut g = Gpu::new(&m);
    let out = g.upload(&[0u8; 96 * 16]);
    g.launch(&m, "k", [1, 1, 1], [96, 1, 1], 0, &[Arg::U64(out)])
        .unwrap();
    let o = to_u32(&g.download(out, 96 * 16));
    for t in 0..96usize {
        assert_eq!(o[t * 4], 24, "__syncthreads_count, thread {t}");
        assert_eq!(o[t * 4 + 1], 1, "__syncthreads_and, thread {t}");
        assert_eq!(o[t * 4 + 2], 0, "__syncthreads_or, thread {t}");
        let lane = t % 32;
        assert_eq!(
            o[t * 4 + 3],
            0xFFu32 << (lane / 8 * 8),
            "match.any, thread {t}"
        );
    }
    // A counted barrier that does not cover the block is refused, not mis-synchronized.
    let e = g
        .launch(&m, "k", [1, 1, 1], [128, 1, 1], 0, &[Arg::U64(out)])
        .unwrap_err();
    assert!(matches!(e, ExecError::Unsupported { .. }), "{e}");
}
