//! End to end, no GPU: host-to-device copies by content (issue 12, the content cache). A C program
//! (`tests/remote/upload.c`) uploads seeded bytes through `gleam run` to `gleam serve --backend emu` and
//! reads them back (it fails on any difference); `GLEAM_STATS` says how many bytes the session sent, and
//! the serving peer's store (`<config dir>/cache`) is inspected directly.
//!
//! Payloads are a few 8 MiB chunks: enough to tell one chunk from all of them, small enough for CI.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{Server, compile_c, output_within, text};
use gleam_cache::{BlobStore, ContentId};

const LIMIT: Duration = Duration::from_secs(120);
const MIB: u64 = 1 << 20;
/// The payload of most tests: four chunks.
const PAYLOAD_MIB: u64 = 32;

struct Lab {
    server: Server,
    exe: PathBuf,
    dir: tempfile::TempDir,
}

impl Lab {
    fn new() -> Self {
        Self::with_limit(None)
    }

    /// A server whose content cache is limited to `limit` bytes.
    fn with_limit(limit: Option<u64>) -> Self {
        let config = tempfile::tempdir().unwrap();
        if let Some(limit) = limit {
            BlobStore::open(config.path().join("cache"), limit).unwrap();
        }
        let server = Server::start_in("emu", config, &[]);
        let dir = tempfile::tempdir().unwrap();
        let exe = compile_c("upload", dir.path());
        Self { server, exe, dir }
    }

    fn command(&self, args: &[&str], stats: &Path) -> Command {
        let mut cmd = self.server.run(&self.exe, args);
        cmd.env("GLEAM_STATS", stats);
        cmd
    }

    /// Runs `upload MIB SEED MODE [KIND CHANGES...]`; returns its stdout and the bytes the session sent.
    fn upload(&self, args: &[&str], env: &[(&str, &str)]) -> (String, u64) {
        let (stdout, stats) = self.upload_with_stats(args, env);
        (stdout, stats["sent_bytes"].as_u64().expect("sent_bytes"))
    }

    /// [`Lab::upload`], with the session's whole `GLEAM_STATS` record.
    fn upload_with_stats(
        &self,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> (String, serde_json::Value) {
        let stats = self
            .dir
            .path()
            .join(format!("stats-{}.json", next_suffix()));
        let mut cmd = self.command(args, &stats);
        cmd.envs(env.iter().copied());
        let out = output_within(cmd, LIMIT);
        let stdout = checked(&out, args);
        (stdout, read_stats(&stats))
    }

    fn store(&self) -> BlobStore {
        BlobStore::open_recorded(self.cache_dir()).unwrap()
    }

    fn cache_dir(&self) -> PathBuf {
        self.server.config_path().join("cache")
    }
}

fn checked(out: &Output, args: &[&str]) -> String {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success() && stdout.contains("all ok"),
        "upload {args:?}: exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    stdout
}

fn next_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn read_stats(stats: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(stats).expect("GLEAM_STATS written")).unwrap()
}

/// Every blob file of a store, by id.
fn blob_files(cache: &Path) -> Vec<(ContentId, PathBuf)> {
    let mut out = Vec::new();
    for shard in std::fs::read_dir(cache.join("blobs")).unwrap().flatten() {
        for file in std::fs::read_dir(shard.path()).unwrap().flatten() {
            let name = file.file_name().into_string().unwrap();
            out.push((name.parse().unwrap(), file.path()));
        }
    }
    out
}

/// Every blob's bytes hash to its name, and no partial blob is visible.
fn assert_consistent(cache: &Path) {
    for (id, path) in blob_files(cache) {
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(ContentId::of(&bytes), id, "{} is corrupt", path.display());
    }
}

#[test]
fn a_second_run_of_the_same_upload_sends_at_most_one_percent() {
    let lab = Lab::new();
    let payload = PAYLOAD_MIB * MIB;
    let size = PAYLOAD_MIB.to_string();
    let (_, cold) = lab.upload(&[&size, "1", "sync"], &[]);
    assert!(cold >= payload, "a cold upload sent only {cold} bytes");
    let (_, warm) = lab.upload(&[&size, "1", "sync"], &[]);
    assert!(
        warm * 100 <= payload,
        "the warm run sent {warm} bytes of a {payload}-byte payload"
    );
    let stats = lab.store().stats().unwrap();
    assert_eq!(stats.blobs, PAYLOAD_MIB / 8, "{stats:?}");
    assert!(stats.hits >= PAYLOAD_MIB / 8, "{stats:?}");
    // The classic path (the benchmark's baseline) ignores the cache.
    let (_, off) = lab.upload(&[&size, "1", "sync"], &[("GLEAM_CACHE", "off")]);
    assert!(off >= payload, "with the cache off only {off} bytes went");
}

#[test]
fn uploads_and_downloads_travel_on_the_bulk_connection_unless_it_is_turned_off() {
    let lab = Lab::new();
    let payload = PAYLOAD_MIB * MIB;
    let size = PAYLOAD_MIB.to_string();
    // Synchronous and stream-ordered copies: their chunks cross on the bulk connection, and land exactly
    // (the program checks every byte it reads back); the read-back comes over it too.
    for (seed, mode) in [("21", "sync"), ("22", "async")] {
        let (_, stats) = lab.upload_with_stats(&[&size, seed, mode], &[]);
        let sent = stats["bulk_sent_bytes"].as_u64().expect("bulk_sent_bytes");
        let received = stats["bulk_received_bytes"]
            .as_u64()
            .expect("bulk_received_bytes");
        assert!(
            sent >= payload && received >= payload,
            "{mode}: {sent} bytes sent and {received} received on the bulk connection for a \
             {payload}-byte payload each way: {stats}"
        );
    }
    // Turned off, the same chunks and read-backs share the session connection, and land the same.
    let (_, stats) =
        lab.upload_with_stats(&[&size, "23", "async"], &[("GLEAM_BULK_CONNECTION", "off")]);
    assert_eq!(stats["bulk_sent_bytes"].as_u64(), Some(0), "{stats}");
    assert_eq!(stats["bulk_received_bytes"].as_u64(), Some(0), "{stats}");
    assert!(stats["sent_bytes"].as_u64().unwrap() >= payload, "{stats}");
    assert!(
        stats["received_bytes"].as_u64().unwrap() >= payload,
        "{stats}"
    );
}

#[test]
fn a_large_copy_stripes_over_several_bulk_connections_each_way() {
    let lab = Lab::new();
    // 40 MiB: three segments (8, 16 and 16 MiB), one per stripe; read back in ten 4 MiB pieces that
    // take turns. The program checks every byte it reads back, whichever connection brought it.
    let (mib, stripes) = (40, 3);
    for (seed, mode) in [("31", "sync"), ("32", "async")] {
        let (_, stats) = lab.upload_with_stats(
            &[&mib.to_string(), seed, mode],
            &[("GLEAM_BULK_STRIPES", &stripes.to_string())],
        );
        let each = stats["bulk_stripes"].as_array().expect("bulk_stripes");
        assert_eq!(each.len(), stripes, "{mode}: {stats}");
        for (stripe, counts) in each.iter().enumerate() {
            let (sent, received) = (counts[0].as_u64().unwrap(), counts[1].as_u64().unwrap());
            assert!(
                sent >= 8 * MIB && received >= 8 * MIB,
                "{mode}: stripe {stripe} carried {sent} bytes up and {received} down: {stats}"
            );
        }
    }
}

#[test]
fn every_copy_form_lands_exactly_and_in_stream_order() {
    let lab = Lab::new();
    // Sync (a miss), async between two memsets of its stream, then cuMemcpy (hits of the same session);
    // odd sizes so the last chunk is short.
    let (stdout, sent) = lab.upload(&["20.5", "2", "all"], &[]);
    for mode in ["sync", "async", "unified"] {
        assert!(stdout.contains(&format!("upload {mode}:")), "{stdout}");
    }
    let payload = 41 * MIB / 2;
    assert!(
        sent < payload + payload / 4,
        "three copies of one payload sent {sent} bytes"
    );
    // Every call waited for: the same bytes.
    lab.upload(&["20.5", "3", "all"], &[("CUDA_LAUNCH_BLOCKING", "1")]);
    // Below the threshold: the plain path, also exact.
    lab.upload(&["3", "4", "all"], &[("GLEAM_CACHE_THRESHOLD", "4MiB")]);
}

#[test]
fn a_changed_chunk_is_the_only_one_sent_again() {
    let lab = Lab::new();
    let size = PAYLOAD_MIB.to_string();
    lab.upload(&[&size, "5", "sync"], &[]);
    // One byte flipped in chunk 2 (bytes 16..24 MiB).
    let at = (20 * MIB).to_string();
    let (_, sent) = lab.upload(&[&size, "5", "sync", "random", &at], &[]);
    assert!(
        (8 * MIB..10 * MIB).contains(&sent),
        "a one-chunk change sent {sent} bytes"
    );
    assert_eq!(lab.store().stats().unwrap().blobs, PAYLOAD_MIB / 8 + 1);
}

#[test]
fn compressible_chunks_travel_compressed() {
    let lab = Lab::new();
    let size = PAYLOAD_MIB.to_string();
    let payload = PAYLOAD_MIB * MIB;
    let (_, sent) = lab.upload(
        &[&size, "6", "sync", "weights"],
        &[("GLEAM_CACHE_COMPRESS", "on")],
    );
    assert!(
        sent < payload * 9 / 10,
        "fp16-like weights sent {sent} of {payload} bytes"
    );
}

#[test]
fn an_evicted_chunk_is_sent_again() {
    // Room for two of the four chunks.
    let lab = Lab::with_limit(Some(20 * MIB));
    let size = PAYLOAD_MIB.to_string();
    lab.upload(&[&size, "7", "sync"], &[]);
    let stats = lab.store().stats().unwrap();
    assert!(stats.evicted >= 2, "{stats:?}");
    assert!(stats.bytes <= 20 * MIB, "{stats:?}");
    let (_, sent) = lab.upload(&[&size, "7", "sync"], &[]);
    assert!(
        sent >= 16 * MIB,
        "evicted chunks must be sent again: {sent}"
    );
    assert_consistent(&lab.cache_dir());
}

#[test]
fn a_corrupt_blob_is_dropped_and_fetched_again() {
    let lab = Lab::new();
    let size = PAYLOAD_MIB.to_string();
    lab.upload(&[&size, "8", "sync"], &[]);
    let (_, path) = blob_files(&lab.cache_dir())
        .into_iter()
        .find(|(_, p)| p.metadata().unwrap().len() == 8 * MIB)
        .expect("a chunk blob");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[12345] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    let (_, sent) = lab.upload(&[&size, "8", "sync"], &[]);
    assert!(
        (8 * MIB..10 * MIB).contains(&sent),
        "one corrupt chunk: {sent} bytes sent"
    );
    let stats = lab.store().stats().unwrap();
    assert_eq!(stats.corrupt, 1, "{stats:?}");
    assert_consistent(&lab.cache_dir());
}

#[test]
fn two_clients_uploading_the_same_payload_at_once() {
    let lab = Lab::new();
    let size = PAYLOAD_MIB.to_string();
    let args = [size.as_str(), "9", "all"];
    let runs: Vec<_> = (0..2)
        .map(|i| {
            let stats = lab.dir.path().join(format!("both-{i}.json"));
            let cmd = lab.command(&args, &stats);
            std::thread::spawn(move || output_within(cmd, LIMIT))
        })
        .collect();
    for run in runs {
        checked(&run.join().unwrap(), &args);
    }
    assert_eq!(lab.store().stats().unwrap().blobs, PAYLOAD_MIB / 8);
    assert_consistent(&lab.cache_dir());
    let (_, warm) = lab.upload(&[&size, "9", "sync"], &[]);
    assert!(warm * 100 <= PAYLOAD_MIB * MIB, "{warm} bytes sent");
}

#[test]
fn a_session_killed_mid_upload_leaves_the_store_consistent() {
    let lab = Lab::new();
    let stats = lab.dir.path().join("killed.json");
    let mut victim = lab
        .command(&["96", "10", "sync"], &stats)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill the session process once the cache holds part of the payload (or is writing it).
    let cache = lab.cache_dir();
    let started = Instant::now();
    let mut killed = false;
    while started.elapsed() < LIMIT {
        let writing = std::fs::read_dir(cache.join("tmp")).is_ok_and(|d| d.count() > 0)
            || cache.join("blobs").is_dir() && !blob_files(&cache).is_empty();
        if writing {
            for pid in lab.server.session_pids() {
                // SAFETY: plain syscall on a child process of our server.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                killed = true;
            }
            if killed {
                break;
            }
        }
        if victim.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(killed, "the session never started writing to the cache");
    let _ = victim.wait();
    assert_consistent(&cache);
    // The store still works: stats add up, and the payload uploads and arrives intact.
    let store = lab.store();
    let counted = store.stats().unwrap();
    let files = blob_files(&cache);
    assert_eq!(counted.blobs, files.len() as u64, "{counted:?}");
    lab.upload(&["96", "10", "sync"], &[]);
    let (_, warm) = lab.upload(&["96", "10", "sync"], &[]);
    assert!(warm * 100 <= 96 * MIB, "{warm} bytes sent");
    assert_consistent(&cache);
}
