//! What the pipeline driver trains: a model that is a sequence of layers ([`Layered`]), cut into
//! contiguous stages ([`LayerStage`]) between which only plain `f32` activations and their
//! gradients travel.
//!
//! Two implementations: lockstep's character-level transformer (`transformer.rs`) and any user
//! `LayeredJob` (`job/layered_job.rs`). The driver never sees burn or the data: it
//! hands a stage the sample indices of each micro-batch, the received activations, and gets back
//! activations, a loss, input gradients and flat parameter gradients.

use std::ops::Range;

use lockstep_model::PieceSum;

use crate::error::TrainError;
use crate::outcome::{EvalSums, ReplicaError};

/// Where a stage that holds none of its parameters between layers takes each layer's from, just
/// before the layer runs (ZeRO 3 per layer: an all-gather of the layer's chunks over the
/// data-parallel group). A failure's message is the stage's error; the caller keeps the cause.
pub trait LayerSource {
    /// The whole parameters of the stage's layer `k` (stage-relative), as its slice of the
    /// stage's flat vector.
    fn layer(&mut self, k: usize) -> Result<Vec<f32>, String>;
}

/// A layer-sequence model with its data, as the pipeline driver sees it (object safe).
pub trait Layered {
    /// Named in errors and messages (the job, or the built-in dataset).
    fn name(&self) -> String;
    /// Layers a pipeline may cut between.
    fn num_layers(&self) -> usize;
    /// Flat offset of each layer's first parameter, plus the total at the end
    /// (`num_layers() + 1` values): layer `l` owns `offsets[l]..offsets[l + 1]`.
    fn layer_offsets(&self) -> Vec<usize>;
    /// Architecture fingerprint (ranks and checkpoints compare it).
    fn structure_hash(&self) -> [u8; 32];
    /// The job's own optimizer update (`optimizer.kind = "custom"`); default: none.
    fn update_rule(
        &self,
        _cfg: &crate::config::TrainConfig,
    ) -> Option<std::sync::Arc<dyn lockstep_model::UpdateRule>> {
        None
    }
    /// Training samples (the sampler draws indices below this).
    fn train_len(&self) -> usize;
    /// The evaluation samples, in order (the same on every rank and layout).
    fn eval_samples(&self) -> Vec<u32>;
    /// What evaluation sums are divided by for `samples` evaluated samples (samples, or
    /// predicted characters for the language model).
    fn eval_units(&self, samples: usize) -> f64;
    /// Evaluation samples per chunk: fixed whatever the layout, so each chunk's sums have the
    /// same bits everywhere. Default: one micro-batch.
    fn eval_chunk(&self, microbatch: usize) -> usize {
        microbatch
    }
    /// The loss scale of one micro-batch: its gradient is `scale ·` the gradient of its summed
    /// loss, so that all micro-batches of a step add up to the gradient of the step's mean loss.
    fn loss_scale(&self, global_batch: usize) -> f32;
    /// Seconds of forward + backward of each layer on a micro-batch of `n` samples (balancing).
    fn profile_layers(&self, n: usize, reps: usize) -> Result<Vec<f64>, TrainError>;
    /// Output activations per sample of each layer (the plan's message sizes; 0 for the last).
    fn activation_floats(&self) -> Vec<usize>;
    /// Values per sample that a training forward of `layers` keeps in its autodiff graph until
    /// the backward (memory accounting and `lockstep plan`; an estimate). The default counts
    /// only each layer's output, a lower bound; a model that knows its saved tensors says so.
    fn held_activation_floats(&self, layers: Range<usize>) -> usize {
        let floats = self.activation_floats();
        layers.map(|l| floats.get(l).copied().unwrap_or(0)).sum()
    }
    /// A short name of each layer (messages, plan).
    fn layer_name(&self, layer: usize) -> String;
    /// Layers `layers`, initialised from `seed` exactly like the same slice of the whole model.
    fn stage(
        &self,
        layers: Range<usize>,
        seed: u64,
    ) -> Result<Box<dyn LayerStage + '_>, TrainError>;
    /// The fixed tensor-parallel pieces of each layer (1: computed whole; the built-in
    /// transformer's `model.tp_pieces`).
    fn tp_pieces(&self) -> usize {
        1
    }
    /// Parameters of `layer` split across the tensor-parallel ranks (the rest replicated on
    /// each): memory per rank in `lockstep plan`. 0 for a model without tensor parallelism.
    fn tp_split_params(&self, _layer: usize) -> usize {
        0
    }
    /// Layers `layers` as tensor-parallel rank `tp_rank` of `tp`, computing its share of the
    /// [`Layered::tp_pieces`] fixed pieces and summing them with the group's through `sum`
    /// (which can fail; the driver learns why from its own side of `sum`); initialised from
    /// `seed` like the same slices of the whole model.
    fn tp_stage(
        &self,
        layers: Range<usize>,
        seed: u64,
        tp: usize,
        tp_rank: usize,
        sum: Box<dyn PieceSum>,
    ) -> Result<Box<dyn LayerStage + '_>, TrainError> {
        let _ = (layers, seed, tp_rank, sum);
        Err(TrainError::JobSetup {
            job: self.name(),
            message: format!("this model has no tensor-parallel form (parallel.tp = {tp})"),
        })
    }
}

/// [`LayerStage::backward_streaming`] without streaming: one backward of micro-batch `id`, then
/// each layer's range of its gradient handed to `on_layer`, the last layer first.
pub fn backward_then_hand_out<S: LayerStage + ?Sized>(
    stage: &mut S,
    id: u64,
    layers: &[Range<usize>],
    on_layer: &(dyn Fn(usize, &[f32]) + Sync),
) -> Result<(), ReplicaError> {
    let mut grad = vec![0f32; layers.last().map_or(0, |r| r.end)];
    stage.backward(id, None, &mut grad)?;
    for (l, r) in layers.iter().enumerate().rev() {
        on_layer(l, &grad[r.clone()]);
    }
    Ok(())
}

/// What a training forward produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Forwarded {
    /// For the next stage.
    Activations(Vec<f32>),
    /// The scaled loss of the micro-batch (last stage).
    Loss(f32),
}

/// What an evaluation forward produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Evaluated {
    Activations(Vec<f32>),
    /// Last stage: loss and metric sums over the chunk's samples.
    Sums(EvalSums),
}

/// A contiguous range of layers on one rank, forward and backward split apart; a forward's graph
/// is kept under its micro-batch id until the matching backward.
pub trait LayerStage {
    fn is_first(&self) -> bool;
    fn is_last(&self) -> bool;
    fn num_params(&self) -> usize;
    fn params_flat(&self) -> Vec<f32>;
    fn set_params_flat(&mut self, params: &[f32]) -> Result<(), ReplicaError>;
    /// Drop the parameters until the next `set_params_flat`, if the stage can (ZeRO 3 holds only
    /// its chunk between steps). Default: keep them (a user's burn layers stay as they are).
    fn release_params(&mut self) {}
    /// Micro-batches whose forward graphs are held.
    fn held(&self) -> usize;
    /// Floats this stage receives from the previous one for `n` samples (0 on the first stage),
    /// and so sends back as their gradient.
    fn input_len(&self, n: usize) -> usize;
    /// Floats this stage sends to the next one for `n` samples (0 on the last stage), and so
    /// receives back as their gradient.
    fn output_len(&self, n: usize) -> usize;
    /// The next [`LayerStage::forward`] (or `forward_streamed`) computes a micro-batch that
    /// draws its random numbers from `draws` (per layer: [`crate::draws::DrawPart`]). Default:
    /// nothing (a stage without randomness).
    fn begin_microbatch(&mut self, _draws: crate::draws::Draws) {}
    /// Training forward of micro-batch `id` over the training samples `samples`; `input` is the
    /// previous stage's activations (`None` on the first stage). Returns the seconds spent
    /// reading data besides the result.
    fn forward(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
    ) -> Result<(Forwarded, f64), ReplicaError>;
    /// Backward of micro-batch `id`: `grad_output` from the next stage (`None` on the last);
    /// writes the stage's parameter gradients into `grad` and returns the input gradient for the
    /// previous stage (`None` on the first).
    fn backward(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        grad: &mut [f32],
    ) -> Result<Option<Vec<f32>>, ReplicaError>;
    /// Evaluation forward (nothing kept) over the evaluation samples `samples`.
    fn evaluate(
        &mut self,
        samples: &[u32],
        input: Option<&[f32]>,
    ) -> Result<Evaluated, ReplicaError>;
    /// Names of the training metrics the last stage records with each loss (default: none);
    /// the same on every stage and rank.
    fn train_metric_names(&self) -> Vec<String> {
        Vec::new()
    }
    /// The training metrics of the micro-batches whose loss this stage computed since the last
    /// call: one row of per-sample sums per micro-batch, in any order (summed exactly).
    fn take_train_metrics(&mut self) -> Vec<Vec<f32>> {
        Vec::new()
    }
    /// Ranges of the stage's canonical flat vector (its layers' slice of the whole model) whose
    /// concatenation is [`LayerStage::params_flat`]: all of it, unless a tensor-parallel rank
    /// holds only its pieces.
    fn index_map(&self) -> Vec<Range<usize>> {
        std::iter::once(0..self.num_params()).collect()
    }
    /// Buckets of the local flat gradient for the exact data-parallel sum, when the stage needs
    /// its own (`None`: the layer buckets of the canonical vector).
    fn grad_buckets(&self, bucket_elems: usize) -> Option<Vec<Range<usize>>> {
        let _ = bucket_elems;
        None
    }
    /// [`LayerStage::forward`] of a micro-batch whose backward will stream layer by layer
    /// ([`LayerStage::backward_streaming`], `dist.overlap` on one stage). A stage that streams
    /// keeps each layer's graph apart here. Default: the plain forward.
    fn forward_streamed(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        self.forward(id, samples, input, scale)
    }
    /// Backward of micro-batch `id` on a one-stage model, handing each layer's parameter
    /// gradient (the stage's local range `layers[l]`) to `on_layer(l, values)` as soon as it
    /// exists, the last layer first — bitwise what [`LayerStage::backward`] writes. Default: one
    /// backward, then every layer handed out (correct, but nothing reaches the sum early).
    fn backward_streaming(
        &mut self,
        id: u64,
        layers: &[Range<usize>],
        on_layer: &(dyn Fn(usize, &[f32]) + Sync),
    ) -> Result<(), ReplicaError> {
        backward_then_hand_out(self, id, layers, on_layer)
    }
    /// Whether the stage runs [`LayerStage::forward_from`] and [`LayerStage::backward_from`]:
    /// ZeRO 3 then gathers one layer at a time instead of the whole stage. Default: no.
    fn fetches_layers(&self) -> bool {
        false
    }
    /// [`LayerStage::forward`] with the stage's parameters released: each layer's taken from
    /// `source` just before it runs and released after (a stage that recomputes its layers).
    fn forward_from(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
        source: &mut dyn LayerSource,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        let _ = (id, samples, input, scale, source);
        Err(ReplicaError::Other(
            "this stage cannot take its layers' parameters one at a time".into(),
        ))
    }
    /// [`LayerStage::backward`] of a micro-batch that [`LayerStage::forward_from`] ran, each
    /// layer's parameters taken from `source` again.
    fn backward_from(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        grad: &mut [f32],
        source: &mut dyn LayerSource,
    ) -> Result<Option<Vec<f32>>, ReplicaError> {
        let _ = (id, grad_output, grad, source);
        Err(ReplicaError::Other(
            "this stage cannot take its layers' parameters one at a time".into(),
        ))
    }
    /// [`LayerStage::evaluate`] of several chunks (`inputs[i]` the previous stage's activations
    /// for `chunks[i]`) with the stage's parameters released: each layer's taken from `source`
    /// once for them all, every chunk run through it, then released. One result per chunk,
    /// each what `evaluate` gives it alone. With no chunk the layers are still taken (the
    /// source's gathers are collectives that every replica makes).
    fn evaluate_from(
        &mut self,
        chunks: &[&[u32]],
        inputs: &[Option<Vec<f32>>],
        source: &mut dyn LayerSource,
    ) -> Result<Vec<Evaluated>, ReplicaError> {
        let _ = (chunks, inputs, source);
        Err(ReplicaError::Other(
            "this stage cannot take its layers' parameters one at a time".into(),
        ))
    }
    /// The replica of a model trained whole (`flat.rs`), whose micro-batches are computed in one
    /// call each instead of a forward and a backward; `None` for a stage of layers.
    fn whole(&mut self) -> Option<&mut dyn crate::replica::Replica> {
        None
    }
}
