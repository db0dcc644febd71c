//! What a training job is, as the drivers see it.
//!
//! Two levels, both public:
//! - [`Job`] (in `burn_job.rs`): what a burn user writes — an ordinary single-device burn
//!   `Module`, burn `Dataset`s, a batch function, a loss per micro-batch and optional metrics.
//!   Every `Job` is a [`JobSpec`] through a blanket implementation.
//! - [`JobSpec`] + [`Replica`]: the flat interface the data-parallel step driver trains: one
//!   model replica per rank behind `Vec<f32>` parameters, computing the loss and gradient of a
//!   micro-batch given by sample indices; a user who needs that control (streaming gradients
//!   during backward for `dist.overlap`) can implement it directly.
//! - [`LayeredJob`] / [`StagedJob`] through [`Pipelined`]: a model as a sequence of layers, for
//!   pipelines, ZeRO 3 layer by layer and overlap; the built-in MLP/CNN are one.
//!
//! The driver never sees burn: it moves sample indices in and flat gradients out, so the
//! reproducibility rules (fixed micro-batches, exact sums, elementwise optimizers) hold for every
//! job alike.

mod activation;
mod burn_job;
mod layered_job;
mod staged_job;

pub use activation::{Activation, ActivationError, Part, PartKind, Parts};
pub use burn_job::{BoxError, BurnReplica, Job, LossReduction};
pub use layered_job::{BurnLayered, LayeredJob, Pipelined};
pub use staged_job::StagedJob;

pub(crate) use crate::outcome::catch_job_panic;
pub use crate::outcome::{Computed, EvalSums, ReplicaError};
pub use crate::replica::Replica;

use crate::config::{ConfigError, ConfigSections, TrainConfig};
use crate::device::Placement;
use crate::TrainError;
use lockstep_run::ModelShape;

/// A job as the CLI and the drivers handle it (object safe).
pub trait JobSpec: Send + Sync {
    /// Short name used in errors, logs and reports (e.g. `own-cnn`).
    fn name(&self) -> String;
    /// What `cfg` trains, for messages (the built-in job says which model on which data).
    fn label(&self, _cfg: &TrainConfig) -> String {
        self.name()
    }
    /// Whether evaluation figures are per predicted character (a character-level language
    /// model) rather than per sample; only changes how they are worded.
    fn evaluates_per_character(&self, _cfg: &TrainConfig) -> bool {
        false
    }
    /// The job's default configuration, TOML (sections of lockstep's config and the job's own
    /// `[job]` table); `--config` and `--set` apply on top of it.
    fn default_config(&self) -> String {
        String::new()
    }
    /// What the job's model can do, as far as the layout is concerned, known before it is built
    /// (the parallel plan refuses what it cannot do). Default: a model trained whole that does
    /// not stream gradients, as a user's `Job`.
    fn shape(&self, _cfg: &TrainConfig) -> ModelShape {
        flat_job_shape(false)
    }
    /// How the binary presents itself on its command line (`--help`, `--version`); `None`: as
    /// lockstep (the built-in jobs). A user's `Job` or `LayeredJob` presents itself by its name,
    /// with its `about` and `version`.
    fn binary(&self) -> Option<BinaryAbout> {
        None
    }
    /// The model holding `params` (a checkpoint's, canonical flat order) as burn record bytes
    /// that the job's own module type loads with `load_file` (`export`); `None`: the job's model
    /// is no burn module (lockstep's built-in models).
    fn model_record(
        &self,
        _cfg: &TrainConfig,
        _params: &[f32],
    ) -> Option<Result<Vec<u8>, TrainError>> {
        None
    }
    /// The job's hook on the training loop's events in rank 0's worker: each evaluation
    /// ([`Event::Evaluated`](crate::Event::Evaluated)), each checkpoint on disk
    /// ([`Event::Checkpointed`](crate::Event::Checkpointed)), progress, resumption. Default:
    /// nothing. Called through [`JobSpec::hook`], which turns a panic into an error.
    fn on_event(&self, _event: &crate::Event) {}
    /// [`JobSpec::on_event`] with a panic caught: its message, as the job's code reported it.
    fn hook(&self, event: &crate::Event) -> Result<(), String> {
        catch_job_panic(|| self.on_event(event))
    }
    /// Which config sections the job reads (the run's config.toml shows those). Default: lockstep's
    /// own and `[job]` (a user's job); lockstep's built-in models read `[model]` and `[data]` too.
    fn config_sections(&self) -> ConfigSections {
        ConfigSections::JobOwn
    }
    /// Checks the whole config: lockstep's sections ([`ConfigLoad::validate_common`](crate::ConfigLoad::validate_common), or the
    /// built-in jobs' stricter [`ConfigLoad::validate_builtin`](crate::ConfigLoad::validate_builtin)) and the job's own settings.
    fn validate(&self, cfg: &TrainConfig) -> Result<(), ConfigError>;
    /// Builds this rank's replica: model initialised from `train.seed` (rank 0's copy is then
    /// broadcast) on `device` (the worker's `train.device`), datasets opened.
    fn build(&self, cfg: &TrainConfig, device: &Placement) -> Result<Trainable<'_>, TrainError>;
}

/// How a user's binary presents itself: `my-job --help` and `my-job --version`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BinaryAbout {
    /// One line on what it trains (empty: a default naming the job).
    pub about: String,
    /// The job's version (empty: only lockstep's is shown).
    pub version: String,
}

/// The shape of a user's `Job` (trained whole, no streamed gradients), with how to lay it out,
/// and whether its products take `train.precision`.
pub fn flat_job_shape(bf16_products: bool) -> ModelShape {
    ModelShape::Flat {
        streams_gradients: false,
        bf16_products,
        to_layer: "implement lockstep::LayeredJob (a model written as a sequence of layers) and \
                   run lockstep::main(lockstep::Pipelined(job))"
            .into(),
    }
}

/// What [`JobSpec::build`] returns.
pub enum Trainable<'job> {
    /// A model replica for the data-parallel driver.
    Replica(Box<dyn Replica + 'job>),
    /// A layer-sequence model for the pipeline driver (`dp × pp`, also with one stage): the
    /// built-in transformer, or a user's [`LayeredJob`].
    Layered(Box<dyn crate::pipeline::layered::Layered + 'job>),
}
