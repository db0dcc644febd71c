//! Errors of the data crate. Every variant that concerns a file names it, and says what is wrong
//! in terms a user can act on (which line, which header field, which count).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{}: file not found ({hint})", .path.display())]
    NotFound { path: PathBuf, hint: &'static str },

    #[error("{}: cannot read: {cause}", .path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },

    #[error("{}: gzip data is corrupt or truncated: {cause}", .path.display())]
    Gzip {
        path: PathBuf,
        cause: std::io::Error,
    },

    /// A malformed line of a CSV or text file; `line` is 1-based.
    #[error("{} line {line}: {problem}", .path.display())]
    BadLine {
        path: PathBuf,
        line: usize,
        problem: String,
    },

    #[error("{}: contains no samples", .path.display())]
    Empty { path: PathBuf },

    #[error("{}: bad IDX magic 0x{found:08x} (expected 0x{expected:08x} for {what})", .path.display())]
    IdxMagic {
        path: PathBuf,
        found: u32,
        expected: u32,
        what: &'static str,
    },

    /// The IDX payload is shorter ("truncated: ...") or longer than the header promises.
    #[error("{}: {problem}", .path.display())]
    IdxLength { path: PathBuf, problem: String },

    #[error(
        "{} holds {n_images} images but {} holds {n_labels} labels; they must be the same set",
        .images.display(), .labels.display()
    )]
    CountMismatch {
        images: PathBuf,
        n_images: usize,
        labels: PathBuf,
        n_labels: usize,
    },

    #[error("{}: label {label} of sample {index} is not below the class count {classes}", .path.display())]
    LabelOutOfRange {
        path: PathBuf,
        index: usize,
        label: u32,
        classes: usize,
    },

    #[error("sampler over {n} samples with global batch {global_batch}: {problem}")]
    Sampler {
        n: usize,
        global_batch: usize,
        problem: &'static str,
    },
}
