//! A small decoder-only, character-level transformer written as a **sequence of layers** that
//! pipeline stages can cut anywhere between two layers:
//!
//! | layer | what | parameters (canonical order) |
//! |---|---|---|
//! | 0 | embedding | `embed.tok [vocab, d]`, `embed.pos [context, d]` |
//! | 1..=blocks | pre-norm block: x + attn(ln1(x)); x + mlp(ln2(x)) | `blocks.i.{ln1_gain, ln1_bias, qkv_w [d, 3d], qkv_b, proj_w [d, d], proj_b, ln2_gain, ln2_bias, fc1_w [d, ff], fc1_b, fc2_w [ff, d], fc2_b}` |
//! | blocks + 1 | head: final layer norm, output projection, loss | `head.{ln_gain, ln_bias, out_w [d, vocab], out_b}` |
//!
//! Everything about the layout is a pure function of the [`TransformerSpec`], so any contiguous
//! range of layers (a stage) knows its parameters' global names, their initial values (our own
//! seeded generator, per global tensor index) and its place in the whole model's flat vector:
//! the concatenation of the stages' flat vectors in stage order *is* the whole model's. The burn
//! layers themselves are `lockstep-train`'s built-in transformer job (`builtin/transformer.rs`),
//! a `LayeredJob`; this module holds the spec and the attention both its forms use
//! ([`attend`]). Single-device code: nothing here knows about ranks.

use std::ops::Range;

use crate::attention::{causal_attention, MASKED};
use crate::softmax::softmax_last;
use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::bf16::Products;
use crate::error::ModelError;
use crate::rng::SplitMix64;

/// Shape of the transformer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransformerSpec {
    /// Distinct characters (≤ 256: targets travel as bytes in evaluation).
    pub vocab: usize,
    /// Characters per sequence.
    pub context: usize,
    pub d_model: usize,
    pub heads: usize,
    pub blocks: usize,
    /// Hidden width of each block's MLP.
    pub d_ff: usize,
    /// How the products take their operands (`train.precision`): every linear layer's input and
    /// weight, the attention's `[Q | K | V]` and the head's product. Part of a run's identity
    /// through the config, not of the parameters' shapes.
    pub products: Products,
}

/// What a layer of the sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    Embedding,
    Block(usize),
    Head,
}

impl TransformerSpec {
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::InvalidSpec(m));
        if self.vocab < 2 || self.vocab > 256 {
            return bad(format!("vocab {} must be in 2..=256", self.vocab));
        }
        if self.context < 2 {
            return bad(format!("context {} must be ≥ 2", self.context));
        }
        if self.d_model == 0 || self.heads == 0 || !self.d_model.is_multiple_of(self.heads) {
            return bad(format!(
                "{} heads must be ≥ 1 and divide d_model = {}",
                self.heads, self.d_model
            ));
        }
        if self.blocks == 0 || self.d_ff == 0 {
            return bad("a transformer needs ≥ 1 block and d_ff ≥ 1".into());
        }
        Ok(())
    }

    /// Embedding + blocks + head.
    pub fn num_layers(&self) -> usize {
        self.blocks + 2
    }

    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        assert!(layer < self.num_layers(), "layer {layer} out of range");
        match layer {
            0 => LayerKind::Embedding,
            l if l == self.blocks + 1 => LayerKind::Head,
            l => LayerKind::Block(l - 1),
        }
    }

    /// Global names and shapes of one layer's parameters, in canonical order.
    pub fn layer_params(&self, layer: usize) -> Vec<(String, Vec<usize>)> {
        let (d, ff, v) = (self.d_model, self.d_ff, self.vocab);
        match self.layer_kind(layer) {
            LayerKind::Embedding => vec![
                ("embed.tok".into(), vec![v, d]),
                ("embed.pos".into(), vec![self.context, d]),
            ],
            LayerKind::Block(i) => [
                ("ln1_gain", vec![d]),
                ("ln1_bias", vec![d]),
                ("qkv_w", vec![d, 3 * d]),
                ("qkv_b", vec![3 * d]),
                ("proj_w", vec![d, d]),
                ("proj_b", vec![d]),
                ("ln2_gain", vec![d]),
                ("ln2_bias", vec![d]),
                ("fc1_w", vec![d, ff]),
                ("fc1_b", vec![ff]),
                ("fc2_w", vec![ff, d]),
                ("fc2_b", vec![d]),
            ]
            .into_iter()
            .map(|(n, s)| (format!("blocks.{i}.{n}"), s))
            .collect(),
            LayerKind::Head => vec![
                ("head.ln_gain".into(), vec![d]),
                ("head.ln_bias".into(), vec![d]),
                ("head.out_w".into(), vec![d, v]),
                ("head.out_b".into(), vec![v]),
            ],
        }
    }

    /// Parameters per layer.
    pub fn layer_param_counts(&self) -> Vec<usize> {
        (0..self.num_layers())
            .map(|l| {
                self.layer_params(l)
                    .iter()
                    .map(|(_, s)| s.iter().product::<usize>())
                    .sum()
            })
            .collect()
    }

    /// Initial values of the layers in `layers`, reproducible from `seed`: each tensor draws from
    /// its own generator keyed by its *global* index, so a stage's values equal the same slice of
    /// the whole model's. Embeddings: uniform with std 0.02; weights: LeCun uniform, the two
    /// projections that write into the residual stream scaled by 1/√(2·blocks) (so the stream's
    /// variance does not grow with depth); layer-norm gains 1; biases 0.
    pub fn initial_params(&self, layers: Range<usize>, seed: u64) -> Vec<f32> {
        let first_tensor: usize = (0..layers.start).map(|l| self.layer_params(l).len()).sum();
        let residual_scale = 1.0 / (2.0 * self.blocks as f64).sqrt();
        let mut out = Vec::new();
        let mut index = first_tensor;
        for l in layers {
            for (name, shape) in self.layer_params(l) {
                let len: usize = shape.iter().product();
                let short = name.rsplit('.').next().unwrap_or("");
                if short.ends_with("gain") {
                    out.extend(std::iter::repeat_n(1.0f32, len));
                } else if shape.len() == 1 {
                    out.extend(std::iter::repeat_n(0.0f32, len));
                } else {
                    let std = if name.starts_with("embed.") {
                        0.02
                    } else {
                        let s = 1.0 / (shape[0] as f64).sqrt();
                        if short == "proj_w" || short == "fc2_w" {
                            s * residual_scale
                        } else {
                            s
                        }
                    };
                    // Uniform(-b, b) has std b/√3.
                    let bound = (std * 3f64.sqrt()) as f32;
                    let mut rng = SplitMix64::for_tensor(seed, index);
                    out.extend((0..len).map(|_| rng.next_symmetric_f32(bound)));
                }
                index += 1;
            }
        }
        out
    }
}

/// Additive mask `[1, 1, t, t]`: 0 where a position may attend (itself and earlier), −1e9 after.
pub(crate) fn causal_mask(t: usize, device: &Device) -> Tensor<4> {
    let mut m = vec![0f32; t * t];
    for i in 0..t {
        for j in i + 1..t {
            m[i * t + j] = MASKED;
        }
    }
    Tensor::from_data(TensorData::new(m, [1, 1, t, t]), device)
}

/// Causal self-attention of `heads` heads over `qkv = [Q | K | V]` (`[n, t, 3·w]`, each of the
/// three `w = heads · dh` wide): `[n, t, w]`, heads side by side. The whole layer's heads, or
/// one tensor-parallel piece's. One op (`attention.rs`) with the bits of the same function composed of burn's operations (what it is off the flex backend).
pub fn attend(qkv: Tensor<3>, heads: usize) -> Tensor<3> {
    if qkv.dtype() == DType::F32 && crate::flex_values::on_flex(&qkv) {
        return causal_attention(qkv, heads);
    }
    let mask = causal_mask(qkv.dims()[1], &qkv.device());
    attend_composed(qkv, heads, &mask)
}

/// [`attend`] composed of burn ops, with an additive `mask` ([`causal_mask`]): the reference the
/// fused op is tested against, and the path for other element types and devices.
pub(crate) fn attend_composed(qkv: Tensor<3>, heads: usize, mask: &Tensor<4>) -> Tensor<3> {
    let [n, t, w3] = qkv.dims();
    let w = w3 / 3;
    let dh = w / heads;
    let split = |k: usize| -> Tensor<4> {
        qkv.clone()
            .narrow(2, k * w, w)
            .reshape([n, t, heads, dh])
            .swap_dims(1, 2)
    };
    let (q, k, v) = (split(0), split(1), split(2));
    let scores = q
        .matmul(k.swap_dims(2, 3))
        .mul_scalar(1.0 / (dh as f32).sqrt())
        + mask.clone();
    softmax_last(scores)
        .matmul(v)
        .swap_dims(1, 2)
        .reshape([n, t, w])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TransformerSpec {
        TransformerSpec {
            vocab: 11,
            context: 8,
            d_model: 16,
            heads: 2,
            blocks: 3,
            d_ff: 32,
            products: Default::default(),
        }
    }

    #[test]
    fn stage_initial_values_are_slices_of_the_whole() {
        let s = spec();
        let whole = s.initial_params(0..s.num_layers(), 7);
        assert_eq!(whole.len(), s.layer_param_counts().iter().sum::<usize>());
        for cut in 1..s.num_layers() {
            let a = s.initial_params(0..cut, 7);
            let b = s.initial_params(cut..s.num_layers(), 7);
            assert_eq!([a, b].concat(), whole, "cut at layer {cut}");
        }
    }

    #[test]
    fn bad_specs_are_refused() {
        let mut s = spec();
        s.heads = 3;
        assert!(s.validate().unwrap_err().to_string().contains("heads"));
        let mut s = spec();
        s.vocab = 300;
        assert!(s.validate().is_err());
    }
}
