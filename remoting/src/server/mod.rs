//! The serving side of a CUDA session.
//!
//! * [`backend`]: [`Backend`](backend::Backend), what executes calls (real GPU or emu).
//! * [`session`]: [`Session`](session::Session), the sans-IO engine applying CUDA's ordering and error rules.
//! * [`worker`]: the session process's stdin/stdout loop around a [`Session`](session::Session).
//! * [`host`]: [`serve_connection`](host::serve_connection), one QUIC connection ↔ one session process,
//!   and [`pick_backend`](host::pick_backend).
//! * [`real`]: [`RealBackend`](real::RealBackend), NVIDIA's driver on a real GPU, which passes the driver
//!   only handles its registry (`handles`) has seen the driver return.

pub mod backend;
mod handles;
pub mod host;
pub mod real;
pub mod session;
pub mod worker;
