//! [`Replica`]: one rank's copy of a model trained whole, as every driver sees it (a leaf: the
//! job adapters implement it, the training loop's one-stage case runs it).

use std::sync::Arc;

use lockstep_model::{ParamInfo, UpdateRule};

use crate::config::TrainConfig;

use crate::draws::Draws;
use crate::outcome::{Computed, EvalSums, ReplicaError};

/// One rank's copy of the model with its data, behind flat parameters in a canonical order that
/// is the same on every process (never keyed by burn's random `ParamId`s).
pub trait Replica {
    /// Samples in the training set (the sampler draws indices below this).
    fn train_len(&self) -> usize;
    /// Samples in the evaluation set.
    fn eval_len(&self) -> usize;
    /// Name, shape and flat position of every parameter tensor, in canonical order.
    fn layout(&self) -> Vec<ParamInfo>;
    /// Architecture fingerprint: ranks refuse to train together when theirs differ, and a
    /// checkpoint of another architecture is refused.
    fn structure_hash(&self) -> [u8; 32];
    /// All parameters, canonical order.
    fn params_flat(&self) -> Vec<f32>;
    /// Replace all parameters (canonical order).
    fn set_params_flat(&mut self, params: &[f32]) -> Result<(), ReplicaError>;
    /// The next training micro-batch draws its random numbers (dropout, augmentation) from
    /// `draws`: called before each [`Replica::loss_and_grad`] (or its streaming form), so that
    /// they do not depend on which rank computes it. Default: nothing (a model without
    /// randomness). A burn job's replica reseeds its device ([`Draws::seed`]).
    fn begin_microbatch(&mut self, _draws: Draws) {}
    /// Forward and backward on the training samples `samples` (one micro-batch): writes
    /// `scale · d(mean loss · n)/d(params)`, i.e. the gradient of the micro-batch's share of the
    /// global batch's mean loss when `scale = 1 / global_batch`, into `grad_out`, and returns
    /// that scaled loss. Must be a pure function of the parameters and the samples.
    fn loss_and_grad(
        &mut self,
        samples: &[u32],
        scale: f32,
        grad_out: &mut [f32],
    ) -> Result<Computed, ReplicaError>;
    /// Optional (`dist.overlap`): like [`Replica::loss_and_grad`], but each parameter's gradient
    /// goes to `on_grad(index in layout, values)` as soon as backward has produced it, bitwise
    /// equal to what `loss_and_grad` writes. `None` = not supported (the config is refused).
    fn loss_and_grad_streaming(
        &mut self,
        _samples: &[u32],
        _scale: f32,
        _on_grad: &(dyn Fn(usize, &[f32]) + Sync),
    ) -> Option<Result<Computed, ReplicaError>> {
        None
    }
    /// Whether [`Replica::loss_and_grad_streaming`] is implemented.
    fn streams_gradients(&self) -> bool {
        false
    }
    /// Names of the training metrics each training micro-batch records (default: none); the same
    /// on every rank.
    fn train_metric_names(&self) -> Vec<String> {
        Vec::new()
    }
    /// The training metrics of the micro-batches computed since the last call, one row of
    /// per-sample sums (in [`Replica::train_metric_names`]' order) per micro-batch, in any
    /// order: the driver sums them exactly.
    fn take_train_metrics(&mut self) -> Vec<Vec<f32>> {
        Vec::new()
    }
    /// The job's own optimizer update (`optimizer.kind = "custom"`); default: none.
    fn update_rule(&self, _cfg: &TrainConfig) -> Option<Arc<dyn UpdateRule>> {
        None
    }
    /// Evaluation without gradients on the evaluation samples `samples`.
    fn evaluate(&mut self, samples: &[u32]) -> Result<EvalSums, ReplicaError>;
    /// Optional: an estimate of the bytes the autodiff graph of one training micro-batch of `n`
    /// samples keeps until its backward (reported as `activation_peak_bytes`); 0 = unknown.
    fn activation_bytes(&self, _n: usize) -> u64 {
        0
    }
}
