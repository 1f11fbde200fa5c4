//! The built library exports exactly NVIDIA's 580 driver surface plus Gleam's marker, under the SONAME
//! `libcuda.so.1`, and nothing of Rust's std or the dependencies.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

fn library() -> PathBuf {
    // Integration tests run from target/<profile>/deps; cargo builds the cdylib there and beside it.
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [
        deps.join("libgleamcuda.so"),
        deps.parent().unwrap().join("libgleamcuda.so"),
    ]
    .into_iter()
    .filter(|p| p.is_file())
    .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
    .expect("cargo builds libgleamcuda.so for the tests")
}

#[test]
fn exported_symbols_are_the_580_driver_plus_the_marker() {
    let lib = library();
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .expect("run nm");
    assert!(
        out.status.success(),
        "nm failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let exported: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .map(|s| s.split('@').next().unwrap_or(s).to_owned())
        .collect();
    let mut expected: BTreeSet<String> = include_str!("../libcuda-580-exports.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    expected.insert("gleam_shim_marker".into());
    let missing: Vec<_> = expected.difference(&exported).collect();
    let extra: Vec<_> = exported.difference(&expected).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing: {missing:?}\nextra: {extra:?}"
    );
}

#[test]
fn soname_is_libcuda_so_1() {
    let out = Command::new("readelf")
        .arg("-d")
        .arg(library())
        .output()
        .expect("run readelf");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Library soname: [libcuda.so.1]"), "{text}");
}
