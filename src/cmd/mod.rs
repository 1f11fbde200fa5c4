//! Command-line interface: one module per subcommand.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gleam_auth::identity;
use gleam_mesh::control;

pub mod backend;
pub mod cache;
pub mod linkemu;
pub mod mesh;
pub mod peer;
pub mod peers;
pub mod run;
pub mod serve;
pub mod session;
pub mod trace;

/// Gleam: run CUDA programs on another device's GPU, over the LAN.
#[derive(Debug, Parser)]
#[command(name = "gleam", version, about)]
pub struct Cli {
    /// More log output (-v info, -vv debug, -vvv trace). `GLEAM_LOG` overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the peer daemon: advertise this device's GPU, join the mesh, serve GPU work.
    #[command(alias = "gleam-peer")]
    Peer(peer::Args),
    /// Inspect the mesh through the local daemon.
    Peers(peers::Args),
    /// Create or join a mesh (the shared secret that lets devices trust each other).
    Mesh(mesh::Args),
    /// Serve GPU work on one address without discovery (the mesh's identity and secret still apply).
    Serve(serve::Args),
    /// Run a program with Gleam's libcuda.so.1 in place, its CUDA work on a peer's GPU.
    Run(run::Args),
    /// Relay UDP between two addresses through an emulated link (rate, delay, jitter, loss).
    Linkemu(linkemu::Args),
    /// Look at or empty this device's content cache (weights and modules clients sent before).
    Cache(cache::Args),
    /// Run a program through Gleam, then print the driver calls it made and what they cost.
    Trace(trace::TraceArgs),
    /// Internal: one client's session, in its own process (started by `serve`/`peer`).
    #[command(hide = true)]
    Session(session::Args),
}

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Peer(args) => peer::run(args),
        Command::Peers(args) => peers::run(args),
        Command::Mesh(args) => mesh::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Run(args) => run::run(args),
        Command::Linkemu(args) => linkemu::run(args),
        Command::Cache(args) => cache::run(args),
        Command::Trace(args) => trace::run(args),
        Command::Session(args) => session::run(args),
    }
}

/// `--config-dir DIR` (env `GLEAM_CONFIG_DIR`), shared by every subcommand that reads this device's
/// identity and mesh secret or talks to its daemon.
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigDir {
    /// This device's identity, mesh secret and daemon socket (default: `$GLEAM_CONFIG_DIR`, else
    /// ~/.config/gleam).
    #[arg(
        long = "config-dir",
        env = "GLEAM_CONFIG_DIR",
        value_name = "DIR",
        global = true
    )]
    pub dir: Option<PathBuf>,
}

impl ConfigDir {
    /// The directory: the flag, else the environment, else the per-user default (an error when there
    /// is no home directory to put it in).
    pub fn path(&self) -> anyhow::Result<PathBuf> {
        match &self.dir {
            Some(dir) => Ok(dir.clone()),
            None => Ok(identity::default_config_dir()?),
        }
    }

    /// The control socket of this directory's daemon: `DIR/daemon.sock` when a directory other
    /// than the default was named, else where the daemon listens by default (which also follows
    /// `$GLEAM_CONFIG_DIR`, then `$XDG_RUNTIME_DIR`).
    pub fn daemon_socket(&self) -> anyhow::Result<PathBuf> {
        let default = identity::default_config_dir().ok();
        match &self.dir {
            Some(dir) if Some(dir) != default.as_ref() => Ok(dir.join("daemon.sock")),
            _ => Ok(control::default_socket_path()?),
        }
    }

    /// The daemon to ask: [`Self::daemon_socket`], or the system service's
    /// ([`control::SYSTEM_SOCKET`]) when no directory was named and only that one exists.
    pub fn socket(&self) -> anyhow::Result<PathBuf> {
        let own = self.daemon_socket()?;
        match self.dir {
            Some(_) => Ok(own),
            None => Ok(control::socket_or_system(own)),
        }
    }
}

/// A command group whose subcommands all take `--config-dir` (before or after the subcommand).
#[derive(Debug, clap::Args)]
pub struct WithConfigDir<C: Subcommand> {
    #[command(flatten)]
    pub config: ConfigDir,
    #[command(subcommand)]
    pub command: C,
}

/// Logs go to stderr through `tracing`; `GLEAM_LOG` (an `EnvFilter` string) wins over `-v`. Colour only
/// on a terminal (not in files, pipes or the journal; `NO_COLOR` turns it off); no timestamps under
/// systemd, whose journal adds its own.
pub fn init_tracing(verbose: u8) {
    let default = match verbose {
        0 => "warn,gleam=info",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("GLEAM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = match std::env::var_os("JOURNAL_STREAM").is_some() {
        true => builder.without_time().try_init(),
        false => builder.try_init(),
    };
}

/// `--session-grace`/`--grace`: seconds, fractions allowed, up to a day.
pub(crate) fn parse_grace(text: &str) -> Result<f64, String> {
    gleam_host::process::parse_grace(text)
        .map(|grace| grace.as_secs_f64())
        .ok_or_else(|| format!("{text:?} is not a number of seconds between 0 and 86400"))
}

/// Tells each session process the grace window given on the command line (else it reads
/// `GLEAM_SESSION_GRACE` itself, or uses its default).
pub(crate) fn pass_grace(worker: &mut gleam_host::SessionCommand, grace: Option<f64>) {
    if let Some(secs) = grace {
        worker.args.push("--grace".to_owned());
        worker.args.push(secs.to_string());
    }
}
