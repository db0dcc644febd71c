//! lockstep's built-in jobs, chosen by the config: the MLP and CNN classifiers on digits /
//! Fashion-MNIST / MNIST, and the character-level transformer on text (the layered driver).
//!
//! The classifiers go through the same public [`JobSpec`] / [`Replica`] interface as any user
//! job; they implement the flat level directly because their forward anchors each parameter in
//! its layer, which lets `dist.overlap` stream gradients during backward.

use crate::device::Placement;
use crate::ConfigLoad;
use lockstep_data::Dataset;
use lockstep_model::{Model, ModelSpec, ParamInfo};

use crate::config::{ConfigError, ConfigSections, ModelKind, TrainConfig};
use crate::job::{Computed, EvalSums, JobSpec, Replica, ReplicaError, Trainable};
use crate::TrainError;
use lockstep_run::ModelShape;

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
            // On any device (the classifiers, which the plan keeps on the CPU, ignore it).
            let device = device.seeded(cfg.train.seed);
            let model = crate::pipeline::transformer::Transformer::new(cfg, device)?;
            return Ok(Trainable::Layered(Box::new(model)));
        }
        let (train, test) = crate::datasets::load(&cfg.data, cfg.train.seed)?;
        let model = Model::new(&model_spec(cfg, &train), cfg.train.seed)?;
        Ok(Trainable::Replica(Box::new(Classifier {
            model,
            train,
            test,
            x: Vec::new(),
            y: Vec::new(),
            held_per_sample: crate::limits::activation_values_per_sample(cfg) as u64,
        })))
    }
}

/// A built-in MLP or CNN with its training and test sets.
struct Classifier {
    model: Model,
    train: Dataset,
    test: Dataset,
    x: Vec<f32>,
    y: Vec<u8>,
    /// Activation values a training forward keeps per sample (`crate::memory`'s estimate).
    held_per_sample: u64,
}

impl Replica for Classifier {
    fn train_len(&self) -> usize {
        self.train.len()
    }

    fn eval_len(&self) -> usize {
        self.test.len()
    }

    fn layout(&self) -> Vec<ParamInfo> {
        self.model.layout()
    }

    fn structure_hash(&self) -> [u8; 32] {
        self.model.structure_hash()
    }

    fn params_flat(&self) -> Vec<f32> {
        self.model.params_flat()
    }

    fn set_params_flat(&mut self, params: &[f32]) -> Result<(), ReplicaError> {
        Ok(self.model.set_params_flat(params)?)
    }

    fn loss_and_grad(
        &mut self,
        samples: &[u32],
        scale: f32,
        grad_out: &mut [f32],
    ) -> Result<Computed, ReplicaError> {
        let t0 = std::time::Instant::now();
        self.train.gather(samples, &mut self.x, &mut self.y);
        let data_seconds = t0.elapsed().as_secs_f64();
        let timed =
            self.model
                .loss_and_grad_timed(&self.x, &self.y, samples.len(), scale, grad_out)?;
        Ok(Computed {
            loss: timed.loss,
            data_seconds,
            forward_seconds: timed.forward_seconds,
            backward_seconds: timed.backward_seconds,
        })
    }

    fn streams_gradients(&self) -> bool {
        true
    }

    fn loss_and_grad_streaming(
        &mut self,
        samples: &[u32],
        scale: f32,
        on_grad: &(dyn Fn(usize, &[f32]) + Sync),
    ) -> Option<Result<Computed, ReplicaError>> {
        let t0 = std::time::Instant::now();
        self.train.gather(samples, &mut self.x, &mut self.y);
        let data_seconds = t0.elapsed().as_secs_f64();
        let result =
            self.model
                .loss_and_grad_streaming(&self.x, &self.y, samples.len(), scale, on_grad);
        Some(result.map_err(Into::into).map(|loss| Computed {
            loss,
            data_seconds,
            ..Computed::default()
        }))
    }

    fn activation_bytes(&self, n: usize) -> u64 {
        4 * self.held_per_sample * n as u64
    }

    fn evaluate(&mut self, samples: &[u32]) -> Result<EvalSums, ReplicaError> {
        self.test.gather(samples, &mut self.x, &mut self.y);
        let (loss, correct) = self.model.evaluate(&self.x, &self.y, samples.len())?;
        Ok(EvalSums {
            loss,
            metrics: vec![("accuracy".into(), correct as f64)],
        })
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
