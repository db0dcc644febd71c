//! [`StagedJob`]: a model written as a sequence of layers that exchange any [`Activation`] —
//! tensors of any rank, integer tensors, tuples or your own struct of them. It is what the
//! pipeline machinery (`layered_job.rs`) runs; every [`LayeredJob`] (whose layers exchange
//! `[samples, width]` floats) is one through the blanket implementation below, so a job needs
//! this trait only when its layers pass something else.

use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use lockstep_model::UpdateRule;

use super::activation::Activation;
use super::burn_job::{BoxError, LossReduction};
use super::layered_job::LayeredJob;
use crate::config::{JobSettings, TrainConfig};

/// A training job whose model is a sequence of burn modules ("layers") exchanging
/// [`StagedJob::Activation`]s: [`LayeredJob`] with activations of your choice. A pipeline stage
/// sends its last layer's activation to the next stage as its parts (each part's first dimension
/// the samples; shapes checked against the model's at every boundary), and integer parts (token
/// ids, masks) travel exactly. Run it with `lockstep::main(lockstep::Pipelined(MyJob))`.
///
/// ```
/// use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
/// use burn::module::Module;
/// use burn::tensor::{Device, Int, Tensor};
/// use lockstep_train::job::{BoxError, StagedJob};
/// use lockstep_train::TrainConfig;
/// # use burn::data::dataset::Dataset;
///
/// #[derive(Module, Debug)]
/// enum Layer {
///     Embed(Embedding),
///     Mix(Linear),
///     Head(Linear),
/// }
///
/// struct Tokens;
///
/// impl StagedJob for Tokens {
///     type Layer = Layer;
///     type Item = (Vec<i64>, i64);
///     type Batch = (Tensor<2, Int>, Tensor<1, Int>);
///     /// Token ids `[samples, time]`, then hidden states `[samples, time, 16]`, with the ids
///     /// kept alongside.
///     type Activation = (Tensor<3>, Tensor<2, Int>);
///
///     fn name(&self) -> &str { "tokens" }
///     fn layers(&self, _: &TrainConfig, device: &Device) -> Vec<Layer> {
///         vec![
///             Layer::Embed(EmbeddingConfig::new(100, 16).init(device)),
///             Layer::Mix(LinearConfig::new(16, 16).init(device)),
///             Layer::Head(LinearConfig::new(16, 100).init(device)),
///         ]
///     }
///     # fn train_data(&self, _: &TrainConfig) -> Result<Box<dyn Dataset<Self::Item>>, BoxError> { unimplemented!() }
///     # fn eval_data(&self, _: &TrainConfig) -> Result<Box<dyn Dataset<Self::Item>>, BoxError> { unimplemented!() }
///     # fn batch(&self, _: Vec<Self::Item>, _: &Device) -> Self::Batch { unimplemented!() }
///     fn input(&self, (ids, _): &Self::Batch) -> Self::Activation {
///         let [n, t] = ids.dims();
///         (Tensor::zeros([n, t, 16], &ids.device()), ids.clone())
///     }
///     fn forward(&self, layer: &Layer, (h, ids): Self::Activation) -> Self::Activation {
///         match layer {
///             Layer::Embed(e) => (e.forward(ids.clone()), ids),
///             Layer::Mix(l) => (l.forward(h), ids),
///             Layer::Head(l) => (l.forward(h), ids),
///         }
///     }
///     fn loss(&self, (logits, _): Self::Activation, (_, y): &Self::Batch) -> Tensor<1> {
///         let last = logits.dims()[1] - 1;
///         let scores = logits.narrow(1, last, 1).squeeze_dim::<2>(1);
///         burn::nn::loss::CrossEntropyLossConfig::new()
///             .init(&scores.device())
///             .forward(scores, y.clone())
///     }
/// }
/// ```
pub trait StagedJob: Send + Sync + 'static {
    /// One layer: any burn module (its float parameters are what lockstep trains).
    type Layer: Module + 'static;
    type Item: Send + 'static;
    type Batch;
    /// What the layers take and give (`Tensor<2>` for a [`LayeredJob`]).
    type Activation: Activation;

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
    /// The first layer's input for a batch.
    fn input(&self, batch: &Self::Batch) -> Self::Activation;
    /// One layer's forward.
    fn forward(&self, layer: &Self::Layer, x: Self::Activation) -> Self::Activation;
    /// The mean loss of a batch from the last layer's output: a single value (a sum over the
    /// samples with [`StagedJob::LOSS_REDUCTION`] = [`LossReduction::Sum`]).
    fn loss(&self, output: Self::Activation, batch: &Self::Batch) -> Tensor<1>;
    /// What [`StagedJob::loss`] returns, as [`crate::job::Job::LOSS_REDUCTION`].
    const LOSS_REDUCTION: LossReduction = LossReduction::Mean;
    /// How many terms one sample's loss sums, as [`LayeredJob::loss_terms_per_sample`].
    fn loss_terms_per_sample(&self) -> usize {
        1
    }
    /// A short name of a layer, as [`LayeredJob::layer_name`].
    fn layer_name(&self, layer: usize) -> String {
        format!("layer {layer}")
    }
    /// Values per sample a layer's training graph keeps, as
    /// [`LayeredJob::graph_floats_per_sample`].
    fn graph_floats_per_sample(&self, _layer: usize) -> Option<usize> {
        None
    }
    /// Evaluation metrics from the last layer's output, as sums over the batch's samples.
    fn metrics(&self, _output: Self::Activation, _batch: &Self::Batch) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
    /// Your own optimizer update, as [`crate::job::Job::update_rule`].
    fn update_rule(&self, _cfg: &TrainConfig) -> Option<Box<dyn UpdateRule>> {
        None
    }
    /// Names of the training metrics [`StagedJob::loss_and_metrics`] returns, in its order.
    const TRAIN_METRICS: &'static [&'static str] = &[];
    /// The layers take `train.precision`, as [`crate::Job::BF16_PRODUCTS`] (default: no).
    const BF16_PRODUCTS: bool = false;
    /// The training loss with metrics from the same output, as
    /// [`crate::job::Job::loss_and_metrics`].
    fn loss_and_metrics(
        &self,
        output: Self::Activation,
        batch: &Self::Batch,
    ) -> (Tensor<1>, Vec<f64>) {
        (self.loss(output, batch), Vec::new())
    }
}

impl<J: LayeredJob> StagedJob for J {
    type Layer = J::Layer;
    type Item = J::Item;
    type Batch = J::Batch;
    type Activation = Tensor<2>;
    const TRAIN_METRICS: &'static [&'static str] = J::TRAIN_METRICS;
    const BF16_PRODUCTS: bool = <J as LayeredJob>::BF16_PRODUCTS;
    const SETTINGS: JobSettings = <J as LayeredJob>::SETTINGS;
    const LOSS_REDUCTION: LossReduction = <J as LayeredJob>::LOSS_REDUCTION;

    fn name(&self) -> &str {
        LayeredJob::name(self)
    }
    fn config(&self) -> &str {
        LayeredJob::config(self)
    }
    fn on_event(&self, event: &crate::Event) {
        LayeredJob::on_event(self, event)
    }
    fn about(&self) -> &str {
        LayeredJob::about(self)
    }
    fn version(&self) -> &str {
        LayeredJob::version(self)
    }
    fn validate(&self, cfg: &TrainConfig) -> Result<(), String> {
        LayeredJob::validate(self, cfg)
    }
    fn loss_terms_per_sample(&self) -> usize {
        LayeredJob::loss_terms_per_sample(self)
    }
    fn layer_name(&self, layer: usize) -> String {
        LayeredJob::layer_name(self, layer)
    }
    fn graph_floats_per_sample(&self, layer: usize) -> Option<usize> {
        LayeredJob::graph_floats_per_sample(self, layer)
    }
    fn layers(&self, cfg: &TrainConfig, device: &Device) -> Vec<J::Layer> {
        LayeredJob::layers(self, cfg, device)
    }
    fn train_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<J::Item>>, BoxError> {
        LayeredJob::train_data(self, cfg)
    }
    fn eval_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<J::Item>>, BoxError> {
        LayeredJob::eval_data(self, cfg)
    }
    fn batch(&self, items: Vec<J::Item>, device: &Device) -> J::Batch {
        LayeredJob::batch(self, items, device)
    }
    fn input(&self, batch: &J::Batch) -> Tensor<2> {
        LayeredJob::input(self, batch)
    }
    fn forward(&self, layer: &J::Layer, x: Tensor<2>) -> Tensor<2> {
        LayeredJob::forward(self, layer, x)
    }
    fn loss(&self, output: Tensor<2>, batch: &J::Batch) -> Tensor<1> {
        LayeredJob::loss(self, output, batch)
    }
    fn metrics(&self, output: Tensor<2>, batch: &J::Batch) -> Vec<(&'static str, f64)> {
        LayeredJob::metrics(self, output, batch)
    }
    fn update_rule(&self, cfg: &TrainConfig) -> Option<Box<dyn UpdateRule>> {
        LayeredJob::update_rule(self, cfg)
    }
    fn loss_and_metrics(&self, output: Tensor<2>, batch: &J::Batch) -> (Tensor<1>, Vec<f64>) {
        LayeredJob::loss_and_metrics(self, output, batch)
    }
}
