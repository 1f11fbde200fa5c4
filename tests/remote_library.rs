//! End to end, no GPU: the library API (`cuLibrary*`, `cuKernel*`) of a C driver-API program through
//! `gleam trace` against the emu backend: lazy libraries and kernels, client-side layouts and answers,
//! optional out-pointers, a `CUkernel` in place of a `CUfunction`; a library never used never reaches the
//! peer.

mod common;

use std::time::Duration;

use common::{Server, compile_c, output_within, text};

#[test]
fn the_library_api_runs_lazily_and_mostly_on_the_client() {
    let server = Server::start("emu");
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_library", dir.path());
    let report = dir.path().join("trace.tsv");
    let cmd = server.trace(&report, &exe);
    let out = output_within(cmd, Duration::from_secs(120));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("loading mode 2"), "{stdout}");
    assert!(stdout.contains("library ok"), "{stdout}");
    let report = std::fs::read_to_string(&report).unwrap();
    let counts = |name: &str| -> Vec<u64> {
        common::trace_counts(&report, name).unwrap_or_else(|| panic!("no {name} in\n{report}"))
    };
    // Only the library that was used went to the peer.
    assert!(report.contains("modules\t1\t"), "{report}");
    // Answered on the client: names, layouts, counts, repeated attribute and occupancy questions.
    for local in [
        "cuLibraryLoadData",
        "cuLibraryGetKernelCount",
        "cuLibraryEnumerateKernels",
        "cuKernelGetName",
        "cuKernelGetParamInfo",
        "cuKernelGetLibrary",
        "cuFuncGetParamInfo",
        "cuFuncGetName",
        "cuModuleGetFunctionCount",
        "cuModuleGetLoadingMode",
    ] {
        let c = counts(local);
        assert_eq!(c[1..3], [0, 0], "{local} was sent: {c:?}");
    }
    // Asked of the peer once, then answered locally.
    for cached in [
        "cuKernelGetAttribute",
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        "cuKernelGetFunction",
    ] {
        let c = counts(cached);
        assert_eq!((c[0], c[2]), (1, 1), "{cached}: {c:?}");
    }
    // The unused library's kernel was looked up locally and never loaded.
    assert_eq!(counts("cuLibraryGetKernel")[2], 0, "{report}");
    assert!(
        stderr.contains("unimplemented entry points reached: none"),
        "{stderr}"
    );
}
