//! Pipeline stages: the contiguous cut of a model's layers that balances their measured cost,
//! and each stage's data-parallel group and parameter count.

use super::{Layer, Layout, Workload};

/// Contiguous cut of `shares` into `parts` stages minimising the largest stage sum (exact dynamic
/// programme; ties go to the earliest cut). Returns `[start, end)` per stage.
pub fn balanced_stages(shares: &[f64], parts: usize) -> Vec<(usize, usize)> {
    let n = shares.len();
    assert!(parts >= 1 && parts <= n, "{parts} stages of {n} layers");
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(shares.iter().scan(0.0, |s, &x| {
            *s += x;
            Some(*s)
        }))
        .collect();
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[k][i]: smallest max-stage over the first i layers in k stages; cut[k][i]: last start.
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut cut = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for k in 1..=parts {
        for i in k..=n {
            for j in (k - 1)..i {
                let v = best[k - 1][j].max(sum(j, i));
                if v < best[k][i] - 1e-15 {
                    best[k][i] = v;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut stages = Vec::with_capacity(parts);
    let mut end = n;
    for k in (1..=parts).rev() {
        let start = cut[k][end];
        stages.push((start, end));
        end = start;
    }
    stages.reverse();
    stages
}

/// Equal compute shares for `n` layers (one layer when `n` is 0).
pub(super) fn even(n: usize) -> Vec<f64> {
    vec![1.0 / n.max(1) as f64; n.max(1)]
}

/// The parameters one rank of a stage of `layers` holds: the whole stage, or under tensor
/// parallelism the replicated parameters plus its share of the split ones.
pub(super) fn rank_params(layers: &[Layer], tp: usize) -> usize {
    layers.iter().map(|l| l.params_per_tp_rank(tp)).sum()
}

/// The gradient buckets of one rank of a stage of `layers`: the exact sum's buckets never
/// straddle a layer, so each layer's values are cut on their own.
fn rank_buckets(layers: &[Layer], tp: usize, bucket_elems: usize) -> usize {
    layers
        .iter()
        .map(|l| l.params_per_tp_rank(tp).div_ceil(bucket_elems.max(1)))
        .sum()
}

/// The largest rank's parameters and gradient buckets, and the data-parallel group (global
/// ranks) of every (stage, tp rank).
pub(super) fn stage_groups(
    w: &Workload,
    layout: Layout,
    shares: &[f64],
) -> (StageSize, Vec<Vec<usize>>) {
    let (pp, tp) = (layout.pp, layout.tp);
    let groups = (0..pp * tp)
        .map(|st| (0..layout.dp).map(|r| r * pp * tp + st).collect())
        .collect();
    let stages = if pp == 1 {
        vec![(0, w.layers.len())]
    } else {
        balanced_stages(shares, pp)
    };
    let largest = stages
        .iter()
        .map(|&(a, b)| StageSize {
            params: rank_params(&w.layers[a..b], tp),
            buckets: rank_buckets(&w.layers[a..b], tp, w.bucket_elems),
        })
        .max_by_key(|s| s.params)
        .unwrap_or(StageSize {
            params: w.params,
            buckets: w.params.div_ceil(w.bucket_elems.max(1)),
        });
    (largest, groups)
}

/// What one rank of a stage sums over its data-parallel group each step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StageSize {
    pub(crate) params: usize,
    /// Its gradient buckets (one shared exponent each in the exact sum).
    pub(crate) buckets: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_are_balanced_by_measured_layer_cost() {
        assert_eq!(
            balanced_stages(&[1.0, 1.0, 1.0, 1.0, 4.0], 2),
            vec![(0, 4), (4, 5)]
        );
        assert_eq!(
            balanced_stages(&[3.0, 1.0, 1.0, 1.0], 2),
            vec![(0, 1), (1, 4)]
        );
        assert_eq!(
            balanced_stages(&[1.0, 2.0, 3.0], 3),
            vec![(0, 1), (1, 2), (2, 3)]
        );
    }
}
