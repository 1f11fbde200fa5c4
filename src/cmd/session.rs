//! `gleam session --backend cuda|emu --client ID --bind ADDR` (hidden): one client's session, in its own
//! process.
//!
//! Started by `gleam serve`/`gleam peer` for each authenticated client (see [`gleam_host`]): it listens on
//! an endpoint of its own, prints `<port> <token>` on stdout for its parent to pass on, admits only that
//! client, and serves its CUDA calls ([`gleam_host::process`]). Logs go to stderr; the exit code says how
//! the session ended, and the parent turns it into the reason it gives the client.

use std::io::Write;
use std::net::IpAddr;
use std::process::ExitCode;

use anyhow::Context;
use gleam_auth::identity::{Identity, PeerId};
use gleam_host::process::{self, ATTACH_TIMEOUT, EXIT_BACKEND, Options};
use gleam_real::RealBackend;
use std::time::Duration;
use tracing::error;

use super::backend::Backend;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// What executes the session.
    #[arg(long, value_enum)]
    pub backend: Backend,
    /// The only peer this session admits (already authenticated by the parent).
    #[arg(long)]
    pub client: PeerId,
    /// The address to listen on (`0.0.0.0` or `::`).
    #[arg(long)]
    pub bind: IpAddr,
    /// How long the session outlives a silent link, in seconds (default: `GLEAM_SESSION_GRACE`, else 15).
    #[arg(long, value_name = "SECS", value_parser = super::parse_grace)]
    pub grace: Option<f64>,
    #[command(flatten)]
    pub config: super::ConfigDir,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config_dir = args.config.path()?;
    // Module images clients sent are kept in the serving device's content cache.
    gleam_server::session::use_content_cache(config_dir.join("cache"));
    let identity = Identity::load(&config_dir).with_context(|| {
        format!(
            "loading this device's identity from {}",
            config_dir.display()
        )
    })?;
    let grace = match args.grace {
        Some(secs) => Duration::from_secs_f64(secs),
        None => process::configured_grace().map_err(anyhow::Error::msg)?,
    };
    let options = Options {
        bind: args.bind,
        identity,
        client: args.client,
        attach_timeout: ATTACH_TIMEOUT,
        grace,
    };
    // The parent reads exactly one line: where to send the client.
    let announce = |port: u16, token: &[u8; 32], grace: Duration| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", gleam_host::announcement(port, token, grace))?;
        out.flush()
    };
    let backend = match args.backend {
        Backend::Auto => Backend::Auto.resolve()?,
        chosen => chosen,
    };
    let reason = match backend {
        Backend::Cuda => match RealBackend::new() {
            Ok(backend) => process::run(backend, options, announce),
            Err(err) => {
                error!(error = %err, "cannot serve this session with NVIDIA's driver");
                return Ok(ExitCode::from(EXIT_BACKEND));
            }
        },
        Backend::Emu | Backend::Auto => process::run(
            gleam_emu::EmuBackend::new(gleam_emu::EmuConfig::default()),
            options,
            announce,
        ),
    };
    Ok(ExitCode::from(reason.code()))
}
