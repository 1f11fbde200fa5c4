//! Replays the GPU-recorded conformance cases in `conformance/` through the interpreter: every
//! `cases/*.case` whose `data/<case>/` exists is launched with its recorded inputs and compared against the
//! outputs recorded on the real GPU. Every mismatch is reported (case, param, index, expected, got); a case
//! without data is listed as skipped. `GLEAM_PTX_CASE=name` runs only the cases whose name contains `name`.

mod common;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use gleam_ptx::{FlatMemory, GlobalMemory, LaunchConfig, Module};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Elem {
    U8,
    U16,
    U32,
    S32,
    U64,
    S64,
    F16,
    Bf16,
    F32,
    F64,
}

impl Elem {
    fn parse(s: &str) -> Option<Elem> {
        Some(match s {
            "u8" => Elem::U8,
            "u16" => Elem::U16,
            "u32" => Elem::U32,
            "s32" => Elem::S32,
            "u64" => Elem::U64,
            "s64" => Elem::S64,
            "f16" => Elem::F16,
            "bf16" => Elem::Bf16,
            "f32" => Elem::F32,
            "f64" => Elem::F64,
            _ => return None,
        })
    }
    fn size(self) -> usize {
        match self {
            Elem::U8 => 1,
            Elem::U16 | Elem::F16 | Elem::Bf16 => 2,
            Elem::U32 | Elem::S32 | Elem::F32 => 4,
            Elem::U64 | Elem::S64 | Elem::F64 => 8,
        }
    }
    fn is_float(self) -> bool {
        matches!(self, Elem::F16 | Elem::Bf16 | Elem::F32 | Elem::F64)
    }
    /// Raw bits of element `i`.
    fn bits(self, b: &[u8], i: usize) -> u64 {
        let n = self.size();
        let mut w = [0u8; 8];
        w[..n].copy_from_slice(&b[i * n..i * n + n]);
        u64::from_le_bytes(w)
    }
    fn value(self, bits: u64) -> f64 {
        match self {
            Elem::U8 | Elem::U16 | Elem::U32 | Elem::U64 => bits as f64,
            Elem::S32 => bits as u32 as i32 as f64,
            Elem::S64 => bits as i64 as f64,
            Elem::F16 => half::f16::from_bits(bits as u16).to_f64(),
            Elem::Bf16 => half::bf16::from_bits(bits as u16).to_f64(),
            Elem::F32 => f32::from_bits(bits as u32) as f64,
            Elem::F64 => f64::from_bits(bits),
        }
    }
    /// Position on a monotonic integer line, so that ulp distance is a difference.
    fn ordinal(self, bits: u64) -> i128 {
        let (mag, sign) = match self {
            Elem::F16 | Elem::Bf16 => (bits & 0x7fff, bits & 0x8000 != 0),
            Elem::F32 => (bits & 0x7fff_ffff, bits & 0x8000_0000 != 0),
            _ => (bits & !(1 << 63), bits >> 63 != 0),
        };
        if sign { -(mag as i128) } else { mag as i128 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Check {
    Exact,
    Ulp(u64),
    Abs(f64),
    Rel(f64),
}

#[derive(Debug)]
enum ParamSpec {
    Ptr {
        elem: Elem,
        count: usize,
        check: Option<Check>,
    },
    Scalar(Vec<u8>),
}

#[derive(Debug)]
struct Case {
    name: String,
    ptx: String,
    kernel: String,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    params: Vec<ParamSpec>,
}

fn parse_num<T: std::str::FromStr>(s: &str, what: &str) -> Result<T, String> {
    s.parse().map_err(|_| format!("bad {what} `{s}`"))
}

fn parse_scalar(ty: &str, v: &str) -> Result<Vec<u8>, String> {
    let int = |v: &str| -> Result<i128, String> {
        let (neg, body) = match v.strip_prefix('-') {
            Some(b) => (true, b),
            None => (false, v),
        };
        let x = match body.strip_prefix("0x") {
            Some(h) => i128::from_str_radix(h, 16).map_err(|_| format!("bad integer `{v}`"))?,
            None => parse_num::<i128>(body, "integer")?,
        };
        Ok(if neg { -x } else { x })
    };
    Ok(match ty {
        "u32" | "s32" => (int(v)? as u32).to_le_bytes().to_vec(),
        "u64" | "s64" => (int(v)? as u64).to_le_bytes().to_vec(),
        "f32" => parse_num::<f32>(v, "f32")?.to_le_bytes().to_vec(),
        "f64" => parse_num::<f64>(v, "f64")?.to_le_bytes().to_vec(),
        _ => return Err(format!("unknown scalar type `{ty}`")),
    })
}

fn parse_case(name: &str, text: &str) -> Result<Case, String> {
    let mut c = Case {
        name: name.to_string(),
        ptx: String::new(),
        kernel: String::new(),
        grid: [1; 3],
        block: [1; 3],
        shared: 0,
        params: Vec::new(),
    };
    let dims = |w: &[&str]| -> Result<[u32; 3], String> {
        if w.len() != 4 {
            return Err(format!("expected 3 dimensions in `{}`", w.join(" ")));
        }
        Ok([
            parse_num(w[1], "dim")?,
            parse_num(w[2], "dim")?,
            parse_num(w[3], "dim")?,
        ])
    };
    for (ln, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let w: Vec<&str> = line.split_whitespace().collect();
        let err = |e: String| format!("{name}.case line {}: {e}", ln + 1);
        match w[0] {
            "ptx" if w.len() == 2 => c.ptx = w[1].to_string(),
            "kernel" if w.len() == 2 => c.kernel = w[1].to_string(),
            "grid" => c.grid = dims(&w).map_err(err)?,
            "block" => c.block = dims(&w).map_err(err)?,
            "shared" if w.len() == 2 => c.shared = parse_num(w[1], "shared").map_err(err)?,
            "param" if w.len() >= 4 && w[1] == "ptr" => {
                let elem =
                    Elem::parse(w[2]).ok_or_else(|| err(format!("unknown elem `{}`", w[2])))?;
                let count = parse_num(w[3], "count").map_err(err)?;
                let mut check = None;
                for kv in &w[4..] {
                    if let Some(ch) = kv.strip_prefix("check=") {
                        check = Some(match ch.split_once(':') {
                            None if ch == "exact" => Check::Exact,
                            Some(("ulp", n)) => Check::Ulp(parse_num(n, "ulp").map_err(err)?),
                            Some(("abs", x)) => Check::Abs(parse_num(x, "abs").map_err(err)?),
                            Some(("rel", x)) => Check::Rel(parse_num(x, "rel").map_err(err)?),
                            _ => return Err(err(format!("unknown check `{ch}`"))),
                        });
                    }
                }
                c.params.push(ParamSpec::Ptr { elem, count, check });
            }
            "param" if w.len() == 3 => c
                .params
                .push(ParamSpec::Scalar(parse_scalar(w[1], w[2]).map_err(err)?)),
            _ => return Err(err(format!("cannot read `{line}`"))),
        }
    }
    if c.ptx.is_empty() || c.kernel.is_empty() {
        return Err(format!("{name}.case: missing ptx or kernel"));
    }
    Ok(c)
}

fn conformance_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("conformance")
}

/// Whether `got` fails `check` against `exp`.
fn mismatch(elem: Elem, check: Check, exp: u64, got: u64) -> bool {
    if exp == got {
        return false;
    }
    let check = if elem.is_float() { check } else { Check::Exact };
    let (e, g) = (elem.value(exp), elem.value(got));
    if elem.is_float() && e.is_nan() && g.is_nan() {
        return false;
    }
    match check {
        Check::Exact => true,
        Check::Ulp(n) => {
            if e.is_nan() || g.is_nan() {
                return true;
            }
            (elem.ordinal(exp) - elem.ordinal(got)).unsigned_abs() > n as u128
        }
        // An unordered (NaN) difference fails.
        Check::Abs(x) => (e - g).abs().partial_cmp(&x).is_none_or(|o| o.is_gt()),
        Check::Rel(x) => (e - g)
            .abs()
            .partial_cmp(&(x * e.abs()))
            .is_none_or(|o| o.is_gt()),
    }
}

/// Runs one case; returns the report lines of its mismatches (empty when it passes).
fn run_case(c: &Case, data: &Path) -> Result<Vec<String>, String> {
    let ptx_path = conformance_dir().join("ptx").join(&c.ptx);
    let text =
        std::fs::read_to_string(&ptx_path).map_err(|e| format!("{}: {e}", ptx_path.display()))?;
    let module = Module::parse(&text).map_err(|e| format!("{}: {e}", c.ptx))?;
    let kernel = module
        .kernel(&c.kernel)
        .ok_or_else(|| format!("no kernel `{}` in {}", c.kernel, c.ptx))?;
    if kernel.params().len() != c.params.len() {
        return Err(format!(
            "kernel has {} params, case lists {}",
            kernel.params().len(),
            c.params.len()
        ));
    }
    let total: usize = c
        .params
        .iter()
        .map(|p| match p {
            ParamSpec::Ptr { elem, count, .. } => elem.size() * count + 512,
            ParamSpec::Scalar(_) => 0,
        })
        .sum::<usize>()
        + module.globals().iter().map(|g| g.size + 512).sum::<usize>()
        + 4096;
    let mut mem = FlatMemory::new(total);
    let mut symbols = HashMap::new();
    for g in module.globals() {
        let a = mem.alloc(g.size).ok_or("arena full")?;
        mem.write(a, &g.init).map_err(|e| e.to_string())?;
        symbols.insert(g.name.clone(), a);
    }
    let mut buf = vec![0u8; kernel.param_bytes()];
    let mut ptrs = Vec::new();
    for (i, (p, decl)) in c.params.iter().zip(kernel.params()).enumerate() {
        let bytes = match p {
            ParamSpec::Ptr { elem, count, .. } => {
                let len = elem.size() * count;
                let input = std::fs::read(data.join(format!("p{i}.in")))
                    .map_err(|e| format!("p{i}.in: {e}"))?;
                if input.len() != len {
                    return Err(format!("p{i}.in has {} bytes, expected {len}", input.len()));
                }
                let a = mem.alloc(len).ok_or("arena full")?;
                mem.write(a, &input).map_err(|e| e.to_string())?;
                ptrs.push((i, a, len));
                a.to_le_bytes().to_vec()
            }
            ParamSpec::Scalar(b) => b.clone(),
        };
        if bytes.len() != decl.size {
            return Err(format!(
                "param {i} is {} bytes in the case, {} in the kernel",
                bytes.len(),
                decl.size
            ));
        }
        buf[decl.offset..decl.offset + decl.size].copy_from_slice(&bytes);
    }
    let cfg = LaunchConfig {
        grid: c.grid,
        block: c.block,
        dynamic_shared_bytes: c.shared,
    };
    gleam_ptx::launch(&module, &c.kernel, &cfg, &buf, &symbols, &mem)
        .map_err(|e| format!("launch: {e}"))?;
    let mut report = Vec::new();
    for (i, addr, len) in ptrs {
        let ParamSpec::Ptr {
            elem,
            count,
            check: Some(check),
        } = c.params[i]
        else {
            continue;
        };
        let expected =
            std::fs::read(data.join(format!("p{i}.out"))).map_err(|e| format!("p{i}.out: {e}"))?;
        if expected.len() != len {
            return Err(format!(
                "p{i}.out has {} bytes, expected {len}",
                expected.len()
            ));
        }
        let mut got = vec![0u8; len];
        mem.read(addr, &mut got).map_err(|e| e.to_string())?;
        let mut bad = 0;
        for k in 0..count {
            let (e, g) = (elem.bits(&expected, k), elem.bits(&got, k));
            if mismatch(elem, check, e, g) {
                if bad < 8 {
                    report.push(format!(
                        "{} p{i}[{k}] ({elem:?}, {check:?}): expected {} ({e:#x}), got {} ({g:#x})",
                        c.name,
                        elem.value(e),
                        elem.value(g)
                    ));
                }
                bad += 1;
            }
        }
        if bad > 8 {
            report.push(format!(
                "{} p{i}: {bad} mismatches of {count} in all",
                c.name
            ));
        }
    }
    Ok(report)
}

#[test]
fn gpu_recorded_cases() {
    let dir = conformance_dir();
    let filter = std::env::var("GLEAM_PTX_CASE").ok();
    let Ok(entries) = std::fs::read_dir(dir.join("cases")) else {
        println!("conformance: no cases directory, nothing to run");
        return;
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".case"))
                .map(str::to_string)
        })
        .collect();
    names.sort();
    let (mut passed, mut skipped, mut failed) = (Vec::new(), Vec::new(), Vec::new());
    let mut log = String::new();
    for name in &names {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        let data = dir.join("data").join(name);
        if !data.is_dir() {
            skipped.push(name.clone());
            continue;
        }
        let text = match std::fs::read_to_string(dir.join("cases").join(format!("{name}.case"))) {
            Ok(t) => t,
            Err(e) => {
                failed.push(name.clone());
                let _ = writeln!(log, "{name}: {e}");
                continue;
            }
        };
        let result = parse_case(name, &text).and_then(|c| run_case(&c, &data));
        match result {
            Ok(r) if r.is_empty() => passed.push(name.clone()),
            Ok(r) => {
                failed.push(name.clone());
                for l in r {
                    let _ = writeln!(log, "{l}");
                }
            }
            Err(e) => {
                failed.push(name.clone());
                let _ = writeln!(log, "{name}: {e}");
            }
        }
    }
    println!("conformance: {} passed: {}", passed.len(), passed.join(" "));
    println!(
        "conformance: {} skipped (no recorded data): {}",
        skipped.len(),
        skipped.join(" ")
    );
    println!("conformance: {} failed: {}", failed.len(), failed.join(" "));
    print!("{log}");
    assert!(
        failed.is_empty(),
        "{} conformance case(s) failed:\n{log}",
        failed.len()
    );
}

#[test]
fn case_files_parse() {
    let c = parse_case(
        "demo",
        "# comment\nptx a.ptx\nkernel k # trailing\ngrid 2 1 1\nblock 64 1 1\nshared 128\n\
         param ptr f32 10 init=random check=ulp:2\nparam ptr u32 4 init=zero\nparam s32 -5\nparam f32 1.5\n",
    )
    .unwrap();
    assert_eq!(c.grid, [2, 1, 1]);
    assert_eq!(c.shared, 128);
    assert!(matches!(
        c.params[0],
        ParamSpec::Ptr {
            elem: Elem::F32,
            count: 10,
            check: Some(Check::Ulp(2))
        }
    ));
    assert!(matches!(c.params[1], ParamSpec::Ptr { check: None, .. }));
    assert!(matches!(&c.params[2], ParamSpec::Scalar(b) if b == &(-5i32).to_le_bytes()));
    assert!(parse_case("bad", "ptx a.ptx\nkernel k\nparam ptr q8 1\n").is_err());
    assert!(!mismatch(
        Elem::F32,
        Check::Ulp(1),
        1f32.to_bits() as u64,
        1.0000001f32.to_bits() as u64
    ));
    assert!(mismatch(
        Elem::F32,
        Check::Ulp(1),
        1f32.to_bits() as u64,
        1.0000005f32.to_bits() as u64
    ));
    assert!(mismatch(Elem::U32, Check::Abs(10.0), 1, 2));
}
