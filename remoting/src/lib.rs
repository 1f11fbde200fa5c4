//! Remoting the CUDA driver API: the protocol between Gleam's shim and a serving peer.
//!
//! * [`api`]: the declaration list ([`cuda_api!`]) of the driver calls forwarded mechanically, and the
//!   [`api::Arg`] trait that says how each argument travels. Shim exports, wire messages and server
//!   dispatch are all generated from it.
//! * [`wire`]: the session protocol: [`wire::Request`], [`wire::Call`], [`wire::ReplyFrame`], framing.
//! * [`client`]: the client side of a session ([`client::Client`]), used by the shim.
//! * [`server`]: the executing side: [`server::backend::Backend`] and the session engine.
//! * [`image`]: sizing module images given only a pointer, and parsing fatbins.
//! * [`types`]: the C ABI types (`CUresult`, handles) shared by the shim and the server.

pub mod api;
pub mod client;
pub mod image;
pub mod server;
pub mod types;
pub mod wire;
