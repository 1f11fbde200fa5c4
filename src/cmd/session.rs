//! `gleam session --backend cuda|emu` (hidden): one client's session, in its own process.
//!
//! Started by `gleam serve`/`gleam peer` for each authenticated connection: requests arrive on stdin,
//! replies leave on stdout (see [`gleam_server::worker`]), logs go to stderr. The exit code says
//! how the session ended, and the parent turns it into the connection's close reason.

use std::process::ExitCode;

use gleam_real::RealBackend;
use gleam_server::worker::{self, EXIT_BACKEND};
use tracing::error;

use super::backend::Backend;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// What executes the session.
    #[arg(long, value_enum)]
    pub backend: Backend,
    /// The serving device's config directory: module images clients sent are kept in its `cache/`.
    #[command(flatten)]
    pub config: super::ConfigDir,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    gleam_server::session::use_content_cache(args.config.path()?.join("cache"));
    let backend = match args.backend {
        Backend::Auto => Backend::Auto.resolve()?,
        chosen => chosen,
    };
    let reason = match backend {
        Backend::Cuda => match RealBackend::new() {
            Ok(backend) => worker::run(backend),
            Err(err) => {
                error!(error = %err, "cannot serve this session with NVIDIA's driver");
                return Ok(ExitCode::from(EXIT_BACKEND));
            }
        },
        Backend::Emu | Backend::Auto => {
            worker::run(gleam_emu::EmuBackend::new(gleam_emu::EmuConfig::default()))
        }
    };
    Ok(ExitCode::from(reason.code()))
}
