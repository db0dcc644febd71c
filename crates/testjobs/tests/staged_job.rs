//! A user's `StagedJob` whose layers exchange integer token ids, rank-3 float steps and rank-2
//! features: the one-worker bits for every pipeline depth, data-parallel replicas, overlap and a
//! restart; a layer whose output shape depends on the batch is a final error naming it.

use std::path::Path;
use std::process::{Command, Output};

fn staged(out: &Path, nproc: &str, extra: &[&str], bad_shape: bool) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockstep-testjob-staged"));
    cmd.args(["train", "--nproc", nproc, "--out", out.to_str().unwrap()])
        .args(extra)
        .env("RUST_BACKTRACE", "0");
    if bad_shape {
        cmd.env("LOCKSTEP_TESTJOB_BAD_SHAPE", "1");
    }
    cmd.output().expect("spawn lockstep-testjob-staged")
}

fn hash(dir: &Path) -> String {
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap();
    s["param_hash"].as_str().unwrap().to_string()
}

#[test]
fn integer_and_rank_3_activations_cross_every_cut_with_the_one_worker_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let runs: [(&str, &str, &[&str]); 8] = [
        ("one", "1", &[]),
        // Cuts after the embedding (integer ids in, rank-3 floats out) and after the pooling.
        (
            "pp2",
            "2",
            &["--set", "parallel.pp=2", "--set", "parallel.stage_cuts=[1]"],
        ),
        (
            "pp2b",
            "2",
            &["--set", "parallel.pp=2", "--set", "parallel.stage_cuts=[3]"],
        ),
        ("pp4", "4", &["--set", "parallel.pp=4"]),
        ("dp2pp2", "4", &["--set", "parallel.pp=2"]),
        ("overlap", "1", &["--set", "dist.overlap=true"]),
        ("dp2z3", "2", &["--set", "parallel.zero=3"]),
        (
            "killed",
            "2",
            &["--set", "parallel.pp=2", "--inject", "kill:rank=1,step=6"],
        ),
    ];
    for (name, nproc, extra) in runs {
        let o = staged(&dir(name), nproc, extra, false);
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(hash(&dir(name)), hash(&dir("one")), "{name} vs one worker");
    }
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir("killed").join("summary.json")).unwrap())
            .unwrap();
    assert!(
        s["restarts"].as_u64().unwrap() >= 1,
        "the kill was survived"
    );
}

#[test]
fn a_layer_whose_output_shape_depends_on_the_batch_is_a_final_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let o = staged(
        &tmp.path().join("run"),
        "2",
        &["--set", "parallel.pp=2", "--set", "parallel.stage_cuts=[2]"],
        true,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    for part in [
        "job `testjob-staged`, step 1, micro-batch 0",
        "the stage's output: it is (float [samples, 5, 8]), but (float [samples, 6, 8])",
    ] {
        assert!(err.contains(part), "the error lacks `{part}`:\n{err}");
    }
    assert!(!err.contains("lockstep: restart "), "{err}");
}

/// `const SETTINGS`: the `[job]` table is read as the job's settings type before any worker
/// starts — a misspelt key or a wrong type is refused naming the field, and nothing is written.
#[test]
fn the_jobs_typed_settings_are_checked_before_anything_starts() {
    let tmp = tempfile::tempdir().unwrap();
    for (set, says) in [
        ("job.embd=4", "unknown field `embd`, expected `embed`"),
        ("job.embed=\"wide\"", "invalid type: string \"wide\""),
    ] {
        let out = tmp.path().join("run");
        let o = staged(&out, "1", &["--set", set], false);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(3), "{set}: {err}");
        assert!(err.contains("[job]") && err.contains(says), "{set}: {err}");
        assert!(!out.exists(), "{set}: nothing written");
    }
    let wide = tmp.path().join("wide");
    let o = staged(&wide, "1", &["--set", "job.embed=12"], false);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
