//! PTX module parser: turns tokens into a small AST of functions, declarations and raw instructions.
//! Instruction semantics are left to `compile`, which knows which opcodes exist.

use std::collections::{HashMap, VecDeque};

use crate::lex::{Lexer, Tok, Token};
use crate::{Limits, ParseError};

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
    /// Initial bytes; the rest of the variable is zero (trailing zeros are not kept).
    pub init: Option<Vec<u8>>,
    pub line: usize,
}

/// A register, symbol or label name (boxed: the syntax tree holds millions of them in large modules).
pub type Name = Box<str>;

#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    Reg(Name),
    /// `!%p`
    NotReg(Name),
    /// `%r|%p` (shfl/setp dual destinations)
    Pair(Box<(Name, Name)>),
    Int(i64),
    F32(u32),
    F64(u64),
    /// `[base+off]`; base is a register or a symbol, or absent for an absolute address.
    Addr(Option<Name>, i64),
    /// `[a, b, ...]`: the texture and surface forms (`[tex, {x, y}]`).
    Bracket(Vec<Operand>),
    /// `sym+off` outside brackets.
    SymOff(Name, i64),
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
    pub guard: Option<(bool, Name)>, // (negated, predicate)
    /// The dotted opcode as written, e.g. `ld.global.v2.f32`.
    pub text: Box<str>,
    pub operands: Box<[Operand]>,
}

impl Instr {
    /// The opcode without its modifiers (`ld`).
    pub fn opcode(&self) -> &str {
        self.text.split('.').next().unwrap_or_default()
    }

    /// The modifiers after the opcode (`global`, `v2`, `f32`).
    pub fn mods(&self) -> impl Iterator<Item = &str> {
        self.text.split('.').skip(1).filter(|m| !m.is_empty())
    }
}

#[derive(Debug, Clone)]
pub enum Stmt {
    Reg { ty: Ty, names: Vec<String> },
    Var(Box<VarDecl>),
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
    /// Index in `funcs` of each function name.
    func_index: HashMap<String, usize>,
    /// Index in `vars` of each module variable name (the first declaration wins).
    var_index: HashMap<String, usize>,
}

impl Ast {
    pub fn func(&self, name: &str) -> Option<&Func> {
        self.func_index.get(name).map(|&i| &self.funcs[i])
    }

    pub fn func_position(&self, name: &str) -> Option<usize> {
        self.func_index.get(name).copied()
    }

    pub fn var(&self, name: &str) -> Option<&VarDecl> {
        self.var_index.get(name).map(|&i| &self.vars[i])
    }
}

/// The parser: pulls tokens from the lexer with a lookahead of two and can step back over one.
struct P<'s> {
    lx: Lexer<'s>,
    /// Tokens read ahead; `ahead[0]` is the current one.
    ahead: VecDeque<Token<'s>>,
    /// The token consumed last, for [`P::back`].
    prev: Option<Token<'s>>,
    /// Set once the lexer has nothing more (or failed).
    done: bool,
    /// A lexer error: reported in place of whatever the parser makes of the early end of input.
    lex_err: Option<ParseError>,
}

type R<T> = Result<T, ParseError>;

const MAX_ALIGN: i64 = 1 << 16;
/// Largest variable or parameter accepted (module globals get materialized).
const MAX_VAR_BYTES: usize = 1 << 30;
/// Most registers one `%r<N>` declaration may create.
const MAX_REG_RANGE: i64 = 1 << 16;

impl<'s> P<'s> {
    fn fill(&mut self, n: usize) {
        while self.ahead.len() < n && !self.done {
            match self.lx.next_token() {
                Ok(Some(t)) => self.ahead.push_back(t),
                Ok(None) => self.done = true,
                Err(e) => {
                    self.lex_err = Some(e);
                    self.done = true;
                }
            }
        }
    }
    fn peek(&mut self) -> Option<Tok<'s>> {
        self.fill(1);
        self.ahead.front().map(|t| t.tok)
    }
    fn peek2(&mut self) -> Option<Tok<'s>> {
        self.fill(2);
        self.ahead.get(1).map(|t| t.tok)
    }
    /// Consumes the current token.
    fn bump(&mut self) {
        self.fill(1);
        if let Some(t) = self.ahead.pop_front() {
            self.prev = Some(t);
        }
    }
    /// Steps back over the token consumed last (to point an error at it).
    fn back(&mut self) {
        if let Some(t) = self.prev.take() {
            self.ahead.push_front(t);
        }
    }
    fn line(&mut self) -> usize {
        self.fill(1);
        match (self.ahead.front().copied(), self.prev) {
            (Some(t), _) | (None, Some(t)) => t.line,
            (None, None) => self.lx.line(),
        }
    }
    fn err<T>(&mut self, expected: &str) -> R<T> {
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
            limit: None,
        })
    }
    fn next(&mut self) -> Option<Tok<'s>> {
        let t = self.peek();
        self.bump();
        t
    }
    fn is_punct(&mut self, c: char) -> bool {
        self.peek() == Some(Tok::Punct(c))
    }
    fn eat_punct(&mut self, c: char) -> bool {
        if self.is_punct(c) {
            self.bump();
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
    fn ident(&mut self, what: &str) -> R<&'s str> {
        match self.peek() {
            Some(Tok::Ident(s)) => {
                self.bump();
                Ok(s)
            }
            _ => self.err(what),
        }
    }
    fn int(&mut self) -> R<i64> {
        let neg = self.eat_punct('-');
        match self.peek() {
            Some(Tok::Int(v)) => {
                let v = v as i64;
                self.bump();
                Ok(if neg { v.wrapping_neg() } else { v })
            }
            _ => self.err("an integer"),
        }
    }
    /// `.align N`: a power of two up to 64 KiB.
    fn align(&mut self) -> R<usize> {
        let a = self.int()?;
        if a <= 0 || a > MAX_ALIGN || a & (a - 1) != 0 {
            self.back();
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
                self.back();
                self.err("an array size under 1 GiB")
            }
        }
    }
    fn skip_line(&mut self) {
        let l = self.line();
        while self.peek().is_some() && self.ahead.front().is_some_and(|t| t.line == l) {
            self.bump();
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
        let mut depth = 0usize;
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

/// Parses a module within `limits` (tokens, kernels, module data).
pub fn parse(src: &str, limits: &Limits) -> R<Ast> {
    let mut p = P {
        lx: Lexer::new(src, limits.max_tokens),
        ahead: VecDeque::with_capacity(4),
        prev: None,
        done: false,
        lex_err: None,
    };
    let r = parse_module(&mut p, limits);
    // Whatever the parser made of an early end of input, the lexer's error is the real one.
    match p.lex_err.take() {
        Some(e) => Err(e),
        None => r,
    }
}

fn parse_module(p: &mut P, limits: &Limits) -> R<Ast> {
    let mut ast = Ast::default();
    let mut kernels = 0usize;
    let mut data_bytes = 0u64;
    while let Some(tok) = p.peek() {
        let Tok::Ident(word) = tok else {
            if p.eat_punct(';') {
                continue;
            }
            return p.err("a directive");
        };
        match word {
            ".version" | ".target" | ".file" => p.skip_line(),
            ".address_size" => {
                p.bump();
                let v = p.int()?;
                if v != 64 {
                    p.back();
                    return p.err("`.address_size 64`");
                }
            }
            ".section" => p.skip_braces()?,
            ".pragma" => p.skip_past(';'),
            ".visible" | ".extern" | ".weak" | ".common" => p.bump(),
            ".entry" | ".func" => {
                let line = p.line();
                let f = parse_func(p)?;
                if f.is_entry && f.body.is_some() {
                    kernels += 1;
                    if kernels > limits.max_kernels {
                        return Err(ParseError {
                            line,
                            expected: format!(
                                "at most {} kernels (Limits::max_kernels)",
                                limits.max_kernels
                            ),
                            found: format!("kernel {}", f.name),
                            limit: Some("max_kernels"),
                        });
                    }
                }
                // A definition replaces an earlier prototype of the same name.
                match ast.func_index.get(&f.name) {
                    Some(&i) => {
                        let old = &mut ast.funcs[i];
                        if f.body.is_some() || old.body.is_none() {
                            *old = f;
                        }
                    }
                    None => {
                        ast.func_index.insert(f.name.clone(), ast.funcs.len());
                        ast.funcs.push(f);
                    }
                }
            }
            ".global" | ".const" | ".shared" | ".local" | ".tex" => {
                let remaining = limits.max_global_bytes.saturating_sub(data_bytes);
                let v = parse_var(p, remaining)?;
                p.expect_punct(';')?;
                if matches!(v.space.as_str(), "global" | "const") {
                    // Checked before anything of that size exists: the caller allocates it later.
                    data_bytes = data_bytes.saturating_add(v.size.unwrap_or(0) as u64);
                    if data_bytes > limits.max_global_bytes {
                        return Err(ParseError {
                            line: v.line,
                            expected: format!(
                                "at most {} bytes of module .global/.const data (Limits::max_global_bytes)",
                                limits.max_global_bytes
                            ),
                            found: format!("{data_bytes} bytes up to {}", v.name),
                            limit: Some("max_global_bytes"),
                        });
                    }
                }
                ast.var_index
                    .entry(v.name.clone())
                    .or_insert(ast.vars.len());
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
        p.back();
        return p.err("`.param`");
    }
    let mut align = None;
    let mut ty = None;
    let mut ptr = false;
    loop {
        match p.peek() {
            Some(Tok::Ident(s)) if s.starts_with('.') => {
                p.bump();
                match s {
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
                            p.back();
                            return p.err("a parameter type");
                        }
                    }
                }
                if ptr && ty.is_some() {
                    // `.ptr .global .align N` follows the type: swallow it without changing the param align.
                    while let Some(Tok::Ident(s)) = p.peek() {
                        match s {
                            ".ptr" | ".global" | ".shared" | ".const" | ".local" => p.bump(),
                            ".align" => {
                                p.bump();
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
    let name = p.ident("a parameter name")?.to_string();
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
    let name = p.ident("a function name")?.to_string();
    let params = if p.is_punct('(') {
        parse_param_list(p)?
    } else {
        Vec::new()
    };
    let mut max_threads = None;
    // Performance directives and attributes.
    while let Some(Tok::Ident(s)) = p.peek() {
        p.bump();
        match s {
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
                    p.bump();
                }
            }
            ".noreturn" | ".abi_preserve" | ".abi_preserve_control" => {}
            ".pragma" => p.skip_past(';'),
            _ => {
                p.back();
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
/// `max_init` caps the initializer of an unsized array (the module data budget left).
fn parse_var(p: &mut P, max_init: u64) -> R<VarDecl> {
    let line = p.line();
    let space = p.ident("a state space")?;
    let mut align = None;
    let mut vec = 1;
    let mut ty = None;
    while let Some(Tok::Ident(s)) = p.peek() {
        if !s.starts_with('.') {
            break;
        }
        p.bump();
        match s {
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
                    p.back();
                    return p.err("a variable type");
                }
            },
        }
    }
    let Some(ty) = ty else {
        return p.err("a variable type");
    };
    let name = p.ident("a variable name")?.to_string();
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
        let cap = if unsized_dim {
            usize::try_from(max_init)
                .unwrap_or(usize::MAX)
                .min(MAX_VAR_BYTES)
        } else {
            size.unwrap_or(0)
        };
        let mut bytes = Vec::new();
        parse_init(p, ty, &mut bytes, cap)?;
        if unsized_dim {
            size = Some(bytes.len());
            unsized_dim = false;
        }
        // Zeros past the last non-zero byte need not be stored: the variable starts zeroed.
        let used = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
        bytes.truncate(used);
        bytes.shrink_to_fit();
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

/// Appends the initializer's bytes to `out`, refusing more than `cap` bytes.
fn parse_init(p: &mut P, ty: Ty, out: &mut Vec<u8>, cap: usize) -> R<()> {
    if p.eat_punct('{') {
        if p.eat_punct('}') {
            return Ok(());
        }
        loop {
            parse_init(p, ty, out, cap)?;
            if p.eat_punct('}') {
                return Ok(());
            }
            p.expect_punct(',')?;
        }
    }
    let neg = p.eat_punct('-');
    let bits: u64 = match p.peek() {
        Some(Tok::Int(v)) => {
            let v = if neg {
                (v as i64).wrapping_neg() as u64
            } else {
                v
            };
            match ty {
                Ty::F32 => u64::from((v as i64 as f32).to_bits()),
                Ty::F64 => (v as i64 as f64).to_bits(),
                _ => v,
            }
        }
        Some(Tok::F32(b)) => {
            let f = f32::from_bits(b);
            let f = if neg { -f } else { f };
            match ty {
                Ty::F64 => f64::from(f).to_bits(),
                _ => u64::from(f.to_bits()),
            }
        }
        Some(Tok::F64(b)) => {
            let f = f64::from_bits(b);
            let f = if neg { -f } else { f };
            match ty {
                Ty::F32 => u64::from((f as f32).to_bits()),
                Ty::F16 => u64::from(half::f16::from_f64(f).to_bits()),
                Ty::Bf16 => u64::from(half::bf16::from_f64(f).to_bits()),
                _ => f.to_bits(),
            }
        }
        _ => return p.err("a constant initializer (address initializers are not supported)"),
    };
    let n = ty.size().min(8);
    if out.len() + n > cap {
        return p.err(&format!(
            "no more initializer values than the variable's {cap} bytes hold"
        ));
    }
    p.bump();
    out.extend_from_slice(&bits.to_le_bytes()[..n]);
    Ok(())
}

fn parse_body(p: &mut P) -> R<Vec<Stmt>> {
    p.expect_punct('{')?;
    let mut depth = 1usize;
    let mut out = Vec::new();
    loop {
        let line = p.line();
        let Some(tok) = p.peek() else {
            return p.err("`}`");
        };
        match tok {
            Tok::Punct('{') => {
                p.bump();
                depth += 1;
                out.push(Stmt::Open);
            }
            Tok::Punct('}') => {
                p.bump();
                depth -= 1;
                if depth == 0 {
                    out.shrink_to_fit();
                    return Ok(out);
                }
                out.push(Stmt::Close);
            }
            Tok::Punct(';') => p.bump(),
            Tok::Punct('@') => {
                p.bump();
                let neg = p.eat_punct('!');
                let pred = p.ident("a guard predicate")?.into();
                let mut ins = parse_instr(p)?;
                ins.guard = Some((neg, pred));
                ins.line = line;
                out.push(Stmt::Instr(ins));
            }
            Tok::Ident(w) => {
                if p.peek2() == Some(Tok::Punct(':')) {
                    p.bump();
                    p.bump();
                    out.push(Stmt::Label(w.to_string()));
                    continue;
                }
                match w {
                    ".loc" | ".file" => p.skip_line(),
                    // Indirect-call prototypes: calls through them are refused at compile time.
                    ".pragma" | ".callprototype" => p.skip_past(';'),
                    ".reg" => {
                        p.bump();
                        let mut ty = None;
                        while let Some(Tok::Ident(s)) = p.peek() {
                            if !s.starts_with('.') {
                                break;
                            }
                            p.bump();
                            if let Some(t) = Ty::from_name(&s[1..]) {
                                ty = Some(t);
                            } else if !matches!(s, ".v2" | ".v4" | ".align") {
                                p.back();
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
                                    p.back();
                                    return p.err("a register range up to 65536");
                                }
                                p.expect_punct('>')?;
                                for k in 0..count.max(0) {
                                    names.push(format!("{n}{k}"));
                                }
                            } else {
                                names.push(n.to_string());
                            }
                            if !p.eat_punct(',') {
                                break;
                            }
                        }
                        p.expect_punct(';')?;
                        out.push(Stmt::Reg { ty, names });
                    }
                    ".local" | ".shared" | ".param" | ".global" | ".const" => {
                        let v = parse_var(p, MAX_VAR_BYTES as u64)?;
                        p.expect_punct(';')?;
                        out.push(Stmt::Var(Box::new(v)));
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
    let text = p.ident("an instruction")?;
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
        text: text.into(),
        operands: operands.into_boxed_slice(),
    })
}

fn parse_operand(p: &mut P) -> R<Operand> {
    match p.peek() {
        Some(Tok::Punct('[')) => {
            p.bump();
            let mut base = None;
            let mut off = 0i64;
            if let Some(Tok::Ident(s)) = p.peek() {
                base = Some(s.into());
                p.bump();
                if p.eat_punct(',') {
                    // `[tex, {x, y}]`, `[tex, sampler, {x}]`, `[surf, {x, y}]`
                    let mut v = vec![Operand::Reg(s.into())];
                    loop {
                        v.push(parse_operand(p)?);
                        if p.eat_punct(']') {
                            return Ok(Operand::Bracket(v));
                        }
                        p.expect_punct(',')?;
                    }
                }
            } else {
                off = p.int()?;
            }
            while p.is_punct('+') || p.is_punct('-') {
                let neg = p.eat_punct('-');
                if !neg {
                    p.bump();
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
            p.bump();
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
            p.bump();
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
            p.bump();
            Ok(Operand::NotReg(p.ident("a predicate")?.into()))
        }
        Some(Tok::Punct('-')) => {
            p.bump();
            match p.next() {
                Some(Tok::Int(v)) => Ok(Operand::Int((v as i64).wrapping_neg())),
                Some(Tok::F32(b)) => Ok(Operand::F32(b ^ 0x8000_0000)),
                Some(Tok::F64(b)) => Ok(Operand::F64(b ^ (1 << 63))),
                _ => {
                    p.back();
                    p.err("a number after `-`")
                }
            }
        }
        Some(Tok::Int(v)) => {
            p.bump();
            Ok(Operand::Int(v as i64))
        }
        Some(Tok::F32(b)) => {
            p.bump();
            Ok(Operand::F32(b))
        }
        Some(Tok::F64(b)) => {
            p.bump();
            Ok(Operand::F64(b))
        }
        Some(Tok::Ident(s)) => {
            p.bump();
            if s == "_" {
                return Ok(Operand::Sink);
            }
            if p.eat_punct('|') {
                let q = p.ident("a predicate after `|`")?;
                return Ok(Operand::Pair(Box::new((s.into(), q.into()))));
            }
            if p.is_punct('+') && matches!(p.peek2(), Some(Tok::Int(_))) {
                p.bump();
                let v = p.int()?;
                return Ok(Operand::SymOff(s.into(), v));
            }
            Ok(Operand::Reg(s.into()))
        }
        _ => p.err("an operand"),
    }
}
