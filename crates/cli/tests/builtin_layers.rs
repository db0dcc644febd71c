//! The built-in MLP and CNN are a `LayeredJob` like a user's: pipelines, ZeRO 3, overlap and
//! recomputation reach them through the one layered path, and every layout ends with the
//! parameters of one worker, bit for bit.

use std::path::Path;
use std::process::Output;

mod common;
use common::{assert_ok, lockstep, param_hash as hash, summary};

/// `lockstep train` of the default job (digits) for a few steps, with `sets` on top.
fn train(out: &Path, nproc: &str, sets: &[&str]) -> Output {
    let mut args = vec!["train", "--nproc", nproc, "--out", out.to_str().unwrap()];
    let base = [
        "train.steps=6",
        "train.eval_every=3",
        "train.log_every=1",
        "checkpoint.every=0",
    ];
    for s in base.iter().chain(sets) {
        args.extend_from_slice(&["--set", s]);
    }
    let o = lockstep(&args).output().expect("spawn lockstep");
    assert_ok(&o);
    o
}

#[test]
fn the_built_in_classifiers_reproduce_one_worker_in_every_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let cnn = ["model.kind=cnn", "model.conv=[4, 8]", "model.cnn_hidden=16"];
    // The MLP has 3 layers (hidden 128, 64, output), the CNN 4 (2 conv blocks, hidden, output).
    for (model, kind, layers) in [("mlp", &["model.kind=mlp"][..], 3), ("cnn", &cnn[..], 4)] {
        let one = tmp.path().join(format!("{model}-one"));
        train(&one, "1", kind);
        let want = hash(&one);
        let s = summary(&one);
        assert_eq!(s["gradient_sum"], "local", "{model}");
        // Evaluated with the job's accuracy metric, as before.
        let accuracy = s["test_accuracy"].as_f64().expect("test_accuracy");
        assert!((0.0..=1.0).contains(&accuracy), "{model}: {accuracy}");
        let deepest = format!("parallel.pp={layers}");
        let cases: &[(&str, &str, &[&str])] = &[
            ("dp2", "2", &[]),
            (
                "pp2-gpipe",
                "2",
                &["parallel.pp=2", "parallel.schedule=gpipe"],
            ),
            ("pp-every-layer", "4", &[&deepest, "parallel.dp=1"]),
            ("dp2-pp2-zero3", "4", &["parallel.pp=2", "parallel.zero=3"]),
            ("dp2-zero3", "2", &["parallel.zero=3"]),
            ("overlap", "2", &["dist.overlap=true"]),
            (
                "recompute-pp2",
                "2",
                &["parallel.pp=2", "train.recompute=\"layers\""],
            ),
        ];
        for (name, nproc, sets) in cases {
            let nproc = if *name == "pp-every-layer" {
                layers.to_string()
            } else {
                nproc.to_string()
            };
            let dir = tmp.path().join(format!("{model}-{name}"));
            train(&dir, &nproc, &[kind, sets].concat());
            assert_eq!(hash(&dir), want, "{model} {name}: not the one-worker bits");
        }
        let s = summary(&tmp.path().join(format!("{model}-dp2")));
        assert_eq!(s["gradient_sum"], "shared_windows", "{model}");
        // ZeRO 3 releases each layer's parameters outside its compute: a rank holds about half.
        let params = |name: &str| {
            summary(&tmp.path().join(format!("{model}-{name}")))["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["memory"]["params_bytes"].as_u64().unwrap())
                .max()
                .unwrap()
        };
        let ratio = params("dp2-zero3") as f64 / params("dp2") as f64;
        assert!(
            ratio <= 0.55,
            "{model}: ZeRO 3 keeps {ratio:.3} of ZeRO 0's parameters"
        );
        let s = summary(&tmp.path().join(format!("{model}-pp-every-layer")));
        assert_eq!(s["plan"]["pp"], layers, "{model}");
    }
}
