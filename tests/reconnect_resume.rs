//! Resuming a session, at the protocol level, against a real `gleam serve --backend emu` on loopback (no
//! namespaces needed, so these run everywhere): a client leaves its connection with a reply unread and a
//! request half sent, comes back on a new connection and gets exactly what it missed; only the peer
//! that opened the session, with its token, may resume it; a session past its grace window is gone.

mod common;

use std::time::Duration;

use common::Server;
use common::client::{ask_for_session, connect_raw, pattern};
use gleam_auth::tls::server_name;
use gleam_protocol::api::{ApiCall, ApiReply, args};
use gleam_protocol::frame::{self, Frame, FrameReader};
use gleam_protocol::order::{Deps, Lane};
use gleam_protocol::resume::Awaited;
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{
    CLOSE_RESUME_ABANDONED, Call, ClientHello, Control, PROTOCOL_VERSION, Reply, ReplyFrame,
    Request, Resumed, StreamOpen,
};

/// One stream of a session connection, with its frame reader.
struct Stream {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    frames: FrameReader,
}

impl Stream {
    async fn open(conn: &quinn::Connection, opening: &StreamOpen) -> Self {
        let (mut send, recv) = conn.open_bi().await.expect("open a stream");
        let mut out = Vec::new();
        frame::encode(opening, &[], &mut out).expect("encode");
        send.write_all(&out).await.expect("write the opening");
        Self {
            send,
            recv,
            frames: FrameReader::new(),
        }
    }

    fn encode(seq: u64, ctx: u64, expects_reply: bool, call: Call, bulk: &[u8]) -> Vec<u8> {
        let request = Request {
            seq,
            ctx,
            expects_reply,
            deps: Deps::default(),
            call,
        };
        let mut out = Vec::new();
        frame::encode(&request, bulk, &mut out).expect("encode");
        out
    }

    async fn send(&mut self, seq: u64, ctx: u64, expects_reply: bool, call: Call, bulk: &[u8]) {
        let out = Self::encode(seq, ctx, expects_reply, call, bulk);
        self.send.write_all(&out).await.expect("write a request");
    }

    /// The next frame on the stream.
    async fn next(&mut self) -> Result<Frame, String> {
        let read = async {
            loop {
                if let Some(frame) = self.frames.next_frame().map_err(|e| e.to_string())? {
                    return Ok(frame);
                }
                match self.recv.read_chunk(usize::MAX, true).await {
                    Ok(Some(chunk)) => self.frames.feed(&chunk.bytes),
                    Ok(None) => return Err("stream ended".to_owned()),
                    Err(e) => return Err(e.to_string()),
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .map_err(|_| "no frame within 10 s".to_owned())?
    }

    async fn reply(&mut self, seq: u64) -> (ReplyFrame, Vec<u8>) {
        let frame = self.next().await.expect("a reply");
        let reply: ReplyFrame = frame.decode().expect("a reply frame");
        assert_eq!(reply.seq, seq, "replies in order");
        (reply, frame.bulk.to_vec())
    }
}

/// Asks to resume `session` on a new authenticated connection from `endpoint`.
async fn ask_to_resume(
    endpoint: &quinn::Endpoint,
    server: &Server,
    session: u64,
    token: [u8; 32],
) -> (quinn::Connection, Control) {
    let conn = endpoint
        .connect(server.addr, &server_name(server.peer))
        .expect("connect")
        .await
        .expect("handshake");
    gleam_auth::proof::authenticate_as_client(&conn, &server.secret())
        .await
        .expect("authenticate");
    let (mut send, mut recv) = conn.open_bi().await.expect("open");
    let mut out = Vec::new();
    let request = Control::Resume {
        protocol: PROTOCOL_VERSION,
        session,
        token,
    };
    frame::encode(&request, &[], &mut out).expect("encode");
    send.write_all(&out).await.expect("write");
    let mut frames = FrameReader::new();
    let answer = loop {
        if let Some(frame) = frames.next_frame().expect("frame") {
            break frame.decode::<Control>().expect("a control message");
        }
        let chunk = recv
            .read_chunk(usize::MAX, true)
            .await
            .expect("read")
            .expect("an answer");
        frames.feed(&chunk.bytes);
    };
    (conn, answer)
}

fn abandon(conn: &quinn::Connection) {
    conn.close(
        quinn::VarInt::from_u32(CLOSE_RESUME_ABANDONED),
        b"test: the link went away",
    );
}

/// An opened session: its offer and the session connection's control lane, after hello.
struct Opened {
    endpoint: quinn::Endpoint,
    lifeline: quinn::Connection,
    conn: quinn::Connection,
    control: Stream,
    port: u16,
    token: [u8; 32],
    session: u64,
    grace_ms: u64,
}

async fn open(server: &Server) -> Opened {
    let (endpoint, lifeline) = connect_raw(server, &server.secret())
        .await
        .expect("connect");
    let Control::Offer {
        port,
        token,
        session,
        grace_ms,
    } = ask_for_session(&lifeline, PROTOCOL_VERSION)
        .await
        .expect("an answer")
    else {
        panic!("no session offered");
    };
    let mut addr = server.addr;
    addr.set_port(port);
    let conn = endpoint
        .connect(addr, &server_name(server.peer))
        .expect("connect to the session")
        .await
        .expect("session handshake");
    let mut control = Stream::open(&conn, &StreamOpen::Attach { token }).await;
    let hello = Call::Hello(ClientHello {
        protocol: PROTOCOL_VERSION,
        client: "resume test".into(),
    });
    control.send(1, 0, true, hello, &[]).await;
    let (reply, _) = control.reply(1).await;
    assert_eq!(reply.result, CUresult::SUCCESS);
    Opened {
        endpoint,
        lifeline,
        conn,
        control,
        port,
        token,
        session,
        grace_ms,
    }
}

#[tokio::test]
async fn a_resumed_session_gets_what_it_missed_once_and_only_its_owner_may_resume_it() {
    let server = Server::start("emu");
    let mut s = open(&server).await;
    assert_eq!(s.grace_ms, 15_000, "the default grace window");
    let c = &mut s.control;
    let retain =
        ApiCall::cuDevicePrimaryCtxRetain(args::cuDevicePrimaryCtxRetain { pctx: (), dev: 0 });
    c.send(2, 0, true, Call::Api(retain), &[]).await;
    let (reply, _) = c.reply(2).await;
    let Reply::Api(ApiReply::cuDevicePrimaryCtxRetain(out)) = reply.reply else {
        panic!("{reply:?}");
    };
    let ctx = out.pctx;
    let alloc = ApiCall::cuMemAlloc_v2(args::cuMemAlloc_v2 {
        dptr: (),
        bytesize: 1 << 16,
    });
    c.send(3, ctx, true, Call::Api(alloc), &[]).await;
    let (reply, _) = c.reply(3).await;
    let Reply::Api(ApiReply::cuMemAlloc_v2(out)) = reply.reply else {
        panic!("{reply:?}");
    };
    let ptr = out.dptr;
    let data = pattern(1 << 16, 7);
    // 4: a copy in (fire and forget); 5: the copy back, whose reply the drop will take; 6: half sent.
    c.send(
        4,
        ctx,
        false,
        Call::MemcpyHtoD {
            dst: ptr,
            stream: None,
        },
        &data,
    )
    .await;
    let back = Call::MemcpyDtoH {
        src: ptr,
        len: data.len() as u64,
        stream: None,
        apart: None,
    };
    c.send(5, ctx, true, back, &[]).await;
    let sync = Call::Api(ApiCall::cuCtxSynchronize(args::cuCtxSynchronize {}));
    let whole = Stream::encode(6, ctx, true, sync, &[]);
    c.send
        .write_all(&whole[..whole.len() / 2])
        .await
        .expect("half a request");
    tokio::time::sleep(Duration::from_millis(300)).await;
    abandon(&s.conn);
    abandon(&s.lifeline);

    // Another peer, even with the token, and the owner with a wrong token: both are told it is gone.
    let (stranger, _) = connect_raw(&server, &server.secret())
        .await
        .expect("connect");
    let (_, answer) = ask_to_resume(&stranger, &server, s.session, s.token).await;
    assert!(matches!(answer, Control::Gone { .. }), "{answer:?}");
    let mut wrong = s.token;
    wrong[0] ^= 1;
    let (_, answer) = ask_to_resume(&s.endpoint, &server, s.session, wrong).await;
    assert!(matches!(answer, Control::Gone { .. }), "{answer:?}");
    // The session process refuses the stranger too.
    let mut addr = server.addr;
    addr.set_port(s.port);
    let sneak = stranger
        .connect(addr, &server_name(server.peer))
        .expect("connect")
        .await
        .expect("handshake");
    // Refused at whichever step the session process gets to first: the connection may already be
    // closed ("not this session's client") when the stream is opened, or the opening is answered by
    // the close.
    let refused = match sneak.open_bi().await {
        Err(_) => true,
        Ok((mut send, recv)) => {
            let mut out = Vec::new();
            let opening = StreamOpen::Resume {
                token: s.token,
                replies: Awaited::default(),
            };
            frame::encode(&opening, &[], &mut out).expect("encode");
            match send.write_all(&out).await {
                Err(_) => true,
                Ok(()) => {
                    let mut sneaking = Stream {
                        send,
                        recv,
                        frames: FrameReader::new(),
                    };
                    sneaking.next().await.is_err()
                }
            }
        }
    };
    assert!(refused, "a stranger resumed the session");

    // The owner comes back: the same offer, and the session process says what it received.
    let (_lifeline, answer) = ask_to_resume(&s.endpoint, &server, s.session, s.token).await;
    let Control::Offer {
        port,
        token,
        session,
        ..
    } = answer
    else {
        panic!("not resumed: {answer:?}");
    };
    assert_eq!((port, token, session), (s.port, s.token, s.session));
    let conn = s
        .endpoint
        .connect(addr, &server_name(server.peer))
        .expect("connect")
        .await
        .expect("handshake");
    let mut c = Stream::open(
        &conn,
        &StreamOpen::Resume {
            token: s.token,
            // Replies 1-3 arrived; 5 and the half-sent 6 are awaited.
            replies: Awaited {
                next: 7,
                waiting: vec![5, 6],
            },
        },
    )
    .await;
    let resumed: Resumed = c
        .next()
        .await
        .expect("the resume answer")
        .decode()
        .expect("a resume answer");
    assert_eq!(
        resumed.received,
        vec![(Lane::CONTROL, 5)],
        "requests 1-5 arrived, the half-sent 6 did not"
    );
    // The reply the drop took comes again, with its data.
    let (reply, bulk) = c.reply(5).await;
    assert_eq!(reply.result, CUresult::SUCCESS);
    assert_eq!(&bulk[..], &data[..], "the copy came back intact");
    // Request 6, sent again whole, runs; the session goes on.
    c.send.write_all(&whole).await.expect("request 6 again");
    let (reply, _) = c.reply(6).await;
    assert_eq!(reply.result, CUresult::SUCCESS);
    c.send(7, ctx, true, Call::Goodbye, &[]).await;
    let (reply, _) = c.reply(7).await;
    assert_eq!(reply.result, CUresult::SUCCESS);
}

#[tokio::test]
async fn a_session_past_its_grace_window_is_gone_and_freed() {
    let server = Server::start_in(
        "emu",
        tempfile::tempdir().expect("temp dir"),
        &[("GLEAM_SESSION_GRACE", "1")],
    );
    let s = open(&server).await;
    assert_eq!(s.grace_ms, 1_000);
    abandon(&s.conn);
    abandon(&s.lifeline);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (_, answer) = ask_to_resume(&s.endpoint, &server, s.session, s.token).await;
    let Control::Gone { reason } = answer else {
        panic!("resumed past the window: {answer:?}");
    };
    assert!(reason.contains("ended"), "{reason}");
    // Its process is gone: everything it held is freed.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !server.session_pids().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "session process still running: {:?}",
            server.session_pids()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
