//! A rank's part of a sharded checkpoint (`checkpoint.sharded`), in and out: which values of its
//! local vector it writes and where they sit in the canonical flat vector, and its local vector
//! read back from a set written by any layout. The format is [`crate::checkpoint::sharded`]'s.

use std::ops::Range;

use crate::checkpoint::sharded::{canonical_pieces, Manifest, ShardLayout};
use crate::checkpoint::CheckpointError;
use crate::zero::Zero;

/// What a rank writes: the ZeRO chunks of its local vector (`zero.chunks()`, at every level, so
/// the replicas of a stage split the writing even at level 0), at their canonical ranges — as
/// ranges of the vectors it keeps, so that a write in the background can hold the vectors
/// themselves rather than a copy. `map`: the local vector's ranges of the stage's canonical
/// vector; `offset`: the stage's first value in the whole model.
pub(crate) fn shard_layout(zero: &Zero, map: &[Range<usize>], offset: usize) -> ShardLayout {
    let mut layout = ShardLayout {
        ranges: Vec::new(),
        whole: Vec::new(),
        chunks: Vec::new(),
        params_whole: zero.level() < 3,
        state_whole: zero.level() == 0,
    };
    let mut owned_at = 0;
    for c in zero.chunks() {
        for (canonical, local) in canonical_pieces(map, offset, c.clone()) {
            // The same values' offset in the concatenation of the rank's chunks.
            let at = owned_at + (local.start - c.start);
            layout.chunks.push(at..at + local.len());
            layout.whole.push(local);
            layout.ranges.push(canonical);
        }
        owned_at += c.len();
    }
    layout
}

/// The canonical ranges of a whole local vector of `len` values (see [`shard_layout`]).
pub(crate) fn local_ranges(map: &[Range<usize>], offset: usize, len: usize) -> Vec<Range<usize>> {
    canonical_pieces(map, offset, 0..len)
        .into_iter()
        .map(|(canonical, _)| canonical)
        .collect()
}

/// A set written by this run's model (the same parameter count, one vector per optimizer state
/// vector plus the parameters), or a mismatch naming it.
pub(crate) fn check_set(
    path: &std::path::Path,
    m: &Manifest,
    num_params: usize,
    state_vectors: usize,
) -> Result<(), CheckpointError> {
    if m.num_params != num_params as u64 || m.vectors as usize != 1 + state_vectors {
        return Err(CheckpointError::Mismatch {
            path: path.display().to_string(),
            what: format!(
                "{} parameters and {} vectors per shard; this run has {num_params} parameters \
                 and {} vectors",
                m.num_params,
                m.vectors,
                1 + state_vectors
            ),
        });
    }
    Ok(())
}
