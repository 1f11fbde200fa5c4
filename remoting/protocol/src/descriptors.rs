//! The CUDA descriptor structs that array, texture, surface and 2D/3D copy calls take by pointer, with
//! their exact C layouts (CUDA 13.0's `cuda.h`; the sizes and offsets are asserted below).
//!
//! Those that only hold values and handles travel by value in the wire message (`In<T>` / `Out<T>` of
//! [`crate::api`]): handles and device pointers are identical on both sides. The copy descriptors
//! ([`CUDA_MEMCPY2D`], [`CUDA_MEMCPY3D`]) hold host pointers of the client, which mean nothing on the
//! server: the shim reads them and sends a [`crate::copy::Copy3D`] instead, with the host bytes packed.

#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::c_void;

use serde::{Deserialize, Serialize};

use crate::api::Plain;

/// `CUDA_ARRAY_DESCRIPTOR` (`_v2`): a 1D or 2D CUDA array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    /// Width in elements.
    pub Width: usize,
    /// Height in elements (0 for a 1D array).
    pub Height: usize,
    /// `CUarray_format`.
    pub Format: u32,
    /// Channels per element (1, 2 or 4).
    pub NumChannels: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (`_v2`): any CUDA array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    /// Width in elements.
    pub Width: usize,
    /// Height in elements (0 for a 1D array).
    pub Height: usize,
    /// Depth in elements (0 for 1D and 2D arrays), or the number of layers of a layered array.
    pub Depth: usize,
    /// `CUarray_format`.
    pub Format: u32,
    /// Channels per element (1, 2 or 4).
    pub NumChannels: u32,
    /// `CUDA_ARRAY3D_*` flags.
    pub Flags: u32,
}

/// `CUDA_RESOURCE_DESC`: what a texture or surface object reads. The C union is kept as raw words
/// ([`CUDA_RESOURCE_DESC::res`]); the accessors interpret it by [`CUDA_RESOURCE_DESC::resType`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct CUDA_RESOURCE_DESC {
    /// `CUresourcetype`.
    pub resType: u32,
    _pad0: u32,
    /// The union `res` (128 bytes).
    pub res: [u64; 16],
    /// Must be zero.
    pub flags: u32,
    _pad1: u32,
}

/// `CUDA_RESOURCE_DESC::res.linear`.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct LinearResource {
    /// Device pointer.
    pub devPtr: u64,
    /// `CUarray_format`.
    pub format: u32,
    /// Channels per element.
    pub numChannels: u32,
    /// Size in bytes.
    pub sizeInBytes: u64,
}

/// `CUDA_RESOURCE_DESC::res.pitch2D`.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Pitch2DResource {
    /// Device pointer.
    pub devPtr: u64,
    /// `CUarray_format`.
    pub format: u32,
    /// Channels per element.
    pub numChannels: u32,
    /// Width in elements.
    pub width: u64,
    /// Height in elements.
    pub height: u64,
    /// Bytes from one row to the next.
    pub pitchInBytes: u64,
}

/// What a [`CUDA_RESOURCE_DESC`] describes.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Resource {
    /// `CU_RESOURCE_TYPE_ARRAY`: a `CUarray`.
    Array(u64),
    /// `CU_RESOURCE_TYPE_MIPMAPPED_ARRAY`: a `CUmipmappedArray`.
    Mipmapped(u64),
    /// `CU_RESOURCE_TYPE_LINEAR`.
    Linear(LinearResource),
    /// `CU_RESOURCE_TYPE_PITCH2D`.
    Pitch2D(Pitch2DResource),
}

/// `CU_RESOURCE_TYPE_*`.
pub const CU_RESOURCE_TYPE_ARRAY: u32 = 0;
/// See [`CU_RESOURCE_TYPE_ARRAY`].
pub const CU_RESOURCE_TYPE_MIPMAPPED_ARRAY: u32 = 1;
/// See [`CU_RESOURCE_TYPE_ARRAY`].
pub const CU_RESOURCE_TYPE_LINEAR: u32 = 2;
/// See [`CU_RESOURCE_TYPE_ARRAY`].
pub const CU_RESOURCE_TYPE_PITCH2D: u32 = 3;

fn lo(w: u64) -> u32 {
    w as u32
}

fn hi(w: u64) -> u32 {
    (w >> 32) as u32
}

fn pair(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

impl CUDA_RESOURCE_DESC {
    /// The resource, or `None` for an unknown `resType`.
    pub fn resource(&self) -> Option<Resource> {
        let r = &self.res;
        Some(match self.resType {
            CU_RESOURCE_TYPE_ARRAY => Resource::Array(r[0]),
            CU_RESOURCE_TYPE_MIPMAPPED_ARRAY => Resource::Mipmapped(r[0]),
            // devPtr (8) | format (4), numChannels (4) | sizeInBytes (8)
            CU_RESOURCE_TYPE_LINEAR => Resource::Linear(LinearResource {
                devPtr: r[0],
                format: lo(r[1]),
                numChannels: hi(r[1]),
                sizeInBytes: r[2],
            }),
            // devPtr | format, numChannels | width | height | pitchInBytes
            CU_RESOURCE_TYPE_PITCH2D => Resource::Pitch2D(Pitch2DResource {
                devPtr: r[0],
                format: lo(r[1]),
                numChannels: hi(r[1]),
                width: r[2],
                height: r[3],
                pitchInBytes: r[4],
            }),
            _ => return None,
        })
    }

    /// A descriptor of `resource` (flags 0).
    pub fn new(resource: Resource) -> Self {
        let mut d = Self::default();
        match resource {
            Resource::Array(a) => {
                d.resType = CU_RESOURCE_TYPE_ARRAY;
                d.res[0] = a;
            }
            Resource::Mipmapped(m) => {
                d.resType = CU_RESOURCE_TYPE_MIPMAPPED_ARRAY;
                d.res[0] = m;
            }
            Resource::Linear(l) => {
                d.resType = CU_RESOURCE_TYPE_LINEAR;
                d.res[0] = l.devPtr;
                d.res[1] = pair(l.format, l.numChannels);
                d.res[2] = l.sizeInBytes;
            }
            Resource::Pitch2D(p) => {
                d.resType = CU_RESOURCE_TYPE_PITCH2D;
                d.res[0] = p.devPtr;
                d.res[1] = pair(p.format, p.numChannels);
                d.res[2] = p.width;
                d.res[3] = p.height;
                d.res[4] = p.pitchInBytes;
            }
        }
        d
    }
}

/// `CUDA_TEXTURE_DESC`: how a texture object samples.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Serialize)]
pub struct CUDA_TEXTURE_DESC {
    /// `CUaddress_mode` per dimension.
    pub addressMode: [u32; 3],
    /// `CUfilter_mode`.
    pub filterMode: u32,
    /// `CU_TRSF_*` flags.
    pub flags: u32,
    /// Maximum anisotropy ratio.
    pub maxAnisotropy: u32,
    /// `CUfilter_mode` between mipmap levels.
    pub mipmapFilterMode: u32,
    /// Mipmap level bias.
    pub mipmapLevelBias: f32,
    /// Mipmap minimum level clamp.
    pub minMipmapLevelClamp: f32,
    /// Mipmap maximum level clamp.
    pub maxMipmapLevelClamp: f32,
    /// Border colour (RGBA).
    pub borderColor: [f32; 4],
    /// Reserved.
    pub reserved: [i32; 12],
}

/// `CUDA_RESOURCE_VIEW_DESC`: a view of an array with another format or a subset of its levels/layers.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct CUDA_RESOURCE_VIEW_DESC {
    /// `CUresourceViewFormat`.
    pub format: u32,
    _pad0: u32,
    /// Width of the view.
    pub width: usize,
    /// Height of the view.
    pub height: usize,
    /// Depth of the view.
    pub depth: usize,
    /// First mipmap level.
    pub firstMipmapLevel: u32,
    /// Last mipmap level.
    pub lastMipmapLevel: u32,
    /// First layer.
    pub firstLayer: u32,
    /// Last layer.
    pub lastLayer: u32,
    /// Reserved.
    pub reserved: [u32; 16],
}

/// `CUDA_MEMCPY2D` (`_v2`): a 2D copy as the application describes it (host pointers are the client's).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEMCPY2D {
    pub srcXInBytes: usize,
    pub srcY: usize,
    pub srcMemoryType: u32,
    pub srcHost: *const c_void,
    pub srcDevice: u64,
    pub srcArray: *mut c_void,
    pub srcPitch: usize,
    pub dstXInBytes: usize,
    pub dstY: usize,
    pub dstMemoryType: u32,
    pub dstHost: *mut c_void,
    pub dstDevice: u64,
    pub dstArray: *mut c_void,
    pub dstPitch: usize,
    pub WidthInBytes: usize,
    pub Height: usize,
}

/// `CUDA_MEMCPY3D` (`_v2`): a 3D copy as the application describes it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEMCPY3D {
    pub srcXInBytes: usize,
    pub srcY: usize,
    pub srcZ: usize,
    pub srcLOD: usize,
    pub srcMemoryType: u32,
    pub srcHost: *const c_void,
    pub srcDevice: u64,
    pub srcArray: *mut c_void,
    pub reserved0: *mut c_void,
    pub srcPitch: usize,
    pub srcHeight: usize,
    pub dstXInBytes: usize,
    pub dstY: usize,
    pub dstZ: usize,
    pub dstLOD: usize,
    pub dstMemoryType: u32,
    pub dstHost: *mut c_void,
    pub dstDevice: u64,
    pub dstArray: *mut c_void,
    pub reserved1: *mut c_void,
    pub dstPitch: usize,
    pub dstHeight: usize,
    pub WidthInBytes: usize,
    pub Height: usize,
    pub Depth: usize,
}

/// `CUmemorytype`: where one side of a copy is.
pub const CU_MEMORYTYPE_HOST: u32 = 1;
/// See [`CU_MEMORYTYPE_HOST`].
pub const CU_MEMORYTYPE_DEVICE: u32 = 2;
/// See [`CU_MEMORYTYPE_HOST`].
pub const CU_MEMORYTYPE_ARRAY: u32 = 3;
/// See [`CU_MEMORYTYPE_HOST`]: a unified address, host or device.
pub const CU_MEMORYTYPE_UNIFIED: u32 = 4;

/// `CUDA_ARRAY3D_*` flags.
pub const CUDA_ARRAY3D_LAYERED: u32 = 0x01;
/// See [`CUDA_ARRAY3D_LAYERED`].
pub const CUDA_ARRAY3D_SURFACE_LDST: u32 = 0x02;
/// See [`CUDA_ARRAY3D_LAYERED`].
pub const CUDA_ARRAY3D_CUBEMAP: u32 = 0x04;
/// See [`CUDA_ARRAY3D_LAYERED`].
pub const CUDA_ARRAY3D_TEXTURE_GATHER: u32 = 0x08;

/// `CU_TRSF_*` texture flags.
pub const CU_TRSF_READ_AS_INTEGER: u32 = 0x01;
/// See [`CU_TRSF_READ_AS_INTEGER`].
pub const CU_TRSF_NORMALIZED_COORDINATES: u32 = 0x02;
/// See [`CU_TRSF_READ_AS_INTEGER`].
pub const CU_TRSF_SRGB: u32 = 0x10;
/// See [`CU_TRSF_READ_AS_INTEGER`].
pub const CU_TRSF_DISABLE_TRILINEAR_OPTIMIZATION: u32 = 0x20;
/// See [`CU_TRSF_READ_AS_INTEGER`].
pub const CU_TRSF_SEAMLESS_CUBEMAP: u32 = 0x40;

/// `CUarray_format` values of the plain formats (one scalar type per channel).
pub mod format {
    pub const UNSIGNED_INT8: u32 = 0x01;
    pub const UNSIGNED_INT16: u32 = 0x02;
    pub const UNSIGNED_INT32: u32 = 0x03;
    pub const SIGNED_INT8: u32 = 0x08;
    pub const SIGNED_INT16: u32 = 0x09;
    pub const SIGNED_INT32: u32 = 0x0a;
    pub const HALF: u32 = 0x10;
    pub const FLOAT: u32 = 0x20;

    /// Bytes per channel of a plain format.
    pub fn channel_bytes(format: u32) -> Option<u64> {
        Some(match format {
            UNSIGNED_INT8 | SIGNED_INT8 => 1,
            UNSIGNED_INT16 | SIGNED_INT16 | HALF => 2,
            UNSIGNED_INT32 | SIGNED_INT32 | FLOAT => 4,
            _ => return None,
        })
    }
}

impl Plain for CUDA_ARRAY_DESCRIPTOR {}
impl Plain for CUDA_ARRAY3D_DESCRIPTOR {}
impl Plain for CUDA_RESOURCE_DESC {}
impl Plain for CUDA_TEXTURE_DESC {}
impl Plain for CUDA_RESOURCE_VIEW_DESC {}

// The C layouts of CUDA 13.0 (x86-64 and aarch64 Linux), as `sizeof`/`offsetof` give them.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<CUDA_ARRAY_DESCRIPTOR>() == 24);
    assert!(size_of::<CUDA_ARRAY3D_DESCRIPTOR>() == 40);
    assert!(size_of::<CUDA_RESOURCE_DESC>() == 144);
    assert!(offset_of!(CUDA_RESOURCE_DESC, res) == 8);
    assert!(offset_of!(CUDA_RESOURCE_DESC, flags) == 136);
    assert!(size_of::<CUDA_TEXTURE_DESC>() == 104);
    assert!(offset_of!(CUDA_TEXTURE_DESC, borderColor) == 40);
    assert!(size_of::<CUDA_RESOURCE_VIEW_DESC>() == 112);
    assert!(offset_of!(CUDA_RESOURCE_VIEW_DESC, width) == 8);
    assert!(size_of::<CUDA_MEMCPY2D>() == 128);
    assert!(offset_of!(CUDA_MEMCPY2D, dstXInBytes) == 56);
    assert!(offset_of!(CUDA_MEMCPY2D, WidthInBytes) == 112);
    assert!(size_of::<CUDA_MEMCPY3D>() == 200);
    assert!(offset_of!(CUDA_MEMCPY3D, dstXInBytes) == 88);
    assert!(offset_of!(CUDA_MEMCPY3D, WidthInBytes) == 176);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_unions_round_trip() {
        let linear = Resource::Linear(LinearResource {
            devPtr: 0x7f00_0000_1000,
            format: format::FLOAT,
            numChannels: 4,
            sizeInBytes: 4096,
        });
        let pitch = Resource::Pitch2D(Pitch2DResource {
            devPtr: 0x7f00_0000_2000,
            format: format::UNSIGNED_INT8,
            numChannels: 1,
            width: 100,
            height: 50,
            pitchInBytes: 512,
        });
        for r in [
            Resource::Array(0x1234),
            Resource::Mipmapped(0x99),
            linear,
            pitch,
        ] {
            assert_eq!(CUDA_RESOURCE_DESC::new(r).resource(), Some(r));
        }
        let mut d = CUDA_RESOURCE_DESC::new(linear);
        d.resType = 9;
        assert_eq!(d.resource(), None);
    }

    /// The union's `linear` member as C lays it out: devPtr at 8, format at 16, numChannels at 20,
    /// sizeInBytes at 24 (offsets in the whole struct).
    #[test]
    fn linear_member_matches_the_c_layout() {
        let d = CUDA_RESOURCE_DESC::new(Resource::Linear(LinearResource {
            devPtr: 0x1122_3344_5566_7788,
            format: 0x20,
            numChannels: 2,
            sizeInBytes: 0x400,
        }));
        // SAFETY: a plain repr(C) struct viewed as its bytes.
        let bytes: &[u8; 144] = unsafe { &*(&raw const d).cast() };
        assert_eq!(bytes[0..4], 2u32.to_le_bytes());
        assert_eq!(bytes[8..16], 0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(bytes[16..20], 0x20u32.to_le_bytes());
        assert_eq!(bytes[20..24], 2u32.to_le_bytes());
        assert_eq!(bytes[24..32], 0x400u64.to_le_bytes());
    }

    #[test]
    fn descriptors_travel_by_value() {
        let d = CUDA_TEXTURE_DESC {
            addressMode: [1, 2, 3],
            borderColor: [0.5, 0.25, 0.0, 1.0],
            ..Default::default()
        };
        let bytes = postcard::to_allocvec(&d).unwrap();
        assert_eq!(
            postcard::from_bytes::<CUDA_TEXTURE_DESC>(&bytes).unwrap(),
            d
        );
    }
}
