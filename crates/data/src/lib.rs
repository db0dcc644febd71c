//! lockstep-data: datasets and the deterministic, world-size-independent sampler.
//!
//! - `read` (private): the one bounded reader every loader reads files and gzip through.
//! - [`dataset`]: the in-memory [`Dataset`] and the seeded train/test split.
//! - [`digits`] (committed, embedded) and [`idx`] / [`fashion`] (MNIST-style files): loaders.
//! - [`text`]: character corpora (the embedded Shakespeare plays) as token ids in fixed windows.
//! - [`sampler`]: the global batch of each step, from `(seed, step)` alone.
//! - [`partition`]: fixed micro-batches and which rank computes which.
//! - [`rng`]: the project's own PRNG, so no dependency upgrade can change a sequence.
//!
//! Invariant: nothing here depends on the world size or rank except [`partition::assign`].

pub mod dataset;
pub mod digits;
pub mod error;
pub mod fashion;
pub mod idx;
pub mod partition;
mod read;
pub mod rng;
pub mod sampler;
pub mod text;

pub use dataset::{split_train_test, Dataset};
pub use digits::{
    load_digits, load_digits_embedded, parse_digits, DIGITS_MAX_BYTES, DIGITS_PATH, DIGITS_SHA256,
};
pub use error::DataError;
pub use fashion::{load_fashion_mnist, FASHION_MNIST_DIR};
pub use idx::{
    idx_files, idx_images_shape, load_idx, load_idx_split, load_idx_with_classes, parse_idx,
    read_idx, IdxArray, IdxFiles, IdxShape, IdxSplit, IDX_IMAGES_U8, IDX_LABELS_U8,
    IDX_MAX_PAYLOAD_BYTES,
};
pub use partition::{assign, microbatches};
pub use rng::Rng;
pub use sampler::Sampler;
pub use text::{
    char_corpus_files, load_char_corpus, load_shakespeare_embedded, parse_char_corpus, CharCorpus,
    Split, SHAKESPEARE_TRAIN_SHA256, SHAKESPEARE_VAL_SHA256, TEXT_MAX_BYTES,
};
