//! The session engine: CUDA's rules for one client's ordered stream of requests, without any IO.
//!
//! [`Session`] turns each [`Request`] (with its frame's bulk bytes) into calls on a [`Backend`] and, for
//! requests that expect one, an [`Answer`]: a [`ReplyFrame`] and its bulk bytes. It owns the rules every
//! backend shares:
//!
//! * the first request must be [`Call::Hello`] with our [`PROTOCOL_VERSION`];
//! * each request runs in the client thread's context ([`Request::ctx`]), switched only on change;
//! * a fire-and-forget request that fails leaves its error *pending*; the next request that expects a reply
//!   is not executed and returns that error instead, which is then cleared unless it is sticky;
//! * a sticky error (from any call) is returned by every later request, and nothing more executes;
//! * every handle a request names must be one the backend gave this session and that is still alive
//!   ([`Handles`], the registry the shim keeps too): a made-up or dead one gets CUDA's own error code and
//!   never reaches the backend, and what a call destroys takes with it what CUDA says dies with it
//!   ([`Backend::forget`] hears of it);
//! * [`Call::Goodbye`] frees everything ([`Backend::shutdown`]) and ends the session.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gleam_ratelimit::RateLimit;
use tracing::{debug, info, warn};

use crate::backend::Backend;
use crate::callbacks::HostCallbacks;
use crate::images::Images;
pub use crate::images::use_content_cache;
use crate::mirrors::{self, Mirrors};
use crate::payloads::{AnswerLater, Payloads, Settled};
use gleam_protocol::api::ApiCall;
use gleam_protocol::frame::Pieces;
use gleam_protocol::order::Lane;
use gleam_protocol::registry::{Admit, Effect, Handles, Kind, Owner, Register};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{
    COPY_CHUNK, Call, LaunchAttr, PROTOCOL_VERSION, Reply, ReplyFrame, Request, ServerHello,
};

/// What the session sends back for a request that expects a reply.
#[derive(Debug)]
pub struct Answer {
    /// The reply message.
    pub frame: ReplyFrame,
    /// Its bulk bytes (device-to-host data; empty otherwise).
    pub bulk: Vec<u8>,
}

/// One client's session over a backend.
pub struct Session<B: Backend> {
    backend: B,
    state: State,
    /// The context last made current on the backend (`Some(0)` = none, `None` = unknown).
    current_ctx: Option<u64>,
    /// The first error of a fire-and-forget request not yet reported, or a sticky error (kept forever).
    pending: Option<CUresult>,
    /// Every live handle the backend gave this session.
    handles: Handles,
    /// Allocations the client mirrors (managed and mapped host memory).
    mirrors: Mirrors,
    /// The module images this session was sent or found (by content).
    images: Images,
    /// Host-to-device payloads being staged (by content).
    payloads: Payloads,
    /// Streams in capture mode (`cuStreamBeginCapture_v2` .. `cuStreamEndCapture`).
    capturing: HashSet<u64>,
    /// Host functions placed in streams whose client function has not returned.
    callbacks: Arc<HostCallbacks>,
    started: Instant,
    requests: u64,
    /// Warnings about a client breaking the protocol (requests before hello, a second hello): a
    /// hostile client must not decide how much the server logs.
    misuse: RateLimit,
    /// The bulk bytes of an upload's chunk being handled, as the network delivered them
    /// ([`Session::handle_pieces`]): kept without a copy for the chunk worker.
    shared_bulk: Option<Pieces>,
    /// Where other requests' bulk bytes that arrived in several pieces are gathered into one slice
    /// (kept between requests up to [`GATHER_KEPT`] bytes, so a stream of copies reuses warm pages).
    gathered: Vec<u8>,
    /// Told (with the request's seq) when an upload's chunk is in place ([`Session::settle_chunks_with`]).
    chunk_sink: Option<ChunkSink>,
    /// The request just handled is marked run by [`Session::chunk_sink`], later.
    run_later: bool,
    /// Where answers made off the executor go ([`Session::answer_later_with`]).
    answer_sink: Option<AnswerSink>,
}

/// Sends an answer made off the executor (an upload announcement's, once the store was read) on a lane.
pub type AnswerSink = Arc<dyn Fn(Lane, ReplyFrame) + Send + Sync>;

/// Told the seq of an [`Call::UploadChunk`] request once its chunk is in place or refused.
pub type ChunkSink = Arc<dyn Fn(u64) + Send + Sync>;

/// The most bytes [`Session::handle_pieces`] keeps for gathering between requests: a plain copy's piece
/// ([`gleam_protocol::wire::COPY_CHUNK`]) with room to spare; a larger request (a module image) gathers
/// into a buffer of its own.
const GATHER_KEPT: usize = 8 << 20;

/// Protocol-misuse warnings logged per [`MISUSE_INTERVAL`]; the rest are counted.
const MISUSE_BURST: u32 = 10;
const MISUSE_INTERVAL: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum State {
    /// Waiting for [`Call::Hello`].
    Greeting,
    /// Hello done: executing calls.
    Open,
    /// Goodbye received, or the client spoke another protocol version: nothing more executes.
    Closed,
}

impl<B: Backend> std::fmt::Debug for Session<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("state", &self.state)
            .field("pending", &self.pending)
            .field("requests", &self.requests)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Session<B> {
    /// A session that has not yet seen the client's hello.
    pub fn new(backend: B) -> Self {
        Self {
            backend,
            state: State::Greeting,
            current_ctx: Some(0),
            pending: None,
            handles: Handles::default(),
            mirrors: Mirrors::default(),
            images: Images::default(),
            payloads: Payloads::default(),
            capturing: HashSet::new(),
            callbacks: Arc::new(HostCallbacks::default()),
            started: Instant::now(),
            requests: 0,
            misuse: RateLimit::new(MISUSE_BURST, MISUSE_INTERVAL),
            shared_bulk: None,
            gathered: Vec::new(),
            chunk_sink: None,
            run_later: false,
            answer_sink: None,
        }
    }

    /// From now on, an upload's chunk ([`Call::UploadChunk`]) counts as run only when it is in place (or
    /// refused): `sink` is told its seq then, from whichever thread placed it, and
    /// [`Session::marks_run_later`] says so for each such request. The session process's scheduler marks
    /// it run then, so the upload's copy, which waits for its chunks, is not picked while they are still
    /// being decoded and checked (it would hold the executor, and every other stream, meanwhile).
    pub fn settle_chunks_with(&mut self, sink: ChunkSink) {
        self.chunk_sink = Some(sink);
    }

    /// From now on, an upload's announcement ([`Call::UploadBegin`]) is answered through `sink` once the
    /// filler thread has read what the content cache holds of it: [`Session::handle`] returns no answer
    /// for it, and the executor runs other requests (the previous segment's copy) meanwhile.
    pub fn answer_later_with(&mut self, sink: AnswerSink) {
        self.answer_sink = Some(sink);
    }

    /// Whether the request just handled will be reported run through the chunk sink, later (then the
    /// caller must not mark it run itself).
    pub fn marks_run_later(&mut self) -> bool {
        std::mem::take(&mut self.run_later)
    }

    /// [`Session::handle`] with the bulk bytes in the pieces the network delivered them in (the session
    /// process's executor hands its frames over this way): an upload's chunk keeps them as they are, for
    /// its worker to hash and place; any other request gets them in one slice, gathered here if they came
    /// in several, so the network thread never copies a request's bytes.
    pub fn handle_pieces(&mut self, req: Request, bulk: Pieces) -> Option<Answer> {
        if matches!(req.call, Call::UploadChunk { .. }) {
            self.shared_bulk = Some(bulk);
            let answer = self.handle(req, &[]);
            self.shared_bulk = None;
            return answer;
        }
        if let Some(bytes) = bulk.as_contiguous() {
            return self.handle(req, bytes);
        }
        let mut gathered = std::mem::take(&mut self.gathered);
        bulk.gather_into(&mut gathered);
        drop(bulk);
        let answer = self.handle(req, &gathered);
        if gathered.capacity() <= GATHER_KEPT {
            self.gathered = gathered;
        }
        answer
    }

    /// Executes one request (`bulk`: its frame's bulk bytes); returns the answer if the request expects
    /// one.
    pub fn handle(&mut self, req: Request, bulk: &[u8]) -> Option<Answer> {
        self.requests += 1;
        match req.call {
            // Answered when its stream gets there, not now.
            Call::HostFunc { stream, id } if self.state == State::Open => {
                let result = self.host_func(req.seq, req.ctx, stream, id).err()?;
                return req.expects_reply.then_some(Answer {
                    frame: ReplyFrame {
                        seq: req.seq,
                        result,
                        reply: Reply::Empty,
                    },
                    bulk: Vec::new(),
                });
            }
            // Answered by the filler thread, when the session process said where to.
            Call::UploadBegin {
                upload,
                ref manifest,
            } if self.state == State::Open && req.expects_reply => {
                if let Some(sink) = self.answer_sink.clone() {
                    return self.begin_upload(req.seq, req.ctx, upload, manifest, &req.call, sink);
                }
            }
            // Normally handled as it arrives (`HostCallbacks::returned`); here for a transport that
            // schedules everything.
            Call::HostFuncReturned { id } => {
                self.callbacks.returned(id);
                return None;
            }
            _ => {}
        }
        let seq = req.seq;
        let expects_reply = req.expects_reply;
        let call = req.call.kind();
        let (result, reply, bulk) = match self.execute(req, bulk) {
            Ok((reply, bulk)) => (CUresult::SUCCESS, reply, bulk),
            Err(err) => (err, Reply::Empty, Vec::new()),
        };
        if !expects_reply {
            if !result.is_success() {
                debug!(seq, call, error = %result, "fire-and-forget request failed: error pending");
            }
            return None;
        }
        Some(Answer {
            frame: ReplyFrame { seq, result, reply },
            bulk,
        })
    }

    /// An upload's announcement answered off the executor (see [`Session::answer_later_with`]); like
    /// the other bookkeeping of cached uploads it runs whatever error is pending. `None`: the filler
    /// answers.
    fn begin_upload(
        &mut self,
        seq: u64,
        ctx: u64,
        upload: u64,
        manifest: &[u8],
        call: &Call,
        sink: AnswerSink,
    ) -> Option<Answer> {
        let lane = call
            .ordering()
            .stream
            .map_or(Lane::CONTROL, Lane::of_stream);
        let later: AnswerLater = Box::new(move |missing| {
            sink(
                lane,
                ReplyFrame {
                    seq,
                    result: CUresult::SUCCESS,
                    reply: Reply::UploadWanted { missing },
                },
            );
        });
        // The filler page-locks the staging buffer, for the upload's context, where that is the one
        // current here (else the copy locks it, on this thread).
        let pin = if self.current_ctx == Some(ctx) && self.handles.check(Kind::Context, ctx).is_ok()
        {
            self.backend.pin_anywhere()
        } else {
            None
        };
        let begun = self.payloads.begin_then(upload, manifest, Some(later), pin);
        let (result, reply) = match begun {
            Ok(None) => return None,
            Ok(Some(missing)) => (CUresult::SUCCESS, Reply::UploadWanted { missing }),
            Err(err) => (err, Reply::Empty),
        };
        Some(Answer {
            frame: ReplyFrame { seq, result, reply },
            bulk: Vec::new(),
        })
    }

    /// Whether the session is over (Goodbye, or a protocol mismatch): the caller should stop reading.
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    /// The backend (for tests and for shutting down after an abrupt end).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// The session's live handles.
    pub fn handles(&self) -> &Handles {
        &self.handles
    }

    /// The host functions in flight: the session process sets where their answers go
    /// ([`HostCallbacks::set_sink`]) and reports completions as they arrive
    /// ([`HostCallbacks::returned`]) and the session's end ([`HostCallbacks::cancel_all`]).
    pub fn host_callbacks(&self) -> Arc<HostCallbacks> {
        self.callbacks.clone()
    }

    /// Ends the session if the client did not say goodbye (its connection ended): frees everything.
    pub fn finish(&mut self) {
        if self.state != State::Closed {
            self.close();
        }
        let unlogged = self.misuse.take_suppressed();
        if unlogged > 0 {
            warn!(
                unlogged,
                "more protocol violations were refused than logged"
            );
        }
        info!(
            requests = self.requests,
            duration_ms = self.started.elapsed().as_millis() as u64,
            "session over"
        );
    }

    /// Runs a request under the pending-error rules. `Err` is what the request reports (its own failure
    /// or the pending error it returns instead of executing).
    fn execute(&mut self, req: Request, bulk: &[u8]) -> Result<(Reply, Vec<u8>), CUresult> {
        match (self.state, &req.call) {
            (State::Greeting, Call::Hello(_)) => {}
            (State::Greeting, _) => {
                if let Some(suppressed) = self.misuse.admit() {
                    warn!(seq = req.seq, suppressed, "request before hello: refused");
                }
                return Err(CUresult::NOT_INITIALIZED);
            }
            (State::Closed, _) => return Err(CUresult::DEINITIALIZED),
            (State::Open, Call::Hello(_)) => {
                if let Some(suppressed) = self.misuse.admit() {
                    warn!(
                        seq = req.seq,
                        suppressed, "second hello in one session: refused"
                    );
                }
                return Err(CUresult::ILLEGAL_STATE);
            }
            (State::Open, _) => {}
        }

        // Goodbye always runs: the client is leaving, and its resources must be freed regardless.
        if matches!(req.call, Call::Goodbye) {
            self.close();
            return Ok((Reply::Empty, Vec::new()));
        }

        // Mirror traffic keeps the client's copies of managed and mapped memory coherent: it needs no
        // context and runs whatever error is pending, without reporting or clearing it (a refused write
        // becomes the pending error, since coherence was lost).
        // So does the bookkeeping of cached uploads (the copy itself is the CUDA call).
        if matches!(
            req.call,
            Call::MirrorRead { .. }
                | Call::MirrorWrite { .. }
                | Call::UploadBegin { .. }
                | Call::UploadChunk { .. }
        ) {
            let expects_reply = req.expects_reply;
            return self
                .dispatch(req.seq, req.ctx, req.call, bulk)
                .map_err(|err| {
                    if expects_reply {
                        err
                    } else {
                        self.failed(err, false)
                    }
                });
        }

        // A cached upload's copy that will not run must not keep its staging.
        if let (Some(err), Call::UploadCopy { upload, .. }) = (self.pending, &req.call)
            && (err.is_sticky() || req.expects_reply)
        {
            self.payloads.discard(*upload);
        }
        if let Some(err) = self.pending {
            if err.is_sticky() {
                return Err(err);
            }
            if req.expects_reply {
                // The sync call reports the earlier failure instead of running, as CUDA's next call does.
                self.pending = None;
                return Err(err);
            }
            // A later fire-and-forget call still runs; the first error stays the one reported.
        }

        if self.current_ctx != Some(req.ctx) && !matches!(req.call, Call::Hello(_)) {
            let switched = self
                .handles
                .check(Kind::Context, req.ctx)
                .and_then(|()| self.backend.set_current_context(req.ctx));
            match switched {
                Ok(()) => self.current_ctx = Some(req.ctx),
                Err(err) => return Err(self.failed(err, req.expects_reply)),
            }
        }

        self.dispatch(req.seq, req.ctx, req.call, bulk)
            .map_err(|err| self.failed(err, req.expects_reply))
    }

    /// Places host function `id` of request `seq` in `stream`; `Err` is the status the client's function
    /// gets at once (the call was refused, or the context is lost). A pending error that is not sticky
    /// stays pending: the client does not wait for this answer, so it must not take the error away from
    /// the call that reports it.
    fn host_func(&mut self, seq: u64, ctx: u64, stream: u64, id: u64) -> Result<(), CUresult> {
        if let Some(err) = self.pending.filter(|e| e.is_sticky()) {
            return Err(err);
        }
        if self.current_ctx != Some(ctx) {
            self.handles.check(Kind::Context, ctx)?;
            self.backend.set_current_context(ctx)?;
            self.current_ctx = Some(ctx);
        }
        self.handles.check(Kind::Stream, stream)?;
        let lane = gleam_protocol::order::Lane::of_stream(stream);
        let point = self
            .callbacks
            .point(seq, lane, id)
            .map_err(crate::callbacks::CallbackError::cuda_result)?;
        self.backend.host_callback(stream, point).inspect_err(|_| {
            self.callbacks.withdraw(id);
        })
    }

    /// Frees everything the session holds and refuses anything more.
    fn close(&mut self) {
        self.state = State::Closed;
        // The chunks this session received reach the content cache before the client hears goodbye.
        self.payloads.finish();
        // No stream waits for a client function any more: the client is leaving.
        self.callbacks.cancel_all();
        self.backend.shutdown(&self.handles);
        self.handles.clear();
        self.mirrors.clear();
    }

    /// Records a failure: sticky errors forever, a fire-and-forget failure until the next reply.
    fn failed(&mut self, err: CUresult, expects_reply: bool) -> CUresult {
        if err.is_sticky() {
            if self.pending != Some(err) {
                warn!(error = %err, "sticky error: the session's context is unusable from now on");
            }
            self.pending = Some(err);
        } else if !expects_reply && self.pending.is_none() {
            self.pending = Some(err);
        }
        err
    }

    /// Executes one call in context `ctx` (current on the backend by now).
    fn dispatch(
        &mut self,
        seq: u64,
        ctx: u64,
        call: Call,
        bulk: &[u8],
    ) -> Result<(Reply, Vec<u8>), CUresult> {
        let in_ctx = Owner::in_context(ctx);
        let reply = match call {
            Call::Hello(hello) => self.hello(hello.protocol, &hello.client)?,
            Call::Api(call) => {
                let mut owner = in_ctx;
                call.admit(&self.handles, &mut owner)?;
                // These change the driver's current context as a side effect: switch again next time.
                if matches!(
                    call,
                    ApiCall::cuCtxCreate_v2(_)
                        | ApiCall::cuCtxCreate_v3(_)
                        | ApiCall::cuCtxDestroy_v2(_)
                        | ApiCall::cuDevicePrimaryCtxReset_v2(_)
                ) {
                    self.current_ctx = None;
                }
                let effect = Effect::of(&call);
                let adding = self.mirrors.before(&call);
                // Which streams capture: host copies queued there are refused (below).
                let capture = match &call {
                    ApiCall::cuStreamBeginCapture_v2(a) => Some((a.stream, true)),
                    ApiCall::cuStreamEndCapture(a) => Some((a.stream, false)),
                    _ => None,
                };
                let reply = self.backend.api(call);
                match capture {
                    Some((stream, true)) if reply.is_ok() => {
                        self.capturing.insert(stream);
                    }
                    // A capture ends whatever the outcome.
                    Some((stream, false)) => {
                        self.capturing.remove(&stream);
                    }
                    _ => {}
                }
                let reply = reply?;
                reply.register(&mut self.handles, &owner);
                if let Some(adding) = adding {
                    self.mirrors.after(adding, &reply, ctx);
                }
                let died = self.handles.apply(effect, Some(&reply));
                if !died.is_empty() {
                    for &emptied in &died.emptied_contexts {
                        self.mirrors.emptied(emptied);
                    }
                    self.backend.forget(&died);
                }
                Reply::Api(reply)
            }
            Call::MemcpyHtoD { dst, stream } => {
                self.check_stream(stream)?;
                self.not_capturing(stream)?;
                self.backend.memcpy_htod(dst, bulk, stream)?;
                Reply::Empty
            }
            Call::MemcpyDtoH {
                src, len, stream, ..
            } => {
                // The reply must fit in a frame: the client splits larger copies.
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&len| len <= COPY_CHUNK)
                    .ok_or(CUresult::INVALID_VALUE)?;
                self.check_stream(stream)?;
                self.not_capturing(stream)?;
                let data = self.backend.memcpy_dtoh(src, len, stream)?;
                return Ok((Reply::Data, data));
            }
            Call::ModuleLoad => {
                let handle = self.backend.module_load(bulk)?;
                self.handles.register(Kind::Module, handle, &in_ctx);
                Reply::Module { handle }
            }
            Call::ModuleGetFunction { module, name } => {
                self.handles.check(Kind::Module, module)?;
                let (handle, info) = self.backend.module_get_function(module, &name)?;
                // Functions live in their module's context.
                let owner = Owner {
                    ctx: self.handles.module_context(module),
                    module: Some(module),
                    ..Owner::default()
                };
                self.handles.register(Kind::Function, handle, &owner);
                Reply::Function { handle, info }
            }
            Call::LibraryLoad => {
                let handle = self.backend.library_load(bulk)?;
                self.handles
                    .register(Kind::Library, handle, &Owner::default());
                Reply::Library { handle }
            }
            Call::LoadImage { image, as_library } => {
                let bytes = if bulk.is_empty() {
                    match self.images.find(&image) {
                        Some(bytes) => bytes,
                        // Loading nothing: the client sends the bytes next.
                        None => return Ok((Reply::ImageWanted, Vec::new())),
                    }
                } else {
                    self.images.accept(&image, bulk).map_err(|err| {
                        warn!(%err, "refusing a module image");
                        CUresult::INVALID_IMAGE
                    })?
                };
                if as_library {
                    let handle = self.backend.library_load(&bytes)?;
                    self.handles
                        .register(Kind::Library, handle, &Owner::default());
                    Reply::Library { handle }
                } else {
                    let handle = self.backend.module_load(&bytes)?;
                    self.handles.register(Kind::Module, handle, &in_ctx);
                    Reply::Module { handle }
                }
            }
            Call::KernelGetFunction { kernel } => {
                self.handles.check(Kind::Kernel, kernel)?;
                let (handle, info) = self.backend.kernel_get_function(kernel)?;
                let owner = Owner {
                    kernel: Some(kernel),
                    ..in_ctx
                };
                self.handles.register(Kind::Function, handle, &owner);
                Reply::Function { handle, info }
            }
            Call::LaunchKernel(launch) => {
                self.handles.check(Kind::Function, launch.function)?;
                self.handles.check(Kind::Stream, launch.stream)?;
                self.backend.launch(&launch)?;
                Reply::Empty
            }
            Call::Memcpy3D { copy, stream } => {
                mirrors::check_copy(&copy, bulk, stream, &self.handles)?;
                // A graph cannot copy from or to the client's memory.
                if copy.src.place == gleam_protocol::copy::Place::Host
                    || copy.dst.place == gleam_protocol::copy::Place::Host
                {
                    self.not_capturing(stream)?;
                }
                let data = self.backend.memcpy3d(&copy, bulk, stream)?;
                if copy.dst.place == gleam_protocol::copy::Place::Host {
                    return Ok((Reply::Data, data));
                }
                Reply::Empty
            }
            Call::MirrorWrite { runs } => {
                // Every run checked, and its bytes found, before anything is written.
                let mut pieces = Vec::with_capacity(runs.len());
                let mut at = 0usize;
                for r in &runs {
                    self.mirrors.check(r.addr, u64::from(r.len))?;
                    let rest = bulk.get(at..).ok_or(CUresult::INVALID_VALUE)?;
                    let n = r.bulk_len(rest).ok_or(CUresult::INVALID_VALUE)?;
                    let writes = r.writes(&rest[..n]).ok_or(CUresult::INVALID_VALUE)?;
                    pieces.push((r.addr, writes));
                    at += n;
                }
                if at != bulk.len() {
                    return Err(CUresult::INVALID_VALUE);
                }
                for (addr, writes) in pieces {
                    for (off, bytes) in writes {
                        self.backend.mirror_write(addr + off as u64, bytes)?;
                    }
                }
                Reply::Empty
            }
            Call::MirrorRead { ranges } => {
                let total: u64 = ranges.iter().map(|r| u64::from(r.len)).sum();
                if total > COPY_CHUNK as u64 {
                    return Err(CUresult::INVALID_VALUE);
                }
                for r in &ranges {
                    self.mirrors.check(r.addr, u64::from(r.len))?;
                }
                let mut fresh = Vec::with_capacity(ranges.len());
                let mut data = Vec::new();
                for r in &ranges {
                    let bytes = self.backend.mirror_read(r.addr, r.len as usize)?;
                    let same = r
                        .hash
                        .is_some_and(|h| h == gleam_protocol::wire::mirror_hash(&bytes));
                    if !same {
                        data.extend_from_slice(&bytes);
                    }
                    fresh.push(!same);
                }
                return Ok((Reply::Mirror { fresh }, data));
            }
            Call::LaunchKernelEx { launch, attrs } => {
                self.handles.check(Kind::Function, launch.function)?;
                self.handles.check(Kind::Stream, launch.stream)?;
                // Events named in attributes reach the driver too.
                for event in attrs.iter().filter_map(LaunchAttr::event) {
                    self.handles.check(Kind::Event, event)?;
                }
                self.backend.launch_ex(&launch, &attrs)?;
                Reply::Empty
            }
            Call::UploadBegin { upload, manifest } => {
                // Without a callback the answer is made here.
                let missing = self.payloads.begin(upload, &manifest)?;
                Reply::UploadWanted { missing }
            }
            Call::UploadChunk { upload, index, .. } => {
                let wire = self
                    .shared_bulk
                    .take()
                    .unwrap_or_else(|| Bytes::copy_from_slice(bulk).into());
                let settled = match &self.chunk_sink {
                    Some(sink) => {
                        let sink = sink.clone();
                        // From here on the sink is told, whatever happens to the chunk.
                        self.run_later = true;
                        Settled::new(move || sink(seq))
                    }
                    None => Settled::none(),
                };
                self.payloads.chunk_then(upload, index, wire, settled)?;
                Reply::Empty
            }
            Call::UploadCopy {
                upload,
                dst,
                stream,
                ..
            } => {
                let checked = self
                    .check_stream(stream)
                    .and_then(|()| self.not_capturing(stream));
                if let Err(err) = checked {
                    // A refused copy must not keep its staging.
                    self.payloads.discard(upload);
                    return Err(err);
                }
                let backend = std::cell::RefCell::new(&mut self.backend);
                let mut pin = |pages: &mut [u8]| backend.borrow_mut().pin_host(pages);
                self.payloads
                    .copy_page_locked(upload, Some(&mut pin), |bytes, pinned| {
                        let mut backend = backend.borrow_mut();
                        backend.memcpy_htod(dst, bytes, stream)?;
                        // A stream's copy from page-locked memory returns before it ran: the staging
                        // buffer is not reused until it did. A synchronous one is done.
                        Ok(stream
                            .filter(|_| pinned)
                            .and_then(|s| backend.device_read(s)))
                    })?;
                Reply::Empty
            }
            // Handled before dispatch.
            Call::Goodbye | Call::HostFunc { .. } | Call::HostFuncReturned { .. } => Reply::Empty,
        };
        Ok((reply, Vec::new()))
    }

    /// A host copy cannot be captured remotely: the captured copy would read or write the session
    /// process's own buffer (gone after the call) at every launch of the graph, not the client's memory.
    fn not_capturing(&self, stream: Option<u64>) -> Result<(), CUresult> {
        match stream {
            Some(s) if self.capturing.contains(&s) => {
                warn!(
                    stream = s,
                    "a host copy queued on a capturing stream: refused (a graph cannot copy from or to a remote \
                     client's memory)"
                );
                Err(CUresult::STREAM_CAPTURE_UNSUPPORTED)
            }
            _ => Ok(()),
        }
    }

    fn check_stream(&self, stream: Option<u64>) -> Result<(), CUresult> {
        stream.map_or(Ok(()), |s| self.handles.check(Kind::Stream, s))
    }

    fn hello(&mut self, protocol: u32, client: &str) -> Result<Reply, CUresult> {
        if protocol != PROTOCOL_VERSION {
            warn!(
                client,
                client_protocol = protocol,
                server_protocol = PROTOCOL_VERSION,
                "client speaks another protocol version: upgrade the older side"
            );
            self.state = State::Closed;
            // The client learns our version from the reply's absence of a hello and this code.
            return Err(CUresult::SYSTEM_DRIVER_MISMATCH);
        }
        let (driver_version, backend, devices) = self.backend.describe()?;
        info!(client, backend = %backend, devices = devices.len(), "session opened");
        self.state = State::Open;
        Ok(Reply::Hello(ServerHello {
            protocol: PROTOCOL_VERSION,
            driver_version,
            backend,
            server: server_description(),
            devices,
        }))
    }
}

/// `gleam <version> on <host> (pid N)`, for the client's logs.
fn server_description() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown host".to_owned());
    format!(
        "gleam {} on {host} (pid {})",
        env!("CARGO_PKG_VERSION"),
        std::process::id()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ApiBackend;
    use gleam_protocol::api::{ApiReply, args, outs};
    use gleam_protocol::wire::{ClientHello, DeviceInfo, FunctionInfo, Launch, ParamSlot};

    /// Records what the engine asks of it; fails where told to. Tests the engine's rules, not CUDA.
    #[derive(Default)]
    struct Recorder {
        log: Vec<String>,
        fail_memset: Option<CUresult>,
        fail_launch: Option<CUresult>,
        shut_down: bool,
        /// Contexts `cuCtxCreate` has handed out.
        created: usize,
    }

    /// The contexts the recorder creates, in order (the last one cannot be made current).
    const CONTEXTS: [u64; 3] = [0x10, 0x20, 0xbad];

    impl ApiBackend for Recorder {
        fn cuCtxCreate_v2(
            &mut self,
            _: args::cuCtxCreate_v2,
        ) -> Result<outs::cuCtxCreate_v2, CUresult> {
            let ctx = *CONTEXTS.get(self.created).ok_or(CUresult::OUT_OF_MEMORY)?;
            self.created += 1;
            Ok(outs::cuCtxCreate_v2 {
                pctx: ctx,
                ..Default::default()
            })
        }
        fn cuMemAlloc_v2(
            &mut self,
            a: args::cuMemAlloc_v2,
        ) -> Result<outs::cuMemAlloc_v2, CUresult> {
            self.log.push(format!("alloc {}", a.bytesize));
            Ok(outs::cuMemAlloc_v2 {
                dptr: 0x1000,
                bytesize: (),
            })
        }
        fn cuMemsetD8_v2(
            &mut self,
            a: args::cuMemsetD8_v2,
        ) -> Result<outs::cuMemsetD8_v2, CUresult> {
            self.log.push(format!("memset {:#x}", a.dst));
            match self.fail_memset {
                Some(err) => Err(err),
                None => Ok(outs::cuMemsetD8_v2::default()),
            }
        }
        fn cuCtxSynchronize(
            &mut self,
            _: args::cuCtxSynchronize,
        ) -> Result<outs::cuCtxSynchronize, CUresult> {
            self.log.push("sync".into());
            Ok(outs::cuCtxSynchronize {})
        }
        fn cuStreamBeginCapture_v2(
            &mut self,
            _: args::cuStreamBeginCapture_v2,
        ) -> Result<outs::cuStreamBeginCapture_v2, CUresult> {
            self.log.push("begin capture".into());
            Ok(Default::default())
        }
        fn cuStreamEndCapture(
            &mut self,
            _: args::cuStreamEndCapture,
        ) -> Result<outs::cuStreamEndCapture, CUresult> {
            self.log.push("end capture".into());
            Err(CUresult::STREAM_CAPTURE_INVALIDATED)
        }
    }

    impl Backend for Recorder {
        fn describe(&mut self) -> Result<(i32, String, Vec<DeviceInfo>), CUresult> {
            Ok((
                13000,
                "test".into(),
                vec![DeviceInfo {
                    name: "recorder".into(),
                    uuid: [7; 16],
                    total_mem: 1 << 30,
                    attributes: vec![0; 10],
                    pci_bus_id: "0000:00:00.0".into(),
                }],
            ))
        }
        fn set_current_context(&mut self, ctx: u64) -> Result<(), CUresult> {
            self.log.push(format!("ctx {ctx:#x}"));
            if ctx == 0xbad {
                Err(CUresult::INVALID_CONTEXT)
            } else {
                Ok(())
            }
        }
        fn memcpy_htod(&mut self, dst: u64, data: &[u8], _: Option<u64>) -> Result<(), CUresult> {
            self.log.push(format!("htod {dst:#x} {}", data.len()));
            Ok(())
        }
        fn memcpy_dtoh(
            &mut self,
            src: u64,
            len: usize,
            _: Option<u64>,
        ) -> Result<Vec<u8>, CUresult> {
            self.log.push(format!("dtoh {src:#x} {len}"));
            Ok(vec![0xab; len])
        }
        fn module_load(&mut self, image: &[u8]) -> Result<u64, CUresult> {
            self.log.push(format!("load {}", image.len()));
            Ok(0x77)
        }
        fn module_get_function(
            &mut self,
            module: u64,
            name: &str,
        ) -> Result<(u64, FunctionInfo), CUresult> {
            self.log.push(format!("func {module:#x} {name}"));
            Ok((
                0x88,
                FunctionInfo {
                    params: vec![ParamSlot { offset: 0, size: 8 }],
                    attributes: vec![1024],
                },
            ))
        }
        fn launch(&mut self, launch: &Launch) -> Result<(), CUresult> {
            self.log.push(format!("launch {:#x}", launch.function));
            match self.fail_launch {
                Some(err) => Err(err),
                None => Ok(()),
            }
        }
        fn shutdown(&mut self, _: &gleam_protocol::registry::Handles) {
            self.log.push("shutdown".into());
            self.shut_down = true;
        }
    }

    /// A request without bulk bytes, its reply message only.
    trait HandleReq {
        fn handle_req(&mut self, req: Request) -> Option<ReplyFrame>;
    }

    impl HandleReq for Session<Recorder> {
        fn handle_req(&mut self, req: Request) -> Option<ReplyFrame> {
            self.handle(req, &[]).map(|answer| answer.frame)
        }
    }

    fn req(seq: u64, ctx: u64, expects_reply: bool, call: Call) -> Request {
        Request {
            seq,
            ctx,
            expects_reply,
            deps: Default::default(),
            call,
        }
    }

    fn hello(protocol: u32) -> Call {
        Call::Hello(ClientHello {
            protocol,
            client: "test".into(),
        })
    }

    fn memset(dst: u64) -> Call {
        Call::Api(ApiCall::cuMemsetD8_v2(args::cuMemsetD8_v2 {
            dst,
            value: 0,
            n: 1,
        }))
    }

    fn sync() -> Call {
        Call::Api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {}))
    }

    fn launch() -> Call {
        Call::LaunchKernel(Launch {
            function: 0x88,
            grid: [1; 3],
            block: [1; 3],
            shared_mem_bytes: 0,
            stream: 0,
            params: vec![0; 8],
        })
    }

    /// A session after hello, holding the handles the tests use: the contexts in [`CONTEXTS`] and
    /// function 0x88 of module 0x77. Its backend's log starts empty, with no context current.
    fn open(backend: Recorder) -> Session<Recorder> {
        let mut s = Session::new(backend);
        let r = s
            .handle_req(req(1, 0, true, hello(PROTOCOL_VERSION)))
            .unwrap();
        assert_eq!(r.result, CUresult::SUCCESS);
        let create = Call::Api(ApiCall::cuCtxCreate_v2(args::cuCtxCreate_v2 {
            pctx: (),
            flags: 0,
            dev: 0,
        }));
        for _ in CONTEXTS {
            let r = s.handle_req(req(1, 0, true, create.clone())).unwrap();
            assert_eq!(r.result, CUresult::SUCCESS);
        }
        let r = s.handle(req(1, 0, true, Call::ModuleLoad), b"k").unwrap();
        assert_eq!(r.frame.result, CUresult::SUCCESS);
        let get = Call::ModuleGetFunction {
            module: 0x77,
            name: "k".into(),
        };
        assert_eq!(
            s.handle_req(req(1, 0, true, get)).unwrap().result,
            CUresult::SUCCESS
        );
        s.backend.log.clear();
        s
    }

    #[test]
    fn hello_describes_the_backend() {
        let mut s = Session::new(Recorder::default());
        let r = s
            .handle_req(req(1, 0, true, hello(PROTOCOL_VERSION)))
            .unwrap();
        assert_eq!((r.seq, r.result), (1, CUresult::SUCCESS));
        let Reply::Hello(h) = r.reply else {
            panic!("not a hello: {:?}", r.reply)
        };
        assert_eq!(h.protocol, PROTOCOL_VERSION);
        assert_eq!(h.driver_version, 13000);
        assert_eq!(h.backend, "test");
        assert_eq!(h.devices.len(), 1);
        assert_eq!(h.devices[0].name, "recorder");
    }

    #[test]
    fn wrong_protocol_version_closes_the_session() {
        let mut s = Session::new(Recorder::default());
        let r = s
            .handle_req(req(1, 0, true, hello(PROTOCOL_VERSION + 1)))
            .unwrap();
        assert_eq!(r.result, CUresult::SYSTEM_DRIVER_MISMATCH);
        assert!(s.is_closed());
        let r = s.handle_req(req(2, 0, true, sync())).unwrap();
        assert_eq!(r.result, CUresult::DEINITIALIZED);
        assert!(s.backend.log.is_empty(), "{:?}", s.backend.log);
    }

    #[test]
    fn calls_before_hello_are_refused() {
        let mut s = Session::new(Recorder::default());
        let r = s.handle_req(req(1, 0, true, sync())).unwrap();
        assert_eq!(r.result, CUresult::NOT_INITIALIZED);
        assert!(s.backend.log.is_empty());
    }

    /// Log lines written while `f` runs, at the server's default level (warnings).
    fn logged(f: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Buffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let bytes = buffer.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    /// Issue 11: 200,000 requests before hello wrote 31 MB of warnings, one per request.
    #[test]
    fn a_flood_of_refused_requests_logs_a_bounded_amount() {
        let log = logged(|| {
            let mut s = Session::new(Recorder::default());
            for seq in 0..200_000 {
                let r = s.handle_req(req(seq, 0, true, sync())).unwrap();
                assert_eq!(r.result, CUresult::NOT_INITIALIZED);
            }
            s.finish();
        });
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), MISUSE_BURST as usize + 1, "{log}");
        assert!(log.len() < 4096, "{} bytes logged", log.len());
        assert!(lines[0].contains("request before hello: refused"), "{log}");
        // The final summary counts what was not logged.
        let summary = lines.last().unwrap();
        assert!(
            summary.contains(&format!("unlogged={}", 200_000 - MISUSE_BURST)),
            "{summary}"
        );
    }

    #[test]
    fn listed_calls_reply_with_out_values_and_seq() {
        let mut s = open(Recorder::default());
        let call = Call::Api(ApiCall::cuMemAlloc_v2(args::cuMemAlloc_v2 {
            dptr: (),
            bytesize: 4096,
        }));
        let r = s.handle_req(req(42, 0, true, call)).unwrap();
        assert_eq!((r.seq, r.result), (42, CUresult::SUCCESS));
        assert!(matches!(
            r.reply,
            Reply::Api(ApiReply::cuMemAlloc_v2(outs::cuMemAlloc_v2 {
                dptr: 0x1000,
                ..
            }))
        ));
        // A call the backend does not implement says so.
        let call = Call::Api(ApiCall::cuCtxGetFlags(args::cuCtxGetFlags { flags: () }));
        let r = s.handle_req(req(43, 0, true, call)).unwrap();
        assert_eq!(r.result, CUresult::NOT_SUPPORTED);
        assert!(matches!(r.reply, Reply::Empty));
    }

    #[test]
    fn context_switches_only_on_change() {
        let mut s = open(Recorder::default());
        s.handle_req(req(2, 0x10, false, memset(1)));
        s.handle_req(req(3, 0x10, false, memset(2)));
        s.handle_req(req(4, 0x20, false, memset(3)));
        s.handle_req(req(5, 0x20, true, sync()));
        assert_eq!(
            s.backend.log,
            [
                "ctx 0x10",
                "memset 0x1",
                "memset 0x2",
                "ctx 0x20",
                "memset 0x3",
                "sync"
            ]
        );
        // A context that cannot be made current fails the call, which does not run.
        let r = s.handle_req(req(6, 0xbad, true, sync())).unwrap();
        assert_eq!(r.result, CUresult::INVALID_CONTEXT);
        assert_eq!(s.backend.log.last().unwrap(), "ctx 0xbad");
        // A context the backend never gave out does not even reach it.
        let r = s.handle_req(req(7, 0x999, true, sync())).unwrap();
        assert_eq!(r.result, CUresult::INVALID_CONTEXT);
        assert_eq!(s.backend.log.last().unwrap(), "ctx 0xbad");
    }

    #[test]
    fn deferred_error_is_returned_once_by_the_next_sync_call() {
        let mut s = open(Recorder {
            fail_memset: Some(CUresult::INVALID_VALUE),
            ..Default::default()
        });
        assert!(s.handle_req(req(2, 0, false, memset(1))).is_none());
        // Later fire-and-forget work still runs.
        assert!(s.handle_req(req(3, 0, false, launch())).is_none());
        let r = s.handle_req(req(4, 0, true, sync())).unwrap();
        assert_eq!((r.seq, r.result), (4, CUresult::INVALID_VALUE));
        // The sync call reported the error instead of running.
        assert_eq!(s.backend.log, ["memset 0x1", "launch 0x88"]);
        let r = s.handle_req(req(5, 0, true, sync())).unwrap();
        assert_eq!(r.result, CUresult::SUCCESS);
        assert_eq!(s.backend.log.last().unwrap(), "sync");
    }

    #[test]
    fn cached_uploads_are_bookkeeping_and_their_copy_the_cuda_call() {
        let mut s = open(Recorder {
            fail_memset: Some(CUresult::INVALID_VALUE),
            ..Default::default()
        });
        s.handle_req(req(2, 0, false, memset(1)));
        let data: Vec<u8> = (0..3000u32).map(|i| (i / 1024) as u8).collect();
        let manifest = gleam_cache::Manifest::with_chunk_size(&data, 1024);
        let mut seq = 2;
        let mut upload = |s: &mut Session<Recorder>, id: u64| {
            seq += 1;
            let begin = Call::UploadBegin {
                upload: id,
                manifest: manifest.encode(),
            };
            // Bookkeeping neither reports nor clears the pending error.
            let r = s.handle_req(req(seq, 0, true, begin)).unwrap();
            assert_eq!(r.result, CUresult::SUCCESS);
            let Reply::UploadWanted { missing } = r.reply else {
                panic!("{:?}", r.reply)
            };
            assert_eq!(missing, [0, 1, 2]);
            for index in missing {
                seq += 1;
                let r = manifest.chunk_range(index as usize);
                let wire = gleam_cache::encode_chunk(
                    &data[r.start as usize..r.end as usize],
                    gleam_cache::Compression::default(),
                )
                .to_wire();
                let chunk = Call::UploadChunk {
                    upload: id,
                    index,
                    stream: None,
                    stripe: 0,
                };
                assert!(s.handle(req(seq, 0, false, chunk), &wire).is_none());
            }
            seq += 1;
            let copy = Call::UploadCopy {
                upload: id,
                dst: 0x1000,
                stream: None,
                continues: false,
            };
            s.handle_req(req(seq, 0, true, copy)).unwrap().result
        };
        // The copy reports the earlier failure instead of running, and drops its staging.
        assert_eq!(upload(&mut s, 1), CUresult::INVALID_VALUE);
        assert!(!s.backend.log.iter().any(|l| l.starts_with("htod")));
        assert_eq!(upload(&mut s, 2), CUresult::SUCCESS);
        assert_eq!(s.backend.log.last().unwrap(), "htod 0x1000 3000");
        // A copy of nothing staged is refused.
        let copy = Call::UploadCopy {
            upload: 1,
            dst: 0x1000,
            stream: None,
            continues: false,
        };
        let r = s.handle_req(req(99, 0, true, copy)).unwrap();
        assert_eq!(r.result, CUresult::INVALID_VALUE);
    }

    #[test]
    fn first_deferred_error_wins() {
        let mut s = open(Recorder {
            fail_memset: Some(CUresult::INVALID_VALUE),
            fail_launch: Some(CUresult::INVALID_HANDLE),
            ..Default::default()
        });
        s.handle_req(req(2, 0, false, memset(1)));
        s.handle_req(req(3, 0, false, launch()));
        let r = s.handle_req(req(4, 0, true, sync())).unwrap();
        assert_eq!(r.result, CUresult::INVALID_VALUE);
    }

    #[test]
    fn a_failing_sync_call_leaves_nothing_pending() {
        let mut s = open(Recorder {
            fail_memset: Some(CUresult::INVALID_VALUE),
            ..Default::default()
        });
        let r = s.handle_req(req(2, 0, true, memset(1))).unwrap();
        assert_eq!(r.result, CUresult::INVALID_VALUE);
        let r = s.handle_req(req(3, 0, true, sync())).unwrap();
        assert_eq!(r.result, CUresult::SUCCESS);
    }

    #[test]
    fn sticky_errors_are_returned_forever_and_stop_execution() {
        let mut s = open(Recorder {
            fail_launch: Some(CUresult::ILLEGAL_ADDRESS),
            ..Default::default()
        });
        s.handle_req(req(2, 0, false, launch()));
        s.handle_req(req(3, 0, false, memset(1)));
        for seq in 4..7 {
            let r = s.handle_req(req(seq, 0, true, sync())).unwrap();
            assert_eq!((r.seq, r.result), (seq, CUresult::ILLEGAL_ADDRESS));
        }
        assert_eq!(s.backend.log, ["launch 0x88"]);
        // Goodbye still frees everything.
        let r = s.handle_req(req(7, 0, true, Call::Goodbye)).unwrap();
        assert_eq!(r.result, CUresult::SUCCESS);
        assert!(s.backend.shut_down && s.is_closed());
    }

    #[test]
    fn sticky_error_from_a_sync_call_persists() {
        let mut s = open(Recorder {
            fail_launch: Some(CUresult::LAUNCH_FAILED),
            ..Default::default()
        });
        let r = s.handle_req(req(2, 0, true, launch())).unwrap();
        assert_eq!(r.result, CUresult::LAUNCH_FAILED);
        let r = s.handle_req(req(3, 0, true, sync())).unwrap();
        assert_eq!(r.result, CUresult::LAUNCH_FAILED);
    }

    #[test]
    fn copies_modules_and_functions() {
        let mut s = open(Recorder::default());
        let r = s
            .handle(
                req(
                    2,
                    0,
                    true,
                    Call::MemcpyHtoD {
                        dst: 0x1000,
                        stream: None,
                    },
                ),
                &[1; 100],
            )
            .unwrap();
        assert_eq!(r.frame.result, CUresult::SUCCESS);
        let r = s
            .handle(
                req(
                    3,
                    0,
                    true,
                    Call::MemcpyDtoH {
                        src: 0x1000,
                        len: 16,
                        stream: None,
                        apart: None,
                    },
                ),
                &[],
            )
            .unwrap();
        assert!(matches!(r.frame.reply, Reply::Data));
        assert_eq!(r.bulk, [0xab; 16]);
        // Larger than one chunk: refused without touching the backend.
        let r = s
            .handle_req(req(
                4,
                0,
                true,
                Call::MemcpyDtoH {
                    src: 0x1000,
                    len: COPY_CHUNK as u64 + 1,
                    stream: None,
                    apart: None,
                },
            ))
            .unwrap();
        assert_eq!(r.result, CUresult::INVALID_VALUE);
        let r = s
            .handle(req(5, 0, true, Call::ModuleLoad), b".version 8.0\0")
            .unwrap()
            .frame;
        assert!(matches!(r.reply, Reply::Module { handle: 0x77 }));
        let r = s
            .handle_req(req(
                6,
                0,
                true,
                Call::ModuleGetFunction {
                    module: 0x77,
                    name: "k".into(),
                },
            ))
            .unwrap();
        let Reply::Function { handle, info } = r.reply else {
            panic!("{:?}", r.reply)
        };
        assert_eq!((handle, info.params_bytes()), (0x88, 8));
        // A kernel the backend never gave out is refused before it reaches the backend.
        let r = s
            .handle_req(req(7, 0, true, Call::KernelGetFunction { kernel: 1 }))
            .unwrap();
        assert_eq!(r.result, CUresult::INVALID_HANDLE);
        assert_eq!(
            s.backend.log,
            [
                "htod 0x1000 100",
                "dtoh 0x1000 16",
                "load 13",
                "func 0x77 k"
            ]
        );
    }

    #[test]
    fn goodbye_shuts_down_and_closes() {
        let mut s = open(Recorder::default());
        let r = s.handle_req(req(2, 0, true, Call::Goodbye)).unwrap();
        assert_eq!((r.seq, r.result), (2, CUresult::SUCCESS));
        assert!(s.is_closed() && s.backend.shut_down);
        let r = s.handle_req(req(3, 0, true, sync())).unwrap();
        assert_eq!(r.result, CUresult::DEINITIALIZED);
        // finish() after goodbye does not shut down twice.
        s.finish();
        assert_eq!(s.backend.log.iter().filter(|l| *l == "shutdown").count(), 1);
    }

    #[test]
    fn host_copies_on_a_capturing_stream_are_refused() {
        let mut s = open(Recorder::default());
        let htod = |stream| Call::MemcpyHtoD {
            dst: 0x1000,
            stream: Some(stream),
        };
        let begin = Call::Api(ApiCall::cuStreamBeginCapture_v2(
            args::cuStreamBeginCapture_v2 { stream: 2, mode: 0 },
        ));
        assert_eq!(
            s.handle_req(req(2, 0, true, begin)).unwrap().result,
            CUresult::SUCCESS
        );
        let r = s.handle(req(3, 0, true, htod(2)), &[1; 4]).unwrap();
        assert_eq!(r.frame.result, CUresult::STREAM_CAPTURE_UNSUPPORTED);
        let dtoh = Call::MemcpyDtoH {
            src: 0x1000,
            len: 4,
            stream: Some(2),
            apart: None,
        };
        let r = s.handle_req(req(4, 0, true, dtoh)).unwrap();
        assert_eq!(r.result, CUresult::STREAM_CAPTURE_UNSUPPORTED);
        // Another stream copies as usual.
        let r = s.handle(req(5, 0, true, htod(0)), &[1; 4]).unwrap();
        assert_eq!(r.frame.result, CUresult::SUCCESS);
        // The capture ends (here invalidated), and with it the refusal.
        let end = Call::Api(ApiCall::cuStreamEndCapture(args::cuStreamEndCapture {
            stream: 2,
            graph: (),
        }));
        let r = s.handle_req(req(6, 0, true, end)).unwrap();
        assert_eq!(r.result, CUresult::STREAM_CAPTURE_INVALIDATED);
        let r = s.handle(req(7, 0, true, htod(2)), &[1; 4]).unwrap();
        assert_eq!(r.frame.result, CUresult::SUCCESS);
        assert_eq!(
            s.backend.log,
            [
                "begin capture",
                "htod 0x1000 4",
                "end capture",
                "htod 0x1000 4"
            ]
        );
    }
}
