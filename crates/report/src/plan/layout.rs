//! Layouts: `dp` data-parallel replicas of a `pp`-stage pipeline whose stages are split over
//! `tp` tensor-parallel ranks, how they are written (`--layouts 1,4x1,2x2,tp2,dp2xtp2`) and which
//! are worth comparing on a cluster.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::{Cluster, PlanError, Workload};

/// `dp` data-parallel replicas of a `pp`-stage pipeline, each stage on `tp` tensor-parallel
/// ranks; rank = (replica · pp + stage) · tp + tp rank (`parallel_dims.rs`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Layout {
    pub dp: usize,
    #[serde(default = "one")]
    pub tp: usize,
    pub pp: usize,
}

fn one() -> usize {
    1
}

impl Layout {
    /// `dp` replicas of a `pp`-stage pipeline without tensor parallelism.
    pub fn dp_pp(dp: usize, pp: usize) -> Layout {
        Layout { dp, tp: 1, pp }
    }

    pub fn world(&self) -> usize {
        self.dp * self.tp * self.pp
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp={}", self.dp)?;
        if self.tp > 1 {
            write!(f, "×tp={}", self.tp)?;
        }
        if self.pp > 1 {
            write!(f, "×pp={}", self.pp)?;
        }
        Ok(())
    }
}

impl FromStr for Layout {
    type Err = PlanError;
    /// `DPxPP` (e.g. `2x2`), `DP` alone (pipeline of one stage), or named factors in the order
    /// dp, tp, pp as `lockstep scale` writes them (`tp2`, `dp2xtp2`, `tp2xpp2`, `dp2xpp2`).
    fn from_str(s: &str) -> Result<Self, PlanError> {
        let bad = |m: &str| PlanError::Layout {
            layout: s.to_string(),
            message: m.to_string(),
        };
        let t = s.trim();
        if t.starts_with(|c: char| c.is_ascii_alphabetic()) {
            let [dp, tp, pp] = crate::scaling::layout_factors(t).map_err(|m| bad(&m))?;
            return Ok(Layout { dp, tp, pp });
        }
        let (dp, pp) = match t.split_once(['x', 'X', '×']) {
            Some((a, b)) => (a, b),
            None => (t, "1"),
        };
        let num = |v: &str| v.trim().parse::<usize>().ok().filter(|&n| n >= 1);
        match (num(dp), num(pp)) {
            (Some(dp), Some(pp)) => Ok(Layout::dp_pp(dp, pp)),
            _ => Err(bad(
                "expected DPxPP with whole numbers ≥ 1 (e.g. 4x1, 2x2), DP alone (e.g. 4) or \
                 named factors (e.g. tp2, dp2xtp2, tp2xpp2)",
            )),
        }
    }
}

/// Parse a comma-separated layout list, e.g. `1,2,4x1,2x2`.
pub fn parse_layouts(spec: &str) -> Result<Vec<Layout>, PlanError> {
    let v: Vec<Layout> = spec
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    if v.is_empty() {
        return Err(PlanError::Layout {
            layout: spec.to_string(),
            message: "no layout given (e.g. --layouts 2,4,2x2)".into(),
        });
    }
    Ok(v)
}

/// Layouts worth comparing on `cluster`: world sizes 1, powers of two and whole nodes, each split
/// into every pipeline depth the model allows and, for a model of `tp_pieces` > 1, every
/// tensor-parallel width that divides the pieces (within one node: its ranks talk most).
pub fn candidate_layouts(cluster: &Cluster, workload: &Workload) -> Vec<Layout> {
    let cap = cluster.capacity();
    let mut worlds: Vec<usize> = std::iter::successors(Some(1usize), |w| Some(w * 2))
        .take_while(|&w| w <= cap)
        .chain((1..=cluster.nodes).map(|k| k * cluster.workers_per_node))
        .collect();
    worlds.sort_unstable();
    worlds.dedup();
    let layers = workload.layers.len().max(1);
    let mut out = Vec::new();
    let tps = (1..=workload.tp_pieces.min(cluster.workers_per_node))
        .filter(|tp| workload.tp_pieces.is_multiple_of(*tp));
    for w in worlds {
        for tp in tps.clone().filter(|tp| w.is_multiple_of(*tp)) {
            let rest = w / tp;
            for pp in (1..=rest.min(layers)).filter(|pp| rest.is_multiple_of(*pp)) {
                out.push(Layout {
                    dp: rest / pp,
                    tp,
                    pp,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_support::{pipeline_workload, workload};
    use crate::plan::ClusterSpec;

    #[test]
    fn layouts_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_layouts("1, 4x1,2x2").unwrap(),
            vec![
                Layout::dp_pp(1, 1),
                Layout::dp_pp(4, 1),
                Layout::dp_pp(2, 2)
            ]
        );
        assert_eq!(
            parse_layouts("tp2,dp2xtp2,tp2xpp2").unwrap(),
            vec![
                Layout {
                    dp: 1,
                    tp: 2,
                    pp: 1
                },
                Layout {
                    dp: 2,
                    tp: 2,
                    pp: 1
                },
                Layout {
                    dp: 1,
                    tp: 2,
                    pp: 2
                }
            ]
        );
        let names: Vec<String> = parse_layouts("tp2,dp2xtp2xpp2")
            .unwrap()
            .iter()
            .map(Layout::to_string)
            .collect();
        assert_eq!(names, ["dp=1×tp=2", "dp=2×tp=2×pp=2"]);
        let e = parse_layouts("pp2xtp2").unwrap_err().to_string();
        assert!(
            e.contains("`pp2xtp2`") && e.contains("in that order"),
            "{e}"
        );
        let e = parse_layouts("2,0x2").unwrap_err().to_string();
        assert!(e.contains("`0x2`"), "{e}");
        assert!(parse_layouts("2y2").is_err());
        assert!(parse_layouts("").is_err());
    }

    #[test]
    fn candidates_cover_worlds_and_pipeline_depths() {
        let c = ClusterSpec {
            nodes: Some(3),
            workers_per_node: Some(2),
            link_gbps: Some(10.0),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        let flat: Vec<String> = candidate_layouts(&c, &workload(10))
            .iter()
            .map(|l| l.to_string())
            .collect();
        assert_eq!(flat, ["dp=1", "dp=2", "dp=4", "dp=6"]);
        let deep: Vec<String> = candidate_layouts(&c, &pipeline_workload(3, 8))
            .iter()
            .map(|l| l.to_string())
            .collect();
        assert_eq!(
            deep,
            [
                "dp=1",
                "dp=2",
                "dp=1×pp=2",
                "dp=4",
                "dp=2×pp=2",
                "dp=6",
                "dp=3×pp=2",
                "dp=2×pp=3"
            ]
        );
    }
}
