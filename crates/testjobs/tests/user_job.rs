//! A user's own job (written only against the public `lockstep` API) gets all of lockstep:
//! processes, the same parameter bits at every world size, recovery from a killed worker, the
//! run outputs with its own metric, and a clear, final error (exit status 3, no restart loop)
//! when its data or loss misbehaves.

mod support;

use std::path::Path;
use std::process::{Command, Output};

use support::{per_step, train_metric};

fn testjob(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockstep-testjob"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("spawn lockstep-testjob")
}

fn train(out: &Path, nproc: &str, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--nproc", nproc, "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    testjob(&args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn assert_ok(o: &Output) {
    assert!(o.status.success(), "failed: {}", stderr(o));
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

fn hash(dir: &Path) -> String {
    summary(dir)["param_hash"].as_str().unwrap().to_string()
}

#[test]
fn a_user_job_reaches_the_same_parameters_at_every_world_size_and_reports_its_metric() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    assert_ok(&train(&one, "1", &[]));
    for n in ["2", "3"] {
        let dir = tmp.path().join(format!("n{n}"));
        assert_ok(&train(&dir, n, &[]));
        assert_eq!(hash(&dir), hash(&one), "{n} workers vs 1");
        assert_eq!(summary(&dir)["world_size"], n.parse::<u64>().unwrap());
    }
    let s = summary(&one);
    let mae = s["test_metrics"]["mae"]
        .as_f64()
        .expect("the job's metric in summary.json");
    // A fixed smooth target of inputs in [-1, 1): the untrained net is far off (mae ≈ 0.9);
    // 12 steps must have learnt something.
    assert!(mae > 0.0 && mae < 0.5, "mae {mae}");
    assert!(
        s["test_accuracy"].is_null(),
        "no accuracy metric: {}",
        s["test_accuracy"]
    );
    let metrics = std::fs::read_to_string(one.join("metrics.jsonl")).unwrap();
    assert!(
        metrics.contains("\"mae\""),
        "metrics.jsonl lacks the job's metric"
    );
    let report = std::fs::read_to_string(one.join("report.html")).unwrap();
    assert!(
        report.contains("test mae"),
        "report.html lacks the job's metric"
    );
}

#[test]
fn a_killed_worker_of_a_user_job_is_restarted_to_the_fault_free_parameters() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference");
    assert_ok(&train(&reference, "1", &[]));
    let killed = tmp.path().join("killed");
    assert_ok(&train(&killed, "3", &["--inject", "kill:rank=1,step=6"]));
    assert_eq!(hash(&killed), hash(&reference));
    assert!(summary(&killed)["restarts"].as_u64().unwrap() >= 1);
}

/// A worker stuck inside the user's dataset (its read of one training sample never returns) is
/// outside any collective: its launcher finds it from its heartbeats within 2 × the stall
/// timeout — long before the peers' 60 s collective timeout —, names it, and restarts the job,
/// which ends with the parameters of a run whose data never hung.
#[test]
fn a_worker_hung_in_data_loading_is_found_by_its_heartbeat_named_and_recovered() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference");
    assert_ok(&train(&reference, "1", &[]));
    let dir = tmp.path().join("hung");
    let once = tmp.path().join("hung-once");
    let o = Command::new(env!("CARGO_BIN_EXE_lockstep-testjob"))
        .args(["train", "--nproc", "3", "--out", dir.to_str().unwrap()])
        .args([
            "--set",
            "job.misbehave=\"hang-in-data\"",
            "--set",
            "dist.timeout_secs=60",
        ])
        .args(["--stall-timeout", "3"])
        .env("LOCKSTEP_TESTJOB_HANG_ONCE", &once)
        .output()
        .unwrap();
    assert_ok(&o);
    let err = stderr(&o);
    assert!(err.contains("reading training sample 37 hangs"), "{err}");
    assert!(
        err.contains("failed: stopped making progress outside any collective"),
        "{err}"
    );
    let s = summary(&dir);
    assert_eq!(hash(&dir), hash(&reference));
    assert_eq!(s["restarts"], 1);
    let f = &s["failures"][0];
    assert!(
        f["detected_by"].as_str().unwrap().contains("heartbeats"),
        "{f}"
    );
    let detection = f["detection_seconds"].as_f64().unwrap();
    assert!(
        detection < 6.0,
        "detection took {detection} s, more than 2× the 3 s stall timeout"
    );
}

/// Runs the job with one misbehaviour and checks the failure is final and explained.
fn misbehaves(how: &str, expected: &[&str]) -> (tempfile::TempDir, Output) {
    let tmp = tempfile::tempdir().unwrap();
    let setting = format!("job.misbehave=\"{how}\"");
    let o = train(&tmp.path().join("run"), "2", &["--set", &setting]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{how}: {err}");
    for e in expected {
        assert!(err.contains(e), "{how}: the error lacks `{e}`:\n{err}");
    }
    assert!(
        !err.contains("lockstep: restart "),
        "{how}: restarted:\n{err}"
    );
    assert!(err.contains("not restarting"), "{how}:\n{err}");
    assert!(
        !err.contains("stack backtrace"),
        "{how}: backtrace noise:\n{err}"
    );
    (tmp, o)
}

/// Said once (not once per rank and again by the launcher), and nothing left behind: the run
/// directory this launch created is gone, so the same command works once the data is fixed.
#[test]
fn a_dataset_shorter_than_a_batch_is_a_final_error_naming_the_job() {
    let (tmp, o) = misbehaves(
        "short-dataset",
        &[
            "`testjob`",
            "10 training samples",
            "train.global_batch = 32",
        ],
    );
    let err = stderr(&o);
    assert_eq!(
        err.matches("10 training samples").count(),
        1,
        "said once:\n{err}"
    );
    assert!(
        !tmp.path().join("run").exists(),
        "an unstarted run leaves no directory"
    );
}

/// A user's binary is itself: its name and version (with lockstep's) in `--version`, its job in
/// `--help`, summary.json and the report's title; its config.toml holds only the sections it
/// reads, with floats as written.
#[test]
fn a_user_binary_presents_itself_and_writes_only_its_own_config() {
    let v = testjob(&["--version"]);
    let out = String::from_utf8_lossy(&v.stdout).into_owned();
    assert!(
        out.starts_with("lockstep-testjob ") && out.contains("(lockstep "),
        "{out}"
    );
    let h = testjob(&["train", "--help"]);
    let help = String::from_utf8_lossy(&h.stdout).into_owned();
    assert!(help.contains("Train testjob on N workers"), "{help}");
    assert!(!help.contains("digits"), "{help}");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    assert_ok(&train(&dir, "1", &["--set", "train.steps=2"]));
    assert_eq!(summary(&dir)["job"], "testjob");
    let report = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        report.starts_with("# testjob: lockstep run report"),
        "{report}"
    );
    let config = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    assert!(
        !config.contains("[model]") && !config.contains("[data]"),
        "{config}"
    );
    assert!(
        config.contains("lr = 0.05\n") && config.contains("[job]"),
        "{config}"
    );
    // And it resumes from that file as the same run.
    let again = testjob(&[
        "train",
        "--resume",
        dir.to_str().unwrap(),
        "--set",
        "train.steps=3",
    ]);
    assert_ok(&again);
}

#[test]
fn a_batch_of_the_wrong_shape_is_a_final_error_naming_job_step_and_microbatch() {
    misbehaves(
        "wrong-shape",
        &[
            "job `testjob`, step 1, micro-batch 0",
            "panicked",
            "expected 8, got 7",
        ],
    );
}

#[test]
fn a_nan_loss_is_a_final_error_naming_the_step_and_microbatch_and_keeps_earlier_checkpoints() {
    // Sample 37 is poisoned; the sampler's shuffle puts it in some step's batch: the error must
    // name that step and the micro-batch holding it.
    let (tmp, o) = misbehaves(
        "nan-loss",
        &["job `testjob`, step ", "micro-batch ", "the loss is NaN"],
    );
    let err = stderr(&o);
    let step: u64 = err
        .split("job `testjob`, step ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.parse().ok())
        .expect("a step number");
    // Checkpoints every 4 steps: those written before the failing step are still there.
    let ckpts: Vec<_> = std::fs::read_dir(tmp.path().join("run/checkpoints"))
        .map(|d| d.flatten().collect())
        .unwrap_or_default();
    assert_eq!(ckpts.len() as u64, ((step - 1) / 4).min(3), "{err}");
}

#[test]
fn a_panic_while_opening_the_data_is_a_final_error_naming_the_job() {
    misbehaves(
        "panic-in-data",
        &[
            "job `testjob`: opening the job panicked",
            "evaluation files are missing",
            "common.rs:",
        ],
    );
}

#[test]
fn bad_job_settings_are_refused_before_anything_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let o = train(&out, "2", &["--set", "job.misbehave=\"often\""]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("job.misbehave = `often`"),
        "{}",
        stderr(&o)
    );
    let o = train(&out, "2", &["--set", "job.colour=1"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("colour"), "{}", stderr(&o));
    // What a user job cannot do (yet) is refused by name.
    let o = train(&out, "2", &["--set", "parallel.pp=2"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(stderr(&o).contains("parallel.pp"), "{}", stderr(&o));
    let o = train(&out, "2", &["--set", "dist.overlap=true"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(stderr(&o).contains("dist.overlap"), "{}", stderr(&o));
    assert!(!out.join("summary.json").exists());
}

#[test]
fn the_device_is_named_per_rank_and_one_that_cannot_be_had_is_refused_before_anything_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let cpu = tmp.path().join("cpu");
    assert_ok(&train(&cpu, "2", &["--device", "cpu"]));
    let s = summary(&cpu);
    for r in s["ranks"].as_array().unwrap() {
        let device = r["device"].as_str().unwrap();
        assert!(device.starts_with("flex 0: "), "{device}");
    }
    let metrics = std::fs::read_to_string(cpu.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"device_copy\""), "no device_copy phase");
    // No GPU here: built without CUDA (the default build) or without a driver, the run is
    // refused by the launcher, naming the setting, before any worker or file.
    let out = tmp.path().join("cuda");
    let o = train(&out, "2", &["--set", "train.device=\"cuda\""]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("train.device = \"cuda\""),
        "{}",
        stderr(&o)
    );
    assert!(
        !stderr(&o).contains("[rank "),
        "a worker started: {}",
        stderr(&o)
    );
    assert!(!out.exists());
    let o = train(&out, "2", &["--device", "tpu"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("tpu"), "{}", stderr(&o));
}

#[test]
fn a_user_jobs_settings_are_part_of_its_identity() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    assert_ok(&train(&out, "2", &[]));
    let o = testjob(&[
        "train",
        "--resume",
        out.to_str().unwrap(),
        "--set",
        "job.hidden=32",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("job.hidden: 16 → 32"), "{}", stderr(&o));
    // Extending it is allowed and continues from its last checkpoint.
    let o = testjob(&[
        "train",
        "--resume",
        out.to_str().unwrap(),
        "--set",
        "train.steps=16",
    ]);
    assert_ok(&o);
    assert_eq!(summary(&out)["steps"], 16);
}

/// A worker that runs out of memory reports it as a typed message (lockstep's allocator) and
/// aborts; with `RUST_BACKTRACE=1` a backtrace follows, so the allocator's own line is no longer
/// among the last lines the launcher shows — which it never reads anyway. Out of memory, final:
/// no restart of a failure that recurs, and the summary says so by kind.
#[test]
fn a_worker_out_of_memory_is_final_even_with_a_backtrace_after_the_allocators_line() {
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_lockstep-testjob"))
        .args([
            "train",
            "--nproc",
            "2",
            "--out",
            tmp.path().join("run").to_str().unwrap(),
            "--set",
            "job.misbehave=\"out-of-memory\"",
        ])
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("spawn lockstep-testjob");
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("memory allocation of"), "{err}");
    assert!(
        err.contains("stack backtrace"),
        "the backtrace did not follow:\n{err}"
    );
    assert!(err.contains("(out of memory: not restarting)"), "{err}");
    assert!(!err.contains("lockstep: restart "), "restarted:\n{err}");
    assert!(
        err.contains("ran out of memory (an allocation of 35184372088832 bytes failed)"),
        "{err}"
    );
    assert!(
        !err.contains("@@lockstep"),
        "a protocol line was shown:\n{err}"
    );
}

/// burn's `Dropout` inside a user's model: every micro-batch draws from its own stream keyed by
/// (seed, step, micro-batch), so the masks — and the parameters — are the same whichever rank
/// computes a micro-batch, at 1, 2 or 3 workers and after a killed worker's restart; and the
/// dropout really acts (the parameters differ from a run without it).
#[test]
fn dropout_in_a_user_job_gives_one_hash_at_every_world_size_and_after_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let dropout = ["--set", "job.dropout=0.3"];
    let one = tmp.path().join("one");
    assert_ok(&train(&one, "1", &dropout));
    let plain = tmp.path().join("plain");
    assert_ok(&train(&plain, "1", &[]));
    assert_ne!(hash(&one), hash(&plain), "dropout must change the run");
    for n in ["2", "3"] {
        let dir = tmp.path().join(format!("n{n}"));
        assert_ok(&train(&dir, n, &dropout));
        assert_eq!(hash(&dir), hash(&one), "dropout at {n} workers vs 1");
    }
    let killed = tmp.path().join("killed");
    let mut args = dropout.to_vec();
    args.extend(["--inject", "kill:rank=1,step=6"]);
    assert_ok(&train(&killed, "3", &args));
    assert!(summary(&killed)["restarts"].as_u64().unwrap() >= 1);
    assert_eq!(hash(&killed), hash(&one), "dropout after a restart");
}

/// `optimizer.clip_grad_norm` on a user's `Job`: the same parameters at 1 and 3 workers, and a
/// clipped run differs from an unclipped one (the limit binds).
#[test]
fn gradient_clipping_in_a_user_job_gives_one_hash_at_every_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let clip = ["--set", "optimizer.clip_grad_norm=0.2"];
    let one = tmp.path().join("one");
    assert_ok(&train(&one, "1", &clip));
    let three = tmp.path().join("three");
    assert_ok(&train(&three, "3", &clip));
    assert_eq!(hash(&three), hash(&one), "clipped: 3 workers vs 1");
    let plain = tmp.path().join("plain");
    assert_ok(&train(&plain, "1", &[]));
    assert_ne!(hash(&one), hash(&plain), "clipping must change the run");
    let bad = tmp.path().join("bad");
    let o = train(&bad, "1", &["--set", "optimizer.clip_grad_norm=-1"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("optimizer.clip_grad_norm"),
        "{}",
        stderr(&o)
    );
}

/// `Job::on_event`: rank 0's hook sees each evaluation (with the figures summary.json records)
/// and each checkpoint on disk — the same events with the same bits at 1 and 3 workers; a hook
/// that panics ends the run with exit status 3 naming it, after the outputs are written.
#[test]
fn the_jobs_hook_sees_the_same_evaluations_and_checkpoints_at_every_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let hooked = |n: &str| {
        let events = tmp.path().join(format!("events-{n}.txt"));
        let o = Command::new(env!("CARGO_BIN_EXE_lockstep-testjob"))
            .args(["train", "--nproc", n, "--out"])
            .arg(tmp.path().join(format!("run-{n}")))
            .env("LOCKSTEP_TESTJOB_EVENTS", &events)
            .output()
            .unwrap();
        assert_ok(&o);
        std::fs::read_to_string(events).unwrap()
    };
    let one = hooked("1");
    assert_eq!(hooked("3"), one, "the hook's events at 3 workers vs 1");
    let lines: Vec<&str> = one.lines().collect();
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("evaluated")).count(),
        2,
        "{one}"
    );
    for step in [4, 8, 12] {
        assert!(
            one.contains(&format!("checkpointed {step} step-")),
            "checkpoint {step}: {one}"
        );
    }
    let mae = summary(&tmp.path().join("run-1"))["test_metrics"]["mae"]
        .as_f64()
        .unwrap();
    let last = lines
        .iter()
        .find(|l| l.starts_with("evaluated 12 "))
        .unwrap();
    let bits = u64::from_str_radix(last.rsplit(' ').next().unwrap(), 16).unwrap();
    let hooked_mae = f64::from_bits(bits);
    // (serde_json's float parsing may be off by an ulp: compare within a few.)
    assert!(
        (hooked_mae - mae).abs() <= 4.0 * f64::EPSILON * mae,
        "the last evaluation's mae {hooked_mae} is summary.json's {mae}"
    );
    let dir = tmp.path().join("panics");
    let o = Command::new(env!("CARGO_BIN_EXE_lockstep-testjob"))
        .args(["train", "--nproc", "2", "--out"])
        .arg(&dir)
        .env("LOCKSTEP_TESTJOB_HOOK_PANIC", "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("on_event hook panicked"),
        "{}",
        stderr(&o)
    );
    assert!(
        stderr(&o).contains("evaluation 6 (deliberate)"),
        "{}",
        stderr(&o)
    );
    assert!(dir.join("summary.json").exists(), "the outputs are written");
}

/// Every optimizer (Adam with L2 decay, AdamW, SGD with Nesterov momentum and decay) gives the
/// same parameters at 1 and 3 workers, and each is a different run.
#[test]
fn every_optimizer_gives_one_hash_at_1_and_3_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let optimizers: [&[&str]; 3] = [
        &[
            "optimizer.kind=\"adam\"",
            "optimizer.weight_decay=0.01",
            "train.lr=0.005",
        ],
        &[
            "optimizer.kind=\"adamw\"",
            "optimizer.weight_decay=0.01",
            "train.lr=0.005",
        ],
        &[
            "optimizer.kind=\"sgd\"",
            "optimizer.nesterov=true",
            "optimizer.weight_decay=0.01",
        ],
    ];
    let mut hashes = Vec::new();
    for (i, sets) in optimizers.iter().enumerate() {
        let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s]).collect();
        let one = tmp.path().join(format!("{i}-one"));
        let three = tmp.path().join(format!("{i}-three"));
        assert_ok(&train(&one, "1", &args));
        assert_ok(&train(&three, "3", &args));
        assert_eq!(hash(&three), hash(&one), "{sets:?}: 3 workers vs 1");
        hashes.push(hash(&one));
    }
    hashes.dedup();
    assert_eq!(hashes.len(), 3, "three different runs");
}

/// `Job::loss_and_metrics`: the training metric of every step is summed exactly over the global
/// batch, so it has the same bits at 1 and 3 workers and after a restart; it is the per-sample
/// mean (mean absolute error² ≤ mean squared error, the loss, with equality only for equal
/// errors); it reaches TensorBoard's file; and a job returning more values than it names is
/// stopped with a final error naming the step and the micro-batch.
#[test]
fn a_user_jobs_training_metrics_are_the_same_at_every_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    assert_ok(&train(&one, "1", &[]));
    let mae = train_metric(&one, "mae");
    assert_eq!(mae.len(), 12, "one value per step: {mae:?}");
    let loss = per_step(&one, |r| r["loss"].as_f64());
    for ((step, m), (_, l)) in mae.iter().zip(&loss) {
        assert!(*m > 0.0 && m * m < *l, "step {step}: mae {m}, mse {l}");
    }
    let three = tmp.path().join("three");
    assert_ok(&train(&three, "3", &[]));
    assert_eq!(train_metric(&three, "mae"), mae, "3 workers vs 1");
    let killed = tmp.path().join("killed");
    assert_ok(&train(&killed, "2", &["--inject", "kill:rank=1,step=6"]));
    assert_eq!(train_metric(&killed, "mae"), mae, "after a restart");
    let events = std::fs::read(one.join("tensorboard/events.out.tfevents.0.lockstep")).unwrap();
    assert!(
        events.windows(9).any(|w| w == b"train/mae"),
        "TensorBoard's file lacks train/mae"
    );

    let bad = tmp.path().join("bad");
    let o = Command::new(env!("CARGO_BIN_EXE_lockstep-testjob"))
        .args(["train", "--nproc", "2", "--out"])
        .arg(&bad)
        .env("LOCKSTEP_TESTJOB_BAD_METRICS", "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    for part in [
        "testjob",
        "step 1",
        "micro-batch",
        "2 training metrics",
        "TRAIN_METRICS",
    ] {
        assert!(err.contains(part), "the error lacks `{part}`:\n{err}");
    }
}

/// `optimizer.kind = "custom"`: the job's own elementwise update rule (sign descent with
/// momentum) gives one hash at 1 and 3 workers, with its state sharded (ZeRO 1) and after a
/// restart from a checkpoint (its state saved and restored); a rule that is not elementwise is
/// refused before anything starts, naming it.
#[test]
fn a_jobs_own_update_rule_gives_one_hash_for_every_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let custom = ["--set", "optimizer.kind=\"custom\""];
    let one = tmp.path().join("one");
    assert_ok(&train(&one, "1", &custom));
    let sgd = tmp.path().join("sgd");
    assert_ok(&train(&sgd, "1", &[]));
    assert_ne!(hash(&one), hash(&sgd), "the rule must change the run");
    let layouts: [(&str, &str, &[&str]); 3] = [
        ("three", "3", &[]),
        ("zero1", "2", &["--set", "parallel.zero=1"]),
        ("killed", "2", &["--inject", "kill:rank=1,step=6"]),
    ];
    for (name, n, extra) in layouts {
        let dir = tmp.path().join(name);
        assert_ok(&train(&dir, n, &[&custom[..], extra].concat()));
        assert_eq!(hash(&dir), hash(&one), "custom rule: {name} vs 1 worker");
    }
    assert!(
        summary(&tmp.path().join("killed"))["restarts"]
            .as_u64()
            .unwrap()
            >= 1
    );

    let bad = tmp.path().join("bad");
    let o = Command::new(env!("CARGO_BIN_EXE_lockstep-testjob"))
        .args(["train", "--nproc", "2", "--out"])
        .arg(&bad)
        .args(custom)
        .env("LOCKSTEP_TESTJOB_BAD_RULE", "1")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    for part in [
        "optimizer.kind",
        "`slice-normalised` is not elementwise",
        "parameter",
    ] {
        assert!(err.contains(part), "the error lacks `{part}`:\n{err}");
    }
    assert!(!bad.exists(), "refused before anything was written");
}

/// A `Job` that does not declare `BF16_PRODUCTS` (its products are burn's, untouched by
/// lockstep) is refused `train.precision = "bf16"` before any worker starts, naming the setting
/// and what to do; nothing is written.
#[test]
fn bf16_is_refused_for_a_job_whose_products_do_not_take_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let o = train(&out, "2", &["--set", "train.precision=\"bf16\""]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    for needle in ["train.precision", "BF16_PRODUCTS", "lockstep::products"] {
        assert!(err.contains(needle), "missing {needle:?}: {err}");
    }
    assert!(!out.exists(), "a refused run wrote {}", out.display());
}
