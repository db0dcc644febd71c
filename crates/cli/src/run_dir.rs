//! The run directory is a ledger: nothing in it is rewritten by a request that has not been
//! validated first, and an ordinary command never destroys a run.
//!
//! - A fresh `train` refuses a directory that already holds a run (it names the files and
//!   suggests `--resume` or another `--out`); `--overwrite` removes that run's files first.
//! - `--resume DIR` checks the request against the run before writing anything: `--set` may
//!   change how the run is executed (workers, timeouts, logging, checkpoints) but not what it
//!   computes; a finished run is reported as finished and left untouched, unless a larger
//!   `train.steps` (or `train.epochs`) extends it — every earlier record is then kept.
//! - Checkpoint directories are probed for writability before any worker starts.

use std::path::{Path, PathBuf};

use lockstep_train::TrainConfig;

/// A request that would damage or cannot continue a run. Bad input: exit status 3.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error(
        "{dir} already holds a run ({files}); continue it with `lockstep train --resume {dir}`, \
         choose another --out, or pass --overwrite to replace it"
    )]
    HoldsRun { dir: String, files: String },
    #[error("--resume {dir}: {dir}/config.toml is missing, so this is not a run directory")]
    NotARun { dir: String },
    #[error(
        "--resume {dir}: --set would change what the run computes ({changes}); a resumed run \
         keeps its settings: start a new run with --out instead"
    )]
    ChangesIdentity { dir: String, changes: String },
    #[error("--resume {dir}: {what}")]
    BadLength { dir: String, what: String },
    #[error("checkpoint directory {dir} is not writable: {cause}")]
    Unwritable { dir: String, cause: String },
    #[error("{path}: {what}")]
    Unreadable { path: String, what: String },
}

/// Files that make a directory a run.
const RUN_FILES: &[&str] = &[
    "config.toml",
    "summary.json",
    "metrics.jsonl",
    "report.md",
    "report.html",
];

fn display(p: &Path) -> String {
    p.display().to_string()
}

/// The run files (and checkpoint directory) present in `dir`.
fn run_files(dir: &Path, ckpt_dir: &Path) -> Vec<String> {
    let mut found: Vec<String> = RUN_FILES
        .iter()
        .filter(|f| dir.join(f).exists())
        .map(|f| f.to_string())
        .collect();
    if lockstep_train::checkpoint::list(ckpt_dir).is_ok_and(|l| !l.is_empty()) {
        found.push(format!("checkpoints in {}", display(ckpt_dir)));
    }
    found
}

/// A fresh run into `dir`: refuse a directory holding a run, unless `overwrite`, which removes the
/// run's files (and checkpoints) — and nothing else.
pub fn prepare_fresh(dir: &Path, cfg: &TrainConfig, overwrite: bool) -> Result<(), RunDirError> {
    let ckpt_dir = lockstep_train::checkpoint_dir(cfg, dir);
    let found = run_files(dir, &ckpt_dir);
    if found.is_empty() {
        return Ok(());
    }
    if !overwrite {
        return Err(RunDirError::HoldsRun {
            dir: display(dir),
            files: found.join(", "),
        });
    }
    for f in RUN_FILES {
        let _ = std::fs::remove_file(dir.join(f));
    }
    if let Ok(list) = lockstep_train::checkpoint::list(&ckpt_dir) {
        for (_, p) in list {
            let _ = std::fs::remove_file(p);
        }
    }
    Ok(())
}

/// What `--resume` will do.
#[derive(Debug)]
pub enum Resume {
    /// Continue (an interrupted run, or a finished one extended to more steps).
    Continue,
    /// The run is complete and the request asks for nothing more: touch nothing.
    Finished { steps: u64, param_hash: String },
}

/// Check `--resume dir` with the config `cfg` (the run's config.toml plus `--set`) against the run.
pub fn check_resume(dir: &Path, cfg: &TrainConfig) -> Result<Resume, RunDirError> {
    let config_path = dir.join("config.toml");
    if !config_path.exists() {
        return Err(RunDirError::NotARun { dir: display(dir) });
    }
    let old = TrainConfig::load_for(crate::job(), Some(&config_path), &[]).map_err(|e| {
        RunDirError::Unreadable {
            path: display(&config_path),
            what: e.to_string(),
        }
    })?;
    let changes = old.identity_differences(cfg);
    if !changes.is_empty() {
        return Err(RunDirError::ChangesIdentity {
            dir: display(dir),
            changes: changes.join(", "),
        });
    }
    let (o, n) = (&old.train, &cfg.train);
    let bad_length = |what: String| RunDirError::BadLength {
        dir: display(dir),
        what,
    };
    if (o.steps == 0) != (n.steps == 0) {
        return Err(bad_length(format!(
            "the run's length is given in {}; extend it with the same key",
            if o.steps > 0 {
                "train.steps"
            } else {
                "train.epochs"
            }
        )));
    }
    if n.steps < o.steps || n.epochs < o.epochs {
        return Err(bad_length(format!(
            "a resumed run can be extended but not shortened (train.steps {} → {}, train.epochs \
             {} → {})",
            o.steps, n.steps, o.epochs, n.epochs
        )));
    }
    let summary_path = dir.join("summary.json");
    let Ok(text) = std::fs::read_to_string(&summary_path) else {
        return Ok(Resume::Continue); // interrupted before its end
    };
    let summary: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| RunDirError::Unreadable {
            path: display(&summary_path),
            what: format!("not valid JSON ({e}); the run's files were left as they are"),
        })?;
    // A summary is written when every step of its config is done; it belongs to the config in
    // config.toml unless an extension rewrote that config and has not finished yet.
    let extended = n.steps > o.steps || n.epochs > o.epochs;
    if extended || summary["config_hash"].as_str() != Some(old.hash_hex().as_str()) {
        return Ok(Resume::Continue);
    }
    Ok(Resume::Finished {
        steps: summary["steps"].as_u64().unwrap_or(0),
        param_hash: summary["param_hash"].as_str().unwrap_or("?").to_string(),
    })
}

/// Create `dir` (the checkpoint directory) if needed and prove it writable with a probe file, so
/// an unwritable `checkpoint.dir` is found before the first checkpoint, not at it.
pub fn check_writable(dir: &Path) -> Result<(), RunDirError> {
    let unwritable = |cause: std::io::Error| RunDirError::Unwritable {
        dir: display(dir),
        cause: cause.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(unwritable)?;
    let probe: PathBuf = dir.join(format!(".lockstep-probe.{}", std::process::id()));
    std::fs::write(&probe, b"probe").map_err(unwritable)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}
