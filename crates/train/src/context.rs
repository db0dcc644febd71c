//! What a training loop needs besides the config ([`WorkerContext`]) and what it tells its
//! caller ([`Event`]).

use std::path::Path;

use lockstep_comm::Communicator;

use crate::device::Placement;
use crate::faults::Fault;

/// A progress report for the terminal (rank 0 only).
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub step: u64,
    pub total_steps: u64,
    pub loss: f64,
    pub samples_per_sec: f64,
    pub eta_seconds: f64,
}

/// What the loop tells its caller (rank 0 only, except `Notice`); a job sees them in its
/// `on_event` hook.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Event {
    /// Every `train.log_every` steps.
    Progress(Progress),
    /// A step completed (its number, counting from 1).
    StepDone(u64),
    /// Training continues from the checkpoint of this step.
    Resumed(u64),
    /// Something worth a log line (damaged checkpoint skipped, straggler, …).
    Notice(String),
    /// The model was evaluated after `step` steps (the figures summary.json and metrics.jsonl
    /// record, the same for every world size).
    Evaluated {
        step: u64,
        eval: crate::metrics::Eval,
    },
    /// The checkpoint after `step` steps is on disk at `path` (atomic, checksummed).
    Checkpointed { step: u64, path: std::path::PathBuf },
}

/// What a run's outputs say about its job: summary.json's `job`, and the sections the run's
/// config.toml shows.
#[derive(Clone, Debug)]
pub struct JobLabel {
    pub name: String,
    pub sections: crate::config::ConfigSections,
}

/// Everything the loop needs that is not in the config.
pub struct WorkerContext<'a> {
    pub comm: &'a mut Communicator,
    /// Host name of this rank (for the summary).
    pub host: String,
    /// This rank's device (`train.device`, opened for its local rank).
    pub device: Placement,
    /// Run directory; only rank 0 writes to it (outputs and checkpoints).
    pub out_dir: &'a Path,
    pub on_event: &'a mut dyn FnMut(Event),
    /// Continue from the newest good checkpoint, if there is one.
    pub resume: bool,
    /// Deliberately injected faults (tests, demonstrations).
    pub faults: &'a [Fault],
}
