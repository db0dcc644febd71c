//! The scaling report of `lockstep scale`: `scale_report.md` and a self-contained
//! `scale_report.html` (inline SVG, no scripts, no external assets) from the [`ScaleReport`] that
//! is also written to `scale.json`, plus each run's loss curve.
//!
//! Sections: the verdict (one plain-language line per run); speedup against the ideal line and
//! efficiency; the time of a step by phase per run (data / compute / communication / waiting /
//! pipeline bubble); the loss curves of all runs on one plot; final metrics side by side; whether
//! the parameter hashes agree. Tables are written identically to both files.

use crate::report::{per_step, Doc, Table};
use crate::scaling::{Run, ScalePoint, ScaleReport};
use crate::svg::{LineChart, Series, StackedBars, DASHES, PALETTE};

/// Phases of the per-step breakdown, with their colours (as in the run report).
const BREAKDOWN: [(&str, &str); 5] = [
    ("data", "#999999"),
    ("compute (forward, backward, optimizer)", "#0072b2"),
    ("communication", "#e69f00"),
    ("waiting", "#d55e00"),
    ("pipeline bubble", "#cc79a7"),
];

/// "dp-2 (2 workers)".
fn who(p: &ScalePoint) -> String {
    match p.world_size {
        1 => format!("{} (1 worker)", p.label),
        n => format!("{} ({n} workers)", p.label),
    }
}

fn short(hash: &str) -> &str {
    &hash[..12.min(hash.len())]
}

/// Which family a run belongs to on the speedup plot.
fn family(p: &ScalePoint) -> &'static str {
    match (p.dp, p.tp, p.pp) {
        (_, tp, _) if tp > 1 => "tensor parallel",
        (_, _, pp) if pp <= 1 => "data parallel",
        (1, _, _) => "pipeline",
        _ => "data × pipeline",
    }
}

/// `(markdown, html)`; `runs` are the runs behind `report.points`, in the same order (for their
/// loss curves).
pub fn render(report: &ScaleReport, runs: &[Run]) -> (String, String) {
    let points = &report.points;
    let mut doc = Doc::default();

    doc.section("verdict", "Verdict");
    doc.para(&report.headline);
    doc.list(&report.verdict);
    doc.para(
        "Step time is the median over the steady-state steps (the first 10%, at most 5, are warm-up) \
         of the slowest rank's step; speedup = baseline step time / step time; efficiency = speedup × \
         baseline workers / workers.",
    );
    speedup_section(&mut doc, points);
    breakdown_section(&mut doc, points);
    loss_section(&mut doc, points, runs);
    final_section(&mut doc, points);
    memory_section(&mut doc, points);
    hashes_section(&mut doc, report);
    doc.finish("lockstep scaling report", "", "")
}

/// Speedup and efficiency per layout: a table, the speedup per family against the ideal, and
/// efficiency bars.
fn speedup_section(doc: &mut Doc, points: &[ScalePoint]) {
    doc.section("speedup", "Speedup and efficiency");
    let mut t = Table::new(&[
        "run",
        "workers",
        "dp × tp × pp",
        "step ms",
        "samples/s",
        "speedup",
        "efficiency",
        "communication % of step",
        "device",
    ]);
    for p in points {
        t.row(vec![
            p.label.clone(),
            p.world_size.to_string(),
            format!("{} × {} × {}", p.dp, p.tp, p.pp),
            format!("{:.3}", p.median_step_seconds * 1e3),
            format!("{:.1}", p.samples_per_sec),
            format!("{:.2}×", p.speedup),
            format!("{:.1}%", p.efficiency * 100.0),
            format!("{:.1}%", p.communication_fraction * 100.0),
            p.devices.join("; "),
        ]);
    }
    doc.table(&t);
    if let Some(b) = points.first() {
        doc.figure(speedup_chart(points, b));
        doc.figure(efficiency_bars(points));
    }
}

/// Speedup per family of layouts against the linear ideal, from the baseline `b`.
fn speedup_chart(points: &[ScalePoint], b: &ScalePoint) -> String {
    let mut worlds: Vec<usize> = points.iter().map(|p| p.world_size).collect();
    worlds.sort_unstable();
    worlds.dedup();
    let ideal: Vec<(f64, f64)> = worlds
        .iter()
        .map(|&n| (n as f64, n as f64 / b.world_size as f64))
        .collect();
    let mut chart = LineChart::new("speedup against the ideal", "workers", "speedup (×)")
        .series(Series::new("ideal (linear)", "#555555", ideal).dashed("6 4"));
    for (i, fam) in [
        "data parallel",
        "pipeline",
        "data × pipeline",
        "tensor parallel",
    ]
    .iter()
    .enumerate()
    {
        let mut mine: Vec<&ScalePoint> = points.iter().filter(|p| family(p) == *fam).collect();
        if mine.is_empty() {
            continue;
        }
        mine.sort_by_key(|p| p.world_size);
        let mut xy: Vec<(f64, f64)> = mine
            .iter()
            .map(|p| (p.world_size as f64, p.speedup))
            .collect();
        let mut labels: Vec<String> = mine
            .iter()
            .map(|p| {
                format!(
                    "{}: {:.2}× ({:.0}%)",
                    p.label,
                    p.speedup,
                    p.efficiency * 100.0
                )
            })
            .collect();
        // A single worker is every family's first point (1 replica of 1 stage): start each
        // curve at a one-worker baseline so that a family with one run still shows a trend.
        if (b.dp, b.tp, b.pp) == (1, 1, 1) && !mine.iter().any(|p| p.label == b.label) {
            xy.insert(0, (1.0, 1.0));
            labels.insert(0, String::new());
        }
        chart = chart.series(Series::new(*fam, PALETTE[i], xy).with_markers(labels));
    }
    chart.y_from_zero().x_integer().render()
}

/// Parallel efficiency of every layout, against 100%.
fn efficiency_bars(points: &[ScalePoint]) -> String {
    StackedBars {
        title: "parallel efficiency (speedup per worker, relative to the baseline)".into(),
        x_label: "efficiency (%)".into(),
        segments: vec![("efficiency".into(), PALETTE[0].into())],
        rows: points
            .iter()
            .map(|p| (who(p), vec![p.efficiency]))
            .collect(),
        unit_scale: 100.0,
        unit: "%".into(),
        reference: Some((1.0, "ideal 100%".into())),
    }
    .render()
}

/// Median time per step by phase, per layout.
fn breakdown_section(doc: &mut Doc, points: &[ScalePoint]) {
    doc.section("breakdown", "Time per step by phase");
    doc.para(
        "Medians over steady-state steps of the slowest rank, per phase (medians of the parts need \
         not add up exactly to the median step). Communication is exposed gradient exchange; waiting \
         is time blocked on slower ranks; the bubble is pipeline idle time.",
    );
    let mut t = Table::new(&[
        "run",
        "step ms",
        "data ms",
        "compute ms",
        "communication ms",
        "waiting ms",
        "bubble ms",
    ]);
    for p in points {
        t.row(vec![
            p.label.clone(),
            format!("{:.3}", p.median_step_seconds * 1e3),
            format!("{:.3}", p.data * 1e3),
            format!("{:.3}", p.compute() * 1e3),
            format!("{:.3}", p.communication * 1e3),
            format!("{:.3}", p.waiting * 1e3),
            format!("{:.3}", p.bubble * 1e3),
        ]);
    }
    doc.table(&t);
    doc.figure(
        StackedBars {
            title: "median time per step by phase (slowest rank)".into(),
            x_label: "milliseconds per step".into(),
            segments: BREAKDOWN
                .iter()
                .map(|(n, c)| (n.to_string(), c.to_string()))
                .collect(),
            rows: points
                .iter()
                .map(|p| {
                    (
                        who(p),
                        vec![p.data, p.compute(), p.communication, p.waiting, p.bubble],
                    )
                })
                .collect(),
            unit_scale: 1e3,
            unit: " ms".into(),
            reference: None,
        }
        .render(),
    );
}

/// Every run's loss curve, and whether they are identical.
fn loss_section(doc: &mut Doc, points: &[ScalePoint], runs: &[Run]) {
    doc.section("loss", "Loss curves");
    let curves: Vec<Vec<(f64, f64)>> = runs
        .iter()
        .map(|r| per_step(&r.records, |x| x.loss))
        .collect();
    if let Some(first) = curves.first() {
        let identical = curves.iter().all(|c| c == first);
        doc.para(&if identical {
            format!(
                "All {} loss curves are identical, step for step (drawn with different dashes so each stays visible).",
                curves.len()
            )
        } else {
            let max_diff = curves
                .iter()
                .flat_map(|c| {
                    c.iter()
                        .zip(first)
                        .map(|(a, b)| (a.1 - b.1).abs())
                })
                .fold(0.0, f64::max);
            format!(
                "The loss curves differ from the baseline's by up to {max_diff:.3e} (same steps compared)."
            )
        });
    }
    let mut chart = LineChart::new(
        "training loss of every run",
        "step",
        "loss (global batch mean)",
    );
    for (i, (c, p)) in curves.into_iter().zip(points).enumerate() {
        chart = chart.series(
            Series::new(who(p), PALETTE[i % PALETTE.len()], c).dashed(DASHES[i % DASHES.len()]),
        );
    }
    doc.figure(chart.render());
}

/// Final loss, test figures and hash per layout.
fn final_section(doc: &mut Doc, points: &[ScalePoint]) {
    doc.section("final", "Final metrics");
    let mut t = Table::new(&[
        "run",
        "workers",
        "final loss",
        "test loss",
        "test accuracy",
        "samples/s",
        "wall s",
        "parameter hash",
        "same as baseline",
    ]);
    for p in points {
        t.row(vec![
            p.label.clone(),
            p.world_size.to_string(),
            format!("{:.6}", p.final_loss),
            format!("{:.6}", p.test_loss),
            if p.test_accuracy.is_finite() {
                format!("{:.4}", p.test_accuracy)
            } else {
                "—".to_string()
            },
            format!("{:.1}", p.samples_per_sec),
            format!("{:.3}", p.wall_seconds),
            format!("`{}`", short(&p.param_hash)),
            if p.same_result_as_first { "yes" } else { "NO" }.to_string(),
        ]);
    }
    doc.table(&t);
}

/// Whether every layout ended with the baseline's parameter hash.
fn hashes_section(doc: &mut Doc, report: &ScaleReport) {
    let points = &report.points;
    doc.section("hashes", "Reproducibility");
    match points.first() {
        None => doc.para("No runs."),
        Some(b) if report.hashes_agree => doc.para(&format!(
            "Same result: all {} runs ended with the same parameter hash {} — bit-identical parameters.",
            points.len(),
            b.param_hash
        )),
        Some(b) => {
            let differ: Vec<String> = points
                .iter()
                .filter(|p| !p.same_result_as_first)
                .map(|p| format!("{} ({})", p.label, p.param_hash))
                .collect();
            doc.para(&format!(
                "DIFFERENT results: {} ended with other parameters than the baseline {} ({}). \
                 With dist.reproducible = false a different world size changes low bits; with \
                 dist.reproducible = true this is a bug worth reporting.",
                differ.join(", "),
                b.label,
                b.param_hash
            ));
        }
    }
}

/// Every layout's ranks: held memory against peak resident memory (runs without memory figures
/// are left out; no section when none has them).
fn memory_section(doc: &mut Doc, points: &[ScalePoint]) {
    let rows: Vec<(String, lockstep_run::memory::RankMemory)> = points
        .iter()
        .flat_map(|p| {
            p.memory
                .iter()
                .enumerate()
                .map(move |(r, m)| (format!("{} rank {r}", p.label), *m))
        })
        .collect();
    if rows.is_empty() {
        return;
    }
    doc.section("memory", "Memory per rank");
    doc.para(&crate::memory::explanation());
    doc.table(&crate::report::memory_table(&rows));
    doc.figure(crate::memory::bars("memory per rank, by layout (peak)", &rows).render());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scaling::{compare, Layout};
    use crate::svg::well_formed;
    use lockstep_run::metrics::{PhaseSeconds, RankMemory, RankSummary, StepRecord, Summary};

    fn run(name: &str, dp: usize, pp: usize, hash: &str, step_secs: f64, loss_shift: f64) -> Run {
        let world = dp * pp;
        let records = (0..20)
            .flat_map(|step| {
                (0..world).map(move |rank| StepRecord {
                    rank,
                    step,
                    loss: 2.0 / (step + 1) as f64 + loss_shift,
                    lr: 0.1,
                    samples: 8,
                    samples_per_sec: 1.0,
                    step_seconds: step_secs,
                    seconds: PhaseSeconds {
                        data: 0.0001,
                        forward: step_secs * 0.3,
                        backward: step_secs * 0.5,
                        communication: step_secs * 0.1,
                        waiting: step_secs * 0.05,
                        optimizer: 0.0002,
                        overlapped_communication: 0.0,
                        device_copy: 0.0,
                        checkpoint: 0.0,
                    },
                    bytes_sent: 0,
                    eval: None,
                    pipeline: None,
                    rss_bytes: None,
                    grad_norm: None,
                    train_metrics: Default::default(),
                })
            })
            .collect();
        Run {
            layout: Layout {
                name: name.into(),
                dp,
                tp: 1,
                pp,
            },
            summary: Summary {
                job: String::new(),
                global_batch: 64,
                microbatch: 16,
                final_loss: 0.123456 + loss_shift,
                test_loss: 0.234567,
                test_accuracy: 0.9721,
                wall_seconds: 1.25 / world as f64,
                ranks: (0..world)
                    .map(|r| RankSummary {
                        memory: Some(RankMemory {
                            params_bytes: (8 / pp as u64) << 20,
                            grads_bytes: (3 * (8 / pp as u64)) << 20,
                            optimizer_bytes: (2 * (8 / pp as u64)) << 20,
                            activation_peak_bytes: 1 << 20,
                            peak_rss_bytes: (200 + r as u64) << 20,
                        }),
                        device: "flex 0: cpu".into(),
                        ..crate::scaling::tests::rank_summary(r)
                    })
                    .collect(),
                ..crate::scaling::tests::summary(world, hash)
            },
            records,
        }
    }

    #[test]
    fn every_section_is_present_with_the_input_numbers() {
        let runs = vec![
            run("dp-1", 1, 1, "aaaaaaaaaaaaaaaa", 0.010, 0.0),
            run("dp-2", 2, 1, "aaaaaaaaaaaaaaaa", 0.006, 0.0),
            run("dp2xpp2", 2, 2, "aaaaaaaaaaaaaaaa", 0.004, 0.0),
        ];
        let report = compare(&runs);
        let (md, html) = render(&report, &runs);
        for h in [
            "## Verdict",
            "## Speedup and efficiency",
            "## Time per step by phase",
            "## Loss curves",
            "## Final metrics",
            "## Memory per rank",
            "## Reproducibility",
        ] {
            assert!(md.contains(h), "report lacks {h}:\n{md}");
        }
        for v in &report.verdict {
            assert!(md.contains(&format!("- {v}")), "verdict {v:?} missing");
        }
        assert!(md.contains(&report.headline));
        // Numbers as computed by compare (10 ms → 6 ms: 1.67×, 83.3% on 2 workers).
        for row in [
            "| dp-1 | 1 | 1 × 1 × 1 | 10.000 | 6400.0 | 1.00× | 100.0% | 15.0% | flex 0: cpu |",
            "| dp-2 | 2 | 2 × 1 × 1 | 6.000 | 10666.7 | 1.67× | 83.3% | 15.0% | flex 0: cpu |",
            "| dp2xpp2 | 4 | 2 × 1 × 2 | 4.000 | 16000.0 | 2.50× | 62.5% | 15.0% | flex 0: cpu |",
            "| dp-2 | 6.000 | 0.100 | 5.000 | 0.600 | 0.300 | 0.000 |",
            "| dp-1 | 1 | 0.123456 | 0.234567 | 0.9721 | 6400.0 | 1.250 | `aaaaaaaaaaaa` | yes |",
            "| dp2xpp2 | 4 | 0.123456 | 0.234567 | 0.9721 | 16000.0 | 0.312 | `aaaaaaaaaaaa` | yes |",
            // Memory: 8 MiB of parameters on one stage, 4 on each of two; 14 MiB of state.
            "| dp-1 rank 0 | 8.0 | 24.0 | 16.0 | 1.0 | 49.0 | 200.0 | 585.5 | yes |",
            "| dp2xpp2 rank 3 | 4.0 | 12.0 | 8.0 | 1.0 | 25.0 | 203.0 | 549.5 | yes |",
        ] {
            assert!(md.contains(row), "report lacks {row:?}:\n{md}");
        }
        assert!(md.contains("All 3 loss curves are identical"), "{md}");
        assert!(md.contains(
            "Same result: all 3 runs ended with the same parameter hash aaaaaaaaaaaaaaaa"
        ));
        for id in [
            "verdict",
            "speedup",
            "breakdown",
            "loss",
            "final",
            "memory",
            "hashes",
        ] {
            assert!(
                html.contains(&format!("<section id=\"{id}\">")),
                "html lacks section {id}"
            );
        }
        // Speedup plot: the ideal line, one curve per layout family, labelled points.
        for needle in [
            "ideal (linear)",
            ">data parallel</text>",
            ">data × pipeline</text>",
            "dp-2: 1.67× (83%)",
            "ideal 100%",
            "pipeline bubble",
            "dp2xpp2 (4 workers)",
            "<td>10666.7</td>",
        ] {
            assert!(html.contains(needle), "html lacks {needle:?}");
        }
        // One loss curve per run, plus the speedup chart's three: the ideal, data parallel, and
        // data × pipeline (its one run joined to the 1-worker baseline).
        assert_eq!(html.matches("<polyline").count(), 3 + 3);
        well_formed(&html).unwrap();
        assert!(!html.contains("<script"));
    }

    #[test]
    fn a_tensor_parallel_layout_has_its_rows_curve_and_memory_bars() {
        let mut tp2 = run("tp2", 2, 1, "aaaaaaaaaaaaaaaa", 0.008, 0.0);
        tp2.layout = Layout {
            name: "tp2".into(),
            dp: 1,
            tp: 2,
            pp: 1,
        };
        let runs = vec![run("dp-1", 1, 1, "aaaaaaaaaaaaaaaa", 0.010, 0.0), tp2];
        let report = compare(&runs);
        assert_eq!((report.points[1].dp, report.points[1].tp), (1, 2));
        let (md, html) = render(&report, &runs);
        for row in [
            "| tp2 | 2 | 1 × 2 × 1 | 8.000 | 8000.0 | 1.25× | 62.5% | 15.0% |",
            "| tp2 rank 1 | 8.0 | 24.0 | 16.0 | 1.0 | 49.0 | 201.0 | 585.5 | yes |",
        ] {
            assert!(md.contains(row), "report lacks {row:?}:\n{md}");
        }
        // Its own curve on the speedup chart, and bars of both its ranks in the memory chart.
        assert!(html.contains(">tensor parallel</text>"), "{html}");
        let memory = &html[html.find("<section id=\"memory\">").unwrap()..];
        let memory = &memory[..memory.find("</section>").unwrap()];
        for bar in ["tp2 rank 0", "tp2 rank 1", "dp-1 rank 0"] {
            assert!(memory.contains(bar), "memory chart lacks {bar}: {memory}");
        }
        well_formed(&html).unwrap();
    }

    #[test]
    fn disagreeing_hashes_and_curves_are_called_out() {
        let runs = vec![
            run("dp-1", 1, 1, "1111111111111111", 0.010, 0.0),
            run("dp-2", 2, 1, "2222222222222222", 0.012, 0.001),
        ];
        let report = compare(&runs);
        let (md, html) = render(&report, &runs);
        assert!(md.contains("DIFFERENT results: dp-2 (2222222222222222) ended with other parameters than the baseline dp-1 (1111111111111111)"), "{md}");
        assert!(md.contains("| dp-2 | 2 | 0.124456 | 0.234567 | 0.9721 | 5333.3 | 0.625 | `222222222222` | NO |"), "{md}");
        assert!(
            md.contains("differ from the baseline's by up to 1.000e-3"),
            "{md}"
        );
        assert!(md.contains("1.20× slower than dp-1"), "{md}");
        assert!(html.contains("DIFFERENT results"));
        well_formed(&html).unwrap();
    }
}
