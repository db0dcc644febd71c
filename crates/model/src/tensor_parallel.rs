//! The **canonical split** of the transformer for tensor parallelism: which slices of which
//! parameters make up each of the `T` fixed pieces of a block, and which pieces one rank holds.
//!
//! Bitwise equality across tensor-parallel sizes needs a split that one worker computes too: a
//! block with `T = tp_pieces` is always computed as `T` pieces — attention piece `p` owns heads
//! `[p·H/T, (p+1)·H/T)` (its Q, K and V columns of `qkv_w`/`qkv_b`, its rows of `proj_w`), MLP
//! piece `p` owns columns `[p·F/T, (p+1)·F/T)` of `fc1_w`/`fc1_b` and the same rows of `fc2_w`
//! (column-parallel then row-parallel, Megatron style). Everything else — layer norms,
//! embeddings, the head and the row-parallel biases `proj_b`, `fc2_b` — is replicated: the
//! vocabulary is at most 256, so every rank computing the output projection costs little.
//!
//! The `T` partial outputs of a row-parallel product and the `T` input gradients of a
//! column-parallel one are summed **exactly** ([`PieceSum`]: fixed point against one exponent
//! shared by the whole tensor, integer sums), so the sum's bits depend only on the multiset of
//! pieces, never on which rank computed which. A rank's pieces are `T / tp` consecutive ones;
//! the model crate never learns how the other pieces are computed: [`PieceSum`] is implemented
//! locally here ([`LocalPieceSum`], one rank holding all `T`) and over a communicator by the
//! training crate.
//!
//! A rank's parameters are a **local flat vector**: per canonical tensor, the whole tensor when
//! replicated, or each local piece's slice (row-major in the piece's own shape). Its
//! [`TpLayout::index_map`] lists, in local order, the ranges of the stage's canonical flat vector
//! that the local vector is made of, so checkpoints stay whole-model and optimizers (elementwise)
//! update local slices with the same bits as whole vectors.

use std::ops::Range;

use crate::error::ModelError;
use crate::transformer::{LayerKind, TransformerSpec};

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

/// Which of the `pieces` fixed pieces one rank computes: `tp` ranks, this one `tp_rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpSplit {
    pub pieces: usize,
    pub tp: usize,
    pub tp_rank: usize,
}

impl TpSplit {
    /// One rank holding all `pieces`.
    pub fn whole(pieces: usize) -> Self {
        TpSplit {
            pieces,
            tp: 1,
            tp_rank: 0,
        }
    }

    /// Checks that `pieces` is a valid split of `spec` and that `tp` divides it.
    pub fn new(
        spec: &TransformerSpec,
        pieces: usize,
        tp: usize,
        tp_rank: usize,
    ) -> Result<Self, ModelError> {
        let bad = |m: String| Err(ModelError::InvalidSpec(m));
        if pieces == 0 || !spec.heads.is_multiple_of(pieces) || !spec.d_ff.is_multiple_of(pieces) {
            return bad(format!(
                "tp_pieces = {pieces} must be ≥ 1 and divide heads = {} and d_ff = {}",
                spec.heads, spec.d_ff
            ));
        }
        if tp == 0 || !pieces.is_multiple_of(tp) || tp_rank >= tp {
            return bad(format!(
                "tensor-parallel rank {tp_rank} of {tp}: tp must divide tp_pieces = {pieces}"
            ));
        }
        Ok(TpSplit {
            pieces,
            tp,
            tp_rank,
        })
    }

    /// The pieces this rank computes.
    pub fn local(&self) -> Range<usize> {
        let per = self.pieces / self.tp;
        self.tp_rank * per..(self.tp_rank + 1) * per
    }
}

/// One tensor of a rank's local parameters (kept as a matrix: vectors are `[1, len]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalTensor {
    /// Canonical name, with `[piece p]` for a piece's slice.
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    /// Offset in the local flat vector.
    pub offset: usize,
    /// Ranges of the stage's canonical flat vector, in local (row-major) order.
    pub map: Vec<Range<usize>>,
}

impl LocalTensor {
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Indices (into [`TpLayout::tensors`]) of one layer's local tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LayerSlots {
    Embedding {
        tok: usize,
        pos: usize,
    },
    Block {
        ln1: [usize; 2],
        /// Per local piece: `qkv_w`, `qkv_b`, `proj_w`.
        attn: Vec<[usize; 3]>,
        proj_b: usize,
        ln2: [usize; 2],
        /// Per local piece: `fc1_w`, `fc1_b`, `fc2_w`.
        mlp: Vec<[usize; 3]>,
        fc2_b: usize,
    },
    Head {
        ln: [usize; 2],
        out_w: usize,
        out_b: usize,
    },
}

/// A rank's local parameters of a range of layers under a split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpLayout {
    pub tensors: Vec<LocalTensor>,
    pub(crate) slots: Vec<LayerSlots>,
}

/// Builds the local tensors in canonical tensor order (a split tensor's local pieces in order).
struct Builder<'a> {
    spec: &'a TransformerSpec,
    split: TpSplit,
    tensors: Vec<LocalTensor>,
    /// Stage-relative offset of the next canonical tensor.
    base: usize,
    local: usize,
}

impl Builder<'_> {
    fn push(&mut self, name: String, rows: usize, cols: usize, map: Vec<Range<usize>>) -> usize {
        debug_assert_eq!(map.iter().map(|r| r.len()).sum::<usize>(), rows * cols);
        self.tensors.push(LocalTensor {
            name,
            rows,
            cols,
            offset: self.local,
            map: merge(map),
        });
        self.local += rows * cols;
        self.tensors.len() - 1
    }

    /// A replicated canonical tensor of `shape`.
    fn whole(&mut self, name: String, shape: &[usize]) -> usize {
        let (rows, cols) = match shape {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => unreachable!("transformer tensors are vectors or matrices"),
        };
        let base = self.base;
        self.base += rows * cols;
        self.push(name, rows, cols, one(base..base + rows * cols))
    }

    /// A split canonical matrix `[rows, cols]`: per local piece, the ranges `piece(p, base)`
    /// of a `[prows, pcols]` slice.
    fn pieces(
        &mut self,
        name: &str,
        shape: &[usize],
        pshape: [usize; 2],
        piece: impl Fn(usize, usize) -> Vec<Range<usize>>,
    ) -> Vec<usize> {
        let base = self.base;
        self.base += shape.iter().product::<usize>();
        self.split
            .local()
            .map(|p| {
                self.push(
                    format!("{name}[piece {p}]"),
                    pshape[0],
                    pshape[1],
                    piece(p, base),
                )
            })
            .collect()
    }

    fn layer(&mut self, layer: usize) -> LayerSlots {
        let params = self.spec.layer_params(layer);
        let (d, ff, t) = (self.spec.d_model, self.spec.d_ff, self.split.pieces);
        let (dp, fp) = (d / t, ff / t);
        let whole = |b: &mut Self, i: usize| b.whole(params[i].0.clone(), &params[i].1);
        match self.spec.layer_kind(layer) {
            LayerKind::Embedding => LayerSlots::Embedding {
                tok: whole(self, 0),
                pos: whole(self, 1),
            },
            LayerKind::Head => LayerSlots::Head {
                ln: [whole(self, 0), whole(self, 1)],
                out_w: whole(self, 2),
                out_b: whole(self, 3),
            },
            LayerKind::Block(_) => {
                let ln1 = [whole(self, 0), whole(self, 1)];
                // Q, K and V columns of the piece's heads, row by row.
                let qkv_w = self.pieces(&params[2].0, &params[2].1, [d, 3 * dp], |p, b| {
                    (0..d)
                        .flat_map(|i| {
                            (0..3).map(move |k| {
                                let s = b + i * 3 * d + k * d + p * dp;
                                s..s + dp
                            })
                        })
                        .collect()
                });
                let qkv_b = self.pieces(&params[3].0, &params[3].1, [1, 3 * dp], |p, b| {
                    (0..3)
                        .map(|k| b + k * d + p * dp..b + k * d + (p + 1) * dp)
                        .collect()
                });
                let proj_w = self.pieces(&params[4].0, &params[4].1, [dp, d], |p, b| {
                    one(b + p * dp * d..b + (p + 1) * dp * d)
                });
                let proj_b = whole(self, 5);
                let ln2 = [whole(self, 6), whole(self, 7)];
                let fc1_w = self.pieces(&params[8].0, &params[8].1, [d, fp], |p, b| {
                    (0..d)
                        .map(|i| b + i * ff + p * fp..b + i * ff + (p + 1) * fp)
                        .collect()
                });
                let fc1_b = self.pieces(&params[9].0, &params[9].1, [1, fp], |p, b| {
                    one(b + p * fp..b + (p + 1) * fp)
                });
                let fc2_w = self.pieces(&params[10].0, &params[10].1, [fp, d], |p, b| {
                    one(b + p * fp * d..b + (p + 1) * fp * d)
                });
                let fc2_b = whole(self, 11);
                let zip3 = |a: &[usize], b: &[usize], c: &[usize]| {
                    (0..a.len()).map(|i| [a[i], b[i], c[i]]).collect()
                };
                LayerSlots::Block {
                    ln1,
                    attn: zip3(&qkv_w, &qkv_b, &proj_w),
                    proj_b,
                    ln2,
                    mlp: zip3(&fc1_w, &fc1_b, &fc2_w),
                    fc2_b,
                }
            }
        }
    }
}

/// Parameters of `layer` that the canonical split cuts into pieces (a block's `qkv_w`, `qkv_b`,
/// `proj_w`, `fc1_w`, `fc1_b`, `fc2_w`: the tensors `Builder::layer` cuts); the rest of the
/// layer is replicated on every tensor-parallel rank. A rank of `tp` holds
/// `params − split + split / tp` of the layer.
pub fn split_params(spec: &TransformerSpec, layer: usize) -> usize {
    const SPLIT: [usize; 6] = [2, 3, 4, 8, 9, 10];
    match spec.layer_kind(layer) {
        LayerKind::Block(_) => spec
            .layer_params(layer)
            .iter()
            .enumerate()
            .filter(|(i, _)| SPLIT.contains(i))
            .map(|(_, (_, shape))| shape.iter().product::<usize>())
            .sum(),
        _ => 0,
    }
}

/// A map of one range.
fn one(r: Range<usize>) -> Vec<Range<usize>> {
    std::iter::once(r).collect()
}

/// Adjacent ranges joined (a piece's consecutive columns of consecutive rows stay one range).
fn merge(ranges: Vec<Range<usize>>) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

impl TpLayout {
    /// The local parameters of `layers` of `spec` under `split` (checked by [`TpSplit::new`]).
    pub fn new(spec: &TransformerSpec, layers: Range<usize>, split: TpSplit) -> TpLayout {
        let mut b = Builder {
            spec,
            split,
            tensors: Vec::new(),
            base: 0,
            local: 0,
        };
        let slots = layers.map(|l| b.layer(l)).collect();
        TpLayout {
            tensors: b.tensors,
            slots,
        }
    }

    /// Values in the local flat vector.
    pub fn num_params(&self) -> usize {
        self.tensors.iter().map(LocalTensor::len).sum()
    }

    /// Ranges of the stage's canonical flat vector whose concatenation is the local flat vector.
    pub fn index_map(&self) -> Vec<Range<usize>> {
        merge(self.tensors.iter().flat_map(|t| t.map.clone()).collect())
    }

    /// Buckets of the local flat vector for the exact gradient sum: each local tensor cut into
    /// `bucket_elems`-value pieces. A bucket never mixes pieces, so it holds the same elements
    /// in every layout with the same split, and shares the same exponent.
    pub fn grad_buckets(&self, bucket_elems: usize) -> Vec<Range<usize>> {
        let step = bucket_elems.max(1);
        let mut out = Vec::new();
        for t in &self.tensors {
            let mut s = t.offset;
            while s < t.offset + t.len() {
                let e = (s + step).min(t.offset + t.len());
                out.push(s..e);
                s = e;
            }
        }
        out
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
    fn split_params_count_what_a_rank_holds_a_share_of() {
        let s = spec();
        for layer in 0..s.num_layers() {
            let whole: usize = s
                .layer_params(layer)
                .iter()
                .map(|(_, shape)| shape.iter().product::<usize>())
                .sum();
            let split = split_params(&s, layer);
            for (pieces, tp) in [(4, 2), (4, 4), (2, 2)] {
                let rank = TpLayout::new(
                    &s,
                    layer..layer + 1,
                    TpSplit::new(&s, pieces, tp, 1).unwrap(),
                );
                assert_eq!(
                    rank.num_params(),
                    whole - split + split / tp,
                    "layer {layer}"
                );
            }
        }
        assert_eq!(split_params(&s, 0), 0, "the embedding is replicated");
    }

    fn spec() -> TransformerSpec {
        TransformerSpec {
            vocab: 11,
            context: 4,
            d_model: 8,
            heads: 4,
            blocks: 2,
            d_ff: 12,
            products: Default::default(),
        }
    }

    #[test]
    fn the_ranks_index_maps_tile_the_stage_exactly_once() {
        let s = spec();
        for layers in [0..s.num_layers(), 1..3, 2..4] {
            let len: usize = s.layout(layers.clone()).iter().map(|p| p.len).sum();
            for (pieces, tp) in [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)] {
                let mut seen = vec![0u8; len];
                for r in 0..tp {
                    let split = TpSplit::new(&s, pieces, tp, r).unwrap();
                    let l = TpLayout::new(&s, layers.clone(), split);
                    let map = l.index_map();
                    assert_eq!(map.iter().map(|r| r.len()).sum::<usize>(), l.num_params());
                    for rg in &map {
                        for i in rg.clone() {
                            seen[i] += 1;
                        }
                    }
                }
                // Split tensors once over the group, replicated ones once per rank.
                let replicated: usize = s
                    .layout(layers.clone())
                    .iter()
                    .filter(|p| {
                        !["qkv_w", "qkv_b", "proj_w", "fc1_w", "fc1_b", "fc2_w"]
                            .iter()
                            .any(|n| p.name.ends_with(n))
                    })
                    .map(|p| p.len)
                    .sum();
                let total: usize = seen.iter().map(|&c| c as usize).sum();
                assert_eq!(
                    total,
                    len + (tp - 1) * replicated,
                    "{layers:?} {pieces}/{tp}"
                );
                assert!(seen.iter().all(|&c| c >= 1));
            }
        }
    }

    #[test]
    fn a_piece_holds_its_heads_q_k_v_columns() {
        let s = spec();
        // Block 0 alone: ln1 (2·8), then qkv_w [8, 24]; piece 1 of 4 (dp = 2).
        let l = TpLayout::new(&s, 1..2, TpSplit::new(&s, 4, 4, 1).unwrap());
        let qkv = &l.tensors[2];
        assert_eq!(qkv.name, "blocks.0.qkv_w[piece 1]");
        assert_eq!((qkv.rows, qkv.cols), (8, 6));
        assert_eq!(qkv.map[..3], [18..20, 26..28, 34..36]);
        let values: Vec<f32> = (0..600).map(|i| i as f32).collect();
        let local = gather_map(&values, &l.index_map());
        let mut back = vec![-1f32; 600];
        scatter_map(&local, &l.index_map(), &mut back);
        for rg in l.index_map() {
            assert!(rg.clone().all(|i| back[i] == i as f32));
        }
    }

    #[test]
    fn bad_splits_are_refused() {
        let s = spec();
        assert!(TpSplit::new(&s, 3, 1, 0).is_err()); // 3 ∤ 4 heads
        assert!(TpSplit::new(&s, 4, 3, 0).is_err()); // 3 ∤ 4 pieces
        let e = TpSplit::new(&s, 8, 1, 0).unwrap_err().to_string();
        assert!(e.contains("heads = 4") && e.contains("d_ff = 12"), "{e}");
        assert_eq!(TpSplit::new(&s, 4, 2, 1).unwrap().local(), 2..4);
    }
}
