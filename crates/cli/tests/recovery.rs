//! Fault tolerance end to end: injected crashes, hangs, lost workers and damaged checkpoints are
//! survived, and the final parameters are bit-identical to the fault-free run's.

use std::path::Path;
use std::process::Output;

mod common;
use common::{assert_ok, lockstep, summary};

const STEPS: &str = "train.steps=40";
const EVERY: u64 = 10;

fn run(args: &[&str]) -> Output {
    lockstep(args).output().expect("spawn lockstep")
}

fn train(out: &Path, nproc: &str, extra: &[&str]) -> Output {
    let every = format!("checkpoint.every={EVERY}");
    let mut args = vec![
        "train",
        "--nproc",
        nproc,
        "--out",
        out.to_str().unwrap(),
        "--set",
        STEPS,
        "--set",
        &every,
    ];
    args.extend_from_slice(extra);
    run(&args)
}

fn ok(o: &Output) -> &Output {
    assert_ok(o);
    o
}

fn reference_hash(tmp: &Path) -> String {
    let dir = tmp.join("reference");
    ok(&train(&dir, "1", &[]));
    summary(&dir)["param_hash"].as_str().unwrap().to_string()
}

/// 20 runs, each losing one random worker at a random step (SIGKILL): all finish with the
/// fault-free parameters, recomputing at most one checkpoint interval.
#[test]
fn chaos_twenty_random_kills_all_recover_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let want = reference_hash(tmp.path());
    let mut seed: u64 = 0x5eed;
    let mut next = |n: u64| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    for run in 0..20 {
        let (rank, step) = (next(3), 1 + next(38));
        let dir = tmp.path().join(format!("chaos-{run}"));
        let spec = format!("kill:rank={rank},step={step}");
        let o = train(&dir, "3", &["--inject", &spec]);
        assert!(
            o.status.success(),
            "run {run} ({spec}) did not recover:\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let s = summary(&dir);
        assert_eq!(
            s["param_hash"].as_str().unwrap(),
            want,
            "run {run} ({spec})"
        );
        assert_eq!(s["restarts"], 1, "run {run}");
        let f = &s["failures"][0];
        assert_eq!(f["rank"], rank, "run {run}: {f}");
        assert!(f["what"].as_str().unwrap().contains("SIGKILL"), "{f}");
        let recomputed = f["steps_recomputed"].as_u64().unwrap();
        assert!(
            recomputed <= EVERY,
            "run {run} ({spec}): {recomputed} steps recomputed > interval {EVERY}"
        );
        assert_eq!(
            f["resumed_from"].as_u64().unwrap(),
            step / EVERY * EVERY,
            "run {run} ({spec})"
        );
    }
}

#[test]
fn elastic_job_loses_a_worker_for_good_and_finishes_on_three_with_the_same_result() {
    let tmp = tempfile::tempdir().unwrap();
    let want = reference_hash(tmp.path());
    let dir = tmp.path().join("elastic");
    let o = ok(&train(&dir, "3:4", &["--inject", "lose:rank=3,step=25"])).clone();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("continuing elastically with 3 workers"),
        "{err}"
    );
    let s = summary(&dir);
    assert_eq!(s["world_size"], 3);
    assert_eq!(s["param_hash"].as_str().unwrap(), want);
    assert_eq!(s["failures"][0]["world_size"], 4);
}

/// A worker slot given back after an elastic shrink (`kill -USR1 <launcher>`): the job regrows
/// to MAX at the next checkpoint boundary, resuming from the checkpoint just written, and ends
/// with the fault-free bits; both changes are on the summary's membership timeline.
#[test]
fn elastic_job_regrows_when_a_slot_is_given_back() {
    use std::io::{BufRead, BufReader};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("regrow");
    let reference = tmp.path().join("reference");
    let sets = ["--set", "train.steps=80", "--set", "checkpoint.every=10"];
    let mut args = vec![
        "train",
        "--nproc",
        "1",
        "--out",
        reference.to_str().unwrap(),
    ];
    args.extend(sets);
    ok(&run(&args));
    let want = summary(&reference)["param_hash"].clone();
    let mut args = vec!["train", "--nproc", "3:4", "--out", dir.to_str().unwrap()];
    args.extend(sets);
    // Slow enough that the signal lands well before the last boundary.
    args.extend(["--inject", "lose:rank=3,step=5;slow:rank=0,factor=30"]);
    let mut child = lockstep(&args)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn lockstep");
    let mut log = String::new();
    let mut signalled = false;
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        if !signalled && line.contains("continuing elastically with 3 workers") {
            let pid = child.id().to_string();
            let sent = std::process::Command::new("kill")
                .args(["-USR1", &pid])
                .status();
            assert!(sent.unwrap().success());
            signalled = true;
        }
        log.push_str(&line);
        log.push('\n');
    }
    assert!(child.wait().unwrap().success(), "{log}");
    assert!(signalled, "the worker was never lost:\n{log}");
    let s = summary(&dir);
    assert_eq!(s["param_hash"], want, "{log}");
    assert_eq!(s["world_size"], 4, "{log}");
    assert_eq!(s["restarts"], 1, "a regrow is not a restart: {log}");
    let m = s["membership"].as_array().unwrap();
    assert_eq!(m.len(), 2, "{m:?}");
    assert_eq!(
        (&m[0]["change"], &m[0]["world_after"]),
        (&"worker lost".into(), &3.into())
    );
    assert_eq!(m[1]["change"], "worker slot given back");
    assert_eq!(
        (&m[1]["world_before"], &m[1]["world_after"]),
        (&3.into(), &4.into())
    );
    let resumed = m[1]["resumed_from"].as_u64().unwrap();
    assert!(resumed.is_multiple_of(EVERY) && resumed > 0, "{m:?}");
    assert!(m[1]["steps_recomputed"].as_u64().unwrap() < EVERY, "{m:?}");
}

#[test]
fn a_hung_worker_is_detected_within_twice_the_timeout_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    let want = reference_hash(tmp.path());
    let dir = tmp.path().join("hang");
    let o = ok(&train(
        &dir,
        "3",
        &[
            "--inject",
            "hang:rank=1,step=23",
            "--set",
            "dist.timeout_secs=3",
        ],
    ))
    .clone();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("worker rank 1 failed: stopped making progress"),
        "{err}"
    );
    let s = summary(&dir);
    assert_eq!(s["param_hash"].as_str().unwrap(), want);
    let f = &s["failures"][0];
    assert_eq!(f["rank"], 1);
    let detection = f["detection_seconds"].as_f64().unwrap();
    assert!(
        detection < 6.0,
        "detection took {detection} s, more than 2× the 3 s timeout"
    );
}

/// A worker stuck outside any collective (the injected hang fires at the start of its step,
/// before its data is loaded) is found by its launcher from its heartbeats — not waiting, idle —
/// long before the peers' 60 s collective timeout, named, and recovered from.
#[test]
fn a_worker_hung_outside_collectives_is_found_by_its_heartbeat_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    let want = reference_hash(tmp.path());
    let dir = tmp.path().join("stall");
    let o = ok(&train(
        &dir,
        "3",
        &[
            "--inject",
            "hang:rank=1,step=23",
            "--set",
            "dist.timeout_secs=60",
            "--stall-timeout",
            "3",
        ],
    ))
    .clone();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("worker rank 1 failed: stopped making progress outside any collective"),
        "{err}"
    );
    let s = summary(&dir);
    assert_eq!(s["param_hash"].as_str().unwrap(), want);
    assert_eq!(s["restarts"], 1);
    let f = &s["failures"][0];
    assert_eq!(f["rank"], 1);
    let detection = f["detection_seconds"].as_f64().unwrap();
    assert!(
        detection < 6.0,
        "detection took {detection} s, more than 2× the 3 s stall timeout"
    );
}

#[test]
fn a_damaged_newest_checkpoint_is_reported_and_the_previous_one_used() {
    let tmp = tempfile::tempdir().unwrap();
    let want = reference_hash(tmp.path());
    let dir = tmp.path().join("corrupt");
    let o = ok(&train(
        &dir,
        "2",
        &["--inject", "corrupt-checkpoint:step=20;kill:rank=1,step=25"],
    ))
    .clone();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("skipping damaged checkpoint") && err.contains("checksum"),
        "{err}"
    );
    let s = summary(&dir);
    assert_eq!(s["param_hash"].as_str().unwrap(), want);
    assert_eq!(s["failures"][0]["resumed_from"], 10);
    assert_eq!(s["steps_recomputed"], 15);
}

/// Checkpoints written in the background hold the bytes of those written in the step, and the
/// run ends with the same parameters; its summary says which way they were written and what
/// they cost. The writer holds the training vectors themselves (no copy): a write slow enough
/// that the next steps' updates happen while it still reads them (the updates then copy first)
/// still holds the values of its own step.
#[test]
fn background_checkpoints_have_the_bytes_of_checkpoints_written_in_the_step() {
    let tmp = tempfile::tempdir().unwrap();
    let (in_step, background) = (tmp.path().join("in-step"), tmp.path().join("background"));
    let slow = tmp.path().join("slow");
    ok(&train(&in_step, "2", &[]));
    ok(&train(
        &background,
        "2",
        &["--set", "checkpoint.async=true"],
    ));
    let o = ok(&train(
        &slow,
        "2",
        &[
            "--set",
            "checkpoint.async=true",
            "--inject",
            "slow-checkpoint-write:step=20,seconds=2",
        ],
    ))
    .clone();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("writes the checkpoint of step 20 2 s slower"),
        "{err}"
    );
    for dir in [&background, &slow] {
        assert_eq!(summary(dir)["param_hash"], summary(&in_step)["param_hash"]);
    }
    for step in [20, 30, 40] {
        let name = format!("checkpoints/step-{step:09}.ckpt");
        for dir in [&background, &slow] {
            let (a, b) = (in_step.join(&name), dir.join(&name));
            assert_eq!(
                std::fs::read(&a).unwrap(),
                std::fs::read(&b).unwrap(),
                "{name} of {dir:?}"
            );
        }
    }
    for (dir, background) in [(&in_step, false), (&background, true)] {
        let c = &summary(dir)["checkpoints"];
        assert_eq!(c["background"], background, "{c}");
        assert_eq!(c["count"], 4, "{c}");
        assert!(c["stall_seconds_max"].as_f64().unwrap() > 0.0, "{c}");
    }
    // The stall is a phase of the checkpoint steps' records, and only of theirs.
    let metrics = std::fs::read_to_string(background.join("metrics.jsonl")).unwrap();
    let stalled: Vec<u64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["rank"] == 0 && r["seconds"]["checkpoint"].as_f64().is_some())
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(stalled, [9, 19, 29, 39]);
    let report = std::fs::read_to_string(background.join("report.md")).unwrap();
    assert!(
        report.contains("Checkpoints: 4 taken, written in the background"),
        "{report}"
    );
}

/// Rank 0 killed half-way through writing a checkpoint, in the step or in the background: the
/// unfinished file never counts as a checkpoint, the run resumes from the previous one with the
/// fault-free parameters, and the unfinished file is removed.
#[test]
fn a_kill_while_a_checkpoint_is_written_resumes_from_the_previous_one() {
    let tmp = tempfile::tempdir().unwrap();
    let want = reference_hash(tmp.path());
    for background in ["false", "true"] {
        let dir = tmp.path().join(format!("async-{background}"));
        let mode = format!("checkpoint.async={background}");
        let o = ok(&train(
            &dir,
            "2",
            &[
                "--set",
                &mode,
                "--inject",
                "kill-while-checkpointing:step=20",
            ],
        ))
        .clone();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("rank 0 kills itself while writing the checkpoint of step 20")
                && err.contains("left unfinished by an interrupted checkpoint write"),
            "{background}: {err}"
        );
        let s = summary(&dir);
        assert_eq!(s["param_hash"].as_str().unwrap(), want, "{background}");
        assert_eq!(s["failures"][0]["resumed_from"], 10, "{background}");
        let mut names: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "step-000000020.ckpt",
                "step-000000030.ckpt",
                "step-000000040.ckpt"
            ],
            "{background}"
        );
    }
}

#[test]
fn resume_continues_a_stopped_run_on_a_different_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let want = reference_hash(tmp.path());
    let dir = tmp.path().join("stopped");
    // 4 workers, no restarts allowed: the job fails at step 27 …
    let o = train(
        &dir,
        "4",
        &["--inject", "kill:rank=2,step=27", "--max-restarts", "0"],
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("giving up after 0 restart(s)"));
    // … and continues on 2 workers from its step-20 checkpoint, to the same bits.
    let o = ok(&run(&[
        "train",
        "--nproc",
        "2",
        "--resume",
        dir.to_str().unwrap(),
    ]))
    .clone();
    assert!(String::from_utf8_lossy(&o.stderr).contains("resumed from the checkpoint of step 20"));
    let s = summary(&dir);
    assert_eq!(s["world_size"], 2);
    assert_eq!(s["param_hash"].as_str().unwrap(), want);
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let steps: std::collections::BTreeSet<u64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(
        steps.len(),
        40,
        "metrics.jsonl keeps one continuous curve over both attempts"
    );
}

#[test]
fn a_checkpoint_of_another_run_is_refused_without_restarts() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    ok(&train(&a, "2", &[]));
    let b = tmp.path().join("b");
    let o = train(
        &b,
        "2",
        &[
            "--set",
            "train.lr=0.05",
            "--inject",
            "kill:rank=0,step=15",
            "--max-restarts",
            "0",
        ],
    );
    assert!(!o.status.success());
    // Plant run A's checkpoints in run B's directory, then resume B.
    let ckpts = b.join("checkpoints");
    std::fs::remove_dir_all(&ckpts).unwrap();
    std::fs::create_dir_all(&ckpts).unwrap();
    for e in std::fs::read_dir(a.join("checkpoints")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, ckpts.join(p.file_name().unwrap())).unwrap();
    }
    let o = run(&["train", "--nproc", "2", "--resume", b.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("belongs to another run") && err.contains("config identity"),
        "{err}"
    );
    assert!(
        err.contains("not restarting"),
        "bad input must not be retried: {err}"
    );
}

#[test]
fn a_straggler_is_named_in_the_log_and_the_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("slow");
    let o = ok(&train(&dir, "2", &["--inject", "slow:rank=1,factor=4"])).clone();
    assert!(String::from_utf8_lossy(&o.stderr).contains("straggler: rank 1"));
    let s = summary(&dir);
    assert_eq!(s["straggler"], 1);
    assert_eq!(s["restarts"], 0);
}
