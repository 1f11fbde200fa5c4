//! Mesh membership proof, run right after the TLS handshake.
//!
//! TLS proves who a peer is ([`PeerId`]); this proves it belongs to our mesh. The client opens the
//! connection's first bidirectional stream and sends
//! `blake3::keyed_hash(secret, "gleam-auth-v1" || "client" || exporter)`, where `exporter` is 32
//! bytes of keying material exported from this TLS session (label [`EXPORTER_LABEL`]). The server
//! checks it and only then answers with the same hash over role `"server"`. The proof is bound to
//! the session, so it cannot be replayed on another connection, and the secret never travels.
//!
//! A side that sees a wrong proof closes the connection with [`CLOSE_AUTH_FAILED`] and a reason
//! the other side reports as [`AuthError::Refused`]. Callers must not accept other streams on a
//! connection before authentication succeeded. Until it succeeds, the server grants the client only a
//! few KiB of flow-control credit and two streams ([`crate::tls::server_config`]).

use std::time::Duration;

use quinn::{ConnectionError, VarInt};
use tracing::debug;

use crate::identity::{MeshSecret, PeerId};
use crate::tls::{TlsError, remote_peer_id};

/// QUIC application close code for "authentication failed" (the reason text says why).
pub const CLOSE_AUTH_FAILED: VarInt = VarInt::from_u32(0x4741_0001);
/// The TLS exporter label the proof is bound to.
pub const EXPORTER_LABEL: &[u8] = b"gleam/1 mesh auth";
/// How long either side waits for the other's proof.
pub const AUTH_TIMEOUT: Duration = Duration::from_secs(5);

/// Proves membership to the server of `conn` and checks its proof. Returns the server's id.
pub async fn authenticate_as_client(
    conn: &quinn::Connection,
    secret: &MeshSecret,
) -> Result<PeerId, AuthError> {
    let peer = remote_peer_id(conn)?;
    let result = tokio::time::timeout(AUTH_TIMEOUT, client_exchange(conn, secret, peer)).await;
    finish(conn, peer, result)
}

/// Checks the membership proof of the client of `conn` and proves ours. Returns the client's id.
///
/// A client that proved membership gets the connection's full flow-control credit
/// ([`crate::tls::grant_credit`]); until then it had the pre-authentication allowance of
/// [`crate::tls::server_config`].
pub async fn authenticate_as_server(
    conn: &quinn::Connection,
    secret: &MeshSecret,
) -> Result<PeerId, AuthError> {
    let peer = remote_peer_id(conn)?;
    let result = tokio::time::timeout(AUTH_TIMEOUT, server_exchange(conn, secret, peer)).await;
    finish(conn, peer, result)
}

/// Membership could not be established; the connection is closed (or was closed by the peer).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The connection failed for a reason other than authentication.
    #[error("connection lost during authentication")]
    ConnectionLost(#[source] ConnectionError),
    /// TLS keying material could not be exported (the handshake is not complete).
    #[error("cannot export TLS keying material")]
    Exporter,
    /// The peer broke the protocol (e.g. ended the stream before its proof).
    #[error("peer {peer} broke the authentication protocol: {what}")]
    Protocol { peer: PeerId, what: &'static str },
    /// The peer closed the connection because our proof did not check: we are not in its mesh.
    #[error("peer {peer} refused us: {reason}")]
    Refused { peer: PeerId, reason: String },
    /// The peer's proof did not check: it does not hold our mesh secret.
    #[error(
        "peer {peer} is not in this mesh (its mesh-secret proof is wrong); \
         run `gleam mesh join CODE` there with this mesh's code"
    )]
    SecretMismatch { peer: PeerId },
    /// The peer's id could not be read from the connection.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The peer did not complete its part within [`AUTH_TIMEOUT`].
    #[error("peer {peer} did not authenticate within {AUTH_TIMEOUT:?}")]
    TimedOut { peer: PeerId },
}

async fn client_exchange(
    conn: &quinn::Connection,
    secret: &MeshSecret,
    peer: PeerId,
) -> Result<(), AuthError> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|err| lost(err, peer))?;
    let ours = proof(conn, secret, Role::Client)?;
    send.write_all(ours.as_bytes())
        .await
        .map_err(|err| write_error(err, peer))?;
    let theirs = read_proof(&mut recv, peer).await?;
    // `blake3::Hash` compares in constant time.
    if theirs != proof(conn, secret, Role::Server)? {
        return Err(AuthError::SecretMismatch { peer });
    }
    // Nothing more will be sent on this stream; an already-closed stream is fine.
    let _ = send.finish();
    Ok(())
}

async fn server_exchange(
    conn: &quinn::Connection,
    secret: &MeshSecret,
    peer: PeerId,
) -> Result<(), AuthError> {
    let (mut send, mut recv) = conn.accept_bi().await.map_err(|err| lost(err, peer))?;
    let theirs = read_proof(&mut recv, peer).await?;
    if theirs != proof(conn, secret, Role::Client)? {
        return Err(AuthError::SecretMismatch { peer });
    }
    // A member: full flow-control credit, announced before our proof so that the client, which
    // starts its work when the proof arrives, finds it there.
    crate::tls::grant_credit(conn);
    // Only a proven member learns our proof.
    let ours = proof(conn, secret, Role::Server)?;
    send.write_all(ours.as_bytes())
        .await
        .map_err(|err| write_error(err, peer))?;
    let _ = send.finish();
    Ok(())
}

/// Turns the exchange's outcome into the result, closing the connection on failure with a reason
/// the peer can show.
fn finish(
    conn: &quinn::Connection,
    peer: PeerId,
    result: Result<Result<(), AuthError>, tokio::time::error::Elapsed>,
) -> Result<PeerId, AuthError> {
    let err = match result {
        Ok(Ok(())) => {
            debug!(%peer, remote = %conn.remote_address(), "peer authenticated");
            return Ok(peer);
        }
        Ok(Err(err)) => err,
        Err(_) => AuthError::TimedOut { peer },
    };
    let reason: &[u8] = match &err {
        AuthError::SecretMismatch { .. } => b"mesh secret mismatch: not in this mesh",
        AuthError::TimedOut { .. } => b"authentication timed out",
        AuthError::Protocol { .. } => b"authentication protocol error",
        AuthError::Exporter => b"authentication failed",
        // Already closed by the peer or the network, or refused by it: nothing to tell.
        _ => return Err(err),
    };
    // The caller decides how loudly to report it (a device of another mesh retries forever).
    debug!(%peer, remote = %conn.remote_address(), error = %err, "refusing peer");
    conn.close(CLOSE_AUTH_FAILED, reason);
    Err(err)
}

#[derive(Clone, Copy)]
enum Role {
    Client,
    Server,
}

fn proof(
    conn: &quinn::Connection,
    secret: &MeshSecret,
    role: Role,
) -> Result<blake3::Hash, AuthError> {
    let mut exporter = [0; 32];
    conn.export_keying_material(&mut exporter, EXPORTER_LABEL, b"")
        .map_err(|_| AuthError::Exporter)?;
    let mut hasher = blake3::Hasher::new_keyed(secret.key());
    hasher.update(DOMAIN);
    hasher.update(match role {
        Role::Client => b"client",
        Role::Server => b"server",
    });
    hasher.update(&exporter);
    Ok(hasher.finalize())
}

async fn read_proof(recv: &mut quinn::RecvStream, peer: PeerId) -> Result<blake3::Hash, AuthError> {
    let mut buf = [0; 32];
    match recv.read_exact(&mut buf).await {
        Ok(()) => Ok(blake3::Hash::from_bytes(buf)),
        Err(quinn::ReadExactError::FinishedEarly(_)) => Err(AuthError::Protocol {
            peer,
            what: "stream ended before the proof",
        }),
        Err(quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(err))) => {
            Err(lost(err, peer))
        }
        Err(quinn::ReadExactError::ReadError(_)) => Err(AuthError::Protocol {
            peer,
            what: "proof stream reset",
        }),
    }
}

fn write_error(err: quinn::WriteError, peer: PeerId) -> AuthError {
    match err {
        quinn::WriteError::ConnectionLost(err) => lost(err, peer),
        _ => AuthError::Protocol {
            peer,
            what: "proof stream stopped",
        },
    }
}

/// A lost connection, recognising the peer's "authentication failed" close.
fn lost(err: ConnectionError, peer: PeerId) -> AuthError {
    match err {
        ConnectionError::ApplicationClosed(close) if close.error_code == CLOSE_AUTH_FAILED => {
            AuthError::Refused {
                peer,
                reason: String::from_utf8_lossy(&close.reason).into_owned(),
            }
        }
        err => AuthError::ConnectionLost(err),
    }
}

const DOMAIN: &[u8] = b"gleam-auth-v1";

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::identity::Identity;
    use crate::tls::{ALPN_CUDA, ALPN_MESH, client_config, server_config, server_name};

    struct Pair {
        server: quinn::Endpoint,
        server_id: Identity,
        client: quinn::Endpoint,
        client_id: Identity,
    }

    impl Pair {
        fn new() -> Self {
            let server_id = Identity::ephemeral().unwrap();
            let client_id = Identity::ephemeral().unwrap();
            let server = quinn::Endpoint::server(
                server_config(&server_id).unwrap(),
                SocketAddr::from(([127, 0, 0, 1], 0)),
            )
            .unwrap();
            let client = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
            Self {
                server,
                server_id,
                client,
                client_id,
            }
        }

        /// Connects expecting `expected`; returns (client side, server side) results.
        async fn connect(
            &self,
            expected: PeerId,
            alpn: &[u8],
        ) -> (
            Result<quinn::Connection, ConnectionError>,
            Result<quinn::Connection, ConnectionError>,
        ) {
            let config = client_config(&self.client_id, expected, alpn).unwrap();
            let addr = self.server.local_addr().unwrap();
            let connecting = self
                .client
                .connect_with(config, addr, &server_name(expected))
                .unwrap();
            let accept = async {
                let incoming = self.server.accept().await.expect("endpoint open");
                incoming.await
            };
            tokio::join!(connecting, accept)
        }
    }

    fn alpn_of(conn: &quinn::Connection) -> Vec<u8> {
        let data = conn.handshake_data().unwrap();
        let data = data
            .downcast::<quinn::crypto::rustls::HandshakeData>()
            .unwrap();
        data.protocol.unwrap()
    }

    #[tokio::test]
    async fn matching_secrets_authenticate_both_sides_on_both_alpns() {
        let pair = Pair::new();
        let secret = MeshSecret::generate();
        for alpn in [ALPN_MESH, ALPN_CUDA] {
            let (client, server) = pair.connect(pair.server_id.peer_id(), alpn).await;
            let (client, server) = (client.unwrap(), server.unwrap());
            assert_eq!(alpn_of(&client), alpn);
            assert_eq!(alpn_of(&server), alpn);
            assert_eq!(remote_peer_id(&client).unwrap(), pair.server_id.peer_id());
            assert_eq!(remote_peer_id(&server).unwrap(), pair.client_id.peer_id());

            let (c, s) = tokio::join!(
                authenticate_as_client(&client, &secret),
                authenticate_as_server(&server, &secret),
            );
            assert_eq!(c.unwrap(), pair.server_id.peer_id());
            assert_eq!(s.unwrap(), pair.client_id.peer_id());

            // The connection stays usable after authentication.
            let (mut send, mut recv) = client.open_bi().await.unwrap();
            send.write_all(b"ping").await.unwrap();
            send.finish().unwrap();
            let (mut s_send, mut s_recv) = server.accept_bi().await.unwrap();
            assert_eq!(s_recv.read_to_end(16).await.unwrap(), b"ping");
            s_send.write_all(b"pong").await.unwrap();
            s_send.finish().unwrap();
            assert_eq!(recv.read_to_end(16).await.unwrap(), b"pong");
        }
    }

    #[tokio::test]
    async fn wrong_secret_fails_on_both_sides() {
        let pair = Pair::new();
        let (client, server) = pair.connect(pair.server_id.peer_id(), ALPN_CUDA).await;
        let (client, server) = (client.unwrap(), server.unwrap());
        let (ours, theirs) = (MeshSecret::generate(), MeshSecret::generate());
        let (c, s) = tokio::join!(
            authenticate_as_client(&client, &ours),
            authenticate_as_server(&server, &theirs),
        );
        match s.unwrap_err() {
            AuthError::SecretMismatch { peer } => assert_eq!(peer, pair.client_id.peer_id()),
            other => panic!("server: {other}"),
        }
        match c.unwrap_err() {
            AuthError::Refused { peer, reason } => {
                assert_eq!(peer, pair.server_id.peer_id());
                assert!(reason.contains("mesh secret"), "{reason}");
            }
            other => panic!("client: {other}"),
        }
        // Both ends see the connection closed with the auth-failed code.
        match client.closed().await {
            ConnectionError::ApplicationClosed(close) => {
                assert_eq!(close.error_code, CLOSE_AUTH_FAILED);
            }
            other => panic!("{other}"),
        }
    }

    #[tokio::test]
    async fn wrong_expected_peer_id_fails_the_handshake() {
        let pair = Pair::new();
        let impostor = Identity::ephemeral().unwrap().peer_id();
        let (client, server) = pair.connect(impostor, ALPN_MESH).await;
        let err = client.unwrap_err();
        assert!(err.to_string().contains("PeerIdMismatch"), "{err}");
        assert!(
            server.is_err(),
            "the server must not get an established connection"
        );
    }

    #[tokio::test]
    async fn unknown_alpn_is_refused() {
        let pair = Pair::new();
        let (client, server) = pair.connect(pair.server_id.peer_id(), b"http/1.1").await;
        assert!(client.is_err());
        assert!(server.is_err());
    }

    #[tokio::test]
    async fn silent_client_times_out() {
        let pair = Pair::new();
        let (client, server) = pair.connect(pair.server_id.peer_id(), ALPN_MESH).await;
        let (client, server) = (client.unwrap(), server.unwrap());
        let started = std::time::Instant::now();
        let err = authenticate_as_server(&server, &MeshSecret::generate())
            .await
            .unwrap_err();
        assert!(matches!(err, AuthError::TimedOut { .. }), "{err}");
        assert!(started.elapsed() >= AUTH_TIMEOUT);
        match client.closed().await {
            ConnectionError::ApplicationClosed(close) => {
                assert_eq!(&close.reason[..], b"authentication timed out");
            }
            other => panic!("{other}"),
        }
    }
}
