//! Textures and surfaces through the whole interpreter, before any GPU recording exists: every texture and
//! surface case of `conformance/` runs on inputs generated as the GPU harness generates them, and its outputs
//! are compared with a CPU reference written here from CUDA's documented rules and what the GPU recordings
//! showed (independently of the interpreter's `tex` module: exact rational arithmetic). Plus the errors: bad handles, `.trap`, unsupported corners.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::case::{
    Case, Check, Init, ParamSpec, ResKind, ResourceSpec, TexSpec, compare, generated_inputs,
    parse_case, setup,
};
use gleam_ptx::{
    AddressMode, ChannelFormat, ExecError, FilterMode, FlatMemory, LaunchConfig, LaunchOptions,
    Module, Resource, ResourceKind, SurfaceDesc, TextureDesc, TextureResolver,
};

fn conformance(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("conformance")
        .join(path)
}

/// Every case that uses texture or surface objects.
fn object_cases() -> Vec<Case> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(conformance("cases")).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_string();
        let c = parse_case(&name, &std::fs::read_to_string(&path).unwrap()).unwrap();
        if c.uses_objects() {
            out.push(c);
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

// ---- the CPU reference ----

/// A texel's channels as the texture returns them: floats, or integers for integer reads.
#[derive(Clone, Copy, Debug)]
enum Value {
    F([f64; 4]),
    I([i64; 4]),
}

/// A texel's channels as stored (f16/f32 as their exact values); channels the format lacks are 0.
#[derive(Clone, Copy, Debug)]
enum Raw {
    Int([i64; 4]),
    Float([f64; 4]),
}

struct RefTexture<'a> {
    spec: &'a TexSpec,
    res: &'a ResourceSpec,
    data: &'a [u8],
}

/// `n / 256` rounded to the nearest integer, halves up.
fn r8(n: i64) -> i64 {
    (n + 128).div_euclid(256)
}

/// `num / den * 2^exp` (den > 0) rounded to a float of `p` significant bits whose smallest step is
/// 2^`min_exp`, halves away from zero: how the texture unit rounds its blends.
fn round_away(num: i128, den: i128, exp: i32, p: i32, min_exp: i32) -> f64 {
    if num == 0 {
        return 0.0;
    }
    let (neg, num) = (num < 0, num.abs());
    let bits = |v: i128| 128 - v.leading_zeros() as i32;
    // floor(log2(num / den)).
    let mut e = bits(num) - bits(den);
    let below = |e: i32| {
        if e >= 0 {
            num < den << e
        } else {
            num << -e < den
        }
    };
    if below(e) {
        e -= 1;
    }
    let q_exp = (e + exp - (p - 1)).max(min_exp);
    let s = exp - q_exp;
    let (n2, d2) = if s >= 0 {
        (num.checked_shl(s as u32).unwrap(), den)
    } else {
        (num, den.checked_shl((-s) as u32).unwrap())
    };
    assert!(bits(n2) < 126 && bits(d2) < 126, "reference out of range");
    let mut q = n2 / d2;
    if 2 * (n2 % d2) >= d2 {
        q += 1;
    }
    let v = q as f64 * 2f64.powi(q_exp);
    if neg { -v } else { v }
}

/// An exactly representable float as `m * 2^e`, `m` an integer.
fn split_float(v: f64) -> (i128, i32) {
    if v == 0.0 {
        return (0, 0);
    }
    let b = v.to_bits();
    let exp = ((b >> 52) & 0x7ff) as i32;
    let frac = i128::from(b & ((1 << 52) - 1));
    let (m, e) = if exp == 0 {
        (frac, -1074)
    } else {
        (frac | 1 << 52, exp - 1075)
    };
    let m = if b >> 63 == 1 { -m } else { m };
    (m, e)
}

impl RefTexture<'_> {
    fn dims(&self) -> [i64; 3] {
        match self.res.kind {
            ResKind::Array { dims, .. } => dims.map(|d| d.max(1) as i64),
            ResKind::Linear { count } => [count as i64, 1, 1],
            ResKind::Pitch2d { width, height } => [width as i64, height as i64, 1],
        }
    }

    fn layers(&self) -> i64 {
        match self.res.kind {
            ResKind::Array { layers, .. } => layers as i64,
            _ => 0,
        }
    }

    fn one_d_array(&self) -> bool {
        matches!(
            self.res.kind,
            ResKind::Array {
                dims: [_, 0, _],
                ..
            }
        )
    }

    fn floats(&self) -> bool {
        let f = self.res.format;
        matches!(f, ChannelFormat::F16 | ChannelFormat::F32)
            || (!self.spec.read_as_integer
                && matches!(
                    f,
                    ChannelFormat::U8 | ChannelFormat::U16 | ChannelFormat::S8 | ChannelFormat::S16
                ))
    }

    /// The integer reading as 1.0 in the normalized read mode.
    fn norm_max(&self) -> i64 {
        match self.res.format {
            ChannelFormat::U8 => 255,
            ChannelFormat::U16 => 65535,
            ChannelFormat::S8 => 127,
            _ => 32767,
        }
    }

    /// Texel `[x, y, z]` of `layer`, all in range.
    fn raw(&self, p: [i64; 3], layer: i64) -> Raw {
        let [w, h, d] = self.dims();
        let index = (((layer * d + p[2]) * h + p[1]) * w + p[0]) as usize;
        let ch = self.res.channels as usize;
        let elem = self.res.channel_elem();
        let mut v = [0f64; 4];
        for (c, out) in v.iter_mut().enumerate().take(ch) {
            *out = elem.value(elem.bits(self.data, index * ch + c));
        }
        match self.res.format {
            ChannelFormat::F16 | ChannelFormat::F32 => Raw::Float(v),
            _ => Raw::Int(v.map(|x| x as i64)),
        }
    }

    /// The border colour stored in the texture's format: unsigned normalized formats truncate it to their
    /// steps, signed ones round it to the nearest step, f16 rounds it toward zero, integer reads take the low
    /// bits of its f32 bit pattern (sign-extended); missing channels are 0.
    fn border_raw(&self) -> Raw {
        let ch = self.res.channels as usize;
        let b: [f32; 4] = std::array::from_fn(|c| if c < ch { self.spec.border[c] } else { 0.0 });
        let bits = |v: f32, width: u32, signed: bool| -> i64 {
            let x = u64::from(v.to_bits()) & ((1u64 << width) - 1);
            if signed && x >> (width - 1) == 1 {
                x as i64 - (1i64 << width)
            } else {
                x as i64
            }
        };
        match self.res.format {
            ChannelFormat::F32 => Raw::Float(b.map(f64::from)),
            ChannelFormat::F16 => Raw::Float(b.map(|v| {
                // Toward zero: the nearest f16, or the one below it in magnitude.
                let h = half::f16::from_f32(v);
                let h = if h.to_f32().abs() > v.abs() {
                    half::f16::from_bits(h.to_bits() - 1)
                } else {
                    h
                };
                h.to_f64()
            })),
            ChannelFormat::U32 => Raw::Int(b.map(|v| bits(v, 32, false))),
            ChannelFormat::S32 => Raw::Int(b.map(|v| bits(v, 32, true))),
            f if self.spec.read_as_integer => {
                let (width, signed) = match f {
                    ChannelFormat::U8 => (8, false),
                    ChannelFormat::S8 => (8, true),
                    ChannelFormat::U16 => (16, false),
                    _ => (16, true),
                };
                Raw::Int(b.map(|v| bits(v, width, signed)))
            }
            ChannelFormat::S8 | ChannelFormat::S16 => {
                Raw::Int(b.map(|v| {
                    (f64::from(v).clamp(-1.0, 1.0) * self.norm_max() as f64).round() as i64
                }))
            }
            _ => {
                Raw::Int(b.map(|v| {
                    (f64::from(v).clamp(0.0, 1.0) * self.norm_max() as f64).trunc() as i64
                }))
            }
        }
    }

    /// What a point sample of `raw` returns.
    fn read(&self, raw: Raw) -> Value {
        match raw {
            Raw::Float(f) => Value::F(f),
            Raw::Int(i) if self.floats() => {
                let m = self.norm_max();
                Value::F(i.map(|v| f64::from(v.max(-m) as f32 / m as f32)))
            }
            Raw::Int(i) => Value::I(i),
        }
    }

    /// The address mode along `d` as it acts: wrap and mirror clamp unnormalized coordinates.
    fn mode(&self, d: usize) -> AddressMode {
        match self.spec.address[d] {
            AddressMode::Wrap | AddressMode::Mirror if !self.spec.normalized => AddressMode::Clamp,
            m => m,
        }
    }

    /// Texel index `i` of a dimension of `n`, brought into range by the address mode (`None`: border).
    fn wrap(&self, i: i64, n: i64, d: usize) -> Option<i64> {
        match self.mode(d) {
            AddressMode::Clamp => Some(i.clamp(0, n - 1)),
            AddressMode::Border => (i >= 0 && i < n).then_some(i),
            AddressMode::Wrap => Some(((i % n) + n) % n),
            AddressMode::Mirror => {
                // Period 2n: 0 .. n-1, then n-1 .. 0.
                let m = ((i % (2 * n)) + 2 * n) % (2 * n);
                Some(if m < n { m } else { 2 * n - 1 - m })
            }
        }
    }

    fn tap(&self, idx: [i64; 3], dims: usize, layer: i64) -> Raw {
        let n = self.dims();
        let mut p = [0i64; 3];
        for d in 0..dims {
            match self.wrap(idx[d], n[d], d) {
                Some(i) => p[d] = i,
                None => return self.border_raw(),
            }
        }
        self.raw(p, layer)
    }

    fn layer(&self, layer: Option<i64>) -> i64 {
        layer.map_or(0, |l| i64::from(l as u32).min(self.layers() - 1))
    }

    /// Texel-space coordinate of `c` along dimension `d`.
    fn scaled(&self, c: f32, d: usize) -> f64 {
        if self.spec.normalized {
            f64::from(c * self.dims()[d] as f32)
        } else {
            f64::from(c)
        }
    }

    /// Corner weights (1/256 steps) of a footprint with upper-texel fractions `f`: split along z, then x,
    /// then y; a split rounds its upper part, except along y in the lower x column, where it rounds the
    /// lower part.
    fn weights(f: &[i64]) -> Vec<i64> {
        let slice = |q: i64, out: &mut Vec<i64>| {
            let (a, b) = (f[0], f[1]);
            let hi_x = r8(a * q);
            let lo_x = q - hi_x;
            let w00 = r8((256 - b) * lo_x);
            let w11 = r8(b * hi_x);
            out.extend([w00, hi_x - w11, lo_x - w00, w11]);
        };
        let mut w = Vec::new();
        match f.len() {
            1 => w.extend([256 - f[0], f[0]]),
            2 => slice(256, &mut w),
            _ => {
                slice(256 - f[2], &mut w);
                slice(f[2], &mut w);
            }
        }
        w
    }

    /// Channel `c` of the taps blended, as the texture unit rounds it.
    fn blend(&self, taps: &[(i64, Raw)], c: usize) -> f64 {
        match self.res.format {
            ChannelFormat::F32 | ChannelFormat::F16 => {
                let parts: Vec<(i64, i128, i32)> = taps
                    .iter()
                    .filter(|(w, _)| *w != 0)
                    .map(|&(w, r)| match r {
                        Raw::Float(f) => {
                            let (m, e) = split_float(f[c]);
                            (w, m, e)
                        }
                        Raw::Int(_) => unreachable!(),
                    })
                    .collect();
                let emin = parts.iter().map(|p| p.2).min().unwrap_or(0);
                let num: i128 = parts
                    .iter()
                    .map(|&(w, m, e)| i128::from(w) * (m << (e - emin)))
                    .sum();
                let (p, min_exp) = if self.res.format == ChannelFormat::F16 {
                    (11, -24)
                } else {
                    (24, -149)
                };
                round_away(num, 256, emin, p, min_exp)
            }
            f => {
                let ints = taps.iter().map(|&(w, r)| match r {
                    Raw::Int(i) => (w, i[c]),
                    Raw::Float(_) => unreachable!(),
                });
                let m = self.norm_max();
                if matches!(f, ChannelFormat::U8 | ChannelFormat::U16) {
                    // 16-bit fixed point: 8-bit values widen to v * 257.
                    let widen = 65535 / m;
                    let sum: i64 = ints.map(|(w, v)| w * v * widen).sum();
                    f64::from(r8(sum) as f32 / 65535.0)
                } else if f == ChannelFormat::S16 {
                    // 16-bit fixed point, like the unsigned formats.
                    let sum: i64 = ints.map(|(w, v)| w * v.max(-m)).sum();
                    f64::from(r8(sum) as f32 / 32767.0)
                } else {
                    // s8: the nearest multiple of 1/32767 (the hardware's rule is not settled).
                    let sum: i64 = ints.map(|(w, v)| w * v.max(-m)).sum();
                    let q = (2 * sum * 32767 + 256 * m).div_euclid(2 * 256 * m);
                    f64::from(q as f32 / 32767.0)
                }
            }
        }
    }

    /// `tex` at float coordinates.
    fn sample(&self, c: &[f32], layer: Option<i64>) -> Value {
        let layer = self.layer(layer);
        // A 1D array is a 2D image one texel high, sampled at y = 0.
        let mut c = c.to_vec();
        if c.len() == 1 && self.one_d_array() {
            c.push(0.0);
        }
        let dims = c.len();
        if self.spec.filter == FilterMode::Point {
            let mut idx = [0i64; 3];
            for d in 0..dims {
                idx[d] = self.scaled(c[d], d).floor() as i64;
            }
            return self.read(self.tap(idx, dims, layer));
        }
        // Per dimension: the lower texel and the weight of the upper one, in 1/256 steps (a clamped
        // coordinate first moved onto the edge texel's centre).
        let mut lo = [0i64; 3];
        let mut f = vec![0i64; dims];
        for d in 0..dims {
            let mut t = self.scaled(c[d], d) - 0.5;
            if self.mode(d) == AddressMode::Clamp {
                t = t.clamp(0.0, (self.dims()[d] - 1) as f64);
            }
            let steps = (t * 256.0 + 0.5).floor() as i64;
            lo[d] = steps.div_euclid(256);
            f[d] = steps.rem_euclid(256);
        }
        let w = Self::weights(&f);
        let taps: Vec<(i64, Raw)> = w
            .iter()
            .enumerate()
            .map(|(k, &wk)| {
                let idx: [i64; 3] = std::array::from_fn(|d| lo[d] + (k as i64 >> d & 1));
                (wk, self.tap(idx, dims, layer))
            })
            .collect();
        assert!(self.floats(), "linear filtering of integers");
        Value::F(std::array::from_fn(|ch| {
            if ch < self.res.channels as usize {
                self.blend(&taps, ch)
            } else {
                0.0
            }
        }))
    }

    /// `tex1Dfetch`: zero outside the buffer.
    fn fetch(&self, i: i64) -> Value {
        if i < 0 || i >= self.dims()[0] {
            return if self.floats() {
                Value::F([0.0; 4])
            } else {
                Value::I([0; 4])
            };
        }
        self.read(self.raw([i, 0, 0], 0))
    }

    /// `tld4`: component `comp` of the bilinear footprint, counter-clockwise from the lower left.
    fn gather(&self, c: &[f32], comp: usize) -> Value {
        let mut lo = [0i64; 3];
        for d in 0..2 {
            let steps = ((self.scaled(c[d], d) - 0.5) * 256.0 + 0.5).floor() as i64;
            lo[d] = steps.div_euclid(256);
        }
        let at = |dx: i64, dy: i64| self.read(self.tap([lo[0] + dx, lo[1] + dy, 0], 2, 0));
        let four = [at(0, 1), at(1, 1), at(1, 0), at(0, 0)];
        match four[0] {
            Value::F(_) => Value::F(four.map(|v| match v {
                Value::F(f) => f[comp],
                Value::I(_) => unreachable!(),
            })),
            Value::I(_) => Value::I(four.map(|v| match v {
                Value::I(i) => i[comp],
                Value::F(_) => unreachable!(),
            })),
        }
    }
}

fn push(out: &mut Vec<u8>, v: Value) {
    match v {
        Value::F(f) => f.iter().for_each(|x| out.extend((*x as f32).to_le_bytes())),
        Value::I(i) => i.iter().for_each(|x| out.extend((*x as i32).to_le_bytes())),
    }
}

fn f32_param(c: &Case, i: usize) -> f32 {
    match &c.params[i] {
        ParamSpec::Scalar(b) => f32::from_le_bytes(b[..4].try_into().unwrap()),
        p => panic!("param {i}: {p:?}"),
    }
}

fn s32_param(c: &Case, i: usize) -> i32 {
    match &c.params[i] {
        ParamSpec::Scalar(b) => i32::from_le_bytes(b[..4].try_into().unwrap()),
        p => panic!("param {i}: {p:?}"),
    }
}

/// `start + i * step` as the kernels compute it (`cvt.rn.f32.s32` then `fma.rn.f32`).
fn coord(start: f32, step: f32, i: i32) -> f32 {
    (i as f32).mul_add(step, start)
}

/// The expected bytes of each checked buffer (`p<i>`) and resource of a texture or surface case.
fn reference(c: &Case, inputs: &HashMap<String, Vec<u8>>) -> HashMap<String, Vec<u8>> {
    let mut out = HashMap::new();
    let tex = || -> RefTexture {
        let ParamSpec::Tex(spec) = &c.params[0] else {
            panic!("{}: the first parameter is the texture", c.name)
        };
        let (_, res) = c.resource(&spec.resource).unwrap();
        RefTexture {
            spec,
            res,
            data: &inputs[&res.name],
        }
    };
    let mut buf = Vec::new();
    match c.kernel.as_str() {
        "tex1d_f4" => {
            let t = tex();
            let (x0, dx, n) = (f32_param(c, 2), f32_param(c, 3), s32_param(c, 4));
            for i in 0..n {
                push(&mut buf, t.sample(&[coord(x0, dx, i)], None));
            }
        }
        "tex2d_f4" | "tex2d_u4" | "tex2d_i4" | "tld4_f4" | "tld4_u4" => {
            let t = tex();
            let (x0, dx, y0, dy) = (
                f32_param(c, 2),
                f32_param(c, 3),
                f32_param(c, 4),
                f32_param(c, 5),
            );
            let (nx, ny) = (s32_param(c, 6), s32_param(c, 7));
            for j in 0..ny {
                for i in 0..nx {
                    let p = [coord(x0, dx, i), coord(y0, dy, j)];
                    if c.kernel.starts_with("tld4") {
                        for comp in 0..4 {
                            push(&mut buf, t.gather(&p, comp));
                        }
                    } else {
                        push(&mut buf, t.sample(&p, None));
                    }
                }
            }
        }
        "tex3d_f4" | "tex2d_layered_f4" => {
            let t = tex();
            let f: Vec<f32> = (2..8).map(|i| f32_param(c, i)).collect();
            let layered = c.kernel == "tex2d_layered_f4";
            let (nx, ny, nz) = if layered {
                (s32_param(c, 6), s32_param(c, 7), s32_param(c, 8))
            } else {
                (s32_param(c, 8), s32_param(c, 9), s32_param(c, 10))
            };
            for k in 0..nz {
                for j in 0..ny {
                    for i in 0..nx {
                        let (x, y) = (coord(f[0], f[1], i), coord(f[2], f[3], j));
                        let v = if layered {
                            t.sample(&[x, y], Some(i64::from(k)))
                        } else {
                            t.sample(&[x, y, coord(f[4], f[5], k)], None)
                        };
                        push(&mut buf, v);
                    }
                }
            }
        }
        "tex1dfetch_f4" | "tex1dfetch_i4" => {
            let t = tex();
            let (first, n) = (s32_param(c, 2), s32_param(c, 3));
            for i in 0..n {
                push(&mut buf, t.fetch(i64::from(first + i)));
            }
        }
        "tex_query" => {
            // A 1D resource is one texel high; the depth of a layered one is its layer count, that of a
            // 2D one 0.
            let dims = |r: &ResourceSpec| match r.kind {
                ResKind::Array {
                    dims: [w, h, d],
                    layers,
                } => [w, h.max(1), if layers > 0 { layers } else { d }].map(|d| d as u32),
                _ => unreachable!(),
            };
            for r in &c.resources {
                for d in dims(r) {
                    buf.extend(d.to_le_bytes());
                }
            }
        }
        _ => {}
    }
    if !buf.is_empty() {
        let p = c
            .params
            .iter()
            .position(|p| matches!(p, ParamSpec::Ptr { .. }))
            .unwrap();
        out.insert(format!("p{p}"), buf);
        return out;
    }
    // Surfaces.
    let texels = |name: &str| -> Vec<u32> {
        inputs[name]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let words = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    match c.kernel.as_str() {
        "surf2d_roundtrip" => {
            let src = texels("src");
            let dst: Vec<u32> = src
                .iter()
                .map(|v| v.wrapping_mul(3).wrapping_add(1))
                .collect();
            out.insert("dst".into(), words(&dst));
        }
        "surf1d_roundtrip" => {
            let src: Vec<f32> = texels("src").iter().map(|b| f32::from_bits(*b)).collect();
            let dst: Vec<f32> = src
                .chunks_exact(2)
                .flat_map(|v| [v[1] * 2.0, v[0] + 1.0])
                .collect();
            out.insert(
                "dst".into(),
                dst.iter().flat_map(|v| v.to_le_bytes()).collect(),
            );
        }
        "surf3d_roundtrip" => {
            let src = &inputs["src"];
            let dst: Vec<u8> = src
                .chunks_exact(4)
                .flat_map(|v| [v[3], v[2].wrapping_add(1), v[1] ^ 0x5a, v[0]])
                .collect();
            out.insert("dst".into(), dst);
        }
        "surf2d_layered_roundtrip" => {
            let src: Vec<f32> = texels("src").iter().map(|b| f32::from_bits(*b)).collect();
            let per_layer = 4 * 3 * 4;
            let mut dst = vec![0f32; src.len()];
            for z in 0..3 {
                for t in 0..per_layer / 4 {
                    let s = &src[z * per_layer + 4 * t..][..4];
                    let d = &mut dst[(2 - z) * per_layer + 4 * t..][..4];
                    d.copy_from_slice(&[s[0], -s[1], s[2] * 0.5, s[3]]);
                }
            }
            out.insert(
                "dst".into(),
                dst.iter().flat_map(|v| v.to_le_bytes()).collect(),
            );
        }
        "surf2d_read_oob" => {
            let s = texels("s");
            let (w, h) = (6i32, 5i32);
            let (x0, y0, nx, ny) = (
                s32_param(c, 2),
                s32_param(c, 3),
                s32_param(c, 4),
                s32_param(c, 5),
            );
            let mut o = Vec::new();
            for j in 0..ny {
                for i in 0..nx {
                    let (x, y) = (x0 + i, y0 + j);
                    let inside = (0..w).contains(&x) && (0..h).contains(&y);
                    o.push(if inside { s[(y * w + x) as usize] } else { 0 });
                    o.push(s[(y.clamp(0, h - 1) * w + x.clamp(0, w - 1)) as usize]);
                }
            }
            out.insert("p1".into(), words(&o));
        }
        "surf2d_write_oob" => {
            let mut s = texels("s");
            let (w, h) = (6usize, 5usize);
            for y in 0..h {
                s[y * w + w - 1] = 1000 + y as u32;
            }
            out.insert("s".into(), words(&s));
        }
        k => panic!("{}: no reference for kernel {k}", c.name),
    }
    out
}

#[test]
fn texture_and_surface_cases_match_the_cpu_reference() {
    let cases = object_cases();
    assert!(cases.len() >= 30, "{} cases", cases.len());
    let mut report = Vec::new();
    for c in &cases {
        let text = std::fs::read_to_string(conformance("ptx").join(&c.ptx)).unwrap();
        let module = Module::parse(&text).unwrap();
        let inputs = generated_inputs(c);
        let s = setup(c, &module, &|name: &str| {
            inputs.get(name).cloned().ok_or(format!("no input {name}"))
        })
        .unwrap();
        let cfg = LaunchConfig {
            grid: c.grid,
            block: c.block,
            dynamic_shared_bytes: c.shared,
        };
        let opts = LaunchOptions {
            textures: Some(&s.objects),
            ..LaunchOptions::default()
        };
        if let Err(e) = gleam_ptx::launch_with(
            &module, &c.kernel, &cfg, &s.params, &s.symbols, &s.mem, &opts,
        ) {
            report.push(format!("{}: launch: {e}", c.name));
            continue;
        }
        let expected = reference(c, &inputs);
        // Where the case is recorded, the reference must reproduce the GPU bit for bit too.
        let recorded = |key: &str| {
            std::fs::read(conformance("data").join(&c.name).join(format!("{key}.out"))).ok()
        };
        let mut checked = 0;
        for (i, p) in c.params.iter().enumerate() {
            if let ParamSpec::Ptr {
                elem,
                check: Some(_),
                ..
            } = p
            {
                let key = format!("p{i}");
                let exp = expected
                    .get(&key)
                    .unwrap_or_else(|| panic!("{}: no reference for {key}", c.name));
                report.extend(compare(
                    &format!("{} {key}", c.name),
                    *elem,
                    Check::Exact,
                    exp,
                    &s.buffer(i).unwrap(),
                ));
                if let Some(gpu) = recorded(&key) {
                    let label = format!("{} {key} (reference vs GPU)", c.name);
                    report.extend(compare(&label, *elem, Check::Exact, &gpu, exp));
                }
                checked += 1;
            }
        }
        for (k, r) in c.resources.iter().enumerate() {
            if r.check.is_some() {
                let exp = expected
                    .get(&r.name)
                    .unwrap_or_else(|| panic!("{}: no reference for {}", c.name, r.name));
                report.extend(compare(
                    &format!("{} {}", c.name, r.name),
                    r.channel_elem(),
                    Check::Exact,
                    exp,
                    &s.dense(c, k).unwrap(),
                ));
                if let Some(gpu) = recorded(&r.name) {
                    let label = format!("{} {} (reference vs GPU)", c.name, r.name);
                    report.extend(compare(&label, r.channel_elem(), Check::Exact, &gpu, exp));
                }
                checked += 1;
            }
        }
        assert!(checked > 0, "{}: nothing checked", c.name);
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}

// ---- errors and refusals ----

const SURF_PTX: &str = ".version 8.0\n.target sm_75\n.address_size 64\n\
    .visible .entry k(.param .u64 s, .param .u32 x)\n{\n .reg .b32 %r<4>;\n .reg .b64 %rd<2>;\n\
     ld.param.u64 %rd1, [s];\n ld.param.u32 %r1, [x];\n\
     mov.u32 %r3, 1;\n suld.b.2d.b32.trap {%r2}, [%rd1, {%r1, %r3}];\n ret;\n}\n";

const TEX_PTX: &str = ".version 8.0\n.target sm_75\n.address_size 64\n\
    .visible .entry k(.param .u64 t)\n{\n .reg .f32 %f<6>;\n .reg .b64 %rd<2>;\n\
     ld.param.u64 %rd1, [t];\n mov.f32 %f1, 0f3F000000;\n\
     tex.2d.v4.f32.f32 {%f2, %f3, %f4, %f5}, [%rd1, {%f1, %f1}];\n ret;\n}\n";

struct One(Option<TextureDesc>, Option<SurfaceDesc>);

impl TextureResolver for One {
    fn texture(&self, h: u64) -> Option<TextureDesc> {
        self.0.filter(|_| h == 7)
    }
    fn surface(&self, h: u64) -> Option<SurfaceDesc> {
        self.1.filter(|_| h == 7)
    }
}

fn run(ptx: &str, params: &[u8], res: &One, mem: &FlatMemory) -> Result<(), ExecError> {
    let m = Module::parse(ptx).unwrap();
    let cfg = LaunchConfig {
        grid: [1, 1, 1],
        block: [1, 1, 1],
        dynamic_shared_bytes: 0,
    };
    let opts = LaunchOptions {
        textures: Some(res),
        ..LaunchOptions::default()
    };
    gleam_ptx::launch_with(&m, "k", &cfg, params, &HashMap::new(), mem, &opts).map(|_| ())
}

fn image(mem: &mut FlatMemory) -> Resource {
    let a = mem.alloc(64).unwrap();
    Resource::array(a, ChannelFormat::F32, 1, [4, 4, 0], 0)
}

#[test]
fn surface_trap_mode_faults_out_of_range() {
    let mut mem = FlatMemory::new(4096);
    let res = One(
        None,
        Some(SurfaceDesc {
            resource: image(&mut mem),
        }),
    );
    let params = |x: u32| [7u64.to_le_bytes().as_slice(), &x.to_le_bytes()].concat();
    assert_eq!(run(SURF_PTX, &params(4), &res, &mem), Ok(()));
    assert!(matches!(
        run(SURF_PTX, &params(16), &res, &mem),
        Err(ExecError::MemoryFault {
            space: "surface",
            ..
        })
    ));
    assert!(matches!(
        run(SURF_PTX, &params(2), &res, &mem),
        Err(ExecError::Misaligned { .. })
    ));
}

#[test]
fn unknown_handles_and_missing_resolvers_are_errors() {
    let mut mem = FlatMemory::new(4096);
    let d = TextureDesc::new(image(&mut mem));
    let res = One(Some(d), None);
    assert_eq!(run(TEX_PTX, &7u64.to_le_bytes(), &res, &mem), Ok(()));
    assert!(matches!(
        run(TEX_PTX, &8u64.to_le_bytes(), &res, &mem),
        Err(ExecError::InvalidHandle {
            kind: "texture",
            handle: 8,
            ..
        })
    ));
    // A surface handle is not a texture handle.
    let res = One(
        None,
        Some(SurfaceDesc {
            resource: d.resource,
        }),
    );
    assert!(matches!(
        run(TEX_PTX, &7u64.to_le_bytes(), &res, &mem),
        Err(ExecError::InvalidHandle { .. })
    ));
    // No resolver at all.
    let m = Module::parse(TEX_PTX).unwrap();
    let cfg = LaunchConfig {
        grid: [1, 1, 1],
        block: [1, 1, 1],
        dynamic_shared_bytes: 0,
    };
    let r = gleam_ptx::launch(&m, "k", &cfg, &7u64.to_le_bytes(), &HashMap::new(), &mem);
    assert!(matches!(r, Err(ExecError::InvalidHandle { .. })), "{r:?}");
}

#[test]
fn unsupported_corners_are_refused_not_guessed() {
    let mut mem = FlatMemory::new(4096);
    let base = TextureDesc::new(image(&mut mem));
    let refused = |d: TextureDesc| {
        let r = run(TEX_PTX, &7u64.to_le_bytes(), &One(Some(d), None), &mem);
        assert!(
            matches!(r, Err(ExecError::Unsupported { .. })),
            "{d:?}: {r:?}"
        );
    };
    let mut d = base;
    d.srgb = true;
    refused(d);
    let mut d = base;
    d.resource.kind = ResourceKind::MipmappedArray;
    refused(d);
    let mut d = base;
    d.resource.cubemap = true;
    refused(d);
    // Float coordinates on linear memory.
    let mut d = base;
    d.resource = Resource::linear(d.resource.base, ChannelFormat::F32, 1, 64);
    refused(d);
    // Linear filtering of integers.
    let mut d = base;
    d.resource.format = ChannelFormat::S32;
    d.read_as_integer = true;
    d.filter = FilterMode::Linear;
    refused(d);
    // LOD forms and cubemaps are refused when the kernel is compiled.
    for (op, coords) in [
        ("tex.level.2d.v4.f32.f32", "[%rd1, {%f1, %f1}], %f1"),
        ("tex.cube.v4.f32.f32", "[%rd1, {%f1, %f1, %f1, %f1}]"),
        ("tex.2d.v2.f16x2.f32", "[%rd1, {%f1, %f1}]"),
    ] {
        let src = TEX_PTX.replace(
            "tex.2d.v4.f32.f32 {%f2, %f3, %f4, %f5}, [%rd1, {%f1, %f1}]",
            &format!("{op} {{%f2, %f3, %f4, %f5}}, {coords}"),
        );
        let m = Module::parse(&src).unwrap();
        assert!(m.kernel("k").unwrap().unsupported().is_some(), "{op}");
    }
}

#[test]
fn generated_case_inputs_are_deterministic_and_sized() {
    for c in object_cases() {
        let a = generated_inputs(&c);
        let b = generated_inputs(&c);
        assert_eq!(a, b);
        for r in &c.resources {
            assert_eq!(a[&r.name].len(), r.dense_bytes(), "{} {}", c.name, r.name);
            if r.init == Init::Zero {
                assert!(a[&r.name].iter().all(|&b| b == 0));
            }
        }
    }
}

/// Descriptors no sane driver would make: the interpreter must answer with errors, never panic.
struct Hostile(Vec<Resource>);

impl TextureResolver for Hostile {
    fn texture(&self, h: u64) -> Option<TextureDesc> {
        let r = *self.0.get(h as usize % self.0.len())?;
        let mut d = TextureDesc::new(r);
        d.filter = if h & 1 == 0 {
            FilterMode::Point
        } else {
            FilterMode::Linear
        };
        d.normalized_coords = h & 2 != 0;
        d.address = if h & 8 == 0 {
            [AddressMode::Wrap, AddressMode::Mirror, AddressMode::Border]
        } else {
            [AddressMode::Mirror, AddressMode::Clamp, AddressMode::Wrap]
        };
        d.read_as_integer = h & 4 != 0;
        Some(d)
    }
    fn surface(&self, h: u64) -> Option<SurfaceDesc> {
        Some(SurfaceDesc {
            resource: *self.0.get(h as usize % self.0.len())?,
        })
    }
}

#[test]
fn mutated_texture_kernels_and_hostile_descriptors_error_without_panics() {
    let mut mem = FlatMemory::new(1 << 16);
    let buf = mem.alloc(4096).unwrap();
    let huge = Resource::array(buf, ChannelFormat::F32, 4, [u64::MAX, 1 << 40, 3], 0);
    let mut layered = Resource::array(buf, ChannelFormat::U8, 2, [7, 5, 0], u64::MAX);
    layered.row_pitch = u64::MAX;
    let mut high = Resource::pitch2d(u64::MAX - 8, ChannelFormat::S16, 1, 9, 9, 3);
    high.slice_pitch = u64::MAX;
    let odd = Resource::array(buf, ChannelFormat::F16, 3, [0, 0, 0], 0);
    let linear = Resource::linear(buf, ChannelFormat::S8, 4, 4096);
    let resolver = Hostile(vec![huge, layered, high, odd, linear]);
    let mut seed: u64 = 0x0DDB_1A5E_5BAD_5EED;
    let mut launched = 0;
    for file in ["textures.ptx", "surfaces.ptx"] {
        let text = std::fs::read_to_string(conformance("ptx").join(file)).unwrap();
        let tokens: Vec<&str> = text
            .split_inclusive(|c: char| c.is_whitespace() || ",;[]{}()".contains(c))
            .collect();
        let replacements = [
            "",
            "{",
            "}",
            "[",
            "]",
            "%rd1",
            "%f1",
            "%r1",
            ".a2d",
            ".3d",
            "-1",
            "0f7FC00000",
            ".v2",
            ".b64",
            ".zero",
            "_",
            "tex.1d.v4.s32.f32",
            "suld.b.1d.b8.clamp",
        ];
        for _ in 0..200 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let at = (seed >> 33) as usize % tokens.len();
            let with = replacements[(seed >> 20) as usize % replacements.len()];
            let mutated: String = tokens
                .iter()
                .enumerate()
                .map(|(i, t)| if i == at { with } else { *t })
                .collect();
            let Ok(m) = Module::parse(&mutated) else {
                continue;
            };
            for k in m.kernels() {
                if k.unsupported().is_some() {
                    continue;
                }
                // Handles pick the hostile descriptors; pointers point at the small buffer.
                let mut params = vec![0u8; k.param_bytes()];
                for (i, p) in k.params().iter().enumerate() {
                    let v: u64 = if p.size == 8 {
                        if i == 0 || i == 1 && k.name().starts_with("surf") {
                            seed >> (i * 7) & 0xff
                        } else {
                            buf
                        }
                    } else {
                        (seed >> (i * 5)) & 0x1f
                    };
                    params[p.offset..p.offset + p.size.min(8)]
                        .copy_from_slice(&v.to_le_bytes()[..p.size.min(8)]);
                }
                let cfg = LaunchConfig {
                    grid: [1, 2, 1],
                    block: [4, 4, 2],
                    dynamic_shared_bytes: 0,
                };
                let opts = LaunchOptions {
                    textures: Some(&resolver),
                    max_thread_instructions: Some(1 << 20),
                    ..LaunchOptions::default()
                };
                let _ = gleam_ptx::launch_with(
                    &m,
                    k.name(),
                    &cfg,
                    &params,
                    &HashMap::new(),
                    &mem,
                    &opts,
                );
                launched += 1;
            }
        }
    }
    assert!(launched > 100, "{launched} launches");
}
