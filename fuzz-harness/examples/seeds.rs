//! Writes the fuzzers' starting inputs: `cargo run -p gleam-fuzz-harness --example seeds -- DIR` makes
//! `DIR/<target>/seed-N` for every target.

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/seeds".into()),
    );
    let targets: [(&str, Vec<Vec<u8>>); 7] = [
        ("frames", gleam_fuzz_harness::seeds::frames()),
        ("ptx", gleam_fuzz_harness::seeds::ptx()),
        ("fatbin", gleam_fuzz_harness::seeds::fatbin()),
        ("shim", gleam_fuzz_harness::seeds::shim()),
        ("gossip", gleam_fuzz_harness::seeds::gossip()),
        ("link", gleam_fuzz_harness::seeds::link()),
        ("control", gleam_fuzz_harness::seeds::control()),
    ];
    for (target, seeds) in targets {
        let out = dir.join(target);
        std::fs::create_dir_all(&out)?;
        for (i, seed) in seeds.iter().enumerate() {
            std::fs::write(out.join(format!("seed-{i}")), seed)?;
        }
        println!("{}: {} seeds", out.display(), seeds.len());
    }
    Ok(())
}
