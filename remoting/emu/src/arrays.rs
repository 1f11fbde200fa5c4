//! CUDA arrays, texture and surface objects, and 2D/3D copies on the emulated device.
//!
//! An array's texels live in device memory ([`DeviceMemory`]) in the layout the PTX interpreter reads
//! ([`gleam_ptx::Resource::array`]): dense and row-major, rows of `width * element` bytes, then rows of a
//! slice, then slices (3D) or layers (layered arrays). Copies address arrays in that layout too
//! ([`ArrayShape`]). Texture and surface objects are descriptors over arrays or device memory; kernels
//! see them through a [`Resolver`] snapshot taken at launch, so an object destroyed while a kernel is
//! queued is still what that kernel was launched with (its memory is what CUDA's rules protect).
//!
//! Refused with `CUDA_ERROR_NOT_SUPPORTED` (and a log line saying why) rather than emulated wrongly:
//! formats other than the plain 8/16/32-bit integer, half and float ones, and resource views.

use std::collections::HashMap;
use std::sync::Arc;

use gleam_protocol::copy::{ArrayShape, Copy3D, Place};
use gleam_protocol::descriptors::{
    CU_TRSF_NORMALIZED_COORDINATES, CU_TRSF_READ_AS_INTEGER, CU_TRSF_SRGB, CUDA_ARRAY3D_CUBEMAP,
    CUDA_ARRAY3D_DESCRIPTOR, CUDA_ARRAY3D_LAYERED, CUDA_ARRAY3D_SURFACE_LDST,
    CUDA_ARRAY3D_TEXTURE_GATHER, CUDA_RESOURCE_DESC, CUDA_RESOURCE_VIEW_DESC, CUDA_TEXTURE_DESC,
    Resource, format,
};
use gleam_protocol::types::CUresult;
use gleam_ptx::{
    AddressMode, ChannelFormat, FilterMode, MemoryFault, SurfaceDesc, TextureDesc, TextureResolver,
};

use crate::device::limits;
use crate::memory::{ALLOC_ALIGN, DeviceMemory};

/// Handle namespace of arrays (see the backend's `kind` module).
const ARRAY_KIND: u64 = 0x0a00_0000_0000;

/// One CUDA array.
#[derive(Clone, Debug)]
struct ArrayObj {
    desc: CUDA_ARRAY3D_DESCRIPTOR,
    /// Device address of texel (0, 0, 0) of layer 0.
    base: u64,
    shape: ArrayShape,
    resource: gleam_ptx::Resource,
}

#[derive(Clone, Debug)]
struct TexObj {
    res: CUDA_RESOURCE_DESC,
    tex: CUDA_TEXTURE_DESC,
    view: CUDA_RESOURCE_VIEW_DESC,
}

/// What kernels resolve texture and surface handles to: a snapshot of the live objects.
#[derive(Clone, Debug, Default)]
pub struct Resolver {
    textures: HashMap<u64, TextureDesc>,
    surfaces: HashMap<u64, SurfaceDesc>,
}

impl TextureResolver for Resolver {
    fn texture(&self, handle: u64) -> Option<TextureDesc> {
        self.textures.get(&handle).copied()
    }

    fn surface(&self, handle: u64) -> Option<SurfaceDesc> {
        self.surfaces.get(&handle).copied()
    }
}

/// The arrays, texture objects and surface objects of one session.
#[derive(Debug, Default)]
pub struct Objects {
    arrays: HashMap<u64, ArrayObj>,
    textures: HashMap<u64, TexObj>,
    surfaces: HashMap<u64, CUDA_RESOURCE_DESC>,
    resolver: Arc<Resolver>,
    next: u64,
}

/// The interpreter's channel type of a plain `CUarray_format`.
fn channel_format(f: u32) -> Result<ChannelFormat, CUresult> {
    Ok(match f {
        format::UNSIGNED_INT8 => ChannelFormat::U8,
        format::UNSIGNED_INT16 => ChannelFormat::U16,
        format::UNSIGNED_INT32 => ChannelFormat::U32,
        format::SIGNED_INT8 => ChannelFormat::S8,
        format::SIGNED_INT16 => ChannelFormat::S16,
        format::SIGNED_INT32 => ChannelFormat::S32,
        format::HALF => ChannelFormat::F16,
        format::FLOAT => ChannelFormat::F32,
        // The packed, block-compressed and video formats are real CUDA formats the emulator does not
        // lay out or sample.
        0x50 | 0x91..=0xcb => {
            tracing::warn!(
                "array format {f:#x} is not emulated (only the 8/16/32-bit integer, half and float formats)"
            );
            return Err(CUresult::NOT_SUPPORTED);
        }
        _ => return Err(CUresult::INVALID_VALUE),
    })
}

fn channels(n: u32) -> Result<u8, CUresult> {
    match n {
        1 | 2 | 4 => Ok(n as u8),
        _ => Err(CUresult::INVALID_VALUE),
    }
}

/// Whether the extents of an array description are valid for CUDA (the table of `cuArray3DCreate`), with
/// the emulated device's limits.
fn check_extents(d: &CUDA_ARRAY3D_DESCRIPTOR) -> Result<(), CUresult> {
    let (w, h, depth, flags) = (d.Width as u64, d.Height as u64, d.Depth as u64, d.Flags);
    let within = |v: u64, max: u64| (1..=max).contains(&v);
    let surface = flags & CUDA_ARRAY3D_SURFACE_LDST != 0;
    let pick = |tex: u64, surf: u64| if surface { surf.min(tex) } else { tex };
    let layered = flags & CUDA_ARRAY3D_LAYERED != 0;
    let cubemap = flags & CUDA_ARRAY3D_CUBEMAP != 0;
    let gather = flags & CUDA_ARRAY3D_TEXTURE_GATHER != 0;
    let ok = if cubemap {
        let max = pick(limits::TEXTURE_CUBEMAP, limits::SURFACE_CUBEMAP);
        w == h
            && within(w, max)
            && if layered {
                depth.is_multiple_of(6) && within(depth, limits::LAYERS_CUBEMAP)
            } else {
                depth == 6
            }
    } else if layered {
        match (h, depth) {
            (0, l) => {
                within(w, pick(limits::TEXTURE_1D_LAYERED, limits::SURFACE_1D))
                    && within(l, limits::LAYERS)
            }
            (h, l) => {
                let max = pick(limits::TEXTURE_2D_LAYERED, limits::SURFACE_2D_LAYERED);
                within(w, max) && within(h, max) && within(l, limits::LAYERS)
            }
        }
    } else {
        match (h, depth) {
            (0, 0) => within(w, pick(limits::TEXTURE_1D, limits::SURFACE_1D)),
            (h, 0) if gather => {
                within(w, limits::TEXTURE_2D_GATHER) && within(h, limits::TEXTURE_2D_GATHER)
            }
            (h, 0) => {
                within(w, pick(limits::TEXTURE_2D_WIDTH, limits::SURFACE_2D_WIDTH))
                    && within(
                        h,
                        pick(limits::TEXTURE_2D_HEIGHT, limits::SURFACE_2D_HEIGHT),
                    )
            }
            (0, _) => false,
            (h, dd) => {
                let max = pick(limits::TEXTURE_3D, limits::SURFACE_3D);
                within(w, max) && within(h, max) && within(dd, max)
            }
        }
    };
    // Texture gather is for 2D arrays only.
    if ok && (!gather || (h > 0 && depth == 0 && !layered && !cubemap)) {
        Ok(())
    } else {
        Err(CUresult::INVALID_VALUE)
    }
}

impl Objects {
    /// `cuArrayCreate`/`cuArray3DCreate`: allocates the array's texels (zeroed) for context `ctx`.
    pub fn create_array(
        &mut self,
        mem: &DeviceMemory,
        desc: CUDA_ARRAY3D_DESCRIPTOR,
        ctx: u64,
    ) -> Result<u64, CUresult> {
        const KNOWN_FLAGS: u32 = CUDA_ARRAY3D_LAYERED
            | CUDA_ARRAY3D_SURFACE_LDST
            | CUDA_ARRAY3D_CUBEMAP
            | CUDA_ARRAY3D_TEXTURE_GATHER;
        let fmt = channel_format(desc.Format)?;
        let ch = channels(desc.NumChannels)?;
        if desc.Flags & !KNOWN_FLAGS != 0 {
            // Depth textures, colour attachments, sparse and deferred-mapping arrays.
            tracing::warn!(
                flags = desc.Flags,
                "array flags the emulator does not offer"
            );
            return Err(CUresult::NOT_SUPPORTED);
        }
        check_extents(&desc)?;
        let layered = desc.Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP) != 0;
        let (w, h, d) = (desc.Width as u64, desc.Height as u64, desc.Depth as u64);
        let (dims, layers) = if layered {
            ([w, h, 1], d)
        } else {
            ([w, h, d], 0)
        };
        let elem = channel_bytes(desc.Format) * u64::from(ch);
        let shape = ArrayShape {
            row_bytes: w * elem,
            rows: h.max(1),
            slices: d.max(1),
            elem_bytes: elem,
        };
        let bytes = shape.bytes();
        let base = mem.alloc(bytes, ALLOC_ALIGN, ctx)?;
        let mut resource = gleam_ptx::Resource::array(base, fmt, ch, dims, layers);
        resource.cubemap = desc.Flags & CUDA_ARRAY3D_CUBEMAP != 0;
        debug_assert_eq!(resource.span_bytes(), Some(bytes));
        self.next += 1;
        let handle = ARRAY_KIND | (self.next << 4);
        self.arrays.insert(
            handle,
            ArrayObj {
                desc,
                base,
                shape,
                resource,
            },
        );
        Ok(handle)
    }

    /// `cuArrayDestroy`: frees the texels (the caller has let queued work finish).
    pub fn destroy_array(&mut self, mem: &DeviceMemory, handle: u64) -> Result<(), CUresult> {
        let a = self
            .arrays
            .remove(&handle)
            .ok_or(CUresult::INVALID_HANDLE)?;
        // The context's destruction may have freed the storage already.
        let _ = mem.free(a.base);
        Ok(())
    }

    /// `cuArray3DGetDescriptor`.
    pub fn descriptor(&self, handle: u64) -> Result<CUDA_ARRAY3D_DESCRIPTOR, CUresult> {
        self.arrays
            .get(&handle)
            .map(|a| a.desc)
            .ok_or(CUresult::INVALID_HANDLE)
    }

    /// The shape copies see of `handle`.
    pub fn shape(&self, handle: u64) -> Result<ArrayShape, CUresult> {
        self.arrays
            .get(&handle)
            .map(|a| a.shape)
            .ok_or(CUresult::INVALID_HANDLE)
    }

    fn base(&self, handle: u64) -> Result<u64, CUresult> {
        self.arrays
            .get(&handle)
            .map(|a| a.base)
            .ok_or(CUresult::INVALID_HANDLE)
    }

    /// The interpreter's resource for a resource descriptor (checked as `cuTexObjectCreate` checks it).
    fn resource(
        &self,
        mem: &DeviceMemory,
        desc: &CUDA_RESOURCE_DESC,
    ) -> Result<gleam_ptx::Resource, CUresult> {
        if desc.flags != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        let aligned = |p: u64| p != 0 && p.is_multiple_of(limits::TEXTURE_ALIGNMENT);
        match desc.resource().ok_or(CUresult::INVALID_VALUE)? {
            Resource::Array(a) => self
                .arrays
                .get(&a)
                .map(|a| a.resource)
                .ok_or(CUresult::INVALID_HANDLE),
            Resource::Mipmapped(_) => Err(CUresult::INVALID_HANDLE),
            Resource::Linear(l) => {
                let fmt = channel_format(l.format)?;
                let ch = channels(l.numChannels)?;
                let elem = channel_bytes(l.format) * u64::from(ch);
                if !aligned(l.devPtr)
                    || l.sizeInBytes < elem
                    || l.sizeInBytes / elem > limits::TEXTURE_1D_LINEAR
                {
                    return Err(CUresult::INVALID_VALUE);
                }
                mem.check(l.devPtr, l.sizeInBytes, false)?;
                Ok(gleam_ptx::Resource::linear(
                    l.devPtr,
                    fmt,
                    ch,
                    l.sizeInBytes,
                ))
            }
            Resource::Pitch2D(p) => {
                let fmt = channel_format(p.format)?;
                let ch = channels(p.numChannels)?;
                let elem = channel_bytes(p.format) * u64::from(ch);
                let row = p.width.checked_mul(elem).ok_or(CUresult::INVALID_VALUE)?;
                if !aligned(p.devPtr)
                    || !p
                        .pitchInBytes
                        .is_multiple_of(limits::TEXTURE_PITCH_ALIGNMENT)
                    || !(1..=limits::TEXTURE_2D_LINEAR_WIDTH).contains(&p.width)
                    || !(1..=limits::TEXTURE_2D_LINEAR_HEIGHT).contains(&p.height)
                    || p.pitchInBytes > limits::TEXTURE_2D_LINEAR_PITCH
                    || p.pitchInBytes < row
                {
                    return Err(CUresult::INVALID_VALUE);
                }
                mem.check(p.devPtr, p.pitchInBytes * (p.height - 1) + row, false)?;
                Ok(gleam_ptx::Resource::pitch2d(
                    p.devPtr,
                    fmt,
                    ch,
                    p.width,
                    p.height,
                    p.pitchInBytes,
                ))
            }
        }
    }

    /// `cuTexObjectCreate`.
    pub fn create_texture(
        &mut self,
        mem: &DeviceMemory,
        res: CUDA_RESOURCE_DESC,
        tex: CUDA_TEXTURE_DESC,
        view: Option<CUDA_RESOURCE_VIEW_DESC>,
    ) -> Result<u64, CUresult> {
        if view.is_some() {
            tracing::warn!("texture resource views are not emulated");
            return Err(CUresult::NOT_SUPPORTED);
        }
        let resource = self.resource(mem, &res)?;
        let mode = |m: u32| {
            Ok(match m {
                0 => AddressMode::Wrap,
                1 => AddressMode::Clamp,
                2 => AddressMode::Mirror,
                3 => AddressMode::Border,
                _ => return Err(CUresult::INVALID_VALUE),
            })
        };
        let filter = match tex.filterMode {
            0 => FilterMode::Point,
            1 => FilterMode::Linear,
            _ => return Err(CUresult::INVALID_VALUE),
        };
        let linear_memory = matches!(res.resource(), Some(Resource::Linear(_)));
        let mut desc = TextureDesc::new(resource);
        // Address and filter modes do not apply to linear memory (`tex1Dfetch`).
        if !linear_memory {
            desc.address = [
                mode(tex.addressMode[0])?,
                mode(tex.addressMode[1])?,
                mode(tex.addressMode[2])?,
            ];
            desc.filter = filter;
        }
        desc.normalized_coords = tex.flags & CU_TRSF_NORMALIZED_COORDINATES != 0;
        desc.read_as_integer = tex.flags & CU_TRSF_READ_AS_INTEGER != 0;
        desc.srgb = tex.flags & CU_TRSF_SRGB != 0;
        desc.border = tex.borderColor;
        // Linear filtering needs float results: integer reads (32-bit integers always are) cannot be
        // filtered.
        let int32 = matches!(resource.format, ChannelFormat::U32 | ChannelFormat::S32);
        let float_format = matches!(resource.format, ChannelFormat::F16 | ChannelFormat::F32);
        if desc.filter == FilterMode::Linear && !float_format && (int32 || desc.read_as_integer) {
            return Err(CUresult::INVALID_VALUE);
        }
        self.next += 1;
        let handle = self.next;
        self.textures.insert(
            handle,
            TexObj {
                res,
                tex,
                view: CUDA_RESOURCE_VIEW_DESC::default(),
            },
        );
        Arc::make_mut(&mut self.resolver)
            .textures
            .insert(handle, desc);
        Ok(handle)
    }

    /// `cuTexObjectDestroy`.
    pub fn destroy_texture(&mut self, handle: u64) -> Result<(), CUresult> {
        self.textures
            .remove(&handle)
            .ok_or(CUresult::INVALID_HANDLE)?;
        Arc::make_mut(&mut self.resolver).textures.remove(&handle);
        Ok(())
    }

    /// The descriptors a texture object was created with.
    pub fn texture_descs(
        &self,
        handle: u64,
    ) -> Result<
        (
            CUDA_RESOURCE_DESC,
            CUDA_TEXTURE_DESC,
            CUDA_RESOURCE_VIEW_DESC,
        ),
        CUresult,
    > {
        self.textures
            .get(&handle)
            .map(|t| (t.res, t.tex, t.view))
            .ok_or(CUresult::INVALID_HANDLE)
    }

    /// `cuSurfObjectCreate` of an array.
    pub fn create_surface(&mut self, res: CUDA_RESOURCE_DESC) -> Result<u64, CUresult> {
        if res.flags != 0 {
            return Err(CUresult::INVALID_VALUE);
        }
        let Some(Resource::Array(a)) = res.resource() else {
            return Err(CUresult::INVALID_VALUE);
        };
        // NVIDIA's driver 580 makes a surface of an array created without `SURFACE_LDST` too (recorded on
        // the H200 by tools/gpu/mem_facts.c).
        let array = self.arrays.get(&a).ok_or(CUresult::INVALID_HANDLE)?;
        let desc = SurfaceDesc {
            resource: array.resource,
        };
        self.next += 1;
        let handle = self.next;
        self.surfaces.insert(handle, res);
        Arc::make_mut(&mut self.resolver)
            .surfaces
            .insert(handle, desc);
        Ok(handle)
    }

    /// `cuSurfObjectDestroy`.
    pub fn destroy_surface(&mut self, handle: u64) -> Result<(), CUresult> {
        self.surfaces
            .remove(&handle)
            .ok_or(CUresult::INVALID_HANDLE)?;
        Arc::make_mut(&mut self.resolver).surfaces.remove(&handle);
        Ok(())
    }

    /// The resource descriptor a surface object was created with.
    pub fn surface_desc(&self, handle: u64) -> Result<CUDA_RESOURCE_DESC, CUresult> {
        self.surfaces
            .get(&handle)
            .copied()
            .ok_or(CUresult::INVALID_HANDLE)
    }

    /// What kernels launched now see.
    pub fn resolver(&self) -> Arc<Resolver> {
        self.resolver.clone()
    }

    /// Handles died by the registry's rules (with their context): drop them. Their storage went with
    /// the context's memory.
    pub fn forget(&mut self, kind: gleam_protocol::registry::Kind, handle: u64) {
        use gleam_protocol::registry::Kind;
        let r = Arc::make_mut(&mut self.resolver);
        match kind {
            Kind::Array => {
                self.arrays.remove(&handle);
            }
            Kind::TexObject => {
                self.textures.remove(&handle);
                r.textures.remove(&handle);
            }
            Kind::SurfObject => {
                self.surfaces.remove(&handle);
                r.surfaces.remove(&handle);
            }
            _ => {}
        }
    }

    /// Forgets everything (the session is over; the memory is freed by the caller).
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Resolves a checked copy into where its rows are.
    pub fn plan(&self, copy: &Copy3D) -> Result<Plan, CUresult> {
        let (src, dst) = copy.check(|a| self.shape(a))?;
        let at = |place: Place, origin: u64| -> Result<End, CUresult> {
            Ok(match place {
                Place::Host => End::Host,
                Place::Device(_) => End::Device(origin),
                Place::Array(a) => End::Device(self.base(a)? + origin),
            })
        };
        Ok(Plan {
            src: (
                at(copy.src.place, src.origin)?,
                src.row_stride,
                src.slice_stride,
            ),
            dst: (
                at(copy.dst.place, dst.origin)?,
                dst.row_stride,
                dst.slice_stride,
            ),
            width: copy.width_bytes,
            height: copy.height,
            depth: copy.depth,
        })
    }
}

fn channel_bytes(f: u32) -> u64 {
    format::channel_bytes(f).unwrap_or(1)
}

/// Where one side of a planned copy starts.
#[derive(Clone, Copy, Debug)]
enum End {
    /// Packed host bytes (offset 0).
    Host,
    /// A device address (array storage included).
    Device(u64),
}

/// A checked copy, resolved to device addresses: run it with [`Plan::run`].
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    src: (End, u64, u64),
    dst: (End, u64, u64),
    width: u64,
    height: u64,
    depth: u64,
}

impl Plan {
    /// Whether the destination is the client's memory (the bytes come back).
    pub fn to_host(&self) -> bool {
        matches!(self.dst.0, End::Host)
    }

    /// Checks that every device row lies inside an allocation (the span from the first row's start to
    /// the last row's end must lie in one), so that a bad copy fails at the call.
    pub fn check(&self, mem: &DeviceMemory) -> Result<(), CUresult> {
        if self.width == 0 || self.height == 0 || self.depth == 0 {
            return Ok(());
        }
        for ((end, row, slice), write) in [(self.src, false), (self.dst, true)] {
            if let End::Device(origin) = end {
                let last = (self.depth - 1) * slice + (self.height - 1) * row;
                mem.check(origin, last + self.width, write)?;
            }
        }
        Ok(())
    }

    /// Moves the bytes: `host` is the packed source if it is the client's; returns the packed destination
    /// if it is.
    pub fn run(&self, mem: &DeviceMemory, host: &[u8]) -> Result<Vec<u8>, MemoryFault> {
        let w = self.width as usize;
        let mut out = if self.to_host() {
            vec![0u8; w * self.height as usize * self.depth as usize]
        } else {
            Vec::new()
        };
        let mut packed = 0usize;
        let mut row = vec![0u8; w];
        for z in 0..self.depth {
            for y in 0..self.height {
                let at = |(end, r, s): (End, u64, u64)| match end {
                    End::Host => None,
                    End::Device(o) => Some(o + z * s + y * r),
                };
                match (at(self.src), at(self.dst)) {
                    (None, Some(d)) => mem.write_bytes(d, &host[packed..packed + w])?,
                    (Some(s), None) => mem.read_bytes(s, &mut out[packed..packed + w])?,
                    (Some(s), Some(d)) => {
                        mem.read_bytes(s, &mut row)?;
                        mem.write_bytes(d, &row)?;
                    }
                    (None, None) => {
                        out[packed..packed + w].copy_from_slice(&host[packed..packed + w]);
                    }
                }
                packed += w;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gleam_protocol::copy::Side;
    use gleam_protocol::descriptors::{LinearResource, Pitch2DResource};

    fn desc(
        w: usize,
        h: usize,
        d: usize,
        fmt: u32,
        ch: u32,
        flags: u32,
    ) -> CUDA_ARRAY3D_DESCRIPTOR {
        CUDA_ARRAY3D_DESCRIPTOR {
            Width: w,
            Height: h,
            Depth: d,
            Format: fmt,
            NumChannels: ch,
            Flags: flags,
        }
    }

    #[test]
    fn array_extents_follow_cudas_table() {
        let mem = DeviceMemory::new(64 << 20);
        let mut o = Objects::default();
        let ok = |o: &mut Objects, d| o.create_array(&mem, d, 1);
        assert!(ok(&mut o, desc(64, 0, 0, format::FLOAT, 1, 0)).is_ok());
        assert!(ok(&mut o, desc(64, 32, 0, format::UNSIGNED_INT8, 4, 0)).is_ok());
        assert!(ok(&mut o, desc(8, 8, 8, format::HALF, 2, 0)).is_ok());
        assert!(
            ok(
                &mut o,
                desc(16, 0, 3, format::FLOAT, 1, CUDA_ARRAY3D_LAYERED)
            )
            .is_ok()
        );
        assert!(
            ok(
                &mut o,
                desc(16, 16, 6, format::FLOAT, 1, CUDA_ARRAY3D_CUBEMAP)
            )
            .is_ok()
        );
        for bad in [
            desc(0, 0, 0, format::FLOAT, 1, 0),
            desc(64, 0, 4, format::FLOAT, 1, 0),
            desc(64, 0, 0, format::FLOAT, 3, 0),
            desc(64, 0, 0, 0x77, 1, 0),
            desc(16, 8, 6, format::FLOAT, 1, CUDA_ARRAY3D_CUBEMAP),
            desc(16, 16, 5, format::FLOAT, 1, CUDA_ARRAY3D_CUBEMAP),
            desc(8, 8, 8, format::FLOAT, 1, CUDA_ARRAY3D_TEXTURE_GATHER),
            desc(1 << 20, 0, 0, format::FLOAT, 1, 0),
        ] {
            assert_eq!(ok(&mut o, bad), Err(CUresult::INVALID_VALUE), "{bad:?}");
        }
        assert_eq!(
            ok(&mut o, desc(64, 0, 0, 0xc0, 1, 0)),
            Err(CUresult::NOT_SUPPORTED)
        );
    }

    #[test]
    fn copies_land_in_the_interpreters_layout() {
        let mem = DeviceMemory::new(64 << 20);
        let mut o = Objects::default();
        // A 2D layered array: 4 x 3 texels of u16, 2 layers.
        let a = o
            .create_array(
                &mem,
                desc(4, 3, 2, format::UNSIGNED_INT16, 1, CUDA_ARRAY3D_LAYERED),
                1,
            )
            .unwrap();
        let bytes: Vec<u8> = (0..48).collect();
        let up = Copy3D {
            src: Side::host(8, 3),
            dst: Side::array(a, 0, 0, 0),
            width_bytes: 8,
            height: 3,
            depth: 2,
        };
        o.plan(&up).unwrap().run(&mem, &bytes).unwrap();
        // Texel (x=1, y=2) of layer 1 is where the interpreter's Resource says.
        let r = o.arrays[&a].resource;
        let addr = r.base + r.layer_pitch() + 2 * r.row_pitch + r.elem_bytes();
        let mut t = [0u8; 2];
        mem.read_bytes(addr, &mut t).unwrap();
        assert_eq!(t, [24 + 16 + 2, 24 + 16 + 3]);
        // A sub-rectangle back out: x 1..3, y 1..3 of layer 1.
        let down = Copy3D {
            src: Side::array(a, 2, 1, 1),
            dst: Side::host(4, 2),
            width_bytes: 4,
            height: 2,
            depth: 1,
        };
        let plan = o.plan(&down).unwrap();
        plan.check(&mem).unwrap();
        assert_eq!(
            plan.run(&mem, &[]).unwrap(),
            [34, 35, 36, 37, 42, 43, 44, 45]
        );
    }

    #[test]
    fn textures_and_surfaces_check_their_resources() {
        let mem = DeviceMemory::new(64 << 20);
        let mut o = Objects::default();
        let plain = o
            .create_array(&mem, desc(8, 8, 0, format::FLOAT, 1, 0), 1)
            .unwrap();
        let surf = o
            .create_array(
                &mem,
                desc(8, 8, 0, format::FLOAT, 1, CUDA_ARRAY3D_SURFACE_LDST),
                1,
            )
            .unwrap();
        let tex = CUDA_TEXTURE_DESC {
            addressMode: [1; 3],
            filterMode: 1,
            ..Default::default()
        };
        let t = o
            .create_texture(
                &mem,
                CUDA_RESOURCE_DESC::new(Resource::Array(plain)),
                tex,
                None,
            )
            .unwrap();
        assert!(o.resolver().texture(t).is_some());
        assert_eq!(o.texture_descs(t).unwrap().1, tex);
        // As on the H200, an array without SURFACE_LDST makes a surface too.
        assert!(
            o.create_surface(CUDA_RESOURCE_DESC::new(Resource::Array(plain)))
                .is_ok()
        );
        let s = o
            .create_surface(CUDA_RESOURCE_DESC::new(Resource::Array(surf)))
            .unwrap();
        assert!(o.resolver().surface(s).is_some());
        // Linear memory must be aligned and allocated; pitched rows aligned to 32 bytes.
        let buf = mem.alloc(4096, 512, 1).unwrap();
        let lin = |p| {
            CUDA_RESOURCE_DESC::new(Resource::Linear(LinearResource {
                devPtr: p,
                format: format::FLOAT,
                numChannels: 1,
                sizeInBytes: 1024,
            }))
        };
        assert!(o.create_texture(&mem, lin(buf), tex, None).is_ok());
        assert_eq!(
            o.create_texture(&mem, lin(buf + 4), tex, None),
            Err(CUresult::INVALID_VALUE)
        );
        let pitch = |p| {
            CUDA_RESOURCE_DESC::new(Resource::Pitch2D(Pitch2DResource {
                devPtr: buf,
                format: format::FLOAT,
                numChannels: 1,
                width: 8,
                height: 4,
                pitchInBytes: p,
            }))
        };
        assert!(o.create_texture(&mem, pitch(64), tex, None).is_ok());
        assert_eq!(
            o.create_texture(&mem, pitch(48), tex, None),
            Err(CUresult::INVALID_VALUE)
        );
        // Linear filtering of integer reads is refused.
        let ints = o
            .create_array(&mem, desc(8, 8, 0, format::SIGNED_INT32, 1, 0), 1)
            .unwrap();
        assert_eq!(
            o.create_texture(
                &mem,
                CUDA_RESOURCE_DESC::new(Resource::Array(ints)),
                tex,
                None
            ),
            Err(CUresult::INVALID_VALUE)
        );
        o.destroy_texture(t).unwrap();
        assert!(o.resolver().texture(t).is_none());
        assert_eq!(o.destroy_texture(t), Err(CUresult::INVALID_HANDLE));
    }
}
