//! What every tensor-parallel layer (`tp_layers.rs`, `tp_attention.rs`) shares with the
//! training crate: the exact sum of a tensor's pieces ([`PieceSum`]) and a rank's **index map**.
//!
//! A layer with `T` fixed pieces is always computed as its `T` pieces, and the `T` partial
//! outputs of a row-parallel product and the `T` input gradients of a column-parallel one are
//! summed **exactly** (fixed point against one exponent shared by the whole tensor, integer
//! sums), so the sum's bits depend only on the multiset of pieces, never on which rank computed
//! which. The model crate never learns how the other pieces are computed: [`PieceSum`] is
//! implemented here for one rank holding all `T` ([`LocalPieceSum`]) and over a communicator by
//! the training crate.
//!
//! A rank's parameters are a **local flat vector**: per tensor, the whole tensor when
//! replicated, or its pieces' runs of rows. Its index map lists, in local order, the ranges of
//! the stage's canonical flat vector the local vector is made of ([`gather_map`],
//! [`scatter_map`]), so checkpoints stay whole-model and optimizers (elementwise) update local
//! slices with the same bits as whole vectors.

use std::ops::Range;

/// Sums the pieces of one tensor exactly, with the pieces other ranks hold.
pub trait PieceSum {
    /// `local` are this rank's pieces (each `out.len()` values) of `total` pieces in all; `out`
    /// receives the exact sum of all `total` (every rank of the group the same bits). Fails on a
    /// non-finite value or a communication failure, with a message.
    fn sum_pieces(&mut self, local: &[&[f32]], total: usize, out: &mut [f32])
        -> Result<(), String>;
}

/// [`PieceSum`] for one rank holding every piece.
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalPieceSum;

impl PieceSum for LocalPieceSum {
    fn sum_pieces(
        &mut self,
        local: &[&[f32]],
        total: usize,
        out: &mut [f32],
    ) -> Result<(), String> {
        lockstep_exact::sum_local(local, total, out).map_err(|e| e.to_string())
    }
}

/// The values of `stage_flat` that `map` selects, in order.
pub fn gather_map(stage_flat: &[f32], map: &[Range<usize>]) -> Vec<f32> {
    map.iter()
        .flat_map(|r| stage_flat[r.clone()].iter().copied())
        .collect()
}

/// Write `local` back into the positions of `stage_flat` that `map` selects.
pub fn scatter_map(local: &[f32], map: &[Range<usize>], stage_flat: &mut [f32]) {
    let mut i = 0;
    for r in map {
        stage_flat[r.clone()].copy_from_slice(&local[i..i + r.len()]);
        i += r.len();
    }
    debug_assert_eq!(i, local.len());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_gathers_and_scatters_the_same_values() {
        let whole: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let map = [1..3, 5..6, 8..10];
        let local = gather_map(&whole, &map);
        assert_eq!(local, [1.0, 2.0, 5.0, 8.0, 9.0]);
        let mut back = vec![-1.0; 10];
        scatter_map(&local, &map, &mut back);
        assert_eq!(
            back,
            [-1.0, 1.0, 2.0, -1.0, -1.0, 5.0, -1.0, -1.0, 8.0, 9.0]
        );
    }

    #[test]
    fn local_sums_are_exact() {
        let (a, b) = ([1e8f32, 1.0], [-1e8f32, 1.0]);
        let mut out = [0f32; 2];
        LocalPieceSum.sum_pieces(&[&a, &b], 2, &mut out).unwrap();
        assert_eq!(out, [0.0, 2.0]);
    }
}
