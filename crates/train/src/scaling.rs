//! "Did scaling help?": compare runs of the same config at different world sizes.
//!
//! Step time is the **median over steady-state steps of the slowest rank's step time** (a
//! synchronous step finishes when its slowest rank does); the first steps (allocator and cache
//! warm-up) are skipped. Speedup and efficiency are relative to the first run given (normally 1
//! worker): speedup = t₀ / tₙ, efficiency = speedup · n₀ / n.

use serde::{Deserialize, Serialize};

use crate::metrics::{StepRecord, Summary};

/// One world size's figures.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ScalePoint {
    pub world_size: usize,
    pub median_step_seconds: f64,
    pub samples_per_sec: f64,
    pub speedup: f64,
    pub efficiency: f64,
    /// Median per-step seconds of the slowest rank, by phase.
    pub forward: f64,
    pub backward: f64,
    pub communication: f64,
    pub waiting: f64,
    pub optimizer: f64,
    pub data: f64,
    /// (communication + waiting) / step time.
    pub communication_fraction: f64,
    pub final_loss: f64,
    pub test_accuracy: f64,
    pub param_hash: String,
    pub same_result_as_first: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ScaleReport {
    pub points: Vec<ScalePoint>,
    /// Every run ended with the first run's parameter hash.
    pub hashes_agree: bool,
    /// One plain-language line per world size.
    pub verdict: Vec<String>,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Steps skipped as warm-up: 10% of the run, at most 5.
pub fn warmup_steps(total: u64) -> u64 {
    (total / 10).min(5)
}

/// Per steady-state step, the record of the rank whose step took longest.
fn slowest_per_step(records: &[StepRecord]) -> Vec<&StepRecord> {
    let total = records.iter().map(|r| r.step + 1).max().unwrap_or(0);
    let skip = warmup_steps(total);
    let mut by_step: std::collections::BTreeMap<u64, &StepRecord> = Default::default();
    for r in records.iter().filter(|r| r.step >= skip) {
        let e = by_step.entry(r.step).or_insert(r);
        if r.step_seconds > e.step_seconds {
            *e = r;
        }
    }
    by_step.into_values().collect()
}

/// Build the comparison from `(summary, records)` of each run, first run = baseline.
pub fn compare(runs: &[(Summary, Vec<StepRecord>)]) -> ScaleReport {
    let mut points: Vec<ScalePoint> = Vec::new();
    for (summary, records) in runs {
        let slow = slowest_per_step(records);
        let m = |f: &dyn Fn(&StepRecord) -> f64| median(slow.iter().map(|r| f(r)).collect());
        let step = m(&|r| r.step_seconds);
        let comm = m(&|r| r.seconds.communication);
        let wait = m(&|r| r.seconds.waiting);
        points.push(ScalePoint {
            world_size: summary.world_size,
            median_step_seconds: step,
            samples_per_sec: summary.global_batch as f64 / step,
            speedup: 1.0,
            efficiency: 1.0,
            forward: m(&|r| r.seconds.forward),
            backward: m(&|r| r.seconds.backward),
            communication: comm,
            waiting: wait,
            optimizer: m(&|r| r.seconds.optimizer),
            data: m(&|r| r.seconds.data),
            communication_fraction: if step > 0.0 {
                (comm + wait) / step
            } else {
                0.0
            },
            final_loss: summary.final_loss,
            test_accuracy: summary.test_accuracy,
            param_hash: summary.param_hash.clone(),
            same_result_as_first: true,
        });
    }
    if let Some(first) = points.first().cloned() {
        for p in &mut points {
            p.speedup = first.median_step_seconds / p.median_step_seconds;
            p.efficiency = p.speedup * first.world_size as f64 / p.world_size as f64;
            p.same_result_as_first = p.param_hash == first.param_hash;
        }
    }
    let verdict = points
        .iter()
        .skip(1)
        .map(|p| {
            format!(
                "{} workers: {:.2}× {} than {}, {:.0}% efficient, communication {:.0}% of step, {}",
                p.world_size,
                if p.speedup >= 1.0 {
                    p.speedup
                } else {
                    1.0 / p.speedup
                },
                if p.speedup >= 1.0 { "faster" } else { "slower" },
                points[0].world_size,
                p.efficiency * 100.0,
                p.communication_fraction * 100.0,
                if p.same_result_as_first {
                    "same result (identical parameter hash)".to_string()
                } else {
                    "DIFFERENT result (parameter hash differs)".to_string()
                }
            )
        })
        .collect();
    let hashes_agree = points.iter().all(|p| p.same_result_as_first);
    ScaleReport {
        points,
        hashes_agree,
        verdict,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::PhaseSeconds;

    fn rec(rank: usize, step: u64, secs: f64, comm: f64) -> StepRecord {
        StepRecord {
            rank,
            step,
            loss: 1.0,
            lr: 0.1,
            samples: 1,
            samples_per_sec: 1.0,
            step_seconds: secs,
            seconds: PhaseSeconds {
                communication: comm,
                forward: secs - comm,
                ..Default::default()
            },
            bytes_sent: 0,
            eval: None,
            pipeline: None,
        }
    }

    fn summary(world: usize, hash: &str) -> Summary {
        Summary {
            world_size: world,
            steps: 20,
            global_batch: 100,
            microbatch: 10,
            reproducible: true,
            transport: "shm".into(),
            final_loss: 0.5,
            test_loss: 0.5,
            test_accuracy: 0.9,
            param_hash: hash.into(),
            config_hash: "c".into(),
            wall_seconds: 1.0,
            samples_per_sec: 1.0,
            imbalance: 1.0,
            straggler: None,
            bytes_sent_total: 0,
            communication_fraction: 0.0,
            evals: vec![],
            ranks: vec![],
            pipeline: None,
        }
    }

    #[test]
    fn speedup_uses_the_slowest_rank_and_skips_warmup() {
        // 1 worker: 1.0 s steps (a slow warm-up step 0 is ignored).
        let one: Vec<StepRecord> = (0..20)
            .map(|s| rec(0, s, if s == 0 { 9.0 } else { 1.0 }, 0.0))
            .collect();
        // 2 workers: rank 1 is slower (0.6 s) than rank 0 (0.5 s); the step takes 0.6 s.
        let two: Vec<StepRecord> = (0..20)
            .flat_map(|s| {
                [
                    rec(0, s, 0.5, 0.1),
                    rec(1, s, if s == 0 { 9.0 } else { 0.6 }, 0.15),
                ]
            })
            .collect();
        let r = compare(&[(summary(1, "h"), one), (summary(2, "h"), two)]);
        let p = &r.points[1];
        assert!((p.median_step_seconds - 0.6).abs() < 1e-12);
        assert!((p.speedup - 1.0 / 0.6).abs() < 1e-9);
        assert!((p.efficiency - 1.0 / 1.2).abs() < 1e-9);
        assert!((p.communication_fraction - 0.25).abs() < 1e-9);
        assert!(r.hashes_agree);
        assert!(r.verdict[0].starts_with("2 workers: 1.67× faster than 1, 83% efficient, communication 25% of step, same result"), "{}", r.verdict[0]);
    }

    #[test]
    fn a_different_hash_is_called_out() {
        let recs = |w: usize| (0..10).map(|s| rec(w - 1, s, 1.0, 0.0)).collect::<Vec<_>>();
        let r = compare(&[(summary(1, "a"), recs(1)), (summary(2, "b"), recs(2))]);
        assert!(!r.hashes_agree);
        assert!(r.verdict[0].contains("DIFFERENT result"));
    }
}
