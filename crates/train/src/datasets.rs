//! Resolve the `[data]` section of a config to train and test sets.

use std::path::PathBuf;

use lockstep_data::{DataError, Dataset};

use crate::config::DataConfig;

/// Load `(train, test)` for a validated data config. `seed` makes the digits split deterministic.
pub fn load(cfg: &DataConfig, seed: u64) -> Result<(Dataset, Dataset), DataError> {
    match cfg.dataset.as_str() {
        "digits" => {
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
        name @ ("fashion-mnist" | "mnist") => {
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
        other => unreachable!("config validation admits no dataset `{other}`"),
    }
}
