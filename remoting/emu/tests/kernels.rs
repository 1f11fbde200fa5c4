//! Modules and launches: a PTX vector add, module globals and atomics, launch validation, and a faulting
//! kernel leaving the sticky CUDA_ERROR_ILLEGAL_ADDRESS behind.

mod common;

use common::{Emu, PTX, Params};
use gleam_protocol::api::args;
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{Launch, ParamSlot};
use gleam_server::backend::{ApiBackend, Backend};

#[test]
fn vector_add_runs_and_reports_its_layout() {
    let mut emu = Emu::new(64 << 20);
    // A NUL-terminated image, as cuModuleLoadData gets it.
    let mut image = PTX.as_bytes().to_vec();
    image.push(0);
    let module = emu.b.module_load(&image).unwrap();
    let (f, info) = emu.function(module, "vecAdd").unwrap();
    assert_eq!(
        info.params,
        vec![
            ParamSlot { offset: 0, size: 8 },
            ParamSlot { offset: 8, size: 8 },
            ParamSlot {
                offset: 16,
                size: 8
            },
            ParamSlot {
                offset: 24,
                size: 4
            },
        ]
    );
    assert_eq!(info.attributes[0], 1024); // MAX_THREADS_PER_BLOCK
    assert_eq!(info.attributes[5], 80); // PTX_VERSION
    assert_eq!(info.attributes[6], 75); // BINARY_VERSION
    // The same name gives the same handle.
    assert_eq!(emu.function(module, "vecAdd").unwrap().0, f);
    assert_eq!(
        emu.function(module, "nope").map(|_| ()),
        Err(CUresult::NOT_FOUND)
    );

    let n = 1000usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let y: Vec<f32> = (0..n).map(|i| 1000.0 - i as f32).collect();
    let bytes = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let (dx, dy, dz) = (
        emu.alloc(n * 4).unwrap(),
        emu.alloc(n * 4).unwrap(),
        emu.alloc(n * 4).unwrap(),
    );
    emu.b.memcpy_htod(dx, &bytes(&x), None).unwrap();
    emu.b.memcpy_htod(dy, &bytes(&y), None).unwrap();
    let p = Params::default().u64(dx).u64(dy).u64(dz).u32(n as u32);
    emu.launch(f, n.div_ceil(256) as u32, 256, 0, &p).unwrap();
    let out = emu.b.memcpy_dtoh(dz, n * 4, None).unwrap();
    for (i, c) in out.chunks_exact(4).enumerate() {
        let z = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        assert_eq!(z, x[i] + y[i], "element {i}");
    }
    emu.b
        .cuModuleUnload(args::cuModuleUnload { module })
        .unwrap();
    assert_eq!(
        emu.function(module, "vecAdd").map(|_| ()),
        Err(CUresult::INVALID_HANDLE)
    );
}

#[test]
fn module_globals_are_initialised_and_atomics_add_up() {
    let mut emu = Emu::new(64 << 20);
    let module = emu.load(PTX).unwrap();
    let g = emu
        .b
        .cuModuleGetGlobal_v2(args::cuModuleGetGlobal_v2 {
            dptr: true,
            bytes: true,
            module,
            name: "counter".into(),
        })
        .unwrap();
    assert_eq!(g.bytes, 4);
    assert_eq!(emu.download_u32(g.dptr, 1, None).unwrap(), vec![5]);
    let (f, _) = emu.function(module, "bumpCounter").unwrap();
    // 16 blocks of 128 threads, each adding 3 atomically, on several OS threads at once.
    emu.launch(f, 16, 128, 0, &Params::default().u32(3))
        .unwrap();
    assert_eq!(
        emu.download_u32(g.dptr, 1, None).unwrap(),
        vec![5 + 16 * 128 * 3]
    );
    assert_eq!(
        emu.b
            .cuModuleGetGlobal_v2(args::cuModuleGetGlobal_v2 {
                dptr: true,
                bytes: true,
                module,
                name: "missing".into(),
            })
            .map(|_| ()),
        Err(CUresult::NOT_FOUND)
    );
}

#[test]
fn launches_are_validated_before_they_are_queued() {
    let mut emu = Emu::new(1 << 20);
    let module = emu.load(PTX).unwrap();
    let (f, _) = emu.function(module, "poke").unwrap();
    let p = Params::default().u64(0);
    let launch =
        |grid: [u32; 3], block: [u32; 3], shared: u32, params: Vec<u8>, function: u64| Launch {
            function,
            grid,
            block,
            shared_mem_bytes: shared,
            stream: 0,
            params,
        };
    let cases = [
        (
            launch([1, 1, 1], [1025, 1, 1], 0, p.0.clone(), f),
            CUresult::INVALID_VALUE,
        ),
        (
            launch([1, 1, 1], [32, 32, 2], 0, p.0.clone(), f),
            CUresult::INVALID_VALUE,
        ),
        (
            launch([1, 1, 1], [1, 1, 65], 0, p.0.clone(), f),
            CUresult::INVALID_VALUE,
        ),
        (
            launch([0, 1, 1], [1, 1, 1], 0, p.0.clone(), f),
            CUresult::INVALID_VALUE,
        ),
        (
            launch([1, 65536, 1], [1, 1, 1], 0, p.0.clone(), f),
            CUresult::INVALID_VALUE,
        ),
        (
            launch([1, 1, 1], [1, 1, 1], 64 << 10, p.0.clone(), f),
            CUresult::INVALID_VALUE,
        ),
        (
            launch([1, 1, 1], [1, 1, 1], 0, vec![0; 4], f),
            CUresult::INVALID_VALUE,
        ),
        (
            launch([1, 1, 1], [1, 1, 1], 0, p.0.clone(), 0xdead),
            CUresult::INVALID_HANDLE,
        ),
    ];
    for (l, want) in cases {
        assert_eq!(emu.b.launch(&l), Err(want), "{l:?}");
    }
    let mut bad_stream = launch([1, 1, 1], [1, 1, 1], 0, p.0.clone(), f);
    bad_stream.stream = 0x5555;
    assert_eq!(emu.b.launch(&bad_stream), Err(CUresult::INVALID_HANDLE));

    // Raising the dynamic shared memory limit lets a bigger launch through validation.
    emu.b
        .cuFuncSetAttribute(args::cuFuncSetAttribute {
            func: f,
            attrib: 8,
            value: 60 << 10,
        })
        .unwrap();
    let got = emu
        .b
        .cuFuncGetAttribute(args::cuFuncGetAttribute {
            value: (),
            attrib: 8,
            func: f,
        })
        .unwrap();
    assert_eq!(got.value, 60 << 10);
    assert_eq!(
        emu.b
            .cuFuncSetAttribute(args::cuFuncSetAttribute {
                func: f,
                attrib: 8,
                value: 1 << 20
            })
            .map(|_| ()),
        Err(CUresult::INVALID_VALUE)
    );
    let occupancy = emu
        .b
        .cuOccupancyMaxActiveBlocksPerMultiprocessor(
            args::cuOccupancyMaxActiveBlocksPerMultiprocessor {
                num_blocks: (),
                func: f,
                block_size: 256,
                dynamic_smem: 0,
            },
        )
        .unwrap();
    assert!((1..=16).contains(&occupancy.num_blocks));
    // None of those errors was sticky.
    assert!(emu.alloc(16).is_ok());
}

#[test]
fn a_faulting_kernel_leaves_a_sticky_illegal_address() {
    let mut emu = Emu::new(1 << 20);
    let module = emu.load(PTX).unwrap();
    let (f, _) = emu.function(module, "poke").unwrap();
    let good = emu.alloc(64).unwrap();
    // Queued fine: the pointer is only dereferenced on the device.
    emu.launch(f, 1, 1, 0, &Params::default().u64(0x10))
        .unwrap();
    assert_eq!(
        emu.b
            .cuCtxSynchronize(args::cuCtxSynchronize {})
            .map(|_| ()),
        Err(CUresult::ILLEGAL_ADDRESS)
    );
    assert_eq!(emu.b.sticky_error(), Some(CUresult::ILLEGAL_ADDRESS));
    // Every later call returns it, forever.
    assert_eq!(emu.alloc(16), Err(CUresult::ILLEGAL_ADDRESS));
    assert_eq!(
        emu.b.memcpy_dtoh(good, 4, None),
        Err(CUresult::ILLEGAL_ADDRESS)
    );
    assert_eq!(
        emu.launch(f, 1, 1, 0, &Params::default().u64(good)),
        Err(CUresult::ILLEGAL_ADDRESS)
    );
    assert_eq!(emu.sync(0), Err(CUresult::ILLEGAL_ADDRESS));
    emu.b.shutdown(&Default::default());
}

#[test]
fn images_without_ptx_are_refused_clearly() {
    let mut emu = Emu::new(1 << 20);
    assert_eq!(
        emu.b.module_load(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0"),
        Err(CUresult::NO_BINARY_FOR_GPU)
    );
    assert_eq!(emu.b.module_load(b""), Err(CUresult::INVALID_IMAGE));
    assert_eq!(
        emu.b
            .module_load(b".version 8.0\n.target sm_75\n.entry broken( {"),
        Err(CUresult::INVALID_PTX)
    );
    // A fatbin holding the PTX (as nvcc embeds it) loads and runs.
    let mut ptx = PTX.as_bytes().to_vec();
    ptx.push(0);
    let fatbin = gleam_fatbin::synth::fatbin(&[
        gleam_fatbin::synth::Entry {
            kind: 2,
            sm_arch: 75,
            flags: 0,
            payload: b"\x7fELF....",
        },
        gleam_fatbin::synth::Entry {
            kind: 1,
            sm_arch: 75,
            flags: 0,
            payload: &ptx,
        },
    ]);
    let module = emu.b.module_load(&fatbin).unwrap();
    assert!(emu.function(module, "vecAdd").is_ok());
}

#[test]
fn libraries_expose_kernels_as_functions() {
    let mut emu = Emu::new(1 << 20);
    let library = emu.b.library_load(PTX.as_bytes()).unwrap();
    let kernel = emu
        .b
        .cuLibraryGetKernel(args::cuLibraryGetKernel {
            kernel: (),
            library,
            name: "addOne".into(),
        })
        .unwrap()
        .kernel;
    let (f, info) = emu.b.kernel_get_function(kernel).unwrap();
    assert_eq!(info.params.len(), 2);
    let a = emu.alloc(4 * 32).unwrap();
    let b = emu.alloc(4 * 32).unwrap();
    emu.upload_u32(a, &(0..32).collect::<Vec<_>>()).unwrap();
    emu.launch(f, 1, 32, 0, &Params::default().u64(a).u64(b))
        .unwrap();
    assert_eq!(
        emu.download_u32(b, 32, None).unwrap(),
        (1..33).collect::<Vec<_>>()
    );
    emu.b
        .cuLibraryUnload(args::cuLibraryUnload { library })
        .unwrap();
    assert_eq!(
        emu.b.kernel_get_function(kernel).map(|_| ()),
        Err(CUresult::INVALID_HANDLE)
    );
}

#[test]
fn modules_beyond_the_device_limits_are_refused() {
    let mut emu = Emu::new(1 << 20);
    let big_shared = r#"
.version 8.0
.target sm_75
.address_size 64

.visible .entry hog()
{
	.reg .b32 	%r<2>;
	// 100000 bytes of static shared memory: more than the 48 KiB ptxas allows.
	.shared .align 4 .b8 hog_buf[100000];

	mov.u32 	%r1, 0;
	st.shared.u32 	[hog_buf], %r1;
	ret;

}
"#;
    assert_eq!(emu.load(big_shared), Err(CUresult::INVALID_PTX));
    // A global larger than the device's memory: out of memory, and nothing leaks.
    let big_global = ".version 8.0\n.target sm_75\n.address_size 64\n\n.global .align 4 .b8 small[16];\n.global .align 4 .b8 huge[4000000];\n";
    assert_eq!(emu.load(big_global), Err(CUresult::OUT_OF_MEMORY));
    assert_eq!(emu.b.memory().live_allocations(), 0);
    assert!(emu.alloc(1024).is_ok());
}

const ODD_PTX: &str = r#"
.version 8.0
.target sm_75
.address_size 64

.visible .entry trapper()
{
	trap;
	ret;

}
.visible .entry exotic()
{
	.reg .b32 	%r<3>;

	mov.u32 	%r1, 1;
	frobnicate.u32 	%r2, %r1;
	ret;

}
"#;

#[test]
fn a_trap_is_a_sticky_launch_failure() {
    let mut emu = Emu::new(1 << 20);
    let module = emu.load(ODD_PTX).unwrap();
    let (f, _) = emu.function(module, "trapper").unwrap();
    emu.launch(f, 1, 32, 0, &Params::default()).unwrap();
    assert_eq!(emu.sync(0), Err(CUresult::LAUNCH_FAILED));
    assert_eq!(emu.alloc(16), Err(CUresult::LAUNCH_FAILED));
}

#[test]
fn an_unsupported_instruction_fails_the_launch_instead_of_computing_garbage() {
    let mut emu = Emu::new(1 << 20);
    // The module loads (the instruction is only reported when the kernel runs, as a JIT failure would be).
    let module = emu.load(ODD_PTX).unwrap();
    let (f, _) = emu.function(module, "exotic").unwrap();
    emu.launch(f, 1, 1, 0, &Params::default()).unwrap();
    assert_eq!(emu.sync(0), Err(CUresult::LAUNCH_FAILED));
    assert_eq!(emu.b.sticky_error(), Some(CUresult::LAUNCH_FAILED));
}
