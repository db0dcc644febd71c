//! Fashion-MNIST (Zalando, MIT licence): 60,000 training and 10,000 test images of 28×28, 10
//! classes, in the gzipped IDX files that Debian's `dataset-fashion-mnist` package installs
//! (scripts/setup.sh installs it).

use std::path::Path;

use crate::dataset::Dataset;
use crate::error::DataError;
use crate::idx::{load_idx_split, IdxSplit};

/// Where `dataset-fashion-mnist` puts the files.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Loads the official (train, test) split from `dir`, e.g. [`FASHION_MNIST_DIR`]; the datasets
/// are named "fashion-mnist-train" and "fashion-mnist-test". The files are those of
/// [`crate::idx_files`] (`.gz` as installed, or gunzipped copies).
pub fn load_fashion_mnist(dir: &Path) -> Result<(Dataset, Dataset), DataError> {
    Ok((
        load_idx_split(dir, IdxSplit::Train, "fashion-mnist-train")?,
        load_idx_split(dir, IdxSplit::Test, "fashion-mnist-test")?,
    ))
}
