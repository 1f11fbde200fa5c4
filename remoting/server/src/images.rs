//! The module images a serving peer has been sent, by content, so that each crosses the network once.
//!
//! A session keeps the images of its own run in memory; the peer's content cache ([`BlobStore`], in
//! `<config dir>/cache`, shared by every session process and kept across runs) keeps them for the next
//! session, of any client. A client names an image by its BLAKE3 hash (`Call::LoadImage`); [`Images::find`]
//! answers from memory, then from the store; bytes a client sends are checked against the hash they were
//! announced with before they are kept ([`Images::accept`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use gleam_cache::{BlobStore, ContentId};
use gleam_protocol::wire::ImageRef;
use tracing::{debug, warn};

/// Where `gleam session` processes keep module images (set once at process start).
static CONTENT_CACHE: OnceLock<PathBuf> = OnceLock::new();

/// Module images of this process's sessions go to the content cache in `dir` (`<config dir>/cache`).
pub fn use_content_cache(dir: PathBuf) {
    let _ = CONTENT_CACHE.set(dir);
}

/// The content cache of this process ([`use_content_cache`]), opened once and shared by module images
/// and payloads; `None` when none is configured or it cannot be opened.
pub(crate) fn content_cache() -> Option<Arc<BlobStore>> {
    static OPENED: OnceLock<Option<Arc<BlobStore>>> = OnceLock::new();
    OPENED
        .get_or_init(|| {
            let dir = CONTENT_CACHE.get()?;
            match BlobStore::open_recorded(dir) {
                Ok(store) => Some(Arc::new(store)),
                Err(err) => {
                    warn!(dir = %dir.display(), %err, "content cache unusable: nothing is kept across sessions");
                    None
                }
            }
        })
        .clone()
}

/// A session's module images.
#[derive(Debug, Default)]
pub struct Images {
    memory: HashMap<[u8; 32], Arc<[u8]>>,
    /// `None` until first needed; `Some(None)` when there is no store (not configured, or unusable).
    store: Option<Option<Arc<BlobStore>>>,
}

/// Bytes that do not match the image they were announced as.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "the image bytes ({got} bytes) do not match the announced image ({want} bytes, hash {hash})"
)]
pub struct Mismatch {
    /// Bytes received.
    pub got: usize,
    /// Bytes announced.
    pub want: u64,
    /// The announced hash, in hex.
    pub hash: String,
}

impl Images {
    /// A session's images with the content cache in `dir` (`None`: in memory only).
    pub fn with_store(dir: Option<PathBuf>) -> Self {
        let store = dir.map(|dir| match BlobStore::open_recorded(&dir) {
            Ok(store) => Some(Arc::new(store)),
            Err(err) => {
                warn!(dir = %dir.display(), %err, "content cache unusable: module images are kept in memory only");
                None
            }
        });
        Self {
            memory: HashMap::new(),
            store,
        }
    }

    fn store(&mut self) -> Option<&BlobStore> {
        self.store.get_or_insert_with(content_cache).as_deref()
    }

    /// The image named `image`, if this session or the content cache has it.
    pub fn find(&mut self, image: &ImageRef) -> Option<Arc<[u8]>> {
        if let Some(bytes) = self.memory.get(&image.hash) {
            return Some(bytes.clone());
        }
        let id = ContentId(image.hash);
        let found = match self.store()?.get(&id) {
            Ok(found) => found?,
            Err(err) => {
                warn!(%err, "content cache read failed");
                return None;
            }
        };
        if found.len() as u64 != image.len {
            return None;
        }
        debug!(hash = %id, bytes = found.len(), "module image found in the content cache");
        let bytes: Arc<[u8]> = found.into();
        self.memory.insert(image.hash, bytes.clone());
        Some(bytes)
    }

    /// Keeps `bytes`, which a client sent as `image`, after checking they are what it announced.
    pub fn accept(&mut self, image: &ImageRef, bytes: &[u8]) -> Result<Arc<[u8]>, Mismatch> {
        let id = ContentId::of(bytes);
        if id.0 != image.hash || bytes.len() as u64 != image.len {
            return Err(Mismatch {
                got: bytes.len(),
                want: image.len,
                hash: ContentId(image.hash).to_hex(),
            });
        }
        let bytes: Arc<[u8]> = bytes.into();
        self.memory.insert(image.hash, bytes.clone());
        if let Some(store) = self.store()
            && let Err(err) = store.put(&bytes)
        {
            warn!(%err, "cannot keep a module image in the content cache");
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(bytes: &[u8]) -> ImageRef {
        ImageRef {
            hash: *blake3::hash(bytes).as_bytes(),
            len: bytes.len() as u64,
        }
    }

    #[test]
    fn images_are_kept_by_content_across_sessions() {
        let dir = tempfile::tempdir().unwrap();
        let image = b".version 8.0\n.target sm_75\0".to_vec();
        let name = reference(&image);
        let mut first = Images::with_store(Some(dir.path().into()));
        assert!(first.find(&name).is_none());
        first.accept(&name, &image).unwrap();
        assert_eq!(&*first.find(&name).unwrap(), &image[..]);
        // Another session process of the same peer finds it in the store.
        let mut second = Images::with_store(Some(dir.path().into()));
        assert_eq!(&*second.find(&name).unwrap(), &image[..]);
        // A session without a store only has what it was sent.
        let mut alone = Images::with_store(None);
        assert!(alone.find(&name).is_none());
    }

    #[test]
    fn bytes_that_are_not_the_announced_image_are_refused() {
        let mut images = Images::with_store(None);
        let name = reference(b"one image");
        assert!(images.accept(&name, b"another image").is_err());
        assert!(images.find(&name).is_none());
        let short = ImageRef { len: 3, ..name };
        assert!(images.accept(&short, b"one image").is_err());
    }
}
