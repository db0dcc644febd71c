//! The README's claims for own-cnn: the same parameters on 1 and 3 workers, a killed worker
//! recovered to them, and the job's accuracy in summary.json and the report. Needs Fashion-MNIST
//! from scripts/setup.sh (CI sets LOCKSTEP_REQUIRE_FASHION=1, so there a missing dataset fails).

use std::path::Path;
use std::process::{Command, Output};

const DATA: &str = "/usr/share/datasets/fashion-mnist";

fn own_cnn(out: &Path, nproc: &str, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--nproc", nproc, "--out", out.to_str().unwrap()];
    args.extend_from_slice(&["--set", "train.steps=30"]);
    args.extend_from_slice(extra);
    let o = Command::new(env!("CARGO_BIN_EXE_own-cnn"))
        .args(&args)
        .output()
        .expect("spawn own-cnn");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn own_cnn_is_the_same_on_one_and_three_workers_and_after_a_kill() {
    let required = std::env::var("LOCKSTEP_REQUIRE_FASHION").is_ok_and(|v| v == "1");
    if !Path::new(DATA).exists() && !required {
        eprintln!("note: {DATA} not found; run scripts/setup.sh");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    own_cnn(&a, "1", &[]);
    own_cnn(&b, "3", &[]);
    own_cnn(&c, "3", &["--inject", "kill:rank=1,step=15"]);
    let (sa, sb, sc) = (summary(&a), summary(&b), summary(&c));
    assert_eq!(sa["param_hash"], sb["param_hash"]);
    assert_eq!(sa["param_hash"], sc["param_hash"]);
    assert!(sc["restarts"].as_u64().unwrap() >= 1);
    // 30 steps of 96 images: far from trained, well above chance (10%).
    let accuracy = sa["test_accuracy"].as_f64().unwrap();
    assert!(accuracy > 0.4, "test accuracy {accuracy}");
    let report = std::fs::read_to_string(c.join("report.html")).unwrap();
    assert!(report.contains("test accuracy"));
}
