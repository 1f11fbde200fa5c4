//! The store in one process: real files in temporary directories, several handles and threads.

use std::sync::{Arc, Barrier};
use std::thread;

use super::*;
use crate::{Compression, Decoder, encode_chunk};

fn store(limit: u64) -> (tempfile::TempDir, BlobStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path(), limit).unwrap();
    (dir, store)
}

/// Distinct, deterministic bytes.
fn blob(seed: u32, len: usize) -> Vec<u8> {
    let mut x = u64::from(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn temp_files(store: &BlobStore) -> usize {
    fs::read_dir(store.root().join("tmp")).unwrap().count()
}

/// Overwrites one byte of a stored blob in place, as a failing disk would.
fn flip_byte(store: &BlobStore, id: &ContentId, at: u64) {
    use std::os::unix::fs::FileExt;
    let file = File::options()
        .read(true)
        .write(true)
        .open(store.blob_path(id))
        .unwrap();
    let mut byte = [0];
    file.read_exact_at(&mut byte, at).unwrap();
    file.write_all_at(&[byte[0] ^ 0x01], at).unwrap();
}

#[test]
fn hit_miss_dedup_and_persistence() {
    let (dir, store) = store(1 << 20);
    let id = store.put(b"weights").unwrap();
    assert_eq!(id, ContentId::of(b"weights"));
    assert_eq!(store.put(b"weights").unwrap(), id);
    assert_eq!(store.get(&id).unwrap().as_deref(), Some(&b"weights"[..]));
    let mut dst = [0; 7];
    assert!(store.read_into(&id, &mut dst).unwrap());
    assert_eq!(&dst, b"weights");
    assert_eq!(store.get(&ContentId::of(b"other")).unwrap(), None);
    assert!(!store.read_into(&ContentId::of(b"other"), &mut dst).unwrap());
    // Asked for with the wrong length: a miss, and the blob is left alone.
    assert!(!store.read_into(&id, &mut [0; 3]).unwrap());
    assert!(store.contains(&id));
    let stats = store.stats().unwrap();
    assert_eq!(
        (
            stats.blobs,
            stats.bytes,
            stats.hits,
            stats.misses,
            stats.corrupt
        ),
        (1, 7, 2, 3, 0)
    );
    drop(store);

    // Another handle (as another run would) finds the blob and the counters.
    let again = BlobStore::open_recorded(dir.path()).unwrap();
    assert_eq!(again.get(&id).unwrap().as_deref(), Some(&b"weights"[..]));
    let stats = again.stats().unwrap();
    assert_eq!((stats.blobs, stats.hits, stats.limit), (1, 3, 1 << 20));
    assert_eq!(id.to_string().parse::<ContentId>().unwrap(), id);
}

#[test]
fn a_flipped_byte_is_detected_dropped_and_reported_as_a_miss() {
    let (_dir, store) = store(1 << 20);
    let data = blob(1, 10_000);
    let id = store.put(&data).unwrap();
    flip_byte(&store, &id, 5000);
    assert_eq!(store.get(&id).unwrap(), None);
    assert!(!store.contains(&id));
    // Fetched again, it is whole.
    store.put(&data).unwrap();
    assert_eq!(store.get(&id).unwrap().unwrap(), data);

    // The same through read_into, and for a blob that lost its tail.
    flip_byte(&store, &id, 0);
    let mut dst = vec![0; data.len()];
    assert!(!store.read_into(&id, &mut dst).unwrap());
    assert!(!store.contains(&id));
    store.put(&data).unwrap();
    File::options()
        .write(true)
        .open(store.blob_path(&id))
        .unwrap()
        .set_len(100)
        .unwrap();
    assert!(!store.read_into(&id, &mut dst).unwrap());
    assert!(!store.contains(&id));
    // A re-put over a blob of the wrong length replaces it.
    store.put(&data).unwrap();
    File::options()
        .write(true)
        .open(store.blob_path(&id))
        .unwrap()
        .set_len(100)
        .unwrap();
    store.put(&data).unwrap();
    assert!(store.read_into(&id, &mut dst).unwrap());

    let stats = store.stats().unwrap();
    assert_eq!(stats.corrupt, 3);
    assert_eq!((stats.blobs, stats.bytes), (1, data.len() as u64));
}

#[test]
fn eviction_follows_last_use_and_returns_under_the_limit() {
    let (_dir, store) = store(1000);
    let ids: Vec<ContentId> = (0..10).map(|i| store.put(&blob(i, 100)).unwrap()).collect();
    assert_eq!(store.stats().unwrap().evicted, 0);
    // Use 0 and 1 again (one by reading, one by storing again): 2 and 3 are now the oldest.
    store.get(&ids[0]).unwrap().unwrap();
    store.put(&blob(1, 100)).unwrap();
    let newest = store.put(&blob(10, 100)).unwrap();
    // 1100 > 1000: evicted down to 90% of the limit, least recently used first.
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(store.contains(id), ![2, 3].contains(&i), "blob {i}");
    }
    assert!(store.contains(&newest));
    let stats = store.stats().unwrap();
    assert_eq!((stats.blobs, stats.bytes, stats.evicted), (9, 900, 2));
}

#[test]
fn a_blob_over_the_limit_is_kept_until_the_next_commit() {
    let (_dir, store) = store(1000);
    let small = store.put(&blob(1, 300)).unwrap();
    let big = store.put(&blob(2, 1500)).unwrap();
    assert!(store.contains(&big) && !store.contains(&small));
    let next = store.put(&blob(3, 300)).unwrap();
    assert!(store.contains(&next) && !store.contains(&big));
    let stats = store.stats().unwrap();
    assert_eq!((stats.blobs, stats.bytes), (1, 300));
}

#[test]
fn a_partly_changed_payload_misses_only_its_changed_chunks() {
    const CHUNK: u32 = 64 << 10;
    let (_dir, store) = store(64 << 20);
    let old = blob(7, 5 * CHUNK as usize + 1234);
    let stored = store.put_payload_chunked(&old, CHUNK).unwrap();
    assert_eq!(stored.chunks().len(), 6);
    assert_eq!(store.manifest(&stored.id()).unwrap(), Some(stored.clone()));
    assert!(store.plan(&stored).is_complete());

    let mut new = old.clone();
    new[CHUNK as usize + 10] ^= 0xFF;
    new[3 * CHUNK as usize] ^= 0xFF;
    let manifest = Manifest::with_chunk_size(&new, CHUNK);
    let plan = store.plan(&manifest);
    assert_eq!(plan.missing, vec![1, 3]);
    assert_eq!(plan.missing_bytes, 2 * u64::from(CHUNK));
    assert_eq!(plan.present_bytes, new.len() as u64 - 2 * u64::from(CHUNK));

    // The server's side: fill what the store has, fetch the rest as encoded chunks.
    let mut dst = vec![0; new.len()];
    let mut missing = store.read_payload(&manifest, &mut dst).unwrap();
    assert_eq!(missing, plan.missing);
    // A chunk corrupted between plan and read is reported too.
    flip_byte(&store, &manifest.chunks()[4], 9);
    missing = store.read_payload(&manifest, &mut dst).unwrap();
    assert_eq!(missing, vec![1, 3, 4]);
    let mut decoder = Decoder::new();
    for &i in &missing {
        let range = manifest.chunk_range(i);
        let range = range.start as usize..range.end as usize;
        let wire = encode_chunk(&new[range.clone()], Compression::default()).to_wire();
        let id = &manifest.chunks()[i];
        decoder
            .decode_into(id, &wire, &mut dst[range.clone()])
            .unwrap();
        store.put(&dst[range]).unwrap();
    }
    assert_eq!(dst, new);
    assert!(store.plan(&manifest).is_complete());
    assert!(matches!(
        store.read_payload(&manifest, &mut dst[1..]),
        Err(CacheError::BufferLength { .. })
    ));
}

#[test]
fn threads_storing_one_blob_at_once_store_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let shared = Arc::new(BlobStore::open(dir.path(), 1 << 30).unwrap());
    let data = Arc::new(blob(3, 1 << 20));
    let barrier = Arc::new(Barrier::new(8));
    let workers: Vec<_> = (0..8)
        .map(|i| {
            let (shared, data, barrier) = (shared.clone(), data.clone(), barrier.clone());
            let root = dir.path().to_path_buf();
            thread::spawn(move || {
                // Half share one handle, half have their own (as separate sessions would).
                let own;
                let store = if i % 2 == 0 {
                    &*shared
                } else {
                    own = BlobStore::open(root, 1 << 30).unwrap();
                    &own
                };
                barrier.wait();
                if i % 4 == 1 {
                    let mut writer = store.writer().unwrap();
                    writer.write_all(&data).unwrap();
                    writer.commit(Some(&ContentId::of(&data))).unwrap()
                } else {
                    store.put(&data).unwrap()
                }
            })
        })
        .collect();
    let ids: Vec<ContentId> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    assert!(ids.iter().all(|id| *id == ids[0]));
    let stats = shared.stats().unwrap();
    assert_eq!((stats.blobs, stats.bytes), (1, data.len() as u64));
    assert_eq!(shared.get(&ids[0]).unwrap().as_deref(), Some(&data[..]));
    assert_eq!(temp_files(&shared), 0);
}

#[test]
fn readers_during_eviction_see_whole_blobs_or_misses() {
    const LEN: usize = 4096;
    let dir = tempfile::tempdir().unwrap();
    let limit = 20 * LEN as u64;
    let store = Arc::new(BlobStore::open(dir.path(), limit).unwrap());
    let first: Vec<(ContentId, Vec<u8>)> = (0..20)
        .map(|i| {
            let data = blob(i, LEN);
            (store.put(&data).unwrap(), data)
        })
        .collect();
    let first = Arc::new(first);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|r| {
            let (first, root, done) = (first.clone(), dir.path().to_path_buf(), done.clone());
            thread::spawn(move || {
                let store = BlobStore::open_recorded(root).unwrap();
                let (mut hits, mut misses) = (0, 0);
                // Until the writer is done, then once more.
                let mut last = false;
                for round in 0.. {
                    if last {
                        break;
                    }
                    last = done.load(Ordering::SeqCst);
                    for (id, data) in first.iter() {
                        let got = if (round + r) % 2 == 0 {
                            store.get(id).unwrap()
                        } else {
                            let mut dst = vec![0; LEN];
                            store.read_into(id, &mut dst).unwrap().then_some(dst)
                        };
                        match got {
                            Some(bytes) => {
                                assert_eq!(&bytes, data);
                                hits += 1;
                            }
                            None => misses += 1,
                        }
                    }
                }
                (hits, misses)
            })
        })
        .collect();
    for i in 100..160 {
        store.put(&blob(i, LEN)).unwrap();
    }
    done.store(true, Ordering::SeqCst);
    let mut misses = 0;
    for reader in readers {
        misses += reader.join().unwrap().1;
    }
    let stats = store.stats().unwrap();
    assert!(stats.bytes <= limit, "{stats:?}");
    assert_eq!(stats.corrupt, 0);
    assert!(stats.evicted >= 40, "{stats:?}");
    // At the end the store holds at most 20 blobs, the last one written among them: at least one of
    // the first twenty is gone in each reader's last round, however much they kept them in use.
    assert!(misses >= 2, "{misses} misses");
}

#[test]
fn clear_empties_the_store_and_keeps_its_limit() {
    let (dir, store) = store(12345);
    for i in 0..5 {
        store.put(&blob(i, 100)).unwrap();
    }
    store.get(&ContentId::of(b"absent")).unwrap();
    let cleared = store.clear().unwrap();
    assert_eq!((cleared.blobs, cleared.bytes), (5, 500));
    let stats = store.stats().unwrap();
    assert_eq!(
        (stats.blobs, stats.bytes, stats.misses, stats.limit),
        (0, 0, 0, 12345)
    );
    assert_eq!(store.digest().unwrap().blobs, 0);
    // Still usable, by this handle and a new one.
    let id = store.put(b"after").unwrap();
    let other = BlobStore::open_recorded(dir.path()).unwrap();
    assert_eq!(other.get(&id).unwrap().as_deref(), Some(&b"after"[..]));
}

#[test]
fn a_damaged_or_half_updated_record_is_recounted() {
    let (dir, store) = store(1 << 20);
    for i in 0..3 {
        store.put(&blob(i, 1000)).unwrap();
    }
    // A writer that died between marking the record dirty and committing its blob, after its
    // rename: the blob is there, the count is not.
    let mut guard = store.lock().unwrap();
    guard.begin().unwrap();
    drop(guard);
    let extra = blob(9, 500);
    let path = store.blob_path(&ContentId::of(&extra));
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(&path, &extra).unwrap();
    let stats = store.stats().unwrap();
    assert_eq!((stats.blobs, stats.bytes, stats.limit), (4, 3500, 1 << 20));
    drop(store);

    // A torn record.
    fs::write(dir.path().join("state"), [7u8; 50]).unwrap();
    let store = BlobStore::open(dir.path(), 1 << 20).unwrap();
    let stats = store.stats().unwrap();
    assert_eq!((stats.blobs, stats.bytes), (4, 3500));
}

#[test]
fn writers_leave_nothing_unless_committed_with_the_right_id() {
    let (_dir, store) = store(1 << 20);
    let mut writer = store.writer().unwrap();
    writer.write_all(b"half a blob").unwrap();
    assert_eq!(temp_files(&store), 1);
    drop(writer);
    assert_eq!(temp_files(&store), 0);

    let mut writer = store.writer().unwrap();
    writer.write_all(b"not what was promised").unwrap();
    let promised = ContentId::of(b"promised");
    assert!(matches!(
        writer.commit(Some(&promised)),
        Err(CacheError::HashMismatch { .. })
    ));
    assert_eq!(temp_files(&store), 0);
    assert_eq!(store.stats().unwrap().blobs, 0);

    let mut writer = store.writer().unwrap();
    writer.write_all(b"in ").unwrap();
    writer.write_all(b"pieces").unwrap();
    let id = writer.commit(None).unwrap();
    assert_eq!(store.get(&id).unwrap().as_deref(), Some(&b"in pieces"[..]));
}

#[test]
fn opening_removes_abandoned_temporary_files_only() {
    let (dir, store) = store(1 << 20);
    let mut live = store.writer().unwrap();
    live.write_all(b"still being written").unwrap();
    fs::write(
        dir.path().join("tmp/12345-abc-0.part"),
        b"left by a dead writer",
    )
    .unwrap();
    assert_eq!(temp_files(&store), 2);
    let _other = BlobStore::open(dir.path(), 1 << 20).unwrap();
    assert_eq!(temp_files(&store), 1, "the live writer's file stays");
    let id = live.commit(None).unwrap();
    assert!(store.contains(&id));
}

#[test]
fn digests_are_equal_for_equal_contents() {
    let (_a_dir, a) = store(1 << 20);
    let (_b_dir, b) = store(1 << 20);
    assert_eq!(a.digest().unwrap(), b.digest().unwrap());
    a.put(b"one").unwrap();
    a.put(b"two").unwrap();
    b.put(b"two").unwrap();
    assert_ne!(a.digest().unwrap(), b.digest().unwrap());
    b.put(b"one").unwrap();
    let digest = a.digest().unwrap();
    assert_eq!(digest, b.digest().unwrap());
    assert_eq!((digest.blobs, digest.bytes), (2, 6));
}
