//! The built-in transformer's shape as a config gives it: one home for the job that builds it
//! (`builtin::transformer`) and the limits that estimate its size before any data is read
//! (`limits`), which would otherwise import each other in a cycle.

use lockstep_model::TransformerSpec;

use crate::config::TrainConfig;

/// The transformer `cfg` describes, for a corpus with `vocab` characters (`model.d_ff = 0`:
/// four times `model.d_model`), its products as `train.precision` asks.
pub(crate) fn transformer_spec(cfg: &TrainConfig, vocab: usize) -> TransformerSpec {
    let m = &cfg.model;
    TransformerSpec {
        vocab,
        context: m.context,
        d_model: m.d_model,
        heads: m.heads,
        blocks: m.blocks,
        d_ff: if m.d_ff == 0 { 4 * m.d_model } else { m.d_ff },
        products: crate::precision::products(cfg),
    }
}
