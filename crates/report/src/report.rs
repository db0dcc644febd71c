//! The run report: `report.md` and a self-contained `report.html` (inline SVG, no external assets,
//! no scripts) written next to `summary.json`, from the same numbers.
//!
//! Sections: headline figures; loss curve and test accuracy (taken from `metrics.jsonl`, which is
//! one continuous record across restarts, so the curves span every attempt); evaluations;
//! throughput over time; per-rank time by phase as stacked bars (with the pipeline bubble for
//! pipeline runs), load balance and straggler; the pipeline (stages, their layers, compute,
//! send/receive, measured vs ideal bubble, peak activations) when the run had one; failures and
//! recoveries on a step timeline. Every table is built once and written to both files, so the
//! Markdown and the HTML cannot disagree.

use std::fmt::Write as _;

use crate::memory;
use crate::svg::{esc, LineChart, Series, Span, StackedBars, Timeline, PALETTE};
use lockstep_run::metrics::{Eval, PipelineSummary, RankMemory, StepRecord, Summary};

/// Extra facts the launcher knows (restarts and failures).
#[derive(Debug, Default, Clone)]
pub struct Recovery {
    pub restarts: u64,
    pub steps_recomputed: u64,
    /// One line per failure.
    pub failures: Vec<String>,
    /// One line per membership change (node lost or joined, worker slot lost or given back).
    pub membership: Vec<String>,
}

/// One failure as placed on the timeline (the launcher's failure record, reduced to what the plot
/// needs).
#[derive(Debug, Clone, PartialEq)]
pub struct FailureMark {
    pub attempt: usize,
    /// Whom it happened to: "rank 3", "node 2 (hostC)".
    pub who: String,
    /// World size of the attempt that failed.
    pub world_size: usize,
    /// What happened, e.g. "killed by signal 9 (SIGKILL)".
    pub what: String,
    /// Last step the attempt completed (None: it failed before completing one).
    pub step: Option<u64>,
    /// Step the next attempt resumed from (None: not restarted).
    pub resumed_from: Option<u64>,
}

/// A table written identically to Markdown and HTML. A cell wrapped in backticks is code.
#[derive(Debug, Clone, Default)]
pub(crate) struct Table {
    head: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new(head: &[&str]) -> Self {
        Self {
            head: head.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.head.len(), "row width");
        self.rows.push(cells);
    }

    pub(crate) fn md(&self) -> String {
        let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
        let mut s = line(&self.head);
        s += &format!("|{}\n", "---|".repeat(self.head.len()));
        for r in &self.rows {
            s += &line(r);
        }
        s
    }

    pub(crate) fn html(&self) -> String {
        let cell = |tag: &str, c: &str| match c.strip_prefix('`').and_then(|c| c.strip_suffix('`'))
        {
            Some(code) => format!("<{tag}><code>{}</code></{tag}>", esc(code)),
            None => format!("<{tag}>{}</{tag}>", esc(c)),
        };
        let mut s = String::from("<table><thead><tr>");
        for h in &self.head {
            s += &cell("th", h);
        }
        s += "</tr></thead><tbody>";
        for r in &self.rows {
            s += "<tr>";
            for c in r {
                s += &cell("td", c);
            }
            s += "</tr>";
        }
        s + "</tbody></table>"
    }
}

/// A report being written to Markdown and HTML at once.
#[derive(Debug, Default)]
pub(crate) struct Doc {
    pub(crate) md: String,
    pub(crate) html: String,
}

impl Doc {
    /// Start a section: `## heading` in Markdown, `<section id><h2>` in HTML.
    pub(crate) fn section(&mut self, id: &str, heading: &str) {
        if !self.html.is_empty() {
            self.html += "</section>";
        }
        let _ = write!(self.md, "\n## {heading}\n\n");
        let _ = write!(
            self.html,
            "<section id=\"{}\"><h2>{}</h2>",
            esc(id),
            esc(heading)
        );
    }

    /// A paragraph in both.
    pub(crate) fn para(&mut self, text: &str) {
        let _ = writeln!(self.md, "{text}\n");
        let _ = write!(self.html, "<p>{}</p>", esc(text));
    }

    /// A bulleted list in both.
    pub(crate) fn list(&mut self, items: &[String]) {
        self.html += "<ul>";
        for i in items {
            let _ = writeln!(self.md, "- {i}");
            let _ = write!(self.html, "<li>{}</li>", esc(i));
        }
        self.html += "</ul>";
        self.md += "\n";
    }

    /// A table in both; in HTML a long one is folded (a `<details>` element: no script needed).
    pub(crate) fn table(&mut self, t: &Table) {
        self.md += &t.md();
        self.md += "\n";
        if t.rows.len() > 12 {
            let _ = write!(
                self.html,
                "<details><summary>{} rows</summary>{}</details>",
                t.rows.len(),
                t.html()
            );
        } else {
            self.html += &t.html();
        }
    }

    /// A chart: HTML only (the Markdown carries the numbers in its tables).
    pub(crate) fn figure(&mut self, svg: String) {
        let _ = write!(self.html, "<figure>{svg}</figure>");
    }

    /// The finished `(markdown, html)` with `title` as the top heading and page title.
    pub(crate) fn finish(self, title: &str, intro_md: &str, intro_html: &str) -> (String, String) {
        let md = format!("# {title}\n\n{intro_md}{}", self.md);
        let mut html = format!(
            "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{0}</title><style>{STYLE}</style></head><body><h1>{0}</h1>{intro_html}",
            esc(title)
        );
        html += &self.html;
        if !self.html.is_empty() {
            html += "</section>";
        }
        html += "</body></html>\n";
        (md, html)
    }
}

const STYLE: &str = "body{font-family:sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}\
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 9px;text-align:left}\
th{background:#f3f3f3}summary{cursor:pointer;color:#0072b2}section{margin:2em 0}figure{margin:1em 0}code{font-size:90%;word-break:break-all}\
h2{border-bottom:1px solid #ddd;padding-bottom:.2em}";

/// Per-rank phases of the stacked bars, with their colours.
const PHASES: [(&str, &str); 7] = [
    ("data", "#999999"),
    ("forward", "#56b4e9"),
    ("backward", "#0072b2"),
    ("optimizer", "#009e73"),
    ("communication", "#e69f00"),
    ("waiting", "#d55e00"),
    ("pipeline bubble", "#cc79a7"),
];

/// Test evaluations of the whole run, `(step, eval)` in step order: from the `eval` field of the
/// records (continuous across restarts), falling back to the summary's (final attempt only) for
/// records written without it.
pub fn evaluations(summary: &Summary, records: &[StepRecord]) -> Vec<(u64, Eval)> {
    let mut by_step = std::collections::BTreeMap::new();
    for r in records {
        if let Some(e) = &r.eval {
            by_step.entry(r.step + 1).or_insert_with(|| e.clone());
        }
    }
    if by_step.is_empty() {
        return summary.evals.clone();
    }
    by_step.into_iter().collect()
}

/// `(step + 1, value)` of one record per step (the lowest rank's), in step order.
pub(crate) fn per_step(records: &[StepRecord], f: impl Fn(&StepRecord) -> f64) -> Vec<(f64, f64)> {
    let mut by_step: std::collections::BTreeMap<u64, &StepRecord> = Default::default();
    for r in records {
        let e = by_step.entry(r.step).or_insert(r);
        if r.rank < e.rank {
            *e = r;
        }
    }
    by_step
        .into_iter()
        .map(|(s, r)| (s as f64 + 1.0, f(r)))
        .collect()
}

/// `(markdown, html)` for a finished run (no failure timeline: see [`render_with_failures`]).
pub fn render(summary: &Summary, records: &[StepRecord], recovery: &Recovery) -> (String, String) {
    render_with_failures(summary, records, recovery, &[])
}

/// `(markdown, html)` for a finished run; `failures` places each failure and restart on a step
/// timeline.
pub fn render_with_failures(
    summary: &Summary,
    records: &[StepRecord],
    recovery: &Recovery,
    failures: &[FailureMark],
) -> (String, String) {
    let s = summary;
    let evals = evaluations(s, records);
    let straggler = match s.straggler {
        Some(r) => format!("rank {r} is a straggler"),
        None => "no straggler".to_string(),
    };
    let head = headline_table(s, recovery, &straggler);
    let mut doc = Doc::default();
    loss_section(&mut doc, records, &evals, failures);
    evaluations_section(&mut doc, &evals);
    throughput_section(&mut doc, s, records);
    ranks_section(&mut doc, s, records, &straggler);
    checkpoints_paragraph(&mut doc, s);
    memory_section(&mut doc, s, records);
    if let Some(p) = &s.pipeline {
        pipeline_section(&mut doc, s, p);
    }
    failures_section(&mut doc, s, recovery, failures);

    // A user's job names itself in the title (summaries of built-in runs say "lockstep").
    let title = match s.job.as_str() {
        "" | "lockstep" => "lockstep run report".to_string(),
        job => format!("{job}: lockstep run report"),
    };
    doc.finish(
        &title,
        &head.md(),
        &format!("<section id=\"headline\">{}</section>", head.html()),
    )
}

/// The headline figures: one row per figure.
fn headline_table(s: &Summary, recovery: &Recovery, straggler: &str) -> Table {
    let bandwidth = if s.wall_seconds > 0.0 {
        s.bytes_sent_total as f64 / s.wall_seconds / 1e9
    } else {
        0.0
    };
    let mut head = Table::new(&["figure", "value"]);
    if let Some(plan) = &s.plan {
        // The layout, sum and precision the run followed ("dp 2 × tp 1 × pp 1, exact sum, bf16
        // products"); summaries written before the plan was recorded have none.
        head.row(vec!["plan".to_string(), plan.describe()]);
    }
    for (k, v) in [
        ("world size", s.world_size.to_string()),
        ("transport", s.transport.clone()),
        ("steps", s.steps.to_string()),
        (
            "global batch / micro-batch",
            format!("{} / {}", s.global_batch, s.microbatch),
        ),
        ("final training loss", format!("{:.6}", s.final_loss)),
        ("test accuracy", format!("{:.4}", s.test_accuracy)),
        ("test loss", format!("{:.6}", s.test_loss)),
        ("wall seconds", format!("{:.3}", s.wall_seconds)),
        ("samples per second", format!("{:.1}", s.samples_per_sec)),
        (
            "imbalance (max/mean compute)",
            format!("{:.3}", s.imbalance),
        ),
        ("straggler", straggler.to_string()),
        (
            "communication share of step time",
            format!("{:.1}%", s.communication_fraction * 100.0),
        ),
        ("bytes sent (all ranks)", s.bytes_sent_total.to_string()),
        (
            "average send bandwidth (all ranks)",
            format!("{bandwidth:.3} GB/s"),
        ),
        ("reproducible gradient sum", s.reproducible.to_string()),
        ("parameter hash (SHA-256)", format!("`{}`", s.param_hash)),
        ("restarts", recovery.restarts.to_string()),
        ("steps recomputed", recovery.steps_recomputed.to_string()),
    ] {
        head.row(vec![k.to_string(), v]);
    }
    for (name, v) in &s.test_metrics {
        head.row(vec![format!("test {name}"), format!("{v:.4}")]);
    }
    head
}

/// Training loss and the job's test metrics over the steps, restarts marked.
fn loss_section(
    doc: &mut Doc,
    records: &[StepRecord],
    evals: &[(u64, Eval)],
    failures: &[FailureMark],
) {
    // Loss and accuracy, over every attempt.
    let loss = per_step(records, |r| r.loss);
    let restarts: Vec<(f64, String)> = failures
        .iter()
        .filter_map(|f| {
            f.resumed_from
                .map(|from| (from as f64, format!("restart {}", f.attempt + 1)))
        })
        .collect();
    doc.section("loss", "Loss and accuracy");
    doc.para(&match (loss.first(), loss.last()) {
        (Some(a), Some(b)) => format!(
            "Training loss (mean over the global batch) went from {:.4} at step {} to {:.4} at step {}; {} test evaluation(s).",
            a.1, a.0, b.1, b.0, evals.len()
        ),
        _ => "No steps recorded.".to_string(),
    });
    let mut loss_chart = LineChart::new("training loss (global batch mean)", "step", "loss")
        .series(Series::new("training loss", PALETTE[0], loss));
    loss_chart.x_marks = restarts.clone();
    doc.figure(loss_chart.render());
    // The job's metrics (by name, as its last evaluation reports them); accuracy first when the
    // job reports one.
    let names = metric_names(evals);
    let has_accuracy = evals.iter().any(|(_, e)| e.test_accuracy.is_finite());
    let mut metric_series = Vec::new();
    if has_accuracy {
        let acc: Vec<(f64, f64)> = evals
            .iter()
            .map(|(step, e)| (*step as f64, e.test_accuracy))
            .collect();
        metric_series.push(("test accuracy".to_string(), acc));
    }
    for name in &names {
        let points: Vec<(f64, f64)> = evals
            .iter()
            .filter_map(|(step, e)| e.metrics.get(name).map(|v| (*step as f64, *v)))
            .collect();
        metric_series.push((format!("test {name}"), points));
    }
    for (i, (title, points)) in metric_series.into_iter().enumerate() {
        let color = PALETTE[(2 + i) % PALETTE.len()];
        let mut chart = LineChart::new(&title, "step", &title)
            .series(Series::new(&title, color, points).with_markers(Vec::new()));
        chart.x_marks = restarts.clone();
        doc.figure(chart.render());
    }
}

/// One row per evaluation: test loss, accuracy and the job's metrics.
fn evaluations_section(doc: &mut Doc, evals: &[(u64, Eval)]) {
    let names = metric_names(evals);
    let has_accuracy = evals.iter().any(|(_, e)| e.test_accuracy.is_finite());
    doc.section("evals", "Evaluations");
    let mut columns = vec!["step".to_string(), "test loss".to_string()];
    if has_accuracy {
        columns.push("test accuracy".into());
    }
    columns.extend(names.iter().map(|n| format!("test {n}")));
    let column_refs: Vec<&str> = columns.iter().map(String::as_str).collect();
    let mut ev = Table::new(&column_refs);
    for (step, e) in evals {
        let mut row = vec![step.to_string(), format!("{:.6}", e.test_loss)];
        if has_accuracy {
            row.push(format!("{:.4}", e.test_accuracy));
        }
        for name in &names {
            row.push(
                e.metrics
                    .get(name)
                    .map_or("—".into(), |v| format!("{v:.4}")),
            );
        }
        ev.row(row);
    }
    doc.table(&ev);
}

fn throughput_section(doc: &mut Doc, s: &Summary, records: &[StepRecord]) {
    doc.section("throughput", "Throughput");
    let thr = per_step(records, |r| r.samples_per_sec);
    let mut sorted: Vec<f64> = thr.iter().map(|p| p.1).collect();
    sorted.sort_by(|a, b| a.total_cmp(b));
    if let Some(m) = sorted.get(sorted.len() / 2) {
        doc.para(&format!(
            "Median {m:.0} samples per second per step (global batch / step wall time); {:.1} over the whole run.",
            s.samples_per_sec
        ));
    }
    doc.figure(
        LineChart::new("throughput per step", "step", "samples per second")
            .series(Series::new("samples/s", PALETTE[1], thr))
            .y_from_zero()
            .render(),
    );
}

/// Per-rank totals and time by phase.
fn ranks_section(doc: &mut Doc, s: &Summary, records: &[StepRecord], straggler: &str) {
    doc.section("ranks", "Per rank");
    let mut ranks = Table::new(&[
        "rank",
        "host",
        "device",
        "samples",
        "compute s",
        "communication s",
        "waiting s",
        "data s",
        "optimizer s",
        "device copy s",
        "checkpoint s",
        "bytes sent",
        "mean step s",
        "max step s",
    ]);
    for r in &s.ranks {
        ranks.row(vec![
            r.rank.to_string(),
            r.host.clone(),
            r.device.clone(),
            r.samples.to_string(),
            format!("{:.3}", r.compute_seconds),
            format!("{:.3}", r.communication_seconds),
            format!("{:.3}", r.waiting_seconds),
            format!("{:.3}", r.data_seconds),
            format!("{:.3}", r.optimizer_seconds),
            format!("{:.3}", r.device_copy_seconds),
            format!("{:.3}", r.checkpoint_seconds),
            r.bytes_sent.to_string(),
            format!("{:.5}", r.step_seconds_mean),
            format!("{:.5}", r.step_seconds_max),
        ]);
    }
    doc.table(&ranks);
    let pipelined = s.ranks.iter().any(|r| r.pipeline.is_some());
    let phases = &PHASES[..if pipelined { 7 } else { 6 }];
    let bars = StackedBars {
        title: "time per rank by phase (whole run)".into(),
        x_label: "seconds".into(),
        segments: phases
            .iter()
            .map(|(n, c)| (n.to_string(), c.to_string()))
            .collect(),
        rows: s
            .ranks
            .iter()
            .map(|r| {
                let mine = records.iter().filter(|x| x.rank == r.rank);
                let (f, b) = mine.fold((0.0, 0.0), |a, x| {
                    (a.0 + x.seconds.forward, a.1 + x.seconds.backward)
                });
                let mut v = vec![
                    r.data_seconds,
                    f,
                    b,
                    r.optimizer_seconds,
                    r.communication_seconds,
                    r.waiting_seconds,
                ];
                if pipelined {
                    v.push(r.pipeline.map_or(0.0, |p| p.bubble_seconds));
                }
                (format!("rank {}", r.rank), v)
            })
            .collect(),
        unit_scale: 1.0,
        unit: " s".into(),
        reference: None,
    };
    doc.figure(bars.render());
    doc.para(&format!(
        "Imbalance {:.3} (max / mean compute seconds; 1.000 = balanced); {straggler}.",
        s.imbalance
    ));
}

/// How checkpoints were written and what they stalled (nothing without checkpoints).
fn checkpoints_paragraph(doc: &mut Doc, s: &Summary) {
    if let Some(c) = &s.checkpoints {
        doc.para(&format!(
            "Checkpoints: {} taken, written {}; each stalled training {:.3} s (median; at most \
             {:.3} s){}.",
            c.count,
            match (c.background, c.sharded) {
                (true, _) => "in the background (checkpoint.async)",
                (false, true) => "in the step, a shard by every rank (checkpoint.sharded)",
                (false, false) => "in the step",
            },
            c.stall_seconds_median,
            c.stall_seconds_max,
            c.ordinary_step_seconds_median
                .map(|o| format!(" against {o:.3} s for an ordinary step"))
                .unwrap_or_default()
        ));
    }
}

/// The job's metric names, as its last evaluation reports them.
fn metric_names(evals: &[(u64, Eval)]) -> Vec<String> {
    evals
        .last()
        .map(|(_, e)| e.metrics.keys().cloned().collect())
        .unwrap_or_default()
}

/// Every rank's memory against its peak resident memory (nothing for a run recorded without
/// memory figures).
fn memory_section(doc: &mut Doc, s: &Summary, records: &[StepRecord]) {
    let rows: Vec<(String, RankMemory)> = s
        .ranks
        .iter()
        .filter_map(|r| r.memory.map(|m| (r.rank.to_string(), m)))
        .collect();
    if rows.is_empty() {
        return;
    }
    doc.section("memory", "Memory");
    doc.para(&memory::explanation());
    doc.table(&memory_table(&rows));
    doc.figure(memory::bars("memory per rank (peak)", &rows).render());
    if let Some(chart) = memory::rss_chart(s, records) {
        doc.figure(chart.render());
    }
}

/// The memory table of `(label, memory)` rows (run and scale reports).
pub(crate) fn memory_table(rows: &[(String, RankMemory)]) -> Table {
    let mut t = Table::new(&memory::TABLE_HEAD);
    for (label, m) in rows {
        t.row(memory::table_row(label, m));
    }
    t
}

/// Stages, their layers and costs, measured vs ideal bubble, per-rank pipeline totals.
fn pipeline_section(doc: &mut Doc, s: &Summary, p: &PipelineSummary) {
    doc.section("pipeline", "Pipeline");
    let (pp, m) = (p.pp, p.microbatches_per_replica);
    doc.para(&format!(
        "{} data-parallel replica(s) × {pp} pipeline stage(s), schedule {}, {m} micro-batch(es) per replica per step; stage cuts {}.",
        p.dp, p.schedule, p.cuts_from
    ));
    doc.para(&format!(
        "Bubble (idle share of the schedule): measured {:.1}%, ideal for balanced stages (p − 1) / (m + p − 1) = ({pp} − 1) / ({m} + {pp} − 1) = {:.1}%.",
        p.bubble_fraction * 100.0,
        p.ideal_bubble_fraction * 100.0
    ));
    let stage_ranks = |stage: usize| -> Vec<(usize, lockstep_run::metrics::RankPipeline)> {
        s.ranks
            .iter()
            .filter_map(|r| r.pipeline.map(|rp| (r.rank, rp)))
            .filter(|(_, rp)| rp.stage == stage)
            .collect()
    };
    let mut stages = Table::new(&[
        "stage",
        "layers [first..end)",
        "ranks",
        "compute s/step",
        "bubble fraction",
        "peak activations",
    ]);
    let mut bubble_rows = Vec::new();
    for stage in 0..pp {
        let ranks = stage_ranks(stage);
        let bubble = if ranks.is_empty() {
            f64::NAN
        } else {
            ranks.iter().map(|(_, rp)| rp.bubble_fraction).sum::<f64>() / ranks.len() as f64
        };
        let layers = p
            .stage_layers
            .get(stage)
            .map_or("?".into(), |(a, b)| format!("{a}..{b}"));
        stages.row(vec![
            stage.to_string(),
            layers.clone(),
            ranks
                .iter()
                .map(|(r, _)| r.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            p.stage_compute_seconds
                .get(stage)
                .map_or("?".into(), |v| format!("{v:.5}")),
            format!("{bubble:.3}"),
            p.peak_activations
                .get(stage)
                .map_or("?".into(), |v| v.to_string()),
        ]);
        bubble_rows.push((format!("stage {stage} ({layers})"), vec![bubble]));
    }
    doc.table(&stages);
    doc.figure(
        StackedBars {
            title: "pipeline bubble per stage: measured vs ideal".into(),
            x_label: "share of the schedule spent idle (%)".into(),
            segments: vec![("measured bubble".into(), PHASES[6].1.into())],
            rows: bubble_rows,
            unit_scale: 100.0,
            unit: "%".into(),
            reference: Some((
                p.ideal_bubble_fraction,
                format!("ideal {:.1}%", p.ideal_bubble_fraction * 100.0),
            )),
        }
        .render(),
    );
    if !p.layer_seconds.is_empty() {
        doc.para(&format!(
            "Measured cost per layer (forward + backward of one micro-batch, ms): {}.",
            p.layer_seconds
                .iter()
                .map(|v| format!("{:.3}", v * 1e3))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let mut per_rank = Table::new(&[
        "rank",
        "replica",
        "stage",
        "send s",
        "recv s",
        "bubble s",
        "schedule s",
        "bubble fraction",
        "peak activations",
        "p2p bytes",
    ]);
    for r in &s.ranks {
        if let Some(rp) = r.pipeline {
            per_rank.row(vec![
                r.rank.to_string(),
                rp.replica.to_string(),
                rp.stage.to_string(),
                format!("{:.4}", rp.send_seconds),
                format!("{:.4}", rp.recv_seconds),
                format!("{:.4}", rp.bubble_seconds),
                format!("{:.4}", rp.schedule_seconds),
                format!("{:.3}", rp.bubble_fraction),
                rp.peak_activations.to_string(),
                rp.p2p_bytes.to_string(),
            ]);
        }
    }
    doc.table(&per_rank);
}

/// Restarts, the failure list and (with failure marks) the timeline of attempts.
fn failures_section(doc: &mut Doc, s: &Summary, recovery: &Recovery, failures: &[FailureMark]) {
    doc.section("failures", "Failures and recoveries");
    if recovery.failures.is_empty() && recovery.membership.is_empty() && failures.is_empty() {
        doc.para("None.");
        return;
    }
    doc.para(&format!(
        "{} restart(s), {} step(s) recomputed.",
        recovery.restarts, recovery.steps_recomputed
    ));
    doc.list(&recovery.failures);
    if !recovery.membership.is_empty() {
        doc.para("Membership changes (each took effect at a restart from a checkpoint):");
        doc.list(&recovery.membership);
    }
    if failures.is_empty() {
        return;
    }
    let spans = attempt_spans(s, failures);
    doc.para("Steps covered by each attempt:");
    doc.list(
        &spans
            .iter()
            .map(|sp| {
                format!(
                    "{}: steps {}–{}{}",
                    sp.label,
                    sp.start,
                    sp.end,
                    sp.failure
                        .as_ref()
                        .map_or(String::new(), |f| format!(", then {f}"))
                )
            })
            .collect::<Vec<_>>(),
    );
    doc.figure(
        Timeline {
            title: "attempts: steps covered, failures (×) and where each restart resumed".into(),
            x_label: "step".into(),
            x_max: s.steps as f64,
            spans,
        }
        .render(),
    );
}

/// The steps each attempt covered: attempt 0 from step 0, each later one from the step its
/// predecessor's restart resumed from; each failed attempt ends at the last step it completed.
fn attempt_spans(s: &Summary, failures: &[FailureMark]) -> Vec<Span> {
    let mut marks = failures.to_vec();
    marks.sort_by_key(|f| f.attempt);
    let mut spans = Vec::new();
    let mut start = 0u64;
    for f in &marks {
        let end = f.step.unwrap_or(start).max(start);
        spans.push(Span {
            label: format!("attempt {} ({} workers)", f.attempt, f.world_size),
            start: start as f64,
            end: end as f64,
            colour: PALETTE[spans.len() % 2 * 5].into(),
            failure: Some(
                format!(
                    "{} {} at step {end}",
                    f.who,
                    f.what.split(" (").next().unwrap_or(&f.what)
                )
                .trim_start()
                .to_string(),
            ),
        });
        match f.resumed_from {
            Some(from) => start = from,
            None => return spans,
        }
    }
    spans.push(Span {
        label: format!(
            "attempt {} ({} workers)",
            marks.last().map_or(0, |f| f.attempt + 1),
            s.world_size
        ),
        start: start as f64,
        end: s.steps as f64,
        colour: PALETTE[2].into(),
        failure: None,
    });
    spans
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::svg::well_formed;
    use lockstep_run::metrics::{
        Eval, PhaseSeconds, PipelineStep, RankPipeline, RankSummary, StepRecord,
    };

    fn records(world: usize, steps: u64) -> Vec<StepRecord> {
        (0..steps)
            .flat_map(|step| {
                (0..world).map(move |rank| StepRecord {
                    rank,
                    step,
                    loss: 2.0 / (step + 1) as f64,
                    lr: 0.1,
                    samples: 8,
                    samples_per_sec: 1000.0 + step as f64,
                    step_seconds: 0.01,
                    seconds: PhaseSeconds {
                        forward: 0.003,
                        backward: 0.004,
                        communication: 0.002,
                        ..Default::default()
                    },
                    bytes_sent: 100,
                    // Evaluations every 5 steps, as the trainer records them on every rank.
                    eval: ((step + 1) % 5 == 0).then(|| Eval {
                        test_loss: 1.0 / (step + 1) as f64,
                        test_accuracy: 0.5 + step as f64 / 100.0,
                        ..Default::default()
                    }),
                    pipeline: None,
                    rss_bytes: Some((300 + rank as u64 * 10 + step) << 20),
                    grad_norm: None,
                    train_metrics: Default::default(),
                })
            })
            .collect()
    }

    fn rank(r: usize) -> RankSummary {
        RankSummary {
            rank: r,
            host: "h<1>".into(),
            device: String::new(),
            samples: 80,
            compute_seconds: 0.07,
            communication_seconds: 0.02,
            waiting_seconds: 0.0,
            data_seconds: 0.0,
            optimizer_seconds: 0.001,
            overlapped_communication_seconds: 0.0,
            device_copy_seconds: 0.0,
            checkpoint_seconds: 0.0,
            bytes_sent: 1000,
            step_seconds_mean: 0.01,
            step_seconds_max: 0.012,
            pipeline: None,
            memory: Some(RankMemory {
                params_bytes: 4 << 20,
                grads_bytes: 16 << 20,
                optimizer_bytes: 8 << 20,
                activation_peak_bytes: 2 << 20,
                peak_rss_bytes: (300 + 10 * r as u64) << 20,
            }),
        }
    }

    fn summary() -> Summary {
        Summary {
            job: String::new(),
            world_size: 2,
            steps: 10,
            global_batch: 16,
            microbatch: 8,
            reproducible: true,
            transport: "shm".into(),
            final_loss: 0.2,
            test_loss: 0.1,
            test_accuracy: 0.59,
            test_metrics: Default::default(),
            param_hash: "abc123".into(),
            config_hash: "c".into(),
            wall_seconds: 0.5,
            samples_per_sec: 320.0,
            imbalance: 1.0,
            straggler: None,
            bytes_sent_total: 2000,
            communication_fraction: 0.2,
            // The final attempt only (it resumed at step 6): the report must not rely on it.
            evals: vec![(
                10,
                Eval {
                    test_loss: 0.1,
                    test_accuracy: 0.59,
                    ..Default::default()
                },
            )],
            ranks: vec![rank(0), rank(1)],
            pipeline: None,
            compute: Default::default(),
            gradient_sum: None,
            param_gathering: None,
            layers_prefetched: None,
            plan: None,
            checkpoints: Some(lockstep_run::metrics::CheckpointSummary {
                background: false,
                sharded: true,
                count: 2,
                stall_seconds_median: 0.3,
                stall_seconds_max: 0.4,
                ordinary_step_seconds_median: Some(0.01),
            }),
        }
    }

    #[test]
    fn the_headline_shows_the_plan_the_run_followed() {
        let mut summary = summary();
        let (without, _) =
            render_with_failures(&summary, &records(2, 10), &Recovery::default(), &[]);
        assert!(
            !without.contains("| plan |"),
            "a summary without a plan shows none"
        );
        summary.plan = Some(lockstep_run::ParallelPlan {
            world: 2,
            dp: 2,
            tp: 1,
            pp: 1,
            zero: 3,
            microbatches: 4,
            microbatches_per_replica: 2,
            schedule: None,
            tp_pieces: 1,
            overlap: false,
            exact_sum: true,
            bf16_products: true,
        });
        let (md, _) = render_with_failures(&summary, &records(2, 10), &Recovery::default(), &[]);
        assert!(
            md.contains("| plan | dp 2 × tp 1 × pp 1, ZeRO 3, exact sum, bf16 products |"),
            "{md}"
        );
    }

    #[test]
    fn every_section_is_present_and_numbers_match_the_summary() {
        let summary = summary();
        let recovery = Recovery {
            restarts: 1,
            steps_recomputed: 4,
            failures: vec!["attempt 0: rank 1 killed".into()],
            membership: vec!["after attempt 0: node 1 (h1) lost, world 4 -> 2".into()],
        };
        let marks = [FailureMark {
            attempt: 0,
            who: "rank 1".into(),
            world_size: 2,
            what: "killed by signal 9 (SIGKILL)".into(),
            step: Some(8),
            resumed_from: Some(4),
        }];
        let (md, html) = render_with_failures(&summary, &records(2, 10), &recovery, &marks);
        for needle in [
            "| test accuracy | 0.5900 |",
            "| test loss | 0.100000 |",
            "| final training loss | 0.200000 |",
            "| samples per second | 320.0 |",
            "| world size | 2 |",
            "| parameter hash (SHA-256) | `abc123` |",
            "| restarts | 1 |",
            "| steps recomputed | 4 |",
            "| 0 | h<1> |  | 80 | 0.070 | 0.020 | 0.000 | 0.000 | 0.001 | 0.000 | 0.000 | 1000 | 0.01000 | 0.01200 |",
            "Checkpoints: 2 taken, written in the step, a shard by every rank \
             (checkpoint.sharded); each stalled training 0.300 s (median; at most 0.400 s) \
             against 0.010 s for an ordinary step.",
            "## Per rank",
            "## Evaluations",
            "## Failures and recoveries",
            "attempt 0: rank 1 killed",
            "Membership changes (each took effect at a restart from a checkpoint):",
            "after attempt 0: node 1 (h1) lost, world 4 -> 2",
            // Evaluations of both attempts, from the records; the last equals summary.json's.
            "| 5 | 0.200000 | 0.5400 |",
            "| 10 | 0.100000 | 0.5900 |",
            "1 restart(s), 4 step(s) recomputed.",
            "- attempt 0 (2 workers): steps 0–8, then rank 1 killed by signal 9 at step 8",
            "- attempt 1 (2 workers): steps 4–10",
            // Memory per rank: 30 MiB of model state, goal 1.5 × 30 + 512 MiB.
            "## Memory",
            "| 0 | 4.0 | 16.0 | 8.0 | 2.0 | 30.0 | 300.0 | 557.0 | yes |",
            "| 1 | 4.0 | 16.0 | 8.0 | 2.0 | 30.0 | 310.0 | 557.0 | yes |",
        ] {
            assert!(md.contains(needle), "report.md lacks {needle:?}:\n{md}");
        }
        assert!(
            !md.contains("## Pipeline"),
            "no pipeline section without a pipeline"
        );
        for id in [
            "id=\"headline\"",
            "id=\"loss\"",
            "id=\"evals\"",
            "id=\"throughput\"",
            "id=\"ranks\"",
            "id=\"failures\"",
            "id=\"memory\"",
            "aria-label=\"resident memory per step\"",
            "<polyline",
            "<rect",
            "<code>abc123</code>",
            "<td>0.5900</td>",
            "<td>0.5400</td>",
            "resumed from 4",
            "restart 1",
        ] {
            assert!(html.contains(id), "report.html lacks {id:?}");
        }
        assert!(
            html.contains("h&lt;1&gt;") && !html.contains("h<1>"),
            "text is escaped"
        );
        well_formed(&html).unwrap();
        // The accuracy curve has one dot per evaluation of every attempt (steps 5 and 10).
        let acc = html
            .split("<svg")
            .find(|svg| svg.contains("aria-label=\"test accuracy\""))
            .expect("accuracy chart");
        assert_eq!(acc.matches("<circle").count(), 2, "{acc}");
    }

    #[test]
    fn without_failures_the_section_says_none_and_evals_fall_back_to_the_summary() {
        let mut recs = records(1, 10);
        for r in &mut recs {
            r.eval = None; // metrics.jsonl written before evaluations were recorded per step
        }
        let mut s = summary();
        s.ranks.truncate(1);
        let (md, html) = render(&s, &recs, &Recovery::default());
        assert!(md.contains("## Failures and recoveries\n\nNone."), "{md}");
        assert!(md.contains("| 10 | 0.100000 | 0.5900 |"), "{md}");
        assert!(!md.contains("| 5 |"), "{md}");
        well_formed(&html).unwrap();
    }

    #[test]
    fn the_pipeline_section_shows_stages_bubble_and_per_rank_totals() {
        let mut s = summary();
        s.world_size = 4;
        let rp = |stage: usize, replica: usize, bubble: f64| RankPipeline {
            stage,
            replica,
            send_seconds: 0.01 * (stage + 1) as f64,
            recv_seconds: 0.02,
            bubble_seconds: bubble,
            schedule_seconds: 1.0,
            bubble_fraction: bubble,
            peak_activations: 2 - stage,
            p2p_bytes: 4096,
        };
        s.ranks = (0..4)
            .map(|r| {
                let mut x = rank(r);
                x.pipeline = Some(rp(r % 2, r / 2, 0.2 + 0.1 * r as f64));
                x
            })
            .collect();
        s.pipeline = Some(PipelineSummary {
            dp: 2,
            pp: 2,
            microbatches_per_replica: 4,
            schedule: "1f1b".into(),
            stage_layers: vec![(0, 3), (3, 6)],
            cuts_from: "auto".into(),
            layer_seconds: vec![0.001, 0.002, 0.0015, 0.001, 0.002, 0.0005],
            bubble_fraction: 0.35,
            ideal_bubble_fraction: 0.2,
            peak_activations: vec![2, 1],
            stage_compute_seconds: vec![0.0123, 0.0111],
        });
        let mut recs = records(4, 10);
        for r in &mut recs {
            r.pipeline = Some(PipelineStep {
                stage: r.rank % 2,
                ..Default::default()
            });
        }
        let (md, html) = render(&s, &recs, &Recovery::default());
        for needle in [
            "## Pipeline",
            "2 data-parallel replica(s) × 2 pipeline stage(s), schedule 1f1b, 4 micro-batch(es) per replica per step; stage cuts auto.",
            "measured 35.0%, ideal for balanced stages (p − 1) / (m + p − 1) = (2 − 1) / (4 + 2 − 1) = 20.0%",
            // Stage 0 is ranks 0 and 2 (bubble 0.2 and 0.4: mean 0.3).
            "| 0 | 0..3 | 0, 2 | 0.01230 | 0.300 | 2 |",
            "| 1 | 3..6 | 1, 3 | 0.01110 | 0.400 | 1 |",
            "| 3 | 1 | 1 | 0.0200 | 0.0200 | 0.5000 | 1.0000 | 0.500 | 1 | 4096 |",
            "1.000, 2.000, 1.500, 1.000, 2.000, 0.500",
        ] {
            assert!(md.contains(needle), "report.md lacks {needle:?}:\n{md}");
        }
        for needle in [
            "id=\"pipeline\"",
            "pipeline bubble",
            "ideal 20.0%",
            "stage 1 (3..6)",
        ] {
            assert!(html.contains(needle), "report.html lacks {needle:?}");
        }
        well_formed(&html).unwrap();
    }

    #[test]
    fn attempts_chain_from_each_resume_point() {
        let mut s = summary();
        s.steps = 200;
        s.world_size = 3;
        let mark = |attempt, world_size, step, from| FailureMark {
            attempt,
            who: "rank 1".into(),
            world_size,
            what: "killed".into(),
            step,
            resumed_from: from,
        };
        let spans = attempt_spans(
            &s,
            &[
                mark(1, 4, Some(150), Some(150)),
                mark(0, 4, Some(120), Some(100)),
            ],
        );
        let got: Vec<(f64, f64, bool)> = spans
            .iter()
            .map(|sp| (sp.start, sp.end, sp.failure.is_some()))
            .collect();
        assert_eq!(
            got,
            vec![
                (0.0, 120.0, true),
                (100.0, 150.0, true),
                (150.0, 200.0, false)
            ]
        );
        assert_eq!(spans[2].label, "attempt 2 (3 workers)");
        // A failure that was not restarted ends the timeline.
        let spans = attempt_spans(&s, &[mark(0, 4, None, None)]);
        assert_eq!(spans.len(), 1);
        assert_eq!((spans[0].start, spans[0].end), (0.0, 0.0));
    }
}
