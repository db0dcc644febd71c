//! The run's length and optimizer, from the config.

use lockstep_data::Sampler;
use lockstep_model::OptimizerSpec;

use crate::config::{OptimizerKind, TrainConfig};
use crate::error::TrainError;

/// Step records reserved up front (more are added as the run goes; a run's length is no reason
/// to allocate its records before the first step).
pub(crate) const RECORDS_RESERVED: usize = 4096;

/// Steps of the run: `train.steps`, or `train.epochs` passes over a dataset the sampler covers —
/// refused, naming `train.epochs`, when that is more than [`crate::limits::MAX_STEPS`].
pub(crate) fn total_steps(cfg: &TrainConfig, sampler: &Sampler) -> Result<u64, TrainError> {
    let t = &cfg.train;
    if t.steps > 0 {
        return Ok(t.steps);
    }
    let per_epoch = sampler.steps_per_epoch() as u64;
    match t.epochs.checked_mul(per_epoch) {
        Some(n) if n <= crate::limits::MAX_STEPS => Ok(n),
        _ => Err(crate::config::ConfigError::Invalid {
            field: "train.epochs",
            message: format!(
                "{} epochs of {per_epoch} steps exceed the limit of {} steps",
                t.epochs,
                crate::limits::MAX_STEPS
            ),
        }
        .into()),
    }
}

pub fn optimizer_spec(cfg: &TrainConfig) -> OptimizerSpec {
    let o = &cfg.optimizer;
    match o.kind {
        OptimizerKind::Adam => OptimizerSpec::Adam {
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
        },
        OptimizerKind::AdamW => OptimizerSpec::AdamW {
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
        },
        // The rule itself comes from the job (`Ledger::optimizer`).
        OptimizerKind::Custom => OptimizerSpec::Custom {
            name: "custom".into(),
        },
        OptimizerKind::Sgd => OptimizerSpec::Sgd {
            momentum: o.momentum,
            weight_decay: o.weight_decay,
            nesterov: o.nesterov,
        },
    }
}
