//! Link measurements: RTT and loss from QUIC's own statistics, bandwidth from the traffic that flows
//! and from small, budgeted probes.
//!
//! A probe is one bidirectional stream on a mesh connection: the prober sends [`STREAM_PROBE`], a
//! 4-byte length and that many bytes at low priority; the receiver reads them, timing from the first
//! byte to the last (the dispersion of a packet train, which the bottleneck of the path sets), and
//! answers with the byte count, the timed byte count and the time it took. A receiver stops a probe
//! that has taken [`MAX_SPAN`] (STOP_SENDING, then its answer over what arrived), so a probe sized for
//! a fast link costs a slow one no more than that.
//!
//! When and how big: [`Prober`], a sans-IO policy per link. Probes are sized to take about
//! [`TARGET_SPAN`] at the current estimate, and a token bucket of link time keeps all probes on a link
//! below [`SHARE_PERCENT`] percent of wall time (so of the link's capacity), however slow the link.
//! Traffic already flowing (sessions served over a link) raises the estimate without any probe.

use std::time::{Duration, Instant};

use tracing::debug;

use crate::state::LinkQuality;

/// First byte of a probe stream.
pub const STREAM_PROBE: u8 = 1;
/// The most a peer may ask us to absorb in one probe.
pub const MAX_PROBE_BYTES: u32 = 16 << 20;
/// Probes never take more than this share of a link's time (averaged over [`Prober`]'s bucket).
pub const SHARE_PERCENT: u32 = 2;
/// The smallest probe: large enough to get past the burst allowance of a shaper (a token bucket
/// passes its burst at line rate) and to span several packets.
pub const MIN_PROBE: u32 = 16 << 10;
/// The largest probe (about 3 ms at 10 Gbit/s).
pub const MAX_PROBE: u32 = 4 << 20;
/// A probe is sized to take about this long at the current estimate.
pub const TARGET_SPAN: Duration = Duration::from_millis(10);
/// A receiver ends a probe after this long, whatever its size.
pub const MAX_SPAN: Duration = Duration::from_millis(100);

/// What a finished probe measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProbeReport {
    /// Bytes the receiver got (all of them, or fewer when it stopped the probe at [`MAX_SPAN`]).
    pub received: u64,
    /// Bytes that arrived after the first chunk.
    pub timed_bytes: u64,
    /// Time from the first chunk to the last, at the receiver.
    pub timed: Duration,
    /// Time from the first byte sent to the answer, at the prober (the probe's cost).
    pub elapsed: Duration,
    /// The connection's smoothed RTT when the probe started.
    pub rtt: Duration,
}

/// Measures the bandwidth towards the other side of `conn` with a probe of `bytes` bytes.
pub async fn measure_bandwidth(
    conn: &quinn::Connection,
    bytes: u32,
) -> Result<ProbeReport, ProbeError> {
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
        match send.write_all(&chunk[..n]).await {
            Ok(()) => left -= n,
            // The receiver ended the probe at its time limit: its answer follows.
            Err(quinn::WriteError::Stopped(_)) => break,
            Err(err) => return Err(err.into()),
        }
    }
    let _ = send.finish();
    let mut reply = [0u8; 24];
    let read = recv.read_exact(&mut reply).await;
    // Whatever was not sent yet is not worth sending now.
    let _ = send.reset(quinn::VarInt::from_u32(0));
    read.map_err(|err| match err {
        quinn::ReadExactError::ReadError(err) => ProbeError::Read(err),
        quinn::ReadExactError::FinishedEarly(_) => ProbeError::Protocol("no probe reply"),
    })?;
    let report = parse_reply(&reply, bytes, started.elapsed(), rtt)?;
    debug!(peer = %conn.remote_address(), bytes, ?report, "bandwidth probe");
    Ok(report)
}

/// Reads the receiver's answer to a probe of `sent` bytes, which took `elapsed` at the prober with the
/// connection's RTT at `rtt`. The receiver is another device: its figures are checked, not trusted.
pub fn parse_reply(
    reply: &[u8; 24],
    sent: u32,
    elapsed: Duration,
    rtt: Duration,
) -> Result<ProbeReport, ProbeError> {
    let field = |i: usize| {
        let mut word = [0u8; 8];
        word.copy_from_slice(&reply[i * 8..i * 8 + 8]);
        u64::from_be_bytes(word)
    };
    let (received, timed_bytes, timed_us) = (field(0), field(1), field(2));
    if received > u64::from(sent) || timed_bytes > received {
        return Err(ProbeError::Protocol("probe reply does not match"));
    }
    Ok(ProbeReport {
        received,
        timed_bytes,
        timed: Duration::from_micros(timed_us),
        elapsed,
        rtt,
    })
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
    let mut total = 0u64;
    // When the first chunk arrived, and how many bytes it carried.
    let mut first: Option<(Instant, u64)> = None;
    let mut last = None;
    while total < u64::from(len) {
        let deadline = first.map(|(at, _)| at + MAX_SPAN);
        let next = recv.read_chunk(usize::MAX, true);
        let chunk = match deadline {
            Some(deadline) => match tokio::time::timeout_at(deadline.into(), next).await {
                Ok(chunk) => chunk?,
                Err(_) => {
                    // Long enough: stop the sender and answer over what arrived.
                    let _ = recv.stop(quinn::VarInt::from_u32(0));
                    break;
                }
            },
            None => next.await?,
        };
        let Some(chunk) = chunk else { break };
        let now = Instant::now();
        total += chunk.bytes.len() as u64;
        if total > u64::from(len) {
            return Err(ProbeError::Protocol("probe longer than announced"));
        }
        match first {
            None => first = Some((now, total)),
            Some(_) => last = Some(now),
        }
    }
    let (timed_bytes, timed_us) = match (first, last) {
        (Some((since, at)), Some(until)) => (
            total - at,
            until.saturating_duration_since(since).as_micros() as u64,
        ),
        _ => (0, 0),
    };
    let mut reply = [0u8; 24];
    reply[..8].copy_from_slice(&total.to_be_bytes());
    reply[8..16].copy_from_slice(&timed_bytes.to_be_bytes());
    reply[16..].copy_from_slice(&timed_us.to_be_bytes());
    send.write_all(&reply).await?;
    let _ = send.finish();
    Ok(())
}

/// When to probe one link and how big, and what its bandwidth is (sans-IO: time comes in).
///
/// * Cadence: a probe every `interval` (1 s by default), so a change shows within about that.
/// * Budget: a bucket of link time fills at [`SHARE_PERCENT`] % of wall time up to [`BUCKET`]; every
///   probe costs the time it took, and none starts while the bucket is empty. On a slow link, where even
///   the smallest probe takes long, this stretches the cadence instead of exceeding the share.
/// * Size: [`TARGET_SPAN`] at the current estimate, within [`MIN_PROBE`]..[`MAX_PROBE`]; four times the
///   last size when the last probe was too quick to time (so the estimate was only a lower bound).
/// * Estimate: a probe that differs from the estimate by more than 2x replaces it (a link change shows at
///   once); closer ones are averaged in (noise does not make the choice of peer flap). Traffic that
///   flowed faster than the estimate raises it ([`Prober::on_traffic`]).
/// * Confirmation: the noise of a probe is one-sided. A host busy elsewhere delays the receiver's reads
///   (a 16 KiB probe over a bare veth once read as 4 Mbit/s on a loaded 2-core machine), nothing makes a
///   link look faster than it is. So the first reading of a link, and a reading below half the estimate,
///   stand only once a second probe, sent at once ([`CONFIRM_AFTER`]) and sized to the low reading,
///   agrees; otherwise the higher of the two is kept. The confirming probe does not wait for the budget
///   (it follows a probe that did, and its cost is charged like any other), so the long-run share holds.
#[derive(Clone, Debug)]
pub struct Prober {
    interval: Duration,
    estimate: Option<Estimate>,
    /// A reading that would replace the estimate downwards (or be the first one), until a confirming
    /// probe agrees.
    unconfirmed: Option<Estimate>,
    last_size: u32,
    /// Link time probes may still use; negative after an expensive probe.
    credit_us: i64,
    refilled: Instant,
    /// Earliest start of the next probe.
    due: Instant,
    in_flight: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Estimate {
    bps: u64,
    /// Only "at least this": the probe was too quick to time.
    lower_bound: bool,
    at: Instant,
}

impl Prober {
    /// A new link, first probed after `first_after`, then every `interval` (budget permitting).
    pub fn new(now: Instant, first_after: Duration, interval: Duration) -> Self {
        Self {
            interval,
            estimate: None,
            unconfirmed: None,
            last_size: MIN_PROBE,
            credit_us: BUCKET.as_micros() as i64,
            refilled: now,
            due: now + first_after,
            in_flight: false,
        }
    }

    /// The bandwidth estimate in bits per second (`None` until the first measurement).
    pub fn bandwidth_bps(&self) -> Option<u64> {
        self.estimate.map(|estimate| estimate.bps)
    }

    /// Whether a probe should start now, and with how many bytes. Marks it in flight: report its end
    /// with [`Prober::on_probe_done`].
    pub fn poll_probe(&mut self, now: Instant) -> Option<u32> {
        self.refill(now);
        // A confirming probe goes whatever the budget (see the type's doc).
        let budget_ok = self.credit_us >= 0 || self.unconfirmed.is_some();
        if self.in_flight || now < self.due || !budget_ok {
            return None;
        }
        // A confirming probe is sized to the reading it checks.
        let size = match self.unconfirmed.or(self.estimate) {
            None => MIN_PROBE,
            Some(estimate) if estimate.lower_bound => self.last_size.saturating_mul(4),
            Some(estimate) => {
                let bytes = estimate.bps as f64 / 8.0 * TARGET_SPAN.as_secs_f64();
                bytes.min(f64::from(MAX_PROBE)).round() as u32
            }
        }
        .clamp(MIN_PROBE, MAX_PROBE);
        self.in_flight = true;
        self.last_size = size;
        Some(size)
    }

    /// A probe ended (`None`: it failed after `cost`); charges its cost and updates the estimate.
    ///
    /// The cost is the link time the probe took: its duration, or its whole size at the rate it measured
    /// when that is longer (bytes the receiver stopped may still have been queued), with the headers
    /// and ACKs that came with it.
    pub fn on_probe_done(&mut self, now: Instant, report: Option<ProbeReport>, cost: Duration) {
        self.refill(now);
        self.in_flight = false;
        self.due = now + self.interval;
        // A probe the receiver stopped still had bytes queued at the bottleneck: count the whole probe
        // at the rate it measured, but no more than half again its span (the sender resets the rest).
        // The receiver's figures are its word: computed in floating point and capped before they become
        // a Duration (a span of u64::MAX µs over one timed byte once overflowed it and panicked).
        let airtime = report
            .filter(|report| report.timed >= MIN_TIMED && report.timed_bytes > 0)
            .map_or(Duration::ZERO, |report| {
                let whole = report.timed.as_secs_f64() * f64::from(self.last_size)
                    / report.timed_bytes as f64;
                Duration::try_from_secs_f64(whole.min(cost.as_secs_f64() * 1.5))
                    .unwrap_or(Duration::ZERO)
            });
        let charged = cost.max(airtime).mul_f64(WIRE_OVERHEAD);
        self.credit_us -= charged.as_micros().min(i64::MAX as u128) as i64;
        let Some(report) = report else {
            // A failed confirmation: a first reading stands, a low one is dropped (the budget's
            // exemption ends here either way).
            if let Some(low) = self.unconfirmed.take() {
                self.estimate.get_or_insert(low);
            }
            return;
        };
        let sample = match report.timed {
            timed if timed >= MIN_TIMED && report.timed_bytes > 0 => Estimate {
                bps: (report.timed_bytes as f64 * 8.0 / timed.as_secs_f64()) as u64,
                lower_bound: false,
                at: now,
            },
            _ => {
                // Too quick to time: the whole probe within about one round trip at most.
                let span = report.elapsed.saturating_sub(report.rtt).max(MIN_TIMED);
                Estimate {
                    bps: (report.received as f64 * 8.0 / span.as_secs_f64()) as u64,
                    lower_bound: true,
                    at: now,
                }
            }
        };
        self.on_sample(now, sample);
    }

    fn on_sample(&mut self, now: Instant, sample: Estimate) {
        // This probe confirms (or not) an earlier low reading: the two agree within 2x, or the higher
        // one (the noise only ever lowers a reading) stands.
        if let Some(low) = self.unconfirmed.take() {
            let confirmed = match ratio(sample, low) {
                r if (0.5..=2.0).contains(&r) && !sample.lower_bound && !low.lower_bound => {
                    Estimate {
                        bps: (low.bps + sample.bps) / 2,
                        lower_bound: false,
                        at: now,
                    }
                }
                _ if sample.bps >= low.bps => sample,
                _ => Estimate { at: now, ..low },
            };
            self.estimate = Some(match self.estimate {
                // The low reading was not borne out: the link is as fast as it was.
                Some(old) if ratio(confirmed, old) >= 0.5 => Estimate { at: now, ..old },
                _ => confirmed,
            });
            return;
        }
        let Some(old) = self.estimate else {
            self.unconfirmed = Some(sample);
            self.due = now + CONFIRM_AFTER;
            return;
        };
        let r = ratio(sample, old);
        self.estimate = Some(if sample.lower_bound {
            // A bound says "at least": it only raises.
            match sample.bps > old.bps {
                true => sample,
                false => Estimate { at: now, ..old },
            }
        } else if r < 0.5 {
            self.unconfirmed = Some(sample);
            self.due = now + CONFIRM_AFTER;
            old
        } else if old.lower_bound || r > 2.0 {
            sample
        } else {
            Estimate {
                bps: (old.bps + sample.bps) / 2,
                lower_bound: false,
                at: now,
            }
        });
    }

    /// Traffic delivered over the link at `bps` (e.g. a CUDA session served to that peer): a rate the
    /// link evidently has. Raises the estimate when higher, and postpones the next probe.
    pub fn on_traffic(&mut self, now: Instant, bps: u64) {
        let higher = self
            .estimate
            .or(self.unconfirmed)
            .is_none_or(|estimate| bps > estimate.bps);
        if higher && bps > 0 {
            // Evidence against a low reading awaiting its confirmation.
            self.unconfirmed = None;
            self.estimate = Some(Estimate {
                bps,
                lower_bound: false,
                at: now,
            });
        }
        if !self.in_flight {
            self.due = self.due.max(now + self.interval);
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.refilled);
        self.refilled = now;
        let earned = elapsed.as_micros() as i64 * i64::from(SHARE_PERCENT) / 100;
        self.credit_us = (self.credit_us + earned).min(BUCKET.as_micros() as i64);
    }
}

/// How soon a first or low reading is checked by a second probe.
pub const CONFIRM_AFTER: Duration = Duration::from_millis(100);

/// `a`'s rate over `b`'s.
fn ratio(a: Estimate, b: Estimate) -> f64 {
    a.bps as f64 / b.bps.max(1) as f64
}

/// The most link time probes may save up (so at most this much more than the share in a burst).
pub const BUCKET: Duration = Duration::from_millis(20);

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
    #[error("probe: connection lost")]
    Connection(#[from] quinn::ConnectionError),
    /// The other side broke the probe protocol.
    #[error("probe: {0}")]
    Protocol(&'static str),
    /// Reading the probe stream failed.
    #[error("probe: reading the stream failed")]
    Read(#[from] quinn::ReadError),
    /// Writing the probe stream failed.
    #[error("probe: writing the stream failed")]
    Write(#[from] quinn::WriteError),
}

/// Bytes on the wire per probe byte: QUIC, UDP, IP and Ethernet headers on ~1200-byte packets, and the
/// ACKs coming back.
const WIRE_OVERHEAD: f64 = 1.1;

/// The receiver's timing is trusted only when it spans at least this long (scheduling noise is
/// tens of microseconds).
const MIN_TIMED: Duration = Duration::from_millis(1);

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use gleam_auth::identity::Identity;
    use gleam_auth::tls::{ALPN_MESH, client_config, server_config, server_name};

    async fn pair() -> (
        quinn::Connection,
        quinn::Connection,
        quinn::Endpoint,
        quinn::Endpoint,
    ) {
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
        // No proof in these tests: the credit a proof would have granted.
        gleam_auth::tls::grant_credit(&accepted);
        (conn, accepted, client, server)
    }

    #[tokio::test]
    async fn probe_measures_a_loopback_link_and_rejects_oversized_probes() {
        let (conn, accepted, _client, _server) = pair().await;
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
        let report = measure_bandwidth(&conn, 1 << 20).await.unwrap();
        assert_eq!(report.received, 1 << 20);
        assert!(report.timed_bytes <= report.received);
        let mut prober = Prober::new(Instant::now(), Duration::ZERO, Duration::from_secs(1));
        assert_eq!(prober.poll_probe(Instant::now()), Some(MIN_PROBE));
        prober.on_probe_done(Instant::now(), Some(report), report.elapsed);
        assert_eq!(
            prober.bandwidth_bps(),
            None,
            "a first reading awaits its confirmation"
        );
        let size = prober
            .poll_probe(Instant::now() + CONFIRM_AFTER)
            .expect("the confirming probe");
        let confirm = measure_bandwidth(&conn, size).await.unwrap();
        prober.on_probe_done(Instant::now(), Some(confirm), confirm.elapsed);
        let bps = prober.bandwidth_bps().unwrap();
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
        assert_eq!(serving.await.unwrap(), 2);

        let mut meter = LossMeter::default();
        let quality = link_quality(&conn, &mut meter, bps);
        assert_eq!(quality.bandwidth_bps, bps);
        assert!(quality.loss <= 1.0);
    }

    /// A report of `bytes` at `bps`, timed by the receiver.
    fn report(bytes: u64, bps: u64) -> (ProbeReport, Duration) {
        let timed = Duration::from_secs_f64(bytes as f64 * 8.0 / bps as f64);
        let rtt = Duration::from_micros(300);
        let report = ProbeReport {
            received: bytes,
            timed_bytes: bytes,
            timed,
            elapsed: timed + rtt,
            rtt,
        };
        (report, report.elapsed)
    }

    /// Runs a prober on a virtual clock over a link of `bps` for `secs`; returns the share of link
    /// time its probes used and the estimates seen.
    fn simulate(
        prober: &mut Prober,
        t0: Instant,
        from: Duration,
        secs: u64,
        bps: u64,
    ) -> (f64, Duration) {
        let mut now = t0 + from;
        let end = now + Duration::from_secs(secs);
        let mut busy = Duration::ZERO;
        while now < end {
            if let Some(size) = prober.poll_probe(now) {
                // What the receiver would measure: stopped at MAX_SPAN.
                let full = Duration::from_secs_f64(f64::from(size) * 8.0 / bps as f64);
                let span = full.min(MAX_SPAN);
                let bytes = (span.as_secs_f64() * bps as f64 / 8.0) as u64;
                let (report, cost) = report(bytes, bps);
                now += cost;
                busy += span;
                prober.on_probe_done(now, Some(report), cost);
            }
            // The daemon looks every 250 ms.
            now += Duration::from_millis(250);
        }
        (busy.as_secs_f64() / secs as f64, now - t0)
    }

    #[test]
    fn probes_take_at_most_the_share_of_a_slow_link() {
        let t0 = Instant::now();
        let mut prober = Prober::new(t0, Duration::ZERO, Duration::from_secs(1));
        // 1 Mbit/s: even the smallest probe takes 131 ms, so the budget, not the interval, paces it.
        let (share, _) = simulate(&mut prober, t0, Duration::ZERO, 600, 1_000_000);
        assert!(
            share <= f64::from(SHARE_PERCENT) / 100.0 * 1.05,
            "share {share}"
        );
        let bps = prober.bandwidth_bps().unwrap();
        assert!((900_000..1_100_000).contains(&bps), "{bps}");
        // 200 kbit/s: the probe is cut at MAX_SPAN; still within the share.
        let mut prober = Prober::new(t0, Duration::ZERO, Duration::from_secs(1));
        let (share, _) = simulate(&mut prober, t0, Duration::ZERO, 600, 200_000);
        assert!(
            share <= f64::from(SHARE_PERCENT) / 100.0 * 1.05,
            "share {share}"
        );
    }

    #[test]
    fn a_fast_link_is_probed_every_interval_with_probes_sized_to_it() {
        let t0 = Instant::now();
        let mut prober = Prober::new(t0, Duration::ZERO, Duration::from_secs(1));
        let (share, _) = simulate(&mut prober, t0, Duration::ZERO, 60, 1_000_000_000);
        let bps = prober.bandwidth_bps().unwrap();
        assert!((900_000_000..1_100_000_000).contains(&bps), "{bps}");
        // About TARGET_SPAN per second: 1 %.
        assert!(share < 0.015, "share {share}");
        let size = prober.poll_probe(t0 + Duration::from_secs(3600)).unwrap();
        assert_eq!(size, 1_250_000, "10 ms at 1 Gbit/s");
    }

    #[test]
    fn an_absurd_answer_from_the_receiver_is_survived() {
        let t0 = Instant::now();
        let mut prober = Prober::new(t0, Duration::ZERO, Duration::from_secs(1));
        // A fast link makes the next probe large; then the receiver claims one timed byte over
        // u64::MAX microseconds.
        simulate(&mut prober, t0, Duration::ZERO, 10, 10_000_000_000);
        let now = t0 + Duration::from_secs(3600);
        let size = prober.poll_probe(now).unwrap();
        let mut reply = [0u8; 24];
        reply[..8].copy_from_slice(&u64::from(size).to_be_bytes());
        reply[8..16].copy_from_slice(&1u64.to_be_bytes());
        reply[16..].copy_from_slice(&u64::MAX.to_be_bytes());
        let cost = Duration::from_millis(5);
        let report = parse_reply(&reply, size, cost, Duration::from_micros(200)).unwrap();
        prober.on_probe_done(now + cost, Some(report), cost);
        assert!(prober.poll_probe(now + Duration::from_secs(10)).is_some());
    }

    #[test]
    fn a_link_change_replaces_the_estimate_at_the_next_probe() {
        let t0 = Instant::now();
        let mut prober = Prober::new(t0, Duration::ZERO, Duration::from_secs(1));
        let (_, at) = simulate(&mut prober, t0, Duration::ZERO, 10, 1_000_000_000);
        // The link drops to 20 Mbit/s: within 1.5 s (one interval and a tick) the estimate follows.
        let (_, _) = simulate(&mut prober, t0, at, 2, 20_000_000);
        let bps = prober.bandwidth_bps().unwrap();
        assert!((15_000_000..25_000_000).contains(&bps), "{bps}");
        // And back up: once the ~160 ms of link time the cut probe cost is paid back (8 s at 2 %), a
        // first quick probe shows "much faster" (a lower bound), the next ones time it properly.
        let back = at + Duration::from_secs(2);
        let (_, _) = simulate(&mut prober, t0, back, 9, 1_000_000_000);
        let bps = prober.bandwidth_bps().unwrap();
        assert!(bps > 100_000_000, "{bps}");
        let (_, _) = simulate(
            &mut prober,
            t0,
            back + Duration::from_secs(9),
            3,
            1_000_000_000,
        );
        let bps = prober.bandwidth_bps().unwrap();
        assert!(bps > 500_000_000, "{bps}");
    }

    #[test]
    fn small_differences_are_averaged_and_quick_probes_grow() {
        let t0 = Instant::now();
        let mut prober = Prober::new(t0, Duration::ZERO, Duration::from_secs(1));
        assert_eq!(prober.poll_probe(t0), Some(MIN_PROBE));
        let (first, cost) = report(100_000, 100_000_000);
        prober.on_probe_done(t0, Some(first), cost);
        let now = t0 + CONFIRM_AFTER;
        prober.poll_probe(now).unwrap();
        let (second, cost) = report(100_000, 150_000_000);
        prober.on_probe_done(now, Some(second), cost);
        let mean = prober.bandwidth_bps().unwrap();
        assert!(mean.abs_diff(125_000_000) < 1_000, "{mean}");
        let now = now + Duration::from_secs(2);
        prober.poll_probe(now).unwrap();
        let (third, cost) = report(100_000, 175_000_000);
        prober.on_probe_done(now, Some(third), cost);
        let mean = prober.bandwidth_bps().unwrap();
        assert!(mean.abs_diff(150_000_000) < 1_000, "{mean}");

        // A probe that arrives in one go (not timed): a lower bound, and the next is 4x bigger.
        let mut prober = Prober::new(t0, Duration::ZERO, Duration::from_secs(1));
        let quick = |size: u32| ProbeReport {
            received: u64::from(size),
            timed_bytes: 0,
            timed: Duration::ZERO,
            elapsed: Duration::from_micros(400),
            rtt: Duration::from_micros(300),
        };
        let size = prober.poll_probe(t0).unwrap();
        prober.on_probe_done(t0, Some(quick(size)), Duration::from_micros(400));
        let now = t0 + CONFIRM_AFTER;
        assert_eq!(prober.poll_probe(now), Some(size * 4));
        prober.on_probe_done(now, Some(quick(size * 4)), Duration::from_micros(400));
        let bound = prober.bandwidth_bps().unwrap();
        assert_eq!(bound, u64::from(size) * 4 * 8 * 1000, "bytes per MIN_TIMED");
        assert_eq!(
            prober.poll_probe(now + Duration::from_secs(2)),
            Some(size * 16)
        );
    }

    #[test]
    fn a_stalled_probe_does_not_make_a_fast_link_slow() {
        let t0 = Instant::now();
        // The first probe's last bytes were read 32 ms late (the receiving host was busy): 4 Mbit/s
        // on a 1 Gbit/s link. The confirming probe, sized to 4 Mbit/s, arrives in one go.
        let mut prober = Prober::new(t0, Duration::ZERO, Duration::from_secs(1));
        let size = prober.poll_probe(t0).unwrap();
        let (stalled, cost) = report(u64::from(size), 4_000_000);
        let mut now = t0 + cost;
        prober.on_probe_done(now, Some(stalled), cost);
        assert_eq!(prober.bandwidth_bps(), None);
        assert_eq!(prober.poll_probe(now), None, "not before CONFIRM_AFTER");
        now += CONFIRM_AFTER;
        // Sent although the stalled probe overdrew the budget.
        let size = prober.poll_probe(now).expect("confirming probe");
        assert_eq!(
            size, MIN_PROBE,
            "10 ms at 4 Mbit/s is below the smallest probe"
        );
        let (fast, cost) = report(u64::from(size), 1_000_000_000);
        prober.on_probe_done(now + cost, Some(fast), cost);
        assert!(prober.bandwidth_bps().unwrap() > 100_000_000);

        // Once measured, a stall makes a reading to confirm, not the estimate.
        let mut prober = Prober::new(t0, Duration::ZERO, Duration::from_secs(1));
        let (_, at) = simulate(&mut prober, t0, Duration::ZERO, 5, 1_000_000_000);
        let now = t0 + at + Duration::from_secs(2);
        let size = prober.poll_probe(now).unwrap();
        let (stalled, cost) = report(u64::from(size), 100_000_000);
        prober.on_probe_done(now, Some(stalled), cost);
        let bps = prober.bandwidth_bps().unwrap();
        assert!(bps > 900_000_000, "{bps}");
        let size = prober.poll_probe(now + CONFIRM_AFTER).unwrap();
        assert_eq!(size, 125_000, "sized to the low reading");
        let (fast, cost) = report(u64::from(size), 1_000_000_000);
        prober.on_probe_done(now + CONFIRM_AFTER, Some(fast), cost);
        let bps = prober.bandwidth_bps().unwrap();
        assert!(bps > 900_000_000, "{bps}");
        // The next probe waits for the interval again.
        assert_eq!(prober.poll_probe(now + CONFIRM_AFTER * 2), None);
    }

    #[test]
    fn traffic_raises_the_estimate_and_defers_probes() {
        let t0 = Instant::now();
        let mut prober = Prober::new(t0, Duration::ZERO, Duration::from_secs(1));
        prober.on_traffic(t0, 300_000_000);
        assert_eq!(prober.bandwidth_bps(), Some(300_000_000));
        assert_eq!(prober.poll_probe(t0 + Duration::from_millis(500)), None);
        // Slower traffic says nothing about capacity (the application may have sent little).
        prober.on_traffic(t0, 1_000);
        assert_eq!(prober.bandwidth_bps(), Some(300_000_000));
        assert!(prober.poll_probe(t0 + Duration::from_secs(2)).is_some());
        // A failed probe costs its time but keeps the estimate.
        prober.on_probe_done(t0 + Duration::from_secs(2), None, Duration::from_millis(10));
        assert_eq!(prober.bandwidth_bps(), Some(300_000_000));
    }
}
