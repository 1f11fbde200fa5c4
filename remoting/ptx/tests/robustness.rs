//! Untrusted PTX must give errors, never panics or unbounded allocations.

mod common;

use common::fixture;
use gleam_ptx::Module;

#[test]
fn every_truncation_of_real_ptx_parses_or_errors() {
    for name in ["vecadd.ptx", "call.ptx", "warp.ptx", "ops.ptx"] {
        let text = fixture(name);
        for cut in (0..text.len()).filter(|i| text.is_char_boundary(*i)) {
            let _ = Module::parse(&text[..cut]);
        }
    }
}

#[test]
fn token_mutations_parse_or_error() {
    let text = fixture("ops.ptx");
    let tokens: Vec<&str> = text
        .split_inclusive(|c: char| c.is_whitespace() || ",;[]{}()".contains(c))
        .collect();
    let replacements = [
        "",
        "}",
        "{",
        "[",
        "%r999",
        "-1",
        "99999999999999999999",
        "0f7FC00000",
        ".b8",
        "@",
        ";",
        "$L__BB0_9",
    ];
    // A fixed linear congruential sequence keeps the test deterministic.
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..3000 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let at = (seed >> 33) as usize % tokens.len();
        let with = replacements[(seed >> 20) as usize % replacements.len()];
        let mutated: String = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| if i == at { with } else { *t })
            .collect::<Vec<_>>()
            .concat();
        if let Ok(m) = Module::parse(&mutated) {
            for k in m.kernels() {
                let _ = (k.param_bytes(), k.static_shared_bytes(), k.unsupported());
            }
        }
    }
}

#[test]
fn hostile_sizes_are_rejected() {
    let head = ".version 9.0\n.target sm_90\n.address_size 64\n";
    let cases = [
        ".global .align 4 .b8 big[99999999999999];\n".to_string(),
        ".global .align 4 .b8 big[4294967296][4294967296];\n".to_string(),
        ".global .align 3 .b8 x[4];\n".to_string(),
        ".global .align 4611686018427387904 .b8 x[4];\n".to_string(),
        ".visible .entry k()\n{\n .reg .b32 %r<4000000000>;\n ret;\n}\n".to_string(),
        ".visible .entry k(.param .align 8 .b8 p[18446744073709551615])\n{\n ret;\n}\n".to_string(),
    ];
    for c in cases {
        let src = format!("{head}{c}");
        assert!(Module::parse(&src).is_err(), "accepted: {c}");
    }
    // A kernel demanding absurd local memory compiles to an error reported at launch, not an allocation.
    let src =
        format!("{head}.visible .entry k()\n{{\n .local .align 4 .b8 d[1073741824];\n ret;\n}}\n");
    let m = Module::parse(&src).unwrap();
    assert!(m.kernel("k").unwrap().unsupported().is_some());
}
