//! `lockstep scale`: run the same training at several world sizes and say whether scaling helped.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use lockstep_train::scaling::ScaleReport;
use lockstep_train::{StepRecord, Summary};

/// Parse "1,2,4".
pub fn parse_nprocs(spec: &str) -> Result<Vec<usize>> {
    let v: Vec<usize> = spec
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .with_context(|| format!("--nproc: `{s}` is not a worker count"))
        })
        .collect::<Result<_>>()?;
    if v.is_empty() || v.contains(&0) {
        bail!("--nproc needs one or more worker counts ≥ 1, e.g. 1,2,4");
    }
    Ok(v)
}

pub fn run_dir(out: &Path, nproc: usize) -> PathBuf {
    out.join(format!("nproc-{nproc}"))
}

/// Read one finished run's summary and per-step records.
pub fn load_run(dir: &Path) -> Result<(Summary, Vec<StepRecord>)> {
    let s = std::fs::read_to_string(dir.join("summary.json"))
        .with_context(|| format!("reading {}/summary.json", dir.display()))?;
    let summary: Summary = serde_json::from_str(&s)
        .with_context(|| format!("parsing {}/summary.json", dir.display()))?;
    let m = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .with_context(|| format!("reading {}/metrics.jsonl", dir.display()))?;
    let records = m
        .lines()
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l)
                .with_context(|| format!("{}/metrics.jsonl line {}", dir.display(), i + 1))
        })
        .collect::<Result<Vec<StepRecord>>>()?;
    Ok((summary, records))
}

pub fn format_table(r: &ScaleReport) -> String {
    let mut s = format!(
        "{:>7} {:>10} {:>11} {:>8} {:>7} {:>9} {:>9} {:>9} {:>7} {:>10} {:>8}\n",
        "workers",
        "step_ms",
        "samples/s",
        "speedup",
        "effic.",
        "fwd_ms",
        "bwd_ms",
        "comm_ms",
        "comm%",
        "test_acc",
        "hash"
    );
    for p in &r.points {
        s += &format!(
            "{:>7} {:>10.2} {:>11.0} {:>7.2}× {:>6.0}% {:>9.2} {:>9.2} {:>9.2} {:>6.0}% {:>10.4} {:>8}\n",
            p.world_size,
            p.median_step_seconds * 1e3,
            p.samples_per_sec,
            p.speedup,
            p.efficiency * 100.0,
            p.forward * 1e3,
            p.backward * 1e3,
            (p.communication + p.waiting) * 1e3,
            p.communication_fraction * 100.0,
            p.test_accuracy,
            &p.param_hash[..8.min(p.param_hash.len())]
        );
    }
    for v in &r.verdict {
        s += &format!("{v}\n");
    }
    s
}
