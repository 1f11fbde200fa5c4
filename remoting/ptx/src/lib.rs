//! `gleam-ptx`: a PTX parser and interpreter, so kernels can run honestly on a CPU when no GPU is around.
//!
//! The main types:
//! - [`Module`]: a parsed PTX module ([`Module::parse`], errors as [`ParseError`] naming the line), holding
//!   its [`Kernel`]s and module-scope [`GlobalVar`]s. Every kernel is compiled once at parse time into a
//!   compact instruction array with resolved register slots and branch targets (`.func` calls are
//!   inlined); an instruction the interpreter cannot execute is recorded ([`Kernel::unsupported`]) and
//!   reported by [`launch`] as [`ExecError::Unsupported`] with its PTX line: never a silent wrong result.
//! - [`Kernel`]: an entry point's parameter layout ([`Param`]) and resource figures (shared, local, regs).
//! - [`GlobalMemory`]: device global memory, owned by the caller (the emu backend); [`FlatMemory`] is a
//!   simple lock-free implementation for tests and tools.
//! - [`launch`]: runs a kernel over a grid ([`LaunchConfig`]) and returns [`LaunchStats`] or an [`ExecError`].
//!
//! Execution model: the threads of a block run as 32-lane warps; within a warp the lanes run in lockstep
//! with per-lane program counters, and each step executes the instruction at the minimum PC among runnable
//! lanes (which reconverges structured code and lets `shfl.sync`/`vote.sync` see every participating lane).
//! Warps of a block take turns in time slices; `bar.sync` parks a warp until every live warp of the block
//! has arrived. Blocks are independent and run in parallel on OS threads.
//!
//! Address spaces: global and const addresses are device pointers (const variables live in the caller's
//! global memory at the addresses given in `symbols`). Shared and local addresses are offsets inside the
//! block's shared window and the thread's local window; in generic addressing they appear at
//! [`SHARED_WINDOW`] and [`LOCAL_WINDOW`] (and kernel parameters at [`PARAM_WINDOW`]), high fixed bases that cannot collide with device pointers.
//!
//! Floating point: `.rn/.rz/.rm/.rp` arithmetic, `fma`, `div`, `sqrt`, `rcp` and `cvt` are correctly
//! rounded (computed with error-free transformations in f64); `.approx` instructions are computed in f64
//! and rounded, which is well inside PTX's documented error; `.ftz` and `.sat` are honoured for f32.
//! Textures and surfaces: `tex`, `tld4`, `suld.b`, `sust.b`, `txq` and `suq` on texture and surface
//! objects, resolved through the caller's [`TextureResolver`] (whose documentation gives the exact
//! semantics and what is refused).
//!
//! Limits: [`Module::parse_with`] takes [`Limits`] on what a module may cost (tokens, kernels, module data,
//! instructions after inlining), and [`launch_with`] takes [`LaunchOptions`] (a cancel flag, a deadline,
//! an instruction budget), so hostile or runaway input ends in an error, never in exhausted memory or a
//! launch that never returns.
//!
//! Not supported (reported as unsupported): mipmapped, cubemap and sRGB textures, `cp.async`/`mbarrier`/tensor-core
//! instructions, named barriers with thread counts, 16-bit atomics, indirect calls and recursion deeper
//! than 16 calls.

mod compile;
mod exec;
mod flat;
mod lex;
mod ops;
mod parse;
mod tex;

pub use exec::{LaunchOptions, launch, launch_with};
pub use flat::{FLAT_BASE, FlatMemory};
pub use tex::{
    AddressMode, ChannelFormat, FilterMode, Resource, ResourceKind, SurfaceDesc, TextureDesc,
    TextureResolver,
};

use std::collections::HashMap;

/// What one module may make the interpreter spend. Each figure is checked while parsing and compiling,
/// before the memory it bounds is allocated, and going over it is a [`ParseError`] (or, for one kernel,
/// [`Kernel::unsupported`]), never an abort. The defaults accept every real module seen so far; a caller
/// such as the emu backend tightens them from its own budgets (for example its device-memory size).
///
/// Memory: parsing and compiling hold 4 to 13 bytes per byte of PTX text as nvcc writes it (the syntax
/// tree plus the compiled kernels; tokens are not stored), so the default 32M tokens (some 130 MiB of PTX)
/// bound a module's compile-time footprint to about 1.5 GiB; module data is not materialised beyond its
/// initialisers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// PTX tokens in the module text (bounds the parser's memory, which is proportional to it).
    pub max_tokens: usize,
    /// `.entry` kernels defined in the module.
    pub max_kernels: usize,
    /// Bytes of module-scope `.global` and `.const` data, the declared sizes summed.
    pub max_global_bytes: u64,
    /// Instructions one kernel may amount to after `.func` inlining. Counted before inlining, from the
    /// size of each function times the calls made to it, so a call tree that would explode is refused
    /// without being expanded.
    pub max_kernel_instructions: usize,
    /// Instructions all the kernels of the module may amount to together after inlining.
    pub max_module_instructions: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_tokens: 1 << 25,
            max_kernels: 1 << 17,
            max_global_bytes: 1 << 30,
            max_kernel_instructions: 1 << 22,
            max_module_instructions: 1 << 24,
        }
    }
}

/// Base of the shared-memory window in generic addresses (`cvta.shared` adds it, `cvta.to.shared` removes it).
pub const SHARED_WINDOW: u64 = 0xFE00_0000_0000_0000;
/// Base of the local-memory window in generic addresses (per thread, like on hardware).
pub const LOCAL_WINDOW: u64 = 0xFD00_0000_0000_0000;
/// Base of the kernel-parameter window in generic addresses (`cvta.param`), read-only.
pub const PARAM_WINDOW: u64 = 0xFC00_0000_0000_0000;
/// Size of each window; generic addresses in `[BASE, BASE + WINDOW_SIZE)` map to that space.
pub const WINDOW_SIZE: u64 = 1 << 32;

/// A state space of a module-scope variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateSpace {
    Global,
    Const,
}

/// A module-scope `.global` or `.const` variable; the caller allocates it and passes its address to
/// [`launch`] through `symbols`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalVar {
    pub name: String,
    pub space: StateSpace,
    pub size: usize,
    pub align: usize,
    /// Initial contents of the first `init.len()` bytes (at most `size`); the rest of the variable is
    /// zero. Zero-initialised data is not materialised: a variable without initializer has an empty `init`.
    pub init: Vec<u8>,
}

/// A kernel parameter in the packed parameter buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    pub name: String,
    pub offset: usize,
    pub size: usize,
    pub align: usize,
}

/// A parsed PTX module.
#[derive(Debug)]
pub struct Module {
    kernels: Vec<Kernel>,
    kernel_index: HashMap<String, usize>,
    globals: Vec<GlobalVar>,
}

impl Module {
    /// Parses PTX text and compiles its kernels within the default [`Limits`].
    pub fn parse(ptx: &str) -> Result<Module, ParseError> {
        Module::parse_with(ptx, &Limits::default())
    }

    /// Parses PTX text and compiles its kernels within `limits`.
    pub fn parse_with(ptx: &str, limits: &Limits) -> Result<Module, ParseError> {
        let ast = parse::parse(ptx, limits)?;
        compile::build_module(&ast, limits)
    }

    pub fn kernel(&self, name: &str) -> Option<&Kernel> {
        self.kernel_index.get(name).map(|&i| &self.kernels[i])
    }

    pub fn kernels(&self) -> impl Iterator<Item = &Kernel> {
        self.kernels.iter()
    }

    /// Module-scope `.global` and `.const` variables.
    pub fn globals(&self) -> &[GlobalVar] {
        &self.globals
    }
}

/// An `.entry` of a module.
#[derive(Debug)]
pub struct Kernel {
    name: String,
    params: Vec<Param>,
    param_bytes: usize,
    max_threads: u32,
    num_regs: u32,
    /// The compiled body, or why it cannot run (reported at launch).
    program: Result<compile::Program, ExecError>,
}

impl Kernel {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Parameters in declaration order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// Total packed size of the parameters (each aligned as CUDA lays them out).
    pub fn param_bytes(&self) -> usize {
        self.param_bytes
    }

    pub fn static_shared_bytes(&self) -> usize {
        self.program.as_ref().map_or(0, |p| p.shared_bytes)
    }

    pub fn local_bytes_per_thread(&self) -> usize {
        self.program.as_ref().map_or(0, |p| p.local_bytes)
    }

    /// The `.maxntid`/`.reqntid` product, else 1024.
    pub fn max_threads_per_block(&self) -> u32 {
        self.max_threads
    }

    /// Declared registers (a plausible figure for `cuFuncGetAttribute`).
    pub fn num_regs(&self) -> u32 {
        self.num_regs
    }

    /// Why this kernel cannot run, if the compiler found an instruction it does not support.
    pub fn unsupported(&self) -> Option<&ExecError> {
        self.program.as_ref().err()
    }
}

/// Device global memory, owned by the caller (the emu backend). Addresses are device pointers.
pub trait GlobalMemory: Sync {
    fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemoryFault>;
    fn write(&self, addr: u64, data: &[u8]) -> Result<(), MemoryFault>;
    /// Atomic read-modify-write of `size` (4 or 8) bytes at `addr`: `op(old) -> new`; returns old.
    fn atomic(
        &self,
        addr: u64,
        size: usize,
        op: &mut dyn FnMut(u64) -> u64,
    ) -> Result<u64, MemoryFault>;
}

/// An access outside any allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("memory fault: {len} bytes at {addr:#x}")]
pub struct MemoryFault {
    pub addr: u64,
    pub len: usize,
}

/// Grid and block dimensions of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub dynamic_shared_bytes: u32,
}

/// What a launch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaunchStats {
    /// Instructions executed, counted once per active thread.
    pub thread_instructions: u64,
    /// Warp-level steps (one instruction issued for a set of lanes).
    pub warp_steps: u64,
    pub blocks: u64,
}

/// A syntax error in PTX text, or a module over one of its [`Limits`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("PTX line {line}: expected {expected}, found {found}")]
pub struct ParseError {
    pub line: usize,
    pub expected: String,
    pub found: String,
    /// The [`Limits`] field the module went over (`"max_tokens"`, ...), `None` for a syntax error: a
    /// caller may report the two differently (out of resources versus invalid PTX).
    pub limit: Option<&'static str>,
}

/// Why a launch failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    #[error("illegal address: {space} access of {len} bytes at {addr:#x} (PTX line {line})")]
    MemoryFault {
        space: &'static str,
        addr: u64,
        len: usize,
        line: usize,
    },
    #[error("misaligned address: {len}-byte access at {addr:#x} (PTX line {line})")]
    Misaligned { addr: u64, len: usize, line: usize },
    #[error("unsupported PTX instruction `{instruction}` at line {line}")]
    Unsupported { instruction: String, line: usize },
    #[error("invalid launch: {reason}")]
    InvalidLaunch { reason: String },
    #[error("kernel trapped at PTX line {line} (block {block:?}, thread {thread:?})")]
    Trap {
        line: usize,
        block: [u32; 3],
        thread: [u32; 3],
    },
    #[error("no kernel named `{0}` in the module")]
    NoSuchKernel(String),
    #[error("module symbol `{0}` has no address in the symbol table")]
    MissingSymbol(String),
    /// The launch was stopped before the kernel finished (see [`LaunchOptions`]): on a GPU, what a
    /// watchdog does to a kernel that runs too long.
    #[error("launch stopped: {0}")]
    Stopped(StopReason),
    #[error("invalid {kind} object handle {handle:#x} (PTX line {line})")]
    InvalidHandle {
        kind: &'static str,
        handle: u64,
        line: usize,
    },
}

/// Why [`launch_with`] stopped a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StopReason {
    #[error("cancelled by the caller")]
    Cancelled,
    #[error("its deadline passed")]
    Deadline,
    #[error("it ran past its budget of {0} thread-instructions")]
    Budget(u64),
}
