//! A minimal client of the session protocol for the `serve_*` tests: a real QUIC connection, mesh
//! authentication and framing (no mocks), against a [`Server`].

use std::time::Duration;

use gleam_auth::identity::{Identity, MeshSecret};
use gleam_auth::tls::{ALPN_CUDA, client_config, server_name};
use gleam_protocol::api::{ApiCall, ApiReply, args};
use gleam_protocol::frame::{self, FrameReader};
use gleam_protocol::order::Deps;
use gleam_protocol::types::CUresult;
use gleam_protocol::wire::{
    COPY_CHUNK, Call, ClientHello, Control, PROTOCOL_VERSION, Reply, ReplyFrame, Request,
    ServerHello, StreamOpen,
};

use super::Server;

/// A minimal client of the session protocol: everything on the control lane, in order.
pub struct Client {
    pub endpoint: quinn::Endpoint,
    /// The authenticated connection to the peer, kept as the session's lifeline.
    pub lifeline: quinn::Connection,
    /// The connection to the session process.
    pub conn: quinn::Connection,
    pub send: quinn::SendStream,
    pub recv: quinn::RecvStream,
    seq: u64,
    pub ctx: u64,
    frames: FrameReader,
    /// The bulk bytes of the last reply read (device-to-host data).
    pub last_bulk: Vec<u8>,
}

/// Connects and authenticates with `secret`; no session stream yet.
pub async fn connect_raw(
    server: &Server,
    secret: &MeshSecret,
) -> Result<(quinn::Endpoint, quinn::Connection), String> {
    let identity = Identity::ephemeral().map_err(|e| e.to_string())?;
    let mut endpoint =
        quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).map_err(|e| e.to_string())?;
    endpoint.set_default_client_config(
        client_config(&identity, server.peer, ALPN_CUDA).map_err(|e| e.to_string())?,
    );
    let conn = endpoint
        .connect(server.addr, &server_name(server.peer))
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    gleam_auth::proof::authenticate_as_client(&conn, secret)
        .await
        .map_err(|e| e.to_string())?;
    Ok((endpoint, conn))
}

/// Asks the peer for a session on an authenticated connection: the session process's port and token,
/// or the peer's refusal.
pub async fn ask_for_session(conn: &quinn::Connection, protocol: u32) -> Result<Control, String> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    frame::encode(&Control::Open { protocol }, &[], &mut out).expect("encode");
    send.write_all(&out).await.map_err(|e| e.to_string())?;
    let mut frames = FrameReader::new();
    loop {
        if let Some(frame) = frames.next_frame().map_err(|e| e.to_string())? {
            return frame.decode().map_err(|e| e.to_string());
        }
        match recv.read_chunk(usize::MAX, true).await {
            Ok(Some(chunk)) => frames.feed(&chunk.bytes),
            Ok(None) => return Err("offer stream ended".into()),
            Err(e) => return Err(e.to_string()),
        }
    }
}

impl Client {
    /// Connects, authenticates, asks for a session, connects to the session process and attaches
    /// (Hello not yet sent).
    pub async fn connect(server: &Server) -> Self {
        let (endpoint, lifeline) = connect_raw(server, &server.secret())
            .await
            .expect("connect and authenticate");
        let Control::Offer { port, token, .. } = ask_for_session(&lifeline, PROTOCOL_VERSION)
            .await
            .expect("a session offer")
        else {
            panic!("the peer refused the session");
        };
        let mut addr = server.addr;
        addr.set_port(port);
        let conn = endpoint
            .connect(addr, &server_name(server.peer))
            .expect("connect to the session")
            .await
            .expect("session handshake");
        let (mut send, recv) = conn.open_bi().await.expect("open the control lane");
        let mut out = Vec::new();
        frame::encode(&StreamOpen::Attach { token }, &[], &mut out).expect("encode");
        send.write_all(&out).await.expect("attach");
        Self {
            endpoint,
            lifeline,
            conn,
            send,
            recv,
            seq: 0,
            ctx: 0,
            frames: FrameReader::new(),
            last_bulk: Vec::new(),
        }
    }

    /// Connects, says hello and makes device 0's primary context current.
    pub async fn open(server: &Server) -> (Self, ServerHello) {
        let mut c = Self::connect(server).await;
        let hello = c.hello().await;
        let ctx = c
            .api_ok(ApiCall::cuDevicePrimaryCtxRetain(
                args::cuDevicePrimaryCtxRetain { pctx: (), dev: 0 },
            ))
            .await;
        let ApiReply::cuDevicePrimaryCtxRetain(out) = ctx else {
            panic!("wrong reply {ctx:?}")
        };
        c.ctx = out.pctx;
        (c, hello)
    }

    pub async fn hello(&mut self) -> ServerHello {
        let r = self
            .call(Call::Hello(ClientHello {
                protocol: PROTOCOL_VERSION,
                client: "serve test".into(),
            }))
            .await;
        assert_eq!(r.result, CUresult::SUCCESS);
        match r.reply {
            Reply::Hello(h) => h,
            other => panic!("not a hello reply: {other:?}"),
        }
    }

    /// Sends a request without waiting.
    pub async fn send(&mut self, call: Call, expects_reply: bool) -> u64 {
        self.try_send(call, expects_reply)
            .await
            .expect("write request")
    }

    /// Sends a request; `Err` if the session is gone.
    pub async fn try_send(&mut self, call: Call, expects_reply: bool) -> Result<u64, String> {
        self.try_send_with(call, &[], expects_reply).await
    }

    /// Sends a request with bulk bytes; `Err` if the session is gone.
    pub async fn try_send_with(
        &mut self,
        call: Call,
        bulk: &[u8],
        expects_reply: bool,
    ) -> Result<u64, String> {
        self.seq += 1;
        let req = Request {
            seq: self.seq,
            ctx: self.ctx,
            expects_reply,
            deps: Deps::default(),
            call,
        };
        let mut out = Vec::new();
        frame::encode(&req, bulk, &mut out).expect("encode");
        self.send.write_all(&out).await.map_err(|e| e.to_string())?;
        Ok(self.seq)
    }

    /// Writes raw bytes on the session stream.
    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.send.write_all(bytes).await.expect("write raw bytes");
    }

    /// Reads the next reply (its bulk bytes go to `last_bulk`); `Err` when the session ends first.
    pub async fn reply(&mut self) -> Result<ReplyFrame, String> {
        loop {
            if let Some(frame) = self.frames.next_frame().map_err(|e| e.to_string())? {
                self.last_bulk = frame.bulk.to_vec();
                return frame.decode().map_err(|e| e.to_string());
            }
            // The session process dying shows on the lifeline (its parent closes it with the reason),
            // not on the session connection, whose far end just goes silent.
            let chunk = tokio::select! {
                chunk = self.recv.read_chunk(usize::MAX, true) => chunk,
                closed = self.lifeline.closed() => return Err(format!("lifeline closed: {closed}")),
            };
            match chunk {
                Ok(Some(chunk)) => self.frames.feed(&chunk.bytes),
                Ok(None) => return Err("session stream ended".into()),
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// A sync call: sends and waits for its reply.
    pub async fn call(&mut self, call: Call) -> ReplyFrame {
        self.try_call(call).await.expect("reply")
    }

    /// A sync call with bulk bytes.
    pub async fn call_with(&mut self, call: Call, bulk: &[u8]) -> ReplyFrame {
        let seq = self
            .try_send_with(call, bulk, true)
            .await
            .expect("write request");
        let r = self.reply().await.expect("reply");
        assert_eq!(r.seq, seq, "replies come in order with their request's seq");
        r
    }

    pub async fn try_call(&mut self, call: Call) -> Result<ReplyFrame, String> {
        let seq = self.try_send(call, true).await?;
        let r = self.reply().await?;
        assert_eq!(r.seq, seq, "replies come in order with their request's seq");
        Ok(r)
    }

    pub async fn api(&mut self, call: ApiCall) -> ReplyFrame {
        self.call(Call::Api(call)).await
    }

    pub async fn api_ok(&mut self, call: ApiCall) -> ApiReply {
        let name = call.name();
        let r = self.api(call).await;
        assert_eq!(r.result, CUresult::SUCCESS, "{name}");
        match r.reply {
            Reply::Api(a) => a,
            other => panic!("{name}: not an api reply: {other:?}"),
        }
    }

    pub async fn alloc(&mut self, bytes: usize) -> Result<u64, CUresult> {
        let r = self
            .api(ApiCall::cuMemAlloc_v2(args::cuMemAlloc_v2 {
                dptr: (),
                bytesize: bytes,
            }))
            .await;
        match r.reply {
            Reply::Api(ApiReply::cuMemAlloc_v2(out)) if r.result.is_success() => Ok(out.dptr),
            _ => Err(r.result),
        }
    }

    /// A synchronous host-to-device copy in `COPY_CHUNK` pieces, the last one expecting the reply.
    pub async fn htod(&mut self, dst: u64, data: &[u8]) -> CUresult {
        let pieces: Vec<&[u8]> = data.chunks(COPY_CHUNK).collect();
        for (i, piece) in pieces.iter().enumerate() {
            let last = i + 1 == pieces.len();
            let call = Call::MemcpyHtoD {
                dst: dst + (i * COPY_CHUNK) as u64,
                stream: None,
            };
            if last {
                return self.call_with(call, piece).await.result;
            }
            self.try_send_with(call, piece, false)
                .await
                .expect("write request");
        }
        CUresult::SUCCESS
    }

    /// A synchronous device-to-host copy, chunk by chunk.
    pub async fn dtoh(&mut self, src: u64, len: usize) -> Result<Vec<u8>, CUresult> {
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            let n = (len - out.len()).min(COPY_CHUNK);
            let r = self
                .call(Call::MemcpyDtoH {
                    src: src + out.len() as u64,
                    len: n as u64,
                    stream: None,
                    apart: None,
                })
                .await;
            match r.reply {
                Reply::Data if r.result.is_success() => out.extend_from_slice(&self.last_bulk),
                _ => return Err(r.result),
            }
        }
        Ok(out)
    }

    /// Waits for the connection to close; the close code and reason, or why it closed otherwise.
    /// How the session ended, as its lifeline's close says (the session process's exit, or the session
    /// connection's own close when that came first).
    pub async fn closed(&self, within: Duration) -> quinn::ConnectionError {
        tokio::time::timeout(within, async {
            tokio::select! {
                closed = self.lifeline.closed() => closed,
                closed = self.conn.closed() => closed,
            }
        })
        .await
        .expect("the connection closes in time")
    }
}

/// A recognisable byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}
