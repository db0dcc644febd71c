//! Errors of the model crate. Every variant names what was wrong and with which values, so a
//! failing rank can say exactly which input it refused.

use thiserror::Error;

/// Why a model operation refused its input.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ModelError {
    /// The model specification cannot describe a working network.
    #[error("invalid model spec: {0}")]
    InvalidSpec(String),
    /// A flat parameter (or gradient) vector has the wrong number of elements.
    #[error("{what}: expected {expected} f32 values, got {got}")]
    ParamLength {
        /// Which vector was checked (e.g. "set_params_flat", "grad_out").
        what: &'static str,
        /// `num_params()` of the model.
        expected: usize,
        /// Length that was passed.
        got: usize,
    },
    /// The input features do not match `n` samples of the model's input size.
    #[error(
        "input x: expected {n} samples x {per_sample} features = {expected} f32 values, got {got}"
    )]
    InputLength {
        /// Number of samples the caller announced.
        n: usize,
        /// Features per sample the model expects.
        per_sample: usize,
        /// `n * per_sample`.
        expected: usize,
        /// Length of `x`.
        got: usize,
    },
    /// The labels do not match `n` samples.
    #[error("labels y: expected {expected} labels (one per sample), got {got}")]
    LabelLength {
        /// Number of samples the caller announced.
        expected: usize,
        /// Length of `y`.
        got: usize,
    },
    /// A label is not a valid class index.
    #[error("label y[{index}] = {label} is out of range: the model has {classes} classes")]
    LabelOutOfRange {
        /// Sample index of the offending label.
        index: usize,
        /// The label value.
        label: u8,
        /// Number of classes of the model.
        classes: usize,
    },
    /// A batch with no samples was passed where at least one is required.
    #[error("empty batch: n must be at least 1")]
    EmptyBatch,
    /// The model produced a non-finite loss; the gradients are meaningless.
    #[error("non-finite loss {loss} on a batch of {n} samples (diverged training or bad input)")]
    NonFiniteLoss {
        /// The loss value.
        loss: f32,
        /// Batch size.
        n: usize,
    },
}
