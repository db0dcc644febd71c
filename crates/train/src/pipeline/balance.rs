//! Cutting a layer sequence into pipeline stages.
//!
//! A pipeline runs at the pace of its slowest stage, so the cuts minimise the largest stage cost
//! (the classic linear-partition problem; dynamic programming over prefix sums, O(p·L²) for L
//! layers, trivial at transformer depths). Costs are measured per layer
//! (`Layered::profile_layers`) or the cuts come from the config.

use std::ops::Range;

/// The first layer of stages 1..p (p − 1 increasing indices in 1..L) that minimise the largest
/// stage's summed cost. Ties go to the earliest cuts, so equal inputs give equal cuts.
pub fn balance(costs: &[f64], stages: usize) -> Vec<usize> {
    let layers = costs.len();
    assert!(
        stages >= 1 && stages <= layers,
        "{stages} stages for {layers} layers"
    );
    let mut prefix = vec![0.0; layers + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c.max(0.0);
    }
    let cost = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[k][j]: minimal largest cost of cutting layers 0..j into k stages; from[k][j]: where
    // the last of those stages starts.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; layers + 1]; stages + 1];
    let mut from = vec![vec![0usize; layers + 1]; stages + 1];
    best[0][0] = 0.0;
    for k in 1..=stages {
        for j in k..=layers {
            for i in (k - 1)..j {
                let v = best[k - 1][i].max(cost(i, j));
                if v < best[k][j] {
                    best[k][j] = v;
                    from[k][j] = i;
                }
            }
        }
    }
    let mut cuts = Vec::with_capacity(stages - 1);
    let mut j = layers;
    for k in (2..=stages).rev() {
        j = from[k][j];
        cuts.push(j);
    }
    cuts.reverse();
    cuts
}

/// Layer ranges of the stages given the cuts.
pub fn stage_ranges(cuts: &[usize], layers: usize) -> Vec<Range<usize>> {
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(layers);
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_layers_split_evenly_and_a_heavy_layer_stands_alone() {
        assert_eq!(balance(&[1.0; 6], 2), vec![3]);
        assert_eq!(balance(&[1.0; 6], 3), vec![2, 4]);
        assert_eq!(balance(&[1.0; 4], 4), vec![1, 2, 3]);
        assert_eq!(balance(&[1.0; 5], 1), Vec::<usize>::new());
        // Cheap embedding, four blocks, heavy head: the head shares with only one block
        // (3.1 | 4.0 beats 4.1 | 3.0).
        assert_eq!(balance(&[0.1, 1.0, 1.0, 1.0, 1.0, 3.0], 2), vec![4]);
        assert_eq!(balance(&[0.1, 1.0, 1.0, 1.0, 1.0, 5.0], 2), vec![5]);
        let cuts = balance(&[0.2, 1.0, 1.0, 1.0, 1.0, 1.2], 3);
        let ranges = stage_ranges(&cuts, 6);
        let loads: Vec<f64> = ranges
            .iter()
            .map(|r| [0.2, 1.0, 1.0, 1.0, 1.0, 1.2][r.clone()].iter().sum())
            .collect();
        assert!(
            loads.iter().cloned().fold(0.0, f64::max) <= 2.2 + 1e-12,
            "{loads:?}"
        );
    }

    #[test]
    fn the_result_is_optimal_on_random_costs() {
        // Brute force over all cut sets for small cases.
        let mut seed = 12345u64;
        for _ in 0..200 {
            let layers = 2 + (seed % 6) as usize;
            let costs: Vec<f64> = (0..layers)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 33) % 100) as f64 + 1.0
                })
                .collect();
            let stages = 1 + (seed % layers as u64) as usize;
            let max_of = |cuts: &[usize]| {
                stage_ranges(cuts, layers)
                    .iter()
                    .map(|r| costs[r.clone()].iter().sum::<f64>())
                    .fold(0.0, f64::max)
            };
            let got = max_of(&balance(&costs, stages));
            let mut best = f64::INFINITY;
            for mask in 0u32..(1 << (layers - 1)) {
                if mask.count_ones() as usize != stages - 1 {
                    continue;
                }
                let cuts: Vec<usize> = (1..layers).filter(|c| mask & (1 << (c - 1)) != 0).collect();
                best = best.min(max_of(&cuts));
            }
            assert_eq!(got, best, "costs {costs:?} stages {stages}");
        }
    }
}
