//! Fashion-MNIST (Zalando, MIT licence): 60,000 training and 10,000 test images of 28×28, 10
//! classes, in the gzipped IDX files that Debian's `dataset-fashion-mnist` package installs
//! (scripts/setup.sh installs it).

use std::path::Path;

use crate::dataset::Dataset;
use crate::error::DataError;
use crate::idx::load_idx;

/// Where `dataset-fashion-mnist` puts the files.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Loads the official (train, test) split from `dir`, e.g. [`FASHION_MNIST_DIR`]; the datasets
/// are named "fashion-mnist-train" and "fashion-mnist-test".
pub fn load_fashion_mnist(dir: &Path) -> Result<(Dataset, Dataset), DataError> {
    let part = |prefix: &str, name: &str| {
        load_idx(
            &dir.join(format!("{prefix}-images-idx3-ubyte.gz")),
            &dir.join(format!("{prefix}-labels-idx1-ubyte.gz")),
            name,
        )
    };
    Ok((
        part("train", "fashion-mnist-train")?,
        part("t10k", "fashion-mnist-test")?,
    ))
}
