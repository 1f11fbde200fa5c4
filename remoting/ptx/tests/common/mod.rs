//! Helpers shared by the integration tests: buffers in a `FlatMemory` and parameter packing.
#![allow(dead_code)]

pub mod case;

use std::collections::HashMap;

use gleam_ptx::{
    ExecError, FlatMemory, GlobalMemory, LaunchConfig, LaunchStats, Module, StateSpace,
};

pub fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A scalar or pointer kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    U32(u32),
    U64(u64),
    F32(f32),
}

/// Packs `args` at the offsets the kernel declares.
pub fn pack(module: &Module, kernel: &str, args: &[Arg]) -> Vec<u8> {
    let k = module.kernel(kernel).expect("kernel");
    assert_eq!(k.params().len(), args.len(), "argument count");
    let mut buf = vec![0u8; k.param_bytes()];
    for (p, a) in k.params().iter().zip(args) {
        let bytes: Vec<u8> = match a {
            Arg::U32(v) => v.to_le_bytes().to_vec(),
            Arg::U64(v) => v.to_le_bytes().to_vec(),
            Arg::F32(v) => v.to_le_bytes().to_vec(),
        };
        assert_eq!(bytes.len(), p.size, "size of {}", p.name);
        buf[p.offset..p.offset + p.size].copy_from_slice(&bytes);
    }
    buf
}

pub struct Gpu {
    pub mem: FlatMemory,
    pub symbols: HashMap<String, u64>,
}

impl Gpu {
    pub fn new(module: &Module) -> Gpu {
        let mut mem = FlatMemory::new(64 << 20);
        let mut symbols = HashMap::new();
        for g in module.globals() {
            let a = mem.alloc(g.size).expect("arena");
            mem.write(a, &g.init).expect("init");
            assert!(matches!(g.space, StateSpace::Global | StateSpace::Const));
            symbols.insert(g.name.clone(), a);
        }
        Gpu { mem, symbols }
    }

    pub fn upload(&mut self, data: &[u8]) -> u64 {
        let a = self.mem.alloc(data.len().max(1)).expect("arena");
        self.mem.write(a, data).expect("upload");
        a
    }

    pub fn download(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read(addr, &mut v).expect("download");
        v
    }

    pub fn launch(
        &self,
        module: &Module,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        args: &[Arg],
    ) -> Result<LaunchStats, ExecError> {
        let params = pack(module, kernel, args);
        let cfg = LaunchConfig {
            grid,
            block,
            dynamic_shared_bytes: shared,
        };
        gleam_ptx::launch(module, kernel, &cfg, &params, &self.symbols, &self.mem)
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn to_u32(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
