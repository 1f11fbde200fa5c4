//! `gleam peer` (alias `gleam-peer`): the daemon that joins the mesh and serves this device's GPU.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use gleam_mesh::daemon::{Daemon, DaemonConfig, DeviceInfo, SessionHandler};
use gleam_mesh::identity::{self, Identity, MeshSecret};
use gleam_mesh::state::GpuSummary;
use gleam_mesh::{PeerId, control};
use gleam_remoting::server::host::{self, BackendChoice, BackendRequest, WorkerCommand};

use super::serve::Backend;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// UDP address for QUIC (both IPv6 and IPv4 with the default).
    #[arg(long, default_value = "[::]:4747")]
    pub listen: SocketAddr,
    /// Use mDNS only on this interface (repeatable; default: every interface that is up).
    #[arg(long = "interface", value_name = "NAME")]
    pub interfaces: Vec<String>,
    /// Do not advertise or browse with mDNS (use --seed).
    #[arg(long)]
    pub no_mdns: bool,
    /// A peer to connect to without discovery, as ID@ADDR:PORT (repeatable).
    #[arg(long = "seed", value_name = "ID@ADDR", value_parser = parse_seed)]
    pub seeds: Vec<(PeerId, SocketAddr)>,
    /// The name other peers show for this device (default: the host name).
    #[arg(long)]
    pub name: Option<String>,
    /// Seconds between bandwidth probes of each link.
    #[arg(long, default_value_t = 10.0)]
    pub probe_interval: f64,
    /// What executes sessions: `auto` (a GPU if one answers, else `emu`), `cuda` or `emu`.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    pub backend: Backend,
    /// Control socket (default: $GLEAM_CONFIG_DIR/daemon.sock or $XDG_RUNTIME_DIR/gleam/daemon.sock).
    #[arg(long)]
    pub socket: Option<std::path::PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = identity::default_config_dir();
    let identity = Identity::load_or_create(&dir)?;
    let secret = MeshSecret::load(&dir)?;
    let mut config = DaemonConfig::new(args.socket.unwrap_or_else(control::default_socket_path));
    config.listen = args.listen;
    config.mdns = !args.no_mdns;
    config.interfaces = args.interfaces;
    config.seeds = args.seeds;
    if let Some(name) = args.name {
        config.host = name;
    }
    config.probe_interval = Duration::try_from_secs_f64(args.probe_interval)
        .context("--probe-interval must be a positive number of seconds")?;

    let choice = match args.backend {
        Backend::Auto => host::pick_backend(BackendRequest::Auto),
        Backend::Emu => host::pick_backend(BackendRequest::Emu),
        Backend::Cuda => {
            gleam_remoting::server::real::probe().context("`--backend cuda`: no usable GPU")?;
            BackendChoice::Cuda
        }
    };
    let device: Arc<dyn DeviceInfo> = match choice {
        BackendChoice::Emu => Arc::new(EmulatedDevice::new()),
        // TODO(remoting): report the real GPUs' names, memory and compute capability once
        // gleam_remoting exposes them (today only the device count is public).
        BackendChoice::Cuda => Arc::new(RealDevice::new()),
    };
    // Each authenticated CUDA session gets its own `gleam session --backend X` process.
    let worker = WorkerCommand::gleam_session(choice).context("finding the gleam executable")?;
    let handler: SessionHandler = Arc::new(move |conn: quinn::Connection, peer: PeerId| {
        let worker = worker.clone();
        tokio::spawn(async move { host::serve_connection(conn, peer, worker).await });
    });

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let daemon = Daemon::bind(config, identity, secret, device, handler)?;
        eprintln!(
            "gleam peer {} listening on {}",
            daemon.peer_id(),
            daemon.local_addr()?
        );
        daemon.run(shutdown_signal()).await?;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The emu backend's device: "device memory" lives in host memory.
struct EmulatedDevice {
    gpus: Vec<GpuSummary>,
}

impl EmulatedDevice {
    fn new() -> Self {
        // The emulated device keeps "device memory" in host memory: offer half of it.
        let total_memory = host_memory().map_or(8 << 30, |bytes| bytes / 2);
        Self {
            gpus: vec![GpuSummary {
                model: "Gleam emulated GPU".into(),
                total_memory,
                compute_capability: (8, 0),
                emulated: true,
            }],
        }
    }
}

impl DeviceInfo for EmulatedDevice {
    fn gpus(&self) -> Vec<GpuSummary> {
        self.gpus.clone()
    }
}

/// Real GPUs, as far as the remoting crate reports them (the count).
struct RealDevice {
    gpus: Vec<GpuSummary>,
}

impl RealDevice {
    fn new() -> Self {
        let count = gleam_remoting::server::real::probe().unwrap_or(0);
        let gpu = GpuSummary {
            model: "NVIDIA GPU".into(),
            total_memory: 0,
            compute_capability: (0, 0),
            emulated: false,
        };
        Self {
            gpus: vec![gpu; count],
        }
    }
}

impl DeviceInfo for RealDevice {
    fn gpus(&self) -> Vec<GpuSummary> {
        self.gpus.clone()
    }
}

fn host_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|line| line.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn parse_seed(text: &str) -> Result<(PeerId, SocketAddr), String> {
    let (id, addr) = text.split_once('@').ok_or("expected ID@ADDR:PORT")?;
    let id = id.parse().map_err(|err| format!("{err}"))?;
    let addr = addr
        .parse()
        .map_err(|err| format!("bad address {addr:?}: {err}"))?;
    Ok((id, addr))
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
