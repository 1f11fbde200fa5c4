//! The checked-in corpora (`fuzz/corpus/<target>/`, minimised by the fuzzer) and the inputs of bugs the
//! fuzzers found (`fuzz/regressions/<target>/`, kept whatever minimisation does), for the stable tests that
//! replay them.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

/// Where the corpus of `target` lives.
pub fn dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target)
}

/// Where the regression inputs of `target` live.
pub fn regressions_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/regressions")
        .join(target)
}

/// Every file of `target`'s corpus and regressions, sorted by name.
pub fn files(target: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = [dir(target), regressions_dir(target)]
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flatten()
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Feeds every corpus file of `target` to `run`; panics naming each file whose run panicked.
pub fn replay(target: &str, run: impl Fn(&[u8])) -> usize {
    let files = files(target);
    assert!(!files.is_empty(), "the {target} corpus is empty");
    let mut failed = Vec::new();
    for path in &files {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if catch_unwind(AssertUnwindSafe(|| run(&data))).is_err() {
            failed.push(path.display().to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{target}: these inputs panicked: {failed:?}"
    );
    files.len()
}
