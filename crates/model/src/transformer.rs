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
//! the concatenation of the stages' flat vectors in stage order *is* the whole model's.
//! Single-device code: nothing here knows about ranks.

use std::ops::Range;

use crate::attention::{causal_attention, MASKED};
use crate::dense::dense_linear;
use crate::gelu::gelu;
use crate::layer_norm::layer_norm;
use crate::softmax::softmax_last;
use burn::module::{Module, Param};
use burn::tensor::module::embedding;
use burn::tensor::{DType, Device, Gradients, Int, Tensor, TensorData};
use sha2::{Digest, Sha256};

use crate::bf16::Products;
use crate::error::ModelError;
use crate::params::{self, ParamInfo};
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
    /// weight, the attention's `[Q | K | V]` and the head's product. Not part of
    /// [`TransformerSpec::structure_hash`] (the parameters are the same); part of a run's
    /// identity through the config.
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

    /// Offsets of each layer in the whole model's flat vector, plus the total at the end.
    pub fn layer_offsets(&self) -> Vec<usize> {
        let mut offsets = vec![0];
        for c in self.layer_param_counts() {
            offsets.push(offsets.last().unwrap() + c);
        }
        offsets
    }

    /// Layout of the layers in `layers`, offsets relative to the first of them.
    pub fn layout(&self, layers: Range<usize>) -> Vec<ParamInfo> {
        let mut offset = 0;
        let mut out = Vec::new();
        for l in layers {
            for (name, shape) in self.layer_params(l) {
                let len = shape.iter().product();
                out.push(ParamInfo {
                    name,
                    shape,
                    offset,
                    len,
                });
                offset += len;
            }
        }
        out
    }

    /// Values exchanged at a stage boundary for `n` sequences (activations forward, their
    /// gradients backward): `n · context · d_model`.
    pub fn activation_len(&self, n: usize) -> usize {
        n * self.context * self.d_model
    }

    /// SHA-256 over the architecture and every parameter's global name and shape: the same for
    /// every stage of one model, so ranks can compare it whatever their stage.
    pub fn structure_hash(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"lockstep-model transformer v1\0");
        for v in [
            self.vocab,
            self.context,
            self.d_model,
            self.heads,
            self.blocks,
            self.d_ff,
        ] {
            h.update((v as u64).to_le_bytes());
        }
        for p in self.layout(0..self.num_layers()) {
            h.update((p.name.len() as u64).to_le_bytes());
            h.update(p.name.as_bytes());
            for &d in &p.shape {
                h.update((d as u64).to_le_bytes());
            }
        }
        h.finalize().into()
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

// ----- burn modules (declaration order = canonical order above) -----

#[derive(Module, Debug)]
pub(crate) struct Embed {
    tok: Param<Tensor<2>>,
    pos: Param<Tensor<2>>,
}

#[derive(Module, Debug)]
pub(crate) struct Block {
    ln1_gain: Param<Tensor<1>>,
    ln1_bias: Param<Tensor<1>>,
    qkv_w: Param<Tensor<2>>,
    qkv_b: Param<Tensor<1>>,
    proj_w: Param<Tensor<2>>,
    proj_b: Param<Tensor<1>>,
    ln2_gain: Param<Tensor<1>>,
    ln2_bias: Param<Tensor<1>>,
    fc1_w: Param<Tensor<2>>,
    fc1_b: Param<Tensor<1>>,
    fc2_w: Param<Tensor<2>>,
    fc2_b: Param<Tensor<1>>,
}

#[derive(Module, Debug)]
pub(crate) struct Head {
    ln_gain: Param<Tensor<1>>,
    ln_bias: Param<Tensor<1>>,
    out_w: Param<Tensor<2>>,
    out_b: Param<Tensor<1>>,
}

/// The layers of one stage.
#[derive(Module, Debug)]
pub(crate) struct StageNet {
    embed: Option<Embed>,
    blocks: Vec<Block>,
    head: Option<Head>,
}

fn p1(n: usize, device: &Device) -> Param<Tensor<1>> {
    Param::from_tensor(Tensor::zeros([n], device))
}
fn p2(a: usize, b: usize, device: &Device) -> Param<Tensor<2>> {
    Param::from_tensor(Tensor::zeros([a, b], device))
}

impl StageNet {
    /// Zero-filled layers `layers` of `spec` (real values are written through the flat mapper).
    pub(crate) fn zeros(spec: &TransformerSpec, layers: Range<usize>, device: &Device) -> StageNet {
        let (d, ff, v) = (spec.d_model, spec.d_ff, spec.vocab);
        let mut net = StageNet {
            embed: None,
            blocks: Vec::new(),
            head: None,
        };
        for l in layers {
            match spec.layer_kind(l) {
                LayerKind::Embedding => {
                    net.embed = Some(Embed {
                        tok: p2(v, d, device),
                        pos: p2(spec.context, d, device),
                    })
                }
                LayerKind::Block(_) => net.blocks.push(Block {
                    ln1_gain: p1(d, device),
                    ln1_bias: p1(d, device),
                    qkv_w: p2(d, 3 * d, device),
                    qkv_b: p1(3 * d, device),
                    proj_w: p2(d, d, device),
                    proj_b: p1(d, device),
                    ln2_gain: p1(d, device),
                    ln2_bias: p1(d, device),
                    fc1_w: p2(d, ff, device),
                    fc1_b: p1(ff, device),
                    fc2_w: p2(ff, d, device),
                    fc2_b: p1(d, device),
                }),
                LayerKind::Head => {
                    net.head = Some(Head {
                        ln_gain: p1(d, device),
                        ln_bias: p1(d, device),
                        out_w: p2(d, v, device),
                        out_b: p1(v, device),
                    })
                }
            }
        }
        net
    }

    pub(crate) fn empty() -> StageNet {
        StageNet {
            embed: None,
            blocks: Vec::new(),
            head: None,
        }
    }

    /// Token ids `[n, t]` → residual stream `[n, t, d]` (first stage only).
    pub(crate) fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let e = self
            .embed
            .as_ref()
            .expect("embed() on a stage without the embedding");
        embed_tokens(e.tok.val(), e.pos.val(), tokens)
    }

    /// The stage's blocks on the residual stream.
    pub(crate) fn blocks(&self, mut x: Tensor<3>, spec: &TransformerSpec) -> Tensor<3> {
        if self.blocks.is_empty() {
            return x;
        }
        for b in &self.blocks {
            x = block_forward(b, x, spec);
        }
        x
    }

    /// Block `i` of the stage (its `i`-th, not the model's) on the residual stream.
    pub(crate) fn block(&self, i: usize, x: Tensor<3>, spec: &TransformerSpec) -> Tensor<3> {
        block_forward(&self.blocks[i], x, spec)
    }

    /// Move the parameter gradients of the stage's layer `k` (its layers in order: the
    /// embedding when it has it, its blocks, the head when it has it) out of `grads` into `out`,
    /// that layer's slice of the stage's flat vector.
    pub(crate) fn read_layer_grads(&self, k: usize, grads: Gradients, out: &mut [f32]) {
        let k = match &self.embed {
            Some(embed) if k == 0 => return params::read_grads(embed, grads, out),
            Some(_) => k - 1,
            None => k,
        };
        match self.blocks.get(k) {
            Some(block) => params::read_grads(block, grads, out),
            None => {
                let head = self.head.as_ref().expect("a layer index within the stage");
                params::read_grads(head, grads, out)
            }
        }
    }

    /// The stage's layer `k` (numbered as in [`StageNet::read_layer_grads`]) with its parameters
    /// written from `values` (shaped by `layout`, that layer's entries of the stage's layout), or
    /// released (`None`: empty tensors, ids kept); the other layers untouched.
    pub(crate) fn with_layer(
        mut self,
        k: usize,
        values: Option<&[f32]>,
        layout: &[ParamInfo],
        device: &Device,
    ) -> StageNet {
        fn apply<M: Module>(m: M, values: Option<&[f32]>, layout: &[ParamInfo], d: &Device) -> M {
            match values {
                Some(v) => params::write_shaped(m, v, d, layout),
                None => params::release(m, d),
            }
        }
        let k = match self.embed.take() {
            Some(embed) if k == 0 => {
                self.embed = Some(apply(embed, values, layout, device));
                return self;
            }
            Some(embed) => {
                self.embed = Some(embed);
                k - 1
            }
            None => k,
        };
        if k < self.blocks.len() {
            let block = self.blocks.remove(k);
            self.blocks.insert(k, apply(block, values, layout, device));
        } else {
            let head = self.head.take().expect("a layer index within the stage");
            self.head = Some(apply(head, values, layout, device));
        }
        self
    }

    /// Residual stream → logits `[n·t, vocab]` (last stage only).
    pub(crate) fn logits(&self, x: Tensor<3>, products: Products) -> Tensor<2> {
        let h = self
            .head
            .as_ref()
            .expect("logits() on a stage without the head");
        head_logits(
            x,
            h.ln_gain.val(),
            h.ln_bias.val(),
            h.out_w.val(),
            h.out_b.val(),
            products,
        )
    }
}

/// Token ids `[n, t]` → token plus position embeddings `[n, t, d]`.
pub(crate) fn embed_tokens(tok: Tensor<2>, pos: Tensor<2>, tokens: Tensor<2, Int>) -> Tensor<3> {
    let [_, t] = tokens.dims();
    let x = embedding(tok, tokens);
    let pos: Tensor<3> = pos.narrow(0, 0, t).unsqueeze();
    x + pos
}

/// The head: final layer norm and output projection, `[n, t, d]` → logits `[n·t, vocab]`.
pub(crate) fn head_logits(
    x: Tensor<3>,
    gain: Tensor<1>,
    bias: Tensor<1>,
    out_w: Tensor<2>,
    out_b: Tensor<1>,
    products: Products,
) -> Tensor<2> {
    let x = layer_norm(x, gain, bias);
    let [n, t, d] = x.dims();
    let x = products.operand(x.reshape([n * t, d]));
    x.matmul(products.operand(out_w)) + out_b.unsqueeze()
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

/// `x W + b` over the last dimension of `[n, t, d_in]`, the operands taken as `products` says.
pub(crate) fn linear3(x: Tensor<3>, w: Tensor<2>, b: Tensor<1>, products: Products) -> Tensor<3> {
    let [n, t, d] = x.dims();
    let out = w.dims()[1];
    let (x, w) = (products.operand(x.reshape([n * t, d])), products.operand(w));
    dense_linear(x, w, b).reshape([n, t, out])
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

fn block_forward(b: &Block, x: Tensor<3>, spec: &TransformerSpec) -> Tensor<3> {
    let p = spec.products;
    let h = layer_norm(x.clone(), b.ln1_gain.val(), b.ln1_bias.val());
    let qkv = p.operand(linear3(h, b.qkv_w.val(), b.qkv_b.val(), p));
    let attended = attend(qkv, spec.heads);
    let x = x + linear3(attended, b.proj_w.val(), b.proj_b.val(), p);
    let h = layer_norm(x.clone(), b.ln2_gain.val(), b.ln2_bias.val());
    let m = linear3(
        gelu(linear3(h, b.fc1_w.val(), b.fc1_b.val(), p)),
        b.fc2_w.val(),
        b.fc2_b.val(),
        p,
    );
    x + m
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
    fn stage_layouts_and_initial_values_are_slices_of_the_whole() {
        let s = spec();
        let offsets = s.layer_offsets();
        let whole = s.initial_params(0..s.num_layers(), 7);
        assert_eq!(whole.len(), *offsets.last().unwrap());
        for cut in 1..s.num_layers() {
            let a = s.initial_params(0..cut, 7);
            let b = s.initial_params(cut..s.num_layers(), 7);
            assert_eq!([a, b].concat(), whole, "cut at layer {cut}");
        }
        // The burn module's own layout agrees with the spec's, name order and shapes.
        let net = StageNet::zeros(&s, 1..3, &Device::flex());
        let burn_layout = crate::params::layout(&net);
        let ours = s.layout(1..3);
        assert_eq!(burn_layout.len(), ours.len());
        for (b, o) in burn_layout.iter().zip(&ours) {
            assert_eq!((b.shape.clone(), b.offset), (o.shape.clone(), o.offset));
            assert!(
                o.name.ends_with(b.name.rsplit('.').next().unwrap()),
                "{} vs {}",
                b.name,
                o.name
            );
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
