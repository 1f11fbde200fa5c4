//! `gleam peer` (alias `gleam-peer`): the daemon that joins the mesh and serves this device's GPU.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use gleam_auth::identity::{Identity, MeshSecret};
use gleam_auth::{PeerAddr, PeerId};
use gleam_cache::BlobStore;
use gleam_mesh::daemon::{Daemon, DaemonConfig, DeviceInfo, DeviceLoad, SessionHandler};
use gleam_mesh::state::{CacheDigest, GpuSummary};

use super::backend::Backend;
use tracing::{debug, info, warn};

use gleam_facts::{HostCpu, LoadSampler, NvmlGpus, SAMPLE_PERIOD, VisibleDevices};

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
    /// A peer to connect to without discovery, as ID@HOST:PORT (several addresses comma-separated;
    /// repeatable).
    #[arg(long = "seed", value_name = "ID@HOST:PORT")]
    pub seeds: Vec<PeerAddr>,
    /// The name other peers show for this device (default: the host name).
    #[arg(long)]
    pub name: Option<String>,
    /// Seconds between bandwidth probes of each link (slow links are probed less often: probes never
    /// take more than 2% of a link).
    #[arg(long, default_value_t = 1.0)]
    pub probe_interval: f64,
    /// What executes sessions: `auto` (a GPU if one answers, else `emu`), `cuda` or `emu`.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    pub backend: Backend,
    /// Join the mesh only to borrow GPUs: advertise none and serve no sessions (e.g. a laptop that
    /// should not offer its CPU-emulated GPU).
    #[arg(long, conflicts_with = "backend")]
    pub borrow_only: bool,
    /// Control socket (default: DIR/daemon.sock for --config-dir DIR, else
    /// $XDG_RUNTIME_DIR/gleam/daemon.sock).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Permission bits of the control socket, in octal (0600: this user only; the system service
    /// uses 0660 so members of its group can use `gleam run` and `gleam peers`).
    #[arg(long, default_value = "600", value_parser = parse_mode)]
    pub socket_mode: u32,
    /// How long a CUDA session outlives a silent network link, in seconds, counted from the last time its
    /// client was heard: a client that reconnects within it resumes the session with its GPU state.
    #[arg(long, env = "GLEAM_SESSION_GRACE", value_name = "SECS", value_parser = super::parse_grace)]
    pub session_grace: Option<f64>,
    #[command(flatten)]
    pub config: super::ConfigDir,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let dir = args.config.path()?;
    let identity = Identity::load_or_create(&dir)?;
    let secret = MeshSecret::load(&dir)?;
    let socket = match args.socket {
        Some(socket) => socket,
        // Our own socket, never the system service's.
        None => args.config.daemon_socket()?,
    };
    let mut config = DaemonConfig::new(socket);
    config.control_socket_mode = args.socket_mode;
    config.listen = args.listen;
    config.mdns = !args.no_mdns;
    config.interfaces = args.interfaces;
    config.seeds = args.seeds;
    if let Some(name) = args.name {
        config.host = name;
    }
    config.probe_interval = Duration::try_from_secs_f64(args.probe_interval)
        .context("--probe-interval must be a positive number of seconds")?;

    let (device, handler) = if args.borrow_only {
        borrow_only()
    } else {
        serving(args.backend, &dir, args.session_grace)?
    };
    // What this device caches by content is gossiped with its GPU facts, for cache-affine placement.
    let device: Arc<dyn DeviceInfo> = match BlobStore::open(dir.join("cache"), CACHE_BUDGET) {
        Ok(store) => Arc::new(WithCache::new(device, store)),
        Err(err) => {
            warn!(
                "content cache unavailable, advertising none: {}",
                gleam_auth::Chain(&err)
            );
            device
        }
    };

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

/// What a serving peer advertises, and its handler: each authenticated CUDA session gets its own
/// `gleam session --backend X` process.
fn serving(
    backend: Backend,
    config_dir: &std::path::Path,
    session_grace: Option<f64>,
) -> anyhow::Result<(Arc<dyn DeviceInfo>, SessionHandler)> {
    let choice = backend.resolve()?;
    let device: Arc<dyn DeviceInfo> = match choice {
        Backend::Cuda => Arc::new(RealDevice::new()),
        Backend::Emu | Backend::Auto => Arc::new(EmulatedDevice::new()),
    };
    let mut worker = choice.session_command(config_dir)?;
    super::pass_grace(&mut worker, session_grace);
    let handler: SessionHandler = Arc::new(move |conn: quinn::Connection, peer: PeerId| {
        let worker = worker.clone();
        tokio::spawn(async move { gleam_host::serve_connection(conn, peer, worker).await });
    });
    Ok((device, handler))
}

/// Default byte budget of the content cache in the config directory.
const CACHE_BUDGET: u64 = 64 << 30;
/// How often the cache's digest is recomputed (it walks the store).
const CACHE_DIGEST_PERIOD: Duration = Duration::from_secs(10);

/// A device, plus the digest of this device's content cache (`<config dir>/cache`).
struct WithCache {
    device: Arc<dyn DeviceInfo>,
    store: BlobStore,
    last: std::sync::Mutex<Option<(std::time::Instant, CacheDigest)>>,
}

impl WithCache {
    fn new(device: Arc<dyn DeviceInfo>, store: BlobStore) -> Self {
        Self {
            device,
            store,
            last: std::sync::Mutex::new(None),
        }
    }
}

impl DeviceInfo for WithCache {
    fn gpus(&self) -> Vec<GpuSummary> {
        self.device.gpus()
    }

    fn load(&self) -> DeviceLoad {
        self.device.load()
    }

    fn cache(&self) -> CacheDigest {
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((at, digest)) = &*last
            && at.elapsed() < CACHE_DIGEST_PERIOD
        {
            return digest.clone();
        }
        let digest = match self.store.digest() {
            Ok(d) => {
                let mut short = [0u8; 16];
                short.copy_from_slice(&d.fingerprint[..16]);
                CacheDigest {
                    entries: d.blobs,
                    bytes: d.bytes,
                    digest: if d.blobs == 0 { [0; 16] } else { short },
                }
            }
            Err(err) => {
                debug!("cannot read the content cache: {}", gleam_auth::Chain(&err));
                CacheDigest::default()
            }
        };
        *last = Some((std::time::Instant::now(), digest.clone()));
        digest
    }
}

/// A borrow-only peer advertises no GPU and turns sessions away with a reason.
fn borrow_only() -> (Arc<dyn DeviceInfo>, SessionHandler) {
    let handler: SessionHandler = Arc::new(|conn: quinn::Connection, peer: PeerId| {
        tracing::info!(%peer, "refused a CUDA session: this peer runs with --borrow-only");
        conn.close(
            gleam_host::CLOSE_WORKER_FAILED,
            b"this peer serves no GPU work (gleam peer --borrow-only)",
        );
    });
    (Arc::new(NoGpu), handler)
}

/// The device of a borrow-only peer: no GPU to offer.
struct NoGpu;

impl DeviceInfo for NoGpu {
    fn gpus(&self) -> Vec<GpuSummary> {
        Vec::new()
    }
}

/// The emu backend's device: "device memory" lives in host memory and kernels run on the CPU.
struct EmulatedDevice {
    gpus: Vec<GpuSummary>,
    cpu: HostCpu,
}

impl EmulatedDevice {
    fn new() -> Self {
        // Exactly what each `gleam session --backend emu` worker offers: they inherit this
        // environment and read the same configuration.
        let total_memory = gleam_emu::EmuConfig::default().memory_bytes;
        let (major, minor) = gleam_emu::device::CC;
        Self {
            gpus: vec![GpuSummary {
                model: "Gleam emulated GPU (PTX interpreter)".into(),
                total_memory,
                compute_capability: (
                    u32::try_from(major).unwrap_or(0),
                    u32::try_from(minor).unwrap_or(0),
                ),
                emulated: true,
            }],
            cpu: HostCpu::new(),
        }
    }
}

impl DeviceInfo for EmulatedDevice {
    fn gpus(&self) -> Vec<GpuSummary> {
        self.gpus.clone()
    }

    /// Host CPU load as utilization (the interpreter runs on these cores); free memory is the
    /// total, since each session is its own process with its own budget.
    fn load(&self) -> DeviceLoad {
        // Reading /proc/loadavg is cheap enough for the daemon's loop; a 1-minute average changes
        // slowly, so a failure (not Linux) just reports an idle device.
        let utilization = self.cpu.utilization().unwrap_or_else(|err| {
            debug!(error = %gleam_auth::Chain(&err), "host CPU load");
            0.0
        });
        DeviceLoad {
            utilization,
            free_memory: None,
            queue_len: 0,
        }
    }
}

/// Real GPUs: facts and load from NVML, which needs no CUDA context (the daemon runs forever and
/// a context would cost memory on every GPU).
struct RealDevice {
    gpus: Vec<GpuSummary>,
    /// `None` when NVML is unavailable: the load is then unknown (idle, all memory free).
    load: Option<LoadSampler>,
}

impl RealDevice {
    fn new() -> Self {
        match NvmlGpus::open(&VisibleDevices::from_env()) {
            Ok(nvml) => {
                let mut gpus = nvml.summaries();
                // Sessions see the driver's devices; NVML's selection can differ (MIG instances,
                // CUDA_VISIBLE_DEVICES entries NVML cannot map). Then advertise the driver's list.
                let cuda = gleam_real::probe().ok();
                if let Some(cuda) = cuda
                    && cuda != gpus.len()
                    && let Ok(driver) = gleam_facts::driver_gpus()
                {
                    warn!(
                        nvml = gpus.len(),
                        cuda,
                        "NVML and the CUDA driver count different GPUs: advertising the driver's \
                         (load still from NVML)"
                    );
                    gpus = driver;
                } else {
                    info!(count = gpus.len(), "GPU facts from NVML");
                }
                let load = LoadSampler::spawn(SAMPLE_PERIOD, move || nvml.sample())
                    .inspect_err(|err| warn!(error = %gleam_auth::Chain(err), "GPU load will not be reported"))
                    .ok();
                Self { gpus, load }
            }
            // Logged once (the daemon builds its device once), naming what is missing.
            Err(nvml_err) => match gleam_facts::driver_gpus() {
                Ok(gpus) => {
                    warn!(
                        nvml_err = %gleam_auth::Chain(&nvml_err),
                        count = gpus.len(),
                        "GPU facts from the CUDA driver instead; GPU utilization and free memory \
                         will not be reported"
                    );
                    Self { gpus, load: None }
                }
                Err(driver_err) => {
                    warn!(
                        nvml_err = %gleam_auth::Chain(&nvml_err),
                        driver_err = %gleam_auth::Chain(&driver_err),
                        "no GPU facts: advertising no GPUs, and no GPU load"
                    );
                    Self {
                        gpus: Vec::new(),
                        load: None,
                    }
                }
            },
        }
    }
}

impl DeviceInfo for RealDevice {
    fn gpus(&self) -> Vec<GpuSummary> {
        self.gpus.clone()
    }

    fn load(&self) -> DeviceLoad {
        self.load
            .as_ref()
            .map_or_else(DeviceLoad::default, LoadSampler::latest)
    }
}

fn parse_mode(text: &str) -> Result<u32, String> {
    u32::from_str_radix(text.trim_start_matches("0o"), 8)
        .ok()
        .filter(|mode| *mode <= 0o777)
        .ok_or_else(|| format!("{text:?} is not an octal permission mode like 600 or 660"))
}

async fn shutdown_signal() {
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emulated_device_advertises_the_emu_backends_device() {
        let device = EmulatedDevice::new();
        let gpus = device.gpus();
        assert_eq!(gpus.len(), 1);
        assert_eq!(gpus[0].model, "Gleam emulated GPU (PTX interpreter)");
        assert_eq!(
            gpus[0].total_memory,
            gleam_emu::EmuConfig::default().memory_bytes
        );
        assert_eq!(gpus[0].compute_capability, (7, 5));
        assert!(gpus[0].emulated);
        let load = device.load();
        assert!((0.0..=1.0).contains(&load.utilization));
        assert_eq!(load.free_memory, None, "each session has the whole budget");
    }

    #[test]
    fn real_device_degrades_without_nvidia_software() {
        // No NVML and no driver on CI: constructing must not panic, and reports nothing it
        // cannot know. On a GPU host: real facts and a live load.
        let device = RealDevice::new();
        let gpus = device.gpus();
        let load = device.load();
        assert!((0.0..=1.0).contains(&load.utilization));
        if gpus.is_empty() {
            assert!(device.load.is_none());
            assert_eq!(load.free_memory, None);
        } else {
            for gpu in &gpus {
                assert!(!gpu.emulated);
                assert!(gpu.total_memory > 0, "{gpu:?}");
                assert!(gpu.compute_capability.0 > 0, "{gpu:?}");
            }
            if device.load.is_some() {
                let total: u64 = gpus.iter().map(|gpu| gpu.total_memory).sum();
                assert!(load.free_memory.is_some_and(|free| free <= total));
            }
        }
    }
}
