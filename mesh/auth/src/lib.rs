//! `gleam-auth`: who a device is, and how two devices come to trust each other.
//!
//! Every Gleam connection (mesh gossip and CUDA sessions alike) is built from the three parts here, in this
//! order:
//!
//! * [`identity`]: [`Identity`] (this device's long-term Ed25519 key and self-signed certificate, made at
//!   first start), [`PeerId`] (the BLAKE3 hash of a device's public key) and [`MeshSecret`] (the shared
//!   secret that defines a mesh), with the config directory they live in.
//! * [`tls`]: quinn/rustls configurations for mutually authenticated TLS 1.3 in which each side pins the
//!   other's [`PeerId`], and the ALPNs [`tls::ALPN_MESH`] and [`tls::ALPN_CUDA`].
//! * [`proof`]: the mesh-secret proof run right after the handshake, bound to that TLS session, so a device
//!   outside the mesh is refused without the secret ever travelling.
//!
//! The bulk connection's congestion controller, [`delay_target::DelayTarget`], keeps the queue an upload
//! builds at the bottleneck near a target delay, so a session's small calls do not wait behind it.
//!
//! [`busy_poll::BusyPoll`] keeps the thread that drives a session's connections polling, rather than
//! sleeping, while a round trip is under way.
//!
//! Reaching a peer: [`target::PeerAddr`] (the one parser of `<peer-id>@HOST:PORT[,...]`) and
//! [`dial::dial`] (try every address of a peer, happy-eyeballs style, first handshake wins).
//!
//! The crate does no discovery and keeps no peer state: that is `gleam-mesh`.

pub mod busy_poll;
pub mod delay_target;
pub mod dial;
pub mod identity;
pub mod proof;
pub mod target;
pub mod tls;

pub use identity::{Identity, MeshSecret, PeerId};
pub use target::PeerAddr;

/// Shows an error with its chain of causes (`outer: inner: innermost`), for logs: errors here put their
/// cause in `source()`, not in their own message, so a plain `{}` shows only the outer part.
#[derive(Debug)]
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(err) = source {
            write!(f, ": {err}")?;
            source = err.source();
        }
        Ok(())
    }
}
