//! PTX module parser: turns tokens into a small AST of functions, declarations and raw instructions.
//! Instruction semantics are left to `compile`, which knows which opcodes exist.

use crate::ParseError;
use crate::lex::{Tok, Token, tokenize};

/// A scalar PTX type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    B8,
    B16,
    B32,
    B64,
    B128,
    U8,
    U16,
    U32,
    U64,
    S8,
    S16,
    S32,
    S64,
    F16,
    F16x2,
    Bf16,
    Bf16x2,
    F32,
    F64,
    Pred,
}

impl Ty {
    pub fn from_name(s: &str) -> Option<Ty> {
        Some(match s {
            "b8" => Ty::B8,
            "b16" => Ty::B16,
            "b32" => Ty::B32,
            "b64" => Ty::B64,
            "b128" => Ty::B128,
            "u8" => Ty::U8,
            "u16" => Ty::U16,
            "u32" => Ty::U32,
            "u64" => Ty::U64,
            "s8" => Ty::S8,
            "s16" => Ty::S16,
            "s32" => Ty::S32,
            "s64" => Ty::S64,
            "f16" => Ty::F16,
            "f16x2" => Ty::F16x2,
            "bf16" => Ty::Bf16,
            "bf16x2" => Ty::Bf16x2,
            "f32" => Ty::F32,
            "f64" => Ty::F64,
            "pred" => Ty::Pred,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            Ty::B8 | Ty::U8 | Ty::S8 | Ty::Pred => 1,
            Ty::B16 | Ty::U16 | Ty::S16 | Ty::F16 | Ty::Bf16 => 2,
            Ty::B32 | Ty::U32 | Ty::S32 | Ty::F32 | Ty::F16x2 | Ty::Bf16x2 => 4,
            Ty::B64 | Ty::U64 | Ty::S64 | Ty::F64 => 8,
            Ty::B128 => 16,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            Ty::F16 | Ty::F16x2 | Ty::Bf16 | Ty::Bf16x2 | Ty::F32 | Ty::F64
        )
    }

    pub fn is_signed(self) -> bool {
        matches!(self, Ty::S8 | Ty::S16 | Ty::S32 | Ty::S64)
    }
}

/// A declared variable (module or function scope) or parameter.
#[derive(Debug, Clone)]
pub struct VarDecl {
    pub name: String,
    /// `global`, `const`, `shared`, `local`, `param`.
    pub space: String,
    pub align: usize,
    /// Total size in bytes; `None` for unsized `[]` arrays (dynamic shared memory).
    pub size: Option<usize>,
    pub init: Option<Vec<u8>>,
    pub line: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    Reg(String),
    /// `!%p`
    NotReg(String),
    /// `%r|%p` (shfl/setp dual destinations)
    Pair(String, String),
    Int(i64),
    F32(u32),
    F64(u64),
    /// `[base+off]`; base is a register or a symbol, or absent for an absolute address.
    Addr(Option<String>, i64),
    /// `sym+off` outside brackets.
    SymOff(String, i64),
    /// `{a, b, ...}`
    Vec(Vec<Operand>),
    /// `(a, b, ...)` in `call`.
    List(Vec<Operand>),
    /// `_`
    Sink,
}

#[derive(Debug, Clone)]
pub struct Instr {
    pub line: usize,
    pub guard: Option<(bool, String)>, // (negated, predicate)
    pub opcode: String,
    pub mods: Vec<String>,
    pub operands: Vec<Operand>,
}

#[derive(Debug, Clone)]
pub enum Stmt {
    Reg { ty: Ty, names: Vec<String> },
    Var(VarDecl),
    Label(String),
    Open,
    Close,
    Instr(Instr),
}

#[derive(Debug, Clone)]
pub struct Func {
    pub name: String,
    pub is_entry: bool,
    pub params: Vec<VarDecl>,
    pub rets: Vec<VarDecl>,
    pub body: Option<Vec<Stmt>>,
    pub max_threads: Option<u32>,
    pub line: usize,
}

#[derive(Debug, Default)]
pub struct Ast {
    pub funcs: Vec<Func>,
    pub vars: Vec<VarDecl>,
}

struct P {
    t: Vec<Token>,
    i: usize,
}

type R<T> = Result<T, ParseError>;

const MAX_ALIGN: i64 = 1 << 16;
/// Largest variable or parameter accepted (module globals get materialized).
const MAX_VAR_BYTES: usize = 1 << 30;
/// Most registers one `%r<N>` declaration may create.
const MAX_REG_RANGE: i64 = 1 << 16;

impl P {
    fn peek(&self) -> Option<&Tok> {
        self.t.get(self.i).map(|t| &t.tok)
    }
    fn peek2(&self) -> Option<&Tok> {
        self.t.get(self.i + 1).map(|t| &t.tok)
    }
    fn line(&self) -> usize {
        self.t.get(self.i).or(self.t.last()).map_or(1, |t| t.line)
    }
    fn err<T>(&self, expected: &str) -> R<T> {
        let found = match self.peek() {
            None => "end of input".to_string(),
            Some(Tok::Ident(s)) => format!("`{s}`"),
            Some(Tok::Int(v)) => format!("`{v}`"),
            Some(Tok::Punct(c)) => format!("`{c}`"),
            Some(Tok::Str(s)) => format!("\"{s}\""),
            Some(t) => format!("{t:?}"),
        };
        Err(ParseError {
            line: self.line(),
            expected: expected.into(),
            found,
        })
    }
    fn next(&mut self) -> Option<Tok> {
        let t = self.t.get(self.i).map(|t| t.tok.clone());
        self.i += 1;
        t
    }
    fn is_punct(&self, c: char) -> bool {
        self.peek() == Some(&Tok::Punct(c))
    }
    fn eat_punct(&mut self, c: char) -> bool {
        if self.is_punct(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect_punct(&mut self, c: char) -> R<()> {
        if self.eat_punct(c) {
            Ok(())
        } else {
            self.err(&format!("`{c}`"))
        }
    }
    fn ident(&mut self, what: &str) -> R<String> {
        match self.peek() {
            Some(Tok::Ident(s)) => {
                let s = s.clone();
                self.i += 1;
                Ok(s)
            }
            _ => self.err(what),
        }
    }
    fn int(&mut self) -> R<i64> {
        let neg = self.eat_punct('-');
        match self.peek() {
            Some(Tok::Int(v)) => {
                let v = *v as i64;
                self.i += 1;
                Ok(if neg { v.wrapping_neg() } else { v })
            }
            _ => self.err("an integer"),
        }
    }
    /// `.align N`: a power of two up to 64 KiB.
    fn align(&mut self) -> R<usize> {
        let a = self.int()?;
        if a <= 0 || a > MAX_ALIGN || a & (a - 1) != 0 {
            self.i -= 1;
            return self.err("an alignment that is a power of two up to 65536");
        }
        Ok(a as usize)
    }
    /// `[N]`: an array dimension, multiplied into `size` without overflow or absurd totals.
    fn dim(&mut self, size: usize) -> R<usize> {
        let n = self.int()?;
        match usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(size))
            .filter(|t| *t <= MAX_VAR_BYTES)
        {
            Some(t) => Ok(t),
            None => {
                self.i -= 1;
                self.err("an array size under 1 GiB")
            }
        }
    }
    fn skip_line(&mut self) {
        let l = self.line();
        while self.i < self.t.len() && self.t[self.i].line == l {
            self.i += 1;
        }
    }
    fn skip_past(&mut self, c: char) {
        while let Some(t) = self.next() {
            if t == Tok::Punct(c) {
                break;
            }
        }
    }
    fn skip_braces(&mut self) -> R<()> {
        while !self.is_punct('{') {
            if self.next().is_none() {
                return self.err("`{`");
            }
        }
        let mut depth = 0;
        while let Some(t) = self.next() {
            match t {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => {
                    depth -= 1;
                    if depth == 0 {
                        return Ok(());
                    }
                }
                _ => {}
            }
        }
        self.err("`}`")
    }
}

pub fn parse(src: &str) -> R<Ast> {
    let mut p = P {
        t: tokenize(src)?,
        i: 0,
    };
    let mut ast = Ast::default();
    while let Some(tok) = p.peek().cloned() {
        let Tok::Ident(word) = tok else {
            if p.eat_punct(';') {
                continue;
            }
            return p.err("a directive");
        };
        match word.as_str() {
            ".version" | ".target" | ".file" => p.skip_line(),
            ".address_size" => {
                p.i += 1;
                let v = p.int()?;
                if v != 64 {
                    p.i -= 1;
                    return p.err("`.address_size 64`");
                }
            }
            ".section" => p.skip_braces()?,
            ".pragma" => p.skip_past(';'),
            ".visible" | ".extern" | ".weak" | ".common" => p.i += 1,
            ".entry" | ".func" => {
                let f = parse_func(&mut p)?;
                // A definition replaces an earlier prototype of the same name.
                if let Some(old) = ast.funcs.iter_mut().find(|g| g.name == f.name) {
                    if f.body.is_some() || old.body.is_none() {
                        *old = f;
                    }
                } else {
                    ast.funcs.push(f);
                }
            }
            ".global" | ".const" | ".shared" | ".local" | ".tex" => {
                let v = parse_var(&mut p)?;
                p.expect_punct(';')?;
                ast.vars.push(v);
            }
            ".alias" => p.skip_past(';'),
            _ => return p.err("a module-level directive"),
        }
    }
    Ok(ast)
}

/// `.param .u64 .ptr .global .align 4 name` / `.param .align 8 .b8 name[16]` / `.reg .b32 name`.
fn parse_param(p: &mut P) -> R<VarDecl> {
    let line = p.line();
    let space = p.ident("`.param`")?;
    if space != ".param" && space != ".reg" {
        p.i -= 1;
        return p.err("`.param`");
    }
    let mut align = None;
    let mut ty = None;
    let mut ptr = false;
    loop {
        match p.peek() {
            Some(Tok::Ident(s)) if s.starts_with('.') => {
                let s = s.clone();
                p.i += 1;
                match s.as_str() {
                    ".align" => align = Some(p.align()?),
                    ".ptr" => ptr = true,
                    ".global" | ".shared" | ".const" | ".local" => {}
                    _ => {
                        if let Some(t) = Ty::from_name(&s[1..]) {
                            if ptr {
                                // The `.align` after `.ptr` describes the pointee; the param stays 8-aligned.
                                align = None;
                            }
                            ty = Some(t);
                        } else {
                            p.i -= 1;
                            return p.err("a parameter type");
                        }
                    }
                }
                if ptr && ty.is_some() {
                    // `.ptr .global .align N` follows the type: swallow it without changing the param align.
                    while let Some(Tok::Ident(s)) = p.peek() {
                        match s.as_str() {
                            ".ptr" | ".global" | ".shared" | ".const" | ".local" => p.i += 1,
                            ".align" => {
                                p.i += 1;
                                p.align()?;
                            }
                            _ => break,
                        }
                    }
                }
            }
            _ => break,
        }
    }
    let Some(ty) = ty else {
        return p.err("a parameter type");
    };
    let name = p.ident("a parameter name")?;
    let mut size = ty.size();
    while p.eat_punct('[') {
        size = p.dim(size)?;
        p.expect_punct(']')?;
    }
    Ok(VarDecl {
        name,
        space: space[1..].to_string(),
        align: if ptr { 8 } else { align.unwrap_or(ty.size()) },
        size: Some(size),
        init: None,
        line,
    })
}

fn parse_param_list(p: &mut P) -> R<Vec<VarDecl>> {
    p.expect_punct('(')?;
    let mut v = Vec::new();
    if p.eat_punct(')') {
        return Ok(v);
    }
    loop {
        v.push(parse_param(p)?);
        if p.eat_punct(')') {
            return Ok(v);
        }
        p.expect_punct(',')?;
    }
}

fn parse_func(p: &mut P) -> R<Func> {
    let line = p.line();
    let kind = p.ident("`.entry` or `.func`")?;
    let is_entry = kind == ".entry";
    let rets = if !is_entry && p.is_punct('(') {
        parse_param_list(p)?
    } else {
        Vec::new()
    };
    let name = p.ident("a function name")?;
    let params = if p.is_punct('(') {
        parse_param_list(p)?
    } else {
        Vec::new()
    };
    let mut max_threads = None;
    // Performance directives and attributes.
    while let Some(Tok::Ident(s)) = p.peek() {
        let s = s.clone();
        p.i += 1;
        match s.as_str() {
            ".maxntid" | ".reqntid" => {
                let mut prod: u64 = 1;
                loop {
                    prod = prod.saturating_mul(p.int()?.max(1) as u64);
                    if !p.eat_punct(',') {
                        break;
                    }
                }
                max_threads = Some(prod.min(1024) as u32);
            }
            ".minnctapersm" | ".maxnctapersm" | ".maxnreg" | ".maxclusterrank" => {
                p.int()?;
            }
            ".reqnctapercluster" | ".explicitcluster" => {
                while p.eat_punct(',') || matches!(p.peek(), Some(Tok::Int(_))) {
                    p.i += 1;
                }
            }
            ".noreturn" | ".abi_preserve" | ".abi_preserve_control" => {}
            ".pragma" => p.skip_past(';'),
            _ => {
                p.i -= 1;
                return p.err("a function body or performance directive");
            }
        }
    }
    let body = if p.eat_punct(';') {
        None
    } else {
        Some(parse_body(p)?)
    };
    Ok(Func {
        name,
        is_entry,
        params,
        rets,
        body,
        max_threads,
        line,
    })
}

/// `[.align N] [.vN] .type name[dims] [= init]` after the state-space word (which is consumed here).
fn parse_var(p: &mut P) -> R<VarDecl> {
    let line = p.line();
    let space = p.ident("a state space")?;
    let mut align = None;
    let mut vec = 1;
    let mut ty = None;
    while let Some(Tok::Ident(s)) = p.peek() {
        if !s.starts_with('.') {
            break;
        }
        let s = s.clone();
        p.i += 1;
        match s.as_str() {
            ".align" => align = Some(p.align()?),
            ".v2" => vec = 2,
            ".v4" => vec = 4,
            ".v8" => vec = 8,
            ".attribute" => {
                p.skip_past(')');
            }
            _ => match Ty::from_name(&s[1..]) {
                Some(t) => ty = Some(t),
                None => {
                    p.i -= 1;
                    return p.err("a variable type");
                }
            },
        }
    }
    let Some(ty) = ty else {
        return p.err("a variable type");
    };
    let name = p.ident("a variable name")?;
    let elem = ty.size() * vec;
    let mut size = Some(elem);
    let mut unsized_dim = false;
    while p.eat_punct('[') {
        if p.eat_punct(']') {
            unsized_dim = true;
            continue;
        }
        size = Some(p.dim(size.unwrap_or(0))?);
        p.expect_punct(']')?;
    }
    let mut init = None;
    if p.eat_punct('=') {
        let mut bytes = Vec::new();
        parse_init(p, ty, &mut bytes)?;
        if unsized_dim {
            size = Some(bytes.len());
            unsized_dim = false;
        }
        init = Some(bytes);
    }
    if unsized_dim {
        size = None;
    }
    Ok(VarDecl {
        name,
        space: space[1..].to_string(),
        align: align.unwrap_or(elem),
        size,
        init,
        line,
    })
}

fn parse_init(p: &mut P, ty: Ty, out: &mut Vec<u8>) -> R<()> {
    if p.eat_punct('{') {
        if p.eat_punct('}') {
            return Ok(());
        }
        loop {
            parse_init(p, ty, out)?;
            if p.eat_punct('}') {
                return Ok(());
            }
            p.expect_punct(',')?;
        }
    }
    let neg = p.eat_punct('-');
    let bits: u64 = match p.peek().cloned() {
        Some(Tok::Int(v)) => {
            let v = if neg {
                (v as i64).wrapping_neg() as u64
            } else {
                v
            };
            match ty {
                Ty::F32 => (v as i64 as f32).to_bits() as u64,
                Ty::F64 => (v as i64 as f64).to_bits(),
                _ => v,
            }
        }
        Some(Tok::F32(b)) => {
            let f = f32::from_bits(b);
            let f = if neg { -f } else { f };
            match ty {
                Ty::F64 => (f as f64).to_bits(),
                _ => f.to_bits() as u64,
            }
        }
        Some(Tok::F64(b)) => {
            let f = f64::from_bits(b);
            let f = if neg { -f } else { f };
            match ty {
                Ty::F32 => (f as f32).to_bits() as u64,
                Ty::F16 => half::f16::from_f64(f).to_bits() as u64,
                Ty::Bf16 => half::bf16::from_f64(f).to_bits() as u64,
                _ => f.to_bits(),
            }
        }
        _ => return p.err("a constant initializer (address initializers are not supported)"),
    };
    p.i += 1;
    let n = ty.size().min(8);
    out.extend_from_slice(&bits.to_le_bytes()[..n]);
    Ok(())
}

fn parse_body(p: &mut P) -> R<Vec<Stmt>> {
    p.expect_punct('{')?;
    let mut depth = 1;
    let mut out = Vec::new();
    loop {
        let line = p.line();
        let Some(tok) = p.peek().cloned() else {
            return p.err("`}`");
        };
        match tok {
            Tok::Punct('{') => {
                p.i += 1;
                depth += 1;
                out.push(Stmt::Open);
            }
            Tok::Punct('}') => {
                p.i += 1;
                depth -= 1;
                if depth == 0 {
                    return Ok(out);
                }
                out.push(Stmt::Close);
            }
            Tok::Punct(';') => p.i += 1,
            Tok::Punct('@') => {
                p.i += 1;
                let neg = p.eat_punct('!');
                let pred = p.ident("a guard predicate")?;
                let mut ins = parse_instr(p)?;
                ins.guard = Some((neg, pred));
                ins.line = line;
                out.push(Stmt::Instr(ins));
            }
            Tok::Ident(w) => {
                if p.peek2() == Some(&Tok::Punct(':')) {
                    p.i += 2;
                    out.push(Stmt::Label(w));
                    continue;
                }
                match w.as_str() {
                    ".loc" | ".file" => p.skip_line(),
                    // Indirect-call prototypes: calls through them are refused at compile time.
                    ".pragma" | ".callprototype" => p.skip_past(';'),
                    ".reg" => {
                        p.i += 1;
                        let mut ty = None;
                        while let Some(Tok::Ident(s)) = p.peek() {
                            if !s.starts_with('.') {
                                break;
                            }
                            let s = s.clone();
                            p.i += 1;
                            if let Some(t) = Ty::from_name(&s[1..]) {
                                ty = Some(t);
                            } else if !matches!(s.as_str(), ".v2" | ".v4" | ".align") {
                                p.i -= 1;
                                return p.err("a register type");
                            }
                        }
                        let Some(ty) = ty else {
                            return p.err("a register type");
                        };
                        let mut names = Vec::new();
                        loop {
                            let n = p.ident("a register name")?;
                            if p.eat_punct('<') {
                                let count = p.int()?;
                                if count > MAX_REG_RANGE {
                                    p.i -= 1;
                                    return p.err("a register range up to 65536");
                                }
                                p.expect_punct('>')?;
                                for k in 0..count.max(0) {
                                    names.push(format!("{n}{k}"));
                                }
                            } else {
                                names.push(n);
                            }
                            if !p.eat_punct(',') {
                                break;
                            }
                        }
                        p.expect_punct(';')?;
                        out.push(Stmt::Reg { ty, names });
                    }
                    ".local" | ".shared" | ".param" | ".global" | ".const" => {
                        let v = parse_var(p)?;
                        p.expect_punct(';')?;
                        out.push(Stmt::Var(v));
                    }
                    s if s.starts_with('.') => return p.err("a statement"),
                    _ => {
                        let mut ins = parse_instr(p)?;
                        ins.line = line;
                        out.push(Stmt::Instr(ins));
                    }
                }
            }
            _ => return p.err("a statement"),
        }
    }
}

fn parse_instr(p: &mut P) -> R<Instr> {
    let line = p.line();
    let op = p.ident("an instruction")?;
    let mut parts = op.split('.');
    let opcode = parts.next().unwrap_or_default().to_string();
    let mods = parts
        .filter(|m| !m.is_empty())
        .map(str::to_string)
        .collect();
    let mut operands = Vec::new();
    if !p.eat_punct(';') {
        loop {
            operands.push(parse_operand(p)?);
            if p.eat_punct(';') {
                break;
            }
            p.expect_punct(',')?;
        }
    }
    Ok(Instr {
        line,
        guard: None,
        opcode,
        mods,
        operands,
    })
}

fn parse_operand(p: &mut P) -> R<Operand> {
    match p.peek().cloned() {
        Some(Tok::Punct('[')) => {
            p.i += 1;
            let mut base = None;
            let mut off = 0i64;
            if let Some(Tok::Ident(s)) = p.peek() {
                base = Some(s.clone());
                p.i += 1;
            } else {
                off = p.int()?;
            }
            while p.is_punct('+') || p.is_punct('-') {
                let neg = p.eat_punct('-');
                if !neg {
                    p.i += 1;
                }
                let v = p.int()?;
                off = if neg {
                    off.wrapping_sub(v)
                } else {
                    off.wrapping_add(v)
                };
            }
            p.expect_punct(']')?;
            Ok(Operand::Addr(base, off))
        }
        Some(Tok::Punct('{')) => {
            p.i += 1;
            let mut v = Vec::new();
            loop {
                v.push(parse_operand(p)?);
                if p.eat_punct('}') {
                    return Ok(Operand::Vec(v));
                }
                p.expect_punct(',')?;
            }
        }
        Some(Tok::Punct('(')) => {
            p.i += 1;
            let mut v = Vec::new();
            if p.eat_punct(')') {
                return Ok(Operand::List(v));
            }
            loop {
                v.push(parse_operand(p)?);
                if p.eat_punct(')') {
                    return Ok(Operand::List(v));
                }
                p.expect_punct(',')?;
            }
        }
        Some(Tok::Punct('!')) => {
            p.i += 1;
            Ok(Operand::NotReg(p.ident("a predicate")?))
        }
        Some(Tok::Punct('-')) => {
            p.i += 1;
            match p.next() {
                Some(Tok::Int(v)) => Ok(Operand::Int((v as i64).wrapping_neg())),
                Some(Tok::F32(b)) => Ok(Operand::F32(b ^ 0x8000_0000)),
                Some(Tok::F64(b)) => Ok(Operand::F64(b ^ (1 << 63))),
                _ => {
                    p.i -= 1;
                    p.err("a number after `-`")
                }
            }
        }
        Some(Tok::Int(v)) => {
            p.i += 1;
            Ok(Operand::Int(v as i64))
        }
        Some(Tok::F32(b)) => {
            p.i += 1;
            Ok(Operand::F32(b))
        }
        Some(Tok::F64(b)) => {
            p.i += 1;
            Ok(Operand::F64(b))
        }
        Some(Tok::Ident(s)) => {
            p.i += 1;
            if s == "_" {
                return Ok(Operand::Sink);
            }
            if p.eat_punct('|') {
                let q = p.ident("a predicate after `|`")?;
                return Ok(Operand::Pair(s, q));
            }
            if p.is_punct('+') && matches!(p.peek2(), Some(Tok::Int(_))) {
                p.i += 1;
                let v = p.int()?;
                return Ok(Operand::SymOff(s, v));
            }
            Ok(Operand::Reg(s))
        }
        _ => p.err("an operand"),
    }
}
