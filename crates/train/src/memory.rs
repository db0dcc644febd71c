//! Per-rank memory of a training loop, counted from the buffers it holds; the figures, the goal
//! and the prediction formula are `lockstep_run::memory`'s (re-exported here).
//!
//! Why counted from the buffers: the figures in `summary.json` must follow whatever the loops
//! actually keep. A loop hands [`ModelState`] the very vectors it holds (its parameters, every
//! gradient buffer, its optimizer), so when a layout keeps smaller buffers (a ZeRO shard, a
//! pipeline stage) the figures shrink with them, with no second formula to keep in step.
//! Activations are the exception: burn holds them inside its autodiff graph, so they are the
//! model's own estimate of one micro-batch's saved tensors ([`crate::job::Replica::activation_bytes`],
//! [`crate::pipeline::layered::Layered::held_activation_floats`]) times the most micro-batches
//! the rank held at once.

use std::ops::Range;

use lockstep_model::{LayerKind, Optimizer, TransformerSpec};

pub use lockstep_run::memory::*;

/// What a training loop holds, taken from its buffers (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelState {
    params_bytes: u64,
    grads_bytes: u64,
    optimizer_bytes: u64,
    activation_bytes_per_microbatch: u64,
}

impl ModelState {
    /// The parameters and optimizer state a loop keeps.
    pub fn new(params: &[f32], optimizer: &Optimizer) -> Self {
        ModelState {
            params_bytes: params.len() as u64 * F32,
            optimizer_bytes: optimizer.state().iter().map(|v| v.len() as u64 * F32).sum(),
            ..Default::default()
        }
    }

    /// Add gradient buffers (per micro-batch, reduced, …).
    pub fn grads<'g>(mut self, buffers: impl IntoIterator<Item = &'g [f32]>) -> Self {
        self.grads_bytes += buffers
            .into_iter()
            .map(|g| g.len() as u64 * F32)
            .sum::<u64>();
        self
    }

    /// Add a gradient buffer of `len` values that the loop does not hold itself (the layer a
    /// streamed backward hands out).
    pub fn grad_buffer(mut self, len: usize) -> Self {
        self.grads_bytes += len as u64 * F32;
        self
    }

    /// Add the exact reducer's accumulator for a gradient of `len` values: one `i64` per value
    /// in reproducible mode, none in plain mode. An upper bound: the schedule that all-reduces
    /// the sums (vectors below the small-message threshold) keeps this whole accumulator between
    /// steps, but the reduce-scattered schedule forms the sums one ring segment at a time (plus
    /// two chunk-sized carries with more than two ranks) and a single rank forms none.
    pub fn exact_scratch(mut self, reproducible: bool, len: usize) -> Self {
        if reproducible {
            self.grads_bytes += len as u64 * FIXED;
        }
        self
    }

    /// The model's estimate of the activations one micro-batch's autodiff graph keeps.
    pub fn activations_per_microbatch(mut self, bytes: u64) -> Self {
        self.activation_bytes_per_microbatch = bytes;
        self
    }

    /// The figures with `peak_held` micro-batches' activations held at once, and the process's
    /// peak resident memory now.
    pub fn measure(&self, peak_held: usize) -> RankMemory {
        RankMemory {
            params_bytes: self.params_bytes,
            grads_bytes: self.grads_bytes,
            optimizer_bytes: self.optimizer_bytes,
            activation_peak_bytes: self.activation_bytes_per_microbatch * peak_held.max(1) as u64,
            peak_rss_bytes: peak_rss_bytes().unwrap_or(0),
        }
    }
}

/// Values per sequence that a training forward of the transformer's `layers` keeps for its
/// backward (an estimate counted from the built-in transformer's forward, per token, in
/// `builtin/transformer.rs`):
/// the embedding 2·d (lookup, position sum); a block 16·d + 4·d_ff + 4·heads·context (two
/// layer norms' intermediates, q/k/v and their head-split copies, scores, mask sum, softmax,
/// attention output, projections, residual sums, the MLP's hidden pre- and post-GELU values);
/// the head 4·d + 3·vocab (layer norm, logits, log-softmax).
pub fn transformer_held_floats(spec: &TransformerSpec, layers: Range<usize>) -> usize {
    let kinds = layers.map(|l| spec.layer_kind(l));
    usize::try_from(transformer_held_values(spec, kinds)).unwrap_or(usize::MAX)
}

/// [`transformer_held_floats`] in `u128` over any sequence of layer kinds (the resource limits
/// evaluate it for widths whose product overflows `usize`).
pub(crate) fn transformer_held_values(
    spec: &TransformerSpec,
    layers: impl Iterator<Item = LayerKind>,
) -> u128 {
    let d = spec.d_model as u128;
    let (ff, t) = (spec.d_ff as u128, spec.context as u128);
    let (heads, vocab) = (spec.heads as u128, spec.vocab as u128);
    let per_token: u128 = layers
        .map(|kind| match kind {
            LayerKind::Embedding => 2 * d,
            LayerKind::Block(_) => 16 * d + 4 * ff + 4 * heads * t,
            LayerKind::Head => 4 * d + 3 * vocab,
        })
        .sum();
    per_token * t
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_model::OptimizerSpec;

    #[test]
    fn state_is_counted_from_the_buffers() {
        let params = vec![0f32; 1000];
        let adamw = Optimizer::new(
            &OptimizerSpec::AdamW {
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.0,
            },
            params.len(),
        );
        let grads = [vec![0f32; 1000], vec![0f32; 1000]];
        let reduced = vec![0f32; 1000];
        let m = ModelState::new(&params, &adamw)
            .grads(grads.iter().map(Vec::as_slice).chain([reduced.as_slice()]))
            .exact_scratch(true, reduced.len())
            .activations_per_microbatch(100)
            .measure(3);
        assert_eq!(m.params_bytes, 4000);
        assert_eq!(m.optimizer_bytes, 2 * m.params_bytes);
        assert_eq!(m.grads_bytes, 3 * 4000 + 8000);
        assert_eq!(m.activation_peak_bytes, 300);
        assert_eq!(m.model_state_bytes(), 4000 + 20000 + 8000 + 300, "{m:?}");
        let sgd = Optimizer::new(
            &OptimizerSpec::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
                nesterov: false,
            },
            params.len(),
        );
        assert_eq!(
            ModelState::new(&params, &sgd).measure(1).optimizer_bytes,
            4000
        );
    }
}
