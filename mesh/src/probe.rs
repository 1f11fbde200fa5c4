//! Link measurements: RTT and loss from QUIC's own statistics, bandwidth from short probes.
//!
//! A probe is one bidirectional stream on a mesh connection: the prober sends
//! [`STREAM_PROBE`], a 4-byte length and that many bytes at low priority; the receiver reads them
//! all, timing the last three quarters (after congestion control's slow start has opened the
//! window), and answers with the byte count, the timed byte count and the time it took.
//! Bandwidth = timed bytes / time, measured where the bytes arrive; when that time is too short
//! to trust (a very fast link), the prober's own bytes / (elapsed - RTT) bounds it instead.
//! Probes are small ([`PROBE_BYTES`]) and the daemon skips them while it serves CUDA sessions, so
//! they do not disturb running work.

use std::time::{Duration, Instant};

use tracing::debug;

use crate::state::LinkQuality;

/// First byte of a probe stream.
pub const STREAM_PROBE: u8 = 1;
/// Bytes sent by one probe.
pub const PROBE_BYTES: u32 = 1 << 20;
/// The most a peer may ask us to absorb in one probe.
pub const MAX_PROBE_BYTES: u32 = 16 << 20;

/// Measures the bandwidth towards the other side of `conn`, in bits per second.
pub async fn measure_bandwidth(conn: &quinn::Connection, bytes: u32) -> Result<u64, ProbeError> {
    let rtt = conn.rtt();
    let (mut send, mut recv) = conn.open_bi().await?;
    // Below everything else on this connection.
    let _ = send.set_priority(-100);
    let started = Instant::now();
    let mut header = [0u8; 5];
    header[0] = STREAM_PROBE;
    header[1..].copy_from_slice(&bytes.to_be_bytes());
    send.write_all(&header).await?;
    let chunk = vec![0u8; 64 * 1024];
    let mut left = bytes as usize;
    while left > 0 {
        let n = left.min(chunk.len());
        send.write_all(&chunk[..n]).await?;
        left -= n;
    }
    send.finish()
        .map_err(|_| ProbeError::Protocol("stream closed early"))?;
    let mut reply = [0u8; 24];
    recv.read_exact(&mut reply).await.map_err(|err| match err {
        quinn::ReadExactError::ReadError(err) => ProbeError::Read(err),
        quinn::ReadExactError::FinishedEarly(_) => ProbeError::Protocol("no probe reply"),
    })?;
    let field = |i: usize| {
        let mut word = [0u8; 8];
        word.copy_from_slice(&reply[i * 8..i * 8 + 8]);
        u64::from_be_bytes(word)
    };
    let (total, timed_bytes, timed_us) = (field(0), field(1), field(2));
    if total != u64::from(bytes) || timed_bytes > total {
        return Err(ProbeError::Protocol("probe reply does not match"));
    }
    let elapsed = started.elapsed();
    let transfer = elapsed.saturating_sub(rtt).max(MIN_TRANSFER);
    let whole = f64::from(bytes) * 8.0 / transfer.as_secs_f64();
    let bps = match Duration::from_micros(timed_us) {
        timed if timed >= MIN_TIMED => (timed_bytes as f64 * 8.0 / timed.as_secs_f64()) as u64,
        _ => whole as u64,
    };
    debug!(peer = %conn.remote_address(), ?elapsed, ?rtt, mbps = bps / 1_000_000, "bandwidth probe");
    Ok(bps)
}

/// Answers a probe whose kind byte was already read from `recv`.
pub async fn serve_probe(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) -> Result<(), ProbeError> {
    let mut len = [0u8; 4];
    recv.read_exact(&mut len)
        .await
        .map_err(|_| ProbeError::Protocol("short probe header"))?;
    let len = u32::from_be_bytes(len);
    if len > MAX_PROBE_BYTES {
        return Err(ProbeError::Protocol("probe too large"));
    }
    // Time from the first quarter on: by then slow start is over on any link worth measuring.
    let mark = u64::from(len) / 4;
    let mut total = 0u64;
    let mut timer: Option<(Instant, u64)> = None;
    while let Some(chunk) = recv.read_chunk(usize::MAX, true).await? {
        total += chunk.bytes.len() as u64;
        if total > u64::from(len) {
            return Err(ProbeError::Protocol("probe longer than announced"));
        }
        if timer.is_none() && total >= mark {
            timer = Some((Instant::now(), total));
        }
    }
    let (timed_bytes, timed_us) = match timer {
        Some((since, at)) => (total - at, since.elapsed().as_micros() as u64),
        None => (0, 0),
    };
    let mut reply = [0u8; 24];
    reply[..8].copy_from_slice(&total.to_be_bytes());
    reply[8..16].copy_from_slice(&timed_bytes.to_be_bytes());
    reply[16..].copy_from_slice(&timed_us.to_be_bytes());
    send.write_all(&reply).await?;
    let _ = send.finish();
    Ok(())
}

/// Loss over the interval between two looks at a connection's statistics.
#[derive(Debug, Default)]
pub struct LossMeter {
    sent: u64,
    lost: u64,
}

impl LossMeter {
    /// The fraction of packets lost since the previous call.
    pub fn update(&mut self, stats: &quinn::ConnectionStats) -> f32 {
        let sent = stats.path.sent_packets.saturating_sub(self.sent);
        let lost = stats.path.lost_packets.saturating_sub(self.lost);
        self.sent = stats.path.sent_packets;
        self.lost = stats.path.lost_packets;
        match sent {
            0 => 0.0,
            sent => (lost as f64 / sent as f64).min(1.0) as f32,
        }
    }
}

/// RTT and loss of `conn` now, with the last probed bandwidth.
pub fn link_quality(
    conn: &quinn::Connection,
    meter: &mut LossMeter,
    bandwidth_bps: u64,
) -> LinkQuality {
    LinkQuality {
        rtt_us: u32::try_from(conn.rtt().as_micros()).unwrap_or(u32::MAX),
        bandwidth_bps,
        loss: meter.update(&conn.stats()),
    }
}

/// A probe failed; the link keeps its previous measurement.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// The connection went away.
    #[error("probe: {0}")]
    Connection(#[from] quinn::ConnectionError),
    /// The other side broke the probe protocol.
    #[error("probe: {0}")]
    Protocol(&'static str),
    /// Reading the probe stream failed.
    #[error("probe: {0}")]
    Read(#[from] quinn::ReadError),
    /// Writing the probe stream failed.
    #[error("probe: {0}")]
    Write(#[from] quinn::WriteError),
}

/// Below this, timing noise dominates; cap the estimate instead of dividing by ~0.
const MIN_TRANSFER: Duration = Duration::from_micros(100);
/// The receiver's timing is used only when it spans at least this long.
const MIN_TIMED: Duration = Duration::from_millis(2);

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use gleam_auth::identity::Identity;
    use gleam_auth::tls::{ALPN_MESH, client_config, server_config, server_name};

    #[tokio::test]
    async fn probe_measures_a_loopback_link_and_rejects_oversized_probes() {
        let (server_id, client_id) = (
            Identity::ephemeral().unwrap(),
            Identity::ephemeral().unwrap(),
        );
        let server = quinn::Endpoint::server(
            server_config(&server_id).unwrap(),
            SocketAddr::from(([127, 0, 0, 1], 0)),
        )
        .unwrap();
        let client = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let config = client_config(&client_id, server_id.peer_id(), ALPN_MESH).unwrap();
        let addr = server.local_addr().unwrap();
        let name = server_name(server_id.peer_id());
        let (conn, accepted) = tokio::join!(
            async {
                client
                    .connect_with(config, addr, &name)
                    .unwrap()
                    .await
                    .unwrap()
            },
            async { server.accept().await.unwrap().await.unwrap() },
        );
        let serving = tokio::spawn(async move {
            let mut served = 0;
            while let Ok((send, mut recv)) = accepted.accept_bi().await {
                let mut kind = [0u8; 1];
                recv.read_exact(&mut kind).await.unwrap();
                assert_eq!(kind[0], STREAM_PROBE);
                if serve_probe(send, recv).await.is_ok() {
                    served += 1;
                }
            }
            served
        });
        let bps = measure_bandwidth(&conn, PROBE_BYTES).await.unwrap();
        // Loopback in a debug build: well above 10 Mbit/s, and not absurd.
        assert!(bps > 10_000_000 && bps < 1_000_000_000_000, "{bps}");
        let err = measure_bandwidth(&conn, MAX_PROBE_BYTES + 1)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                ProbeError::Protocol(_) | ProbeError::Read(_) | ProbeError::Write(_)
            ),
            "{err}"
        );
        conn.close(0u32.into(), b"");
        assert_eq!(serving.await.unwrap(), 1);

        let mut meter = LossMeter::default();
        let quality = link_quality(&conn, &mut meter, bps);
        assert_eq!(quality.bandwidth_bps, bps);
        assert!(quality.loss <= 1.0);
    }
}
