//! Flow-control credit before and after the mesh proof (issue 11): a connection that has not proven
//! membership can make the server buffer only a few KiB, whatever it pushes and on however many streams;
//! one that has proven it gets the full LAN windows.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gleam_auth::identity::{Identity, MeshSecret};
use gleam_auth::proof::{authenticate_as_client, authenticate_as_server};
use gleam_auth::tls;

/// Connections the attacker opens, and streams it tries on each.
const CONNECTIONS: usize = 8;
const STREAMS: usize = 16;
/// How long it pushes (well inside the 5 s the server waits for a proof).
const PUSH: Duration = Duration::from_millis(1500);

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A server that authenticates every connection as the daemon does, keeping the server side of each.
fn server(secret: MeshSecret) -> (Identity, SocketAddr, Arc<Mutex<Vec<quinn::Connection>>>) {
    let id = Identity::ephemeral().unwrap();
    let endpoint = tls::endpoint(loopback(), Some(tls::server_config(&id).unwrap())).unwrap();
    let addr = endpoint.local_addr().unwrap();
    let conns = Arc::new(Mutex::new(Vec::new()));
    let kept = conns.clone();
    tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            let Ok(conn) = incoming.await else { continue };
            kept.lock().unwrap().push(conn.clone());
            let secret = secret.clone();
            tokio::spawn(async move {
                let _ = authenticate_as_server(&conn, &secret).await;
            });
        }
    });
    (id, addr, conns)
}

async fn connect(server_id: &Identity, addr: SocketAddr) -> (quinn::Endpoint, quinn::Connection) {
    let client = quinn::Endpoint::client(loopback()).unwrap();
    let config = tls::client_config(
        &Identity::ephemeral().unwrap(),
        server_id.peer_id(),
        tls::ALPN_CUDA,
    )
    .unwrap();
    let conn = client
        .connect_with(config, addr, &tls::server_name(server_id.peer_id()))
        .unwrap()
        .await
        .unwrap();
    (client, conn)
}

/// Writes `chunk` on `send` until the push time is over.
async fn push(mut send: quinn::SendStream, chunk: Arc<Vec<u8>>) {
    let _ = tokio::time::timeout(PUSH, async {
        while send.write_all(&chunk).await.is_ok() {}
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_connections_cannot_make_the_server_buffer_more_than_a_few_kib() {
    let (server_id, addr, conns) = server(MeshSecret::generate());
    let chunk = Arc::new(vec![0x5a_u8; 256 << 10]);
    let mut clients = Vec::new();
    let mut pushes = Vec::new();
    let mut opened = 0;
    let mut silent = Vec::new();
    for _ in 0..CONNECTIONS {
        let (endpoint, conn) = connect(&server_id, addr).await;
        // The first stream is the one the server reads a proof from: a wrong proof would end the
        // connection at once, so it stays silent (the server waits for it up to its timeout).
        let (mut proof, proof_recv) = conn.open_bi().await.unwrap();
        proof.write_all(&[]).await.unwrap();
        silent.push((proof, proof_recv));
        opened += 1;
        for _ in 1..STREAMS {
            // Opening waits for stream credit: the streams past the allowance never open.
            let Ok(Ok((send, _recv))) =
                tokio::time::timeout(Duration::from_millis(50), conn.open_bi()).await
            else {
                break;
            };
            opened += 1;
            pushes.push(tokio::spawn(push(send, chunk.clone())));
        }
        if let Ok(Ok(send)) = tokio::time::timeout(Duration::from_millis(50), conn.open_uni()).await
        {
            opened += 1;
            pushes.push(tokio::spawn(push(send, chunk.clone())));
        }
        clients.push((endpoint, conn));
    }
    for p in pushes {
        p.await.unwrap();
    }
    let conns = conns.lock().unwrap().clone();
    assert_eq!(conns.len(), CONNECTIONS);
    let received: Vec<u64> = conns.iter().map(|c| c.stats().udp_rx.bytes).collect();
    eprintln!(
        "{opened} streams opened on {CONNECTIONS} connections; bytes the server received on each: {received:?}"
    );
    assert!(
        opened <= CONNECTIONS * tls::PREAUTH_BIDI_STREAMS as usize,
        "{opened} streams opened before authentication"
    );
    for (i, bytes) in received.iter().enumerate() {
        // The handshake (a padded Initial, the client's certificate), acknowledgements and the
        // pre-authentication window: well under 32 KiB. With the LAN windows it was megabytes.
        assert!(
            *bytes < 32 << 10,
            "connection {i}: the server received {bytes} bytes before any proof"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authenticated_connection_gets_the_full_windows_and_streams() {
    let secret = MeshSecret::generate();
    let (server_id, addr, conns) = server(secret.clone());
    let (_endpoint, conn) = connect(&server_id, addr).await;
    authenticate_as_client(&conn, &secret).await.unwrap();
    let server_conn = conns.lock().unwrap()[0].clone();
    let before = server_conn.stats().udp_rx.bytes;
    // 64 streams of 256 KiB that the server never accepts nor reads: they open and their bytes arrive
    // only if the credit was raised (16 MiB against a 4 KiB window and 2 streams before the proof).
    let chunk = vec![0xa5_u8; 256 << 10];
    let mut sends = Vec::new();
    for _ in 0..64 {
        let (mut send, recv) = tokio::time::timeout(Duration::from_secs(2), conn.open_bi())
            .await
            .expect("stream credit after authentication")
            .unwrap();
        send.write_all(&chunk).await.unwrap();
        sends.push((send, recv));
    }
    let want = before + 64 * chunk.len() as u64;
    let arrived = tokio::time::timeout(Duration::from_secs(10), async {
        while server_conn.stats().udp_rx.bytes < want {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        arrived.is_ok(),
        "only {} of {want} bytes arrived: the credit was not raised",
        server_conn.stats().udp_rx.bytes
    );
}
