//! The project's example kernels, as nvcc 13 compiled them (`examples/kernels/*.ptx`), run on the emu
//! backend and checked against CPU references computed the same way (fused multiply-add where the
//! kernels use `fmaf`, wrapping sums where they use `atomicAdd`).

mod common;

use common::{Emu, Params};
use gleam_protocol::api::args;
use gleam_protocol::wire::Launch;
use gleam_server::backend::{ApiBackend, Backend};

fn example(name: &str) -> String {
    let path = format!(
        "{}/../../examples/kernels/{name}.ptx",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn params_f32(p: Params, v: f32) -> Params {
    p.u32(v.to_bits())
}

#[test]
fn vector_add() {
    let mut emu = Emu::new(64 << 20);
    let module = emu.load(&example("vector_add")).unwrap();
    let (f, info) = emu.function(module, "vector_add").unwrap();
    assert_eq!(info.params_bytes(), 28);
    let n = 3000usize;
    let a: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
    let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.25).cos()).collect();
    let (da, db, dc) = (
        emu.alloc(n * 4).unwrap(),
        emu.alloc(n * 4).unwrap(),
        emu.alloc(n * 4).unwrap(),
    );
    emu.b.memcpy_htod(da, &f32s(&a), None).unwrap();
    emu.b.memcpy_htod(db, &f32s(&b), None).unwrap();
    let p = Params::default().u64(da).u64(db).u64(dc).u32(n as u32);
    emu.launch(f, n.div_ceil(128) as u32, 128, 0, &p).unwrap();
    let c = to_f32s(&emu.b.memcpy_dtoh(dc, n * 4, None).unwrap());
    for i in 0..n {
        assert_eq!(c[i].to_bits(), (a[i] + b[i]).to_bits(), "element {i}");
    }
}

#[test]
fn reduce_sum() {
    let mut emu = Emu::new(64 << 20);
    let module = emu.load(&example("reduce")).unwrap();
    let (f, info) = emu.function(module, "reduce_sum").unwrap();
    assert!(
        info.attributes[1] >= 128,
        "static shared bytes {:?}",
        info.attributes
    );
    let n = 100_000usize;
    let input: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let din = emu.alloc(n * 4).unwrap();
    let dout = emu.alloc(4).unwrap();
    emu.upload_u32(din, &input).unwrap();
    emu.upload_u32(dout, &[0]).unwrap();
    emu.launch(
        f,
        32,
        256,
        0,
        &Params::default().u64(din).u64(dout).u32(n as u32),
    )
    .unwrap();
    let want = input.iter().fold(0u32, |s, &v| s.wrapping_add(v));
    assert_eq!(emu.download_u32(dout, 1, None).unwrap(), vec![want]);
}

#[test]
fn matmul() {
    let mut emu = Emu::new(64 << 20);
    let module = emu.load(&example("matmul")).unwrap();
    let (f, _) = emu.function(module, "matmul").unwrap();
    let n = 40usize; // not a multiple of the 16x16 tile
    let a: Vec<f32> = (0..n * n)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.125)
        .collect();
    let b: Vec<f32> = (0..n * n)
        .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.5)
        .collect();
    let bytes = n * n * 4;
    let (da, db, dc) = (
        emu.alloc(bytes).unwrap(),
        emu.alloc(bytes).unwrap(),
        emu.alloc(bytes).unwrap(),
    );
    emu.b.memcpy_htod(da, &f32s(&a), None).unwrap();
    emu.b.memcpy_htod(db, &f32s(&b), None).unwrap();
    let tiles = n.div_ceil(16) as u32;
    emu.b
        .launch(&Launch {
            function: f,
            grid: [tiles, tiles, 1],
            block: [16, 16, 1],
            shared_mem_bytes: 0,
            stream: 0,
            params: Params::default().u64(da).u64(db).u64(dc).u32(n as u32).0,
        })
        .unwrap();
    let c = to_f32s(&emu.b.memcpy_dtoh(dc, bytes, None).unwrap());
    for row in 0..n {
        for col in 0..n {
            let mut acc = 0f32;
            for k in 0..n {
                acc = a[row * n + k].mul_add(b[k * n + col], acc);
            }
            assert_eq!(c[row * n + col].to_bits(), acc.to_bits(), "C[{row}][{col}]");
        }
    }
}

#[test]
fn streams_scale_add_then_saxpy() {
    let mut emu = Emu::new(64 << 20);
    let module = emu.load(&example("streams")).unwrap();
    let (scale_add, _) = emu.function(module, "scale_add").unwrap();
    let (saxpy, _) = emu.function(module, "saxpy").unwrap();
    let n = 4096usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32 / 64.0).collect();
    let (dx, dy) = (emu.alloc(n * 4).unwrap(), emu.alloc(n * 4).unwrap());
    let s1 = emu.stream(1);
    let s2 = emu.stream(1);
    let ready = emu.event(0);
    emu.b.memcpy_htod(dx, &f32s(&x), Some(s1)).unwrap();
    let p = params_f32(params_f32(Params::default().u64(dx).u64(dy), 3.0), 0.5).u32(n as u32);
    emu.launch(scale_add, (n / 256) as u32, 256, s1, &p)
        .unwrap();
    emu.record(ready, s1).unwrap();
    emu.b
        .cuStreamWaitEvent(args::cuStreamWaitEvent {
            stream: s2,
            event: ready,
            flags: 0,
        })
        .unwrap();
    let p = params_f32(Params::default(), 2.0)
        .u64(dx)
        .u64(dy)
        .u32(n as u32);
    emu.launch(saxpy, (n / 256) as u32, 256, s2, &p).unwrap();
    let y = to_f32s(&emu.b.memcpy_dtoh(dy, n * 4, Some(s2)).unwrap());
    for i in 0..n {
        let want = 2f32.mul_add(x[i], 3f32.mul_add(x[i], 0.5));
        assert_eq!(y[i].to_bits(), want.to_bits(), "y[{i}]");
    }
}
