//! The README's claims for own-tabular: the same parameters on 1 and 3 workers, a killed worker
//! recovered to them, the job's own metric (mean absolute error in grams) in summary.json and the
//! report, and a model that beats predicting the mean mass.

use std::path::Path;
use std::process::{Command, Output};

fn own_tabular(out: &Path, nproc: &str, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--nproc", nproc, "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = Command::new(env!("CARGO_BIN_EXE_own-tabular"))
        .args(&args)
        .output()
        .expect("spawn own-tabular");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn own_tabular_is_the_same_on_one_and_three_workers_and_after_a_kill() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    own_tabular(&a, "1", &[]);
    own_tabular(&b, "3", &[]);
    own_tabular(&c, "3", &["--inject", "kill:rank=1,step=150"]);
    let (sa, sb, sc) = (summary(&a), summary(&b), summary(&c));
    assert_eq!(sa["param_hash"], sb["param_hash"]);
    assert_eq!(sa["param_hash"], sc["param_hash"]);
    assert!(sc["restarts"].as_u64().unwrap() >= 1);
    // Predicting the mean mass of the training rows is off by ≈ 650 g on average.
    let mae = sa["test_metrics"]["mae_grams"].as_f64().unwrap();
    assert!(mae < 400.0, "mean absolute error {mae} g");
    let report = std::fs::read_to_string(c.join("report.html")).unwrap();
    assert!(report.contains("test mae_grams"));
}
