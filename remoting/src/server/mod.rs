//! The serving side of a CUDA session.
//!
//! * [`backend`]: [`Backend`](backend::Backend), what executes calls (real GPU or emu).

pub mod backend;
