//! What the test jobs' end-to-end tests read back from a run directory.

use std::path::Path;

/// Per step, the value `pick` finds in metrics.jsonl's records of every rank (and restarted
/// attempt), sorted with duplicates merged: one entry per step means every rank recorded the
/// same bits.
pub fn per_step(dir: &Path, pick: impl Fn(&serde_json::Value) -> Option<f64>) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let mut v: Vec<(u64, f64)> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|r| Some((r["step"].as_u64()?, pick(&r)?)))
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v.dedup();
    v
}

/// The job's training metric `name` per step ([`per_step`]).
pub fn train_metric(dir: &Path, name: &str) -> Vec<(u64, f64)> {
    per_step(dir, |r| r["train_metrics"][name].as_f64())
}
