//! A chunk's wire form: compressed with zstd where that pays, decided chunk by chunk, and verified
//! against its id when decoded.
//!
//! An encoded chunk is a 5-byte [`ChunkHeader`] (codec tag, decoded length) and a body. The
//! [`Encoder`] tries plain zstd and zstd over byte-shuffled data (the bytes of 2- or 4-byte
//! elements regrouped by position, so the exponent bytes of fp16/bf16/fp32 weights sit together) on
//! a small sample of the chunk, compresses the whole chunk with the best of them only when the
//! sample promises at least [`Compression::min_ratio`], and falls back to the raw bytes (borrowed,
//! not copied) whenever compression does not pay. The [`Decoder`] bounds every allocation by
//! [`MAX_CHUNK_SIZE`] and checks the result's BLAKE3 against the id that was asked for.

use std::borrow::Cow;

use crate::{ContentId, DecodeError, MAX_CHUNK_SIZE};

/// Length of a [`ChunkHeader`] on the wire.
pub const HEADER_LEN: usize = 5;

/// Chunks shorter than this are always sent raw: a zstd frame would not repay its own header.
const MIN_COMPRESS: usize = 256;
/// The codec is chosen on this many slices of the chunk...
const SAMPLES: usize = 4;
/// ... of this many bytes each (a multiple of every shuffle width), ~3% of an 8 MiB chunk per
/// candidate.
const SAMPLE_LEN: usize = 16 << 10;

/// How a chunk's body is encoded (its tag is the header's first byte).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
#[repr(u8)]
pub enum Codec {
    /// The chunk's bytes as they are.
    Raw = 0,
    /// zstd of the bytes.
    Zstd = 1,
    /// zstd of the bytes shuffled as 2-byte elements (fp16, bf16).
    Shuffle2Zstd = 2,
    /// zstd of the bytes shuffled as 4-byte elements (fp32).
    Shuffle4Zstd = 3,
}

impl Codec {
    /// Every codec the encoder may choose besides `Raw`, in the order it tries them.
    const COMPRESSED: [Codec; 3] = [Codec::Zstd, Codec::Shuffle2Zstd, Codec::Shuffle4Zstd];

    /// The tag byte.
    pub fn tag(self) -> u8 {
        self as u8
    }

    /// The codec of a tag byte.
    pub fn from_tag(tag: u8) -> Result<Self, DecodeError> {
        Ok(match tag {
            0 => Self::Raw,
            1 => Self::Zstd,
            2 => Self::Shuffle2Zstd,
            3 => Self::Shuffle4Zstd,
            other => return Err(DecodeError::UnknownCodec(other)),
        })
    }

    fn shuffle_width(self) -> Option<usize> {
        match self {
            Self::Shuffle2Zstd => Some(2),
            Self::Shuffle4Zstd => Some(4),
            Self::Raw | Self::Zstd => None,
        }
    }
}

/// The fixed part of an encoded chunk: its codec and decoded length.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct ChunkHeader {
    /// How the body is encoded.
    pub codec: Codec,
    /// The chunk's length once decoded (at most [`MAX_CHUNK_SIZE`]).
    pub raw_len: u32,
}

impl ChunkHeader {
    /// Splits an encoded chunk into its header and body, checking the header.
    pub fn parse(wire: &[u8]) -> Result<(Self, &[u8]), DecodeError> {
        let Some((head, body)) = wire.split_first_chunk::<HEADER_LEN>() else {
            return Err(DecodeError::Truncated {
                what: "chunk",
                needed: HEADER_LEN,
                got: wire.len(),
            });
        };
        let header = Self::parse_head(*head)?;
        if header.codec == Codec::Raw && body.len() != header.raw_len as usize {
            return Err(DecodeError::Length {
                expected: header.raw_len.into(),
                actual: body.len() as u64,
            });
        }
        Ok((header, body))
    }

    /// Checks the header alone (the first [`HEADER_LEN`] bytes of an encoded chunk), for a chunk whose
    /// body is not in one slice; the caller checks a raw body's length.
    pub fn parse_head(head: [u8; HEADER_LEN]) -> Result<Self, DecodeError> {
        let codec = Codec::from_tag(head[0])?;
        let raw_len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
        if raw_len > MAX_CHUNK_SIZE {
            return Err(DecodeError::TooLarge {
                what: "chunk",
                len: raw_len.into(),
                max: MAX_CHUNK_SIZE.into(),
            });
        }
        Ok(Self { codec, raw_len })
    }

    /// The header's wire bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let len = self.raw_len.to_le_bytes();
        [self.codec.tag(), len[0], len[1], len[2], len[3]]
    }
}

/// When the [`Encoder`] compresses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Compression {
    /// Off: every chunk goes raw (for links faster than the cores can compress).
    pub enabled: bool,
    /// zstd level; low levels are as good as high ones on weights (rust-stack-notes §6).
    pub level: i32,
    /// A chunk is sent compressed only if that makes it at least this many times smaller.
    pub min_ratio: f64,
}

impl Compression {
    /// Never compress.
    pub const OFF: Self = Self {
        enabled: false,
        level: 1,
        min_ratio: f64::INFINITY,
    };

    /// What one core compresses per second, conservatively: weights at level 1, sampling included
    /// (250-500 MB/s measured on a loaded 2-core VM; rust-stack-notes §6 has 830 MB/s on a quiet one).
    pub const BYTES_PER_SEC_PER_CORE: f64 = 250e6;

    /// The default policy if `cores` can compress faster than the link carries bytes (with a 1.5x
    /// margin for the rest of the sender's work: hashing, encryption), else [`OFF`](Self::OFF).
    /// Chunks are compressed in parallel and pipelined with sending, so compression pays exactly
    /// when it is not the bottleneck.
    pub fn for_link(link_bytes_per_sec: f64, cores: usize) -> Self {
        if cores as f64 * Self::BYTES_PER_SEC_PER_CORE > 1.5 * link_bytes_per_sec {
            Self::default()
        } else {
            Self::OFF
        }
    }
}

impl Default for Compression {
    /// zstd level 1, kept when it saves at least 10%.
    fn default() -> Self {
        Self {
            enabled: true,
            level: 1,
            min_ratio: 1.1,
        }
    }
}

/// A chunk ready for the wire: send [`header`](Self::header)'s bytes, then [`body`](Self::body).
#[derive(Clone, Debug)]
pub struct Encoded<'a> {
    /// Codec and decoded length.
    pub header: ChunkHeader,
    /// The encoded bytes: borrowed from the chunk when raw.
    pub body: Cow<'a, [u8]>,
}

impl Encoded<'_> {
    /// Bytes on the wire, header included.
    pub fn wire_len(&self) -> usize {
        HEADER_LEN + self.body.len()
    }

    /// Header and body in one buffer (a copy; a transport can send the two parts instead).
    pub fn to_wire(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.wire_len());
        out.extend_from_slice(&self.header.encode());
        out.extend_from_slice(&self.body);
        out
    }
}

/// Encodes chunks for the wire; keeps its zstd context and buffers between chunks (one per thread).
pub struct Encoder {
    policy: Compression,
    zstd: Option<zstd::bulk::Compressor<'static>>,
    scratch: Scratch,
}

/// Buffers reused from chunk to chunk.
#[derive(Default)]
struct Scratch {
    sample: Vec<u8>,
    shuffled: Vec<u8>,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("policy", &self.policy)
            .field("zstd", &self.zstd.is_some())
            .finish_non_exhaustive()
    }
}

impl Encoder {
    /// An encoder following `policy`.
    pub fn new(policy: Compression) -> Self {
        let zstd = if policy.enabled {
            zstd::bulk::Compressor::new(policy.level)
                .inspect_err(|e| tracing::warn!("zstd unavailable, chunks go uncompressed: {e}"))
                .ok()
        } else {
            None
        };
        Self {
            policy,
            zstd,
            scratch: Scratch::default(),
        }
    }

    /// `chunk`'s wire form: compressed with the codec that pays best, or raw.
    ///
    /// # Panics
    /// If `chunk` is longer than [`MAX_CHUNK_SIZE`] (cut payloads with a [`Manifest`](crate::Manifest)).
    pub fn encode<'a>(&mut self, chunk: &'a [u8]) -> Encoded<'a> {
        assert!(
            chunk.len() <= MAX_CHUNK_SIZE as usize,
            "a chunk of {} bytes exceeds MAX_CHUNK_SIZE",
            chunk.len()
        );
        let raw = |chunk: &'a [u8]| Encoded {
            header: ChunkHeader {
                codec: Codec::Raw,
                raw_len: chunk.len() as u32,
            },
            body: Cow::Borrowed(chunk),
        };
        let min_ratio = self.policy.min_ratio;
        let Some(zstd) = self.zstd.as_mut().filter(|_| chunk.len() >= MIN_COMPRESS) else {
            return raw(chunk);
        };
        let Some(codec) = choose(zstd, chunk, min_ratio, &mut self.scratch) else {
            return raw(chunk);
        };
        // Capped at the size that still pays: zstd gives up as soon as it would exceed it.
        let cap = (chunk.len() as f64 / min_ratio) as usize;
        match compress(zstd, codec, chunk, cap, &mut self.scratch.shuffled) {
            Some(body) if body.len() as f64 * min_ratio <= chunk.len() as f64 => Encoded {
                header: ChunkHeader {
                    codec,
                    raw_len: chunk.len() as u32,
                },
                body: Cow::Owned(body),
            },
            _ => raw(chunk),
        }
    }

    /// `chunk` encoded with `codec` whether or not that pays (for measurements and tests; the
    /// policy's level still applies). Falls back to raw only if zstd fails or compression is off.
    ///
    /// # Panics
    /// If `chunk` is longer than [`MAX_CHUNK_SIZE`].
    pub fn encode_as<'a>(&mut self, chunk: &'a [u8], codec: Codec) -> Encoded<'a> {
        assert!(
            chunk.len() <= MAX_CHUNK_SIZE as usize,
            "chunk exceeds MAX_CHUNK_SIZE"
        );
        let raw_len = chunk.len() as u32;
        let body = match (codec, self.zstd.as_mut()) {
            (Codec::Raw, _) | (_, None) => None,
            (codec, Some(zstd)) => {
                let cap = zstd::zstd_safe::compress_bound(chunk.len());
                compress(zstd, codec, chunk, cap, &mut self.scratch.shuffled)
            }
        };
        match body {
            Some(body) => Encoded {
                header: ChunkHeader { codec, raw_len },
                body: Cow::Owned(body),
            },
            None => Encoded {
                header: ChunkHeader {
                    codec: Codec::Raw,
                    raw_len,
                },
                body: Cow::Borrowed(chunk),
            },
        }
    }
}

/// `chunk` compressed with `codec` in at most `cap` bytes, or `None` if it does not fit.
///
/// A shuffled chunk is compressed one byte plane per zstd frame (the tail joins the last plane),
/// the frames concatenated: zstd keeps one literal table per 128 KiB block, so planes sharing a
/// block would share a table and lose most of what the shuffle gained. One decompression call
/// decodes the concatenated frames.
fn compress(
    zstd: &mut zstd::bulk::Compressor<'static>,
    codec: Codec,
    chunk: &[u8],
    cap: usize,
    shuffled: &mut Vec<u8>,
) -> Option<Vec<u8>> {
    let mut body = vec![0; cap];
    let mut len = 0;
    match codec.shuffle_width() {
        Some(width) => {
            shuffle(chunk, width, shuffled);
            let plane = chunk.len() / width;
            for k in 0..width {
                let end = if k + 1 == width {
                    chunk.len()
                } else {
                    (k + 1) * plane
                };
                len += zstd
                    .compress_to_buffer(&shuffled[k * plane..end], &mut body[len..])
                    .ok()?;
            }
        }
        None => len = zstd.compress_to_buffer(chunk, &mut body[..]).ok()?,
    }
    body.truncate(len);
    Some(body)
}

/// The compressed codec that does best on a sample of `chunk`, if it reaches `min_ratio` there.
fn choose(
    zstd: &mut zstd::bulk::Compressor<'static>,
    chunk: &[u8],
    min_ratio: f64,
    scratch: &mut Scratch,
) -> Option<Codec> {
    let Scratch { sample, shuffled } = scratch;
    let sample: &[u8] = if chunk.len() <= SAMPLES * SAMPLE_LEN {
        chunk
    } else {
        // Evenly spread slices, at offsets aligned to every shuffle width.
        let stride = ((chunk.len() - SAMPLE_LEN) / (SAMPLES - 1)) & !3;
        sample.clear();
        for k in 0..SAMPLES {
            sample.extend_from_slice(&chunk[k * stride..k * stride + SAMPLE_LEN]);
        }
        sample
    };
    let mut best: Option<(usize, Codec)> = None;
    for codec in Codec::COMPRESSED {
        let Some(body) = compress(zstd, codec, sample, sample.len(), shuffled) else {
            continue;
        };
        // A later (costlier) candidate must do 1% better to be preferred.
        if best.is_none_or(|(least, _)| body.len() * 101 < least * 100) {
            best = Some((body.len(), codec));
        }
    }
    let (least, codec) = best?;
    (least as f64 * min_ratio <= sample.len() as f64).then_some(codec)
}

/// Decodes and verifies chunks; keeps its zstd context and buffer between chunks (one per thread).
#[derive(Default)]
pub struct Decoder {
    zstd: Option<zstd::bulk::Decompressor<'static>>,
    shuffled: Vec<u8>,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder").finish_non_exhaustive()
    }
}

impl Decoder {
    /// A decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Decodes the encoded chunk `wire` and checks that it is the chunk `id`.
    pub fn decode(&mut self, id: &ContentId, wire: &[u8]) -> Result<Vec<u8>, DecodeError> {
        let (header, _) = ChunkHeader::parse(wire)?;
        let mut out = vec![0; header.raw_len as usize];
        self.decode_into(id, wire, &mut out)?;
        Ok(out)
    }

    /// Decodes the encoded chunk `wire` straight into `dst`, which must have the chunk's length,
    /// and checks that it is the chunk `id`. On error `dst` holds garbage.
    pub fn decode_into(
        &mut self,
        id: &ContentId,
        wire: &[u8],
        dst: &mut [u8],
    ) -> Result<(), DecodeError> {
        let (header, body) = ChunkHeader::parse(wire)?;
        if dst.len() != header.raw_len as usize {
            return Err(DecodeError::Length {
                expected: dst.len() as u64,
                actual: header.raw_len.into(),
            });
        }
        match header.codec {
            Codec::Raw => dst.copy_from_slice(body),
            Codec::Zstd => self.decompress(body, dst)?,
            Codec::Shuffle2Zstd | Codec::Shuffle4Zstd => {
                let width = header.codec.shuffle_width().expect("a shuffled codec");
                let mut shuffled = std::mem::take(&mut self.shuffled);
                shuffled.resize(dst.len(), 0);
                let done = self.decompress(body, &mut shuffled);
                if done.is_ok() {
                    unshuffle(&shuffled, width, dst);
                }
                self.shuffled = shuffled;
                done?;
            }
        }
        let actual = ContentId::of(dst);
        if actual != *id {
            return Err(DecodeError::HashMismatch {
                expected: *id,
                actual,
            });
        }
        Ok(())
    }

    /// Decompresses `body` to exactly fill `dst` (zstd refuses to write past its end).
    fn decompress(&mut self, body: &[u8], dst: &mut [u8]) -> Result<(), DecodeError> {
        let zstd = match &mut self.zstd {
            Some(zstd) => zstd,
            empty => empty.insert(zstd::bulk::Decompressor::new().map_err(DecodeError::Zstd)?),
        };
        let n = zstd
            .decompress_to_buffer(body, dst)
            .map_err(DecodeError::Zstd)?;
        if n != dst.len() {
            return Err(DecodeError::Length {
                expected: dst.len() as u64,
                actual: n as u64,
            });
        }
        Ok(())
    }
}

/// `chunk`'s wire form under `policy` (a one-off [`Encoder`]; keep one per thread for many chunks).
pub fn encode_chunk(chunk: &[u8], policy: Compression) -> Encoded<'_> {
    Encoder::new(policy).encode(chunk)
}

/// Decodes an encoded chunk and checks that it is the chunk `id` (a one-off [`Decoder`]).
pub fn decode_chunk(id: &ContentId, wire: &[u8]) -> Result<Vec<u8>, DecodeError> {
    Decoder::new().decode(id, wire)
}

/// Regroups `src`'s bytes as `width`-byte elements (2 or 4) by byte position: all first bytes,
/// then all second bytes, and so on; a tail shorter than an element is kept as it is.
fn shuffle(src: &[u8], width: usize, dst: &mut Vec<u8>) {
    dst.clear();
    dst.resize(src.len(), 0);
    match width {
        2 => shuffle2(src, dst),
        4 => shuffle4(src, dst),
        _ => unreachable!("shuffle widths are 2 and 4"),
    }
}

/// Undoes [`shuffle`] into `dst` (of `src`'s length).
fn unshuffle(src: &[u8], width: usize, dst: &mut [u8]) {
    match width {
        2 => unshuffle2(src, dst),
        4 => unshuffle4(src, dst),
        _ => unreachable!("shuffle widths are 2 and 4"),
    }
}

// The planes are gathered and scattered a machine word at a time (SWAR: 3 GB/s where a byte-by-byte
// loop, which the compiler does not vectorize, gives 1), then element by element for the rest.

fn shuffle2(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / 2;
    let (p0, rest) = dst.split_at_mut(n);
    let (p1, tail) = rest.split_at_mut(n);
    let mut words = src[..2 * n].chunks_exact(8);
    let (mut a, mut b) = (p0.chunks_exact_mut(4), p1.chunks_exact_mut(4));
    for ((word, a), b) in (&mut words).zip(&mut a).zip(&mut b) {
        let x = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        a.copy_from_slice(&gather2(x).to_le_bytes());
        b.copy_from_slice(&gather2(x >> 8).to_le_bytes());
    }
    let rest = words.remainder().chunks_exact(2);
    for ((e, a), b) in rest.zip(a.into_remainder()).zip(b.into_remainder()) {
        (*a, *b) = (e[0], e[1]);
    }
    tail.copy_from_slice(&src[2 * n..]);
}

fn unshuffle2(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / 2;
    let (p0, rest) = src.split_at(n);
    let (p1, tail) = rest.split_at(n);
    let (body, dst_tail) = dst.split_at_mut(2 * n);
    let mut words = body.chunks_exact_mut(8);
    let (mut a, mut b) = (p0.chunks_exact(4), p1.chunks_exact(4));
    for ((word, a), b) in (&mut words).zip(&mut a).zip(&mut b) {
        let a = u32::from_le_bytes(a.try_into().expect("4 bytes"));
        let b = u32::from_le_bytes(b.try_into().expect("4 bytes"));
        word.copy_from_slice(&(scatter2(a) | scatter2(b) << 8).to_le_bytes());
    }
    let rest = words.into_remainder().chunks_exact_mut(2);
    for ((e, a), b) in rest.zip(a.remainder()).zip(b.remainder()) {
        (e[0], e[1]) = (*a, *b);
    }
    dst_tail.copy_from_slice(tail);
}

fn shuffle4(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / 4;
    let (planes, tail) = dst.split_at_mut(4 * n);
    let (p01, p23) = planes.split_at_mut(2 * n);
    let ((p0, p1), (p2, p3)) = (p01.split_at_mut(n), p23.split_at_mut(n));
    let mut words = src[..4 * n].chunks_exact(16);
    let mut planes = [p0, p1, p2, p3].map(|p| p.chunks_exact_mut(4));
    'words: for word in &mut words {
        let x = u128::from_le_bytes(word.try_into().expect("16 bytes"));
        for (k, plane) in planes.iter_mut().enumerate() {
            let Some(out) = plane.next() else {
                break 'words;
            };
            out.copy_from_slice(&gather4(x >> (8 * k)).to_le_bytes());
        }
    }
    let [a, b, c, d] = planes.map(std::slice::ChunksExactMut::into_remainder);
    let rest = words.remainder().chunks_exact(4);
    for ((((e, a), b), c), d) in rest.zip(a).zip(b).zip(c).zip(d) {
        (*a, *b, *c, *d) = (e[0], e[1], e[2], e[3]);
    }
    tail.copy_from_slice(&src[4 * n..]);
}

fn unshuffle4(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / 4;
    let (planes, tail) = src.split_at(4 * n);
    let (body, dst_tail) = dst.split_at_mut(4 * n);
    let mut planes: [_; 4] = std::array::from_fn(|k| planes[k * n..(k + 1) * n].chunks_exact(4));
    let mut words = body.chunks_exact_mut(16);
    'words: for word in &mut words {
        let mut x = 0u128;
        for (k, plane) in planes.iter_mut().enumerate() {
            let Some(bytes) = plane.next() else {
                break 'words;
            };
            x |= scatter4(u32::from_le_bytes(bytes.try_into().expect("4 bytes"))) << (8 * k);
        }
        word.copy_from_slice(&x.to_le_bytes());
    }
    let [a, b, c, d] = planes.map(|p| p.remainder());
    let rest = words.into_remainder().chunks_exact_mut(4);
    for ((((e, a), b), c), d) in rest.zip(a).zip(b).zip(c).zip(d) {
        (e[0], e[1], e[2], e[3]) = (*a, *b, *c, *d);
    }
    dst_tail.copy_from_slice(tail);
}

/// Bytes 0, 2, 4, 6 of `x`, packed.
fn gather2(x: u64) -> u32 {
    let v = x & 0x00FF_00FF_00FF_00FF;
    let v = (v | v >> 8) & 0x0000_FFFF_0000_FFFF;
    (v | v >> 16) as u32
}

/// The inverse: the 4 bytes of `x` at bytes 0, 2, 4, 6.
fn scatter2(x: u32) -> u64 {
    let v = u64::from(x);
    let v = (v | v << 16) & 0x0000_FFFF_0000_FFFF;
    (v | v << 8) & 0x00FF_00FF_00FF_00FF
}

/// Bytes 0, 4, 8, 12 of `x`, packed.
fn gather4(x: u128) -> u32 {
    let v = x & 0x0000_00FF_0000_00FF_0000_00FF_0000_00FF;
    let v = (v | v >> 24) & 0x0000_0000_0000_FFFF_0000_0000_0000_FFFF;
    (v | v >> 48) as u32
}

/// The inverse: the 4 bytes of `x` at bytes 0, 4, 8, 12.
fn scatter4(x: u32) -> u128 {
    let v = u128::from(x);
    let v = (v | v << 48) & 0x0000_0000_0000_FFFF_0000_0000_0000_FFFF;
    (v | v << 24) & 0x0000_00FF_0000_00FF_0000_00FF_0000_00FF
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fp16 weights ~ N(0, 0.02) from a fixed seed (Box-Muller over a xorshift generator).
    fn fp16_weights(n: usize) -> Vec<u8> {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n)
            .flat_map(|_| {
                let z = (-2.0 * uniform().ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos();
                half::f16::from_f64(0.02 * z).to_le_bytes()
            })
            .collect()
    }

    fn noise(n: usize) -> Vec<u8> {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect()
    }

    fn round_trip(data: &[u8]) -> Encoded<'_> {
        let id = ContentId::of(data);
        let encoded = encode_chunk(data, Compression::default());
        let wire = encoded.to_wire();
        assert_eq!(decode_chunk(&id, &wire).unwrap(), data);
        let mut dst = vec![0xAA; data.len()];
        Decoder::new().decode_into(&id, &wire, &mut dst).unwrap();
        assert_eq!(dst, data);
        encoded
    }

    #[test]
    fn shuffle_round_trips_with_tails() {
        for len in [0, 1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 1001, 1003] {
            let src = noise(len);
            for width in [2, 4] {
                let mut s = Vec::new();
                shuffle(&src, width, &mut s);
                let mut back = vec![0; len];
                unshuffle(&s, width, &mut back);
                assert_eq!(back, src, "len {len} width {width}");
            }
        }
        let mut s = Vec::new();
        shuffle(&[1, 2, 3, 4, 5], 2, &mut s);
        assert_eq!(s, [1, 3, 2, 4, 5]);
    }

    #[test]
    fn each_kind_of_data_gets_the_codec_that_pays() {
        assert_eq!(round_trip(&noise(300_000)).header.codec, Codec::Raw);
        let zeros = round_trip(&[0; 300_000]);
        assert_ne!(zeros.header.codec, Codec::Raw);
        assert!(zeros.wire_len() < 1000);
        let weights = fp16_weights(150_000);
        let encoded = round_trip(&weights);
        assert_eq!(encoded.header.codec, Codec::Shuffle2Zstd);
        assert!(encoded.wire_len() as f64 * 1.1 < weights.len() as f64);
        // Small chunks and a disabled policy go raw, borrowed.
        assert_eq!(round_trip(&[0; 100]).header.codec, Codec::Raw);
        let off = encode_chunk(&[0; 300_000], Compression::OFF);
        assert!(off.header.codec == Codec::Raw && matches!(off.body, Cow::Borrowed(_)));
    }

    #[test]
    fn compression_is_for_links_slower_than_the_cores() {
        let gbe = 125e6;
        assert!(Compression::for_link(gbe, 2).enabled);
        assert!(!Compression::for_link(10.0 * gbe, 2).enabled);
        assert!(Compression::for_link(10.0 * gbe, 16).enabled);
    }

    #[test]
    fn decoding_rejects_what_a_peer_should_not_send() {
        let data = fp16_weights(50_000);
        let id = ContentId::of(&data);
        let wire = encode_chunk(&data, Compression::default()).to_wire();
        let mut decoder = Decoder::new();
        // Another chunk's bytes under this id.
        let other = ContentId::of(b"something else");
        assert!(matches!(
            decoder.decode(&other, &wire),
            Err(DecodeError::HashMismatch { .. })
        ));
        // A flipped body byte: zstd fails or the hash does.
        let mut flipped = wire.clone();
        let last = flipped.len() - 10;
        flipped[last] ^= 0x40;
        assert!(decoder.decode(&id, &flipped).is_err());
        // A declared length that lies, a truncated header, an unknown codec, an oversized chunk.
        let mut short = wire.clone();
        short[1..5].copy_from_slice(&1000u32.to_le_bytes());
        assert!(decoder.decode(&id, &short).is_err());
        assert!(matches!(
            decoder.decode(&id, &wire[..3]),
            Err(DecodeError::Truncated { .. })
        ));
        let mut unknown = wire.clone();
        unknown[0] = 9;
        assert!(matches!(
            decoder.decode(&id, &unknown),
            Err(DecodeError::UnknownCodec(9))
        ));
        let mut huge = wire.clone();
        huge[1..5].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decoder.decode(&id, &huge),
            Err(DecodeError::TooLarge { .. })
        ));
        // A destination of the wrong length.
        let mut dst = vec![0; data.len() - 1];
        assert!(matches!(
            decoder.decode_into(&id, &wire, &mut dst),
            Err(DecodeError::Length { .. })
        ));
        // The decoder still works after all that.
        assert_eq!(decoder.decode(&id, &wire).unwrap(), data);
    }
}
