//! `cuGetProcAddress` / `cuGetProcAddress_v2`: answered locally (cudart calls them hundreds of times at
//! start, before `cuInit`), returning the variant of each entry point that the caller's CUDA version and
//! stream flags expect. Returning the wrong variant would be silent ABI corruption.
//!
//! The table `proc-table.tsv` (`base<TAB>flags<TAB>min_version<TAB>symbol`, one row per variant
//! breakpoint, holding until the next row of the same base and flags; symbol `-` = none yet) is generated
//! from NVIDIA's driver on the GPU machine and compiled in. Without a table (a build before it existed),
//! [`fallback`] answers: a rule plus the breakpoints known from public sources. The chosen symbol is then
//! looked up among this library's own exports ([`crate::exports::address`]).

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::sync::OnceLock;

use gleam_protocol::types::CUresult;

use crate::state;

/// The generated table (empty until the GPU machine produced it).
const TABLE: &str = include_str!(concat!(env!("OUT_DIR"), "/proc-table.tsv"));

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
const PER_THREAD: u64 = 2;

/// `CUdriverProcAddressQueryResult`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    /// Found.
    Success = 0,
    /// No such entry point.
    SymbolNotFound = 1,
    /// The entry point exists only in newer CUDA versions than the one asked for.
    VersionNotSufficient = 2,
}

/// Rows of the generated table: (base, flags) -> [(min_version, symbol)], sorted by version.
type Rows = HashMap<(String, u64), Vec<(i32, String)>>;

fn table() -> &'static Rows {
    static ROWS: OnceLock<Rows> = OnceLock::new();
    ROWS.get_or_init(|| parse_table(TABLE))
}

/// Parses `base<TAB>flags<TAB>min_version<TAB>symbol` lines; comments (`#`), blank and malformed lines
/// (a header) are skipped.
pub fn parse_table(text: &str) -> Rows {
    let mut rows: Rows = HashMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split('\t').collect();
        let [base, flags, version, symbol] = fields[..] else {
            continue;
        };
        let (Ok(flags), Ok(version)) = (flags.parse::<u64>(), version.parse::<i32>()) else {
            continue;
        };
        rows.entry((base.to_owned(), flags))
            .or_default()
            .push((version, symbol.to_owned()));
    }
    for variants in rows.values_mut() {
        variants.sort_by_key(|(v, _)| *v);
    }
    rows
}

/// Whether this library exports `name` (every export of NVIDIA's 580 driver).
fn exported(name: &str) -> bool {
    crate::exports::address(name).is_some()
}

/// The symbol for `base` at `version` with `flags`, from `rows` or else the fallback rule.
pub fn select(rows: &Rows, base: &str, version: i32, flags: u64) -> Result<String, Status> {
    let flags = if flags == PER_THREAD {
        PER_THREAD
    } else {
        flags & 1
    };
    let variants = rows
        .get(&(base.to_owned(), flags))
        .or_else(|| rows.get(&(base.to_owned(), 0)));
    match variants {
        // A `-` row: the entry point does not exist at that version.
        Some(variants) => match variants.iter().rev().find(|(min, _)| *min <= version) {
            Some((_, symbol)) if symbol != "-" => Ok(symbol.clone()),
            _ => Err(Status::VersionNotSufficient),
        },
        // The generated table lists every entry point of the driver: anything else does not exist.
        None if !rows.is_empty() => Err(Status::SymbolNotFound),
        None => fallback(base, version, flags),
    }
}

/// Variant breakpoints beyond the 3.2 `_v2` generation, from public sources (newest first).
const BREAKPOINTS: &[(&str, &[(i32, &str)])] = &[
    (
        "cuCtxCreate",
        &[
            (12050, "cuCtxCreate_v4"),
            (11040, "cuCtxCreate_v3"),
            (3020, "cuCtxCreate_v2"),
        ],
    ),
    ("cuCtxSynchronize", &[(13000, "cuCtxSynchronize_v2")]),
    ("cuCtxGetDevice", &[(13000, "cuCtxGetDevice_v2")]),
    ("cuEventElapsedTime", &[(12080, "cuEventElapsedTime_v2")]),
    ("cuGetProcAddress", &[(12000, "cuGetProcAddress_v2")]),
    ("cuDeviceGetUuid", &[(11040, "cuDeviceGetUuid_v2")]),
    (
        "cuDevicePrimaryCtxRelease",
        &[(11000, "cuDevicePrimaryCtxRelease_v2")],
    ),
    (
        "cuDevicePrimaryCtxReset",
        &[(11000, "cuDevicePrimaryCtxReset_v2")],
    ),
    (
        "cuDevicePrimaryCtxSetFlags",
        &[(11000, "cuDevicePrimaryCtxSetFlags_v2")],
    ),
    (
        "cuStreamGetCaptureInfo",
        &[
            (12030, "cuStreamGetCaptureInfo_v3"),
            (11030, "cuStreamGetCaptureInfo_v2"),
        ],
    ),
    (
        "cuStreamBeginCapture",
        &[(10010, "cuStreamBeginCapture_v2")],
    ),
    ("cuGraphInstantiate", &[(11000, "cuGraphInstantiate_v2")]),
    ("cuMemAdvise", &[(12020, "cuMemAdvise_v2")]),
    ("cuMemPrefetchAsync", &[(12020, "cuMemPrefetchAsync_v2")]),
];

/// Without a table row: the known breakpoints, else `base_v2` from CUDA 3.2 on, else `base`; with the
/// per-thread flag, the `_ptds`/`_ptsz` form of the chosen symbol when the driver has one.
pub fn fallback(base: &str, version: i32, flags: u64) -> Result<String, Status> {
    let known = BREAKPOINTS.iter().find(|(b, _)| *b == base);
    let chosen = match known.and_then(|(_, points)| points.iter().find(|(min, _)| *min <= version))
    {
        Some((_, symbol)) => symbol.to_string(),
        None if version >= 3020 && exported(&format!("{base}_v2")) && known.is_none() => {
            format!("{base}_v2")
        }
        None if exported(base) => base.to_owned(),
        None => return Err(Status::SymbolNotFound),
    };
    if flags == PER_THREAD {
        for suffix in ["_ptds", "_ptsz"] {
            let candidate = format!("{chosen}{suffix}");
            if exported(&candidate) {
                return Ok(candidate);
            }
        }
    }
    Ok(chosen)
}

unsafe fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
    status: *mut u32,
) -> Result<(), CUresult> {
    let report = |s: Status| {
        if !status.is_null() {
            // SAFETY: the caller's symbolStatus out-pointer.
            unsafe { status.write(s as u32) };
        }
    };
    let name = if symbol.is_null() {
        ""
    } else {
        // SAFETY: a NUL-terminated symbol name.
        unsafe { CStr::from_ptr(symbol) }.to_str().unwrap_or("")
    };
    if pfn.is_null() || name.is_empty() {
        report(Status::SymbolNotFound);
        return Err(CUresult::NOT_FOUND);
    }
    let found = select(table(), name, version, flags)
        .and_then(|symbol| crate::exports::address(&symbol).ok_or(Status::SymbolNotFound));
    match found {
        Ok(address) => {
            // SAFETY: checked non-NULL above.
            unsafe { pfn.write(address) };
            report(Status::Success);
            Ok(())
        }
        Err(s) => {
            tracing::debug!(symbol = name, version, flags, status = ?s, "cuGetProcAddress: not found");
            crate::trace::proc_miss(name, version, flags);
            // SAFETY: checked non-NULL above.
            unsafe { pfn.write(std::ptr::null_mut()) };
            report(s);
            Err(CUresult::NOT_FOUND)
        }
    }
}

pub unsafe fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: i32,
    flags: u64,
) -> Result<(), CUresult> {
    state::init_logging();
    // SAFETY: the caller's arguments, as the C API requires them.
    unsafe { get_proc_address(symbol, pfn, cuda_version, flags, std::ptr::null_mut()) }
}

pub unsafe fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: i32,
    flags: u64,
    status: *mut u32,
) -> Result<(), CUresult> {
    state::init_logging();
    // SAFETY: as above.
    unsafe { get_proc_address(symbol, pfn, cuda_version, flags, status) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_rows_pick_the_newest_variant_not_above_the_version() {
        let rows = parse_table(
            "base\tflags\tmin_version\tsymbol\n\
             cuMemAlloc\t0\t2000\tcuMemAlloc\n\
             cuMemAlloc\t0\t3020\tcuMemAlloc_v2\n\
             cuLaunchKernel\t0\t4000\tcuLaunchKernel\n\
             cuLaunchKernel\t2\t7000\tcuLaunchKernel_ptsz\n",
        );
        assert_eq!(select(&rows, "cuMemAlloc", 2000, 0).unwrap(), "cuMemAlloc");
        assert_eq!(
            select(&rows, "cuMemAlloc", 12000, 0).unwrap(),
            "cuMemAlloc_v2"
        );
        assert_eq!(
            select(&rows, "cuMemAlloc", 1000, 0),
            Err(Status::VersionNotSufficient)
        );
        assert_eq!(
            select(&rows, "cuLaunchKernel", 13000, 2).unwrap(),
            "cuLaunchKernel_ptsz"
        );
        // Flag 1 (legacy stream) without rows of its own uses the default rows.
        assert_eq!(
            select(&rows, "cuLaunchKernel", 13000, 1).unwrap(),
            "cuLaunchKernel"
        );
    }

    #[test]
    fn the_generated_table_answers_like_the_driver() {
        let rows = table();
        if TABLE.trim().is_empty() {
            return; // Built before the table existed: the fallback test covers this build.
        }
        assert_eq!(select(rows, "cuMemAlloc", 2000, 0).unwrap(), "cuMemAlloc");
        assert_eq!(
            select(rows, "cuMemAlloc", 13000, 0).unwrap(),
            "cuMemAlloc_v2"
        );
        assert_eq!(
            select(rows, "cuMemAlloc", 1000, 0),
            Err(Status::VersionNotSufficient)
        );
        assert_eq!(
            select(rows, "cuCtxCreate", 12000, 0).unwrap(),
            "cuCtxCreate_v3"
        );
        assert_eq!(
            select(rows, "cuCtxCreate", 13000, 0).unwrap(),
            "cuCtxCreate_v4"
        );
        assert_eq!(
            select(rows, "cuLaunchKernel", 13000, 2).unwrap(),
            "cuLaunchKernel_ptsz"
        );
        assert_eq!(
            select(rows, "cuMemcpyHtoD", 12000, 2).unwrap(),
            "cuMemcpyHtoD_v2_ptds"
        );
        assert_eq!(
            select(rows, "cuNoSuchThing", 12000, 0),
            Err(Status::SymbolNotFound)
        );
        // Every symbol the table can return is one of our exports.
        for variants in rows.values() {
            for (_, symbol) in variants {
                assert!(
                    symbol == "-" || exported(symbol),
                    "{symbol} is not exported"
                );
            }
        }
    }

    #[test]
    fn fallback_follows_known_breakpoints_and_stream_flags() {
        let rows = Rows::new();
        assert_eq!(
            select(&rows, "cuCtxCreate", 3020, 0).unwrap(),
            "cuCtxCreate_v2"
        );
        assert_eq!(
            select(&rows, "cuCtxCreate", 12000, 0).unwrap(),
            "cuCtxCreate_v3"
        );
        assert_eq!(
            select(&rows, "cuCtxCreate", 13000, 0).unwrap(),
            "cuCtxCreate_v4"
        );
        assert_eq!(
            select(&rows, "cuCtxCreate", 2000, 0).unwrap(),
            "cuCtxCreate"
        );
        assert_eq!(select(&rows, "cuMemAlloc", 2000, 0).unwrap(), "cuMemAlloc");
        assert_eq!(
            select(&rows, "cuMemAlloc", 12000, 0).unwrap(),
            "cuMemAlloc_v2"
        );
        assert_eq!(
            select(&rows, "cuGetProcAddress", 11030, 0).unwrap(),
            "cuGetProcAddress"
        );
        assert_eq!(
            select(&rows, "cuGetProcAddress", 12000, 0).unwrap(),
            "cuGetProcAddress_v2"
        );
        assert_eq!(
            select(&rows, "cuMemcpyHtoD", 12000, 2).unwrap(),
            "cuMemcpyHtoD_v2_ptds"
        );
        assert_eq!(
            select(&rows, "cuLaunchKernel", 12000, 2).unwrap(),
            "cuLaunchKernel_ptsz"
        );
        assert_eq!(
            select(&rows, "cuLaunchKernel", 12000, 0).unwrap(),
            "cuLaunchKernel"
        );
        assert_eq!(
            select(&rows, "cuNoSuchThing", 12000, 0),
            Err(Status::SymbolNotFound)
        );
    }

    /// The 440 `cuGetProcAddress` requests the CUDA 13.0 runtime makes at start-up (recorded identically
    /// for static cudart and torch's `libcudart.so.13`): each gets the result NVIDIA's driver gave, and a
    /// function of this library.
    #[test]
    fn the_runtimes_requests_are_answered_as_the_driver_answered() {
        let recorded = include_str!("../../../docs/data/cudart-13.0-getproc-requests.txt");
        let mut answered = 0;
        for line in recorded.lines().filter(|l| l.starts_with("proc ")) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // `proc <name> <version> <flags> -> <result>`; the first request has an empty name.
            let (name, rest) = if fields.len() == 6 {
                (fields[1], &fields[2..])
            } else {
                ("", &fields[1..])
            };
            let version: i32 = rest[0].parse().unwrap();
            let flags: u64 = rest[1].parse().unwrap();
            let want: u32 = rest[3].parse().unwrap();
            let symbol = std::ffi::CString::new(name).unwrap();
            let mut pfn = std::ptr::null_mut();
            let mut status = 9u32;
            // SAFETY: valid out-pointers and a NUL-terminated name.
            let got = unsafe {
                get_proc_address(
                    symbol.as_ptr(),
                    &raw mut pfn,
                    version,
                    flags,
                    &raw mut status,
                )
            };
            let code = got.err().unwrap_or(CUresult::SUCCESS).0;
            assert_eq!(code, want, "{line}");
            if want == 0 {
                assert!(!pfn.is_null(), "{line}");
                assert_eq!(status, Status::Success as u32, "{line}");
                answered += 1;
            }
        }
        assert_eq!(answered, 439);
    }

    /// Every entry point the measured workloads (torch 2.11 ResNet-50 and GPT-2 inference, an nvcc program;
    /// `pytorch-driver-surface.md`) call, through `cuGetProcAddress` at the version they asked for or by
    /// symbol, is implemented: none of them is a stub.
    #[test]
    fn the_measured_workloads_reach_no_stub() {
        use gleam_protocol::api::{EXPORTS, Travel};
        const BY_PROC: &[(&str, i32)] = &[
            ("cuCtxGetDevice", 13000),
            ("cuKernelGetAttribute", 12000),
            ("cuLaunchKernel", 4000),
            ("cuDeviceGetAttribute", 2000),
            ("cuKernelGetFunction", 12000),
            ("cuLaunchKernelEx", 11060),
            ("cuStreamIsCapturing", 10000),
            ("cuStreamSynchronize", 2000),
            ("cuMemcpyHtoDAsync", 3020),
            ("cuKernelSetAttribute", 12000),
            ("cuOccupancyMaxActiveClusters", 11070),
            ("cuMemAlloc", 3020),
            ("cuEventCreate", 2000),
            ("cuLibraryGetKernel", 12000),
            ("cuLibraryUnload", 12000),
            ("cuLibraryLoadData", 12000),
            ("cuStreamCreate", 2000),
            ("cuCtxGetCurrent", 4000),
            ("cuModuleGetLoadingMode", 11070),
            ("cuInit", 2000),
            ("cuDeviceTotalMem", 3020),
            ("cuDevicePrimaryCtxRetain", 7000),
            ("cuDevicePrimaryCtxRelease", 7000),
            ("cuDeviceGetUuid", 9020),
            ("cuDeviceGetName", 2000),
            ("cuDeviceGetCount", 2000),
            ("cuDeviceGet", 2000),
            ("cuDriverGetVersion", 2020),
            ("cuMemsetD8Async", 3020),
            ("cuMemHostAlloc", 2020),
            ("cuMemFree", 3020),
            ("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", 7000),
            ("cuOccupancyAvailableDynamicSMemPerBlock", 10020),
            ("cuMemcpyDtoHAsync", 3020),
            ("cuMemHostGetDevicePointer", 3020),
            ("cuLibraryGetGlobal", 12000),
            ("cuDeviceGetName", 13000),
            ("cuDeviceGetAttribute", 13000),
            ("cuDeviceGet", 13000),
            ("cuCtxSynchronize", 13000),
            ("cuCtxSetCurrent", 4000),
            ("cuCtxGetStreamPriorityRange", 5050),
            ("cuMemcpyDtoDAsync", 3020),
            ("cuMemcpyHtoD", 3020),
            ("cuMemcpyDtoH", 3020),
            ("cuDevicePrimaryCtxGetState", 7000),
            ("cuDevicePrimaryCtxReset", 7000),
        ];
        const BY_SYMBOL: &[&str] = &[
            "cuDevicePrimaryCtxGetState",
            "cuKernelGetAttribute",
            "cuCtxGetCurrent",
            "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags",
            "cuLaunchKernelEx",
            "cuLaunchKernel",
            "cuKernelGetFunction",
            "cuFuncGetAttribute",
            "cuCtxGetLimit",
            "cuOccupancyMaxActiveClusters",
            "cuLibraryGetKernel",
            "cuLibraryLoadData",
            "cuKernelSetAttribute",
            "cuFuncSetAttribute",
            "cuDriverGetVersion",
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            "cuOccupancyAvailableDynamicSMemPerBlock",
            "cuModuleLoadData",
            "cuModuleGetFunction",
            "cuInit",
            "cuDeviceGetAttribute",
            "cuDeviceGet",
            "cuGetErrorString",
            "cuDeviceGetCount",
        ];
        let mode = |symbol: &str| EXPORTS.iter().find(|(n, _)| *n == symbol).map(|(_, t)| *t);
        let mut stubs = Vec::new();
        for &(name, version) in BY_PROC {
            let symbol = select(table(), name, version, 0)
                .unwrap_or_else(|s| panic!("{name}@{version}: {s:?}"));
            if mode(&symbol) == Some(Travel::Stub) {
                stubs.push(format!("{name}@{version} -> {symbol}"));
            }
        }
        for &symbol in BY_SYMBOL {
            match mode(symbol) {
                Some(Travel::Stub) => stubs.push(symbol.to_owned()),
                None => panic!("{symbol} is not an export"),
                Some(_) => {}
            }
        }
        assert!(stubs.is_empty(), "stubs reached: {stubs:?}");
    }
}
