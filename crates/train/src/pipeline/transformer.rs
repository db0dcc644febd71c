//! lockstep's built-in character-level transformer as a [`Layered`] model: embedding, blocks,
//! head over a character corpus (the embedded Shakespeare plays, or `data.dir`), on the worker's
//! device (`train.device`: lockstep's kernels on the CPU, burn's operations elsewhere). With
//! `model.tp_pieces > 1` the same model is `builtin/tp_transformer.rs`'s job of `lockstep::tp`
//! layers instead.

use std::ops::Range;
use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::Device;
use lockstep_data::text::{CharCorpus, Split};
use lockstep_model::{
    LayerKind, LayerSource, Stage, StageEval, StageInput, StageOutput, TransformerSpec,
};

use super::layered::{Evaluated, Forwarded, LayerStage, Layered};
use crate::config::{Recompute, TrainConfig};
use crate::error::TrainError;
use crate::outcome::{EvalSums, ReplicaError};

/// Validation windows evaluated (evenly spaced over the validation text; 512 × context characters).
const EVAL_WINDOWS: usize = 512;

/// The transformer a config describes, for a corpus with `vocab` characters.
pub fn transformer_spec(cfg: &TrainConfig, vocab: usize) -> TransformerSpec {
    let m = &cfg.model;
    TransformerSpec {
        vocab,
        context: m.context,
        d_model: m.d_model,
        heads: m.heads,
        blocks: m.blocks,
        d_ff: if m.d_ff == 0 { 4 * m.d_model } else { m.d_ff },
        products: crate::precision::products(cfg),
    }
}

/// The corpus of a validated text config: the embedded Shakespeare plays, or, when `data.dir` is
/// set, that folder's `train.txt` and `val.txt` (plain or gzipped as `.txt.gz`).
pub fn load_corpus(cfg: &TrainConfig) -> Result<CharCorpus, TrainError> {
    if cfg.data.dir.is_empty() {
        return Ok(lockstep_data::text::load_shakespeare_embedded()?);
    }
    Ok(lockstep_data::text::load_char_corpus(&PathBuf::from(
        &cfg.data.dir,
    ))?)
}

/// The transformer of a config with its corpus.
pub struct Transformer {
    spec: TransformerSpec,
    corpus: CharCorpus,
    /// The autodiff device its stages compute on (`train.device`).
    device: Device,
    /// `train.recompute = "layers"`.
    recompute: bool,
}

/// The spec of a text config and its corpus, checked against each other: the spec is valid for
/// the corpus's characters and the validation text holds at least one window.
pub fn spec_and_corpus(cfg: &TrainConfig) -> Result<(TransformerSpec, CharCorpus), TrainError> {
    let corpus = load_corpus(cfg)?;
    let spec = transformer_spec(cfg, corpus.vocab_size());
    spec.validate()?;
    if corpus.num_windows(Split::Val, spec.context) == 0 {
        return Err(TrainError::ValidationTooShort {
            dataset: corpus.name.clone(),
            chars: corpus.tokens(Split::Val).len(),
            context: spec.context,
        });
    }
    Ok((spec, corpus))
}

/// The validation windows a transformer is evaluated on: `EVAL_WINDOWS` (or all there are),
/// evenly spaced over the validation text.
pub fn eval_windows(corpus: &CharCorpus, context: usize) -> Vec<u32> {
    let available = corpus.num_windows(Split::Val, context);
    let k = EVAL_WINDOWS.min(available);
    (0..k).map(|i| (i * available / k) as u32).collect()
}

impl Transformer {
    /// Load the corpus and check that the spec fits it; stages will compute on `device`.
    pub fn new(cfg: &TrainConfig, device: Device) -> Result<Transformer, TrainError> {
        let (spec, corpus) = spec_and_corpus(cfg)?;
        Ok(Transformer {
            spec,
            corpus,
            device,
            recompute: cfg.train.recompute == Recompute::Layers,
        })
    }
}

impl Layered for Transformer {
    fn name(&self) -> String {
        self.corpus.name.clone()
    }

    fn num_layers(&self) -> usize {
        self.spec.num_layers()
    }

    fn layer_offsets(&self) -> Vec<usize> {
        self.spec.layer_offsets()
    }

    fn structure_hash(&self) -> [u8; 32] {
        self.spec.structure_hash()
    }

    fn train_len(&self) -> usize {
        self.corpus.num_windows(Split::Train, self.spec.context)
    }

    fn eval_samples(&self) -> Vec<u32> {
        eval_windows(&self.corpus, self.spec.context)
    }

    fn eval_units(&self, samples: usize) -> f64 {
        // Loss and accuracy are per predicted character.
        (samples * self.spec.context) as f64
    }

    fn loss_scale(&self, global_batch: usize) -> f32 {
        1.0 / (global_batch * self.spec.context) as f32
    }

    fn profile_layers(&self, n: usize, reps: usize) -> Result<Vec<f64>, TrainError> {
        Ok(Stage::profile_layers(&self.spec, n, reps)?)
    }

    fn activation_floats(&self) -> Vec<usize> {
        let last = self.spec.num_layers() - 1;
        (0..=last)
            .map(|l| {
                if l == last {
                    0
                } else {
                    self.spec.context * self.spec.d_model
                }
            })
            .collect()
    }

    fn held_activation_floats(&self, layers: Range<usize>) -> usize {
        if !self.recompute {
            return crate::memory::transformer_held_floats(&self.spec, layers);
        }
        // Each layer's input: the token ids (two words each) or the residual stream.
        let stream = self.spec.context * self.spec.d_model;
        layers
            .map(|l| {
                if l == 0 {
                    2 * self.spec.context
                } else {
                    stream
                }
            })
            .sum()
    }

    fn layer_name(&self, layer: usize) -> String {
        match self.spec.layer_kind(layer) {
            LayerKind::Embedding => "embedding".into(),
            LayerKind::Block(b) => format!("block {b}"),
            LayerKind::Head => "head".into(),
        }
    }

    fn stage(
        &self,
        layers: Range<usize>,
        seed: u64,
    ) -> Result<Box<dyn LayerStage + '_>, TrainError> {
        let stage = Stage::new_on(&self.spec, layers, seed, self.device.clone())?
            .with_recompute(self.recompute);
        Ok(self.reading(stage))
    }
}

impl Transformer {
    /// `stage` with this transformer's corpus to read its tokens and targets from.
    fn reading(&self, stage: Stage) -> Box<dyn LayerStage + '_> {
        Box::new(TransformerStage {
            stage,
            corpus: &self.corpus,
            x: Vec::new(),
            y: Vec::new(),
        })
    }
}

/// How [`TransformerStage::forward_kept`] runs: its graph kept whole, cut between layers (for a
/// streamed backward), or each layer's parameters taken from a source (ZeRO 3 per layer).
enum Kept<'s> {
    Whole,
    Streamed,
    From(&'s mut dyn LayerSource),
}

/// Some layers of the transformer and the corpus they read tokens and targets from.
struct TransformerStage<'a> {
    stage: Stage,
    corpus: &'a CharCorpus,
    x: Vec<i64>,
    y: Vec<i64>,
}

impl TransformerStage<'_> {
    /// A training forward of micro-batch `id`, its graph kept whole or (`streamed`, for a
    /// backward that hands out each layer's gradient as it goes) cut between layers.
    fn forward_kept(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
        how: Kept<'_>,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        let t0 = Instant::now();
        self.gather(Split::Train, samples);
        let data_seconds = t0.elapsed().as_secs_f64();
        let stage_input = match input {
            Some(a) => StageInput::Activations(a),
            None => StageInput::Tokens(&self.x),
        };
        let targets = self.stage.is_last().then_some(&self.y[..]);
        let n = samples.len();
        let kept = match how {
            Kept::Whole => self.stage.forward(id, stage_input, n, targets, scale)?,
            Kept::Streamed => self
                .stage
                .forward_streamed(id, stage_input, n, targets, scale)?,
            Kept::From(source) => {
                self.stage
                    .forward_from(id, stage_input, n, targets, scale, source)?
            }
        };
        let out = match kept {
            StageOutput::Activations(a) => Forwarded::Activations(a),
            StageOutput::Loss(l) => Forwarded::Loss(l),
        };
        Ok((out, data_seconds))
    }

    /// Tokens and targets of `samples` (first and last stages only).
    fn gather(&mut self, split: Split, samples: &[u32]) {
        if self.stage.is_first() || self.stage.is_last() {
            let context = self.stage.spec().context;
            self.corpus
                .gather_windows(split, context, samples, &mut self.x, &mut self.y);
        }
    }
}

impl LayerStage for TransformerStage<'_> {
    fn is_first(&self) -> bool {
        self.stage.is_first()
    }

    fn is_last(&self) -> bool {
        self.stage.is_last()
    }

    fn num_params(&self) -> usize {
        self.stage.num_params()
    }

    fn params_flat(&self) -> Vec<f32> {
        self.stage.params_flat()
    }

    fn set_params_flat(&mut self, params: &[f32]) -> Result<(), ReplicaError> {
        Ok(self.stage.set_params_flat(params)?)
    }

    fn release_params(&mut self) {
        self.stage.release_params()
    }

    fn held(&self) -> usize {
        self.stage.held()
    }

    fn input_len(&self, n: usize) -> usize {
        if self.stage.is_first() {
            0
        } else {
            self.stage.spec().activation_len(n)
        }
    }

    fn output_len(&self, n: usize) -> usize {
        if self.stage.is_last() {
            0
        } else {
            self.stage.spec().activation_len(n)
        }
    }

    fn forward(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        self.forward_kept(id, samples, input, scale, Kept::Whole)
    }

    fn forward_streamed(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        self.forward_kept(id, samples, input, scale, Kept::Streamed)
    }

    fn fetches_layers(&self) -> bool {
        self.stage.fetches_layers()
    }

    fn forward_from(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
        source: &mut dyn LayerSource,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        self.forward_kept(id, samples, input, scale, Kept::From(source))
    }

    fn backward_from(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        grad: &mut [f32],
        source: &mut dyn LayerSource,
    ) -> Result<Option<Vec<f32>>, ReplicaError> {
        Ok(self.stage.backward_from(id, grad_output, grad, source)?)
    }

    fn backward_streaming(
        &mut self,
        id: u64,
        layers: &[Range<usize>],
        on_layer: &(dyn Fn(usize, &[f32]) + Sync),
    ) -> Result<(), ReplicaError> {
        self.stage
            .backward_streaming(id, None, layers, &mut |k, values| on_layer(k, values))?;
        Ok(())
    }

    fn backward(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        grad: &mut [f32],
    ) -> Result<Option<Vec<f32>>, ReplicaError> {
        Ok(self.stage.backward(id, grad_output, grad)?)
    }

    fn evaluate(
        &mut self,
        samples: &[u32],
        input: Option<&[f32]>,
    ) -> Result<Evaluated, ReplicaError> {
        self.gather(Split::Val, samples);
        let stage_input = match input {
            Some(a) => StageInput::Activations(a),
            None => StageInput::Tokens(&self.x),
        };
        let targets = self.stage.is_last().then_some(&self.y[..]);
        Ok(
            match self.stage.evaluate(stage_input, samples.len(), targets)? {
                StageEval::Activations(a) => Evaluated::Activations(a),
                StageEval::Scores { loss_sum, correct } => Evaluated::Sums(EvalSums {
                    loss: loss_sum,
                    metrics: vec![("accuracy".into(), correct as f64)],
                }),
            },
        )
    }
}
