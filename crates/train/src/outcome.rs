//! What a job's code hands back to the drivers — the loss and timings of a micro-batch
//! ([`Computed`]), evaluation sums ([`EvalSums`]), and its failures ([`ReplicaError`]) — and the
//! guard every call into job code runs under (`catch_job_panic`).

/// Timings and loss of one micro-batch.
#[derive(Debug, Clone, Copy, Default)]
pub struct Computed {
    /// The scaled loss (its gradient is what was written).
    pub loss: f32,
    /// Reading the samples and building the batch.
    pub data_seconds: f64,
    pub forward_seconds: f64,
    pub backward_seconds: f64,
}

/// Sums over evaluated samples (divided by the total number of samples by the driver).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EvalSums {
    /// Sum over samples of the loss.
    pub loss: f64,
    /// Named sums over samples (e.g. `accuracy`: the number of correct samples); reported as
    /// per-sample means.
    pub metrics: Vec<(String, f64)>,
}

/// A failure of the job's own code or data, told apart from lockstep's failures so that the
/// error names the job, the step and the micro-batch. Never cured by a restart.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    /// The loss of a micro-batch is NaN or infinite.
    #[error("the loss is {loss} (not finite)")]
    NonFiniteLoss { loss: f32 },
    /// The loss is not a single value.
    #[error("the loss must be a single value, but it has shape {shape:?}")]
    LossShape { shape: Vec<usize> },
    /// The dataset could not return an item below its length.
    #[error("the {split} dataset failed to return item {index}: {message}")]
    Dataset {
        split: &'static str,
        index: usize,
        message: String,
    },
    /// The job's code panicked (e.g. a batch of the wrong shape for the model).
    #[error("the job's code panicked: {0}")]
    Panicked(String),
    /// A parameter vector of the wrong length.
    #[error("{what}: expected {expected} values, got {got}")]
    ParamLength {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// Anything else the job reports.
    #[error("{0}")]
    Other(String),
}

impl From<lockstep_model::ModelError> for ReplicaError {
    fn from(e: lockstep_model::ModelError) -> Self {
        match e {
            lockstep_model::ModelError::NonFiniteLoss { loss, .. } => {
                ReplicaError::NonFiniteLoss { loss }
            }
            other => ReplicaError::Other(other.to_string()),
        }
    }
}

/// Run a job's own code, turning a panic into its message and location ("… at src/main.rs:9:5").
///
/// A panic in job code is reported once, in lockstep's error naming the job, the step and the
/// micro-batch: the default panic hook's report (and backtrace) is suppressed for it, so that the
/// launcher's excerpt of the worker's last output shows the error. Panics elsewhere are reported
/// as usual.
pub(crate) fn catch_job_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    install_quiet_hook();
    IN_JOB_CODE.with(|c| c.set(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    IN_JOB_CODE.with(|c| c.set(false));
    result.map_err(|payload| {
        let message = if let Some(s) = payload.downcast_ref::<&str>() {
            (*s).to_string()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.clone()
        } else {
            "(no message)".to_string()
        };
        match PANIC_LOCATION.with(|l| l.take()) {
            Some(at) => format!("{message} (at {at})"),
            None => message,
        }
    })
}

thread_local! {
    static IN_JOB_CODE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static PANIC_LOCATION: std::cell::Cell<Option<String>> = const { std::cell::Cell::new(None) };
}

fn install_quiet_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if IN_JOB_CODE.with(|c| c.get()) {
                let at = info.location().map(|l| l.to_string());
                PANIC_LOCATION.with(|l| l.set(at));
            } else {
                default(info)
            }
        }));
    });
}
