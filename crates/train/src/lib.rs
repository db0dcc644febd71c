//! lockstep-train: data-parallel training applied from outside to single-device models.
//!
//! Invariant: nothing here reads argv or environment variables; the CLI resolves those and passes
//! a [`TrainConfig`] and a ready [`lockstep_comm::Communicator`].

pub mod builtin;
pub mod checkpoint;
mod clip;
/// The config types and their TOML mechanics (`lockstep-run`); [`ConfigLoad`] loads them for a job.
pub use lockstep_run::config;
/// Step records and the summary (`lockstep-run`).
pub use lockstep_run::metrics;
/// Rank ↔ (replica, stage, tp rank) (`lockstep-run`).
pub use lockstep_run::parallel_dims;
pub mod context;
pub mod datasets;
pub mod device;
pub mod draws;
pub mod error;
pub mod export;
pub mod faults;
pub mod files;
pub mod grad_parts;
pub mod grad_sync;
pub mod job;
pub mod limits;
pub mod memory;
mod model_spec;
pub mod outcome;
pub mod pipeline;
pub mod precision;
pub mod replica;
mod run;
pub mod trainer;
mod validation;
pub mod zero;

pub use builtin::BuiltinJob;
pub use config::{ConfigError, TrainConfig};
pub use context::{Event, JobLabel, Progress, WorkerContext};
pub use error::TrainError;
pub use job::{Job, JobSpec, LayeredJob, Pipelined, Replica, ReplicaError};
pub use metrics::{StepRecord, Summary};
pub use parallel_dims::{Coords, ParallelDims};
pub use run::checkpointing::checkpoint_dir;
pub use run::outputs::write_atomic;
pub use trainer::train;
pub use validation::ConfigLoad;
