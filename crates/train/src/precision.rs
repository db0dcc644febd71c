//! `train.precision` for a model's layers: the config's choice as `lockstep_model::Products`.

use lockstep_model::Products;

use crate::config::{Precision, TrainConfig};

/// How `cfg` has a model take its products' operands (`train.precision`): a job's layers call
/// `products(cfg).operand(x)` on each operand of each product (and declare
/// `const BF16_PRODUCTS: bool = true`).
pub fn products(cfg: &TrainConfig) -> Products {
    match cfg.train.precision {
        Precision::F32 => Products::F32,
        Precision::Bf16 => Products::Bf16,
    }
}
