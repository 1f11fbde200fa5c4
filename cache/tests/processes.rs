//! The store shared by real processes: this test binary re-runs itself as the child processes
//! (the `child_process` test, which does nothing unless `GLEAM_CACHE_CHILD` names a role).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};
use std::{env, fs, thread};

use gleam_cache::{BlobStore, ContentId};

const LIMIT: Duration = Duration::from_secs(20);

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

/// A child process running `role` on the store in `dir`, its `@` lines forwarded to a channel.
struct Kid {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Kid {
    fn spawn(role: &str, dir: &Path, extra: &[(&str, String)]) -> Self {
        let mut cmd = Command::new(env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "child_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("GLEAM_CACHE_CHILD", role)
        .env("GLEAM_CACHE_DIR", dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest may have printed "test child_process ... " before it on the line.
                if let Some((_, msg)) = line.split_once('@')
                    && tx.send(msg.to_owned()).is_err()
                {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    fn next_line(&self) -> String {
        self.lines
            .recv_timeout(LIMIT)
            .expect("the child process went quiet")
    }

    /// SIGKILL, then every line it printed before dying.
    fn kill(&mut self) -> Vec<String> {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let mut rest = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(2)) {
            rest.push(line);
        }
        rest
    }

    fn wait_success(&mut self) {
        let deadline = Instant::now() + LIMIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "child failed: {status}");
                return;
            }
            assert!(Instant::now() < deadline, "child process hung");
            thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Kid {
    /// A failing test does not leave its children running.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn temp_files(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir.join("tmp"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect()
}

/// Every blob file in the store, by walking its directory.
fn blob_ids(dir: &Path) -> Vec<ContentId> {
    let mut out = Vec::new();
    for shard in fs::read_dir(dir.join("blobs")).unwrap() {
        for file in fs::read_dir(shard.unwrap().path()).unwrap() {
            let name = file.unwrap().file_name();
            out.push(name.to_str().unwrap().parse().unwrap());
        }
    }
    out
}

/// What the children do.
#[test]
fn child_process() {
    let Ok(role) = env::var("GLEAM_CACHE_CHILD") else {
        return; // a normal test run
    };
    let dir = PathBuf::from(env::var("GLEAM_CACHE_DIR").unwrap());
    let store = BlobStore::open_recorded(&dir).unwrap();
    match role.as_str() {
        // Store the same ten blobs as the other child, starting together.
        "put-same" => {
            while !dir.join("go").exists() {
                thread::sleep(Duration::from_micros(200));
            }
            for seed in 0..10 {
                store.put(&blob(seed, 1 << 20)).unwrap();
            }
        }
        // Stay in the middle of writing one blob until killed.
        "stall" => {
            let mut writer = store.writer().unwrap();
            writer.write_all(&blob(1, 1 << 20)).unwrap();
            println!("@writing");
            loop {
                writer.write_all(&blob(2, 64 << 10)).unwrap();
                thread::sleep(Duration::from_millis(5));
            }
        }
        // Store blob after blob until killed, saying which are committed.
        "put-loop" => {
            for seed in 0.. {
                let id = store.put(&blob(seed, 256 << 10)).unwrap();
                println!("@stored {id}");
            }
        }
        // Read one blob (refreshing its last use), then exit.
        "read" => {
            let id: ContentId = env::var("GLEAM_CACHE_ID").unwrap().parse().unwrap();
            assert!(store.get(&id).unwrap().is_some());
        }
        other => panic!("unknown child role {other}"),
    }
}

#[test]
fn two_processes_storing_the_same_blobs_at_once_store_each_once() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path();
    BlobStore::open(dir, 1 << 30).unwrap();
    let kids = [
        Kid::spawn("put-same", dir, &[]),
        Kid::spawn("put-same", dir, &[]),
    ];
    fs::write(dir.join("go"), b"").unwrap();
    for mut kid in kids {
        kid.wait_success();
    }
    let store = BlobStore::open_recorded(dir).unwrap();
    let stats = store.stats().unwrap();
    assert_eq!((stats.blobs, stats.bytes, stats.corrupt), (10, 10 << 20, 0));
    for seed in 0..10 {
        let data = blob(seed, 1 << 20);
        assert_eq!(store.get(&ContentId::of(&data)).unwrap(), Some(data));
    }
    assert!(temp_files(dir).is_empty());
}

#[test]
fn a_writer_killed_mid_blob_leaves_nothing_visible_and_its_file_is_cleaned() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path();
    BlobStore::open(dir, 1 << 30).unwrap();
    let mut kid = Kid::spawn("stall", dir, &[]);
    assert_eq!(kid.next_line(), "writing");
    kid.kill();
    // Killed in mid-write: its partial file is there, no blob is.
    let partial = temp_files(dir);
    assert_eq!(partial.len(), 1, "{partial:?}");
    assert!(fs::metadata(&partial[0]).unwrap().len() >= 1 << 20);
    assert!(blob_ids(dir).is_empty());

    let store = BlobStore::open(dir, 1 << 30).unwrap();
    assert!(
        temp_files(dir).is_empty(),
        "the abandoned file is removed at open"
    );
    assert_eq!(store.stats().unwrap().blobs, 0);
    assert_eq!(store.get(&ContentId::of(&blob(1, 1 << 20))).unwrap(), None);
}

#[test]
fn a_writer_killed_at_a_random_point_leaves_only_whole_blobs() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path();
    BlobStore::open(dir, 1 << 30).unwrap();
    let mut kid = Kid::spawn("put-loop", dir, &[]);
    let mut committed = Vec::new();
    for _ in 0..4 {
        committed.push(kid.next_line());
    }
    let jitter = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        % 15_000_000;
    thread::sleep(Duration::from_nanos(jitter.into()));
    committed.extend(kid.kill());

    let store = BlobStore::open(dir, 1 << 30).unwrap();
    assert!(temp_files(dir).is_empty());
    let present = blob_ids(dir);
    for line in &committed {
        let id: ContentId = line.strip_prefix("stored ").unwrap().parse().unwrap();
        assert!(present.contains(&id), "committed blob {id} is missing");
    }
    // Every visible blob is whole (a torn one would read as a miss and be counted corrupt).
    for id in &present {
        assert!(store.get(id).unwrap().is_some(), "blob {id} is not whole");
    }
    let stats = store.stats().unwrap();
    assert_eq!(stats.corrupt, 0);
    assert_eq!(stats.blobs, present.len() as u64);
    assert_eq!(stats.bytes, present.len() as u64 * (256 << 10));
}

#[test]
fn a_read_in_another_process_protects_a_blob_from_eviction() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path();
    let store = BlobStore::open(dir, 1000).unwrap();
    let ids: Vec<ContentId> = (0..10).map(|i| store.put(&blob(i, 100)).unwrap()).collect();
    Kid::spawn("read", dir, &[("GLEAM_CACHE_ID", ids[0].to_string())]).wait_success();
    store.put(&blob(10, 100)).unwrap();
    assert!(store.contains(&ids[0]), "read by the child: recently used");
    assert!(!store.contains(&ids[1]) && !store.contains(&ids[2]));
    assert!(ids[3..].iter().all(|id| store.contains(id)));
    let stats = store.stats().unwrap();
    assert_eq!((stats.blobs, stats.hits), (9, 1));
}
