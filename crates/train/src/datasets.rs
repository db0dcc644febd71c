//! Resolve the `[data]` section of a config to train and test sets.

use std::path::PathBuf;

use lockstep_data::{DataError, Dataset, IdxSplit};

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
            let dir = idx_dir(cfg);
            let train = lockstep_data::load_idx_split(&dir, IdxSplit::Train, name)?;
            let test = lockstep_data::load_idx_split(&dir, IdxSplit::Test, name)?;
            Ok((train, test))
        }
        // The text corpus is the transformer's (config validation pairs them).
        DatasetKind::Shakespeare => unreachable!("the classifiers never load the text corpus"),
    }
}

/// The folder of an IDX dataset (MNIST, Fashion-MNIST): `data.dir`, or Fashion-MNIST's packaged
/// location. MNIST has none here: its directory must be given in data.dir (config validation
/// enforces that).
pub fn idx_dir(cfg: &DataConfig) -> PathBuf {
    if cfg.dir.is_empty() {
        PathBuf::from(lockstep_data::FASHION_MNIST_DIR)
    } else {
        PathBuf::from(&cfg.dir)
    }
}
