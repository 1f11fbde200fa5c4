//! Fatbins built by nvcc 13.0 (tests/fixtures/make.sh): parsed, decompressed and selected from.

use gleam_fatbin::{
    ArchVariant, Compression, ComputeCapability, EntryKind, Fatbin, ImageError, image_size_in,
};

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// (kind, sm_arch, variant, compression) of every entry.
fn summary(fatbin: &Fatbin<'_>) -> Vec<(EntryKind, u32, ArchVariant, Compression)> {
    fatbin
        .entries
        .iter()
        .map(|e| (e.kind, e.sm_arch, e.arch().variant, e.compression()))
        .collect()
}

fn ptx_text(bytes: &[u8]) -> &str {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    std::str::from_utf8(&bytes[..end]).unwrap()
}

const BUDGET: usize = 1 << 20;
const H200: ComputeCapability = ComputeCapability::new(9, 0);

#[test]
fn multi_arch_fatbin_lists_every_entry() {
    let bytes = fixture("multi_arch.fatbin");
    assert_eq!(image_size_in(&bytes).unwrap(), bytes.len());
    let fatbin = Fatbin::parse(&bytes).unwrap();
    use ArchVariant::*;
    use Compression::*;
    use EntryKind::*;
    assert_eq!(
        summary(&fatbin),
        vec![
            (Elf, 75, Generic, None),
            (Elf, 86, Generic, None),
            (Ptx, 80, Generic, Zstd),
            (Ptx, 90, Generic, Zstd),
            (Elf, 90, Generic, None),
            (Elf, 90, ArchSpecific, None),
        ]
    );
    // Every ELF entry is a whole cubin, sized exactly by the ELF sizer.
    for e in fatbin.entries.iter().filter(|e| e.kind == Elf) {
        assert!(e.payload.starts_with(b"\x7fELF"));
        assert!(image_size_in(e.payload).unwrap() <= e.payload.len());
    }
    // PTX entries: the PTX ISA version is recorded (9.0 for nvcc 13.0) and the text says its target.
    let ptx90 = &fatbin.entries[3];
    assert_eq!(ptx90.version, (9, 0));
    let text = ptx90.decompressed(BUDGET).unwrap();
    assert_eq!(text.len() as u64, ptx90.uncompressed_size);
    assert!(
        ptx_text(&text).contains(".target sm_90"),
        "{}",
        ptx_text(&text)
    );
}

#[test]
fn selection_follows_cuda_compatibility() {
    let bytes = fixture("multi_arch.fatbin");
    let fatbin = Fatbin::parse(&bytes).unwrap();
    let pick = |major, minor| {
        fatbin
            .select(ComputeCapability::new(major, minor))
            .map(|s| (s.index, s.entry.kind, s.entry.arch().to_string()))
    };
    // H200 (9.0): both sm_90 and sm_90a cubins fit; the arch-specific one is preferred.
    assert_eq!(pick(9, 0), Some((5, EntryKind::Elf, "sm_90a".into())));
    // 8.9 (Ada): sm_86 runs there (same major, lower minor); 8.0 (A100): no cubin for 8.0, PTX compute_80.
    assert_eq!(pick(8, 9), Some((1, EntryKind::Elf, "sm_86".into())));
    assert_eq!(pick(8, 0), Some((2, EntryKind::Ptx, "sm_80".into())));
    // 7.5 exactly: its cubin. 12.0 (Blackwell consumer): no cubin; the highest PTX (compute_90) by JIT.
    assert_eq!(pick(7, 5), Some((0, EntryKind::Elf, "sm_75".into())));
    assert_eq!(pick(12, 0), Some((3, EntryKind::Ptx, "sm_90".into())));
    // 7.0 (Volta): nothing at or below it.
    assert_eq!(pick(7, 0), None);
    assert_eq!(fatbin.runnable(H200), vec![2, 3, 4, 5]);
}

#[test]
fn arch_and_family_specific_entries_stay_on_their_targets() {
    let bytes = fixture("family.fatbin");
    let fatbin = Fatbin::parse(&bytes).unwrap();
    use ArchVariant::*;
    assert_eq!(
        summary(&fatbin)
            .iter()
            .map(|s| (s.0, s.1, s.2))
            .collect::<Vec<_>>(),
        vec![
            (EntryKind::Elf, 100, ArchSpecific),
            (EntryKind::Ptx, 100, FamilySpecific),
            (EntryKind::Elf, 120, Generic),
            (EntryKind::Ptx, 90, ArchSpecific),
        ]
    );
    let pick = |major, minor| {
        fatbin
            .select(ComputeCapability::new(major, minor))
            .map(|s| s.index)
    };
    assert_eq!(pick(10, 0), Some(0)); // sm_100a on exactly 10.0
    assert_eq!(pick(10, 3), Some(1)); // not sm_100a; compute_100f within the family
    assert_eq!(pick(12, 0), Some(2));
    assert_eq!(pick(9, 0), Some(3)); // compute_90a PTX on exactly 9.0
    assert_eq!(pick(12, 1), Some(2)); // sm_120 runs on 12.1
    assert_eq!(pick(11, 0), None); // neither compute_90a nor compute_100f PTX crosses majors
}

#[test]
fn lz4_and_zstd_entries_decompress_to_their_claimed_sizes() {
    for (name, codec) in [
        ("lz4_speed.fatbin", Compression::Lz4),
        ("zstd_size.fatbin", Compression::Zstd),
    ] {
        let bytes = fixture(name);
        let fatbin = Fatbin::parse(&bytes).unwrap();
        assert_eq!(fatbin.entries.len(), 2, "{name}");
        for e in &fatbin.entries {
            assert_eq!(e.compression(), codec, "{name}");
            let out = e.decompressed(BUDGET).unwrap();
            assert_eq!(out.len() as u64, e.uncompressed_size, "{name}");
            match e.kind {
                EntryKind::Elf => {
                    assert!(out.starts_with(b"\x7fELF"), "{name}");
                    assert_eq!(image_size_in(&out).unwrap(), out.len(), "{name}");
                }
                EntryKind::Ptx => assert!(ptx_text(&out).contains(".entry add_one"), "{name}"),
                EntryKind::Other(k) => panic!("{name}: kind {k}"),
            }
        }
        // Both codecs carry the same cubin and PTX.
        let first = fatbin.entries[0].decompressed(BUDGET).unwrap();
        assert_eq!(first.len(), 4456, "{name}");
    }
    let lz4 = fixture("lz4_speed.fatbin");
    let zstd = fixture("zstd_size.fatbin");
    let (a, b) = (Fatbin::parse(&lz4).unwrap(), Fatbin::parse(&zstd).unwrap());
    for i in 0..2 {
        assert_eq!(
            a.entries[i].decompressed(BUDGET).unwrap(),
            b.entries[i].decompressed(BUDGET).unwrap()
        );
    }
}

#[test]
fn default_and_plain_ptx_agree() {
    let compressed = fixture("ptx75_default.fatbin");
    let plain = fixture("ptx75_plain.fatbin");
    let (c, p) = (
        Fatbin::parse(&compressed).unwrap(),
        Fatbin::parse(&plain).unwrap(),
    );
    assert_eq!(c.entries[0].compression(), Compression::Zstd);
    assert_eq!(p.entries[0].compression(), Compression::None);
    let from_zstd = c.entries[0].decompressed(BUDGET).unwrap();
    assert_eq!(
        ptx_text(&from_zstd),
        p.entries[0].ptx_text().unwrap(),
        "the same PTX either way"
    );
    assert_eq!(
        c.select(ComputeCapability::new(9, 0)).unwrap().index,
        0,
        "compute_75 PTX runs on 9.0"
    );
}

#[test]
fn budget_is_enforced_before_allocating() {
    let bytes = fixture("zstd_size.fatbin");
    let fatbin = Fatbin::parse(&bytes).unwrap();
    let elf = &fatbin.entries[0];
    assert!(matches!(
        elf.decompressed(1000),
        Err(ImageError::OverBudget {
            needed: 4456,
            budget: 1000
        })
    ));
    // An entry that lies about its size (claims less than it inflates to) fails, within the budget.
    let mut lying = bytes.clone();
    let at = 16 + 56; // first entry's uncompressed_size
    lying[at..at + 8].copy_from_slice(&100u64.to_le_bytes());
    let fatbin = Fatbin::parse(&lying).unwrap();
    assert!(fatbin.entries[0].decompressed(BUDGET).is_err());
    // Unknown size (0): the budget bounds the output.
    lying[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
    let fatbin = Fatbin::parse(&lying).unwrap();
    assert!(matches!(
        fatbin.entries[0].decompressed(4000),
        Err(ImageError::OverBudget { .. })
    ));
    assert_eq!(fatbin.entries[0].decompressed(5000).unwrap().len(), 4456);
}

#[test]
fn rebuild_keeps_only_the_chosen_entries() {
    let bytes = fixture("multi_arch.fatbin");
    let fatbin = Fatbin::parse(&bytes).unwrap();
    let chosen = fatbin.select(H200).unwrap().index;
    let stripped = fatbin.rebuild(&[chosen, 3]);
    assert!(stripped.len() < bytes.len() / 2);
    assert_eq!(image_size_in(&stripped).unwrap(), stripped.len());
    let again = Fatbin::parse(&stripped).unwrap();
    assert_eq!(again.entries.len(), 2);
    assert_eq!(again.entries[0].arch().to_string(), "sm_90a");
    assert_eq!(again.entries[0].payload, fatbin.entries[chosen].payload);
    assert_eq!(
        again.entries[1].decompressed(BUDGET).unwrap(),
        fatbin.entries[3].decompressed(BUDGET).unwrap()
    );
}

#[test]
fn corrupted_real_fatbins_never_panic() {
    let mut seed = 0x9e37_79b9u32;
    for name in ["multi_arch.fatbin", "lz4_speed.fatbin", "zstd_size.fatbin"] {
        let original = fixture(name);
        for _ in 0..300 {
            let mut bytes = original.clone();
            for _ in 0..8 {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let at = 4 + (seed as usize >> 8) % (bytes.len() - 4);
                bytes[at] = (seed >> 3) as u8;
            }
            if let Ok(fatbin) = Fatbin::parse(&bytes) {
                for e in &fatbin.entries {
                    let _ = e.decompressed(64 << 10);
                }
                let _ = fatbin.select(H200);
            }
        }
    }
}

/// An `-rdc` program: its wrapper (version 2) holds an empty fatbin of its own and, in the NULL-terminated
/// prelinked list, one relocatable fatbin per object (PTX whose entry header is 96 bytes), which the driver
/// links at load time. Built here in memory the way the registration code lays it out.
#[test]
fn version_2_wrapper_lists_the_objects_fatbins() {
    let own: Vec<u8> = {
        let mut v = Vec::new();
        v.extend_from_slice(&gleam_fatbin::FATBIN_MAGIC.to_le_bytes());
        v.extend_from_slice(&1u16.to_le_bytes());
        v.extend_from_slice(&16u16.to_le_bytes());
        v.extend_from_slice(&0u64.to_le_bytes());
        v
    };
    let a = fixture("rdc_a.fatbin");
    let b = fixture("rdc_b.fatbin");
    let list: [*const u8; 3] = [a.as_ptr(), b.as_ptr(), std::ptr::null()];
    let mut wrapper = Vec::new();
    wrapper.extend_from_slice(&gleam_fatbin::FATBIN_WRAPPER_MAGIC.to_le_bytes());
    wrapper.extend_from_slice(&2u32.to_le_bytes());
    wrapper.extend_from_slice(&(own.as_ptr() as u64).to_le_bytes());
    wrapper.extend_from_slice(&(list.as_ptr() as u64).to_le_bytes());
    // SAFETY: the wrapper, the fatbins and the list are alive and laid out as the runtime lays them.
    let read = unsafe { gleam_fatbin::read_wrapper(wrapper.as_ptr().cast()) }.unwrap();
    assert_eq!(read.version, 2);
    assert_eq!(read.prelinked.len(), 2);
    assert!(Fatbin::parse(&own).unwrap().entries.is_empty());
    let mut texts = Vec::new();
    for (ptr, bytes) in read.prelinked.iter().zip([&a, &b]) {
        assert_eq!(*ptr, bytes.as_ptr());
        // SAFETY: points at a whole fatbin.
        let size = unsafe { gleam_fatbin::image_size(ptr.cast()) }.unwrap();
        assert_eq!(size, bytes.len());
        let fatbin = Fatbin::parse(bytes).unwrap();
        assert_eq!(fatbin.entries.len(), 1);
        let entry = &fatbin.entries[0];
        assert_eq!(entry.kind, EntryKind::Ptx);
        assert_eq!(entry.raw.len(), 96 + entry.payload.len().div_ceil(8) * 8);
        texts.push(ptx_text(&entry.decompressed(BUDGET).unwrap()).to_owned());
    }
    // The caller's object declares what the other defines: only linking both makes a module.
    assert!(texts[0].contains(".extern .func") && texts[0].contains("helper"));
    assert!(texts[1].contains(".visible .func") && texts[1].contains("helper"));
}

/// `params.fatbin` (params.cu: scalars of every size, aligned and padded structs, a 160-byte struct, a
/// templated kernel): the layouts read from the sm_75 and sm_90 cubins equal those read from the PTX, and
/// the PTX layout is the C ABI's.
#[test]
fn cubin_and_ptx_layouts_agree() {
    use gleam_fatbin::kernels::kernels_of;
    let bytes = fixture("params.fatbin");
    let fatbin = Fatbin::parse(&bytes).unwrap();
    let mut ptx = None;
    let mut cubins = Vec::new();
    for e in &fatbin.entries {
        let payload = e.decompressed(BUDGET).unwrap();
        let kernels = kernels_of(&payload).unwrap();
        match e.kind {
            EntryKind::Ptx => ptx = Some(kernels),
            EntryKind::Elf => cubins.push((e.sm_arch, kernels)),
            EntryKind::Other(_) => {}
        }
    }
    let ptx = ptx.expect("a PTX entry");
    let layout = |name: &str| -> Vec<(u32, u32)> {
        ptx.get(name)
            .unwrap_or_else(|| panic!("{name} in the PTX"))
            .params
            .iter()
            .map(|p| (p.offset, p.size))
            .collect()
    };
    assert_eq!(layout("none"), []);
    assert_eq!(
        layout("scalars"),
        [(0, 1), (2, 2), (4, 4), (8, 8), (16, 4), (24, 8), (32, 8)]
    );
    assert_eq!(
        layout("structs"),
        [(0, 1), (16, 16), (32, 24), (56, 160), (216, 4), (224, 8)]
    );
    assert_eq!(layout("_Z9templatedIdEvPT_S0_"), [(0, 8), (8, 8)]);
    assert_eq!(
        cubins.iter().map(|(sm, _)| *sm).collect::<Vec<_>>(),
        [75, 90]
    );
    for (sm, kernels) in &cubins {
        assert_eq!(kernels, &ptx, "sm_{sm} cubin vs PTX");
    }
}

/// Every sm_90 cubin of a real library (`GLEAM_FATBIN_LIBRARY`, e.g. torch's `libtorch_cuda.so`): its
/// `.nv_fatbin` section's fatbins parse, and every kernel's layout is read without error.
#[test]
#[ignore = "needs a CUDA library on disk: GLEAM_FATBIN_LIBRARY=/path/to/libtorch_cuda.so"]
fn a_real_librarys_cubins_all_parse() {
    use gleam_fatbin::kernels::kernels_of;
    let path = std::env::var("GLEAM_FATBIN_LIBRARY").expect("GLEAM_FATBIN_LIBRARY");
    let lib = std::fs::read(&path).unwrap();
    let section = nv_fatbin_section(&lib).expect("an .nv_fatbin section");
    let (mut fatbins, mut cubins, mut kernels, mut params) = (0, 0, 0, 0);
    let mut at = 0;
    while at + 16 <= section.len() {
        let rest = &section[at..];
        let Ok(size) = image_size_in(rest) else {
            at += 8; // padding between fatbins
            continue;
        };
        let fatbin = Fatbin::parse(&rest[..size]).unwrap();
        fatbins += 1;
        for e in fatbin
            .entries
            .iter()
            .filter(|e| e.kind == EntryKind::Elf && e.sm_arch == 90)
        {
            let payload = e.decompressed(64 << 20).unwrap();
            let found =
                kernels_of(&payload).unwrap_or_else(|err| panic!("fatbin {fatbins}: {err}"));
            cubins += 1;
            kernels += found.len();
            params += found
                .by_name
                .values()
                .map(|k| k.params.len())
                .sum::<usize>();
        }
        at += size.next_multiple_of(8);
    }
    eprintln!(
        "{path}: {fatbins} fatbins, {cubins} sm_90 cubins, {kernels} kernels, {params} parameters"
    );
    assert!(cubins > 0 && kernels > 0);
}

/// The `.nv_fatbin` section of a host ELF.
fn nv_fatbin_section(elf: &[u8]) -> Option<&[u8]> {
    let u16_at = |at: usize| u16::from_le_bytes(elf[at..at + 2].try_into().unwrap()) as usize;
    let u64_at = |at: usize| u64::from_le_bytes(elf[at..at + 8].try_into().unwrap()) as usize;
    let (shoff, shentsize, shnum, shstrndx) = (u64_at(40), u16_at(58), u16_at(60), u16_at(62));
    let header = |i: usize| shoff + i * shentsize;
    let names = u64_at(header(shstrndx) + 24);
    (0..shnum).find_map(|i| {
        let h = header(i);
        let name_at = names + u32::from_le_bytes(elf[h..h + 4].try_into().unwrap()) as usize;
        let name = &elf[name_at..name_at + 11];
        (name == b".nv_fatbin\0").then(|| &elf[u64_at(h + 24)..u64_at(h + 24) + u64_at(h + 32)])
    })
}
