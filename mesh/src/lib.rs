//! `gleam-mesh`: which peers there are, how they find each other, what each offers, and which one
//! should run a job. (Who a device is and how peers trust each other is `gleam-auth`.)
//!
//! * [`discovery`]: mDNS advertisement and browsing ([`discovery::Discovery`]).
//! * [`gossip`]: SWIM membership and failure detection by foca, carrying each peer's
//!   [`state::PeerState`] ([`gossip::Gossip`], sans-IO).
//! * [`state`]: the versioned per-peer state and the local [`state::MeshView`] (sans-IO).
//! * [`probe`]: link measurements (RTT and loss from QUIC, bandwidth from session traffic and small
//!   probes that never take more than 2 % of a link, [`probe::Prober`], sans-IO).
//! * [`addrs`]: every address of every peer and when to dial it ([`addrs::AddrBook`], sans-IO).
//! * [`duplicate`]: two devices with one identity: noticed, reported, settled (sans-IO rules).
//! * [`select`]: the best-peer policy, a pure function of candidates and a job hint.
//! * [`control`]: the daemon's Unix-socket API and its blocking client.
//! * [`daemon`]: the peer daemon ([`daemon::Daemon`]) tying it all together around one quinn
//!   endpoint; CUDA sessions go to a [`daemon::SessionHandler`] supplied by the binary.

pub mod addrs;
pub mod control;
pub mod daemon;
pub mod discovery;
pub mod duplicate;
pub mod gossip;
pub mod probe;
pub mod select;
pub mod state;
