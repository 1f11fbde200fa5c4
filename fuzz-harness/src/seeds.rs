//! Starting inputs for the fuzzers (`cargo run -p gleam-fuzz-harness --example seeds -- DIR`): real
//! sessions, real PTX and real fatbins, so that mutations start from input that gets deep. The checked-in
//! corpora began as these, grown and minimised by the fuzzers.

use gleam_emu::{EmuBackend, EmuConfig};
use gleam_protocol::api::{ApiCall, ApiReply, args};
use gleam_protocol::frame;
use gleam_protocol::wire::{Call, ClientHello, Launch, PROTOCOL_VERSION, Reply, Request};
use gleam_server::session::Session;

use crate::frames::{EMU_MEMORY, KERNELS_PTX};
use crate::gossip;

/// Seeds of the `frames` target: whole client sessions (chunk byte first).
pub fn frames() -> Vec<Vec<u8>> {
    let mut seeds = vec![
        copies_session(),
        launch_session(),
        streams_session(),
        library_session(),
        contexts_session(),
    ];
    // The same session cut into small pieces, as a slow network delivers it.
    let mut cut = launch_session();
    cut[0] = 7;
    seeds.push(cut);
    // Requests before hello, then a malformed frame.
    let mut s = Recorder::new();
    s.lenient = true;
    s.bare(Call::Api(ApiCall::cuCtxSynchronize(
        args::cuCtxSynchronize {},
    )));
    s.stream
        .extend_from_slice(&[3, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff]);
    seeds.push(s.finish_raw());
    seeds
}

/// Builds a session's byte stream while running it, so later requests can use the handles earlier
/// replies gave.
struct Recorder {
    session: Session<EmuBackend>,
    stream: Vec<u8>,
    seq: u64,
    ctx: u64,
    /// Whether a failing reply is expected (else building the seed stops there).
    lenient: bool,
}

impl Recorder {
    fn new() -> Self {
        Self {
            session: Session::new(EmuBackend::new(EmuConfig::with_memory(EMU_MEMORY))),
            stream: vec![0],
            seq: 0,
            ctx: 0,
            lenient: false,
        }
    }

    /// A session after hello, with the primary context current.
    fn open() -> Self {
        let mut s = Self::new();
        s.call(Call::Hello(ClientHello {
            protocol: PROTOCOL_VERSION,
            client: "fuzz seed".into(),
        }));
        match s.api(ApiCall::cuDevicePrimaryCtxRetain(
            args::cuDevicePrimaryCtxRetain { pctx: (), dev: 0 },
        )) {
            ApiReply::cuDevicePrimaryCtxRetain(o) => s.ctx = o.pctx,
            other => panic!("{other:?}"),
        }
        s
    }

    fn send(&mut self, call: Call, bulk: &[u8], expects_reply: bool) -> Option<Reply> {
        self.seq += 1;
        let request = Request {
            seq: self.seq,
            ctx: self.ctx,
            expects_reply,
            deps: Default::default(),
            call,
        };
        frame::encode(&request, bulk, &mut self.stream).expect("seed requests encode");
        let answer = self.session.handle(request, bulk)?;
        assert!(
            self.lenient || answer.frame.result.is_success(),
            "seed request {} failed: {}",
            self.seq,
            answer.frame.result
        );
        Some(answer.frame.reply)
    }

    fn call_with(&mut self, call: Call, bulk: &[u8]) -> Reply {
        self.send(call, bulk, true).expect("a reply")
    }

    fn call(&mut self, call: Call) -> Reply {
        self.call_with(call, &[])
    }

    fn bare(&mut self, call: Call) {
        self.send(call, &[], false);
    }

    fn api(&mut self, call: ApiCall) -> ApiReply {
        match self.call(Call::Api(call)) {
            Reply::Api(reply) => reply,
            other => panic!("seed call failed: {other:?}"),
        }
    }

    fn alloc(&mut self, bytes: usize) -> u64 {
        match self.api(ApiCall::cuMemAlloc_v2(args::cuMemAlloc_v2 {
            dptr: (),
            bytesize: bytes,
        })) {
            ApiReply::cuMemAlloc_v2(o) => o.dptr,
            other => panic!("{other:?}"),
        }
    }

    fn module(&mut self) -> u64 {
        match self.call_with(Call::ModuleLoad, KERNELS_PTX.as_bytes()) {
            Reply::Module { handle } => handle,
            other => panic!("{other:?}"),
        }
    }

    fn function(&mut self, module: u64, name: &str) -> u64 {
        match self.call(Call::ModuleGetFunction {
            module,
            name: name.into(),
        }) {
            Reply::Function { handle, .. } => handle,
            other => panic!("{other:?}"),
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.call(Call::Goodbye);
        self.stream
    }

    fn finish_raw(self) -> Vec<u8> {
        self.stream
    }
}

fn launch(function: u64, blocks: u32, threads: u32, params: Vec<u8>) -> Call {
    Call::LaunchKernel(Launch {
        function,
        grid: [blocks, 1, 1],
        block: [threads, 1, 1],
        shared_mem_bytes: 0,
        stream: 0,
        params,
    })
}

fn copies_session() -> Vec<u8> {
    let mut s = Recorder::open();
    let a = s.alloc(4096);
    let b = s.alloc(1 << 20);
    s.call_with(
        Call::MemcpyHtoD {
            dst: a,
            stream: None,
        },
        &[7; 4096],
    );
    s.bare(Call::Api(ApiCall::cuMemcpyDtoD_v2(args::cuMemcpyDtoD_v2 {
        dst: b,
        src: a,
        bytes: 4096,
    })));
    s.bare(Call::Api(ApiCall::cuMemsetD8_v2(args::cuMemsetD8_v2 {
        dst: b + 4096,
        value: 9,
        n: 100,
    })));
    s.call(Call::MemcpyDtoH {
        src: b,
        len: 8192,
        stream: None,
        apart: None,
    });
    s.api(ApiCall::cuMemGetInfo_v2(args::cuMemGetInfo_v2 {
        free: (),
        total: (),
    }));
    s.call(Call::Api(ApiCall::cuMemGetAddressRange_v2(
        args::cuMemGetAddressRange_v2 {
            base: (),
            size: (),
            dptr: b + 5,
        },
    )));
    s.bare(Call::Api(ApiCall::cuMemFree_v2(args::cuMemFree_v2 {
        dptr: a,
    })));
    // A memset of freed memory: the deferred error comes back with the next sync call.
    s.lenient = true;
    s.bare(Call::Api(ApiCall::cuMemsetD8_v2(args::cuMemsetD8_v2 {
        dst: a,
        value: 0,
        n: 1,
    })));
    s.call(Call::Api(ApiCall::cuCtxSynchronize(
        args::cuCtxSynchronize {},
    )));
    s.finish()
}

fn launch_session() -> Vec<u8> {
    let mut s = Recorder::open();
    let module = s.module();
    let add = s.function(module, "add");
    let count = s.function(module, "count");
    let mix = s.function(module, "mix");
    let n = 256u32;
    let bufs: Vec<u64> = (0..3).map(|_| s.alloc(n as usize * 4)).collect();
    let input: Vec<u8> = (0..n).flat_map(u32::to_le_bytes).collect();
    s.call_with(
        Call::MemcpyHtoD {
            dst: bufs[0],
            stream: None,
        },
        &input,
    );
    s.call_with(
        Call::MemcpyHtoD {
            dst: bufs[1],
            stream: None,
        },
        &input,
    );
    let mut params = Vec::new();
    for b in &bufs {
        params.extend_from_slice(&b.to_le_bytes());
    }
    params.extend_from_slice(&n.to_le_bytes());
    params.extend_from_slice(&[0; 4]);
    s.bare(launch(add, 2, 128, params));
    s.bare(launch(count, 1, 32, 3u32.to_le_bytes().to_vec()));
    s.bare(launch(mix, 1, 1, vec![1; 40]));
    s.call(Call::MemcpyDtoH {
        src: bufs[2],
        len: u64::from(n) * 4,
        stream: None,
        apart: None,
    });
    s.call(Call::Api(ApiCall::cuModuleGetGlobal_v2(
        args::cuModuleGetGlobal_v2 {
            dptr: true,
            bytes: true,
            module,
            name: "counter".into(),
        },
    )));
    s.call(Call::Api(ApiCall::cuFuncGetAttribute(
        args::cuFuncGetAttribute {
            value: (),
            attrib: 0,
            func: add,
        },
    )));
    s.bare(Call::Api(ApiCall::cuModuleUnload(args::cuModuleUnload {
        module,
    })));
    s.call(Call::Api(ApiCall::cuCtxSynchronize(
        args::cuCtxSynchronize {},
    )));
    s.finish()
}

fn streams_session() -> Vec<u8> {
    let mut s = Recorder::open();
    let stream = match s.api(ApiCall::cuStreamCreate(args::cuStreamCreate {
        stream: (),
        flags: 1,
    })) {
        ApiReply::cuStreamCreate(o) => o.stream,
        other => panic!("{other:?}"),
    };
    let events: Vec<u64> = (0..2)
        .map(|_| {
            match s.api(ApiCall::cuEventCreate(args::cuEventCreate {
                event: (),
                flags: 0,
            })) {
                ApiReply::cuEventCreate(o) => o.event,
                other => panic!("{other:?}"),
            }
        })
        .collect();
    let p = s.alloc(1 << 16);
    s.bare(Call::Api(ApiCall::cuEventRecord(args::cuEventRecord {
        event: events[0],
        stream,
    })));
    s.bare(Call::Api(ApiCall::cuMemsetD32Async(
        args::cuMemsetD32Async {
            dst: p,
            value: 0xdead_beef,
            n: 1 << 14,
            stream,
        },
    )));
    s.send(
        Call::MemcpyHtoD {
            dst: p,
            stream: Some(stream),
        },
        &[1; 64],
        false,
    );
    s.bare(Call::Api(ApiCall::cuEventRecord(args::cuEventRecord {
        event: events[1],
        stream,
    })));
    s.bare(Call::Api(ApiCall::cuStreamWaitEvent(
        args::cuStreamWaitEvent {
            stream: 0,
            event: events[1],
            flags: 0,
        },
    )));
    s.call(Call::MemcpyDtoH {
        src: p,
        len: 256,
        stream: Some(stream),
        apart: None,
    });
    s.call(Call::Api(ApiCall::cuStreamSynchronize(
        args::cuStreamSynchronize { stream },
    )));
    s.call(Call::Api(ApiCall::cuEventElapsedTime(
        args::cuEventElapsedTime {
            ms: (),
            start: events[0],
            end: events[1],
        },
    )));
    for event in events {
        s.bare(Call::Api(ApiCall::cuEventDestroy_v2(
            args::cuEventDestroy_v2 { event },
        )));
    }
    s.bare(Call::Api(ApiCall::cuStreamDestroy_v2(
        args::cuStreamDestroy_v2 { stream },
    )));
    s.finish()
}

fn library_session() -> Vec<u8> {
    let mut s = Recorder::open();
    let library = match s.call_with(Call::LibraryLoad, KERNELS_PTX.as_bytes()) {
        Reply::Library { handle } => handle,
        other => panic!("{other:?}"),
    };
    let kernel = match s.api(ApiCall::cuLibraryGetKernel(args::cuLibraryGetKernel {
        kernel: (),
        library,
        name: "count".into(),
    })) {
        ApiReply::cuLibraryGetKernel(o) => o.kernel,
        other => panic!("{other:?}"),
    };
    s.call(Call::KernelGetFunction { kernel });
    s.bare(launch(kernel, 4, 64, 1u32.to_le_bytes().to_vec()));
    s.call(Call::Api(ApiCall::cuLibraryGetGlobal(
        args::cuLibraryGetGlobal {
            dptr: true,
            bytes: true,
            library,
            name: "table".into(),
        },
    )));
    s.call(Call::Api(ApiCall::cuLibraryUnload(args::cuLibraryUnload {
        library,
    })));
    s.finish()
}

fn contexts_session() -> Vec<u8> {
    let mut s = Recorder::open();
    let ctx = match s.api(ApiCall::cuCtxCreate_v2(args::cuCtxCreate_v2 {
        pctx: (),
        flags: 0,
        dev: 0,
    })) {
        ApiReply::cuCtxCreate_v2(o) => o.pctx,
        other => panic!("{other:?}"),
    };
    let primary = s.ctx;
    s.ctx = ctx;
    let p = s.alloc(1024);
    s.bare(Call::Api(ApiCall::cuCtxSetLimit(args::cuCtxSetLimit {
        limit: 1,
        value: 4096,
    })));
    s.ctx = primary;
    s.alloc(1024);
    s.call(Call::Api(ApiCall::cuCtxDestroy_v2(args::cuCtxDestroy_v2 {
        ctx,
    })));
    // The destroyed context's memory went with it.
    s.lenient = true;
    s.bare(Call::Api(ApiCall::cuMemFree_v2(args::cuMemFree_v2 {
        dptr: p,
    })));
    s.call(Call::Api(ApiCall::cuDevicePrimaryCtxReset_v2(
        args::cuDevicePrimaryCtxReset_v2 { dev: 0 },
    )));
    s.finish()
}

/// Seeds of the `ptx` target: the PTX interpreter's own test kernels and the harness's module.
pub fn ptx() -> Vec<Vec<u8>> {
    let mut seeds = vec![KERNELS_PTX.as_bytes().to_vec()];
    seeds.extend(files("remoting/ptx/tests/fixtures", "ptx"));
    seeds
}

/// Seeds of the `fatbin` target: real fatbins from nvcc 13.0 (plain, LZ4, ZSTD, multi-arch, -rdc) and a
/// PTX image.
pub fn fatbin() -> Vec<Vec<u8>> {
    let mut seeds = files("remoting/fatbin/tests/fixtures", "fatbin");
    seeds.push(KERNELS_PTX.as_bytes().to_vec());
    seeds
}

/// The files with extension `ext` in the workspace folder `dir`.
fn files(dir: &str, ext: &str) -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(dir);
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}
/// Seeds of the `shim` target: its input is decoded into operations ([`arbitrary`]), so any bytes are a
/// sequence of calls; these are pseudo-random ones of a few lengths (the fuzzer finds the structure).
pub fn shim() -> Vec<Vec<u8>> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    [64, 128, 256, 512, 1024, 2048, 4096]
        .iter()
        .map(|&len| (0..len).map(|_| next() as u8).collect())
        .collect()
}

/// Seeds of the `gossip` target: a real exchange. Three members with GPUs answer [`gossip::me`]'s
/// announcements and probes with their own SWIM instances, carrying their published states; what they
/// send it (and the passing of time) is recorded as the target's steps.
pub fn gossip() -> Vec<Vec<u8>> {
    use gleam_mesh::gossip::{Gossip, Member, Output};

    let mut node = gossip::Node::new();
    let mut peers: Vec<Gossip> = (0..3u8)
        .map(|i| {
            let mut g = Gossip::new(
                Member {
                    id: gossip::peer(i),
                    boot: 5,
                },
                u64::from(i),
            );
            g.publish(&sample_state(i)).expect("publishing a state");
            while g.poll().is_some() {}
            g
        })
        .collect();
    let mut steps = Vec::new();
    let mut seeds = Vec::new();
    for round in 0..12 {
        // Deliver what the node sent; record what the peers answer it.
        let mut answers = Vec::new();
        for (to, packet) in std::mem::take(&mut node.outbox) {
            let Some(i) = (0..3u8).find(|&i| gossip::peer(i) == to) else {
                continue;
            };
            let g = &mut peers[usize::from(i)];
            let _ = g.handle_data(&packet);
            while let Some(output) = g.poll() {
                if let Output::Send(dst, bytes) = output
                    && dst == gossip::me().id
                {
                    answers.push((i, bytes.to_vec()));
                }
            }
        }
        for (i, bytes) in answers {
            steps.push(i);
            steps.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
            steps.extend_from_slice(&bytes);
            node.packet(i, &bytes);
        }
        steps.push(3);
        steps.extend_from_slice(&600u16.to_le_bytes());
        node.advance(600);
        if round == 3 || round == 11 {
            seeds.push(steps.clone());
        }
    }
    assert_eq!(node.known(), 3, "the seed exchange carried every state");
    seeds
}

fn sample_state(i: u8) -> gleam_mesh::state::PeerState {
    use gleam_mesh::state::{CacheDigest, GpuSummary, LinkQuality, LinkReport, Load, PeerState};
    PeerState {
        id: gossip::peer(i),
        boot: 5,
        version: 1,
        protocol: gleam_mesh::state::PROTOCOL_VERSION,
        host: format!("host-{i}"),
        addrs: vec![std::net::SocketAddr::from(([10, 0, 0, i + 1], 4747))],
        gpus: vec![GpuSummary {
            model: "NVIDIA H200".into(),
            total_memory: 141 << 30,
            compute_capability: (9, 0),
            emulated: i == 2,
        }],
        load: Load {
            utilization: 0.25,
            free_memory: 100 << 30,
            active_sessions: 1,
            queue_len: 0,
            mean_job_secs: 3.5,
        },
        cache: CacheDigest::default(),
        links: vec![LinkReport {
            peer: gossip::me().id,
            quality: LinkQuality {
                rtt_us: 400,
                bandwidth_bps: 1_000_000_000,
                loss: 0.0,
            },
        }],
    }
}

/// Seeds of the `link` target: hello and duplicate messages, probes answered as a fast and a slow link
/// would answer them, traffic.
pub fn link() -> Vec<Vec<u8>> {
    use gleam_mesh::duplicate::{LinkMessage, Run};

    let message = |m: &LinkMessage| {
        let bytes = postcard::to_allocvec(m).expect("a link message encodes");
        let mut step = vec![4, bytes.len() as u8];
        step.extend_from_slice(&bytes);
        step
    };
    let answer = |received: u64, timed_bytes: u64, timed_us: u64, ms: u16| {
        let mut step = vec![2];
        step.extend_from_slice(&received.to_be_bytes());
        step.extend_from_slice(&timed_bytes.to_be_bytes());
        step.extend_from_slice(&timed_us.to_be_bytes());
        step.extend_from_slice(&ms.to_le_bytes());
        step.extend_from_slice(&4u16.to_le_bytes());
        step
    };
    let wait = |ms: u16| {
        let mut step = vec![0];
        step.extend_from_slice(&ms.to_le_bytes());
        step
    };
    let hello = message(&LinkMessage::Hello(Run {
        nonce: 42,
        started_ms: 1_700_000_000_000,
    }));
    let duplicate = message(&LinkMessage::Duplicate {
        addr: std::net::SocketAddr::from(([192, 168, 1, 20], 4747)),
    });
    let mut fast = [hello.clone(), wait(1100), vec![1]].concat();
    fast.extend(answer(16 << 10, 15 << 10, 130, 2));
    fast.extend([wait(1000), vec![1]].concat());
    fast.extend(answer(64 << 10, 60 << 10, 500, 3));
    let mut slow = [duplicate, wait(1100), vec![1]].concat();
    slow.extend(answer(16 << 10, 8 << 10, 90_000, 100));
    slow.extend(
        [
            wait(5000),
            vec![1],
            vec![3],
            1_000_000u64.to_le_bytes().to_vec(),
        ]
        .concat(),
    );
    vec![hello, fast, slow]
}

/// Seeds of the `control` target: the requests `gleam peers list` and `gleam run` send.
pub fn control() -> Vec<Vec<u8>> {
    use gleam_mesh::control::Request;
    use gleam_mesh::select::JobHint;

    [
        Request::List,
        Request::Best {
            hint: JobHint::default(),
        },
        Request::Best {
            hint: JobHint {
                bytes: 1 << 30,
                compute_secs: 60.0,
                memory: 40 << 30,
            },
        },
    ]
    .iter()
    .map(|r| {
        let mut line = serde_json::to_vec(r).expect("a request encodes");
        line.push(b'\n');
        line
    })
    .collect()
}
