//! The run directory is a ledger, and bad requests are refused before anything starts: each case
//! the hardening audit found, reproduced with the real binary. A refused request exits with
//! status 3, names the field or path, prints no backtrace, starts no worker and leaves every file
//! of an earlier run byte-identical.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::{assert_ok, lockstep, summary};

fn run(args: &[&str]) -> Output {
    lockstep(args).output().expect("spawn lockstep")
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// A refusal: exit status 3, one error line containing every `want`, no panic or backtrace.
fn refused(o: &Output, want: &[&str]) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(3), "expected exit status 3:\n{err}");
    for w in want {
        assert!(err.contains(w), "the error does not name {w:?}:\n{err}");
    }
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "a refusal must not panic:\n{err}"
    );
    assert!(
        !err.contains("[rank "),
        "no worker may start for a refused request:\n{err}"
    );
    err
}

fn finished_run(dir: &Path) {
    let o = run(&[
        "train",
        "--nproc",
        "2",
        "--out",
        dir.to_str().unwrap(),
        "--set",
        "train.steps=12",
        "--set",
        "checkpoint.every=5",
    ]);
    assert_ok(&o);
}

#[test]
fn a_finished_run_is_never_rewritten_by_resume_refused_sets_or_a_new_train() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    finished_run(&dir);
    let before = snapshot(&dir);
    let d = dir.to_str().unwrap();

    // --resume of a finished run: says so, changes nothing, succeeds.
    let o = run(&["train", "--nproc", "2", "--resume", d]);
    assert_ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("finished run (12 steps"), "{err}");
    assert_eq!(
        snapshot(&dir),
        before,
        "resume of a finished run wrote files"
    );

    // A refused --set leaves config.toml alone, so the plain resume still works afterwards.
    let o = run(&["train", "--resume", d, "--set", "train.lr=0.2"]);
    refused(&o, &["train.lr", "0.1", "0.2", "--out"]);
    assert_eq!(snapshot(&dir), before, "a refused resume wrote files");
    assert_ok(&run(&["train", "--resume", d]));

    // Shortening is refused too.
    let o = run(&["train", "--resume", d, "--set", "train.steps=5"]);
    refused(&o, &["extended but not shortened"]);

    // A fresh train into the run's directory is refused, naming it and the way out.
    let o = run(&["train", "--out", d, "--set", "train.steps=3"]);
    refused(&o, &[d, "--resume", "--overwrite", "summary.json"]);
    assert_eq!(snapshot(&dir), before, "a refused train wrote files");

    // --overwrite replaces it explicitly.
    let o = run(&["train", "--out", d, "--set", "train.steps=3", "--overwrite"]);
    assert_ok(&o);
    assert_eq!(summary(&dir)["steps"], 3);
}

#[test]
fn a_finished_run_extends_keeping_every_earlier_record() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    finished_run(&dir);
    let first_hash = summary(&dir)["param_hash"].as_str().unwrap().to_string();
    let metrics_before = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let d = dir.to_str().unwrap();
    let o = run(&[
        "train",
        "--nproc",
        "3",
        "--resume",
        d,
        "--set",
        "train.steps=20",
    ]);
    assert_ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    // The last step is always checkpointed, so the extension continues from where it ended.
    assert!(
        err.contains("resumed from the checkpoint of step 12"),
        "{err}"
    );
    let s = summary(&dir);
    assert_eq!(s["steps"], 20);
    assert_ne!(s["param_hash"].as_str().unwrap(), first_hash);
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert!(
        metrics.starts_with(&metrics_before),
        "the first 12 steps' records must be kept as they were"
    );
    let steps: std::collections::BTreeSet<u64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, (0..20).collect());
}

#[test]
fn values_no_worker_could_hold_are_refused_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    for (i, (set, field)) in [
        ("dist.timeout_secs=1e19", "dist.timeout_secs"),
        ("dist.timeout_secs=1e300", "dist.timeout_secs"),
        ("train.steps=10000000000", "train.steps"),
        ("model.hidden=[1000000000]", "model.hidden"),
        ("model.hidden=[4611686018427387904]", "model.hidden"),
    ]
    .into_iter()
    .enumerate()
    {
        let out = tmp.path().join(format!("r{i}"));
        let o = run(&["train", "--out", out.to_str().unwrap(), "--set", set]);
        refused(&o, &[field]);
        assert!(!out.exists(), "{set}: the run directory was created");
    }
    // Epochs are checked against the dataset once it is known: still bad input, never retried.
    let out = tmp.path().join("epochs");
    let o = run(&[
        "train",
        "--nproc",
        "1",
        "--out",
        out.to_str().unwrap(),
        "--set",
        "train.steps=0",
        "--set",
        "train.epochs=1000000",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("train.epochs")
            && err.contains("not restarting")
            && !err.contains("restart 1/"),
        "{err}"
    );
}

#[test]
fn requests_that_cannot_run_are_refused_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("r");
    let o_ = out.to_str().unwrap();
    // A fault for a rank that does not exist would be silently ignored: refused.
    let o = run(&[
        "train",
        "--nproc",
        "2",
        "--out",
        o_,
        "--inject",
        "kill:rank=9,step=3",
    ]);
    refused(&o, &["rank 9", "world of 2"]);
    // More workers than shared memory connects: refused at once, not spawned four times.
    let o = run(&["train", "--nproc", "300", "--out", o_]);
    refused(&o, &["--nproc 300", "256"]);
    assert!(!out.exists());
    // An unwritable checkpoint directory is found now, not at the first checkpoint.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let ckpt = file.join("checkpoints");
    let set = format!("checkpoint.dir={}", ckpt.display());
    let o = run(&["train", "--nproc", "2", "--out", o_, "--set", &set]);
    refused(&o, &["checkpoint directory", ckpt.to_str().unwrap()]);
}

#[test]
fn a_validation_text_shorter_than_the_context_is_an_error_not_a_zero_score() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("corpus");
    std::fs::create_dir_all(&data).unwrap();
    let line = "To be, or not to be, that is the question.\n";
    std::fs::write(data.join("train.txt"), line.repeat(200)).unwrap();
    std::fs::write(data.join("val.txt"), "Too short.\n").unwrap();
    let out = tmp.path().join("r");
    let o = run(&[
        "train",
        "--config",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../configs/shakespeare.toml"
        ),
        "--nproc",
        "1",
        "--out",
        out.to_str().unwrap(),
        "--set",
        &format!("data.dir={}", data.display()),
        "--set",
        "train.steps=2",
        "--set",
        "model.context=16",
        "--set",
        "parallel.pp=1",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("validation text has 11 characters") && err.contains("model.context = 16"),
        "{err}"
    );
    assert!(err.contains("not restarting"), "{err}");
}
