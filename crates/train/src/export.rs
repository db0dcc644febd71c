//! Models in and out of lockstep as burn records: a checkpoint's parameters written into the
//! job's own `Module` and saved in burn's record format (burnpack), which the user's code loads
//! with `module.load_file(path)` on plain burn; and `train.init_from`, which starts a run from
//! such a record (fine-tuning).
//!
//! The checkpoint's flat vector is the model's parameters in declaration order (the order
//! [`flat::layout`] walks), so writing it into a freshly built model restores every tensor; the
//! record then names each tensor by its module path, as burn's own `save_file` does.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::Device;
use lockstep_model::flat;

use crate::checkpoint::{self, CheckpointError, Identity};
use crate::config::TrainConfig;
use crate::TrainError;

/// Why no parameters could be taken from a run.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The run wrote no checkpoint (`checkpoint.every = 0`, or it stopped before the first).
    #[error(
        "{dir} holds no checkpoint of this run (checkpoint.every = {every}); nothing to export"
    )]
    NoCheckpoint { dir: String, every: u64 },
    /// `--step` names a step with no checkpoint.
    #[error("{dir} has no checkpoint after step {step}; it has checkpoints after steps {have}")]
    NoSuchStep {
        dir: String,
        step: u64,
        have: String,
    },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

/// The parameters in `run_dir`'s checkpoint taken after `step` (1-based, as the progress lines
/// count), or in its newest good one: (its step, the parameters). Only a checkpoint of this run's
/// config identity is taken (`cfg`: the run's own config.toml).
pub fn checkpointed_params(
    cfg: &TrainConfig,
    run_dir: &Path,
    step: Option<u64>,
) -> Result<(u64, Vec<f32>), ExportError> {
    let dir = crate::checkpoint_dir(cfg, run_dir);
    let files = checkpoint::list(&dir)?;
    let shown = dir.display().to_string();
    let chosen: Vec<PathBuf> = match step {
        Some(s) => match files.iter().find(|(done, _)| *done == s) {
            Some((_, p)) => vec![p.clone()],
            None if files.is_empty() => Vec::new(),
            None => {
                let have: Vec<String> = files.iter().map(|(s, _)| s.to_string()).collect();
                return Err(ExportError::NoSuchStep {
                    dir: shown,
                    step: s,
                    have: have.join(", "),
                });
            }
        },
        None => files.iter().rev().map(|(_, p)| p.clone()).collect(),
    };
    let config = cfg.identity_hash();
    let mut last_error = None;
    for path in chosen {
        // The model's fingerprint is checked by the job, which rebuilds the model and compares
        // the parameter count; the config identity here.
        let Some(found) = checkpoint::read_identity(&path) else {
            continue;
        };
        let expect = Identity {
            config: config.clone(),
            model: found.model,
        };
        match checkpoint::load(&path, &expect) {
            Ok(c) => return Ok((c.step, c.params)),
            Err(e @ CheckpointError::Mismatch { .. }) => return Err(e.into()),
            Err(e) if step.is_some() => return Err(e.into()),
            Err(e) => last_error = Some(e),
        }
    }
    match last_error {
        Some(e) => Err(e.into()),
        None => Err(ExportError::NoCheckpoint {
            dir: shown,
            every: cfg.checkpoint.every,
        }),
    }
}

/// The model `build` makes (on the CPU, seeded with `train.seed`, as a worker's) holding `params`
/// as burn record bytes: `JobSpec::model_record` of a `Job` or a `LayeredJob`. A panic in
/// `build` is an error naming `job`.
pub(crate) fn record_of<M: Module>(
    job: &str,
    cfg: &TrainConfig,
    params: &[f32],
    build: impl FnOnce(&Device) -> M,
) -> Result<Vec<u8>, TrainError> {
    let device = crate::device::Placement::cpu().seeded(cfg.train.seed);
    let model =
        crate::outcome::catch_job_panic(|| build(&device)).map_err(|p| TrainError::JobSetup {
            job: job.to_string(),
            message: format!("building the model panicked: {p}"),
        })?;
    record_bytes(job, model, params, &device)
}

/// `model` holding `params` (canonical flat order) as burn record bytes (burnpack), which the
/// job's own module type loads with `load_file`. `job` names it in errors.
pub(crate) fn record_bytes<M: Module>(
    job: &str,
    model: M,
    params: &[f32],
    device: &Device,
) -> Result<Vec<u8>, TrainError> {
    let expected: usize = flat::layout(&model).iter().map(|p| p.len).sum();
    if expected != params.len() {
        return Err(TrainError::JobSetup {
            job: job.to_string(),
            message: format!(
                "the checkpoint holds {} parameters, but the job's model has {expected}: not \
                 this job's run (or its model changed since)",
                params.len()
            ),
        });
    }
    let model = flat::write(model, params, device);
    let bytes = model
        .into_record()
        .into_bytes()
        .map_err(|e| TrainError::JobSetup {
            job: job.to_string(),
            message: format!("encoding the burn record: {e}"),
        })?;
    Ok(bytes.to_vec())
}

/// `model` with its parameters loaded from the burn record at `cfg.train.init_from`, when set.
pub(crate) fn init_from<M: Module>(
    job: &str,
    model: M,
    cfg: &TrainConfig,
) -> Result<M, TrainError> {
    let path = &cfg.train.init_from;
    if path.is_empty() {
        return Ok(model);
    }
    model.try_load_file(path).map_err(|e| TrainError::JobSetup {
        job: job.to_string(),
        message: format!("train.init_from = `{path}`: not a burn record of this job's model: {e}"),
    })
}
