//! Target `frames`: what a client can send a session process, as raw bytes.
//!
//! The input is `chunk | stream`: the stream is cut into pieces of `chunk` bytes (0 = whole) as a network
//! would cut it. Three readers of the framing must agree on it, frame for frame: the sans-IO
//! [`FrameReader`] fed piece by piece, the blocking [`frame::read_blocking`] the session process uses, and
//! the relay's [`Scanner`]. Each frame then goes, as in the session process, through request decoding (the
//! first malformed one ends the session) and a [`Session`] over an [`EmuBackend`] with [`EMU_MEMORY`] of
//! device memory, and each answer is encoded as a reply frame. At the end the session is finished as when
//! a connection drops. Any panic, hang or unbounded allocation on the way is a bug.
//!
//! One thing a hostile stream can do is bounded only in time: a kernel runs until the emu's watchdog
//! stops it (10 s by default), which would make every such input a hang to the fuzzer. So the harness
//! lets through only launches of its own loop-free module ([`KERNELS_PTX`]) of at most
//! [`MAX_LAUNCH_THREADS`] threads (plain, `LaunchKernelEx`, or replayed by a graph), and counts the rest
//! as refused; the PTX interpreter meets hostile kernels in the `ptx` target. Everything else (streams
//! included: the emu bounds them and runs them on a small pool) reaches the engine as sent.

use std::collections::HashSet;
use std::io::Cursor;

use gleam_emu::{EmuBackend, EmuConfig};
use gleam_protocol::api::{ApiCall, ApiReply};
use gleam_protocol::frame::{self, Frame, FrameError, FrameReader, Scanner};
use gleam_protocol::wire::{Call, Reply, Request};
use gleam_server::session::{Answer, Session};

/// Device memory of the emulated GPU: small, so allocation paths hit their limits.
pub const EMU_MEMORY: u64 = 16 << 20;
/// Most threads one admitted launch may run.
pub const MAX_LAUNCH_THREADS: u64 = 4096;
/// The module whose kernels may be launched (no loops: every launch is short).
pub const KERNELS_PTX: &str = include_str!("kernels.ptx");

/// Runs one input. Panics only on a bug.
pub fn run(data: &[u8]) {
    let Some((&chunk, stream)) = data.split_first() else {
        return;
    };
    let frames = agreed_frames(stream, usize::from(chunk));
    let mut session = Session::new(EmuBackend::new(EmuConfig::with_memory(EMU_MEMORY)));
    let mut guard = Guard::default();
    let mut head = Vec::new();
    for frame in &frames {
        // The session process ends the session at the first request that does not decode.
        let Ok(request) = frame.decode::<Request>() else {
            break;
        };
        if !guard.admit(&request) {
            continue;
        }
        let call = request.call.clone();
        let answer = session.handle(request, &frame.bulk);
        if let Some(answer) = &answer {
            guard.observe(&call, &frame.bulk, answer);
            head.clear();
            // An answer too large to encode ends a real session; it must not panic either.
            let _ = frame::encode_head(&answer.frame, answer.bulk.len(), &mut head);
        }
        if session.is_closed() {
            break;
        }
    }
    session.finish();
}

/// How a reader's view of the stream ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// Between two frames.
    Clean,
    /// Inside a frame (a truncated stream).
    Truncated,
    /// A prefix over the limits.
    Refused,
}

/// The stream's frames, after checking that the three readers see the same frames and the same end.
fn agreed_frames(stream: &[u8], chunk: usize) -> Vec<Frame> {
    let piece = if chunk == 0 {
        stream.len().max(1)
    } else {
        chunk
    };

    let mut reader = FrameReader::new();
    let mut by_reader = Vec::new();
    let mut reader_end = None;
    'feed: for bytes in stream.chunks(piece) {
        reader.feed(bytes);
        loop {
            match reader.next_frame() {
                Ok(Some(frame)) => by_reader.push(frame),
                Ok(None) => break,
                Err(FrameError::HeaderTooLarge(_) | FrameError::BulkTooLarge(_)) => {
                    reader_end = Some(End::Refused);
                    break 'feed;
                }
                Err(other) => panic!("the frame reader failed without IO: {other}"),
            }
        }
        assert!(!reader.has_frame(), "has_frame after next_frame said none");
    }
    let reader_end = reader_end.unwrap_or(if reader.is_mid_frame() {
        End::Truncated
    } else {
        End::Clean
    });

    let mut cursor = Cursor::new(stream);
    let mut buf = Vec::new();
    let mut blocking = Vec::new();
    let blocking_end = loop {
        match frame::read_blocking(&mut cursor, &mut buf) {
            Ok(Some(prefix)) => {
                let (header, bulk) = buf.split_at(prefix.header_len);
                assert_eq!(bulk.len(), prefix.bulk_len, "read_blocking's bulk length");
                blocking.push((header.to_vec(), bulk.to_vec()));
            }
            Ok(None) => break End::Clean,
            Err(FrameError::Io(_)) => break End::Truncated,
            Err(FrameError::HeaderTooLarge(_) | FrameError::BulkTooLarge(_)) => {
                break End::Refused;
            }
            Err(other) => panic!("read_blocking failed unexpectedly: {other}"),
        }
    };

    let mut scanner = Scanner::new();
    let scanner_end = match stream
        .chunks(piece)
        .try_for_each(|bytes| scanner.feed(bytes))
    {
        Err(_) => End::Refused,
        Ok(()) if scanner.at_boundary() => End::Clean,
        Ok(()) => End::Truncated,
    };

    assert_eq!(
        by_reader.len(),
        blocking.len(),
        "FrameReader and read_blocking disagree on the frame count"
    );
    for (i, (a, (header, bulk))) in by_reader.iter().zip(&blocking).enumerate() {
        assert!(
            a.header[..] == header[..] && a.bulk[..] == bulk[..],
            "frame {i} differs between FrameReader and read_blocking"
        );
    }
    assert_eq!(reader_end, blocking_end, "the readers disagree on the end");
    assert_eq!(reader_end, scanner_end, "the scanner disagrees on the end");
    by_reader
}

/// Keeps what is known to be unbounded out of the session (see the module documentation).
#[derive(Default)]
struct Guard {
    /// Modules and libraries loaded from [`KERNELS_PTX`].
    safe_images: HashSet<u64>,
    /// Functions and kernels of those.
    launchable: HashSet<u64>,
    /// Content hashes of [`KERNELS_PTX`] images the session accepted (`Call::LoadImage`).
    safe_hashes: HashSet<[u8; 32]>,
    refused: u64,
}

impl Guard {
    fn admit(&mut self, request: &Request) -> bool {
        let ok = match &request.call {
            Call::LaunchKernel(launch) | Call::LaunchKernelEx { launch, .. } => {
                let threads = launch
                    .grid
                    .iter()
                    .chain(&launch.block)
                    .fold(1u64, |n, &d| n.saturating_mul(u64::from(d)));
                self.launchable.contains(&launch.function) && threads <= MAX_LAUNCH_THREADS
            }
            _ => true,
        };
        if !ok {
            self.refused += 1;
        }
        ok
    }

    /// Learns which handles the answer to `call` made launchable.
    fn observe(&mut self, call: &Call, bulk: &[u8], answer: &Answer) {
        let safe_image = image_is_kernels(bulk);
        match (call, &answer.frame.reply) {
            (
                Call::LoadImage { image, .. },
                Reply::Module { handle } | Reply::Library { handle },
            ) => {
                // The server checked the bytes against the hash; without bytes it used what it kept.
                let safe = if bulk.is_empty() {
                    self.safe_hashes.contains(&image.hash)
                } else {
                    if safe_image {
                        self.safe_hashes.insert(image.hash);
                    }
                    safe_image
                };
                if safe {
                    self.safe_images.insert(*handle);
                } else {
                    self.safe_images.remove(handle);
                }
            }
            (Call::ModuleLoad, Reply::Module { handle })
            | (Call::LibraryLoad, Reply::Library { handle }) => {
                if safe_image {
                    self.safe_images.insert(*handle);
                } else {
                    self.safe_images.remove(handle);
                }
            }
            (Call::ModuleGetFunction { module, .. }, Reply::Function { handle, .. }) => {
                self.mark(*handle, self.safe_images.contains(module));
            }
            (Call::KernelGetFunction { kernel }, Reply::Function { handle, .. }) => {
                self.mark(*handle, self.launchable.contains(kernel));
            }
            (
                Call::Api(ApiCall::cuLibraryGetKernel(args)),
                Reply::Api(ApiReply::cuLibraryGetKernel(outs)),
            ) => {
                self.mark(outs.kernel, self.safe_images.contains(&args.library));
            }
            (
                Call::Api(ApiCall::cuLibraryGetModule(args)),
                Reply::Api(ApiReply::cuLibraryGetModule(outs)),
            ) => {
                if self.safe_images.contains(&args.library) {
                    self.safe_images.insert(outs.module);
                } else {
                    self.safe_images.remove(&outs.module);
                }
            }
            _ => {}
        }
    }

    fn mark(&mut self, handle: u64, safe: bool) {
        if safe {
            self.launchable.insert(handle);
        } else {
            self.launchable.remove(&handle);
        }
    }
}

/// Whether a module image is the harness's own module (with or without its NUL).
fn image_is_kernels(image: &[u8]) -> bool {
    let text = image.strip_suffix(&[0]).unwrap_or(image);
    text == KERNELS_PTX.as_bytes()
}
