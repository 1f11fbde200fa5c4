//! 2D and 3D copies as they travel: [`Copy3D`], the canonical form of `cuMemcpy2D`/`cuMemcpy3D` and of the
//! array copies (`cuMemcpyHtoA` ...), with the client's host memory packed.
//!
//! A copy moves `depth` slices of `height` rows of `width_bytes` bytes. Each side is host memory, device
//! memory at an address, or a CUDA array. Host sides never carry an address: the source's rows are packed
//! back to back in the request's bulk bytes, and the destination's come back the same way in the reply,
//! so a host side always has `x = y = z = 0`, `pitch = width_bytes` and `height = height` (the client
//! packs and unpacks with the application's own pitches). The copy's geometry is validated here
//! ([`Copy3D::check`]), once, for every backend.

use serde::{Deserialize, Serialize};

use crate::types::CUresult;
use crate::wire::COPY_CHUNK;

/// Where one side of a copy is.
#[derive(Clone, Copy, Debug, Deserialize, Eq, PartialEq, Serialize)]
pub enum Place {
    /// The client's memory, packed in the frame's bulk bytes.
    Host,
    /// Device memory starting at this address (`srcDevice`/`dstDevice`).
    Device(u64),
    /// A CUDA array (`CUarray`).
    Array(u64),
}

/// One side of a copy: the place and the position of the first byte in it.
#[derive(Clone, Copy, Debug, Deserialize, Eq, PartialEq, Serialize)]
pub struct Side {
    /// Host, device or array.
    pub place: Place,
    /// Byte offset in a row (for arrays, a multiple of the element size).
    pub x_bytes: u64,
    /// First row.
    pub y: u64,
    /// First slice (or layer of a layered array).
    pub z: u64,
    /// Bytes from one row to the next (ignored for arrays: theirs).
    pub pitch: u64,
    /// Rows from one slice to the next (ignored for arrays: theirs).
    pub height: u64,
}

impl Side {
    /// The packed host side of a copy `width_bytes` wide and `height` rows high.
    pub fn host(width_bytes: u64, height: u64) -> Self {
        Self {
            place: Place::Host,
            x_bytes: 0,
            y: 0,
            z: 0,
            pitch: width_bytes,
            height,
        }
    }

    /// Device memory at `base` with the given pitches, starting at `(x_bytes, y, z)`.
    pub fn device(base: u64, x_bytes: u64, y: u64, z: u64, pitch: u64, height: u64) -> Self {
        Self {
            place: Place::Device(base),
            x_bytes,
            y,
            z,
            pitch,
            height,
        }
    }

    /// A CUDA array, starting at `(x_bytes, y, z)`.
    pub fn array(array: u64, x_bytes: u64, y: u64, z: u64) -> Self {
        Self {
            place: Place::Array(array),
            x_bytes,
            y,
            z,
            pitch: 0,
            height: 0,
        }
    }
}

/// The shape of a CUDA array as copies see it: rows of `row_bytes`, `rows` rows per slice, `slices`
/// slices (the depth of a 3D array, or the layers of a layered one), densely packed.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct ArrayShape {
    /// Bytes per row (`width * element size`).
    pub row_bytes: u64,
    /// Rows per slice (1 for a 1D array).
    pub rows: u64,
    /// Slices (1 for 1D and 2D arrays).
    pub slices: u64,
    /// Bytes of one element (array `x` offsets are multiples of it).
    pub elem_bytes: u64,
}

impl ArrayShape {
    /// Total bytes.
    pub fn bytes(&self) -> u64 {
        self.row_bytes * self.rows * self.slices
    }
}

/// A 2D or 3D copy, canonical.
#[derive(Clone, Copy, Debug, Deserialize, Eq, PartialEq, Serialize)]
pub struct Copy3D {
    /// Where the bytes come from.
    pub src: Side,
    /// Where they go.
    pub dst: Side,
    /// Bytes per row.
    pub width_bytes: u64,
    /// Rows per slice.
    pub height: u64,
    /// Slices.
    pub depth: u64,
}

/// Where the rows of one side of a checked copy are: row `(y, z)` of the copy starts at byte
/// `origin + z * slice_stride + y * row_stride` of the side's memory (an offset into the array's storage
/// or the packed bulk bytes, or a device address).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Rows {
    /// First byte of the copy.
    pub origin: u64,
    /// Bytes from one row to the next.
    pub row_stride: u64,
    /// Bytes from one slice to the next.
    pub slice_stride: u64,
}

impl Rows {
    /// Where row `y` of slice `z` of the copy starts.
    pub fn at(&self, y: u64, z: u64) -> u64 {
        self.origin + z * self.slice_stride + y * self.row_stride
    }
}

impl Copy3D {
    /// Bytes the host side moves (each host side is packed: width * height * depth), `None` on overflow.
    pub fn packed_bytes(&self) -> Option<u64> {
        self.width_bytes
            .checked_mul(self.height)?
            .checked_mul(self.depth)
    }

    /// Whether the copy moves nothing.
    pub fn is_empty(&self) -> bool {
        self.width_bytes == 0 || self.height == 0 || self.depth == 0
    }

    /// Validates the copy for CUDA's rules (pitches at least as wide as the rows they hold, everything
    /// inside the arrays) and says where each side's rows
    /// are. `shape` gives the shape of an array side. Errors are `CUDA_ERROR_INVALID_VALUE`.
    pub fn check(
        &self,
        shape: impl Fn(u64) -> Result<ArrayShape, CUresult>,
    ) -> Result<(Rows, Rows), CUresult> {
        let invalid = CUresult::INVALID_VALUE;
        self.packed_bytes().ok_or(invalid)?;
        let side = |s: &Side| -> Result<Rows, CUresult> {
            match s.place {
                Place::Host => {
                    if s.x_bytes != 0 || s.y != 0 || s.z != 0 {
                        return Err(invalid);
                    }
                    Ok(Rows {
                        origin: 0,
                        row_stride: self.width_bytes,
                        slice_stride: self.width_bytes * self.height,
                    })
                }
                Place::Device(base) => {
                    // Pitch 0 is accepted when it is never used (one row per slice, one slice).
                    let pitch = s.pitch;
                    if (self.height > 1 || self.depth > 1) && pitch < s.x_bytes + self.width_bytes {
                        return Err(invalid);
                    }
                    if self.depth > 1 && s.height < s.y + self.height {
                        return Err(invalid);
                    }
                    let slice = pitch.checked_mul(s.height).ok_or(invalid)?;
                    let origin =
                        s.z.checked_mul(slice)
                            .and_then(|o| o.checked_add(s.y.checked_mul(pitch)?))
                            .and_then(|o| o.checked_add(s.x_bytes))
                            .and_then(|o| o.checked_add(base))
                            .ok_or(invalid)?;
                    Ok(Rows {
                        origin,
                        row_stride: pitch,
                        slice_stride: slice,
                    })
                }
                Place::Array(handle) => {
                    let a = shape(handle)?;
                    let inside = |start: u64, len: u64, limit: u64| {
                        start.checked_add(len).is_some_and(|end| end <= limit)
                    };
                    // An offset inside an element is accepted (NVIDIA's driver 580 copies from it: recorded
                    // by tests/remote/driver_memory.c on the H200); the row must hold the copy.
                    if a.elem_bytes == 0
                        || !inside(s.x_bytes, self.width_bytes, a.row_bytes)
                        || !inside(s.y, self.height, a.rows)
                        || !inside(s.z, self.depth, a.slices)
                    {
                        return Err(invalid);
                    }
                    let slice = a.row_bytes * a.rows;
                    Ok(Rows {
                        origin: s.z * slice + s.y * a.row_bytes + s.x_bytes,
                        row_stride: a.row_bytes,
                        slice_stride: slice,
                    })
                }
            }
        };
        Ok((side(&self.src)?, side(&self.dst)?))
    }

    /// Splits the copy into pieces whose packed host bytes each fit in `limit` (whole rows where a row
    /// fits, else pieces of rows), in order: the pieces' host bytes are the copy's, back to back.
    /// A copy without a host side is one piece.
    pub fn split(&self, limit: u64) -> Vec<Copy3D> {
        let host = matches!(self.src.place, Place::Host) || matches!(self.dst.place, Place::Host);
        let limit = limit.max(1);
        if !host || self.is_empty() || self.packed_bytes().is_some_and(|n| n <= limit) {
            return vec![*self];
        }
        let mut pieces = Vec::new();
        // Moves a side to row (y, z) of the copy, column `x` (host sides stay packed: their position is
        // implicit in the order of the pieces).
        let at = |s: &Side, x: u64, y: u64, z: u64| -> Side {
            match s.place {
                Place::Host => *s,
                _ => Side {
                    x_bytes: s.x_bytes + x,
                    y: s.y + y,
                    z: s.z + z,
                    ..*s
                },
            }
        };
        let piece = |x: u64, y: u64, z: u64, w: u64, h: u64| Copy3D {
            src: Side {
                pitch: if self.src.place == Place::Host {
                    w
                } else {
                    self.src.pitch
                },
                height: if self.src.place == Place::Host {
                    h
                } else {
                    self.src.height
                },
                ..at(&self.src, x, y, z)
            },
            dst: Side {
                pitch: if self.dst.place == Place::Host {
                    w
                } else {
                    self.dst.pitch
                },
                height: if self.dst.place == Place::Host {
                    h
                } else {
                    self.dst.height
                },
                ..at(&self.dst, x, y, z)
            },
            width_bytes: w,
            height: h,
            depth: 1,
        };
        for z in 0..self.depth {
            if self.width_bytes <= limit {
                let rows = (limit / self.width_bytes).max(1);
                let mut y = 0;
                while y < self.height {
                    let h = rows.min(self.height - y);
                    pieces.push(piece(0, y, z, self.width_bytes, h));
                    y += h;
                }
            } else {
                for y in 0..self.height {
                    let mut x = 0;
                    while x < self.width_bytes {
                        let w = limit.min(self.width_bytes - x);
                        pieces.push(piece(x, y, z, w, 1));
                        x += w;
                    }
                }
            }
        }
        pieces
    }
}

/// Splits a copy into pieces that fit one frame each ([`COPY_CHUNK`] host bytes).
pub fn pieces(copy: &Copy3D) -> Vec<Copy3D> {
    copy.split(COPY_CHUNK as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(_: u64) -> Result<ArrayShape, CUresult> {
        // A 2D array of 16 x 8 float2 (8-byte elements).
        Ok(ArrayShape {
            row_bytes: 128,
            rows: 8,
            slices: 1,
            elem_bytes: 8,
        })
    }

    #[test]
    fn rows_of_each_side() {
        let c = Copy3D {
            src: Side::device(0x1000, 16, 2, 0, 256, 0),
            dst: Side::array(7, 8, 1, 0),
            width_bytes: 64,
            height: 3,
            depth: 1,
        };
        let (s, d) = c.check(shape).unwrap();
        assert_eq!(s.at(0, 0), 0x1000 + 2 * 256 + 16);
        assert_eq!(s.at(1, 0), 0x1000 + 3 * 256 + 16);
        assert_eq!(d.at(0, 0), 128 + 8);
        assert_eq!(d.at(2, 0), 3 * 128 + 8);
    }

    #[test]
    fn cudas_rules_are_checked() {
        let ok = Copy3D {
            src: Side::host(64, 3),
            dst: Side::array(7, 0, 0, 0),
            width_bytes: 64,
            height: 3,
            depth: 1,
        };
        assert!(ok.check(shape).is_ok());
        // An offset inside an element is accepted, as NVIDIA's driver accepts it.
        let unaligned = Copy3D {
            dst: Side::array(7, 2, 0, 0),
            ..ok
        };
        assert!(unaligned.check(shape).is_ok());
        // Past the row, past the rows, past the slices.
        for dst in [
            Side::array(7, 72, 0, 0),
            Side::array(7, 0, 6, 0),
            Side::array(7, 0, 0, 1),
        ] {
            assert_eq!(
                Copy3D { dst, ..ok }.check(shape),
                Err(CUresult::INVALID_VALUE),
                "{dst:?}"
            );
        }
        // A device pitch narrower than the rows it holds.
        let narrow = Copy3D {
            dst: Side::device(0x1000, 8, 0, 0, 64, 0),
            ..ok
        };
        assert_eq!(narrow.check(shape), Err(CUresult::INVALID_VALUE));
        // A host side with a position is not canonical.
        let mut host = ok;
        host.src.y = 1;
        assert_eq!(host.check(shape), Err(CUresult::INVALID_VALUE));
    }

    #[test]
    fn splits_keep_the_bytes_in_order() {
        let c = Copy3D {
            src: Side::host(10, 4),
            dst: Side::device(0x1000, 3, 1, 1, 64, 8),
            width_bytes: 10,
            height: 4,
            depth: 2,
        };
        // Every byte lands where the whole copy would put it.
        let place = |c: &Copy3D| {
            let (_, d) = c.check(shape).unwrap();
            let mut out = Vec::new();
            for z in 0..c.depth {
                for y in 0..c.height {
                    for x in 0..c.width_bytes {
                        out.push(d.at(y, z) + x);
                    }
                }
            }
            out
        };
        let whole = place(&c);
        for limit in [1, 7, 10, 25, 80] {
            let pieces = c.split(limit);
            assert!(pieces.iter().all(|p| p.packed_bytes().unwrap() <= limit));
            let split: Vec<u64> = pieces.iter().flat_map(place).collect();
            assert_eq!(split, whole, "limit {limit}");
        }
        assert_eq!(c.split(80).len(), 1);
    }
}

/// The bytes a 2D fill (`cuMemsetD2D8/16/32`) spans from its first byte: `height` rows of `width`
/// elements of `element` bytes, rows `pitch` bytes apart; `Ok(0)` for an empty fill. Checked as the driver
/// checks it, so the shim refuses at the call what the peer would refuse later: the address aligned to
/// the element, and (with more than one row) the pitch too, with rows that fit it.
pub fn fill_2d_span(
    dst: u64,
    pitch: usize,
    element: usize,
    width: usize,
    height: usize,
) -> Result<usize, CUresult> {
    let row = width.checked_mul(element).ok_or(CUresult::INVALID_VALUE)?;
    if element == 0
        || !dst.is_multiple_of(element as u64)
        || (height > 1 && (!pitch.is_multiple_of(element) || row > pitch))
    {
        return Err(CUresult::INVALID_VALUE);
    }
    if row == 0 || height == 0 {
        return Ok(0);
    }
    pitch
        .checked_mul(height - 1)
        .and_then(|b| b.checked_add(row))
        .ok_or(CUresult::INVALID_VALUE)
}

#[cfg(test)]
mod fill_tests {
    use super::*;

    #[test]
    fn two_d_fills_are_checked_as_the_driver_checks_them() {
        assert_eq!(fill_2d_span(0x1000, 64, 4, 10, 3), Ok(64 * 2 + 40));
        assert_eq!(fill_2d_span(0x1000, 64, 2, 0, 3), Ok(0));
        assert_eq!(fill_2d_span(0x1000, 64, 1, 5, 0), Ok(0));
        // One row needs no pitch.
        assert_eq!(fill_2d_span(0x1000, 0, 1, 5, 1), Ok(5));
        assert_eq!(
            fill_2d_span(0x1001, 64, 2, 1, 1),
            Err(CUresult::INVALID_VALUE)
        );
        assert_eq!(
            fill_2d_span(0x1000, 62, 4, 1, 2),
            Err(CUresult::INVALID_VALUE)
        );
        assert_eq!(
            fill_2d_span(0x1000, 4, 1, 8, 2),
            Err(CUresult::INVALID_VALUE)
        );
        assert_eq!(
            fill_2d_span(0x1000, usize::MAX, 1, 1, 3),
            Err(CUresult::INVALID_VALUE)
        );
    }
}
