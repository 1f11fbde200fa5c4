//! Frames: how messages travel on a byte stream. The one place that knows the format; the client, the
//! network host and the session process all go through it.
//!
//! ```text
//! frame := header_len: u32 LE | bulk_len: u32 LE | header: postcard message | bulk: raw bytes
//! ```
//!
//! The header is a small postcard-encoded message ([`crate::wire::Request`] or
//! [`crate::wire::ReplyFrame`]); bulk bytes (the data of a copy, a module image) travel after it as they are,
//! never through serde. So a writer can send a header and borrowed bulk bytes without first copying them
//! into one message ([`encode_head`]), and a reader decodes the small header and borrows the bulk from its
//! buffer ([`Frame`]).
//!
//! [`FrameReader`] is a sans-IO reader: feed it bytes as they arrive, take complete frames out.
//! [`PieceReader`] does the same with received buffers taken by value, leaving bulk bytes in them
//! ([`Pieces`]).
//! [`Scanner`] only checks frame boundaries and limits, for a relay that must not buffer.
//! [`read_blocking`] reads one frame from a blocking reader. A header over [`MAX_HEADER`] or bulk over
//! [`MAX_BULK`] is refused as soon as its prefix arrives, before anything is allocated for it.

use std::io::{self, Read};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Bytes of the length prefix.
pub const PREFIX_LEN: usize = 8;
/// Largest header either side accepts.
pub const MAX_HEADER: usize = 1 << 20;
/// Largest bulk part either side accepts (copies are split into [`crate::wire::COPY_CHUNK`] pieces).
pub const MAX_BULK: usize = 64 << 20;

/// A framing or decoding failure: the stream is unusable from here on.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The transport failed, or ended inside a frame.
    #[error("connection failed: {0}")]
    Io(#[from] io::Error),
    /// A frame announced a header larger than [`MAX_HEADER`].
    #[error("frame header of {0} bytes exceeds the {MAX_HEADER}-byte limit")]
    HeaderTooLarge(usize),
    /// A frame announced bulk data larger than [`MAX_BULK`].
    #[error("frame data of {0} bytes exceeds the {MAX_BULK}-byte limit")]
    BulkTooLarge(usize),
    /// The header is not a valid message.
    #[error("malformed message: {0}")]
    Malformed(#[from] postcard::Error),
}

/// A frame's two lengths, read from its prefix and checked against the limits.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Prefix {
    /// Header bytes.
    pub header_len: usize,
    /// Bulk bytes.
    pub bulk_len: usize,
}

impl Prefix {
    /// Parses and checks a prefix.
    pub fn parse(bytes: [u8; PREFIX_LEN]) -> Result<Self, FrameError> {
        let [h0, h1, h2, h3, b0, b1, b2, b3] = bytes;
        let header_len = u32::from_le_bytes([h0, h1, h2, h3]) as usize;
        let bulk_len = u32::from_le_bytes([b0, b1, b2, b3]) as usize;
        if header_len > MAX_HEADER {
            return Err(FrameError::HeaderTooLarge(header_len));
        }
        if bulk_len > MAX_BULK {
            return Err(FrameError::BulkTooLarge(bulk_len));
        }
        Ok(Self {
            header_len,
            bulk_len,
        })
    }

    /// The whole frame's length, prefix included.
    pub fn frame_len(self) -> usize {
        PREFIX_LEN + self.header_len + self.bulk_len
    }
}

/// One received frame: its header bytes (decode them with [`Frame::decode`]) and its bulk bytes.
#[derive(Clone, Debug)]
pub struct Frame {
    /// The postcard-encoded message.
    pub header: Bytes,
    /// The raw bulk bytes (empty for most messages).
    pub bulk: Bytes,
}

impl Frame {
    /// Decodes the header.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, FrameError> {
        Ok(postcard::from_bytes(&self.header)?)
    }
}

/// Appends one frame carrying `header` and `bulk` to `out`.
pub fn encode<T: Serialize>(header: &T, bulk: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    encode_head(header, bulk.len(), out)?;
    out.extend_from_slice(bulk);
    Ok(())
}

/// Appends the prefix and header of a frame whose `bulk_len` bulk bytes the caller sends right after, to a
/// `Vec<u8>` or a `BytesMut` (a client lane's batch). On failure `out` is left as it was.
pub fn encode_head<T: Serialize>(
    header: &T,
    bulk_len: usize,
    out: &mut impl BufMut,
) -> Result<(), FrameError> {
    if bulk_len > MAX_BULK {
        return Err(FrameError::BulkTooLarge(bulk_len));
    }
    // Serialized on the stack first (a launch's header is a few dozen to a few hundred bytes), the heap
    // only for a larger one: a vector of its own per frame, grown from nothing by postcard, was a good part
    // of a client's CPU per launch.
    let mut stack = [0u8; HEADER_ON_STACK];
    let on_heap;
    let encoded: &[u8] = match postcard::to_slice(header, &mut stack) {
        Ok(encoded) => encoded,
        Err(postcard::Error::SerializeBufferFull) => {
            on_heap = postcard::to_stdvec(header)?;
            &on_heap
        }
        Err(err) => return Err(err.into()),
    };
    if encoded.len() > MAX_HEADER {
        return Err(FrameError::HeaderTooLarge(encoded.len()));
    }
    // Both fit in u32: the limits above are far below 4 GiB.
    out.put_u32_le(encoded.len() as u32);
    out.put_u32_le(bulk_len as u32);
    out.put_slice(encoded);
    Ok(())
}

/// Headers up to this size are serialized without a heap allocation.
const HEADER_ON_STACK: usize = 512;

/// A sans-IO frame reader: bytes in ([`FrameReader::feed`]), whole frames out ([`FrameReader::next_frame`]).
///
/// Frames come out as [`Bytes`] views of the reader's buffer, so taking one costs no copy. A prefix over
/// the limits is an error at once; memory for a frame grows only as its bytes arrive.
#[derive(Debug, Default)]
pub struct FrameReader {
    buf: BytesMut,
}

impl FrameReader {
    /// An empty reader.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete frame, if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        let Some(prefix) = self.buf.first_chunk::<PREFIX_LEN>() else {
            return Ok(None);
        };
        let prefix = Prefix::parse(*prefix)?;
        if self.buf.len() < prefix.frame_len() {
            // Reserve for the rest of this frame as it arrives, not beyond.
            self.buf.reserve(prefix.frame_len() - self.buf.len());
            return Ok(None);
        }
        self.buf.advance(PREFIX_LEN);
        let header = self.buf.split_to(prefix.header_len).freeze();
        let bulk = self.buf.split_to(prefix.bulk_len).freeze();
        Ok(Some(Frame { header, bulk }))
    }

    /// Whether bytes of an unfinished frame are buffered (a stream ending now ends inside a frame).
    pub fn is_mid_frame(&self) -> bool {
        !self.buf.is_empty()
    }

    /// Whether a whole frame is buffered (so [`FrameReader::next_frame`] returns one without more input).
    pub fn has_frame(&self) -> bool {
        match self
            .buf
            .first_chunk::<PREFIX_LEN>()
            .map(|p| Prefix::parse(*p))
        {
            Some(Ok(prefix)) => self.buf.len() >= prefix.frame_len(),
            // A bad prefix is an error the next call reports at once.
            Some(Err(_)) => true,
            None => false,
        }
    }
}

impl FrameReader {
    /// The bytes fed and not yet taken out as frames (to go on reading the stream with a
    /// [`PieceReader`]).
    pub fn into_buffered(self) -> Bytes {
        self.buf.freeze()
    }
}

/// Bulk bytes as the transport delivered them: its pieces in order, never copied into one buffer.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct Pieces {
    parts: Vec<Bytes>,
    len: usize,
}

impl Pieces {
    /// Appends a piece.
    pub fn push(&mut self, piece: Bytes) {
        if !piece.is_empty() {
            self.len += piece.len();
            self.parts.push(piece);
        }
    }

    /// Bytes in all.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pieces, in order.
    pub fn iter(&self) -> impl Iterator<Item = &[u8]> {
        self.parts.iter().map(|part| &part[..])
    }

    /// The pieces from byte `at` on, in order (the first one cut at `at`; none if `at` is past the end).
    pub fn iter_from(&self, at: usize) -> impl Iterator<Item = &[u8]> {
        let mut skip = at;
        self.parts.iter().filter_map(move |part| {
            if skip >= part.len() {
                skip -= part.len();
                return None;
            }
            let from = std::mem::take(&mut skip);
            Some(&part[from..])
        })
    }

    /// The first `N` bytes, if there are as many (a header that may straddle pieces).
    pub fn first_chunk<const N: usize>(&self) -> Option<[u8; N]> {
        let mut out = [0; N];
        let mut at = 0;
        for part in &self.parts {
            let n = (N - at).min(part.len());
            out[at..at + n].copy_from_slice(&part[..n]);
            at += n;
            if at == N {
                return Some(out);
            }
        }
        (N == 0).then_some(out)
    }

    /// The bytes as one slice, when they arrived in one piece (or none).
    pub fn as_contiguous(&self) -> Option<&[u8]> {
        match self.parts.as_slice() {
            [] => Some(&[]),
            [one] => Some(one),
            _ => None,
        }
    }

    /// Copies the bytes from `at` on into `dst`, which must be exactly that long (`false`, and nothing
    /// copied, if it is not).
    pub fn copy_from_to(&self, at: usize, dst: &mut [u8]) -> bool {
        if at > self.len || dst.len() != self.len - at {
            return false;
        }
        let mut filled = 0;
        for part in self.iter_from(at) {
            dst[filled..filled + part.len()].copy_from_slice(part);
            filled += part.len();
        }
        true
    }

    /// Copies every byte into `dst`, which must be exactly [`Pieces::len`] long (`false`, and nothing
    /// copied, if it is not).
    pub fn copy_to_slice(&self, dst: &mut [u8]) -> bool {
        self.copy_from_to(0, dst)
    }

    /// The bytes in a vector of their own.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut all = Vec::new();
        self.gather_into(&mut all);
        all
    }

    /// Replaces what `out` holds with the bytes (a buffer kept between uses keeps its pages).
    pub fn gather_into(&self, out: &mut Vec<u8>) {
        out.clear();
        out.reserve(self.len);
        for part in &self.parts {
            out.extend_from_slice(part);
        }
    }

    /// The bytes in one buffer: no copy when they arrived in one piece.
    pub fn into_bytes(mut self) -> Bytes {
        match self.parts.len() {
            1 => self.parts.pop().unwrap_or_default(),
            _ => Bytes::from(self.to_vec()),
        }
    }
}

impl From<Bytes> for Pieces {
    fn from(bytes: Bytes) -> Self {
        let mut pieces = Self::default();
        pieces.push(bytes);
        pieces
    }
}

/// A frame as a [`PieceReader`] gives it: the header in one buffer, the bulk as it arrived.
#[derive(Clone, Debug)]
pub struct PieceFrame {
    /// The postcard-encoded message.
    pub header: Bytes,
    /// The raw bulk bytes.
    pub bulk: Pieces,
}

impl PieceFrame {
    /// Decodes the header.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, FrameError> {
        Ok(postcard::from_bytes(&self.header)?)
    }
}

/// A sans-IO frame reader that keeps bulk bytes in the buffers they arrived in
/// ([`PieceReader::feed`] takes them by value): only prefixes and headers are copied, so a large reply
/// costs the reading thread no pass over its bytes (the thread that wants them copies them once, to
/// where they go). The limits are checked as in [`FrameReader`].
#[derive(Debug, Default)]
pub struct PieceReader {
    /// The current frame's prefix and header bytes so far.
    head: BytesMut,
    prefix: Option<Prefix>,
    /// Once the header is complete: it, the bulk so far, and the bulk bytes still to come.
    body: Option<(Bytes, Pieces, usize)>,
    ready: std::collections::VecDeque<PieceFrame>,
}

impl PieceReader {
    /// A reader at a frame boundary.
    pub fn new() -> Self {
        Self::default()
    }

    /// A reader that first takes `buffered` (a [`FrameReader`]'s leftover).
    pub fn after(buffered: Bytes) -> Result<Self, FrameError> {
        let mut reader = Self::new();
        reader.feed(buffered)?;
        Ok(reader)
    }

    /// Takes received bytes; an error names a frame whose prefix breaks the limits (the stream is
    /// unusable from there).
    pub fn feed(&mut self, mut bytes: Bytes) -> Result<(), FrameError> {
        while !bytes.is_empty() {
            if let Some((_, bulk, left)) = &mut self.body {
                let n = (*left).min(bytes.len());
                bulk.push(bytes.split_to(n));
                *left -= n;
            } else {
                let wanted = match self.prefix {
                    None => PREFIX_LEN,
                    Some(prefix) => PREFIX_LEN + prefix.header_len,
                };
                let n = (wanted - self.head.len()).min(bytes.len());
                self.head.extend_from_slice(&bytes.split_to(n));
                if self.prefix.is_none()
                    && let Some(prefix) = self.head.first_chunk::<PREFIX_LEN>()
                {
                    self.prefix = Some(Prefix::parse(*prefix)?);
                }
                if let Some(prefix) = self.prefix
                    && self.head.len() == PREFIX_LEN + prefix.header_len
                {
                    let header = self.head.split_off(PREFIX_LEN).freeze();
                    self.head.clear();
                    self.body = Some((header, Pieces::default(), prefix.bulk_len));
                }
            }
            self.complete();
        }
        // A frame with neither header nor bulk bytes is complete with its prefix.
        self.complete();
        Ok(())
    }

    fn complete(&mut self) {
        if let Some((_, _, 0)) = self.body
            && let Some((header, bulk, _)) = self.body.take()
        {
            self.prefix = None;
            self.ready.push_back(PieceFrame { header, bulk });
        }
    }

    /// The next complete frame, if one has arrived.
    pub fn next_frame(&mut self) -> Option<PieceFrame> {
        self.ready.pop_front()
    }

    /// Whether bytes of an unfinished frame are held (a stream ending now ends inside a frame).
    pub fn is_mid_frame(&self) -> bool {
        !self.head.is_empty() || self.body.is_some()
    }
}

/// Follows frame boundaries in a byte stream without keeping its bytes, checking each prefix against the
/// limits: what a relay needs to refuse an oversized frame before forwarding it.
#[derive(Clone, Debug, Default)]
pub struct Scanner {
    /// Bytes of the current frame's prefix seen so far.
    prefix: Vec<u8>,
    /// Bytes of the current frame's body still to come.
    remaining: usize,
}

impl Scanner {
    /// A scanner at a frame boundary.
    pub fn new() -> Self {
        Self::default()
    }

    /// Follows `bytes`; an error names the first frame whose prefix breaks the limits.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<(), FrameError> {
        while !bytes.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(bytes.len());
                self.remaining -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (PREFIX_LEN - self.prefix.len()).min(bytes.len());
            self.prefix.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if let Some(prefix) = self.prefix.first_chunk::<PREFIX_LEN>() {
                let prefix = Prefix::parse(*prefix)?;
                self.remaining = prefix.header_len + prefix.bulk_len;
                self.prefix.clear();
            }
        }
        Ok(())
    }

    /// Whether the stream is between frames.
    pub fn at_boundary(&self) -> bool {
        self.remaining == 0 && self.prefix.is_empty()
    }
}

/// Reads one frame from a blocking reader into `buf` (reused between calls; grown without being
/// zero-filled). `Ok(None)` on a clean end of the stream between frames; an end inside a frame is an
/// error.
pub fn read_blocking<R: Read>(r: &mut R, buf: &mut Vec<u8>) -> Result<Option<Prefix>, FrameError> {
    let mut prefix = [0u8; PREFIX_LEN];
    let mut got = 0;
    while got < PREFIX_LEN {
        match r.read(&mut prefix[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(FrameError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the stream ended inside a frame's length prefix",
                )));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let prefix = Prefix::parse(prefix)?;
    let body = prefix.header_len + prefix.bulk_len;
    buf.clear();
    let read = r.take(body as u64).read_to_end(buf)?;
    if read < body {
        return Err(FrameError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the stream ended inside a frame",
        )));
    }
    Ok(Some(prefix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Deserialize, Serialize)]
    struct Msg {
        seq: u64,
        name: String,
    }

    fn msg(seq: u64) -> Msg {
        Msg {
            seq,
            name: "cuMemcpyHtoD_v2".into(),
        }
    }

    #[test]
    fn frames_round_trip_through_the_reader_in_any_split() {
        let mut stream = Vec::new();
        encode(&msg(1), b"bulk bytes", &mut stream).unwrap();
        encode(&msg(2), b"", &mut stream).unwrap();
        let mut head = Vec::new();
        encode_head(&msg(3), 3, &mut head).unwrap();
        stream.extend_from_slice(&head);
        stream.extend_from_slice(b"abc");
        for split in [1, 2, 7, 8, 9, 13, stream.len()] {
            let mut reader = FrameReader::new();
            let mut frames = Vec::new();
            for piece in stream.chunks(split) {
                reader.feed(piece);
                while let Some(frame) = reader.next_frame().unwrap() {
                    frames.push(frame);
                }
            }
            assert!(!reader.is_mid_frame());
            let decoded: Vec<(Msg, Vec<u8>)> = frames
                .iter()
                .map(|f| (f.decode().unwrap(), f.bulk.to_vec()))
                .collect();
            assert_eq!(
                decoded,
                [
                    (msg(1), b"bulk bytes".to_vec()),
                    (msg(2), Vec::new()),
                    (msg(3), b"abc".to_vec())
                ],
                "split {split}"
            );
        }
    }

    #[test]
    fn pieces_are_read_across_their_boundaries() {
        let all: Vec<u8> = (0..=255).collect();
        for cut in [1, 3, 7, 100, 256] {
            let mut pieces = Pieces::default();
            for part in all.chunks(cut) {
                pieces.push(Bytes::copy_from_slice(part));
            }
            assert_eq!(
                pieces.first_chunk::<5>(),
                Some([0, 1, 2, 3, 4]),
                "cut {cut}"
            );
            assert_eq!(pieces.as_contiguous().is_some(), cut == 256);
            for at in [0, 1, 5, 100, 255, 256] {
                let from: Vec<u8> = pieces.iter_from(at).flatten().copied().collect();
                assert_eq!(from, all[at..], "cut {cut} from {at}");
                let mut dst = vec![0; 256 - at];
                assert!(pieces.copy_from_to(at, &mut dst));
                assert_eq!(dst, all[at..]);
            }
            assert!(!pieces.copy_from_to(3, &mut [0; 3]));
            assert!(!pieces.copy_from_to(300, &mut []));
        }
        let mut short = Pieces::default();
        short.push(Bytes::from_static(b"abc"));
        assert_eq!(short.first_chunk::<4>(), None);
        assert_eq!(Pieces::default().as_contiguous(), Some(&[][..]));
    }

    #[test]
    fn the_piece_reader_gives_the_same_frames_without_copying_bulk() {
        let mut stream = Vec::new();
        encode(&msg(1), b"bulk bytes", &mut stream).unwrap();
        encode(&msg(2), b"", &mut stream).unwrap();
        encode(&msg(3), &[5; 1000], &mut stream).unwrap();
        let stream = Bytes::from(stream);
        for split in [1, 2, 7, 8, 9, 13, 100, stream.len()] {
            // The first bytes through a FrameReader, as a handshake reads them.
            let mut first = FrameReader::new();
            first.feed(&stream[..split.min(5)]);
            let mut reader = PieceReader::after(first.into_buffered()).unwrap();
            let mut frames = Vec::new();
            let mut at = split.min(5);
            while at < stream.len() {
                let end = (at + split).min(stream.len());
                reader.feed(stream.slice(at..end)).unwrap();
                frames.extend(std::iter::from_fn(|| reader.next_frame()));
                at = end;
            }
            assert!(!reader.is_mid_frame());
            let decoded: Vec<(Msg, Vec<u8>)> = frames
                .iter()
                .map(|f| {
                    let mut bulk = vec![0; f.bulk.len()];
                    assert!(f.bulk.copy_to_slice(&mut bulk));
                    assert_eq!(f.bulk.clone().into_bytes(), bulk);
                    (f.decode().unwrap(), bulk)
                })
                .collect();
            assert_eq!(
                decoded,
                [
                    (msg(1), b"bulk bytes".to_vec()),
                    (msg(2), Vec::new()),
                    (msg(3), vec![5; 1000])
                ],
                "split {split}"
            );
        }
        // Bulk pieces are views of the fed buffers, not copies.
        let mut reader = PieceReader::new();
        reader.feed(stream.clone()).unwrap();
        let first = reader.next_frame().unwrap();
        let piece = first.bulk.iter().next().unwrap();
        assert!(stream.as_ptr_range().contains(&piece.as_ptr()));
        // A prefix over the limits is refused as it arrives.
        let mut huge = Vec::new();
        huge.extend_from_slice(&0u32.to_le_bytes());
        huge.extend_from_slice(&(MAX_BULK as u32 + 1).to_le_bytes());
        assert!(matches!(
            PieceReader::new().feed(Bytes::from(huge)),
            Err(FrameError::BulkTooLarge(_))
        ));
    }

    #[test]
    fn blocking_reads_match_and_report_truncation() {
        let mut stream = Vec::new();
        encode(&msg(7), &[9; 100], &mut stream).unwrap();
        let mut buf = Vec::new();
        let mut cursor = io::Cursor::new(&stream[..]);
        let prefix = read_blocking(&mut cursor, &mut buf).unwrap().unwrap();
        assert_eq!(prefix.bulk_len, 100);
        let header: Msg = postcard::from_bytes(&buf[..prefix.header_len]).unwrap();
        assert_eq!(header, msg(7));
        assert!(read_blocking(&mut cursor, &mut buf).unwrap().is_none());
        // Cut inside the prefix and inside the body: errors, not a clean end.
        for cut in [3, PREFIX_LEN + 2, stream.len() - 1] {
            let mut cursor = io::Cursor::new(&stream[..cut]);
            assert!(
                matches!(read_blocking(&mut cursor, &mut buf), Err(FrameError::Io(_))),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn a_header_that_cannot_be_sent_leaves_what_was_encoded_before_it() {
        let mut out = Vec::new();
        encode(&msg(1), b"first", &mut out).unwrap();
        let before = out.clone();
        let huge = Msg {
            seq: 2,
            name: "x".repeat(MAX_HEADER),
        };
        assert!(matches!(
            encode_head(&huge, 0, &mut out),
            Err(FrameError::HeaderTooLarge(_))
        ));
        assert!(matches!(
            encode_head(&msg(3), MAX_BULK + 1, &mut out),
            Err(FrameError::BulkTooLarge(_))
        ));
        assert_eq!(out, before);
        // And the stream goes on, with a header too large for the stack too.
        let large = Msg {
            seq: 4,
            name: "y".repeat(3 * HEADER_ON_STACK),
        };
        encode(&large, b"", &mut out).unwrap();
        let mut reader = FrameReader::new();
        reader.feed(&out);
        let first = reader.next_frame().unwrap().unwrap();
        assert_eq!(first.decode::<Msg>().unwrap(), msg(1));
        assert_eq!(&first.bulk[..], b"first");
        let next = reader.next_frame().unwrap().unwrap();
        assert_eq!(next.decode::<Msg>().unwrap(), large);
    }

    #[test]
    fn oversized_prefixes_are_refused_before_any_allocation() {
        let mut big = Vec::new();
        big.extend_from_slice(&((MAX_HEADER as u32) + 1).to_le_bytes());
        big.extend_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            FrameReader::new().next_frame().map(|_| ()).and_then(|()| {
                let mut r = FrameReader::new();
                r.feed(&big);
                r.next_frame().map(|_| ())
            }),
            Err(FrameError::HeaderTooLarge(_))
        ));
        let mut huge_bulk = Vec::new();
        huge_bulk.extend_from_slice(&1u32.to_le_bytes());
        huge_bulk.extend_from_slice(&u32::MAX.to_le_bytes());
        let mut reader = FrameReader::new();
        reader.feed(&huge_bulk);
        assert!(matches!(
            reader.next_frame(),
            Err(FrameError::BulkTooLarge(_))
        ));
        assert!(reader.buf.capacity() < 1 << 16, "nothing reserved for it");
        let mut scanner = Scanner::new();
        assert!(matches!(
            scanner.feed(&huge_bulk),
            Err(FrameError::BulkTooLarge(_))
        ));
        let mut buf = Vec::new();
        assert!(matches!(
            read_blocking(&mut &huge_bulk[..], &mut buf),
            Err(FrameError::BulkTooLarge(_))
        ));
        assert!(matches!(
            encode_head(&msg(1), MAX_BULK + 1, &mut Vec::new()),
            Err(FrameError::BulkTooLarge(_))
        ));
    }

    #[test]
    fn the_scanner_follows_boundaries_across_splits() {
        let mut stream = Vec::new();
        for i in 0..5u64 {
            encode(&msg(i), &vec![1; i as usize * 10], &mut stream).unwrap();
        }
        for split in [1, 3, 8, 64] {
            let mut scanner = Scanner::new();
            for (i, piece) in stream.chunks(split).enumerate() {
                scanner.feed(piece).unwrap();
                let fed = ((i + 1) * split).min(stream.len());
                if fed == stream.len() {
                    assert!(scanner.at_boundary());
                }
            }
        }
        let mut scanner = Scanner::new();
        scanner.feed(&stream[..stream.len() - 1]).unwrap();
        assert!(!scanner.at_boundary());
    }

    #[test]
    fn malformed_headers_are_errors() {
        let mut stream = Vec::new();
        encode(&[0xffu8; 3], b"", &mut stream).unwrap();
        let mut reader = FrameReader::new();
        reader.feed(&stream);
        let frame = reader.next_frame().unwrap().unwrap();
        assert!(matches!(
            frame.decode::<Msg>(),
            Err(FrameError::Malformed(_))
        ));
    }
}
