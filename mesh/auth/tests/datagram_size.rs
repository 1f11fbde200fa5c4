//! Datagram sizes. Path MTU discovery: a connection between two of Gleam's endpoints grows its datagrams
//! from QUIC's initial 1200 bytes to the configured ceiling (Ethernet's 1452 by default), so bulk copies
//! cost fewer packets and AEAD operations. A path fitted to loopback (`tls::fit_to_path`, both ends)
//! carries loopback datagrams from the first packet on.

mod common;

use std::time::Duration;

use gleam_auth::tls;

use common::Peers;

#[tokio::test]
async fn loopback_connections_grow_their_datagrams_to_the_ceiling() {
    let peers = Peers::new();
    let (server, addr) = peers.server_endpoint(tls::server_config(&peers.server_id).unwrap());
    let accept = common::accept_one_stream(server);
    let client = gleam_auth::dial::client_endpoint().unwrap();
    let conn = client
        .connect_with(
            peers.client_config(),
            addr,
            &tls::server_name(peers.server_id.peer_id()),
        )
        .unwrap()
        .await
        .unwrap();
    let mut send = conn.open_uni().await.unwrap();
    let data = vec![7u8; 8 << 20];
    // Probing takes a few round trips once the handshake is confirmed.
    tokio::time::sleep(Duration::from_millis(100)).await;
    send.write_all(&data).await.unwrap();
    send.finish().unwrap();
    assert_eq!(accept.await.unwrap().len(), data.len());
    let mtu = conn.stats().path.current_mtu;
    eprintln!(
        "path mtu {mtu}, datagrams sent {}",
        conn.stats().udp_tx.datagrams
    );
    assert_eq!(mtu, tls::udp_payload_max(), "path MTU stopped at {mtu}");
}

#[tokio::test]
async fn loopback_paths_carry_loopback_datagrams_from_the_start() {
    let peers = Peers::new();
    let config = tls::server_config(&peers.server_id).unwrap();
    let (server, addr) = peers.server_endpoint(config.clone());
    let accept = tokio::spawn(async move {
        let incoming = server.accept().await.unwrap();
        let conn = tls::accept(incoming, &config).unwrap().await.unwrap();
        tls::grant_credit(&conn);
        let mut recv = conn.accept_uni().await.unwrap();
        let got = recv.read_to_end(usize::MAX).await.unwrap().len();
        (got, conn.stats().path.current_mtu)
    });
    let client = gleam_auth::dial::client_endpoint().unwrap();
    let mut config = peers.client_config();
    config.transport_config(std::sync::Arc::new(tls::transport_config_to(addr)));
    let conn = tokio::time::timeout(
        Duration::from_secs(5),
        client
            .connect_with(config, addr, &tls::server_name(peers.server_id.peer_id()))
            .unwrap(),
    )
    .await
    .expect("the handshake finished")
    .unwrap();
    let mut send = conn.open_uni().await.unwrap();
    let data = vec![7u8; 8 << 20];
    send.write_all(&data).await.unwrap();
    send.finish().unwrap();
    let (got, server_mtu) = tokio::time::timeout(Duration::from_secs(10), accept)
        .await
        .expect("the server received everything")
        .unwrap();
    assert_eq!(got, data.len());
    let stats = conn.stats();
    eprintln!(
        "client mtu {}, server mtu {server_mtu}, datagrams sent {}",
        stats.path.current_mtu, stats.udp_tx.datagrams
    );
    assert_eq!(stats.path.current_mtu, tls::loopback_udp_payload());
    assert_eq!(server_mtu, tls::loopback_udp_payload());
    // 8 MiB in loopback datagrams, not in Ethernet-sized ones.
    assert!(
        stats.udp_tx.datagrams
            < 2 * (data.len() as u64) / u64::from(tls::loopback_udp_payload()) + 200,
        "{} datagrams for {} bytes",
        stats.udp_tx.datagrams,
        data.len()
    );
}
