//! The README's claims for own-pipeline: a user's layer-sequence model gives the same parameters
//! on one worker (`parallel.pp = 1`), as a 2-stage pipeline (1F1B and GPipe), and as 2 replicas ×
//! 2 stages after a killed worker; it learns; a pipeline deeper than the model is refused.

use std::path::Path;
use std::process::{Command, Output};

fn own_pipeline(out: &Path, nproc: &str, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--nproc", nproc, "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_own-pipeline"))
        .args(&args)
        .output()
        .expect("spawn own-pipeline")
}

fn ok(o: Output) -> Output {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn own_pipeline_has_the_single_worker_bits_on_every_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |name: &str| tmp.path().join(name);
    let steps = ["--set", "train.steps=150"];
    ok(own_pipeline(
        &dir("one"),
        "1",
        &[&steps[..], &["--set", "parallel.pp=1"]].concat(),
    ));
    ok(own_pipeline(&dir("pp2"), "2", &steps));
    ok(own_pipeline(
        &dir("gpipe"),
        "2",
        &[&steps[..], &["--set", "parallel.schedule=\"gpipe\""]].concat(),
    ));
    ok(own_pipeline(
        &dir("dp2pp2-killed"),
        "4",
        &[&steps[..], &["--inject", "kill:rank=3,step=70"]].concat(),
    ));
    let want = summary(&dir("one"))["param_hash"].clone();
    for name in ["pp2", "gpipe", "dp2pp2-killed"] {
        assert_eq!(summary(&dir(name))["param_hash"], want, "{name}");
    }
    let killed = summary(&dir("dp2pp2-killed"));
    assert!(killed["restarts"].as_u64().unwrap() >= 1);
    assert_eq!(killed["pipeline"]["pp"], 2);
    assert_eq!(killed["pipeline"]["dp"], 2);
    // 150 steps of 64 digits (the default 200 reach ≈ 94%).
    let accuracy = summary(&dir("one"))["test_accuracy"].as_f64().unwrap();
    assert!(accuracy > 0.8, "test accuracy {accuracy}");
    let report = std::fs::read_to_string(dir("pp2").join("report.html")).unwrap();
    assert!(report.contains("test accuracy") && report.contains("bubble"));
}

#[test]
fn a_pipeline_deeper_than_the_model_is_refused_naming_the_setting() {
    let tmp = tempfile::tempdir().unwrap();
    let o = own_pipeline(&tmp.path().join("deep"), "5", &["--set", "parallel.pp=5"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("parallel.pp") && err.contains("only 4 layers"),
        "{err}"
    );
}
