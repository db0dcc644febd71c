//! The run's files: `metrics.jsonl` written incrementally and `config.toml` + `summary.json` at
//! the end (rank 0 only, atomically).

use std::path::Path;

use lockstep_comm::Communicator;

use super::collect::gather_records;
use crate::config::{ConfigSections, TrainConfig};
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
    /// When this attempt began (seconds since the epoch): the TensorBoard file's time base.
    start_unix: f64,
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
            start_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
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
                    lines = earlier_records(&path, start_step)?;
                }
            } else {
                lines = std::fs::read(&path).map_err(io)?;
            }
            for r in &new {
                serde_json::to_writer(&mut lines, r).expect("record serialises");
                lines.push(b'\n');
            }
            write_atomic(&path, &lines)?;
            self.write_tensorboard(dir, &lines)?;
        }
        self.started = true;
        self.gathered.extend(new);
        Ok(())
    }
}

impl MetricsLog {
    /// `<dir>/tensorboard/`'s event file from metrics.jsonl's `lines` (all of them: the file
    /// tells the same story, restarts included).
    fn write_tensorboard(&self, dir: &Path, lines: &[u8]) -> Result<(), TrainError> {
        let records: Vec<StepRecord> = lines
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .filter_map(|l| serde_json::from_slice(l).ok())
            .collect();
        let tb = dir.join("tensorboard");
        std::fs::create_dir_all(&tb).map_err(|cause| TrainError::Io {
            path: tb.display().to_string(),
            cause,
        })?;
        let bytes = lockstep_run::tensorboard::event_file(&records, self.start_unix);
        write_atomic(&tb.join(lockstep_run::tensorboard::EVENT_FILE), &bytes)
    }
}

/// The lines of metrics.jsonl at `path` for steps before `start_step`, as they are. A line that is
/// not a step record is an error naming it, never dropped: the file is the run's only record of
/// those steps.
fn earlier_records(path: &Path, start_step: u64) -> Result<Vec<u8>, TrainError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(cause) => {
            return Err(TrainError::Io {
                path: path.display().to_string(),
                cause,
            })
        }
    };
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let record: StepRecord =
            serde_json::from_str(line).map_err(|e| TrainError::CorruptMetrics {
                path: path.display().to_string(),
                line: i + 1,
                what: e.to_string(),
            })?;
        if record.step < start_step {
            lines.extend_from_slice(line.as_bytes());
            lines.push(b'\n');
        }
    }
    Ok(lines)
}

pub(crate) fn write_outputs(
    dir: &Path,
    cfg: &TrainConfig,
    sections: ConfigSections,
    summary: &Summary,
) -> Result<(), TrainError> {
    std::fs::create_dir_all(dir).map_err(|source| TrainError::Io {
        path: dir.display().to_string(),
        cause: source,
    })?;
    write_atomic(
        &dir.join("config.toml"),
        cfg.to_run_file(sections).as_bytes(),
    )?;
    let mut s = serde_json::to_vec_pretty(summary).expect("summary serialises");
    s.push(b'\n');
    write_atomic(&dir.join("summary.json"), &s)?;
    Ok(())
}

/// [`crate::files::replace_atomically`], for run outputs and every other file lockstep writes.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    crate::files::replace_atomically(path, bytes).map_err(|cause| TrainError::Io {
        path: path.display().to_string(),
        cause,
    })
}
