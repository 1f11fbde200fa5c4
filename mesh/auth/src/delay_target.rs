//! The bulk connection's congestion controller: [`DelayTarget`], made by [`DelayTargetConfig`].
//!
//! Every other packet on a path waits in the bottleneck's queue behind bulk data, so the queue a bulk
//! transfer keeps is the delay it adds to every small call of the session. A loss-based controller
//! (Cubic) fills that queue before it backs off; quinn's BBR still keeps several milliseconds of it.
//! [`DelayTarget`] keeps the queue it builds near a target delay, as LEDBAT (RFC 6817) does, with FAST
//! TCP's update: the queueing delay is the round trip above the smallest one seen, and each round the
//! window moves by half the queue's distance from the target (at most doubling, at most halving), so it
//! settles fast and a spike of scheduling noise on a busy host costs a few percent, not half the rate.
//! Where the path's capacity is unknown (the start, a fresh base) the window doubles per round until a
//! queue shows, as slow start does.
//!
//! An application waits on every bulk byte, so unlike a background scavenger this controller must not
//! starve. Two guards:
//! - Delay that does not fall when the window does is not this connection's queue (jitter that holds
//!   under load, a path that changed, a flow that will not yield): after [`STUCK_ROUNDS`] rounds over the
//!   target in which the window fell to a quarter (or to its minimum), the path's base round trip is
//!   measured afresh from the current one. When that happens [`GIVE_UP_REBASES`] times in a row, the
//!   delay carries no signal on this path (a radio link whose delay grows with load by itself), and
//!   quinn's BBR takes the connection over for good.
//! - Loss is taken for congestion (halving the window once per round) only with a queue of four times
//!   the target or more, or above [`LOSS_TOLERANCE`] of a round's bytes (and more than two datagrams):
//!   a radio link's random loss with no queue behind it does not halve the rate.
//!
//! The logic is a pure state machine on the times quinn passes in ([`DelayTarget::handle_ack`] and
//! friends), so it is tested on a simulated bottleneck with a virtual clock.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn::congestion::{Controller, ControllerFactory};

/// The queueing delay the bulk connection aims to keep at the bottleneck, unless
/// `GLEAM_BULK_QUEUE_TARGET_US` says otherwise (see [`queue_target`]). Measured on the GPU machine (H100
/// host, emulated 1 Gbit/s 1 ms link, `GLEAM_BULK_QUEUE_TARGET_US=T WORKLOADS=two-streams LINKS=L1
/// MODES=gleam bash scripts/bench/lan.sh`, 100, 150 and 200 µs alternating twice in one call): the other
/// stream's p99 during a 1 GiB upload of incompressible bytes 1.90 and 1.85 times its idle value at 100 µs,
/// 2.05 and 2.01 at 150, 2.00 and 2.11 at 200, the upload taking 9.07-9.08 s against 9.01-9.04 (0.6%
/// longer); in an earlier call, 500 µs gave 2.0x, and cold 512 MiB weights (compressible) went at 128 MiB/s
/// with 100 µs against 141-146 with 200-500, still 107% of the link.
pub const DEFAULT_TARGET: Duration = Duration::from_micros(100);

/// Rounds over the target (with the window cut to a quarter) after which the delay is taken for the
/// path's, not this connection's queue. A queue of this connection's own is gone two or three rounds
/// after its window fell below the path's capacity, and shows gone a round or two later (the delay is
/// the smallest of two rounds).
pub const STUCK_ROUNDS: u32 = 6;

/// The share of a round's bytes that may be lost with no queue before the loss counts as congestion
/// (1 in 50, BBRv2's threshold).
pub const LOSS_TOLERANCE: u64 = 50;

/// Fresh bases in a row (see [`STUCK_ROUNDS`]) after which the delay is taken for no signal at all.
pub const GIVE_UP_REBASES: u32 = 3;

/// Rounds under the target that end a row of fresh bases.
const HEALTHY_ROUNDS: u32 = 100;

/// The share of the queue's distance from the target that one round removes is 1 / GAIN_DIVISOR.
const GAIN_DIVISOR: u128 = 2;

/// A queue this many times the target is full: a loss then is congestion whatever its share.
const FULL_QUEUE: u32 = 4;

/// Datagrams a round may lose with no queue before its loss share counts.
const LOSS_FLOOR: u64 = 2;

/// The initial window: [`crate::tls::INITIAL_WINDOW`] (a LAN's bandwidth-delay product), or ten datagrams
/// if larger. A download after a quiet spell starts from it (the window does not grow while the
/// application limits the sending).
fn initial_window(mtu: u64) -> u64 {
    crate::tls::INITIAL_WINDOW.max(10 * mtu)
}

/// The target queueing delay: `GLEAM_BULK_QUEUE_TARGET_US` (50-100000 µs), else [`DEFAULT_TARGET`].
pub fn queue_target() -> Duration {
    std::env::var("GLEAM_BULK_QUEUE_TARGET_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_TARGET, |us| {
            Duration::from_micros(us.clamp(50, 100_000))
        })
}

/// Makes a [`DelayTarget`] per connection (a quinn congestion controller factory).
#[derive(Clone, Copy, Debug)]
pub struct DelayTargetConfig {
    /// The queueing delay to keep at the bottleneck.
    pub target: Duration,
}

impl Default for DelayTargetConfig {
    fn default() -> Self {
        Self {
            target: queue_target(),
        }
    }
}

impl ControllerFactory for DelayTargetConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(DelayTarget::new(self.target, now, current_mtu))
    }
}

/// A congestion controller that keeps the bottleneck queue it builds near a target delay (see the module
/// documentation).
#[derive(Clone, Debug)]
pub struct DelayTarget {
    /// Set for good once the path's delay proved not to answer to the window: BBR runs the connection.
    fallback: Option<Fallback>,
    /// Times the base was measured afresh with no stretch of [`HEALTHY_ROUNDS`] under the target between,
    /// and the rounds under the target since the last time.
    rebases: u32,
    rounds_under: u32,
    target: Duration,
    mtu: u64,
    window: u64,
    /// Doubling per round until the queue shows (see [`DelayTarget::handle_ack`]).
    slow_start: bool,
    /// The smallest round trip since the connection began or the base was last measured afresh: the path
    /// with empty queues.
    base: Option<Duration>,
    /// The smallest round trip of the round before this one, and of this one so far: the current delay is
    /// the smaller, so one late acknowledgement (or a busy receiver's scheduling) is not a queue.
    previous_round_min: Option<Duration>,
    round_min: Option<Duration>,
    /// A round ends when a packet sent after it began is acknowledged.
    round_start: Instant,
    round_acked: u64,
    previous_round_acked: u64,
    round_lost: u64,
    /// Consecutive rounds that ended over the target, and the window when they began.
    rounds_over: u32,
    window_when_over: u64,
    /// Losses of packets sent before this do not cut the window again (once per round).
    recovery_start: Instant,
}

impl DelayTarget {
    /// A controller aiming at `target` of queueing delay, for datagrams of `mtu` bytes.
    pub fn new(target: Duration, now: Instant, mtu: u16) -> Self {
        let mtu = u64::from(mtu);
        Self {
            fallback: None,
            rebases: 0,
            rounds_under: 0,
            target,
            mtu,
            window: initial_window(mtu),
            slow_start: true,
            base: None,
            previous_round_min: None,
            round_min: None,
            round_start: now,
            round_acked: 0,
            previous_round_acked: 0,
            round_lost: 0,
            rounds_over: 0,
            window_when_over: 0,
            recovery_start: now,
        }
    }

    /// The congestion window: bytes that may be in flight.
    pub fn window(&self) -> u64 {
        self.window
    }

    /// Whether the path's delay proved not to answer to the window ([`GIVE_UP_REBASES`] fresh bases in
    /// a row): a path whose delay grows with load by itself (a radio link's jitter, a shaper) would keep
    /// the window at its minimum. Quinn's BBR takes the connection over from then on.
    pub fn gave_up(&self) -> bool {
        self.rebases >= GIVE_UP_REBASES
    }

    /// The queueing delay now: the current round trip above the base.
    pub fn queue_delay(&self) -> Duration {
        match (self.current(), self.base) {
            (Some(current), Some(base)) => current.saturating_sub(base),
            _ => Duration::ZERO,
        }
    }

    /// The current round trip: the smallest of this round and the one before.
    fn current(&self) -> Option<Duration> {
        [self.previous_round_min, self.round_min]
            .into_iter()
            .flatten()
            .min()
    }

    fn min_window(&self) -> u64 {
        2 * self.mtu
    }

    /// `bytes` of a packet sent at `sent` were acknowledged at `now`.
    pub fn handle_ack(&mut self, now: Instant, sent: Instant, bytes: u64, app_limited: bool) {
        let rtt = now.saturating_duration_since(sent);
        if sent > self.round_start {
            self.end_round(now);
        }
        self.round_min = Some(self.round_min.map_or(rtt, |m| m.min(rtt)));
        self.base = Some(self.base.map_or(rtt, |b| b.min(rtt)));
        self.round_acked += bytes;
        if app_limited {
            // Too little was sent to tell anything about the window.
            return;
        }
        let (Some(current), Some(base)) = (self.current(), self.base) else {
            return;
        };
        let (queue, target) = (current.saturating_sub(base), self.target);
        if self.slow_start {
            // The path's capacity is unknown (the start, a fresh base): the proportional step below would
            // fill it slowly where the round trip is long next to the target, so the window doubles per
            // round until this round's queue reaches half the target. Not after a cut, where doubling
            // would overshoot the queue each time the proportional step dips below the path's capacity.
            let latest = self.round_min.unwrap_or(current).saturating_sub(base);
            if latest * 2 < target {
                self.window += bytes;
                return;
            }
            self.slow_start = false;
        }
        // FAST TCP's update (Jin, Wei and Low, 2004), spread over a round's acknowledgements: per round
        // the window changes by (target - queue) / round trip of itself, over GAIN_DIVISOR. The window
        // over the round trip is the rate, so that adds or removes 1/GAIN_DIVISOR of the bytes that
        // stand between the queue and the target (at most doubling, at most halving per round).
        let round_trip = current.as_nanos().max(1);
        let bytes = u128::from(bytes);
        if queue <= target {
            let grow = bytes * (target - queue).as_nanos() / (GAIN_DIVISOR * round_trip);
            self.window += u64::try_from(grow.min(bytes)).unwrap_or(u64::MAX);
        } else {
            let shrink = bytes * (queue - target).as_nanos() / (GAIN_DIVISOR * round_trip);
            let shrink = u64::try_from(shrink.min(bytes / 2)).unwrap_or(u64::MAX);
            self.window = self.window.saturating_sub(shrink).max(self.min_window());
        }
    }

    /// Packets sent at `sent` or before were lost (`lost` bytes of them; 0 for an ECN mark).
    pub fn handle_congestion(&mut self, now: Instant, sent: Instant, persistent: bool, lost: u64) {
        self.round_lost += lost;
        if persistent {
            self.window = self.min_window();
            self.slow_start = false;
            self.recovery_start = now;
            return;
        }
        if sent <= self.recovery_start {
            return;
        }
        // The queue this controller keeps hovers around the target; well over it, the queue is full.
        let queued = self.queue_delay() > FULL_QUEUE * self.target;
        // A share of a round means little while a round is a handful of datagrams.
        let lossy = self.round_lost > LOSS_FLOOR * self.mtu
            && self.round_lost * LOSS_TOLERANCE > self.round_acked + self.previous_round_acked;
        if lost == 0 || queued || lossy {
            self.window = (self.window / 2).max(self.min_window());
            self.slow_start = false;
            self.recovery_start = now;
        }
    }

    /// The path now carries datagrams of `mtu` bytes.
    pub fn handle_mtu(&mut self, mtu: u16) {
        self.mtu = u64::from(mtu);
        self.window = self.window.max(self.min_window());
    }

    fn end_round(&mut self, now: Instant) {
        tracing::trace!(
            window = self.window,
            queue_us = self.queue_delay().as_micros() as u64,
            base_us = self.base.map_or(0, |b| b.as_micros() as u64),
            acked = self.round_acked,
            lost = self.round_lost,
            "bulk round"
        );
        if self.queue_delay() > self.target {
            if self.rounds_over == 0 {
                self.window_when_over = self.window;
            }
            self.rounds_over += 1;
            let cut = self.window * 4 <= self.window_when_over || self.window == self.min_window();
            if self.rounds_over >= STUCK_ROUNDS && cut {
                // Not this connection's queue: measure the path afresh from here.
                self.base = self.current();
                self.rounds_over = 0;
                self.rounds_under = 0;
                self.rebases += 1;
                self.slow_start = true;
                tracing::debug!(base = ?self.base, window = self.window, "bulk delay base measured afresh");
            }
        } else {
            self.rounds_over = 0;
            self.rounds_under += 1;
            if self.rounds_under >= HEALTHY_ROUNDS {
                self.rebases = 0;
            }
        }
        if self.round_min.is_some() {
            self.previous_round_min = self.round_min.take();
        }
        self.previous_round_acked = self.round_acked;
        self.round_acked = 0;
        self.round_lost = 0;
        self.round_start = now;
    }
}

impl DelayTarget {
    /// The controller that runs the connection now: BBR once the delay gave no signal.
    fn fallback_or_hand_over(&mut self, now: Instant) -> Option<&mut Box<dyn Controller>> {
        if self.fallback.is_none() && self.gave_up() {
            tracing::info!(
                "the bulk connection's delay does not answer to its window (jitter under load?): \
                 BBR takes it over"
            );
            let mtu = u16::try_from(self.mtu).unwrap_or(u16::MAX);
            let bbr = Arc::new(quinn::congestion::BbrConfig::default()).build(now, mtu);
            self.fallback = Some(Fallback(bbr));
        }
        self.fallback.as_mut().map(|f| &mut f.0)
    }
}

/// The controller a [`DelayTarget`] hands its connection to (cloned through `clone_box`).
struct Fallback(Box<dyn Controller>);

impl Clone for Fallback {
    fn clone(&self) -> Self {
        Self(self.0.clone_box())
    }
}

impl std::fmt::Debug for Fallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Fallback").field(&self.0.window()).finish()
    }
}

impl Controller for DelayTarget {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        if let Some(fallback) = &mut self.fallback {
            fallback.0.on_sent(now, bytes, last_packet_number);
        }
    }

    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &quinn_proto::RttEstimator,
    ) {
        match self.fallback_or_hand_over(now) {
            Some(fallback) => fallback.on_ack(now, sent, bytes, app_limited, rtt),
            None => self.handle_ack(now, sent, bytes, app_limited),
        }
    }

    fn on_end_acks(
        &mut self,
        now: Instant,
        in_flight: u64,
        app_limited: bool,
        largest: Option<u64>,
    ) {
        if let Some(fallback) = &mut self.fallback {
            fallback.0.on_end_acks(now, in_flight, app_limited, largest);
        }
    }

    fn on_congestion_event(&mut self, now: Instant, sent: Instant, persistent: bool, lost: u64) {
        match &mut self.fallback {
            Some(fallback) => fallback.0.on_congestion_event(now, sent, persistent, lost),
            None => self.handle_congestion(now, sent, persistent, lost),
        }
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.handle_mtu(new_mtu);
        if let Some(fallback) = &mut self.fallback {
            fallback.0.on_mtu_update(new_mtu);
        }
    }

    fn window(&self) -> u64 {
        self.fallback.as_ref().map_or(self.window, |f| f.0.window())
    }

    fn metrics(&self) -> quinn::congestion::ControllerMetrics {
        match &self.fallback {
            Some(fallback) => fallback.0.metrics(),
            None => {
                let mut metrics = quinn::congestion::ControllerMetrics::default();
                metrics.congestion_window = self.window;
                metrics
            }
        }
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(self.clone())
    }

    fn initial_window(&self) -> u64 {
        initial_window(self.mtu)
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}
