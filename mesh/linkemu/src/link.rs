//! The sans-IO core: one direction of an emulated link, driven by the caller's clock.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::config::{LinkConfig, MAX_DELAY, jittered};

/// Whatever the configured queue, a link never holds more than this many bytes (queued plus
/// in flight), so a flood cannot exhaust memory.
pub const MAX_HELD_BYTES: u64 = 256 << 20;

/// One direction of an emulated link: a drop-tail queue served at `rate`, then a propagation delay
/// of `delay ± jitter`, with random loss on arrival.
///
/// It does no IO and reads no clock: feed it datagrams with [`Link::handle_datagram`], take them
/// out with [`Link::poll_transmit`] once [`Link::poll_timeout`] has passed. `T` is whatever the
/// caller needs to send the datagram on (its bytes, an address); the link only looks at `len`.
#[derive(Debug)]
pub struct Link<T> {
    config: LinkConfig,
    rng: StdRng,
    /// When the serializer finishes the last accepted datagram.
    busy_until: Option<Instant>,
    /// Datagrams past the queue, ordered by delivery time.
    in_flight: VecDeque<Datagram<T>>,
    held_bytes: u64,
    stats: LinkStats,
}

/// A datagram on its way through a [`Link`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Datagram<T> {
    pub payload: T,
    pub len: usize,
    /// When it was handed to the link.
    pub arrived: Instant,
    /// When it comes out at the far end.
    pub deliver_at: Instant,
}

/// What the link did with an arriving datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accepted,
    Dropped(DropReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Random loss.
    Loss,
    /// The queue was full (or the link held [`MAX_HELD_BYTES`]).
    QueueFull,
}

/// Counters of one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub offered_packets: u64,
    pub offered_bytes: u64,
    pub delivered_packets: u64,
    pub delivered_bytes: u64,
    pub lost_packets: u64,
    pub overflow_packets: u64,
}

impl LinkStats {
    pub fn dropped_packets(&self) -> u64 {
        self.lost_packets + self.overflow_packets
    }
}

impl<T> Link<T> {
    pub fn new(mut config: LinkConfig) -> Self {
        // Keep `Instant + delay` far from overflow whatever the caller passed.
        config.delay = config.delay.min(MAX_DELAY);
        config.jitter = config.jitter.min(MAX_DELAY);
        Self {
            rng: StdRng::seed_from_u64(config.seed),
            config,
            busy_until: None,
            in_flight: VecDeque::new(),
            held_bytes: 0,
            stats: LinkStats::default(),
        }
    }

    /// Offers a datagram of `len` bytes arriving at `now`.
    pub fn handle_datagram(&mut self, now: Instant, len: usize, payload: T) -> Verdict {
        let len64 = len as u64;
        self.stats.offered_packets += 1;
        self.stats.offered_bytes += len64;
        if self.config.loss.sample(&mut self.rng) {
            self.stats.lost_packets += 1;
            return Verdict::Dropped(DropReason::Loss);
        }
        if self.held_bytes.saturating_add(len64) > MAX_HELD_BYTES {
            self.stats.overflow_packets += 1;
            return Verdict::Dropped(DropReason::QueueFull);
        }

        let leaves = match self.config.rate {
            None => now,
            Some(rate) => {
                let backlog = self.queued_bytes(now);
                let limit = self.config.queue.bytes(rate);
                if backlog > 0 && limit.is_some_and(|limit| backlog + len64 > limit) {
                    self.stats.overflow_packets += 1;
                    return Verdict::Dropped(DropReason::QueueFull);
                }
                let start = self.busy_until.map_or(now, |busy| busy.max(now));
                let Some(leaves) = start.checked_add(rate.transmit_time(len64)) else {
                    self.stats.overflow_packets += 1;
                    return Verdict::Dropped(DropReason::QueueFull);
                };
                self.busy_until = Some(leaves);
                leaves
            }
        };

        let delay = jittered(self.config.delay, self.config.jitter, &mut self.rng);
        // Both terms are bounded (MAX_HELD_BYTES at >= 1 bit/s, MAX_DELAY), so this cannot
        // overflow an `Instant` in practice; saturate to `leaves` rather than panic anyway.
        let mut deliver_at = leaves.checked_add(delay).unwrap_or(leaves);
        let datagram = |deliver_at| Datagram {
            payload,
            len,
            arrived: now,
            deliver_at,
        };
        if self.config.reorder {
            // Stable: equal times keep arrival order.
            let at = self
                .in_flight
                .partition_point(|queued| queued.deliver_at <= deliver_at);
            self.in_flight.insert(at, datagram(deliver_at));
        } else {
            // A wire does not reorder: a datagram never overtakes the one before it.
            if let Some(last) = self.in_flight.back() {
                deliver_at = deliver_at.max(last.deliver_at);
            }
            self.in_flight.push_back(datagram(deliver_at));
        }
        self.held_bytes += len64;
        Verdict::Accepted
    }

    /// The next datagram due at `now`, if any.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Datagram<T>> {
        if self.in_flight.front()?.deliver_at > now {
            return None;
        }
        let datagram = self.in_flight.pop_front()?;
        self.held_bytes -= datagram.len as u64;
        self.stats.delivered_packets += 1;
        self.stats.delivered_bytes += datagram.len as u64;
        Some(datagram)
    }

    /// When the next datagram is due; `None` when the link is empty.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.in_flight.front().map(|datagram| datagram.deliver_at)
    }

    /// Bytes still waiting for (or in) serialization at `now`.
    pub fn queued_bytes(&self, now: Instant) -> u64 {
        match (self.config.rate, self.busy_until) {
            (Some(rate), Some(busy)) => rate.bytes_in(busy.saturating_duration_since(now)),
            _ => 0,
        }
    }

    /// Queueing delay a datagram arriving at `now` would see before its serialization starts.
    pub fn queueing_delay(&self, now: Instant) -> Duration {
        self.busy_until
            .map_or(Duration::ZERO, |busy| busy.saturating_duration_since(now))
    }

    /// Datagrams accepted but not yet delivered.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    pub fn stats(&self) -> LinkStats {
        self.stats
    }

    pub fn config(&self) -> &LinkConfig {
        &self.config
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Loss, QueueLimit, Rate};

    fn drain<T>(link: &mut Link<T>) -> Vec<Datagram<T>> {
        let mut out = Vec::new();
        while let Some(at) = link.poll_timeout() {
            // Nothing is handed out before its time.
            if let Some(early) = at.checked_sub(Duration::from_nanos(1)) {
                assert!(link.poll_transmit(early).is_none());
            }
            out.push(link.poll_transmit(at).expect("due datagram"));
        }
        out
    }

    #[test]
    fn perfect_link_passes_through_at_once() {
        let t0 = Instant::now();
        let mut link = Link::new(LinkConfig::default());
        assert_eq!(link.handle_datagram(t0, 100, 1), Verdict::Accepted);
        assert_eq!(link.poll_timeout(), Some(t0));
        assert_eq!(link.poll_transmit(t0).map(|d| d.payload), Some(1));
        assert_eq!(link.poll_timeout(), None);
    }

    #[test]
    fn delay_is_exact() {
        let t0 = Instant::now();
        let delay = Duration::from_micros(500);
        let mut link = Link::new(LinkConfig {
            delay,
            ..LinkConfig::default()
        });
        for i in 0..10u32 {
            let at = t0 + Duration::from_micros(100) * i;
            assert_eq!(link.handle_datagram(at, 1200, i), Verdict::Accepted);
        }
        let out = drain(&mut link);
        assert_eq!(out.len(), 10);
        for (i, d) in out.iter().enumerate() {
            assert_eq!(d.payload, i as u32);
            assert_eq!(d.deliver_at - d.arrived, delay);
        }
    }

    #[test]
    fn rate_is_respected() {
        // 1 Gbit/s: 10 MB takes 80 ms, one 1000-byte datagram every 8 µs.
        let t0 = Instant::now();
        let mut link = Link::new(LinkConfig {
            rate: Rate::gbit(1),
            queue: QueueLimit::Unlimited,
            ..LinkConfig::default()
        });
        for i in 0..10_000u32 {
            assert_eq!(link.handle_datagram(t0, 1000, i), Verdict::Accepted);
        }
        assert_eq!(link.queued_bytes(t0), 10_000_000);
        assert_eq!(link.queueing_delay(t0), Duration::from_millis(80));
        let out = drain(&mut link);
        assert_eq!(out.len(), 10_000);
        for (i, d) in out.iter().enumerate() {
            assert_eq!(d.deliver_at - t0, Duration::from_micros(8) * (i as u32 + 1));
        }
        assert_eq!(
            out.last().map(|d| d.deliver_at - t0),
            Some(Duration::from_millis(80))
        );
        let stats = link.stats();
        assert_eq!(stats.delivered_bytes, 10_000_000);
        assert_eq!(stats.dropped_packets(), 0);
    }

    #[test]
    fn rate_and_delay_add_up() {
        let t0 = Instant::now();
        let mut link = Link::new(LinkConfig {
            rate: Rate::mbit(100),
            delay: Duration::from_millis(2),
            ..LinkConfig::default()
        });
        link.handle_datagram(t0, 1250, ());
        // 1250 B at 100 Mbit/s = 100 µs, then 2 ms on the wire.
        assert_eq!(link.poll_timeout(), Some(t0 + Duration::from_micros(2100)));
        // An idle serializer starts at arrival time, not where it last stopped.
        let later = t0 + Duration::from_secs(1);
        link.poll_transmit(later);
        link.handle_datagram(later, 1250, ());
        assert_eq!(
            link.poll_timeout(),
            Some(later + Duration::from_micros(2100))
        );
    }

    #[test]
    fn queue_overflow_drops_tail() {
        // 1 Mbit/s: 1000 bytes take 8 ms; a 10 kB queue holds 10 of them.
        let t0 = Instant::now();
        let mut link = Link::new(LinkConfig {
            rate: Rate::mbit(1),
            queue: QueueLimit::Bytes(10_000),
            ..LinkConfig::default()
        });
        let verdicts: Vec<_> = (0..20u32)
            .map(|i| link.handle_datagram(t0, 1000, i))
            .collect();
        assert!(verdicts[..10].iter().all(|v| *v == Verdict::Accepted));
        assert!(
            verdicts[10..]
                .iter()
                .all(|v| *v == Verdict::Dropped(DropReason::QueueFull))
        );
        // Once one datagram has left there is room for exactly one more.
        let t1 = t0 + Duration::from_millis(8);
        assert_eq!(link.handle_datagram(t1, 1000, 20), Verdict::Accepted);
        assert_eq!(
            link.handle_datagram(t1, 1000, 21),
            Verdict::Dropped(DropReason::QueueFull)
        );
        let out: Vec<u32> = drain(&mut link).into_iter().map(|d| d.payload).collect();
        assert_eq!(out, (0..10).chain([20]).collect::<Vec<_>>());
        assert_eq!(link.stats().overflow_packets, 11);
    }

    #[test]
    fn queue_limited_by_delay() {
        // 1 ms of queue at 1 Gbit/s is 125 kB: 125 datagrams of 1000 bytes.
        let t0 = Instant::now();
        let mut link = Link::new(LinkConfig {
            rate: Rate::gbit(1),
            queue: QueueLimit::Delay(Duration::from_millis(1)),
            ..LinkConfig::default()
        });
        let accepted = (0..1000)
            .filter(|_| link.handle_datagram(t0, 1000, ()) == Verdict::Accepted)
            .count();
        assert_eq!(accepted, 125);
        assert_eq!(link.queueing_delay(t0), Duration::from_millis(1));
    }

    #[test]
    fn idle_link_takes_one_oversized_datagram() {
        let t0 = Instant::now();
        let mut link = Link::new(LinkConfig {
            rate: Rate::mbit(1),
            queue: QueueLimit::Bytes(100),
            ..LinkConfig::default()
        });
        assert_eq!(link.handle_datagram(t0, 1500, ()), Verdict::Accepted);
        assert_eq!(
            link.handle_datagram(t0, 10, ()),
            Verdict::Dropped(DropReason::QueueFull)
        );
    }

    #[test]
    fn loss_ratio_within_bounds_and_seeded() {
        let run = |seed| {
            let t0 = Instant::now();
            let mut link = Link::new(LinkConfig {
                loss: Loss::new(0.01).expect("valid"),
                seed,
                ..LinkConfig::default()
            });
            let lost: Vec<bool> = (0..100_000)
                .map(|_| link.handle_datagram(t0, 100, ()) == Verdict::Dropped(DropReason::Loss))
                .collect();
            assert_eq!(
                link.stats().lost_packets as usize,
                lost.iter().filter(|l| **l).count()
            );
            lost
        };
        let a = run(7);
        let lost = a.iter().filter(|l| **l).count();
        // Binomial(100000, 0.01): mean 1000, sd ~31.5; ±20% is over 6 sd.
        assert!((800..=1200).contains(&lost), "lost {lost}");
        assert_eq!(a, run(7), "same seed, same losses");
        assert_ne!(a, run(8), "another seed, other losses");
    }

    #[test]
    fn jitter_keeps_fifo_unless_reordering_is_asked() {
        let delay = Duration::from_millis(1);
        let jitter = Duration::from_micros(500);
        let make = |reorder| {
            Link::new(LinkConfig {
                delay,
                jitter,
                reorder,
                seed: 3,
                ..LinkConfig::default()
            })
        };
        let t0 = Instant::now();
        let gap = Duration::from_micros(50);

        let mut fifo = make(false);
        for i in 0..1000u32 {
            fifo.handle_datagram(t0 + gap * i, 100, i);
        }
        let out = drain(&mut fifo);
        let mut latest = t0;
        let mut varied = false;
        for (i, d) in out.iter().enumerate() {
            assert_eq!(d.payload, i as u32);
            assert!(d.deliver_at >= latest);
            latest = d.deliver_at;
            let one_way = d.deliver_at - d.arrived;
            // Clamping only ever delays, and never past the previous datagram.
            assert!(one_way >= delay - jitter, "{one_way:?}");
            varied |= one_way != delay;
        }
        assert!(varied);

        let mut free = make(true);
        for i in 0..1000u32 {
            free.handle_datagram(t0 + gap * i, 100, i);
        }
        let out = drain(&mut free);
        assert_eq!(out.len(), 1000);
        assert!(out.windows(2).all(|w| w[0].deliver_at <= w[1].deliver_at));
        assert!(
            out.windows(2).any(|w| w[0].payload > w[1].payload),
            "some reordering"
        );
        for d in &out {
            let one_way = d.deliver_at - d.arrived;
            assert!(
                one_way >= delay - jitter && one_way <= delay + jitter,
                "{one_way:?}"
            );
        }
    }

    #[test]
    fn memory_is_capped_without_a_queue_limit() {
        let t0 = Instant::now();
        let mut link = Link::new(LinkConfig {
            delay: Duration::from_secs(1),
            queue: QueueLimit::Unlimited,
            ..LinkConfig::default()
        });
        let chunk = 1 << 20;
        let accepted = (0..300)
            .filter(|_| link.handle_datagram(t0, chunk, ()) == Verdict::Accepted)
            .count();
        assert_eq!(accepted as u64, MAX_HELD_BYTES / chunk as u64);
        assert_eq!(link.stats().overflow_packets, 300 - accepted as u64);
    }
}
