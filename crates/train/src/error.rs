//! [`TrainError`]: why a training run stopped, and whether a restart can cure it.

use lockstep_comm::exact::ExactError;
use lockstep_comm::CommError;

use crate::checkpoint::CheckpointError;
use crate::outcome::ReplicaError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("gradient synchronisation at step {step}: {cause}")]
    Sync { step: u64, cause: ExactError },
    #[error(transparent)]
    Data(#[from] lockstep_data::DataError),
    #[error(transparent)]
    Model(#[from] lockstep_model::ModelError),
    #[error("model structure differs between ranks: rank {rank} has {theirs}, rank 0 has {ours} (same config and binary on every worker?)")]
    ModelMismatch {
        rank: usize,
        theirs: String,
        ours: String,
    },
    #[error("rank {rank} multiplies matrices with the {theirs} kernels, rank 0 with {ours}: ranks with different kernel sets give different bits (use the same CPU model on every host, or build lockstep with `-p lockstep-cli --no-default-features` everywhere to pin the FMA kernels)")]
    KernelMismatch {
        rank: usize,
        theirs: String,
        ours: String,
    },
    #[error(
        "replicas diverged: rank {rank} ended with parameter hash {theirs}, rank 0 with {ours}"
    )]
    Diverged {
        rank: usize,
        theirs: String,
        ours: String,
    },
    #[error(
        "dataset `{dataset}` has {have} training samples, fewer than one global batch (train.global_batch = {need})"
    )]
    TooSmall {
        dataset: String,
        have: usize,
        need: usize,
    },
    #[error(
        "dataset `{dataset}`: the validation text has {chars} characters, too short for one \
         window of model.context = {context} characters (it needs at least {})",
        context + 1
    )]
    ValidationTooShort {
        dataset: String,
        chars: usize,
        context: usize,
    },
    #[error("writing {path}: {cause}")]
    Io { path: String, cause: std::io::Error },
    #[error("{path}, line {line}: not a step record ({what}); repair or remove that line")]
    CorruptMetrics {
        path: String,
        line: usize,
        what: String,
    },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("rank 0 could not load the checkpoint to resume from (see its error)")]
    ResumeFailed,
    #[error("job `{job}`: opening the {split} data: {message}")]
    JobData {
        job: String,
        split: &'static str,
        message: String,
    },
    #[error("job `{job}`: {message}")]
    JobSetup { job: String, message: String },
    #[error("job `{job}`, step {step}, micro-batch {microbatch} (samples {first}..{end} of the global batch): {cause}", step = step + 1, first = samples.start, end = samples.end)]
    Job {
        job: String,
        /// Counting from 0 (shown from 1, as in the progress lines).
        step: u64,
        microbatch: usize,
        samples: std::ops::Range<usize>,
        cause: ReplicaError,
    },
    #[error("job `{job}`, evaluation after step {step}: {cause}")]
    JobEval {
        job: String,
        step: u64,
        cause: ReplicaError,
    },
}

impl TrainError {
    /// Micro-batch `k` of `step` (micro-batches of `size` samples) failed in the user's job.
    pub(crate) fn microbatch(
        job: impl Into<String>,
        step: u64,
        k: usize,
        size: usize,
        cause: ReplicaError,
    ) -> Self {
        TrainError::Job {
            job: job.into(),
            step,
            microbatch: k,
            samples: k * size..(k + 1) * size,
            cause,
        }
    }

    /// Failures that a restart cannot cure: the input is wrong (config, data, model, a checkpoint
    /// of another run) or the disk is full. The launcher ends the job instead of retrying.
    pub fn is_permanent(&self) -> bool {
        match self {
            TrainError::Data(_)
            | TrainError::Config(_)
            | TrainError::Model(_)
            | TrainError::ModelMismatch { .. }
            | TrainError::KernelMismatch { .. }
            | TrainError::TooSmall { .. }
            | TrainError::ValidationTooShort { .. }
            | TrainError::ResumeFailed
            | TrainError::CorruptMetrics { .. }
            | TrainError::JobData { .. }
            | TrainError::JobSetup { .. }
            | TrainError::Job { .. }
            | TrainError::JobEval { .. }
            | TrainError::Checkpoint(CheckpointError::Mismatch { .. })
            | TrainError::Checkpoint(CheckpointError::NoSpace { .. }) => true,
            TrainError::Checkpoint(CheckpointError::NotRegular { .. }) => true,
            // A shared-memory name another user holds: every attempt would meet it.
            TrainError::Comm(c) => c.is_permanent(),
            TrainError::Io { cause, .. } => {
                crate::files::is_no_space(cause) || crate::files::is_not_regular(cause)
            }
            _ => false,
        }
    }
}
