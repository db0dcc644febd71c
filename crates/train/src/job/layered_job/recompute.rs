//! `train.recompute = "layers"` on a stage of a user's layered model: a training forward keeps
//! only each layer's input (as its wire words, with the micro-batch's batch and draws), and the
//! backward runs each layer's forward again — last layer first, from the same input values with
//! the same draws — and its backward at once, handing its input's gradient to the layer before.
//! The values are those of the kept graph, and a graph cut at every layer gives the parameter
//! gradients of the whole one (as with `dist.overlap`): the same bits, with one layer's graph
//! alive at a time instead of the stage's for every micro-batch in flight.

use burn::module::Module;
use lockstep_model::flat;

use super::{dot, leaf_gradients, tensors_of, BurnStage, StagedJob};
use crate::draws::{DrawPart, Draws};
use crate::job::activation::{activation_of, float_values, parts_of, Layout};
use crate::job::burn_job::guarded;
use crate::outcome::ReplicaError;
use crate::pipeline::layered::Forwarded;

/// What a recomputed micro-batch keeps from its forward until its backward.
pub(super) struct Kept<B> {
    /// Each layer's input, as wire words.
    inputs: Vec<Vec<f32>>,
    n: usize,
    /// The micro-batch's share of the global batch (the loss's scale).
    share: f32,
    /// Its draws (later micro-batches' forwards reseed the stage in between).
    draws: Option<Draws>,
    /// Its batch (the last stage's loss reads it).
    batch: Option<B>,
}

fn other(e: impl std::fmt::Display) -> ReplicaError {
    ReplicaError::Other(e.to_string())
}

impl<J: StagedJob> BurnStage<'_, '_, J> {
    /// The training forward of micro-batch `id`, keeping only each layer's input.
    pub(super) fn forward_kept(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        let device = self.owner.device.clone();
        let n = samples.len();
        let (batch, data_seconds) = self.training_batch(samples)?;
        let (_, mut x) = self.input(batch.as_ref(), input, n, &device, false)?;
        let mut inputs = Vec::with_capacity(self.layers.len());
        // The same layers with parameters that track no gradient: autodiff records nothing (and
        // keeps nothing alive), while dropout and the like still act as in training.
        let frozen: Vec<J::Layer> = self.layers.iter().map(|l| l.clone().no_grad()).collect();
        for (i, layer) in frozen.iter().enumerate() {
            // Each layer starts from fresh tensors of its input's values: no graph reaches back.
            let words = Layout::encode(&parts_of(x)).map_err(other)?;
            let layout = &self.owner.boundaries[self.first_layer + i];
            let (parts, _) = layout.decode(&words, n, &device, false).map_err(other)?;
            inputs.push(words);
            self.reseed(DrawPart::Layer(self.first_layer + i));
            let fresh = activation_of(parts).map_err(other)?;
            x = guarded(|| self.owner.job.forward(layer, fresh))?;
        }
        let share = J::LOSS_REDUCTION.share(n, scale);
        let result = if self.last {
            let batch = batch.as_ref().expect("the last stage reads its batch");
            let (_, value) = self.scaled_loss(x, batch, share)?;
            Forwarded::Loss(value)
        } else {
            Forwarded::Activations(self.outgoing(x, n)?.0)
        };
        let draws = self.draws;
        self.kept.insert(
            id,
            Kept {
                inputs,
                n,
                share,
                draws,
                batch: if self.last { batch } else { None },
            },
        );
        Ok((result, data_seconds))
    }

    /// The backward of a kept micro-batch: each layer recomputed and differentiated, last first.
    pub(super) fn backward_kept(
        &mut self,
        kept: Kept<J::Batch>,
        grad_output: Option<&[f32]>,
        grad: &mut [f32],
    ) -> Result<Option<Vec<f32>>, ReplicaError> {
        let later = std::mem::replace(&mut self.draws, kept.draws);
        let result = self.recompute_backward(&kept, grad_output, grad);
        self.draws = later;
        result
    }

    fn recompute_backward(
        &mut self,
        kept: &Kept<J::Batch>,
        grad_output: Option<&[f32]>,
        grad: &mut [f32],
    ) -> Result<Option<Vec<f32>>, ReplicaError> {
        let device = self.owner.device.clone();
        let n = kept.n;
        // The gradient with respect to the current layer's output's float parts.
        let mut gout: Vec<Vec<f32>> = match grad_output {
            Some(g) => {
                let floats = self.out_layout.split_floats(g, n).map_err(other)?;
                floats.into_iter().map(<[f32]>::to_vec).collect()
            }
            None => Vec::new(),
        };
        let stage_start = self.owner.offsets[self.first_layer];
        for l in (0..self.layers.len()).rev() {
            let layout = &self.owner.boundaries[self.first_layer + l];
            let wants_input_grad = l > 0 || !self.first;
            let (parts, leaves) = layout
                .decode(&kept.inputs[l], n, &device, wants_input_grad)
                .map_err(other)?;
            let x = activation_of(parts).map_err(other)?;
            self.reseed(DrawPart::Layer(self.first_layer + l));
            let out = guarded(|| self.owner.job.forward(&self.layers[l], x))?;
            let seed = match (&kept.batch, l + 1 == self.layers.len()) {
                (Some(batch), true) => {
                    self.reseed(DrawPart::Loss);
                    let (loss, _) = guarded(|| self.owner.job.loss_and_metrics(out, batch))?;
                    Some(guarded(|| loss.mul_scalar(kept.share))?)
                }
                _ => {
                    let gout = gout.iter().map(Vec::as_slice);
                    dot(float_values(parts_of(out)), tensors_of(gout, &device))
                }
            };
            let range = self.owner.offsets[self.first_layer + l] - stage_start
                ..self.owner.offsets[self.first_layer + l + 1] - stage_start;
            let Some(seed) = seed else {
                // No float path from this layer's output to the loss.
                grad[range].fill(0.0);
                gout = leaves.iter().map(|t| vec![0f32; t.dims()[0]]).collect();
                continue;
            };
            let grads = guarded(|| seed.backward())?;
            gout = leaf_gradients(&leaves, &grads)?;
            crate::device::copy_from(&self.owner.device, || {
                flat::read_grads(&self.layers[l], grads, &mut grad[range])
            });
        }
        Ok((!self.first).then(|| self.in_layout.gradient_words(n, &gout)))
    }
}
