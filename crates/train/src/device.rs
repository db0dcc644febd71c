//! Where a job's model computes (`train.device`): the burn device of one worker, opened once per
//! process, and what the run reports of it.
//!
//! - `cpu`: burn's flex backend (every model kind).
//! - `wgpu`: burn's wgpu backend pinned to Vulkan (Metal on macOS). wgpu would otherwise fall
//!   back to OpenGL where Vulkan is missing; a run on another API than the one asked for is a
//!   different run, so that is refused instead. The adapter is the worker's `local_rank` modulo
//!   the machine's adapters (hardware ones first, then software ones such as Mesa's llvmpipe).
//! - `cuda`: GPU `local_rank mod count`, where count honours `CUDA_VISIBLE_DEVICES` (the driver
//!   applies it). Several workers may share one GPU.
//! - `auto`: CUDA where built in and present, else a hardware wgpu adapter, else the CPU.
//!
//! A device the binary was built without, or one the machine lacks, is a [`DeviceError`]; the
//! launcher probes the device before any worker starts (exit 3), so no run silently trains on
//! another backend than the one asked for.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use burn::tensor::{Device, Tensor};
use lockstep_run::config::DeviceKind;
use serde::{Deserialize, Serialize};

/// What the run reports of one rank's device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// The device the worker computes on: `cpu`, `wgpu` or `cuda` (`auto` resolved).
    pub kind: DeviceKind,
    /// burn's backend and, for wgpu, the graphics API: "flex", "wgpu/vulkan", "cuda".
    pub backend: String,
    /// The adapter or GPU's own name ("llvmpipe (LLVM 15.0.6, 256 bits)", "NVIDIA H100 …"),
    /// the CPU's model for `cpu`.
    pub adapter: String,
    /// Which of the machine's adapters or GPUs (0 for the CPU).
    pub index: usize,
}

impl DeviceInfo {
    /// "wgpu/vulkan 0: llvmpipe (LLVM 15.0.6, 256 bits)" for logs and reports.
    pub fn describe(&self) -> String {
        format!("{} {}: {}", self.backend, self.index, self.adapter)
    }
}

/// A device that cannot be used, naming the setting.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DeviceError {
    #[error(
        "train.device = \"{asked}\": this binary was built without burn's `{feature}` backend \
         (build it with `--features {feature}`)"
    )]
    NotBuilt {
        asked: DeviceKind,
        feature: &'static str,
    },
    #[error("train.device = \"{asked}\": {reason}")]
    Unavailable { asked: DeviceKind, reason: String },
}

/// One worker's device: burn's autodiff device on it and what it is.
#[derive(Debug, Clone)]
pub struct Placement {
    device: Device,
    pub info: DeviceInfo,
}

impl Placement {
    /// The CPU (flex): the default.
    pub fn cpu() -> Placement {
        Placement {
            device: Device::flex(),
            info: DeviceInfo {
                kind: DeviceKind::Cpu,
                backend: "flex".into(),
                adapter: cpu_model().unwrap_or_else(|| "cpu".into()),
                index: 0,
            },
        }
    }

    /// The device of the worker with `local_rank` on this host, opened once per process.
    pub fn open(asked: DeviceKind, local_rank: usize) -> Result<Placement, DeviceError> {
        static OPENED: Mutex<Option<HashMap<(DeviceKind, usize), Placement>>> = Mutex::new(None);
        let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        let opened = opened.get_or_insert_with(HashMap::new);
        if let Some(p) = opened.get(&(asked, local_rank)) {
            return Ok(p.clone());
        }
        let placement = match asked {
            DeviceKind::Cpu => Placement::cpu(),
            DeviceKind::Wgpu => backends::wgpu(local_rank, false)?,
            DeviceKind::Cuda => backends::cuda(local_rank)?,
            DeviceKind::Auto => backends::cuda(local_rank)
                .or_else(|_| backends::wgpu(local_rank, true))
                .unwrap_or_else(|_| Placement::cpu()),
        };
        placement.check(asked)?;
        opened.insert((asked, local_rank), placement.clone());
        Ok(placement)
    }

    /// Whether `asked` can be opened here, without opening it (the launcher's check before any
    /// worker starts: a CUDA context or a wgpu runtime in the launcher would be held for the
    /// whole run).
    pub fn probe(asked: DeviceKind) -> Result<(), DeviceError> {
        match asked {
            DeviceKind::Cpu | DeviceKind::Auto => Ok(()),
            DeviceKind::Wgpu => backends::wgpu_probe(),
            DeviceKind::Cuda => backends::cuda_count().map(|_| ()),
        }
    }

    /// The autodiff device seeded with `seed`, so that burn's initialisers give the same values
    /// on every run and every rank.
    pub fn seeded(&self, seed: u64) -> Device {
        let device = self.device.clone().autodiff();
        device.seed(seed);
        device
    }

    /// A tensor made and read back: a device that cannot compute says so here, not mid-run.
    fn check(&self, asked: DeviceKind) -> Result<(), DeviceError> {
        let device = self.device.clone();
        let result = crate::outcome::catch_job_panic(move || {
            Tensor::<1>::from_floats([1.0f32, 2.0], &device)
                .sum()
                .into_data()
                .try_to_vec::<f32>()
        });
        match result {
            Ok(Ok(v)) if v == [3.0] => Ok(()),
            Ok(Ok(v)) => Err(unavailable(
                asked,
                format!("1 + 2 gave {v:?} on {}", self.info.describe()),
            )),
            Ok(Err(e)) => Err(unavailable(
                asked,
                format!("reading back from {}: {e:?}", self.info.describe()),
            )),
            Err(panic) => Err(unavailable(
                asked,
                format!("{}: {panic}", self.info.describe()),
            )),
        }
    }
}

/// Nanoseconds this process spent reading gradients off the model's device since the last
/// [`take_copy_seconds`] (one worker per process).
static COPY_NANOS: AtomicU64 = AtomicU64::new(0);

/// Read gradients off `device` with `read`, timed as a device copy: the device finishes its
/// queued work first (counted as the caller's compute), so the time is the copy alone.
pub(crate) fn copy_from<T>(device: &Device, read: impl FnOnce() -> T) -> T {
    let _ = device.sync();
    timed_copy(read)
}

/// Run `copy` (a transfer between the model's device and the host), timed as a device copy.
pub(crate) fn timed_copy<T>(copy: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let out = copy();
    COPY_NANOS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    out
}

/// Seconds of device copies since the last call (the step driver's `device_copy` phase).
pub(crate) fn take_copy_seconds() -> f64 {
    COPY_NANOS.swap(0, Ordering::Relaxed) as f64 * 1e-9
}

fn unavailable(asked: DeviceKind, reason: String) -> DeviceError {
    DeviceError::Unavailable { asked, reason }
}

/// `asked` needs a cargo feature this binary was built without.
#[allow(dead_code)] // unused when both backends are built in
fn not_built(asked: DeviceKind, feature: &'static str) -> DeviceError {
    DeviceError::NotBuilt { asked, feature }
}

/// The CPU's model name (`model name` in /proc/cpuinfo), where the system says it.
pub fn cpu_model() -> Option<String> {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
}

/// A failed dynamic load's message without the list of every library name tried (cudarc names
/// about thirty), which would bury the one line that matters.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn library_search_dropped(message: &str) -> &str {
    message
        .split_once(" - searched for library names")
        .map_or(message, |(first, _)| first)
}

#[cfg(feature = "wgpu")]
mod wgpu_backend;

mod backends {
    #[allow(unused_imports)]
    use super::{not_built, unavailable, DeviceError, DeviceKind, Placement};

    #[cfg(feature = "wgpu")]
    pub(super) fn wgpu(local_rank: usize, hardware_only: bool) -> Result<Placement, DeviceError> {
        super::wgpu_backend::open(local_rank, hardware_only)
    }

    #[cfg(feature = "wgpu")]
    pub(super) fn wgpu_probe() -> Result<(), DeviceError> {
        super::wgpu_backend::find(0, false).map(|_| ())
    }

    #[cfg(not(feature = "wgpu"))]
    pub(super) fn wgpu(_: usize, _: bool) -> Result<Placement, DeviceError> {
        Err(not_built(DeviceKind::Wgpu, "wgpu"))
    }

    #[cfg(not(feature = "wgpu"))]
    pub(super) fn wgpu_probe() -> Result<(), DeviceError> {
        Err(not_built(DeviceKind::Wgpu, "wgpu"))
    }

    /// The GPUs the CUDA driver shows this process (after `CUDA_VISIBLE_DEVICES`).
    #[cfg(feature = "cuda")]
    pub(super) fn cuda_count() -> Result<usize, DeviceError> {
        let count = crate::outcome::catch_job_panic(|| {
            cudarc::driver::result::init()?;
            cudarc::driver::result::device::get_count()
        });
        let why = match count {
            Ok(Ok(n)) if n > 0 => return Ok(n as usize),
            Ok(Ok(_)) => "the machine has no CUDA GPU (CUDA_VISIBLE_DEVICES may hide them)".into(),
            Ok(Err(e)) => format!("the CUDA driver found no usable GPU: {e}"),
            Err(panic) => format!(
                "no CUDA driver on this machine ({}; if the NVIDIA driver is installed, put the \
                 directory of libcuda.so on LD_LIBRARY_PATH)",
                super::library_search_dropped(&panic)
            ),
        };
        Err(unavailable(DeviceKind::Cuda, why))
    }

    #[cfg(not(feature = "cuda"))]
    pub(super) fn cuda_count() -> Result<usize, DeviceError> {
        Err(not_built(DeviceKind::Cuda, "cuda"))
    }

    #[cfg(feature = "cuda")]
    pub(super) fn cuda(local_rank: usize) -> Result<Placement, DeviceError> {
        use super::{Device, DeviceInfo};
        let index = local_rank % cuda_count()?;
        let adapter = cudarc::driver::result::device::get(index as i32)
            .and_then(cudarc::driver::result::device::get_name)
            .unwrap_or_else(|e| format!("CUDA device {index} ({e})"));
        Ok(Placement {
            device: Device::cuda(index),
            info: DeviceInfo {
                kind: DeviceKind::Cuda,
                backend: "cuda".into(),
                adapter,
                index,
            },
        })
    }

    #[cfg(not(feature = "cuda"))]
    pub(super) fn cuda(_: usize) -> Result<Placement, DeviceError> {
        Err(not_built(DeviceKind::Cuda, "cuda"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_opens_and_names_its_model() {
        let p = Placement::open(DeviceKind::Cpu, 3).unwrap();
        assert_eq!(p.info.kind, DeviceKind::Cpu);
        assert_eq!(p.info.backend, "flex");
        assert!(!p.info.adapter.is_empty());
        // auto without an accelerator in this build is the CPU.
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        assert_eq!(Placement::open(DeviceKind::Auto, 0).unwrap().info, p.info);
    }

    #[test]
    fn a_missing_library_is_named_without_every_name_tried() {
        let cudarc = r#"Unable to dynamically load the "cuda" shared library - searched for library names: ["libcuda.so", "libcuda.so.1"]. Ensure that `LD_LIBRARY_PATH` has the correct path"#;
        assert_eq!(
            library_search_dropped(cudarc),
            r#"Unable to dynamically load the "cuda" shared library"#
        );
        assert_eq!(library_search_dropped("no device"), "no device");
    }

    #[test]
    fn a_backend_left_out_of_the_build_is_named() {
        #[cfg(not(feature = "cuda"))]
        {
            let e = Placement::open(DeviceKind::Cuda, 0)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("train.device = \"cuda\"") && e.contains("--features cuda"),
                "{e}"
            );
        }
        #[cfg(not(feature = "wgpu"))]
        {
            let e = Placement::open(DeviceKind::Wgpu, 0)
                .unwrap_err()
                .to_string();
            assert!(e.contains("--features wgpu"), "{e}");
        }
    }
}
