//! lockstep's built-in character-level transformer as a [`LayeredJob`], trained by the one
//! layered path like any user's job: token and position embeddings; pre-norm blocks of causal
//! self-attention and a GELU MLP, each with its residual; a final layer norm and the output
//! projection — over a character corpus (the embedded Shakespeare plays, or `data.dir`).
//!
//! A block is computed whole ([`Block`]: lockstep's kernels, `lockstep_model::ops`, on the flex
//! CPU backend, burn's operations on any other device) or, with `model.tp_pieces = T > 1`, as
//! `lockstep::tp` layers ([`TpBlock`]: a [`ParallelSelfAttention`] with the heads in `T` pieces,
//! a [`ColumnParallelLinear`] → GELU → [`RowParallelLinear`] MLP) — the one tensor-parallel
//! implementation, the one users have. Both start from the spec's initial values
//! ([`TransformerSpec::initial_params`]; the pieces' layers hold them in their own layouts), so
//! the two train the same model and differ only by rounding.
//!
//! Between layers a micro-batch is `[n, context · d_model]`; the first layer takes the token ids
//! as `f32` values (exact: at most 256 characters) and the last gives `[n, context · vocab]`
//! logits. The loss is the cross-entropy summed over every predicted character, scaled by
//! `1 / (global batch · context)` ([`LayeredJob::loss_terms_per_sample`]).

use std::path::PathBuf;
use std::sync::Arc;

use burn::data::dataset::{Dataset as DatasetOf, DatasetError};
use burn::module::{Module, Param};
use burn::tensor::module::embedding;
use burn::tensor::{Device, Int, Tensor, TensorData};
use lockstep_data::text::{CharCorpus, Split};
use lockstep_model::ops::{causal_self_attention, dense_linear, gelu, layer_norm};
use lockstep_model::{
    count_correct, cross_entropy_sum, flat, ColumnParallelLinear, ColumnParallelLinearConfig,
    LayerKind, ParallelSelfAttention, ParallelSelfAttentionConfig, Products, RowParallelLinear,
    RowParallelLinearConfig, TransformerSpec,
};

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::job::{BoxError, LayeredJob, LossReduction};
use crate::model_spec::transformer_spec;

/// Validation windows evaluated (evenly spaced over the validation text; 512 × context characters).
const EVAL_WINDOWS: usize = 512;

/// Token and position embeddings (`[vocab, d]`, `[context, d]`).
#[derive(Module, Debug)]
pub(super) struct Embed {
    tok: Param<Tensor<2>>,
    pos: Param<Tensor<2>>,
}

/// One block computed whole: `x + proj(attention(qkv(ln1(x))))`, then
/// `x + fc2(gelu(fc1(ln2(x))))`; weights `[inputs, outputs]`, the spec's names and order.
#[derive(Module, Debug)]
pub(super) struct Block {
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

/// One block as tensor-parallel pieces: `x + attention(ln1(x))`, then
/// `x + down(gelu(up(ln2(x))))`.
#[derive(Module, Debug)]
pub(super) struct TpBlock {
    ln1_gain: Param<Tensor<1>>,
    ln1_bias: Param<Tensor<1>>,
    attention: ParallelSelfAttention,
    ln2_gain: Param<Tensor<1>>,
    ln2_bias: Param<Tensor<1>>,
    up: ColumnParallelLinear,
    down: RowParallelLinear,
}

/// The final layer norm and the output projection (`[d, vocab]`, replicated across tp ranks).
#[derive(Module, Debug)]
pub(super) struct Head {
    ln_gain: Param<Tensor<1>>,
    ln_bias: Param<Tensor<1>>,
    out_w: Param<Tensor<2>>,
    out_b: Param<Tensor<1>>,
}

/// One layer of the sequence. (Unboxed: burn's `Module` has no `Box` impl, and a model holds a
/// few dozen layers at most.)
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub(super) enum TransformerLayer {
    Embed(Embed),
    Block(Block),
    TpBlock(TpBlock),
    Head(Head),
}

/// The transformer a config describes, with its corpus.
pub(super) struct TransformerJob {
    spec: TransformerSpec,
    /// `model.tp_pieces` (1: blocks computed whole).
    pieces: usize,
    corpus: Arc<CharCorpus>,
    /// Validation windows, evenly spaced over the validation text.
    eval_windows: Vec<u32>,
}

/// The corpus of a validated text config: the embedded Shakespeare plays, or, when `data.dir` is
/// set, that folder's `train.txt` and `val.txt` (plain or gzipped as `.txt.gz`).
fn load_corpus(cfg: &TrainConfig) -> Result<CharCorpus, TrainError> {
    if cfg.data.dir.is_empty() {
        return Ok(lockstep_data::text::load_shakespeare_embedded()?);
    }
    Ok(lockstep_data::text::load_char_corpus(&PathBuf::from(
        &cfg.data.dir,
    ))?)
}

impl TransformerJob {
    /// Load the corpus and check that the spec fits it: valid for its characters, and at least
    /// one validation window.
    pub(super) fn new(cfg: &TrainConfig) -> Result<TransformerJob, TrainError> {
        let corpus = load_corpus(cfg)?;
        let spec = transformer_spec(cfg, corpus.vocab_size());
        spec.validate()?;
        let available = corpus.num_windows(Split::Val, spec.context);
        if available == 0 {
            return Err(TrainError::ValidationTooShort {
                dataset: corpus.name.clone(),
                chars: corpus.tokens(Split::Val).len(),
                context: spec.context,
            });
        }
        let k = EVAL_WINDOWS.min(available);
        Ok(TransformerJob {
            eval_windows: (0..k).map(|i| (i * available / k) as u32).collect(),
            spec,
            pieces: cfg.model.tp_pieces.max(1),
            corpus: Arc::new(corpus),
        })
    }
}

/// One window of the text: `context` input ids and the `context` next characters.
#[derive(Clone, Debug)]
pub(super) struct Window {
    x: Vec<i64>,
    y: Vec<i64>,
}

/// Windows of one split of the corpus, by index.
struct Windows {
    corpus: Arc<CharCorpus>,
    split: Split,
    context: usize,
    /// The windows of the split this set holds (the validation ones), or all of them.
    chosen: Option<Vec<u32>>,
}

impl DatasetOf<Window> for Windows {
    fn get(&self, index: usize) -> Result<Window, DatasetError> {
        let window = match &self.chosen {
            Some(chosen) => chosen.get(index).copied(),
            None => (index < self.len()).then_some(index as u32),
        };
        let Some(window) = window else {
            return Err(DatasetError::new(std::io::Error::other(format!(
                "window {index} of the {} {:?} text, which has {}",
                self.corpus.name,
                self.split,
                self.len()
            ))));
        };
        let (mut x, mut y) = (Vec::new(), Vec::new());
        self.corpus
            .gather_windows(self.split, self.context, &[window], &mut x, &mut y);
        Ok(Window { x, y })
    }

    fn len(&self) -> usize {
        match &self.chosen {
            Some(chosen) => chosen.len(),
            None => self.corpus.num_windows(self.split, self.context),
        }
    }
}

/// A micro-batch: token ids as `f32` `[n, context]`, targets `[n · context, 1]`, and the targets
/// on the host (for accuracy).
pub(super) struct TextBatch {
    tokens: Tensor<2>,
    targets: Tensor<2, Int>,
    labels: Vec<u8>,
}

impl TransformerJob {
    fn dims(&self) -> (usize, usize, usize) {
        (self.spec.context, self.spec.d_model, self.spec.vocab)
    }

    /// Layer `l` with the spec's initial values from `seed`, in the layers' own layouts.
    fn initial_layer(&self, l: usize, seed: u64, device: &Device) -> TransformerLayer {
        let (t, d, v) = (self.spec.context, self.spec.d_model, self.spec.vocab);
        let ff = self.spec.d_ff;
        let canonical = self.spec.initial_params(l..l + 1, seed);
        let zeros1 = |n| Param::from_tensor(Tensor::zeros([n], device));
        let zeros2 = |a, b| Param::from_tensor(Tensor::zeros([a, b], device));
        let (layer, values) = match self.spec.layer_kind(l) {
            LayerKind::Embedding => {
                let layer = TransformerLayer::Embed(Embed {
                    tok: zeros2(v, d),
                    pos: zeros2(t, d),
                });
                (layer, canonical)
            }
            LayerKind::Block(_) if self.pieces == 1 => {
                let layer = TransformerLayer::Block(Block {
                    ln1_gain: zeros1(d),
                    ln1_bias: zeros1(d),
                    qkv_w: zeros2(d, 3 * d),
                    qkv_b: zeros1(3 * d),
                    proj_w: zeros2(d, d),
                    proj_b: zeros1(d),
                    ln2_gain: zeros1(d),
                    ln2_bias: zeros1(d),
                    fc1_w: zeros2(d, ff),
                    fc1_b: zeros1(ff),
                    fc2_w: zeros2(ff, d),
                    fc2_b: zeros1(d),
                });
                (layer, canonical)
            }
            LayerKind::Block(_) => {
                let layer = TransformerLayer::TpBlock(TpBlock {
                    ln1_gain: zeros1(d),
                    ln1_bias: zeros1(d),
                    attention: ParallelSelfAttentionConfig::new(d, self.spec.heads, self.pieces)
                        .init(device),
                    ln2_gain: zeros1(d),
                    ln2_bias: zeros1(d),
                    up: ColumnParallelLinearConfig::new(d, ff, self.pieces).init(device),
                    down: RowParallelLinearConfig::new(ff, d, self.pieces).init(device),
                });
                (layer, block_values(&canonical, d, ff, self.pieces))
            }
            LayerKind::Head => {
                let layer = TransformerLayer::Head(Head {
                    ln_gain: zeros1(d),
                    ln_bias: zeros1(d),
                    out_w: zeros2(d, v),
                    out_b: zeros1(v),
                });
                (layer, canonical)
            }
        };
        flat::write(layer, &values, device)
    }
}

/// A block's canonical values (the spec's order: `ln1`, `qkv_w [d, 3d]`, `qkv_b`, `proj_w`,
/// `proj_b`, `ln2`, `fc1_w [d, ff]`, `fc1_b`, `fc2_w [ff, d]`, `fc2_b`) in [`Block`]'s order and
/// layouts: the column layers' weights transposed to `[outputs, inputs]`, and `qkv`'s outputs
/// reordered piece by piece (piece `p`'s Q, K and V columns of its heads), as
/// [`ParallelSelfAttention`] holds them. The row layers' weights keep their layout.
fn block_values(canonical: &[f32], d: usize, ff: usize, pieces: usize) -> Vec<f32> {
    let mut at = 0;
    let mut take = |len: usize| {
        let part = &canonical[at..at + len];
        at += len;
        part
    };
    let (ln1_gain, ln1_bias) = (take(d), take(d));
    let (qkv_w, qkv_b) = (take(d * 3 * d), take(3 * d));
    let (proj_w, proj_b) = (take(d * d), take(d));
    let (ln2_gain, ln2_bias) = (take(d), take(d));
    let (fc1_w, fc1_b) = (take(d * ff), take(ff));
    let (fc2_w, fc2_b) = (take(ff * d), take(d));
    // Row r of the attention's column layer is canonical column `order[r]`.
    let w = d / pieces;
    let order: Vec<usize> = (0..pieces)
        .flat_map(|p| (0..3).flat_map(move |k| (0..w).map(move |j| k * d + p * w + j)))
        .collect();
    let mut out = Vec::with_capacity(canonical.len());
    out.extend_from_slice(ln1_gain);
    out.extend_from_slice(ln1_bias);
    out.extend(
        order
            .iter()
            .flat_map(|&c| (0..d).map(move |i| qkv_w[i * 3 * d + c])),
    );
    out.extend(order.iter().map(|&c| qkv_b[c]));
    out.extend_from_slice(proj_w);
    out.extend_from_slice(proj_b);
    out.extend_from_slice(ln2_gain);
    out.extend_from_slice(ln2_bias);
    out.extend((0..ff).flat_map(|f| (0..d).map(move |i| fc1_w[i * ff + f])));
    out.extend_from_slice(fc1_b);
    out.extend_from_slice(fc2_w);
    out.extend_from_slice(fc2_b);
    debug_assert_eq!(out.len(), canonical.len());
    out
}

impl LayeredJob for TransformerJob {
    type Layer = TransformerLayer;
    type Item = Window;
    type Batch = TextBatch;
    // The cross-entropy summed over every predicted character, scaled by lockstep by
    // 1 / (global batch · context): the per-character mean.
    const LOSS_REDUCTION: LossReduction = LossReduction::Sum;

    fn name(&self) -> &str {
        "lockstep"
    }

    fn loss_terms_per_sample(&self) -> usize {
        self.spec.context
    }

    fn layer_name(&self, layer: usize) -> String {
        match self.spec.layer_kind(layer) {
            LayerKind::Embedding => "embedding".into(),
            LayerKind::Block(b) => format!("block {b}"),
            LayerKind::Head => "head".into(),
        }
    }

    fn graph_floats_per_sample(&self, layer: usize) -> Option<usize> {
        Some(crate::memory::transformer_held_floats(
            &self.spec,
            layer..layer + 1,
        ))
    }

    fn layers(&self, cfg: &TrainConfig, device: &Device) -> Vec<TransformerLayer> {
        (0..self.spec.num_layers())
            .map(|l| self.initial_layer(l, cfg.train.seed, device))
            .collect()
    }

    fn train_data(&self, _: &TrainConfig) -> Result<Box<dyn DatasetOf<Window>>, BoxError> {
        Ok(Box::new(Windows {
            corpus: self.corpus.clone(),
            split: Split::Train,
            context: self.spec.context,
            chosen: None,
        }))
    }

    fn eval_data(&self, _: &TrainConfig) -> Result<Box<dyn DatasetOf<Window>>, BoxError> {
        Ok(Box::new(Windows {
            corpus: self.corpus.clone(),
            split: Split::Val,
            context: self.spec.context,
            chosen: Some(self.eval_windows.clone()),
        }))
    }

    fn batch(&self, items: Vec<Window>, device: &Device) -> TextBatch {
        let (n, t) = (items.len(), self.spec.context);
        let mut x = Vec::with_capacity(n * t);
        let mut y = Vec::with_capacity(n * t);
        for item in items {
            x.extend(item.x.iter().map(|&id| id as f32));
            y.extend(item.y);
        }
        let labels = y.iter().map(|&id| id as u8).collect();
        TextBatch {
            tokens: Tensor::from_data(TensorData::new(x, [n, t]), device),
            targets: Tensor::from_data(TensorData::new(y, [n * t, 1]), device),
            labels,
        }
    }

    fn input(&self, batch: &TextBatch) -> Tensor<2> {
        batch.tokens.clone()
    }

    fn forward(&self, layer: &TransformerLayer, x: Tensor<2>) -> Tensor<2> {
        let (t, d, v) = self.dims();
        let n = x.dims()[0];
        let p = self.spec.products;
        match layer {
            TransformerLayer::Embed(e) => {
                let x = embedding(e.tok.val(), x.int());
                let pos: Tensor<3> = e.pos.val().unsqueeze();
                (x + pos).reshape([n, t * d])
            }
            TransformerLayer::Block(b) => {
                let x = x.reshape([n, t, d]);
                let h = layer_norm(x.clone(), b.ln1_gain.val(), b.ln1_bias.val());
                let qkv = p.operand(linear3(h, b.qkv_w.val(), b.qkv_b.val(), p));
                let attended = causal_self_attention(qkv, self.spec.heads);
                let x = x + linear3(attended, b.proj_w.val(), b.proj_b.val(), p);
                let h = layer_norm(x.clone(), b.ln2_gain.val(), b.ln2_bias.val());
                let hidden = gelu(linear3(h, b.fc1_w.val(), b.fc1_b.val(), p));
                let m = linear3(hidden, b.fc2_w.val(), b.fc2_b.val(), p);
                (x + m).reshape([n, t * d])
            }
            TransformerLayer::TpBlock(b) => {
                let x = x.reshape([n, t, d]);
                let h = layer_norm(x.clone(), b.ln1_gain.val(), b.ln1_bias.val());
                let x = x + b.attention.forward_in(h, p);
                let h = layer_norm(x.clone(), b.ln2_gain.val(), b.ln2_bias.val());
                let m = b.down.forward_in(gelu(b.up.forward_in(h, p)), p);
                (x + m).reshape([n, t * d])
            }
            TransformerLayer::Head(h) => {
                let x = layer_norm(x.reshape([n, t, d]), h.ln_gain.val(), h.ln_bias.val());
                let x = p.operand(x.reshape([n * t, d]));
                let logits = x.matmul(p.operand(h.out_w.val())) + h.out_b.val().unsqueeze();
                logits.reshape([n, t * v])
            }
        }
    }

    fn loss(&self, output: Tensor<2>, batch: &TextBatch) -> Tensor<1> {
        let (t, _, v) = self.dims();
        let n = output.dims()[0];
        let logits = output.reshape([n * t, v]);
        cross_entropy_sum(logits, batch.targets.clone())
    }

    fn metrics(&self, output: Tensor<2>, batch: &TextBatch) -> Vec<(&'static str, f64)> {
        let v = self.spec.vocab;
        let logits = output.into_data();
        let correct = count_correct(flat::f32_slice(&logits), &batch.labels, v);
        vec![("accuracy", correct as f64)]
    }
}

/// `x W + b` over the last dimension of `[n, t, d_in]` (`W` as `[d_in, d_out]`), the operands
/// taken as `products` says: lockstep's dense kernel on the flex CPU backend.
fn linear3(x: Tensor<3>, w: Tensor<2>, b: Tensor<1>, products: Products) -> Tensor<3> {
    let [n, t, d] = x.dims();
    let out = w.dims()[1];
    let (x, w) = (products.operand(x.reshape([n * t, d])), products.operand(w));
    dense_linear(x, w, b).reshape([n, t, out])
}

#[cfg(test)]
mod tests {
    //! The layers hold the spec's initial values: in the spec's order when whole (so the flat
    //! vector is the spec's), moved into the tensor-parallel layers' layouts with pieces.

    use super::*;

    fn spec() -> TransformerSpec {
        TransformerSpec {
            vocab: 11,
            context: 4,
            d_model: 8,
            heads: 4,
            blocks: 2,
            d_ff: 12,
            products: Products::F32,
        }
    }

    fn job(pieces: usize) -> TransformerJob {
        let corpus = lockstep_data::text::parse_char_corpus(
            "tiny",
            b"abcdefghij abcdefghij abcdefghij",
            b"abcdefghij abc",
        )
        .unwrap();
        TransformerJob {
            spec: spec(),
            pieces,
            corpus: Arc::new(corpus),
            eval_windows: vec![0],
        }
    }

    #[test]
    fn whole_layers_are_the_spec_in_its_order() {
        let (s, job, device) = (spec(), job(1), Device::flex().autodiff());
        for l in 0..s.num_layers() {
            let layer = job.initial_layer(l, 7, &device);
            let shapes: Vec<Vec<usize>> =
                flat::layout(&layer).into_iter().map(|p| p.shape).collect();
            let want: Vec<Vec<usize>> = s.layer_params(l).into_iter().map(|(_, s)| s).collect();
            assert_eq!(shapes, want, "layer {l}");
            let n = s.layer_param_counts()[l];
            assert_eq!(
                flat::read(&layer, n),
                s.initial_params(l..l + 1, 7),
                "layer {l}"
            );
        }
    }

    #[test]
    fn pieces_hold_the_specs_values_in_their_layouts() {
        let (s, device) = (spec(), Device::flex().autodiff());
        let (d, ff) = (s.d_model, s.d_ff);
        let canonical = s.initial_params(1..2, 7);
        for pieces in [2, 4] {
            let layer = job(pieces).initial_layer(1, 7, &device);
            let TransformerLayer::TpBlock(b) = &layer else {
                panic!("pieces {pieces}: a tensor-parallel block");
            };
            let held = flat::read(&layer, canonical.len());
            let (mut a, mut c) = (held.clone(), canonical.clone());
            a.sort_by(f32::total_cmp);
            c.sort_by(f32::total_cmp);
            assert_eq!(a, c, "pieces {pieces}: the same values");
            // Row r of qkv is piece p's part k (Q, K, V), column j of its heads: canonical column
            // k·d + p·w + j of qkv_w ([d, 3d], after ln1's 2·d values).
            let qkv = b.attention.qkv.weight.val().into_data();
            let qkv = qkv.as_slice::<f32>().unwrap();
            let w = d / pieces;
            for (p, k, j) in [(0, 0, 0), (pieces - 1, 2, w - 1), (1, 1, 1)] {
                let (r, col) = (p * 3 * w + k * w + j, k * d + p * w + j);
                for i in 0..d {
                    assert_eq!(qkv[r * d + i], canonical[2 * d + i * 3 * d + col]);
                }
            }
            // up is fc1 transposed: row f, column i = fc1_w[i, f].
            let up = b.up.weight.val().into_data();
            let fc1 = 2 * d + 3 * d * d + 3 * d + d * d + d + 2 * d;
            assert_eq!(
                up.as_slice::<f32>().unwrap()[5 * d + 3],
                canonical[fc1 + 3 * ff + 5]
            );
        }
    }
}
