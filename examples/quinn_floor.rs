//! The transport's floor for the LAN benchmark (`scripts/bench/lan.sh`): a bare quinn connection between
//! two processes with Gleam's TLS and transport settings (`gleam_auth::tls`), no CUDA and no protocol: a
//! one-byte round trip (median of 2,000) and a bulk transfer each way on one stream. Gleam's own figures
//! are read against these.
//!
//! Each end runs on one thread (no hand-off between threads, which Gleam's client cannot avoid: the
//! application's thread is not the runtime's) and polls its socket as Gleam's network threads do
//! ([`BusyPoll`]: the client through its round trips, the server for a while after each answer; on hosts
//! where Gleam's waiters spin, unless `GLEAM_BUSY_POLL=off`), so the floor waits for the network the same
//! way.
//!
//! ```text
//! quinn_floor serve 127.0.0.1:0          # prints "listening ADDR PEERID", serves until killed
//! quinn_floor connect ADDR PEERID [MIB]  # prints one JSON object
//! ```

use std::net::SocketAddr;
use std::time::Instant;

use gleam_auth::busy_poll::BusyPoll;
use gleam_auth::identity::{Identity, PeerId};
use gleam_auth::tls::{ALPN_CUDA, client_config, endpoint, server_config, server_name};

const ROUND_TRIPS: usize = 2_000;
const CHUNK: usize = 1 << 20;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match args.get(1).map(String::as_str) {
        Some("serve") => runtime.block_on(serve(args.get(2).map_or("127.0.0.1:0", |s| s).parse()?)),
        Some("connect") if args.len() >= 4 => runtime.block_on(connect(
            args[2].parse()?,
            args[3].parse()?,
            args.get(4).and_then(|m| m.parse().ok()).unwrap_or(256),
        )),
        _ => {
            anyhow::bail!("usage: quinn_floor serve [ADDR] | quinn_floor connect ADDR PEERID [MIB]")
        }
    }
}

/// Polling as Gleam's session process does: on hosts where its waiters spin, unless `GLEAM_BUSY_POLL=off`.
fn busy_poll() -> std::sync::Arc<BusyPoll> {
    BusyPoll::beside_spinning(
        gleam_protocol::tuning::spin_budget(),
        gleam_auth::busy_poll::ANSWER_LINGER,
    )
}

async fn serve(addr: SocketAddr) -> anyhow::Result<()> {
    let id = Identity::ephemeral()?;
    let config = server_config(&id)?;
    let endpoint = endpoint(addr, Some(config.clone()))?;
    println!("listening {} {}", endpoint.local_addr()?, id.peer_id());
    // As a session process: awake for a while after each answer.
    let busy = busy_poll();
    tokio::spawn(busy.clone().run());
    while let Some(incoming) = endpoint.accept().await {
        // Fitted to the path as a session endpoint does (loopback datagrams on loopback).
        let Ok(connecting) = gleam_auth::tls::accept(incoming, &config) else {
            continue;
        };
        let busy = busy.clone();
        tokio::spawn(async move {
            let Ok(conn) = connecting.await else { return };
            // The floor is measured without the proof: the full credit it would have granted.
            gleam_auth::tls::grant_credit(&conn);
            while let Ok((send, recv)) = conn.accept_bi().await {
                tokio::spawn(answer(send, recv, busy.clone()));
            }
        });
    }
    Ok(())
}

/// One stream: `r` echoes single bytes; `u` counts what arrives and answers the count; `d N` sends N MiB.
async fn answer(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    busy: std::sync::Arc<BusyPoll>,
) -> anyhow::Result<()> {
    let mut kind = [0u8; 1];
    recv.read_exact(&mut kind).await?;
    match kind[0] {
        b'r' => {
            let mut byte = [0u8; 1];
            while recv.read_exact(&mut byte).await.is_ok() {
                // Awake for the next request, as after a session's answer.
                busy.touch();
                send.write_all(&byte).await?;
            }
        }
        b'u' => {
            let mut total = 0u64;
            while let Some(chunk) = recv.read_chunk(usize::MAX, true).await? {
                total += chunk.bytes.len() as u64;
            }
            send.write_all(&total.to_le_bytes()).await?;
        }
        b'd' => {
            let mut mib = [0u8; 4];
            recv.read_exact(&mut mib).await?;
            let chunk = bytes::Bytes::from(vec![7u8; CHUNK]);
            for _ in 0..u32::from_le_bytes(mib) {
                send.write_chunk(chunk.clone()).await?;
            }
        }
        _ => {}
    }
    send.finish()?;
    let _ = send.stopped().await;
    Ok(())
}

async fn connect(addr: SocketAddr, peer: PeerId, mib: u32) -> anyhow::Result<()> {
    let id = Identity::ephemeral()?;
    let endpoint = endpoint("0.0.0.0:0".parse()?, None)?;
    let mut config = client_config(&id, peer, ALPN_CUDA)?;
    config.transport_config(std::sync::Arc::new(gleam_auth::tls::transport_config_to(
        addr,
    )));
    let conn = endpoint
        .connect_with(config, addr, &server_name(peer))?
        .await?;

    // Round trips: one byte each way, one stream; awake throughout, as for a thread spinning for its
    // reply.
    let busy = busy_poll();
    tokio::spawn(busy.clone().run());
    let hot = busy.hold();
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(b"r").await?;
    let mut byte = [0u8; 1];
    let mut samples = Vec::with_capacity(ROUND_TRIPS);
    for i in 0..ROUND_TRIPS + 100 {
        let t = Instant::now();
        send.write_all(&[i as u8]).await?;
        recv.read_exact(&mut byte).await?;
        if i >= 100 {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    send.finish()?;
    drop(hot);
    samples.sort_by(f64::total_cmp);
    let median = samples[samples.len() / 2];

    // Upload: MIB MiB on one stream, until the server counted them.
    let (mut send, mut recv) = conn.open_bi().await?;
    let chunk = bytes::Bytes::from(vec![3u8; CHUNK]);
    let t = Instant::now();
    send.write_all(b"u").await?;
    for _ in 0..mib {
        send.write_chunk(chunk.clone()).await?;
    }
    send.finish()?;
    let mut count = [0u8; 8];
    recv.read_exact(&mut count).await?;
    let up = t.elapsed().as_secs_f64();
    anyhow::ensure!(
        u64::from_le_bytes(count) == u64::from(mib) << 20,
        "upload count"
    );

    // Download: MIB MiB from the server.
    let (mut send, mut recv) = conn.open_bi().await?;
    let t = Instant::now();
    send.write_all(b"d").await?;
    send.write_all(&mib.to_le_bytes()).await?;
    send.finish()?;
    let mut got = 0u64;
    while let Some(chunk) = recv.read_chunk(usize::MAX, true).await? {
        got += chunk.bytes.len() as u64;
    }
    let down = t.elapsed().as_secs_f64();
    anyhow::ensure!(got == u64::from(mib) << 20, "download count");
    let mtu = conn.stats().path.current_mtu;
    conn.close(0u32.into(), b"done");
    endpoint.wait_idle().await;
    let m = f64::from(mib);
    println!(
        "{{\"rtt_median_us\": {median:.1}, \"upload_mib_s\": {:.1}, \"download_mib_s\": {:.1}, \"mib\": {mib}, \"mtu\": {mtu}}}",
        m / up,
        m / down
    );
    Ok(())
}
