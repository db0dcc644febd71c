//! `lockstep plan` end to end: calibrate from a real (small) run, print and write a plan whose
//! byte count matches what the run sent; bad inputs are refused naming the flag or file.

mod common;

use std::path::Path;

use common::{assert_ok, lockstep};

fn plan(from: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["plan", "--from", from.to_str().unwrap()];
    args.extend_from_slice(extra);
    lockstep(&args).output().unwrap()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn plan_calibrates_from_a_run_and_refuses_bad_descriptions_by_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let out = lockstep(&[
        "train",
        "--nproc",
        "2",
        "--threads-per-worker",
        "1",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.steps=20",
        "--set",
        "train.eval_every=0",
        "--set",
        "checkpoint.every=0",
    ])
    .output()
    .unwrap();
    assert_ok(&out);

    let json = tmp.path().join("plan.json");
    let out = plan(
        &run,
        &[
            "--nodes",
            "2",
            "--workers-per-node",
            "2",
            "--link-gbps",
            "10",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    for want in ["dp=1 ", "dp=2 ", "dp=4 ", "recommendation: ", "(agree)"] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    let p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let cal = &p["calibration"];
    assert_eq!(cal["world"], 2);
    // The model counts exactly the bytes the run sent (loss exchange, exponents, i64 gradient).
    assert_eq!(
        cal["modelled_bytes_per_rank_step"],
        cal["measured_bytes_per_rank_step"]
    );
    // Predicting the calibration run's own layout (2 workers on one node, shared memory, whose
    // links the calibration assumed) gives back about its measured step.
    let own = p["predictions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["layout"]["dp"] == 2 && x["layout"]["pp"] == 1)
        .expect("dp=2 predicted");
    let (pred, meas) = (
        own["step_s"].as_f64().unwrap(),
        cal["measured_step_s"].as_f64().unwrap(),
    );
    assert!(
        (pred / meas - 1.0).abs() < 0.3,
        "dp=2 predicted {pred} s vs measured {meas} s"
    );
    assert!(p["recommendation"]["why"]
        .as_str()
        .unwrap()
        .contains("ms/step"));

    // Bad cluster descriptions name the flag (and the key of a cluster file).
    let e = stderr(&plan(&run, &["--nodes", "2"]));
    assert!(
        e.contains("--workers-per-node") && e.contains("required"),
        "{e}"
    );
    let e = stderr(&plan(&run, &["--nodes", "2", "--workers-per-node", "1"]));
    assert!(
        e.contains("--link-gbps") && e.contains("required for 2 nodes"),
        "{e}"
    );
    let e = stderr(&plan(&run, &["--workers-per-node", "2", "--link-gbps=0"]));
    assert!(e.contains("--link-gbps") && e.contains("positive"), "{e}");
    let e = stderr(&plan(
        &run,
        &["--workers-per-node", "2", "--layouts", "2y2"],
    ));
    assert!(e.contains("--layouts") && e.contains("`2y2`"), "{e}");
    let file = tmp.path().join("cluster.toml");
    std::fs::write(&file, "nodes = 2\nworkers_per_node = 2\nlink_gbit = 10\n").unwrap();
    let e = stderr(&plan(&run, &["--cluster", file.to_str().unwrap()]));
    assert!(e.contains("cluster.toml") && e.contains("link_gbit"), "{e}");
}

#[test]
fn plan_without_a_run_names_the_missing_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = plan(tmp.path(), &["--workers-per-node", "2"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(e.contains("config.toml"), "{e}");
}
