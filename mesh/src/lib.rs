//! `gleam-mesh`: who the peers are, how they trust each other, how they find each other, and
//! which one should run a job.
//!
//! * [`identity`]: [`Identity`] (this device's key and self-signed certificate), [`PeerId`] (the
//!   hash of a device's public key), [`MeshSecret`] (the shared secret that defines a mesh).
//! * [`tls`]: quinn/rustls configs for mutually authenticated TLS 1.3 with pinned peer ids, the
//!   ALPNs [`tls::ALPN_MESH`] and [`tls::ALPN_CUDA`].
//! * [`auth`]: the mesh-secret proof run on every new connection, bound to its TLS session.
//! * [`discovery`]: mDNS advertisement and browsing ([`discovery::Discovery`]).
//! * [`gossip`]: SWIM membership and failure detection by foca, carrying each peer's
//!   [`state::PeerState`] ([`gossip::Gossip`], sans-IO).
//! * [`state`]: the versioned per-peer state and the local [`state::MeshView`] (sans-IO).
//! * [`probe`]: link measurements (RTT and loss from QUIC, bandwidth from short probes).
//! * [`select`]: the best-peer policy, a pure function of candidates and a job hint.
//! * [`control`]: the daemon's Unix-socket API and its blocking client.
//! * [`daemon`]: the peer daemon ([`daemon::Daemon`]) tying it all together around one quinn
//!   endpoint; CUDA sessions go to a [`daemon::SessionHandler`] supplied by the binary.

pub mod auth;
pub mod control;
pub mod daemon;
pub mod discovery;
pub mod gossip;
pub mod identity;
pub mod probe;
pub mod select;
pub mod state;
pub mod tls;

pub use identity::{Identity, MeshSecret, PeerId};
