//! The README's claims for own-tp: a user's layer-sequence model with lockstep's tensor-parallel
//! layers gives the one-worker parameters on every layout — tp2, dp2 × tp2, tp2 × pp2 (1F1B and
//! GPipe, also cut between a column- and its row-parallel layer), dp2 × tp2 with ZeRO 3, tp4 —
//! after a killed tp rank, and when a checkpoint moves between layouts; invalid `parallel.tp` is
//! refused before any worker starts.

use std::path::Path;
use std::process::{Command, Output};

fn own_tp(out: &Path, nproc: &str, sets: &[&str], extra: &[&str]) -> Output {
    let mut args = vec!["train", "--nproc", nproc, "--out", out.to_str().unwrap()];
    for s in sets {
        args.extend_from_slice(&["--set", s]);
    }
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_own-tp"))
        .args(&args)
        .output()
        .expect("spawn own-tp")
}

fn ok(o: Output) -> Output {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

fn hash(dir: &Path) -> serde_json::Value {
    summary(dir)["param_hash"].clone()
}

const STEPS: &str = "train.steps=60";

#[test]
fn own_tp_has_the_single_worker_bits_on_every_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |name: &str| tmp.path().join(name);
    ok(own_tp(&dir("one"), "1", &[STEPS, "parallel.tp=1"], &[]));
    let want = hash(&dir("one"));
    let layouts: &[(&str, &str, &[&str])] = &[
        ("tp2", "2", &[]),
        ("dp2xtp2", "4", &[]),
        ("tp2xpp2", "4", &["parallel.pp=2"]),
        (
            "tp2xpp2-gpipe",
            "4",
            &["parallel.pp=2", "parallel.schedule=\"gpipe\""],
        ),
        // Cut between the first column- and row-parallel layers: the stages exchange each tp
        // rank's pieces of the hidden activations.
        (
            "tp2xpp2-cut1",
            "4",
            &["parallel.pp=2", "parallel.stage_cuts=[1]"],
        ),
        ("dp2xtp2-zero3", "4", &["parallel.zero=3"]),
        ("tp4", "4", &["parallel.tp=4"]),
    ];
    for (name, nproc, sets) in layouts {
        let o = ok(own_tp(
            &dir(name),
            nproc,
            &[&[STEPS][..], sets].concat(),
            &[],
        ));
        assert_eq!(hash(&dir(name)), want, "{name}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("tensor-parallel layers computed as 4 fixed pieces"),
            "{err}"
        );
    }
    assert_eq!(summary(&dir("dp2xtp2"))["pipeline"]["dp"], 2);
}

#[test]
fn a_killed_tp_rank_recovers_and_checkpoints_move_between_layouts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |name: &str| tmp.path().join(name);
    ok(own_tp(&dir("one"), "1", &[STEPS, "parallel.tp=1"], &[]));
    let want = hash(&dir("one"));

    // dp2 × tp2, tp rank 1 of replica 0 killed at step 30: restart from the checkpoint of 20.
    ok(own_tp(
        &dir("killed"),
        "4",
        &[STEPS],
        &["--inject", "kill:rank=1,step=30"],
    ));
    assert!(summary(&dir("killed"))["restarts"].as_u64().unwrap() >= 1);
    assert_eq!(hash(&dir("killed")), want, "killed and restarted");

    // tp2 × pp2 stops at step 50 (no restarts); one worker ends the run from its checkpoint.
    let stop = |d: &Path, nproc: &str, sets: &[&str], fault: &str| {
        let o = own_tp(d, nproc, sets, &["--inject", fault, "--max-restarts", "0"]);
        assert!(!o.status.success());
    };
    let resume = |d: &Path, nproc: &str, sets: &[&str]| {
        let mut args = vec!["train", "--resume", d.to_str().unwrap(), "--nproc", nproc];
        for s in sets {
            args.extend_from_slice(&["--set", s]);
        }
        let o = ok(Command::new(env!("CARGO_BIN_EXE_own-tp"))
            .args(&args)
            .output()
            .unwrap());
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    stop(
        &dir("moved"),
        "4",
        &[STEPS, "parallel.pp=2"],
        "kill:rank=3,step=50",
    );
    let err = resume(&dir("moved"), "1", &["parallel.tp=1", "parallel.pp=1"]);
    assert!(
        err.contains("resumed from the checkpoint of step 40"),
        "{err}"
    );
    assert_eq!(hash(&dir("moved")), want, "tp2 × pp2 → 1 worker");

    // And the reverse: one worker stops at step 30; tp2 ends the run.
    stop(
        &dir("spread"),
        "1",
        &[STEPS, "parallel.tp=1"],
        "kill:rank=0,step=30",
    );
    let err = resume(&dir("spread"), "2", &["parallel.tp=2"]);
    assert!(
        err.contains("resumed from the checkpoint of step 20"),
        "{err}"
    );
    assert_eq!(hash(&dir("spread")), want, "1 worker → tp2");
}

#[test]
fn invalid_tensor_parallelism_is_refused_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let refused = |o: Output, needles: &[&str]| {
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(3), "{err}");
        assert!(!err.contains("[rank"), "a worker started: {err}");
        for n in needles {
            assert!(err.contains(n), "`{n}` missing from {err}");
        }
    };
    // 3 ranks do not divide the layers' 4 pieces.
    let o = own_tp(&tmp.path().join("three"), "3", &["parallel.tp=3"], &[]);
    refused(o, &["parallel.tp", "must divide the 4 fixed pieces"]);
    // Pieces of 3 for the hidden width 258: tp2 does not divide them either.
    let o = own_tp(
        &tmp.path().join("odd"),
        "2",
        &["job.pieces=3", "job.hidden=258"],
        &[],
    );
    refused(o, &["parallel.tp", "must divide the 3 fixed pieces"]);
    // own-pipeline's model has no tensor-parallel layers.
    let o = Command::new(env!("CARGO_BIN_EXE_own-pipeline"))
        .args(["train", "--nproc", "2", "--out"])
        .arg(tmp.path().join("dense"))
        .args(["--set", "parallel.tp=2", "--set", "parallel.pp=1"])
        .output()
        .unwrap();
    refused(o, &["parallel.tp", "have none", "ColumnParallelLinear"]);
}
