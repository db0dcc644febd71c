//! [`LayeredJob`]: a burn user's model written as a sequence of layers, which lockstep can cut
//! into pipeline stages (`parallel.pp > 1`, GPipe or 1F1B, balanced cuts) with the same
//! parameter bits as one worker; [`Pipelined`] makes it (or any [`StagedJob`]) a job.
//!
//! Between stages an activation travels as its parts' words (`activation.rs`). A stage rebuilds
//! its input's float parts as fresh leaves that require a gradient, and a non-last stage's
//! backward starts from `Σ sum(output_i · grad_output_i)` over its output's float parts, whose
//! gradient with respect to each `output_i` is exactly `grad_output_i`: so the parameter
//! gradients of a cut model are bitwise those of the uncut one, and the driver's exact per-layer
//! sums make every layout reproduce the single-stage run.

use crate::ConfigLoad;
use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::tensor::{Device, Gradients, Tensor, TensorData};
use lockstep_model::flat::{self, ParamInfo};
use lockstep_model::{
    in_tp_scope, narrow_to_pieces, tp_params_of, LocalPieceSum, PieceSum, TpParam, UpdateRule,
};
use sha2::{Digest, Sha256};

use super::activation::{activation_of, float_values, parts_of, ActivationError, Layout, Part};
use super::burn_job::{self, guarded, metric_row, open_data, scalar, BoxError, LossReduction};
use super::staged_job::StagedJob;
use super::{catch_job_panic, EvalSums, JobSpec, ReplicaError, Trainable};
use crate::config::{ConfigError, JobSettings, TrainConfig};
use crate::device::Placement;
use crate::draws::{DrawPart, Draws};
use crate::pipeline::layered::{
    backward_then_hand_out, Evaluated, Forwarded, LayerSource, LayerStage, Layered,
};
use crate::TrainError;
use lockstep_run::{ModelShape, ParallelPlan};

mod recompute;

/// A training job whose model is a sequence of burn modules ("layers"), each mapping activations
/// `[samples, width]` to `[samples, width']`. Everything else is as in [`crate::job::Job`].
///
/// A sketch (compiled examples: `examples/own-pipeline`):
///
/// ```text
/// impl lockstep::LayeredJob for MyJob {
///     type Layer = Block;                 // one layer type (an enum deriving Module for several kinds)
///     …
///     fn layers(&self, _cfg: &TrainConfig, device: &Device) -> Vec<Block> { … }
///     fn input(&self, batch: &MyBatch) -> Tensor<2> { batch.features.clone() }
///     fn forward(&self, layer: &Block, x: Tensor<2>) -> Tensor<2> { layer.forward(x) }
///     fn loss(&self, output: Tensor<2>, batch: &MyBatch) -> Tensor<1> { … mean loss … }
/// }
/// fn main() { lockstep::main(lockstep::Pipelined(MyJob)) }
/// ```
pub trait LayeredJob: Send + Sync + 'static {
    /// One layer: any burn module (its float parameters are what lockstep trains).
    type Layer: Module + 'static;
    type Item: Send + 'static;
    type Batch;

    /// Short name, used in errors, logs and the report.
    fn name(&self) -> &str;
    /// Default configuration (TOML), as [`crate::job::Job::config`].
    fn config(&self) -> &str {
        ""
    }
    /// Called on each event of the training loop, as [`crate::job::Job::on_event`].
    fn on_event(&self, _event: &crate::Event) {}
    /// One line on what the job trains, as [`crate::job::Job::about`].
    fn about(&self) -> &str {
        ""
    }
    /// The job's version, as [`crate::job::Job::version`].
    fn version(&self) -> &str {
        ""
    }
    /// The type of the job's `[job]` settings, as [`crate::job::Job::SETTINGS`].
    const SETTINGS: JobSettings = JobSettings::NONE;
    /// Check the job's own settings, as [`crate::job::Job::validate`].
    fn validate(&self, _cfg: &TrainConfig) -> Result<(), String> {
        Ok(())
    }
    /// The model's layers, freshly initialised on `device` (seeded with `train.seed`). Every rank
    /// builds all of them and keeps its stage's.
    fn layers(&self, cfg: &TrainConfig, device: &Device) -> Vec<Self::Layer>;
    fn train_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Self::Item>>, BoxError>;
    fn eval_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Self::Item>>, BoxError>;
    /// Turn items into a batch on `device` (the shape of burn's `Batcher::batch`).
    fn batch(&self, items: Vec<Self::Item>, device: &Device) -> Self::Batch;
    /// The first layer's input for a batch, `[samples, width]`.
    fn input(&self, batch: &Self::Batch) -> Tensor<2>;
    /// One layer's forward.
    fn forward(&self, layer: &Self::Layer, x: Tensor<2>) -> Tensor<2>;
    /// The mean loss of a batch from the last layer's output: a single value (a sum over the
    /// samples with [`LayeredJob::LOSS_REDUCTION`] = [`LossReduction::Sum`]).
    fn loss(&self, output: Tensor<2>, batch: &Self::Batch) -> Tensor<1>;
    /// What [`LayeredJob::loss`] returns, as [`crate::job::Job::LOSS_REDUCTION`].
    const LOSS_REDUCTION: LossReduction = LossReduction::Mean;
    /// How many terms one sample's loss sums — the predicted tokens of a sequence for a language
    /// model (default 1). lockstep scales the loss by `1 / (global batch × terms)` and reports
    /// losses and metrics per term: with [`LossReduction::Sum`] and a loss summed over every
    /// token, the per-token mean with one rounding.
    fn loss_terms_per_sample(&self) -> usize {
        1
    }
    /// A short name of layer `layer` for messages and `lockstep plan` (default: "layer N").
    fn layer_name(&self, layer: usize) -> String {
        format!("layer {layer}")
    }
    /// Values per sample that layer `layer`'s training graph keeps for its backward, if you know
    /// them (an estimate, for `summary.json`'s activation memory and `lockstep plan`; default:
    /// none, and lockstep counts the layer's output, a lower bound).
    fn graph_floats_per_sample(&self, _layer: usize) -> Option<usize> {
        None
    }
    /// Evaluation metrics from the last layer's output, as sums over the batch's samples (or
    /// their terms, [`LayeredJob::loss_terms_per_sample`]).
    fn metrics(&self, _output: Tensor<2>, _batch: &Self::Batch) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
    /// Your own optimizer update on flat slices, used when the config says
    /// `optimizer.kind = "custom"` (default: none), as for [`crate::Job::update_rule`].
    fn update_rule(&self, _cfg: &TrainConfig) -> Option<Box<dyn UpdateRule>> {
        None
    }
    /// Names of the training metrics [`LayeredJob::loss_and_metrics`] returns, in its order
    /// (default: none).
    const TRAIN_METRICS: &'static [&'static str] = &[];
    /// The layers take `train.precision`, as [`crate::Job::BF16_PRODUCTS`] (default: no).
    const BF16_PRODUCTS: bool = false;
    /// The training loss with metrics from the same output: the loss as
    /// [`LayeredJob::loss`] gives it, and one sum over the batch's samples per name in
    /// [`LayeredJob::TRAIN_METRICS`]. Summed exactly over the global batch and logged every step
    /// as per-sample means, as for [`crate::Job::loss_and_metrics`]. Default: the loss and no
    /// metrics.
    fn loss_and_metrics(&self, output: Tensor<2>, batch: &Self::Batch) -> (Tensor<1>, Vec<f64>) {
        (self.loss(output, batch), Vec::new())
    }
}

/// A [`LayeredJob`] (or any [`StagedJob`]) as a job:
/// `lockstep::main(lockstep::Pipelined(MyJob))`. It runs with any `parallel.pp` (1 = data
/// parallel only) and `parallel.dp`.
pub struct Pipelined<J>(pub J);

impl<J: StagedJob> JobSpec for Pipelined<J> {
    fn name(&self) -> String {
        self.0.name().to_string()
    }

    fn model_record(
        &self,
        cfg: &TrainConfig,
        params: &[f32],
    ) -> Option<Result<Vec<u8>, TrainError>> {
        Some(crate::export::record_of(
            self.0.name(),
            cfg,
            params,
            |device| self.0.layers(cfg, device),
        ))
    }

    fn on_event(&self, event: &crate::Event) {
        self.0.on_event(event)
    }

    fn binary(&self) -> Option<crate::job::BinaryAbout> {
        Some(crate::job::BinaryAbout {
            about: self.0.about().to_string(),
            version: self.0.version().to_string(),
        })
    }

    fn default_config(&self) -> String {
        self.0.config().to_string()
    }

    fn shape(&self, _cfg: &TrainConfig) -> ModelShape {
        // Its layers and pieces are known once built: the workers check them then.
        ModelShape::Layered {
            layers: None,
            tp_pieces: None,
            pieces_from: String::new(),
            recomputes: true,
            bf16_products: J::BF16_PRODUCTS,
        }
    }

    fn validate(&self, cfg: &TrainConfig) -> Result<(), ConfigError> {
        cfg.validate_common_layered()?;
        ParallelPlan::check_shape(cfg, &self.shape(cfg))?;
        burn_job::check_job_items(
            cfg,
            self.0.name(),
            J::SETTINGS,
            J::TRAIN_METRICS,
            self.0.update_rule(cfg).as_deref(),
        )?;
        self.0
            .validate(cfg)
            .map_err(|message| ConfigError::Invalid {
                field: "job",
                message: format!("job `{}`: {message}", self.0.name()),
            })?;
        if cfg.parallel.tp > 1 {
            // Tensor parallelism needs the model's tensor-parallel layers: build them once (on
            // the seeded device, as a worker would) to learn their pieces before any worker starts.
            let device = Placement::cpu().seeded(cfg.train.seed);
            let layers = catch_job_panic(|| self.0.layers(cfg, &device)).map_err(|p| {
                ConfigError::Invalid {
                    field: "job",
                    message: format!("job `{}`: building the layers panicked: {p}", self.0.name()),
                }
            })?;
            let kinds: Vec<_> = layers.iter().map(tp_params_of).collect();
            let pieces = model_pieces(self.0.name(), &kinds).map_err(|e| match e {
                TrainError::Config(c) => c,
                other => ConfigError::Invalid {
                    field: "parallel.tp",
                    message: other.to_string(),
                },
            })?;
            let shape = ModelShape::Layered {
                layers: Some(layers.len()),
                tp_pieces: Some(pieces),
                pieces_from: format!("job `{}`'s tensor-parallel layers", self.0.name()),
                recomputes: true,
                bf16_products: J::BF16_PRODUCTS,
            };
            ParallelPlan::check_shape(cfg, &shape)?;
        }
        Ok(())
    }

    fn build(&self, cfg: &TrainConfig, device: &Placement) -> Result<Trainable<'_>, TrainError> {
        Ok(Trainable::Layered(Box::new(BurnLayered::new(
            &self.0, cfg, device,
        )?)))
    }
}

/// A [`StagedJob`]'s layers and data on one rank, as the pipeline driver's [`Layered`].
pub struct BurnLayered<'j, J: StagedJob> {
    job: JobRef<'j, J>,
    device: Device,
    layers: Vec<J::Layer>,
    /// Flat offset of each layer's first parameter, and the total.
    offsets: Vec<usize>,
    /// The layout of the first layer's input, then of each layer's output (from one sample).
    boundaries: Vec<Layout>,
    structure_hash: [u8; 32],
    train: Box<dyn Dataset<J::Item>>,
    eval: Box<dyn Dataset<J::Item>>,
    /// Each layer's parameters (canonical order) and which of them tensor-parallel layers split.
    layouts: Vec<Vec<ParamInfo>>,
    tp_params: Vec<Vec<Option<TpParam>>>,
    /// The fixed pieces of the model's tensor-parallel layers (1: none).
    pieces: usize,
    /// `train.recompute = "layers"`: training forwards keep only each layer's input.
    recompute: bool,
}

/// The pieces all tensor-parallel layers of a model share (1 without any), or why they do not.
fn model_pieces(job: &str, kinds: &[Vec<Option<TpParam>>]) -> Result<usize, TrainError> {
    let mut seen: Vec<(usize, usize)> = Vec::new();
    for (l, layer) in kinds.iter().enumerate() {
        for p in layer.iter().flatten() {
            if !seen.iter().any(|&(_, t)| t == p.pieces) {
                seen.push((l, p.pieces));
            }
        }
    }
    match seen.as_slice() {
        [] => Ok(1),
        [(_, t)] => Ok(*t),
        [(a, ta), (b, tb), ..] => Err(TrainError::JobSetup {
            job: job.to_string(),
            message: format!(
                "the model's tensor-parallel layers must all have the same pieces: layer {a} has \
                 {ta}, layer {b} has {tb}"
            ),
        }),
    }
}

/// A [`PieceSum`] that only gives shapes (zeros): probing activation widths on a rank's pieces
/// without its group.
struct ShapeOnly;

impl PieceSum for ShapeOnly {
    fn sum_pieces(&mut self, _: &[&[f32]], _: usize, out: &mut [f32]) -> Result<(), String> {
        out.fill(0.0);
        Ok(())
    }
}

/// The job a [`BurnLayered`] runs: a user's, borrowed from the caller, or one built for the run
/// (the built-in classifiers, which hold their datasets).
enum JobRef<'j, J> {
    Borrowed(&'j J),
    Owned(Box<J>),
}

impl<J> std::ops::Deref for JobRef<'_, J> {
    type Target = J;

    fn deref(&self) -> &J {
        match self {
            JobRef::Borrowed(job) => job,
            JobRef::Owned(job) => job,
        }
    }
}

impl<J: StagedJob> BurnLayered<'static, J> {
    /// [`BurnLayered::new`] for a job made for this run, which it keeps.
    pub fn owning(job: J, cfg: &TrainConfig, place: &Placement) -> Result<Self, TrainError> {
        Self::with_job(JobRef::Owned(Box::new(job)), cfg, place)
    }
}

impl<'j, J: StagedJob> BurnLayered<'j, J> {
    pub fn new(job: &'j J, cfg: &TrainConfig, place: &Placement) -> Result<Self, TrainError> {
        Self::with_job(JobRef::Borrowed(job), cfg, place)
    }

    fn with_job(
        job: JobRef<'j, J>,
        cfg: &TrainConfig,
        place: &Placement,
    ) -> Result<Self, TrainError> {
        let name = job.name().to_string();
        let setup = |message: String| TrainError::JobSetup {
            job: name.clone(),
            message,
        };
        let (train, eval) = open_data(&name, job.train_data(cfg), job.eval_data(cfg))?;
        if eval.is_empty() || train.is_empty() {
            return Err(setup("a dataset is empty".into()));
        }
        let device = place.seeded(cfg.train.seed);
        let layers = catch_job_panic(|| job.layers(cfg, &device))
            .map_err(|p| setup(format!("building the layers panicked: {p}")))?;
        let layers = crate::export::init_from(&name, layers, cfg)?;
        if layers.is_empty() {
            return Err(setup("the model has no layers".into()));
        }
        let mut offsets = vec![0];
        let mut normalised = Vec::with_capacity(layers.len());
        let mut layouts = Vec::with_capacity(layers.len());
        for layer in layers {
            let layout = flat::layout(&layer);
            let len: usize = layout.iter().map(|p| p.len).sum();
            // Every parameter an autodiff leaf of our device, from its own values.
            let values = flat::read(&layer, len);
            normalised.push(flat::write(layer, &values, &device));
            offsets.push(offsets.last().unwrap() + len);
            layouts.push(layout);
        }
        let tp_params: Vec<_> = normalised.iter().map(tp_params_of).collect();
        let pieces = model_pieces(&name, &tp_params)?;
        if *offsets.last().unwrap() == 0 {
            return Err(setup("the model has no float parameters to train".into()));
        }
        let structure_hash = structure_hash(&name, &normalised);
        let mut me = BurnLayered {
            job,
            device,
            layers: normalised,
            offsets,
            boundaries: Vec::new(),
            structure_hash,
            train,
            eval,
            layouts,
            tp_params,
            pieces,
            recompute: cfg.train.recompute == crate::config::Recompute::Layers,
        };
        me.boundaries = me
            .probe_boundaries(&me.layers)
            .map_err(|e| setup(e.to_string()))?;
        Ok(me)
    }

    /// One training sample through `layers` (no gradients): the activations' layouts.
    fn probe_boundaries(&self, layers: &[J::Layer]) -> Result<Vec<Layout>, ReplicaError> {
        let device = self.device.clone().inner();
        let batch = batch_of(&*self.job, &*self.train, "training", &[0], &device)?;
        let mut x = guarded(|| self.job.input(&batch))?;
        let mut boundaries = Vec::with_capacity(layers.len() + 1);
        for l in 0..=layers.len() {
            let parts = parts_of(x);
            let place = |e: ActivationError| {
                ReplicaError::Other(match l {
                    0 => format!("the first layer's input: {e}"),
                    _ => format!("layer {}'s output: {e}", l - 1),
                })
            };
            boundaries.push(Layout::of(&parts, 1).map_err(place)?);
            x = activation_of(parts).map_err(place)?;
            if let Some(layer) = layers.get(l) {
                let layer = layer.valid();
                x = guarded(|| self.job.forward(&layer, x))?;
            }
        }
        Ok(boundaries)
    }

    /// Where tp rank `tp_rank` of `tp`'s local parameters of `layers` sit in the stage's canonical
    /// vector (merged ranges, local order), and the local vector cut into runs that never mix
    /// pieces (split tensors per piece, others whole).
    fn tp_maps(
        &self,
        layers: Range<usize>,
        tp: usize,
        tp_rank: usize,
    ) -> (Vec<Range<usize>>, Vec<Range<usize>>) {
        let mut map: Vec<Range<usize>> = Vec::new();
        let mut runs = Vec::new();
        let mut local = 0;
        let stage_start = self.offsets[layers.start];
        for l in layers {
            for (info, kind) in self.layouts[l].iter().zip(&self.tp_params[l]) {
                let base = self.offsets[l] - stage_start + info.offset;
                let (range, piece_len) = match kind {
                    Some(split) => {
                        let piece_len = info.len / split.pieces;
                        let count = split.pieces / tp;
                        let first = tp_rank * count;
                        (
                            base + first * piece_len..base + (first + count) * piece_len,
                            piece_len,
                        )
                    }
                    None => (base..base + info.len, info.len),
                };
                let len = range.len();
                match map.last_mut() {
                    Some(last) if last.end == range.start => last.end = range.end,
                    _ => map.push(range),
                }
                let mut s = local;
                while s < local + len {
                    runs.push(s..s + piece_len.max(1).min(local + len - s));
                    s += piece_len.max(1);
                }
                local += len;
            }
        }
        (map, runs)
    }
}

/// The items of `samples` from `set`, batched on `device` by the job.
fn batch_of<J: StagedJob>(
    job: &J,
    set: &dyn Dataset<J::Item>,
    split: &'static str,
    samples: &[u32],
    device: &Device,
) -> Result<J::Batch, ReplicaError> {
    burn_job::batch_of(set, split, samples, |items| job.batch(items, device))
}

impl<J: StagedJob> Layered for BurnLayered<'_, J> {
    fn name(&self) -> String {
        self.job.name().to_string()
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn layer_offsets(&self) -> Vec<usize> {
        self.offsets.clone()
    }

    fn structure_hash(&self) -> [u8; 32] {
        self.structure_hash
    }

    fn update_rule(&self, cfg: &TrainConfig) -> Option<std::sync::Arc<dyn UpdateRule>> {
        self.job.update_rule(cfg).map(std::sync::Arc::from)
    }

    fn train_len(&self) -> usize {
        self.train.len()
    }

    fn eval_samples(&self) -> Vec<u32> {
        (0..self.eval.len() as u32).collect()
    }

    fn eval_units(&self, samples: usize) -> f64 {
        (samples * self.job.loss_terms_per_sample()) as f64
    }

    fn loss_scale(&self, global_batch: usize) -> f32 {
        1.0 / (global_batch * self.job.loss_terms_per_sample()) as f32
    }

    fn profile_layers(&self, n: usize, reps: usize) -> Result<Vec<f64>, TrainError> {
        // Forward of each layer on the first `n` training samples, without gradients: the
        // relative costs the balancer needs (backward is about proportional).
        let device = self.device.clone().inner();
        let samples: Vec<u32> = (0..n.min(self.train.len()) as u32).collect();
        let fail = |e: ReplicaError| TrainError::JobSetup {
            job: self.job.name().to_string(),
            message: format!("profiling the layers: {e}"),
        };
        let batch =
            batch_of(&*self.job, &*self.train, "training", &samples, &device).map_err(fail)?;
        let layers: Vec<J::Layer> = self.layers.iter().map(|l| l.valid()).collect();
        let mut times = vec![Vec::with_capacity(reps); layers.len()];
        for rep in 0..=reps {
            let mut x = guarded(|| self.job.input(&batch)).map_err(fail)?;
            for (l, layer) in layers.iter().enumerate() {
                let t0 = Instant::now();
                x = guarded(|| self.job.forward(layer, x)).map_err(fail)?;
                if rep > 0 {
                    times[l].push(t0.elapsed().as_secs_f64());
                }
            }
        }
        Ok(times.into_iter().map(crate::metrics::median).collect())
    }

    fn activation_floats(&self) -> Vec<usize> {
        let last = self.layers.len() - 1;
        (0..=last)
            .map(|l| {
                if l == last {
                    0
                } else {
                    self.boundaries[l + 1].words_per_sample()
                }
            })
            .collect()
    }

    fn held_activation_floats(&self, layers: Range<usize>) -> usize {
        // Recomputed: each layer's input (its words); else the job's estimate of each layer's
        // graph, or at least its output (a lower bound: burn's graph keeps more).
        let outputs = self.activation_floats();
        let kept = |l: usize| match self.recompute {
            true => self.boundaries[l].words_per_sample(),
            false => self.job.graph_floats_per_sample(l).unwrap_or(outputs[l]),
        };
        layers.map(kept).sum()
    }

    fn layer_name(&self, layer: usize) -> String {
        self.job.layer_name(layer)
    }

    fn stage(
        &self,
        layers: Range<usize>,
        seed: u64,
    ) -> Result<Box<dyn LayerStage + '_>, TrainError> {
        if self.pieces > 1 {
            // Tensor-parallel layers are always computed as their pieces: one rank holding all.
            return self.tp_stage(layers, seed, 1, 0, Box::new(LocalPieceSum));
        }
        // The seed was used once, for the whole model: every rank cuts the same initial values.
        let num_params = self.offsets[layers.end] - self.offsets[layers.start];
        Ok(Box::new(BurnStage {
            owner: self,
            first: layers.start == 0,
            last: layers.end == self.layers.len(),
            in_layout: self.boundaries[layers.start].clone(),
            out_layout: self.boundaries[layers.end].clone(),
            layers: self.layers[layers.clone()].to_vec(),
            num_params,
            pending: HashMap::new(),
            kept: HashMap::new(),
            tp: None,
            released: None,
            streamed: HashMap::new(),
            first_layer: layers.start,
            draws: None,
            metric_rows: Vec::new(),
        }))
    }

    fn tp_pieces(&self) -> usize {
        self.pieces
    }

    fn tp_split_params(&self, layer: usize) -> usize {
        self.layouts[layer]
            .iter()
            .zip(&self.tp_params[layer])
            .filter(|(_, kind)| kind.is_some())
            .map(|(info, _)| info.len)
            .sum()
    }

    fn tp_stage(
        &self,
        layers: Range<usize>,
        _seed: u64,
        tp: usize,
        tp_rank: usize,
        sum: Box<dyn PieceSum>,
    ) -> Result<Box<dyn LayerStage + '_>, TrainError> {
        // The plan checked `tp` against the model's pieces.
        let job = self.job.name();
        let setup = |message: String| TrainError::JobSetup {
            job: job.to_string(),
            message,
        };
        // Every rank built the whole model from the same seed; each keeps its pieces' rows. The
        // layers before the stage are narrowed too, only to learn the stage's input layout.
        let narrowed: Vec<J::Layer> = catch_job_panic(|| {
            self.layers[..layers.end]
                .iter()
                .map(|l| narrow_to_pieces(l.clone(), tp, tp_rank, &self.device))
                .collect()
        })
        .map_err(|p| {
            setup(format!(
                "narrowing the tensor-parallel layers panicked: {p}"
            ))
        })?;
        let mut probe: Box<dyn PieceSum> = Box::new(ShapeOnly);
        let (boundaries, _) =
            in_tp_scope(tp, tp_rank, &mut probe, || self.probe_boundaries(&narrowed));
        let boundaries = boundaries
            .map_err(|e| setup(format!("tensor parallelism (parallel.tp = {tp}): {e}")))?;
        let last = layers.end == self.layers.len();
        if let Some(why) = (last)
            .then(|| self.boundaries[layers.end].mismatch(&boundaries[layers.end]))
            .flatten()
        {
            return Err(setup(format!(
                "with parallel.tp = {tp} the last layer's output differs on each rank ({why}): a \
                 model must end with its pieces summed (a RowParallelLinear after a \
                 ColumnParallelLinear), not with a ColumnParallelLinear's local pieces"
            )));
        }
        let (map, runs) = self.tp_maps(layers.clone(), tp, tp_rank);
        let num_params = map.iter().map(|r| r.len()).sum();
        Ok(Box::new(BurnStage {
            owner: self,
            first: layers.start == 0,
            last,
            in_layout: boundaries[layers.start].clone(),
            out_layout: boundaries[layers.end].clone(),
            layers: narrowed[layers.clone()].to_vec(),
            num_params,
            pending: HashMap::new(),
            kept: HashMap::new(),
            released: None,
            streamed: HashMap::new(),
            tp: Some(StageTp {
                tp,
                tp_rank,
                sum: Some(sum),
                map,
                runs,
            }),
            first_layer: layers.start,
            draws: None,
            metric_rows: Vec::new(),
        }))
    }
}

/// A tensor-parallel rank's side of a stage.
struct StageTp {
    tp: usize,
    tp_rank: usize,
    /// Lent to the tp scope during forward, backward and evaluation.
    sum: Option<Box<dyn PieceSum>>,
    /// The local parameters' ranges in the stage's canonical vector.
    map: Vec<Range<usize>>,
    /// The local vector in runs that never mix pieces (bucket boundaries).
    runs: Vec<Range<usize>>,
}

/// What a training forward keeps until its backward.
struct Pending {
    /// The input's float leaves (non-first stages), whose gradients go back to the previous
    /// stage.
    input: Vec<Tensor<1>>,
    /// The micro-batch's samples.
    n: usize,
    output: PendingOutput,
}

enum PendingOutput {
    /// The output's float parts (flattened), which the next stage's gradient multiplies.
    Activations(Vec<Tensor<1>>),
    /// Boxed: a tensor is far larger than a `Vec`.
    Loss(Box<Tensor<1>>),
}

/// Some consecutive layers of a [`StagedJob`].
struct BurnStage<'a, 'j, J: StagedJob> {
    owner: &'a BurnLayered<'j, J>,
    first: bool,
    last: bool,
    /// What the stage receives and sends (per sample).
    in_layout: Layout,
    out_layout: Layout,
    layers: Vec<J::Layer>,
    num_params: usize,
    pending: HashMap<u64, Pending>,
    tp: Option<StageTp>,
    /// The layers' parameter shapes while their values are released (ZeRO 3 between steps).
    released: Option<Vec<ParamInfo>>,
    /// Micro-batches forwarded for a streaming backward, each layer's graph apart.
    streamed: HashMap<u64, Split>,
    /// Index of the stage's first layer in the whole model (the key of its layers' draws).
    first_layer: usize,
    /// The draws of the micro-batch about to be forwarded.
    draws: Option<Draws>,
    /// The training metrics of the micro-batches whose loss this (last) stage computed since the
    /// driver last took them.
    metric_rows: Vec<Vec<f32>>,
    /// `train.recompute = "layers"`: the micro-batches forwarded without their graphs.
    kept: HashMap<u64, recompute::Kept<J::Batch>>,
}

/// A micro-batch's graph cut after every layer, as at a stage boundary (each layer's input
/// fresh leaves of the previous layer's output values), so backward can run layer by layer.
struct Split {
    /// Per layer: its input's float leaves (none for the first) and its output's float parts.
    layers: Vec<(Vec<Tensor<1>>, Vec<Tensor<1>>)>,
    loss: Tensor<1>,
}

impl<J: StagedJob> BurnStage<'_, '_, J> {
    /// `f` inside this rank's tp scope (a tensor-parallel stage), so that its layers compute
    /// their pieces and sum them with the group; a failed piece sum is the result.
    fn scoped<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<R, ReplicaError>,
    ) -> Result<R, ReplicaError> {
        let Some((tp, tp_rank, mut sum)) = self
            .tp
            .as_mut()
            .and_then(|t| Some((t.tp, t.tp_rank, t.sum.take()?)))
        else {
            return f(self);
        };
        let (result, failure) = in_tp_scope(tp, tp_rank, &mut sum, || f(self));
        if let Some(t) = self.tp.as_mut() {
            t.sum = Some(sum);
        }
        match failure {
            Some(message) => Err(ReplicaError::Other(format!(
                "a tensor-parallel piece sum failed: {message}"
            ))),
            None => result,
        }
    }

    /// Reseed the device for `part` of the micro-batch being forwarded (nothing before the
    /// driver's first `begin_microbatch`, e.g. while profiling).
    fn reseed(&self, part: DrawPart) {
        if let Some(d) = self.draws {
            d.seed(&self.owner.device, part);
        }
    }

    /// The training batch of `samples` where this stage reads one (the first stage's input, the
    /// last stage's loss), drawing the micro-batch's batch draws; and the seconds it took.
    fn training_batch(&self, samples: &[u32]) -> Result<(Option<J::Batch>, f64), ReplicaError> {
        let t0 = Instant::now();
        let batch = if self.first || self.last {
            self.reseed(DrawPart::Batch);
            let set = &*self.owner.train;
            Some(batch_of(
                &*self.owner.job,
                set,
                "training",
                samples,
                &self.owner.device,
            )?)
        } else {
            None
        };
        Ok((batch, t0.elapsed().as_secs_f64()))
    }

    /// The stage's input: the batch's (first stage) or the received activations, whose float
    /// parts are leaves that require a gradient when `train` (returned too).
    fn input(
        &self,
        batch: Option<&J::Batch>,
        received: Option<&[f32]>,
        n: usize,
        device: &Device,
        train: bool,
    ) -> Result<(Vec<Tensor<1>>, J::Activation), ReplicaError> {
        match (batch, received) {
            (Some(b), None) if self.first => Ok((Vec::new(), guarded(|| self.owner.job.input(b))?)),
            (_, Some(words)) if !self.first => {
                let (parts, leaves) = self
                    .in_layout
                    .decode(words, n, device, train)
                    .map_err(ReplicaError::Other)?;
                let x = activation_of(parts).map_err(|e| {
                    ReplicaError::Other(format!("the stage's input does not fit its type: {e}"))
                })?;
                Ok((leaves, x))
            }
            _ => Err(ReplicaError::Other(
                "a stage got no input (internal: first-stage flag and input disagree)".into(),
            )),
        }
    }

    /// This stage's layers over `x`; in training (`train`), each layer drawing from its own
    /// stream of the micro-batch's draws.
    fn run_layers(
        &self,
        layers: &[J::Layer],
        mut x: J::Activation,
        train: bool,
    ) -> Result<J::Activation, ReplicaError> {
        for (i, layer) in layers.iter().enumerate() {
            if train {
                self.reseed(DrawPart::Layer(self.first_layer + i));
            }
            x = guarded(|| self.owner.job.forward(layer, x))?;
        }
        Ok(x)
    }

    /// A non-last stage's output of `n` samples for the next stage: its words, and its parts
    /// (checked against the layout the model was built with).
    fn outgoing(&self, x: J::Activation, n: usize) -> Result<(Vec<f32>, Vec<Part>), ReplicaError> {
        let parts = parts_of(x);
        let layout = Layout::of(&parts, n)
            .map_err(|e| ReplicaError::Other(format!("the stage's output: {e}")))?;
        if let Some(why) = self.out_layout.mismatch(&layout) {
            return Err(ReplicaError::Other(format!("the stage's output: {why}")));
        }
        let words = Layout::encode(&parts).map_err(ReplicaError::Other)?;
        Ok((words, parts))
    }
}

impl<J: StagedJob> LayerStage for BurnStage<'_, '_, J> {
    fn is_first(&self) -> bool {
        self.first
    }

    fn is_last(&self) -> bool {
        self.last
    }

    fn num_params(&self) -> usize {
        self.num_params
    }

    fn params_flat(&self) -> Vec<f32> {
        flat::read(&self.layers, self.num_params)
    }

    fn set_params_flat(&mut self, params: &[f32]) -> Result<(), ReplicaError> {
        if params.len() != self.num_params {
            return Err(ReplicaError::ParamLength {
                what: "set_params_flat",
                expected: self.num_params,
                got: params.len(),
            });
        }
        let layers = std::mem::take(&mut self.layers);
        self.layers = match self.released.take() {
            Some(layout) => crate::device::timed_copy(|| {
                flat::write_shaped(layers, params, &self.owner.device, &layout)
            }),
            None => crate::device::timed_copy(|| flat::write(layers, params, &self.owner.device)),
        };
        Ok(())
    }

    fn release_params(&mut self) {
        assert!(
            self.pending.is_empty() && self.kept.is_empty(),
            "parameters released with {} forward graphs pending",
            self.pending.len() + self.kept.len()
        );
        if self.released.is_none() {
            self.released = Some(flat::layout(&self.layers));
            let layers = std::mem::take(&mut self.layers);
            self.layers = flat::release(layers, &self.owner.device);
        }
    }

    fn held(&self) -> usize {
        self.pending.len() + self.streamed.len() + self.kept.len()
    }

    fn input_len(&self, n: usize) -> usize {
        if self.first {
            0
        } else {
            n * self.in_layout.words_per_sample()
        }
    }

    fn output_len(&self, n: usize) -> usize {
        if self.last {
            0
        } else {
            n * self.out_layout.words_per_sample()
        }
    }

    fn begin_microbatch(&mut self, draws: Draws) {
        self.draws = Some(draws);
    }

    fn forward(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        self.scoped(|s| s.forward_in_scope(id, samples, input, scale))
    }

    fn backward(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        grad: &mut [f32],
    ) -> Result<Option<Vec<f32>>, ReplicaError> {
        self.scoped(|s| s.backward_in_scope(id, grad_output, grad))
    }

    fn evaluate(
        &mut self,
        samples: &[u32],
        input: Option<&[f32]>,
    ) -> Result<Evaluated, ReplicaError> {
        self.scoped(|s| s.evaluate_in_scope(samples, input))
    }

    fn train_metric_names(&self) -> Vec<String> {
        J::TRAIN_METRICS.iter().map(|n| n.to_string()).collect()
    }

    fn take_train_metrics(&mut self) -> Vec<Vec<f32>> {
        std::mem::take(&mut self.metric_rows)
    }

    fn forward_streamed(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        if !(self.first && self.last) || self.tp.is_some() || input.is_some() {
            return self.forward(id, samples, input, scale);
        }
        self.forward_split(id, samples, scale)
    }

    fn fetches_layers(&self) -> bool {
        self.owner.recompute
    }

    fn forward_from(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
        source: &mut dyn LayerSource,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        if !self.fetches_layers() || self.released.is_none() {
            return Err(ReplicaError::Other(
                "a stage takes its layers one at a time only when it recomputes them and holds \
                 no parameters (released)"
                    .into(),
            ));
        }
        self.scoped(|s| s.forward_kept(id, samples, input, scale, Some(source)))
    }

    fn backward_from(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        grad: &mut [f32],
        source: &mut dyn LayerSource,
    ) -> Result<Option<Vec<f32>>, ReplicaError> {
        let kept = self.kept.remove(&id).ok_or_else(|| {
            ReplicaError::Other(format!(
                "backward of micro-batch {id} without its recomputing forward"
            ))
        })?;
        self.scoped(|s| s.backward_kept(kept, grad_output, grad, Some(source)))
    }

    fn evaluate_from(
        &mut self,
        chunks: &[&[u32]],
        inputs: &[Option<Vec<f32>>],
        source: &mut dyn LayerSource,
    ) -> Result<Vec<Evaluated>, ReplicaError> {
        if !self.fetches_layers() || self.released.is_none() || chunks.len() != inputs.len() {
            return Err(ReplicaError::Other(
                "an evaluation takes the layers one at a time only on a stage that recomputes \
                 them and holds no parameters (released), with one input per chunk"
                    .into(),
            ));
        }
        self.scoped(|s| s.evaluate_by_layer(chunks, inputs, source))
    }

    fn backward_streaming(
        &mut self,
        id: u64,
        layers: &[Range<usize>],
        on_layer: &(dyn Fn(usize, &[f32]) + Sync),
    ) -> Result<(), ReplicaError> {
        match self.streamed.remove(&id) {
            Some(split) => self.backward_split(split, layers, on_layer),
            None => backward_then_hand_out(self, id, layers, on_layer),
        }
    }

    fn index_map(&self) -> Vec<Range<usize>> {
        match &self.tp {
            Some(t) => t.map.clone(),
            None => std::iter::once(0..self.num_params).collect(),
        }
    }

    fn grad_buckets(&self, bucket_elems: usize) -> Option<Vec<Range<usize>>> {
        let t = self.tp.as_ref()?;
        let step = bucket_elems.max(1);
        let mut out = Vec::new();
        for run in &t.runs {
            let mut s = run.start;
            while s < run.end {
                let e = (s + step).min(run.end);
                out.push(s..e);
                s = e;
            }
        }
        Some(out)
    }
}

impl<J: StagedJob> BurnStage<'_, '_, J> {
    fn forward_in_scope(
        &mut self,
        id: u64,
        samples: &[u32],
        input: Option<&[f32]>,
        scale: f32,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        if self.owner.recompute {
            return self.forward_kept(id, samples, input, scale, None);
        }
        let device = self.owner.device.clone();
        let n = samples.len();
        let (batch, data_seconds) = self.training_batch(samples)?;
        let (leaves, x) = self.input(batch.as_ref(), input, n, &device, true)?;
        let x = self.run_layers(&self.layers, x, true)?;
        let (output, result) = if self.last {
            let batch = batch.as_ref().expect("the last stage reads its batch");
            let (scaled, value) = self.scaled_loss(x, batch, J::LOSS_REDUCTION.share(n, scale))?;
            (
                PendingOutput::Loss(Box::new(scaled)),
                Forwarded::Loss(value),
            )
        } else {
            let (words, parts) = self.outgoing(x, n)?;
            (
                PendingOutput::Activations(float_values(parts)),
                Forwarded::Activations(words),
            )
        };
        self.pending.insert(
            id,
            Pending {
                input: leaves,
                n,
                output,
            },
        );
        Ok((result, data_seconds))
    }

    fn backward_in_scope(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        grad: &mut [f32],
    ) -> Result<Option<Vec<f32>>, ReplicaError> {
        if let Some(kept) = self.kept.remove(&id) {
            return self.backward_kept(kept, grad_output, grad, None);
        }
        let pending = self.pending.remove(&id).ok_or_else(|| {
            ReplicaError::Other(format!("backward of micro-batch {id} without its forward"))
        })?;
        let n = pending.n;
        let seed = match (pending.output, grad_output) {
            (PendingOutput::Loss(loss), None) => Some(*loss),
            (PendingOutput::Activations(outs), Some(g)) => {
                let douts = self
                    .out_layout
                    .split_floats(g, n)
                    .map_err(ReplicaError::Other)?;
                dot(outs, tensors_of(douts, &self.owner.device))
            }
            _ => {
                return Err(ReplicaError::Other(
                    "backward got a gradient on the last stage or none on another".into(),
                ))
            }
        };
        let Some(seed) = seed else {
            // An output without float parts: nothing before it affects the loss.
            grad.fill(0.0);
            let zeros = vec![0f32; n * self.in_layout.words_per_sample()];
            return Ok((!self.first).then_some(zeros));
        };
        let grads = guarded(|| seed.backward())?;
        let input_grad = if self.first {
            None
        } else {
            let values = leaf_gradients(&pending.input, &grads)?;
            Some(self.in_layout.gradient_words(n, &values))
        };
        crate::device::copy_from(&self.owner.device, || {
            flat::read_grads(&self.layers, grads, grad)
        });
        Ok(input_grad)
    }

    /// [`LayerStage::forward_streamed`] on a one-stage model: the graph cut after every layer.
    fn forward_split(
        &mut self,
        id: u64,
        samples: &[u32],
        scale: f32,
    ) -> Result<(Forwarded, f64), ReplicaError> {
        let device = self.owner.device.clone();
        let n = samples.len();
        // One stage: first and last, so it reads the batch.
        let (batch, data_seconds) = self.training_batch(samples)?;
        let batch = batch.expect("a one-stage model reads its batch");
        let mut x = guarded(|| self.owner.job.input(&batch))?;
        let mut layers = Vec::with_capacity(self.layers.len());
        let fail = |e: ActivationError| ReplicaError::Other(e.to_string());
        for (i, layer) in self.layers.iter().enumerate() {
            let (leaves, input) = if i == 0 {
                (Vec::new(), x)
            } else {
                // Cut as at a stage boundary: the output's values as fresh leaves.
                let layout = &self.owner.boundaries[self.first_layer + i];
                let words = Layout::encode(&parts_of(x)).map_err(ReplicaError::Other)?;
                let (parts, leaves) = layout
                    .decode(&words, n, &device, true)
                    .map_err(ReplicaError::Other)?;
                (leaves, activation_of(parts).map_err(fail)?)
            };
            self.reseed(DrawPart::Layer(self.first_layer + i));
            let out = guarded(|| self.owner.job.forward(layer, input))?;
            let parts = parts_of(out);
            layers.push((leaves, float_values(parts.clone())));
            x = activation_of(parts).map_err(fail)?;
        }
        let (scaled, value) = self.scaled_loss(x, &batch, J::LOSS_REDUCTION.share(n, scale))?;
        self.streamed.insert(
            id,
            Split {
                layers,
                loss: scaled,
            },
        );
        Ok((Forwarded::Loss(value), data_seconds))
    }

    /// The last layer's output's loss scaled by the micro-batch's `share` of the global batch,
    /// and its value; the micro-batch's training metrics recorded for the driver.
    fn scaled_loss(
        &mut self,
        output: J::Activation,
        batch: &J::Batch,
        share: f32,
    ) -> Result<(Tensor<1>, f32), ReplicaError> {
        self.reseed(DrawPart::Loss);
        let (loss, metrics) = guarded(|| self.owner.job.loss_and_metrics(output, batch))?;
        scalar(&loss)?;
        self.metric_rows
            .push(metric_row(J::TRAIN_METRICS, metrics)?);
        let scaled = guarded(|| loss.mul_scalar(share))?;
        let value = scalar(&scaled)?;
        Ok((scaled, value))
    }

    /// Backward of a [`Split`] micro-batch, layer by layer from the loss: each layer's
    /// parameter gradients handed out as soon as its backward ends.
    fn backward_split(
        &mut self,
        split: Split,
        ranges: &[Range<usize>],
        on_layer: &(dyn Fn(usize, &[f32]) + Sync),
    ) -> Result<(), ReplicaError> {
        let mut loss = Some(split.loss);
        // The gradient with respect to the current layer's output's float parts.
        let mut grad_output: Vec<Tensor<1>> = Vec::new();
        for (l, (leaves, outs)) in split.layers.into_iter().enumerate().rev() {
            let seed = match loss.take() {
                Some(loss) => Some(loss),
                None => dot(outs, std::mem::take(&mut grad_output)),
            };
            let Some(seed) = seed else {
                // No float path from here to the loss: this layer and those before it get zeros.
                on_layer(l, &vec![0f32; ranges[l].len()]);
                continue;
            };
            let grads = guarded(|| seed.backward())?;
            let values = leaf_gradients(&leaves, &grads)?;
            grad_output = tensors_of(values.iter().map(Vec::as_slice), &self.owner.device);
            let mut values = vec![0f32; ranges[l].len()];
            crate::device::copy_from(&self.owner.device, || {
                flat::read_grads(&self.layers[l], grads, &mut values)
            });
            on_layer(l, &values);
        }
        Ok(())
    }

    fn evaluate_in_scope(
        &mut self,
        samples: &[u32],
        input: Option<&[f32]>,
    ) -> Result<Evaluated, ReplicaError> {
        let (batch, x) = self.eval_input(samples, input)?;
        let layers: Vec<J::Layer> = self.layers.iter().map(|l| l.valid()).collect();
        let x = self.run_layers(&layers, x, false)?;
        self.evaluated(x, batch.as_ref(), samples.len())
    }

    /// An evaluation's batch of `samples` (where this stage reads one) and the stage's input:
    /// the batch's, or the previous stage's activations `input` (no gradient).
    fn eval_input(
        &self,
        samples: &[u32],
        input: Option<&[f32]>,
    ) -> Result<(Option<J::Batch>, J::Activation), ReplicaError> {
        let device = self.owner.device.clone().inner();
        let batch = if self.first || self.last {
            Some(batch_of(
                &*self.owner.job,
                &*self.owner.eval,
                "evaluation",
                samples,
                &device,
            )?)
        } else {
            None
        };
        let (_, x) = self.input(batch.as_ref(), input, samples.len(), &device, false)?;
        Ok((batch, x))
    }

    /// What the stage hands on after evaluating `n` samples to `x`: the next stage's
    /// activations, or (last stage) the loss and metric sums of `batch`.
    fn evaluated(
        &self,
        x: J::Activation,
        batch: Option<&J::Batch>,
        n: usize,
    ) -> Result<Evaluated, ReplicaError> {
        if !self.last {
            return Ok(Evaluated::Activations(self.outgoing(x, n)?.0));
        }
        let batch = batch.expect("the last stage reads its batch");
        let loss = scalar(&guarded(|| self.owner.job.loss(x.clone(), batch))?)?;
        let metrics = guarded(|| self.owner.job.metrics(x, batch))?;
        Ok(Evaluated::Sums(EvalSums {
            loss: J::LOSS_REDUCTION.sum_of(loss, n),
            metrics: metrics
                .into_iter()
                .map(|(name, sum)| (name.to_string(), sum))
                .collect(),
        }))
    }
}

/// Each leaf's gradient values in `grads`: zeros for a leaf the backward did not reach (a float
/// part the layers did not use).
fn leaf_gradients(leaves: &[Tensor<1>], grads: &Gradients) -> Result<Vec<Vec<f32>>, ReplicaError> {
    leaves
        .iter()
        .map(|leaf| match leaf.grad(grads) {
            Some(g) => g
                .try_to_vec_as::<f32>()
                .map_err(|e| ReplicaError::Other(format!("reading a gradient: {e:?}"))),
            None => Ok(vec![0f32; leaf.dims()[0]]),
        })
        .collect()
}

/// Flat tensors of `values` on `device`.
fn tensors_of<'v>(values: impl IntoIterator<Item = &'v [f32]>, device: &Device) -> Vec<Tensor<1>> {
    values
        .into_iter()
        .map(|v| Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), device))
        .collect()
}

/// `Σ_i sum(outs_i · grads_i)`: backward from it gives each `outs_i` exactly `grads_i` (`None`
/// without float parts).
fn dot(outs: Vec<Tensor<1>>, grads: Vec<Tensor<1>>) -> Option<Tensor<1>> {
    outs.into_iter()
        .zip(grads)
        .map(|(o, g)| (o * g).sum())
        .reduce(|a, b| a + b)
}

/// SHA-256 over the job's name and every layer's parameter names and shapes, in order.
fn structure_hash<M: Module>(job: &str, layers: &[M]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"lockstep layered job structure v1\0");
    h.update((job.len() as u64).to_le_bytes());
    h.update(job.as_bytes());
    for (l, layer) in layers.iter().enumerate() {
        h.update((l as u64).to_le_bytes());
        flat::hash_layout(&mut h, &flat::layout(layer));
    }
    h.finalize().into()
}
