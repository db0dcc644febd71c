//! The built-in transformer with `model.tp_pieces = T > 1`, written as a [`LayeredJob`] of
//! `lockstep::tp` layers: the one tensor-parallel implementation, the one users have too.
//!
//! The model is `pipeline/transformer.rs`'s — token and position embeddings; pre-norm blocks of
//! causal self-attention and a GELU MLP, each with its residual; a final layer norm and the
//! output projection — with each block's attention a [`ParallelSelfAttention`] (heads in `T`
//! pieces) and its MLP a [`ColumnParallelLinear`] → GELU → [`RowParallelLinear`] (`d_ff` in `T`
//! pieces). Layer norms, GELU and the attention are lockstep's kernels (`lockstep_model::ops`).
//! The parameters start from the spec's initial values ([`TransformerSpec::initial_params`])
//! moved into the tensor-parallel layers' layouts, so a run with `T` pieces starts where the
//! unsplit model does and differs from it only by rounding (each piece's own products, the
//! pieces' exact sums).
//!
//! Between layers a micro-batch is `[n, context · d_model]`; the first layer takes the token ids
//! as `f32` values (exact: at most 256 characters) and the last gives `[n, context · vocab]`
//! logits.

use std::sync::Arc;

use burn::data::dataset::{Dataset as DatasetOf, DatasetError};
use burn::module::{Module, Param};
use burn::tensor::module::embedding;
use burn::tensor::{Device, Int, Tensor, TensorData};
use lockstep_data::text::{CharCorpus, Split};
use lockstep_model::ops::{gelu, layer_norm};
use lockstep_model::{
    cross_entropy_sum, flat, sum_ce_and_correct, ColumnParallelLinear, ColumnParallelLinearConfig,
    LayerKind, ParallelSelfAttention, ParallelSelfAttentionConfig, RowParallelLinear,
    RowParallelLinearConfig, TransformerSpec,
};

use crate::config::TrainConfig;
use crate::job::{BoxError, LayeredJob, LossReduction};

/// Token and position embeddings (`[vocab, d]`, `[context, d]`).
#[derive(Module, Debug)]
pub(super) struct Embed {
    tok: Param<Tensor<2>>,
    pos: Param<Tensor<2>>,
}

/// One block: `x + attention(ln1(x))`, then `x + down(gelu(up(ln2(x))))`.
#[derive(Module, Debug)]
pub(super) struct Block {
    ln1_gain: Param<Tensor<1>>,
    ln1_bias: Param<Tensor<1>>,
    attention: ParallelSelfAttention,
    ln2_gain: Param<Tensor<1>>,
    ln2_bias: Param<Tensor<1>>,
    up: ColumnParallelLinear,
    down: RowParallelLinear,
}

/// The final layer norm and the output projection (`[d, vocab]`, replicated).
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
pub(super) enum TpLayer {
    Embed(Embed),
    Block(Block),
    Head(Head),
}

/// The transformer of a config with `model.tp_pieces > 1`, and its corpus.
pub(super) struct TpTransformerJob {
    pub(super) spec: TransformerSpec,
    pub(super) pieces: usize,
    pub(super) corpus: Arc<CharCorpus>,
    /// Validation windows (evenly spaced over the validation text), as the unsplit model's.
    pub(super) eval_windows: Vec<u32>,
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

impl TpTransformerJob {
    fn dims(&self) -> (usize, usize, usize) {
        (self.spec.context, self.spec.d_model, self.spec.vocab)
    }

    /// Layer `l` with the spec's initial values from `seed`, in the layers' own layouts.
    fn initial_layer(&self, l: usize, seed: u64, device: &Device) -> TpLayer {
        let (t, d, v) = (self.spec.context, self.spec.d_model, self.spec.vocab);
        let ff = self.spec.d_ff;
        let canonical = self.spec.initial_params(l..l + 1, seed);
        let zeros1 = |n| Param::from_tensor(Tensor::zeros([n], device));
        let zeros2 = |a, b| Param::from_tensor(Tensor::zeros([a, b], device));
        let (layer, values) = match self.spec.layer_kind(l) {
            LayerKind::Embedding => {
                let layer = TpLayer::Embed(Embed {
                    tok: zeros2(v, d),
                    pos: zeros2(t, d),
                });
                (layer, canonical)
            }
            LayerKind::Block(_) => {
                let layer = TpLayer::Block(Block {
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
                let layer = TpLayer::Head(Head {
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

impl LayeredJob for TpTransformerJob {
    type Layer = TpLayer;
    type Item = Window;
    type Batch = TextBatch;
    // The cross-entropy summed over every predicted character, scaled by lockstep by
    // 1 / (global batch · context): the per-character mean, as the unsplit transformer's.
    const LOSS_REDUCTION: LossReduction = LossReduction::Sum;

    fn name(&self) -> &str {
        "lockstep"
    }

    fn loss_terms_per_sample(&self) -> usize {
        self.spec.context
    }

    fn layers(&self, cfg: &TrainConfig, device: &Device) -> Vec<TpLayer> {
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

    fn forward(&self, layer: &TpLayer, x: Tensor<2>) -> Tensor<2> {
        let (t, d, v) = self.dims();
        let n = x.dims()[0];
        let p = self.spec.products;
        match layer {
            TpLayer::Embed(e) => {
                let x = embedding(e.tok.val(), x.int());
                let pos: Tensor<3> = e.pos.val().unsqueeze();
                (x + pos).reshape([n, t * d])
            }
            TpLayer::Block(b) => {
                let x = x.reshape([n, t, d]);
                let h = layer_norm(x.clone(), b.ln1_gain.val(), b.ln1_bias.val());
                let x = x + b.attention.forward_in(h, p);
                let h = layer_norm(x.clone(), b.ln2_gain.val(), b.ln2_bias.val());
                let m = b.down.forward_in(gelu(b.up.forward_in(h, p)), p);
                (x + m).reshape([n, t * d])
            }
            TpLayer::Head(h) => {
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
        let (_, correct) = sum_ce_and_correct(flat::f32_slice(&logits), &batch.labels, v);
        vec![("accuracy", correct as f64)]
    }
}
