//! Resolve the `[data]` section of a config to train and test sets.

use std::path::PathBuf;

use lockstep_data::{DataError, Dataset};

use crate::config::{DataConfig, DatasetKind};

/// Load `(train, test)` for a validated data config. `seed` makes the digits split deterministic.
pub fn load(cfg: &DataConfig, seed: u64) -> Result<(Dataset, Dataset), DataError> {
    match cfg.dataset {
        DatasetKind::Digits => {
            let all = if cfg.dir.is_empty() {
                lockstep_data::load_digits_embedded()?
            } else {
                lockstep_data::load_digits(&PathBuf::from(&cfg.dir).join("digits.csv.gz"))?
            };
            Ok(lockstep_data::split_train_test(
                all,
                cfg.test_fraction,
                seed,
            ))
        }
        kind @ (DatasetKind::FashionMnist | DatasetKind::Mnist) => {
            let name = kind.name();
            // MNIST has no packaged location here: its directory must be given in data.dir
            // (config validation enforces that).
            let dir = if cfg.dir.is_empty() {
                PathBuf::from(lockstep_data::FASHION_MNIST_DIR)
            } else {
                PathBuf::from(&cfg.dir)
            };
            let pick = |stem: &str| {
                let gz = dir.join(format!("{stem}.gz"));
                if gz.exists() {
                    gz
                } else {
                    dir.join(stem)
                }
            };
            let train = lockstep_data::load_idx(
                &pick("train-images-idx3-ubyte"),
                &pick("train-labels-idx1-ubyte"),
                name,
            )?;
            let test = lockstep_data::load_idx(
                &pick("t10k-images-idx3-ubyte"),
                &pick("t10k-labels-idx1-ubyte"),
                name,
            )?;
            Ok((train, test))
        }
        // The text corpus is the transformer's (config validation pairs them).
        DatasetKind::Shakespeare => unreachable!("the classifiers never load the text corpus"),
    }
}
