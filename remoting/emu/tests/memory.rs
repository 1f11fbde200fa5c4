//! Device memory through the backend: allocation, limits, copies, memsets and bad pointers.

mod common;

use common::Emu;
use gleam_emu::memory::VA_BASE;
use gleam_protocol::api::args;
use gleam_protocol::types::CUresult;
use gleam_server::backend::{ApiBackend, Backend};

#[test]
fn alloc_is_aligned_distinct_and_bounded_by_the_configured_size() {
    let mut emu = Emu::new(1 << 20);
    let a = emu.alloc(1000).unwrap();
    let b = emu.alloc(1).unwrap();
    assert!(a >= VA_BASE && b >= VA_BASE);
    assert_eq!((a % 256, b % 256), (0, 0));
    assert!(b >= a + 1000 || a > b, "allocations overlap");

    let info = emu
        .b
        .cuMemGetInfo_v2(args::cuMemGetInfo_v2 {
            free: (),
            total: (),
        })
        .unwrap();
    assert_eq!(info.total, 1 << 20);
    assert_eq!(info.free, (1 << 20) - 1024 - 256);

    // Beyond the device's memory: OUT_OF_MEMORY, and not sticky.
    assert_eq!(emu.alloc(1 << 20), Err(CUresult::OUT_OF_MEMORY));
    assert_eq!(emu.alloc(0), Err(CUresult::INVALID_VALUE));
    let c = emu.alloc(4096).unwrap();

    // Freed memory is reusable; a freed pointer is no longer valid.
    emu.free(a).unwrap();
    assert_eq!(emu.free(a), Err(CUresult::INVALID_VALUE));
    assert_eq!(emu.free(b + 4), Err(CUresult::INVALID_VALUE));
    emu.free(b).unwrap();
    emu.free(c).unwrap();
    let big = emu.alloc((1 << 20) - 256).unwrap();
    emu.free(big).unwrap();
    assert_eq!(emu.b.memory().live_allocations(), 0);
}

#[test]
fn copies_and_memsets_round_trip() {
    let mut emu = Emu::new(64 << 20);
    let n = 3 << 20; // several staging pieces
    let a = emu.alloc(n).unwrap();
    let b = emu.alloc(n).unwrap();
    let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    emu.b.memcpy_htod(a, &data, None).unwrap();
    emu.b
        .cuMemcpyDtoD_v2(args::cuMemcpyDtoD_v2 {
            dst: b,
            src: a,
            bytes: n,
        })
        .unwrap();
    assert_eq!(emu.b.memcpy_dtoh(b, n, None).unwrap(), data);

    // Overlapping device-to-device copy within one allocation behaves like memmove.
    emu.b
        .cuMemcpyDtoD_v2(args::cuMemcpyDtoD_v2 {
            dst: a + 1,
            src: a,
            bytes: n - 1,
        })
        .unwrap();
    let back = emu.b.memcpy_dtoh(a, n, None).unwrap();
    assert_eq!(back[0], data[0]);
    assert_eq!(&back[1..], &data[..n - 1]);

    emu.b
        .cuMemsetD8_v2(args::cuMemsetD8_v2 {
            dst: a + 3,
            value: 0xab,
            n: 5,
        })
        .unwrap();
    emu.b
        .cuMemsetD16_v2(args::cuMemsetD16_v2 {
            dst: a + 8,
            value: 0x1234,
            n: 2,
        })
        .unwrap();
    emu.b
        .cuMemsetD32_v2(args::cuMemsetD32_v2 {
            dst: a + 12,
            value: 0xdead_beef,
            n: 1,
        })
        .unwrap();
    let head = emu.b.memcpy_dtoh(a, 16, None).unwrap();
    assert_eq!(&head[3..8], &[0xab; 5]);
    assert_eq!(&head[8..12], &[0x34, 0x12, 0x34, 0x12]);
    assert_eq!(&head[12..16], &0xdead_beefu32.to_le_bytes());
    // Misaligned D16/D32 memsets are refused as the driver does.
    assert_eq!(
        emu.b
            .cuMemsetD32_v2(args::cuMemsetD32_v2 {
                dst: a + 2,
                value: 0,
                n: 1
            })
            .map(|_| ()),
        Err(CUresult::INVALID_VALUE)
    );

    // A memset spanning several staging pieces, ending exactly at the allocation's end.
    emu.b
        .cuMemsetD16_v2(args::cuMemsetD16_v2 {
            dst: b,
            value: 0xbeef,
            n: n / 2,
        })
        .unwrap();
    let all = emu.b.memcpy_dtoh(b, n, None).unwrap();
    assert!(all.chunks_exact(2).all(|c| c == [0xef, 0xbe]));

    // Async variants on a stream, then a stream-ordered read back.
    let s = emu.stream(0);
    emu.b
        .cuMemsetD32Async(args::cuMemsetD32Async {
            dst: b,
            value: 7,
            n: 4,
            stream: s,
        })
        .unwrap();
    emu.b.memcpy_htod(b + 16, &[1, 2, 3, 4], Some(s)).unwrap();
    let got = emu.download_u32(b, 5, Some(s)).unwrap();
    assert_eq!(got, vec![7, 7, 7, 7, u32::from_le_bytes([1, 2, 3, 4])]);
}

#[test]
fn invalid_pointers_and_ranges_are_invalid_value() {
    let mut emu = Emu::new(1 << 20);
    let a = emu.alloc(100).unwrap();
    assert_eq!(
        emu.b.memcpy_htod(a + 50, &[0; 51], None),
        Err(CUresult::INVALID_VALUE)
    );
    assert_eq!(
        emu.b.memcpy_dtoh(0x1234, 4, None),
        Err(CUresult::INVALID_VALUE)
    );
    assert_eq!(
        emu.b.memcpy_dtoh(a + 100, 1, None),
        Err(CUresult::INVALID_VALUE)
    );
    assert_eq!(
        emu.b
            .cuMemcpyDtoD_v2(args::cuMemcpyDtoD_v2 {
                dst: a,
                src: a + 1,
                bytes: 100
            })
            .map(|_| ()),
        Err(CUresult::INVALID_VALUE)
    );
    assert_eq!(
        emu.b
            .cuMemsetD8_v2(args::cuMemsetD8_v2 {
                dst: u64::MAX - 3,
                value: 1,
                n: 8
            })
            .map(|_| ()),
        Err(CUresult::INVALID_VALUE)
    );

    let range = emu
        .b
        .cuMemGetAddressRange_v2(args::cuMemGetAddressRange_v2 {
            base: (),
            size: (),
            dptr: a + 42,
        })
        .unwrap();
    assert_eq!((range.base, range.size), (a, 100));
    assert_eq!(
        emu.b
            .cuMemGetAddressRange_v2(args::cuMemGetAddressRange_v2 {
                base: (),
                size: (),
                dptr: 8
            })
            .map(|_| ()),
        Err(CUresult::NOT_FOUND)
    );
    // None of that was sticky.
    emu.free(a).unwrap();
}

#[test]
fn calls_without_a_current_context_fail() {
    let mut emu = Emu::new(1 << 20);
    emu.b.set_current_context(0).unwrap();
    assert_eq!(emu.alloc(16), Err(CUresult::INVALID_CONTEXT));
    assert_eq!(
        emu.b.set_current_context(0x1234),
        Err(CUresult::INVALID_CONTEXT)
    );
}

#[test]
fn contexts_own_their_memory() {
    let mut emu = Emu::new(1 << 20);
    let mine = emu.alloc(4096).unwrap();
    let ctx = emu
        .b
        .cuCtxCreate_v2(args::cuCtxCreate_v2 {
            pctx: (),
            flags: 0,
            dev: 0,
        })
        .unwrap()
        .pctx;
    assert!(ctx > 2);
    emu.b.set_current_context(ctx).unwrap();
    let theirs = emu.alloc(4096).unwrap();
    emu.b
        .cuCtxDestroy_v2(args::cuCtxDestroy_v2 { ctx })
        .unwrap();
    // The destroyed context's memory is gone; the primary context's is not.
    assert_eq!(emu.b.memory().address_range(theirs), None);
    assert!(emu.b.memory().address_range(mine).is_some());
    assert_eq!(
        emu.b
            .cuCtxDestroy_v2(args::cuCtxDestroy_v2 { ctx: emu.ctx })
            .map(|_| ()),
        Err(CUresult::INVALID_CONTEXT)
    );

    // Releasing the last reference to the primary context frees its resources too.
    emu.b.set_current_context(emu.ctx).unwrap();
    let state = emu
        .b
        .cuDevicePrimaryCtxGetState(args::cuDevicePrimaryCtxGetState {
            dev: 0,
            flags: (),
            active: (),
        })
        .unwrap();
    assert_eq!(state.active, 1);
    emu.b
        .cuDevicePrimaryCtxRelease_v2(args::cuDevicePrimaryCtxRelease_v2 { dev: 0 })
        .unwrap();
    assert_eq!(emu.b.memory().live_allocations(), 0);
    assert_eq!(
        emu.b
            .cuDevicePrimaryCtxRelease_v2(args::cuDevicePrimaryCtxRelease_v2 { dev: 0 })
            .map(|_| ()),
        Err(CUresult::INVALID_CONTEXT)
    );
}

#[test]
fn describe_reports_the_emulated_device() {
    let mut emu = Emu::new(2 << 30);
    let (driver, backend, devices) = emu.b.describe().unwrap();
    assert_eq!((driver, backend.as_str()), (13000, "emu"));
    assert_eq!(devices.len(), 1);
    let d = &devices[0];
    assert_eq!(d.name, "Gleam Emulator (PTX interpreter)");
    assert_eq!(d.total_mem, 2 << 30);
    assert_eq!(d.pci_bus_id, "0000:00:00.0");
    assert_eq!(d.attributes.len(), 144);
    assert_eq!(d.attributes[75] * 10 + d.attributes[76], 75);
    assert_eq!(d.attributes[10], 32);
    let again = emu.b.describe().unwrap().2;
    assert_eq!(again[0].uuid, d.uuid);
}
