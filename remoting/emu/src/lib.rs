//! `gleam-emu`: the GPU-less backend. A machine without a GPU serves CUDA sessions for real: device memory,
//! streams and events live in host memory and threads, and kernels run on the PTX interpreter
//! ([`gleam_ptx`]).
//!
//! The main types:
//! - [`EmuBackend`]: implements [`gleam_server::backend::ApiBackend`] and
//!   [`gleam_server::backend::Backend`] for one session. Create it with
//!   [`EmuBackend::new`]`(`[`EmuConfig`]`)`.
//! - [`EmuConfig`]: the emulated device's memory size (4 GiB by default, `GLEAM_EMU_MEMORY=2GiB` overrides)
//!   its kernel watchdog (10 s by default, `GLEAM_EMU_KERNEL_TIMEOUT=30` overrides, `0` turns it off) and
//!   the host bytes queued copies may hold (512 MiB by default, `GLEAM_EMU_QUEUED_COPY_BYTES`).
//! - [`memory::DeviceMemory`]: the allocator over a fake device address range (from
//!   [`memory::VA_BASE`]) and the interpreter's [`gleam_ptx::GlobalMemory`].
//! - [`streams::Streams`]: a queue per stream run by a bounded pool of worker threads, with CUDA's
//!   legacy-stream and event ordering.
//! - [`pools::Pools`]: memory pools (stream-ordered allocation).
//! - [`backlog::CopyBacklog`]: the bound on host bytes held by queued asynchronous copies.
//!
//! # Errors of asynchronous work (the sticky error)
//! Launches, memsets, device-to-device and async copies are validated when they are submitted (bad
//! handles, pointers, launch dimensions return their `CUresult` at once) and then run on the stream's
//! worker. A kernel that faults sets the backend's *sticky error* (`CUDA_ERROR_ILLEGAL_ADDRESS` for a
//! memory fault, `CUDA_ERROR_MISALIGNED_ADDRESS`, `CUDA_ERROR_LAUNCH_FAILED` for anything else, including an
//! instruction the interpreter does not support) and logs the kernel's name and the interpreter's message.
//! From then on every call of the backend returns that error first (as a real context does after a
//! fault), queued work is skipped, and synchronising calls (`cuStreamSynchronize`, `cuCtxSynchronize`,
//! `cuEventSynchronize`, copies to the host) return it once they have waited. The session engine therefore
//! needs nothing special: whatever call comes next reports the fault. Only `shutdown`,
//! `describe` and `set_current_context` ignore it.
//!
//! # The kernel watchdog
//! A kernel that runs longer than [`EmuConfig::kernel_timeout`] is stopped and leaves the sticky
//! `CUDA_ERROR_LAUNCH_TIMEOUT`, as a display watchdog does on a GPU (the device reports
//! `KERNEL_EXEC_TIMEOUT` = 1 while the watchdog is on). Ten seconds by default: a few times longer than
//! any kernel of the test suites and examples takes in the interpreter on a small CI host, yet short
//! enough that a kernel that never ends (a bug, or a hostile client) frees its session and the host's
//! cores quickly. A fault or a timeout stops the session's other running kernels too (their context is
//! lost anyway), and the end of the session stops running kernels and skips queued work.

pub mod arrays;
pub mod attrs;
mod backend;
pub mod backlog;
pub mod capture;
pub mod device;
pub mod image;
pub mod managed;
pub mod memory;
pub mod pools;
pub mod streams;

use std::time::Duration;

use gleam_protocol::tuning::parse_size;

pub use backend::EmuBackend;

/// Default emulated memory: 4 GiB.
pub const DEFAULT_MEMORY_BYTES: u64 = 4 << 30;
/// Default kernel watchdog (see the crate documentation for why ten seconds).
pub const DEFAULT_KERNEL_TIMEOUT: Duration = Duration::from_secs(10);
/// Default bound on the host bytes of queued asynchronous copies ([`backlog`]): 512 MiB per session.
pub const DEFAULT_QUEUED_COPY_BYTES: u64 = 512 << 20;
/// How long a copy waits for room in a full backlog with no copy running before it is refused: three
/// watchdog periods (a stream behind a few long kernels still moves).
pub const QUEUED_COPY_STALL: Duration = Duration::from_secs(30);

/// Configuration of the emulated device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmuConfig {
    /// Device memory the session may allocate, in bytes (`cuMemGetInfo`'s total).
    pub memory_bytes: u64,
    /// How long one kernel may run before the watchdog stops it (`None`: no watchdog).
    pub kernel_timeout: Option<Duration>,
    /// Host bytes that queued asynchronous copies may hold ([`backlog::CopyBacklog`]).
    pub queued_copy_bytes: u64,
    /// How long a copy waits for room without progress before it is refused.
    pub queued_copy_stall: Duration,
}

impl EmuConfig {
    /// `memory_bytes` of memory and the default watchdog.
    pub fn with_memory(memory_bytes: u64) -> Self {
        Self {
            memory_bytes,
            kernel_timeout: Some(DEFAULT_KERNEL_TIMEOUT),
            queued_copy_bytes: DEFAULT_QUEUED_COPY_BYTES,
            queued_copy_stall: QUEUED_COPY_STALL,
        }
    }

    /// The configuration from the environment: `GLEAM_EMU_MEMORY` (e.g. `2GiB`, `512MiB`, `1000000`),
    /// `GLEAM_EMU_KERNEL_TIMEOUT` (seconds, fractions allowed; `0` = no watchdog) and
    /// `GLEAM_EMU_QUEUED_COPY_BYTES` (a size).
    pub fn from_env() -> Result<Self, ConfigError> {
        let size = |var: &'static str, default: u64| match std::env::var(var) {
            Ok(v) => nonzero_size(&v).ok_or(ConfigError::BadSize { var, value: v }),
            Err(_) => Ok(default),
        };
        let memory_bytes = size("GLEAM_EMU_MEMORY", DEFAULT_MEMORY_BYTES)?;
        let queued_copy_bytes = size("GLEAM_EMU_QUEUED_COPY_BYTES", DEFAULT_QUEUED_COPY_BYTES)?;
        let kernel_timeout = match std::env::var("GLEAM_EMU_KERNEL_TIMEOUT") {
            Ok(v) => parse_timeout(&v)?,
            Err(_) => Some(DEFAULT_KERNEL_TIMEOUT),
        };
        Ok(Self {
            memory_bytes,
            kernel_timeout,
            queued_copy_bytes,
            queued_copy_stall: QUEUED_COPY_STALL,
        })
    }
}

impl Default for EmuConfig {
    /// [`EmuConfig::from_env`], falling back to the defaults (with a warning) if a variable is malformed.
    fn default() -> Self {
        Self::from_env().unwrap_or_else(|e| {
            tracing::warn!(
                "{e}; using the defaults: {DEFAULT_MEMORY_BYTES} bytes, a {DEFAULT_KERNEL_TIMEOUT:?} kernel \
                 watchdog, {DEFAULT_QUEUED_COPY_BYTES} bytes of queued copies"
            );
            Self::with_memory(DEFAULT_MEMORY_BYTES)
        })
    }
}

/// A malformed configuration value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A size variable (`GLEAM_EMU_MEMORY`, `GLEAM_EMU_QUEUED_COPY_BYTES`) is not a size.
    #[error("{var}={value:?} is not a size (examples: 2GiB, 512MiB, 1G, 1048576)")]
    BadSize {
        /// The variable.
        var: &'static str,
        /// What it says.
        value: String,
    },
    /// `GLEAM_EMU_KERNEL_TIMEOUT` is not a number of seconds.
    #[error(
        "GLEAM_EMU_KERNEL_TIMEOUT={0:?} is not a number of seconds (examples: 10, 2.5, 0 for none)"
    )]
    BadTimeout(String),
}

/// Parses the watchdog: seconds (fractions allowed), `0` for none.
pub fn parse_timeout(s: &str) -> Result<Option<Duration>, ConfigError> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| ConfigError::BadTimeout(s.to_owned()))?;
    if !secs.is_finite() || !(0.0..=1e9).contains(&secs) {
        return Err(ConfigError::BadTimeout(s.to_owned()));
    }
    Ok((secs > 0.0).then(|| Duration::from_secs_f64(secs)))
}

/// A size setting: a byte size ([`parse_size`]) other than zero (no memory, no queue).
fn nonzero_size(text: &str) -> Option<u64> {
    parse_size(text).filter(|&bytes| bytes > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_settings_are_sizes_above_zero() {
        assert_eq!(nonzero_size("2GiB"), Some(2 << 30));
        assert_eq!(nonzero_size("512 MiB"), Some(512 << 20));
        assert!(nonzero_size("lots").is_none());
        assert!(nonzero_size("0").is_none());
        assert!(nonzero_size("99999999999TiB").is_none());
    }

    #[test]
    fn timeouts_parse() {
        assert_eq!(parse_timeout("10"), Ok(Some(Duration::from_secs(10))));
        assert_eq!(parse_timeout(" 0.5 "), Ok(Some(Duration::from_millis(500))));
        assert_eq!(parse_timeout("0"), Ok(None));
        assert!(parse_timeout("-1").is_err());
        assert!(parse_timeout("soon").is_err());
        assert!(parse_timeout("inf").is_err());
    }
}
