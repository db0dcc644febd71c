//! `train.recompute = "layers"` on a stage of a user's layered model: a training forward keeps
//! only each layer's input (as its wire words, with the micro-batch's batch and draws), and the
//! backward runs each layer's forward again — last layer first, from the same input values with
//! the same draws — and its backward at once, handing its input's gradient to the layer before.
//! The values are those of the kept graph, and a graph cut at every layer gives the parameter
//! gradients of the whole one (as with `dist.overlap`): the same bits, with one layer's graph
//! alive at a time instead of the stage's for every micro-batch in flight.
//!
//! With a [`LayerSource`] (ZeRO 3 one layer at a time), the stage holds no parameters: each
//! layer's are taken from the source just before the layer runs, forward and recomputed
//! backward, and released after; an evaluation takes each layer once for a group of chunks.
//!
//! On a tensor-parallel stage everything runs inside the stage's tp scope: a recomputed
//! forward sums its pieces over the group again (every tp rank recomputes the same layers in
//! the same order, so the sums meet), and a layer's parameters are this rank's pieces.

use crate::pipeline::layered::{LayerSource, Layered};
use burn::module::Module;
use lockstep_model::flat::{self, ParamInfo};

use super::{dot, leaf_gradients, tensors_of, BurnStage, StagedJob};
use crate::draws::{DrawPart, Draws};
use crate::job::activation::{activation_of, float_values, parts_of, Layout};
use crate::job::burn_job::guarded;
use crate::outcome::ReplicaError;
use crate::parallel_dims::params_per_tp_rank;
use crate::pipeline::layered::{Evaluated, Forwarded};

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
        mut source: Option<&mut dyn LayerSource>,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        let device = self.owner.device.clone();
        let n = samples.len();
        let (batch, data_seconds) = self.training_batch(samples)?;
        let (_, mut x) = self.input(batch.as_ref(), input, n, &device, false)?;
        let mut inputs = Vec::with_capacity(self.layers.len());
        for i in 0..self.layers.len() {
            if let Some(source) = source.as_deref_mut() {
                self.fetch_layer(i, source)?;
            }
            // The layer with parameters that track no gradient: autodiff records nothing (and
            // keeps nothing alive), while dropout and the like still act as in training.
            let layer = self.layers[i].clone().no_grad();
            // Each layer starts from fresh tensors of its input's values: no graph reaches back.
            let words = Layout::encode(&parts_of(x)).map_err(other)?;
            let layout = &self.owner.boundaries[self.first_layer + i];
            let (parts, _) = layout.decode(&words, n, &device, false).map_err(other)?;
            inputs.push(words);
            self.reseed(DrawPart::Layer(self.first_layer + i));
            let fresh = activation_of(parts).map_err(other)?;
            x = guarded(|| self.owner.job.forward(&layer, fresh))?;
            drop(layer);
            if source.is_some() {
                self.drop_layer(i);
            }
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
        source: Option<&mut dyn LayerSource>,
    ) -> Result<Option<Vec<f32>>, ReplicaError> {
        let later = std::mem::replace(&mut self.draws, kept.draws);
        let result = self.recompute_backward(&kept, grad_output, grad, source);
        self.draws = later;
        result
    }

    /// [`LayerStage::evaluate_from`](crate::pipeline::layered::LayerStage::evaluate_from):
    /// every chunk's input first, then each layer taken from `source`, every chunk run through
    /// it (as `evaluate` runs it: no draws, no graph), and released.
    pub(super) fn evaluate_by_layer(
        &mut self,
        chunks: &[&[u32]],
        inputs: &[Option<Vec<f32>>],
        source: &mut dyn LayerSource,
    ) -> Result<Vec<Evaluated>, ReplicaError> {
        let mut batches = Vec::with_capacity(chunks.len());
        let mut xs = Vec::with_capacity(chunks.len());
        for (samples, input) in chunks.iter().zip(inputs) {
            let (batch, x) = self.eval_input(samples, input.as_deref())?;
            batches.push(batch);
            xs.push(x);
        }
        for l in 0..self.layers.len() {
            self.fetch_layer(l, source)?;
            let layer = self.layers[l].valid();
            xs = xs
                .into_iter()
                .map(|x| guarded(|| self.owner.job.forward(&layer, x)))
                .collect::<Result<_, _>>()?;
            drop(layer);
            self.drop_layer(l);
        }
        xs.into_iter()
            .zip(&batches)
            .zip(chunks)
            .map(|((x, batch), samples)| self.evaluated(x, batch.as_ref(), samples.len()))
            .collect()
    }

    /// Layer `l`'s parameters (of the stage) written from `source`; the stage's are released.
    fn fetch_layer(&mut self, l: usize, source: &mut dyn LayerSource) -> Result<(), ReplicaError> {
        let range = self.layer_range(l);
        let values = source.layer(l).map_err(|message| {
            other(format!(
                "fetching the parameters of the stage's layer {l}: {message}"
            ))
        })?;
        if values.len() != range.len() {
            return Err(ReplicaError::ParamLength {
                what: "a fetched layer's parameters",
                expected: range.len(),
                got: values.len(),
            });
        }
        let layout: Vec<ParamInfo> = match &self.released {
            Some(all) => flat::layout_within(all, &range),
            None => {
                return Err(other(
                    "a layer fetched while the stage holds its parameters",
                ))
            }
        };
        let layer = self.layers[l].clone();
        let device = &self.owner.device;
        self.layers[l] =
            crate::device::timed_copy(|| flat::write_shaped(layer, &values, device, &layout));
        Ok(())
    }

    /// Layer `l`'s parameters released again.
    fn drop_layer(&mut self, l: usize) {
        let layer = self.layers[l].clone();
        self.layers[l] = flat::release(layer, &self.owner.device);
    }

    /// Layer `l`'s range of the stage's flat vector: of this tp rank's local one on a
    /// tensor-parallel stage (each split parameter `1/tp` of its rows).
    fn layer_range(&self, l: usize) -> std::ops::Range<usize> {
        let local_len = |layer: usize| {
            let whole = self.owner.offsets[layer + 1] - self.owner.offsets[layer];
            match &self.tp {
                Some(t) => params_per_tp_rank(whole, self.owner.tp_split_params(layer), t.tp),
                None => whole,
            }
        };
        let first = self.first_layer;
        let start: usize = (first..first + l).map(local_len).sum();
        start..start + local_len(first + l)
    }

    fn recompute_backward(
        &mut self,
        kept: &Kept<J::Batch>,
        grad_output: Option<&[f32]>,
        grad: &mut [f32],
        mut source: Option<&mut dyn LayerSource>,
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
        for l in (0..self.layers.len()).rev() {
            if let Some(source) = source.as_deref_mut() {
                self.fetch_layer(l, source)?;
            }
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
            let range = self.layer_range(l);
            match seed {
                Some(seed) => {
                    let grads = guarded(|| seed.backward())?;
                    gout = leaf_gradients(&leaves, &grads)?;
                    crate::device::copy_from(&self.owner.device, || {
                        flat::read_grads(&self.layers[l], grads, &mut grad[range])
                    });
                }
                None => {
                    // No float path from this layer's output to the loss.
                    grad[range].fill(0.0);
                    gout = leaves.iter().map(|t| vec![0f32; t.dims()[0]]).collect();
                }
            }
            if source.is_some() {
                self.drop_layer(l);
            }
        }
        Ok((!self.first).then(|| self.in_layout.gradient_words(n, &gout)))
    }
}
