//! Virtual memory management on the emu backend: reservations, physical allocations, mappings and their
//! access rights, as CUDA defines them.

mod common;

use common::{Emu, PTX, Params};
use gleam_protocol::api::args;
use gleam_protocol::types::{CUmemAccessDesc, CUmemAllocationProp, CUmemLocation, CUresult};
use gleam_server::backend::{ApiBackend, Backend};

const GRAN: u64 = 2 << 20;
const DEVICE0: CUmemLocation = CUmemLocation { kind: 1, id: 0 };

fn prop() -> CUmemAllocationProp {
    CUmemAllocationProp {
        kind: 1,
        location: DEVICE0,
        ..CUmemAllocationProp::default()
    }
}

impl Emu {
    fn reserve(&mut self, size: u64) -> Result<u64, CUresult> {
        self.b
            .cuMemAddressReserve(args::cuMemAddressReserve {
                ptr: (),
                size: size as usize,
                alignment: 0,
                addr: 0,
                flags: 0,
            })
            .map(|o| o.ptr)
    }

    fn create(&mut self, size: u64) -> Result<u64, CUresult> {
        self.b
            .cuMemCreate(args::cuMemCreate {
                handle: (),
                size: size as usize,
                prop: Box::new(prop()),
                flags: 0,
            })
            .map(|o| o.handle)
    }

    fn map(&mut self, ptr: u64, size: u64, offset: u64, handle: u64) -> Result<(), CUresult> {
        self.b
            .cuMemMap(args::cuMemMap {
                ptr,
                size: size as usize,
                offset: offset as usize,
                handle,
                flags: 0,
            })
            .map(|_| ())
    }

    fn unmap(&mut self, ptr: u64, size: u64) -> Result<(), CUresult> {
        self.b
            .cuMemUnmap(args::cuMemUnmap {
                ptr,
                size: size as usize,
            })
            .map(|_| ())
    }

    fn set_access(&mut self, ptr: u64, size: u64, flags: u32) -> Result<(), CUresult> {
        self.b
            .cuMemSetAccess(args::cuMemSetAccess {
                ptr,
                size: size as usize,
                desc: Box::new(CUmemAccessDesc {
                    location: DEVICE0,
                    flags,
                }),
                count: (),
            })
            .map(|_| ())
    }

    fn release(&mut self, handle: u64) -> Result<(), CUresult> {
        self.b
            .cuMemRelease(args::cuMemRelease { handle })
            .map(|_| ())
    }

    fn address_free(&mut self, ptr: u64, size: u64) -> Result<(), CUresult> {
        self.b
            .cuMemAddressFree(args::cuMemAddressFree {
                ptr,
                size: size as usize,
            })
            .map(|_| ())
    }

    fn used(&mut self) -> u64 {
        let info = self
            .b
            .cuMemGetInfo_v2(args::cuMemGetInfo_v2 {
                free: (),
                total: (),
            })
            .unwrap();
        (info.total - info.free) as u64
    }
}

#[test]
fn mappings_need_access_and_copies_span_adjacent_ones() {
    let mut emu = Emu::new(64 << 20);
    let va = emu.reserve(4 * GRAN).unwrap();
    assert_eq!(va % GRAN, 0);
    let (a, b) = (emu.create(GRAN).unwrap(), emu.create(GRAN).unwrap());
    emu.map(va, GRAN, 0, a).unwrap();
    emu.map(va + GRAN, GRAN, 0, b).unwrap();
    // Mapped but not accessible yet: copies are refused.
    assert_eq!(
        emu.b.memcpy_htod(va, &[1; 8], None),
        Err(CUresult::INVALID_VALUE)
    );
    // Read-only: reads work, writes do not.
    emu.set_access(va, 2 * GRAN, 1).unwrap();
    assert_eq!(emu.b.memcpy_dtoh(va, 8, None), Ok(vec![0; 8]));
    assert_eq!(
        emu.b.memcpy_htod(va, &[1; 8], None),
        Err(CUresult::INVALID_VALUE)
    );
    emu.set_access(va, 2 * GRAN, 3).unwrap();
    // One copy across the boundary of the two mappings.
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    let at = va + GRAN - 1000;
    emu.b.memcpy_htod(at, &data, None).unwrap();
    assert_eq!(emu.b.memcpy_dtoh(at, data.len(), None).unwrap(), data);
    // A kernel reading and writing across it too.
    let module = emu.load(PTX).unwrap();
    let add_one = emu.function(module, "addOne").unwrap().0;
    let n = 1024;
    let src = va + GRAN - 2048;
    let dst = va + 2 * GRAN - 4 * n as u64;
    emu.upload_u32(src, &(0..n as u32).collect::<Vec<_>>())
        .unwrap();
    emu.launch(add_one, 4, 256, 0, &Params::default().u64(src).u64(dst))
        .unwrap();
    assert_eq!(
        emu.download_u32(dst, n, Some(0)).unwrap(),
        (1..=n as u32).collect::<Vec<_>>()
    );
    // The range beyond the mappings is reserved, not mapped.
    assert_eq!(
        emu.b.memcpy_dtoh(va + 2 * GRAN, 8, None),
        Err(CUresult::INVALID_VALUE)
    );
}

#[test]
fn a_kernel_writing_a_read_only_mapping_faults() {
    let mut emu = Emu::new(64 << 20);
    let va = emu.reserve(GRAN).unwrap();
    let h = emu.create(GRAN).unwrap();
    emu.map(va, GRAN, 0, h).unwrap();
    emu.set_access(va, GRAN, 1).unwrap();
    let module = emu.load(PTX).unwrap();
    let add_one = emu.function(module, "addOne").unwrap().0;
    emu.launch(add_one, 1, 32, 0, &Params::default().u64(va).u64(va + 4096))
        .unwrap();
    assert_eq!(emu.sync(0), Err(CUresult::ILLEGAL_ADDRESS));
}

#[test]
fn mapping_rules_follow_cuda() {
    let mut emu = Emu::new(64 << 20);
    let va = emu.reserve(4 * GRAN).unwrap();
    let h = emu.create(2 * GRAN).unwrap();
    // Sizes and offsets are multiples of the granularity; sizes of physical allocations too.
    assert_eq!(emu.create(GRAN + 4096), Err(CUresult::INVALID_VALUE));
    assert_eq!(emu.map(va, GRAN + 4096, 0, h), Err(CUresult::INVALID_VALUE));
    assert_eq!(emu.map(va + 4096, GRAN, 0, h), Err(CUresult::INVALID_VALUE));
    // Not past the physical allocation, not outside a reservation, not over another mapping.
    assert_eq!(emu.map(va, GRAN, 2 * GRAN, h), Err(CUresult::INVALID_VALUE));
    assert_eq!(
        emu.map(va + 4 * GRAN, GRAN, 0, h),
        Err(CUresult::INVALID_VALUE)
    );
    emu.map(va, 2 * GRAN, 0, h).unwrap();
    assert_eq!(emu.map(va + GRAN, GRAN, 0, h), Err(CUresult::INVALID_VALUE));
    // The second half of the same allocation, mapped again further on: an alias.
    emu.map(va + 3 * GRAN, GRAN, GRAN, h).unwrap();
    emu.set_access(va, 2 * GRAN, 3).unwrap();
    emu.set_access(va + 3 * GRAN, GRAN, 3).unwrap();
    emu.b.memcpy_htod(va + GRAN + 8, b"alias!!!", None).unwrap();
    assert_eq!(
        emu.b.memcpy_dtoh(va + 3 * GRAN + 8, 8, None).unwrap(),
        b"alias!!!"
    );
    // Access is set on whole mappings, and a part of one cannot be unmapped.
    assert_eq!(
        emu.set_access(va, GRAN, 3),
        Err(CUresult::INVALID_VALUE),
        "half of a mapping"
    );
    assert_eq!(emu.unmap(va, GRAN), Err(CUresult::INVALID_VALUE));
    // cuMemFree is not for mappings.
    assert_eq!(emu.free(va), Err(CUresult::INVALID_VALUE));
    // A reservation with mappings left is not freed.
    assert_eq!(emu.address_free(va, 4 * GRAN), Err(CUresult::INVALID_VALUE));
    // Unmapping several whole mappings at once (with a hole between them is refused).
    assert_eq!(emu.unmap(va, 4 * GRAN), Err(CUresult::INVALID_VALUE));
    emu.unmap(va, 2 * GRAN).unwrap();
    emu.unmap(va + 3 * GRAN, GRAN).unwrap();
    emu.address_free(va, 4 * GRAN).unwrap();
    emu.release(h).unwrap();
    assert_eq!(emu.release(h), Err(CUresult::INVALID_VALUE));
}

#[test]
fn physical_memory_counts_until_released_and_unmapped() {
    let mut emu = Emu::new(16 << 20);
    let base = emu.used();
    let va = emu.reserve(8 * GRAN).unwrap();
    assert_eq!(emu.used(), base, "address space costs no memory");
    let h = emu.create(4 * GRAN).unwrap();
    assert_eq!(emu.used(), base + 4 * GRAN);
    // The device's capacity bounds physical memory.
    assert_eq!(emu.create(8 * GRAN), Err(CUresult::OUT_OF_MEMORY));
    emu.map(va, 4 * GRAN, 0, h).unwrap();
    emu.set_access(va, 4 * GRAN, 3).unwrap();
    emu.b.memcpy_htod(va, b"kept", None).unwrap();
    // Released while mapped: still there; retained from its address: the same handle.
    emu.release(h).unwrap();
    assert_eq!(emu.used(), base + 4 * GRAN);
    assert_eq!(emu.b.memcpy_dtoh(va, 4, None).unwrap(), b"kept");
    let again = emu
        .b
        .cuMemRetainAllocationHandle(args::cuMemRetainAllocationHandle {
            handle: (),
            addr: va + GRAN + 12,
        })
        .unwrap()
        .handle;
    assert_eq!(again, h);
    let props = emu
        .b
        .cuMemGetAllocationPropertiesFromHandle(args::cuMemGetAllocationPropertiesFromHandle {
            prop: (),
            handle: h,
        })
        .unwrap()
        .prop;
    assert_eq!(props, prop());
    emu.release(h).unwrap();
    emu.unmap(va, 4 * GRAN).unwrap();
    assert_eq!(emu.used(), base, "released and unmapped: gone");
    emu.address_free(va, 8 * GRAN).unwrap();
}

#[test]
fn granularity_and_properties_are_checked() {
    let mut emu = Emu::new(16 << 20);
    let g = emu
        .b
        .cuMemGetAllocationGranularity(args::cuMemGetAllocationGranularity {
            granularity: (),
            prop: Box::new(prop()),
            option: 1,
        })
        .unwrap()
        .granularity;
    assert_eq!(g as u64, GRAN);
    let on_device_3 = CUmemAllocationProp {
        location: CUmemLocation { kind: 1, id: 3 },
        ..prop()
    };
    assert_eq!(
        emu.b
            .cuMemCreate(args::cuMemCreate {
                handle: (),
                size: GRAN as usize,
                prop: Box::new(on_device_3),
                flags: 0,
            })
            .map(|o| o.handle),
        Err(CUresult::INVALID_DEVICE)
    );
    // Reservations at a free hint are placed there.
    let va = emu.reserve(GRAN).unwrap();
    emu.address_free(va, GRAN).unwrap();
    let at = emu
        .b
        .cuMemAddressReserve(args::cuMemAddressReserve {
            ptr: (),
            size: GRAN as usize,
            alignment: 0,
            addr: va,
            flags: 0,
        })
        .unwrap()
        .ptr;
    assert_eq!(at, va);
}
