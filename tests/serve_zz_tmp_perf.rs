mod serve_util;
use std::time::Instant;
use gleam_remoting::api::{ApiCall, args};
use gleam_remoting::wire::{Call, Payload};
use serve_util::{Client, Server};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perf() {
    let server = Server::start_in(&std::env::var("PERF_BACKEND").unwrap_or("emu".into()), tempfile::tempdir().unwrap(), &[("GLEAM_LOG", "warn")]);
    let (mut c, _) = Client::open(&server).await;
    for _ in 0..500 { c.api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {})).await; }
    let n = 5000;
    let t = Instant::now();
    for _ in 0..n { c.api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {})).await; }
    eprintln!("sync rt: {:?}", t.elapsed() / n);
    let ptr = c.alloc(64).await.unwrap();
    let n = 100000;
    let t = Instant::now();
    for _ in 0..n { c.send(Call::Api(ApiCall::cuMemsetD8_v2(args::cuMemsetD8_v2 { dst: ptr, value: 1, n: 64 })), false).await; }
    c.api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {})).await;
    eprintln!("deferred: {:.0}/s", n as f64 / t.elapsed().as_secs_f64());
    let big = vec![5u8; 4 << 20];
    let ptr = c.alloc(256 << 20).await.unwrap();
    let t = Instant::now();
    for i in 0..64u64 { c.send(Call::MemcpyHtoD { dst: ptr + i * (4 << 20), data: Payload::Inline(big.clone()), stream: None }, i == 63).await; }
    c.reply().await.unwrap();
    eprintln!("htod: {:.0} MB/s", 256.0 / t.elapsed().as_secs_f64());
}
