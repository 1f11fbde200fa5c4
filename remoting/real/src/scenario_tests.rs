//! Mirrored memory, arrays and texture objects through the session engine, as a client drives them: one
//! scenario, run on the emu backend (CI) and on NVIDIA's driver (`--ignored`, on the GPU machine).

use gleam_protocol::api::{ApiCall, ApiReply, args, outs};
use gleam_protocol::copy::{Copy3D, Side};
use gleam_protocol::descriptors::{
    CUDA_ARRAY3D_DESCRIPTOR, CUDA_ARRAY3D_SURFACE_LDST, CUDA_RESOURCE_DESC, CUDA_TEXTURE_DESC,
    Resource, format,
};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{
    Call, ClientHello, Launch, MirrorRange, MirrorRun, PROTOCOL_VERSION, Reply, Request,
    mirror_hash,
};
use gleam_server::backend::Backend;
use gleam_server::session::Session;

/// `data[i] += 1` for `i < n` (u32).
const ADD_ONE: &str = include_str!("../tests/fixtures/add_one.ptx");

struct Driver<B: Backend> {
    s: Session<B>,
    seq: u64,
    ctx: u64,
}

impl<B: Backend> Driver<B> {
    fn new(backend: B) -> Self {
        let mut d = Self {
            s: Session::new(backend),
            seq: 0,
            ctx: 0,
        };
        let (r, _, _) = d.call(Call::Hello(ClientHello {
            protocol: PROTOCOL_VERSION,
            client: "scenario".into(),
        }));
        assert_eq!(r, CUresult::SUCCESS);
        let retain = d.api(ApiCall::cuDevicePrimaryCtxRetain(
            args::cuDevicePrimaryCtxRetain { pctx: (), dev: 0 },
        ));
        let Ok(ApiReply::cuDevicePrimaryCtxRetain(o)) = retain else {
            panic!("{retain:?}")
        };
        d.ctx = o.pctx;
        d
    }

    fn send(&mut self, call: Call, bulk: &[u8], reply: bool) -> Option<(CUresult, Reply, Vec<u8>)> {
        self.seq += 1;
        let req = Request {
            seq: self.seq,
            ctx: self.ctx,
            expects_reply: reply,
            deps: Default::default(),
            call,
        };
        self.s
            .handle(req, bulk)
            .map(|a| (a.frame.result, a.frame.reply, a.bulk))
    }

    fn call(&mut self, call: Call) -> (CUresult, Reply, Vec<u8>) {
        self.send(call, &[], true).expect("a reply")
    }

    fn api(&mut self, call: ApiCall) -> Result<ApiReply, CUresult> {
        match self.call(Call::Api(call)) {
            (CUresult::SUCCESS, Reply::Api(r), _) => Ok(r),
            (err, _, _) => Err(err),
        }
    }

    fn sync(&mut self) -> CUresult {
        self.api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {}))
            .err()
            .unwrap_or(CUresult::SUCCESS)
    }

    fn read(
        &mut self,
        addr: u64,
        len: u32,
        hash: Option<[u8; 16]>,
    ) -> Result<Option<Vec<u8>>, CUresult> {
        match self.call(Call::MirrorRead {
            ranges: vec![MirrorRange { addr, len, hash }],
        }) {
            (CUresult::SUCCESS, Reply::Mirror { fresh }, bulk) => Ok(fresh[0].then_some(bulk)),
            (err, _, _) => Err(err),
        }
    }

    fn write(&mut self, addr: u64, bytes: &[u8]) -> CUresult {
        let runs = vec![MirrorRun {
            addr,
            len: bytes.len() as u32,
            masked: false,
        }];
        self.send(Call::MirrorWrite { runs }, bytes, true)
            .unwrap()
            .0
    }

    fn add_one(&mut self, function: u64, ptr: u64, n: u32) {
        let mut params = ptr.to_le_bytes().to_vec();
        params.extend(n.to_le_bytes());
        let launch = Launch {
            function,
            grid: [1, 1, 1],
            block: [64, 1, 1],
            shared_mem_bytes: 0,
            stream: 0,
            params,
        };
        assert!(self.send(Call::LaunchKernel(launch), &[], false).is_none());
    }

    fn copy(&mut self, copy: Copy3D, bulk: &[u8]) -> Result<Vec<u8>, CUresult> {
        match self
            .send(Call::Memcpy3D { copy, stream: None }, bulk, true)
            .expect("a reply")
        {
            (CUresult::SUCCESS, _, data) => Ok(data),
            (err, _, _) => Err(err),
        }
    }
}

fn words(n: u32, from: u32) -> Vec<u8> {
    (from..from + n).flat_map(u32::to_le_bytes).collect()
}

pub(crate) fn scenario<B: Backend>(backend: B) {
    let mut d = Driver::new(backend);
    let (r, reply, _) = d.send(Call::ModuleLoad, ADD_ONE.as_bytes(), true).unwrap();
    let Reply::Module { handle: module } = reply else {
        panic!("{r:?}")
    };
    let (_, reply, _) = d.call(Call::ModuleGetFunction {
        module,
        name: "add_one".into(),
    });
    let Reply::Function {
        handle: add_one, ..
    } = reply
    else {
        panic!("{reply:?}")
    };

    // Managed memory: the client's bytes in, a kernel, the device's bytes out.
    let Ok(ApiReply::cuMemAllocManaged(outs::cuMemAllocManaged { dptr: m, .. })) =
        d.api(ApiCall::cuMemAllocManaged(args::cuMemAllocManaged {
            dptr: (),
            bytesize: 4096,
            flags: 1,
        }))
    else {
        panic!("cuMemAllocManaged")
    };
    assert_eq!(d.write(m, &words(16, 10)), CUresult::SUCCESS);
    d.add_one(add_one, m, 16);
    assert_eq!(d.sync(), CUresult::SUCCESS);
    let after = words(16, 11);
    assert_eq!(d.read(m, 64, None), Ok(Some(after.clone())));
    // What the client holds already costs no bytes.
    assert_eq!(d.read(m, 64, Some(mirror_hash(&after))), Ok(None));
    // Outside the allocation, or not mirrored at all: refused.
    assert_eq!(d.read(m + 4090, 16, None), Err(CUresult::INVALID_VALUE));
    assert_eq!(d.read(0x1000, 4, None), Err(CUresult::INVALID_VALUE));

    // Host memory the device maps, through its device pointer.
    let Ok(ApiReply::cuMemHostAlloc(outs::cuMemHostAlloc { pp: h, .. })) =
        d.api(ApiCall::cuMemHostAlloc(args::cuMemHostAlloc {
            pp: (),
            bytesize: 256,
            flags: 3,
        }))
    else {
        panic!("cuMemHostAlloc")
    };
    let Ok(ApiReply::cuMemHostGetDevicePointer_v2(o)) = d.api(
        ApiCall::cuMemHostGetDevicePointer_v2(args::cuMemHostGetDevicePointer_v2 {
            pdptr: (),
            p: h,
            flags: 0,
        }),
    ) else {
        panic!("cuMemHostGetDevicePointer")
    };
    assert_eq!(d.write(h, &words(8, 100)), CUresult::SUCCESS);
    d.add_one(add_one, o.pdptr, 8);
    assert_eq!(d.sync(), CUresult::SUCCESS);
    assert_eq!(d.read(h, 32, None), Ok(Some(words(8, 101))));

    // A pending error of the application is neither reported nor cleared by mirror traffic.
    let bad = Call::Api(ApiCall::cuMemsetD8_v2(args::cuMemsetD8_v2 {
        dst: 0x10,
        value: 0,
        n: 1,
    }));
    assert!(d.send(bad, &[], false).is_none());
    assert_eq!(d.read(h, 4, None), Ok(Some(words(1, 101))));
    assert_ne!(d.sync(), CUresult::SUCCESS);
    assert_eq!(d.sync(), CUresult::SUCCESS);

    // Freed: no longer reachable.
    assert!(
        d.api(ApiCall::cuMemFree_v2(args::cuMemFree_v2 { dptr: m }))
            .is_ok()
    );
    assert_eq!(d.read(m, 4, None), Err(CUresult::INVALID_VALUE));
    assert!(
        d.api(ApiCall::cuMemFreeHost(args::cuMemFreeHost { p: h }))
            .is_ok()
    );
    assert_eq!(d.read(h, 4, None), Err(CUresult::INVALID_VALUE));

    // A 2D float array with surface access: in from the host, a sub-rectangle out.
    let desc = CUDA_ARRAY3D_DESCRIPTOR {
        Width: 8,
        Height: 4,
        Depth: 0,
        Format: format::FLOAT,
        NumChannels: 1,
        Flags: CUDA_ARRAY3D_SURFACE_LDST,
    };
    let Ok(ApiReply::cuArray3DCreate_v2(o)) =
        d.api(ApiCall::cuArray3DCreate_v2(args::cuArray3DCreate_v2 {
            array: (),
            desc: Box::new(desc),
        }))
    else {
        panic!("cuArray3DCreate")
    };
    let a = o.array;
    let image: Vec<u8> = (0..32u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
    let up = Copy3D {
        src: Side::host(32, 4),
        dst: Side::array(a, 0, 0, 0),
        width_bytes: 32,
        height: 4,
        depth: 1,
    };
    assert_eq!(d.copy(up, &image), Ok(Vec::new()));
    let down = Copy3D {
        src: Side::array(a, 8, 1, 0),
        dst: Side::host(12, 2),
        width_bytes: 12,
        height: 2,
        depth: 1,
    };
    let want: Vec<u8> = [10u32, 11, 12, 18, 19, 20]
        .iter()
        .flat_map(|&v| (v as f32).to_le_bytes())
        .collect();
    assert_eq!(d.copy(down, &[]), Ok(want));

    // Texture and surface objects over it.
    let res_desc = CUDA_RESOURCE_DESC::new(Resource::Array(a));
    let tex_desc = CUDA_TEXTURE_DESC {
        addressMode: [1; 3],
        ..Default::default()
    };
    let Ok(ApiReply::cuTexObjectCreate(t)) =
        d.api(ApiCall::cuTexObjectCreate(args::cuTexObjectCreate {
            object: (),
            res_desc: Box::new(res_desc),
            tex_desc: Box::new(tex_desc),
            view_desc: None,
        }))
    else {
        panic!("cuTexObjectCreate")
    };
    let Ok(ApiReply::cuTexObjectGetTextureDesc(back)) = d.api(ApiCall::cuTexObjectGetTextureDesc(
        args::cuTexObjectGetTextureDesc {
            tex_desc: (),
            object: t.object,
        },
    )) else {
        panic!("cuTexObjectGetTextureDesc")
    };
    assert_eq!(back.tex_desc.addressMode, [1; 3]);
    let Ok(ApiReply::cuSurfObjectCreate(s)) =
        d.api(ApiCall::cuSurfObjectCreate(args::cuSurfObjectCreate {
            object: (),
            res_desc: Box::new(res_desc),
        }))
    else {
        panic!("cuSurfObjectCreate")
    };
    assert!(
        d.api(ApiCall::cuTexObjectDestroy(args::cuTexObjectDestroy {
            object: t.object
        }))
        .is_ok()
    );
    assert!(
        d.api(ApiCall::cuSurfObjectDestroy(args::cuSurfObjectDestroy {
            object: s.object
        }))
        .is_ok()
    );
    assert!(
        d.api(ApiCall::cuArrayDestroy(args::cuArrayDestroy { array: a }))
            .is_ok()
    );
    // Dead handles never reach the backend.
    assert_eq!(d.copy(down, &[]), Err(CUresult::INVALID_HANDLE));
    assert_eq!(
        d.api(ApiCall::cuTexObjectDestroy(args::cuTexObjectDestroy {
            object: t.object
        }))
        .err(),
        Some(CUresult::INVALID_HANDLE)
    );
    d.call(Call::Goodbye);
}

#[test]
fn scenario_on_the_emu_backend() {
    scenario(gleam_emu::EmuBackend::new(
        gleam_emu::EmuConfig::with_memory(64 << 20),
    ));
}

#[test]
#[ignore = "needs a GPU: mirrored memory, arrays and texture objects on NVIDIA's driver"]
fn mirror_and_array_scenario_on_a_real_gpu() {
    let backend = crate::RealBackend::new().expect("a GPU and its driver");
    scenario(backend);
}
