//! A user's `LayeredJob`: the same parameter bits on one worker and as a pipeline of any layout,
//! and a misbehaving stage stopped with one final error naming the job, the step and the
//! micro-batch (exit status 3, no restart).

use std::path::Path;
use std::process::{Command, Output};

fn layered(out: &Path, nproc: &str, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--nproc", nproc, "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_lockstep-testjob-layered"))
        .args(&args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("spawn lockstep-testjob-layered")
}

fn hash(dir: &Path) -> String {
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap();
    s["param_hash"].as_str().unwrap().to_string()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_layered_user_job_has_the_one_worker_bits_as_a_pipeline() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    for (name, nproc, pp) in [("one", "1", "1"), ("pp2", "2", "2"), ("dp2pp2", "4", "2")] {
        let o = layered(&dir(name), nproc, &["--set", &format!("parallel.pp={pp}")]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
    }
    assert_eq!(hash(&dir("pp2")), hash(&dir("one")));
    assert_eq!(hash(&dir("dp2pp2")), hash(&dir("one")));
}

fn misbehaves(how: &str, expected: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let setting = format!("job.misbehave=\"{how}\"");
    let o = layered(
        &tmp.path().join("run"),
        "2",
        &["--set", "parallel.pp=2", "--set", &setting],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{how}: {err}");
    for e in expected {
        assert!(err.contains(e), "{how}: the error lacks `{e}`:\n{err}");
    }
    assert!(
        !err.contains("lockstep: restart "),
        "{how}: restarted:\n{err}"
    );
    assert!(!err.contains("stack backtrace"), "{how}:\n{err}");
}

#[test]
fn a_nan_loss_in_the_last_stage_is_a_final_error_naming_step_and_microbatch() {
    misbehaves(
        "nan-loss",
        &[
            "job `testjob-layered`, step ",
            "micro-batch ",
            "the loss is NaN",
        ],
    );
}

#[test]
fn a_batch_of_the_wrong_shape_in_the_first_stage_is_a_final_error() {
    misbehaves(
        "wrong-shape",
        &["job `testjob-layered`", "panicked", "expected 8, got 7"],
    );
}
