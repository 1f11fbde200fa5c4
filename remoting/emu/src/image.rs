//! From a module image to PTX text: the emu backend can only run PTX.
//!
//! Accepts PTX text (NUL-terminated or not) and fatbins holding a PTX entry (stored plainly, LZ4- or
//! ZSTD-compressed), picked with [`gleam_fatbin::Fatbin::best_ptx`]. A cubin (ELF) or a fatbin
//! with only cubins is [`ImageError::NoPtx`], which the backend reports as `CUDA_ERROR_NO_BINARY_FOR_GPU`.

use std::io::Read;

use gleam_fatbin::{Compression, Fatbin, ImageKind, classify};
use gleam_protocol::types::CUresult;

/// Largest decompressed PTX accepted (a guard against decompression bombs).
const MAX_PTX_BYTES: u64 = 256 << 20;

/// Why an image yields no PTX.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A cubin, or a fatbin with cubins only.
    #[error(
        "the image holds no PTX ({0}); the emu backend interprets PTX only: build with PTX embedded, e.g. nvcc -gencode arch=compute_75,code=compute_75"
    )]
    NoPtx(&'static str),
    /// The image is empty.
    #[error("the image is empty")]
    Empty,
    /// The client sent a fatbin wrapper instead of the fatbin it points to.
    #[error("a fatbin wrapper cannot be loaded remotely (its pointer means nothing here)")]
    Wrapper,
    /// The fatbin's structure is broken.
    #[error("malformed fatbin: {0}")]
    Fatbin(#[from] gleam_fatbin::ImageError),
    /// A compressed PTX entry did not decompress.
    #[error("cannot decompress the fatbin's PTX entry ({0})")]
    Decompress(String),
    /// The PTX text is not UTF-8.
    #[error("the PTX text is not valid UTF-8")]
    NotUtf8,
}

impl ImageError {
    /// The `CUresult` the driver returns for this.
    pub fn code(&self) -> CUresult {
        match self {
            Self::NoPtx(_) => CUresult::NO_BINARY_FOR_GPU,
            _ => CUresult::INVALID_IMAGE,
        }
    }
}

/// The PTX text of an image (PTX or fatbin), for a device of SM architecture `sm`.
pub fn ptx_of(image: &[u8], sm: u32) -> Result<String, ImageError> {
    if image.is_empty() {
        return Err(ImageError::Empty);
    }
    match classify(image) {
        ImageKind::Elf => Err(ImageError::NoPtx("an ELF cubin")),
        ImageKind::FatbinWrapper => Err(ImageError::Wrapper),
        ImageKind::Ptx => text(image),
        ImageKind::Fatbin => {
            let fatbin = Fatbin::parse(image)?;
            let entry = fatbin
                .best_ptx(sm)
                .ok_or(ImageError::NoPtx("a fatbin with cubins only"))?;
            match entry.compression() {
                Compression::None => text(entry.payload),
                Compression::Zstd => {
                    let mut out = Vec::new();
                    // One frame: the stored payload may carry zero padding after it.
                    zstd::stream::read::Decoder::new(entry.payload)
                        .and_then(|d| d.single_frame().take(MAX_PTX_BYTES).read_to_end(&mut out))
                        .map_err(|e| ImageError::Decompress(format!("zstd: {e}")))?;
                    text(&out)
                }
                Compression::Lz4 => {
                    let limit = if entry.uncompressed_size > 0 {
                        entry.uncompressed_size.min(MAX_PTX_BYTES)
                    } else {
                        MAX_PTX_BYTES
                    };
                    let out = lz4_block(entry.payload, limit as usize)
                        .map_err(|e| ImageError::Decompress(format!("lz4: {e}")))?;
                    text(&out)
                }
            }
        }
    }
}

/// PTX text up to the first NUL.
fn text(bytes: &[u8]) -> Result<String, ImageError> {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    std::str::from_utf8(&bytes[..end])
        .map(str::to_owned)
        .map_err(|_| ImageError::NotUtf8)
}

/// Decodes one LZ4 block (the raw block format, no frame), producing at most `limit` bytes.
pub fn lz4_block(input: &[u8], limit: usize) -> Result<Vec<u8>, &'static str> {
    let mut out: Vec<u8> = Vec::with_capacity(limit.min(16 << 20));
    let mut i = 0;
    let byte = |i: &mut usize| -> Result<u8, &'static str> {
        let b = *input.get(*i).ok_or("truncated block")?;
        *i += 1;
        Ok(b)
    };
    let length = |i: &mut usize, mut n: usize| -> Result<usize, &'static str> {
        if n == 15 {
            loop {
                let b = byte(i)?;
                n = n.checked_add(b as usize).ok_or("length overflows")?;
                if b != 255 {
                    break;
                }
            }
        }
        Ok(n)
    };
    while i < input.len() {
        let token = byte(&mut i)?;
        let literals = length(&mut i, (token >> 4) as usize)?;
        let lit = input.get(i..i + literals).ok_or("literals past the end")?;
        if out.len() + literals > limit {
            return Err("output exceeds the declared size");
        }
        out.extend_from_slice(lit);
        i += literals;
        if i == input.len() {
            break; // the last sequence has literals only
        }
        let lo = byte(&mut i)?;
        let hi = byte(&mut i)?;
        let offset = u16::from_le_bytes([lo, hi]) as usize;
        if offset == 0 || offset > out.len() {
            return Err("match offset outside the output");
        }
        let len = length(&mut i, (token & 15) as usize)? + 4;
        if out.len() + len > limit {
            return Err("output exceeds the declared size");
        }
        let start = out.len() - offset;
        // Byte by byte: a match may overlap the bytes it produces (run-length style).
        for k in 0..len {
            let b = out[start + k];
            out.push(b);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gleam_fatbin::synth;

    #[test]
    fn lz4_literals_and_overlapping_matches() {
        // "abc" then a match of 9 at offset 3 -> "abcabcabcabc", then literal "Z".
        let block = [0x35, b'a', b'b', b'c', 3, 0, 0x10, b'Z'];
        assert_eq!(lz4_block(&block, 64).unwrap(), b"abcabcabcabcZ");
        assert!(lz4_block(&block, 5).is_err());
        assert!(lz4_block(&[0x10, b'a', 9, 0], 64).is_err());
    }

    #[test]
    fn picks_ptx_from_fatbins_and_refuses_cubins() {
        let ptx = b".version 8.0\n.target sm_75\n\0\0";
        let fat = synth::fatbin(&[
            synth::Entry {
                kind: 2,
                sm_arch: 75,
                flags: 0,
                payload: b"\x7fELF....",
            },
            synth::Entry {
                kind: 1,
                sm_arch: 75,
                flags: 0,
                payload: ptx,
            },
        ]);
        assert_eq!(ptx_of(&fat, 75).unwrap(), ".version 8.0\n.target sm_75\n");
        let cubins = synth::fatbin(&[synth::Entry {
            kind: 2,
            sm_arch: 75,
            flags: 0,
            payload: b"\x7fELF....",
        }]);
        assert_eq!(
            ptx_of(&cubins, 75).unwrap_err().code(),
            CUresult::NO_BINARY_FOR_GPU
        );
        assert_eq!(
            ptx_of(b"\x7fELF\x02\x01", 75).unwrap_err().code(),
            CUresult::NO_BINARY_FOR_GPU
        );
        let zstd_ptx = zstd::bulk::compress(&ptx[..], 3).unwrap();
        let fat = synth::fatbin(&[synth::Entry {
            kind: 1,
            sm_arch: 52,
            flags: gleam_fatbin::FLAG_COMPRESSED_ZSTD,
            payload: &zstd_ptx,
        }]);
        assert!(ptx_of(&fat, 75).unwrap().starts_with(".version 8.0"));
    }
}
