//! The run report: `report.md` and a self-contained `report.html` (inline SVG, no external assets)
//! written next to `summary.json`, from the same numbers.
//!
//! Sections: headline figures, loss curve (and test accuracy), throughput over time, per-rank time
//! breakdown as stacked bars, load balance and straggler, communication volume, reproducibility
//! (the parameter hash), failures and recoveries.

use std::fmt::Write as _;

use crate::metrics::{StepRecord, Summary};

/// Extra facts the launcher knows (restarts and failures), as JSON values from summary.json.
#[derive(Debug, Default, Clone)]
pub struct Recovery {
    pub restarts: u64,
    pub steps_recomputed: u64,
    /// One line per failure.
    pub failures: Vec<String>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A polyline chart of `(x, y)` series, each with a colour and a label.
fn line_chart(title: &str, x_label: &str, series: &[(&str, &str, Vec<(f64, f64)>)]) -> String {
    let (w, h, pad) = (640.0, 260.0, 48.0);
    let pts: Vec<&(f64, f64)> = series
        .iter()
        .flat_map(|s| s.2.iter())
        .filter(|p| p.0.is_finite() && p.1.is_finite())
        .collect();
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" aria-label="{}">"#,
        esc(title)
    );
    let _ = write!(
        svg,
        r#"<text x="{}" y="16" font-size="13" text-anchor="middle">{}</text>"#,
        w / 2.0,
        esc(title)
    );
    if pts.is_empty() {
        svg += r#"<text x="20" y="60" font-size="12">no data</text></svg>"#;
        return svg;
    }
    let (x0, x1) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.0), a.1.max(p.0)));
    let (y0, y1) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.1), a.1.max(p.1)));
    let (y0, y1) = if y1 > y0 {
        (y0.min(0.0), y1)
    } else {
        (y0 - 1.0, y1 + 1.0)
    };
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let sx = |x: f64| pad + (x - x0) / (x1 - x0) * (w - 2.0 * pad);
    let sy = |y: f64| h - pad - (y - y0) / (y1 - y0) * (h - 2.0 * pad);
    let _ = write!(
        svg,
        r##"<line x1="{pad}" y1="{}" x2="{}" y2="{}" stroke="#444"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{}" stroke="#444"/>"##,
        h - pad,
        w - pad,
        h - pad,
        h - pad
    );
    let _ = write!(
        svg,
        r#"<text x="{}" y="{}" font-size="11" text-anchor="middle">{}</text>"#,
        w / 2.0,
        h - 10.0,
        esc(x_label)
    );
    for (v, y) in [(y0, sy(y0)), (y1, sy(y1))] {
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" font-size="10" text-anchor="end">{v:.3}</text>"#,
            pad - 4.0,
            y + 3.0
        );
    }
    for (v, x) in [(x0, sx(x0)), (x1, sx(x1))] {
        let _ = write!(
            svg,
            r#"<text x="{x}" y="{}" font-size="10" text-anchor="middle">{v:.0}</text>"#,
            h - pad + 14.0
        );
    }
    for (i, (label, colour, data)) in series.iter().enumerate() {
        let path: Vec<String> = data
            .iter()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .map(|p| format!("{:.1},{:.1}", sx(p.0), sy(p.1)))
            .collect();
        let _ = write!(
            svg,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{}"/>"#,
            path.join(" ")
        );
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" font-size="11" fill="{colour}">{}</text>"#,
            w - pad - 150.0,
            pad + 14.0 * i as f64,
            esc(label)
        );
    }
    svg + "</svg>"
}

/// Stacked horizontal bars: one per rank, segments per phase.
fn stacked_bars(title: &str, rows: &[(String, Vec<f64>)], phases: &[(&str, &str)]) -> String {
    let (w, bar, pad_l) = (640.0, 22.0, 80.0);
    let h = 40.0 + rows.len() as f64 * (bar + 8.0) + 24.0;
    let max: f64 = rows
        .iter()
        .map(|r| r.1.iter().sum::<f64>())
        .fold(0.0, f64::max)
        .max(1e-12);
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" aria-label="{}">"#,
        esc(title)
    );
    let _ = write!(
        svg,
        r#"<text x="{}" y="16" font-size="13" text-anchor="middle">{}</text>"#,
        w / 2.0,
        esc(title)
    );
    for (i, (name, vals)) in rows.iter().enumerate() {
        let y = 30.0 + i as f64 * (bar + 8.0);
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" font-size="11" text-anchor="end">{}</text>"#,
            pad_l - 6.0,
            y + 15.0,
            esc(name)
        );
        let mut x = pad_l;
        for (v, (_, colour)) in vals.iter().zip(phases) {
            let width = v / max * (w - pad_l - 20.0);
            let _ = write!(
                svg,
                r#"<rect x="{x:.1}" y="{y}" width="{width:.1}" height="{bar}" fill="{colour}"/>"#
            );
            x += width;
        }
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{}" font-size="10">{:.2}s</text>"#,
            x + 4.0,
            y + 15.0,
            vals.iter().sum::<f64>()
        );
    }
    let ly = h - 10.0;
    for (i, (label, colour)) in phases.iter().enumerate() {
        let x = pad_l + i as f64 * 95.0;
        let _ = write!(
            svg,
            r#"<rect x="{x}" y="{}" width="10" height="10" fill="{colour}"/><text x="{}" y="{ly}" font-size="10">{label}</text>"#,
            ly - 9.0,
            x + 14.0
        );
    }
    svg + "</svg>"
}

const PHASES: [(&str, &str); 6] = [
    ("data", "#9e9e9e"),
    ("forward", "#42a5f5"),
    ("backward", "#1565c0"),
    ("optimizer", "#66bb6a"),
    ("communication", "#ef6c00"),
    ("waiting", "#e53935"),
];

/// `(markdown, html)` for a finished run.
pub fn render(summary: &Summary, records: &[StepRecord], recovery: &Recovery) -> (String, String) {
    let s = summary;
    let rank0: Vec<&StepRecord> = records.iter().filter(|r| r.rank == 0).collect();
    let loss: Vec<(f64, f64)> = rank0
        .iter()
        .map(|r| (r.step as f64 + 1.0, r.loss))
        .collect();
    let acc: Vec<(f64, f64)> = s
        .evals
        .iter()
        .map(|(step, e)| (*step as f64, e.test_accuracy))
        .collect();
    let thr: Vec<(f64, f64)> = rank0
        .iter()
        .map(|r| (r.step as f64 + 1.0, r.samples_per_sec))
        .collect();
    let per_rank: Vec<(String, Vec<f64>)> = s
        .ranks
        .iter()
        .map(|r| {
            let fwd_bwd: Vec<&StepRecord> = records.iter().filter(|x| x.rank == r.rank).collect();
            let f: f64 = fwd_bwd.iter().map(|x| x.seconds.forward).sum();
            let b: f64 = fwd_bwd.iter().map(|x| x.seconds.backward).sum();
            (
                format!("rank {}", r.rank),
                vec![
                    r.data_seconds,
                    f,
                    b,
                    r.optimizer_seconds,
                    r.communication_seconds,
                    r.waiting_seconds,
                ],
            )
        })
        .collect();
    let bandwidth = if s.wall_seconds > 0.0 {
        s.bytes_sent_total as f64 / s.wall_seconds / 1e9
    } else {
        0.0
    };
    let straggler = match s.straggler {
        Some(r) => format!("rank {r} is a straggler"),
        None => "no straggler".to_string(),
    };

    let mut md = String::new();
    let _ = writeln!(md, "# lockstep run report\n");
    let _ = writeln!(md, "| figure | value |\n|---|---|");
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
        ("straggler", straggler.clone()),
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
        let _ = writeln!(md, "| {k} | {v} |");
    }
    let _ = writeln!(md, "\n## Per rank\n\n| rank | host | samples | compute s | communication s | waiting s | data s | optimizer s | bytes sent | mean step s | max step s |\n|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &s.ranks {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {:.5} | {:.5} |",
            r.rank,
            r.host,
            r.samples,
            r.compute_seconds,
            r.communication_seconds,
            r.waiting_seconds,
            r.data_seconds,
            r.optimizer_seconds,
            r.bytes_sent,
            r.step_seconds_mean,
            r.step_seconds_max
        );
    }
    let _ = writeln!(
        md,
        "\n## Evaluations\n\n| step | test loss | test accuracy |\n|---|---|---|"
    );
    for (step, e) in &s.evals {
        let _ = writeln!(
            md,
            "| {step} | {:.6} | {:.4} |",
            e.test_loss, e.test_accuracy
        );
    }
    let _ = writeln!(md, "\n## Failures and recoveries\n");
    if recovery.failures.is_empty() {
        let _ = writeln!(md, "None.");
    }
    for f in &recovery.failures {
        let _ = writeln!(md, "- {f}");
    }

    let mut html = String::from("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>lockstep run report</title><style>body{font-family:sans-serif;max-width:900px;margin:2em auto}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}section{margin:1.5em 0}</style></head><body>");
    html += "<h1>lockstep run report</h1>";
    html += &markdown_table_to_html(&md);
    let _ = write!(
        html,
        "<section id=\"loss\"><h2>Loss and accuracy</h2>{}{}</section>",
        line_chart(
            "training loss (global batch mean)",
            "step",
            &[("loss", "#1565c0", loss)]
        ),
        line_chart("test accuracy", "step", &[("accuracy", "#2e7d32", acc)])
    );
    let _ = write!(
        html,
        "<section id=\"throughput\"><h2>Throughput</h2>{}</section>",
        line_chart(
            "samples per second",
            "step",
            &[("samples/s", "#ef6c00", thr)]
        )
    );
    let _ = write!(
        html,
        "<section id=\"ranks\"><h2>Time per rank</h2>{}<p>Imbalance {:.3}; {}.</p></section>",
        stacked_bars("seconds by phase", &per_rank, &PHASES),
        s.imbalance,
        esc(&straggler)
    );
    let _ = write!(html, "<section id=\"failures\"><h2>Failures and recoveries</h2><p>{} restart(s), {} step(s) recomputed.</p><ul>{}</ul></section>", recovery.restarts, recovery.steps_recomputed, recovery.failures.iter().map(|f| format!("<li>{}</li>", esc(f))).collect::<String>());
    html += "</body></html>\n";
    (md, html)
}

/// The markdown tables of `md` as HTML tables (headings as h2).
fn markdown_table_to_html(md: &str) -> String {
    let mut out = String::new();
    let mut in_table = false;
    for line in md.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            if in_table {
                out += "</table>";
                in_table = false;
            }
            let _ = write!(out, "<h2>{}</h2>", esc(h));
        } else if line.starts_with('|') {
            if line.starts_with("|---") {
                continue;
            }
            if !in_table {
                out += "<table>";
                in_table = true;
            }
            let cells: Vec<String> = line
                .trim_matches('|')
                .split(" | ")
                .map(|c| format!("<td>{}</td>", esc(c.trim().trim_matches('`'))))
                .collect();
            let _ = write!(out, "<tr>{}</tr>", cells.concat());
        } else if in_table {
            out += "</table>";
            in_table = false;
        } else if let Some(item) = line.strip_prefix("- ") {
            let _ = write!(out, "<p>{}</p>", esc(item));
        } else if line == "None." {
            out += "<p>None.</p>";
        }
    }
    if in_table {
        out += "</table>";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Eval, PhaseSeconds, RankSummary};

    #[test]
    fn every_section_is_present_and_numbers_match_the_summary() {
        let records: Vec<StepRecord> = (0..10)
            .flat_map(|step| {
                (0..2).map(move |rank| StepRecord {
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
                    eval: None,
                    pipeline: None,
                })
            })
            .collect();
        let rank = |r: usize| RankSummary {
            rank: r,
            host: "h<1>".into(),
            samples: 80,
            compute_seconds: 0.07,
            communication_seconds: 0.02,
            waiting_seconds: 0.0,
            data_seconds: 0.0,
            optimizer_seconds: 0.001,
            overlapped_communication_seconds: 0.0,
            bytes_sent: 1000,
            step_seconds_mean: 0.01,
            step_seconds_max: 0.012,
            pipeline: None,
        };
        let summary = Summary {
            world_size: 2,
            steps: 10,
            global_batch: 16,
            microbatch: 8,
            reproducible: true,
            transport: "shm".into(),
            final_loss: 0.2,
            test_loss: 0.3,
            test_accuracy: 0.9125,
            param_hash: "abc123".into(),
            config_hash: "c".into(),
            wall_seconds: 0.5,
            samples_per_sec: 320.0,
            imbalance: 1.0,
            straggler: None,
            bytes_sent_total: 2000,
            communication_fraction: 0.2,
            evals: vec![(
                10,
                Eval {
                    test_loss: 0.3,
                    test_accuracy: 0.9125,
                },
            )],
            ranks: vec![rank(0), rank(1)],
            pipeline: None,
        };
        let recovery = Recovery {
            restarts: 1,
            steps_recomputed: 4,
            failures: vec!["attempt 0: rank 1 killed".into()],
        };
        let (md, html) = render(&summary, &records, &recovery);
        for needle in [
            "| test accuracy | 0.9125 |",
            "| parameter hash (SHA-256) | `abc123` |",
            "| restarts | 1 |",
            "| steps recomputed | 4 |",
            "## Per rank",
            "## Evaluations",
            "## Failures and recoveries",
            "attempt 0: rank 1 killed",
            "| 10 | 0.300000 | 0.9125 |",
        ] {
            assert!(md.contains(needle), "report.md lacks {needle:?}:\n{md}");
        }
        for id in [
            "id=\"loss\"",
            "id=\"throughput\"",
            "id=\"ranks\"",
            "id=\"failures\"",
            "<polyline",
            "<rect",
            "abc123",
            "0.9125",
        ] {
            assert!(html.contains(id), "report.html lacks {id:?}");
        }
        assert!(
            html.contains("h&lt;1&gt;") && !html.contains("h<1>"),
            "text is escaped"
        );
        assert!(
            !html.contains("http://") || !html.contains("src="),
            "no external assets"
        );
    }
}
