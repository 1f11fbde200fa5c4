//! Setup shared by the tests that run a real QUIC connection between two of Gleam's endpoints on
//! loopback: two identities, the server's endpoint, and a server task that reads one stream.

use std::net::SocketAddr;

use gleam_auth::identity::Identity;
use gleam_auth::tls;
use tempfile::TempDir;

/// A server's and a client's identity, each in its own temporary folder (removed with this).
pub struct Peers {
    pub server_id: Identity,
    pub client_id: Identity,
    _dirs: (TempDir, TempDir),
}

impl Peers {
    /// Two fresh identities.
    pub fn new() -> Self {
        let dirs = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        Peers {
            server_id: Identity::load_or_create(dirs.0.path()).unwrap(),
            client_id: Identity::load_or_create(dirs.1.path()).unwrap(),
            _dirs: dirs,
        }
    }

    /// The server's endpoint under `config` on a free loopback port, and its address.
    pub fn server_endpoint(&self, config: quinn::ServerConfig) -> (quinn::Endpoint, SocketAddr) {
        let server = tls::endpoint(SocketAddr::from(([127, 0, 0, 1], 0)), Some(config)).unwrap();
        let addr = server.local_addr().unwrap();
        (server, addr)
    }

    /// The client's config for a CUDA session with the server.
    pub fn client_config(&self) -> quinn::ClientConfig {
        tls::client_config(&self.client_id, self.server_id.peer_id(), tls::ALPN_CUDA).unwrap()
    }
}

/// A task that accepts one connection on `server` under the server's own config, grants it credit
/// (no proof here: the credit a proof would have granted), and reads its first unidirectional stream
/// to the end.
pub fn accept_one_stream(server: quinn::Endpoint) -> tokio::task::JoinHandle<Vec<u8>> {
    tokio::spawn(async move {
        let conn = server.accept().await.unwrap().await.unwrap();
        tls::grant_credit(&conn);
        let mut recv = conn.accept_uni().await.unwrap();
        recv.read_to_end(usize::MAX).await.unwrap()
    })
}
