//! The session process's loop: frames in on stdin, replies out on stdout, one [`Session`] in between.
//!
//! `gleam session` runs [`run`] with the chosen backend; its parent relays the client's QUIC stream to it.
//! IO is blocking: the process serves exactly one client. Replies are buffered and flushed only when no
//! complete request is already waiting, so a burst of fire-and-forget requests costs no syscall per frame
//! while a synchronous reply is never held back.
//!
//! The process's exit code says how the session ended ([`ExitReason::code`]), which the parent reports to
//! the client as the connection's close reason.

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::time::{Duration, Instant};

use tracing::{error, info};

use gleam_protocol::frame::{self, FrameError};
use gleam_protocol::wire::Request;

use crate::backend::Backend;
use crate::session::{Answer, Session};

/// Read buffer: large enough to hold many small requests, so bursts are read in one syscall.
const READ_BUFFER: usize = 1 << 20;
/// Write buffer for replies.
const WRITE_BUFFER: usize = 256 << 10;

/// How a session process ended.
#[derive(Debug, thiserror::Error)]
pub enum ExitReason {
    /// The client said goodbye, or its stream ended between frames.
    #[error("session ended")]
    Ended,
    /// A frame did not decode as a request: the client is broken or hostile.
    #[error("malformed request: {0}")]
    Malformed(#[source] FrameError),
    /// A frame announced more than the frame limits allow.
    #[error("request frame too large: {0}")]
    FrameTooLarge(#[source] FrameError),
    /// Reading requests or writing replies failed (the parent went away).
    #[error("session pipe failed: {0}")]
    Io(#[source] io::Error),
}

impl ExitReason {
    /// Exit code of the session process for this reason (see [`ExitReason::describe_code`]).
    pub fn code(&self) -> u8 {
        match self {
            Self::Ended => 0,
            Self::Malformed(_) => EXIT_MALFORMED,
            Self::FrameTooLarge(_) => EXIT_FRAME_TOO_LARGE,
            Self::Io(_) => EXIT_IO,
        }
    }

    /// What an exit code of a session process means, for the parent's close reason.
    pub fn describe_code(code: i32) -> &'static str {
        match code {
            0 => "session ended",
            c if c == i32::from(EXIT_MALFORMED) => "malformed request",
            c if c == i32::from(EXIT_FRAME_TOO_LARGE) => "request frame too large",
            c if c == i32::from(EXIT_IO) => "session pipe failed",
            c if c == i32::from(EXIT_BACKEND) => "the GPU backend could not start",
            _ => "session process failed",
        }
    }
}

/// Exit code: a request did not decode.
pub const EXIT_MALFORMED: u8 = 3;
/// Exit code: a request frame exceeded the frame limits.
pub const EXIT_FRAME_TOO_LARGE: u8 = 4;
/// Exit code: stdin/stdout failed.
pub const EXIT_IO: u8 = 5;
/// Exit code: the backend could not be created (used by `gleam session`).
pub const EXIT_BACKEND: u8 = 6;

/// Serves one session over the process's stdin and stdout until it ends.
pub fn run<B: Backend>(backend: B) -> ExitReason {
    // Raw descriptors, not `Stdin`/`Stdout`: stdout's line buffering would flush at every 0x0a byte.
    let (input, output) = match (raw_stdin(), raw_stdout()) {
        (Ok(i), Ok(o)) => (i, o),
        (Err(err), _) | (_, Err(err)) => return ExitReason::Io(err),
    };
    let input = SpinningPipe {
        file: input,
        spin: gleam_protocol::tuning::spin_budget(),
    };
    serve(backend, input, output)
}

/// The request pipe, read after a brief spin: when the next request comes within the spin, the process
/// does not go to sleep and back (see [`gleam_protocol::tuning::spin_budget`]). The spin starts only when the
/// read buffer is empty, i.e. right after the replies were flushed.
struct SpinningPipe {
    file: std::fs::File,
    spin: Duration,
}

impl Read for SpinningPipe {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.spin.is_zero() {
            let start = Instant::now();
            while !readable_now(&self.file) && start.elapsed() < self.spin {
                std::hint::spin_loop();
            }
        }
        self.file.read(buf)
    }
}

/// Whether reading `file` would not block (data, end of file or an error pending).
fn readable_now(file: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    let mut pollfd = libc::pollfd {
        fd: file.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, a zero timeout; nothing is retained after the call.
    let rc = unsafe { libc::poll(&raw mut pollfd, 1, 0) };
    // On a poll failure, stop spinning and let the blocking read report whatever is wrong.
    rc != 0
}

/// Serves one session over `input`/`output` until it ends (a clean end of input, Goodbye or an error).
pub fn serve<B: Backend, R: Read, W: Write>(backend: B, input: R, output: W) -> ExitReason {
    let mut session = Session::new(backend);
    let mut input = BufReader::with_capacity(READ_BUFFER, input);
    let mut output = BufWriter::with_capacity(WRITE_BUFFER, output);
    let reason = serve_loop(&mut session, &mut input, &mut output);
    // Whatever happened, the replies produced so far go out and the session's resources are freed.
    let flushed = output.flush();
    session.finish();
    let reason = match (reason, flushed) {
        (ExitReason::Ended, Err(err)) => ExitReason::Io(err),
        (reason, _) => reason,
    };
    match &reason {
        ExitReason::Ended => info!("session process done"),
        other => error!(reason = %other, "session ended abnormally"),
    }
    reason
}

fn serve_loop<B: Backend, R: Read, W: Write>(
    session: &mut Session<B>,
    input: &mut BufReader<R>,
    output: &mut BufWriter<W>,
) -> ExitReason {
    let mut body = Vec::new();
    let mut head = Vec::new();
    loop {
        let prefix = match frame::read_blocking(input, &mut body) {
            Ok(Some(prefix)) => prefix,
            Ok(None) => return ExitReason::Ended,
            Err(err @ (FrameError::HeaderTooLarge(_) | FrameError::BulkTooLarge(_))) => {
                return ExitReason::FrameTooLarge(err);
            }
            Err(FrameError::Io(err)) => return ExitReason::Io(err),
            Err(err @ FrameError::Malformed(_)) => return ExitReason::Malformed(err),
        };
        let (header, bulk) = body.split_at(prefix.header_len);
        let request: Request = match postcard::from_bytes(header) {
            Ok(request) => request,
            Err(err) => return ExitReason::Malformed(err.into()),
        };
        if let Some(answer) = session.handle(request, bulk)
            && let Err(reason) = write_answer(&answer, &mut head, output)
        {
            return reason;
        }
        if session.is_closed() {
            return ExitReason::Ended;
        }
        if !complete_frame_buffered(input.buffer())
            && let Err(err) = output.flush()
        {
            return ExitReason::Io(err);
        }
    }
}

/// Writes an answer: its header, then its bulk bytes as they are (no copy into the frame).
fn write_answer<W: Write>(
    answer: &Answer,
    head: &mut Vec<u8>,
    output: &mut BufWriter<W>,
) -> Result<(), ExitReason> {
    head.clear();
    if let Err(err) = frame::encode_head(&answer.frame, answer.bulk.len(), head) {
        // Only an over-long reply can fail to encode; the session cannot answer: end it.
        error!(seq = answer.frame.seq, error = %err, "cannot encode reply");
        return Err(ExitReason::Io(io::Error::other(err.to_string())));
    }
    output.write_all(head).map_err(ExitReason::Io)?;
    output.write_all(&answer.bulk).map_err(ExitReason::Io)
}

/// Whether `buf` starts with a whole frame (so reading it will not block).
fn complete_frame_buffered(buf: &[u8]) -> bool {
    match buf
        .first_chunk::<{ frame::PREFIX_LEN }>()
        .map(|p| frame::Prefix::parse(*p))
    {
        Some(Ok(prefix)) => buf.len() >= prefix.frame_len(),
        // A bad prefix: reading it fails at once, without blocking.
        Some(Err(_)) => true,
        None => false,
    }
}

fn raw_stdin() -> io::Result<std::fs::File> {
    use std::os::fd::AsFd;
    Ok(std::fs::File::from(
        io::stdin().as_fd().try_clone_to_owned()?,
    ))
}

fn raw_stdout() -> io::Result<std::fs::File> {
    use std::os::fd::AsFd;
    Ok(std::fs::File::from(
        io::stdout().as_fd().try_clone_to_owned()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ApiBackend;
    use gleam_protocol::api::{ApiCall, args, outs};
    use gleam_protocol::frame::{FrameReader, MAX_BULK};
    use gleam_protocol::types::CUresult;
    use gleam_protocol::wire::{
        Call, ClientHello, DeviceInfo, FunctionInfo, Launch, PROTOCOL_VERSION, Reply, ReplyFrame,
    };

    /// A byte-array "device" at address 0x1000; enough to drive the loop.
    struct Bytes(Vec<u8>);

    impl ApiBackend for Bytes {
        fn cuCtxSynchronize(
            &mut self,
            _: args::cuCtxSynchronize,
        ) -> Result<outs::cuCtxSynchronize, CUresult> {
            Ok(outs::cuCtxSynchronize {})
        }
    }

    impl Backend for Bytes {
        fn describe(&mut self) -> Result<(i32, String, Vec<DeviceInfo>), CUresult> {
            Ok((13000, "bytes".into(), Vec::new()))
        }
        fn set_current_context(&mut self, _: u64) -> Result<(), CUresult> {
            Ok(())
        }
        fn memcpy_htod(&mut self, dst: u64, data: &[u8], _: Option<u64>) -> Result<(), CUresult> {
            let at = dst.checked_sub(0x1000).ok_or(CUresult::INVALID_VALUE)? as usize;
            let end = at.checked_add(data.len()).filter(|&e| e <= self.0.len());
            self.0[at..end.ok_or(CUresult::INVALID_VALUE)?].copy_from_slice(data);
            Ok(())
        }
        fn memcpy_dtoh(
            &mut self,
            src: u64,
            len: usize,
            _: Option<u64>,
        ) -> Result<Vec<u8>, CUresult> {
            let at = src.checked_sub(0x1000).ok_or(CUresult::INVALID_VALUE)? as usize;
            let end = at.checked_add(len).filter(|&e| e <= self.0.len());
            Ok(self.0[at..end.ok_or(CUresult::INVALID_VALUE)?].to_vec())
        }
        fn module_load(&mut self, _: &[u8]) -> Result<u64, CUresult> {
            Err(CUresult::INVALID_IMAGE)
        }
        fn module_get_function(
            &mut self,
            _: u64,
            _: &str,
        ) -> Result<(u64, FunctionInfo), CUresult> {
            Err(CUresult::INVALID_HANDLE)
        }
        fn launch(&mut self, _: &Launch) -> Result<(), CUresult> {
            Err(CUresult::INVALID_HANDLE)
        }
        fn shutdown(&mut self, _: &gleam_protocol::registry::Handles) {}
    }

    fn frame_with(seq: u64, expects_reply: bool, call: Call, bulk: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let req = Request {
            seq,
            ctx: 0,
            expects_reply,
            call,
        };
        frame::encode(&req, bulk, &mut out).unwrap();
        out
    }

    fn frame(seq: u64, expects_reply: bool, call: Call) -> Vec<u8> {
        frame_with(seq, expects_reply, call, &[])
    }

    /// The replies written, each with its bulk bytes.
    fn replies(out: &[u8]) -> Vec<(ReplyFrame, Vec<u8>)> {
        let mut reader = FrameReader::new();
        reader.feed(out);
        let mut all = Vec::new();
        while let Some(frame) = reader.next_frame().unwrap() {
            all.push((frame.decode().unwrap(), frame.bulk.to_vec()));
        }
        assert!(!reader.is_mid_frame());
        all
    }

    fn hello() -> Call {
        Call::Hello(ClientHello {
            protocol: PROTOCOL_VERSION,
            client: "worker test".into(),
        })
    }

    #[test]
    fn serves_a_session_until_goodbye() {
        let mut input = frame(1, true, hello());
        input.extend(frame_with(
            2,
            false,
            Call::MemcpyHtoD {
                dst: 0x1000,
                stream: None,
            },
            b"gleam",
        ));
        // A failing fire-and-forget launch: its error comes back with the next reply.
        input.extend(frame(
            3,
            false,
            Call::LaunchKernel(Launch {
                function: 9,
                grid: [1; 3],
                block: [1; 3],
                shared_mem_bytes: 0,
                stream: 0,
                params: Vec::new(),
            }),
        ));
        input.extend(frame(
            4,
            true,
            Call::Api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {})),
        ));
        input.extend(frame(
            5,
            true,
            Call::MemcpyDtoH {
                src: 0x1000,
                len: 5,
                stream: None,
            },
        ));
        input.extend(frame(6, true, Call::Goodbye));
        // Anything after goodbye is not read.
        input.extend(frame(7, true, Call::Goodbye));
        let mut output = Vec::new();
        let reason = serve(Bytes(vec![0; 64]), &input[..], &mut output);
        assert!(matches!(reason, ExitReason::Ended), "{reason}");
        let r = replies(&output);
        let seqs: Vec<u64> = r.iter().map(|(r, _)| r.seq).collect();
        assert_eq!(seqs, [1, 4, 5, 6]);
        assert!(matches!(r[0].0.reply, Reply::Hello(ref h) if h.backend == "bytes"));
        assert_eq!(r[1].0.result, CUresult::INVALID_HANDLE);
        assert!(matches!(r[2].0.reply, Reply::Data));
        assert_eq!(r[2].1, b"gleam");
        assert_eq!(r[3].0.result, CUresult::SUCCESS);
    }

    #[test]
    fn malformed_and_oversized_frames_end_the_session_with_distinct_codes() {
        let mut input = frame(1, true, hello());
        input.extend(3u32.to_le_bytes());
        input.extend(0u32.to_le_bytes());
        input.extend([0xff, 0xff, 0xff]);
        let mut output = Vec::new();
        let reason = serve(Bytes(vec![0; 8]), &input[..], &mut output);
        assert_eq!(reason.code(), EXIT_MALFORMED, "{reason}");
        // The reply before the bad frame still went out.
        assert_eq!(replies(&output).len(), 1);

        let mut input = frame(1, true, hello());
        input.extend(1u32.to_le_bytes());
        input.extend(((MAX_BULK + 1) as u32).to_le_bytes());
        let reason = serve(Bytes(vec![0; 8]), &input[..], Vec::new());
        assert_eq!(reason.code(), EXIT_FRAME_TOO_LARGE, "{reason}");

        // A stream cut inside a frame is an IO error, not a clean end.
        let mut input = frame(1, true, hello());
        input.truncate(input.len() - 1);
        let reason = serve(Bytes(vec![0; 8]), &input[..], Vec::new());
        assert_eq!(reason.code(), EXIT_IO, "{reason}");
    }

    #[test]
    fn large_data_replies_carry_their_bytes_as_bulk() {
        for len in [0, 1, 3 << 20] {
            let data: Vec<u8> = (0..len).map(|i| (i * 13 + 1) as u8).collect();
            let answer = Answer {
                frame: ReplyFrame {
                    seq: 1 << 33,
                    result: CUresult::SUCCESS,
                    reply: Reply::Data,
                },
                bulk: data.clone(),
            };
            let mut out = BufWriter::new(Vec::new());
            write_answer(&answer, &mut Vec::new(), &mut out).unwrap();
            let written = out.into_inner().unwrap();
            let r = replies(&written);
            assert_eq!(r.len(), 1);
            assert!(matches!(r[0].0.reply, Reply::Data));
            assert!(r[0].1 == data, "len {len}");
        }
    }

    #[test]
    fn the_spinning_pipe_reads_whatever_comes_during_or_after_the_spin() {
        let (reader, mut writer) = std::io::pipe().unwrap();
        let mut pipe = SpinningPipe {
            file: std::fs::File::from(std::os::fd::OwnedFd::from(reader)),
            spin: Duration::from_millis(20),
        };
        let feeder = std::thread::spawn(move || {
            // Within the spin, then after it, then the end of the stream.
            std::thread::sleep(Duration::from_millis(5));
            writer.write_all(b"during").unwrap();
            std::thread::sleep(Duration::from_millis(60));
            writer.write_all(b"after").unwrap();
        });
        let mut buf = [0u8; 16];
        let n = pipe.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"during");
        let t = std::time::Instant::now();
        let n = pipe.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"after");
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "it blocked after the spin"
        );
        feeder.join().unwrap();
        assert_eq!(pipe.read(&mut buf).unwrap(), 0);
    }

    #[test]
    fn complete_frames_are_detected_in_the_buffer() {
        assert!(!complete_frame_buffered(&[]));
        assert!(!complete_frame_buffered(&[1, 0, 0]));
        assert!(!complete_frame_buffered(&[2, 0, 0, 0, 1, 0, 0, 0, 9, 9]));
        assert!(complete_frame_buffered(&[2, 0, 0, 0, 1, 0, 0, 0, 9, 9, 9]));
        assert!(complete_frame_buffered(&[0; 8]));
    }
}
