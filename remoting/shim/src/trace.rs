//! What `gleam trace -- CMD` reports: every driver call the program made, how it travelled, and what Gleam
//! could not answer.
//!
//! Tracing is on when `GLEAM_TRACE_FILE` names a file (`gleam trace` sets it). Each export's guard then
//! classifies its call by what the session client actually sent during it ([`gleam_client::sent`]):
//! nothing (answered locally), only fire-and-forget requests, or a request it waited for. Stubs
//! (unimplemented entry points), unknown export tables and their unknown slots, and `cuGetProcAddress`
//! misses are counted beside, with the module images sent ([`crate::images::stats`]). At exit the
//! library's destructor writes the report (one tab-separated record per line) to the file, for `gleam
//! trace` to print.
//!
//! Off (the default), a call costs one relaxed atomic load here.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

use gleam_client::sent;
use gleam_protocol::types::CUresult;

/// 0: not decided yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Whether calls are being counted.
#[inline]
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => decide(),
    }
}

#[cold]
fn decide() -> bool {
    let on = report_path().is_some();
    STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    on
}

fn report_path() -> Option<std::path::PathBuf> {
    std::env::var_os("GLEAM_TRACE_FILE")
        .filter(|p| !p.is_empty())
        .map(Into::into)
}

/// Counts of one export.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Counts {
    /// Answered without sending anything.
    pub local: u64,
    /// Sent only fire-and-forget requests.
    pub fire_and_forget: u64,
    /// Waited for a reply.
    pub waited: u64,
    /// Returned an error.
    pub failed: u64,
    /// Reached an unimplemented entry point.
    pub unimplemented: u64,
}

#[derive(Debug, Default)]
struct Report {
    calls: BTreeMap<&'static str, Counts>,
    unknown_tables: BTreeMap<String, u64>,
    unknown_slots: BTreeMap<(String, usize), u64>,
    proc_misses: BTreeMap<(String, i32, u64), u64>,
}

static REPORT: Mutex<Option<Report>> = Mutex::new(None);

fn report() -> MutexGuard<'static, Option<Report>> {
    REPORT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Before an export's body: forget what the thread sent before.
#[inline]
pub fn begin() {
    let _ = sent::take();
}

/// After an export's body.
pub fn end(name: &'static str, result: CUresult) {
    let sent = sent::take();
    let mut report = report();
    let c = report
        .get_or_insert_with(Report::default)
        .calls
        .entry(name)
        .or_default();
    if sent & sent::WAITED != 0 {
        c.waited += 1;
    } else if sent & sent::FIRE_AND_FORGET != 0 {
        c.fire_and_forget += 1;
    } else {
        c.local += 1;
    }
    if !result.is_success() {
        c.failed += 1;
    }
}

/// A stub was called.
pub fn unimplemented(name: &'static str) {
    if enabled() {
        let mut report = report();
        let r = report.get_or_insert_with(Report::default);
        r.calls.entry(name).or_default().unimplemented += 1;
    }
}

/// An export table Gleam does not serve was requested.
pub fn unknown_table(uuid: &str) {
    if enabled() {
        let mut report = report();
        let r = report.get_or_insert_with(Report::default);
        *r.unknown_tables.entry(uuid.to_owned()).or_default() += 1;
    }
}

/// A slot of an export table that Gleam does not implement was called.
pub fn unknown_slot(uuid: &str, slot: usize) {
    if enabled() {
        let mut report = report();
        let r = report.get_or_insert_with(Report::default);
        *r.unknown_slots.entry((uuid.to_owned(), slot)).or_default() += 1;
    }
}

/// `cuGetProcAddress` found no entry point for `symbol` at `version` with `flags`.
pub fn proc_miss(symbol: &str, version: i32, flags: u64) {
    if enabled() {
        let mut report = report();
        let r = report.get_or_insert_with(Report::default);
        *r.proc_misses
            .entry((symbol.to_owned(), version, flags))
            .or_default() += 1;
    }
}

/// The report as text: one tab-separated record per line, first field its kind.
pub fn render() -> String {
    let report = report();
    let empty = Report::default();
    let r = report.as_ref().unwrap_or(&empty);
    let mut out = String::from("# gleam trace report v1\n");
    for (name, c) in &r.calls {
        let _ = writeln!(
            out,
            "call\t{name}\t{}\t{}\t{}\t{}\t{}",
            c.local, c.fire_and_forget, c.waited, c.failed, c.unimplemented
        );
    }
    for (uuid, n) in &r.unknown_tables {
        let _ = writeln!(out, "table\t{uuid}\t{n}");
    }
    for ((uuid, slot), n) in &r.unknown_slots {
        let _ = writeln!(out, "slot\t{uuid}\t{slot}\t{n}");
    }
    for ((symbol, version, flags), n) in &r.proc_misses {
        let _ = writeln!(out, "proc\t{symbol}\t{version}\t{flags}\t{n}");
    }
    let m = crate::images::stats();
    let _ = writeln!(out, "modules\t{}\t{}\t{}", m.sent, m.sent_bytes, m.found);
    out
}

/// Writes the report to `GLEAM_TRACE_FILE` (at exit, from the library's destructor: no logging).
pub fn write_report() {
    if !enabled() {
        return;
    }
    if let Some(path) = report_path() {
        let _ = std::fs::write(path, render());
    }
}
