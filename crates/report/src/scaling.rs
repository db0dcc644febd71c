//! "Did scaling help?": compare runs of the same config at different world sizes and layouts.
//!
//! Layouts (`--layouts` of `lockstep scale`): `dp` is pure data parallelism at each world size,
//! `pp` one pipeline with as many stages as workers, `tp` one tensor-parallel group as wide as the
//! world; a product of factors in the order dp, tp, pp (`dpAxppB`, `tpB`, `dpAxtpB`, `tpAxppB`,
//! `dpAxtpBxppC`) is exactly that layout (one run of their product of workers, missing factors
//! 1). [`parse_layouts`] reads the list, [`expand`] turns it and the world sizes into the runs to
//! make, in order, without duplicates.
//!
//! Step time is the **median over steady-state steps of the slowest rank's step time** (a
//! synchronous step finishes when its slowest rank does); the first steps (allocator and cache
//! warm-up) are skipped. Speedup and efficiency are relative to the first run (normally 1
//! worker): speedup = t₀ / tₙ, efficiency = speedup · n₀ / n.

use lockstep_run::metrics::median;
use serde::{Deserialize, Serialize};

use lockstep_run::config::{ConfigError, TrainConfig};
use lockstep_run::metrics::{RankMemory, StepRecord, Summary};
use lockstep_run::parallel_dims::ParallelDims;

/// One entry of a layout list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutSpec {
    /// Pure data parallelism at each world size.
    Dp,
    /// One pipeline with as many stages as workers, at each world size.
    Pp,
    /// One tensor-parallel group of all workers, at each world size.
    Tp,
    /// `dp` replicas of a `pp`-stage pipeline whose stages are split over `tp` ranks: one run of
    /// `dp · tp · pp` workers.
    Fixed { dp: usize, tp: usize, pp: usize },
}

/// A layout to run: its name (also its run directory) and its factors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// `dp-N`, `pp-N`, `tp-N`, `dpAxppB` or the factors written with tp (`dpAxtpB`, …).
    pub name: String,
    pub dp: usize,
    #[serde(default = "one")]
    pub tp: usize,
    pub pp: usize,
}

fn one() -> usize {
    1
}

impl Layout {
    pub fn world(&self) -> usize {
        self.dp * self.tp * self.pp
    }

    /// The config overrides that select this layout (applied after the user's `--set`s).
    pub fn overrides(&self) -> Vec<String> {
        vec![
            format!("parallel.dp={}", self.dp),
            format!("parallel.tp={}", self.tp),
            format!("parallel.pp={}", self.pp),
        ]
    }

    /// Check the layout against `cfg` (loaded with [`Layout::overrides`]) as `lockstep train`
    /// will: the factors multiply to the world size and every replica gets a micro-batch. A
    /// pipeline of a model without layers was already refused by the config's own validation.
    pub fn check(&self, cfg: &TrainConfig) -> Result<ParallelDims, ConfigError> {
        ParallelDims::from_config(cfg, self.world())
    }

    /// "2 workers" / "4 workers: 2 replicas × 2 stages".
    pub fn describe(&self) -> String {
        let workers = if self.world() == 1 {
            "1 worker".to_string()
        } else {
            format!("{} workers", self.world())
        };
        match (self.tp, self.pp) {
            (1, 1) => workers,
            (1, pp) => format!("{workers}: {} replica(s) × {pp} stages", self.dp),
            (tp, 1) => format!(
                "{workers}: {} replica(s) × {tp} tensor-parallel ranks",
                self.dp
            ),
            (tp, pp) => format!(
                "{workers}: {} replica(s) × {pp} stages × {tp} tensor-parallel ranks",
                self.dp
            ),
        }
    }
}

/// A fixed layout's name: `dpAxppB` without tensor parallelism (as before tp existed),
/// otherwise its factors other than 1 in the order dp, tp, pp (`tp2`, `dp2xtp2`, `tp2xpp2`).
fn fixed_name(dp: usize, tp: usize, pp: usize) -> String {
    if tp == 1 {
        return format!("dp{dp}xpp{pp}");
    }
    [("dp", dp), ("tp", tp), ("pp", pp)]
        .iter()
        .filter(|&&(axis, n)| n > 1 || axis == "tp")
        .map(|(axis, n)| format!("{axis}{n}"))
        .collect::<Vec<_>>()
        .join("x")
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error(
        "layout `{spec}`: {reason} (a layout is dp, pp, tp or factors dpA, tpB, ppC joined by x \
         in that order, such as dp2xpp2, tp2, dp2xtp2)"
    )]
    Syntax { spec: String, reason: String },
    #[error(
        "no layouts given (a comma-separated list of dp, pp, tp or factors such as dp2xpp2, tp2, \
         dp2xtp2)"
    )]
    Empty,
}

/// Parse `"dp,pp,dp2xpp2"`.
pub fn parse_layouts(spec: &str) -> Result<Vec<LayoutSpec>, LayoutError> {
    let mut out = Vec::new();
    for part in spec.split(',') {
        let p = part.trim();
        let bad = |reason: &str| LayoutError::Syntax {
            spec: p.to_string(),
            reason: reason.to_string(),
        };
        let l = match p {
            "" if spec.trim().is_empty() => return Err(LayoutError::Empty),
            "" => return Err(bad("empty entry")),
            "dp" => LayoutSpec::Dp,
            "pp" => LayoutSpec::Pp,
            "tp" => LayoutSpec::Tp,
            _ => {
                let [dp, tp, pp] = layout_factors(p).map_err(|reason| bad(&reason))?;
                LayoutSpec::Fixed { dp, tp, pp }
            }
        };
        out.push(l);
    }
    Ok(out)
}

/// `dpAxtpBxppC` with any factor left out (1), but at least a tp or pp one: a fixed layout's
/// `[dp, tp, pp]` (also `lockstep plan --layouts`'s named form).
pub(crate) fn layout_factors(p: &str) -> Result<[usize; 3], String> {
    const AXES: [(&str, &str); 3] = [
        ("dp", "replica count"),
        ("tp", "tensor-parallel width"),
        ("pp", "stage count"),
    ];
    let mut f = [None; 3];
    let mut next = 0;
    for part in p.split('x') {
        let i = AXES
            .iter()
            .position(|(axis, _)| part.starts_with(axis))
            .filter(|&i| i >= next)
            .ok_or("not dp, pp, tp or factors dpA, tpB, ppC in that order")?;
        let n = &part[2..];
        let v = n
            .parse::<usize>()
            .ok()
            .filter(|&v| v >= 1)
            .ok_or_else(|| format!("{} `{n}` is not a whole number ≥ 1", AXES[i].1))?;
        f[i] = Some(v);
        next = i + 1;
    }
    if f[1].is_none() && f[2].is_none() {
        return Err("a fixed layout names tpB or ppC (e.g. dp4xpp1); dp alone is the sweep".into());
    }
    Ok(f.map(|v| v.unwrap_or(1)))
}

/// The runs of a sweep, in order: each layout at each world size (a fixed layout once), skipping
/// any `(dp, tp, pp)` already listed (e.g. `pp` at 1 worker is `dp` at 1 worker).
pub fn expand(specs: &[LayoutSpec], sizes: &[usize]) -> Vec<Layout> {
    let mut out: Vec<Layout> = Vec::new();
    let mut push = |name: String, dp: usize, tp: usize, pp: usize| {
        if !out.iter().any(|l| (l.dp, l.tp, l.pp) == (dp, tp, pp)) {
            out.push(Layout { name, dp, tp, pp });
        }
    };
    for s in specs {
        match *s {
            LayoutSpec::Dp => sizes.iter().for_each(|&n| push(format!("dp-{n}"), n, 1, 1)),
            LayoutSpec::Pp => sizes.iter().for_each(|&n| push(format!("pp-{n}"), 1, 1, n)),
            LayoutSpec::Tp => sizes.iter().for_each(|&n| push(format!("tp-{n}"), 1, n, 1)),
            LayoutSpec::Fixed { dp, tp, pp } => push(fixed_name(dp, tp, pp), dp, tp, pp),
        }
    }
    out
}

/// One run's figures.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ScalePoint {
    /// The layout's name (also its run directory).
    #[serde(default)]
    pub label: String,
    pub world_size: usize,
    #[serde(default)]
    pub dp: usize,
    #[serde(default = "one")]
    pub tp: usize,
    #[serde(default)]
    pub pp: usize,
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
    /// Pipeline bubble (idle time inside the schedule; 0 without a pipeline).
    #[serde(default)]
    pub bubble: f64,
    /// (communication + waiting) / step time.
    pub communication_fraction: f64,
    pub final_loss: f64,
    #[serde(default)]
    pub test_loss: f64,
    /// The job's `accuracy` metric; NaN (`null`) for a job that reports none.
    #[serde(default, with = "lockstep_run::metrics::nan_as_null")]
    pub test_accuracy: f64,
    /// Wall seconds of the whole run (summary.json).
    #[serde(default)]
    pub wall_seconds: f64,
    pub param_hash: String,
    pub same_result_as_first: bool,
    /// Each rank's memory (summary.json's `ranks[i].memory`), in rank order; empty for runs
    /// recorded without it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory: Vec<RankMemory>,
    /// The distinct devices its ranks computed on (summary.json's `ranks[i].device`, in rank
    /// order of first appearance); empty for runs recorded without them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
}

impl ScalePoint {
    /// Forward + backward + optimizer.
    pub fn compute(&self) -> f64 {
        self.forward + self.backward + self.optimizer
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ScaleReport {
    pub points: Vec<ScalePoint>,
    /// Every run ended with the first run's parameter hash.
    pub hashes_agree: bool,
    /// One plain-language line per run (the first: the baseline).
    pub verdict: Vec<String>,
    /// One sentence: the fastest run against the baseline, and whether the results agree.
    #[serde(default)]
    pub headline: String,
}

/// One finished run of a sweep.
#[derive(Debug, Clone)]
pub struct Run {
    pub layout: Layout,
    pub summary: Summary,
    pub records: Vec<StepRecord>,
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

fn percent(f: f64) -> String {
    format!("{:.0}%", f * 100.0)
}

fn distinct_devices(summary: &lockstep_run::Summary) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in &summary.ranks {
        if !r.device.is_empty() && !out.contains(&r.device) {
            out.push(r.device.clone());
        }
    }
    out
}

/// Build the comparison, the first run being the baseline.
pub fn compare(runs: &[Run]) -> ScaleReport {
    let mut points: Vec<ScalePoint> = Vec::new();
    for run in runs {
        let (summary, records) = (&run.summary, &run.records);
        let slow = slowest_per_step(records);
        let m = |f: &dyn Fn(&StepRecord) -> f64| median(slow.iter().map(|r| f(r)).collect());
        let step = m(&|r| r.step_seconds);
        let comm = m(&|r| r.seconds.communication);
        let wait = m(&|r| r.seconds.waiting);
        points.push(ScalePoint {
            label: run.layout.name.clone(),
            world_size: summary.world_size,
            dp: run.layout.dp,
            tp: run.layout.tp,
            pp: run.layout.pp,
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
            bubble: m(&|r| r.pipeline.map_or(0.0, |p| p.bubble_seconds)),
            communication_fraction: if step > 0.0 {
                (comm + wait) / step
            } else {
                0.0
            },
            final_loss: summary.final_loss,
            test_loss: summary.test_loss,
            test_accuracy: summary.test_accuracy,
            wall_seconds: summary.wall_seconds,
            param_hash: summary.param_hash.clone(),
            same_result_as_first: true,
            memory: summary.ranks.iter().filter_map(|r| r.memory).collect(),
            devices: distinct_devices(summary),
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
        .zip(runs)
        .enumerate()
        .map(|(i, (p, run))| verdict_line(i, p, &points[0], &run.layout))
        .collect();
    let hashes_agree = points.iter().all(|p| p.same_result_as_first);
    let headline = headline(&points, hashes_agree);
    ScaleReport {
        points,
        hashes_agree,
        verdict,
        headline,
    }
}

fn verdict_line(i: usize, p: &ScalePoint, base: &ScalePoint, layout: &Layout) -> String {
    let who = format!("{} ({})", p.label, layout.describe());
    let bubble = if p.pp > 1 && p.median_step_seconds > 0.0 {
        format!(
            ", pipeline bubble {} of step",
            percent(p.bubble / p.median_step_seconds)
        )
    } else {
        String::new()
    };
    if i == 0 {
        return format!(
            "{who}: baseline, {:.2} ms per step, {:.0} samples/s, communication {} of step{bubble}",
            p.median_step_seconds * 1e3,
            p.samples_per_sec,
            percent(p.communication_fraction)
        );
    }
    let (factor, word) = if p.speedup >= 1.0 {
        (p.speedup, "faster")
    } else {
        (1.0 / p.speedup, "slower")
    };
    format!(
        "{who}: {factor:.2}× {word} than {}, {} efficient, communication {} of step{bubble}, {}",
        base.label,
        percent(p.efficiency),
        percent(p.communication_fraction),
        if p.same_result_as_first {
            "same result (identical parameter hash)"
        } else {
            "DIFFERENT result (parameter hash differs)"
        }
    )
}

fn headline(points: &[ScalePoint], hashes_agree: bool) -> String {
    let Some(base) = points.first() else {
        return "No runs.".into();
    };
    let result = if hashes_agree {
        "every run ended with the same parameter hash".to_string()
    } else {
        let differ: Vec<&str> = points
            .iter()
            .filter(|p| !p.same_result_as_first)
            .map(|p| p.label.as_str())
            .collect();
        format!(
            "the parameter hashes DIFFER ({} ≠ {})",
            differ.join(", "),
            base.label
        )
    };
    let best = points
        .iter()
        .skip(1)
        .max_by(|a, b| a.speedup.total_cmp(&b.speedup));
    match best {
        None => format!("Only the baseline {} ran; {result}.", base.label),
        Some(b) if b.speedup > 1.0 => format!(
            "Scaling helped: {} is {:.2}× as fast as {} ({} efficient); {result}.",
            b.label,
            b.speedup,
            base.label,
            percent(b.efficiency)
        ),
        Some(b) => format!(
            "Scaling did not help: no run beat {} (best: {} at {:.2}×); {result}.",
            base.label, b.label, b.speedup
        ),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use lockstep_run::metrics::{PhaseSeconds, PipelineStep, RankSummary};

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
            rss_bytes: None,
            grad_norm: None,
            train_metrics: Default::default(),
        }
    }

    /// A neutral rank for tests.
    pub(crate) fn rank_summary(rank: usize) -> RankSummary {
        RankSummary {
            rank,
            host: "h".into(),
            device: String::new(),
            samples: 0,
            compute_seconds: 0.0,
            communication_seconds: 0.0,
            waiting_seconds: 0.0,
            data_seconds: 0.0,
            optimizer_seconds: 0.0,
            overlapped_communication_seconds: 0.0,
            device_copy_seconds: 0.0,
            checkpoint_seconds: 0.0,
            bytes_sent: 0,
            step_seconds_mean: 0.0,
            step_seconds_max: 0.0,
            pipeline: None,
            memory: None,
        }
    }

    /// A neutral summary for tests (also the base of other modules' fixtures, which override the
    /// fields they check).
    pub(crate) fn summary(world: usize, hash: &str) -> Summary {
        Summary {
            job: String::new(),
            world_size: world,
            steps: 20,
            global_batch: 100,
            microbatch: 10,
            reproducible: true,
            transport: "shm".into(),
            final_loss: 0.5,
            test_loss: 0.25,
            test_accuracy: 0.9,
            test_metrics: Default::default(),
            param_hash: hash.into(),
            config_hash: "c".into(),
            wall_seconds: 1.5,
            samples_per_sec: 1.0,
            imbalance: 1.0,
            straggler: None,
            bytes_sent_total: 0,
            communication_fraction: 0.0,
            evals: vec![],
            ranks: vec![],
            pipeline: None,
            compute: Default::default(),
            gradient_sum: None,
            param_gathering: None,
            layers_prefetched: None,
            plan: None,
            checkpoints: None,
        }
    }

    fn run(name: &str, dp: usize, pp: usize, hash: &str, records: Vec<StepRecord>) -> Run {
        Run {
            layout: Layout {
                name: name.into(),
                dp,
                tp: 1,
                pp,
            },
            summary: summary(dp * pp, hash),
            records,
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
        let r = compare(&[run("dp-1", 1, 1, "h", one), run("dp-2", 2, 1, "h", two)]);
        let p = &r.points[1];
        assert!((p.median_step_seconds - 0.6).abs() < 1e-12);
        assert!((p.speedup - 1.0 / 0.6).abs() < 1e-9);
        assert!((p.efficiency - 1.0 / 1.2).abs() < 1e-9);
        assert!((p.communication_fraction - 0.25).abs() < 1e-9);
        assert_eq!((p.label.as_str(), p.dp, p.pp), ("dp-2", 2, 1));
        assert_eq!((p.test_loss, p.wall_seconds), (0.25, 1.5));
        assert!(r.hashes_agree);
        assert_eq!(r.verdict.len(), 2);
        assert_eq!(
            r.verdict[0],
            "dp-1 (1 worker): baseline, 1000.00 ms per step, 100 samples/s, communication 0% of step"
        );
        assert_eq!(r.verdict[1], "dp-2 (2 workers): 1.67× faster than dp-1, 83% efficient, communication 25% of step, same result (identical parameter hash)");
        assert_eq!(r.headline, "Scaling helped: dp-2 is 1.67× as fast as dp-1 (83% efficient); every run ended with the same parameter hash.");
    }

    #[test]
    fn a_different_hash_and_a_slowdown_are_called_out() {
        let recs = |w: usize, secs: f64| {
            (0..10)
                .map(|s| rec(w - 1, s, secs, 0.0))
                .collect::<Vec<_>>()
        };
        let r = compare(&[
            run("dp-1", 1, 1, "a", recs(1, 1.0)),
            run("dp-2", 2, 1, "b", recs(2, 2.0)),
        ]);
        assert!(!r.hashes_agree);
        assert!(!r.points[1].same_result_as_first);
        assert!(
            r.verdict[1].contains("2.00× slower than dp-1, 25% efficient"),
            "{}",
            r.verdict[1]
        );
        assert!(r.verdict[1].ends_with("DIFFERENT result (parameter hash differs)"));
        assert_eq!(r.headline, "Scaling did not help: no run beat dp-1 (best: dp-2 at 0.50×); the parameter hashes DIFFER (dp-2 ≠ dp-1).");
    }

    #[test]
    fn a_pipeline_reports_its_bubble() {
        let recs: Vec<StepRecord> = (0..10)
            .flat_map(|s| {
                (0..2).map(move |rank| {
                    let mut r = rec(rank, s, 1.0, 0.0);
                    r.pipeline = Some(PipelineStep {
                        stage: rank,
                        bubble_seconds: 0.25,
                        ..Default::default()
                    });
                    r
                })
            })
            .collect();
        let r = compare(&[run("pp-2", 1, 2, "h", recs)]);
        assert_eq!(r.points[0].bubble, 0.25);
        assert!(
            r.verdict[0].starts_with("pp-2 (2 workers: 1 replica(s) × 2 stages): baseline"),
            "{}",
            r.verdict[0]
        );
        assert!(
            r.verdict[0].ends_with("pipeline bubble 25% of step"),
            "{}",
            r.verdict[0]
        );
    }

    #[test]
    fn layouts_parse_and_expand_without_duplicates() {
        assert_eq!(
            parse_layouts("dp, pp,dp2xpp2").unwrap(),
            vec![
                LayoutSpec::Dp,
                LayoutSpec::Pp,
                LayoutSpec::Fixed {
                    dp: 2,
                    tp: 1,
                    pp: 2
                }
            ]
        );
        let runs = expand(&parse_layouts("dp,pp,dp2xpp2,dp4xpp1").unwrap(), &[1, 2, 4]);
        let got: Vec<(&str, usize, usize)> =
            runs.iter().map(|l| (l.name.as_str(), l.dp, l.pp)).collect();
        // pp-1 is dp-1, and dp4xpp1 is dp-4: each runs once, under its first name.
        assert_eq!(
            got,
            vec![
                ("dp-1", 1, 1),
                ("dp-2", 2, 1),
                ("dp-4", 4, 1),
                ("pp-2", 1, 2),
                ("pp-4", 1, 4),
                ("dp2xpp2", 2, 2),
            ]
        );
        assert_eq!(runs[5].world(), 4);
        assert_eq!(
            runs[3].overrides(),
            vec!["parallel.dp=1", "parallel.tp=1", "parallel.pp=2"]
        );
        assert_eq!(runs[5].describe(), "4 workers: 2 replica(s) × 2 stages");
    }

    #[test]
    fn tensor_parallel_layouts_parse_name_and_expand() {
        let specs = parse_layouts("tp,tp2,dp2xtp2,tp2xpp2,dp2xtp2xpp2,dp1xtp4").unwrap();
        assert_eq!(specs[0], LayoutSpec::Tp);
        assert_eq!(
            specs[2],
            LayoutSpec::Fixed {
                dp: 2,
                tp: 2,
                pp: 1
            }
        );
        let runs = expand(&specs, &[1, 2, 4]);
        let got: Vec<(&str, usize, usize, usize, usize)> = runs
            .iter()
            .map(|l| (l.name.as_str(), l.dp, l.tp, l.pp, l.world()))
            .collect();
        // tp-2 is tp2, tp-4 is dp1xtp4: each runs once, under its first name.
        assert_eq!(
            got,
            vec![
                ("tp-1", 1, 1, 1, 1),
                ("tp-2", 1, 2, 1, 2),
                ("tp-4", 1, 4, 1, 4),
                ("dp2xtp2", 2, 2, 1, 4),
                ("tp2xpp2", 1, 2, 2, 4),
                ("dp2xtp2xpp2", 2, 2, 2, 8),
            ]
        );
        assert_eq!(
            runs[4].overrides(),
            vec!["parallel.dp=1", "parallel.tp=2", "parallel.pp=2"]
        );
        assert_eq!(
            runs[3].describe(),
            "4 workers: 2 replica(s) × 2 tensor-parallel ranks"
        );
        assert_eq!(
            runs[4].describe(),
            "4 workers: 1 replica(s) × 2 stages × 2 tensor-parallel ranks"
        );
    }

    #[test]
    fn bad_layouts_are_refused_with_the_reason() {
        for (spec, needle) in [
            ("tq", "layout `tq`: not dp, pp, tp or factors"),
            (
                "pp2xtp2",
                "layout `pp2xtp2`: not dp, pp, tp or factors dpA, tpB, ppC in that order",
            ),
            ("dp2", "dp alone is the sweep"),
            ("tp0", "tensor-parallel width `0` is not a whole number ≥ 1"),
            ("dp2pp2", "layout `dp2pp2`: replica count `2pp2`"),
            ("dp0xpp2", "replica count `0` is not a whole number ≥ 1"),
            ("dp2xpp", "stage count `` is not a whole number ≥ 1"),
            ("dpxpp2", "replica count `` is not a whole number ≥ 1"),
            ("dp,,pp", "layout ``: empty entry"),
            ("dp2xpp-1", "stage count `-1`"),
        ] {
            let e = parse_layouts(spec).unwrap_err().to_string();
            assert!(e.contains(needle), "{spec}: {e}");
            assert!(e.contains("dp2xpp2"), "the error shows the syntax: {e}");
        }
        assert_eq!(parse_layouts(" ").unwrap_err(), LayoutError::Empty);
    }

    #[test]
    fn layouts_are_checked_against_the_config() {
        let pp = |stages| Layout {
            name: format!("pp-{stages}"),
            dp: 1,
            tp: 1,
            pp: stages,
        };
        // The default config is an MLP of 3 layers: its own validation refuses 4 stages.
        let e = TrainConfig::parse_builtin("", "built-in defaults", &pp(4).overrides())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("parallel.pp") && e.contains("only 3 layers"),
            "{e}"
        );
        assert!(TrainConfig::parse_builtin("", "x", &pp(3).overrides()).is_ok());
        // Pure data parallelism at any size passes.
        let dp3 = &expand(&[LayoutSpec::Dp], &[3])[0];
        let cfg = TrainConfig::parse_builtin("", "x", &dp3.overrides()).unwrap();
        assert_eq!(dp3.check(&cfg).unwrap().world, 3);
        // … as long as every replica gets a micro-batch (the default has 64 / 16 = 4).
        let dp8 = &expand(&[LayoutSpec::Dp], &[8])[0];
        let cfg = TrainConfig::parse_builtin("", "x", &dp8.overrides()).unwrap();
        let e = dp8.check(&cfg).unwrap_err().to_string();
        assert!(
            e.contains("parallel.microbatches") && e.contains("8"),
            "{e}"
        );
    }
}
