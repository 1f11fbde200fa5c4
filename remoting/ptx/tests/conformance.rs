//! Replays the GPU-recorded conformance cases in `conformance/` through the interpreter: every
//! `cases/*.case` whose `data/<case>/` exists is launched with its recorded inputs and compared against the
//! outputs recorded on the real GPU. Every mismatch is reported (case, buffer, index, expected, got). A case
//! without data is skipped, and the skip is announced on the test's stderr (bypassing the test harness's
//! capture) with the recording it lacks. `GLEAM_PTX_CASE=name` runs only the cases whose name contains
//! `name`.

mod common;

use std::io::Write as _;
use std::path::{Path, PathBuf};

use common::case::{
    Case, Check, Elem, ParamSpec, compare, generated_inputs, mismatch, parse_case, setup,
};
use gleam_ptx::{LaunchConfig, LaunchOptions, Module};

fn conformance_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("conformance")
}

fn load_module(c: &Case) -> Result<Module, String> {
    let ptx_path = conformance_dir().join("ptx").join(&c.ptx);
    let text =
        std::fs::read_to_string(&ptx_path).map_err(|e| format!("{}: {e}", ptx_path.display()))?;
    Module::parse(&text).map_err(|e| format!("{}: {e}", c.ptx))
}

/// Runs one case; returns the report lines of its mismatches (empty when it passes). `exact` compares every
/// checked buffer bit for bit, whatever tolerance the case gives.
fn run_case(c: &Case, data: &Path, exact: bool) -> Result<Vec<String>, String> {
    let module = load_module(c)?;
    let read = |name: &str| -> Result<Vec<u8>, String> {
        std::fs::read(data.join(format!("{name}.in"))).map_err(|e| format!("{name}.in: {e}"))
    };
    let s = setup(c, &module, &read)?;
    let cfg = LaunchConfig {
        grid: c.grid,
        block: c.block,
        dynamic_shared_bytes: c.shared,
    };
    let opts = LaunchOptions {
        textures: Some(&s.objects),
        ..LaunchOptions::default()
    };
    gleam_ptx::launch_with(
        &module, &c.kernel, &cfg, &s.params, &s.symbols, &s.mem, &opts,
    )
    .map_err(|e| format!("launch: {e}"))?;
    let expected = |name: &str| -> Result<Vec<u8>, String> {
        std::fs::read(data.join(format!("{name}.out"))).map_err(|e| format!("{name}.out: {e}"))
    };
    let mut report = Vec::new();
    for (i, p) in c.params.iter().enumerate() {
        if let ParamSpec::Ptr {
            elem,
            check: Some(check),
            ..
        } = p
        {
            let got = s.buffer(i).ok_or("buffer")?;
            report.extend(compare(
                &format!("{} p{i}", c.name),
                *elem,
                if exact { Check::Exact } else { *check },
                &expected(&format!("p{i}"))?,
                &got,
            ));
        }
    }
    for (k, r) in c.resources.iter().enumerate() {
        if let Some(check) = r.check {
            let got = s.dense(c, k)?;
            report.extend(compare(
                &format!("{} {}", c.name, r.name),
                r.channel_elem(),
                if exact { Check::Exact } else { check },
                &expected(&r.name)?,
                &got,
            ));
        }
    }
    Ok(report)
}

fn case_names() -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(conformance_dir().join("cases")) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".case"))
                .map(str::to_string)
        })
        .collect();
    names.sort();
    names
}

fn read_case(name: &str) -> Result<Case, String> {
    let path = conformance_dir().join("cases").join(format!("{name}.case"));
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_case(name, &text)
}

#[test]
fn gpu_recorded_cases() {
    let dir = conformance_dir();
    let filter = std::env::var("GLEAM_PTX_CASE").ok();
    let names = case_names();
    assert!(
        !names.is_empty(),
        "no cases in {}",
        dir.join("cases").display()
    );
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
        match read_case(name).and_then(|c| run_case(&c, &data, false)) {
            Ok(r) if r.is_empty() => passed.push(name.clone()),
            Ok(r) => {
                failed.push(name.clone());
                for l in r {
                    log.push_str(&l);
                    log.push('\n');
                }
            }
            Err(e) => {
                failed.push(name.clone());
                log.push_str(&format!("{name}: {e}\n"));
            }
        }
    }
    println!("conformance: {} passed: {}", passed.len(), passed.join(" "));
    println!("conformance: {} failed: {}", failed.len(), failed.join(" "));
    if !skipped.is_empty() {
        // Straight to stderr, not through the captured print macros: a skip must never pass unseen.
        let _ = writeln!(
            std::io::stderr(),
            "conformance: SKIPPED {} case(s) that have no GPU recording yet (no {}/<case>/): {}\n\
             conformance: record exactly those on the GPU machine, from the repo root, with\n    \
             OUT=<dir> KEEP_PTX=1 CASES='{}' bash scripts/gpu/record-conformance.sh\n\
             conformance: then run `tar xzf <dir>/conformance.tgz` at the repo root here",
            skipped.len(),
            dir.join("data").display(),
            skipped.join(" "),
            skipped.join(" ")
        );
    }
    print!("{log}");
    assert!(
        failed.is_empty(),
        "{} conformance case(s) failed:\n{log}",
        failed.len()
    );
}

/// The sampler reproduces every recorded texture result bit for bit, not only within the cases'
/// tolerances (which leave room for an implementation that blends in another order): weights, blending and
/// rounding are the hardware's (see `gleam_ptx::TextureResolver`).
#[test]
fn texture_cases_are_bit_exact() {
    let dir = conformance_dir();
    let mut report = Vec::new();
    let mut ran = 0;
    for name in case_names() {
        let data = dir.join("data").join(&name);
        if !(name.starts_with("tex") || name.starts_with("tld4")) || !data.is_dir() {
            continue;
        }
        match read_case(&name).and_then(|c| run_case(&c, &data, true)) {
            Ok(r) => report.extend(r),
            Err(e) => report.push(format!("{name}: {e}")),
        }
        ran += 1;
    }
    assert!(ran >= 30, "only {ran} recorded texture cases");
    assert!(report.is_empty(), "{}", report.join("\n"));
}

/// The recorded inputs are what the Rust generator makes of the same case (so the CPU-reference tests in
/// `textures.rs` run on the data the GPU saw).
#[test]
fn recorded_inputs_match_the_generator() {
    let dir = conformance_dir();
    let mut report = Vec::new();
    for name in case_names() {
        let data = dir.join("data").join(&name);
        if !data.is_dir() {
            continue;
        }
        let c = read_case(&name).unwrap();
        for (key, bytes) in generated_inputs(&c) {
            let path = data.join(format!("{key}.in"));
            match std::fs::read(&path) {
                Ok(rec) if rec == bytes => {}
                Ok(_) => report.push(format!("{name}/{key}.in differs from the generator")),
                Err(e) => report.push(format!("{}: {e}", path.display())),
            }
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
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
            check: Some(Check::Ulp(2)),
            ..
        }
    ));
    assert!(matches!(c.params[1], ParamSpec::Ptr { check: None, .. }));
    assert!(matches!(&c.params[2], ParamSpec::Scalar(b) if b == &(-5i32).to_le_bytes()));
    assert!(parse_case("bad", "ptx a.ptx\nkernel k\nparam ptr q8 1\n").is_err());
    let t = parse_case(
        "tex",
        "ptx t.ptx\nkernel k\nresource img array u8 4 8 6 surface init=random check=exact\n\
         resource buf linear f32 1 40 init=iota\n\
         param tex img filter=linear address=wrap,clamp normalized read=element border=0,0.5,1,1\n\
         param surf img\nparam tex buf\n",
    )
    .unwrap();
    assert_eq!(t.resources.len(), 2);
    assert_eq!(t.resources[0].dense_bytes(), 8 * 6 * 4);
    match &t.params[0] {
        ParamSpec::Tex(s) => {
            assert_eq!(s.address[0], gleam_ptx::AddressMode::Wrap);
            assert_eq!(s.address[2], gleam_ptx::AddressMode::Clamp);
            assert!(s.normalized && s.read_as_integer);
            assert_eq!(s.border, [0.0, 0.5, 1.0, 1.0]);
        }
        p => panic!("{p:?}"),
    }
    // Surfaces need an array made for them; textures a resource declared before.
    assert!(
        parse_case(
            "t",
            "ptx t\nkernel k\nresource b linear f32 1 4 init=zero\nparam surf b\n"
        )
        .is_err()
    );
    assert!(parse_case("t", "ptx t\nkernel k\nparam tex nothing\n").is_err());
    assert!(!mismatch(
        Elem::F32,
        Check::Ulp(1),
        u64::from(1f32.to_bits()),
        u64::from(1.0000001f32.to_bits())
    ));
    assert!(mismatch(
        Elem::F32,
        Check::Ulp(1),
        u64::from(1f32.to_bits()),
        u64::from(1.0000005f32.to_bits())
    ));
    assert!(mismatch(Elem::U32, Check::Abs(10.0), 1, 2));
}
