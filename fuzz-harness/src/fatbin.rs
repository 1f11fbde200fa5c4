//! Target `fatbin`: a module image from a client (what `cuModuleLoadData` ships), through everything that
//! reads one: sizing ([`gleam_fatbin::image_size_in`], and the pointer form the shim uses, which must
//! agree), fatbin parsing, selection for a few compute capabilities, decompression of each entry within
//! [`BUDGET`] bytes, rebuilding (which must parse back to the same entries), and the emu backend's
//! extraction of the PTX to interpret ([`gleam_emu::image::ptx_of`]).

use gleam_fatbin::{ComputeCapability, Fatbin, FatbinEntry, image_size, image_size_in};

/// Bytes one entry may decompress to.
pub const BUDGET: usize = 1 << 20;

/// Compute capabilities selection is tried for (Turing, Ampere, Hopper, Blackwell).
const CCS: [ComputeCapability; 4] = [
    ComputeCapability::new(7, 5),
    ComputeCapability::new(8, 6),
    ComputeCapability::new(9, 0),
    ComputeCapability::new(12, 0),
];

/// Runs one input. Panics only on a bug.
pub fn run(data: &[u8]) {
    sizing(data);
    if let Ok(fatbin) = Fatbin::parse(data) {
        entries(&fatbin);
    }
    let _ = gleam_emu::image::ptx_of(data, 90);
}

/// The slice and pointer forms of sizing agree, and a size never exceeds the slice.
fn sizing(data: &[u8]) {
    // PTX ends at its NUL: the pointer form reads up to one, so both see the same terminated copy.
    let mut terminated = Vec::with_capacity(data.len() + 1);
    terminated.extend_from_slice(data);
    terminated.push(0);
    let Ok(n) = image_size_in(&terminated) else {
        return;
    };
    assert!(
        n <= terminated.len(),
        "image_size_in: {n} bytes from a {}-byte slice",
        terminated.len()
    );
    // SAFETY: image_size_in found every header and table the pointer form reads inside `terminated`,
    // and PTX text is NUL-terminated in it.
    let by_pointer = unsafe { image_size(terminated.as_ptr().cast()) };
    assert_eq!(by_pointer, Ok(n), "image_size and image_size_in disagree");
}

fn entries(fatbin: &Fatbin<'_>) {
    for entry in &fatbin.entries {
        let _ = (entry.arch(), entry.compression(), entry.ptx_text());
        for cc in CCS {
            let _ = entry.runs_on(cc);
        }
        if let Ok(std::borrow::Cow::Owned(out)) = entry.decompressed(BUDGET) {
            assert!(
                out.len() <= BUDGET,
                "decompressed {} bytes past the budget",
                out.len()
            );
        }
    }
    for cc in CCS {
        if let Some(selected) = fatbin.select(cc) {
            assert!(
                selected.entry.runs_on(cc),
                "selected an entry that does not run on {cc:?}"
            );
        }
        for i in fatbin.runnable(cc) {
            assert!(fatbin.entries[i].runs_on(cc));
        }
    }
    let _ = fatbin.best_ptx(90);
    let all: Vec<usize> = (0..fatbin.entries.len()).collect();
    let rebuilt = fatbin.rebuild(&all);
    let again = Fatbin::parse(&rebuilt).expect("a rebuilt fatbin parses");
    assert_eq!(
        again.entries.len(),
        fatbin.entries.len(),
        "rebuilding changed the entry count"
    );
    for (a, b) in fatbin.entries.iter().zip(&again.entries) {
        assert!(
            same(a, b),
            "rebuilding changed an entry: {a:?} became {b:?}"
        );
    }
}

fn same(a: &FatbinEntry<'_>, b: &FatbinEntry<'_>) -> bool {
    (
        a.kind,
        a.sm_arch,
        a.flags,
        a.uncompressed_size,
        a.version,
        a.payload,
    ) == (
        b.kind,
        b.sm_arch,
        b.flags,
        b.uncompressed_size,
        b.version,
        b.payload,
    )
}
