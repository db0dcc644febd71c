//! How a global batch is cut into micro-batches and shared among ranks.
//!
//! Floating-point results depend on how a batch is split (matmul reduction order follows the batch
//! composition), so the unit of computation is a fixed-size micro-batch whose contents depend only
//! on the global batch, never on the world size. Ranks compute whole micro-batches; the trainer
//! combines per-micro-batch results in micro-batch order, which gives the same bits on any world
//! size.

use std::ops::Range;

/// Cuts `global` into consecutive micro-batches of `microbatch` samples, in order. When
/// `microbatch` does not divide the length, the last micro-batch is shorter (callers that need
/// equal sizes should check `global.len() % microbatch == 0` when validating their settings).
///
/// # Panics
/// If `microbatch == 0`.
pub fn microbatches(global: &[u32], microbatch: usize) -> Vec<&[u32]> {
    assert!(microbatch > 0, "micro-batch size must be at least 1");
    global.chunks(microbatch).collect()
}

/// The contiguous range of micro-batch numbers that `rank` of `world` computes. Shares are as
/// even as possible: the first `n_micro % world` ranks get one more (4 on 3 ranks ⇒ 2, 1, 1).
/// Ranks beyond `n_micro` get an empty range.
///
/// # Panics
/// If `world == 0` or `rank >= world`.
pub fn assign(n_micro: usize, world: usize, rank: usize) -> Range<usize> {
    assert!(
        rank < world,
        "rank {rank} is not below the world size {world}"
    );
    let base = n_micro / world;
    let extra = n_micro % world;
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    start..start + len
}
