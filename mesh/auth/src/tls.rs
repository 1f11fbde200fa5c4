//! TLS 1.3 and QUIC configuration for every Gleam connection.
//!
//! Both sides present a self-signed certificate ([`Identity`]). A client pins the server: the
//! server's SubjectPublicKeyInfo must hash to the [`PeerId`] the client expected (learned from
//! mDNS or given by the user). A server accepts any well-formed certificate and learns the
//! client's id after the handshake ([`remote_peer_id`]); whether that client may do anything is
//! decided by the mesh-secret proof in [`crate::proof`], not by TLS.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{NoInitialCipherSuite, QuicClientConfig, QuicServerConfig};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::identity::{Identity, PeerId};

/// ALPN of mesh traffic: gossip, probes, daemon-to-daemon requests.
pub const ALPN_MESH: &[u8] = b"gleam-mesh/1";
/// ALPN of a CUDA session (a client shim talking to a serving peer).
pub const ALPN_CUDA: &[u8] = b"gleam-cuda/1";

/// The server config of a peer: TLS 1.3 only, client certificate required, both ALPNs accepted
/// ([`ALPN_MESH`], [`ALPN_CUDA`]), transport tuned for a LAN ([`transport_config`]) except for the
/// flow-control credit, which stays at the pre-authentication allowance ([`PREAUTH_WINDOW`] bytes,
/// [`PREAUTH_BIDI_STREAMS`] streams) until the caller calls [`grant_credit`] on a connection that
/// proved it may be served.
pub fn server_config(id: &Identity) -> Result<quinn::ServerConfig, TlsError> {
    let provider = provider();
    let mut tls = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(Arc::new(AnyPeerVerifier {
            algorithms: provider.signature_verification_algorithms,
        }))
        .with_single_cert(vec![id.certificate().clone()], id.private_key())?;
    tls.alpn_protocols = vec![ALPN_MESH.to_vec(), ALPN_CUDA.to_vec()];
    // No session tickets: connections are long-lived, and a resumed session would skip the
    // certificate checks that tie a connection to a PeerId.
    tls.send_tls13_tickets = 0;
    tls.max_early_data_size = 0;
    let quic = QuicServerConfig::try_from(tls)?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(quic));
    config.transport_config(Arc::new(preauth_transport_config()));
    Ok(config)
}

/// Raises an accepted connection's flow-control credit from the pre-authentication allowance to the
/// LAN windows of [`transport_config`]: a connection window of 64 MiB and 1024 streams each way.
///
/// Call it once the peer has proven it may be served (the mesh proof, or a session token), and never
/// before: until then a stranger can make this side buffer only [`PREAUTH_WINDOW`] bytes a connection.
/// The per-stream window is a transport parameter fixed at the handshake; the connection window caps it.
pub fn grant_credit(conn: &quinn::Connection) {
    conn.set_receive_window(quinn::VarInt::from_u32(CONNECTION_WINDOW));
    conn.set_max_concurrent_bi_streams(quinn::VarInt::from_u32(MAX_STREAMS));
    conn.set_max_concurrent_uni_streams(quinn::VarInt::from_u32(MAX_STREAMS));
}

/// The client config for connecting to the peer `expected`, offering ALPN `alpn`.
///
/// The handshake fails unless the server's key hashes to `expected`. Connect with any valid DNS
/// name, conventionally [`server_name`]`(expected)`.
pub fn client_config(
    id: &Identity,
    expected: PeerId,
    alpn: &[u8],
) -> Result<quinn::ClientConfig, TlsError> {
    let provider = provider();
    let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedPeerVerifier {
            expected,
            algorithms: provider.signature_verification_algorithms,
        }))
        .with_client_auth_cert(vec![id.certificate().clone()], id.private_key())?;
    tls.alpn_protocols = vec![alpn.to_vec()];
    tls.resumption = rustls::client::Resumption::disabled();
    tls.enable_early_data = false;
    let quic = QuicClientConfig::try_from(tls)?;
    let mut config = quinn::ClientConfig::new(Arc::new(quic));
    config.transport_config(Arc::new(transport_config()));
    Ok(config)
}

/// The PeerId of the other side of an established connection (from the certificate it
/// presented; both sides always present one).
pub fn remote_peer_id(conn: &quinn::Connection) -> Result<PeerId, TlsError> {
    let identity = conn.peer_identity().ok_or(TlsError::NoPeerCertificate)?;
    let certs = identity
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| TlsError::NoPeerCertificate)?;
    let cert = certs.first().ok_or(TlsError::NoPeerCertificate)?;
    PeerId::from_certificate(cert).map_err(TlsError::PeerCertificate)
}

/// The TLS server name used when connecting to `peer` (`<id>.gleam.invalid`; `.invalid` never
/// resolves). The verifier checks the key, not the name; the name only keeps logs readable.
pub fn server_name(peer: PeerId) -> String {
    format!("{peer}.gleam.invalid")
}

/// The QUIC transport settings for a LAN: failures noticed within seconds, a short first
/// retransmission timeout, and flow-control windows large enough for bulk copies at 10-25 Gbit/s.
pub fn transport_config() -> quinn::TransportConfig {
    let mut transport = quinn::TransportConfig::default();
    // Keep-alive well under the idle timeout, so a live but quiet peer never times out, and a
    // dead one is detected within IDLE_TIMEOUT_MS.
    transport.keep_alive_interval(Some(KEEP_ALIVE));
    transport.max_idle_timeout(Some(quinn::IdleTimeout::from(quinn::VarInt::from_u32(
        IDLE_TIMEOUT_MS,
    ))));
    // LAN round trips are sub-millisecond; quinn's 333 ms default would make the first loss cost
    // a third of a second.
    transport.initial_rtt(Duration::from_millis(10));
    // Per-stream credit below the connection's, so one stalled stream cannot take all of it.
    transport.stream_receive_window(quinn::VarInt::from_u32(STREAM_WINDOW));
    transport.receive_window(quinn::VarInt::from_u32(CONNECTION_WINDOW));
    transport.send_window(u64::from(CONNECTION_WINDOW));
    // One bidi stream per CUDA stream, plus request streams: allow many at once.
    transport.max_concurrent_bidi_streams(quinn::VarInt::from_u32(MAX_STREAMS));
    transport.max_concurrent_uni_streams(quinn::VarInt::from_u32(MAX_STREAMS));
    // Datagrams are not flow-controlled and arrive before any proof: quinn keeps up to this many bytes
    // of them unread (dropping the oldest), instead of its default 1.25 MB. Gossip, their only use,
    // sends a few hundred bytes at a time to a reader that never waits.
    transport.datagram_receive_buffer_size(Some(DATAGRAM_BUFFER));
    // Datagrams as large as the path carries, up to `GLEAM_UDP_PAYLOAD_MAX` (path MTU discovery with
    // black-hole detection, from 1200 bytes; Ethernet's 1452 by default). Loopback is fitted apart
    // (`fit_to_path`).
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(udp_payload_max());
    transport.mtu_discovery_config(Some(mtu));
    congestion_control().apply(&mut transport);
    transport
}

/// [`transport_config`] for a session's bulk connection (uploads' chunks): its own congestion window, under
/// `GLEAM_BULK_CONGESTION` (`delay`, `bbr` or `cubic`) if set, else the controller for a LAN path
/// ([`DEFAULT_BULK_CONGESTION`]); [`bulk_transport_config_to`] fits it to the actual path.
///
/// Why a delay-target controller on a LAN: every other stream's calls wait in the bottleneck's queue
/// behind the upload, and [`crate::delay_target::DelayTarget`] keeps that queue near a target delay.
/// Measured on the GPU machine (H100 host, `GLEAM_BULK_CONGESTION=bbr|delay WORKLOADS="two-streams
/// weights-cold" LINKS="L0 L1" MODES=gleam bash scripts/bench/lan.sh`, emulated 1 Gbit/s 1 ms link with a
/// 1.5 MB drop-tail queue, bbr, delay, bbr, delay in one call): the other stream's p99 synchronisation
/// during a 1 GiB upload 2.5 and 2.5 times its idle value with a 500 µs delay target against 5.7 and 6.0
/// with BBR (Cubic: 13.8-23.0 in earlier calls), with cold 512 MiB uploads at the same rate (146 MiB/s
/// both, 122% of the link with compression); the 100 µs default target: 1.85-1.90x (see
/// [`crate::delay_target::DEFAULT_TARGET`]).
pub fn bulk_transport_config() -> quinn::TransportConfig {
    let mut transport = transport_config();
    bulk_congestion(PathKind::Lan).apply(&mut transport);
    transport
}

/// [`transport_config`] fitted to the path to `remote` ([`fit_to_path`]).
pub fn transport_config_to(remote: SocketAddr) -> quinn::TransportConfig {
    let mut transport = transport_config();
    fit_to_path(&mut transport, remote);
    transport
}

/// [`bulk_transport_config`] fitted to the path to `remote` ([`fit_to_path`]), with the bulk controller
/// for that path ([`bulk_congestion`]).
pub fn bulk_transport_config_to(remote: SocketAddr) -> quinn::TransportConfig {
    let kind = path_kind(remote);
    let mut transport = transport_config();
    bulk_congestion(kind).apply(&mut transport);
    fit_to_path_kind(&mut transport, kind);
    transport
}

/// Where the other end of a connection is.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum PathKind {
    /// This very machine: no link, no queue shared with anyone.
    Loopback,
    /// Another machine (or loopback standing for one: `GLEAM_LOOPBACK_PATH=lan`, as the benchmarks'
    /// link emulator does).
    Lan,
}

/// The kind of path to `remote`: loopback addresses (an IPv4-mapped IPv6 one included) are
/// [`PathKind::Loopback`] unless `GLEAM_LOOPBACK_PATH=lan` says loopback stands for a LAN.
pub fn path_kind(remote: SocketAddr) -> PathKind {
    let lan = std::env::var("GLEAM_LOOPBACK_PATH").is_ok_and(|v| v.trim() == "lan");
    if remote.ip().to_canonical().is_loopback() && !lan {
        PathKind::Loopback
    } else {
        PathKind::Lan
    }
}

/// Fits `transport` to the path to `remote` ([`path_kind`]). On loopback (a peer on this very machine)
/// every datagram carries [`loopback_udp_payload`] bytes from the first packet on, with no discovery:
/// per-datagram work (encryption, headers, system calls, acknowledgements) is what bounds one
/// connection's rate there, and loopback carries far larger datagrams than Ethernet. Measured with
/// `examples/quinn_floor` (one connection, 512 MiB each way, 2-core development machine, two rounds):
/// 1452 bytes 521-649 MiB/s, 4096 bytes 851-1005, 6000 bytes 1235-1511, 6550 bytes 1170-1249. The
/// smallest size is set to the same, since it is where quinn's black-hole detector would fall back to.
/// Elsewhere the LAN settings stay (discovery up to [`udp_payload_max`]).
pub fn fit_to_path(transport: &mut quinn::TransportConfig, remote: SocketAddr) {
    fit_to_path_kind(transport, path_kind(remote));
}

/// [`fit_to_path`] for a path already known to be of `kind`.
fn fit_to_path_kind(transport: &mut quinn::TransportConfig, kind: PathKind) {
    if kind == PathKind::Loopback {
        let size = loopback_udp_payload();
        transport
            .min_mtu(size)
            .initial_mtu(size)
            .mtu_discovery_config(None);
    }
}

/// The UDP payload of every datagram on loopback: `GLEAM_LOOPBACK_UDP_PAYLOAD` (1200-6550, see
/// [`GSO_UDP_PAYLOAD_MAX`]), else [`LOOPBACK_UDP_PAYLOAD`].
pub fn loopback_udp_payload() -> u16 {
    udp_payload_from_env("GLEAM_LOOPBACK_UDP_PAYLOAD", LOOPBACK_UDP_PAYLOAD)
}

/// Accepts `incoming` under `config` (a [`server_config`]), fitted to the path it came by
/// ([`fit_to_path`]): a connection from this machine gets loopback datagrams.
pub fn accept(
    incoming: quinn::Incoming,
    config: &quinn::ServerConfig,
) -> Result<quinn::Connecting, quinn::ConnectionError> {
    let kind = path_kind(incoming.remote_address());
    if kind == PathKind::Lan {
        return incoming.accept();
    }
    let mut fitted = config.clone();
    let mut transport = preauth_transport_config();
    fit_to_path_kind(&mut transport, kind);
    fitted.transport_config(Arc::new(transport));
    incoming.accept_with(Arc::new(fitted))
}

/// The bulk connection's congestion controller on a path of `kind`: `GLEAM_BULK_CONGESTION` if set; else
/// [`DEFAULT_BULK_CONGESTION`] on a LAN, and Cubic on loopback, where no link queue is shared with
/// anything and the round trip measures the receiving process's scheduling. Cold 256 MiB uploads on the
/// H100 host's loopback (`GLEAM_BULK_CONGESTION=$cc LINKS=loopback bash cache/bench/upload.sh .carry 256 2
/// cuda` for bbr, cubic, delay, twice over in one call): 604-668 MiB/s with Cubic, 516-543 with BBR,
/// 483-668 with the delay target. (An earlier call, before the session process owned its connections, had BBR ahead of
/// the delay target, 850-866 against 729-750.)
fn bulk_congestion(kind: PathKind) -> CongestionControl {
    let default = match kind {
        PathKind::Lan => DEFAULT_BULK_CONGESTION,
        PathKind::Loopback => CongestionControl::Cubic,
    };
    congestion_from_env("GLEAM_BULK_CONGESTION", default)
}

/// Which congestion controller QUIC connections use.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum CongestionControl {
    /// Loss-based (quinn's default): fills the bottleneck's queue before it backs off.
    Cubic,
    /// Model-based: paces at the measured bottleneck rate, keeping the queue (and so the delay a bulk
    /// transfer adds to every other packet on the link) small, and shrugging off random loss.
    Bbr,
    /// Delay-based ([`crate::delay_target::DelayTarget`]): keeps the bottleneck queue it builds near a
    /// target delay (`GLEAM_BULK_QUEUE_TARGET_US`).
    DelayTarget,
}

impl CongestionControl {
    /// Makes `transport`'s connections use this controller.
    pub fn apply(self, transport: &mut quinn::TransportConfig) {
        match self {
            Self::Cubic => transport.congestion_controller_factory(Arc::new({
                let mut cubic = quinn::congestion::CubicConfig::default();
                cubic.initial_window(INITIAL_WINDOW);
                cubic
            })),
            Self::Bbr => transport
                .congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default())),
            Self::DelayTarget => transport.congestion_controller_factory(Arc::new(
                crate::delay_target::DelayTargetConfig::default(),
            )),
        };
    }
}

/// The congestion controller: `GLEAM_CONGESTION=cubic|bbr`, else [`DEFAULT_CONGESTION`].
pub fn congestion_control() -> CongestionControl {
    congestion_from_env("GLEAM_CONGESTION", DEFAULT_CONGESTION)
}

/// The controller the environment variable `name` names (`cubic`, `bbr` or `delay`), else `default`.
fn congestion_from_env(name: &str, default: CongestionControl) -> CongestionControl {
    match std::env::var(name).ok().as_deref().map(str::trim) {
        Some("cubic") => CongestionControl::Cubic,
        Some("bbr") => CongestionControl::Bbr,
        Some("delay") => CongestionControl::DelayTarget,
        _ => default,
    }
}

/// [`server_config`] for a session process's endpoint, whose connections send the session's replies:
/// on a LAN under the bulk connection's controller ([`DEFAULT_BULK_CONGESTION`], or
/// `GLEAM_BULK_CONGESTION`), since large downloads come back over the bulk connection and must keep the
/// link's queue short for every other stream's calls, as uploads do (the session connection's replies
/// are small, and never fill a window). A loopback client is fitted apart by [`accept`] (the loss-based
/// controller: no link queue there).
pub fn session_server_config(id: &Identity) -> Result<quinn::ServerConfig, TlsError> {
    let mut config = server_config(id)?;
    let mut transport = preauth_transport_config();
    bulk_congestion(PathKind::Lan).apply(&mut transport);
    config.transport_config(Arc::new(transport));
    Ok(config)
}

/// The congestion controller unless `GLEAM_CONGESTION` says otherwise.
pub const DEFAULT_CONGESTION: CongestionControl = CongestionControl::Cubic;

/// The initial congestion window of the loss-based controller and of the delay target
/// ([`crate::delay_target`]), in bytes: 128 KiB, a LAN's bandwidth-delay product (1 Gbit/s x 1 ms),
/// where quinn's default is ten datagrams (14.7 kB). A reply direction that only ever carried small
/// answers never grows its window (it is application-limited), so a device-to-host copy after it starts
/// from this window: a 1 MiB read-back took six round trips of slow start from the default. quinn paces
/// the window over the round trip, so it leaves as a paced burst, not at once.
pub const INITIAL_WINDOW: u64 = 128 << 10;

/// The bulk connection's congestion controller on a LAN unless `GLEAM_BULK_CONGESTION` says otherwise (see
/// [`bulk_transport_config`] for why).
pub const DEFAULT_BULK_CONGESTION: CongestionControl = CongestionControl::DelayTarget;

/// [`transport_config`] with the credit a connection gets before it authenticated: a peer that has
/// not proven anything can open [`PREAUTH_BIDI_STREAMS`] bidirectional streams (the proof's, or the
/// session attach's) and no unidirectional one, and have at most [`PREAUTH_WINDOW`] bytes of stream
/// data buffered here, whatever it sends and however many connections it opens. [`grant_credit`]
/// raises both on a connection, and quinn announces the new limits to the peer at once.
fn preauth_transport_config() -> quinn::TransportConfig {
    let mut transport = transport_config();
    transport.receive_window(quinn::VarInt::from_u32(PREAUTH_WINDOW));
    transport.max_concurrent_bidi_streams(quinn::VarInt::from_u32(PREAUTH_BIDI_STREAMS));
    transport.max_concurrent_uni_streams(quinn::VarInt::from_u32(0));
    transport
}

/// The largest UDP payload QUIC may use: `GLEAM_UDP_PAYLOAD_MAX` (1200-6550, see
/// [`GSO_UDP_PAYLOAD_MAX`]; for jumbo-frame LANs), else 1452 (Ethernet). Path MTU discovery finds what
/// the path carries below it.
pub fn udp_payload_max() -> u16 {
    udp_payload_from_env("GLEAM_UDP_PAYLOAD_MAX", ETHERNET_UDP_PAYLOAD)
}

/// A datagram payload size from the environment variable `name`, held to 1200-[`GSO_UDP_PAYLOAD_MAX`];
/// `default` when it is unset or not a number.
fn udp_payload_from_env(name: &str, default: u16) -> u16 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse::<u16>().ok())
        .map_or(default, |v| v.clamp(1200, GSO_UDP_PAYLOAD_MAX))
}

/// A QUIC endpoint on `addr` (a server when `server` is given) whose UDP socket has large kernel
/// buffers (see [`bind_udp`]).
pub fn endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> std::io::Result<quinn::Endpoint> {
    let socket = bind_udp(addr)?;
    let mut config = quinn::EndpointConfig::default();
    config
        // What this endpoint receives: loopback's datagrams too (see `fit_to_path`).
        .max_udp_payload_size(udp_payload_max().max(loopback_udp_payload()))
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    quinn::Endpoint::new(config, server, socket, Arc::new(quinn::TokioRuntime))
}

/// Binds a UDP socket for QUIC and asks for [`UDP_BUFFER`] bytes of kernel buffer each way.
///
/// With the default (about 200 KiB) a bulk copy overflows the receive buffer as soon as the receiving
/// thread is late by a fraction of a millisecond: the kernel drops datagrams, and every loss halves
/// the congestion window. The forced variant (root or `CAP_NET_ADMIN`) passes `net.core.rmem_max`;
/// otherwise the kernel caps the request at that limit. Failure only costs speed.
pub fn bind_udp(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    let socket = std::net::UdpSocket::bind(addr)?;
    for (forced, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        if set_socket_int(&socket, forced, UDP_BUFFER).is_err()
            && let Err(err) = set_socket_int(&socket, plain, UDP_BUFFER)
        {
            tracing::debug!(error = %err, "cannot grow the UDP socket buffer");
        }
    }
    Ok(socket)
}

fn set_socket_int(
    socket: &std::net::UdpSocket,
    option: libc::c_int,
    value: libc::c_int,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a socket we own, an int option, a pointer to an int that lives across the call.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Configuring TLS or reading the peer's identity failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// The rustls config could not be built (e.g. the key does not match the certificate).
    #[error("TLS configuration")]
    Config(#[from] rustls::Error),
    /// The crypto provider offers no cipher suite QUIC can use for its initial packets.
    #[error("TLS configuration")]
    NoInitialCipherSuite(#[from] NoInitialCipherSuite),
    /// The connection has no peer certificate (not a Gleam connection, or not yet established).
    #[error("the connection carries no peer certificate")]
    NoPeerCertificate,
    /// The peer's certificate did not parse.
    #[error("the peer's certificate does not parse")]
    PeerCertificate(#[source] rustls::Error),
}

/// The server's key does not match the id the client expected.
#[derive(Debug, thiserror::Error)]
#[error("peer id mismatch: expected {expected}, the server's key is {actual}")]
pub struct PeerIdMismatch {
    /// The id the client wanted to reach.
    pub expected: PeerId,
    /// The id of the key the server presented.
    pub actual: PeerId,
}

/// The handshake-signature methods both verifiers share: TLS 1.3 only, checked with the
/// verifier's `algorithms`.
macro_rules! tls13_signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            _message: &[u8],
            _cert: &CertificateDer<'_>,
            _dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            // Unreachable: the configs only allow TLS 1.3.
            Err(rustls::PeerIncompatible::Tls13RequiredForQuic.into())
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.algorithms.supported_schemes()
        }
    };
}

/// Client side: accept the server's certificate only if its key hashes to `expected`.
#[derive(Debug)]
struct PinnedPeerVerifier {
    expected: PeerId,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PinnedPeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if !intermediates.is_empty() {
            return Err(rustls::CertificateError::UnknownIssuer.into());
        }
        let actual = PeerId::from_certificate(end_entity)?;
        if actual != self.expected {
            let mismatch = PeerIdMismatch {
                expected: self.expected,
                actual,
            };
            tracing::warn!(%mismatch, "refusing server");
            return Err(
                rustls::CertificateError::Other(rustls::OtherError(Arc::new(mismatch))).into(),
            );
        }
        Ok(ServerCertVerified::assertion())
    }

    tls13_signatures!();
}

/// Server side: require a client certificate, accept any well-formed one (the handshake proves
/// the client holds its key); membership is checked afterwards by [`crate::proof`].
#[derive(Debug)]
struct AnyPeerVerifier {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ClientCertVerifier for AnyPeerVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        if !intermediates.is_empty() {
            return Err(rustls::CertificateError::UnknownIssuer.into());
        }
        PeerId::from_certificate(end_entity)?;
        Ok(ClientCertVerified::assertion())
    }

    tls13_signatures!();
}

/// The crypto provider is chosen explicitly, so the process-wide default (which other crates in
/// the same process may set differently) does not matter.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

const CONNECTION_WINDOW: u32 = 64 * 1024 * 1024;
/// Unread datagram bytes a connection keeps (see [`transport_config`]): above the largest UDP payload
/// (quinn closes a connection that receives a datagram larger than this buffer).
const DATAGRAM_BUFFER: usize = 128 * 1024;
/// Connection receive window before authentication: room for the 32-byte proof or a session's
/// attach frame (and a first request behind it), nothing more (issue 11: with the full windows, ten
/// unauthenticated connections pushing data took a server from 100 MB to 710 MB).
pub const PREAUTH_WINDOW: u32 = 4 * 1024;
/// Bidirectional streams a peer may open before authentication: the proof's or the attach's, and one
/// the client may open early (it waits for more credit otherwise, it does not fail).
pub const PREAUTH_BIDI_STREAMS: u32 = 2;
/// Kernel buffer asked for each QUIC UDP socket, each way (see [`bind_udp`]).
const UDP_BUFFER: libc::c_int = 8 << 20;
/// A connection that hears nothing from its peer for this long is lost (sessions count their grace
/// window from the last time they heard from the other side, so they need it).
pub const IDLE_TIMEOUT_MS: u32 = 5_000;
const KEEP_ALIVE: Duration = Duration::from_secs(1);
const MAX_STREAMS: u32 = 1024;
/// The largest datagram payload quinn can send: it hands the kernel up to 10 datagrams in one
/// segmentation-offload (GSO) send, which the kernel refuses above 65,535 bytes in all (IPv4 and UDP
/// headers included). Larger datagrams are lost whenever they go out in such a batch, and path MTU
/// discovery then falls back to 1200 bytes for good (measured on loopback: a 9000-byte ceiling ended at
/// 1200 after 5,868 datagrams for 8 MiB; 6550 stayed at 6550, 1,310 datagrams).
pub const GSO_UDP_PAYLOAD_MAX: u16 = 6550;
/// A 1500-byte Ethernet MTU less IPv6 and UDP headers.
const ETHERNET_UDP_PAYLOAD: u16 = 1452;
/// Every datagram's payload on loopback (see [`fit_to_path`] for the measurements).
pub const LOOPBACK_UDP_PAYLOAD: u16 = 6000;
const STREAM_WINDOW: u32 = 16 * 1024 * 1024;
