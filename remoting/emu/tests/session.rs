//! The session engine over the emu backend: the requests a client sends, in order, with deferred calls and
//! the sticky error of a faulting kernel coming back in the next reply.

mod common;

use common::{PTX, Params};
use gleam_emu::{EmuBackend, EmuConfig};
use gleam_protocol::api::{ApiCall, ApiReply, args};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{
    Call, ClientHello, Launch, PROTOCOL_VERSION, Reply, ReplyFrame, Request,
};
use gleam_server::session::Session;

struct Client {
    session: Session<EmuBackend>,
    seq: u64,
    ctx: u64,
    /// The bulk bytes of the last answer (device-to-host data).
    bulk: Vec<u8>,
}

impl Client {
    fn send_with(&mut self, call: Call, bulk: &[u8], expects_reply: bool) -> Option<ReplyFrame> {
        self.seq += 1;
        let request = Request {
            seq: self.seq,
            ctx: self.ctx,
            expects_reply,
            deps: Default::default(),
            call,
        };
        let answer = self.session.handle(request, bulk)?;
        assert_eq!(answer.frame.seq, self.seq);
        self.bulk = answer.bulk;
        Some(answer.frame)
    }

    fn send(&mut self, call: Call, expects_reply: bool) -> Option<ReplyFrame> {
        self.send_with(call, &[], expects_reply)
    }

    fn call_with(&mut self, call: Call, bulk: &[u8]) -> (CUresult, Reply) {
        let r = self.send_with(call, bulk, true).expect("a reply");
        (r.result, r.reply)
    }

    fn call(&mut self, call: Call) -> (CUresult, Reply) {
        self.call_with(call, &[])
    }

    fn api(&mut self, call: ApiCall) -> Result<ApiReply, CUresult> {
        match self.call(Call::Api(call)) {
            (CUresult::SUCCESS, Reply::Api(r)) => Ok(r),
            (err, _) => Err(err),
        }
    }
}

#[test]
fn a_client_session_end_to_end() {
    let mut c = Client {
        session: Session::new(EmuBackend::new(EmuConfig::with_memory(16 << 20))),
        seq: 0,
        ctx: 0,
        bulk: Vec::new(),
    };
    let (res, reply) = c.call(Call::Hello(ClientHello {
        protocol: PROTOCOL_VERSION,
        client: "test".into(),
    }));
    assert_eq!(res, CUresult::SUCCESS);
    let Reply::Hello(hello) = reply else {
        panic!("no hello")
    };
    assert_eq!(hello.backend, "emu");
    assert_eq!(hello.devices[0].attributes[75], 7);

    let Ok(ApiReply::cuDevicePrimaryCtxRetain(r)) = c.api(ApiCall::cuDevicePrimaryCtxRetain(
        args::cuDevicePrimaryCtxRetain { pctx: (), dev: 0 },
    )) else {
        panic!("retain failed")
    };
    c.ctx = r.pctx;

    let alloc =
        |c: &mut Client, n: usize| match c.api(ApiCall::cuMemAlloc_v2(args::cuMemAlloc_v2 {
            dptr: (),
            bytesize: n,
        })) {
            Ok(ApiReply::cuMemAlloc_v2(o)) => Ok(o.dptr),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
    let a = alloc(&mut c, 128).unwrap();
    let b = alloc(&mut c, 128).unwrap();
    let input: Vec<u8> = (0..32u32).flat_map(|v| (v * 10).to_le_bytes()).collect();
    assert_eq!(
        c.call_with(
            Call::MemcpyHtoD {
                dst: a,
                stream: None
            },
            &input
        )
        .0,
        CUresult::SUCCESS
    );
    let (res, reply) = c.call_with(Call::ModuleLoad, PTX.as_bytes());
    assert_eq!(res, CUresult::SUCCESS);
    let Reply::Module { handle: module } = reply else {
        panic!("no module")
    };
    let get = |c: &mut Client, name: &str| match c.call(Call::ModuleGetFunction {
        module,
        name: name.into(),
    }) {
        (CUresult::SUCCESS, Reply::Function { handle, .. }) => handle,
        other => panic!("{other:?}"),
    };
    let add_one = get(&mut c, "addOne");
    let poke = get(&mut c, "poke");

    // A deferred launch, then a synchronous read-back on the legacy stream.
    let launch = |function: u64, params: Params| Launch {
        function,
        grid: [1, 1, 1],
        block: [32, 1, 1],
        shared_mem_bytes: 0,
        stream: 0,
        params: params.0,
    };
    assert!(
        c.send(
            Call::LaunchKernel(launch(add_one, Params::default().u64(a).u64(b))),
            false
        )
        .is_none()
    );
    let (res, reply) = c.call(Call::MemcpyDtoH {
        src: b,
        len: 128,
        stream: None,
        apart: None,
    });
    assert_eq!(res, CUresult::SUCCESS);
    let Reply::Data = reply else {
        panic!("no data")
    };
    let out: Vec<u32> = c
        .bulk
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(out, (0..32).map(|v| v * 10 + 1).collect::<Vec<_>>());

    // A deferred error that is not sticky: reported once by the next sync call.
    c.send(
        Call::Api(ApiCall::cuMemsetD8_v2(args::cuMemsetD8_v2 {
            dst: 0x42,
            value: 0,
            n: 1,
        })),
        false,
    );
    assert_eq!(alloc(&mut c, 16), Err(CUresult::INVALID_VALUE));
    assert!(alloc(&mut c, 16).is_ok());

    // A faulting kernel: fire-and-forget succeeds, then every later call reports the sticky error.
    assert!(
        c.send(
            Call::LaunchKernel(launch(poke, Params::default().u64(0x8))),
            false
        )
        .is_none()
    );
    assert_eq!(
        c.call(Call::MemcpyDtoH {
            src: b,
            len: 4,
            stream: None,
            apart: None,
        })
        .0,
        CUresult::ILLEGAL_ADDRESS
    );
    assert_eq!(alloc(&mut c, 16), Err(CUresult::ILLEGAL_ADDRESS));
    assert_eq!(alloc(&mut c, 16), Err(CUresult::ILLEGAL_ADDRESS));

    assert_eq!(c.call(Call::Goodbye).0, CUresult::SUCCESS);
    assert!(c.session.is_closed());
    assert_eq!(c.session.backend_mut().memory().live_allocations(), 0);
}
