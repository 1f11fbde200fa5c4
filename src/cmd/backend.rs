//! What executes CUDA sessions on this device: the one `--backend` choice shared by `gleam serve`,
//! `gleam peer` and the internal `gleam session`.

use anyhow::Context;
use std::path::Path;

use gleam_host::SessionCommand;
use tracing::info;

/// `--backend` values.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq, clap::ValueEnum)]
pub enum Backend {
    /// A real GPU if NVIDIA's driver loads and reports a device, else `emu`.
    #[default]
    Auto,
    /// NVIDIA's driver on a real GPU (fails at start if no GPU answers).
    Cuda,
    /// The GPU-less backend: device memory in host memory, kernels run on the CPU by the PTX interpreter.
    Emu,
}

impl Backend {
    /// Resolves `auto` by probing NVIDIA's driver; `cuda` must find a usable GPU. Never returns `Auto`.
    pub fn resolve(self) -> anyhow::Result<Self> {
        match self {
            Self::Emu => Ok(Self::Emu),
            Self::Cuda => {
                let devices = gleam_real::probe().context("`--backend cuda`: no usable GPU")?;
                info!(devices, "serving with NVIDIA's driver");
                Ok(Self::Cuda)
            }
            Self::Auto => Ok(match gleam_real::probe() {
                Ok(devices) => {
                    info!(devices, "serving with NVIDIA's driver");
                    Self::Cuda
                }
                Err(why) => {
                    info!(
                        %why,
                        "no GPU found: the emu backend serves (device memory in host memory, kernels run on \
                         the CPU by the PTX interpreter)"
                    );
                    Self::Emu
                }
            }),
        }
    }

    /// The name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Cuda => "cuda",
            Self::Emu => "emu",
        }
    }

    /// `<this executable> session --backend <self> --config-dir <dir>`: how `gleam serve` and `gleam peer`
    /// run each session (the session presents this device's identity from `config_dir`).
    pub fn session_command(self, config_dir: &Path) -> anyhow::Result<SessionCommand> {
        let program = std::env::current_exe().context("finding the gleam executable")?;
        Ok(SessionCommand {
            program,
            args: vec![
                "session".to_owned(),
                "--backend".to_owned(),
                self.as_str().to_owned(),
                "--config-dir".to_owned(),
                config_dir.display().to_string(),
            ],
            env: Vec::new(),
        })
    }
}
