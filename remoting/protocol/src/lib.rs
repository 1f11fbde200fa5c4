//! `gleam-protocol`: what Gleam's shim and a serving peer say to each other, and nothing about how the bytes
//! travel.
//!
//! * [`api`]: the declaration list of the CUDA driver API ([`cuda_api!`]) and the [`api::Arg`] trait that
//!   says how each C argument travels. The shim's exports, the wire messages, the server's dispatch and the
//!   real backend's calls are all generated from it.
//! * [`wire`]: the session's messages: [`wire::Request`] / [`wire::Call`] from the client,
//!   [`wire::ReplyFrame`] / [`wire::Reply`] from the server, and the hello exchange.
//! * [`registry`]: [`registry::Handles`], the registry of live handles with each kind's lifetime rules.
//! * [`order`]: lanes and dependencies: which requests must run after which ([`order::Sequencer`] on
//!   the client, [`order::Scheduler`] on the serving side).
//! * [`recycle`]: large bulk buffers reused rather than faulted in afresh ([`recycle::Recycler`]).
//! * [`resume`]: what each side keeps until the other has it, to resume a session after a drop.
//! * [`types`]: the C ABI types (`CUresult`, handles, constants) shared by every layer.
//! * [`descriptors`]: the C descriptor structs of arrays, textures, surfaces and 2D/3D copies.
//! * [`copy`]: 2D/3D copies in the canonical form they travel in.
//! * [`tuning`]: the waiting strategy both ends of a session share.

#[macro_use]
pub mod api;
pub mod copy;
pub mod descriptors;
pub mod frame;
pub mod order;
pub mod recycle;
pub mod registry;
pub mod resume;
pub mod tuning;
pub mod types;
pub mod wire;
