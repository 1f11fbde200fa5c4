//! What a link does to the datagrams crossing it, and the parsers for its human spellings
//! (`1gbit`, `0.5ms`, `64KiB`, `1%`), shared by the CLI and by tests.

use std::fmt;
use std::num::NonZeroU64;
use std::str::FromStr;
use std::time::Duration;

use rand::RngExt;

/// The longest delay or jitter a link accepts: far beyond any LAN, and small enough that
/// `Instant + delay` can never overflow.
pub const MAX_DELAY: Duration = Duration::from_secs(3600);

/// One direction of an emulated link.
///
/// The default is a perfect link: no rate limit, no delay, no loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkConfig {
    /// Serialization rate; `None` means datagrams leave as soon as they arrive.
    pub rate: Option<Rate>,
    /// One-way propagation delay, added after serialization.
    pub delay: Duration,
    /// Each datagram's delay is drawn uniformly from `delay ± jitter` (never below zero).
    pub jitter: Duration,
    /// Probability that a datagram is dropped on arrival.
    pub loss: Loss,
    /// Bound on the bytes waiting for serialization (drop-tail). Only meaningful with a `rate`.
    pub queue: QueueLimit,
    /// Let jitter reorder datagrams. Off by default: delivery times are clamped to stay FIFO,
    /// as on a real wire.
    pub reorder: bool,
    /// Seed of the loss and jitter RNG, so runs are reproducible.
    pub seed: u64,
}

impl Default for LinkConfig {
    fn default() -> Self {
        Self {
            rate: None,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: Loss::NONE,
            queue: QueueLimit::DEFAULT,
            reorder: false,
            seed: 0,
        }
    }
}

impl fmt::Display for LinkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rate {
            Some(rate) => write!(f, "rate {rate}")?,
            None => f.write_str("rate unlimited")?,
        }
        write!(f, ", delay {:?}", self.delay)?;
        if !self.jitter.is_zero() {
            write!(f, " ± {:?}", self.jitter)?;
        }
        write!(f, ", loss {}, queue {}", self.loss, self.queue)?;
        if self.reorder {
            f.write_str(", reordering")?;
        }
        Ok(())
    }
}

/// A link rate in bits per second (never zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rate(NonZeroU64);

impl Rate {
    pub const fn from_bits_per_sec(bits: NonZeroU64) -> Self {
        Self(bits)
    }

    /// `None` for zero.
    pub const fn bits_per_sec(bits: u64) -> Option<Self> {
        match NonZeroU64::new(bits) {
            Some(bits) => Some(Self(bits)),
            None => None,
        }
    }

    pub const fn mbit(mbit: u64) -> Option<Self> {
        Self::bits_per_sec(mbit.saturating_mul(1_000_000))
    }

    pub const fn gbit(gbit: u64) -> Option<Self> {
        Self::bits_per_sec(gbit.saturating_mul(1_000_000_000))
    }

    pub const fn as_bits_per_sec(self) -> u64 {
        self.0.get()
    }

    /// How long `len` bytes occupy the wire, rounded up to the nanosecond.
    pub fn transmit_time(self, len: u64) -> Duration {
        let bits = u128::from(len) * 8 * 1_000_000_000;
        let rate = u128::from(self.0.get());
        duration_from_nanos_u128(bits.div_ceil(rate))
    }

    /// How many bytes go out in `time`, rounded up.
    pub fn bytes_in(self, time: Duration) -> u64 {
        let bits = time.as_nanos() * u128::from(self.0.get());
        u64::try_from(bits.div_ceil(8_000_000_000)).unwrap_or(u64::MAX)
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bits = self.0.get();
        for (unit, scale) in [("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)] {
            if bits as f64 >= scale {
                return write!(f, "{}{unit}", bits as f64 / scale);
            }
        }
        write!(f, "{bits}bit")
    }
}

/// Units as `tc` spells them: `bit` family in bits/s, `bps` family in *bytes*/s.
const RATE_UNITS: &[(&str, f64)] = &[
    ("", 1.0),
    ("bit", 1.0),
    ("kbit", 1e3),
    ("mbit", 1e6),
    ("gbit", 1e9),
    ("tbit", 1e12),
    ("kibit", 1024.0),
    ("mibit", 1024.0 * 1024.0),
    ("gibit", 1024.0 * 1024.0 * 1024.0),
    ("bps", 8.0),
    ("kbps", 8e3),
    ("mbps", 8e6),
    ("gbps", 8e9),
];

impl FromStr for Rate {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (value, unit) = split_number(s, "rate")?;
        let scale = lookup(RATE_UNITS, &unit).ok_or_else(|| ParseError::UnknownUnit {
            what: "rate",
            input: s.to_owned(),
            unit,
            expected: "bit, kbit, mbit, gbit, tbit, kibit, mibit, gibit, or bps, kbps, mbps, gbps (bytes/s)",
        })?;
        let bits = (value * scale).round();
        if bits < 1.0 {
            return Err(ParseError::OutOfRange {
                what: "rate",
                input: s.to_owned(),
                reason: "must be at least 1bit",
            });
        }
        if bits >= u64::MAX as f64 {
            return Err(ParseError::OutOfRange {
                what: "rate",
                input: s.to_owned(),
                reason: "is too large",
            });
        }
        // In range by the two checks above.
        Rate::bits_per_sec(bits as u64).ok_or_else(|| ParseError::OutOfRange {
            what: "rate",
            input: s.to_owned(),
            reason: "must be at least 1bit",
        })
    }
}

/// A loss probability in `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Loss(f64);

impl Loss {
    pub const NONE: Self = Self(0.0);

    /// `None` unless `0 <= p <= 1`.
    pub fn new(p: f64) -> Option<Self> {
        (0.0..=1.0).contains(&p).then_some(Self(p))
    }

    pub fn probability(self) -> f64 {
        self.0
    }

    /// Whether the next datagram is lost; draws from `rng` only when loss is possible, so a
    /// lossless link leaves the RNG untouched.
    pub(crate) fn sample(self, rng: &mut impl rand::Rng) -> bool {
        self.0 > 0.0 && rng.random_bool(self.0)
    }
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}%", self.0 * 100.0)
    }
}

impl FromStr for Loss {
    type Err = ParseError;

    /// `0.01` or `1%`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let trimmed = s.trim();
        let (number, scale) = match trimmed.strip_suffix('%') {
            Some(number) => (number.trim_end(), 0.01),
            None => (trimmed, 1.0),
        };
        let value: f64 = number.parse().map_err(|_| ParseError::NotANumber {
            what: "loss",
            input: s.to_owned(),
        })?;
        Loss::new(value * scale).ok_or_else(|| ParseError::OutOfRange {
            what: "loss",
            input: s.to_owned(),
            reason: "must be between 0 and 1 (or 0% and 100%)",
        })
    }
}

/// How much a link's serialization queue holds before it drops arriving datagrams (drop-tail).
///
/// An idle link always accepts one datagram, however large, so a tiny limit still passes traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueLimit {
    /// At most this many bytes waiting (including the datagram being serialized).
    Bytes(u64),
    /// At most this much queueing delay, i.e. `delay × rate` bytes.
    Delay(Duration),
    /// Never drop for lack of room (memory is still capped, see [`crate::Link`]).
    Unlimited,
}

impl QueueLimit {
    /// About `netem`'s default of 1000 full-size packets.
    pub const DEFAULT: Self = Self::Bytes(1_500_000);

    /// The limit in bytes at `rate`; `None` when unlimited.
    pub fn bytes(self, rate: Rate) -> Option<u64> {
        match self {
            Self::Bytes(bytes) => Some(bytes),
            Self::Delay(delay) => Some(rate.bytes_in(delay)),
            Self::Unlimited => None,
        }
    }
}

impl Default for QueueLimit {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl fmt::Display for QueueLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Bytes(bytes) => write!(f, "{bytes}B"),
            Self::Delay(delay) => write!(f, "{delay:?}"),
            Self::Unlimited => f.write_str("unlimited"),
        }
    }
}

const SIZE_UNITS: &[(&str, f64)] = &[
    ("", 1.0),
    ("b", 1.0),
    ("kb", 1e3),
    ("mb", 1e6),
    ("gb", 1e9),
    ("kib", 1024.0),
    ("mib", 1024.0 * 1024.0),
    ("gib", 1024.0 * 1024.0 * 1024.0),
];

impl FromStr for QueueLimit {
    type Err = ParseError;

    /// A queueing delay (`1ms`), a size (`64KiB`, `100kb`, `1500`), or `unlimited`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("unlimited") {
            return Ok(Self::Unlimited);
        }
        let (value, unit) = split_number(s, "queue")?;
        if let Some(scale) = lookup(TIME_UNITS, &unit).filter(|_| !unit.is_empty()) {
            return duration_from_secs(value * scale, s, "queue").map(Self::Delay);
        }
        let scale = lookup(SIZE_UNITS, &unit).ok_or_else(|| ParseError::UnknownUnit {
            what: "queue",
            input: s.to_owned(),
            unit,
            expected: "a size (b, kb, mb, kib, mib) or a delay (us, ms, s), or `unlimited`",
        })?;
        let bytes = (value * scale).round();
        if bytes >= u64::MAX as f64 {
            return Err(ParseError::OutOfRange {
                what: "queue",
                input: s.to_owned(),
                reason: "is too large",
            });
        }
        Ok(Self::Bytes(bytes as u64))
    }
}

const TIME_UNITS: &[(&str, f64)] = &[
    ("ns", 1e-9),
    ("us", 1e-6),
    ("µs", 1e-6),
    ("ms", 1e-3),
    ("s", 1.0),
];

/// Parses a delay such as `0.5ms`, `500us` or `1s` (a bare `0` is also fine). At most
/// [`MAX_DELAY`].
pub fn parse_delay(s: &str) -> Result<Duration, ParseError> {
    let (value, unit) = split_number(s, "delay")?;
    if unit.is_empty() && value == 0.0 {
        return Ok(Duration::ZERO);
    }
    let scale = lookup(TIME_UNITS, &unit).ok_or_else(|| ParseError::UnknownUnit {
        what: "delay",
        input: s.to_owned(),
        unit,
        expected: "ns, us, ms or s",
    })?;
    duration_from_secs(value * scale, s, "delay")
}

fn duration_from_secs(secs: f64, input: &str, what: &'static str) -> Result<Duration, ParseError> {
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if d <= MAX_DELAY => Ok(d),
        _ => Err(ParseError::OutOfRange {
            what,
            input: input.to_owned(),
            reason: "must be at most 1 hour",
        }),
    }
}

/// Splits `"1.5 Gbit"` into `(1.5, "gbit")`; the number must be finite and not negative.
fn split_number(s: &str, what: &'static str) -> Result<(f64, String), ParseError> {
    let trimmed = s.trim();
    let end = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(end);
    let value: f64 = number.parse().map_err(|_| ParseError::NotANumber {
        what,
        input: s.to_owned(),
    })?;
    if !value.is_finite() {
        return Err(ParseError::NotANumber {
            what,
            input: s.to_owned(),
        });
    }
    Ok((value, unit.trim().to_lowercase()))
}

fn lookup(units: &[(&str, f64)], unit: &str) -> Option<f64> {
    units
        .iter()
        .find(|(name, _)| *name == unit)
        .map(|(_, scale)| *scale)
}

fn duration_from_nanos_u128(nanos: u128) -> Duration {
    let secs = u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX);
    // The remainder is below 1e9, so it fits.
    Duration::new(secs, (nanos % 1_000_000_000) as u32)
}

/// A uniform draw from `[base - spread, base + spread]`, floored at zero.
pub(crate) fn jittered(base: Duration, spread: Duration, rng: &mut impl rand::Rng) -> Duration {
    if spread.is_zero() {
        return base;
    }
    let spread = spread.as_nanos() as i128;
    let nanos = base.as_nanos() as i128 + rng.random_range(-spread..=spread);
    duration_from_nanos_u128(nanos.max(0) as u128)
}

/// A value on the command line (or in a test) that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("invalid {what} `{input}`: expected a number followed by a unit")]
    NotANumber { what: &'static str, input: String },
    #[error("invalid {what} `{input}`: unknown unit `{unit}` (expected {expected})")]
    UnknownUnit {
        what: &'static str,
        input: String,
        unit: String,
        expected: &'static str,
    },
    #[error("invalid {what} `{input}`: {reason}")]
    OutOfRange {
        what: &'static str,
        input: String,
        reason: &'static str,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_like_tc() {
        let bits = |s: &str| s.parse::<Rate>().map(Rate::as_bits_per_sec);
        assert_eq!(bits("1gbit"), Ok(1_000_000_000));
        assert_eq!(bits("100mbit"), Ok(100_000_000));
        assert_eq!(bits("500kbit"), Ok(500_000));
        assert_eq!(bits("1.5Gbit"), Ok(1_500_000_000));
        assert_eq!(bits("2 mbit"), Ok(2_000_000));
        assert_eq!(bits("1mibit"), Ok(1_048_576));
        assert_eq!(bits("1000"), Ok(1000));
        assert_eq!(bits("10mbps"), Ok(80_000_000));
        assert!(matches!(bits("1gbt"), Err(ParseError::UnknownUnit { .. })));
        assert!(matches!(bits("fast"), Err(ParseError::NotANumber { .. })));
        assert!(matches!(bits("0mbit"), Err(ParseError::OutOfRange { .. })));
        assert!(matches!(bits("-1mbit"), Err(ParseError::NotANumber { .. })));
        assert!(bits("1e30gbit").is_err());
        let msg = "1gbt".parse::<Rate>().unwrap_err().to_string();
        assert!(msg.contains("unknown unit `gbt`"), "{msg}");
    }

    #[test]
    fn rates_display_compactly() {
        assert_eq!(Rate::gbit(1).unwrap().to_string(), "1gbit");
        assert_eq!(Rate::mbit(200).unwrap().to_string(), "200mbit");
        assert_eq!(Rate::bits_per_sec(500).unwrap().to_string(), "500bit");
    }

    #[test]
    fn rate_arithmetic() {
        let gbit = Rate::gbit(1).unwrap();
        assert_eq!(gbit.transmit_time(1000), Duration::from_micros(8));
        assert_eq!(gbit.transmit_time(10_000_000), Duration::from_millis(80));
        assert_eq!(gbit.bytes_in(Duration::from_millis(1)), 125_000);
        let odd = Rate::bits_per_sec(3).unwrap();
        assert_eq!(odd.transmit_time(1), Duration::from_nanos(2_666_666_667));
    }

    #[test]
    fn delays_parse() {
        assert_eq!(parse_delay("0.5ms"), Ok(Duration::from_micros(500)));
        assert_eq!(parse_delay("500us"), Ok(Duration::from_micros(500)));
        assert_eq!(parse_delay("500µs"), Ok(Duration::from_micros(500)));
        assert_eq!(parse_delay("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_delay("0"), Ok(Duration::ZERO));
        assert!(matches!(
            parse_delay("5"),
            Err(ParseError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_delay("2h"),
            Err(ParseError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_delay("7200s"),
            Err(ParseError::OutOfRange { .. })
        ));
    }

    #[test]
    fn losses_parse() {
        assert_eq!("0.01".parse::<Loss>().map(Loss::probability), Ok(0.01));
        assert_eq!("1%".parse::<Loss>().map(Loss::probability), Ok(0.01));
        assert_eq!("0".parse::<Loss>(), Ok(Loss::NONE));
        assert!(matches!(
            "1.5".parse::<Loss>(),
            Err(ParseError::OutOfRange { .. })
        ));
        assert!(matches!(
            "NaN".parse::<Loss>(),
            Err(ParseError::OutOfRange { .. })
        ));
        assert!(matches!(
            "lots".parse::<Loss>(),
            Err(ParseError::NotANumber { .. })
        ));
    }

    #[test]
    fn queues_parse() {
        let q = |s: &str| s.parse::<QueueLimit>();
        assert_eq!(q("1ms"), Ok(QueueLimit::Delay(Duration::from_millis(1))));
        assert_eq!(q("64KiB"), Ok(QueueLimit::Bytes(65_536)));
        assert_eq!(q("100kb"), Ok(QueueLimit::Bytes(100_000)));
        assert_eq!(q("1500"), Ok(QueueLimit::Bytes(1500)));
        assert_eq!(q("unlimited"), Ok(QueueLimit::Unlimited));
        assert!(matches!(q("3 pkts"), Err(ParseError::UnknownUnit { .. })));
        let gbit = Rate::gbit(1).unwrap();
        assert_eq!(
            QueueLimit::Delay(Duration::from_millis(1)).bytes(gbit),
            Some(125_000)
        );
    }
}
