//! lockstep-run: what a run is, as plain data — its configuration ([`config::TrainConfig`]: the
//! types, the TOML mechanics and the checks that need nothing but the config), its layout
//! ([`parallel_dims::ParallelDims`]) and its parallel plan ([`layout::ParallelPlan`]: every
//! capability rule in one place), what it records ([`metrics`]: step records and the
//! summary) and the formula for its memory per rank ([`memory`]).
//!
//! No tensors and no burn: the report, the scaling comparison and `lockstep plan` read runs
//! through this crate alone; `lockstep-train` adds what needs a model (loading a job's config
//! with its own checks and the memory limits, counting a loop's buffers).

pub mod config;
pub mod layout;
pub mod memory;
pub mod metrics;
pub mod parallel_dims;
pub mod read;
pub mod tensorboard;

pub use config::{ConfigError, ConfigSections, TrainConfig};
pub use layout::{ModelShape, ParallelPlan};
pub use metrics::{StepRecord, Summary};
pub use parallel_dims::{Coords, ParallelDims};
