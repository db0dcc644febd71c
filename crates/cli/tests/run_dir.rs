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

/// Every file under `dir` but the lock file, whose holder line changes with each launcher.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut all = snapshot(dir);
    all.remove(&dir.join(".lockstep.lock"));
    all
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn a_run_killed_after_its_last_checkpoint_resumes_to_its_final_evaluation() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    finished_run(&dir);
    let whole = summary(&dir);
    let d = dir.to_str().unwrap();
    // Killed after the final checkpoint, before summary.json: what such a run leaves.
    for f in ["summary.json", "report.md", "report.html"] {
        std::fs::remove_file(dir.join(f)).unwrap();
    }
    let o = run(&["train", "--nproc", "3", "--resume", d]);
    assert_ok(&o);
    let s = summary(&dir);
    for key in [
        "param_hash",
        "final_loss",
        "test_loss",
        "test_accuracy",
        "steps",
    ] {
        assert_eq!(s[key], whole[key], "{key} after the resume at the end");
    }
    assert!(dir.join("report.html").exists());
    // A later resume calls it finished and changes nothing.
    let before = files(&dir);
    let o = run(&["train", "--resume", d]);
    assert_ok(&o);
    assert!(String::from_utf8_lossy(&o.stderr).contains("finished run (12 steps"));
    assert_eq!(files(&dir), before);

    // A summary that an earlier version wrote without the final figures is not a finished run:
    // resuming evaluates the final model again.
    let mut broken = whole.clone();
    for key in ["final_loss", "test_loss", "test_accuracy"] {
        broken[key] = serde_json::Value::Null;
    }
    std::fs::write(dir.join("summary.json"), broken.to_string()).unwrap();
    assert_ok(&run(&["train", "--resume", d]));
    let s = summary(&dir);
    assert_eq!(s["test_accuracy"], whole["test_accuracy"]);
    assert_eq!(s["final_loss"], whole["final_loss"]);
}

#[test]
fn resume_requests_that_would_lose_records_are_refused_and_change_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    finished_run(&dir);
    let d = dir.to_str().unwrap();
    let before = files(&dir);

    // A run measured in steps cannot be "extended" in epochs (it would run no step at all).
    let o = run(&["train", "--resume", d, "--set", "train.epochs=3"]);
    refused(&o, &["train.steps", "train.epochs"]);
    assert_eq!(files(&dir), before);

    // Records up to step 12 but no checkpoint where the request looks: it would retrain from 0.
    let empty = tmp.path().join("empty-ckpts");
    std::fs::create_dir(&empty).unwrap();
    let set = format!("checkpoint.dir={}", empty.display());
    std::fs::remove_file(dir.join("summary.json")).unwrap();
    let interrupted = files(&dir);
    let o = run(&["train", "--resume", d, "--set", &set]);
    refused(&o, &["no checkpoint", empty.to_str().unwrap(), "12"]);
    assert_eq!(files(&dir), interrupted);

    // A damaged line of metrics.jsonl is named, never dropped.
    let metrics = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[3] = "{\"rank\": 0, \"step\": tr";
    std::fs::write(&metrics, lines.join("\n") + "\n").unwrap();
    let damaged = files(&dir);
    let o = run(&["train", "--resume", d]);
    refused(&o, &["metrics.jsonl", "line 4"]);
    assert_eq!(files(&dir), damaged);
    std::fs::write(&metrics, &text).unwrap();

    // An emptied config.toml would resume with built-in defaults, one without its length with
    // the default length: refused, naming what is gone.
    let config = dir.join("config.toml");
    let whole = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, "").unwrap();
    let o = run(&["train", "--resume", d]);
    refused(&o, &["config.toml", "lacks", "train"]);
    let cut: String = whole
        .lines()
        .filter(|l| !l.starts_with("steps ="))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&config, cut).unwrap();
    let o = run(&["train", "--resume", d]);
    refused(&o, &["config.toml", "lacks train.steps"]);
    std::fs::write(&config, &whole).unwrap();
    // With everything restored, the interrupted run resumes to its end.
    assert_ok(&run(&["train", "--resume", d]));
    assert_eq!(summary(&dir)["steps"], 12);
}

#[test]
fn a_second_launcher_on_a_run_directory_is_refused_naming_the_first() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let d = dir.to_str().unwrap();
    let first = lockstep(&[
        "train",
        "--nproc",
        "2",
        "--out",
        d,
        "--set",
        "train.steps=100000",
        "--set",
        "checkpoint.every=0",
    ])
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null())
    .spawn()
    .unwrap();
    let lock = dir.join(".lockstep.lock");
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&lock).map_or(true, |s| s.is_empty()) {
        assert!(
            t0.elapsed().as_secs() < 60,
            "the first launcher never locked"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let pid = first.id().to_string();
    for args in [
        vec!["train", "--out", d, "--set", "train.steps=3"],
        vec!["train", "--out", d, "--overwrite", "--set", "train.steps=3"],
        vec!["train", "--resume", d],
    ] {
        let o = run(&args);
        refused(&o, &["in use", &format!("pid {pid}")]);
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(first.id() as i32, libc::SIGTERM) };
    let mut first = first;
    first.wait().unwrap();
    // Its lock went with it (the kernel releases it with the process).
    assert_ok(&run(&[
        "train",
        "--out",
        d,
        "--overwrite",
        "--set",
        "train.steps=3",
    ]));
}

#[test]
fn overwrite_removes_only_the_replaced_runs_own_files_and_only_once_the_request_is_valid() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    finished_run(&a);
    finished_run(&b);
    let (a_, b_) = (a.to_str().unwrap(), b.to_str().unwrap());
    let a_before = files(&a);

    // b's checkpoints/ made a link to a's: --overwrite b never deletes through it.
    std::fs::remove_dir_all(b.join("checkpoints")).unwrap();
    std::os::unix::fs::symlink(a.join("checkpoints"), b.join("checkpoints")).unwrap();
    let b_before = files(&b);
    let o = run(&[
        "train",
        "--out",
        b_,
        "--overwrite",
        "--set",
        "train.steps=3",
    ]);
    refused(&o, &["symbolic link", "checkpoints"]);
    assert_eq!(files(&a), a_before, "a's checkpoints were touched");
    assert_eq!(files(&b), b_before);
    std::fs::remove_file(b.join("checkpoints")).unwrap();

    // A user's file named like a checkpoint is not the run's: refused, nothing removed.
    let user = a.join("checkpoints").join("step-000000099.ckpt");
    std::fs::write(&user, b"my own notes").unwrap();
    let before = files(&a);
    let o = run(&[
        "train",
        "--out",
        a_,
        "--overwrite",
        "--set",
        "train.steps=3",
    ]);
    refused(&o, &["step-000000099.ckpt", "not the replaced run's"]);
    assert_eq!(files(&a), before);
    std::fs::remove_file(&user).unwrap();

    // A request refused after the run-directory checks (an unwritable checkpoint.dir) removes
    // nothing: the earlier run is still whole.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let set = format!("checkpoint.dir={}", file.join("c").display());
    let before = files(&a);
    let o = run(&["train", "--out", a_, "--overwrite", "--set", &set]);
    refused(&o, &["checkpoint directory"]);
    assert_eq!(files(&a), before, "a refused --overwrite removed files");

    // A valid --overwrite replaces the run: its checkpoints are the new run's only.
    assert_ok(&run(&[
        "train",
        "--out",
        a_,
        "--overwrite",
        "--set",
        "train.steps=3",
    ]));
    let steps: Vec<String> = std::fs::read_dir(a.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(steps, vec!["step-000000003.ckpt"], "{steps:?}");
    assert_eq!(json(&a.join("summary.json"))["steps"], 3);
}
