//! `lockstep scale`: run the same training at several world sizes and layouts, and say whether
//! scaling helped (`scale.json`, `scale_report.md`, `scale_report.html` in the output directory,
//! one run directory per layout).

use lockstep_train::ConfigLoad;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use lockstep_report::scaling::{self, Layout, LayoutSpec, Run, ScaleReport};
use lockstep_train::{StepRecord, Summary, TrainConfig};

/// Parse "1,2,4".
pub fn parse_nprocs(spec: &str) -> Result<Vec<usize>> {
    let bad = || {
        crate::request::BadRequest(format!(
            "--nproc {spec}: needs one or more worker counts from 1 to {}, e.g. 1,2,4",
            crate::flags::MAX_LOCAL_WORKERS
        ))
    };
    let v: Vec<usize> = spec
        .split(',')
        .map(|s| s.trim().parse::<usize>().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    if v.is_empty()
        || v.iter()
            .any(|&n| n == 0 || n > crate::flags::MAX_LOCAL_WORKERS)
    {
        return Err(bad().into());
    }
    Ok(v)
}

/// The sweep's runs, in order, each checked against the config (with the user's `--set`s and the
/// layout's own overrides) before anything runs: a bad layout or a pipeline the model cannot
/// have fails here, not after an hour of earlier runs.
pub fn plan(
    layouts: Option<&str>,
    sizes: &[usize],
    config: Option<&Path>,
    sets: &[String],
) -> Result<Vec<Layout>> {
    let specs = match layouts {
        Some(l) => scaling::parse_layouts(l).context("--layouts")?,
        None => vec![LayoutSpec::Dp],
    };
    let plan = scaling::expand(&specs, sizes);
    for layout in &plan {
        let cfg = TrainConfig::load_for(crate::job(), config, &layout_sets(layout, sets))
            .with_context(|| format!("layout {} ({})", layout.name, layout.describe()))?;
        layout
            .check(&cfg)
            .with_context(|| format!("layout {} ({})", layout.name, layout.describe()))?;
    }
    Ok(plan)
}

/// The user's overrides, then the layout's (which win).
pub fn layout_sets(layout: &Layout, sets: &[String]) -> Vec<String> {
    sets.iter().cloned().chain(layout.overrides()).collect()
}

pub fn run_dir(out: &Path, layout: &Layout) -> PathBuf {
    out.join(&layout.name)
}

/// Read one finished run's summary and per-step records.
pub fn load_run(dir: &Path) -> Result<(Summary, Vec<StepRecord>)> {
    use lockstep_run::read::{read_text, METRICS_MAX_BYTES, SUMMARY_MAX_BYTES};
    let s = read_text(&dir.join("summary.json"), SUMMARY_MAX_BYTES)
        .with_context(|| format!("reading {}/summary.json", dir.display()))?;
    let summary: Summary = serde_json::from_str(&s)
        .with_context(|| format!("parsing {}/summary.json", dir.display()))?;
    let m = read_text(&dir.join("metrics.jsonl"), METRICS_MAX_BYTES)
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

/// Write `scale.json`, `scale_report.md` and `scale_report.html` into `out`; returns their paths.
pub fn write_outputs(out: &Path, report: &ScaleReport, runs: &[Run]) -> Result<Vec<PathBuf>> {
    let (md, html) = lockstep_report::scale_report::render(report, runs);
    let files = [
        ("scale.json", serde_json::to_string_pretty(report)? + "\n"),
        ("scale_report.md", md),
        ("scale_report.html", html),
    ];
    let mut paths = Vec::new();
    for (name, text) in files {
        let path = out.join(name);
        lockstep_train::write_atomic(&path, text.as_bytes())?;
        paths.push(path);
    }
    Ok(paths)
}

pub fn format_table(r: &ScaleReport) -> String {
    let label_w = r
        .points
        .iter()
        .map(|p| p.label.len())
        .max()
        .unwrap_or(0)
        .max(6);
    let mut s = format!(
        "{:<label_w$} {:>7} {:>10} {:>11} {:>8} {:>7} {:>9} {:>9} {:>9} {:>7} {:>9} {:>10} {:>8}\n",
        "layout",
        "workers",
        "step_ms",
        "samples/s",
        "speedup",
        "effic.",
        "fwd_ms",
        "bwd_ms",
        "comm_ms",
        "comm%",
        "bubble_ms",
        "test_acc",
        "hash"
    );
    for p in &r.points {
        s += &format!(
            "{:<label_w$} {:>7} {:>10.2} {:>11.0} {:>7.2}× {:>6.0}% {:>9.2} {:>9.2} {:>9.2} {:>6.0}% {:>9.2} {:>10} {:>8}\n",
            p.label,
            p.world_size,
            p.median_step_seconds * 1e3,
            p.samples_per_sec,
            p.speedup,
            p.efficiency * 100.0,
            p.forward * 1e3,
            p.backward * 1e3,
            (p.communication + p.waiting) * 1e3,
            p.communication_fraction * 100.0,
            p.bubble * 1e3,
            if p.test_accuracy.is_finite() {
                format!("{:.4}", p.test_accuracy)
            } else {
                "—".into()
            },
            &p.param_hash[..8.min(p.param_hash.len())]
        );
    }
    for v in &r.verdict {
        s += &format!("{v}\n");
    }
    s += &format!("{}\n", r.headline);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(p: &[Layout]) -> Vec<&str> {
        p.iter().map(|l| l.name.as_str()).collect()
    }

    #[test]
    fn the_plan_defaults_to_data_parallel_and_names_run_directories() {
        let p = plan(None, &[1, 2], None, &[]).unwrap();
        assert_eq!(names(&p), ["dp-1", "dp-2"]);
        assert_eq!(run_dir(Path::new("out"), &p[1]), Path::new("out/dp-2"));
        let sets = layout_sets(&p[1], &["train.steps=5".into(), "parallel.pp=3".into()]);
        assert_eq!(
            sets,
            [
                "train.steps=5",
                "parallel.pp=3",
                "parallel.dp=2",
                "parallel.tp=1",
                "parallel.pp=1"
            ],
            "the layout's overrides come last and win"
        );
        assert_eq!(
            TrainConfig::load(None, &sets).unwrap().parallel.pp,
            1,
            "the resolved config has the layout's values"
        );
    }

    #[test]
    fn bad_layouts_fail_before_any_run() {
        let e = format!("{:#}", plan(Some("dp,tq"), &[1, 2], None, &[]).unwrap_err());
        assert!(e.starts_with("--layouts: layout `tq`"), "{e}");
        // Tensor parallelism of a model without pieces: the config's own error, naming the layout.
        let e = format!("{:#}", plan(Some("tp"), &[1, 2], None, &[]).unwrap_err());
        assert!(
            e.contains("layout tp-2 (2 workers: 1 replica(s) × 2 tensor-parallel ranks)")
                && e.contains("tp_pieces"),
            "{e}"
        );
        // More stages than the default MLP has layers: the config's own validation error,
        // naming the layout.
        let e = plan(Some("dp,pp"), &[1, 4], None, &[]).unwrap_err();
        let text = format!("{e:#}");
        assert!(
            text.contains("layout pp-4 (4 workers: 1 replica(s) × 4 stages)"),
            "{text}"
        );
        assert!(
            text.contains("parallel.pp") && text.contains("only 3 layers"),
            "{text}"
        );
        assert!(
            e.chain().any(|c| c.is::<lockstep_train::ConfigError>()),
            "a bad-input error (exit status 3)"
        );
        // Too many workers for the micro-batches of a step, at the last size of the sweep.
        let e = format!("{:#}", plan(None, &[1, 2, 8], None, &[]).unwrap_err());
        assert!(e.starts_with("layout dp-8 (8 workers)"), "{e}");
        // A bad --set is reported too, before any run.
        assert!(plan(None, &[1], None, &["train.steps=x".into()]).is_err());
    }

    #[test]
    fn tensor_parallel_layouts_pass_the_configs_check() {
        let config = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../configs/shakespeare.toml"
        ));
        let sets = ["model.tp_pieces=4".to_string()];
        let p = plan(Some("dp,tp,dp2xtp2,tp2xpp2"), &[1, 2], Some(config), &sets).unwrap();
        assert_eq!(names(&p), ["dp-1", "dp-2", "tp-2", "dp2xtp2", "tp2xpp2"]);
        assert_eq!((p[3].dp, p[3].tp, p[3].pp), (2, 2, 1));
    }

    #[test]
    fn worker_counts_parse() {
        assert_eq!(parse_nprocs("1, 2,4").unwrap(), [1, 2, 4]);
        assert!(parse_nprocs("1,0").is_err());
        assert!(parse_nprocs("1,x").is_err());
    }
}
