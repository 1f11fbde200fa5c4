//! Module images on the client: what is sent of them, once, and what the client reads from them.
//!
//! A fatbin carries code for many GPUs; only what the serving GPU runs is sent ([`Image::for_peer`]): the
//! cubin for its compute capability, else the best PTX it can JIT (announced in the hello's device
//! attributes), or, for the GPU-less emu backend, the best PTX (it interprets PTX only). The chosen entry
//! travels as a one-entry fatbin, compressed as it was stored. A bare PTX text or cubin goes as it is.
//!
//! An image is named by the BLAKE3 hash of those bytes. [`load`] first announces the hash; the serving
//! peer answers from what it has (this session's images, and its content cache, which outlives sessions)
//! or asks for the bytes, so an image crosses the network once per serving peer. [`stats`] counts what
//! was sent, for `gleam trace`.
//!
//! The kernels and their parameter layouts are read from the same bytes on the client
//! ([`gleam_fatbin::kernels`]), lazily (the first time a kernel of the image is asked for), so that a launch
//! never trusts the server about how many bytes to read from the application's `kernelParams`.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use gleam_fatbin::kernels::{Kernels, kernels_of};
use gleam_fatbin::{ComputeCapability, EntryKind, Fatbin, ImageKind, classify};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{Call, ImageRef, Reply};

use crate::{context, state};

/// Largest decompressed entry the client reads kernels from (torch's largest sm_90 cubin is far below).
const MAX_CODE_BYTES: usize = 512 << 20;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR` / `_MINOR`.
const CC_MAJOR: usize = 75;
const CC_MINOR: usize = 76;

/// What the serving peer's device runs.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Target {
    /// A GPU of this compute capability: its SASS, else PTX it can JIT.
    Gpu(ComputeCapability),
    /// The emu backend: PTX only, of any version up to this SM (it interprets PTX).
    PtxOnly(u32),
}

impl Target {
    /// The target of the session's device 0 (Gleam serves one device per session).
    pub fn of_session() -> Result<Self, CUresult> {
        let session = state::session()?;
        let hello = session.client.hello();
        let device = hello.devices.first().ok_or(CUresult::NO_DEVICE)?;
        let attr = |i: usize| {
            device
                .attributes
                .get(i)
                .copied()
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(0)
        };
        let cc = ComputeCapability::new(attr(CC_MAJOR), attr(CC_MINOR));
        Ok(if hello.backend == "emu" {
            Self::PtxOnly(cc.major * 10 + cc.minor)
        } else {
            Self::Gpu(cc)
        })
    }
}

/// An image as the client keeps it: the bytes the serving peer gets, their name, and (once read) the
/// kernels they hold.
#[derive(Debug)]
pub struct Image {
    bytes: Vec<u8>,
    hash: [u8; 32],
    kernels: OnceLock<Result<Kernels, CUresult>>,
}

impl Image {
    /// What the peer gets of the image `original` (a fatbin, cubin or PTX text, exactly its extent):
    /// `CUDA_ERROR_NO_BINARY_FOR_GPU` when a fatbin holds nothing the target runs.
    pub fn for_peer(original: &[u8], target: Target) -> Result<Self, CUresult> {
        let bytes = match classify(original) {
            ImageKind::Fatbin => {
                let fatbin = Fatbin::parse(original).map_err(|err| {
                    tracing::warn!(%err, "cannot parse a fatbin image");
                    CUresult::INVALID_IMAGE
                })?;
                let index = choose(&fatbin, target).ok_or_else(|| {
                    let has: Vec<String> = fatbin
                        .entries
                        .iter()
                        .map(|e| match e.kind {
                            EntryKind::Ptx => format!("compute_{}", e.sm_arch),
                            _ => e.arch().to_string(),
                        })
                        .collect();
                    tracing::debug!(?target, ?has, "no fatbin entry for the serving device");
                    CUresult::NO_BINARY_FOR_GPU
                })?;
                fatbin.rebuild(&[index])
            }
            ImageKind::FatbinWrapper => return Err(CUresult::INVALID_IMAGE),
            ImageKind::Elf | ImageKind::Ptx => original.to_vec(),
        };
        Ok(Self::new(bytes))
    }

    /// An image sent exactly as given.
    pub fn new(bytes: Vec<u8>) -> Self {
        let hash = *blake3::hash(&bytes).as_bytes();
        Self {
            bytes,
            hash,
            kernels: OnceLock::new(),
        }
    }

    /// The bytes the serving peer gets.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// What the image is called on the wire.
    pub fn reference(&self) -> ImageRef {
        ImageRef {
            hash: self.hash,
            len: self.bytes.len() as u64,
        }
    }

    /// The image's kernels and their parameter layouts, read once. `CUDA_ERROR_INVALID_IMAGE` if the code
    /// cannot be read (then nothing of it can be launched with `kernelParams`).
    pub fn kernels(&self) -> Result<&Kernels, CUresult> {
        self.kernels
            .get_or_init(|| read_kernels(&self.bytes))
            .as_ref()
            .map_err(|&e| e)
    }
}

/// The entry of `fatbin` that `target` runs.
fn choose(fatbin: &Fatbin<'_>, target: Target) -> Option<usize> {
    match target {
        Target::Gpu(cc) => fatbin.select(cc).map(|s| s.index),
        Target::PtxOnly(max_sm) => {
            let best = fatbin.best_ptx(max_sm)?;
            fatbin
                .entries
                .iter()
                .position(|e| std::ptr::eq(e.raw.as_ptr(), best.raw.as_ptr()))
        }
    }
}

fn read_kernels(bytes: &[u8]) -> Result<Kernels, CUresult> {
    let code = match classify(bytes) {
        ImageKind::Fatbin => {
            let fatbin = Fatbin::parse(bytes).map_err(|_| CUresult::INVALID_IMAGE)?;
            let entry = fatbin.entries.first().ok_or(CUresult::INVALID_IMAGE)?;
            entry
                .decompressed(MAX_CODE_BYTES)
                .map_err(|err| {
                    tracing::warn!(%err, "cannot decompress a module image's code");
                    CUresult::INVALID_IMAGE
                })?
                .into_owned()
        }
        _ => bytes.to_vec(),
    };
    kernels_of(&code).map_err(|err| {
        tracing::error!(
            %err,
            "cannot read the kernels of a module image: its kernels cannot be launched with kernelParams"
        );
        CUresult::INVALID_IMAGE
    })
}

/// What was sent of module images in this process (for `gleam trace`).
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Stats {
    /// Images the serving peer had to be sent.
    pub sent: u64,
    /// Their bytes.
    pub sent_bytes: u64,
    /// Images the serving peer already had (no bytes sent).
    pub found: u64,
}

static SENT: AtomicU64 = AtomicU64::new(0);
static SENT_BYTES: AtomicU64 = AtomicU64::new(0);
static FOUND: AtomicU64 = AtomicU64::new(0);

/// What was sent so far.
pub fn stats() -> Stats {
    Stats {
        sent: SENT.load(Ordering::Relaxed),
        sent_bytes: SENT_BYTES.load(Ordering::Relaxed),
        found: FOUND.load(Ordering::Relaxed),
    }
}

/// Loads `image` on the serving peer, as a module of the current context or as a library; its handle.
/// The bytes travel only if the peer does not have them yet.
pub fn load(image: &Image, as_library: bool) -> Result<u64, CUresult> {
    let session = state::session()?;
    let call = Call::LoadImage {
        image: image.reference(),
        as_library,
    };
    let ctx = context::current();
    let answer = session
        .client
        .call_with(ctx, call.clone(), &[])
        .map_err(state::lost)?;
    answer.result.result()?;
    let reply = match answer.reply {
        Reply::ImageWanted => {
            let answer = session
                .client
                .call_with(ctx, call, image.bytes())
                .map_err(state::lost)?;
            answer.result.result()?;
            SENT.fetch_add(1, Ordering::Relaxed);
            SENT_BYTES.fetch_add(image.bytes().len() as u64, Ordering::Relaxed);
            answer.reply
        }
        other => {
            FOUND.fetch_add(1, Ordering::Relaxed);
            other
        }
    };
    match (reply, as_library) {
        (Reply::Module { handle }, false) | (Reply::Library { handle }, true) => Ok(handle),
        (other, _) => Err(state::mismatch("module image load", &other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/../fatbin/tests/fixtures/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    #[test]
    fn only_what_the_serving_device_runs_is_sent() {
        let original = fixture("multi_arch.fatbin");
        let h200 = Image::for_peer(&original, Target::Gpu(ComputeCapability::new(9, 0))).unwrap();
        let sent = Fatbin::parse(h200.bytes()).unwrap();
        assert_eq!(sent.entries.len(), 1);
        assert_eq!(sent.entries[0].kind, EntryKind::Elf);
        assert_eq!(sent.entries[0].arch().to_string(), "sm_90a");
        assert!(h200.bytes().len() < original.len() / 3);
        // The emu gets PTX only.
        let emu = Image::for_peer(&original, Target::PtxOnly(75)).unwrap();
        let sent = Fatbin::parse(emu.bytes()).unwrap();
        assert_eq!(sent.entries.len(), 1);
        assert_eq!(sent.entries[0].kind, EntryKind::Ptx);
        // Nothing for a GPU older than every entry.
        let old = Image::for_peer(&original, Target::Gpu(ComputeCapability::new(6, 1)));
        assert_eq!(old.unwrap_err(), CUresult::NO_BINARY_FOR_GPU);
        // The same selection gives the same bytes, hence the same name.
        let again = Image::for_peer(&original, Target::Gpu(ComputeCapability::new(9, 0))).unwrap();
        assert_eq!(again.reference(), h200.reference());
        assert_ne!(emu.reference(), h200.reference());
    }

    #[test]
    fn kernels_are_read_from_what_is_sent() {
        let original = fixture("params.fatbin");
        for target in [
            Target::Gpu(ComputeCapability::new(9, 0)),
            Target::Gpu(ComputeCapability::new(7, 5)),
            Target::PtxOnly(75),
        ] {
            let image = Image::for_peer(&original, target).unwrap();
            let kernels = image.kernels().unwrap();
            let structs = kernels.get("structs").unwrap();
            assert_eq!(structs.params.len(), 6, "{target:?}");
            assert_eq!(structs.params_bytes(), 232, "{target:?}");
        }
        // Bytes that are not code: an error, remembered.
        let junk = Image::new(b"\x7fELF\x02\x01 not really".to_vec());
        assert_eq!(junk.kernels().unwrap_err(), CUresult::INVALID_IMAGE);
        assert_eq!(junk.kernels().unwrap_err(), CUresult::INVALID_IMAGE);
    }
}
