//! The interpreter: runs a compiled [`Program`] over a grid. Each OS worker takes whole blocks; within a
//! block, warps run one after the other until they finish or park at `bar.sync`; within a warp, lanes run
//! in lockstep at the minimum PC among runnable lanes.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use crate::compile::{
    ConstVal, FL_FTZ, FL_SAT, Inst, NONE, Op, Program, R, Space, Special, TexInst, TexKind,
};
use crate::ops::{self, AtomOp};
use crate::tex::{self, Coords, SurfaceAccess, TexError};
use crate::{
    ExecError, GlobalMemory, LOCAL_WINDOW, LaunchConfig, LaunchStats, Module, PARAM_WINDOW,
    SHARED_WINDOW, StopReason, SurfaceDesc, TextureDesc, TextureResolver, WINDOW_SIZE,
};

/// Warp steps a warp runs before the block scheduler moves on to the next warp.
const SLICE_STEPS: u64 = 4096;

/// Backward branches the min-PC group may take while other lanes of its warp wait before those lanes get
/// a turn (forward progress for intra-warp spin locks).
const STARVE_LIMIT: u32 = 1_000;

/// Thread-instructions a worker executes between two checks of the stop conditions (about 0.1 ms).
const CHECK_EVERY: u64 = 1 << 15;

/// Shared memory a block may use (static plus dynamic), as on sm_90.
const MAX_SHARED: usize = 227 * 1024;

/// Runs `kernel` of `module` over the grid in `cfg`, to the end.
///
/// `params` is the packed parameter buffer laid out per [`crate::Kernel::params`]; `symbols` gives the device
/// address of every module `.global`/`.const` variable the kernel uses.
pub fn launch(
    module: &Module,
    kernel: &str,
    cfg: &LaunchConfig,
    params: &[u8],
    symbols: &HashMap<String, u64>,
    mem: &dyn GlobalMemory,
) -> Result<LaunchStats, ExecError> {
    launch_with(
        module,
        kernel,
        cfg,
        params,
        symbols,
        mem,
        &LaunchOptions::default(),
    )
}

/// What a launch may use besides its arguments, and when it must stop.
///
/// Every worker checks the stop conditions before each block, and after each warp time slice once it has
/// executed 32768 thread-instructions since its last check (about 0.1 ms), so a launch stops within a
/// millisecond or so of the flag or deadline, and overshoots its budget by at most that much (plus one
/// slice) per worker. The checks cost well under 1% of the interpreter's time.
#[derive(Clone, Copy, Default)]
pub struct LaunchOptions<'a> {
    /// Set (from any thread) to stop the launch: [`StopReason::Cancelled`].
    pub cancel: Option<&'a AtomicBool>,
    /// The launch stops when this instant passes: [`StopReason::Deadline`].
    pub deadline: Option<Instant>,
    /// Thread-instructions (as [`LaunchStats::thread_instructions`] counts them) the launch may execute:
    /// [`StopReason::Budget`].
    pub max_thread_instructions: Option<u64>,
    /// Resolves the texture and surface object handles the kernel uses.
    pub textures: Option<&'a dyn TextureResolver>,
}

impl std::fmt::Debug for LaunchOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchOptions")
            .field("cancel", &self.cancel)
            .field("deadline", &self.deadline)
            .field("max_thread_instructions", &self.max_thread_instructions)
            .field("textures", &self.textures.is_some())
            .finish()
    }
}

/// [`launch`] with [`LaunchOptions`]: a way to stop it early, and texture and surface objects.
pub fn launch_with(
    module: &Module,
    kernel: &str,
    cfg: &LaunchConfig,
    params: &[u8],
    symbols: &HashMap<String, u64>,
    mem: &dyn GlobalMemory,
    opts: &LaunchOptions,
) -> Result<LaunchStats, ExecError> {
    let k = module
        .kernel(kernel)
        .ok_or_else(|| ExecError::NoSuchKernel(kernel.to_string()))?;
    let prog = k.program.as_ref().map_err(Clone::clone)?;
    let invalid = |reason: String| Err(ExecError::InvalidLaunch { reason });
    let [bx, by, bz] = cfg.block;
    let [gx, gy, gz] = cfg.grid;
    if bx == 0 || by == 0 || bz == 0 || gx == 0 || gy == 0 || gz == 0 {
        return invalid(format!(
            "zero dimension in grid {:?} or block {:?}",
            cfg.grid, cfg.block
        ));
    }
    let nthreads = u64::from(bx) * u64::from(by) * u64::from(bz);
    if nthreads > u64::from(k.max_threads) || bz > 64 {
        return invalid(format!(
            "block {:?} exceeds the kernel's {} threads per block",
            cfg.block, k.max_threads
        ));
    }
    if gy > 65535 || gz > 65535 || gx > i32::MAX as u32 {
        return invalid(format!("grid {:?} exceeds the device limits", cfg.grid));
    }
    if params.len() < k.param_bytes {
        return invalid(format!(
            "parameter buffer has {} bytes, kernel needs {}",
            params.len(),
            k.param_bytes
        ));
    }
    let dyn_base = prog.shared_bytes.div_ceil(16) * 16;
    let shared_total = dyn_base + cfg.dynamic_shared_bytes as usize;
    if shared_total > MAX_SHARED {
        return invalid(format!(
            "{shared_total} bytes of shared memory exceed {MAX_SHARED}"
        ));
    }
    let mut consts = Vec::with_capacity(prog.consts.len());
    for (r, c) in &prog.consts {
        let v = match *c {
            ConstVal::Imm(v) => v,
            ConstVal::Global(i, off) => {
                let name = &prog.global_syms[i];
                let base = symbols
                    .get(name)
                    .ok_or_else(|| ExecError::MissingSymbol(name.clone()))?;
                base.wrapping_add(off as u64)
            }
            ConstVal::DynShared(off) => (dyn_base as u64).wrapping_add(off as u64),
        };
        consts.push((*r, v));
    }
    let nblocks = u64::from(gx) * u64::from(gy) * u64::from(gz);
    let failed = AtomicBool::new(false);
    let ctx = Ctx {
        prog,
        cfg,
        params,
        mem,
        consts,
        nthreads: nthreads as usize,
        shared_total,
        textures: opts.textures,
        stop: Stop {
            failed: &failed,
            cancel: opts.cancel,
            deadline: opts.deadline,
            budget: opts.max_thread_instructions,
            executed: AtomicU64::new(0),
        },
    };
    let workers = std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(nblocks as usize)
        .max(1);
    let next = AtomicU64::new(0);
    let first_err: Mutex<Option<(u64, ExecError)>> = Mutex::new(None);
    let total = Mutex::new(LaunchStats::default());
    let work = || {
        let mut b = Block::new(&ctx);
        let mut stats = LaunchStats::default();
        loop {
            if failed.load(Ordering::Relaxed) {
                break;
            }
            let id = next.fetch_add(1, Ordering::Relaxed);
            if id >= nblocks {
                break;
            }
            let ctaid = [
                (id % u64::from(gx)) as u32,
                ((id / u64::from(gx)) % u64::from(gy)) as u32,
                (id / (u64::from(gx) * u64::from(gy))) as u32,
            ];
            // Blocks whose setup outweighs their instructions may never add up to a check inside
            // `run`: check between blocks too.
            let stop = ctx.stop.check(0).map(|_| ());
            if let Err(e) = stop.and_then(|()| b.run(&ctx, ctaid, &mut stats)) {
                failed.store(true, Ordering::Relaxed);
                if let Ok(mut slot) = first_err.lock() {
                    // Report the error of the lowest block for determinism.
                    if slot.as_ref().is_none_or(|(bid, _)| id < *bid) {
                        *slot = Some((id, e));
                    }
                }
                break;
            }
            stats.blocks += 1;
        }
        if let Ok(mut t) = total.lock() {
            t.thread_instructions += stats.thread_instructions;
            t.warp_steps += stats.warp_steps;
            t.blocks += stats.blocks;
        }
    };
    if workers == 1 {
        work();
    } else {
        std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(work);
            }
        });
    }
    if let Some((_, e)) = first_err
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        return Err(e);
    }
    Ok(total
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner))
}

struct Ctx<'a> {
    prog: &'a Program,
    cfg: &'a LaunchConfig,
    params: &'a [u8],
    mem: &'a dyn GlobalMemory,
    consts: Vec<(R, u64)>,
    nthreads: usize,
    shared_total: usize,
    textures: Option<&'a dyn TextureResolver>,
    stop: Stop<'a>,
}

/// When workers must stop early: another worker failed, or a [`LaunchOptions`] condition holds.
struct Stop<'a> {
    failed: &'a AtomicBool,
    cancel: Option<&'a AtomicBool>,
    deadline: Option<Instant>,
    budget: Option<u64>,
    /// Thread-instructions executed by all workers (kept only when there is a budget).
    executed: AtomicU64,
}

impl Stop<'_> {
    /// Called between time slices with the thread-instructions the slice executed. `Ok(true)`: stop quietly
    /// (another worker failed and reports its own error).
    fn check(&self, slice_instructions: u64) -> Result<bool, ExecError> {
        if self.failed.load(Ordering::Relaxed) {
            return Ok(true);
        }
        if self.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(ExecError::Stopped(StopReason::Cancelled));
        }
        if let Some(max) = self.budget.filter(|_| slice_instructions > 0) {
            let done = self
                .executed
                .fetch_add(slice_instructions, Ordering::Relaxed)
                .saturating_add(slice_instructions);
            if done > max {
                return Err(ExecError::Stopped(StopReason::Budget(max)));
            }
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(ExecError::Stopped(StopReason::Deadline));
        }
        Ok(false)
    }
}

/// Per-worker state, reused across blocks.
struct Block {
    regs: Vec<u64>,
    pcs: Vec<[u32; 32]>,
    /// Per warp: backward branches taken by the min-PC group while other lanes waited (see STARVE_LIMIT).
    starve: Vec<u32>,
    alive: Vec<u32>,
    waiting: Vec<u32>,
    shared: Vec<u8>,
    local: Vec<u8>,
    clock: u64,
    /// `bar.red` accumulators of the barrier being gathered (popc, and, or) and of the last one released.
    red_acc: [u64; 3],
    red_last: [u64; 3],
    /// Thread-instructions since the stop conditions were last checked.
    unchecked: u64,
    /// Texture and surface descriptors resolved so far.
    objects: Objects,
}

/// Descriptors of the texture and surface handles a worker has met (a launch uses a handful; a hostile
/// kernel inventing handles only makes the resolver answer more often).
#[derive(Default)]
struct Objects {
    textures: Vec<(u64, Option<TextureDesc>)>,
    surfaces: Vec<(u64, Option<SurfaceDesc>)>,
}

const MAX_CACHED_OBJECTS: usize = 64;

fn cached<T: Copy>(
    list: &mut Vec<(u64, Option<T>)>,
    handle: u64,
    resolve: impl FnOnce() -> Option<T>,
) -> Option<T> {
    if let Some((_, d)) = list.iter().find(|(h, _)| *h == handle) {
        return *d;
    }
    if list.len() >= MAX_CACHED_OBJECTS {
        list.clear();
    }
    let d = resolve();
    list.push((handle, d));
    d
}

impl Objects {
    fn texture(&mut self, ctx: &Ctx, handle: u64, line: usize) -> Result<TextureDesc, ExecError> {
        cached(&mut self.textures, handle, || {
            ctx.textures.and_then(|t| t.texture(handle))
        })
        .ok_or(ExecError::InvalidHandle {
            kind: "texture",
            handle,
            line,
        })
    }

    fn surface(&mut self, ctx: &Ctx, handle: u64, line: usize) -> Result<SurfaceDesc, ExecError> {
        cached(&mut self.surfaces, handle, || {
            ctx.textures.and_then(|t| t.surface(handle))
        })
        .ok_or(ExecError::InvalidHandle {
            kind: "surface",
            handle,
            line,
        })
    }
}

/// Runs texture or surface instruction `Program::tex[i]` for the lanes in `em`.
#[cold]
#[inline(never)]
fn tex_warp(
    ctx: &Ctx,
    objects: &mut Objects,
    i: u32,
    regs: &mut [u64],
    em: u32,
    line: usize,
) -> Result<(), ExecError> {
    let t = &ctx.prog.tex[i as usize];
    let mut err = Ok(());
    lanes(em, |l| {
        if err.is_ok() {
            err = tex_lane(ctx, objects, t, regs, l, line);
        }
    });
    err
}

/// Runs texture or surface instruction `t` for lane `l` of a warp whose registers are `regs`.
fn tex_lane(
    ctx: &Ctx,
    objects: &mut Objects,
    t: &TexInst,
    regs: &mut [u64],
    l: usize,
    line: usize,
) -> Result<(), ExecError> {
    let rd = |regs: &[u64], r: R| regs[r as usize * 32 + l];
    let handle = rd(regs, t.handle);
    let what = match t.kind {
        TexKind::Sample(_) => "tex",
        TexKind::Gather(..) => "tld4",
        TexKind::Load(_) => "suld.b",
        TexKind::Store(_) => "sust.b",
        TexKind::TexQuery(_) => "txq",
        TexKind::SurfQuery(_) => "suq",
    };
    let space = if what.starts_with('s') {
        "surface"
    } else {
        "texture"
    };
    let fail = |e: TexError| match e {
        TexError::Unsupported(why) => ExecError::Unsupported {
            instruction: format!("{what} ({why})"),
            line,
        },
        TexError::Fault(f) => ExecError::MemoryFault {
            space,
            addr: f.addr,
            len: f.len,
            line,
        },
        TexError::Misaligned { x, len } => ExecError::Misaligned {
            addr: x as u64,
            len,
            line,
        },
    };
    let coords = |regs: &[u64]| t.coords.map(|r| if r == NONE { 0 } else { rd(regs, r) });
    match t.kind {
        TexKind::Sample(ty) | TexKind::Gather(ty, _) => {
            let desc = objects.texture(ctx, handle, line)?;
            let c = coords(regs);
            let (layer, xyz) = if t.geom.layered() {
                (c[0] as u32, &c[1..])
            } else {
                (0, &c[..3])
            };
            let at = Coords {
                layer,
                c: [xyz[0] as u32, xyz[1] as u32, xyz[2] as u32],
                int: t.int_coords,
            };
            let v = match t.kind {
                TexKind::Gather(_, comp) => {
                    tex::gather(&desc, t.geom, comp as usize, &at, ty, ctx.mem)
                }
                _ => tex::sample(&desc, t.geom, &at, ty, ctx.mem),
            }
            .map_err(fail)?;
            for (k, &r) in t.regs.iter().enumerate().take(t.n as usize) {
                regs[r as usize * 32 + l] = u64::from(v[k]);
            }
        }
        TexKind::Load(clamp) | TexKind::Store(clamp) => {
            let desc = objects.surface(ctx, handle, line)?;
            let c = coords(regs).map(|v| v as u32 as i32);
            let size = t.size as usize;
            let len = size * t.n as usize;
            let access = SurfaceAccess {
                desc: &desc,
                geom: t.geom,
                coords: c,
                len,
                clamp,
            };
            let mut buf = [0u8; 32];
            if let TexKind::Load(_) = t.kind {
                access.load(ctx.mem, &mut buf[..len]).map_err(fail)?;
                for (k, &r) in t.regs.iter().enumerate().take(t.n as usize) {
                    let mut w = [0u8; 8];
                    w[..size].copy_from_slice(&buf[k * size..k * size + size]);
                    regs[r as usize * 32 + l] = u64::from_le_bytes(w);
                }
            } else {
                for (k, &r) in t.regs.iter().enumerate().take(t.n as usize) {
                    let v = rd(regs, r).to_le_bytes();
                    buf[k * size..k * size + size].copy_from_slice(&v[..size]);
                }
                access.store(ctx.mem, &buf[..len]).map_err(fail)?;
            }
        }
        TexKind::TexQuery(q) => {
            let desc = objects.texture(ctx, handle, line)?;
            regs[t.regs[0] as usize * 32 + l] = u64::from(q.answer(&desc.resource));
        }
        TexKind::SurfQuery(q) => {
            let desc = objects.surface(ctx, handle, line)?;
            regs[t.regs[0] as usize * 32 + l] = u64::from(q.answer(&desc.resource));
        }
    }
    Ok(())
}

/// What a warp touches besides its registers.
struct Mem<'a> {
    global: &'a dyn GlobalMemory,
    shared: &'a mut [u8],
    local: &'a mut [u8],
    local_size: usize,
    params: &'a [u8],
}

#[derive(Debug)]
enum Fault {
    Oob(&'static str, u64, usize),
    Misaligned(u64, usize),
}

fn space_name(s: Space) -> &'static str {
    match s {
        Space::Global => "global",
        Space::Shared => "shared",
        Space::Local => "local",
        Space::Param => "param",
        Space::Generic => "generic",
    }
}

impl Mem<'_> {
    fn resolve(space: Space, addr: u64) -> (Space, u64) {
        if space != Space::Generic {
            return (space, addr);
        }
        if addr.wrapping_sub(SHARED_WINDOW) < WINDOW_SIZE {
            (Space::Shared, addr - SHARED_WINDOW)
        } else if addr.wrapping_sub(LOCAL_WINDOW) < WINDOW_SIZE {
            (Space::Local, addr - LOCAL_WINDOW)
        } else if addr.wrapping_sub(PARAM_WINDOW) < WINDOW_SIZE {
            (Space::Param, addr - PARAM_WINDOW)
        } else {
            (Space::Global, addr)
        }
    }

    fn slice(buf: &mut [u8], space: Space, addr: u64, len: usize) -> Result<&mut [u8], Fault> {
        let start = usize::try_from(addr).map_err(|_| Fault::Oob(space_name(space), addr, len))?;
        let end = start
            .checked_add(len)
            .ok_or(Fault::Oob(space_name(space), addr, len))?;
        buf.get_mut(start..end)
            .ok_or(Fault::Oob(space_name(space), addr, len))
    }

    /// Offset in the block's local buffer of `thread`'s local address `addr`.
    fn local_at(&self, addr: u64, size: usize, thread: usize) -> Result<u64, Fault> {
        if addr.saturating_add(size as u64) > self.local_size as u64 {
            return Err(Fault::Oob("local", addr, size));
        }
        Ok((thread * self.local_size) as u64 + addr)
    }

    fn read(&mut self, space: Space, addr: u64, size: usize, thread: usize) -> Result<u64, Fault> {
        let (space, addr) = Self::resolve(space, addr);
        if addr % size as u64 != 0 {
            return Err(Fault::Misaligned(addr, size));
        }
        let mut b = [0u8; 8];
        match space {
            Space::Global | Space::Generic => self
                .global
                .read(addr, &mut b[..size])
                .map_err(|f| Fault::Oob("global", f.addr, f.len))?,
            Space::Shared => {
                b[..size].copy_from_slice(Self::slice(self.shared, space, addr, size)?);
            }
            Space::Local => {
                let at = self.local_at(addr, size, thread)?;
                b[..size].copy_from_slice(Self::slice(self.local, space, at, size)?);
            }
            Space::Param => {
                let start = usize::try_from(addr).map_err(|_| Fault::Oob("param", addr, size))?;
                let s = start
                    .checked_add(size)
                    .and_then(|end| self.params.get(start..end))
                    .ok_or(Fault::Oob("param", addr, size))?;
                b[..size].copy_from_slice(s);
            }
        }
        Ok(u64::from_le_bytes(b))
    }

    fn write(
        &mut self,
        space: Space,
        addr: u64,
        size: usize,
        v: u64,
        thread: usize,
    ) -> Result<(), Fault> {
        let (space, addr) = Self::resolve(space, addr);
        if addr % size as u64 != 0 {
            return Err(Fault::Misaligned(addr, size));
        }
        let b = v.to_le_bytes();
        match space {
            Space::Global | Space::Generic => self
                .global
                .write(addr, &b[..size])
                .map_err(|f| Fault::Oob("global", f.addr, f.len)),
            Space::Shared => {
                Self::slice(self.shared, space, addr, size)?.copy_from_slice(&b[..size]);
                Ok(())
            }
            Space::Local => {
                let at = self.local_at(addr, size, thread)?;
                Self::slice(self.local, space, at, size)?.copy_from_slice(&b[..size]);
                Ok(())
            }
            Space::Param => Err(Fault::Oob("param", addr, size)),
        }
    }

    fn atomic(
        &mut self,
        space: Space,
        addr: u64,
        size: usize,
        op: &mut dyn FnMut(u64) -> u64,
        thread: usize,
    ) -> Result<u64, Fault> {
        let (space, addr) = Self::resolve(space, addr);
        if addr % size as u64 != 0 {
            return Err(Fault::Misaligned(addr, size));
        }
        match space {
            Space::Global | Space::Generic => self
                .global
                .atomic(addr, size, op)
                .map_err(|f| Fault::Oob("global", f.addr, f.len)),
            // One OS thread runs the whole block, so shared and local read-modify-writes are atomic already.
            _ => {
                let old = self.read(space, addr, size, thread)?;
                self.write(space, addr, size, op(old), thread)?;
                Ok(old)
            }
        }
    }
}

#[inline]
fn lanes(mut m: u32, mut f: impl FnMut(usize)) {
    while m != 0 {
        let l = m.trailing_zeros() as usize;
        m &= m - 1;
        f(l);
    }
}

impl Block {
    fn new(ctx: &Ctx) -> Block {
        let nwarps = ctx.nthreads.div_ceil(32);
        let stride = ctx.prog.nregs as usize * 32;
        Block {
            regs: vec![0; nwarps * stride],
            pcs: vec![[0; 32]; nwarps],
            starve: vec![0; nwarps],
            alive: vec![0; nwarps],
            waiting: vec![0; nwarps],
            shared: vec![0; ctx.shared_total],
            local: vec![0; ctx.nthreads * ctx.prog.local_bytes],
            clock: 0,
            red_acc: [0, 1, 0],
            red_last: [0; 3],
            unchecked: 0,
            objects: Objects::default(),
        }
    }

    fn run(
        &mut self,
        ctx: &Ctx,
        ctaid: [u32; 3],
        stats: &mut LaunchStats,
    ) -> Result<(), ExecError> {
        let nwarps = self.pcs.len();
        let stride = ctx.prog.nregs as usize * 32;
        let [bx, by, _] = ctx.cfg.block;
        self.shared.fill(0);
        self.local.fill(0);
        self.red_acc = [0, 1, 0];
        for w in 0..nwarps {
            let n = (ctx.nthreads - w * 32).min(32);
            self.alive[w] = if n == 32 { u32::MAX } else { (1u32 << n) - 1 };
            self.waiting[w] = 0;
            self.pcs[w] = [0; 32];
            self.starve[w] = 0;
            let regs = &mut self.regs[w * stride..(w + 1) * stride];
            regs.fill(0);
            for &(r, v) in &ctx.consts {
                regs[r as usize * 32..r as usize * 32 + 32].fill(v);
            }
            for &(r, sp) in &ctx.prog.specials {
                for lane in 0..32usize {
                    let t = (w * 32 + lane) as u32;
                    let tid = [t % bx, (t / bx) % by, t / (bx * by)];
                    let l = lane as u32;
                    let v: u64 = match sp {
                        Special::Tid(d) => u64::from(tid[d]),
                        Special::Ntid(d) => u64::from(ctx.cfg.block[d]),
                        Special::Ctaid(d) => u64::from(ctaid[d]),
                        Special::Nctaid(d) => u64::from(ctx.cfg.grid[d]),
                        Special::LaneId => u64::from(l),
                        Special::WarpId => w as u64,
                        Special::NWarpId => nwarps as u64,
                        Special::LaneMaskEq => 1u64 << l,
                        Special::LaneMaskLt => (1u64 << l) - 1,
                        Special::LaneMaskLe => (1u64 << (l + 1)) - 1,
                        Special::LaneMaskGt => (!((1u64 << (l + 1)) - 1)) & 0xffff_ffff,
                        Special::LaneMaskGe => (!((1u64 << l) - 1)) & 0xffff_ffff,
                        Special::Zero => 0,
                        Special::DynSmem => u64::from(ctx.cfg.dynamic_shared_bytes),
                        Special::TotalSmem => ctx.shared_total as u64,
                    };
                    regs[r as usize * 32 + lane] = v;
                }
            }
        }
        loop {
            // Warps run in time slices, so a warp spinning on a flag another warp of the block sets
            // still lets that warp run.
            let mut ran = false;
            for w in 0..nwarps {
                if self.alive[w] & !self.waiting[w] != 0 {
                    ran = true;
                    let before = stats.thread_instructions;
                    self.run_warp(ctx, w, ctaid, stats)?;
                    // Every slice executes at least one instruction, so this check comes around.
                    self.unchecked += stats.thread_instructions - before;
                    if self.unchecked >= CHECK_EVERY {
                        let n = std::mem::take(&mut self.unchecked);
                        if ctx.stop.check(n)? {
                            return Ok(());
                        }
                    }
                }
            }
            if ran {
                continue;
            }
            if self.alive.iter().all(|&a| a == 0) {
                return Ok(());
            }
            // Every live warp is parked at the barrier: release it.
            for w in 0..nwarps {
                self.waiting[w] = 0;
            }
            self.red_last = self.red_acc;
            self.red_acc = [0, 1, 0];
        }
    }

    fn run_warp(
        &mut self,
        ctx: &Ctx,
        w: usize,
        ctaid: [u32; 3],
        stats: &mut LaunchStats,
    ) -> Result<(), ExecError> {
        let code: &[Inst] = &ctx.prog.code;
        let stride = ctx.prog.nregs as usize * 32;
        let regs = &mut self.regs[w * stride..(w + 1) * stride];
        let pcs = &mut self.pcs[w];
        let objects = &mut self.objects;
        let mut alive = self.alive[w];
        let mut waiting = self.waiting[w];
        let mut mem = Mem {
            global: ctx.mem,
            shared: &mut self.shared,
            local: &mut self.local,
            local_size: ctx.prog.local_bytes,
            params: ctx.params,
        };
        let mut cur: u32 = 0;
        let mut mask: u32 = 0;
        let mut min_other = u32::MAX;
        let mut recompute = true;
        let mut starve = self.starve[w];
        // The current group is not the min-PC one: it runs to its next branch but stops at warp-sync points.
        let mut relief = false;
        let mut tinst = 0u64;
        let mut steps = 0u64;
        let [bx, by, _] = ctx.cfg.block;
        let result = loop {
            if steps >= SLICE_STEPS {
                break Ok(());
            }
            if recompute {
                let run = alive & !waiting;
                if run == 0 {
                    break Ok(());
                }
                cur = u32::MAX;
                lanes(run, |l| cur = cur.min(pcs[l]));
                relief = false;
                if starve >= STARVE_LIMIT {
                    // The min-PC group keeps looping while others wait (a spin lock held by a lagging
                    // lane): give the next group a turn, as Volta's independent scheduling would.
                    starve = 0;
                    let mut next = u32::MAX;
                    lanes(run, |l| {
                        if pcs[l] > cur {
                            next = next.min(pcs[l]);
                        }
                    });
                    if next != u32::MAX {
                        cur = next;
                        relief = true;
                    }
                }
                mask = 0;
                min_other = u32::MAX;
                lanes(run, |l| {
                    if pcs[l] == cur {
                        mask |= 1 << l;
                    } else {
                        min_other = min_other.min(pcs[l]);
                    }
                });
                if relief {
                    min_other = u32::MAX;
                }
                recompute = false;
            }
            let Some(inst) = code.get(cur as usize) else {
                // Ran past the end (cannot happen: every program ends with exit).
                alive &= !mask;
                recompute = true;
                continue;
            };
            let mut em = mask;
            if inst.guard != NONE {
                let g = &regs[inst.guard as usize * 32..inst.guard as usize * 32 + 32];
                let mut keep = 0;
                lanes(mask, |l| {
                    if (g[l] != 0) != inst.gneg {
                        keep |= 1 << l;
                    }
                });
                em = keep;
            }
            if relief
                && matches!(
                    inst.op,
                    Op::Shfl { .. }
                        | Op::Vote { .. }
                        | Op::Redux { .. }
                        | Op::Activemask { .. }
                        | Op::Match { .. }
                        | Op::WarpSync
                )
                && alive & !waiting & !mask != 0
            {
                // Not past a warp-synchronous instruction ahead of the rest of the warp.
                let c = cur;
                lanes(mask, |l| pcs[l] = c);
                recompute = true;
                continue;
            }
            steps += 1;
            tinst += u64::from(mask.count_ones());
            let line = inst.line as usize;
            let fault = |f: Fault| match f {
                Fault::Oob(space, addr, len) => ExecError::MemoryFault {
                    space,
                    addr,
                    len,
                    line,
                },
                Fault::Misaligned(addr, len) => ExecError::Misaligned { addr, len, line },
            };
            macro_rules! rd {
                ($r:expr, $l:expr) => {
                    regs[$r as usize * 32 + $l]
                };
            }
            match inst.op {
                Op::Un { f, d, a, fl } => {
                    if fl == 0 {
                        lanes(em, |l| rd!(d, l) = f(rd!(a, l)));
                    } else {
                        lanes(em, |l| rd!(d, l) = post(fl, f(pre(fl, rd!(a, l)))));
                    }
                }
                Op::Bin { f, d, a, b, fl } => {
                    if fl == 0 {
                        lanes(em, |l| rd!(d, l) = f(rd!(a, l), rd!(b, l)));
                    } else {
                        lanes(em, |l| {
                            rd!(d, l) = post(fl, f(pre(fl, rd!(a, l)), pre(fl, rd!(b, l))));
                        });
                    }
                }
                Op::Tern { f, d, a, b, c, fl } => {
                    if fl == 0 {
                        lanes(em, |l| rd!(d, l) = f(rd!(a, l), rd!(b, l), rd!(c, l)));
                    } else {
                        lanes(em, |l| {
                            rd!(d, l) = post(
                                fl,
                                f(pre(fl, rd!(a, l)), pre(fl, rd!(b, l)), pre(fl, rd!(c, l))),
                            );
                        });
                    }
                }
                Op::Quad { f, d, a, b, c, e } => lanes(em, |l| {
                    rd!(d, l) = f(rd!(a, l), rd!(b, l), rd!(c, l), rd!(e, l));
                }),
                Op::Mov { d, a } => lanes(em, |l| rd!(d, l) = rd!(a, l)),
                Op::Setp {
                    f,
                    fl,
                    comb,
                    d,
                    dn,
                    a,
                    b,
                    c,
                    cneg,
                } => lanes(em, |l| {
                    let r = f(pre(fl, rd!(a, l)), pre(fl, rd!(b, l))) != 0;
                    let cv = c != NONE && ((rd!(c, l) != 0) != cneg);
                    let combine = |x: bool| match comb {
                        1 => x && cv,
                        2 => x || cv,
                        3 => x != cv,
                        _ => x,
                    };
                    rd!(d, l) = u64::from(combine(r));
                    if dn != NONE {
                        rd!(dn, l) = u64::from(combine(!r));
                    }
                }),
                Op::Selp { d, a, b, c, cneg } => lanes(em, |l| {
                    rd!(d, l) = if (rd!(c, l) != 0) != cneg {
                        rd!(a, l)
                    } else {
                        rd!(b, l)
                    };
                }),
                Op::PredLogic { op, d, a, b } => lanes(em, |l| {
                    let (x, y) = (rd!(a, l) != 0, rd!(b, l) != 0);
                    rd!(d, l) = u64::from(match op {
                        0 => x && y,
                        1 => x || y,
                        2 => x != y,
                        _ => !x,
                    });
                }),
                Op::Cvt { d, a, spec } => lanes(em, |l| rd!(d, l) = ops::cvt(rd!(a, l), &spec)),
                Op::Pack { d, n, bits, src } => lanes(em, |l| {
                    let m = if bits >= 64 {
                        u64::MAX
                    } else {
                        (1u64 << bits) - 1
                    };
                    let mut v = 0u64;
                    for (i, s) in src.iter().take(n as usize).enumerate() {
                        v |= (rd!(*s, l) & m) << (i as u32 * u32::from(bits));
                    }
                    rd!(d, l) = v;
                }),
                Op::Unpack { a, n, bits, dst } => lanes(em, |l| {
                    let m = if bits >= 64 {
                        u64::MAX
                    } else {
                        (1u64 << bits) - 1
                    };
                    let v = rd!(a, l);
                    for (i, s) in dst.iter().take(n as usize).enumerate() {
                        rd!(*s, l) = (v >> (i as u32 * u32::from(bits))) & m;
                    }
                }),
                Op::Ld {
                    space,
                    size,
                    signed,
                    n,
                    dst,
                    base,
                    off,
                } => {
                    let sz = size as usize;
                    let mut err = None;
                    lanes(em, |l| {
                        if err.is_some() {
                            return;
                        }
                        let addr = rd!(base, l).wrapping_add(off as u64);
                        let total = sz * n as usize;
                        if n > 1 && !Mem::resolve(space, addr).1.is_multiple_of(total as u64) {
                            err = Some(Fault::Misaligned(addr, total));
                            return;
                        }
                        for (i, dr) in dst.iter().take(n as usize).enumerate() {
                            match mem.read(
                                space,
                                addr.wrapping_add((i * sz) as u64),
                                sz,
                                w * 32 + l,
                            ) {
                                Ok(v) => {
                                    let v = if signed && sz < 8 {
                                        let sh = 64 - 8 * sz as u32;
                                        (((v << sh) as i64) >> sh) as u64
                                    } else {
                                        v
                                    };
                                    rd!(*dr, l) = v;
                                }
                                Err(f) => {
                                    err = Some(f);
                                    return;
                                }
                            }
                        }
                    });
                    if let Some(f) = err {
                        break Err(fault(f));
                    }
                }
                Op::St {
                    space,
                    size,
                    n,
                    src,
                    base,
                    off,
                } => {
                    let sz = size as usize;
                    let mut err = None;
                    lanes(em, |l| {
                        if err.is_some() {
                            return;
                        }
                        let addr = rd!(base, l).wrapping_add(off as u64);
                        let total = sz * n as usize;
                        if n > 1 && !Mem::resolve(space, addr).1.is_multiple_of(total as u64) {
                            err = Some(Fault::Misaligned(addr, total));
                            return;
                        }
                        for (i, s) in src.iter().take(n as usize).enumerate() {
                            let v = rd!(*s, l);
                            if let Err(f) = mem.write(
                                space,
                                addr.wrapping_add((i * sz) as u64),
                                sz,
                                v,
                                w * 32 + l,
                            ) {
                                err = Some(f);
                                return;
                            }
                        }
                    });
                    if let Some(f) = err {
                        break Err(fault(f));
                    }
                }
                Op::Atom {
                    space,
                    op,
                    signed,
                    size,
                    d,
                    base,
                    off,
                    b,
                    c,
                } => {
                    let mut err = None;
                    lanes(em, |l| {
                        if err.is_some() {
                            return;
                        }
                        let addr = rd!(base, l).wrapping_add(off as u64);
                        let bv = rd!(b, l);
                        let cv = if c != NONE { rd!(c, l) } else { 0 };
                        let mut f =
                            |old: u64| ops::atom_apply(op, signed, size as usize, old, bv, cv);
                        match mem.atomic(space, addr, size as usize, &mut f, w * 32 + l) {
                            Ok(old) => rd!(d, l) = old,
                            Err(e) => err = Some(e),
                        }
                    });
                    if let Some(f) = err {
                        break Err(fault(f));
                    }
                    let _ = AtomOp::Add;
                }
                Op::Cvta { d, a, window, to } => lanes(em, |l| {
                    let v = rd!(a, l);
                    rd!(d, l) = if to {
                        v.wrapping_sub(window)
                    } else {
                        v.wrapping_add(window)
                    };
                }),
                Op::IsSpace { d, a, space } => lanes(em, |l| {
                    rd!(d, l) = u64::from(Mem::resolve(Space::Generic, rd!(a, l)).0 == space);
                }),
                Op::Bra { target } => {
                    if target <= cur && em != 0 && alive & !waiting & !mask != 0 {
                        starve = starve.saturating_add(1);
                    } else if alive & !waiting & !mask == 0 {
                        starve = 0;
                    }
                    let next = cur + 1;
                    lanes(mask, |l| {
                        pcs[l] = if em & (1 << l) != 0 { target } else { next }
                    });
                    recompute = true;
                    continue;
                }
                Op::Exit => {
                    alive &= !em;
                    let next = cur + 1;
                    lanes(mask & !em, |l| pcs[l] = next);
                    recompute = true;
                    continue;
                }
                Op::BarCount { count } => {
                    if em != 0 {
                        let n = rd!(count, em.trailing_zeros() as usize) as u32 as usize;
                        if n != ctx.nthreads {
                            break Err(ExecError::Unsupported {
                                instruction: format!(
                                    "bar.sync for {n} of the block's {} threads",
                                    ctx.nthreads
                                ),
                                line,
                            });
                        }
                    }
                    waiting |= em;
                    let next = cur + 1;
                    lanes(mask, |l| pcs[l] = next);
                    recompute = true;
                    continue;
                }
                Op::BarRed { c, cneg } => {
                    let acc = &mut self.red_acc;
                    lanes(em, |l| {
                        let p = u64::from((rd!(c, l) != 0) != cneg);
                        acc[0] += p;
                        acc[1] &= p;
                        acc[2] |= p;
                    });
                    waiting |= em;
                    let next = cur + 1;
                    lanes(mask, |l| pcs[l] = next);
                    recompute = true;
                    continue;
                }
                Op::BarRedResult { op, d } => {
                    let v = self.red_last[op as usize % 3];
                    lanes(em, |l| rd!(d, l) = v);
                }
                Op::Match {
                    all,
                    wide,
                    d,
                    dp,
                    a,
                } => {
                    let val = |x: u64| if wide { x } else { x & 0xffff_ffff };
                    let mut res = [0u64; 32];
                    let mut same = true;
                    let first = if em != 0 {
                        val(rd!(a, em.trailing_zeros() as usize))
                    } else {
                        0
                    };
                    lanes(em, |l| {
                        let v = val(rd!(a, l));
                        same &= v == first;
                        let mut m = 0u32;
                        lanes(em, |k| {
                            if val(rd!(a, k)) == v {
                                m |= 1 << k;
                            }
                        });
                        res[l] = u64::from(m);
                    });
                    lanes(em, |l| {
                        rd!(d, l) = if !all {
                            res[l]
                        } else if same {
                            u64::from(em)
                        } else {
                            0
                        };
                        if dp != NONE {
                            rd!(dp, l) = u64::from(same);
                        }
                    });
                }
                Op::Bar => {
                    waiting |= em;
                    let next = cur + 1;
                    lanes(mask, |l| pcs[l] = next);
                    recompute = true;
                    continue;
                }
                Op::Trap => {
                    if em != 0 {
                        let t = (w * 32 + em.trailing_zeros() as usize) as u32;
                        break Err(ExecError::Trap {
                            line,
                            block: ctaid,
                            thread: [t % bx, (t / bx) % by, t / (bx * by)],
                        });
                    }
                }
                Op::Nop | Op::WarpSync => {}
                Op::Tex { i } => {
                    // Out of line: texture code inlined here slows every other instruction.
                    if let Err(e) = tex_warp(ctx, objects, i, regs, em, line) {
                        break Err(e);
                    }
                }
                Op::Shfl {
                    mode,
                    d,
                    dp,
                    a,
                    b,
                    c,
                } => {
                    let mut vals = [0u64; 32];
                    let mut oks = [false; 32];
                    lanes(em, |l| {
                        let lane = l as i32;
                        let bval = (rd!(b, l) as u32 & 0x1f) as i32;
                        let cv = rd!(c, l) as u32;
                        let clamp = (cv & 0x1f) as i32;
                        let segmask = ((cv >> 8) & 0x1f) as i32;
                        let max_lane = (lane & segmask) | (clamp & !segmask);
                        let min_lane = lane & segmask;
                        let (j, ok) = match mode {
                            0 => (lane - bval, lane - bval >= max_lane),
                            1 => (lane + bval, lane + bval <= max_lane),
                            2 => (lane ^ bval, (lane ^ bval) <= max_lane),
                            _ => {
                                let j = min_lane | (bval & !segmask);
                                (j, j <= max_lane)
                            }
                        };
                        let j = if ok && (0..32).contains(&j) {
                            j as usize
                        } else {
                            l
                        };
                        vals[l] = rd!(a, j);
                        oks[l] = ok;
                    });
                    lanes(em, |l| {
                        rd!(d, l) = vals[l];
                        if dp != NONE {
                            rd!(dp, l) = u64::from(oks[l]);
                        }
                    });
                }
                Op::Vote { mode, d, a, aneg } => {
                    let mut ballot = 0u32;
                    lanes(em, |l| {
                        if (rd!(a, l) != 0) != aneg {
                            ballot |= 1 << l;
                        }
                    });
                    let v = match mode {
                        0 => u64::from(ballot == em),
                        1 => u64::from(ballot != 0),
                        2 => u64::from(ballot == 0 || ballot == em),
                        _ => u64::from(ballot),
                    };
                    lanes(em, |l| rd!(d, l) = v);
                }
                Op::Redux { op, signed, d, a } => {
                    let mut acc: Option<u32> = None;
                    lanes(em, |l| {
                        let x = rd!(a, l) as u32;
                        acc = Some(match acc {
                            None => x,
                            Some(y) => match op {
                                0 => y.wrapping_add(x),
                                1 if signed => (y as i32).min(x as i32) as u32,
                                1 => y.min(x),
                                2 if signed => (y as i32).max(x as i32) as u32,
                                2 => y.max(x),
                                3 => y & x,
                                4 => y | x,
                                _ => y ^ x,
                            },
                        });
                    });
                    let v = u64::from(acc.unwrap_or(0));
                    lanes(em, |l| rd!(d, l) = v);
                }
                Op::Carry {
                    sub,
                    cin,
                    cout,
                    wide,
                    mul,
                    signed,
                    d,
                    a,
                    b,
                    c,
                    cc,
                } => lanes(em, |l| {
                    let (x, y) = match mul {
                        0 => (rd!(a, l), rd!(b, l)),
                        _ => {
                            let (p, q) = (rd!(a, l), rd!(b, l));
                            let prod: u128 = match (wide, signed) {
                                (false, false) => {
                                    u128::from(u64::from(p as u32) * u64::from(q as u32))
                                }
                                (false, true) => {
                                    u128::from((i64::from(p as i32) * i64::from(q as i32)) as u64)
                                }
                                (true, false) => u128::from(p) * u128::from(q),
                                (true, true) => {
                                    (i128::from(p as i64) * i128::from(q as i64)) as u128
                                }
                            };
                            let half = match (wide, mul) {
                                (false, 1) => u64::from(prod as u32),
                                (false, _) => u64::from((prod >> 32) as u32),
                                (true, 1) => prod as u64,
                                (true, _) => (prod >> 64) as u64,
                            };
                            (half, rd!(c, l))
                        }
                    };
                    let ci = if cin { rd!(cc, l) & 1 } else { 0 };
                    let c = ci;
                    let (r, flag) = match (wide, sub) {
                        (false, false) => {
                            let t = u64::from(x as u32) + u64::from(y as u32) + c;
                            (u64::from(t as u32), t >> 32)
                        }
                        (false, true) => {
                            let t = u64::from(x as u32).wrapping_sub(u64::from(y as u32) + c);
                            (u64::from(t as u32), (t >> 63) & 1)
                        }
                        (true, false) => {
                            let t = u128::from(x) + u128::from(y) + u128::from(c);
                            (t as u64, (t >> 64) as u64)
                        }
                        (true, true) => {
                            let t = u128::from(x).wrapping_sub(u128::from(y) + u128::from(c));
                            (t as u64, ((t >> 127) & 1) as u64)
                        }
                    };
                    rd!(d, l) = r;
                    if cout {
                        rd!(cc, l) = flag;
                    }
                }),
                Op::Activemask { d } => lanes(em, |l| rd!(d, l) = u64::from(mask)),
                Op::Clock { d } => {
                    let v = self.clock + steps;
                    lanes(em, |l| rd!(d, l) = v);
                }
            }
            cur += 1;
            if cur >= min_other {
                let c = cur;
                lanes(mask, |l| pcs[l] = c);
                recompute = true;
            }
        };
        if !recompute {
            // Stopped on an error mid-sequence: keep the PCs coherent anyway.
            lanes(mask, |l| pcs[l] = cur);
        }
        self.alive[w] = alive;
        self.waiting[w] = waiting;
        self.starve[w] = starve;
        self.clock += steps;
        stats.thread_instructions += tinst;
        stats.warp_steps += steps;
        result
    }
}

#[inline]
fn pre(fl: u8, x: u64) -> u64 {
    if fl & FL_FTZ != 0 { ops::ftz32(x) } else { x }
}

#[inline]
fn post(fl: u8, mut r: u64) -> u64 {
    if fl & FL_FTZ != 0 {
        r = ops::ftz32(r);
    }
    if fl & FL_SAT != 0 {
        r = ops::sat32(r);
    }
    r
}
