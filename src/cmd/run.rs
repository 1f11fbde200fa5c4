//! `gleam run`: runs a program with Gleam's `libcuda.so.1` in front of it, so its CUDA work executes on a
//! peer's GPU.
//!
//! The shim (`libgleamcuda.so` beside the `gleam` executable, or `$GLEAM_SHIM`) is exposed in a private
//! temporary directory as `libcuda.so.1`, `libcuda.so` and `libcuda.so.13` (the names cudart and cudarc
//! look for), which is prepended to `LD_LIBRARY_PATH`. `GLEAM_PEER` and `GLEAM_CONFIG_DIR` tell the shim
//! where to connect and as whom. The peer is checked first with one authenticated connection, so an
//! unreachable peer is a clear message from gleam rather than a CUDA error deep in the program.

use std::ffi::OsString;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use gleam_auth::identity::{Identity, MeshSecret, PeerId};
use gleam_client::Client;
use gleam_mesh::control;
use gleam_mesh::select::JobHint;

use super::ConfigDir;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The GPU peer, as `<peer-id>@HOST:PORT` (what `gleam serve` prints). Without it, the local mesh
    /// daemon (`gleam peer`) picks the best peer.
    #[arg(long, env = "GLEAM_PEER")]
    pub peer: Option<String>,
    #[command(flatten)]
    pub config: ConfigDir,
    /// The program to run, and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub command: Vec<OsString>,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config_dir = args.config.path();
    let (peer, addr) = match args.peer {
        Some(target) => parse_target(&target)?,
        None => best_peer(&args.config.socket())?,
    };
    check_peer(peer, addr, &config_dir)?;

    let shim = find_shim()?;
    let dir = ShimDir::create(&shim)?;
    let mut library_path = OsString::from(dir.path());
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        library_path.push(":");
        library_path.push(old);
    }
    let (program, rest) = args.command.split_first().context("no program to run")?;
    tracing::debug!(?program, shim = %shim.display(), "running through Gleam");
    let status = std::process::Command::new(program)
        .args(rest)
        .env("LD_LIBRARY_PATH", library_path)
        .env("GLEAM_PEER", format!("{peer}@{addr}"))
        .env("GLEAM_CONFIG_DIR", &config_dir)
        .status()
        .with_context(|| format!("cannot start {}", Path::new(program).display()))?;
    drop(dir);
    Ok(exit_code(status))
}

/// The program's exit code; a signal `n` becomes `128 + n`, as shells report it.
fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(code as u8),
        (None, Some(signal)) => ExitCode::from((128 + signal) as u8),
        (None, None) => ExitCode::FAILURE,
    }
}

/// Asks the local mesh daemon (`gleam peer`) which peer should run the job.
/// `socket`: the daemon of this config directory, wherever --config-dir pointed.
fn best_peer(socket: &Path) -> anyhow::Result<(PeerId, SocketAddr)> {
    let best = control::best_peer(socket, JobHint::default()).map_err(|err| {
        anyhow::anyhow!(
            "no --peer given, and the local mesh daemon did not answer ({err}); start it with \
             `gleam peer`, or pass --peer <peer-id>@HOST:PORT (printed by `gleam serve`)"
        )
    })?;
    let best = best.context(
        "the mesh knows no peer with a GPU right now (`gleam peers list` shows the members); \
         pass --peer <peer-id>@HOST:PORT to name one",
    )?;
    let addr = *best
        .addrs
        .first()
        .with_context(|| format!("the mesh knows no address of peer {}", best.id))?;
    tracing::info!(peer = %best.id, %addr, expected_secs = best.expected_secs, "chose GPU peer");
    Ok((best.id, addr))
}

/// Parses `<peer-id>@HOST:PORT`.
pub fn parse_target(target: &str) -> anyhow::Result<(PeerId, SocketAddr)> {
    let (id, host) = target
        .trim()
        .split_once('@')
        .with_context(|| format!("peer {target:?} is not <peer-id>@HOST:PORT"))?;
    let peer: PeerId = id
        .parse()
        .map_err(|_| anyhow::anyhow!("{id:?} is not a peer id (26 base32 characters)"))?;
    let addr = host
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve {host:?}"))?
        .next()
        .with_context(|| format!("{host:?} resolves to no address"))?;
    Ok((peer, addr))
}

/// One quick authenticated connection, so that a wrong address or mesh is reported by gleam itself.
fn check_peer(peer: PeerId, addr: SocketAddr, config_dir: &Path) -> anyhow::Result<()> {
    let identity = Identity::load_or_create(config_dir).with_context(|| {
        format!(
            "loading this device's identity from {}",
            config_dir.display()
        )
    })?;
    let secret = MeshSecret::load(config_dir).with_context(|| {
        format!(
            "no mesh secret in {}; join the GPU peer's mesh first with `gleam mesh join CODE`",
            config_dir.display()
        )
    })?;
    let client = Client::connect(peer, addr, &identity, &secret).map_err(|err| {
        anyhow::anyhow!(
            "cannot use GPU peer {peer} at {addr}: {err}\n\
             check that `gleam serve`/`gleam peer` runs there, that the address is right, and that both \
             devices are in the same mesh"
        )
    })?;
    let hello = client.hello();
    tracing::debug!(%peer, %addr, backend = %hello.backend, devices = hello.devices.len(), "GPU peer reachable");
    client.close(Duration::from_secs(1));
    Ok(())
}

/// `$GLEAM_SHIM`, else `libgleamcuda.so` beside this executable.
fn find_shim() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("GLEAM_SHIM").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("GLEAM_SHIM={} does not exist", path.display());
        }
        return Ok(path.canonicalize()?);
    }
    let exe = std::env::current_exe().context("cannot locate the gleam executable")?;
    let dir = exe
        .parent()
        .context("the gleam executable has no directory")?;
    for candidate in [
        dir.join("libgleamcuda.so"),
        dir.join("deps").join("libgleamcuda.so"),
    ] {
        if candidate.is_file() {
            return Ok(candidate.canonicalize()?);
        }
    }
    bail!(
        "Gleam's libcuda (libgleamcuda.so) is not beside {}; build it with `cargo build -p gleam-shim` \
         or point GLEAM_SHIM at it",
        exe.display()
    )
}

/// A private directory of `libcuda.so*` links to the shim, removed when dropped.
struct ShimDir(PathBuf);

impl ShimDir {
    fn create(shim: &Path) -> anyhow::Result<Self> {
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!("gleam-run-{}-{nonce:x}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        let dir = Self(path);
        for name in ["libcuda.so.1", "libcuda.so", "libcuda.so.13"] {
            std::os::unix::fs::symlink(shim, dir.0.join(name))
                .with_context(|| format!("linking {name} in {}", dir.0.display()))?;
        }
        Ok(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ShimDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
