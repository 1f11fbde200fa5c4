//! `gleam-mesh`: who the peers are, how they trust each other, and how they find each other.
//!
//! * [`identity`]: [`Identity`] (this device's key and self-signed certificate), [`PeerId`] (the
//!   hash of a device's public key), [`MeshSecret`] (the shared secret that defines a mesh).
//! * [`tls`]: quinn/rustls configs for mutually authenticated TLS 1.3 with pinned peer ids.
//! * [`auth`]: the mesh-secret proof run on every new connection.

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
