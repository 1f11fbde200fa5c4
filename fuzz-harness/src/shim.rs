//! Target `shim`: an application calling Gleam's `libcuda` with hostile arguments.
//!
//! The input is decoded ([`arbitrary`]) into a sequence of [`Op`]s, each one call of a C export of the shim
//! (`gleamcuda::exports`, linked into this process as a library, exactly the functions a program calls):
//! copies with counts up to `SIZE_MAX`, pointers past their allocation or into nothing, made-up handles,
//! `cuLaunchKernel`/`cuLaunchKernelEx` with broken `kernelParams`/`extra` arrays and launch configurations,
//! `cuGetProcAddress` with any symbol, version and flags, `cuGetExportTable` with any UUID, pointer
//! attributes of any id, device queries with any length...
//!
//! **The choice of peer.** The shim opens one session per process (`cuInit`) and the harness keeps it for
//! every input; each input cleans up what it made (frees, destroys, unloads) and ends with a
//! synchronisation, so inputs do not leak into each other. The peer is one of two:
//! - [`start`]: a real `gleam serve --backend emu` per fuzzing process (the `gleam` binary of this
//!   workspace, 64 MiB of emulated memory, on loopback with a config dir of its own): the whole path runs
//!   for real (shim, client, QUIC, host, session process, engine, emu), at the price of a round trip per
//!   waited-for call, which holds the fuzzer to tens of inputs a second;
//! - [`start_in_process`]: the same session engine and emu backend in this process, handed to the shim as
//!   its session ([`gleam_client::in_process`], `gleamcuda::state::install`): the shim and the client above
//!   the transport run as in production, without the network, hundreds of inputs a second. What it leaves
//!   out, the wire and the session process, has targets and tests of its own (`frames`).
//!
//! The fuzz target uses the peer `GLEAM_FUZZ_SHIM_PEER` names (`in-process` or `server`, the default;
//! `fuzz/run.sh` sets `in-process`); the stable suite replays the corpus against both.
//!
//! **What the application keeps of its side of the contract.** Every pointer the shim may dereference points
//! into memory this harness owns: a host buffer of [`HOST_BYTES`] followed by an inaccessible guard page (a
//! read or write past it is a crash), pinned allocations, 16-slot arrays for `extra`, parameter values.
//! A count larger than the host memory at its pointer is passed on only where the device side cannot hold
//! it either, which is exactly the case the shim must refuse before touching host memory (issue 11); if the
//! device side could hold it, the copy would read past the host buffer legitimately (the application broke
//! the contract), so the harness shortens it. Kernels are the harness's own loop-free module, launched with
//! device pointers that fit, on at most [`MAX_LAUNCH_THREADS`] threads: a fault there would be the
//! harness's fault and would poison the session for every later input (a sticky error), which is
//! reported as a failure.
//!
//! **What is checked** besides "no crash, no hang": an out-of-range copy is `CUDA_ERROR_INVALID_VALUE`;
//! `cuGetProcAddress` only ever returns addresses of this library's exports; after each input's cleanup the
//! session has no sticky error and the emulated device's free memory is back where it started.

use std::collections::HashSet;
use std::ffi::{CString, c_char, c_void};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock, PoisonError};

use arbitrary::{Arbitrary, Unstructured};
use bytes::Bytes;
use gleam_client::in_process::LocalPeer;
use gleam_emu::{EmuBackend, EmuConfig};
use gleam_protocol::types::{
    CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE, CU_LAUNCH_PARAM_END,
    CU_STREAM_LEGACY, CU_STREAM_PER_THREAD, CUresult,
};
use gleam_protocol::wire::{ReplyFrame, Request};
use gleam_server::session::Session;
use gleamcuda::exports as cu;

use crate::frames::KERNELS_PTX;

/// Bytes of the host buffer copies read from and write to (a guard page follows it).
pub const HOST_BYTES: usize = 64 << 10;
/// Most operations one input runs.
pub const MAX_OPS: usize = 48;
/// Most threads one launch may run.
pub const MAX_LAUNCH_THREADS: u64 = 4096;
/// Emulated device memory of the peer, in bytes.
const EMU_MEMORY: u64 = 64 << 20;
/// Largest allocation kept (larger successful ones are freed at once: the host buffer could not fill them).
const MAX_KEPT_ALLOC: u64 = 1 << 20;
/// Largest pinned allocation requested.
const MAX_PINNED: usize = 1 << 20;
/// Streams, events and module loads one input may make.
const MAX_OBJECTS: usize = 4;
/// Bytes of the parameter area `extra` buffers point into (the shim reads up to 32,764 from a pointer).
const PARAM_AREA: usize = 64 << 10;

/// The process's session, the peer it talks to, and the harness's memory.
pub struct Setup {
    peer: Peer,
    ctx: usize,
    module: usize,
    /// `add`, `count`, `mix` of the setup module.
    functions: [usize; 3],
    /// `table` of the setup module: 16 bytes.
    global: u64,
    host: usize,
    params: usize,
    exports: HashSet<usize>,
    names: Vec<CString>,
    free_at_start: usize,
}

impl std::fmt::Debug for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Setup")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

static SETUP: OnceLock<Setup> = OnceLock::new();
/// Inputs run one at a time (the session's context is per thread; the model is per input).
static RUN: Mutex<()> = Mutex::new(());

/// Where the process's session is served.
#[derive(Debug)]
enum Peer {
    /// A `gleam serve --backend emu` child process, over QUIC on loopback: the whole path.
    Server(Mutex<Child>),
    /// The session engine over the emu backend in this process ([`gleam_client::in_process`]).
    InProcess,
}

/// Starts the server and the session once per process, with the `gleam` binary at `gleam`.
///
/// # Panics
/// If the server or the session cannot start: nothing can be fuzzed then.
pub fn start(gleam: &Path) -> &'static Setup {
    SETUP.get_or_init(|| Setup::new(Peer::server(gleam)))
}

/// Starts the session once per process with a peer in this process: the session engine over the emu
/// backend, reached without a network (the shim and the client above the transport run as in production;
/// see [`gleam_client::in_process`] for what is left out). Hundreds of times faster than [`start`]: a waited
/// call costs the engine's work, not a round trip through QUIC and a session process.
///
/// # Panics
/// If the session cannot start, or the shim's session was already opened another way.
pub fn start_in_process() -> &'static Setup {
    SETUP.get_or_init(|| Setup::new(Peer::in_process()))
}

/// The session to fuzz with, started on first use: in this process if `GLEAM_FUZZ_SHIM_PEER` is
/// `in-process`, else a server process ([`start`] with [`default_gleam`]).
fn setup() -> &'static Setup {
    match std::env::var("GLEAM_FUZZ_SHIM_PEER").as_deref() {
        Ok("in-process") => start_in_process(),
        Ok("server") | Err(_) => start(&default_gleam()),
        Ok(other) => panic!("GLEAM_FUZZ_SHIM_PEER={other:?}: expected in-process or server"),
    }
}

/// The `gleam` binary to serve with: `$GLEAM_BIN`, else the newest of this workspace's builds.
pub fn default_gleam() -> PathBuf {
    if let Some(path) = std::env::var_os("GLEAM_BIN") {
        return PathBuf::from(path);
    }
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    ["debug", "release"]
        .iter()
        .map(|profile| target.join(profile).join("gleam"))
        .filter(|p| p.is_file())
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .expect("build the gleam binary first (cargo build --bin gleam), or set GLEAM_BIN")
}

/// Runs one input. Panics only on a bug.
pub fn run(data: &[u8]) {
    let setup = setup();
    let _one_at_a_time = RUN.lock().unwrap_or_else(PoisonError::into_inner);
    let mut u = Unstructured::new(data);
    let mut ops = Vec::new();
    while ops.len() < MAX_OPS {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    let mut input = Input::new(setup);
    // The context is current per thread: make it current on this one.
    // SAFETY: a context handle the shim gave.
    check("cuCtxSetCurrent", unsafe {
        cu::cuCtxSetCurrent(setup.ctx as _)
    });
    let trace = std::env::var_os("GLEAM_FUZZ_TRACE").is_some();
    for op in &ops {
        if trace {
            eprintln!("{op:?}");
        }
        let started = std::time::Instant::now();
        input.run(op);
        note_if_slow(started, op);
    }
    let started = std::time::Instant::now();
    input.clean_up();
    note_if_slow(started, &"the input's clean-up");
}

/// An operation this slow is worth a line: libFuzzer reports a slow input as a whole, without saying which
/// call of it took the time.
const SLOW_OP: std::time::Duration = std::time::Duration::from_secs(2);

fn note_if_slow(started: std::time::Instant, what: &dyn std::fmt::Debug) {
    let took = started.elapsed();
    if took >= SLOW_OP {
        eprintln!("gleam-fuzz: slow operation ({took:?}): {what:?}");
    }
}

fn check(what: &str, r: CUresult) {
    assert!(r.is_success(), "{what}: {r:?}");
}

impl Peer {
    /// Starts `gleam serve --backend emu` and points the shim at it.
    fn server(gleam: &Path) -> Self {
        let config_dir =
            std::env::temp_dir().join(format!("gleam-fuzz-shim-{}", std::process::id()));
        std::fs::create_dir_all(&config_dir).expect("a config dir for the fuzz server");
        let mut command = Command::new(gleam);
        command
            .args(["serve", "127.0.0.1:0", "--backend", "emu", "--config-dir"])
            .arg(&config_dir)
            .env("GLEAM_EMU_MEMORY", EMU_MEMORY.to_string())
            .env(
                "GLEAM_LOG",
                std::env::var("GLEAM_LOG").unwrap_or_else(|_| "error".into()),
            )
            .env_remove("LD_LIBRARY_PATH")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: between fork and exec, one async-signal-safe syscall: the server dies with this process.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut server = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", gleam.display()));
        let mut line = String::new();
        BufReader::new(server.stdout.take().expect("piped stdout"))
            .read_line(&mut line)
            .expect("the server's listening line");
        let target = line
            .trim()
            .strip_prefix("gleam serve: listening on ")
            .and_then(|rest| rest.split_once(" as "))
            .map(|(addr, peer)| format!("{peer}@{addr}"))
            .unwrap_or_else(|| panic!("unexpected first line from gleam serve: {line:?}"));
        // SAFETY: set before the shim's first call (which reads them, once); nothing else in this process
        // reads the environment concurrently: the fuzz target runs on one thread, and the corpus test that
        // calls this is alone in its test binary.
        unsafe {
            std::env::set_var("GLEAM_PEER", &target);
            std::env::set_var("GLEAM_CONFIG_DIR", &config_dir);
            if std::env::var_os("GLEAM_LOG").is_none() {
                std::env::set_var("GLEAM_LOG", "error");
            }
        }
        Self::Server(Mutex::new(server))
    }

    /// Hands the shim a session with the engine in this process.
    fn in_process() -> Self {
        if std::env::var_os("GLEAM_LOG").is_none() {
            // SAFETY: as in `server`: set before the shim reads it, with no other thread reading the
            // environment.
            unsafe { std::env::set_var("GLEAM_LOG", "error") };
        }
        let engine = Session::new(EmuBackend::new(EmuConfig::with_memory(EMU_MEMORY)));
        let client = gleam_client::Client::in_process(Box::new(Engine(engine)))
            .expect("the in-process engine greets the client");
        if gleamcuda::state::install(client).is_err() {
            panic!("the shim's session was opened before the in-process peer was installed");
        }
        Self::InProcess
    }

    /// Whether the peer is still serving (a crash of the server is a bug the fuzzer found).
    fn alive(&self) -> bool {
        match self {
            Self::Server(child) => {
                let mut child = child.lock().unwrap_or_else(PoisonError::into_inner);
                matches!(child.try_wait(), Ok(None))
            }
            Self::InProcess => true,
        }
    }
}

/// The serving side's session engine as a peer in this process.
struct Engine(Session<EmuBackend>);

impl LocalPeer for Engine {
    fn handle(&mut self, request: Request, bulk: Bytes) -> Option<(ReplyFrame, Bytes)> {
        self.0
            .handle_pieces(request, bulk.into())
            .map(|answer| (answer.frame, Bytes::from(answer.bulk)))
    }
}

impl Setup {
    fn new(peer: Peer) -> Self {
        // SAFETY: (every call below) valid out-pointers to locals, NUL-terminated strings, a NUL-terminated
        // PTX image.
        unsafe {
            check("cuInit", cu::cuInit(0));
            let mut ctx = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                cu::cuDevicePrimaryCtxRetain(&raw mut ctx, 0),
            );
            check("cuCtxSetCurrent", cu::cuCtxSetCurrent(ctx));
            let image = CString::new(KERNELS_PTX).expect("no NUL in the PTX");
            let mut module = std::ptr::null_mut();
            check(
                "cuModuleLoadData",
                cu::cuModuleLoadData(&raw mut module, image.as_ptr().cast()),
            );
            let mut functions = [0usize; 3];
            for (slot, name) in functions.iter_mut().zip([c"add", c"count", c"mix"]) {
                let mut f = std::ptr::null_mut();
                check(
                    "cuModuleGetFunction",
                    cu::cuModuleGetFunction(&raw mut f, module, name.as_ptr()),
                );
                *slot = f as usize;
            }
            let (mut global, mut bytes) = (0u64, 0usize);
            check(
                "cuModuleGetGlobal_v2",
                cu::cuModuleGetGlobal_v2(
                    &raw mut global,
                    &raw mut bytes,
                    module,
                    c"table".as_ptr(),
                ),
            );
            assert_eq!(bytes, 16, "the harness module's table");
            let (mut free, mut total) = (0usize, 0usize);
            check(
                "cuMemGetInfo_v2",
                cu::cuMemGetInfo_v2(&raw mut free, &raw mut total),
            );
            let names: Vec<CString> = gleam_protocol::api::EXPORTS
                .iter()
                .map(|(name, _)| CString::new(*name).expect("export names have no NUL"))
                .collect();
            let exports = gleam_protocol::api::EXPORTS
                .iter()
                .filter_map(|(name, _)| gleamcuda::exports::address(name))
                .map(|p| p as usize)
                .collect();
            Self {
                peer,
                ctx: ctx as usize,
                module: module as usize,
                functions,
                global,
                host: guarded(HOST_BYTES),
                params: guarded(PARAM_AREA),
                exports,
                names,
                free_at_start: free,
            }
        }
    }
}

/// `bytes` of zeroed read-write memory followed by an inaccessible page; its address.
fn guarded(bytes: usize) -> usize {
    let page = 4096;
    // SAFETY: an anonymous private mapping, then its last page made inaccessible; never unmapped.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            bytes + page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "mmap of the harness's host memory");
        let guard = p.cast::<u8>().add(bytes).cast::<c_void>();
        assert_eq!(
            libc::mprotect(guard, page, libc::PROT_NONE),
            0,
            "guard page"
        );
        p as usize
    }
}

// ---- The operations -----------------------------------------------------------------------------------

/// A device address.
#[derive(Arbitrary, Clone, Copy, Debug)]
enum Dev {
    /// Into (or a little past) one of this input's allocations.
    Alloc {
        index: u8,
        offset: u32,
    },
    /// Into (or past) the setup module's 16-byte global.
    Global {
        offset: u8,
    },
    /// Anything.
    Raw(u64),
    Null,
}

/// A host address.
#[derive(Arbitrary, Clone, Copy, Debug)]
enum Host {
    Buffer { offset: u16 },
    Pinned { index: u8, offset: u32 },
    Null,
}

/// Either side of a unified `cuMemcpy`.
#[derive(Arbitrary, Clone, Copy, Debug)]
enum Addr {
    Dev(Dev),
    Host(Host),
}

/// A byte count.
#[derive(Arbitrary, Clone, Copy, Debug)]
enum Count {
    Small(u16),
    /// What fits the device side exactly (or 64 bytes).
    Fit,
    /// A little more than fits.
    Over(u8),
    Huge(u64),
    Max,
}

#[derive(Arbitrary, Clone, Copy, Debug)]
enum Size {
    Zero,
    Small(u16),
    Medium(u32),
    Huge(u64),
}

#[derive(Arbitrary, Clone, Copy, Debug)]
enum StreamSel {
    Null,
    Legacy,
    PerThread,
    Created(u8),
    Raw(u64),
}

#[derive(Arbitrary, Clone, Copy, Debug)]
enum FuncSel {
    Add,
    Count,
    Mix,
    /// `add` of a module this input loaded.
    Loaded(u8),
    Raw(u64),
    Null,
}

/// How a launch passes its arguments.
#[derive(Arbitrary, Clone, Debug)]
enum Args {
    /// `kernelParams`, with one entry made NULL if asked; `n` is the element count given to `add`.
    Params {
        null_at: Option<u8>,
        n: u16,
    },
    /// `extra`: up to 8 key/value pairs chosen by `keys`, with the buffer size `size`.
    Extra {
        keys: Vec<u8>,
        size: ExtraSize,
        n: u16,
    },
    /// Both (invalid) or neither.
    Both,
    Neither,
}

#[derive(Arbitrary, Clone, Copy, Debug)]
enum ExtraSize {
    Exact,
    Short(u8),
    Long(u16),
    Any(u64),
}

#[derive(Arbitrary, Clone, Debug)]
enum Symbol {
    Export(u16),
    /// An export's name with a suffix (`_v2`, `_ptsz`...) or other bytes appended.
    Suffixed(u16, Vec<u8>),
    Bytes(Vec<u8>),
    Null,
}

#[derive(Arbitrary, Clone, Copy, Debug)]
enum TableId {
    Known(u8),
    Raw([u8; 16]),
    Null,
}

#[derive(Arbitrary, Clone, Debug)]
enum Name {
    Known(u8),
    Bytes(Vec<u8>),
    Null,
}

#[derive(Arbitrary, Clone, Copy, Debug)]
enum DeviceQuery {
    Attribute(u32),
    Name(i32),
    PciBusId(i32),
    Uuid,
    TotalMem,
}

#[derive(Arbitrary, Clone, Debug)]
enum Op {
    Alloc(Size),
    AllocAsync(Size, StreamSel),
    Free(Dev),
    FreeAsync(Dev, StreamSel),
    HostAlloc {
        size: Size,
        flags: u32,
        plain: bool,
    },
    FreeHost(Host),
    HtoD {
        dst: Dev,
        src: Host,
        count: Count,
        stream: Option<StreamSel>,
    },
    DtoH {
        dst: Host,
        src: Dev,
        count: Count,
        stream: Option<StreamSel>,
    },
    Unified {
        dst: Addr,
        src: Addr,
        count: Count,
        stream: Option<StreamSel>,
    },
    DtoD {
        dst: Dev,
        src: Dev,
        count: Count,
        stream: Option<StreamSel>,
    },
    Memset {
        dst: Dev,
        value: u32,
        count: Count,
        width: u8,
    },
    Attribute {
        attribute: u32,
        ptr: Addr,
        null_data: bool,
    },
    Attributes {
        attributes: Vec<u32>,
        ptr: Addr,
        nulls: u8,
    },
    AddressRange {
        ptr: Addr,
        base: bool,
        size: bool,
    },
    ProcAddress {
        symbol: Symbol,
        version: i32,
        flags: u64,
        v2: bool,
        status: bool,
    },
    ExportTable(TableId),
    GetGlobal {
        name: Name,
        bytes_out: bool,
        loaded: Option<u8>,
    },
    GetFunction(Name),
    LoadModule,
    UnloadModule(u8),
    Launch {
        func: FuncSel,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        stream: StreamSel,
        args: Args,
        how: u8,
        attrs: Vec<(u32, u32)>,
    },
    StreamCreate(u32),
    StreamDestroy(StreamSel),
    StreamSync(StreamSel),
    EventCreate(u32),
    EventRecord(u8, StreamSel),
    EventSync(u8),
    EventElapsed(u8, u8),
    EventDestroy(u8),
    FuncAttribute {
        func: FuncSel,
        attribute: i32,
        set: Option<i32>,
    },
    Occupancy {
        func: FuncSel,
        block: i32,
        smem: usize,
        limit: i32,
        callback: bool,
    },
    Device {
        query: DeviceQuery,
        dev: i32,
    },
    ErrorName {
        code: u32,
        string: bool,
    },
    HostDevicePointer {
        host: Host,
        flags: u32,
    },
    Sync,
}

// ---- One input ------------------------------------------------------------------------------------------

/// What this input made, so pointers can be resolved and everything cleaned up.
struct Input<'s> {
    setup: &'s Setup,
    /// Live device allocations: (base, size).
    allocs: Vec<(u64, u64)>,
    /// Live pinned allocations: (address, size).
    pinned: Vec<(usize, usize)>,
    streams: Vec<usize>,
    events: Vec<usize>,
    /// Modules this input loaded, with their `add` function.
    modules: Vec<(usize, usize)>,
}

/// A C string the shim may read (kept alive by the caller).
fn c_name(bytes: &[u8]) -> CString {
    CString::new(
        bytes
            .iter()
            .copied()
            .filter(|&b| b != 0)
            .collect::<Vec<u8>>(),
    )
    .expect("NULs removed")
}

const NAMES: [&std::ffi::CStr; 6] = [c"add", c"count", c"mix", c"table", c"counter", c"missing"];
const TABLES: [&str; 6] = [
    "6BD5FB6C5BF4E74A8987D93912FD9DF9",
    "42D85A8123F6CB478298F6E78A3AECDC",
    "A094798C2E742E7493F20800200C0A66",
    "C693336E1121DF11A8C368F355D89593",
    "D4082055BDE6704B8D34BA123C66E1F2",
    "00000000000000000000000000000000",
];

impl<'s> Input<'s> {
    fn new(setup: &'s Setup) -> Self {
        Self {
            setup,
            allocs: Vec::new(),
            pinned: Vec::new(),
            streams: Vec::new(),
            events: Vec::new(),
            modules: Vec::new(),
        }
    }

    fn host_ptr(&self, h: Host) -> (*mut c_void, usize) {
        match h {
            Host::Buffer { offset } => {
                let offset = usize::from(offset) % HOST_BYTES;
                (
                    (self.setup.host + offset) as *mut c_void,
                    HOST_BYTES - offset,
                )
            }
            Host::Pinned { index, offset } if !self.pinned.is_empty() => {
                let (p, size) = self.pinned[usize::from(index) % self.pinned.len()];
                let offset = offset as usize % size;
                ((p + offset) as *mut c_void, size - offset)
            }
            Host::Pinned { .. } | Host::Null => (std::ptr::null_mut(), 0),
        }
    }

    fn dev_ptr(&self, d: Dev) -> u64 {
        match d {
            Dev::Alloc { index, offset } if !self.allocs.is_empty() => {
                let (base, size) = self.allocs[usize::from(index) % self.allocs.len()];
                base + u64::from(offset) % (size + 64)
            }
            Dev::Alloc { .. } => 0,
            Dev::Global { offset } => self.setup.global + u64::from(offset % 32),
            Dev::Raw(v) => v,
            Dev::Null => 0,
        }
    }

    fn addr(&self, a: Addr) -> (u64, Option<usize>) {
        match a {
            Addr::Dev(d) => (self.dev_ptr(d), None),
            Addr::Host(h) => {
                let (p, avail) = self.host_ptr(h);
                (p as u64, Some(avail))
            }
        }
    }

    /// Bytes of device memory from `ptr` to the end of its range, as the session knows it (0 if none).
    fn device_room(&self, ptr: u64) -> u64 {
        if ptr == 0 {
            return 0;
        }
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers.
        let r = unsafe { cu::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, ptr) };
        if r.is_success() && ptr >= base {
            (base + size as u64).saturating_sub(ptr)
        } else {
            0
        }
    }

    /// Whether the shim's allocation table holds `ptr` as device memory (how `cuMemcpy` classifies it).
    fn in_device_table(&self, ptr: u64) -> bool {
        let mut kind = 0u32;
        // SAFETY: a 4-byte out-value for CU_POINTER_ATTRIBUTE_MEMORY_TYPE.
        let r = unsafe { cu::cuPointerGetAttribute((&raw mut kind).cast(), 2, ptr) };
        r.is_success() && kind == 2
    }

    fn count(&self, c: Count, room: u64) -> u64 {
        match c {
            Count::Small(n) => u64::from(n),
            Count::Fit if room > 0 => room,
            Count::Fit => 64,
            Count::Over(k) => room + 1 + u64::from(k),
            Count::Huge(n) => n,
            Count::Max => u64::MAX,
        }
    }

    fn stream(&self, s: StreamSel) -> *mut c_void {
        match s {
            StreamSel::Null => std::ptr::null_mut(),
            StreamSel::Legacy => CU_STREAM_LEGACY as *mut c_void,
            StreamSel::PerThread => CU_STREAM_PER_THREAD as *mut c_void,
            StreamSel::Created(i) if !self.streams.is_empty() => {
                self.streams[usize::from(i) % self.streams.len()] as *mut c_void
            }
            StreamSel::Created(_) => std::ptr::null_mut(),
            StreamSel::Raw(v) => v as *mut c_void,
        }
    }

    fn event(&self, i: u8) -> *mut c_void {
        if self.events.is_empty() {
            return 0xdead_0000 as *mut c_void;
        }
        self.events[usize::from(i) % self.events.len()] as *mut c_void
    }

    fn func(&self, f: FuncSel) -> (*mut c_void, Option<usize>) {
        let [add, count, mix] = self.setup.functions;
        match f {
            FuncSel::Add => (add as *mut c_void, Some(0)),
            FuncSel::Count => (count as *mut c_void, Some(1)),
            FuncSel::Mix => (mix as *mut c_void, Some(2)),
            FuncSel::Loaded(i) if !self.modules.is_empty() => {
                let (_, add) = self.modules[usize::from(i) % self.modules.len()];
                (add as *mut c_void, Some(0))
            }
            FuncSel::Loaded(_) | FuncSel::Null => (std::ptr::null_mut(), None),
            FuncSel::Raw(v) => (v as *mut c_void, None),
        }
    }

    fn size(s: Size) -> usize {
        match s {
            Size::Zero => 0,
            Size::Small(n) => usize::from(n),
            Size::Medium(n) => n as usize % (MAX_KEPT_ALLOC as usize + 1),
            Size::Huge(n) => n as usize,
        }
    }

    fn keep_alloc(&mut self, r: CUresult, p: u64, size: usize) {
        if !r.is_success() {
            return;
        }
        if size as u64 > MAX_KEPT_ALLOC {
            // SAFETY: an allocation just made.
            check("cuMemFree_v2", unsafe { cu::cuMemFree_v2(p) });
        } else {
            self.allocs.push((p, size as u64));
        }
    }

    fn forget_alloc(&mut self, p: u64, r: CUresult) {
        if let Some(i) = self.allocs.iter().position(|&(base, _)| base == p) {
            assert!(r.is_success(), "freeing live allocation {p:#x}: {r:?}");
            self.allocs.swap_remove(i);
        }
    }

    #[allow(clippy::too_many_lines)]
    fn run(&mut self, op: &Op) {
        match op {
            Op::Alloc(size) => {
                let n = Self::size(*size);
                let mut p = 0u64;
                // SAFETY: a valid out-pointer.
                let r = unsafe { cu::cuMemAlloc_v2(&raw mut p, n) };
                self.keep_alloc(r, p, n);
            }
            Op::AllocAsync(size, stream) => {
                let n = Self::size(*size);
                let mut p = 0u64;
                // SAFETY: a valid out-pointer; any stream value.
                let r = unsafe { cu::cuMemAllocAsync(&raw mut p, n, self.stream(*stream)) };
                self.keep_alloc(r, p, n);
            }
            Op::Free(d) => {
                let p = self.dev_ptr(*d);
                // SAFETY: any address.
                let r = unsafe { cu::cuMemFree_v2(p) };
                self.forget_alloc(p, r);
            }
            Op::FreeAsync(d, stream) => {
                let p = self.dev_ptr(*d);
                let live = self.allocs.iter().any(|&(base, _)| base == p);
                // A live allocation is freed in order with everything else (the legacy stream), and
                // waited for: kernels of other streams may still use it, and a free racing them is the
                // application's fault (a real GPU faults too, which would poison this session).
                let stream = if live {
                    CU_STREAM_LEGACY as *mut c_void
                } else {
                    self.stream(*stream)
                };
                // SAFETY: any address and stream.
                let r = unsafe { cu::cuMemFreeAsync(p, stream) };
                self.forget_alloc(p, r);
                if live {
                    // SAFETY: no arguments.
                    unsafe { cu::cuCtxSynchronize() };
                }
            }
            Op::HostAlloc { size, flags, plain } => {
                let n = Self::size(*size).min(MAX_PINNED);
                let mut p = 0u64;
                // SAFETY: a valid out-pointer.
                let r = unsafe {
                    if *plain {
                        cu::cuMemAllocHost_v2((&raw mut p).cast::<*mut c_void>(), n)
                    } else {
                        cu::cuMemHostAlloc(&raw mut p, n, *flags)
                    }
                };
                if r.is_success() {
                    assert!(p != 0 && n > 0, "pinned allocation of {n} bytes at {p:#x}");
                    self.pinned.push((p as usize, n));
                }
            }
            Op::FreeHost(h) => {
                let (p, _) = self.host_ptr(*h);
                // SAFETY: any pointer: the shim frees only what its table says it allocated.
                let r = unsafe { cu::cuMemFreeHost(p as u64) };
                if let Some(i) = self.pinned.iter().position(|&(q, _)| q == p as usize) {
                    assert!(r.is_success(), "cuMemFreeHost of a live allocation: {r:?}");
                    self.pinned.swap_remove(i);
                } else if !p.is_null() {
                    // NULL is freed with success, as NVIDIA's driver does.
                    assert!(
                        !r.is_success(),
                        "cuMemFreeHost({p:?}) freed something not allocated"
                    );
                }
            }
            Op::HtoD {
                dst,
                src,
                count,
                stream,
            } => {
                let dst = self.dev_ptr(*dst);
                let room = self.device_room(dst);
                let limit = device_limit(room);
                let (src, avail) = self.host_ptr(*src);
                let mut n = self.count(*count, room);
                if n <= limit && n > avail as u64 {
                    // The device could take it: the source must hold it (the application's promise).
                    n = avail as u64;
                }
                let n = usize::try_from(n).unwrap_or(usize::MAX);
                // SAFETY: `src` holds `n` bytes whenever the destination can take them.
                let r = unsafe {
                    match stream {
                        None => cu::cuMemcpyHtoD_v2(dst, src, n),
                        Some(s) => cu::cuMemcpyHtoDAsync_v2(dst, src, n, self.stream(*s)),
                    }
                };
                assert!(
                    n as u64 <= limit || !r.is_success(),
                    "HtoD of {n} bytes into {room} at {dst:#x} succeeded (allocations: {:x?})",
                    self.allocs
                );
            }
            Op::DtoH {
                dst,
                src,
                count,
                stream,
            } => {
                let src = self.dev_ptr(*src);
                let room = self.device_room(src);
                let limit = device_limit(room);
                let (dst, avail) = self.host_ptr(*dst);
                let mut n = self.count(*count, room);
                if n <= limit && n > avail as u64 {
                    n = avail as u64;
                }
                let n = usize::try_from(n).unwrap_or(usize::MAX);
                // SAFETY: `dst` holds `n` bytes whenever the source has them.
                let r = unsafe {
                    match stream {
                        None => cu::cuMemcpyDtoH_v2(dst, src, n),
                        Some(s) => cu::cuMemcpyDtoHAsync_v2(dst, src, n, self.stream(*s)),
                    }
                };
                assert!(
                    n as u64 <= limit || !r.is_success(),
                    "DtoH of {n} bytes from {room} at {src:#x} succeeded (allocations: {:x?})",
                    self.allocs
                );
            }
            Op::Unified {
                dst,
                src,
                count,
                stream,
            } => {
                let (dst, dst_host) = self.addr(*dst);
                let (src, src_host) = self.addr(*src);
                // cuMemcpy takes a pointer the shim's table does not know for host memory: a device
                // address it does not know would be written as host memory, as NVIDIA's driver would
                // treat an unregistered pointer. The application never passes one; neither does this.
                let dst_dev = self.in_device_table(dst);
                let src_dev = self.in_device_table(src);
                if (!dst_dev && dst_host.is_none()) || (!src_dev && src_host.is_none()) {
                    return;
                }
                let dst_room = if dst_dev { self.device_room(dst) } else { 0 };
                let src_room = if src_dev { self.device_room(src) } else { 0 };
                let mut n = self.count(*count, dst_room.max(src_room));
                let avail = |h: Option<usize>| h.unwrap_or(usize::MAX) as u64;
                n = match (dst_dev, src_dev) {
                    (true, true) => n,
                    (true, false) if n <= dst_room => n.min(avail(src_host)),
                    (false, true) if n <= src_room => n.min(avail(dst_host)),
                    (false, false) => n.min(avail(src_host)).min(avail(dst_host)),
                    _ => n,
                };
                let n = usize::try_from(n).unwrap_or(usize::MAX);
                // SAFETY: every host side holds `n` bytes wherever the shim would touch them.
                let r = unsafe {
                    match stream {
                        None => cu::cuMemcpy(dst, src, n),
                        Some(s) => cu::cuMemcpyAsync(dst, src, n, self.stream(*s)),
                    }
                };
                let too_big = (dst_dev && n as u64 > dst_room) || (src_dev && n as u64 > src_room);
                assert!(
                    !too_big || (dst_dev && src_dev) || !r.is_success(),
                    "cuMemcpy of {n} bytes past a device range succeeded"
                );
            }
            Op::DtoD {
                dst,
                src,
                count,
                stream,
            } => {
                let (dst, src) = (self.dev_ptr(*dst), self.dev_ptr(*src));
                let n = self.count(*count, self.device_room(dst));
                let n = usize::try_from(n).unwrap_or(usize::MAX);
                // SAFETY: device addresses only: nothing of this process is touched.
                unsafe {
                    match stream {
                        None => cu::cuMemcpyDtoD_v2(dst, src, n),
                        Some(s) => cu::cuMemcpyDtoDAsync_v2(dst, src, n, self.stream(*s)),
                    }
                };
            }
            Op::Memset {
                dst,
                value,
                count,
                width,
            } => {
                let dst = self.dev_ptr(*dst);
                let n = usize::try_from(self.count(*count, self.device_room(dst)))
                    .unwrap_or(usize::MAX);
                // SAFETY: device addresses only.
                unsafe {
                    match width % 3 {
                        0 => cu::cuMemsetD8_v2(dst, *value as u8, n),
                        1 => cu::cuMemsetD16_v2(dst, *value as u16, n / 2),
                        _ => cu::cuMemsetD32_v2(dst, *value, n / 4),
                    }
                };
            }
            Op::Attribute {
                attribute,
                ptr,
                null_data,
            } => {
                let (ptr, _) = self.addr(*ptr);
                let mut data = [0u8; 64];
                let out = if *null_data {
                    std::ptr::null_mut()
                } else {
                    data.as_mut_ptr().cast()
                };
                // SAFETY: 64 writable bytes (every attribute is at most 16) or NULL.
                unsafe { cu::cuPointerGetAttribute(out, *attribute, ptr) };
            }
            Op::Attributes {
                attributes,
                ptr,
                nulls,
            } => {
                let (ptr, _) = self.addr(*ptr);
                let mut ids: Vec<u32> = attributes.iter().copied().take(8).collect();
                let mut slots = [[0u8; 64]; 8];
                let mut data: Vec<*mut c_void> = slots
                    .iter_mut()
                    .enumerate()
                    .map(|(i, s)| {
                        if nulls & (1 << i) != 0 {
                            std::ptr::null_mut()
                        } else {
                            s.as_mut_ptr().cast()
                        }
                    })
                    .collect();
                let count = ids.len() as u32;
                // SAFETY: `count` ids and `count` data pointers, each NULL or 64 writable bytes.
                unsafe {
                    cu::cuPointerGetAttributes(count, ids.as_mut_ptr(), data.as_mut_ptr(), ptr)
                };
            }
            Op::AddressRange { ptr, base, size } => {
                let (ptr, _) = self.addr(*ptr);
                let (mut b, mut s) = (0u64, 0usize);
                let bp = if *base {
                    &raw mut b
                } else {
                    std::ptr::null_mut()
                };
                let sp = if *size {
                    &raw mut s
                } else {
                    std::ptr::null_mut()
                };
                // SAFETY: each out-pointer NULL or valid.
                unsafe { cu::cuMemGetAddressRange_v2(bp, sp, ptr) };
            }
            Op::ProcAddress {
                symbol,
                version,
                flags,
                v2,
                status,
            } => self.proc_address(symbol, *version, *flags, *v2, *status),
            Op::ExportTable(id) => {
                let bytes: Option<[u8; 16]> = match id {
                    TableId::Known(i) => {
                        let hex = TABLES[usize::from(*i) % TABLES.len()].as_bytes();
                        let mut out = [0u8; 16];
                        for (o, pair) in out.iter_mut().zip(hex.chunks(2)) {
                            *o = u8::from_str_radix(std::str::from_utf8(pair).unwrap_or("0"), 16)
                                .unwrap_or(0);
                        }
                        Some(out)
                    }
                    TableId::Raw(b) => Some(*b),
                    TableId::Null => None,
                };
                let mut table = std::ptr::null();
                let id = bytes
                    .as_ref()
                    .map_or(std::ptr::null(), |b| b.as_ptr().cast());
                // SAFETY: a valid out-pointer and a 16-byte id (or NULL).
                let r = unsafe { cu::cuGetExportTable(&raw mut table, id) };
                if r.is_success() {
                    assert!(
                        !table.is_null(),
                        "cuGetExportTable succeeded with a NULL table"
                    );
                    // SAFETY: a table's first slot is readable (its size, or a function).
                    let _first = unsafe { table.cast::<usize>().read_volatile() };
                }
            }
            Op::GetGlobal {
                name,
                bytes_out,
                loaded,
            } => {
                let module = match loaded {
                    Some(i) if !self.modules.is_empty() => {
                        self.modules[usize::from(*i) % self.modules.len()].0
                    }
                    Some(_) => 0xbad0,
                    None => self.setup.module,
                };
                let name = self.name(name);
                let (mut p, mut n) = (0u64, 0usize);
                let np = if *bytes_out {
                    &raw mut n
                } else {
                    std::ptr::null_mut()
                };
                let name_ptr = name.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
                // SAFETY: valid or NULL out-pointers, a NUL-terminated name or NULL.
                unsafe {
                    cu::cuModuleGetGlobal_v2(&raw mut p, np, module as *mut c_void, name_ptr)
                };
            }
            Op::GetFunction(name) => {
                let name = self.name(name);
                let mut f = std::ptr::null_mut();
                let name_ptr = name.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
                // SAFETY: a valid out-pointer, a NUL-terminated name or NULL.
                unsafe {
                    cu::cuModuleGetFunction(&raw mut f, self.setup.module as *mut c_void, name_ptr)
                };
            }
            Op::LoadModule => {
                if self.modules.len() >= MAX_OBJECTS {
                    return;
                }
                let image = CString::new(KERNELS_PTX).expect("no NUL in the PTX");
                let mut module = std::ptr::null_mut();
                // SAFETY: a NUL-terminated PTX image, valid out-pointers, a NUL-terminated name.
                unsafe {
                    // A deferred error of an earlier operation would come back from the load instead.
                    cu::cuCtxSynchronize();
                    check(
                        "cuModuleLoadData",
                        cu::cuModuleLoadData(&raw mut module, image.as_ptr().cast()),
                    );
                    let mut add = std::ptr::null_mut();
                    check(
                        "cuModuleGetFunction",
                        cu::cuModuleGetFunction(&raw mut add, module, c"add".as_ptr()),
                    );
                    self.modules.push((module as usize, add as usize));
                }
            }
            Op::UnloadModule(i) => {
                if self.modules.is_empty() {
                    return;
                }
                let (module, _) = self
                    .modules
                    .swap_remove(usize::from(*i) % self.modules.len());
                // SAFETY: a module this input loaded.
                check("cuModuleUnload", unsafe {
                    cu::cuModuleUnload(module as *mut c_void)
                });
            }
            Op::Launch {
                func,
                grid,
                block,
                shared,
                stream,
                args,
                how,
                attrs,
            } => {
                self.launch(*func, *grid, *block, *shared, *stream, args, *how, attrs);
            }
            Op::StreamCreate(flags) => {
                if self.streams.len() >= MAX_OBJECTS {
                    return;
                }
                let mut s = std::ptr::null_mut();
                // SAFETY: a valid out-pointer.
                if unsafe { cu::cuStreamCreate(&raw mut s, *flags) }.is_success() {
                    self.streams.push(s as usize);
                }
            }
            Op::StreamDestroy(s) => {
                let stream = self.stream(*s);
                // SAFETY: any stream value.
                let r = unsafe { cu::cuStreamDestroy_v2(stream) };
                if let Some(i) = self.streams.iter().position(|&x| x == stream as usize) {
                    assert!(r.is_success(), "destroying a live stream: {r:?}");
                    self.streams.swap_remove(i);
                }
            }
            Op::StreamSync(s) => {
                // SAFETY: any stream value.
                unsafe { cu::cuStreamSynchronize(self.stream(*s)) };
            }
            Op::EventCreate(flags) => {
                if self.events.len() >= MAX_OBJECTS {
                    return;
                }
                let mut e = std::ptr::null_mut();
                // SAFETY: a valid out-pointer.
                if unsafe { cu::cuEventCreate(&raw mut e, *flags) }.is_success() {
                    self.events.push(e as usize);
                }
            }
            Op::EventRecord(e, s) => {
                // SAFETY: any event and stream values.
                unsafe { cu::cuEventRecord(self.event(*e), self.stream(*s)) };
            }
            Op::EventSync(e) => {
                // SAFETY: any event value.
                unsafe { cu::cuEventSynchronize(self.event(*e)) };
            }
            Op::EventElapsed(a, b) => {
                let mut ms = 0f32;
                // SAFETY: a valid out-pointer; any event values.
                unsafe { cu::cuEventElapsedTime(&raw mut ms, self.event(*a), self.event(*b)) };
            }
            Op::EventDestroy(e) => {
                let event = self.event(*e);
                // SAFETY: any event value.
                let r = unsafe { cu::cuEventDestroy_v2(event) };
                if let Some(i) = self.events.iter().position(|&x| x == event as usize) {
                    assert!(r.is_success(), "destroying a live event: {r:?}");
                    self.events.swap_remove(i);
                }
            }
            Op::FuncAttribute {
                func,
                attribute,
                set,
            } => {
                let (f, _) = self.func(*func);
                let mut v = 0i32;
                // SAFETY: a valid out-pointer; any function value.
                unsafe {
                    match set {
                        None => cu::cuFuncGetAttribute(&raw mut v, *attribute, f),
                        Some(value) => cu::cuFuncSetAttribute(f, *attribute, *value),
                    }
                };
            }
            Op::Occupancy {
                func,
                block,
                smem,
                limit,
                callback,
            } => {
                let (f, _) = self.func(*func);
                let (mut min_grid, mut size, mut blocks) = (0i32, 0i32, 0i32);
                extern "C" fn per_block(block: i32) -> usize {
                    usize::try_from(block).unwrap_or(0) * 8
                }
                let cb = if *callback {
                    per_block as *mut c_void
                } else {
                    std::ptr::null_mut()
                };
                // SAFETY: valid out-pointers, a callback of the C signature or NULL; any function value.
                unsafe {
                    cu::cuOccupancyMaxPotentialBlockSize(
                        &raw mut min_grid,
                        &raw mut size,
                        f,
                        cb,
                        *smem,
                        *limit,
                    );
                    cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                        &raw mut blocks,
                        f,
                        *block,
                        *smem,
                    );
                }
            }
            Op::Device { query, dev } => self.device(*query, *dev),
            Op::ErrorName { code, string } => {
                let mut s: *const c_char = std::ptr::null();
                // SAFETY: a valid out-pointer.
                let r = unsafe {
                    if *string {
                        cu::cuGetErrorString(*code, &raw mut s)
                    } else {
                        cu::cuGetErrorName(*code, &raw mut s)
                    }
                };
                if r.is_success() {
                    // SAFETY: on success the driver hands a static NUL-terminated string.
                    let text = unsafe { std::ffi::CStr::from_ptr(s) };
                    assert!(!text.to_bytes().is_empty());
                }
            }
            Op::HostDevicePointer { host, flags } => {
                let (p, _) = self.host_ptr(*host);
                let mut d = 0u64;
                // SAFETY: a valid out-pointer; any host pointer.
                unsafe { cu::cuMemHostGetDevicePointer_v2(&raw mut d, p as u64, *flags) };
            }
            Op::Sync => {
                // SAFETY: no arguments.
                unsafe { cu::cuCtxSynchronize() };
            }
        }
    }

    fn name(&self, name: &Name) -> Option<CString> {
        match name {
            Name::Known(i) => Some(NAMES[usize::from(*i) % NAMES.len()].to_owned()),
            Name::Bytes(b) => Some(c_name(b)),
            Name::Null => None,
        }
    }

    fn proc_address(&self, symbol: &Symbol, version: i32, flags: u64, v2: bool, status: bool) {
        let names = &self.setup.names;
        let name: Option<CString> = match symbol {
            Symbol::Export(i) => Some(names[usize::from(*i) % names.len()].clone()),
            Symbol::Suffixed(i, tail) => {
                let mut bytes = names[usize::from(*i) % names.len()].as_bytes().to_vec();
                bytes.extend_from_slice(tail);
                Some(c_name(&bytes))
            }
            Symbol::Bytes(b) => Some(c_name(b)),
            Symbol::Null => None,
        };
        let mut pfn = std::ptr::null_mut();
        let mut found = 0u32;
        let sp = if status {
            &raw mut found
        } else {
            std::ptr::null_mut()
        };
        let np = name.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
        // SAFETY: a NUL-terminated symbol or NULL, valid out-pointers (status NULL or valid).
        let r = unsafe {
            if v2 {
                cu::cuGetProcAddress_v2(np, &raw mut pfn, version, flags, sp)
            } else {
                cu::cuGetProcAddress(np, &raw mut pfn, version, flags)
            }
        };
        if r.is_success() && !pfn.is_null() {
            assert!(
                self.setup.exports.contains(&(pfn as usize)),
                "cuGetProcAddress({name:?}, {version}, {flags:#x}) returned {pfn:?}, not one of the library's exports"
            );
        }
    }

    fn device(&self, query: DeviceQuery, dev: i32) {
        let mut text = [0 as c_char; 256];
        // SAFETY: out-buffers of the sizes passed (lengths beyond 256 are clamped: the application's
        // promise), valid out-pointers.
        unsafe {
            match query {
                DeviceQuery::Attribute(a) => {
                    let mut v = 0i32;
                    cu::cuDeviceGetAttribute(&raw mut v, a, dev);
                }
                DeviceQuery::Name(len) => {
                    cu::cuDeviceGetName(text.as_mut_ptr(), len.min(256), dev);
                }
                DeviceQuery::PciBusId(len) => {
                    cu::cuDeviceGetPCIBusId(text.as_mut_ptr(), len.min(256), dev);
                }
                DeviceQuery::Uuid => {
                    let mut uuid = [0u8; 16];
                    cu::cuDeviceGetUuid_v2(uuid.as_mut_ptr().cast(), dev);
                }
                DeviceQuery::TotalMem => {
                    let mut bytes = 0usize;
                    cu::cuDeviceTotalMem_v2(&raw mut bytes, dev);
                }
            }
        }
    }

    /// Device pointers for `add`'s three arrays and the element count they can all take.
    fn add_arrays(&self, n: u16) -> ([u64; 3], u32) {
        if self.allocs.is_empty() {
            return ([0; 3], 0);
        }
        let pick = |k: usize| self.allocs[(usize::from(n) + k) % self.allocs.len()];
        let arrays = [pick(0), pick(1), pick(2)];
        let fits = arrays.iter().map(|&(_, size)| size / 4).min().unwrap_or(0);
        let count = u64::from(n).min(fits) as u32;
        (arrays.map(|(base, _)| base), count)
    }

    /// A parameter buffer for kernel `kind` (0 = add, 1 = count, 2 = mix), packed as the kernel lays it out.
    fn packed_params(&self, kind: Option<usize>, n: u16) -> Vec<u8> {
        match kind {
            Some(0) => {
                let (arrays, count) = self.add_arrays(n);
                let mut p = Vec::with_capacity(32);
                for a in arrays {
                    p.extend_from_slice(&a.to_le_bytes());
                }
                p.extend_from_slice(&count.to_le_bytes());
                p.extend_from_slice(&[0; 4]);
                p
            }
            Some(1) => u32::from(n).to_le_bytes().to_vec(),
            _ => (0..40u8).collect(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        func: FuncSel,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        stream: StreamSel,
        args: &Args,
        how: u8,
        attrs: &[(u32, u32)],
    ) {
        let (f, kind) = self.func(func);
        let (mut grid, block) = (grid, block);
        // Within the device's limits, a launch runs: keep it small (the interpreter runs every thread).
        let within = block.iter().all(|&d| d >= 1)
            && grid.iter().all(|&d| d >= 1)
            && block[0] <= 1024
            && block[1] <= 1024
            && block[2] <= 64
            && product(&block) <= 1024
            && grid[0] <= i32::MAX as u32
            && grid[1] <= 65535
            && grid[2] <= 65535;
        if within && product(&grid).saturating_mul(product(&block)) > MAX_LAUNCH_THREADS {
            grid = [1, 1, 1];
        }
        let stream = self.stream(stream);

        // Values each kernelParams entry points to (8 slots of 24 bytes: the largest parameter).
        let mut values = [[0u8; 24]; 8];
        let mut params: [*mut c_void; 8] = [std::ptr::null_mut(); 8];
        let mut extra: [*mut c_void; 16] = [std::ptr::null_mut(); 16];
        // The `size_t` an `extra` BUFFER_SIZE entry points to.
        let mut size_slot = match args {
            Args::Extra { size, n, .. } => {
                let packed = self.packed_params(kind, *n).len();
                match size {
                    ExtraSize::Exact => packed,
                    ExtraSize::Short(k) => packed.saturating_sub(usize::from(*k) + 1),
                    ExtraSize::Long(k) => packed + usize::from(*k),
                    ExtraSize::Any(v) => *v as usize,
                }
            }
            _ => 0,
        };
        let (params_ptr, extra_ptr): (*mut *mut c_void, *mut *mut c_void) = match args {
            Args::Params { null_at, n } => {
                let packed = self.packed_params(kind, *n);
                // Split the packed buffer back into the kernel's parameters.
                let layout: &[(usize, usize)] = match kind {
                    Some(0) => &[(0, 8), (8, 8), (16, 8), (24, 4)],
                    Some(1) => &[(0, 4)],
                    _ => &[(0, 24), (24, 4), (32, 8)],
                };
                for (i, &(offset, size)) in layout.iter().enumerate() {
                    values[i][..size].copy_from_slice(&packed[offset..offset + size]);
                    params[i] = values[i].as_mut_ptr().cast();
                }
                if let Some(i) = null_at {
                    params[usize::from(*i) % 8] = std::ptr::null_mut();
                }
                (params.as_mut_ptr(), std::ptr::null_mut())
            }
            Args::Extra { keys, n, .. } => {
                let packed = self.packed_params(kind, *n);
                let area = self.setup.params as *mut u8;
                // SAFETY: the parameter area holds PARAM_AREA bytes; `packed` is at most 40.
                unsafe { std::ptr::copy_nonoverlapping(packed.as_ptr(), area, packed.len()) };
                let keys: Vec<u8> = if keys.is_empty() {
                    vec![1, 2, 0]
                } else {
                    keys.clone()
                };
                for (pair, &key) in keys.iter().take(8).enumerate() {
                    let (k, v): (usize, *mut c_void) = match key % 6 {
                        0 => (CU_LAUNCH_PARAM_END, std::ptr::null_mut()),
                        1 => (CU_LAUNCH_PARAM_BUFFER_POINTER, area.cast()),
                        2 => (CU_LAUNCH_PARAM_BUFFER_SIZE, (&raw mut size_slot).cast()),
                        3 => (CU_LAUNCH_PARAM_BUFFER_POINTER, std::ptr::null_mut()),
                        4 => (CU_LAUNCH_PARAM_BUFFER_SIZE, std::ptr::null_mut()),
                        _ => (usize::from(key), area.cast()),
                    };
                    extra[pair * 2] = k as *mut c_void;
                    extra[pair * 2 + 1] = v;
                }
                (std::ptr::null_mut(), extra.as_mut_ptr())
            }
            Args::Both => (params.as_mut_ptr(), extra.as_mut_ptr()),
            Args::Neither => (std::ptr::null_mut(), std::ptr::null_mut()),
        };
        // SAFETY: every pointer the shim may follow points into this frame's arrays or the parameter
        // area, each as large as the C API lets the shim read.
        unsafe {
            match how % 3 {
                0 => cu::cuLaunchKernel(
                    f, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared, stream,
                    params_ptr, extra_ptr,
                ),
                1 => cu::cuLaunchCooperativeKernel(
                    f, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared, stream,
                    params_ptr,
                ),
                _ => {
                    let attrs: Vec<LaunchAttribute> = attrs
                        .iter()
                        .take(4)
                        .map(|&(id, v)| LaunchAttribute {
                            id,
                            pad: 0,
                            value: [v; 16],
                        })
                        .collect();
                    let config = LaunchConfig {
                        grid,
                        block,
                        shared_mem_bytes: shared,
                        stream,
                        attrs: if attrs.is_empty() {
                            std::ptr::null()
                        } else {
                            attrs.as_ptr()
                        },
                        num_attrs: attrs.len() as u32,
                    };
                    cu::cuLaunchKernelEx((&raw const config).cast(), f, params_ptr, extra_ptr)
                }
            }
        };
    }

    /// Frees and destroys what this input made, then checks the session is healthy and nothing leaked.
    fn clean_up(mut self) {
        // SAFETY: (every call) handles and pointers this input made and still owns.
        unsafe {
            for (p, _) in std::mem::take(&mut self.allocs) {
                check("cuMemFree_v2", cu::cuMemFree_v2(p));
            }
            for (p, _) in std::mem::take(&mut self.pinned) {
                check("cuMemFreeHost", cu::cuMemFreeHost(p as u64));
            }
            for (module, _) in std::mem::take(&mut self.modules) {
                check("cuModuleUnload", cu::cuModuleUnload(module as *mut c_void));
            }
            for e in std::mem::take(&mut self.events) {
                check("cuEventDestroy_v2", cu::cuEventDestroy_v2(e as *mut c_void));
            }
            for s in std::mem::take(&mut self.streams) {
                check(
                    "cuStreamDestroy_v2",
                    cu::cuStreamDestroy_v2(s as *mut c_void),
                );
            }
            // The first synchronisation may report a deferred error of this input; the second must not.
            let first = cu::cuCtxSynchronize();
            assert!(
                !first.is_sticky(),
                "the session has a sticky error ({first:?}): an input made a kernel fault (a harness bug)"
            );
            let second = cu::cuCtxSynchronize();
            assert!(
                second.is_success(),
                "the session is unusable after an input: {second:?} (peer alive: {})",
                self.setup.peer.alive()
            );
            let (mut free, mut total) = (0usize, 0usize);
            check(
                "cuMemGetInfo_v2",
                cu::cuMemGetInfo_v2(&raw mut free, &raw mut total),
            );
            assert_eq!(
                free, self.setup.free_at_start,
                "device memory not returned after an input freed everything it allocated"
            );
        }
    }
}

/// The most bytes a copy at a device pointer with `room` bytes (as [`Input::device_room`] reports them) may
/// move and succeed. Inside an allocation, exactly `room`: more must fail before any host memory is touched
/// (issue 11). Outside every allocation the session reports (room 0: past an allocation's end, a made-up
/// address), CUDA promises nothing: a real GPU takes a copy into the slack its allocation granularity
/// leaves after a buffer (as the emu does), so only more than the whole device's memory must fail, and the
/// harness keeps its side by never passing more host memory than it has there.
fn device_limit(room: u64) -> u64 {
    if room > 0 { room } else { EMU_MEMORY }
}

/// The product of launch dimensions, saturating.
fn product(dims: &[u32; 3]) -> u64 {
    dims.iter()
        .fold(1u64, |n, &d| n.saturating_mul(u64::from(d)))
}

/// `CUlaunchConfig`, as the driver API lays it out.
#[repr(C)]
struct LaunchConfig {
    grid: [u32; 3],
    block: [u32; 3],
    shared_mem_bytes: u32,
    stream: *mut c_void,
    attrs: *const LaunchAttribute,
    num_attrs: u32,
}

/// `CUlaunchAttribute`: an id, padding, a 64-byte value.
#[repr(C)]
#[derive(Clone, Copy)]
struct LaunchAttribute {
    id: u32,
    pad: u32,
    value: [u32; 16],
}
