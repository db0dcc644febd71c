//! A user's `LayeredJob`: the same parameter bits on one worker and as a pipeline of any layout,
//! and a misbehaving stage stopped with one final error naming the job, the step and the
//! micro-batch (exit status 3, no restart).

mod support;

use std::path::Path;
use std::process::{Command, Output};

use support::{per_step, train_metric};

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
    // Its two data-parallel replicas of each stage sum their gradients through shared windows.
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir("dp2pp2").join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(s["gradient_sum"], "shared_windows");
}

/// Each of `runs` (name, nproc, flags) under `dir` with `setting` on top, and a run without it
/// (`plain`), which must end elsewhere than `one`: the setting acts.
fn runs_with(dir: &Path, setting: &[&str], runs: &[(&str, &str, &[&str])]) {
    for (name, nproc, extra) in runs {
        let args = [setting, extra].concat();
        let o = layered(&dir.join(name), nproc, &args);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
    }
    let o = layered(&dir.join("plain"), "1", &[]);
    assert!(o.status.success(), "plain: {}", stderr(&o));
    assert_ne!(
        hash(&dir.join("one")),
        hash(&dir.join("plain")),
        "{setting:?} must change the run"
    );
}

/// Dropout inside a pipeline's layer: each layer draws from the stream of (seed, step,
/// micro-batch, layer), so cutting the model into stages, replicating them, overlapping the
/// backward or killing a worker leaves the masks — and the parameters — as on one worker.
#[test]
fn dropout_in_a_layered_user_job_gives_one_hash_for_every_layout_and_after_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let runs: [(&str, &str, &[&str]); 6] = [
        ("one", "1", &[]),
        ("dp2", "2", &[]),
        ("dp3", "3", &[]),
        ("pp2", "2", &["--set", "parallel.pp=2"]),
        ("overlap", "1", &["--set", "dist.overlap=true"]),
        (
            "killed",
            "4",
            &["--set", "parallel.pp=2", "--inject", "kill:rank=3,step=6"],
        ),
    ];
    runs_with(tmp.path(), &["--set", "job.dropout=0.3"], &runs);
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir("killed").join("summary.json")).unwrap())
            .unwrap();
    assert!(
        s["restarts"].as_u64().unwrap() >= 1,
        "the kill was survived"
    );
    // The job's training metric (`LayeredJob::loss_and_metrics`), from the last stage's output:
    // one value per step, the same bits on every rank and layout.
    let mae = train_metric(&dir("one"), "mae");
    assert_eq!(mae.len(), 12, "one value per step: {mae:?}");
    for name in ["dp2", "dp3", "pp2", "overlap", "killed"] {
        assert_eq!(
            hash(&dir(name)),
            hash(&dir("one")),
            "dropout: {name} vs one worker"
        );
        assert_eq!(train_metric(&dir(name), "mae"), mae, "{name}: training mae");
    }
}

/// `optimizer.clip_grad_norm`: the norm is one exact sum of squares over the whole model, so
/// clipping gives the one-worker bits with replicated and sharded optimizers (ZeRO 0–3) and
/// pipeline stages; metrics.jsonl records the same norm on every rank and layout.
#[test]
fn gradient_clipping_gives_one_hash_for_every_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let runs: [(&str, &str, &[&str]); 6] = [
        ("one", "1", &[]),
        ("dp3", "3", &[]),
        ("dp2z2", "2", &["--set", "parallel.zero=2"]),
        ("dp3z3", "3", &["--set", "parallel.zero=3"]),
        ("pp2", "2", &["--set", "parallel.pp=2"]),
        (
            "dp2pp2z1",
            "4",
            &["--set", "parallel.pp=2", "--set", "parallel.zero=1"],
        ),
    ];
    runs_with(
        tmp.path(),
        &["--set", "optimizer.clip_grad_norm=0.2"],
        &runs,
    );
    let norms = |name: &str| per_step(&dir(name), |r| r["grad_norm"].as_f64());
    let one = norms("one");
    assert_eq!(one.len(), 12, "one norm per step: {one:?}");
    assert!(
        one.iter().filter(|(_, n)| *n > 0.2).count() >= 3,
        "the limit must bind on some steps: {one:?}"
    );
    for name in ["dp3", "dp2z2", "dp3z3", "pp2", "dp2pp2z1"] {
        assert_eq!(
            hash(&dir(name)),
            hash(&dir("one")),
            "clipped: {name} vs one worker"
        );
        assert_eq!(
            norms(name),
            one,
            "{name}: every rank records the one-worker norm"
        );
    }
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

/// Started by a cluster engine instead of `--nproc`: every process is one worker, told its rank by
/// the engine's variables, rank 0 serving the rendezvous at MASTER_ADDR:MASTER_PORT.
fn under_engine(
    bin: &str,
    out: &Path,
    world: usize,
    extra: &[&str],
    vars: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let children: Vec<_> = (0..world)
        .map(|r| {
            let mut c = Command::new(bin);
            c.args(["train", "--out", out.to_str().unwrap()])
                .args(extra)
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("LOCKSTEP_SECRET", "7e".repeat(32))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            for (k, v) in vars(r) {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect();
    for (r, child) in children.into_iter().enumerate() {
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success(), "rank {r}: {}", stderr(&o));
    }
    hash(out)
}

#[test]
fn user_binaries_run_under_torchrun_and_slurm_variables_with_the_one_worker_bits() {
    let tmp = tempfile::tempdir().unwrap();
    // A Job under torchrun-style variables, 2 processes.
    let job = env!("CARGO_BIN_EXE_lockstep-testjob");
    let one = tmp.path().join("job-one");
    let o = Command::new(job)
        .args(["train", "--nproc", "1", "--out", one.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let torch = under_engine(job, &tmp.path().join("torch"), 2, &[], |r| {
        vec![
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_RANK", r.to_string()),
        ]
    });
    assert_eq!(torch, hash(&one));
    // A LayeredJob as a 2-stage pipeline under Slurm-style variables.
    let layered_bin = env!("CARGO_BIN_EXE_lockstep-testjob-layered");
    let one = tmp.path().join("layered-one");
    assert!(layered(&one, "1", &["--set", "parallel.pp=1"])
        .status
        .success());
    let slurm = under_engine(
        layered_bin,
        &tmp.path().join("slurm"),
        2,
        &["--set", "parallel.pp=2"],
        |r| {
            vec![
                ("SLURM_PROCID", r.to_string()),
                ("SLURM_NTASKS", "2".into()),
                ("SLURM_LOCALID", r.to_string()),
            ]
        },
    );
    assert_eq!(slurm, hash(&one));
}

/// ZeRO 3 on a user's layered job: every rank keeps only its shard of the parameters between
/// steps (its burn layers are released, `flat::release`), reports a little over half of ZeRO 0's
/// parameter bytes at dp 2, and ends with the one-worker bits.
#[test]
fn zero3_on_a_layered_user_job_holds_a_shard_with_the_one_worker_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let run = |name: &str, nproc: &str, zero: &str| {
        let o = layered(
            &dir(name),
            nproc,
            &["--set", &format!("parallel.zero={zero}")],
        );
        assert!(o.status.success(), "{name}: {}", stderr(&o));
    };
    run("one", "1", "0");
    run("z0", "2", "0");
    run("z3", "2", "3");
    assert_eq!(hash(&dir("z3")), hash(&dir("one")));
    let params = |name: &str| -> u64 {
        let s: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir(name).join("summary.json")).unwrap())
                .unwrap();
        s["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["memory"]["params_bytes"].as_u64().unwrap())
            .max()
            .unwrap()
    };
    let ratio = params("z3") as f64 / params("z0") as f64;
    assert!(
        ratio <= 0.55,
        "ZeRO 3 keeps {ratio:.3} of ZeRO 0's parameter bytes"
    );
}

/// `dist.overlap` on a layered model with one stage: the last micro-batch's backward runs layer by
/// layer and hands each layer's gradient to the sum as soon as it exists — the bits of the plain
/// schedule, whatever the world.
#[test]
fn overlap_on_a_layered_user_job_gives_the_bits_of_overlap_off() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    for (name, nproc, overlap) in [
        ("off", "2", "false"),
        ("on", "2", "true"),
        ("on3", "3", "true"),
    ] {
        let o = layered(
            &dir(name),
            nproc,
            &["--set", &format!("dist.overlap={overlap}")],
        );
        assert!(o.status.success(), "{name}: {}", stderr(&o));
    }
    assert_eq!(hash(&dir("on")), hash(&dir("off")));
    assert_eq!(hash(&dir("on3")), hash(&dir("off")));
}

/// The job's own update rule on a `LayeredJob`: its state sharded per stage and per data-parallel
/// rank (ZeRO 2 and 3) gives the one-worker bits.
#[test]
fn a_layered_jobs_own_update_rule_gives_one_hash_for_every_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let runs: [(&str, &str, &[&str]); 4] = [
        ("one", "1", &[]),
        ("dp2z3", "2", &["--set", "parallel.zero=3"]),
        (
            "dp2pp2z2",
            "4",
            &["--set", "parallel.pp=2", "--set", "parallel.zero=2"],
        ),
        ("overlap", "1", &["--set", "dist.overlap=true"]),
    ];
    runs_with(tmp.path(), &["--set", "optimizer.kind=\"custom\""], &runs);
    for name in ["dp2z3", "dp2pp2z2", "overlap"] {
        assert_eq!(hash(&dir(name)), hash(&dir("one")), "custom rule: {name}");
    }
}

/// `train.recompute = "layers"`: with dropout, every layout gives the one-worker bits of a run
/// that keeps its graphs (the recomputed forwards draw the same masks), and the first stage of a
/// GPipe pipeline — eight micro-batches in flight — keeps only its layers' inputs, which its
/// activation figure in summary.json shows. At ZeRO 3 the stages gather their parameters one
/// layer at a time (`param_gathering = "layer"`), with the same bits.
#[test]
fn recomputing_layers_keeps_the_bits_and_holds_only_the_layers_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let recompute = ["--set", "train.recompute=\"layers\""];
    let gpipe = [
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.schedule=\"gpipe\"",
    ];
    let runs: [(&str, &str, &[&str]); 6] = [
        ("kept", "1", &[]),
        ("one", "1", &recompute),
        (
            "dp2z3",
            "2",
            &[&recompute[..], &["--set", "parallel.zero=3"]].concat(),
        ),
        ("pp2", "2", &[&recompute[..], &gpipe[..]].concat()),
        ("pp2-kept", "2", &gpipe),
        (
            "dp2pp2z3",
            "4",
            &[
                &recompute[..],
                &["--set", "parallel.pp=2", "--set", "parallel.zero=3"],
            ]
            .concat(),
        ),
    ];
    for (name, nproc, extra) in runs {
        let o = layered(
            &dir(name),
            nproc,
            &[&["--set", "job.dropout=0.3"], extra].concat(),
        );
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        assert_eq!(
            hash(&dir(name)),
            hash(&dir("kept")),
            "{name} vs kept graphs"
        );
    }
    let summary = |name: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(dir(name).join("summary.json")).unwrap()).unwrap()
    };
    for name in ["dp2z3", "dp2pp2z3"] {
        assert_eq!(summary(name)["param_gathering"], "layer", "{name}");
    }
    let activations = |name: &str| -> u64 {
        summary(name)["ranks"][0]["memory"]["activation_peak_bytes"]
            .as_u64()
            .unwrap()
    };
    // Stage 0 (the hidden layer) kept its [n, 16] outputs; recomputing, its [n, 8] inputs.
    assert_eq!(activations("pp2") * 2, activations("pp2-kept"));
}

/// `train.precision = "bf16"` in a user's `LayeredJob` that takes its products' operands through
/// `lockstep::products(cfg)` (and declares `BF16_PRODUCTS`): one worker, a pipeline and two
/// replicas end with one hash, not the `f32` one, and the summary says how the products ran.
#[test]
fn bf16_products_of_a_user_layered_job_have_one_hash_for_every_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let bf16 = ["--set", "train.precision=\"bf16\""];
    let runs: [(&str, &str, Vec<&str>); 4] = [
        ("f32", "1", vec![]),
        ("one", "1", bf16.to_vec()),
        (
            "pp2",
            "2",
            [&bf16[..], &["--set", "parallel.pp=2"]].concat(),
        ),
        ("dp2", "2", bf16.to_vec()),
    ];
    for (name, nproc, extra) in &runs {
        let o = layered(&dir(name), nproc, extra);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
    }
    assert_ne!(
        hash(&dir("one")),
        hash(&dir("f32")),
        "bf16 products changed nothing"
    );
    assert_eq!(hash(&dir("pp2")), hash(&dir("one")));
    assert_eq!(hash(&dir("dp2")), hash(&dir("one")));
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir("dp2").join("summary.json")).unwrap()).unwrap();
    assert_eq!(s["plan"]["bf16_products"], true);
    let how = s["compute"]["bf16_products"].as_str().unwrap_or_default();
    assert!(
        how.starts_with("f32 kernels on bf16-rounded operands"),
        "{how}"
    );
    let f32_run: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir("f32").join("summary.json")).unwrap()).unwrap();
    assert!(f32_run["compute"].get("bf16_products").is_none());
}
