//! Textures and surfaces: the descriptors a caller resolves object handles to ([`TextureResolver`]), and the
//! sampling rules of `tex`, `tld4`, `suld.b` and `sust.b`, as pure functions over [`GlobalMemory`].
//!
//! The exact semantics are documented on [`TextureResolver`].

use crate::{GlobalMemory, MemoryFault};

/// The element type of one texel channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelFormat {
    U8,
    U16,
    U32,
    S8,
    S16,
    S32,
    F16,
    F32,
}

impl ChannelFormat {
    pub fn size(self) -> usize {
        match self {
            ChannelFormat::U8 | ChannelFormat::S8 => 1,
            ChannelFormat::U16 | ChannelFormat::S16 | ChannelFormat::F16 => 2,
            ChannelFormat::U32 | ChannelFormat::S32 | ChannelFormat::F32 => 4,
        }
    }

    fn is_float(self) -> bool {
        matches!(self, ChannelFormat::F16 | ChannelFormat::F32)
    }

    fn signed(self) -> bool {
        matches!(
            self,
            ChannelFormat::S8 | ChannelFormat::S16 | ChannelFormat::S32
        )
    }

    /// The integer that reads as 1.0 in the normalized read mode (8- and 16-bit formats).
    fn norm_max(self) -> u32 {
        match self {
            ChannelFormat::U8 => 255,
            ChannelFormat::S8 => 127,
            ChannelFormat::U16 => 65535,
            _ => 32767,
        }
    }

    /// Whether the default (non-integer) read mode turns it into a normalized float.
    fn promotes(self) -> bool {
        matches!(
            self,
            ChannelFormat::U8 | ChannelFormat::U16 | ChannelFormat::S8 | ChannelFormat::S16
        )
    }
}

/// What memory a texture or surface reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResourceKind {
    /// A 1D buffer in global memory, read by `tex1Dfetch` (integer coordinates) only.
    Linear,
    /// A 2D image in global memory with a row pitch.
    Pitch2D,
    /// A CUDA array in the layout [`Resource::array`] defines.
    Array,
    /// A mipmapped array: refused when sampled.
    MipmappedArray,
}

/// The memory behind a texture or surface object. Texel `(x, y, z)` of layer `l` starts at
/// `base + l * layer_pitch() + z * slice_pitch + y * row_pitch + x * elem_bytes()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resource {
    pub kind: ResourceKind,
    /// Device address of texel (0, 0, 0) of layer 0.
    pub base: u64,
    pub format: ChannelFormat,
    /// 1, 2 or 4.
    pub channels: u8,
    /// Texels per row.
    pub width: u64,
    /// Rows (1 for 1D resources).
    pub height: u64,
    /// Slices (1 for 1D and 2D resources).
    pub depth: u64,
    /// Layers of a layered array, 0 when not layered.
    pub layers: u64,
    /// The dimensions the resource was declared with: 1 (linear memory, 1D arrays), 2 (pitch-2D images, 2D
    /// arrays) or 3. `txq`/`suq` answer a height of 1 beyond the first and a depth of 0 (the layer count
    /// when layered) beyond the second, as the hardware does.
    pub dims: u8,
    /// A cubemap array: refused when sampled.
    pub cubemap: bool,
    /// Bytes from one row to the next.
    pub row_pitch: u64,
    /// Bytes from one slice to the next.
    pub slice_pitch: u64,
}

impl Resource {
    /// A linear buffer of `bytes` bytes (`tex1Dfetch`); partial texels at the end are not addressable.
    pub fn linear(base: u64, format: ChannelFormat, channels: u8, bytes: u64) -> Resource {
        let elem = format.size() as u64 * u64::from(channels);
        Resource {
            kind: ResourceKind::Linear,
            base,
            format,
            channels,
            width: bytes / elem.max(1),
            height: 1,
            depth: 1,
            layers: 0,
            dims: 1,
            cubemap: false,
            row_pitch: bytes,
            slice_pitch: bytes,
        }
    }

    /// A pitched 2D image.
    pub fn pitch2d(
        base: u64,
        format: ChannelFormat,
        channels: u8,
        width: u64,
        height: u64,
        row_pitch: u64,
    ) -> Resource {
        Resource {
            kind: ResourceKind::Pitch2D,
            base,
            format,
            channels,
            width,
            height,
            depth: 1,
            layers: 0,
            dims: 2,
            cubemap: false,
            row_pitch,
            slice_pitch: row_pitch.saturating_mul(height),
        }
    }

    /// A CUDA array laid out densely, row-major: texels of a row are adjacent (`elem_bytes()` each), rows of
    /// a slice follow each other (`row_pitch = width * elem_bytes()`), then slices (`slice_pitch = height *
    /// row_pitch`), then layers (`depth * slice_pitch` each). `width`, `height`, `depth` of 0 count as 1;
    /// `layers` is 0 for an array that is not layered. This is the layout the owner of the array's storage
    /// (the emu backend) must use. The declared dimensions (`dims`) are 1 with a `height` of 0, 2 with a
    /// `depth` of 0, else 3; a layered array has 1 or 2 whatever its `depth` (CUDA has no layered 3D arrays,
    /// and a caller may give a layered array's single slice as a depth of 1).
    pub fn array(
        base: u64,
        format: ChannelFormat,
        channels: u8,
        [width, height, depth]: [u64; 3],
        layers: u64,
    ) -> Resource {
        let elem = format.size() as u64 * u64::from(channels);
        let dims = if height == 0 {
            1
        } else if depth == 0 || layers > 0 {
            2
        } else {
            3
        };
        let (width, height, depth) = (width.max(1), height.max(1), depth.max(1));
        let row_pitch = width.saturating_mul(elem);
        Resource {
            kind: ResourceKind::Array,
            base,
            format,
            channels,
            width,
            height,
            depth,
            layers,
            dims,
            cubemap: false,
            row_pitch,
            slice_pitch: row_pitch.saturating_mul(height),
        }
    }

    /// Bytes of one texel.
    pub fn elem_bytes(&self) -> u64 {
        self.format.size() as u64 * u64::from(self.channels)
    }

    /// Bytes from one layer to the next.
    pub fn layer_pitch(&self) -> u64 {
        self.slice_pitch.saturating_mul(self.depth.max(1))
    }

    /// Bytes from `base` to the end of the last texel (what the owner must have allocated), `None` on
    /// overflow.
    pub fn span_bytes(&self) -> Option<u64> {
        let last = |n: u64| n.max(1) - 1;
        last(self.layers)
            .checked_mul(self.layer_pitch())?
            .checked_add(last(self.depth).checked_mul(self.slice_pitch)?)?
            .checked_add(last(self.height).checked_mul(self.row_pitch)?)?
            .checked_add(self.width.max(1).checked_mul(self.elem_bytes())?)
    }
}

/// How a texture coordinate outside `[0, n)` is brought back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressMode {
    Wrap,
    Clamp,
    Mirror,
    Border,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterMode {
    Point,
    Linear,
}

/// A texture object: a resource and how to sample it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TextureDesc {
    pub resource: Resource,
    /// Per dimension: x, y, z.
    pub address: [AddressMode; 3],
    pub filter: FilterMode,
    pub normalized_coords: bool,
    /// Integer formats read as integers (CUDA's `cudaReadModeElementType`, `CU_TRSF_READ_AS_INTEGER`).
    pub read_as_integer: bool,
    /// sRGB to linear conversion: refused when sampled.
    pub srgb: bool,
    /// The colour of taps outside the texture in border mode (RGBA).
    pub border: [f32; 4],
}

impl TextureDesc {
    /// Point sampling, clamped, unnormalized, integer formats read as normalized floats.
    pub fn new(resource: Resource) -> TextureDesc {
        TextureDesc {
            resource,
            address: [AddressMode::Clamp; 3],
            filter: FilterMode::Point,
            normalized_coords: false,
            read_as_integer: false,
            srgb: false,
            border: [0.0; 4],
        }
    }

    fn reads_float(&self) -> bool {
        let f = self.resource.format;
        f.is_float() || (f.promotes() && !self.read_as_integer)
    }
}

/// A surface object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SurfaceDesc {
    pub resource: Resource,
}

/// Resolves the texture and surface object handles a kernel receives (as `.u64` parameters) to their
/// descriptors. [`crate::launch_with`] asks once per distinct handle per worker thread; a handle it does not
/// know (`None`) fails the launch with [`crate::ExecError::InvalidHandle`].
///
/// Semantics: CUDA's documented rules, with what they leave open settled by recordings on an H200 (driver
/// 580; `conformance/cases/tex*`, `tld4*`, `surf*`), which the interpreter reproduces bit for bit:
/// - Texel coordinates: unnormalized coordinates address texel `i` over `[i, i + 1)`; normalized ones are
///   multiplied by the dimension's size first (in f32). Point filtering takes texel `floor(x)`.
/// - A 1D array is sampled as a 2D image one texel high at `y = 0` (its `y` address mode applies): linear
///   filtering blends in the row above at weight 1/2, which shows as half the border colour in border mode.
/// - Linear filtering: `xb = x - 0.5` in fixed point with 8 fractional bits (nearest, halves up) gives the
///   lower texel `floor(xb)` and the upper texel's weight `a` in 1/256 steps. In clamp mode a coordinate
///   outside the texel centres is first moved onto the edge centre (weight 0). The corner weights, in 1/256
///   steps summing to 1, split the whole weight along z by `c` (exact), then along x by `a`, then along y
///   by `b`, each split rounded to 1/256 (halves up): the upper part is rounded, except along y in the lower
///   x column, where the lower part is (so a 2D footprint has `round(a·b)` and `round((1-a)(1-b))` on its
///   diagonal). Taps of weight 0 are not read.
/// - Blending is exact and rounded once, halves away from zero: to f32 for f32 texels, to f16 for f16 texels.
///   8- and 16-bit unsigned normalized texels blend in 16-bit fixed point (8-bit values widened to 16 bits by
///   repeating their byte, the sum rounded halves up to 16 bits) and read as that over 65535; signed 16-bit
///   ones likewise (the sum rounded halves up to a 16-bit integer, read as that over 32767). Signed 8-bit
///   texels also come out as a multiple of 1/32767, but not the nearest one to the exact blend: their rule is
///   not settled (see `filter_channel`).
/// - Address modes act on texel indices: clamp to `[0, n - 1]`; border gives the border colour for a tap
///   outside; wrap takes the index modulo `n`; mirror reflects with period `2n`. Wrap and mirror exist only
///   with normalized coordinates: with unnormalized ones they act as clamp, as on the hardware.
/// - Read modes: 8- and 16-bit integer formats read as normalized floats (`u/255`, `u/65535`,
///   `max(s/127, -1)`, `max(s/32767, -1)`) unless `read_as_integer`; 32-bit integers are never promoted;
///   f16 and f32 read as f32. Channels missing from the format read as 0, alpha included.
/// - The border colour acts as a texel of the texture's format: channels the format lacks are 0; unsigned
///   normalized formats truncate it to their steps (0.5 reads back as 127/255 from u8, 32767/65535 from
///   u16; 0.3 as 76/255), signed normalized ones round it to the nearest step (-0.3 and 0.7 read back as
///   -9830/32767 and 22937/32767 from s16); f16 rounds it toward zero (0.1 reads back as 0.0999755859375,
///   1e-5 as 167·2^-24, 70000 as 65504); integer reads take the low bits of its f32 bit pattern (3.7, that
///   is 0x406ccccd, reads back as 205 from u8; -2, 300 and 0.5 as 0). Not recorded, hence the interpreter's
///   choice: halves of signed steps round away from zero, signed integer reads sign-extend those bits,
///   32-bit integer reads take all of them.
/// - Integer coordinates (`.s32`): texel indices, point-sampled; on linear memory (`tex1Dfetch`) an index
///   outside the buffer reads zero.
/// - `tld4` returns one component of the four texels of the bilinear footprint, counter-clockwise from the
///   lower left: `(i0, j1), (i1, j1), (i1, j0), (i0, j0)`, no coordinate clamping.
/// - Surfaces (`suld.b`/`sust.b`): the x coordinate is a byte offset (a multiple of the access size), y and z
///   are rows and slices. Out of range: `.trap` faults, `.clamp` clamps each coordinate into the surface,
///   `.zero` loads zero and drops stores.
/// - Layered geometries (`a1d`, `a2d`): the first coordinate is the layer, clamped to the layers present.
/// - `txq`/`suq` answer `width`, `height`, `depth` in texels and `array_size`: a 1D resource's height reads
///   1, a 2D one's depth 0, a layered one's depth its layer count (a layered 2D surface of 2 layers answers
///   a depth of 2; [`Resource::dims`]); other queries are refused.
///
/// Refused as [`crate::ExecError::Unsupported`] rather than answered wrongly: mipmapped resources and LOD
/// forms, cubemaps, sRGB, linear filtering of integer reads, float coordinates on linear memory, a result type
/// that does not match the texture's read mode, and formatted surface stores (`sust.p`).
pub trait TextureResolver: Sync {
    fn texture(&self, handle: u64) -> Option<TextureDesc>;
    fn surface(&self, handle: u64) -> Option<SurfaceDesc>;
}

/// Texture and surface geometries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Geom {
    D1,
    D2,
    D3,
    A1,
    A2,
}

impl Geom {
    pub fn parse(m: &str) -> Option<Geom> {
        Some(match m {
            "1d" => Geom::D1,
            "2d" => Geom::D2,
            "3d" => Geom::D3,
            "a1d" => Geom::A1,
            "a2d" => Geom::A2,
            _ => return None,
        })
    }

    /// Spatial dimensions.
    pub fn dims(self) -> usize {
        match self {
            Geom::D1 | Geom::A1 => 1,
            Geom::D2 | Geom::A2 => 2,
            Geom::D3 => 3,
        }
    }

    pub fn layered(self) -> bool {
        matches!(self, Geom::A1 | Geom::A2)
    }
}

/// The result type of `tex`/`tld4`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TexType {
    F32,
    S32,
    U32,
}

/// Out-of-range policy of `suld.b`/`sust.b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutOfRange {
    Trap,
    Clamp,
    Zero,
}

/// Why a texture or surface access failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TexError {
    Unsupported(String),
    /// A texel outside the memory behind the resource, or a `.trap` surface access out of range.
    Fault(MemoryFault),
    Misaligned {
        x: i64,
        len: usize,
    },
}

impl From<MemoryFault> for TexError {
    fn from(f: MemoryFault) -> TexError {
        TexError::Fault(f)
    }
}

type TexResult<T> = Result<T, TexError>;

fn unsupported<T>(why: impl Into<String>) -> TexResult<T> {
    Err(TexError::Unsupported(why.into()))
}

/// One texel's channels as stored, before any read-mode conversion. Channels the format lacks are 0,
/// alpha included (as the GPU returns them).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stored {
    /// 8-, 16- and 32-bit integer channels, sign-extended for the signed formats.
    Int([i64; 4]),
    /// f16 and f32 channels.
    Float([f32; 4]),
}

/// What `tex`/`tld4` return for one texel: floats, or integer bits (for integer reads).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Texel {
    F([f32; 4]),
    I([u32; 4]),
}

/// Reads texel `(x, y, z)` of `layer` (all in range).
fn stored(
    desc: &TextureDesc,
    mem: &dyn GlobalMemory,
    [x, y, z]: [u64; 3],
    layer: u64,
) -> TexResult<Stored> {
    let r = &desc.resource;
    let addr = texel_addr(r, x, y, z, layer)?;
    let elem = r.elem_bytes() as usize;
    let mut raw = [0u8; 16];
    mem.read(addr, &mut raw[..elem])?;
    let size = r.format.size();
    let channel = |c: usize| -> u32 {
        let b = &raw[c * size..c * size + size];
        match size {
            1 => u32::from(b[0]),
            2 => u32::from(u16::from_le_bytes([b[0], b[1]])),
            _ => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    };
    let present = usize::from(r.channels).min(4);
    use ChannelFormat as C;
    Ok(match r.format {
        C::F16 | C::F32 => Stored::Float(std::array::from_fn(|c| {
            if c >= present {
                return 0.0;
            }
            let bits = channel(c);
            if r.format == C::F16 {
                half::f16::from_bits(bits as u16).to_f32()
            } else {
                f32::from_bits(bits)
            }
        })),
        f => Stored::Int(std::array::from_fn(|c| {
            if c >= present {
                return 0;
            }
            let bits = channel(c);
            match f {
                C::S8 => i64::from(bits as u8 as i8),
                C::S16 => i64::from(bits as u16 as i16),
                C::S32 => i64::from(bits as i32),
                _ => i64::from(bits),
            }
        })),
    })
}

/// The border colour in the texture's own format, as if it were a stored texel (recorded on the H200):
/// - unsigned normalized formats truncate it to their steps (0.5 reads back as 127/255 from u8, 32767/65535
///   from u16), signed normalized ones round it to the nearest step (0.7 reads back as 22937/32767 from s16);
/// - f16 rounds it toward zero (0.1 reads back as 0.0999755859375, 70000 as 65504);
/// - integer reads take the low bits of its f32 bit pattern (3.7, 0x406ccccd, reads back as 205 = 0xcd from
///   u8), sign-extended for the signed formats;
/// - channels the format lacks are 0.
fn border_stored(desc: &TextureDesc) -> Stored {
    let present = |c: usize| c < usize::from(desc.resource.channels);
    let b = desc.border;
    use ChannelFormat as C;
    let f = desc.resource.format;
    if f.is_float() {
        return Stored::Float(std::array::from_fn(|c| match (present(c), f) {
            (false, _) => 0.0,
            (true, C::F16) => f16_toward_zero(b[c]),
            (true, _) => b[c],
        }));
    }
    Stored::Int(std::array::from_fn(|c| {
        if !present(c) {
            return 0;
        }
        if desc.read_as_integer || !f.promotes() {
            let bits = b[c].to_bits();
            return match f {
                C::U8 => i64::from(bits as u8),
                C::S8 => i64::from(bits as u8 as i8),
                C::U16 => i64::from(bits as u16),
                C::S16 => i64::from(bits as u16 as i16),
                C::S32 => i64::from(bits as i32),
                _ => i64::from(bits),
            };
        }
        let v = f64::from(b[c]);
        let max = f64::from(f.norm_max());
        if f.signed() {
            let v = if v.is_nan() { 0.0 } else { v.clamp(-1.0, 1.0) };
            (v * max).round() as i64
        } else {
            let v = if v.is_nan() { 0.0 } else { v.clamp(0.0, 1.0) };
            (v * max).trunc() as i64
        }
    }))
}

/// `v` rounded toward zero to f16 (finite values beyond its range become its largest finite value).
fn f16_toward_zero(v: f32) -> f32 {
    let h = half::f16::from_f32(v);
    if h.to_f32().abs() > v.abs() {
        // Rounded away from zero: the next value toward zero has the bit pattern one below.
        half::f16::from_bits(h.to_bits() - 1).to_f32()
    } else {
        h.to_f32()
    }
}

/// A stored texel as the read mode returns it, unfiltered.
fn point_value(desc: &TextureDesc, s: Stored) -> Texel {
    match s {
        Stored::Float(f) => Texel::F(f),
        Stored::Int(i) if desc.reads_float() => {
            let f = desc.resource.format;
            let max = i64::from(f.norm_max());
            // The most negative signed value reads as -1, like its successor.
            Texel::F(i.map(|v| v.max(-max) as f32 / max as f32))
        }
        Stored::Int(i) => Texel::I(i.map(|v| v as i32 as u32)),
    }
}

/// Reads the tap at texel indices `idx` (the address modes applied; `None` in a dimension is a border tap).
fn tap(
    desc: &TextureDesc,
    mem: &dyn GlobalMemory,
    idx: [Option<i64>; 3],
    layer: u64,
) -> TexResult<Stored> {
    let mut at = [0u64; 3];
    for d in 0..3 {
        match idx[d] {
            Some(i) => at[d] = i as u64,
            None => return Ok(border_stored(desc)),
        }
    }
    stored(desc, mem, at, layer)
}

fn texel_addr(r: &Resource, x: u64, y: u64, z: u64, layer: u64) -> TexResult<u64> {
    let off = (|| {
        layer
            .checked_mul(r.layer_pitch())?
            .checked_add(z.checked_mul(r.slice_pitch)?)?
            .checked_add(y.checked_mul(r.row_pitch)?)?
            .checked_add(x.checked_mul(r.elem_bytes())?)?
            .checked_add(r.base)
    })();
    off.ok_or(TexError::Fault(MemoryFault {
        addr: r.base,
        len: r.elem_bytes() as usize,
    }))
}

/// Sizes beyond this are treated as this (no GPU has a texture near it), so index arithmetic never
/// overflows whatever a descriptor claims.
const MAX_EXTENT: u64 = 1 << 48;

/// A size as a signed extent in `[1, MAX_EXTENT]`.
fn extent(v: u64) -> i64 {
    v.clamp(1, MAX_EXTENT) as i64
}

/// Texture size along each dimension (at least 1).
fn sizes(r: &Resource) -> [i64; 3] {
    [extent(r.width), extent(r.height), extent(r.depth)]
}

/// The mode an address mode acts as: wrap and mirror exist only with normalized coordinates; with
/// unnormalized ones they clamp, as on the hardware.
fn effective_mode(mode: AddressMode, normalized: bool) -> AddressMode {
    match mode {
        AddressMode::Wrap | AddressMode::Mirror if !normalized => AddressMode::Clamp,
        m => m,
    }
}

/// Maps texel index `i` of a dimension of `n` texels into range, or `None` for a border tap.
fn address(i: i64, n: i64, mode: AddressMode, normalized: bool) -> Option<i64> {
    match effective_mode(mode, normalized) {
        AddressMode::Clamp => Some(i.clamp(0, n - 1)),
        AddressMode::Border => (0..n).contains(&i).then_some(i),
        AddressMode::Wrap => Some(i.rem_euclid(n)),
        AddressMode::Mirror => {
            let m = i.rem_euclid(2 * n);
            Some(if m >= n { 2 * n - 1 - m } else { m })
        }
    }
}

/// A float coordinate scaled to texels (normalized coordinates times the size, in f32).
fn texel_coord(c: f32, n: i64, normalized: bool) -> f32 {
    let c = if c.is_nan() { 0.0 } else { c };
    if normalized { c * n as f32 } else { c }
}

/// `xb = x - 0.5` in fixed point with 8 fractional bits, rounded to nearest (halves up): the lower texel
/// and the weight of the upper one in 1/256 steps.
fn linear_split(xb: f64) -> (i64, u32) {
    let fixed = (xb * 256.0 + 0.5).floor() as i64;
    (fixed >> 8, (fixed & 255) as u32)
}

/// The weights, in 1/256 steps summing to 256, of the corners of a linear-filter footprint whose upper
/// texels have the weights `frac` (one per dimension). Corner `k` has bit `d` set for the upper texel of
/// dimension `d`.
///
/// The hardware splits the whole weight dimension by dimension, z first, then x, then y, rounding each
/// split to 1/256 (halves up): the upper part `round(w * f / 256)` when splitting along z and x and in the
/// upper x column along y, the lower part `round(w * (256 - f) / 256)` in the lower x column along y (the
/// rest goes to the other part). So a 2D footprint gets `round(a*b)` and `round((1-a)*(1-b))` on its
/// diagonal corners; the 1D weights are the fraction itself.
fn linear_weights(frac: &[u32]) -> ([u32; 8], usize) {
    /// Splits `w` into (lower, upper) by the upper fraction `f`, rounding the part `round_upper` says.
    fn split(w: u32, f: u32, round_upper: bool) -> (u32, u32) {
        if round_upper {
            let hi = (w * f + 128) >> 8;
            (w - hi, hi)
        } else {
            let lo = (w * (256 - f) + 128) >> 8;
            (lo, w - lo)
        }
    }
    let mut w = [0u32; 8];
    match *frac {
        [a] => {
            w[0] = 256 - a;
            w[1] = a;
            (w, 2)
        }
        [a, b] | [a, b, _] => {
            let slices = match frac.get(2) {
                Some(&c) => split(256, c, true),
                None => (256, 0),
            };
            for (z, q) in [slices.0, slices.1].into_iter().enumerate() {
                let (x0, x1) = split(q, a, true);
                for (x, col) in [x0, x1].into_iter().enumerate() {
                    let (y0, y1) = split(col, b, x == 1);
                    w[z << 2 | x] = y0;
                    w[z << 2 | 2 | x] = y1;
                }
            }
            (w, if frac.len() == 3 { 8 } else { 4 })
        }
        _ => (w, 0),
    }
}

/// The coordinates of a `tex`/`tld4` lane: the layer and up to three spatial coordinates, as floats or
/// integers.
#[derive(Debug, Clone, Copy)]
pub struct Coords {
    pub layer: u32,
    /// Raw bits: f32 or s32 per `int`.
    pub c: [u32; 3],
    pub int: bool,
}

/// Checks what sampling `desc` needs and returns the layer to read.
fn prepare(desc: &TextureDesc, geom: Geom, at: &Coords, ty: TexType) -> TexResult<u64> {
    let r = &desc.resource;
    match r.kind {
        ResourceKind::MipmappedArray => return unsupported("mipmapped textures"),
        ResourceKind::Linear if !(geom == Geom::D1 && at.int) => {
            return unsupported("texture on linear memory read with float coordinates");
        }
        _ => {}
    }
    if r.cubemap {
        return unsupported("cubemap textures");
    }
    if desc.srgb {
        return unsupported("sRGB textures");
    }
    if !matches!(r.channels, 1 | 2 | 4) {
        return unsupported(format!("textures of {} channels", r.channels));
    }
    match (desc.reads_float(), ty) {
        (true, TexType::F32) | (false, TexType::S32 | TexType::U32) => {}
        (true, _) => return unsupported("integer result from a texture read as floats"),
        (false, _) => return unsupported("float result from a texture read as integers"),
    }
    if geom.layered() != (r.layers > 0) {
        return unsupported(if geom.layered() {
            "layered fetch from a texture that is not layered"
        } else {
            "plain fetch from a layered texture"
        });
    }
    Ok(if geom.layered() {
        u64::from(at.layer).min(r.layers - 1)
    } else {
        0
    })
}

/// `tex`: one sample, as the four result registers' bits.
pub fn sample(
    desc: &TextureDesc,
    geom: Geom,
    at: &Coords,
    ty: TexType,
    mem: &dyn GlobalMemory,
) -> TexResult<[u32; 4]> {
    let layer = prepare(desc, geom, at, ty)?;
    let r = &desc.resource;
    let n = sizes(r);
    if r.kind == ResourceKind::Linear {
        // tex1Dfetch: no address mode, zero outside the buffer.
        let i = i64::from(at.c[0] as i32);
        if !(0..n[0]).contains(&i) {
            return Ok([0; 4]);
        }
        return Ok(bits(point_value(
            desc,
            stored(desc, mem, [i as u64, 0, 0], layer)?,
        )));
    }
    // Per-dimension texel index through the address mode (unused dimensions at 0).
    let index = |d: usize, i: i64| address(i, n[d], desc.address[d], desc.normalized_coords);
    if at.int {
        let idx = std::array::from_fn(|d| {
            let i = if d < geom.dims() {
                i64::from(at.c[d] as i32)
            } else {
                0
            };
            index(d, i)
        });
        return Ok(bits(point_value(desc, tap(desc, mem, idx, layer)?)));
    }
    // A 1D array is sampled as a 2D image one texel high at y = 0: the linear filter blends in the row
    // above it, which only shows in border mode (half the border colour).
    let dims = geom.dims().max(2);
    let x: [f32; 3] = std::array::from_fn(|d| {
        if d < geom.dims() {
            texel_coord(f32::from_bits(at.c[d]), n[d], desc.normalized_coords)
        } else {
            0.0
        }
    });
    if desc.filter == FilterMode::Point {
        let idx = std::array::from_fn(|d| index(d, if d < dims { x[d].floor() as i64 } else { 0 }));
        return Ok(bits(point_value(desc, tap(desc, mem, idx, layer)?)));
    }
    if !desc.reads_float() {
        return unsupported("linear filtering of a texture read as integers");
    }
    let mut base = [0i64; 3];
    let mut frac = [0u32; 3];
    for d in 0..dims {
        let mut xb = f64::from(x[d]) - 0.5;
        if effective_mode(desc.address[d], desc.normalized_coords) == AddressMode::Clamp {
            // Clamped outside the texel centres, both taps are the edge texel: the hardware then weighs
            // them as if the coordinate sat on that centre (this shows in the rounding of 3D weights).
            xb = xb.clamp(0.0, (n[d] - 1) as f64);
        }
        (base[d], frac[d]) = linear_split(xb);
    }
    let (weights, corners) = linear_weights(&frac[..dims]);
    let mut taps = [(0u32, Stored::Int([0; 4])); 8];
    for (k, t) in taps.iter_mut().enumerate().take(corners) {
        let idx = std::array::from_fn(|d| {
            if d < dims {
                index(d, base[d].saturating_add((k >> d & 1) as i64))
            } else {
                index(d, 0)
            }
        });
        // A tap of weight 0 is not read (nor is its NaN or infinity blended).
        if weights[k] != 0 {
            *t = (weights[k], tap(desc, mem, idx, layer)?);
        }
    }
    let taps = &taps[..corners];
    Ok(std::array::from_fn(|c| {
        filter_channel(r.format, taps, c).to_bits()
    }))
}

/// Channel `c` of the taps blended with their weights (1/256 steps summing to 256).
///
/// The hardware blends exactly and rounds once, halves away from zero: f32 texels to f32, f16 texels to
/// f16; 8- and 16-bit unsigned normalized texels are blended as 16-bit fixed point (8-bit values widened
/// to 16 bits by repeating their byte) and the 16-bit result converted to a float; signed 16-bit ones
/// likewise (over 32767). Signed 8-bit ones are taken to the nearest multiple of 1/32767 of the exact
/// blend: an approximation, the recording (`tex2d_s8_norm_linear`) gives a multiple of 1/32767 that is not
/// always the nearest.
fn filter_channel(format: ChannelFormat, taps: &[(u32, Stored)], c: usize) -> f32 {
    use ChannelFormat as C;
    let ints = || {
        taps.iter().map(move |&(w, s)| match s {
            Stored::Int(i) => (i64::from(w), i[c]),
            Stored::Float(_) => (0, 0),
        })
    };
    match format {
        C::F32 | C::F16 => {
            let floats = taps.iter().map(|&(w, s)| match s {
                Stored::Float(f) => (w, f[c]),
                Stored::Int(_) => (0, 0.0),
            });
            let (bits, min_exp) = if format == C::F16 {
                (11, -24)
            } else {
                (24, -149)
            };
            round_weighted_sum(floats, bits, min_exp)
        }
        C::U8 | C::U16 => {
            let widen = if format == C::U8 { 257 } else { 1 };
            let sum: i64 = ints().map(|(w, v)| w * v * widen).sum();
            ((sum + 128) >> 8) as f32 / 65535.0
        }
        C::S16 => {
            // 16-bit fixed point like the unsigned formats: the sum rounded halves up to 16 bits.
            let sum: i64 = ints().map(|(w, v)| w * v.max(-32767)).sum();
            ((sum + 128) >> 8) as f32 / 32767.0
        }
        C::S8 => {
            // Not settled: the hardware gives a multiple of 1/32767 within one step of the exact blend;
            // this takes the nearest (halves up), which the recording matches in 95% of its samples.
            let sum: i64 = ints().map(|(w, v)| w * v.max(-127)).sum();
            let q = (2 * sum * 32767 + 256 * 127).div_euclid(2 * 256 * 127);
            q as f32 / 32767.0
        }
        C::U32 | C::S32 => 0.0,
    }
}

/// `Σ w·v / 256` for taps of weight `w` (at most 256 in all) and finite float value `v`, computed exactly
/// and rounded once to a float of `bits` significant bits whose smallest step is 2^`min_exp` (f32: 24 and
/// -149; f16: 11 and -24), halves away from zero. A NaN or infinite tap gives what float arithmetic does.
fn round_weighted_sum(
    terms: impl Iterator<Item = (u32, f32)> + Clone,
    bits: u32,
    min_exp: i32,
) -> f32 {
    if terms.clone().any(|(w, v)| w != 0 && !v.is_finite()) {
        return terms
            .filter(|&(w, _)| w != 0)
            .map(|(w, v)| f64::from(w) * f64::from(v))
            .sum::<f64>() as f32;
    }
    let mut acc = Wide::default();
    for (w, v) in terms {
        let b = v.to_bits();
        let (exp, frac) = ((b >> 23) & 0xff, u64::from(b & 0x7f_ffff));
        // v = m · 2^e2 exactly.
        let (m, e2) = if exp == 0 {
            (frac, -149)
        } else {
            (frac | 1 << 23, exp as i32 - 150)
        };
        // Bit 0 of the accumulator weighs 2^WIDE_UNIT_EXP, and w·m·2^e2 / 256 has its last bit at 2^(e2 - 8).
        let shift = (e2 - 8 - WIDE_UNIT_EXP) as u32;
        acc.add(u64::from(w) * m, shift, b >> 31 == 1);
    }
    let negative = acc.is_negative();
    if negative {
        acc.negate();
    }
    let Some(top) = acc.highest_bit() else {
        return 0.0;
    };
    let min_pos = (min_exp - WIDE_UNIT_EXP) as u32;
    let step = (top + 1).saturating_sub(bits).max(min_pos);
    let mut mant = acc.bits_from(step);
    if step > 0 && acc.bit(step - 1) {
        mant += 1;
    }
    let magnitude = mant as f64 * pow2(step as i32 + WIDE_UNIT_EXP);
    (if negative { -magnitude } else { magnitude }) as f32
}

/// 2^e for e in f64's normal range.
fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// The weight of bit 0 of [`Wide`]: the last bit of a subnormal f32 divided by 256.
const WIDE_UNIT_EXP: i32 = -157;

/// A 320-bit two's complement integer, enough for the exact sum of a few f32 values times 9-bit weights:
/// the largest such product has its top bit at 2^(128 + 9), i.e. bit 294.
#[derive(Debug, Default, Clone, Copy)]
struct Wide([u64; 5]);

impl Wide {
    /// Adds (or subtracts) `v << shift`, `v` below 2^40 and `shift` at most 260.
    fn add(&mut self, v: u64, shift: u32, subtract: bool) {
        let mut x = [0u64; 5];
        let (limb, bit) = ((shift / 64) as usize, shift % 64);
        x[limb] = v << bit;
        if bit > 0 && limb + 1 < x.len() {
            x[limb + 1] = v >> (64 - bit);
        }
        if subtract {
            let mut borrow = false;
            for (a, b) in self.0.iter_mut().zip(x) {
                let (d, o1) = a.overflowing_sub(b);
                let (d, o2) = d.overflowing_sub(u64::from(borrow));
                *a = d;
                borrow = o1 || o2;
            }
        } else {
            let mut carry = false;
            for (a, b) in self.0.iter_mut().zip(x) {
                let (s, o1) = a.overflowing_add(b);
                let (s, o2) = s.overflowing_add(u64::from(carry));
                *a = s;
                carry = o1 || o2;
            }
        }
    }

    fn is_negative(&self) -> bool {
        self.0[4] >> 63 == 1
    }

    fn negate(&mut self) {
        let mut carry = true;
        for a in &mut self.0 {
            let (s, o) = (!*a).overflowing_add(u64::from(carry));
            *a = s;
            carry = o;
        }
    }

    fn highest_bit(&self) -> Option<u32> {
        (0..5)
            .rev()
            .find(|&i| self.0[i] != 0)
            .map(|i| i as u32 * 64 + 63 - self.0[i].leading_zeros())
    }

    fn bit(&self, pos: u32) -> bool {
        self.0[(pos / 64) as usize] >> (pos % 64) & 1 == 1
    }

    /// The 64 bits from bit `pos` up.
    fn bits_from(&self, pos: u32) -> u64 {
        let (limb, bit) = ((pos / 64) as usize, pos % 64);
        let lo = self.0.get(limb).map_or(0, |v| v >> bit);
        let hi = match (bit, self.0.get(limb + 1)) {
            (0, _) | (_, None) => 0,
            (b, Some(v)) => v << (64 - b),
        };
        lo | hi
    }
}

/// `tld4`: component `comp` of the four texels of the bilinear footprint.
pub fn gather(
    desc: &TextureDesc,
    geom: Geom,
    comp: usize,
    at: &Coords,
    ty: TexType,
    mem: &dyn GlobalMemory,
) -> TexResult<[u32; 4]> {
    if geom.dims() != 2 || at.int {
        return unsupported("tld4 other than 2D with float coordinates");
    }
    let layer = prepare(desc, geom, at, ty)?;
    let r = &desc.resource;
    let n = sizes(r);
    let mut base = [0i64; 2];
    for d in 0..2 {
        let x = texel_coord(f32::from_bits(at.c[d]), n[d], desc.normalized_coords);
        base[d] = linear_split(f64::from(x) - 0.5).0;
    }
    let corner = |dx: i64, dy: i64| -> TexResult<u32> {
        let idx = [
            address(
                base[0].saturating_add(dx),
                n[0],
                desc.address[0],
                desc.normalized_coords,
            ),
            address(
                base[1].saturating_add(dy),
                n[1],
                desc.address[1],
                desc.normalized_coords,
            ),
            Some(0),
        ];
        Ok(bits(point_value(desc, tap(desc, mem, idx, layer)?))[comp])
    };
    Ok([corner(0, 1)?, corner(1, 1)?, corner(1, 0)?, corner(0, 0)?])
}

fn bits(t: Texel) -> [u32; 4] {
    match t {
        Texel::F(f) => f.map(f32::to_bits),
        Texel::I(i) => i,
    }
}

/// A surface access: the surface, its geometry and coordinates (`.s32`: x in bytes, then rows, slices;
/// the layer first for layered geometries), and the bytes it moves.
pub struct SurfaceAccess<'a> {
    pub desc: &'a SurfaceDesc,
    pub geom: Geom,
    pub coords: [i32; 4],
    pub len: usize,
    pub clamp: OutOfRange,
}

impl SurfaceAccess<'_> {
    /// The address of the access, `None` when it falls outside in `.zero` mode.
    fn locate(&self) -> TexResult<Option<u64>> {
        let r = &self.desc.resource;
        if r.kind == ResourceKind::MipmappedArray || r.cubemap {
            return unsupported("surfaces on mipmapped or cubemap arrays");
        }
        let layered = self.geom.layered();
        if layered != (r.layers > 0) {
            return unsupported("surface geometry does not match the surface's layering");
        }
        let (layer, xyz) = if layered {
            (i64::from(self.coords[0]), &self.coords[1..])
        } else {
            (0, &self.coords[..])
        };
        let dims = self.geom.dims();
        let len = self.len as i64;
        let x = i64::from(xyz[0]);
        if x.rem_euclid(len) != 0 {
            return Err(TexError::Misaligned { x, len: self.len });
        }
        let width_bytes = extent(r.width) * r.elem_bytes() as i64;
        // Valid ranges: x bytes, then rows, slices, layers.
        let hi = [width_bytes - len, extent(r.height) - 1, extent(r.depth) - 1];
        let mut at = [0i64; 3];
        let mut outside = false;
        for d in 0..dims {
            at[d] = i64::from(xyz[d]);
            outside |= at[d] < 0 || at[d] > hi[d];
        }
        let top_layer = extent(r.layers) - 1;
        let mut layer = layer;
        outside |= layer < 0 || layer > top_layer;
        if outside {
            match self.clamp {
                OutOfRange::Zero => return Ok(None),
                OutOfRange::Trap => {
                    return Err(TexError::Fault(MemoryFault {
                        addr: r.base,
                        len: self.len,
                    }));
                }
                OutOfRange::Clamp => {
                    if hi[0] < 0 {
                        // Narrower than one access: nothing to clamp into.
                        return Err(TexError::Fault(MemoryFault {
                            addr: r.base,
                            len: self.len,
                        }));
                    }
                    for d in 0..dims {
                        at[d] = at[d].clamp(0, hi[d]);
                    }
                    // Keep the byte offset a whole number of accesses.
                    at[0] -= at[0] % len;
                    layer = layer.clamp(0, top_layer);
                }
            }
        }
        let off = (|| {
            (layer as u64)
                .checked_mul(r.layer_pitch())?
                .checked_add((at[2] as u64).checked_mul(r.slice_pitch)?)?
                .checked_add((at[1] as u64).checked_mul(r.row_pitch)?)?
                .checked_add(at[0] as u64)?
                .checked_add(r.base)
        })();
        off.map(Some).ok_or(TexError::Fault(MemoryFault {
            addr: r.base,
            len: self.len,
        }))
    }

    /// `suld.b`: the bytes at the coordinates (zeros outside in `.zero` mode).
    pub fn load(&self, mem: &dyn GlobalMemory, out: &mut [u8]) -> TexResult<()> {
        match self.locate()? {
            Some(addr) => mem.read(addr, out)?,
            None => out.fill(0),
        }
        Ok(())
    }

    /// `sust.b`: writes the bytes at the coordinates (dropped outside in `.zero` mode).
    pub fn store(&self, mem: &dyn GlobalMemory, data: &[u8]) -> TexResult<()> {
        if let Some(addr) = self.locate()? {
            mem.write(addr, data)?;
        }
        Ok(())
    }
}

/// `txq`/`suq` queries the interpreter answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Query {
    Width,
    Height,
    Depth,
    ArraySize,
}

impl Query {
    pub fn parse(m: &str) -> Option<Query> {
        Some(match m {
            "width" => Query::Width,
            "height" => Query::Height,
            "depth" => Query::Depth,
            "array_size" => Query::ArraySize,
            _ => return None,
        })
    }

    /// The answer for resource `r`: extents beyond the dimensions it was declared with are 0 (a 2D
    /// array's depth, recorded on the GPU), as are the layers of an array that is not layered.
    pub fn answer(self, r: &Resource) -> u32 {
        let v = match self {
            Query::Width => r.width,
            // A 1D resource is one texel high; a layered one answers its layer count as its depth.
            Query::Height if r.dims < 2 => 1,
            Query::Height => r.height,
            Query::Depth if r.layers > 0 => r.layers,
            Query::Depth if r.dims < 3 => 0,
            Query::Depth => r.depth,
            Query::ArraySize => r.layers,
        };
        u32::try_from(v).unwrap_or(u32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FlatMemory;

    fn f32_tex(mem: &mut FlatMemory, w: u64, h: u64, vals: &[f32]) -> Resource {
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let a = mem.alloc(bytes.len()).unwrap();
        mem.write(a, &bytes).unwrap();
        Resource::array(a, ChannelFormat::F32, 1, [w, h, 1], 0)
    }

    fn at(x: f32, y: f32) -> Coords {
        Coords {
            layer: 0,
            c: [x.to_bits(), y.to_bits(), 0],
            int: false,
        }
    }

    fn s(d: &TextureDesc, g: Geom, c: Coords, mem: &FlatMemory) -> f32 {
        f32::from_bits(sample(d, g, &c, TexType::F32, mem).unwrap()[0])
    }

    #[test]
    fn address_modes() {
        use AddressMode::*;
        assert_eq!(address(-1, 4, Clamp, true), Some(0));
        assert_eq!(address(5, 4, Clamp, true), Some(3));
        assert_eq!(address(-1, 4, Border, true), None);
        assert_eq!(address(-1, 4, Wrap, true), Some(3));
        assert_eq!(address(9, 4, Wrap, true), Some(1));
        // Mirror: 0 1 2 3 | 3 2 1 0 | 0 1 ...
        let m: Vec<i64> = (-2..10)
            .map(|i| address(i, 4, Mirror, true).unwrap())
            .collect();
        assert_eq!(m, [1, 0, 0, 1, 2, 3, 3, 2, 1, 0, 0, 1]);
        // Unnormalized coordinates clamp instead.
        assert_eq!(address(9, 4, Wrap, false), Some(3));
    }

    #[test]
    fn point_and_linear_1d() {
        let mut mem = FlatMemory::new(1 << 16);
        let r = f32_tex(&mut mem, 4, 1, &[1.0, 2.0, 4.0, 8.0]);
        let mut d = TextureDesc::new(r);
        assert_eq!(s(&d, Geom::D1, at(2.7, 0.0), &mem), 4.0);
        assert_eq!(s(&d, Geom::D1, at(-3.0, 0.0), &mem), 1.0);
        d.filter = FilterMode::Linear;
        // Texel centres return the texel.
        assert_eq!(s(&d, Geom::D1, at(1.5, 0.0), &mem), 2.0);
        // Halfway between texels 1 and 2.
        assert_eq!(s(&d, Geom::D1, at(2.0, 0.0), &mem), 3.0);
        // 0.3 of the way: the weight is quantized to 77/256.
        let v = s(&d, Geom::D1, at(1.8, 0.0), &mem);
        assert_eq!(v, (2.0 + 2.0 * 77.0 / 256.0) as f32);
        // Clamp at the edges: below the first centre the first texel.
        assert_eq!(s(&d, Geom::D1, at(0.2, 0.0), &mem), 1.0);
        d.address[0] = AddressMode::Border;
        d.border = [10.0, 0.0, 0.0, 0.0];
        assert_eq!(s(&d, Geom::D1, at(0.0, 0.0), &mem), 5.5);
        // Missing channels read 0, alpha too.
        let all = sample(&d, Geom::D1, &at(1.5, 0.0), TexType::F32, &mem).unwrap();
        assert_eq!(all.map(f32::from_bits), [2.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn one_d_arrays_blend_the_border_row_above() {
        let mut mem = FlatMemory::new(1 << 16);
        let mut r = f32_tex(&mut mem, 4, 1, &[1.0, 2.0, 4.0, 8.0]);
        r = Resource::array(r.base, r.format, 1, [4, 0, 0], 0);
        assert_eq!((r.dims, r.height), (1, 1));
        let mut d = TextureDesc::new(r);
        d.filter = FilterMode::Linear;
        d.address = [AddressMode::Border; 3];
        d.border = [10.0, 20.0, 30.0, 40.0];
        // Row 0 at y = 0 is half the texel row and half the border row above it.
        assert_eq!(s(&d, Geom::D1, at(1.5, 0.0), &mem), 6.0);
        assert_eq!(s(&d, Geom::D1, at(0.0, 0.0), &mem), 7.75);
        // Only the border mode shows it; point sampling takes row 0.
        d.address[1] = AddressMode::Clamp;
        assert_eq!(s(&d, Geom::D1, at(1.5, 0.0), &mem), 2.0);
        d.address[1] = AddressMode::Border;
        d.filter = FilterMode::Point;
        assert_eq!(s(&d, Geom::D1, at(1.5, 0.0), &mem), 2.0);
        // Border channels the format lacks are 0 too.
        let v = sample(&d, Geom::D1, &at(-1.0, 0.0), TexType::F32, &mem).unwrap();
        assert_eq!(v.map(f32::from_bits), [10.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn weights_split_z_then_x_then_y() {
        let w = |f: &[u32]| {
            let (w, n) = linear_weights(f);
            w[..n].to_vec()
        };
        assert_eq!(w(&[77]), [179, 77]);
        // Corners 00, 10, 01, 11: the diagonal is rounded (halves up), the rest is what remains.
        assert_eq!(w(&[128, 67]), [95, 94, 33, 34]);
        assert_eq!(w(&[128, 225]), [16, 15, 112, 113]);
        // 3D (recorded): slice z0 gets 205, split 103 | 102 along x (102.5 rounds up to the upper part) ...
        let w3 = w(&[128, 102, 51]);
        assert_eq!(&w3[..4], [61, 62, 41, 41]);
        assert_eq!(&w3[4..], [15, 16, 10, 10]);
        for f in [[0, 0, 0], [255, 1, 128], [13, 205, 51], [192, 154, 102]] {
            assert_eq!(w(&f).iter().sum::<u32>(), 256, "{f:?}");
            assert_eq!(w(&f[..2]).iter().sum::<u32>(), 256, "{f:?}");
        }
    }

    #[test]
    fn blends_round_once_halves_away() {
        let sum = |t: &[(u32, f32)], bits, min| round_weighted_sum(t.iter().copied(), bits, min);
        // 1 + 2^-24 is halfway between two f32 values: away from zero, either sign.
        let half_ulp = 2f32.powi(-24);
        assert_eq!(
            sum(&[(128, 1.0), (128, 1.0 + 2.0 * half_ulp)], 24, -149),
            1.0 + 2.0 * half_ulp
        );
        assert_eq!(sum(&[(255, 1.0), (1, 1.0 + 2.0 * half_ulp)], 24, -149), 1.0);
        assert_eq!(
            sum(&[(128, -1.0), (128, -1.0 - 2.0 * half_ulp)], 24, -149),
            -1.0 - 2.0 * half_ulp
        );
        // Exact despite cancellation and a wide spread of magnitudes.
        let tiny = f32::from_bits(1);
        assert_eq!(
            sum(&[(128, 3e38), (127, -3e38), (1, tiny)], 24, -149),
            3e38 / 256.0
        );
        assert_eq!(sum(&[(128, 3e38), (128, -3e38)], 24, -149), 0.0);
        assert_eq!(sum(&[(255, 0.0), (1, tiny)], 24, -149), 0.0);
        assert_eq!(sum(&[(128, 0.0), (128, tiny)], 24, -149), tiny);
        assert_eq!(sum(&[(256, f32::MAX)], 24, -149), f32::MAX);
        assert!(sum(&[(128, f32::INFINITY), (128, f32::NEG_INFINITY)], 24, -149).is_nan());
        assert_eq!(sum(&[(0, f32::NAN), (256, 2.0)], 24, -149), 2.0);
        // To f16 precision: 1 + 2^-11 is a half tie.
        assert_eq!(
            sum(&[(128, 1.0), (128, 1.0 + 2f32.powi(-10))], 11, -24),
            1.0 + 2f32.powi(-10)
        );
        assert_eq!(sum(&[(192, 1.0), (64, 1.0 + 2f32.powi(-10))], 11, -24), 1.0);
    }

    #[test]
    fn normalized_formats_filter_in_16_bit_fixed_point() {
        let mut mem = FlatMemory::new(1 << 16);
        let a = mem.alloc(4).unwrap();
        mem.write(a, &[10, 11, 0, 0]).unwrap();
        let mut d = TextureDesc::new(Resource::array(a, ChannelFormat::U8, 1, [2, 0, 0], 0));
        d.filter = FilterMode::Linear;
        // Halfway: (10 + 11) / 2 * 257 = 2698.5 rounds to 2699.
        assert_eq!(s(&d, Geom::D1, at(1.0, 0.0), &mem), 2699.0 / 65535.0);
        // Border colours are truncated to the format's steps.
        let b = mem.alloc(4).unwrap();
        let mut d = TextureDesc::new(Resource::array(b, ChannelFormat::U16, 2, [1, 1, 0], 0));
        d.address = [AddressMode::Border; 3];
        d.border = [1.0, 0.5, 0.25, 1.0];
        let v = sample(&d, Geom::D2, &at(-1.0, 0.5), TexType::F32, &mem).unwrap();
        assert_eq!(v.map(f32::from_bits), [1.0, 32767.0 / 65535.0, 0.0, 0.0]);
    }

    #[test]
    fn queries_answer_as_recorded() {
        let r2 = Resource::array(0, ChannelFormat::F32, 1, [7, 5, 0], 0);
        let r3 = Resource::array(0, ChannelFormat::F32, 1, [4, 3, 2], 0);
        let r1 = Resource::array(0, ChannelFormat::F32, 1, [9, 0, 0], 4);
        let q = |q: Query, r: &Resource| q.answer(r);
        assert_eq!(
            [Query::Width, Query::Height, Query::Depth].map(|x| q(x, &r2)),
            [7, 5, 0]
        );
        assert_eq!(
            [Query::Width, Query::Height, Query::Depth].map(|x| q(x, &r3)),
            [4, 3, 2]
        );
        // A 1D resource is one texel high; a layered one's depth is its layer count.
        assert_eq!(
            [Query::Height, Query::Depth, Query::ArraySize].map(|x| q(x, &r1)),
            [1, 4, 4]
        );
        let d1 = Resource::array(0, ChannelFormat::F32, 1, [9, 0, 0], 0);
        assert_eq!(
            [Query::Width, Query::Height, Query::Depth].map(|x| q(x, &d1)),
            [9, 1, 0]
        );
        // A layered 2D array is 2D whether its caller gives the depth as 0 or as one slice.
        for depth in [0, 1] {
            let a2 = Resource::array(0, ChannelFormat::F32, 1, [4, 3, depth], 2);
            assert_eq!(
                [Query::Width, Query::Height, Query::Depth, Query::ArraySize].map(|x| q(x, &a2)),
                [4, 3, 2, 2]
            );
        }
        let lin = Resource::linear(0, ChannelFormat::F32, 4, 160);
        assert_eq!([Query::Width, Query::Height].map(|x| q(x, &lin)), [10, 1]);
    }

    #[test]
    fn normalized_wrap_and_mirror() {
        let mut mem = FlatMemory::new(1 << 16);
        let r = f32_tex(&mut mem, 4, 1, &[1.0, 2.0, 4.0, 8.0]);
        let mut d = TextureDesc::new(r);
        d.normalized_coords = true;
        d.address[0] = AddressMode::Wrap;
        assert_eq!(s(&d, Geom::D1, at(1.1, 0.0), &mem), 1.0);
        assert_eq!(s(&d, Geom::D1, at(-0.1, 0.0), &mem), 8.0);
        d.address[0] = AddressMode::Mirror;
        assert_eq!(s(&d, Geom::D1, at(1.1, 0.0), &mem), 8.0);
        assert_eq!(s(&d, Geom::D1, at(-0.1, 0.0), &mem), 1.0);
        d.filter = FilterMode::Linear;
        d.address[0] = AddressMode::Wrap;
        // Between the last texel and the first one, wrapped.
        assert_eq!(s(&d, Geom::D1, at(1.0, 0.0), &mem), 4.5);
    }

    #[test]
    fn bilinear_and_gather() {
        let mut mem = FlatMemory::new(1 << 16);
        let r = f32_tex(&mut mem, 2, 2, &[0.0, 1.0, 2.0, 3.0]);
        let mut d = TextureDesc::new(r);
        d.filter = FilterMode::Linear;
        assert_eq!(s(&d, Geom::D2, at(1.0, 1.0), &mem), 1.5);
        assert_eq!(s(&d, Geom::D2, at(1.5, 0.5), &mem), 1.0);
        let g = gather(&d, Geom::D2, 0, &at(1.0, 1.0), TexType::F32, &mem).unwrap();
        // (i0, j1), (i1, j1), (i1, j0), (i0, j0)
        assert_eq!(g.map(f32::from_bits), [2.0, 3.0, 1.0, 0.0]);
    }

    #[test]
    fn normalized_reads_of_u8() {
        let mut mem = FlatMemory::new(1 << 16);
        let a = mem.alloc(8).unwrap();
        mem.write(a, &[0, 51, 255, 128, 10, 20, 30, 40]).unwrap();
        let r = Resource::array(a, ChannelFormat::U8, 4, [2, 1, 1], 0);
        let d = TextureDesc::new(r);
        let v = sample(&d, Geom::D1, &at(0.5, 0.0), TexType::F32, &mem).unwrap();
        assert_eq!(v.map(f32::from_bits), [0.0, 0.2, 1.0, 128.0 / 255.0]);
        let mut d2 = d;
        d2.read_as_integer = true;
        let v = sample(&d2, Geom::D1, &at(1.5, 0.0), TexType::U32, &mem).unwrap();
        assert_eq!(v, [10, 20, 30, 40]);
        // Result type and read mode must agree.
        assert!(matches!(
            sample(&d2, Geom::D1, &at(1.5, 0.0), TexType::F32, &mem),
            Err(TexError::Unsupported(_))
        ));
        let mut d3 = d2;
        d3.filter = FilterMode::Linear;
        assert!(matches!(
            sample(&d3, Geom::D1, &at(1.5, 0.0), TexType::U32, &mem),
            Err(TexError::Unsupported(_))
        ));
    }

    #[test]
    fn linear_fetch_out_of_range_reads_zero() {
        let mut mem = FlatMemory::new(1 << 16);
        let a = mem.alloc(16).unwrap();
        mem.write(a, &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0])
            .unwrap();
        let mut d = TextureDesc::new(Resource::linear(a, ChannelFormat::S32, 1, 16));
        d.read_as_integer = true;
        let c = |i: i32| Coords {
            layer: 0,
            c: [i as u32, 0, 0],
            int: true,
        };
        let get = |i| sample(&d, Geom::D1, &c(i), TexType::S32, &mem).unwrap();
        assert_eq!(get(2), [3, 0, 0, 0]);
        assert_eq!(get(4), [0; 4]);
        assert_eq!(get(-1), [0; 4]);
    }

    #[test]
    fn surfaces_clamp_zero_trap() {
        let mut mem = FlatMemory::new(1 << 16);
        let a = mem.alloc(4 * 4 * 2).unwrap();
        let desc = SurfaceDesc {
            resource: Resource::array(a, ChannelFormat::U32, 1, [4, 2, 1], 0),
        };
        let acc = |x: i32, y: i32, clamp| SurfaceAccess {
            desc: &desc,
            geom: Geom::D2,
            coords: [x, y, 0, 0],
            len: 4,
            clamp,
        };
        acc(12, 1, OutOfRange::Trap)
            .store(&mem, &7u32.to_le_bytes())
            .unwrap();
        let mut out = [0u8; 4];
        acc(100, 5, OutOfRange::Clamp).load(&mem, &mut out).unwrap();
        assert_eq!(u32::from_le_bytes(out), 7);
        acc(16, 1, OutOfRange::Zero).load(&mem, &mut out).unwrap();
        assert_eq!(out, [0; 4]);
        acc(16, 1, OutOfRange::Zero)
            .store(&mem, &[9, 9, 9, 9])
            .unwrap();
        assert!(matches!(
            acc(16, 1, OutOfRange::Trap).load(&mem, &mut out),
            Err(TexError::Fault(_))
        ));
        assert!(matches!(
            acc(2, 0, OutOfRange::Trap).load(&mem, &mut out),
            Err(TexError::Misaligned { .. })
        ));
    }

    #[test]
    fn hostile_descriptors_do_not_panic() {
        let mem = FlatMemory::new(4096);
        let mut r = Resource::array(0, ChannelFormat::F32, 4, [u64::MAX, u64::MAX, 3], 0);
        r.base = u64::MAX - 3;
        let mut d = TextureDesc::new(r);
        let mut layered = r;
        layered.layers = u64::MAX;
        for filter in [FilterMode::Point, FilterMode::Linear] {
            for mode in [
                AddressMode::Wrap,
                AddressMode::Clamp,
                AddressMode::Mirror,
                AddressMode::Border,
            ] {
                d.filter = filter;
                d.address = [mode; 3];
                d.normalized_coords = mode == AddressMode::Wrap;
                for x in [f32::NAN, f32::INFINITY, -1e30, 1e30, 0.5] {
                    let c = Coords {
                        layer: u32::MAX,
                        c: [x.to_bits(); 3],
                        int: false,
                    };
                    let _ = sample(&d, Geom::D3, &c, TexType::F32, &mem);
                    let _ = gather(&d, Geom::D2, 3, &c, TexType::F32, &mem);
                    let mut dl = d;
                    dl.resource = layered;
                    let _ = sample(&dl, Geom::A2, &c, TexType::F32, &mem);
                }
            }
        }
        for (resource, geom) in [(r, Geom::D3), (layered, Geom::A2)] {
            let sd = SurfaceDesc { resource };
            for x in [i32::MIN, -4, 0, i32::MAX - 3] {
                for clamp in [OutOfRange::Clamp, OutOfRange::Zero, OutOfRange::Trap] {
                    let acc = SurfaceAccess {
                        desc: &sd,
                        geom,
                        coords: [x, x, x, x],
                        len: 16,
                        clamp,
                    };
                    let mut out = [0u8; 16];
                    let _ = acc.load(&mem, &mut out);
                    let _ = acc.store(&mem, &out);
                }
            }
        }
        assert!(r.span_bytes().is_none());
    }
}
