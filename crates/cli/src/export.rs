//! `export`: a run's trained model (its newest good checkpoint, or the one after `--step N`) as a
//! burn record the job's own `Module` loads with `load_file` — for inference, evaluation or
//! fine-tuning elsewhere (`train.init_from` starts a run from one).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use crate::request::BadRequest;
use crate::{job, load_config};

#[derive(Args, Clone)]
pub(crate) struct ExportArgs {
    /// The run directory (as given to `train --out`).
    #[arg(value_name = "RUN")]
    run: PathBuf,
    /// The checkpoint taken after this many steps (default: the newest good one; the last step's
    /// when the run finished).
    #[arg(long)]
    step: Option<u64>,
    /// Where to write the burn record (burnpack), e.g. model.bpk.
    #[arg(long, value_name = "PATH")]
    out: PathBuf,
    /// Replace a file already at --out (without it, an existing file is refused).
    #[arg(long)]
    overwrite: bool,
}

pub(crate) fn run(a: &ExportArgs) -> Result<()> {
    let config = a.run.join("config.toml");
    if !config.is_file() {
        return Err(BadRequest(format!(
            "export {}: {} is missing, so this is not a run directory",
            a.run.display(),
            config.display()
        ))
        .into());
    }
    if a.out.exists() && !a.overwrite {
        return Err(BadRequest(format!(
            "export --out {}: a file is already there (nothing was changed); pass --overwrite to \
             replace it",
            a.out.display()
        ))
        .into());
    }
    let cfg = load_config(Some(&config), &[])?;
    let (step, params) = lockstep_train::export::checkpointed_params(&cfg, &a.run, a.step)?;
    let bytes = job().model_record(&cfg, &params).ok_or_else(|| {
        BadRequest(
            "export: lockstep's built-in models are not burn modules and have no burn record \
             (export is for your own Job or LayeredJob); their checkpoints are in the run's \
             checkpoints/ directory"
                .into(),
        )
    })??;
    lockstep_train::write_atomic(&a.out, &bytes)?;
    eprintln!(
        "{}: exported the parameters after step {step} of {} (param_hash {}) to {}",
        job().name(),
        a.run.display(),
        lockstep_model::param_hash(&params),
        a.out.display()
    );
    Ok(())
}
