//! A userspace link emulator: what `tc netem` would do to a LAN, for machines without it.
//!
//! Tests and benchmarks put an emulated LAN between a Gleam client and peer on one machine by
//! relaying their UDP (QUIC) through it. Per direction it models a serialization rate, a one-way
//! delay with jitter, random loss and a bounded drop-tail queue.
//!
//! - [`Link`] is the sans-IO core of one direction: [`Link::handle_datagram`] offers a datagram
//!   (answering [`Verdict::Accepted`] or [`Verdict::Dropped`]), [`Link::poll_transmit`] hands
//!   out the [`Datagram`]s that are due, [`Link::poll_timeout`] says when the next one is. It
//!   reads no clock, so it is tested against a virtual one.
//! - [`LinkConfig`] describes a direction: [`Rate`], delay, jitter, [`Loss`], [`QueueLimit`]; their
//!   `FromStr` implementations parse the human spellings (`1gbit`, `0.5ms`, `1%`, `64KiB`), with
//!   [`parse_delay`] for durations and [`ParseError`] for what does not parse.
//! - [`Relay`] is the IO layer: a UDP relay from a listening address to an upstream through an
//!   `up` and a `down` link, with one upstream socket per client address (NAT-like).
//!   [`Relay::spawn`] runs it on a dedicated thread with sub-millisecond timing and returns a
//!   [`RelayHandle`] (bound address, [`RelayStats`] with per-direction [`DirectionStats`], stop on
//!   drop).

mod config;
mod link;
mod relay;
mod sys;

pub use config::{LinkConfig, Loss, MAX_DELAY, ParseError, QueueLimit, Rate, parse_delay};
pub use link::{Datagram, DropReason, Link, LinkStats, MAX_HELD_BYTES, Verdict};
pub use relay::{DirectionStats, Relay, RelayError, RelayHandle, RelayStats};
