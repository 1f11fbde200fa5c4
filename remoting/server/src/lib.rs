//! `gleam-server`: the serving side of a CUDA session, independent of the network and of the GPU.
//!
//! * [`backend`]: [`Backend`](backend::Backend), what executes calls (NVIDIA's driver in `gleam-real`, the
//!   GPU-less `gleam-emu`), and [`ApiBackend`](backend::ApiBackend), one method per listed driver call.
//! * [`session`]: [`Session`](session::Session), the sans-IO engine applying CUDA's ordering and error rules
//!   (deferred and sticky errors) to one client's requests.
//! * [`callbacks`]: host functions (`cuLaunchHostFunc`, `cuStreamAddCallback`), run by the client in
//!   stream order.
//! * [`mirrors`]: the allocations a client mirrors (managed and mapped host memory), which bounds what its
//!   direct reads and writes may touch.
//! * [`images`] and [`payloads`]: module images and large host-to-device payloads by content, through
//!   the peer's content cache, so that each crosses the network once; [`staging`] holds their bytes and
//!   [`workers`] runs their decoding, filling and caching off the executor.
//! * [`recycle`]: large reply buffers (device-to-host data), reused rather than faulted in afresh.

pub mod backend;
pub mod callbacks;
pub mod images;
pub mod mirrors;
pub mod payloads;
pub mod recycle;
pub mod session;
pub mod staging;
pub mod workers;
