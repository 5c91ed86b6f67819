//! `--device auto|cpu|cuda[:N]`.

use anyhow::{bail, Result};
use sala_cpu::CpuBackend;
use sala_cuda::CudaBackend;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The first GPU when one is usable, else the CPU.
    Auto,
    Cpu,
    Cuda(usize),
}

/// An opened backend.
pub enum Opened {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
}

impl Device {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => Self::Auto,
            "cpu" => Self::Cpu,
            "cuda" => Self::Cuda(0),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Self::Cuda(n),
                _ => bail!("--device {s}: expected auto, cpu, cuda or cuda:N"),
            },
        })
    }

    pub fn open(self) -> Result<Opened> {
        match self {
            Self::Cpu => Ok(Opened::Cpu(CpuBackend)),
            Self::Cuda(n) => match CudaBackend::new(n) {
                Ok(b) => Ok(Opened::Cuda(Box::new(b))),
                Err(e) => bail!("--device cuda:{n}: {e}"),
            },
            Self::Auto => match CudaBackend::new(0) {
                Ok(b) => Ok(Opened::Cuda(Box::new(b))),
                Err(e) => {
                    if std::env::var_os("SALA_QUIET_DEVICE").is_none() {
                        eprintln!("note: running on the CPU ({e})");
                    }
                    Ok(Opened::Cpu(CpuBackend))
                }
            },
        }
    }
}

/// What the benchmark needs to know of a backend beyond the model ops.
pub trait DeviceStats {
    /// Bytes of device memory in use now (all processes), when the device reports it.
    fn memory_in_use(&self) -> Option<usize>;
    fn total_memory(&self) -> Option<usize>;
    /// Time the host spent waiting for the device so far.
    fn host_wait(&self) -> Option<std::time::Duration>;
    /// Per-kernel (name, device ms, launches) since the last call, when profiling is on.
    fn profile(&self) -> Option<Vec<(String, f64, usize)>> {
        None
    }
}

impl DeviceStats for CpuBackend {
    fn memory_in_use(&self) -> Option<usize> {
        None
    }
    fn total_memory(&self) -> Option<usize> {
        None
    }
    fn host_wait(&self) -> Option<std::time::Duration> {
        None
    }
}

impl DeviceStats for CudaBackend {
    fn memory_in_use(&self) -> Option<usize> {
        self.memory().ok().map(|m| m.0)
    }
    fn total_memory(&self) -> Option<usize> {
        self.memory().ok().map(|m| m.1)
    }
    fn host_wait(&self) -> Option<std::time::Duration> {
        Some(CudaBackend::host_wait(self))
    }
    fn profile(&self) -> Option<Vec<(String, f64, usize)>> {
        self.profile_report()
    }
}
