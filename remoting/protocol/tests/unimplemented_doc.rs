//! `docs/unimplemented.md` names exactly the entry points the declaration list leaves unimplemented
//! (its `stub` lines, and the per-thread forms and aliases of stubs), each once, with the right count:
//! the document cannot fall behind the list. After changing a `stub` line, rerun
//! `python3 tools/driver-list/unimplemented.py`.

use std::collections::BTreeSet;

use gleam_protocol::api::{EXPORTS, Travel};

#[test]
fn the_document_lists_exactly_the_unimplemented_entry_points() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/unimplemented.md");
    let doc = std::fs::read_to_string(path).expect("docs/unimplemented.md exists");
    let listed: Vec<&str> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("- `")?.strip_suffix('`'))
        .collect();
    let documented: BTreeSet<&str> = listed.iter().copied().collect();
    assert_eq!(documented.len(), listed.len(), "a name is listed twice");
    let stubs: BTreeSet<&str> = EXPORTS
        .iter()
        .filter(|(_, travel)| *travel == Travel::Stub)
        .map(|(name, _)| *name)
        .collect();
    let rerun = "rerun `python3 tools/driver-list/unimplemented.py`";
    let stale: Vec<_> = documented.difference(&stubs).collect();
    assert!(
        stale.is_empty(),
        "documented but implemented: {stale:?}; {rerun}"
    );
    let missing: Vec<_> = stubs.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "unimplemented but not documented: {missing:?}; {rerun}"
    );
    let count = format!("{} of the {} entry points", stubs.len(), EXPORTS.len());
    assert!(
        doc.contains(&count),
        "the document should say \"{count}\"; {rerun}"
    );
}
