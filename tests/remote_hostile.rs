//! End to end, no GPU: hostile arguments from the application must get CUDA's error codes from the shim,
//! never kill the application.

mod common;

use std::time::Duration;

use common::{Server, compile_c, output_within, text};

/// Runs `tests/remote/NAME.c` through the shim against an emu server: it must exit 0 and end with `done`.
/// Its standard output.
fn run_to_done(name: &str) -> String {
    let server = Server::start("emu");
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c(name, dir.path());
    let out = output_within(server.run(&exe, &[]), Duration::from_secs(60));
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{name} failed ({:?})\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        text(&out.stderr)
    );
    assert!(stdout.ends_with("done\n"), "{stdout}");
    stdout
}

/// Issue 11: `cuMemcpyHtoD_v2(p, buf, SIZE_MAX)` into a 4 KiB allocation aborted the program, and 64 MiB or
/// 1 TiB crashed it, because the host buffer was read before the device range was checked. Every
/// oversized copy (both directions, sync and async, allocations and module globals) is now
/// `CUDA_ERROR_INVALID_VALUE`, and in-range copies still work.
#[test]
fn oversized_copies_are_invalid_values_not_crashes() {
    let stdout = run_to_done("hostile_copies");
    assert!(
        stdout.contains("htod n=18446744073709551615: CUDA_ERROR_INVALID_VALUE"),
        "{stdout}"
    );
    // The global was read, written in range, and kept its bytes through the refused copies.
    let fill = u32::from_le_bytes([7; 4]);
    assert!(stdout.contains("global holds 1 2 3 4\n"), "{stdout}");
    assert!(
        stdout.contains(&format!("global holds {fill} {fill} {fill} {fill}\n")),
        "{stdout}"
    );
}

/// The shim's fuzz target set a function's maximum threads per block to 1.5 billion with
/// `cuFuncSetAttribute`: the shim sent the set without waiting and wrote the value into its attribute
/// cache, so `cuOccupancyMaxPotentialBlockSize` then walked 47 million block sizes (a round trip each, 20 to
/// 40 s in process). Read-only attributes are now refused at once, as NVIDIA's driver refuses them, and
/// leave every attribute as it was; the settable ones still set.
#[test]
fn read_only_function_attributes_cannot_be_set() {
    let stdout = run_to_done("hostile_attributes");
    assert!(stdout.contains("max threads per block 1024\n"), "{stdout}");
}
