//! Gleam's CUDA session protocol: what a client (the shim) and a serving peer say to each other.
//!
//! A session is one QUIC connection (ALPN `gleam-cuda/1`, authenticated by `gleam_auth::proof`). The client
//! opens one bidirectional stream and sends [`Request`] frames on it; the server executes them in order and
//! answers every request whose `expects_reply` is set with a [`ReplyFrame`] carrying the same `seq`.
//! Requests without a reply are fire-and-forget: if one fails on the server, its error becomes the session's
//! pending error and is returned by the next reply (CUDA's deferred errors). Sticky errors (an illegal
//! address in a kernel, ...) stay pending for the rest of the session, as on a real GPU.
//!
//! Each message travels as one [`crate::frame`]: a small postcard header (these types) and, for the calls
//! that carry data (a host-to-device copy, a module image, a device-to-host reply), the bytes themselves as
//! the frame's bulk part, outside serde.

use serde::{Deserialize, Serialize};

use crate::api::{ApiCall, ApiReply};
use crate::copy::Copy3D;
use crate::types::CUresult;

/// Bumped on any incompatible change to the messages below or to the framing.
pub const PROTOCOL_VERSION: u32 = 11;
/// QUIC close code of a connection the client abandons while resuming a session (an attempt that broke
/// off, or lost to a newer one): the session waits for the next attempt, where any other close by the
/// client ends it.
pub const CLOSE_RESUME_ABANDONED: u32 = 0x4743_0006;
/// Size of the pieces large host-to-device and device-to-host copies are split into.
pub const COPY_CHUNK: usize = 4 << 20;
/// The stream whose lane carries a synchronous cached upload's chunks ([`Call::UploadChunk`] with
/// `stream: None`): a handle no driver gives out. Not on the control lane, where a segment's bulk bytes
/// would hold back the announcement of the next one ([`Call::UploadBegin`]). Not `u64::MAX` either: that
/// is the out-of-band signals' lane ([`crate::order::Lane::SIGNALS`]).
pub const SYNC_UPLOAD_STREAM: u64 = u64::MAX - 1;

/// The pseudo stream whose lane carries the chunks of the cached uploads the application queues on
/// `stream` ([`Call::UploadChunk`]; `None`: synchronous copies, [`SYNC_UPLOAD_STREAM`]). Chunks travel on
/// lanes of their own, not on the copy's stream's lane, so that a client can send them over its bulk
/// connection ([`StreamOpen::Bulk`]) while the stream's small calls keep to the session connection; the
/// copy waits for its chunks through [`upload_event`] wherever they travel. The handle has bit 62 set and
/// bit 63 clear: no driver gives out such a handle (user-space addresses and the emu's handles are far
/// below), and it is never [`SYNC_UPLOAD_STREAM`] nor the signals' lane. Stripe 0's:
/// [`bulk_stream`] gives the others.
pub fn upload_chunk_stream(stream: Option<u64>) -> u64 {
    match stream {
        None => SYNC_UPLOAD_STREAM,
        Some(s) => BULK_STREAM_BIT | (s & !(0b11 << 62)),
    }
}

/// Bulk connections a client may stripe its bulk bytes over ([`bulk_stream`]'s `stripe` is below it).
pub const MAX_STRIPES: u8 = 4;

/// The pseudo stream of `stream`'s bulk lane number `stripe` (below [`MAX_STRIPES`]; 0 is
/// [`upload_chunk_stream`]'s): a client with several bulk connections opens stripe `k`'s lanes on its
/// `k`-th, so that one large copy's bytes cross on several connections at once, each with its own
/// congestion window and encrypted by its own thread ([`Call::UploadChunk`]'s and
/// [`Call::MemcpyDtoH`]'s `stripe`). The stripe flips bits 56-61, which no handle has (see
/// [`upload_chunk_stream`]): a handle that did would only share lanes with another stripe.
pub fn bulk_stream(stream: Option<u64>, stripe: u8) -> u64 {
    upload_chunk_stream(stream) ^ (u64::from(stripe & STRIPE_BITS) << STRIPE_SHIFT)
}

/// Where [`bulk_stream`] puts the stripe.
const STRIPE_SHIFT: u32 = 56;
const STRIPE_BITS: u8 = 0x3f;

/// The stripe of a bulk lane's pseudo stream ([`bulk_stream`]), for the connection it travels on.
pub fn stripe_of(stream: u64) -> u8 {
    let base = if stream >> 62 == 0b11 {
        SYNC_UPLOAD_STREAM
    } else {
        // Stripe 0 of the same stream: bits 56-61 as `upload_chunk_stream` left them, which for a
        // handle below 2^56 (every one a driver gives out) is zero.
        stream & !(u64::from(STRIPE_BITS) << STRIPE_SHIFT)
    };
    (((stream ^ base) >> STRIPE_SHIFT) as u8) & STRIPE_BITS
}

/// The bit that marks [`upload_chunk_stream`]'s pseudo streams of asynchronous copies.
const BULK_STREAM_BIT: u64 = 1 << 62;

/// Whether `stream` is one of [`bulk_stream`]'s pseudo streams: its lane carries bulk bytes.
pub fn is_upload_chunk_stream(stream: u64) -> bool {
    stream | (u64::from(STRIPE_BITS) << STRIPE_SHIFT) == SYNC_UPLOAD_STREAM || stream >> 62 == 0b01
}

/// The pseudo event an upload's chunks record and its copy waits for ([`crate::order::Ordering`]): a
/// handle no driver gives out (the top bit set), one per upload.
pub fn upload_event(upload: u64) -> u64 {
    upload | (1 << 63)
}

/// The first exchange, on the serving peer's own connection (the address discovery and `gleam run` dial):
/// the client asks for a session; the peer starts the session's process, which listens on an endpoint of
/// its own, and says where. The client then connects there directly (no relay in the data path) and keeps
/// this connection as the session's lifeline: the peer closes it with the reason if the session process
/// dies.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub enum Control {
    /// Client: "start a session for me".
    Open {
        /// The client's [`PROTOCOL_VERSION`].
        protocol: u32,
    },
    /// Peer: the session process listens on `port` (same address as this connection), and admits the
    /// client that presents `token` over a connection authenticated as the same peer.
    Offer {
        /// UDP port of the session process's endpoint.
        port: u16,
        /// The session's secret: it admits the client (over a connection authenticated as the same
        /// peer), and again when it resumes the session after a drop ([`Control::Resume`],
        /// [`StreamOpen::Resume`]). Handed over on this authenticated connection only.
        token: [u8; 32],
        /// The session's number at this peer, to name it in [`Control::Resume`].
        session: u64,
        /// How long the session outlives a silent link, in milliseconds, counted from the last time
        /// the peer heard from the client: a client that comes back within it resumes the session.
        grace_ms: u64,
    },
    /// Client, on a new connection after a drop: "resume session `session`" (proved by its `token`;
    /// the connection must be authenticated as the peer that opened it). The peer answers with the
    /// session's [`Control::Offer`] (the same port and token) if the session lives, or
    /// [`Control::Gone`] at once if not (it ended, or this peer restarted).
    Resume {
        /// The client's [`PROTOCOL_VERSION`].
        protocol: u32,
        /// [`Control::Offer::session`].
        session: u64,
        /// [`Control::Offer::token`].
        token: [u8; 32],
    },
    /// Peer: the session to resume is no more.
    Gone {
        /// Why, for the user.
        reason: String,
    },
    /// Peer: no session (another protocol version, the session process could not start...).
    Refused {
        /// The peer's [`PROTOCOL_VERSION`].
        protocol: u32,
        /// Why, for the user.
        reason: String,
    },
}

/// The first frame of every QUIC stream the client opens on a session connection.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub enum StreamOpen {
    /// The connection's first stream: admission with the token of [`Control::Offer`]; it carries the
    /// control lane ([`crate::order::Lane::CONTROL`]).
    Attach {
        /// The token.
        token: [u8; 32],
    },
    /// A further stream: the lane it carries.
    Lane {
        /// The lane.
        lane: crate::order::Lane,
    },
    /// The first stream of the session's bulk connection: a second connection to the session process,
    /// opened by the client once attached, with a congestion window (and controller) of its own, on
    /// which it opens the lanes that carry bulk bytes ([`crate::order::Lane::carries_bulk`]): a large
    /// upload does not share the session connection's congestion window.
    /// The stream carries nothing after this frame; the connection's other streams are lanes
    /// ([`StreamOpen::Lane`]). Losing it is losing the link: the client resumes the session, and the
    /// resumed session carries every lane on its one new connection.
    Bulk {
        /// The session's token.
        token: [u8; 32],
    },
    /// The first stream of a connection that resumes the session after a drop (instead of
    /// [`StreamOpen::Attach`]); it carries the control lane. The session process answers with
    /// [`Resumed`] as this stream's first frame, then sends again the replies the client still awaits
    /// (each on its lane's stream, once the client has reopened it).
    Resume {
        /// The session's token.
        token: [u8; 32],
        /// The replies the client still waits for.
        replies: crate::resume::Awaited,
    },
}

/// The session process's answer to [`StreamOpen::Resume`]: the first frame of the resumed control lane.
/// The client then sends again, per lane, the requests after these marks.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Resumed {
    /// Per lane, the last request the session process received ([`crate::resume::Marks`]).
    pub received: crate::resume::Marks,
}

/// The session process's acknowledgement of requests: per lane, the last one received
/// ([`crate::resume::Marks`]), now and then on a unidirectional stream of its own (the only one it
/// opens), so the client can forget what it keeps for resending. The client acknowledges replies the
/// same way with [`crate::resume::Awaited`] frames on its own unidirectional stream.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Acks {
    /// Per lane, the last frame received.
    pub through: crate::resume::Marks,
}

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
    /// What must run before it (see [`crate::order`]).
    pub deps: crate::order::Deps,
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
    /// Copy the frame's bulk bytes to device memory at `dst`. Synchronous copies are sent with
    /// `stream: None` and the last piece expects a reply; `Some(stream)` is `cuMemcpyHtoDAsync` (the client
    /// has already snapshotted the bytes, so it never needs to wait). Reply: [`Reply::Empty`].
    MemcpyHtoD {
        /// Destination device address.
        dst: u64,
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
        /// `Some(stripe)`: the reply travels apart, on the stream's bulk lane `stripe` ([`bulk_stream`]),
        /// which the client opens on its bulk connection of that number first, not on the stream's own
        /// lane. So a large download has congestion windows of its own, and another stream's small
        /// replies never queue behind it ([`Call::answer_lane`]).
        apart: Option<u8>,
    },
    /// `cuModuleLoadData`/`cuModuleLoadDataEx`/`cuModuleLoad` (the client reads the file): the frame's bulk
    /// bytes are a PTX, cubin or fatbin image, exactly as many bytes as the client determined it spans.
    /// Reply: [`Reply::Module`].
    ModuleLoad,
    /// `cuModuleGetFunction`. Reply: [`Reply::Function`], with everything a launch needs.
    ModuleGetFunction {
        /// Module handle.
        module: u64,
        /// Entry point name.
        name: String,
    },
    /// `cuLibraryLoadData` of the image in the frame's bulk bytes. Reply: [`Reply::Library`].
    LibraryLoad,
    /// `cuKernelGetFunction`: the function of a library kernel in the current context. Reply:
    /// [`Reply::Function`].
    KernelGetFunction {
        /// Kernel handle.
        kernel: u64,
    },
    /// `cuLaunchKernel` and friends. Fire-and-forget unless the client runs in blocking mode.
    LaunchKernel(Launch),
    /// `cuMemcpy2D`/`cuMemcpy3D` (and their async forms) and the array copies, in canonical form: a host
    /// source's bytes are the frame's bulk bytes, packed ([`Copy3D`]); a host destination's come back as
    /// [`Reply::Data`], packed. `stream: None` is the synchronous copy. Pieces fit a frame
    /// ([`crate::copy::pieces`]).
    Memcpy3D {
        /// The copy.
        copy: Copy3D,
        /// `None` for the synchronous copy, else the stream handle.
        stream: Option<u64>,
    },
    /// Writes the client's bytes into mirrored memory (managed memory, and host memory the device maps):
    /// the frame's bulk bytes are the runs' bytes back to back. Executed in request order, so before any
    /// later launch or copy. Addresses are the server's; each run lies inside one mirrored allocation.
    /// Fire-and-forget; reply [`Reply::Empty`] if asked.
    MirrorWrite {
        /// Where each piece of the bulk bytes goes.
        runs: Vec<MirrorRun>,
    },
    /// Reads mirrored memory, without waiting for any stream (concurrent access, as the device's own
    /// coherence allows). A range whose bytes hash ([`mirror_hash`]) to the client's `hash` is not sent.
    /// Reply: [`Reply::Mirror`].
    MirrorRead {
        /// The ranges wanted.
        ranges: Vec<MirrorRange>,
    },
    /// `cuLaunchKernelEx` (and `cuLaunchCooperativeKernel`) with launch attributes (cluster dimensions,
    /// cooperative, priority, programmatic launch...), which the serving driver gets as given.
    /// Fire-and-forget like [`Call::LaunchKernel`].
    LaunchKernelEx {
        /// The launch.
        launch: Launch,
        /// `CUlaunchAttribute`s, in the application's order.
        attrs: Vec<LaunchAttr>,
    },
    /// Loads the module image named by `image` as a module (`cuModuleLoadData`) or a library
    /// (`cuLibraryLoadData`). Without bulk bytes the server looks the image up among those it already has
    /// (this session's, and its content cache's: sent by any client before) and answers
    /// [`Reply::ImageWanted`] if it has none, loading nothing; the client then sends the same call with the
    /// image as the frame's bulk bytes, which the server checks against the hash and keeps. So an image
    /// crosses the network once per serving peer. Reply: [`Reply::Module`] / [`Reply::Library`].
    LoadImage {
        /// What the image is.
        image: ImageRef,
        /// `true`: load it as a library (context-independent), else as a module of the current context.
        as_library: bool,
    },
    /// Announces a host-to-device payload by content (the content cache, `gleam_cache`): `manifest` is
    /// a `gleam_cache::Manifest` in its encoded form, the ids of the payload's fixed-size chunks. The
    /// server stages the payload under the client's number `upload`, fills every chunk it holds (its
    /// content cache, verified; chunks this session sent before) and answers [`Reply::UploadWanted`] with
    /// the chunks it lacks. Bookkeeping, not a CUDA call: it runs whatever error is pending, without
    /// reporting or clearing it. Refused (`OUT_OF_MEMORY`) when the session stages too much already: the
    /// client then copies the plain way ([`Call::MemcpyHtoD`]).
    UploadBegin {
        /// The client's number for this payload (unique among its unfinished uploads).
        upload: u64,
        /// The encoded manifest.
        manifest: Vec<u8>,
    },
    /// One chunk the server asked for: the frame's bulk bytes are the chunk's encoded form
    /// (`gleam_cache::Encoded`: codec header, then body), checked against its id before it is staged and
    /// kept in the content cache. Fire-and-forget bookkeeping, travelling on the copy's stream's lane
    /// ([`SYNC_UPLOAD_STREAM`]'s for a synchronous copy), ahead of the copy.
    UploadChunk {
        /// The upload it belongs to.
        upload: u64,
        /// The chunk's index in the manifest.
        index: u32,
        /// The copy's stream (`None`: the synchronous copy), for its lane.
        stream: Option<u64>,
        /// The stream's bulk lane it travels on ([`bulk_stream`]): every chunk of one upload on the
        /// same, so that the copy waits for the last of them.
        stripe: u8,
    },
    /// Copies a staged upload, now complete, to device memory at `dst` and forgets it: the CUDA call
    /// (`cuMemcpyHtoD`, or `cuMemcpyHtoDAsync` on `stream`). Reply: [`Reply::Empty`].
    UploadCopy {
        /// The upload.
        upload: u64,
        /// Destination device address.
        dst: u64,
        /// `None` for the synchronous copy, else the stream handle.
        stream: Option<u64>,
        /// A later segment of a synchronous copy whose first segment went before: ordered after that
        /// one (the control lane's order) and its own chunks, not after everything earlier (a barrier
        /// would hold the next segment's announcement behind this segment's bytes).
        continues: bool,
    },
    /// `cuLaunchHostFunc` and `cuStreamAddCallback`: a point in `stream` where the client runs a function.
    /// The server answers only when the stream reaches that point, with [`Reply::Empty`] and, as `result`,
    /// the status the function gets (`CUDA_SUCCESS`, or the error of a faulted context or of a refused
    /// call), and from then on holds the stream until [`Call::HostFuncReturned`] names the same `id`.
    /// The client does not wait for the answer on the calling thread.
    HostFunc {
        /// The stream (0, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` as the application passed them).
        stream: u64,
        /// The client's number for this callback, unique in the session.
        id: u64,
    },
    /// The client's function of [`Call::HostFunc`] `id` returned: its stream may go on. Out of band: sent
    /// with seq 0 on [`crate::order::Lane::SIGNALS`], acted on as it arrives (never scheduled: the executor
    /// may be blocked in a synchronization that waits for exactly this), never answered.
    HostFuncReturned {
        /// The callback's id.
        id: u64,
    },
    /// Orderly end of the session: the server frees everything and replies [`Reply::Empty`].
    Goodbye,
}

impl Call {
    /// What kind of call this is, for logs (a listed call's C name is [`ApiCall::name`]).
    pub fn kind(&self) -> &'static str {
        match self {
            Call::Hello(_) => "Hello",
            Call::Api(call) => call.name(),
            Call::MemcpyHtoD { .. } => "MemcpyHtoD",
            Call::MemcpyDtoH { .. } => "MemcpyDtoH",
            Call::ModuleLoad => "ModuleLoad",
            Call::ModuleGetFunction { .. } => "ModuleGetFunction",
            Call::LibraryLoad => "LibraryLoad",
            Call::KernelGetFunction { .. } => "KernelGetFunction",
            Call::LaunchKernel(_) => "LaunchKernel",
            Call::LaunchKernelEx { .. } => "LaunchKernelEx",
            Call::Memcpy3D { .. } => "Memcpy3D",
            Call::MirrorWrite { .. } => "MirrorWrite",
            Call::MirrorRead { .. } => "MirrorRead",
            Call::LoadImage { .. } => "LoadImage",
            Call::UploadBegin { .. } => "UploadBegin",
            Call::UploadChunk { .. } => "UploadChunk",
            Call::UploadCopy { .. } => "UploadCopy",
            Call::HostFunc { .. } => "HostFunc",
            Call::HostFuncReturned { .. } => "HostFuncReturned",
            Call::Goodbye => "Goodbye",
        }
    }
}

/// A module image, by content: its BLAKE3 hash and length.
#[derive(Clone, Copy, Debug, Deserialize, Eq, PartialEq, Serialize)]
pub struct ImageRef {
    /// BLAKE3 of the image's bytes.
    pub hash: [u8; 32],
    /// Its length in bytes.
    pub len: u64,
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

/// Where one piece of a [`Call::MirrorWrite`] goes.
#[derive(Clone, Copy, Debug, Deserialize, Eq, PartialEq, Serialize)]
pub struct MirrorRun {
    /// Server address of the first byte.
    pub addr: u64,
    /// Byte count of the range.
    pub len: u32,
    /// `false`: the run's bulk bytes are the range's `len` bytes. `true`: they are a bitmap of the bytes
    /// written (`len.div_ceil(8)` bytes, bit `i % 8` of byte `i / 8` for byte `i`), then those bytes in
    /// order; the range's other bytes are left as they are.
    pub masked: bool,
}

impl MirrorRun {
    /// How many bulk bytes the run takes, given its bulk bytes from its start (a masked run's bitmap
    /// says), or `None` if they are too few.
    pub fn bulk_len(&self, bulk: &[u8]) -> Option<usize> {
        let len = self.len as usize;
        if !self.masked {
            return (bulk.len() >= len).then_some(len);
        }
        let mask = bulk.get(..len.div_ceil(8))?;
        let ones: u32 = mask.iter().map(|b| b.count_ones()).sum();
        let n = mask.len() + ones as usize;
        (bulk.len() >= n).then_some(n)
    }

    /// The contiguous writes of a run whose bulk bytes are exactly `bulk`: `(offset in the range,
    /// bytes)`, or `None` if `bulk` is not what the run announces.
    pub fn writes<'a>(&self, bulk: &'a [u8]) -> Option<Vec<(usize, &'a [u8])>> {
        let len = self.len as usize;
        if !self.masked {
            return (bulk.len() == len).then(|| vec![(0, bulk)]);
        }
        let (mask, data) = bulk.split_at_checked(len.div_ceil(8))?;
        let bit = |i: usize| mask[i / 8] & (1 << (i % 8)) != 0;
        let mut out = Vec::new();
        let (mut taken, mut i) = (0usize, 0usize);
        while i < len {
            if !bit(i) {
                i += 1;
                continue;
            }
            let from = i;
            while i < len && bit(i) {
                i += 1;
            }
            out.push((from, data.get(taken..taken + (i - from))?));
            taken += i - from;
        }
        (taken == data.len()).then_some(out)
    }
}

/// One range of a [`Call::MirrorRead`].
#[derive(Clone, Copy, Debug, Deserialize, Eq, PartialEq, Serialize)]
pub struct MirrorRange {
    /// Server address of the first byte.
    pub addr: u64,
    /// Byte count.
    pub len: u32,
    /// [`mirror_hash`] of the bytes the client holds, if it holds any worth keeping.
    pub hash: Option<[u8; 16]>,
}

/// The hash by which a [`Call::MirrorRead`] skips ranges the client already holds (BLAKE3, 128 bits: a
/// collision would silently keep stale bytes, so a cryptographic hash).
pub fn mirror_hash(bytes: &[u8]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out.copy_from_slice(&blake3::hash(bytes).as_bytes()[..16]);
    out
}

/// One `CUlaunchAttribute`: its id and its 64-byte value, as the application wrote them.
#[derive(Clone, Copy, Debug, Default, Deserialize, Eq, PartialEq, Serialize)]
pub struct LaunchAttr {
    /// `CUlaunchAttributeID`.
    pub id: u32,
    /// The `CUlaunchAttributeValue` union's bytes, as 16 little-endian words.
    pub value: [u32; 16],
}

impl LaunchAttr {
    /// `CU_LAUNCH_ATTRIBUTE_COOPERATIVE`.
    pub const COOPERATIVE: u32 = 2;
    /// `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`.
    pub const CLUSTER_DIMENSION: u32 = 4;
    /// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_EVENT` (an event handle in the value).
    pub const PROGRAMMATIC_EVENT: u32 = 7;
    /// `CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT` (an event handle in the value).
    pub const LAUNCH_COMPLETION_EVENT: u32 = 12;

    /// The event handle an attribute names, if it names one.
    pub fn event(&self) -> Option<u64> {
        matches!(
            self.id,
            Self::PROGRAMMATIC_EVENT | Self::LAUNCH_COMPLETION_EVENT
        )
        .then(|| u64::from(self.value[0]) | (u64::from(self.value[1]) << 32))
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
    /// Bytes read from the device: the frame's bulk bytes.
    Data,
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
    /// Answer to [`Call::MirrorRead`]: which ranges changed; their bytes, back to back, are the frame's bulk
    /// bytes.
    Mirror {
        /// Per requested range: `true` if its bytes follow (they differ from the client's hash, or no
        /// hash was given), `false` if the client's copy is current.
        fresh: Vec<bool>,
    },
    /// The server does not have the image a [`Call::LoadImage`] named: send it.
    ImageWanted,
    /// Answer to [`Call::UploadBegin`]: the indices of the chunks to send, in payload order (one index
    /// per distinct missing chunk: the server fills repeats itself).
    UploadWanted {
        /// Chunk indices.
        missing: Vec<u32>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{self, FrameReader};

    #[test]
    fn masked_runs_write_only_their_bytes() {
        let run = MirrorRun {
            addr: 0x1000,
            len: 12,
            masked: true,
        };
        // Bytes 1, 2 and 9 of the range: bitmap 0b0000_0110, 0b0000_0010.
        let bulk = [0b0000_0110, 0b0000_0010, 7, 8, 9];
        assert_eq!(run.bulk_len(&bulk), Some(5));
        assert_eq!(
            run.writes(&bulk),
            Some(vec![(1, &[7u8, 8][..]), (9, &[9u8][..])])
        );
        // Too few or too many bytes for the bitmap are refused.
        assert_eq!(run.writes(&bulk[..4]), None);
        assert_eq!(run.bulk_len(&bulk[..4]), None);
        let plain = MirrorRun {
            masked: false,
            ..run
        };
        assert_eq!(plain.bulk_len(&[0; 20]), Some(12));
        assert_eq!(plain.writes(&[0; 11]), None);
    }

    #[test]
    fn requests_travel_with_their_bulk_bytes() {
        let req = Request {
            seq: 7,
            ctx: 0x5555,
            expects_reply: false,
            deps: crate::order::Deps::default(),
            call: Call::MemcpyHtoD {
                dst: 0x7f00_0000_0000,
                stream: Some(9),
            },
        };
        let mut out = Vec::new();
        frame::encode(&req, &[1, 2, 3], &mut out).unwrap();
        let mut reader = FrameReader::new();
        reader.feed(&out);
        let frame = reader.next_frame().unwrap().unwrap();
        let back: Request = frame.decode().unwrap();
        assert_eq!(back.seq, 7);
        assert!(matches!(
            back.call,
            Call::MemcpyHtoD {
                dst: 0x7f00_0000_0000,
                stream: Some(9)
            }
        ));
        assert_eq!(&frame.bulk[..], [1, 2, 3]);
    }
}
