//! Tensor parallelism end to end on a small transformer split into `model.tp_pieces = 4` fixed
//! pieces per block: tp2, tp4, tp2×pp2, dp2×tp2, dp2×tp2 at ZeRO 3 and dp2 recomputing its
//! layers end with the one-worker run's parameters, loss and validation curve, bit for bit; bad
//! layouts are refused before any worker starts; a killed tp rank recovers; a tp2×pp2 checkpoint
//! resumes on one worker, and a one-worker checkpoint as tp4, with the same bits.

use std::path::Path;
use std::process::Output;

mod common;
use common::{assert_ok, lockstep, param_hash as hash, summary, train_transformer};

/// A 4-layer model (embedding, 2 blocks of 4 heads, head), 4 micro-batches of 2 sequences.
const TINY: &[&str] = &[
    "model.d_model=32",
    "model.heads=4",
    "model.blocks=2",
    "model.context=16",
    "model.d_ff=64",
    "train.global_batch=8",
    "parallel.microbatches=4",
    "train.steps=6",
    "train.eval_every=3",
    "train.log_every=1",
    "checkpoint.every=2",
    // configs/shakespeare.toml is a 2-stage pipeline; the layouts below set their own.
    "parallel.pp=1",
];

fn train(out: &Path, nproc: &str, sets: &[&str], extra: &[&str]) -> Output {
    train_transformer(out, nproc, TINY, sets, extra)
}

fn ok(o: Output) -> Output {
    assert_ok(&o);
    o
}

/// Train with `sets` until `kill` stops it (no restarts), then resume on `nproc` workers with
/// `resume`; the resumed run's standard error.
fn stop_then_resume(
    dir: &Path,
    sets: &[&str],
    kill: (&str, &str),
    nproc: &str,
    resume: &[&str],
) -> String {
    let (first_nproc, fault) = kill;
    let o = train(
        dir,
        first_nproc,
        sets,
        &["--inject", fault, "--max-restarts", "0"],
    );
    assert!(!o.status.success());
    let mut args = vec!["train", "--resume", dir.to_str().unwrap(), "--nproc", nproc];
    for s in resume {
        args.extend_from_slice(&["--set", s]);
    }
    let o = ok(lockstep(&args).output().unwrap());
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn every_tensor_parallel_layout_reproduces_the_single_worker_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    ok(train(
        &one,
        "1",
        &["model.tp_pieces=4", "parallel.pp=1"],
        &[],
    ));
    let want = hash(&one);
    let s1 = summary(&one);

    // The same model computed whole: the same training up to rounding, other bits.
    let whole = tmp.path().join("whole");
    ok(train(&whole, "1", &[], &[]));
    let (a, b) = (
        s1["final_loss"].as_f64().unwrap(),
        summary(&whole)["final_loss"].as_f64().unwrap(),
    );
    assert!((a - b).abs() < 1e-3 * b, "pieces {a} vs whole {b}");

    let layouts: &[(&str, &[&str], &str)] = &[
        ("2", &["parallel.tp=2"], "tp2"),
        ("4", &["parallel.tp=4"], "tp4"),
        ("4", &["parallel.tp=2", "parallel.pp=2"], "tp2xpp2"),
        (
            "4",
            &["parallel.tp=2", "parallel.pp=2", "parallel.schedule=gpipe"],
            "tp2xpp2-gpipe",
        ),
        ("4", &["parallel.tp=2", "parallel.dp=2"], "dp2xtp2"),
        // ZeRO 3 on the data-parallel axis: each tp rank's layer segments sharded over its
        // data-parallel group, gathered layer by layer for a step and for evaluation.
        (
            "4",
            &["parallel.tp=2", "parallel.dp=2", "parallel.zero=3"],
            "dp2xtp2-zero3",
        ),
        // The pieces' layers recomputed in backward, on one tp rank each and on two (whose
        // recomputed forwards sum their pieces over the group again).
        (
            "2",
            &["parallel.dp=2", "train.recompute=\"layers\""],
            "dp2-recompute",
        ),
        (
            "2",
            &["parallel.tp=2", "train.recompute=\"layers\""],
            "tp2-recompute",
        ),
        // ... and at ZeRO 3, each tp rank's pieces of a layer gathered over its data-parallel
        // group one layer at a time, the next while the current one computes.
        (
            "4",
            &[
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.zero=3",
                "train.recompute=\"layers\"",
            ],
            "dp2xtp2-zero3-recompute",
        ),
    ];
    for (nproc, sets, name) in layouts {
        let dir = tmp.path().join(name);
        let mut all = vec!["model.tp_pieces=4"];
        all.extend_from_slice(sets);
        ok(train(&dir, nproc, &all, &[]));
        let s = summary(&dir);
        assert_eq!(
            hash(&dir),
            want,
            "{name}: parameters differ from the 1-worker run"
        );
        assert_eq!(s["final_loss"], s1["final_loss"], "{name}");
        assert_eq!(s["evals"], s1["evals"], "{name}: validation curve differs");
        // The loss curve, step for step.
        let losses = |d: &Path| -> Vec<String> {
            std::fs::read_to_string(d.join("metrics.jsonl"))
                .unwrap()
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter(|v| v["rank"] == 0 && v["loss"].is_number())
                .map(|v| format!("{}:{}", v["step"], v["loss"]))
                .collect()
        };
        assert_eq!(losses(&one).len(), 6, "one loss per step");
        assert_eq!(losses(&dir), losses(&one), "{name}: loss curve differs");
    }
    assert_eq!(
        summary(&tmp.path().join("dp2xtp2-zero3-recompute"))["param_gathering"],
        "layer"
    );
    assert_eq!(
        summary(&tmp.path().join("dp2xtp2-zero3"))["param_gathering"],
        "stage"
    );
    // ZeRO 3 keeps half of each tp rank's parameters and optimizer state between steps.
    let memory = |name: &str, k: &str| {
        summary(&tmp.path().join(name))["ranks"][3]["memory"][k]
            .as_u64()
            .unwrap()
    };
    for k in ["params_bytes", "optimizer_bytes"] {
        let (plain, zero3) = (memory("dp2xtp2", k), memory("dp2xtp2-zero3", k));
        assert!(
            zero3 * 2 <= plain + 64,
            "{k}: zero 3 {zero3}, zero 0 {plain}"
        );
    }
}

#[test]
fn bad_tensor_parallel_layouts_are_refused_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: &[(&str, &[&str], &[&str])] = &[
        (
            "2",
            &["parallel.tp=2"],
            &["parallel.tp", "model.tp_pieces = 1"],
        ),
        (
            "2",
            &["model.tp_pieces=4", "parallel.tp=3"],
            &["parallel.tp", "model.tp_pieces = 4"],
        ),
        (
            "4",
            &[
                "model.tp_pieces=4",
                "parallel.tp=2",
                "parallel.pp=2",
                "parallel.dp=2",
            ],
            &[
                "parallel.dp = 2 × parallel.tp = 2 × parallel.pp = 2 = 8 workers",
                "has 4",
            ],
        ),
        (
            "3",
            &["model.tp_pieces=4", "parallel.tp=2"],
            &["parallel.tp = 2", "3 workers"],
        ),
        (
            "1",
            &["model.tp_pieces=3"],
            &["model.tp_pieces", "model.heads = 4", "model.d_ff = 64"],
        ),
    ];
    for (i, (nproc, sets, needles)) in cases.iter().enumerate() {
        let o = train(&tmp.path().join(format!("bad{i}")), nproc, sets, &[]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(
            o.status.code(),
            Some(3),
            "case {i}: bad input exits 3\n{err}"
        );
        for n in *needles {
            assert!(err.contains(n), "case {i}: `{n}` missing from\n{err}");
        }
        assert!(!err.contains("[rank"), "case {i}: a worker started\n{err}");
    }
    let o = train(
        &tmp.path().join("elastic"),
        "2:4",
        &["model.tp_pieces=4", "parallel.tp=2"],
        &[],
    );
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("parallel.tp = 1"));
}

#[test]
fn a_killed_tp_rank_recovers_and_checkpoints_move_between_layouts() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference");
    ok(train(&reference, "1", &["model.tp_pieces=4"], &[]));
    let want = hash(&reference);

    // A tp rank dies at step 3: its partner fails in a piece sum (a link failure, not a job
    // error), the group restarts from the checkpoint of step 2 and ends with the same bits.
    let dir = tmp.path().join("killed");
    let o = ok(train(
        &dir,
        "2",
        &["model.tp_pieces=4", "parallel.tp=2"],
        &["--inject", "kill:rank=1,step=3"],
    ));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("resumed from the checkpoint of step 2"),
        "{err}"
    );
    assert_eq!(summary(&dir)["restarts"], 1);
    assert_eq!(hash(&dir), want);

    // tp2 × pp2 stops at step 5 (no restarts) after the checkpoint of step 4; one worker ends it.
    let dir = tmp.path().join("moved");
    let err = stop_then_resume(
        &dir,
        &["model.tp_pieces=4", "parallel.tp=2", "parallel.pp=2"],
        ("4", "kill:rank=3,step=5"),
        "1",
        &["parallel.tp=1", "parallel.pp=1"],
    );
    assert!(
        err.contains("resumed from the checkpoint of step 4"),
        "{err}"
    );
    assert_eq!(hash(&dir), want);

    // And the reverse: one worker stops at step 3 after the checkpoint of step 2; tp4 ends it.
    let dir = tmp.path().join("spread");
    let err = stop_then_resume(
        &dir,
        &["model.tp_pieces=4"],
        ("1", "kill:rank=0,step=3"),
        "4",
        &["parallel.tp=4"],
    );
    assert!(
        err.contains("resumed from the checkpoint of step 2"),
        "{err}"
    );
    assert_eq!(hash(&dir), want);
}
