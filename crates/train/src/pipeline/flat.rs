//! A model trained whole (a [`Replica`]: a user's `Job`) as a
//! [`Layered`] model of one layer, so that the one training loop (`train.rs`) trains it like any
//! other: data parallelism is a schedule of one stage.
//!
//! Its stage is computed whole ([`LayerStage::whole`]): each micro-batch's forward and backward
//! are one call of the replica, writing the gradient straight into the rank's gradient part (no
//! copy), and the last one can stream its gradients into an overlapped sum (`dist.overlap`). Its
//! evaluation keeps the fixed chunks of [`EVAL_CHUNK`] samples a model trained whole always had.

use std::cell::{RefCell, RefMut};
use std::ops::Range;

use super::layered::{Evaluated, Forwarded, LayerStage, Layered};
use crate::error::TrainError;
use crate::outcome::ReplicaError;
use crate::replica::Replica;

/// Evaluation samples per chunk of a model trained whole: a chunk's sums are computed in one
/// call, in float, so chunks are fixed whatever the world size and only whole chunks are shared.
pub const EVAL_CHUNK: usize = 512;

/// A replica seen as one layer.
pub struct FlatModel<'j> {
    name: String,
    replica: RefCell<Box<dyn Replica + 'j>>,
    len: usize,
    hash: [u8; 32],
    train_len: usize,
    eval_len: usize,
    /// Activation values one training sample keeps until its backward.
    held_per_sample: usize,
}

impl<'j> FlatModel<'j> {
    pub fn new(name: &str, replica: Box<dyn Replica + 'j>) -> Result<Self, TrainError> {
        if replica.eval_len() == 0 {
            return Err(TrainError::JobSetup {
                job: name.to_string(),
                message: "the evaluation dataset is empty".into(),
            });
        }
        Ok(FlatModel {
            name: name.to_string(),
            len: replica.layout().iter().map(|p| p.len).sum(),
            hash: replica.structure_hash(),
            train_len: replica.train_len(),
            eval_len: replica.eval_len(),
            held_per_sample: (replica.activation_bytes(1) / 4) as usize,
            replica: RefCell::new(replica),
        })
    }
}

impl Layered for FlatModel<'_> {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn num_layers(&self) -> usize {
        1
    }

    fn layer_offsets(&self) -> Vec<usize> {
        vec![0, self.len]
    }

    fn structure_hash(&self) -> [u8; 32] {
        self.hash
    }

    fn update_rule(
        &self,
        cfg: &crate::config::TrainConfig,
    ) -> Option<std::sync::Arc<dyn lockstep_model::UpdateRule>> {
        self.replica.borrow().update_rule(cfg)
    }

    fn train_len(&self) -> usize {
        self.train_len
    }

    fn eval_samples(&self) -> Vec<u32> {
        (0..self.eval_len as u32).collect()
    }

    fn eval_units(&self, samples: usize) -> f64 {
        samples as f64
    }

    fn eval_chunk(&self, _microbatch: usize) -> usize {
        EVAL_CHUNK
    }

    fn loss_scale(&self, global_batch: usize) -> f32 {
        1.0 / global_batch as f32
    }

    fn profile_layers(&self, _n: usize, _reps: usize) -> Result<Vec<f64>, TrainError> {
        // One layer: nothing to balance.
        Ok(vec![1.0])
    }

    fn activation_floats(&self) -> Vec<usize> {
        vec![0]
    }

    fn held_activation_floats(&self, _layers: Range<usize>) -> usize {
        self.held_per_sample
    }

    fn layer_name(&self, _layer: usize) -> String {
        self.name.clone()
    }

    fn stage(
        &self,
        _layers: Range<usize>,
        _seed: u64,
    ) -> Result<Box<dyn LayerStage + '_>, TrainError> {
        let replica = self
            .replica
            .try_borrow_mut()
            .map_err(|_| TrainError::JobSetup {
                job: self.name.clone(),
                message: "the model trained whole has one stage, and it is taken".into(),
            })?;
        Ok(Box::new(FlatStage {
            replica,
            len: self.len,
        }))
    }
}

/// The one stage of a [`FlatModel`]: the whole replica.
struct FlatStage<'a, 'j> {
    replica: RefMut<'a, Box<dyn Replica + 'j>>,
    len: usize,
}

/// Forward and backward of a model trained whole are one call ([`LayerStage::whole`]); the split
/// calls of a pipeline stage are not used for it.
fn computed_whole() -> ReplicaError {
    ReplicaError::Other("a model trained whole computes forward and backward in one call".into())
}

impl LayerStage for FlatStage<'_, '_> {
    fn is_first(&self) -> bool {
        true
    }

    fn is_last(&self) -> bool {
        true
    }

    fn num_params(&self) -> usize {
        self.len
    }

    fn params_flat(&self) -> Vec<f32> {
        self.replica.params_flat()
    }

    fn set_params_flat(&mut self, params: &[f32]) -> Result<(), ReplicaError> {
        self.replica.set_params_flat(params)
    }

    fn held(&self) -> usize {
        0
    }

    fn input_len(&self, _n: usize) -> usize {
        0
    }

    fn output_len(&self, _n: usize) -> usize {
        0
    }

    fn forward(
        &mut self,
        _id: u64,
        _samples: &[u32],
        _input: Option<&[f32]>,
        _scale: f32,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        Err(computed_whole())
    }

    fn backward(
        &mut self,
        _id: u64,
        _grad_output: Option<&[f32]>,
        _grad: &mut [f32],
    ) -> Result<Option<Vec<f32>>, ReplicaError> {
        Err(computed_whole())
    }

    fn evaluate(
        &mut self,
        samples: &[u32],
        _input: Option<&[f32]>,
    ) -> Result<Evaluated, ReplicaError> {
        Ok(Evaluated::Sums(self.replica.evaluate(samples)?))
    }

    fn train_metric_names(&self) -> Vec<String> {
        self.replica.train_metric_names()
    }

    fn take_train_metrics(&mut self) -> Vec<Vec<f32>> {
        self.replica.take_train_metrics()
    }

    fn whole(&mut self) -> Option<&mut dyn Replica> {
        Some(&mut **self.replica)
    }
}
