//! `train.precision = "bf16"` on the built-in models: the products' operands rounded to bf16,
//! with one parameter hash for every layout (data parallelism on shared windows, ZeRO 3,
//! pipelines, tensor parallelism), a hash of its own (not f32's), and learning close to f32's.

use std::path::Path;

mod common;
use common::{assert_ok, lockstep, param_hash, summary, train_transformer};

const BF16: &str = "train.precision=\"bf16\"";

fn train(nproc: &str, out: &Path, sets: &[&str]) {
    let mut args = vec!["train", "--nproc", nproc, "--out", out.to_str().unwrap()];
    for s in sets {
        args.extend_from_slice(&["--set", s]);
    }
    assert_ok(&lockstep(&args).output().expect("spawn lockstep"));
}

#[test]
fn bf16_classifiers_have_one_hash_for_every_layout_and_learn_as_f32_does() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let short = "train.steps=25";
    train("1", &dir("f32"), &[short]);
    train("1", &dir("one"), &[short, BF16]);
    train("2", &dir("dp2"), &[short, BF16]);
    train("2", &dir("pp2"), &[short, BF16, "parallel.pp=2"]);
    train("3", &dir("zero3"), &[short, BF16, "parallel.zero=3"]);
    assert_ne!(param_hash(&dir("one")), param_hash(&dir("f32")));
    for layout in ["dp2", "pp2", "zero3"] {
        assert_eq!(
            param_hash(&dir(layout)),
            param_hash(&dir("one")),
            "{layout}"
        );
    }
    let s = summary(&dir("dp2"));
    assert_eq!(s["gradient_sum"], "shared_windows");
    assert_eq!(s["plan"]["bf16_products"], true);
    let how = s["compute"]["bf16_products"].as_str().unwrap_or_default();
    assert!(
        how.starts_with("f32 kernels on bf16-rounded operands"),
        "{how}"
    );
    assert!(summary(&dir("f32"))["compute"]
        .get("bf16_products")
        .is_none());

    // The CNN's convolutions and dense layers.
    let cnn = ["model.kind=\"cnn\"", "train.steps=8", BF16];
    train("1", &dir("cnn1"), &cnn);
    train("2", &dir("cnn2"), &cnn);
    assert_eq!(param_hash(&dir("cnn2")), param_hash(&dir("cnn1")));

    // The default job's whole run: bf16 products end within 2 points of f32's test accuracy.
    train("1", &dir("f32_full"), &[]);
    train("1", &dir("bf16_full"), &[BF16]);
    let acc = |d: &str| summary(&dir(d))["test_accuracy"].as_f64().unwrap();
    let (f32_acc, bf16_acc) = (acc("f32_full"), acc("bf16_full"));
    assert!(
        (bf16_acc - f32_acc).abs() <= 0.02,
        "test accuracy: bf16 {bf16_acc}, f32 {f32_acc}"
    );
}

#[test]
fn the_bf16_transformer_has_one_hash_across_dp_zero3_pp_and_tp() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let small = [
        "model.d_model=32",
        "model.d_ff=64",
        "model.blocks=2",
        "model.context=16",
        "train.steps=4",
        "train.eval_every=0",
        "train.warmup_steps=1",
        "parallel.pp=1",
        BF16,
    ];
    let run = |name: &str, nproc: &str, sets: &[&str]| {
        assert_ok(&train_transformer(&dir(name), nproc, &small, sets, &[]));
    };
    run("one", "1", &[]);
    run("dp2_zero3", "2", &["parallel.zero=3"]);
    run("pp2", "2", &["parallel.pp=2"]);
    run("pieces", "1", &["model.tp_pieces=2"]);
    run("tp2", "2", &["model.tp_pieces=2", "parallel.tp=2"]);
    run("f32", "1", &["train.precision=\"f32\""]);
    assert_ne!(param_hash(&dir("one")), param_hash(&dir("f32")));
    assert_eq!(param_hash(&dir("dp2_zero3")), param_hash(&dir("one")));
    assert_eq!(param_hash(&dir("pp2")), param_hash(&dir("one")));
    assert_eq!(param_hash(&dir("tp2")), param_hash(&dir("pieces")));
}

#[test]
fn bf16_on_a_device_is_refused_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let o = lockstep(&[
        "train",
        "--out",
        out.to_str().unwrap(),
        "--set",
        BF16,
        "--set",
        "train.device=\"wgpu\"",
    ])
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("train.precision"), "{err}");
    assert!(!out.exists());
}
