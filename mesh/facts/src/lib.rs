//! `gleam-facts`: facts about this machine's GPUs and load, for the peer daemon's [`DeviceInfo`] implementations.
//!
//! The daemon runs forever, so it must not hold a CUDA context (a context costs device memory on
//! every GPU it touches). Everything here therefore comes from NVML, the driver's management
//! library, loaded at run time so that the binary builds and runs without NVIDIA software:
//!
//! * [`NvmlGpus`]: an NVML session over the GPUs that sessions will see (after
//!   `CUDA_VISIBLE_DEVICES`), with their static facts ([`GpuSummary`]) and a live
//!   [`sample`](NvmlGpus::sample) of utilization and free memory.
//! * [`LoadSampler`]: a background thread that refreshes a [`DeviceLoad`] about once a second, so
//!   that the daemon's actor loop only ever reads a cached value (NVML calls can block).
//! * [`driver_gpus`]: static facts from the CUDA driver's device queries (no context is created),
//!   for hosts whose driver is installed without NVML (e.g. containers given only the `compute`
//!   driver capability).
//! * [`HostCpu`]: the emulated device's "utilization", from `/proc/loadavg` over the core count.
//! * [`VisibleDevices`]: the parsed `CUDA_VISIBLE_DEVICES`, which NVML does not apply itself.
//! * [`FactsError`]: what can go wrong.
//!
//! [`DeviceInfo`]: gleam_mesh::daemon::DeviceInfo

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use gleam_mesh::daemon::DeviceLoad;
use gleam_mesh::state::GpuSummary;
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use tracing::{debug, info, warn};

/// How often [`LoadSampler`] refreshes (the daemon reads the load about once a second).
pub const SAMPLE_PERIOD: Duration = Duration::from_secs(1);

/// The model name reported when a GPU's name cannot be read.
const UNKNOWN_MODEL: &str = "NVIDIA GPU";

/// Why a fact could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FactsError {
    /// NVML could not be loaded or initialised (no NVIDIA driver, or one without `libnvidia-ml.so.1`).
    #[error("NVML (libnvidia-ml.so.1) unavailable")]
    NvmlInit(#[source] NvmlError),
    /// An NVML query failed.
    #[error("NVML {query} failed: {source}")]
    Nvml {
        /// The query, e.g. "device count".
        query: &'static str,
        /// NVML's error.
        #[source]
        source: NvmlError,
    },
    /// No GPU answered a load query.
    #[error("no GPU answered the load queries")]
    NoLoad,
    /// The CUDA driver is not usable (absent, Gleam's own shim, or failing).
    #[error("CUDA driver unavailable: {0}")]
    Driver(String),
    /// A file under /proc could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `/proc/loadavg` did not hold a load average.
    #[error("malformed /proc/loadavg: {0:?}")]
    LoadAvg(String),
    /// The background sampler thread could not be started.
    #[error("cannot start the load sampler thread")]
    Thread(#[source] std::io::Error),
}

/// An NVML session over the GPUs CUDA sessions will see.
pub struct NvmlGpus {
    nvml: Nvml,
    /// NVML indices of the served GPUs, in CUDA's order as far as NVML can tell it.
    indices: Vec<u32>,
}

impl std::fmt::Debug for NvmlGpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlGpus")
            .field("indices", &self.indices)
            .finish_non_exhaustive()
    }
}

impl NvmlGpus {
    /// Loads NVML and selects the GPUs that `visible` (the daemon's `CUDA_VISIBLE_DEVICES`) lets
    /// CUDA sessions see.
    pub fn open(visible: &VisibleDevices) -> Result<Self, FactsError> {
        let nvml = Nvml::init().map_err(FactsError::NvmlInit)?;
        let count = nvml.device_count().map_err(|source| FactsError::Nvml {
            query: "device count",
            source,
        })?;
        let uuids: Vec<Option<String>> = (0..count)
            .map(|index| {
                nvml.device_by_index(index)
                    .and_then(|device| device.uuid())
                    .ok()
            })
            .collect();
        let indices = match visible.select(&uuids) {
            Some(positions) => positions,
            None => {
                // MIG instances cannot be mapped onto NVML's whole-GPU indices here.
                warn!(
                    "CUDA_VISIBLE_DEVICES names MIG instances: advertising all {count} GPU(s) NVML \
                     reports"
                );
                (0..count).collect()
            }
        };
        Ok(Self { nvml, indices })
    }

    /// Static facts of each served GPU. A fact NVML cannot give is reported as unknown (model
    /// "NVIDIA GPU", 0 bytes, capability 0.0) rather than dropping the GPU.
    pub fn summaries(&self) -> Vec<GpuSummary> {
        self.indices
            .iter()
            .map(|&index| {
                let device = match self.nvml.device_by_index(index) {
                    Ok(device) => device,
                    Err(err) => {
                        warn!(index, %err, "NVML: no handle for GPU; its facts are unknown");
                        return unknown_gpu();
                    }
                };
                let model = device.name().unwrap_or_else(|err| {
                    warn!(index, %err, "NVML: GPU name unknown");
                    UNKNOWN_MODEL.into()
                });
                let total_memory = device.memory_info().map_or_else(
                    |err| {
                        warn!(index, %err, "NVML: GPU memory size unknown");
                        0
                    },
                    |memory| memory.total,
                );
                let compute_capability = device.cuda_compute_capability().map_or_else(
                    |err| {
                        warn!(index, %err, "NVML: compute capability unknown");
                        (0, 0)
                    },
                    |cc| {
                        (
                            u32::try_from(cc.major).unwrap_or(0),
                            u32::try_from(cc.minor).unwrap_or(0),
                        )
                    },
                );
                GpuSummary {
                    model,
                    total_memory,
                    compute_capability,
                    emulated: false,
                }
            })
            .collect()
    }

    /// The current load over the served GPUs (see [`combine_samples`]).
    pub fn sample(&self) -> Result<DeviceLoad, FactsError> {
        let per_gpu: Vec<GpuSample> = self
            .indices
            .iter()
            .map(|&index| {
                let Ok(device) = self.nvml.device_by_index(index) else {
                    return GpuSample::default();
                };
                let utilization = device
                    .utilization_rates()
                    .inspect_err(|err| debug!(index, %err, "NVML utilization"))
                    .ok()
                    .map(|rates| rates.gpu);
                let free_memory = device
                    .memory_info()
                    .inspect_err(|err| debug!(index, %err, "NVML memory info"))
                    .ok()
                    .map(|memory| memory.free);
                GpuSample {
                    utilization_percent: utilization,
                    free_memory,
                }
            })
            .collect();
        combine_samples(&per_gpu).ok_or(FactsError::NoLoad)
    }
}

fn unknown_gpu() -> GpuSummary {
    GpuSummary {
        model: UNKNOWN_MODEL.into(),
        total_memory: 0,
        compute_capability: (0, 0),
        emulated: false,
    }
}

/// One GPU's answers to the load queries (`None`: the query failed or is unsupported).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpuSample {
    /// NVML's utilization: percent of the last sample period in which a kernel ran.
    pub utilization_percent: Option<u32>,
    /// Free device memory in bytes.
    pub free_memory: Option<u64>,
}

/// The peer's load from its GPUs' samples; `None` when no GPU answered anything.
///
/// Utilization is the busiest GPU's, not the mean: a session's program sees all of the peer's
/// GPUs and most programs run on device 0 (or on all of them), and Gleam cannot steer it to the
/// idle one, so a mean would promise idle capacity the session may not get. With one GPU the two
/// agree. Free memory is the sum over GPUs (the mesh's `Load::free_memory`), and is reported only
/// when every GPU answered: a partial sum would understate it, and `None` lets the daemon
/// fall back to the total.
pub fn combine_samples(samples: &[GpuSample]) -> Option<DeviceLoad> {
    let busiest = samples
        .iter()
        .filter_map(|sample| sample.utilization_percent)
        .max();
    let free: Option<u64> = samples
        .iter()
        .map(|sample| sample.free_memory)
        .try_fold(0u64, |sum, free| Some(sum.saturating_add(free?)));
    let any_memory = samples.iter().any(|sample| sample.free_memory.is_some());
    if busiest.is_none() && !any_memory {
        return None;
    }
    Some(DeviceLoad {
        // NVML reports percent; clamp in case a driver reports more than 100.
        utilization: busiest.map_or(0.0, |percent| percent.min(100) as f32 / 100.0),
        free_memory: free,
        queue_len: 0,
    })
}

/// Static facts from the CUDA driver, for when NVML is missing. Device queries need `cuInit` but
/// no context, so nothing stays allocated on the GPUs. The driver applies `CUDA_VISIBLE_DEVICES`
/// and its device order itself.
pub fn driver_gpus() -> Result<Vec<GpuSummary>, FactsError> {
    use cudarc::driver::result;
    use cudarc::driver::sys::CUdevice_attribute;

    // `probe` checks that the library loads, is NVIDIA's (not Gleam's shim) and initialises; only
    // then may cudarc's entry points be called (they panic if the library is absent).
    let count = gleam_real::probe().map_err(|err| FactsError::Driver(err.to_string()))?;
    let driver = |err: cudarc::driver::DriverError| FactsError::Driver(err.to_string());
    result::init().map_err(driver)?;
    (0..count)
        .map(|ordinal| {
            let ordinal = i32::try_from(ordinal).map_err(|_| {
                FactsError::Driver(format!("device ordinal {ordinal} out of range"))
            })?;
            let device = result::device::get(ordinal).map_err(driver)?;
            let model = result::device::get_name(device).unwrap_or_else(|_| UNKNOWN_MODEL.into());
            // SAFETY: `device` is a handle the driver just returned; these are plain queries.
            let total_memory = unsafe { result::device::total_mem(device) }.map_or(0, |b| b as u64);
            let attribute = |attribute| {
                // SAFETY: as above.
                unsafe { result::device::get_attribute(device, attribute) }
                    .ok()
                    .and_then(|value| u32::try_from(value).ok())
                    .unwrap_or(0)
            };
            Ok(GpuSummary {
                model,
                total_memory,
                compute_capability: (
                    attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                    attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
                ),
                emulated: false,
            })
        })
        .collect()
}

/// A [`DeviceLoad`] refreshed by a background thread about once a second.
///
/// The thread owns the sampling closure (and whatever it captures, e.g. an [`NvmlGpus`]) and stops
/// at its next wake-up once the sampler is dropped.
#[derive(Debug)]
pub struct LoadSampler {
    latest: Arc<Mutex<DeviceLoad>>,
}

impl LoadSampler {
    /// Starts the thread. `sample` is called once before this returns (so the first read is
    /// real), then every `period`; an `Err` keeps the last good value. The first failure is
    /// logged at warn level, later ones at debug until a sample succeeds again.
    pub fn spawn<F>(period: Duration, mut sample: F) -> Result<Self, FactsError>
    where
        F: FnMut() -> Result<DeviceLoad, FactsError> + Send + 'static,
    {
        let mut failing = false;
        let mut record = move |slot: &Mutex<DeviceLoad>| match sample() {
            Ok(load) => {
                if failing {
                    info!("GPU load queries answer again");
                    failing = false;
                }
                *slot.lock().unwrap_or_else(PoisonError::into_inner) = load;
            }
            Err(err) if !failing => {
                warn!(%err, "GPU load unavailable; advertising the last known load");
                failing = true;
            }
            Err(err) => debug!(%err, "GPU load still unavailable"),
        };
        let latest = Arc::new(Mutex::new(DeviceLoad::default()));
        record(&latest);
        let weak: Weak<Mutex<DeviceLoad>> = Arc::downgrade(&latest);
        std::thread::Builder::new()
            .name("gleam-gpu-load".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(period);
                    let Some(slot) = weak.upgrade() else { return };
                    record(&slot);
                }
            })
            .map_err(FactsError::Thread)?;
        Ok(Self { latest })
    }

    /// The latest sample.
    pub fn latest(&self) -> DeviceLoad {
        *self.latest.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The host's CPU load, as the emulated device's utilization (its kernels run on these CPUs).
#[derive(Debug)]
pub struct HostCpu {
    cores: usize,
}

impl Default for HostCpu {
    fn default() -> Self {
        Self::new()
    }
}

impl HostCpu {
    const LOADAVG: &'static str = "/proc/loadavg";

    /// The CPUs this process may use.
    pub fn new() -> Self {
        Self {
            cores: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        }
    }

    /// The 1-minute load average over the core count, in 0..=1.
    pub fn utilization(&self) -> Result<f32, FactsError> {
        self.utilization_from(Path::new(Self::LOADAVG))
    }

    fn utilization_from(&self, path: &Path) -> Result<f32, FactsError> {
        let text = std::fs::read_to_string(path).map_err(|source| FactsError::Read {
            path: Self::LOADAVG,
            source,
        })?;
        Ok(cpu_utilization(parse_loadavg(&text)?, self.cores))
    }
}

/// The 1-minute load average from `/proc/loadavg` ("0.52 0.58 0.59 2/1211 12345").
pub fn parse_loadavg(text: &str) -> Result<f32, FactsError> {
    let bad = || FactsError::LoadAvg(text.chars().take(80).collect());
    let first = text.split_whitespace().next().ok_or_else(bad)?;
    let load: f32 = first.parse().map_err(|_| bad())?;
    if !load.is_finite() || load < 0.0 {
        return Err(bad());
    }
    Ok(load)
}

/// Load average over cores, clamped to 0..=1 (an overloaded host is simply fully busy).
pub fn cpu_utilization(loadavg: f32, cores: usize) -> f32 {
    (loadavg / cores.max(1) as f32).clamp(0.0, 1.0)
}

/// `CUDA_VISIBLE_DEVICES` as CUDA reads it: sessions inherit the daemon's environment, so the
/// daemon advertises only the GPUs they will see. NVML ignores the variable, hence this parser.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VisibleDevices {
    /// Unset: every GPU.
    All,
    /// The listed devices, in order (possibly none).
    Listed(Vec<DeviceSelector>),
}

/// One entry of `CUDA_VISIBLE_DEVICES`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSelector {
    /// A device index.
    Index(u32),
    /// A GPU UUID or a unique prefix of one, lowercased, with its `GPU-` prefix.
    Uuid(String),
    /// A MIG instance (`MIG-...`).
    Mig(String),
}

impl VisibleDevices {
    /// Reads the process's `CUDA_VISIBLE_DEVICES`.
    pub fn from_env() -> Self {
        match std::env::var("CUDA_VISIBLE_DEVICES") {
            Ok(value) => Self::parse(&value),
            // Unset, or not UTF-8 (then CUDA would find no valid entry either; treat as unset
            // rather than hide every GPU because of an odd byte).
            Err(_) => Self::All,
        }
    }

    /// Parses the variable's value. Like CUDA, the list ends at the first entry that is not an
    /// index, `GPU-` UUID or `MIG-` UUID; repeated entries are skipped.
    pub fn parse(value: &str) -> Self {
        let mut listed: Vec<DeviceSelector> = Vec::new();
        for entry in value.split(',') {
            let entry = entry.trim();
            let selector = if let Ok(index) = entry.parse::<u32>() {
                DeviceSelector::Index(index)
            } else if entry.len() > 4 && entry[..4].eq_ignore_ascii_case("GPU-") {
                DeviceSelector::Uuid(entry.to_ascii_lowercase())
            } else if entry.len() > 4 && entry[..4].eq_ignore_ascii_case("MIG-") {
                DeviceSelector::Mig(entry.to_owned())
            } else {
                break;
            };
            if !listed.contains(&selector) {
                listed.push(selector);
            }
        }
        Self::Listed(listed)
    }

    /// The positions (NVML indices) of the visible GPUs among `uuids` (NVML's order; `None`
    /// where a GPU's UUID is unknown), in the variable's order. An entry that matches no GPU
    /// (or a UUID prefix that matches several) ends the list, as in CUDA. `None` when the list
    /// names MIG instances, which cannot be mapped onto whole GPUs.
    ///
    /// Indices are taken as NVML's (PCI bus) order. CUDA orders "fastest first" unless
    /// `CUDA_DEVICE_ORDER=PCI_BUS_ID`; the two agree when the GPUs are alike, the usual case.
    pub fn select(&self, uuids: &[Option<String>]) -> Option<Vec<u32>> {
        let count = u32::try_from(uuids.len()).unwrap_or(u32::MAX);
        let listed = match self {
            Self::All => return Some((0..count).collect()),
            Self::Listed(listed) => listed,
        };
        let mut chosen = Vec::new();
        for selector in listed {
            let position = match selector {
                DeviceSelector::Mig(_) => return None,
                DeviceSelector::Index(index) => (*index < count).then_some(*index),
                DeviceSelector::Uuid(prefix) => {
                    let mut matches = uuids.iter().enumerate().filter(|(_, uuid)| {
                        uuid.as_deref()
                            .is_some_and(|uuid| uuid.to_ascii_lowercase().starts_with(prefix))
                    });
                    match (matches.next(), matches.next()) {
                        (Some((position, _)), None) => u32::try_from(position).ok(),
                        _ => None,
                    }
                }
            };
            match position {
                Some(position) if !chosen.contains(&position) => chosen.push(position),
                Some(_) => {}
                None => break,
            }
        }
        Some(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loadavg_parses_the_one_minute_average() {
        let load = parse_loadavg("0.52 0.58 0.59 2/1211 12345\n").unwrap();
        assert!((load - 0.52).abs() < 1e-6);
        assert!((parse_loadavg("17.00 1 1 1/1 1").unwrap() - 17.0).abs() < 1e-6);
    }

    #[test]
    fn malformed_loadavg_is_an_error() {
        for text in [
            "",
            "   \n",
            "busy 0.5 0.5",
            "-1.0 0 0",
            "NaN 0 0",
            "inf 0 0",
        ] {
            assert!(
                matches!(parse_loadavg(text), Err(FactsError::LoadAvg(_))),
                "{text:?}"
            );
        }
    }

    #[test]
    fn cpu_utilization_is_load_over_cores_clamped() {
        assert!((cpu_utilization(1.0, 4) - 0.25).abs() < 1e-6);
        assert_eq!(cpu_utilization(9.0, 4), 1.0);
        assert_eq!(cpu_utilization(0.0, 4), 0.0);
        // A core count of 0 cannot happen, but must not divide by zero.
        assert_eq!(cpu_utilization(0.5, 0), 0.5);
    }

    #[test]
    fn host_cpu_reads_a_loadavg_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("loadavg");
        std::fs::write(&path, "3.00 2.00 1.00 5/300 4242\n").unwrap();
        let cpu = HostCpu { cores: 6 };
        assert!((cpu.utilization_from(&path).unwrap() - 0.5).abs() < 1e-6);
        std::fs::write(&path, "garbage").unwrap();
        assert!(matches!(
            cpu.utilization_from(&path),
            Err(FactsError::LoadAvg(_))
        ));
        assert!(matches!(
            cpu.utilization_from(&dir.path().join("absent")),
            Err(FactsError::Read { .. })
        ));
    }

    #[test]
    fn this_hosts_cpu_utilization_is_in_range() {
        // CI runs on Linux, where /proc/loadavg exists.
        let utilization = HostCpu::new().utilization().unwrap();
        assert!((0.0..=1.0).contains(&utilization));
    }

    #[test]
    fn busiest_gpu_and_summed_free_memory() {
        let samples = [
            GpuSample {
                utilization_percent: Some(20),
                free_memory: Some(10 << 30),
            },
            GpuSample {
                utilization_percent: Some(90),
                free_memory: Some(30 << 30),
            },
        ];
        let load = combine_samples(&samples).unwrap();
        assert!((load.utilization - 0.9).abs() < 1e-6);
        assert_eq!(load.free_memory, Some(40 << 30));
        assert_eq!(load.queue_len, 0);
    }

    #[test]
    fn partial_answers_degrade_field_by_field() {
        // Utilization unsupported on one GPU: the other's still counts; memory still sums.
        let samples = [
            GpuSample {
                utilization_percent: None,
                free_memory: Some(1 << 30),
            },
            GpuSample {
                utilization_percent: Some(150),
                free_memory: Some(2 << 30),
            },
        ];
        let load = combine_samples(&samples).unwrap();
        assert_eq!(load.utilization, 1.0, "clamped to 100 %");
        assert_eq!(load.free_memory, Some(3 << 30));

        // One GPU's memory unknown: no partial sum (the daemon then reports the total).
        let samples = [
            GpuSample {
                utilization_percent: Some(50),
                free_memory: None,
            },
            GpuSample {
                utilization_percent: None,
                free_memory: Some(2 << 30),
            },
        ];
        let load = combine_samples(&samples).unwrap();
        assert!((load.utilization - 0.5).abs() < 1e-6);
        assert_eq!(load.free_memory, None);

        assert!(combine_samples(&[GpuSample::default(); 2]).is_none());
        assert!(combine_samples(&[]).is_none());
    }

    #[test]
    fn visible_devices_parse_like_cuda() {
        use DeviceSelector::*;
        assert_eq!(
            VisibleDevices::parse("1,0"),
            VisibleDevices::Listed(vec![Index(1), Index(0)])
        );
        assert_eq!(
            VisibleDevices::parse(" 2 , GPU-8932F937,MIG-abc"),
            VisibleDevices::Listed(vec![
                Index(2),
                Uuid("gpu-8932f937".into()),
                Mig("MIG-abc".into())
            ])
        );
        // The list ends at the first invalid entry; repeats are skipped.
        assert_eq!(
            VisibleDevices::parse("0,0,-1,1"),
            VisibleDevices::Listed(vec![Index(0)])
        );
        assert_eq!(VisibleDevices::parse(""), VisibleDevices::Listed(vec![]));
        assert_eq!(
            VisibleDevices::parse("NoDevFiles"),
            VisibleDevices::Listed(vec![])
        );
    }

    #[test]
    fn visible_devices_select_nvml_indices() {
        let uuids = [
            Some("GPU-aaaa1111-0000".to_owned()),
            Some("GPU-bbbb2222-0000".to_owned()),
            None,
            Some("GPU-aaaa3333-0000".to_owned()),
        ];
        assert_eq!(VisibleDevices::All.select(&uuids), Some(vec![0, 1, 2, 3]));
        assert_eq!(
            VisibleDevices::parse("3,1").select(&uuids),
            Some(vec![3, 1])
        );
        // Unique UUID prefix, case-insensitive.
        assert_eq!(
            VisibleDevices::parse("GPU-BBBB,0").select(&uuids),
            Some(vec![1, 0])
        );
        // An ambiguous prefix or an index out of range ends the list.
        assert_eq!(
            VisibleDevices::parse("1,GPU-aaaa,0").select(&uuids),
            Some(vec![1])
        );
        assert_eq!(VisibleDevices::parse("0,7,1").select(&uuids), Some(vec![0]));
        // The same GPU by index and by UUID counts once.
        assert_eq!(
            VisibleDevices::parse("1,GPU-bbbb2222").select(&uuids),
            Some(vec![1])
        );
        assert_eq!(VisibleDevices::parse("").select(&uuids), Some(vec![]));
        assert_eq!(VisibleDevices::parse("MIG-x").select(&uuids), None);
    }

    #[test]
    fn nvml_absent_is_an_error_not_a_panic() {
        // No NVIDIA driver here (CI, this build host): opening NVML must fail cleanly. On a GPU
        // host it must find the GPUs and sample them.
        match NvmlGpus::open(&VisibleDevices::All) {
            Err(err) => assert!(matches!(err, FactsError::NvmlInit(_)), "{err}"),
            Ok(gpus) => {
                let summaries = gpus.summaries();
                assert!(summaries.iter().all(|gpu| !gpu.emulated));
                if !summaries.is_empty() {
                    let load = gpus.sample().unwrap();
                    assert!((0.0..=1.0).contains(&load.utilization));
                }
            }
        }
    }

    #[test]
    fn sampler_refreshes_and_keeps_the_last_good_value() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let calls = Arc::new(AtomicU32::new(0));
        let counter = Arc::clone(&calls);
        let sampler = LoadSampler::spawn(Duration::from_millis(5), move || {
            let n = counter.fetch_add(1, Ordering::SeqCst);
            match n {
                0 => Ok(DeviceLoad {
                    utilization: 0.25,
                    free_memory: Some(7),
                    queue_len: 0,
                }),
                // Every later sample fails: the first value must survive.
                _ => Err(FactsError::NoLoad),
            }
        })
        .unwrap();
        // The first sample is taken before spawn returns.
        assert_eq!(sampler.latest().free_memory, Some(7));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while calls.load(Ordering::SeqCst) < 3 {
            assert!(
                std::time::Instant::now() < deadline,
                "sampler thread stalled"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(sampler.latest().utilization, 0.25);
        assert_eq!(sampler.latest().free_memory, Some(7));

        // Dropping the sampler stops the thread (it stops calling the closure).
        drop(sampler);
        std::thread::sleep(Duration::from_millis(30));
        let after_drop = calls.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(calls.load(Ordering::SeqCst), after_drop);
    }

    #[test]
    fn driver_facts_fail_cleanly_without_a_driver() {
        // No libcuda here: an error, never cudarc's "library not found" panic. On a GPU host,
        // one summary per device with a real capability.
        match driver_gpus() {
            Err(err) => assert!(matches!(err, FactsError::Driver(_)), "{err}"),
            Ok(gpus) => assert!(gpus.iter().all(|gpu| gpu.compute_capability.0 > 0)),
        }
    }
}
