//! Pipeline parallelism end to end on the character-level transformer (a small one, so that the
//! whole file runs in seconds): every layout and schedule ends with the parameters of the
//! one-worker run, bit for bit; the schedules hold what they should; bad layouts are refused
//! before any worker starts; a pipeline crash recovers, and a checkpoint moves between layouts.

use std::path::Path;
use std::process::Output;

mod common;
use common::{assert_ok, lockstep, param_hash as hash, summary, train_transformer};

/// A 4-layer model (embedding, 2 blocks, head), 4 micro-batches of 2 sequences per step.
const TINY: &[&str] = &[
    "model.d_model=32",
    "model.heads=2",
    "model.blocks=2",
    "model.context=16",
    "model.d_ff=64",
    "train.global_batch=8",
    "parallel.microbatches=4",
    "train.steps=6",
    "train.eval_every=3",
    "train.log_every=1",
    "checkpoint.every=2",
];

fn train(out: &Path, nproc: &str, sets: &[&str], extra: &[&str]) -> Output {
    train_transformer(out, nproc, TINY, sets, extra)
}

fn ok(o: Output) -> Output {
    assert_ok(&o);
    o
}

#[test]
fn every_layout_and_schedule_reproduces_the_single_worker_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("pp1");
    ok(train(&one, "1", &["parallel.pp=1"], &[]));
    let want = hash(&one);
    let s1 = summary(&one);
    assert_eq!(s1["pipeline"]["pp"], 1);

    let layouts: &[(&str, &[&str], &str)] = &[
        (
            "2",
            &["parallel.pp=2", "parallel.schedule=gpipe"],
            "pp2-gpipe",
        ),
        (
            "2",
            &["parallel.pp=2", "parallel.schedule=1f1b"],
            "pp2-1f1b",
        ),
        (
            "4",
            &["parallel.pp=4", "parallel.schedule=1f1b"],
            "pp4-1f1b",
        ),
        ("4", &["parallel.pp=2", "parallel.dp=2"], "dp2xpp2"),
        ("2", &["parallel.pp=1"], "dp2"),
    ];
    for (nproc, sets, name) in layouts {
        let dir = tmp.path().join(name);
        ok(train(&dir, nproc, sets, &[]));
        let s = summary(&dir);
        assert_eq!(
            hash(&dir),
            want,
            "{name}: parameters differ from the 1-worker run"
        );
        // The loss curve is the same step for step (the loss is an exact sum too).
        assert_eq!(s["final_loss"], s1["final_loss"], "{name}");
        assert_eq!(s["evals"], s1["evals"], "{name}: validation curve differs");
        let p = &s["pipeline"];
        let pp = p["pp"].as_u64().unwrap() as usize;
        let m = p["microbatches_per_replica"].as_u64().unwrap() as usize;
        let peaks: Vec<usize> = p["peak_activations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(peaks.len(), pp);
        for (stage, &peak) in peaks.iter().enumerate() {
            if p["schedule"] == "gpipe" || pp == 1 {
                assert_eq!(peak, if pp == 1 { 1 } else { m }, "{name} stage {stage}");
            } else {
                assert_eq!(peak, (pp - stage).min(m), "{name} stage {stage}");
                assert!(peak <= pp);
            }
        }
        // Every rank reports its stage's send/receive and bubble time.
        for r in s["ranks"].as_array().unwrap() {
            let rp = &r["pipeline"];
            assert!(rp["schedule_seconds"].as_f64().unwrap() > 0.0, "{name}");
            if pp > 1 {
                assert!(rp["p2p_bytes"].as_u64().unwrap() > 0, "{name}");
            }
        }
        let line = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        let first: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
        assert!(first["pipeline"]["bubble_seconds"].is_number(), "{name}");
    }
}

/// The tiny transformer learns the plays through a 2-stage pipeline: 200 steps take the validation
/// loss from ln(76) ≈ 4.33 nats per character (a uniform guess) to 2.71 and next-character accuracy
/// to 26% (measured); the floors are 3.0 and 20%. (docs/src/performance.md's figure for
/// configs/shakespeare.toml itself, 1.93 at step 400, takes minutes: too long for the test suite.)
#[test]
fn the_pipeline_learns_the_plays() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("learn");
    ok(train(
        &dir,
        "2",
        &["parallel.pp=2", "train.steps=200", "train.eval_every=200"],
        &[],
    ));
    let s = summary(&dir);
    let (loss, acc) = (
        s["test_loss"].as_f64().unwrap(),
        s["test_accuracy"].as_f64().unwrap(),
    );
    assert!(
        loss < 3.0 && acc > 0.20,
        "validation loss {loss}, accuracy {acc}"
    );
}

#[test]
fn bad_layouts_are_refused_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: &[(&str, &[&str], &[&str])] = &[
        ("3", &["parallel.pp=2"], &["parallel.pp = 2", "3 workers"]),
        (
            "4",
            &["parallel.pp=2", "parallel.dp=3"],
            &["parallel.dp = 3", "parallel.pp = 2", "6 workers", "has 4"],
        ),
        ("5", &["parallel.pp=5"], &["5 stages", "only 4 layers"]),
        (
            "2",
            &["parallel.microbatches=3"],
            &["parallel.microbatches", "3", "train.global_batch = 8"],
        ),
        (
            "2",
            &["parallel.stage_cuts=[2,3]"],
            &["parallel.stage_cuts"],
        ),
        (
            "2",
            &["parallel.schedule=zigzag"],
            &["parallel.schedule", "zigzag"],
        ),
    ];
    for (i, (nproc, sets, needles)) in cases.iter().enumerate() {
        let dir = tmp.path().join(format!("bad{i}"));
        let o = train(&dir, nproc, sets, &[]);
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
    // An elastic pipeline cannot shrink.
    let o = train(&tmp.path().join("elastic"), "2:4", &["parallel.pp=2"], &[]);
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("elastic"));
}

#[test]
fn a_killed_stage_recovers_and_a_checkpoint_moves_between_layouts() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference");
    ok(train(&reference, "1", &["parallel.pp=1"], &[]));
    let want = hash(&reference);

    // Stage 1 of a 2-stage pipeline dies at step 3; the group restarts from step 2's checkpoint.
    let dir = tmp.path().join("killed");
    let o = ok(train(
        &dir,
        "2",
        &["parallel.pp=2"],
        &["--inject", "kill:rank=1,step=3"],
    ));
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        err.contains("resumed from the checkpoint of step 2"),
        "{err}"
    );
    assert_eq!(hash(&dir), want);
    assert_eq!(summary(&dir)["restarts"], 1);

    // A 2×2 run stops at step 5 (no restarts); it continues as a 4-stage pipeline.
    let dir = tmp.path().join("moved");
    let o = train(
        &dir,
        "4",
        &["parallel.pp=2"],
        &["--inject", "kill:rank=3,step=5", "--max-restarts", "0"],
    );
    assert!(!o.status.success());
    ok(lockstep(&[
        "train",
        "--resume",
        dir.to_str().unwrap(),
        "--nproc",
        "4",
        "--set",
        "parallel.pp=4",
        "--set",
        "parallel.dp=0",
    ])
    .output()
    .unwrap());
    let s = summary(&dir);
    assert_eq!(s["pipeline"]["pp"], 4);
    assert_eq!(hash(&dir), want);
}

#[test]
fn a_plain_sum_pipeline_repeats_its_bits_at_a_fixed_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let sets = ["parallel.pp=2", "parallel.dp=2", "dist.reproducible=false"];
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    ok(train(&a, "4", &sets, &[]));
    ok(train(&b, "4", &sets, &[]));
    assert_eq!(
        hash(&a),
        hash(&b),
        "plain f32 sums are deterministic at a fixed layout"
    );
    assert_eq!(summary(&a)["reproducible"], false);
    assert!(summary(&a)["final_loss"].as_f64().unwrap().is_finite());
}

/// The transformer's data-parallel replicas on one host sum their gradients through shared
/// windows (each rank's micro-batch gradients read where they lie), as a pipeline and without
/// one, with the one-worker bits.
#[test]
fn data_parallel_transformer_stages_sum_through_shared_windows_with_the_one_worker_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    ok(train(&one, "1", &["parallel.pp=1"], &[]));
    assert_eq!(summary(&one)["gradient_sum"], "local");
    for (nproc, pp, name) in [("2", "1", "dp2"), ("4", "2", "dp2pp2")] {
        let dir = tmp.path().join(name);
        let set = format!("parallel.pp={pp}");
        ok(train(&dir, nproc, &[&set], &[]));
        let s = summary(&dir);
        assert_eq!(s["gradient_sum"], "shared_windows", "{name}");
        // The plan the run followed.
        assert_eq!(s["plan"]["dp"], 2, "{name}");
        assert_eq!(s["plan"]["pp"], pp.parse::<u64>().unwrap(), "{name}");
        assert_eq!(s["plan"]["exact_sum"], true, "{name}");
        assert_eq!(hash(&dir), hash(&one), "{name}");
    }
    // Overlapping the sum with the last micro-batch's backward (one stage): the same bits.
    let overlap = tmp.path().join("overlap");
    ok(train(
        &overlap,
        "2",
        &["parallel.pp=1", "dist.overlap=true"],
        &[],
    ));
    assert_eq!(summary(&overlap)["gradient_sum"], "collectives");
    assert_eq!(hash(&overlap), hash(&one));
    // Over TCP the same sum goes through the rings, with the same bits.
    let tcp = tmp.path().join("tcp");
    ok(train(
        &tcp,
        "2",
        &["parallel.pp=1", "dist.transport=tcp"],
        &[],
    ));
    assert_eq!(summary(&tcp)["gradient_sum"], "collectives");
    assert_eq!(hash(&tcp), hash(&one));
}

/// `train.recompute = "layers"` on the transformer: each stage keeps only its layers' inputs and
/// runs their forwards again in backward — the bits of the kept graphs on one worker, as a
/// pipeline and at dp2 × pp2 × ZeRO 3, with far fewer activation bytes; and with
/// tensor-parallel ranks.
#[test]
fn the_transformer_recomputes_its_layers_with_the_bits_of_kept_graphs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let recompute = "train.recompute=\"layers\"";
    ok(train(&dir("plain"), "1", &["parallel.pp=1"], &[]));
    let runs: [(&str, &str, &[&str]); 3] = [
        ("one", "1", &["parallel.pp=1", recompute]),
        ("pp2", "2", &["parallel.pp=2", recompute]),
        (
            "dp2pp2zero3",
            "4",
            &["parallel.pp=2", "parallel.zero=3", recompute],
        ),
    ];
    for (name, nproc, sets) in runs {
        ok(train(&dir(name), nproc, sets, &[]));
        assert_eq!(hash(&dir(name)), hash(&dir("plain")), "{name}");
    }
    // ZeRO 3 on recomputing stages gathers one layer at a time, here inside a 1F1B pipeline.
    assert_eq!(summary(&dir("dp2pp2zero3"))["param_gathering"], "layer");
    let activations = |name: &str| {
        summary(&dir(name))["ranks"][0]["memory"]["activation_peak_bytes"]
            .as_u64()
            .unwrap()
    };
    assert!(
        activations("one") * 4 < activations("plain"),
        "kept inputs {} against kept graphs {}",
        activations("one"),
        activations("plain")
    );
    // Tensor-parallel ranks recompute too, summing their pieces over the group again: the bits
    // of the same pieces on one worker keeping its graphs.
    let pieces = ["parallel.pp=1", "model.tp_pieces=2"];
    ok(train(&dir("pieces"), "1", &pieces, &[]));
    let tp2 = [&pieces[..], &["parallel.tp=2", recompute]].concat();
    ok(train(&dir("tp2"), "2", &tp2, &[]));
    assert_eq!(hash(&dir("tp2")), hash(&dir("pieces")), "tp2 recomputing");
}
