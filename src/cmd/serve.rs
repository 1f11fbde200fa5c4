//! `gleam serve ADDR`: serve CUDA sessions on one address, without discovery.
//!
//! Security is always on: the device's identity (TLS) and the mesh secret (membership proof) are required,
//! and are created on first use. Each authenticated connection gets its own `gleam session` process
//! ([`gleam_host::serve_connection`]).

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use gleam_auth::identity::{Identity, MeshSecret, MeshSecretError};
use gleam_auth::tls::ALPN_CUDA;
use gleam_host::SessionCommand;
use gleam_ratelimit::RateLimit;

use super::backend::Backend;
use quinn::VarInt;
use tracing::{debug, info, warn};

/// Close code: the client asked for a protocol `gleam serve` does not speak (e.g. mesh gossip).
const CLOSE_WRONG_ALPN: VarInt = VarInt::from_u32(0x4743_0010);
/// Refused connections are logged a few a minute (anyone who can reach the port can cause one); the rest
/// are counted in the next one logged.
static REFUSALS: RateLimit = RateLimit::new(20, std::time::Duration::from_secs(60));

/// Example: `gleam serve 0.0.0.0:7447 --backend auto`. Clients connect with `GLEAM_PEER=<peer-id>@<addr>`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Address to listen on (UDP), e.g. `0.0.0.0:7447`; port 0 picks a free one.
    pub addr: String,
    /// What executes sessions: `auto` (a GPU if one answers, else `emu`), `cuda` or `emu`.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    pub backend: Backend,
    /// How long a CUDA session outlives a silent network link, in seconds, counted from the last time its
    /// client was heard: a client that reconnects within it resumes the session with its GPU state.
    #[arg(long, env = "GLEAM_SESSION_GRACE", value_name = "SECS", value_parser = super::parse_grace)]
    pub session_grace: Option<f64>,
    #[command(flatten)]
    pub config: super::ConfigDir,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config_dir = args.config.path()?;
    let identity = Identity::load_or_create(&config_dir).with_context(|| {
        format!(
            "loading this device's identity from {}",
            config_dir.display()
        )
    })?;
    let secret = load_or_create_secret(&config_dir)?;
    let addr = resolve(&args.addr)?;

    let choice = args.backend.resolve()?;
    let mut worker = choice.session_command(&config_dir)?;
    super::pass_grace(&mut worker, args.session_grace);

    // Two threads: measured on the H200 box, a current-thread runtime gave the same round trips.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(serve(addr, identity, secret, worker, choice))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(
    addr: SocketAddr,
    identity: Identity,
    secret: MeshSecret,
    worker: SessionCommand,
    choice: Backend,
) -> anyhow::Result<()> {
    let config = gleam_auth::tls::server_config(&identity).context("configuring TLS")?;
    let endpoint = gleam_auth::tls::endpoint(addr, Some(config))
        .with_context(|| format!("listening on {addr}"))?;
    let local = endpoint.local_addr().context("reading the bound address")?;
    let me = identity.peer_id();
    // The one stdout line: tests and scripts parse it.
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "gleam serve: listening on {local} as {me}")?;
        out.flush()?;
    }
    info!(%local, peer_id = %me, backend = choice.as_str(), "serving CUDA sessions");

    let secret = Arc::new(secret);
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    loop {
        tokio::select! {
            incoming = endpoint.accept() => {
                let Some(incoming) = incoming else { break };
                tokio::spawn(accept(incoming, secret.clone(), worker.clone()));
            }
            _ = tokio::signal::ctrl_c() => {
                info!("interrupted: closing every session");
                endpoint.close(VarInt::from_u32(0), b"server shutting down");
                break;
            }
            _ = terminate.recv() => {
                info!("terminated: closing every session");
                endpoint.close(VarInt::from_u32(0), b"server shutting down");
                break;
            }
        }
    }
    endpoint.wait_idle().await;
    Ok(())
}

/// One connection: handshake, ALPN check, mesh authentication, then its session.
async fn accept(incoming: quinn::Incoming, secret: Arc<MeshSecret>, worker: SessionCommand) {
    let remote = incoming.remote_address();
    let conn = match incoming.await {
        Ok(conn) => conn,
        Err(err) => {
            debug!(%remote, error = %err, "handshake failed");
            return;
        }
    };
    let alpn = conn
        .handshake_data()
        .and_then(|data| data.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|data| data.protocol);
    if alpn.as_deref() != Some(ALPN_CUDA) {
        if let Some(suppressed) = REFUSALS.admit() {
            warn!(%remote, suppressed, "connection for another protocol than CUDA sessions: closing");
        }
        conn.close(
            CLOSE_WRONG_ALPN,
            b"`gleam serve` only serves CUDA sessions (ALPN gleam-cuda/1)",
        );
        return;
    }
    let peer = match gleam_auth::proof::authenticate_as_server(&conn, &secret).await {
        Ok(peer) => peer,
        Err(err) => {
            if let Some(suppressed) = REFUSALS.admit() {
                warn!(%remote, error = %err, suppressed, "client refused");
            }
            return;
        }
    };
    gleam_host::serve_connection(conn, peer, worker).await;
}

/// The mesh secret of this device, or a new one if it has none (there is no mode without one).
fn load_or_create_secret(config_dir: &Path) -> anyhow::Result<MeshSecret> {
    match MeshSecret::load(config_dir) {
        Ok(secret) => Ok(secret),
        Err(MeshSecretError::Missing { .. }) => {
            let secret = MeshSecret::generate();
            secret
                .store(config_dir)
                .context("storing the new mesh secret")?;
            eprintln!(
                "gleam serve: no mesh yet: created one; join other devices with `gleam mesh join {}`",
                secret.join_code()
            );
            Ok(secret)
        }
        Err(err) => Err(err).context("loading the mesh secret"),
    }
}

fn resolve(addr: &str) -> anyhow::Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("bad listen address {addr:?} (expected HOST:PORT)"))?
        .next()
        .with_context(|| format!("{addr:?} resolves to no address"))
}
