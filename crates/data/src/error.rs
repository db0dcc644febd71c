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

    /// Not a regular file: a device such as /dev/zero, a FIFO, a socket or a directory. Such
    /// paths are refused before they are opened (opening a FIFO would block, and a device can
    /// yield bytes forever).
    #[error("{}: not a regular file ({kind}); a dataset must be a regular file", .path.display())]
    NotRegularFile { path: PathBuf, kind: &'static str },

    /// More bytes than the cap of the format (see `read.rs` for the caps): a decompression
    /// bomb, or the wrong file. `found` is the size when it is known before reading (the length
    /// of a file, of bytes in memory); otherwise reading stopped as soon as the cap was passed,
    /// so nothing larger than the cap was ever held.
    #[error("{}: {what} is {}", .path.display(), size_text(.found, *.limit))]
    TooLarge {
        path: PathBuf,
        /// What was measured, e.g. "the text after decompression".
        what: &'static str,
        limit: u64,
        found: Option<u64>,
    },

    /// An IDX header declaring a payload larger than [`crate::idx::IDX_MAX_PAYLOAD_BYTES`];
    /// refused from the header alone, before anything is allocated for it.
    #[error(
        "{}: header declares {} = {declared} bytes of {what}, more than the limit of {limit} bytes",
        .path.display(),
        dims_text(.dims)
    )]
    IdxTooLarge {
        path: PathBuf,
        dims: Vec<usize>,
        declared: u64,
        limit: u64,
        what: &'static str,
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

/// The size found against the limit: exact when known, else where reading stopped.
fn size_text(found: &Option<u64>, limit: u64) -> String {
    match found {
        Some(n) => format!("{n} bytes, more than the limit of {limit} bytes"),
        None => format!("more than the limit of {limit} bytes (reading stopped there)"),
    }
}

/// IDX dimensions as the messages write them: "60000×28×28".
pub(crate) fn dims_text(dims: &[usize]) -> String {
    dims.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join("×")
}
