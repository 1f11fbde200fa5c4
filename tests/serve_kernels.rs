//! Kernels through `gleam serve`: a PTX module loaded, its function's parameter layout returned with the
//! handle, a launch with a packed parameter buffer, results read back. Runs on the `emu` backend
//! everywhere, and on the `cuda` backend too where NVIDIA's driver finds a GPU.

mod common;

use common::Server;
use common::client::Client;
use gleam_protocol::api::{ApiCall, args};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{Call, Launch, ParamSlot, Reply};

/// `data[i] += 1` for `i < n`, in nvcc's PTX style.
const ADD_ONE: &str = include_str!("../remoting/real/tests/fixtures/add_one.ptx");

async fn add_one_on(backend: &str) {
    let server = Server::start(backend);
    let (mut c, _) = Client::open(&server).await;
    let r = c.call_with(Call::ModuleLoad, ADD_ONE.as_bytes()).await;
    assert_eq!(r.result, CUresult::SUCCESS, "{backend}: module load");
    let Reply::Module { handle: module } = r.reply else {
        panic!("{backend}: {:?}", r.reply)
    };
    let r = c
        .call(Call::ModuleGetFunction {
            module,
            name: "add_one".into(),
        })
        .await;
    assert_eq!(r.result, CUresult::SUCCESS, "{backend}: get function");
    let Reply::Function {
        handle: function,
        info,
    } = r.reply
    else {
        panic!("{backend}: {:?}", r.reply)
    };
    assert_eq!(
        info.params,
        [
            ParamSlot { offset: 0, size: 8 },
            ParamSlot { offset: 8, size: 4 }
        ],
        "{backend}: parameter layout"
    );
    assert!(
        info.attributes.first().is_some_and(|&t| t >= 128),
        "{backend}: {:?}",
        info.attributes
    );

    let n = 1000u32;
    let input: Vec<u8> = (0..n).flat_map(|i| (i * 3).to_le_bytes()).collect();
    let ptr = c.alloc(input.len()).await.unwrap();
    assert_eq!(c.htod(ptr, &input).await, CUresult::SUCCESS);
    let mut params = ptr.to_le_bytes().to_vec();
    params.extend(n.to_le_bytes());
    let launch = |params: Vec<u8>| {
        Call::LaunchKernel(Launch {
            function,
            grid: [n.div_ceil(128), 1, 1],
            block: [128, 1, 1],
            shared_mem_bytes: 0,
            stream: 0,
            params,
        })
    };
    // Two fire-and-forget launches, then a synchronisation.
    c.send(launch(params.clone()), false).await;
    c.send(launch(params), false).await;
    let r = c
        .api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {}))
        .await;
    assert_eq!(r.result, CUresult::SUCCESS, "{backend}: kernels ran");
    let out = c.dtoh(ptr, input.len()).await.unwrap();
    for (i, word) in out.chunks_exact(4).enumerate() {
        let v = u32::from_le_bytes(word.try_into().unwrap());
        assert_eq!(v, i as u32 * 3 + 2, "{backend}: element {i}");
    }
    if backend != "emu" {
        // NVIDIA's driver does not validate handles (a bogus one may crash the session process).
        return;
    }
    // An unknown function handle: the deferred launch's error comes back with the next sync call.
    let mut bad = launch(vec![0; 12]);
    if let Call::LaunchKernel(l) = &mut bad {
        l.function = 0xdead_0000;
    }
    c.send(bad, false).await;
    let r = c
        .api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {}))
        .await;
    assert_ne!(
        r.result,
        CUresult::SUCCESS,
        "{backend}: bad launch reported"
    );
}

#[tokio::test]
async fn add_one_on_emu() {
    add_one_on("emu").await;
}

/// On a machine with a GPU, the same through NVIDIA's driver.
#[tokio::test]
#[ignore = "needs a GPU: run on the GPU machine with --ignored"]
async fn add_one_on_cuda() {
    if let Err(why) = gleam_real::probe() {
        panic!("this test needs a GPU and NVIDIA's driver: {why}");
    }
    add_one_on("cuda").await;
}
