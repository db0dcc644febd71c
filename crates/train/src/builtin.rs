//! lockstep's built-in jobs, chosen by the config: the MLP and CNN classifiers on digits /
//! Fashion-MNIST / MNIST, and the character-level transformer on text (the layered driver).
//!
//! Both are a public [`LayeredJob`] like any user's — the classifiers here, the transformer in
//! `transformer.rs` (its blocks of `lockstep::tp` layers with `model.tp_pieces > 1`): the one
//! layered path trains them, with every feature it has (pipelines, tensor parallelism, ZeRO 3,
//! overlap, recomputation, devices).

mod transformer;

use std::sync::Arc;

use burn::data::dataset::{Dataset as DatasetOf, DatasetError};
use burn::tensor::{Device, Int, Tensor, TensorData};
use lockstep_data::Dataset;
use lockstep_model::{
    classifier_layers, count_correct, cross_entropy_sum, flat, ClassifierLayer, ModelSpec, Products,
};

use crate::config::{ConfigError, ConfigSections, ModelKind, TrainConfig};
use crate::device::Placement;
use crate::job::{BoxError, BurnLayered, JobSpec, LayeredJob, LossReduction, Trainable};
use crate::precision::products;
use crate::ConfigLoad;
use crate::TrainError;
use lockstep_run::ModelShape;
use transformer::TransformerJob;

/// The job `lockstep train` runs: whatever `model.kind` and `data.dataset` say.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuiltinJob;

impl JobSpec for BuiltinJob {
    fn name(&self) -> String {
        "lockstep".into()
    }

    fn config_sections(&self) -> ConfigSections {
        ConfigSections::All
    }

    fn evaluates_per_character(&self, cfg: &TrainConfig) -> bool {
        cfg.model.kind == ModelKind::Transformer
    }

    fn label(&self, cfg: &TrainConfig) -> String {
        cfg.data.dataset.to_string()
    }

    fn shape(&self, cfg: &TrainConfig) -> ModelShape {
        cfg.builtin_shape(cfg.pipeline_layers())
    }

    fn validate(&self, cfg: &TrainConfig) -> Result<(), ConfigError> {
        cfg.validate_builtin()
    }

    fn build(&self, cfg: &TrainConfig, device: &Placement) -> Result<Trainable<'_>, TrainError> {
        if cfg.model.kind == ModelKind::Transformer {
            let job = TransformerJob::new(cfg)?;
            return Ok(Trainable::Layered(Box::new(BurnLayered::owning(
                job, cfg, device,
            )?)));
        }
        let (train, test) = crate::datasets::load(&cfg.data, cfg.train.seed)?;
        let job = ClassifierJob {
            spec: model_spec(cfg, &train),
            products: products(cfg),
            train: Arc::new(train),
            test: Arc::new(test),
        };
        Ok(Trainable::Layered(Box::new(BurnLayered::owning(
            job, cfg, device,
        )?)))
    }
}

/// A built-in MLP or CNN with its training and test sets: a [`LayeredJob`] like any user's (its
/// layers `lockstep_model::ClassifierLayer`s, lockstep's CPU kernels on the flex backend and
/// burn's operations on any other device), so pipelines, ZeRO 3, overlap, recomputation and
/// devices reach it through the one layered path.
struct ClassifierJob {
    spec: ModelSpec,
    /// `train.precision`.
    products: Products,
    train: Arc<Dataset>,
    test: Arc<Dataset>,
}

/// One sample of a built-in dataset: its features (NCHW for an image) and label.
#[derive(Clone, Debug)]
struct Sample {
    features: Vec<f32>,
    label: u8,
}

/// A built-in dataset as burn's [`burn::data::dataset::Dataset`] of [`Sample`]s.
struct Samples(Arc<Dataset>);

impl burn::data::dataset::Dataset<Sample> for Samples {
    fn get(&self, index: usize) -> Result<Sample, DatasetError> {
        let set = &self.0;
        if index >= set.len() {
            return Err(DatasetError::new(std::io::Error::other(format!(
                "sample {index} of {}, which has {}",
                set.name,
                set.len()
            ))));
        }
        let dim = set.dim();
        Ok(Sample {
            features: set.features[index * dim..(index + 1) * dim].to_vec(),
            label: set.labels[index],
        })
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// A micro-batch: features `[n, input_len]`, class ids `[n, 1]`, and the labels on the host
/// (for accuracy).
struct ClassBatch {
    features: Tensor<2>,
    targets: Tensor<2, Int>,
    labels: Vec<u8>,
}

impl LayeredJob for ClassifierJob {
    type Layer = ClassifierLayer;
    type Item = Sample;
    type Batch = ClassBatch;
    // `-Σ log p(y)` scaled by 1 / global batch alone: the bits of lockstep's earlier
    // classifier trainer.
    const LOSS_REDUCTION: LossReduction = LossReduction::Sum;

    fn name(&self) -> &str {
        "lockstep"
    }

    fn layers(&self, cfg: &TrainConfig, device: &Device) -> Vec<ClassifierLayer> {
        classifier_layers(&self.spec, cfg.train.seed, device)
            .unwrap_or_else(|e| panic!("the classifier's spec was validated: {e}"))
    }

    fn train_data(&self, _: &TrainConfig) -> Result<Box<dyn DatasetOf<Sample>>, BoxError> {
        Ok(Box::new(Samples(self.train.clone())))
    }

    fn eval_data(&self, _: &TrainConfig) -> Result<Box<dyn DatasetOf<Sample>>, BoxError> {
        Ok(Box::new(Samples(self.test.clone())))
    }

    fn batch(&self, items: Vec<Sample>, device: &Device) -> ClassBatch {
        let n = items.len();
        let dim = self.spec.input_len();
        let mut features = Vec::with_capacity(n * dim);
        let mut labels = Vec::with_capacity(n);
        for item in items {
            features.extend_from_slice(&item.features);
            labels.push(item.label);
        }
        let ids: Vec<i64> = labels.iter().map(|&l| l as i64).collect();
        ClassBatch {
            features: Tensor::from_data(TensorData::new(features, [n, dim]), device),
            targets: Tensor::from_data(TensorData::new(ids, [n, 1]), device),
            labels,
        }
    }

    fn input(&self, batch: &ClassBatch) -> Tensor<2> {
        batch.features.clone()
    }

    fn forward(&self, layer: &ClassifierLayer, x: Tensor<2>) -> Tensor<2> {
        layer.forward_in(x, self.products)
    }

    fn loss(&self, output: Tensor<2>, batch: &ClassBatch) -> Tensor<1> {
        cross_entropy_sum(output, batch.targets.clone())
    }

    fn metrics(&self, output: Tensor<2>, batch: &ClassBatch) -> Vec<(&'static str, f64)> {
        let logits = output.into_data();
        let correct = count_correct(flat::f32_slice(&logits), &batch.labels, self.spec.classes());
        vec![("accuracy", correct as f64)]
    }
}

/// The classifier `cfg` describes for the shape and classes of `data`.
pub fn model_spec(cfg: &TrainConfig, data: &Dataset) -> ModelSpec {
    let [c, h, w] = data.shape;
    match cfg.model.kind {
        ModelKind::Cnn => ModelSpec::Cnn {
            channels: c,
            height: h,
            width: w,
            conv: cfg.model.conv.clone(),
            hidden: cfg.model.cnn_hidden,
            classes: data.classes,
        },
        ModelKind::Mlp | ModelKind::Transformer => ModelSpec::Mlp {
            input: c * h * w,
            hidden: cfg.model.hidden.clone(),
            classes: data.classes,
        },
    }
}
