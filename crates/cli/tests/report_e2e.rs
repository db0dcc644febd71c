//! End-to-end: a real `lockstep scale` sweep (digits, 1 and 2 workers) and the reports it writes.
//! The numbers in `scale_report.md` must be those of `scale.json` and of each run's
//! `summary.json`; both HTML reports must be well-formed and self-contained.

use std::path::Path;

mod common;
use common::{assert_ok, lockstep, summary};
use lockstep_report::svg::well_formed;

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn a_sweep_writes_reports_whose_numbers_are_the_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("sweep");
    let o = lockstep(&[
        "scale",
        "--nproc",
        "1,2",
        "--set",
        "train.steps=30",
        "--set",
        "train.eval_every=10",
        "--out",
        out.to_str().unwrap(),
    ])
    .output()
    .expect("spawn lockstep");
    assert_ok(&o);
    let stderr = String::from_utf8_lossy(&o.stderr);
    for progress in ["run 1/2: dp-1 (1 worker)", "run 2/2: dp-2 (2 workers)"] {
        assert!(
            stderr.contains(progress),
            "no progress line {progress:?}:\n{stderr}"
        );
    }

    let scale: serde_json::Value = serde_json::from_str(&read(&out.join("scale.json"))).unwrap();
    let md = read(&out.join("scale_report.md"));
    let html = read(&out.join("scale_report.html"));
    for h in [
        "## Verdict",
        "## Speedup and efficiency",
        "## Time per step by phase",
        "## Loss curves",
        "## Final metrics",
        "## Reproducibility",
    ] {
        assert!(md.contains(h), "scale_report.md lacks {h}:\n{md}");
    }
    for id in ["verdict", "speedup", "breakdown", "loss", "final", "hashes"] {
        assert!(
            html.contains(&format!("<section id=\"{id}\">")),
            "html lacks {id}"
        );
    }
    well_formed(&html).unwrap_or_else(|e| panic!("scale_report.html: {e}"));

    let points = scale["points"].as_array().expect("points");
    assert_eq!(points.len(), 2);
    for (p, v) in points.iter().zip(scale["verdict"].as_array().unwrap()) {
        let label = p["label"].as_str().unwrap();
        let run = summary(&out.join(label));
        // scale.json carries the run's own figures …
        for key in [
            "final_loss",
            "test_loss",
            "test_accuracy",
            "wall_seconds",
            "param_hash",
        ] {
            assert_eq!(p[key], run[key], "{label}: scale.json {key} ≠ summary.json");
        }
        assert_eq!(p["world_size"], run["world_size"]);
        // … and the report prints exactly those.
        let hash = run["param_hash"].as_str().unwrap();
        let row = format!(
            "| {label} | {} | {:.6} | {:.6} | {:.4} | {:.1} | {:.3} | `{}` | yes |",
            run["world_size"],
            f(&run["final_loss"]),
            f(&run["test_loss"]),
            f(&run["test_accuracy"]),
            f(&p["samples_per_sec"]),
            f(&run["wall_seconds"]),
            &hash[..12]
        );
        assert!(md.contains(&row), "scale_report.md lacks {row:?}:\n{md}");
        let speed = format!(
            "| {label} | {} | {} × {} × {} | {:.3} | {:.1} | {:.2}× | {:.1}% |",
            p["world_size"],
            p["dp"],
            p["tp"],
            p["pp"],
            f(&p["median_step_seconds"]) * 1e3,
            f(&p["samples_per_sec"]),
            f(&p["speedup"]),
            f(&p["efficiency"]) * 100.0
        );
        assert!(
            md.contains(&speed),
            "scale_report.md lacks {speed:?}:\n{md}"
        );
        assert!(md.contains(&format!("- {}", v.as_str().unwrap())));
        assert!(html.contains(&format!("<td>{label}</td>")));

        // Each run has its own report, equal to its summary.json.
        let run_md = read(&out.join(label).join("report.md"));
        for needle in [
            format!("| test accuracy | {:.4} |", f(&run["test_accuracy"])),
            format!("| final training loss | {:.6} |", f(&run["final_loss"])),
            format!("| parameter hash (SHA-256) | `{hash}` |"),
            // Evaluations every 10 steps, from metrics.jsonl.
            "| 10 |".to_string(),
            "| 20 |".to_string(),
            format!(
                "| 30 | {:.6} | {:.4} |",
                f(&run["test_loss"]),
                f(&run["test_accuracy"])
            ),
        ] {
            assert!(
                run_md.contains(&needle),
                "{label}/report.md lacks {needle:?}:\n{run_md}"
            );
        }
        well_formed(&read(&out.join(label).join("report.html")))
            .unwrap_or_else(|e| panic!("{label}/report.html: {e}"));
    }
    // Digits is reproducible by default: the same bits on 1 and 2 workers.
    assert_eq!(scale["hashes_agree"], true);
    assert!(md.contains("Same result: all 2 runs ended with the same parameter hash"));
    assert!(md.contains(scale["headline"].as_str().unwrap()));
    assert!(md.contains("All 2 loss curves are identical"), "{md}");
}

#[test]
fn a_bad_layout_fails_before_any_run() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("sweep");
    // The default MLP has 3 layers: 4 stages are one too many.
    for (layouts, needle) in [("dp,pp", "parallel.pp"), ("dp,dp2x2", "layout `dp2x2`")] {
        let o = lockstep(&[
            "scale",
            "--nproc",
            "1,4",
            "--layouts",
            layouts,
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .expect("spawn lockstep");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "--layouts {layouts} was accepted");
        assert!(err.contains(needle), "--layouts {layouts}: {err}");
        assert!(
            !out.join("dp-1").exists(),
            "a run started before the layouts were checked"
        );
    }
}

/// `lockstep scale --layouts dp,tp` on a small transformer split into 4 pieces: the tp run has
/// its row (dp × tp × pp), its ranks' memory rows and bars, its curve on the speedup chart, and
/// the same parameter hash as the data-parallel runs (same `model.tp_pieces`).
#[test]
fn a_sweep_with_a_tensor_parallel_layout_reports_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("sweep");
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/shakespeare.toml"
    );
    let mut args = vec![
        "scale",
        "--config",
        config,
        "--nproc",
        "1,2",
        "--layouts",
        "dp,tp",
        "--out",
        out.to_str().unwrap(),
    ];
    for s in [
        "model.d_model=32",
        "model.heads=4",
        "model.blocks=2",
        "model.context=16",
        "model.d_ff=64",
        "model.tp_pieces=4",
        "train.global_batch=8",
        "parallel.microbatches=4",
        "train.steps=6",
        "train.eval_every=3",
        "checkpoint.every=0",
    ] {
        args.extend_from_slice(&["--set", s]);
    }
    let o = lockstep(&args).output().expect("spawn lockstep");
    assert_ok(&o);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains("run 3/3: tp-2 (2 workers: 1 replica(s) × 2 tensor-parallel ranks)"),
        "{stderr}"
    );
    let scale: serde_json::Value = serde_json::from_str(&read(&out.join("scale.json"))).unwrap();
    let tp = &scale["points"][2];
    assert_eq!(
        (tp["label"].as_str(), tp["dp"].as_u64(), tp["tp"].as_u64()),
        (Some("tp-2"), Some(1), Some(2))
    );
    let md = read(&out.join("scale_report.md"));
    let html = read(&out.join("scale_report.html"));
    for needle in [
        "| tp-2 | 2 | 1 × 2 × 1 |",
        "| tp-2 rank 0 |",
        "| tp-2 rank 1 |",
    ] {
        assert!(
            md.contains(needle),
            "scale_report.md lacks {needle:?}:\n{md}"
        );
    }
    assert!(html.contains(">tensor parallel</text>"), "no tp curve");
    let memory = &html[html
        .find("<section id=\"memory\">")
        .expect("memory section")..];
    assert!(memory[..memory.find("</section>").unwrap()].contains("tp-2 rank 1"));
    well_formed(&html).unwrap();
    // The tp ranks hold a share of the split matrices: fewer parameter bytes than one worker.
    let bytes = |label: &str, rank: usize| {
        summary(&out.join(label))["ranks"][rank]["memory"]["params_bytes"]
            .as_u64()
            .unwrap()
    };
    assert!(bytes("tp-2", 1) < bytes("dp-1", 0));
    assert_eq!(scale["hashes_agree"], true, "{}", scale["points"]);
}
