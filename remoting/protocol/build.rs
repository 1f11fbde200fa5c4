//! Turns the declaration list (`driver-api.list`) into Rust: the macros every layer generates its code
//! from, the registry's effects, and the table of exports. See the list's header for its format.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let list_path = manifest.join("driver-api.list");
    println!("cargo:rerun-if-changed={}", list_path.display());
    println!("cargo:rerun-if-changed=build.rs");
    let text = std::fs::read_to_string(&list_path).expect("read driver-api.list");
    let entries = match parse(&text) {
        Ok(entries) => entries,
        Err(err) => panic!("driver-api.list: {err}"),
    };
    std::fs::write(out.join("driver_api.rs"), generate(&entries)).expect("write driver_api.rs");
}

/// How a call travels (the list's modes).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Mode {
    Local,
    Hand,
    Sync,
    Deferred,
    Stub,
    PerThread,
    /// Another name of an export with the same contract (an older version of it).
    Alias,
}

impl Mode {
    fn parse(word: &str) -> Option<Self> {
        Some(match word {
            "local" => Self::Local,
            "hand" => Self::Hand,
            "sync" => Self::Sync,
            "deferred" => Self::Deferred,
            "stub" => Self::Stub,
            "per-thread" => Self::PerThread,
            "alias" => Self::Alias,
            _ => return None,
        })
    }

    /// The token the generated macros pass for this mode.
    fn token(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Hand => "hand",
            Self::Sync => "sync",
            Self::Deferred => "deferred",
            Self::Stub => "stub",
            Self::PerThread => "per_thread",
            Self::Alias => "alias",
        }
    }

    fn travel(self) -> &'static str {
        match self {
            Self::Local => "Local",
            Self::Hand => "Hand",
            Self::Sync => "Sync",
            Self::Deferred => "Deferred",
            Self::Stub => "Stub",
            Self::PerThread => "PerThread",
            Self::Alias => "Alias",
        }
    }
}

#[derive(Clone, Debug)]
struct Param {
    name: String,
    ty: String,
}

#[derive(Clone, Debug)]
struct Entry {
    line: usize,
    mode: Mode,
    name: String,
    params: Vec<Param>,
    /// `per-thread`: the call this is the per-thread form of.
    base: Option<String>,
    tags: Vec<String>,
}

impl Entry {
    fn forwarded(&self) -> bool {
        matches!(self.mode, Mode::Sync | Mode::Deferred)
    }

    fn by_hand(&self) -> bool {
        self.tags.iter().any(|t| t == "by-hand")
    }

    /// The argument a tag like `destroys(stream)` names.
    fn tag_arg(&self, tag: &str) -> Option<&str> {
        self.tags.iter().find_map(|t| {
            t.strip_prefix(tag)
                .and_then(|rest| rest.strip_prefix('('))
                .and_then(|rest| rest.strip_suffix(')'))
        })
    }
}

fn parse(text: &str) -> Result<Vec<Entry>, String> {
    let mut entries = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (mode_word, rest) = line
            .split_once(char::is_whitespace)
            .ok_or_else(|| format!("line {line_no}: expected `<mode> <name>(...)`"))?;
        let mode = Mode::parse(mode_word)
            .ok_or_else(|| format!("line {line_no}: unknown mode `{mode_word}`"))?;
        let rest = rest.trim();
        if matches!(mode, Mode::PerThread | Mode::Alias) {
            let (name, base) = rest
                .split_once('=')
                .ok_or_else(|| format!("line {line_no}: expected `{mode_word} <name> = <base>`"))?;
            entries.push(Entry {
                line: line_no,
                mode,
                name: name.trim().to_owned(),
                params: Vec::new(),
                base: Some(base.trim().to_owned()),
                tags: Vec::new(),
            });
            continue;
        }
        let open = rest
            .find('(')
            .ok_or_else(|| format!("line {line_no}: missing `(`"))?;
        let close = matching_paren(rest, open)
            .ok_or_else(|| format!("line {line_no}: unbalanced parentheses"))?;
        let name = rest[..open].trim().to_owned();
        let params = split_top(&rest[open + 1..close], ',')
            .into_iter()
            .filter(|p| !p.trim().is_empty())
            .map(|p| {
                let (name, ty) = p
                    .split_once(':')
                    .ok_or_else(|| format!("line {line_no}: parameter `{p}` has no type"))?;
                Ok(Param {
                    name: name.trim().to_owned(),
                    ty: ty.trim().to_owned(),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let tags = rest[close + 1..]
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        entries.push(Entry {
            line: line_no,
            mode,
            name,
            params,
            base: None,
            tags,
        });
    }
    resolve_per_thread(&mut entries)?;
    check(&entries)?;
    Ok(entries)
}

fn matching_paren(s: &str, open: usize) -> Option<usize> {
    let mut depth = 0;
    for (i, c) in s.char_indices().skip_while(|&(i, _)| i < open) {
        match c {
            '(' | '<' => depth += 1,
            ')' | '>' => {
                depth -= 1;
                if depth == 0 {
                    return (c == ')').then_some(i);
                }
            }
            _ => {}
        }
    }
    None
}

fn split_top(s: &str, sep: char) -> Vec<String> {
    let (mut depth, mut cur, mut out) = (0i32, String::new(), Vec::new());
    for c in s.chars() {
        match c {
            '(' | '<' | '[' => depth += 1,
            ')' | '>' | ']' => depth -= 1,
            _ => {}
        }
        if c == sep && depth == 0 {
            out.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out
}

/// A per-thread form or an alias takes its base's parameters.
fn resolve_per_thread(entries: &mut [Entry]) -> Result<(), String> {
    let bases: HashMap<String, (Vec<Param>, Mode)> = entries
        .iter()
        .filter(|e| !matches!(e.mode, Mode::PerThread | Mode::Alias))
        .map(|e| (e.name.clone(), (e.params.clone(), e.mode)))
        .collect();
    for e in entries
        .iter_mut()
        .filter(|e| matches!(e.mode, Mode::PerThread | Mode::Alias))
    {
        let base = e.base.as_deref().unwrap_or_default();
        let (params, base_mode) = bases
            .get(base)
            .ok_or_else(|| format!("line {}: base `{base}` is not listed", e.line))?;
        e.params = params.clone();
        // The per-thread form of a call not implemented yet is not implemented either (and says so under
        // its own name).
        if *base_mode == Mode::Stub {
            e.mode = Mode::Stub;
            e.base = None;
        }
    }
    Ok(())
}

fn check(entries: &[Entry]) -> Result<(), String> {
    let mut seen = HashMap::new();
    for e in entries {
        if let Some(first) = seen.insert(e.name.as_str(), e.line) {
            return Err(format!(
                "line {}: `{}` already listed at line {first}",
                e.line, e.name
            ));
        }
        for tag in &e.tags {
            let known = tag == "by-hand"
                || tag == "bulk-in"
                || tag == "bulk-out"
                || tag == "barrier"
                || tag == "blocks"
                || tag == "waits-memory"
                || [
                    "destroys(",
                    "retains-primary(",
                    "releases-primary(",
                    "resets-primary(",
                    "records(",
                ]
                .iter()
                .any(|p| tag.starts_with(p));
            if !known {
                return Err(format!("line {}: unknown tag `{tag}`", e.line));
            }
            if tag == "by-hand" && !e.forwarded() {
                return Err(format!(
                    "line {}: `by-hand` applies to sync/deferred calls",
                    e.line
                ));
            }
        }
        for tag in [
            "destroys",
            "retains-primary",
            "releases-primary",
            "resets-primary",
            "records",
        ] {
            if let Some(arg) = e.tag_arg(tag) {
                if !e.forwarded() {
                    return Err(format!(
                        "line {}: `{tag}` applies to sync/deferred calls",
                        e.line
                    ));
                }
                if !e.params.iter().any(|p| p.name == arg) {
                    return Err(format!(
                        "line {}: `{tag}({arg})`: no such parameter",
                        e.line
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Types of the `api` module: how arguments of forwarded calls travel.
const API_TYPES: &[&str] = &[
    "Out",
    "OptOut",
    "In",
    "InOpt",
    "InOut",
    "LaunchConfig",
    "TensorMap",
    "AttrValue",
    "MemOpParams",
    "One",
    "OneSize",
    "Graph",
    "GraphExec",
    "MemPool",
    "MemHandle",
    "PtrValue",
    "Context",
    "Module",
    "Function",
    "Stream",
    "Event",
    "Library",
    "Kernel",
    "Array",
    "TexObject",
    "SurfObject",
    "CStr",
];

/// Qualifies the names in a type so it resolves wherever the generated macros expand.
fn qualify(ty: &str) -> String {
    let mut out = String::new();
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word.is_empty() {
            return;
        }
        let w = std::mem::take(word);
        if API_TYPES.contains(&w.as_str()) {
            let _ = write!(out, "$crate::api::{w}");
        } else if w == "c_void" || w == "c_char" {
            let _ = write!(out, "::std::ffi::{w}");
        } else if w.starts_with("CUDA_") {
            let _ = write!(out, "$crate::descriptors::{w}");
        } else if w.starts_with("CU") {
            let _ = write!(out, "$crate::types::{w}");
        } else {
            out.push_str(&w);
        }
    };
    for c in ty.chars() {
        if c.is_ascii_alphanumeric() || c == '_' {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

fn params_tokens(params: &[Param]) -> String {
    params
        .iter()
        .map(|p| format!("{}: {}", p.name, qualify(&p.ty)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether a parameter is a stream (so its per-thread form maps NULL to `CU_STREAM_PER_THREAD`).
fn is_stream(p: &Param) -> bool {
    matches!(p.ty.as_str(), "Stream" | "CUstream")
}

fn generate(entries: &[Entry]) -> String {
    let mut s = String::from("// GENERATED by build.rs from driver-api.list. Do not edit.\n\n");

    // The forwarded calls, for the wire, the server, the real backend, the registry and the shim.
    s.push_str(
        "/// Hands the forwarded calls of the declaration list (`sync` and `deferred`) to the macro `$g`, as\n\
         /// `sync|deferred fn cuName(arg: Type, ...);` items.\n\
         #[macro_export]\nmacro_rules! cuda_api {\n    ($g:ident) => { $g! {\n",
    );
    for e in entries.iter().filter(|e| e.forwarded()) {
        let _ = writeln!(
            s,
            "        {} fn {}({});",
            e.mode.token(),
            e.name,
            params_tokens(&e.params)
        );
    }
    s.push_str("    } };\n}\n\n");

    // Every export, for the shim.
    s.push_str(
        "/// Hands every export of the declaration list to the macro `$g`, as\n\
         /// `<mode> fn cuName(arg: Type, ...);` items, where `per_thread` items end with\n\
         /// `=> cuBase(args...)` (the call to make, with NULL streams mapped to the per-thread stream) and\n\
         /// forwarded calls the shim wraps by hand (`by-hand`) are `hand` items.\n\
         #[macro_export]\nmacro_rules! cuda_exports {\n    ($g:ident) => { $g! {\n",
    );
    for e in entries {
        // A forwarded call the shim wraps by hand is, for the shim, a hand-written export.
        let mode = if e.forwarded() && e.by_hand() {
            Mode::Hand.token()
        } else {
            e.mode.token()
        };
        let _ = write!(
            s,
            "        {mode} fn {}({})",
            e.name,
            params_tokens(&e.params)
        );
        if let Some(base) = &e.base {
            let args = e
                .params
                .iter()
                .map(|p| {
                    if e.mode == Mode::PerThread && is_stream(p) {
                        format!("$crate::api::per_thread({})", p.name)
                    } else {
                        p.name.clone()
                    }
                })
                .collect::<Vec<_>>()
                .join(", ");
            let _ = write!(s, " => {base}({args})");
        }
        s.push_str(";\n");
    }
    s.push_str("    } };\n}\n\n");

    // The table of exports.
    s.push_str(
        "/// Every export of the declaration list and how it travels, in list order.\n\
         pub const EXPORTS: &[(&str, Travel)] = &[\n",
    );
    for e in entries {
        let _ = writeln!(s, "    (\"{}\", Travel::{}),", e.name, e.mode.travel());
    }
    s.push_str("];\n\n");

    // The registry's effects.
    s.push_str(
        "/// What a forwarded call does to the registry's handles if it succeeds (from the list's tags).\n\
         pub(crate) fn effect_of(call: &crate::api::ApiCall) -> crate::registry::Effect {\n\
         \x20   use crate::api::ApiCall;\n\
         \x20   use crate::registry::{Effect, HandleKind};\n\
         \x20   match call {\n",
    );
    for e in entries.iter().filter(|e| e.forwarded()) {
        let param = |arg: &str| e.params.iter().find(|p| p.name == arg).cloned();
        if let Some(p) = e.tag_arg("destroys").and_then(param) {
            let _ = writeln!(
                s,
                "        ApiCall::{}(a) => Effect::Destroy(<{} as HandleKind>::KIND, a.{}),",
                e.name,
                qualify(&p.ty).replace("$crate", "crate"),
                p.name
            );
        }
        for (tag, variant) in [
            ("retains-primary", "PrimaryRetain"),
            ("releases-primary", "PrimaryRelease"),
            ("resets-primary", "PrimaryReset"),
        ] {
            if let Some(arg) = e.tag_arg(tag) {
                let _ = writeln!(
                    s,
                    "        ApiCall::{}(a) => Effect::{variant}(a.{arg}),",
                    e.name
                );
            }
        }
    }
    s.push_str("        _ => Effect::None,\n    }\n}\n\n");

    // How each forwarded call is ordered against the others (lanes, events, barriers).
    s.push_str(
        "/// How a forwarded call is ordered against the session's other requests (from the list's stream and\n\
         /// event arguments and its `barrier`/`blocks`/`waits-memory`/`records` tags).\n\
         pub(crate) fn api_ordering(call: &crate::api::ApiCall) -> crate::order::Ordering {\n\
         \x20   use crate::api::ApiCall;\n\
         \x20   #[allow(unused_variables)]\n\
         \x20   match call {\n",
    );
    for e in entries.iter().filter(|e| e.forwarded()) {
        let stream = e.params.iter().find(|p| p.ty == "Stream");
        let recorded = e.tag_arg("records");
        let waits: Vec<&Param> = e
            .params
            .iter()
            .filter(|p| p.ty == "Event" && Some(p.name.as_str()) != recorded)
            .collect();
        // A call that destroys a handle runs after every earlier request, whatever its lane: one of
        // them may still name the handle (a wait on an event, a launch of a module's function), and
        // CUDA lets a program destroy what queued work still uses.
        let barrier = e
            .tags
            .iter()
            .any(|t| t == "barrier" || t.starts_with("destroys("));
        let blocks = e.tags.iter().any(|t| t == "blocks");
        let waits_on_memory = e.tags.iter().any(|t| t == "waits-memory");
        let _ = writeln!(
            s,
            "        ApiCall::{}(a) => crate::order::Ordering {{ stream: {}, barrier: {barrier}, \
             blocks: {blocks}, waits_on_memory: {waits_on_memory}, records: {}, waits: [{}], }},",
            e.name,
            stream.map_or("None".to_owned(), |p| format!("Some(a.{})", p.name)),
            recorded.map_or("None".to_owned(), |arg| format!("Some(a.{arg})")),
            (0..2)
                .map(|i| waits
                    .get(i)
                    .map_or("None".to_owned(), |p| format!("Some(a.{})", p.name)))
                .collect::<Vec<_>>()
                .join(", "),
        );
        assert!(
            waits.len() <= 2,
            "{}: more than two event arguments",
            e.name
        );
    }
    s.push_str("    }\n}\n");
    s
}
