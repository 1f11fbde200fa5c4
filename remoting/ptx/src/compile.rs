//! Lowers a parsed kernel into a flat [`Program`]: register names become slot indices, immediates and symbol
//! addresses become constant slots, labels become instruction indices, and `.func` calls are inlined (each
//! call site gets its own registers and local frame). Everything that needs a string comparison happens
//! here, once, so the interpreter never does.

use std::collections::HashMap;

use crate::ops::{self, AtomOp, CvtSpec, F1, F2, F3, F4, Rnd};
use crate::parse::{Ast, Func, Instr, Operand, Stmt, Ty, VarDecl};
use crate::tex::{Geom, OutOfRange, Query, TexType};
use crate::{ExecError, GlobalVar, Kernel, Limits, Module, Param, ParseError, StateSpace};

/// A register slot index.
pub type R = u32;
/// No register (unguarded instruction, absent operand).
pub const NONE: R = u32::MAX;

/// Register slots a program may use (the interpreter keeps 32 lanes x 8 bytes per slot per warp).
const MAX_REGS: usize = 1 << 15;
/// Local memory per thread, as CUDA allows.
const MAX_LOCAL: usize = 512 * 1024;

pub const FL_FTZ: u8 = 1;
pub const FL_SAT: u8 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    Global,
    Shared,
    Local,
    /// Kernel parameter buffer.
    Param,
    Generic,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    Tid(usize),
    Ntid(usize),
    Ctaid(usize),
    Nctaid(usize),
    LaneId,
    WarpId,
    NWarpId,
    LaneMaskEq,
    LaneMaskLt,
    LaneMaskLe,
    LaneMaskGt,
    LaneMaskGe,
    Zero,
    DynSmem,
    TotalSmem,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConstVal {
    Imm(u64),
    /// Address of module global `global_syms[i]` plus an offset.
    Global(usize, i64),
    /// Offset of dynamic shared memory (after all static shared variables) plus an offset.
    DynShared(i64),
}

#[derive(Debug, Clone, Copy)]
pub enum Op {
    Un {
        f: F1,
        d: R,
        a: R,
        fl: u8,
    },
    Bin {
        f: F2,
        d: R,
        a: R,
        b: R,
        fl: u8,
    },
    Tern {
        f: F3,
        d: R,
        a: R,
        b: R,
        c: R,
        fl: u8,
    },
    Quad {
        f: F4,
        d: R,
        a: R,
        b: R,
        c: R,
        e: R,
    },
    Mov {
        d: R,
        a: R,
    },
    /// `setp`: d = cmp(a, b) comb c; dn = !cmp(a, b) comb c. comb: 0 none, 1 and, 2 or, 3 xor.
    Setp {
        f: F2,
        fl: u8,
        comb: u8,
        d: R,
        dn: R,
        a: R,
        b: R,
        c: R,
        cneg: bool,
    },
    /// `selp d, a, b, c`: c ? a : b.
    Selp {
        d: R,
        a: R,
        b: R,
        c: R,
        cneg: bool,
    },
    /// Predicate logic: `and/or/xor/not` on .pred.
    PredLogic {
        op: u8,
        d: R,
        a: R,
        b: R,
    },
    Cvt {
        d: R,
        a: R,
        spec: CvtSpec,
    },
    Pack {
        d: R,
        n: u8,
        bits: u8,
        src: [R; 4],
    },
    Unpack {
        a: R,
        n: u8,
        bits: u8,
        dst: [R; 4],
    },
    Ld {
        space: Space,
        size: u8,
        signed: bool,
        n: u8,
        dst: [R; 4],
        base: R,
        off: i64,
    },
    St {
        space: Space,
        size: u8,
        n: u8,
        src: [R; 4],
        base: R,
        off: i64,
    },
    Atom {
        space: Space,
        op: AtomOp,
        signed: bool,
        size: u8,
        d: R,
        base: R,
        off: i64,
        b: R,
        c: R,
    },
    /// `cvta` between a specific space and generic: adds (`to == false`) or subtracts the window base.
    Cvta {
        d: R,
        a: R,
        window: u64,
        to: bool,
    },
    IsSpace {
        d: R,
        a: R,
        space: Space,
    },
    Bra {
        target: u32,
    },
    Exit,
    Bar,
    /// `shfl.sync`: mode 0 up, 1 down, 2 bfly, 3 idx.
    Shfl {
        mode: u8,
        d: R,
        dp: R,
        a: R,
        b: R,
        c: R,
    },
    /// `vote.sync`: mode 0 all, 1 any, 2 uni, 3 ballot.
    Vote {
        mode: u8,
        d: R,
        a: R,
        aneg: bool,
    },
    /// `redux.sync`: op 0 add, 1 min, 2 max, 3 and, 4 or, 5 xor.
    Redux {
        op: u8,
        signed: bool,
        d: R,
        a: R,
    },
    Activemask {
        d: R,
    },
    /// Extended-precision `add.cc/addc/sub.cc/subc`: `cc` is the per-lane carry (borrow) flag slot.
    /// `mad.cc/madc`: the addend is `mul` 1 = lo, 2 = hi half of a * b, added to c.
    Carry {
        sub: bool,
        cin: bool,
        cout: bool,
        wide: bool,
        mul: u8,
        signed: bool,
        d: R,
        a: R,
        b: R,
        c: R,
        cc: R,
    },
    Clock {
        d: R,
    },
    Trap,
    Nop,
    /// `bar.sync id, count`: a block barrier whose count must equal the block's thread count.
    BarCount {
        count: R,
    },
    /// `bar.red`: contributes a predicate to the block reductions (popc, and, or) and waits.
    BarRed {
        c: R,
        cneg: bool,
    },
    /// Reads the reduction of the barrier just released.
    BarRedResult {
        op: u8,
        d: R,
    },
    /// `match.{any,all}.sync`: lanes holding equal values (`all`: whether every lane does).
    Match {
        all: bool,
        wide: bool,
        d: R,
        dp: R,
        a: R,
    },
    /// `bar.warp.sync`: nothing to do in lockstep, but a point a starvation-relief group must not pass.
    WarpSync,
    /// A texture or surface instruction: `Program::tex[i]`.
    Tex {
        i: u32,
    },
}

/// What a texture or surface instruction does.
#[derive(Debug, Clone, Copy)]
pub enum TexKind {
    /// `tex`
    Sample(TexType),
    /// `tld4` of one component.
    Gather(TexType, u8),
    /// `suld.b`
    Load(OutOfRange),
    /// `sust.b`
    Store(OutOfRange),
    /// `txq`
    TexQuery(Query),
    /// `suq`
    SurfQuery(Query),
}

/// A texture or surface instruction, kept out of [`Op`] so that the common instructions stay small.
#[derive(Debug, Clone, Copy)]
pub struct TexInst {
    pub kind: TexKind,
    pub geom: Geom,
    /// `.s32` texture coordinates (else `.f32`).
    pub int_coords: bool,
    /// The register holding the object handle.
    pub handle: R,
    /// Coordinates, the layer first for layered geometries (`NONE` past the last).
    pub coords: [R; 4],
    /// Destinations (tex, tld4, suld, queries) or sources (sust).
    pub regs: [R; 4],
    pub n: u8,
    /// Bytes per register moved by suld/sust.
    pub size: u8,
}

#[derive(Debug, Clone, Copy)]
pub struct Inst {
    pub op: Op,
    pub guard: R,
    pub gneg: bool,
    pub line: u32,
}

#[derive(Debug)]
pub struct Program {
    pub code: Vec<Inst>,
    pub tex: Vec<TexInst>,
    pub nregs: u32,
    pub consts: Vec<(R, ConstVal)>,
    pub specials: Vec<(R, Special)>,
    pub global_syms: Vec<String>,
    pub shared_bytes: usize,
    pub local_bytes: usize,
}

pub fn build_module(ast: &Ast, limits: &Limits) -> Result<Module, ParseError> {
    let globals = ast
        .vars
        .iter()
        .filter(|v| v.space == "global" || v.space == "const")
        .map(|v| {
            let size = v.size.unwrap_or(0);
            // Only the initialised prefix is stored (the parser dropped trailing zeros).
            let mut init = v.init.clone().unwrap_or_default();
            init.truncate(size);
            GlobalVar {
                name: v.name.clone(),
                space: if v.space == "const" {
                    StateSpace::Const
                } else {
                    StateSpace::Global
                },
                size,
                align: v.align,
                init,
            }
        })
        .collect();
    let inlined = Inlined::analyse(ast);
    let mut total = 0u64;
    let mut kernels = Vec::new();
    let mut kernel_index = HashMap::new();
    for (i, f) in ast.funcs.iter().enumerate() {
        if !f.is_entry || f.body.is_none() {
            continue;
        }
        let mut estimate = 0;
        let program = match inlined.check(i, limits) {
            Err(why) => Err(ExecError::Unsupported {
                instruction: why,
                line: f.line,
            }),
            Ok(cost) => {
                estimate = cost as usize;
                total = total.saturating_add(cost);
                if total > limits.max_module_instructions as u64 {
                    return Err(ParseError {
                        line: f.line,
                        expected: format!(
                            "at most {} instructions after inlining in all kernels together \
                             (Limits::max_module_instructions)",
                            limits.max_module_instructions
                        ),
                        found: format!("{total} by kernel {}", f.name),
                        limit: Some("max_module_instructions"),
                    });
                }
                Ok(())
            }
        };
        kernel_index.insert(f.name.clone(), kernels.len());
        kernels.push(build_kernel(ast, f, program, estimate, limits));
    }
    Ok(Module {
        kernels,
        kernel_index,
        globals,
    })
}

/// Deepest chain of nested calls the inliner accepts (deeper means recursion, in practice).
const MAX_CALL_DEPTH: u32 = 16;

/// What inlining each function would cost, found before inlining anything: per function, the
/// instructions its body amounts to with every call expanded (saturating), and the deepest chain of
/// calls below it (`u32::MAX` through recursion). Linear in the module's size whatever its call graph.
struct Inlined {
    cost: Vec<u64>,
    depth: Vec<u32>,
}

impl Inlined {
    fn analyse(ast: &Ast) -> Inlined {
        let n = ast.funcs.len();
        let mut own = vec![0u64; n];
        let mut callees: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, f) in ast.funcs.iter().enumerate() {
            for s in f.body.iter().flatten() {
                own[i] = own[i].saturating_add(match s {
                    // Each declared register is a slot and a scope entry to make.
                    Stmt::Reg { names, .. } => names.len().max(1) as u64,
                    Stmt::Instr(ins) if ins.opcode() == "call" => {
                        if let Some(g) = call_target(ins).and_then(|t| ast.func_position(t))
                            && ast.funcs[g].body.is_some()
                        {
                            callees[i].push(g);
                        }
                        // The call plus a spill per argument.
                        1 + ins.operands.len() as u64
                    }
                    _ => 1,
                });
            }
        }
        let mut cost = vec![0u64; n];
        let mut depth = vec![0u32; n];
        // 0: not visited, 1: on the DFS stack, 2: done. Iterative: call chains can be arbitrarily long.
        let mut state = vec![0u8; n];
        let mut stack: Vec<(usize, usize)> = Vec::new();
        for root in 0..n {
            if state[root] != 0 {
                continue;
            }
            state[root] = 1;
            stack.push((root, 0));
            while let Some((f, k)) = stack.last_mut() {
                let f = *f;
                if let Some(&g) = callees[f].get(*k) {
                    *k += 1;
                    if state[g] == 0 {
                        state[g] = 1;
                        stack.push((g, 0));
                    }
                    continue;
                }
                let mut c = own[f];
                let mut d = 0u32;
                for &g in &callees[f] {
                    if state[g] == 2 {
                        c = c.saturating_add(cost[g]);
                        d = d.max(depth[g].saturating_add(1));
                    } else {
                        // `g` is still on the stack: `f` is part of a recursion.
                        c = u64::MAX;
                        d = u32::MAX;
                    }
                }
                cost[f] = c;
                depth[f] = d;
                state[f] = 2;
                stack.pop();
            }
        }
        Inlined { cost, depth }
    }

    /// Function `i`'s instructions after inlining, or why it cannot be compiled.
    fn check(&self, i: usize, limits: &Limits) -> Result<u64, String> {
        if self.depth[i] > MAX_CALL_DEPTH {
            return Err(format!(
                "call depth over {MAX_CALL_DEPTH} (recursion is not supported)"
            ));
        }
        let max = limits.max_kernel_instructions as u64;
        if self.cost[i] > max {
            return Err(format!(
                "kernel of {} instructions after inlining (limit {max}, Limits::max_kernel_instructions)",
                if self.cost[i] == u64::MAX {
                    "over 2^64".to_string()
                } else {
                    self.cost[i].to_string()
                }
            ));
        }
        Ok(self.cost[i])
    }
}

/// The callee named by a `call` (its first plain name operand), as `Cx::call` reads it.
fn call_target(ins: &Instr) -> Option<&str> {
    ins.operands.iter().find_map(|o| match o {
        Operand::Reg(n) => Some(&**n),
        _ => None,
    })
}

fn align_up(v: usize, a: usize) -> usize {
    let a = a.max(1);
    v.div_ceil(a) * a
}

/// Compiles kernel `f`, unless `checked` says why not; `estimate` is its size after inlining.
fn build_kernel(
    ast: &Ast,
    f: &Func,
    checked: Result<(), ExecError>,
    estimate: usize,
    limits: &Limits,
) -> Kernel {
    let mut params = Vec::new();
    let mut off = 0;
    for p in &f.params {
        let size = p.size.unwrap_or(0);
        off = align_up(off, p.align);
        params.push(Param {
            name: p.name.clone(),
            offset: off,
            size,
            align: p.align,
        });
        off += size;
    }
    let declared_regs: usize = f
        .body
        .iter()
        .flatten()
        .map(|s| match s {
            Stmt::Reg { ty, names, .. } if *ty != Ty::Pred => {
                names.len() * if ty.size() == 8 { 2 } else { 1 }
            }
            _ => 0,
        })
        .sum();
    let program = checked.and_then(|()| {
        let mut cx = Cx::new(ast, limits);
        // Sized once: the estimate bounds the instructions from above (give or take a few); it also
        // counts register declarations, so past a million the vector grows as needed instead.
        cx.code.reserve_exact(estimate.min(1 << 20) + 1);
        cx.kernel(f, &params)
    });
    Kernel {
        name: f.name.clone(),
        param_bytes: off,
        params,
        max_threads: f.max_threads.unwrap_or(1024),
        num_regs: (declared_regs as u32).clamp(16, 255),
        program,
    }
}

#[derive(Debug, Clone, Copy)]
enum Sym {
    Reg(R),
    /// Offset in the thread's local frame (`.local` variables and call-argument `.param` variables).
    Local(u64),
    Shared(u64),
    /// Offset in the kernel parameter buffer.
    KParam(u64),
}

struct Cx<'a> {
    ast: &'a Ast,
    tex: Vec<TexInst>,
    /// Instructions the program may reach (a backstop behind the inlining estimate).
    max_code: usize,
    code: Vec<Inst>,
    nregs: u32,
    consts: Vec<(R, ConstVal)>,
    const_map: HashMap<ConstKey, R>,
    specials: Vec<(R, Special)>,
    global_syms: Vec<String>,
    global_idx: HashMap<String, usize>,
    shared: HashMap<String, u64>,
    shared_bytes: usize,
    local_bytes: usize,
    scopes: Vec<HashMap<String, Sym>>,
    labels: Vec<Option<u32>>,
    fixups: Vec<(usize, usize)>,
    depth: usize,
    sink: R,
    /// The carry flag of `add.cc`/`addc`, allocated on first use.
    cc: R,
}

#[derive(Hash, PartialEq, Eq, Clone, Copy)]
enum ConstKey {
    Imm(u64),
    Global(usize, i64),
    Dyn(i64),
    Special(u8, u8),
}

fn unsupported(ins: &Instr, why: &str) -> ExecError {
    let mut text = ins.text.to_string();
    if !why.is_empty() {
        text.push_str(" (");
        text.push_str(why);
        text.push(')');
    }
    ExecError::Unsupported {
        instruction: text,
        line: ins.line,
    }
}

type Res<T> = Result<T, ExecError>;

/// Modifiers that change nothing for a sequentially consistent interpreter.
fn ignorable(m: &str) -> bool {
    matches!(
        m,
        "nc" | "volatile"
            | "relaxed"
            | "acquire"
            | "release"
            | "acq_rel"
            | "weak"
            | "strong"
            | "mmio"
            | "ca"
            | "cg"
            | "cs"
            | "lu"
            | "cv"
            | "wb"
            | "wt"
            | "gpu"
            | "sys"
            | "cta"
            | "cluster"
            | "uni"
            | "sync"
            | "aligned"
            | "approx"
            | "full"
            | "noftz"
            | "to"
    ) || m.starts_with("L1::")
        || m.starts_with("L2::")
}

impl<'a> Cx<'a> {
    fn new(ast: &'a Ast, limits: &Limits) -> Self {
        let mut cx = Cx {
            ast,
            tex: Vec::new(),
            max_code: limits.max_kernel_instructions,
            code: Vec::new(),
            nregs: 0,
            consts: Vec::new(),
            const_map: HashMap::new(),
            specials: Vec::new(),
            global_syms: Vec::new(),
            global_idx: HashMap::new(),
            shared: HashMap::new(),
            shared_bytes: 0,
            local_bytes: 0,
            scopes: Vec::new(),
            labels: Vec::new(),
            fixups: Vec::new(),
            depth: 0,
            sink: 0,
            cc: NONE,
        };
        cx.sink = cx.new_reg();
        cx
    }

    fn new_reg(&mut self) -> R {
        // Past MAX_REGS the program is refused in `kernel`; keep counting without overflow until then.
        self.nregs = self.nregs.saturating_add(1);
        self.nregs - 1
    }

    fn konst(&mut self, key: ConstKey, val: ConstVal) -> R {
        if let Some(r) = self.const_map.get(&key) {
            return *r;
        }
        let r = self.new_reg();
        self.const_map.insert(key, r);
        self.consts.push((r, val));
        r
    }

    fn imm(&mut self, v: u64) -> R {
        self.konst(ConstKey::Imm(v), ConstVal::Imm(v))
    }

    fn special(&mut self, name: &str) -> Option<R> {
        let dim = |s: &str| match s {
            "x" => Some(0),
            "y" => Some(1),
            "z" => Some(2),
            _ => None,
        };
        let sp = if let Some((base, d)) = name.rsplit_once('.') {
            let d = dim(d)?;
            match base {
                "%tid" => Special::Tid(d),
                "%ntid" => Special::Ntid(d),
                "%ctaid" => Special::Ctaid(d),
                "%nctaid" => Special::Nctaid(d),
                _ => return None,
            }
        } else {
            match name {
                "%laneid" => Special::LaneId,
                "%warpid" => Special::WarpId,
                "%nwarpid" => Special::NWarpId,
                "%lanemask_eq" => Special::LaneMaskEq,
                "%lanemask_lt" => Special::LaneMaskLt,
                "%lanemask_le" => Special::LaneMaskLe,
                "%lanemask_gt" => Special::LaneMaskGt,
                "%lanemask_ge" => Special::LaneMaskGe,
                "%smid" | "%gridid" | "%clusterid" => Special::Zero,
                "%nsmid" => Special::Zero,
                "%dynamic_smem_size" => Special::DynSmem,
                "%total_smem_size" => Special::TotalSmem,
                _ => return None,
            }
        };
        let code = match sp {
            Special::Tid(d) => (0, d as u8),
            Special::Ntid(d) => (1, d as u8),
            Special::Ctaid(d) => (2, d as u8),
            Special::Nctaid(d) => (3, d as u8),
            Special::LaneId => (4, 0),
            Special::WarpId => (5, 0),
            Special::NWarpId => (6, 0),
            Special::LaneMaskEq => (7, 0),
            Special::LaneMaskLt => (8, 0),
            Special::LaneMaskLe => (9, 0),
            Special::LaneMaskGt => (10, 0),
            Special::LaneMaskGe => (11, 0),
            Special::Zero => (12, 0),
            Special::DynSmem => (13, 0),
            Special::TotalSmem => (14, 0),
        };
        let key = ConstKey::Special(code.0, code.1);
        if let Some(r) = self.const_map.get(&key) {
            return Some(*r);
        }
        let r = self.new_reg();
        self.const_map.insert(key, r);
        self.specials.push((r, sp));
        Some(r)
    }

    fn lookup(&self, name: &str) -> Option<Sym> {
        self.scopes.iter().rev().find_map(|s| s.get(name).copied())
    }

    fn declare(&mut self, name: &str, sym: Sym) {
        if let Some(s) = self.scopes.last_mut() {
            s.insert(name.to_string(), sym);
        }
    }

    fn alloc_local(&mut self, size: usize, align: usize) -> u64 {
        self.local_bytes = align_up(self.local_bytes, align);
        let off = self.local_bytes;
        self.local_bytes += size;
        off as u64
    }

    fn alloc_shared(&mut self, key: &str, size: usize, align: usize) -> u64 {
        if let Some(o) = self.shared.get(key) {
            return *o;
        }
        self.shared_bytes = align_up(self.shared_bytes, align);
        let off = self.shared_bytes as u64;
        self.shared_bytes += size;
        self.shared.insert(key.to_string(), off);
        off
    }

    /// Address (in its own space) of a symbol, as a constant slot, plus the space it lives in.
    fn sym_addr(&mut self, name: &str, off: i64) -> Option<(R, Space)> {
        match self.lookup(name) {
            Some(Sym::Reg(_)) => None,
            Some(Sym::Local(o)) => Some((self.imm(o.wrapping_add(off as u64)), Space::Local)),
            Some(Sym::Shared(o)) => Some((self.imm(o.wrapping_add(off as u64)), Space::Shared)),
            Some(Sym::KParam(o)) => Some((self.imm(o.wrapping_add(off as u64)), Space::Param)),
            None => {
                let v = self.ast.var(name)?;
                match v.space.as_str() {
                    "global" | "const" => {
                        let idx = match self.global_idx.get(name) {
                            Some(&i) => i,
                            None => {
                                self.global_idx
                                    .insert(name.to_string(), self.global_syms.len());
                                self.global_syms.push(name.to_string());
                                self.global_syms.len() - 1
                            }
                        };
                        Some((
                            self.konst(ConstKey::Global(idx, off), ConstVal::Global(idx, off)),
                            Space::Global,
                        ))
                    }
                    "shared" => match v.size {
                        Some(size) => {
                            let o = self.alloc_shared(name, size, v.align);
                            Some((self.imm(o.wrapping_add(off as u64)), Space::Shared))
                        }
                        None => Some((
                            self.konst(ConstKey::Dyn(off), ConstVal::DynShared(off)),
                            Space::Shared,
                        )),
                    },
                    _ => None,
                }
            }
        }
    }

    /// `d = f(a, b, c)` over four 32-bit register operands (the packed SIMD integer forms).
    fn emit_tern_u32(&mut self, ins: &Instr, f: F3) -> Res<()> {
        let ops = &ins.operands;
        let d = self.dst(ins, &ops[0])?;
        let a = self.src(ins, &ops[1], Ty::U32)?;
        let b = self.src(ins, &ops[2], Ty::U32)?;
        let c = self.src(ins, &ops[3], Ty::U32)?;
        self.emit(
            ins,
            Op::Tern {
                f,
                d,
                a,
                b,
                c,
                fl: 0,
            },
        )
    }

    fn emit(&mut self, ins: &Instr, op: Op) -> Res<()> {
        // Inlining can multiply code; refuse absurd sizes instead of exhausting memory.
        if self.code.len() >= self.max_code {
            return Err(unsupported(
                ins,
                &format!(
                    "program over {} instructions after inlining (Limits::max_kernel_instructions)",
                    self.max_code
                ),
            ));
        }
        let (guard, gneg) = match &ins.guard {
            None => (NONE, false),
            Some((neg, p)) => match self.lookup(p) {
                Some(Sym::Reg(r)) => (r, *neg),
                _ => return Err(unsupported(ins, &format!("unknown guard predicate {p}"))),
            },
        };
        self.code.push(Inst {
            op,
            guard,
            gneg,
            line: ins.line as u32,
        });
        Ok(())
    }

    fn kernel(&mut self, f: &Func, params: &[Param]) -> Res<Program> {
        let mut base = HashMap::new();
        for p in params {
            base.insert(p.name.clone(), Sym::KParam(p.offset as u64));
        }
        let body = f.body.as_deref().unwrap_or(&[]);
        self.body(body, base, None)?;
        for (at, label) in std::mem::take(&mut self.fixups) {
            let Some(target) = self.labels[label] else {
                return Err(ExecError::Unsupported {
                    instruction: "bra to an undefined label".into(),
                    line: self.code[at].line as usize,
                });
            };
            if let Op::Bra { target: t } = &mut self.code[at].op {
                *t = target;
            }
        }
        if self.nregs as usize > MAX_REGS {
            return Err(ExecError::Unsupported {
                instruction: format!("{} registers after inlining (limit {MAX_REGS})", self.nregs),
                line: f.line,
            });
        }
        if self.local_bytes > MAX_LOCAL {
            return Err(ExecError::Unsupported {
                instruction: format!(
                    "{} bytes of local memory per thread (limit {MAX_LOCAL})",
                    self.local_bytes
                ),
                line: f.line,
            });
        }
        // Falling off the end of a kernel exits.
        self.code.push(Inst {
            op: Op::Exit,
            guard: NONE,
            gneg: false,
            line: f.line as u32,
        });
        self.code.shrink_to_fit();
        self.consts.shrink_to_fit();
        Ok(Program {
            code: std::mem::take(&mut self.code),
            tex: std::mem::take(&mut self.tex),
            nregs: self.nregs,
            consts: std::mem::take(&mut self.consts),
            specials: std::mem::take(&mut self.specials),
            global_syms: std::mem::take(&mut self.global_syms),
            shared_bytes: self.shared_bytes,
            local_bytes: self.local_bytes,
        })
    }

    /// Compiles one function body instance; `ret` branches to `ret_label` (inlined call) or exits (kernel).
    fn body(
        &mut self,
        body: &[Stmt],
        base: HashMap<String, Sym>,
        ret_label: Option<usize>,
    ) -> Res<()> {
        let saved = std::mem::take(&mut self.scopes);
        self.scopes.push(base);
        // Labels are function-scoped.
        let mut labels = HashMap::new();
        for s in body {
            if let Stmt::Label(l) = s {
                labels.insert(l.clone(), self.labels.len());
                self.labels.push(None);
            }
        }
        for s in body {
            match s {
                Stmt::Open => self.scopes.push(HashMap::new()),
                Stmt::Close => {
                    if self.scopes.len() > 1 {
                        self.scopes.pop();
                    }
                }
                Stmt::Label(l) => {
                    if let Some(&id) = labels.get(l) {
                        self.labels[id] = Some(self.code.len() as u32);
                    }
                }
                Stmt::Reg { names, .. } => {
                    for n in names {
                        let r = self.new_reg();
                        self.declare(n, Sym::Reg(r));
                    }
                }
                Stmt::Var(v) => self.local_var(v)?,
                Stmt::Instr(ins) => self.instr(ins, &labels, ret_label)?,
            }
        }
        self.scopes = saved;
        Ok(())
    }

    fn local_var(&mut self, v: &VarDecl) -> Res<()> {
        let size = v.size.unwrap_or(0);
        let sym = match v.space.as_str() {
            "local" | "param" => Sym::Local(self.alloc_local(size, v.align)),
            "shared" => {
                let key = format!("{}@{}", v.name, v.line);
                Sym::Shared(self.alloc_shared(&key, size, v.align))
            }
            _ => {
                return Err(ExecError::Unsupported {
                    instruction: format!("function-scope .{} variable {}", v.space, v.name),
                    line: v.line,
                });
            }
        };
        self.declare(&v.name, sym);
        Ok(())
    }

    /// A source operand as a slot; immediates are converted to `ty`'s representation.
    fn src(&mut self, ins: &Instr, o: &Operand, ty: Ty) -> Res<R> {
        match o {
            Operand::Reg(n) => {
                if let Some(Sym::Reg(r)) = self.lookup(n) {
                    return Ok(r);
                }
                if let Some(r) = self.special(n) {
                    return Ok(r);
                }
                if &**n == "WARP_SZ" {
                    return Ok(self.imm(32));
                }
                if let Some((r, _)) = self.sym_addr(n, 0) {
                    return Ok(r);
                }
                Err(unsupported(ins, &format!("unknown operand {n}")))
            }
            Operand::SymOff(n, off) => match self.sym_addr(n, *off) {
                Some((r, _)) => Ok(r),
                None => Err(unsupported(ins, &format!("unknown symbol {n}"))),
            },
            Operand::Int(v) => {
                let bits = match ty {
                    Ty::F32 => u64::from((*v as f32).to_bits()),
                    Ty::F64 => (*v as f64).to_bits(),
                    _ => *v as u64,
                };
                Ok(self.imm(bits))
            }
            Operand::F32(b) => {
                let f = f32::from_bits(*b);
                let bits = match ty {
                    Ty::F64 => f64::from(f).to_bits(),
                    Ty::F16 => ops::f2h(f),
                    Ty::Bf16 => ops::f2b(f),
                    _ => u64::from(*b),
                };
                Ok(self.imm(bits))
            }
            Operand::F64(b) => {
                let f = f64::from_bits(*b);
                let bits = match ty {
                    Ty::F32 => u64::from((f as f32).to_bits()),
                    Ty::F16 => u64::from(half::f16::from_f64(f).to_bits()),
                    Ty::Bf16 => u64::from(half::bf16::from_f64(f).to_bits()),
                    _ => *b,
                };
                Ok(self.imm(bits))
            }
            _ => Err(unsupported(ins, "unexpected operand form")),
        }
    }

    fn dst(&mut self, ins: &Instr, o: &Operand) -> Res<R> {
        match o {
            Operand::Reg(n) => match self.lookup(n) {
                Some(Sym::Reg(r)) => Ok(r),
                _ => Err(unsupported(ins, &format!("unknown destination {n}"))),
            },
            Operand::Sink => Ok(self.sink),
            _ => Err(unsupported(ins, "destination is not a register")),
        }
    }

    fn pred_src(&mut self, ins: &Instr, o: &Operand) -> Res<(R, bool)> {
        match o {
            Operand::NotReg(n) => Ok((self.src(ins, &Operand::Reg(n.clone()), Ty::Pred)?, true)),
            Operand::Int(v) => Ok((self.imm(u64::from(*v != 0)), false)),
            o => Ok((self.src(ins, o, Ty::Pred)?, false)),
        }
    }

    /// `[base+off]` with the instruction's space; symbols resolve to their own space.
    fn addr(&mut self, ins: &Instr, o: &Operand, space: Space) -> Res<(R, i64, Space)> {
        match o {
            Operand::Addr(None, off) => Ok((self.imm(0), *off, space)),
            Operand::Addr(Some(n), off) => {
                if let Some(Sym::Reg(r)) = self.lookup(n) {
                    return Ok((r, *off, space));
                }
                match self.sym_addr(n, 0) {
                    Some((r, sp)) => {
                        // A generic access to a symbol goes to the symbol's own space.
                        let sp = if space == Space::Generic {
                            sp
                        } else {
                            space_for(space, sp)
                        };
                        Ok((r, *off, sp))
                    }
                    None => Err(unsupported(ins, &format!("unknown address {n}"))),
                }
            }
            Operand::Reg(n) => self.addr(ins, &Operand::Addr(Some(n.clone()), 0), space),
            _ => Err(unsupported(ins, "expected an address")),
        }
    }

    fn vec_regs(&mut self, ins: &Instr, o: &Operand, ty: Ty, dst: bool) -> Res<(u8, [R; 4])> {
        let list = match o {
            Operand::Vec(v) => v.clone(),
            o => vec![o.clone()],
        };
        if list.is_empty() || list.len() > 4 {
            return Err(unsupported(ins, "vector of more than 4 elements"));
        }
        let mut regs = [NONE; 4];
        for (i, e) in list.iter().enumerate() {
            regs[i] = if dst {
                self.dst(ins, e)?
            } else {
                self.src(ins, e, ty)?
            };
        }
        Ok((list.len() as u8, regs))
    }

    fn instr(
        &mut self,
        ins: &Instr,
        labels: &HashMap<String, usize>,
        ret_label: Option<usize>,
    ) -> Res<()> {
        let mods: Vec<&str> = ins.mods().collect();
        let types: Vec<Ty> = mods.iter().filter_map(|m| Ty::from_name(m)).collect();
        let ty = types.last().copied();
        let has = |m: &str| mods.contains(&m);
        let rnd = if has("rz") || has("rzi") {
            Rnd::Z
        } else if has("rm") || has("rmi") {
            Rnd::M
        } else if has("rp") || has("rpi") {
            Rnd::P
        } else {
            Rnd::N
        };
        let mut fl = 0;
        if has("ftz") {
            fl |= FL_FTZ;
        }
        if has("sat") && ty != Some(Ty::S32) {
            fl |= FL_SAT;
        }
        let ops = &ins.operands;
        let need = |n: usize| -> Res<()> {
            if ops.len() < n {
                Err(unsupported(ins, "too few operands"))
            } else {
                Ok(())
            }
        };
        let op_name = ins.opcode();
        match op_name {
            "mov" => {
                need(2)?;
                let ty = ty.ok_or_else(|| unsupported(ins, "missing type"))?;
                match (&ops[0], &ops[1]) {
                    (Operand::Vec(parts), _) => {
                        let a = self.src(ins, &ops[1], ty)?;
                        let (n, dst) = self.vec_regs(ins, &ops[0], ty, true)?;
                        let bits = (ty.size() * 8 / parts.len()) as u8;
                        self.emit(ins, Op::Unpack { a, n, bits, dst })
                    }
                    (_, Operand::Vec(parts)) => {
                        let d = self.dst(ins, &ops[0])?;
                        let (n, src) = self.vec_regs(ins, &ops[1], ty, false)?;
                        let bits = (ty.size() * 8 / parts.len()) as u8;
                        self.emit(ins, Op::Pack { d, n, bits, src })
                    }
                    (_, Operand::Reg(r))
                        if matches!(&**r, "%clock" | "%clock64" | "%globaltimer") =>
                    {
                        let d = self.dst(ins, &ops[0])?;
                        self.emit(ins, Op::Clock { d })
                    }
                    _ => {
                        let d = self.dst(ins, &ops[0])?;
                        let a = self.src(ins, &ops[1], ty)?;
                        self.emit(ins, Op::Mov { d, a })
                    }
                }
            }
            "ld" | "ldu" | "st" => self.ld_st(ins, &mods, ty),
            "cvta" => {
                need(2)?;
                let d = self.dst(ins, &ops[0])?;
                let a = self.src(ins, &ops[1], Ty::U64)?;
                let to = has("to");
                let window = if has("shared") {
                    crate::SHARED_WINDOW
                } else if has("local") {
                    crate::LOCAL_WINDOW
                } else if has("param") {
                    crate::PARAM_WINDOW
                } else if has("global") || has("const") {
                    0
                } else {
                    return Err(unsupported(ins, "cvta of this space"));
                };
                if window == 0 {
                    self.emit(ins, Op::Mov { d, a })
                } else {
                    self.emit(ins, Op::Cvta { d, a, window, to })
                }
            }
            "isspacep" => {
                need(2)?;
                let d = self.dst(ins, &ops[0])?;
                let a = self.src(ins, &ops[1], Ty::U64)?;
                let space = if has("shared") {
                    Space::Shared
                } else if has("local") {
                    Space::Local
                } else if has("global") {
                    Space::Global
                } else {
                    return Err(unsupported(ins, ""));
                };
                self.emit(ins, Op::IsSpace { d, a, space })
            }
            "cvt" => {
                need(2)?;
                if types.len() != 2 {
                    return Err(unsupported(ins, "cvt needs two types"));
                }
                let (dt, st) = (types[0], types[1]);
                if let Some(m) = mods.iter().find(|m| {
                    Ty::from_name(m).is_none()
                        && !matches!(
                            **m,
                            "rn" | "rz"
                                | "rm"
                                | "rp"
                                | "rni"
                                | "rzi"
                                | "rmi"
                                | "rpi"
                                | "sat"
                                | "ftz"
                        )
                }) {
                    return Err(unsupported(ins, &format!("modifier .{m}")));
                }
                let int_round = mods
                    .iter()
                    .any(|m| matches!(*m, "rni" | "rzi" | "rmi" | "rpi"));
                if matches!(dt, Ty::F16x2 | Ty::Bf16x2) && st == Ty::F32 {
                    need(3)?;
                    if rnd != Rnd::N {
                        return Err(unsupported(ins, ""));
                    }
                    let d = self.dst(ins, &ops[0])?;
                    let a = self.src(ins, &ops[1], st)?;
                    let b = self.src(ins, &ops[2], st)?;
                    let f: F2 = if dt == Ty::F16x2 {
                        |a, b| {
                            ops::f2h(f32::from_bits(b as u32))
                                | ops::f2h(f32::from_bits(a as u32)) << 16
                        }
                    } else {
                        |a, b| {
                            ops::f2b(f32::from_bits(b as u32))
                                | ops::f2b(f32::from_bits(a as u32)) << 16
                        }
                    };
                    return self.emit(ins, Op::Bin { f, d, a, b, fl: 0 });
                }
                let spec = CvtSpec {
                    dst: dt,
                    src: st,
                    rnd,
                    int_round,
                    sat: has("sat"),
                    ftz: has("ftz"),
                };
                if !ops::cvt_supported(&spec) {
                    return Err(unsupported(ins, ""));
                }
                let d = self.dst(ins, &ops[0])?;
                let a = self.src(ins, &ops[1], st)?;
                self.emit(ins, Op::Cvt { d, a, spec })
            }
            "setp" | "set" => self.setp(ins, &mods, &types),
            "selp" => {
                need(4)?;
                let ty = ty.ok_or_else(|| unsupported(ins, "missing type"))?;
                let d = self.dst(ins, &ops[0])?;
                let a = self.src(ins, &ops[1], ty)?;
                let b = self.src(ins, &ops[2], ty)?;
                let (c, cneg) = self.pred_src(ins, &ops[3])?;
                self.emit(ins, Op::Selp { d, a, b, c, cneg })
            }
            "bra" | "brx" => {
                if op_name == "brx" {
                    return Err(unsupported(ins, "indirect branch"));
                }
                need(1)?;
                let Operand::Reg(l) = &ops[0] else {
                    return Err(unsupported(ins, "branch target"));
                };
                let Some(&id) = labels.get(&**l) else {
                    return Err(unsupported(ins, &format!("unknown label {l}")));
                };
                self.fixups.push((self.code.len(), id));
                self.emit(ins, Op::Bra { target: u32::MAX })
            }
            "ret" => match ret_label {
                Some(id) => {
                    self.fixups.push((self.code.len(), id));
                    self.emit(ins, Op::Bra { target: u32::MAX })
                }
                None => self.emit(ins, Op::Exit),
            },
            "exit" => self.emit(ins, Op::Exit),
            "trap" | "brkpt" => self.emit(ins, Op::Trap),
            "call" if ins.guard.is_some() => Err(unsupported(ins, "predicated call")),
            "call" => self.call(ins),
            "bar" | "barrier" => {
                if has("warp") {
                    return self.emit(ins, Op::WarpSync);
                }
                if has("red") {
                    // bar.red.{popc.u32,and.pred,or.pred} d, id, [count,] {!}p
                    let op = if has("popc") {
                        0
                    } else if has("and") {
                        1
                    } else if has("or") {
                        2
                    } else {
                        return Err(unsupported(ins, "barrier reduction"));
                    };
                    if ops.len() != 3 {
                        return Err(unsupported(ins, "barrier reduction with a thread count"));
                    }
                    let d = self.dst(ins, &ops[0])?;
                    let (c, cneg) = self.pred_src(ins, &ops[2])?;
                    self.emit(ins, Op::BarRed { c, cneg })?;
                    return self.emit(ins, Op::BarRedResult { op, d });
                }
                if has("arrive") {
                    return Err(unsupported(ins, "split arrive/wait barriers"));
                }
                match ops.get(1) {
                    None => self.emit(ins, Op::Bar),
                    // A thread count is fine when it covers the whole block (checked at run time).
                    Some(n) => {
                        let count = self.src(ins, n, Ty::U32)?;
                        self.emit(ins, Op::BarCount { count })
                    }
                }
            }
            "tex" | "tld4" | "suld" | "sust" | "txq" | "suq" | "sured" | "suatom" | "tld"
            | "istypep" | "texmode" => self.texture(ins, &mods),
            "membar" | "fence" | "prefetch" | "prefetchu" | "nanosleep" | "pmevent" | "discard" => {
                self.emit(ins, Op::Nop)
            }
            "atom" | "red" => self.atom(ins, &mods, ty),
            "shfl" => {
                need(5)?;
                let mode = if has("up") {
                    0
                } else if has("down") {
                    1
                } else if has("bfly") {
                    2
                } else if has("idx") {
                    3
                } else {
                    return Err(unsupported(ins, "shfl mode"));
                };
                if !has("sync") {
                    return Err(unsupported(ins, "shfl without .sync"));
                }
                let (d, dp) = match &ops[0] {
                    Operand::Pair(p) => {
                        let d = self.dst(ins, &Operand::Reg(p.0.clone()))?;
                        (d, self.dst(ins, &Operand::Reg(p.1.clone()))?)
                    }
                    o => (self.dst(ins, o)?, NONE),
                };
                let a = self.src(ins, &ops[1], Ty::B32)?;
                let b = self.src(ins, &ops[2], Ty::B32)?;
                let c = self.src(ins, &ops[3], Ty::B32)?;
                self.emit(
                    ins,
                    Op::Shfl {
                        mode,
                        d,
                        dp,
                        a,
                        b,
                        c,
                    },
                )
            }
            "vote" => {
                need(2)?;
                let mode = if has("all") {
                    0
                } else if has("any") {
                    1
                } else if has("uni") {
                    2
                } else if has("ballot") {
                    3
                } else {
                    return Err(unsupported(ins, "vote mode"));
                };
                let d = self.dst(ins, &ops[0])?;
                let (a, aneg) = self.pred_src(ins, &ops[1])?;
                self.emit(ins, Op::Vote { mode, d, a, aneg })
            }
            "match" => {
                need(3)?;
                let all = has("all");
                if !all && !has("any") {
                    return Err(unsupported(ins, "match mode"));
                }
                let wide = match ty {
                    Some(Ty::B32) => false,
                    Some(Ty::B64) => true,
                    _ => return Err(unsupported(ins, "match type")),
                };
                let (d, dp) = match &ops[0] {
                    Operand::Pair(p) => {
                        let d = self.dst(ins, &Operand::Reg(p.0.clone()))?;
                        (d, self.dst(ins, &Operand::Reg(p.1.clone()))?)
                    }
                    o => (self.dst(ins, o)?, NONE),
                };
                let a = self.src(ins, &ops[1], Ty::B64)?;
                self.emit(
                    ins,
                    Op::Match {
                        all,
                        wide,
                        d,
                        dp,
                        a,
                    },
                )
            }
            "activemask" => {
                need(1)?;
                let d = self.dst(ins, &ops[0])?;
                self.emit(ins, Op::Activemask { d })
            }
            "redux" => {
                need(2)?;
                let op = ["add", "min", "max", "and", "or", "xor"]
                    .iter()
                    .position(|m| has(m))
                    .ok_or_else(|| unsupported(ins, ""))? as u8;
                let d = self.dst(ins, &ops[0])?;
                let a = self.src(ins, &ops[1], Ty::B32)?;
                self.emit(
                    ins,
                    Op::Redux {
                        op,
                        signed: ty == Some(Ty::S32),
                        d,
                        a,
                    },
                )
            }
            "add" | "sub" | "addc" | "subc" | "mad" | "madc"
                if has("cc") || op_name.ends_with('c') =>
            {
                let is_mad = op_name.starts_with("mad");
                need(if is_mad { 4 } else { 3 })?;
                let ty = ty.ok_or_else(|| unsupported(ins, "missing type"))?;
                let wide = match ty {
                    Ty::U32 | Ty::S32 | Ty::B32 => false,
                    Ty::U64 | Ty::S64 | Ty::B64 => true,
                    _ => return Err(unsupported(ins, "")),
                };
                if self.cc == NONE {
                    self.cc = self.new_reg();
                }
                let d = self.dst(ins, &ops[0])?;
                let a = self.src(ins, &ops[1], ty)?;
                let b = self.src(ins, &ops[2], ty)?;
                let c = if is_mad {
                    self.src(ins, &ops[3], ty)?
                } else {
                    NONE
                };
                let mul = match (is_mad, has("hi")) {
                    (false, _) => 0,
                    (true, false) => 1,
                    (true, true) => 2,
                };
                let op = Op::Carry {
                    sub: op_name.starts_with("sub"),
                    cin: op_name.ends_with('c'),
                    cout: has("cc"),
                    wide,
                    mul,
                    signed: ty.is_signed(),
                    d,
                    a,
                    b,
                    c,
                    cc: self.cc,
                };
                self.emit(ins, op)
            }
            "dp4a" | "dp2a" => {
                need(4)?;
                if types.len() != 2 || types.iter().any(|t| !matches!(t, Ty::U32 | Ty::S32)) {
                    return Err(unsupported(ins, ""));
                }
                let (sa, sb) = (types[0] == Ty::S32, types[1] == Ty::S32);
                let f: F3 = match (op_name, has("hi"), sa, sb) {
                    ("dp4a", _, false, false) => |a, b, c| ops::dp::<false, false, 4, 0>(a, b, c),
                    ("dp4a", _, false, true) => |a, b, c| ops::dp::<false, true, 4, 0>(a, b, c),
                    ("dp4a", _, true, false) => |a, b, c| ops::dp::<true, false, 4, 0>(a, b, c),
                    ("dp4a", _, true, true) => |a, b, c| ops::dp::<true, true, 4, 0>(a, b, c),
                    (_, false, false, false) => |a, b, c| ops::dp::<false, false, 2, 0>(a, b, c),
                    (_, false, false, true) => |a, b, c| ops::dp::<false, true, 2, 0>(a, b, c),
                    (_, false, true, false) => |a, b, c| ops::dp::<true, false, 2, 0>(a, b, c),
                    (_, false, true, true) => |a, b, c| ops::dp::<true, true, 2, 0>(a, b, c),
                    (_, true, false, false) => |a, b, c| ops::dp::<false, false, 2, 2>(a, b, c),
                    (_, true, false, true) => |a, b, c| ops::dp::<false, true, 2, 2>(a, b, c),
                    (_, true, true, false) => |a, b, c| ops::dp::<true, false, 2, 2>(a, b, c),
                    (_, true, true, true) => |a, b, c| ops::dp::<true, true, 2, 2>(a, b, c),
                };
                if op_name == "dp2a" && !has("lo") && !has("hi") {
                    return Err(unsupported(ins, "dp2a needs .lo or .hi"));
                }
                self.emit_tern_u32(ins, f)
            }
            "vabsdiff4" => {
                need(4)?;
                if types.len() != 3
                    || mods
                        .iter()
                        .any(|m| Ty::from_name(m).is_none() && *m != "add")
                {
                    return Err(unsupported(ins, "only the plain and .add SIMD forms"));
                }
                let full = if has("add") {
                    "vabsdiff4.add"
                } else {
                    "vabsdiff4"
                };
                let f = ops::int_tern(full, types[1]).ok_or_else(|| unsupported(ins, ""))?;
                self.emit_tern_u32(ins, f)
            }
            _ => self.arith(ins, &mods, ty, rnd, fl),
        }
    }

    fn ld_st(&mut self, ins: &Instr, mods: &[&str], ty: Option<Ty>) -> Res<()> {
        let ty = ty.ok_or_else(|| unsupported(ins, "missing type"))?;
        let mut space = Space::Generic;
        for m in mods {
            space = match *m {
                "global" => Space::Global,
                "const" => Space::Global,
                "shared" | "shared::cta" | "shared::cluster" => Space::Shared,
                "local" => Space::Local,
                "param" | "param::entry" | "param::func" => Space::Param,
                v if v.starts_with('v') || Ty::from_name(v).is_some() || ignorable(v) => continue,
                _ => return Err(unsupported(ins, &format!("modifier .{m}"))),
            };
        }
        if ty == Ty::B128 || mods.contains(&"v8") {
            return Err(unsupported(ins, "128-bit or 8-wide access"));
        }
        if ins.operands.len() < 2 {
            return Err(unsupported(ins, "too few operands"));
        }
        let size = ty.size() as u8;
        let signed = ty.is_signed();
        if ins.opcode() == "st" {
            let (base, off, space) = self.addr(ins, &ins.operands[0], space)?;
            let (n, src) = self.vec_regs(ins, &ins.operands[1], ty, false)?;
            if space == Space::Param {
                return Err(unsupported(ins, "store to a kernel parameter"));
            }
            self.emit(
                ins,
                Op::St {
                    space,
                    size,
                    n,
                    src,
                    base,
                    off,
                },
            )
        } else {
            let (base, off, space) = self.addr(ins, &ins.operands[1], space)?;
            let (n, dst) = self.vec_regs(ins, &ins.operands[0], ty, true)?;
            self.emit(
                ins,
                Op::Ld {
                    space,
                    size,
                    signed,
                    n,
                    dst,
                    base,
                    off,
                },
            )
        }
    }

    fn atom(&mut self, ins: &Instr, mods: &[&str], ty: Option<Ty>) -> Res<()> {
        let ty = ty.ok_or_else(|| unsupported(ins, "missing type"))?;
        let mut space = Space::Generic;
        let mut op = None;
        for m in mods {
            match *m {
                "global" => space = Space::Global,
                "shared" | "shared::cta" => space = Space::Shared,
                "add" => {
                    op = Some(match ty {
                        Ty::F32 => AtomOp::FAdd32,
                        Ty::F64 => AtomOp::FAdd64,
                        Ty::F16x2 => AtomOp::FAddH2,
                        Ty::Bf16x2 => AtomOp::FAddB2,
                        Ty::F16 | Ty::Bf16 => return Err(unsupported(ins, "16-bit float atomics")),
                        _ => AtomOp::Add,
                    });
                }
                "min" => op = Some(AtomOp::Min),
                "max" => op = Some(AtomOp::Max),
                "exch" => op = Some(AtomOp::Exch),
                "cas" => op = Some(AtomOp::Cas),
                "and" => op = Some(AtomOp::And),
                "or" => op = Some(AtomOp::Or),
                "xor" => op = Some(AtomOp::Xor),
                "inc" => op = Some(AtomOp::Inc),
                "dec" => op = Some(AtomOp::Dec),
                v if Ty::from_name(v).is_some() || ignorable(v) => {}
                _ => return Err(unsupported(ins, &format!("modifier .{m}"))),
            }
        }
        let op = op.ok_or_else(|| unsupported(ins, "missing atomic operation"))?;
        let size = ty.size();
        if size != 4 && size != 8 {
            return Err(unsupported(ins, "atomics on 16-bit data"));
        }
        if matches!(op, AtomOp::Min | AtomOp::Max) && ty.is_float() {
            return Err(unsupported(ins, "float atomic min/max"));
        }
        let red = ins.opcode() == "red";
        let o = &ins.operands;
        let first = if red { 0 } else { 1 };
        if o.len() < first + 2 {
            return Err(unsupported(ins, "too few operands"));
        }
        let d = if red {
            self.sink
        } else {
            self.dst(ins, &o[0])?
        };
        let (base, off, space) = self.addr(ins, &o[first], space)?;
        let b = self.src(ins, &o[first + 1], ty)?;
        let c = if op == AtomOp::Cas {
            let Some(c) = o.get(first + 2) else {
                return Err(unsupported(ins, "cas needs 3 operands"));
            };
            self.src(ins, c, ty)?
        } else {
            NONE
        };
        self.emit(
            ins,
            Op::Atom {
                space,
                op,
                signed: ty.is_signed(),
                size: size as u8,
                d,
                base,
                off,
                b,
                c,
            },
        )
    }

    fn setp(&mut self, ins: &Instr, mods: &[&str], types: &[Ty]) -> Res<()> {
        let o = &ins.operands;
        // set.<cmp>[.bool].dtype.stype / setp.<cmp>[.bool].type
        let is_set = ins.opcode() == "set";
        let sty = *types
            .last()
            .ok_or_else(|| unsupported(ins, "missing type"))?;
        let cmp = mods.first().copied().unwrap_or("");
        // `.ftz` flushes f32 subnormal inputs before comparing.
        let fl = if sty == Ty::F32 && mods.contains(&"ftz") {
            FL_FTZ
        } else {
            0
        };
        if let Some(m) = mods
            .iter()
            .skip(1)
            .find(|m| Ty::from_name(m).is_none() && !matches!(**m, "and" | "or" | "xor" | "ftz"))
        {
            return Err(unsupported(ins, &format!("modifier .{m}")));
        }
        let f = if sty.is_float() {
            ops::flt_cmp(cmp, sty)
        } else {
            ops::int_cmp(cmp, sty)
        };
        let f = f.ok_or_else(|| unsupported(ins, ""))?;
        let comb = match mods.get(1) {
            Some(&"and") => 1,
            Some(&"or") => 2,
            Some(&"xor") => 3,
            _ => 0,
        };
        let need = if comb != 0 { 4 } else { 3 };
        if o.len() < need {
            return Err(unsupported(ins, "too few operands"));
        }
        if is_set {
            // set writes 0xffffffff / 0 (or 1.0f / 0.0 for .f32 destinations).
            if types.len() != 2 || comb != 0 {
                return Err(unsupported(ins, ""));
            }
            let d = self.dst(ins, &o[0])?;
            let a = self.src(ins, &o[1], sty)?;
            let b = self.src(ins, &o[2], sty)?;
            let p = self.sink;
            self.emit(
                ins,
                Op::Setp {
                    f,
                    fl,
                    comb: 0,
                    d: p,
                    dn: NONE,
                    a,
                    b,
                    c: NONE,
                    cneg: false,
                },
            )?;
            let (t, z) = if types[0] == Ty::F32 {
                (u64::from(1f32.to_bits()), 0)
            } else {
                (0xffff_ffff, 0)
            };
            let (t, z) = (self.imm(t), self.imm(z));
            return self.emit(
                ins,
                Op::Selp {
                    d,
                    a: t,
                    b: z,
                    c: p,
                    cneg: false,
                },
            );
        }
        let (d, dn) = match &o[0] {
            Operand::Pair(p) => {
                let d = self.dst(ins, &Operand::Reg(p.0.clone()))?;
                (d, self.dst(ins, &Operand::Reg(p.1.clone()))?)
            }
            x => (self.dst(ins, x)?, NONE),
        };
        let a = self.src(ins, &o[1], sty)?;
        let b = self.src(ins, &o[2], sty)?;
        let (c, cneg) = if comb != 0 {
            self.pred_src(ins, &o[3])?
        } else {
            (NONE, false)
        };
        self.emit(
            ins,
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
            },
        )
    }

    fn arith(&mut self, ins: &Instr, mods: &[&str], ty: Option<Ty>, rnd: Rnd, fl: u8) -> Res<()> {
        let ty = ty.ok_or_else(|| unsupported(ins, ""))?;
        let op = ins.opcode();
        // The operation name plus a mode modifier, e.g. "mul.wide", "mad.lo", "add.sat".
        let mode = mods
            .iter()
            .find(|m| matches!(**m, "lo" | "hi" | "wide" | "sat" | "NaN" | "shiftamt"))
            .filter(|_| !ty.is_float() || mods.contains(&"NaN"));
        let full = match mode {
            Some(m) => format!("{op}.{m}"),
            None if op == "shf" => {
                let dir = if mods.contains(&"l") { "l" } else { "r" };
                let m = if mods.contains(&"clamp") {
                    "clamp"
                } else {
                    "wrap"
                };
                format!("shf.{dir}.{m}")
            }
            None => op.to_string(),
        };
        for m in mods {
            let known = Ty::from_name(m).is_some()
                || ignorable(m)
                || matches!(
                    *m,
                    "lo" | "hi"
                        | "wide"
                        | "sat"
                        | "NaN"
                        | "shiftamt"
                        | "ftz"
                        | "rn"
                        | "rz"
                        | "rm"
                        | "rp"
                )
                || (op == "testp"
                    && matches!(
                        *m,
                        "finite" | "infinite" | "number" | "notanumber" | "normal" | "subnormal"
                    ))
                || (op == "shf" && matches!(*m, "l" | "r" | "wrap" | "clamp"))
                || (op == "lop3" && *m == "b32")
                || (op == "prmt" && *m == "b32");
            if !known {
                return Err(unsupported(ins, &format!("modifier .{m}")));
            }
        }
        let o = &ins.operands;
        // Predicate logic.
        if ty == Ty::Pred {
            let code = match op {
                "and" => 0,
                "or" => 1,
                "xor" => 2,
                "not" => 3,
                _ => return Err(unsupported(ins, "")),
            };
            let d = self.dst(ins, o.first().ok_or_else(|| unsupported(ins, ""))?)?;
            let a = self.src(ins, o.get(1).ok_or_else(|| unsupported(ins, ""))?, Ty::Pred)?;
            let b = if code == 3 {
                a
            } else {
                self.src(ins, o.get(2).ok_or_else(|| unsupported(ins, ""))?, Ty::Pred)?
            };
            return self.emit(ins, Op::PredLogic { op: code, d, a, b });
        }
        if op == "testp" {
            let which = mods.first().copied().unwrap_or("");
            let f = ops::testp(which, ty).ok_or_else(|| unsupported(ins, ""))?;
            if o.len() < 2 {
                return Err(unsupported(ins, ""));
            }
            let d = self.dst(ins, &o[0])?;
            let a = self.src(ins, &o[1], ty)?;
            return self.emit(ins, Op::Un { f, d, a, fl: 0 });
        }
        // Source type for the immediates of wide ops.
        let n_src = o.len().saturating_sub(1);
        if ty.is_float() {
            let fl = if ty == Ty::F32 { fl } else { fl & !FL_FTZ };
            if fl & FL_SAT != 0 && ty != Ty::F32 {
                return Err(unsupported(ins, "saturation on this type"));
            }
            match n_src {
                1 => {
                    if let Some(f) = ops::flt_un(&full, ty, rnd) {
                        let d = self.dst(ins, &o[0])?;
                        let a = self.src(ins, &o[1], ty)?;
                        return self.emit(ins, Op::Un { f, d, a, fl });
                    }
                }
                2 => {
                    if let Some(f) = ops::flt_bin(&full, ty, rnd) {
                        let d = self.dst(ins, &o[0])?;
                        let a = self.src(ins, &o[1], ty)?;
                        let b = self.src(ins, &o[2], ty)?;
                        return self.emit(ins, Op::Bin { f, d, a, b, fl });
                    }
                }
                3 => {
                    if let Some(f) = ops::flt_tern(&full, ty, rnd) {
                        let d = self.dst(ins, &o[0])?;
                        let a = self.src(ins, &o[1], ty)?;
                        let b = self.src(ins, &o[2], ty)?;
                        let c = self.src(ins, &o[3], ty)?;
                        return self.emit(ins, Op::Tern { f, d, a, b, c, fl });
                    }
                }
                _ => {}
            }
            return Err(unsupported(ins, ""));
        }
        if fl != 0 && full != "add.sat" && full != "sub.sat" {
            return Err(unsupported(ins, "saturation on this type"));
        }
        // Shift amounts and bfe/bfi positions are u32 whatever the data type.
        let src_ty = |i: usize| -> Ty {
            match (op, i) {
                ("shl" | "shr", 1) | ("bfe", 1 | 2) | ("bfi", 2 | 3) | ("shf", 2) => Ty::U32,
                ("mad", 2) if full == "mad.wide" => match ty {
                    Ty::S32 => Ty::S64,
                    Ty::U32 => Ty::U64,
                    t => t,
                },
                _ => ty,
            }
        };
        match n_src {
            1 => {
                if let Some(f) = ops::int_un(&full, ty) {
                    let d = self.dst(ins, &o[0])?;
                    let a = self.src(ins, &o[1], src_ty(0))?;
                    return self.emit(ins, Op::Un { f, d, a, fl: 0 });
                }
            }
            2 => {
                if let Some(f) = ops::int_bin(&full, ty) {
                    let d = self.dst(ins, &o[0])?;
                    let a = self.src(ins, &o[1], src_ty(0))?;
                    let b = self.src(ins, &o[2], src_ty(1))?;
                    return self.emit(ins, Op::Bin { f, d, a, b, fl: 0 });
                }
            }
            3 => {
                if let Some(f) = ops::int_tern(&full, ty) {
                    let d = self.dst(ins, &o[0])?;
                    let a = self.src(ins, &o[1], src_ty(0))?;
                    let b = self.src(ins, &o[2], src_ty(1))?;
                    let c = self.src(ins, &o[3], src_ty(2))?;
                    return self.emit(
                        ins,
                        Op::Tern {
                            f,
                            d,
                            a,
                            b,
                            c,
                            fl: 0,
                        },
                    );
                }
            }
            4 => {
                if let Some(f) = ops::int_quad(&full, ty) {
                    let d = self.dst(ins, &o[0])?;
                    let a = self.src(ins, &o[1], src_ty(0))?;
                    let b = self.src(ins, &o[2], src_ty(1))?;
                    let c = self.src(ins, &o[3], src_ty(2))?;
                    let e = self.src(ins, &o[4], src_ty(3))?;
                    return self.emit(ins, Op::Quad { f, d, a, b, c, e });
                }
            }
            _ => {}
        }
        Err(unsupported(ins, ""))
    }

    /// `tex`, `tld4`, `suld.b`, `sust.b`, `txq`, `suq` on object handles held in registers.
    fn texture(&mut self, ins: &Instr, mods: &[&str]) -> Res<()> {
        let op = ins.opcode();
        let ops = &ins.operands;
        let has = |m: &str| mods.contains(&m);
        // The `[handle]` or `[handle, coords]` operand.
        let bracket = |i: usize| -> Res<(&str, Option<&Operand>)> {
            match ops.get(i) {
                Some(Operand::Addr(Some(h), 0)) => Ok((&**h, None)),
                Some(Operand::Bracket(v)) if v.len() == 2 => match &v[0] {
                    Operand::Reg(h) => Ok((&**h, Some(&v[1]))),
                    _ => Err(unsupported(ins, "texture operand")),
                },
                Some(Operand::Bracket(_)) => Err(unsupported(
                    ins,
                    "explicit samplers (independent texture mode)",
                )),
                _ => Err(unsupported(ins, "texture operand")),
            }
        };
        let handle_reg = |cx: &mut Self, name: &str| -> Res<R> {
            match cx.lookup(name) {
                Some(Sym::Reg(r)) => Ok(r),
                _ => Err(unsupported(
                    ins,
                    "texture or surface references (.texref/.surfref); only object handles in registers",
                )),
            }
        };
        let query = |cx: &mut Self, surface: bool| -> Res<()> {
            let q = mods
                .iter()
                .find_map(|m| Query::parse(m))
                .ok_or_else(|| unsupported(ins, "this query"))?;
            if mods.len() != 2 || ops.len() != 2 {
                return Err(unsupported(ins, "this query form"));
            }
            let d = cx.dst(ins, &ops[0])?;
            let (h, coords) = bracket(1)?;
            if coords.is_some() {
                return Err(unsupported(ins, "query operand"));
            }
            let handle = handle_reg(cx, h)?;
            let kind = if surface {
                TexKind::SurfQuery(q)
            } else {
                TexKind::TexQuery(q)
            };
            cx.emit_tex(
                ins,
                TexInst {
                    kind,
                    geom: Geom::D1,
                    int_coords: true,
                    handle,
                    coords: [NONE; 4],
                    regs: [d, NONE, NONE, NONE],
                    n: 1,
                    size: 4,
                },
            )
        };
        match op {
            "txq" => return query(self, false),
            "suq" => return query(self, true),
            "tex" | "tld4" | "suld" | "sust" => {}
            _ => return Err(unsupported(ins, "")),
        }
        let geom = mods
            .iter()
            .find_map(|m| Geom::parse(m))
            .ok_or_else(|| unsupported(ins, "this geometry (cubemaps and multisample textures)"))?;
        let coords_at = if op == "sust" { 0 } else { 1 };
        let (h, coords) = bracket(coords_at)?;
        let coords = coords.ok_or_else(|| unsupported(ins, "missing coordinates"))?;
        let handle = handle_reg(self, h)?;
        if ops.len() != 2 {
            return Err(unsupported(
                ins,
                "texel offsets, depth compare or level-of-detail operands",
            ));
        }
        let list: Vec<Operand> = match coords {
            Operand::Vec(v) => v.clone(),
            o => vec![o.clone()],
        };
        let need = geom.dims() + usize::from(geom.layered());
        if list.len() < need || list.len() > 4 {
            return Err(unsupported(ins, "coordinate count for this geometry"));
        }
        let types: Vec<Ty> = mods.iter().filter_map(|m| Ty::from_name(m)).collect();
        let is_tex = op == "tex" || op == "tld4";
        // tex/tld4: `.dtype.ctype`; surfaces: `.bN` data and `.s32` coordinates.
        let int_coords = if is_tex {
            match types.as_slice() {
                [_, Ty::S32] => true,
                [_, Ty::F32] => false,
                _ => return Err(unsupported(ins, "texture result or coordinate type")),
            }
        } else {
            true
        };
        let mut cregs = [NONE; 4];
        for (k, o) in list.iter().take(need).enumerate() {
            let ty = if geom.layered() && k == 0 {
                Ty::U32
            } else if int_coords {
                Ty::S32
            } else {
                Ty::F32
            };
            cregs[k] = self.src(ins, o, ty)?;
        }
        if is_tex {
            if mods.iter().any(|m| matches!(*m, "base" | "level" | "grad")) {
                return Err(unsupported(ins, "mipmap level-of-detail forms"));
            }
            if !has("v4") {
                return Err(unsupported(ins, "texture results other than .v4"));
            }
            let ty = match types[0] {
                Ty::F32 => TexType::F32,
                Ty::S32 => TexType::S32,
                Ty::U32 => TexType::U32,
                _ => return Err(unsupported(ins, "texture result type")),
            };
            let kind = if op == "tld4" {
                let comp = ["r", "g", "b", "a"]
                    .iter()
                    .position(|c| has(c))
                    .ok_or_else(|| unsupported(ins, "tld4 component"))?;
                TexKind::Gather(ty, comp as u8)
            } else {
                TexKind::Sample(ty)
            };
            let (n, regs) = self.vec_regs(ins, &ops[0], Ty::B32, true)?;
            if n != 4 {
                return Err(unsupported(ins, "texture results other than 4 registers"));
            }
            return self.emit_tex(
                ins,
                TexInst {
                    kind,
                    geom,
                    int_coords,
                    handle,
                    coords: cregs,
                    regs,
                    n,
                    size: 4,
                },
            );
        }
        // suld.b / sust.b
        if !has("b") {
            return Err(unsupported(ins, "formatted surface access (.p)"));
        }
        let clamp = if has("clamp") {
            OutOfRange::Clamp
        } else if has("zero") {
            OutOfRange::Zero
        } else {
            OutOfRange::Trap
        };
        let data = match types.as_slice() {
            [t] if matches!(t, Ty::B8 | Ty::B16 | Ty::B32 | Ty::B64) => *t,
            _ => return Err(unsupported(ins, "surface data type")),
        };
        let vec = if has("v4") {
            4
        } else if has("v2") {
            2
        } else {
            1
        };
        let (kind, (n, regs)) = if op == "suld" {
            (
                TexKind::Load(clamp),
                self.vec_regs(ins, &ops[0], data, true)?,
            )
        } else {
            (
                TexKind::Store(clamp),
                self.vec_regs(ins, &ops[1], data, false)?,
            )
        };
        if n != vec {
            return Err(unsupported(
                ins,
                "register count does not match the vector size",
            ));
        }
        self.emit_tex(
            ins,
            TexInst {
                kind,
                geom,
                int_coords,
                handle,
                coords: cregs,
                regs,
                n,
                size: data.size() as u8,
            },
        )
    }

    fn emit_tex(&mut self, ins: &Instr, t: TexInst) -> Res<()> {
        let i = self.tex.len() as u32;
        self.tex.push(t);
        self.emit(ins, Op::Tex { i })
    }

    fn call(&mut self, ins: &Instr) -> Res<()> {
        let mut rets: &[Operand] = &[];
        let mut args: &[Operand] = &[];
        let mut name = None;
        for o in &ins.operands {
            match o {
                Operand::List(l) if name.is_none() => rets = l,
                Operand::Reg(n) if name.is_none() => name = Some(n.clone()),
                Operand::List(l) => args = l,
                Operand::Reg(_) => {
                    return Err(unsupported(ins, "call with a prototype (indirect call)"));
                }
                _ => return Err(unsupported(ins, "call operand")),
            }
        }
        let name = name.ok_or_else(|| unsupported(ins, "call without a target"))?;
        if let Some(Sym::Reg(_)) = self.lookup(&name) {
            return Err(unsupported(ins, "indirect call"));
        }
        let ast = self.ast;
        let Some(f) = ast.func(&name) else {
            return Err(unsupported(
                ins,
                &format!("call to unknown function {name}"),
            ));
        };
        let Some(body) = &f.body else {
            return match &*name {
                // printf output is not modelled; it returns 0 like a successful vprintf.
                "vprintf" => {
                    if let Some(Operand::Reg(r)) = rets.first()
                        && let Some(Sym::Local(off)) = self.lookup(r)
                    {
                        let base = self.imm(off);
                        let zero = self.imm(0);
                        return self.emit(
                            ins,
                            Op::St {
                                space: Space::Local,
                                size: 4,
                                n: 1,
                                src: [zero, NONE, NONE, NONE],
                                base,
                                off: 0,
                            },
                        );
                    }
                    self.emit(ins, Op::Nop)
                }
                "__assertfail" | "__assert_fail" => self.emit(ins, Op::Trap),
                _ => Err(unsupported(
                    ins,
                    &format!("call to external function {name}"),
                )),
            };
        };
        if self.depth >= 16 {
            return Err(unsupported(
                ins,
                "call depth over 16 (recursion is not supported)",
            ));
        }
        if f.params.len() != args.len() || f.rets.len() != rets.len() {
            return Err(unsupported(ins, "argument count does not match the callee"));
        }
        let mut base = HashMap::new();
        for (formal, actual) in f
            .params
            .iter()
            .chain(f.rets.iter())
            .zip(args.iter().chain(rets.iter()))
        {
            if formal.space != "param" {
                return Err(unsupported(ins, "register (.reg) function parameters"));
            }
            let off = match actual {
                Operand::Reg(n) => match self.lookup(n) {
                    Some(Sym::Local(off)) => off,
                    Some(Sym::Reg(r)) => {
                        // A register argument: spill it into a fresh frame slot.
                        let size = formal.size.unwrap_or(8);
                        let off = self.alloc_local(size, formal.align);
                        let b = self.imm(off);
                        self.emit(
                            ins,
                            Op::St {
                                space: Space::Local,
                                size: size.min(8) as u8,
                                n: 1,
                                src: [r, NONE, NONE, NONE],
                                base: b,
                                off: 0,
                            },
                        )?;
                        off
                    }
                    _ => return Err(unsupported(ins, &format!("call argument {n}"))),
                },
                _ => return Err(unsupported(ins, "immediate call arguments")),
            };
            base.insert(formal.name.clone(), Sym::Local(off));
        }
        let end = self.labels.len();
        self.labels.push(None);
        self.depth += 1;
        let r = self.body(body, base, Some(end));
        self.depth -= 1;
        r?;
        self.labels[end] = Some(self.code.len() as u32);
        Ok(())
    }
}

/// An explicit space on an access to a symbol wins unless it is `.param` naming a local frame variable.
fn space_for(insn: Space, sym: Space) -> Space {
    match (insn, sym) {
        (Space::Param, Space::Local) => Space::Local,
        (s, _) => s,
    }
}
