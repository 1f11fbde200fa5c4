//! What Gleam's fuzz targets run. Each module holds one target's harness function, which takes the
//! fuzzer's bytes and must return normally for every input: a panic, a hang or an unbounded allocation in
//! it is a bug of the code under test (or of the harness, which says so in its assertion messages).
//!
//! The same functions serve two callers:
//! - the cargo-fuzz crate in `fuzz/` (nightly, sanitizers), one `fuzz_target!` per module;
//! - `tests/fuzz_corpus.rs` (stable, CI), which replays every file of `fuzz/corpus/<target>/` through them,
//!   so whatever the fuzzer once found interesting keeps being run by every `cargo test`.
//!
//! | target | module | what it drives |
//! |---|---|---|
//! | `frames` | [`frames`] | a byte stream from a client: frame reader, request decoding, the session engine over the emu backend |
//! | `ptx` | [`ptx`] | PTX text: parser and compiler under [`gleam_ptx::Limits`], then a launch of each kernel on a small budget |
//! | `fatbin` | [`fatbin`] | a module image: sizing, fatbin parsing, selection, decompression within a budget, the emu's PTX extraction |
//! | `shim` | [`shim`] | structured calls of the shim's C exports with hostile arguments, against the session engine in process or a real `gleam serve --backend emu` |
//! | `gossip` | [`gossip`] | SWIM packets from linked members: foca, peers' states, the mesh view and the control answers built from it |
//! | `link` | [`link`] | link messages and hostile answers to bandwidth probes, through the link's prober |
//! | `control` | [`control`] | a request line on the daemon's control socket, and the answer the client must read |

pub mod control;
pub mod corpus;
pub mod fatbin;
pub mod frames;
pub mod gossip;
pub mod link;
pub mod ptx;
pub mod seeds;
pub mod shim;
