//! The bulk connection's delay-target controller on a simulated bottleneck (virtual clock, no sockets):
//! a sender bound by the controller's window, a link of fixed rate with a drop-tail queue, a propagation
//! delay each way, and an acknowledgement per packet; and once under quinn, on a real transfer.

mod common;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use gleam_auth::delay_target::DelayTarget;

const MTU: u64 = 1452;
const TARGET: Duration = gleam_auth::delay_target::DEFAULT_TARGET;

/// One direction of a path: rate, propagation delay each way, queue limit, random loss.
#[derive(Clone, Copy)]
struct Path {
    bytes_per_s: f64,
    one_way: Duration,
    queue_limit: u64,
    /// One packet in this many is lost at random (0: none).
    loss_one_in: u64,
    /// Each packet's delay each way is drawn from `one_way` ± this, in order (`gleam linkemu`'s jitter).
    jitter: Duration,
}

/// What the simulation measured after its warm-up.
struct Outcome {
    /// Delivered bytes per second, as a share of the link rate.
    utilisation: f64,
    /// The 99th percentile of the queueing delay packets met.
    queue_p99: Duration,
    /// Whether the controller gave the connection to BBR.
    gave_up: bool,
}

/// Runs a bulk sender under `DelayTarget` for `length`, over `path` (which `change` may swap for another
/// at a given time), and measures from `warm_up` on.
fn simulate(
    path: Path,
    change: Option<(Duration, Path)>,
    length: Duration,
    warm_up: Duration,
) -> Outcome {
    let t0 = Instant::now();
    let mut cc = DelayTarget::new(TARGET, t0, MTU as u16);
    // Acknowledgements and loss notices, by arrival time: (time, sent, lost).
    let mut events: BinaryHeap<Reverse<(Duration, Duration, bool)>> = BinaryHeap::new();
    let (mut now, mut in_flight, mut link_free) = (Duration::ZERO, 0u64, Duration::ZERO);
    let (mut delivered, mut queue_delays) = (0u64, Vec::new());
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // Each way's delay, drawn from one_way ± jitter.
    let delay = |path: &Path, r: u64| {
        let spread = path.jitter.as_nanos() as u64;
        if spread == 0 {
            return path.one_way;
        }
        (path.one_way + Duration::from_nanos(r % (2 * spread))).saturating_sub(path.jitter)
    };
    let mut last_arrival = Duration::ZERO;
    let mut path_now = path;
    while now < length {
        if let Some((at, next)) = change
            && now >= at
        {
            path_now = next;
        }
        // Send while the window allows.
        while in_flight + MTU <= cc.window() {
            in_flight += MTU;
            let serialisation = Duration::from_secs_f64(MTU as f64 / path_now.bytes_per_s);
            let start = link_free.max(now);
            let backlog = ((start - now).as_secs_f64() * path_now.bytes_per_s) as u64;
            let random_loss = path_now.loss_one_in > 0 && random() % path_now.loss_one_in == 0;
            if backlog + MTU > path_now.queue_limit || random_loss {
                // The sender learns of it about a round trip later.
                events.push(Reverse((
                    now + 2 * path_now.one_way + serialisation,
                    now,
                    true,
                )));
                continue;
            }
            link_free = start + serialisation;
            if now >= warm_up {
                queue_delays.push(start - now);
            }
            // Delivery stays in order, as on a wire.
            last_arrival = last_arrival.max(link_free + delay(&path_now, random()));
            events.push(Reverse((
                last_arrival + delay(&path_now, random()),
                now,
                false,
            )));
        }
        let Some(Reverse((at, sent, lost))) = events.pop() else {
            break;
        };
        now = at;
        in_flight -= MTU;
        if lost {
            cc.handle_congestion(t0 + now, t0 + sent, false, MTU);
        } else {
            if now >= warm_up {
                delivered += MTU;
            }
            cc.handle_ack(t0 + now, t0 + sent, MTU, false);
        }
    }
    queue_delays.sort();
    let measured = (length - warm_up).as_secs_f64();
    let rate = change.map_or(path.bytes_per_s, |(_, p)| p.bytes_per_s);
    Outcome {
        utilisation: delivered as f64 / measured / rate,
        queue_p99: queue_delays[queue_delays.len() * 99 / 100],
        gave_up: cc.gave_up(),
    }
}

/// The benchmark's L1: 1 Gbit/s, 1 ms round trip, a 1.5 MB drop-tail queue.
const L1: Path = Path {
    bytes_per_s: 125e6,
    one_way: Duration::from_micros(500),
    queue_limit: 1_500_000,
    loss_one_in: 0,
    jitter: Duration::ZERO,
};

#[test]
fn fills_the_link_and_keeps_the_queue_near_the_target() {
    let out = simulate(L1, None, Duration::from_secs(3), Duration::from_millis(500));
    assert!(out.utilisation > 0.95, "utilisation {:.3}", out.utilisation);
    assert!(!out.gave_up);
    // A loss-based controller would keep the 1.5 MB queue (12 ms) full.
    assert!(
        out.queue_p99 <= 2 * TARGET,
        "queue p99 {:?} against a target of {TARGET:?}",
        out.queue_p99
    );
}

#[test]
fn random_loss_with_no_queue_does_not_halve_the_rate() {
    // The benchmark's L2 rate and delay, 0.5% loss (a radio link).
    let lossy = Path {
        bytes_per_s: 37.5e6,
        one_way: Duration::from_micros(2500),
        queue_limit: 1_500_000,
        loss_one_in: 200,
        jitter: Duration::ZERO,
    };
    let out = simulate(lossy, None, Duration::from_secs(4), Duration::from_secs(1));
    assert!(out.utilisation > 0.85, "utilisation {:.3}", out.utilisation);
    assert!(!out.gave_up);
}

#[test]
fn a_longer_path_is_measured_afresh_instead_of_starving() {
    // After a second the round trip grows from 1 ms to 4 ms (a path that changed, or jitter that holds
    // under load): 3 ms of delay no window cut can remove.
    let longer = Path {
        one_way: Duration::from_micros(2000),
        ..L1
    };
    let out = simulate(
        L1,
        Some((Duration::from_secs(1), longer)),
        Duration::from_secs(3),
        Duration::from_millis(1500),
    );
    assert!(out.utilisation > 0.9, "utilisation {:.3}", out.utilisation);
}

#[test]
fn a_path_whose_delay_grows_with_load_goes_to_bbr() {
    // The benchmark's L2: 300 Mbit/s, 5 ms round trip, 2 ms of jitter each way, delivered in order. Under
    // load every packet waits for the slowest before it, so the round trip grows by ~4 ms with no queue
    // that any window could drain.
    let jittery = Path {
        bytes_per_s: 37.5e6,
        one_way: Duration::from_micros(2500),
        queue_limit: 1_500_000,
        loss_one_in: 0,
        jitter: Duration::from_millis(2),
    };
    let out = simulate(
        jittery,
        None,
        Duration::from_secs(2),
        Duration::from_secs(1),
    );
    assert!(out.gave_up, "utilisation {:.3}", out.utilisation);
}

#[test]
fn a_full_queue_halves_the_window() {
    // Tail drops behind a standing queue are congestion whatever their share.
    let t0 = Instant::now();
    let mut cc = DelayTarget::new(TARGET, t0, MTU as u16);
    let ms = Duration::from_millis;
    // A 1 ms path, then 2 ms of queue.
    cc.handle_ack(t0 + ms(1), t0, MTU, false);
    for round in 1..4u64 {
        cc.handle_ack(t0 + ms(10 * round), t0 + ms(10 * round - 3), MTU, false);
    }
    assert_eq!(cc.queue_delay(), ms(2));
    let before = cc.window();
    cc.handle_congestion(t0 + ms(50), t0 + ms(45), false, MTU);
    assert_eq!(cc.window(), before / 2);
    // Once per round: a loss of a packet sent before the cut does not cut again.
    cc.handle_congestion(t0 + ms(51), t0 + ms(46), false, MTU);
    assert_eq!(cc.window(), before / 2);
}

/// The bulk connection's configuration on a LAN runs a real QUIC transfer under the delay target: every
/// byte arrives, and the window grew from its initial size on the acknowledgements.
#[tokio::test]
async fn a_bulk_connection_moves_its_bytes_under_the_delay_target() {
    use gleam_auth::tls;
    use std::sync::Arc;

    let peers = common::Peers::new();
    let (server, addr) = peers.server_endpoint(tls::server_config(&peers.server_id).unwrap());
    let accept = common::accept_one_stream(server);
    let client = gleam_auth::dial::client_endpoint().unwrap();
    let mut config = peers.client_config();
    // The LAN's bulk configuration (not fitted to loopback, which keeps BBR).
    config.transport_config(Arc::new(tls::bulk_transport_config()));
    let conn = client
        .connect_with(config, addr, &tls::server_name(peers.server_id.peer_id()))
        .unwrap()
        .await
        .unwrap();
    let data: Vec<u8> = (0..16u32 << 20).map(|i| (i % 251) as u8).collect();
    let mut send = conn.open_uni().await.unwrap();
    send.write_all(&data).await.unwrap();
    send.finish().unwrap();
    assert!(accept.await.unwrap() == data, "the bytes arrived changed");
    let controller = conn
        .congestion_state()
        .into_any()
        .downcast::<DelayTarget>()
        .expect("the bulk connection runs the delay target");
    let initial = 10 * u64::from(conn.stats().path.current_mtu);
    assert!(
        controller.window() > initial,
        "window {} never grew past {initial}",
        controller.window()
    );
}
