//! Gleam's CUDA session protocol: what a client (the shim) and a serving peer say to each other.
//!
//! A session is one QUIC connection (ALPN `gleam-cuda/1`, authenticated by `gleam_auth::proof`). The client
//! opens one bidirectional stream and sends [`Request`] frames on it; the server executes them in order and
//! answers every request whose `expects_reply` is set with a [`ReplyFrame`] carrying the same `seq`.
//! Requests without a reply are fire-and-forget: if one fails on the server, its error becomes the session's
//! pending error and is returned by the next reply (CUDA's deferred errors). Sticky errors (an illegal
//! address in a kernel, ...) stay pending for the rest of the session, as on a real GPU.
//!
//! Framing: each frame is a little-endian `u32` length, then that many bytes of postcard. A frame longer
//! than [`MAX_FRAME`] or that does not decode is a protocol violation: the receiver closes the session.
//!
//! Designed to grow without a redesign: bulk data is a [`Payload`], which can later name content the server
//! already caches (by BLAKE3 hash) instead of carrying it; any request can become fire-and-forget because
//! errors are reported by sequence number.

use std::io;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::api::{ApiCall, ApiReply};
use crate::types::CUresult;

/// Bumped on any incompatible change to the messages below.
pub const PROTOCOL_VERSION: u32 = 1;
/// Largest frame either side accepts (bulk copies are split into [`COPY_CHUNK`] pieces well below it).
pub const MAX_FRAME: usize = 64 << 20;
/// Size of the pieces large host-to-device and device-to-host copies are split into.
pub const COPY_CHUNK: usize = 4 << 20;

/// One client request.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Request {
    /// Sequence number, increasing by one per request of the session (starting at 1).
    pub seq: u64,
    /// The client thread's current context when the call was made (0 = none). The server makes it current
    /// before executing the call, so thread-local context semantics survive the single ordered channel.
    pub ctx: u64,
    /// Whether the client waits for a reply. `false` = fire-and-forget.
    pub expects_reply: bool,
    /// What to do.
    pub call: Call,
}

/// The calls of the protocol: the listed driver calls ([`ApiCall`]) and the ones written by hand.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub enum Call {
    /// First request of a session. Reply: [`Reply::Hello`].
    Hello(ClientHello),
    /// A call from the declaration list. Reply: [`Reply::Api`].
    Api(ApiCall),
    /// Copy host bytes to device memory at `dst`. Synchronous copies are sent with `stream: None` and
    /// the last piece expects a reply; `Some(stream)` is `cuMemcpyHtoDAsync` (the client has already
    /// snapshotted the bytes, so it never needs to wait). Reply: [`Reply::Empty`].
    MemcpyHtoD {
        /// Destination device address.
        dst: u64,
        /// The bytes.
        data: Payload,
        /// `None` for the synchronous copy, else the stream handle.
        stream: Option<u64>,
    },
    /// Copy `len` bytes of device memory at `src` back to the client. Reply: [`Reply::Data`].
    MemcpyDtoH {
        /// Source device address.
        src: u64,
        /// Byte count (at most [`COPY_CHUNK`] per request).
        len: u64,
        /// `None` for the synchronous copy, else the stream handle (the server waits for the stream).
        stream: Option<u64>,
    },
    /// `cuModuleLoadData`/`cuModuleLoadDataEx`/`cuModuleLoad` (the client reads the file): a PTX, cubin or
    /// fatbin image. Reply: [`Reply::Module`].
    ModuleLoad {
        /// The image, exactly as many bytes as the client determined it spans.
        image: Payload,
    },
    /// `cuModuleGetFunction`. Reply: [`Reply::Function`], with everything a launch needs.
    ModuleGetFunction {
        /// Module handle.
        module: u64,
        /// Entry point name.
        name: String,
    },
    /// `cuLibraryLoadData`. Reply: [`Reply::Library`].
    LibraryLoad {
        /// The image.
        image: Payload,
    },
    /// `cuKernelGetFunction`: the function of a library kernel in the current context. Reply:
    /// [`Reply::Function`].
    KernelGetFunction {
        /// Kernel handle.
        kernel: u64,
    },
    /// `cuLaunchKernel` and friends. Fire-and-forget unless the client runs in blocking mode.
    LaunchKernel(Launch),
    /// Orderly end of the session: the server frees everything and replies [`Reply::Empty`].
    Goodbye,
}

/// A kernel launch, with its parameters already packed per the function's layout.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Launch {
    /// `CUfunction` (or a `CUkernel`, which CUDA 12+ accepts in its place).
    pub function: u64,
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// Block dimensions.
    pub block: [u32; 3],
    /// Dynamic shared memory bytes.
    pub shared_mem_bytes: u32,
    /// Stream handle (0, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` as the application passed them).
    pub stream: u64,
    /// The packed parameter buffer (`kernelParams` copied per [`FunctionInfo::params`], or `extra`'s buffer).
    pub params: Vec<u8>,
}

/// Bulk bytes: carried inline today; a content address the server may already hold tomorrow.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub enum Payload {
    /// The bytes themselves.
    Inline(#[serde(with = "serde_bytes_compat")] Vec<u8>),
}

impl Payload {
    /// Length in bytes of the content.
    pub fn len(&self) -> usize {
        match self {
            Self::Inline(bytes) => bytes.len(),
        }
    }

    /// Whether the content is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The client's greeting.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct ClientHello {
    /// [`PROTOCOL_VERSION`] of the client.
    pub protocol: u32,
    /// Human-readable description of the client (program, pid, host), for the server's logs.
    pub client: String,
}

/// A reply, matched to its request by `seq`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct ReplyFrame {
    /// The request's sequence number.
    pub seq: u64,
    /// The CUDA result the call returns to the application. Carries a pending deferred error from an
    /// earlier fire-and-forget call if there was one (that call then was not executed).
    pub result: CUresult,
    /// Out-values; [`Reply::Empty`] when `result` is an error.
    pub reply: Reply,
}

/// Out-values of a call.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub enum Reply {
    /// Nothing but the result.
    Empty,
    /// Answer to [`Call::Hello`].
    Hello(ServerHello),
    /// Answer to a listed call.
    Api(ApiReply),
    /// Bytes read from the device.
    Data(#[serde(with = "serde_bytes_compat")] Vec<u8>),
    /// A loaded module.
    Module {
        /// `CUmodule`.
        handle: u64,
    },
    /// A loaded library.
    Library {
        /// `CUlibrary`.
        handle: u64,
    },
    /// A function handle and what the client needs to launch and query it locally.
    Function {
        /// `CUfunction`.
        handle: u64,
        /// Parameter layout and attributes.
        info: FunctionInfo,
    },
}

/// What the server tells a client about itself and its GPUs at the start of a session. The client answers
/// every device query from this, without a round trip.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct ServerHello {
    /// The server's [`PROTOCOL_VERSION`].
    pub protocol: u32,
    /// The serving driver's `cuDriverGetVersion` (e.g. 13000).
    pub driver_version: i32,
    /// `"cuda"` for a real GPU, `"emu"` for the GPU-less backend.
    pub backend: String,
    /// Human-readable server description for the client's logs.
    pub server: String,
    /// The devices the session may use, by ordinal.
    pub devices: Vec<DeviceInfo>,
}

/// One device, as `cuDeviceGet*` describe it.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct DeviceInfo {
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceGetUuid_v2`.
    pub uuid: [u8; 16],
    /// `cuDeviceTotalMem_v2`.
    pub total_mem: u64,
    /// `cuDeviceGetAttribute` for every attribute id from 1 up to the driver's last one; index = id
    /// (index 0 unused). An attribute the device does not support holds 0.
    pub attributes: Vec<i32>,
    /// `cuDeviceGetPCIBusId`, e.g. `"0000:3b:00.0"`.
    pub pci_bus_id: String,
}

/// A function's parameter layout and attributes, returned with its handle so that launches and
/// `cuFuncGetAttribute` need no round trip.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct FunctionInfo {
    /// Each parameter's (offset, size) in the packed buffer, in declaration order (`cuFuncGetParamInfo`).
    pub params: Vec<ParamSlot>,
    /// `cuFuncGetAttribute` values, indexed by `CUfunction_attribute` (0 = MAX_THREADS_PER_BLOCK ...).
    pub attributes: Vec<i32>,
}

/// One kernel parameter's place in the packed buffer.
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct ParamSlot {
    /// Byte offset.
    pub offset: u32,
    /// Byte size.
    pub size: u32,
}

impl FunctionInfo {
    /// Total size of the packed parameter buffer.
    pub fn params_bytes(&self) -> usize {
        self.params
            .iter()
            .map(|p| (p.offset + p.size) as usize)
            .max()
            .unwrap_or(0)
    }
}

/// A framing or decoding failure: the session is over.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The transport failed or closed mid-frame.
    #[error("connection failed: {0}")]
    Io(#[from] io::Error),
    /// The peer announced a frame larger than [`MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    FrameTooLarge(usize),
    /// The frame's bytes are not a valid message.
    #[error("malformed message: {0}")]
    Malformed(#[from] postcard::Error),
}

/// Encodes `msg` as one frame (length prefix included), appending to `out`.
pub fn encode_frame<T: Serialize>(msg: &T, out: &mut Vec<u8>) -> Result<(), WireError> {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    let mut out_vec = std::mem::take(out);
    out_vec = postcard::to_extend(msg, out_vec)?;
    *out = out_vec;
    let len = out.len() - start - 4;
    if len > MAX_FRAME {
        out.truncate(start);
        return Err(WireError::FrameTooLarge(len));
    }
    out[start..start + 4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

/// Decodes one frame body (without its length prefix).
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    Ok(postcard::from_bytes(body)?)
}

/// Reads one raw frame body into `buf` (async). `Ok(false)` on a clean end of stream between frames.
pub async fn read_frame_body<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<bool, WireError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(false),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(WireError::FrameTooLarge(len));
    }
    buf.clear();
    buf.resize(len, 0);
    r.read_exact(buf).await?;
    Ok(true)
}

/// Reads and decodes one frame (async). `Ok(None)` on a clean end of stream.
pub async fn read_frame<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<Option<T>, WireError> {
    if !read_frame_body(r, buf).await? {
        return Ok(None);
    }
    decode(buf).map(Some)
}

/// Encodes and writes one frame (async).
pub async fn write_frame<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), WireError> {
    let mut out = Vec::new();
    encode_frame(msg, &mut out)?;
    w.write_all(&out).await?;
    Ok(())
}

/// Reads one raw frame body (blocking). `Ok(false)` on a clean end of stream between frames.
pub fn read_frame_body_blocking<R: io::Read>(
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<bool, WireError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(false),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(WireError::FrameTooLarge(len));
    }
    buf.clear();
    buf.resize(len, 0);
    r.read_exact(buf)?;
    Ok(true)
}

/// Bulk bytes as one serde "bytes" value: postcard then copies them in one go instead of element by element.
mod serde_bytes_compat {
    use serde::{Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
                while let Some(b) = seq.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        d.deserialize_bytes(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let req = Request {
            seq: 7,
            ctx: 0x5555,
            expects_reply: false,
            call: Call::MemcpyHtoD {
                dst: 0x7f00_0000_0000,
                data: Payload::Inline(vec![1, 2, 3]),
                stream: Some(9),
            },
        };
        let mut out = Vec::new();
        encode_frame(&req, &mut out).unwrap();
        let mut cursor = io::Cursor::new(out);
        let mut buf = Vec::new();
        assert!(read_frame_body_blocking(&mut cursor, &mut buf).unwrap());
        let back: Request = decode(&buf).unwrap();
        assert_eq!(back.seq, 7);
        match back.call {
            Call::MemcpyHtoD {
                dst,
                data: Payload::Inline(d),
                stream,
            } => {
                assert_eq!((dst, d, stream), (0x7f00_0000_0000, vec![1, 2, 3], Some(9)));
            }
            other => panic!("wrong call {other:?}"),
        }
        assert!(!read_frame_body_blocking(&mut cursor, &mut buf).unwrap());
    }

    #[test]
    fn oversized_and_malformed_frames_are_errors() {
        let mut bad = Vec::new();
        bad.extend_from_slice(&((MAX_FRAME as u32) + 1).to_le_bytes());
        let mut buf = Vec::new();
        assert!(matches!(
            read_frame_body_blocking(&mut io::Cursor::new(bad), &mut buf),
            Err(WireError::FrameTooLarge(_))
        ));
        assert!(matches!(
            decode::<Request>(&[0xff, 0xff, 0xff]),
            Err(WireError::Malformed(_))
        ));
    }
}
