//! Host-to-device copies by content: a large payload is announced by its chunks' BLAKE3 ids, and only the
//! chunks the serving peer lacks cross the network, compressed where that pays.
//!
//! A copy of at least [`Policy::threshold`] bytes is cut into segments of up to [`SEGMENT`] bytes (a
//! bounded staging buffer on the server each, and a pipeline here; the first ones are smaller, so that
//! the first bytes leave after hashing one chunk, not a whole segment). Per segment:
//!
//! 1. its [`Manifest`] is computed (BLAKE3 on every core) and announced ([`Call::UploadBegin`]); the server
//!    fills what it holds and answers which chunks it lacks ([`Reply::UploadWanted`]): one round trip;
//! 2. those chunks are encoded ([`Encoder`]: zstd where it pays, chunk by chunk, on every core) and sent
//!    ([`Call::UploadChunk`], fire-and-forget, on the copy's stream's lane; a synchronous copy's on a lane
//!    of their own, off the control lane that carries the announcements);
//! 3. the copy itself follows ([`Call::UploadCopy`]), waited for only as the plain copy is
//!    (the last piece of a synchronous copy, or every call in blocking mode).
//!
//! An announcer thread hashes and announces ahead, a producer thread waits for the answers and encodes,
//! while the calling thread hands chunks to the network, so the link does not wait for the CPU work
//! (nor the CPU for the round trips). In `auto` mode compression is dropped for the rest of a copy once
//! the network waits for the encoder, and is not tried at all to a peer on this machine: it pays only while
//! the link is the bottleneck. Every byte this function reads from the caller's buffer is read
//! before it returns, so the caller may reuse the buffer at once, as with the plain copy. A segment the
//! server will not stage (too much staged already) is copied the plain way.
//!
//! An upload that takes more than a second shows a progress bar on stderr when it is a terminal.

use std::io::IsTerminal;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::{Duration, Instant};

use gleam_auth::tls::PathKind;
use gleam_cache::{CHUNK_SIZE, Compression, Encoded, Encoder, Manifest};
use gleam_protocol::tuning::{parse_size, turned_off};
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{Call, Reply};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tracing::debug;

use crate::{Client, ClientError, Network, Shared};

/// The part of a copy that is announced, staged and copied as one (a multiple of [`CHUNK_SIZE`]).
pub const SEGMENT: usize = 64 << 20;
/// Copies from this size on go by content unless `GLEAM_CACHE_THRESHOLD` says otherwise.
pub const DEFAULT_THRESHOLD: usize = 1 << 20;
/// Segments announced ahead of the one whose answer the producer waits for (one more may be announced
/// and waiting for room): an announcement is answered only once the server has worked through what was
/// sent before it (up to a lane's queue, 64 MiB) and filled it from its store, so it must leave early;
/// and the hashing of the next segments overlaps that wait. Bounded because each holds a staging buffer
/// on the server.
const ANNOUNCE_AHEAD: usize = 2;
/// Encoded chunks (and segment ends) the producer may have ready ahead of the network.
const LOOKAHEAD: usize = 4;
/// An upload shows its progress once it has taken this long.
const PROGRESS_AFTER: Duration = Duration::from_secs(1);

/// When copies go by content, from the environment (read once per process).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Policy {
    /// `GLEAM_CACHE=off` turns it off (the classic-remoting baseline).
    pub enabled: bool,
    /// Copies of at least this many bytes go by content (`GLEAM_CACHE_THRESHOLD`, e.g. `4MiB`).
    pub threshold: usize,
    /// `GLEAM_CACHE_COMPRESS`: `auto` (the default), `on` or `off`.
    pub compress: Compress,
}

/// Whether chunks are compressed.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Compress {
    /// Where it pays, as long as the network is the bottleneck (never to a peer on this machine).
    Auto,
    /// Where it pays, always.
    On,
    /// Never.
    Off,
}

impl Policy {
    /// The policy the environment sets (`GLEAM_CACHE`, `GLEAM_CACHE_THRESHOLD`, `GLEAM_CACHE_COMPRESS`).
    pub fn from_env() -> Self {
        let var = |name| std::env::var(name).ok();
        Self::from_vars(
            var("GLEAM_CACHE").as_deref(),
            var("GLEAM_CACHE_THRESHOLD").as_deref(),
            var("GLEAM_CACHE_COMPRESS").as_deref(),
        )
    }

    fn from_vars(cache: Option<&str>, threshold: Option<&str>, compress: Option<&str>) -> Self {
        let enabled = !cache.is_some_and(turned_off);
        let size = |t| parse_size(t).and_then(|bytes| usize::try_from(bytes).ok());
        let threshold = match threshold.map(|t| (t, size(t))) {
            Some((_, Some(bytes))) => bytes.max(1),
            Some((text, None)) => {
                tracing::warn!(
                    value = text,
                    "GLEAM_CACHE_THRESHOLD is not a size (e.g. 1048576 or 4MiB); using 1MiB"
                );
                DEFAULT_THRESHOLD
            }
            None => DEFAULT_THRESHOLD,
        };
        let compress = match compress.map(|c| c.trim().to_ascii_lowercase()) {
            Some(c) if c == "on" || c == "1" => Compress::On,
            Some(c) if c == "off" || c == "0" => Compress::Off,
            _ => Compress::Auto,
        };
        Self {
            enabled,
            threshold,
            compress,
        }
    }

    /// The process's policy.
    pub fn get() -> Self {
        static POLICY: OnceLock<Policy> = OnceLock::new();
        *POLICY.get_or_init(Self::from_env)
    }

    /// Whether a copy of `len` bytes goes by content.
    pub fn applies(&self, len: usize) -> bool {
        self.enabled && len >= self.threshold
    }
}

/// What the producer hands the calling thread, in order.
enum Item<'a> {
    /// A chunk the server asked for, encoded.
    Chunk {
        upload: u64,
        index: u32,
        /// Whether another chunk of the same segment came just before (for the starvation test).
        follows: bool,
        encoded: Encoded<'a>,
    },
    /// The segment at `offset` is complete on the server: copy it. `hits`: its bytes the server had.
    Copy {
        upload: u64,
        offset: usize,
        len: usize,
        hits: usize,
    },
    /// The server would not stage the segment at `offset`: copy it the plain way.
    Plain { offset: usize, bytes: &'a [u8] },
    /// The session failed.
    Failed(ClientError),
}

/// Where the producer's time went (microseconds), for the upload's log line.
#[derive(Default)]
struct Timing {
    hash: AtomicU64,
    announce: AtomicU64,
    encode: AtomicU64,
}

impl Timing {
    fn add(counter: &AtomicU64, since: Instant) {
        counter.fetch_add(since.elapsed().as_micros() as u64, Ordering::Relaxed);
    }
}

/// Numbers uploads (unique per process, so per session).
static NEXT_UPLOAD: AtomicU64 = AtomicU64::new(1);

/// Copies `src` to device address `dst` by content; see the module docs. Returns what the plain copy
/// returns: the copy's CUDA result (a synchronous copy's, or the pending error it reports).
pub(crate) fn upload(
    client: &Client,
    network: &Network,
    ctx: u64,
    dst: u64,
    src: &[u8],
    stream: Option<u64>,
    policy: Policy,
) -> Result<CUresult, ClientError> {
    let started = Instant::now();
    // On loopback the link outruns zstd by far: in `auto` mode chunks go raw from the start, not after
    // a first chunk's trial (6 ms per 8 MiB on the H200 host, with the link idle meanwhile).
    let loopback = gleam_auth::tls::path_kind(network.peer_addr) == PathKind::Loopback;
    let compress = AtomicBool::new(match policy.compress {
        Compress::On => true,
        Compress::Auto => !loopback,
        Compress::Off => false,
    });
    let timing = Timing::default();
    let shared = &network.shared;
    let mut progress = Progress::new(src.len() as u64, network.peer_addr.to_string());
    let mut tally = Tally::default();
    let result = std::thread::scope(|scope| {
        let (announced_tx, announced_rx) = sync_channel(ANNOUNCE_AHEAD);
        let (tx, rx) = sync_channel(LOOKAHEAD);
        let (compress, timing) = (&compress, &timing);
        let threads = std::thread::Builder::new()
            .name("gleam-announce".into())
            .spawn_scoped(scope, move || {
                announce_all(shared, ctx, src, timing, announced_tx);
            })
            .and_then(|announcer| {
                std::thread::Builder::new()
                    .name("gleam-upload".into())
                    .spawn_scoped(scope, move || produce(compress, timing, announced_rx, tx))
                    .map(|producer| (announcer, producer))
            });
        let (announcer, producer) = match threads {
            Ok(threads) => threads,
            // No thread to spare: the plain copy needs none.
            Err(err) => {
                debug!(%err, "no upload thread: copying the plain way");
                return client.memcpy_htod_plain(ctx, dst, src, stream, true);
            }
        };
        let result = consume(
            client,
            shared,
            ctx,
            dst,
            src.len(),
            stream,
            &rx,
            &Feedback {
                compress,
                adaptive: policy.compress == Compress::Auto,
            },
            &mut progress,
            &mut tally,
        );
        // Unblocks the producer if the copy ended early (and so the announcer).
        drop(rx);
        let _ = producer.join();
        let _ = announcer.join();
        result
    });
    progress.finish();
    // Announcing waited for a reply (on the producer thread), whatever the copy's own form: for `gleam
    // trace`.
    crate::sent::note(true);
    let secs = started.elapsed().as_secs_f64();
    // The first bulk connection at the end: what held its sending back (a large round trip, losses,
    // the peer's flow control). Read only when the line is logged.
    let bulk = tracing::enabled!(tracing::Level::DEBUG)
        .then(|| shared.bulk_stats())
        .flatten();
    debug!(
        bulk_rtt_us = bulk.map(|b| b.path.rtt.as_micros() as u64),
        bulk_min_rtt_us = bulk.map(|b| b.path.min_rtt.as_micros() as u64),
        bulk_cwnd = bulk.map(|b| b.path.cwnd),
        bulk_lost = bulk.map(|b| b.path.lost_packets),
        bulk_congestion_events = bulk.map(|b| b.path.congestion_events),
        bulk_blocked = bulk.map(|b| b.frame_tx.data_blocked + b.frame_tx.stream_data_blocked),
        bytes = src.len(),
        sent_chunks = tally.chunks,
        sent_raw = tally.raw,
        sent_wire = tally.wire,
        plain = tally.plain,
        hits = tally.hits,
        compressed = compress.load(Ordering::Relaxed),
        hash_ms = timing.hash.load(Ordering::Relaxed) / 1000,
        announce_ms = timing.announce.load(Ordering::Relaxed) / 1000,
        encode_ms = timing.encode.load(Ordering::Relaxed) / 1000,
        starved_ms = tally.starved.as_millis() as u64,
        sending_ms = tally.sending.as_millis() as u64,
        mib_per_s = src.len() as f64 / 1_048_576.0 / secs,
        "upload by content done"
    );
    result
}

/// Where the segments of a `len`-byte copy lie: one chunk, then twice as much each time up to
/// [`SEGMENT`] (boundaries on chunk boundaries, so chunk ids do not depend on the cut).
fn segments(len: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut size = CHUNK_SIZE as usize;
    let mut at = 0;
    while at < len {
        let end = (at + size).min(len);
        out.push(at..end);
        at = end;
        size = (size * 2).min(SEGMENT);
    }
    out
}

/// What the calling thread tells the producer.
struct Feedback<'a> {
    compress: &'a AtomicBool,
    adaptive: bool,
}

/// Counts for the upload's log line.
#[derive(Default)]
struct Tally {
    chunks: usize,
    raw: usize,
    wire: usize,
    plain: usize,
    hits: usize,
    /// Time the calling thread waited for the producer.
    starved: Duration,
    /// Time it spent handing chunks to the network (waiting for room included).
    sending: Duration,
}

/// A segment announced, its answer not yet read.
struct Announced<'a> {
    offset: usize,
    segment: &'a [u8],
    manifest: Manifest,
    upload: u64,
}

/// What the server answered to an announcement.
enum Answered {
    /// Send these chunks.
    Missing(Vec<u32>),
    /// It would not stage the segment: copy it the plain way.
    Plain,
}

/// Hashes a segment and announces it, without waiting for the answer.
fn announce<'a>(
    shared: &std::sync::Arc<Shared>,
    ctx: u64,
    offset: usize,
    segment: &'a [u8],
    timing: &Timing,
) -> Result<(Announced<'a>, crate::Pending), ClientError> {
    let started = Instant::now();
    let manifest = Manifest::of(segment);
    Timing::add(&timing.hash, started);
    tracing::trace!(offset, len = segment.len(), "segment hashed");
    let upload = NEXT_UPLOAD.fetch_add(1, Ordering::Relaxed);
    let call = Call::UploadBegin {
        upload,
        manifest: manifest.encode(),
    };
    let pending = shared
        .submit(ctx, call, &[], true)?
        .ok_or_else(|| ClientError::Protocol("an announcement has no waiter".into()))?;
    let announced = Announced {
        offset,
        segment,
        manifest,
        upload,
    };
    Ok((announced, pending))
}

impl Announced<'_> {
    fn answer(&self, pending: crate::Pending, timing: &Timing) -> Result<Answered, ClientError> {
        let started = Instant::now();
        let answer = pending.wait();
        Timing::add(&timing.announce, started);
        tracing::trace!(upload = self.upload, "announcement answered");
        let answer = answer?;
        if !answer.result.is_success() {
            debug!(upload = self.upload, result = %answer.result, "segment not staged: plain copy");
            return Ok(Answered::Plain);
        }
        match answer.reply {
            Reply::UploadWanted { missing }
                if missing
                    .iter()
                    .all(|&i| (i as usize) < self.manifest.chunks().len()) =>
            {
                Ok(Answered::Missing(missing))
            }
            other => Err(ClientError::Protocol(format!(
                "expected the chunks an upload lacks, got {other:?}"
            ))),
        }
    }
}

/// A segment announced (or the failure to announce it), for the producer.
type Announcement<'a> = Result<(Announced<'a>, crate::Pending), ClientError>;

/// The announcer: hashes each segment and announces it, in order, while the producer waits for earlier
/// answers and encodes (the channel to it holds [`ANNOUNCE_AHEAD`]).
fn announce_all<'a>(
    shared: &std::sync::Arc<Shared>,
    ctx: u64,
    src: &'a [u8],
    timing: &Timing,
    tx: SyncSender<Announcement<'a>>,
) {
    for r in segments(src.len()) {
        let announced = announce(shared, ctx, r.start, &src[r], timing);
        let failed = announced.is_err();
        if tx.send(announced).is_err() || failed {
            return;
        }
    }
}

/// The producer: per announced segment, waits for the answer, then encodes the chunks the server lacks.
fn produce<'a>(
    compress: &AtomicBool,
    timing: &Timing,
    announced: Receiver<Announcement<'a>>,
    tx: SyncSender<Item<'a>>,
) {
    let failed = |err| {
        let _ = tx.send(Item::Failed(err));
    };
    let cores = gleam_cache::parallel::cores();
    while let Ok(next) = announced.recv() {
        let (this, pending) = match next {
            Ok(next) => next,
            Err(err) => return failed(err),
        };
        let answered = this.answer(pending, timing);
        let missing = match answered {
            Ok(Answered::Missing(missing)) => missing,
            Ok(Answered::Plain) => {
                let item = Item::Plain {
                    offset: this.offset,
                    bytes: this.segment,
                };
                if tx.send(item).is_err() {
                    return;
                }
                continue;
            }
            Err(err) => return failed(err),
        };
        let (manifest, segment, upload) = (&this.manifest, this.segment, this.upload);
        let chunk = |i: u32| {
            let r = manifest.chunk_range(i as usize);
            &segment[r.start as usize..r.end as usize]
        };
        let sent: usize = missing.iter().map(|&i| chunk(i).len()).sum();
        let mut follows = false;
        for batch in missing.chunks(cores) {
            let policy = if compress.load(Ordering::Relaxed) {
                Compression::default()
            } else {
                Compression::OFF
            };
            let started = Instant::now();
            let encoded = gleam_cache::parallel::map(batch.to_vec(), |i| {
                (i, Encoder::new(policy).encode(chunk(i)))
            });
            Timing::add(&timing.encode, started);
            for (index, encoded) in encoded {
                let item = Item::Chunk {
                    upload,
                    index,
                    follows,
                    encoded,
                };
                follows = true;
                if tx.send(item).is_err() {
                    return;
                }
            }
        }
        let item = Item::Copy {
            upload,
            offset: this.offset,
            len: segment.len(),
            hits: segment.len() - sent,
        };
        if tx.send(item).is_err() {
            return;
        }
    }
}

/// The calling thread: hands what the producer made to the network, in order.
#[allow(clippy::too_many_arguments)]
fn consume(
    client: &Client,
    shared: &std::sync::Arc<Shared>,
    ctx: u64,
    dst: u64,
    len: usize,
    stream: Option<u64>,
    rx: &Receiver<Item<'_>>,
    feedback: &Feedback<'_>,
    progress: &mut Progress,
    tally: &mut Tally,
) -> Result<CUresult, ClientError> {
    loop {
        let waiting = Instant::now();
        let Ok(item) = rx.recv() else {
            return Err(ClientError::Protocol(
                "the upload thread ended early".into(),
            ));
        };
        tally.starved += waiting.elapsed();
        match item {
            Item::Chunk {
                upload,
                index,
                follows,
                encoded,
            } => {
                // The network ran dry while the encoder worked: compression costs more than it saves.
                if feedback.adaptive
                    && follows
                    && waiting.elapsed() > Duration::from_millis(2)
                    && shared.total.buffered.load(Ordering::Acquire) < CHUNK_SIZE as usize
                    && feedback.compress.swap(false, Ordering::Relaxed)
                {
                    debug!("the network outpaces compression: chunks go raw from now on");
                }
                let header = encoded.header.encode();
                let call = Call::UploadChunk {
                    upload,
                    index,
                    stream,
                    stripe: shared.stripe_for(upload),
                };
                crate::sent::note(false);
                let sending = Instant::now();
                shared.submit(ctx, call, &[&header, &encoded.body], false)?;
                tally.sending += sending.elapsed();
                // A timeline of the upload (`GLEAM_LOG=gleam_client::upload=trace`).
                tracing::trace!(
                    upload,
                    index,
                    waited_us = waiting.elapsed().as_micros() as u64,
                    sending_us = sending.elapsed().as_micros() as u64,
                    "chunk handed over"
                );
                tally.chunks += 1;
                tally.raw += encoded.header.raw_len as usize;
                tally.wire += encoded.wire_len();
                progress.advance(u64::from(encoded.header.raw_len));
            }
            Item::Copy {
                upload,
                offset,
                len: segment,
                hits,
            } => {
                let last = offset + segment >= len;
                let wait = client.blocking || (last && stream.is_none());
                let call = Call::UploadCopy {
                    upload,
                    dst: dst + offset as u64,
                    stream,
                    continues: offset > 0,
                };
                tally.hits += hits;
                progress.advance(hits as u64);
                if let Some(pending) = client.submit(ctx, call, &[], wait)? {
                    let result = pending.wait()?.result;
                    if last || !result.is_success() {
                        return Ok(result);
                    }
                }
                if last {
                    return Ok(CUresult::SUCCESS);
                }
            }
            Item::Plain { offset, bytes } => {
                let last = offset + bytes.len() >= len;
                tally.plain += bytes.len();
                let result =
                    client.memcpy_htod_plain(ctx, dst + offset as u64, bytes, stream, last)?;
                progress.advance(bytes.len() as u64);
                if last || !result.is_success() {
                    return Ok(result);
                }
            }
            Item::Failed(err) => return Err(err),
        }
    }
}

/// The progress bar of one upload: drawn on stderr once the upload has taken [`PROGRESS_AFTER`], if
/// stderr is a terminal.
struct Progress {
    bar: Option<ProgressBar>,
    started: Instant,
    total: u64,
    done: u64,
    peer: String,
}

impl Progress {
    fn new(total: u64, peer: String) -> Self {
        Self {
            bar: None,
            started: Instant::now(),
            total,
            done: 0,
            peer,
        }
    }

    fn advance(&mut self, bytes: u64) {
        self.done += bytes;
        if let Some(bar) = &self.bar {
            bar.set_position(self.done);
            return;
        }
        if self.started.elapsed() < PROGRESS_AFTER || !std::io::stderr().is_terminal() {
            return;
        }
        let bar = ProgressBar::with_draw_target(Some(self.total), ProgressDrawTarget::stderr())
            .with_position(self.done)
            .with_elapsed(self.started.elapsed());
        // The rate counts from here, not from the jump to what was already done.
        bar.reset_eta();
        if let Ok(style) = ProgressStyle::with_template(
            "{msg} {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(format!("gleam: uploading to {}", self.peer));
        self.bar = Some(bar);
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_sets_the_policy() {
        let default = Policy::from_vars(None, None, None);
        assert!(default.enabled);
        assert_eq!(default.threshold, 1 << 20);
        assert_eq!(default.compress, Compress::Auto);
        assert!(default.applies(1 << 20) && !default.applies((1 << 20) - 1));
        assert!(!Policy::from_vars(Some("off"), None, None).applies(1 << 30));
        assert!(Policy::from_vars(Some("on"), None, None).enabled);
        let p = Policy::from_vars(None, Some("4MiB"), Some("off"));
        assert_eq!((p.threshold, p.compress), (4 << 20, Compress::Off));
        assert_eq!(
            Policy::from_vars(None, Some("lots"), None).threshold,
            DEFAULT_THRESHOLD
        );
    }

    #[test]
    fn segments_hold_whole_chunks() {
        assert_eq!(SEGMENT % CHUNK_SIZE as usize, 0);
        let chunk = CHUNK_SIZE as usize;
        let cut = segments(200 * chunk + 5);
        assert_eq!(cut[0], 0..chunk);
        assert_eq!(cut[1], chunk..3 * chunk);
        assert_eq!(cut[4].len(), SEGMENT);
        assert_eq!(cut.last().unwrap().end, 200 * chunk + 5);
        assert!(cut.windows(2).all(|w| w[0].end == w[1].start));
        assert!(
            cut.iter()
                .all(|r| r.start % chunk == 0 && r.len() <= SEGMENT)
        );
        assert_eq!(segments(100).len(), 1);
        assert_eq!(segments(100)[0], 0..100);
    }
}
