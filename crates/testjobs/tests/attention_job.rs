//! A user's transformer built from `lockstep::tp` layers (`ParallelSelfAttention` and a column →
//! row MLP): its heads split across 2 or 4 tensor-parallel ranks, alone, with data parallelism
//! at ZeRO 3, and with a 2-stage pipeline, with recomputed layers too, end with the one-worker
//! parameters bit for bit; a
//! `parallel.tp` that does not divide the pieces is refused before any worker starts.

use std::path::Path;
use std::process::{Command, Output};

fn attention_job(out: &Path, nproc: &str, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--nproc", nproc, "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_lockstep-testjob-attention"))
        .args(&args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("spawn lockstep-testjob-attention")
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn a_users_tensor_parallel_attention_has_the_one_worker_bits_in_every_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let runs: [(&str, &str, &[&str]); 7] = [
        ("one", "1", &[]),
        ("tp2", "2", &["--set", "parallel.tp=2"]),
        ("tp4", "4", &["--set", "parallel.tp=4"]),
        (
            "dp2tp2zero3",
            "4",
            &["--set", "parallel.tp=2", "--set", "parallel.zero=3"],
        ),
        (
            "tp2pp2",
            "4",
            &["--set", "parallel.tp=2", "--set", "parallel.pp=2"],
        ),
        // Recomputed layers: their forwards sum the pieces over the tp group again; at ZeRO 3
        // each tp rank gathers its pieces of one layer at a time.
        (
            "tp2pp2-recompute",
            "4",
            &[
                "--set",
                "parallel.tp=2",
                "--set",
                "parallel.pp=2",
                "--set",
                "train.recompute=\"layers\"",
            ],
        ),
        (
            "dp2tp2zero3-recompute",
            "4",
            &[
                "--set",
                "parallel.tp=2",
                "--set",
                "parallel.zero=3",
                "--set",
                "train.recompute=\"layers\"",
            ],
        ),
    ];
    for (name, nproc, extra) in runs {
        let o = attention_job(&dir(name), nproc, extra);
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let one = summary(&dir("one"));
    let loss = one["final_loss"].as_f64().unwrap();
    assert!(
        loss.is_finite() && loss < 0.2,
        "it learns: final loss {loss}"
    );
    for (name, ..) in &runs[1..] {
        let s = summary(&dir(name));
        assert_eq!(s["param_hash"], one["param_hash"], "{name}");
    }
    assert_eq!(summary(&dir("tp4"))["plan"]["tp"], 4);
    assert_eq!(
        summary(&dir("dp2tp2zero3-recompute"))["param_gathering"],
        "layer"
    );
}

#[test]
fn tensor_parallel_ranks_that_do_not_divide_the_heads_pieces_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tp3");
    let o = attention_job(&out, "3", &["--set", "parallel.tp=3"]);
    assert_eq!(o.status.code(), Some(3));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("parallel.tp") && err.contains("4 fixed pieces"),
        "{err}"
    );
    assert!(!out.exists(), "nothing written for a refused config");
}
