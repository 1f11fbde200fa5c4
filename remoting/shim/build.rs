//! Links the cdylib as `libcuda.so.1` and exports only the driver's `cu*` names plus Gleam's marker.

use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let script = out.join("exports.map");
    // Rust std and dependency symbols stay local: an application must see exactly the driver's surface.
    std::fs::write(
        &script,
        "{\n  global:\n    cu*;\n    gleam_shim_marker;\n  local:\n    *;\n};\n",
    )
    .expect("write the version script");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        script.display()
    );

    // The cuGetProcAddress table is generated on the GPU machine from the real driver; until it exists the
    // shim falls back to a rule (see src/proc.rs). Either way the table is compiled in from OUT_DIR.
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let table = manifest.join("proc-table.tsv");
    // Watch the table, or, while it does not exist, the directory it will appear in.
    match table.exists() {
        true => println!("cargo:rerun-if-changed={}", table.display()),
        false => println!("cargo:rerun-if-changed={}", manifest.display()),
    }
    println!("cargo:rerun-if-changed=build.rs");

    // The integrity-check fixture is recorded on the GPU machine (tools/gpu/integrity_probe.c); its replay
    // test runs once the file exists and shows as ignored until then.
    println!("cargo:rustc-check-cfg=cfg(gleam_integrity_fixture)");
    let fixtures = manifest.join("tests/fixtures");
    println!("cargo:rerun-if-changed={}", fixtures.display());
    if fixtures.join("integrity-fixture.txt").exists() {
        println!("cargo:rustc-cfg=gleam_integrity_fixture");
    }
    let text = std::fs::read_to_string(&table).unwrap_or_default();
    std::fs::write(out.join("proc-table.tsv"), text).expect("write the proc table");
}
