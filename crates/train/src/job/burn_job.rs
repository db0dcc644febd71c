//! [`Job`]: a burn user's model, data and loss, and [`BurnReplica`], which turns any `Job` into
//! the flat [`Replica`] the data-parallel driver trains.
//!
//! Reproducibility with a user's model: the model is built on a seeded device (`train.seed`),
//! rank 0's parameters are broadcast, micro-batches are fixed sets of sample indices, the loss of
//! a micro-batch is scaled by its share of the global batch before backward, and gradients leave
//! burn as flat vectors in the module's declaration order — so the driver's exact sum makes the
//! result independent of the world size exactly as for lockstep's own models.

use crate::ConfigLoad;
use std::error::Error;
use std::time::Instant;

use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use lockstep_model::{flat, ParamInfo, UpdateRule};
use sha2::{Digest, Sha256};

use super::{
    catch_job_panic, BinaryAbout, Computed, EvalSums, JobSpec, Replica, ReplicaError, Trainable,
};
use crate::config::{ConfigError, JobSettings, TrainConfig};
use crate::device::{self, Placement};
use crate::draws::{DrawPart, Draws};
use crate::TrainError;

/// Errors a job's own code returns (opening files, parsing rows, …).
pub type BoxError = Box<dyn Error + Send + Sync + 'static>;

/// A training job written against burn: the model is an ordinary single-device burn `Module`
/// (nothing lockstep-specific inside it), the data are burn `Dataset`s, and the loss is that of
/// one micro-batch. lockstep adds everything else: processes, exact data parallelism,
/// checkpoints, restarts, metrics and the report.
///
/// A sketch (the whole example, compiled: the user guide's "Your own model" chapter):
///
/// ```text
/// impl lockstep::Job for MyJob {
///     type Model = MyNet;
///     type Item = MyItem;
///     type Batch = MyBatch;
///     fn name(&self) -> &str { "my-job" }
///     fn model(&self, _cfg: &TrainConfig, device: &Device) -> MyNet { MyNet::new(device) }
///     fn train_data(&self, _cfg: &TrainConfig) -> Result<Box<dyn Dataset<MyItem>>, BoxError> { … }
///     fn eval_data(&self, _cfg: &TrainConfig) -> Result<Box<dyn Dataset<MyItem>>, BoxError> { … }
///     fn batch(&self, items: Vec<MyItem>, device: &Device) -> MyBatch { MyBatcher.batch(items, device) }
///     fn loss(&self, model: &MyNet, batch: &MyBatch) -> Tensor<1> { … mean cross-entropy … }
/// }
/// fn main() { lockstep::main(MyJob) }
/// ```
pub trait Job: Send + Sync + 'static {
    /// The model: any burn module (its float parameters are what lockstep trains).
    type Model: Module + 'static;
    /// One sample as the datasets return it.
    type Item: Send + 'static;
    /// A batch of samples as the model and the loss consume it.
    type Batch;

    /// Short name, used in errors, logs and the report (e.g. `own-cnn`).
    fn name(&self) -> &str;
    /// Default configuration (TOML): any of lockstep's sections (`[train]`, `[optimizer]`, …) and
    /// the job's own `[job]` table; the run's `--config` and `--set` apply on top.
    fn config(&self) -> &str {
        ""
    }
    /// Called in rank 0's worker on each event of the training loop: an evaluation's figures
    /// ([`crate::Event::Evaluated`]), a checkpoint on disk ([`crate::Event::Checkpointed`]),
    /// progress, resumption (optional; a panic here ends the run with an error once its outputs
    /// are written). The events and their figures are the same at every world size.
    fn on_event(&self, _event: &crate::Event) {}
    /// One line on what the job trains, for `--help` (default: a line naming the job).
    fn about(&self) -> &str {
        ""
    }
    /// The job's version for `--version`, e.g. `env!("CARGO_PKG_VERSION")` (default: none; the
    /// lockstep version is always shown too).
    fn version(&self) -> &str {
        ""
    }
    /// The type of the job's `[job]` settings (default: none): `const SETTINGS: JobSettings =
    /// JobSettings::of::<MySettings>();` has lockstep read the table as `MySettings` before any
    /// worker starts and refuse it with an error naming the field (exit status 3).
    const SETTINGS: JobSettings = JobSettings::NONE;
    /// Check the job's own settings (`cfg.job_section()`); the message is reported with the job's
    /// name and exit status 3.
    fn validate(&self, _cfg: &TrainConfig) -> Result<(), String> {
        Ok(())
    }
    /// A freshly initialised model on `device`. The device is seeded with `train.seed` first,
    /// so burn's own initialisers give the same values on every run; rank 0's values are then
    /// broadcast to the other ranks.
    fn model(&self, cfg: &TrainConfig, device: &Device) -> Self::Model;
    /// The training set; the sampler draws `train.global_batch` indices below its `len()` per step.
    fn train_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Self::Item>>, BoxError>;
    /// The evaluation set (loss and [`Job::metrics`] every `train.eval_every` steps and at the end).
    fn eval_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Self::Item>>, BoxError>;
    /// Turn items into a batch on `device` (the shape of burn's `Batcher::batch`).
    fn batch(&self, items: Vec<Self::Item>, device: &Device) -> Self::Batch;
    /// The mean loss of a batch: a single value. lockstep scales it by the batch's share of the
    /// global batch before backward (a sum over the batch's samples with
    /// [`Job::LOSS_REDUCTION`] = [`LossReduction::Sum`]).
    fn loss(&self, model: &Self::Model, batch: &Self::Batch) -> Tensor<1>;
    /// What [`Job::loss`] returns: the batch's mean (default) or its sum over samples.
    const LOSS_REDUCTION: LossReduction = LossReduction::Mean;
    /// Your own optimizer update on flat slices of the parameters ([`UpdateRule`]), used when
    /// the config says `optimizer.kind = "custom"` (default: none, and `custom` is refused). Its
    /// hyper-parameters can come from your `[job]` settings in `cfg`. It must be elementwise:
    /// lockstep checks that before any worker starts.
    fn update_rule(&self, _cfg: &TrainConfig) -> Option<Box<dyn UpdateRule>> {
        None
    }
    /// Names of the training metrics [`Job::loss_and_metrics`] returns, in its order (default:
    /// none). The same on every rank: the driver learns them before any batch is computed.
    const TRAIN_METRICS: &'static [&'static str] = &[];
    /// The model takes `train.precision` (default: no, and `"bf16"` is refused): each product's
    /// operands go through `lockstep::products(cfg).operand(…)` (lockstep's `dense_linear` and
    /// burn's `matmul`, `conv2d`, … alike), so with `"bf16"` they are rounded to bf16 and their
    /// gradients too.
    const BF16_PRODUCTS: bool = false;
    /// The training loss with metrics from the same forward: the loss as [`Job::loss`] gives it,
    /// and one sum over the batch's samples per name in [`Job::TRAIN_METRICS`] (e.g. the number
    /// of correct predictions). lockstep sums them over the global batch exactly, in an order
    /// that does not depend on the layout, and logs their per-sample means every step
    /// (`train_metrics` in metrics.jsonl, `train/<name>` in TensorBoard): the same bits at every
    /// world size. Default: [`Job::loss`] and no metrics.
    fn loss_and_metrics(&self, model: &Self::Model, batch: &Self::Batch) -> (Tensor<1>, Vec<f64>) {
        (self.loss(model, batch), Vec::new())
    }
    /// Evaluation metrics as sums over the batch's samples (e.g. `("accuracy", correct)`);
    /// lockstep sums them over the whole evaluation set and reports per-sample means in
    /// metrics.jsonl, summary.json and the report.
    fn metrics(&self, _model: &Self::Model, _batch: &Self::Batch) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
}

impl<J: Job> JobSpec for J {
    fn name(&self) -> String {
        Job::name(self).to_string()
    }

    fn model_record(
        &self,
        cfg: &TrainConfig,
        params: &[f32],
    ) -> Option<Result<Vec<u8>, TrainError>> {
        Some(crate::export::record_of(
            Job::name(self),
            cfg,
            params,
            |device| self.model(cfg, device),
        ))
    }

    fn on_event(&self, event: &crate::Event) {
        Job::on_event(self, event)
    }

    fn binary(&self) -> Option<BinaryAbout> {
        Some(BinaryAbout {
            about: Job::about(self).to_string(),
            version: Job::version(self).to_string(),
        })
    }

    fn default_config(&self) -> String {
        Job::config(self).to_string()
    }

    fn shape(&self, _cfg: &TrainConfig) -> lockstep_run::ModelShape {
        crate::job::flat_job_shape(J::BF16_PRODUCTS)
    }

    fn validate(&self, cfg: &TrainConfig) -> Result<(), ConfigError> {
        cfg.validate_common(&self.shape(cfg))?;
        check_job_items(
            cfg,
            Job::name(self),
            J::SETTINGS,
            J::TRAIN_METRICS,
            self.update_rule(cfg).as_deref(),
        )?;
        Job::validate(self, cfg).map_err(|message| ConfigError::Invalid {
            field: "job",
            message: format!("job `{}`: {message}", Job::name(self)),
        })
    }

    fn build(&self, cfg: &TrainConfig, device: &Placement) -> Result<Trainable<'_>, TrainError> {
        Ok(Trainable::Replica(Box::new(BurnReplica::new(
            self, cfg, device,
        )?)))
    }
}

/// A [`Job`]'s model and datasets on one rank, behind the flat [`Replica`] interface.
pub struct BurnReplica<'j, J: Job> {
    job: &'j J,
    device: Device,
    model: J::Model,
    layout: Vec<ParamInfo>,
    num_params: usize,
    structure_hash: [u8; 32],
    train: Box<dyn Dataset<J::Item>>,
    eval: Box<dyn Dataset<J::Item>>,
    /// The training metrics of the micro-batches computed since the driver last took them.
    metric_rows: Vec<Vec<f32>>,
}

impl<'j, J: Job> BurnReplica<'j, J> {
    /// Build the model on `place`'s device seeded with `train.seed` and open both datasets.
    pub fn new(job: &'j J, cfg: &TrainConfig, place: &Placement) -> Result<Self, TrainError> {
        let name = Job::name(job).to_string();
        let (train, eval) = open_data(&name, job.train_data(cfg), job.eval_data(cfg))?;
        let device = place.seeded(cfg.train.seed);
        let model =
            catch_job_panic(|| job.model(cfg, &device)).map_err(|p| TrainError::JobSetup {
                job: name.clone(),
                message: format!("building the model panicked: {p}"),
            })?;
        let model = crate::export::init_from(&name, model, cfg)?;
        let layout = flat::layout(&model);
        let num_params = layout.iter().map(|p| p.len).sum();
        if num_params == 0 {
            return Err(TrainError::JobSetup {
                job: name,
                message: "the model has no float parameters to train".into(),
            });
        }
        // Re-create every parameter as an autodiff leaf of our device, from its own values:
        // initialisation and `set_params_flat` then share one representation.
        let values = flat::read(&model, num_params);
        let model = flat::write(model, &values, &device);
        let structure_hash = structure_hash(&name, &layout);
        Ok(BurnReplica {
            job,
            device,
            model,
            layout,
            num_params,
            structure_hash,
            train,
            eval,
            metric_rows: Vec::new(),
        })
    }

    /// The items of `samples` from `set`, batched on `device`.
    fn batch_of(
        &self,
        set: &dyn Dataset<J::Item>,
        split: &'static str,
        samples: &[u32],
        device: &Device,
    ) -> Result<J::Batch, ReplicaError> {
        batch_of(set, split, samples, |items| self.job.batch(items, device))
    }
}

/// Both datasets of a job, or the error naming the job and the split that failed to open.
pub(super) type Datasets<I> = (Box<dyn Dataset<I>>, Box<dyn Dataset<I>>);

pub(super) fn open_data<I>(
    job: &str,
    train: Result<Box<dyn Dataset<I>>, BoxError>,
    eval: Result<Box<dyn Dataset<I>>, BoxError>,
) -> Result<Datasets<I>, TrainError> {
    let failed = |split: &'static str| {
        move |cause: BoxError| TrainError::JobData {
            job: job.to_string(),
            split,
            message: cause.to_string(),
        }
    };
    Ok((
        train.map_err(failed("training"))?,
        eval.map_err(failed("evaluation"))?,
    ))
}

/// The items of `samples` from `set`, turned into a batch by the job's `batch` (guarded).
pub(super) fn batch_of<I, B>(
    set: &dyn Dataset<I>,
    split: &'static str,
    samples: &[u32],
    batch: impl FnOnce(Vec<I>) -> B,
) -> Result<B, ReplicaError> {
    let mut items = Vec::with_capacity(samples.len());
    for &i in samples {
        items.push(set.get(i as usize).map_err(|e| ReplicaError::Dataset {
            split,
            index: i as usize,
            message: e.to_string(),
        })?);
    }
    guarded(|| batch(items))
}

/// Run the job's code, turning a panic (e.g. a shape mismatch inside burn) into an error.
pub(super) fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, ReplicaError> {
    catch_job_panic(f).map_err(ReplicaError::Panicked)
}

/// The single value of a loss tensor, refusing other shapes and non-finite values.
pub(super) fn scalar(loss: &Tensor<1>) -> Result<f32, ReplicaError> {
    let shape = loss.dims().to_vec();
    if shape != [1] {
        return Err(ReplicaError::LossShape { shape });
    }
    let value = loss
        .clone()
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| ReplicaError::Other(format!("reading the loss: {e:?}")))?[0];
    if value.is_finite() {
        Ok(value)
    } else {
        Err(ReplicaError::NonFiniteLoss { loss: value })
    }
}

/// What lockstep checks of any burn job (`Job`, `LayeredJob`, `StagedJob`) before a worker
/// starts: its `[job]` table against its settings type, its training metrics' names, and its
/// update rule when the config asks for one.
pub(super) fn check_job_items(
    cfg: &TrainConfig,
    job: &str,
    settings: JobSettings,
    metrics: &[&str],
    rule: Option<&dyn UpdateRule>,
) -> Result<(), ConfigError> {
    settings.check(cfg)?;
    check_metric_names(job, metrics)?;
    check_update_rule(cfg, job, rule)
}

/// With `optimizer.kind = "custom"`: the job gives an update rule, and it is elementwise
/// ([`lockstep_model::check_elementwise`]).
fn check_update_rule(
    cfg: &TrainConfig,
    job: &str,
    rule: Option<&dyn UpdateRule>,
) -> Result<(), ConfigError> {
    if cfg.optimizer.kind != crate::config::OptimizerKind::Custom {
        return Ok(());
    }
    let refuse = |message: String| ConfigError::Invalid {
        field: "optimizer.kind",
        message,
    };
    let rule = rule.ok_or_else(|| {
        refuse(format!(
            "`custom` runs the job's own update rule, and job `{job}` gives none \
             (`update_rule`): choose sgd, adam or adamw, or give one"
        ))
    })?;
    catch_job_panic(|| lockstep_model::check_elementwise(rule))
        .unwrap_or_else(|p| Err(format!("it panicked: {p}")))
        .map_err(|why| {
            refuse(format!(
                "job `{job}`'s update rule `{}` is not elementwise: {why}",
                rule.name()
            ))
        })
}

/// Names lockstep logs beside a job's training metrics (`train/<name>` in TensorBoard).
const OWN_TRAIN_SCALARS: [&str; 4] = ["loss", "lr", "samples_per_sec", "grad_norm"];

/// A job's `TRAIN_METRICS`: distinct names of letters, digits, `_`, `-` and `.`, none of them
/// one of lockstep's own training scalars.
pub(super) fn check_metric_names(job: &str, names: &[&str]) -> Result<(), ConfigError> {
    let refuse = |message: String| ConfigError::Invalid {
        field: "job",
        message: format!("job `{job}`: TRAIN_METRICS {names:?}: {message}"),
    };
    for (i, name) in names.iter().enumerate() {
        let allowed = |c: char| c.is_ascii_alphanumeric() || "_-.".contains(c);
        if name.is_empty() || !name.chars().all(allowed) {
            return Err(refuse(format!(
                "`{name}` is not a metric name (letters, digits, `_`, `-`, `.`)"
            )));
        }
        if OWN_TRAIN_SCALARS.contains(name) {
            return Err(refuse(format!(
                "`{name}` is one of lockstep's own training figures"
            )));
        }
        if names[..i].contains(name) {
            return Err(refuse(format!("`{name}` is named twice")));
        }
    }
    Ok(())
}

/// One micro-batch's training metrics as the exact sum takes them: one finite value per name.
pub(super) fn metric_row(names: &[&str], values: Vec<f64>) -> Result<Vec<f32>, ReplicaError> {
    if values.len() != names.len() {
        return Err(ReplicaError::Other(format!(
            "loss_and_metrics returned {} training metrics, but TRAIN_METRICS names {} ({names:?})",
            values.len(),
            names.len()
        )));
    }
    names
        .iter()
        .zip(values)
        .map(|(name, v)| {
            let v32 = v as f32;
            if v32.is_finite() {
                Ok(v32)
            } else {
                Err(ReplicaError::Other(format!(
                    "the training metric `{name}` is {v} (not finite as f32)"
                )))
            }
        })
        .collect()
}

impl<J: Job> Replica for BurnReplica<'_, J> {
    fn train_len(&self) -> usize {
        self.train.len()
    }

    fn eval_len(&self) -> usize {
        self.eval.len()
    }

    fn layout(&self) -> Vec<ParamInfo> {
        self.layout.clone()
    }

    fn structure_hash(&self) -> [u8; 32] {
        self.structure_hash
    }

    fn params_flat(&self) -> Vec<f32> {
        flat::read(&self.model, self.num_params)
    }

    fn set_params_flat(&mut self, params: &[f32]) -> Result<(), ReplicaError> {
        if params.len() != self.num_params {
            return Err(ReplicaError::ParamLength {
                what: "set_params_flat",
                expected: self.num_params,
                got: params.len(),
            });
        }
        self.model = device::timed_copy(|| flat::write(self.model.clone(), params, &self.device));
        Ok(())
    }

    fn begin_microbatch(&mut self, draws: Draws) {
        // The batch function, the model and the loss draw in this order on every rank.
        draws.seed(&self.device, DrawPart::Batch);
    }

    fn loss_and_grad(
        &mut self,
        samples: &[u32],
        scale: f32,
        grad_out: &mut [f32],
    ) -> Result<Computed, ReplicaError> {
        let t0 = Instant::now();
        let batch = self.batch_of(&*self.train, "training", samples, &self.device)?;
        let t1 = Instant::now();
        let share = J::LOSS_REDUCTION.share(samples.len(), scale);
        let (loss, metrics) = guarded(|| self.job.loss_and_metrics(&self.model, &batch))?;
        // Checked before backward: a wrong shape would make `backward` panic.
        scalar(&loss)?;
        self.metric_rows
            .push(metric_row(J::TRAIN_METRICS, metrics)?);
        let scaled = guarded(|| loss.mul_scalar(share))?;
        let t2 = Instant::now();
        let value = scalar(&scaled)?;
        let grads = guarded(|| scaled.backward())?;
        device::copy_from(&self.device, || {
            flat::read_grads(&self.model, grads, grad_out)
        });
        Ok(Computed {
            loss: value,
            data_seconds: (t1 - t0).as_secs_f64(),
            forward_seconds: (t2 - t1).as_secs_f64(),
            backward_seconds: t2.elapsed().as_secs_f64(),
        })
    }

    fn train_metric_names(&self) -> Vec<String> {
        J::TRAIN_METRICS.iter().map(|n| n.to_string()).collect()
    }

    fn update_rule(&self, cfg: &TrainConfig) -> Option<std::sync::Arc<dyn UpdateRule>> {
        self.job.update_rule(cfg).map(std::sync::Arc::from)
    }

    fn take_train_metrics(&mut self) -> Vec<Vec<f32>> {
        std::mem::take(&mut self.metric_rows)
    }

    fn evaluate(&mut self, samples: &[u32]) -> Result<EvalSums, ReplicaError> {
        let device = self.device.clone().inner();
        let batch = self.batch_of(&*self.eval, "evaluation", samples, &device)?;
        let model = self.model.valid();
        let loss = scalar(&guarded(|| self.job.loss(&model, &batch))?)?;
        let metrics = guarded(|| self.job.metrics(&model, &batch))?;
        Ok(EvalSums {
            loss: J::LOSS_REDUCTION.sum_of(loss, samples.len()),
            metrics: metrics
                .into_iter()
                .map(|(name, sum)| (name.to_string(), sum))
                .collect(),
        })
    }
}

/// What a job's loss function returns for a batch of samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossReduction {
    /// The mean over the batch's samples (as burn's and PyTorch's losses by default).
    Mean,
    /// The sum over the batch's samples (PyTorch's `reduction="sum"`): lockstep scales it by
    /// `1 / global batch` alone, one rounding fewer than a mean's.
    Sum,
}

impl LossReduction {
    /// The factor a micro-batch of `n` samples' loss is multiplied by before backward, `scale`
    /// being `1 / global batch`: the micro-batch's share of the global batch for a mean.
    pub(super) fn share(self, n: usize, scale: f32) -> f32 {
        match self {
            LossReduction::Mean => n as f32 * scale,
            LossReduction::Sum => scale,
        }
    }

    /// The sum over `n` samples of a loss the job returned as `loss`.
    pub(super) fn sum_of(self, loss: f32, n: usize) -> f64 {
        match self {
            LossReduction::Mean => loss as f64 * n as f64,
            LossReduction::Sum => loss as f64,
        }
    }
}

/// SHA-256 over the job's name and every parameter's name and shape in canonical order.
fn structure_hash(job: &str, layout: &[ParamInfo]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"lockstep job structure v1\0");
    h.update((job.len() as u64).to_le_bytes());
    h.update(job.as_bytes());
    flat::hash_layout(&mut h, layout);
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_metric_names_are_distinct_plain_and_not_locksteps_own() {
        assert!(check_metric_names("j", &[]).is_ok());
        assert!(check_metric_names("j", &["accuracy", "top-5", "f1.macro"]).is_ok());
        for (names, says) in [
            (&["accuracy", "accuracy"][..], "`accuracy` is named twice"),
            (&["loss"][..], "`loss` is one of lockstep's own"),
            (&["grad_norm"][..], "`grad_norm` is one of lockstep's own"),
            (&[""][..], "`` is not a metric name"),
            (&["a/b"][..], "`a/b` is not a metric name"),
        ] {
            let e = check_metric_names("my-job", names).unwrap_err().to_string();
            assert!(
                e.contains(says) && e.contains("job `my-job`"),
                "{names:?}: {e}"
            );
        }
    }

    #[test]
    fn a_metric_row_has_one_finite_value_per_name() {
        assert_eq!(
            metric_row(&["a", "b"], vec![1.0, 2.5]).unwrap(),
            vec![1.0, 2.5]
        );
        let e = metric_row(&["a"], vec![1.0, 2.0]).unwrap_err().to_string();
        assert!(
            e.contains("returned 2 training metrics") && e.contains("names 1"),
            "{e}"
        );
        let e = metric_row(&["a"], vec![f64::NAN]).unwrap_err().to_string();
        assert!(e.contains("`a` is NaN"), "{e}");
        // Finite as f64 but not as the f32 the exact sum takes.
        assert!(metric_row(&["a"], vec![1e300]).is_err());
    }
}
