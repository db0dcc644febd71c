//! The run's files: `metrics.jsonl` written incrementally and `config.toml` + `summary.json` at
//! the end (rank 0 only, atomically).

use std::path::Path;

use lockstep_comm::Communicator;

use super::collect::gather_records;
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::metrics::{StepRecord, Summary};

/// `metrics.jsonl`, written incrementally.
pub(crate) struct MetricsLog {
    /// All ranks' records of this attempt gathered so far, by (step, rank).
    gathered: Vec<StepRecord>,
    /// How many of this rank's records were already gathered.
    flushed: usize,
    /// Whether this attempt has rewritten the file yet.
    started: bool,
}

impl MetricsLog {
    /// Collective: gather every rank's new records; rank 0 appends them to metrics.jsonl. The
    /// first flush of an attempt rewrites the file keeping only the earlier attempts' lines for
    /// steps before `start_step`, so the file stays one continuous curve across restarts.
    pub(crate) fn new() -> Self {
        MetricsLog {
            gathered: Vec::new(),
            flushed: 0,
            started: false,
        }
    }

    /// All ranks' records of this attempt gathered so far.
    pub(crate) fn gathered(&self) -> &[StepRecord] {
        &self.gathered
    }

    pub(crate) fn flush(
        &mut self,
        comm: &mut Communicator,
        mine: &[StepRecord],
        dir: &Path,
        start_step: u64,
    ) -> Result<(), TrainError> {
        let new = gather_records(comm, &mine[self.flushed..])?;
        self.flushed = mine.len();
        if comm.rank() == 0 {
            let path = dir.join("metrics.jsonl");
            let io = |source| TrainError::Io {
                path: path.display().to_string(),
                cause: source,
            };
            std::fs::create_dir_all(dir).map_err(io)?;
            let mut lines = Vec::new();
            if !self.started {
                if start_step > 0 {
                    for line in std::fs::read_to_string(&path).unwrap_or_default().lines() {
                        if serde_json::from_str::<StepRecord>(line)
                            .is_ok_and(|r| r.step < start_step)
                        {
                            lines.extend_from_slice(line.as_bytes());
                            lines.push(b'\n');
                        }
                    }
                }
            } else {
                lines = std::fs::read(&path).map_err(io)?;
            }
            for r in &new {
                serde_json::to_writer(&mut lines, r).expect("record serialises");
                lines.push(b'\n');
            }
            write_atomic(&path, &lines)?;
        }
        self.started = true;
        self.gathered.extend(new);
        Ok(())
    }
}

pub(crate) fn write_outputs(
    dir: &Path,
    cfg: &TrainConfig,
    summary: &Summary,
) -> Result<(), TrainError> {
    std::fs::create_dir_all(dir).map_err(|source| TrainError::Io {
        path: dir.display().to_string(),
        cause: source,
    })?;
    write_atomic(&dir.join("config.toml"), cfg.to_toml().as_bytes())?;
    let mut s = serde_json::to_vec_pretty(summary).expect("summary serialises");
    s.push(b'\n');
    write_atomic(&dir.join("summary.json"), &s)?;
    Ok(())
}

/// [`crate::files::replace_via`] with a temporary name next to `path`, for run outputs.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    crate::files::replace_via(&tmp, path, bytes).map_err(|cause| TrainError::Io {
        path: path.display().to_string(),
        cause,
    })
}
