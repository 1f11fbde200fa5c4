//! The conformance case format (`conformance/README.md`): parsing a `.case` file, generating its inputs as
//! the GPU harness does, and setting a launch up in a `FlatMemory` with its texture and surface objects.

use std::collections::HashMap;

use gleam_ptx::{
    AddressMode, ChannelFormat, FilterMode, FlatMemory, GlobalMemory, Module, Resource,
    SurfaceDesc, TextureDesc, TextureResolver,
};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Elem {
    U8,
    U16,
    U32,
    S8,
    S16,
    S32,
    U64,
    S64,
    F16,
    Bf16,
    F32,
    F64,
}

impl Elem {
    pub fn parse(s: &str) -> Option<Elem> {
        Some(match s {
            "u8" => Elem::U8,
            "u16" => Elem::U16,
            "u32" => Elem::U32,
            "s8" => Elem::S8,
            "s16" => Elem::S16,
            "s32" => Elem::S32,
            "u64" => Elem::U64,
            "s64" => Elem::S64,
            "f16" => Elem::F16,
            "bf16" => Elem::Bf16,
            "f32" => Elem::F32,
            "f64" => Elem::F64,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            Elem::U8 | Elem::S8 => 1,
            Elem::U16 | Elem::S16 | Elem::F16 | Elem::Bf16 => 2,
            Elem::U32 | Elem::S32 | Elem::F32 => 4,
            Elem::U64 | Elem::S64 | Elem::F64 => 8,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, Elem::F16 | Elem::Bf16 | Elem::F32 | Elem::F64)
    }
    /// Raw bits of element `i`.
    pub fn bits(self, b: &[u8], i: usize) -> u64 {
        let n = self.size();
        let mut w = [0u8; 8];
        w[..n].copy_from_slice(&b[i * n..i * n + n]);
        u64::from_le_bytes(w)
    }
    pub fn value(self, bits: u64) -> f64 {
        match self {
            Elem::U8 | Elem::U16 | Elem::U32 | Elem::U64 => bits as f64,
            Elem::S8 => f64::from(bits as u8 as i8),
            Elem::S16 => f64::from(bits as u16 as i16),
            Elem::S32 => f64::from(bits as u32 as i32),
            Elem::S64 => bits as i64 as f64,
            Elem::F16 => half::f16::from_bits(bits as u16).to_f64(),
            Elem::Bf16 => half::bf16::from_bits(bits as u16).to_f64(),
            Elem::F32 => f64::from(f32::from_bits(bits as u32)),
            Elem::F64 => f64::from_bits(bits),
        }
    }
    /// Position on a monotonic integer line, so that ulp distance is a difference.
    pub fn ordinal(self, bits: u64) -> i128 {
        let (mag, sign) = match self {
            Elem::F16 | Elem::Bf16 => (bits & 0x7fff, bits & 0x8000 != 0),
            Elem::F32 => (bits & 0x7fff_ffff, bits & 0x8000_0000 != 0),
            _ => (bits & !(1 << 63), bits >> 63 != 0),
        };
        if sign {
            -i128::from(mag)
        } else {
            i128::from(mag)
        }
    }
    pub fn of_format(f: ChannelFormat) -> Elem {
        match f {
            ChannelFormat::U8 => Elem::U8,
            ChannelFormat::U16 => Elem::U16,
            ChannelFormat::U32 => Elem::U32,
            ChannelFormat::S8 => Elem::S8,
            ChannelFormat::S16 => Elem::S16,
            ChannelFormat::S32 => Elem::S32,
            ChannelFormat::F16 => Elem::F16,
            ChannelFormat::F32 => Elem::F32,
        }
    }
}

fn format_of(s: &str) -> Option<ChannelFormat> {
    Some(match s {
        "u8" => ChannelFormat::U8,
        "u16" => ChannelFormat::U16,
        "u32" => ChannelFormat::U32,
        "s8" => ChannelFormat::S8,
        "s16" => ChannelFormat::S16,
        "s32" => ChannelFormat::S32,
        "f16" => ChannelFormat::F16,
        "f32" => ChannelFormat::F32,
        _ => return None,
    })
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Check {
    Exact,
    Ulp(u64),
    Abs(f64),
    Rel(f64),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Zero,
    Iota,
    Random,
}

/// Sampling state of a `param tex`.
#[derive(Debug, Clone)]
pub struct TexSpec {
    pub resource: String,
    pub filter: FilterMode,
    pub address: [AddressMode; 3],
    pub normalized: bool,
    pub read_as_integer: bool,
    pub border: [f32; 4],
}

#[derive(Debug, Clone)]
pub enum ParamSpec {
    Ptr {
        elem: Elem,
        count: usize,
        init: Init,
        check: Option<Check>,
    },
    Scalar(Vec<u8>),
    Tex(TexSpec),
    Surf(String),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ResKind {
    /// A CUDA array: width, height, depth (0 where absent) and layers (0: not layered).
    Array {
        dims: [u64; 3],
        layers: u64,
    },
    Linear {
        count: u64,
    },
    Pitch2d {
        width: u64,
        height: u64,
    },
}

#[derive(Debug, Clone)]
pub struct ResourceSpec {
    pub name: String,
    pub kind: ResKind,
    pub format: ChannelFormat,
    pub channels: u8,
    pub surface: bool,
    pub init: Init,
    pub check: Option<Check>,
}

impl ResourceSpec {
    /// Texels in all (dense) layers.
    pub fn texels(&self) -> u64 {
        match self.kind {
            ResKind::Array { dims, layers } => {
                dims.iter().map(|d| (*d).max(1)).product::<u64>() * layers.max(1)
            }
            ResKind::Linear { count } => count,
            ResKind::Pitch2d { width, height } => width * height,
        }
    }
    pub fn elem_bytes(&self) -> usize {
        self.format.size() * self.channels as usize
    }
    /// Bytes of the dense `.in`/`.out` data.
    pub fn dense_bytes(&self) -> usize {
        self.texels() as usize * self.elem_bytes()
    }
    pub fn channel_elem(&self) -> Elem {
        Elem::of_format(self.format)
    }
}

#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    pub ptx: String,
    pub kernel: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared: u32,
    pub params: Vec<ParamSpec>,
    pub resources: Vec<ResourceSpec>,
}

impl Case {
    pub fn resource(&self, name: &str) -> Option<(usize, &ResourceSpec)> {
        self.resources
            .iter()
            .enumerate()
            .find(|(_, r)| r.name == name)
    }
    /// Whether the case uses texture or surface objects.
    pub fn uses_objects(&self) -> bool {
        !self.resources.is_empty()
    }
}

fn parse_num<T: std::str::FromStr>(s: &str, what: &str) -> Result<T, String> {
    s.parse().map_err(|_| format!("bad {what} `{s}`"))
}

fn parse_scalar(ty: &str, v: &str) -> Result<Vec<u8>, String> {
    let int = |v: &str| -> Result<i128, String> {
        let (neg, body) = match v.strip_prefix('-') {
            Some(b) => (true, b),
            None => (false, v),
        };
        let x = match body.strip_prefix("0x") {
            Some(h) => i128::from_str_radix(h, 16).map_err(|_| format!("bad integer `{v}`"))?,
            None => parse_num::<i128>(body, "integer")?,
        };
        Ok(if neg { -x } else { x })
    };
    Ok(match ty {
        "u32" | "s32" => (int(v)? as u32).to_le_bytes().to_vec(),
        "u64" | "s64" => (int(v)? as u64).to_le_bytes().to_vec(),
        "f32" => parse_num::<f32>(v, "f32")?.to_le_bytes().to_vec(),
        "f64" => parse_num::<f64>(v, "f64")?.to_le_bytes().to_vec(),
        _ => return Err(format!("unknown scalar type `{ty}`")),
    })
}

fn parse_init(s: &str) -> Result<Init, String> {
    match s {
        "init=zero" => Ok(Init::Zero),
        "init=iota" => Ok(Init::Iota),
        "init=random" => Ok(Init::Random),
        _ => Err(format!("bad init `{s}`")),
    }
}

fn parse_check(ch: &str) -> Result<Check, String> {
    Ok(match ch.split_once(':') {
        None if ch == "exact" => Check::Exact,
        Some(("ulp", n)) => Check::Ulp(parse_num(n, "ulp")?),
        Some(("abs", x)) => Check::Abs(parse_num(x, "abs")?),
        Some(("rel", x)) => Check::Rel(parse_num(x, "rel")?),
        _ => return Err(format!("unknown check `{ch}`")),
    })
}

fn address_mode(s: &str) -> Result<AddressMode, String> {
    Ok(match s {
        "wrap" => AddressMode::Wrap,
        "clamp" => AddressMode::Clamp,
        "mirror" => AddressMode::Mirror,
        "border" => AddressMode::Border,
        _ => return Err(format!("unknown address mode `{s}`")),
    })
}

/// `resource <name> <array|linear|pitch2d> <format> <channels> <dims...> [layers=N] [surface] init=.. [check=..]`
fn parse_resource(w: &[&str]) -> Result<ResourceSpec, String> {
    if w.len() < 6 {
        return Err("resource <name> <kind> <format> <channels> <sizes..> init=..".into());
    }
    let name = w[1].to_string();
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(format!("resource name `{name}`: use [a-z0-9_]"));
    }
    let format = format_of(w[3]).ok_or_else(|| format!("unknown format `{}`", w[3]))?;
    let channels: u8 = parse_num(w[4], "channels")?;
    if !matches!(channels, 1 | 2 | 4) {
        return Err(format!("{channels} channels: use 1, 2 or 4"));
    }
    let mut sizes = Vec::new();
    let mut layers = 0;
    let mut surface = false;
    let mut init = None;
    let mut check = None;
    for kv in &w[5..] {
        if let Some(v) = kv.strip_prefix("layers=") {
            layers = parse_num(v, "layers")?;
        } else if *kv == "surface" {
            surface = true;
        } else if kv.starts_with("init=") {
            init = Some(parse_init(kv)?);
        } else if let Some(c) = kv.strip_prefix("check=") {
            check = Some(parse_check(c)?);
        } else {
            sizes.push(parse_num::<u64>(kv, "size")?);
        }
    }
    if sizes.contains(&0) {
        return Err("sizes must be positive".into());
    }
    let kind = match (w[2], sizes.as_slice()) {
        ("array", [w]) => ResKind::Array {
            dims: [*w, 0, 0],
            layers,
        },
        ("array", [w, h]) => ResKind::Array {
            dims: [*w, *h, 0],
            layers,
        },
        ("array", [w, h, d]) if layers == 0 => ResKind::Array {
            dims: [*w, *h, *d],
            layers,
        },
        ("linear", [n]) if layers == 0 && !surface => ResKind::Linear { count: *n },
        ("pitch2d", [w, h]) if layers == 0 && !surface => ResKind::Pitch2d {
            width: *w,
            height: *h,
        },
        (k, s) => return Err(format!("bad resource `{k}` with sizes {s:?}")),
    };
    let spec = ResourceSpec {
        name,
        kind,
        format,
        channels,
        surface,
        init: init.ok_or("resource needs init=")?,
        check,
    };
    if spec.dense_bytes() > 16 << 20 {
        return Err("resource over 16 MiB".into());
    }
    Ok(spec)
}

/// `param tex <resource> [filter=..] [address=m[,m[,m]]] [normalized] [read=element|normalized] [border=r,g,b,a]`
fn parse_tex(w: &[&str]) -> Result<TexSpec, String> {
    let mut t = TexSpec {
        resource: w.get(2).ok_or("param tex <resource>")?.to_string(),
        filter: FilterMode::Point,
        address: [AddressMode::Clamp; 3],
        normalized: false,
        read_as_integer: false,
        border: [0.0; 4],
    };
    for kv in &w[3..] {
        if let Some(v) = kv.strip_prefix("filter=") {
            t.filter = match v {
                "point" => FilterMode::Point,
                "linear" => FilterMode::Linear,
                _ => return Err(format!("unknown filter `{v}`")),
            };
        } else if let Some(v) = kv.strip_prefix("address=") {
            let modes: Vec<&str> = v.split(',').collect();
            if modes.is_empty() || modes.len() > 3 {
                return Err(format!("bad address `{v}`"));
            }
            for d in 0..3 {
                t.address[d] = address_mode(modes[d.min(modes.len() - 1)])?;
            }
        } else if *kv == "normalized" {
            t.normalized = true;
        } else if let Some(v) = kv.strip_prefix("read=") {
            t.read_as_integer = match v {
                "element" => true,
                "normalized" => false,
                _ => return Err(format!("unknown read mode `{v}`")),
            };
        } else if let Some(v) = kv.strip_prefix("border=") {
            let c: Vec<&str> = v.split(',').collect();
            if c.len() != 4 {
                return Err(format!("border needs 4 values: `{v}`"));
            }
            for (b, v) in t.border.iter_mut().zip(&c) {
                *b = parse_num(v, "border")?;
            }
        } else {
            return Err(format!("unknown texture setting `{kv}`"));
        }
    }
    Ok(t)
}

pub fn parse_case(name: &str, text: &str) -> Result<Case, String> {
    let mut c = Case {
        name: name.to_string(),
        ptx: String::new(),
        kernel: String::new(),
        grid: [1; 3],
        block: [1; 3],
        shared: 0,
        params: Vec::new(),
        resources: Vec::new(),
    };
    let dims = |w: &[&str]| -> Result<[u32; 3], String> {
        if w.len() != 4 {
            return Err(format!("expected 3 dimensions in `{}`", w.join(" ")));
        }
        Ok([
            parse_num(w[1], "dim")?,
            parse_num(w[2], "dim")?,
            parse_num(w[3], "dim")?,
        ])
    };
    for (ln, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let w: Vec<&str> = line.split_whitespace().collect();
        let err = |e: String| format!("{name}.case line {}: {e}", ln + 1);
        match w[0] {
            "ptx" if w.len() == 2 => c.ptx = w[1].to_string(),
            "kernel" if w.len() == 2 => c.kernel = w[1].to_string(),
            "grid" => c.grid = dims(&w).map_err(err)?,
            "block" => c.block = dims(&w).map_err(err)?,
            "shared" if w.len() == 2 => c.shared = parse_num(w[1], "shared").map_err(err)?,
            "resource" => {
                let r = parse_resource(&w).map_err(err)?;
                if c.resource(&r.name).is_some() {
                    return Err(err(format!("resource `{}` declared twice", r.name)));
                }
                c.resources.push(r);
            }
            "param" if w.len() >= 3 && w[1] == "tex" => {
                let t = parse_tex(&w).map_err(err)?;
                if c.resource(&t.resource).is_none() {
                    return Err(err(format!("no resource `{}` declared before", t.resource)));
                }
                c.params.push(ParamSpec::Tex(t));
            }
            "param" if w.len() == 3 && w[1] == "surf" => {
                match c.resource(w[2]) {
                    Some((_, r)) if r.surface && matches!(r.kind, ResKind::Array { .. }) => {}
                    _ => {
                        return Err(err(format!(
                            "`{}` is not an array resource declared with `surface`",
                            w[2]
                        )));
                    }
                }
                c.params.push(ParamSpec::Surf(w[2].to_string()));
            }
            "param" if w.len() >= 5 && w[1] == "ptr" => {
                let elem =
                    Elem::parse(w[2]).ok_or_else(|| err(format!("unknown elem `{}`", w[2])))?;
                let count = parse_num(w[3], "count").map_err(err)?;
                let init = parse_init(w[4]).map_err(err)?;
                let mut check = None;
                for kv in &w[5..] {
                    match kv.strip_prefix("check=") {
                        Some(ch) => check = Some(parse_check(ch).map_err(err)?),
                        None => return Err(err(format!("unknown setting `{kv}`"))),
                    }
                }
                c.params.push(ParamSpec::Ptr {
                    elem,
                    count,
                    init,
                    check,
                });
            }
            "param" if w.len() == 3 => c
                .params
                .push(ParamSpec::Scalar(parse_scalar(w[1], w[2]).map_err(err)?)),
            _ => return Err(err(format!("cannot read `{line}`"))),
        }
    }
    if c.ptx.is_empty() || c.kernel.is_empty() {
        return Err(format!("{name}.case: missing ptx or kernel"));
    }
    Ok(c)
}

/// Whether `got` fails `check` against `exp`.
pub fn mismatch(elem: Elem, check: Check, exp: u64, got: u64) -> bool {
    if exp == got {
        return false;
    }
    let check = if elem.is_float() { check } else { Check::Exact };
    let (e, g) = (elem.value(exp), elem.value(got));
    if elem.is_float() && e.is_nan() && g.is_nan() {
        return false;
    }
    match check {
        Check::Exact => true,
        Check::Ulp(n) => {
            if e.is_nan() || g.is_nan() {
                return true;
            }
            (elem.ordinal(exp) - elem.ordinal(got)).unsigned_abs() > u128::from(n)
        }
        // An unordered (NaN) difference fails.
        Check::Abs(x) => (e - g)
            .abs()
            .partial_cmp(&x)
            .is_none_or(std::cmp::Ordering::is_gt),
        Check::Rel(x) => (e - g)
            .abs()
            .partial_cmp(&(x * e.abs()))
            .is_none_or(std::cmp::Ordering::is_gt),
    }
}

/// Report lines (at most 8, then a count) for the elements of `got` that fail `check` against `expected`.
pub fn compare(label: &str, elem: Elem, check: Check, expected: &[u8], got: &[u8]) -> Vec<String> {
    let mut report = Vec::new();
    if expected.len() != got.len() {
        report.push(format!(
            "{label}: {} bytes expected, {} produced",
            expected.len(),
            got.len()
        ));
        return report;
    }
    let count = expected.len() / elem.size();
    let mut bad = 0;
    for k in 0..count {
        let (e, g) = (elem.bits(expected, k), elem.bits(got, k));
        if mismatch(elem, check, e, g) {
            if bad < 8 {
                report.push(format!(
                    "{label}[{k}] ({elem:?}, {check:?}): expected {} ({e:#x}), got {} ({g:#x})",
                    elem.value(e),
                    elem.value(g)
                ));
            }
            bad += 1;
        }
    }
    if bad > 8 {
        report.push(format!("{label}: {bad} mismatches of {count} in all"));
    }
    report
}

// ---- inputs, as the harness generates them ----

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The stream index of resource `k` (pointer parameters use their parameter index).
pub fn resource_stream(k: usize) -> usize {
    1000 + k
}

/// `count` elements of `elem` filled per `init`, exactly as `harness.c` fills stream `index` of a case.
pub fn generate(case: &str, index: usize, elem: Elem, count: usize, init: Init) -> Vec<u8> {
    let mut state = fnv1a(case) ^ ((index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut out = Vec::with_capacity(count * elem.size());
    for i in 0..count {
        if init == Init::Zero {
            out.extend(std::iter::repeat_n(0, elem.size()));
            continue;
        }
        let random = init == Init::Random;
        let r = if random {
            splitmix64(&mut state)
        } else {
            i as u64
        };
        let bytes: Vec<u8> = match elem {
            Elem::U8 | Elem::S8 => vec![r as u8],
            Elem::U16 | Elem::S16 => (r as u16).to_le_bytes().to_vec(),
            Elem::U32 | Elem::S32 => (r as u32).to_le_bytes().to_vec(),
            Elem::U64 | Elem::S64 => r.to_le_bytes().to_vec(),
            Elem::F32 => {
                let v = if random {
                    (r >> 40) as f32 * (1.0 / 8388608.0) - 1.0
                } else {
                    i as f32
                };
                v.to_le_bytes().to_vec()
            }
            Elem::F64 => {
                let v = if random {
                    (r >> 11) as f64 * (1.0 / 4503599627370496.0) - 1.0
                } else {
                    i as f64
                };
                v.to_le_bytes().to_vec()
            }
            Elem::F16 => {
                let v = if random {
                    ((r >> 53) as i32 - 1024) as f32 / 1024.0
                } else {
                    i as f32
                };
                half::f16::from_f32(v).to_bits().to_le_bytes().to_vec()
            }
            Elem::Bf16 => {
                let v = if random {
                    ((r >> 56) as i32 - 128) as f32 / 128.0
                } else {
                    i as f32
                };
                half::bf16::from_f32(v).to_bits().to_le_bytes().to_vec()
            }
        };
        out.extend(bytes);
    }
    out
}

/// The inputs of every buffer and resource of `case`, generated locally: `p<i>` and resource names.
pub fn generated_inputs(case: &Case) -> HashMap<String, Vec<u8>> {
    let mut m = HashMap::new();
    for (i, p) in case.params.iter().enumerate() {
        if let ParamSpec::Ptr {
            elem, count, init, ..
        } = p
        {
            m.insert(
                format!("p{i}"),
                generate(&case.name, i, *elem, *count, *init),
            );
        }
    }
    for (k, r) in case.resources.iter().enumerate() {
        let channels = r.texels() as usize * r.channels as usize;
        m.insert(
            r.name.clone(),
            generate(
                &case.name,
                resource_stream(k),
                r.channel_elem(),
                channels,
                r.init,
            ),
        );
    }
    m
}

// ---- a launch set up in memory ----

/// Texture and surface objects by handle.
#[derive(Default)]
pub struct Objects {
    pub textures: Vec<(u64, TextureDesc)>,
    pub surfaces: Vec<(u64, SurfaceDesc)>,
}

impl TextureResolver for Objects {
    fn texture(&self, handle: u64) -> Option<TextureDesc> {
        self.textures
            .iter()
            .find(|(h, _)| *h == handle)
            .map(|(_, d)| *d)
    }
    fn surface(&self, handle: u64) -> Option<SurfaceDesc> {
        self.surfaces
            .iter()
            .find(|(h, _)| *h == handle)
            .map(|(_, d)| *d)
    }
}

/// Where a case's buffers and resources live once set up.
pub struct Setup {
    pub mem: FlatMemory,
    pub symbols: HashMap<String, u64>,
    pub params: Vec<u8>,
    /// Pointer parameters: (parameter index, address, bytes).
    pub ptrs: Vec<(usize, u64, usize)>,
    /// Per resource (case order): its descriptor.
    pub resources: Vec<Resource>,
    pub objects: Objects,
}

/// Texture handles are `TEX_HANDLE + k`, surface handles `SURF_HANDLE + k` (k: parameter index): values
/// no GPU would hand out, so a kernel that confuses them faults.
pub const TEX_HANDLE: u64 = 0x7e57_0000_0000;
pub const SURF_HANDLE: u64 = 0x50f7_0000_0000;

/// Pitch-2D rows are padded to this, so that pitch and width differ as they do on a GPU.
const PITCH_ALIGN: usize = 64;

/// Sets `case` up for `module`: `input(name)` gives the initial bytes of `p<i>` and of each resource.
pub fn setup(
    case: &Case,
    module: &Module,
    input: &dyn Fn(&str) -> Result<Vec<u8>, String>,
) -> Result<Setup, String> {
    let kernel = module
        .kernel(&case.kernel)
        .ok_or_else(|| format!("no kernel `{}` in {}", case.kernel, case.ptx))?;
    if kernel.params().len() != case.params.len() {
        return Err(format!(
            "kernel has {} params, case lists {}",
            kernel.params().len(),
            case.params.len()
        ));
    }
    let padded = |r: &ResourceSpec| match r.kind {
        ResKind::Pitch2d { height, .. } => {
            let row = r.elem_bytes() * r.texels() as usize / height as usize;
            (row.div_ceil(PITCH_ALIGN) * PITCH_ALIGN + PITCH_ALIGN) * height as usize
        }
        _ => r.dense_bytes(),
    };
    let total: usize = case
        .params
        .iter()
        .map(|p| match p {
            ParamSpec::Ptr { elem, count, .. } => elem.size() * count + 512,
            _ => 0,
        })
        .sum::<usize>()
        + case
            .resources
            .iter()
            .map(|r| padded(r) + 512)
            .sum::<usize>()
        + module.globals().iter().map(|g| g.size + 512).sum::<usize>()
        + 4096;
    let mut mem = FlatMemory::new(total);
    let mut symbols = HashMap::new();
    for g in module.globals() {
        let a = mem.alloc(g.size).ok_or("arena full")?;
        mem.write(a, &g.init).map_err(|e| e.to_string())?;
        symbols.insert(g.name.clone(), a);
    }
    let mut resources = Vec::new();
    for r in &case.resources {
        let data = input(&r.name)?;
        if data.len() != r.dense_bytes() {
            return Err(format!(
                "{} has {} bytes, expected {}",
                r.name,
                data.len(),
                r.dense_bytes()
            ));
        }
        let base = mem.alloc(padded(r).max(1)).ok_or("arena full")?;
        let res = match r.kind {
            ResKind::Array { dims, layers } => {
                mem.write(base, &data).map_err(|e| e.to_string())?;
                Resource::array(base, r.format, r.channels, dims, layers)
            }
            ResKind::Linear { .. } => {
                mem.write(base, &data).map_err(|e| e.to_string())?;
                Resource::linear(base, r.format, r.channels, data.len() as u64)
            }
            ResKind::Pitch2d { width, height } => {
                let row = width as usize * r.elem_bytes();
                let pitch = padded(r) / height as usize;
                for y in 0..height as usize {
                    mem.write(base + (y * pitch) as u64, &data[y * row..(y + 1) * row])
                        .map_err(|e| e.to_string())?;
                }
                Resource::pitch2d(base, r.format, r.channels, width, height, pitch as u64)
            }
        };
        resources.push(res);
    }
    let mut objects = Objects::default();
    let mut params = vec![0u8; kernel.param_bytes()];
    let mut ptrs = Vec::new();
    for (i, (p, decl)) in case.params.iter().zip(kernel.params()).enumerate() {
        let bytes = match p {
            ParamSpec::Ptr { elem, count, .. } => {
                let len = elem.size() * count;
                let data = input(&format!("p{i}"))?;
                if data.len() != len {
                    return Err(format!("p{i} has {} bytes, expected {len}", data.len()));
                }
                let a = mem.alloc(len.max(1)).ok_or("arena full")?;
                mem.write(a, &data).map_err(|e| e.to_string())?;
                ptrs.push((i, a, len));
                a.to_le_bytes().to_vec()
            }
            ParamSpec::Scalar(b) => b.clone(),
            ParamSpec::Tex(t) => {
                let (k, _) = case.resource(&t.resource).ok_or("unknown resource")?;
                let mut d = TextureDesc::new(resources[k]);
                d.filter = t.filter;
                d.address = t.address;
                d.normalized_coords = t.normalized;
                d.read_as_integer = t.read_as_integer;
                d.border = t.border;
                let h = TEX_HANDLE + i as u64;
                objects.textures.push((h, d));
                h.to_le_bytes().to_vec()
            }
            ParamSpec::Surf(name) => {
                let (k, _) = case.resource(name).ok_or("unknown resource")?;
                let h = SURF_HANDLE + i as u64;
                objects.surfaces.push((
                    h,
                    SurfaceDesc {
                        resource: resources[k],
                    },
                ));
                h.to_le_bytes().to_vec()
            }
        };
        if bytes.len() != decl.size {
            return Err(format!(
                "param {i} is {} bytes in the case, {} in the kernel",
                bytes.len(),
                decl.size
            ));
        }
        params[decl.offset..decl.offset + decl.size].copy_from_slice(&bytes);
    }
    Ok(Setup {
        mem,
        symbols,
        params,
        ptrs,
        resources,
        objects,
    })
}

impl Setup {
    /// Resource `k`'s texels in the dense layout of the `.in`/`.out` files.
    pub fn dense(&self, case: &Case, k: usize) -> Result<Vec<u8>, String> {
        let spec = &case.resources[k];
        let r = &self.resources[k];
        let mut out = vec![0u8; spec.dense_bytes()];
        match spec.kind {
            ResKind::Pitch2d { width, height } => {
                let row = width as usize * spec.elem_bytes();
                for y in 0..height as usize {
                    self.mem
                        .read(
                            r.base + y as u64 * r.row_pitch,
                            &mut out[y * row..(y + 1) * row],
                        )
                        .map_err(|e| e.to_string())?;
                }
            }
            _ => self.mem.read(r.base, &mut out).map_err(|e| e.to_string())?,
        }
        Ok(out)
    }

    /// The current bytes of pointer parameter `i`.
    pub fn buffer(&self, i: usize) -> Option<Vec<u8>> {
        let &(_, a, len) = self.ptrs.iter().find(|(j, _, _)| *j == i)?;
        let mut v = vec![0u8; len];
        self.mem.read(a, &mut v).ok()?;
        Some(v)
    }
}
