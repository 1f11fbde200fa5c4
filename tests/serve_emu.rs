//! `gleam serve --backend emu` end to end: a real server process on loopback, real QUIC, mesh
//! authentication, one session process per client.

mod common;

use std::time::{Duration, Instant};

use common::Server;
use common::client::{Client, connect_raw, pattern};
use gleam_auth::identity::MeshSecret;
use gleam_host::{CLOSE_PROTOCOL_VIOLATION, CLOSE_WORKER_FAILED};
use gleam_protocol::api::{ApiCall, args};
use gleam_protocol::frame::MAX_BULK;
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{COPY_CHUNK, Call, ClientHello, PROTOCOL_VERSION, Reply};

fn close_of(err: &quinn::ConnectionError) -> (quinn::VarInt, String) {
    match err {
        quinn::ConnectionError::ApplicationClosed(close) => (
            close.error_code,
            String::from_utf8_lossy(&close.reason).into_owned(),
        ),
        other => panic!("expected the server to close the connection, got {other}"),
    }
}

#[tokio::test]
async fn hello_allocate_and_copy_round_trip() {
    let server = Server::start("emu");
    let (mut c, hello) = Client::open(&server).await;
    assert_eq!(hello.protocol, PROTOCOL_VERSION);
    assert_eq!(hello.backend, "emu");
    assert!(!hello.devices.is_empty(), "the emu backend has a device");
    assert!(hello.devices[0].total_mem > 0);
    assert!(hello.devices[0].attributes.len() > 100);
    assert_ne!(c.ctx, 0, "a primary context handle");

    // More than one chunk, so the copy is split into fire-and-forget pieces and a final sync one.
    let len = COPY_CHUNK + 12345;
    let data = pattern(len, 7);
    let ptr = c.alloc(len).await.expect("allocation");
    assert_eq!(c.htod(ptr, &data).await, CUresult::SUCCESS);
    let back = c.dtoh(ptr, len).await.expect("copy back");
    assert!(back == data, "device memory returns what was written");

    // A sub-range, at an offset.
    let back = c.dtoh(ptr + 1000, 64).await.expect("copy back a slice");
    assert_eq!(back, &data[1000..1064]);

    let r = c
        .api(ApiCall::cuMemFree_v2(args::cuMemFree_v2 { dptr: ptr }))
        .await;
    assert_eq!(r.result, CUresult::SUCCESS);
    let r = c.call(Call::Goodbye).await;
    assert_eq!(r.result, CUresult::SUCCESS);
    let (code, reason) = close_of(&c.closed(Duration::from_secs(5)).await);
    assert_eq!(code, quinn::VarInt::from_u32(0), "{reason}");
}

#[tokio::test]
async fn bad_handles_and_pointers_give_cuda_errors() {
    let server = Server::start("emu");
    let (mut c, _) = Client::open(&server).await;
    let r = c
        .api(ApiCall::cuStreamSynchronize(args::cuStreamSynchronize {
            stream: 0xdead_beef_0000,
        }))
        .await;
    assert_eq!(r.result, CUresult::INVALID_HANDLE);
    let r = c
        .call(Call::ModuleGetFunction {
            module: 0xdead_beef_0000,
            name: "nope".into(),
        })
        .await;
    assert_eq!(r.result, CUresult::INVALID_HANDLE);
    // An unknown device pointer.
    assert_eq!(c.dtoh(0x10, 16).await, Err(CUresult::INVALID_VALUE));
    // A deferred free of a bogus pointer: reported by the next sync call, then cleared.
    c.send(
        Call::Api(ApiCall::cuMemFree_v2(args::cuMemFree_v2 { dptr: 0x10 })),
        false,
    )
    .await;
    let sync = || ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {});
    assert_eq!(c.api(sync()).await.result, CUresult::INVALID_VALUE);
    assert_eq!(c.api(sync()).await.result, CUresult::SUCCESS);
    // The session still works.
    assert!(c.alloc(4096).await.is_ok());
}

#[tokio::test]
async fn allocation_beyond_the_emulated_memory_is_out_of_memory() {
    let server = Server::start("emu");
    let (mut c, hello) = Client::open(&server).await;
    let total = hello.devices[0].total_mem as usize;
    assert_eq!(
        c.alloc(total + (1 << 20)).await,
        Err(CUresult::OUT_OF_MEMORY)
    );
    // Not sticky: smaller allocations still work.
    assert!(c.alloc(1 << 20).await.is_ok());
}

#[tokio::test]
async fn protocol_mismatch_is_a_clear_error() {
    let server = Server::start("emu");
    let mut c = Client::connect(&server).await;
    let r = c
        .call(Call::Hello(ClientHello {
            protocol: PROTOCOL_VERSION + 100,
            client: "from the future".into(),
        }))
        .await;
    assert_eq!(r.result, CUresult::SYSTEM_DRIVER_MISMATCH);
    assert!(matches!(r.reply, Reply::Empty));
}

#[tokio::test]
async fn malformed_frame_closes_only_that_connection() {
    let server = Server::start("emu");
    let (mut good, _) = Client::open(&server).await;
    let (mut bad, _) = Client::open(&server).await;
    let ptr = good.alloc(256).await.unwrap();
    assert_eq!(good.htod(ptr, &pattern(256, 1)).await, CUresult::SUCCESS);

    // A frame of three bytes that is not a request.
    bad.send_raw(&[3, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff])
        .await;
    let (code, reason) = close_of(&bad.closed(Duration::from_secs(5)).await);
    assert_eq!(code, CLOSE_PROTOCOL_VIOLATION, "{reason}");
    assert!(reason.contains("malformed"), "{reason}");

    // The other session did not notice.
    assert_eq!(good.dtoh(ptr, 256).await.unwrap(), pattern(256, 1));
    // And new clients are served.
    let (mut third, _) = Client::open(&server).await;
    assert!(third.alloc(64).await.is_ok());
}

#[tokio::test]
async fn oversized_frame_closes_the_connection() {
    let server = Server::start("emu");
    let (mut c, _) = Client::open(&server).await;
    c.send_raw(&1u32.to_le_bytes()).await;
    c.send_raw(&((MAX_BULK as u32) + 1).to_le_bytes()).await;
    let (code, reason) = close_of(&c.closed(Duration::from_secs(5)).await);
    assert_eq!(code, CLOSE_PROTOCOL_VIOLATION, "{reason}");
    assert!(reason.contains("exceeds"), "{reason}");
}

#[tokio::test]
async fn clients_cannot_read_each_others_memory() {
    let server = Server::start("emu");
    let (mut a, _) = Client::open(&server).await;
    let (mut b, _) = Client::open(&server).await;
    let secret = pattern(4096, 99);
    let ptr = a.alloc(4096).await.unwrap();
    assert_eq!(a.htod(ptr, &secret).await, CUresult::SUCCESS);

    // B never allocated: A's pointer means nothing in B's session.
    let read = b.dtoh(ptr, 4096).await;
    assert!(read.is_err(), "B read A's memory: {read:?}");
    // Even if B's own allocation lands on the same address, it is B's memory, not A's bytes.
    let mine = b.alloc(4096).await.unwrap();
    if let Ok(bytes) = b.dtoh(ptr, 4096).await {
        assert_eq!(mine, ptr);
        assert_ne!(bytes, secret, "B saw A's bytes");
    }
    // Separate processes serve them.
    assert!(
        server.session_pids().len() >= 2,
        "{:?}",
        server.session_pids()
    );
    assert_eq!(a.dtoh(ptr, 4096).await.unwrap(), secret);
}

#[tokio::test]
async fn a_client_without_the_mesh_secret_is_refused() {
    let server = Server::start("emu");
    let outsider = MeshSecret::generate();
    let err = connect_raw(&server, &outsider)
        .await
        .expect_err("a client outside the mesh is refused");
    assert!(
        err.contains("refused") || err.contains("mesh"),
        "unexpected error: {err}"
    );
    assert!(
        server.session_pids().is_empty(),
        "no session process was started"
    );
    // Members are still served.
    let (mut c, _) = Client::open(&server).await;
    assert!(c.alloc(64).await.is_ok());
}

#[tokio::test]
async fn killing_the_session_process_ends_the_session_quickly() {
    let server = Server::start("emu");
    let (mut c, _) = Client::open(&server).await;
    let pids = server.session_pids();
    assert_eq!(pids.len(), 1, "{pids:?}");
    let status = std::process::Command::new("kill")
        .args(["-KILL", &pids[0].to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let started = Instant::now();
    let err = c
        .try_call(Call::Api(ApiCall::cuCtxSynchronize(
            args::cuCtxSynchronize {},
        )))
        .await;
    assert!(err.is_err(), "a call after the kill fails: {err:?}");
    let (code, reason) = close_of(&c.closed(Duration::from_secs(5)).await);
    assert_eq!(code, CLOSE_WORKER_FAILED, "{reason}");
    assert!(reason.contains("signal 9"), "{reason}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn a_closed_connection_ends_its_session_process() {
    let server = Server::start("emu");
    let (c, _) = Client::open(&server).await;
    assert_eq!(server.session_pids().len(), 1);
    c.conn.close(quinn::VarInt::from_u32(0), b"bye");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !server.session_pids().is_empty() {
        assert!(Instant::now() < deadline, "session process still running");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn killing_the_server_ends_its_session_processes() {
    let mut server = Server::start("emu");
    let (_c, _) = Client::open(&server).await;
    let pids = server.session_pids();
    assert_eq!(pids.len(), 1, "{pids:?}");
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::path::Path::new(&format!("/proc/{}", pids[0])).exists()
        && !std::fs::read_to_string(format!("/proc/{}/stat", pids[0]))
            .is_ok_and(|s| s.contains(") Z "))
    {
        assert!(
            Instant::now() < deadline,
            "session process outlived its server"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn mesh_protocol_connections_are_not_served() {
    use gleam_auth::identity::Identity;
    use gleam_auth::tls::{ALPN_MESH, client_config, server_name};
    let server = Server::start("emu");
    let identity = Identity::ephemeral().unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(client_config(&identity, server.peer, ALPN_MESH).unwrap());
    let conn = endpoint
        .connect(server.addr, &server_name(server.peer))
        .unwrap()
        .await
        .unwrap();
    let err = tokio::time::timeout(Duration::from_secs(5), conn.closed())
        .await
        .unwrap();
    let (_, reason) = close_of(&err);
    assert!(reason.contains("only serves CUDA sessions"), "{reason}");
    assert!(server.session_pids().is_empty());
}

#[tokio::test]
async fn auto_backend_serves_with_emu_when_there_is_no_gpu() {
    let server = Server::start("auto");
    let (_c, hello) = Client::open(&server).await;
    let expected = match gleam_real::probe() {
        Ok(_) => "cuda",
        Err(_) => "emu",
    };
    assert_eq!(hello.backend, expected);
}

#[test]
fn cuda_backend_without_a_gpu_is_refused_at_start() {
    if gleam_real::probe().is_ok() {
        return; // A GPU is present: `--backend cuda` serves (see serve_kernels).
    }
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(common::gleam())
        .args(["serve", "127.0.0.1:0", "--backend", "cuda", "--config-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "no listening line");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no usable GPU"), "{stderr}");
}
