//! The systemd units as `scripts/install.sh --systemd` installs them: `systemd-analyze verify` is clean and
//! `systemd-analyze security` rates each at most 4.0 (issue 10 item 10). `contrib/check-units.sh` does the
//! checking; this test runs it on the binaries of this build.

use std::path::Path;
use std::process::Command;

#[test]
fn installed_units_verify_clean_and_rate_at_most_4() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED: systemd-analyze is not installed (Debian/Ubuntu: apt install systemd)");
        return;
    }
    let gleam = Path::new(env!("CARGO_BIN_EXE_gleam"));
    let dir = gleam.parent().expect("the binary's directory");
    // The shim is a cdylib of the same build; CI builds the whole workspace before testing.
    if !dir.join("libgleamcuda.so").exists() {
        eprintln!(
            "SKIPPED: {} has no libgleamcuda.so (cargo build -p gleam-shim)",
            dir.display()
        );
        return;
    }
    let out = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib/check-units.sh"))
        .arg(dir)
        .output()
        .expect("run contrib/check-units.sh");
    let report = String::from_utf8_lossy(&out.stdout);
    eprintln!("{report}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "units fail the check:\n{report}");
    assert_eq!(report.matches("verify clean").count(), 2, "{report}");
}
