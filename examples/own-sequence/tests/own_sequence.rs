//! The README's claims for own-sequence: the LSTM classifier with dropout has one parameter hash
//! at 1, 2 and 3 workers, as a 2-stage pipeline and after a killed worker; it learns (test
//! accuracy > 90%); its exported model, loaded by plain burn (`own-sequence-eval`, no lockstep),
//! gives the run's test accuracy; its lockstep-specific code stays within 40 lines.

use std::path::Path;
use std::process::{Command, Output};

fn own_sequence(out: &Path, nproc: &str, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--nproc", nproc, "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    ok(Command::new(env!("CARGO_BIN_EXE_own-sequence"))
        .args(&args)
        .output()
        .expect("spawn own-sequence"))
}

fn ok(o: Output) -> Output {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn one_hash_on_every_layout_and_plain_burn_reproduces_the_test_accuracy() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |name: &str| tmp.path().join(name);
    own_sequence(&dir("one"), "1", &[]);
    own_sequence(&dir("two"), "2", &[]);
    own_sequence(&dir("three"), "3", &[]);
    own_sequence(&dir("pp2"), "2", &["--set", "parallel.pp=2"]);
    own_sequence(&dir("killed"), "3", &["--inject", "kill:rank=2,step=50"]);
    let hash = |name: &str| {
        summary(&dir(name))["param_hash"]
            .as_str()
            .unwrap()
            .to_string()
    };
    for name in ["two", "three", "pp2", "killed"] {
        assert_eq!(hash(name), hash("one"), "{name} vs one worker");
    }
    assert!(summary(&dir("killed"))["restarts"].as_u64().unwrap() >= 1);
    // Dropout acts: without it, another run.
    own_sequence(&dir("plain"), "1", &["--set", "job.dropout=0.0"]);
    assert_ne!(hash("plain"), hash("one"));

    let accuracy = summary(&dir("pp2"))["test_accuracy"].as_f64().unwrap();
    assert!(accuracy > 0.9, "test accuracy {accuracy}");
    let model = tmp.path().join("model.bpk");
    ok(Command::new(env!("CARGO_BIN_EXE_own-sequence"))
        .args([
            "export",
            dir("pp2").to_str().unwrap(),
            "--out",
            model.to_str().unwrap(),
        ])
        .output()
        .unwrap());
    let eval = ok(Command::new(env!("CARGO_BIN_EXE_own-sequence-eval"))
        .arg(&model)
        .output()
        .unwrap());
    let printed = String::from_utf8_lossy(&eval.stdout);
    let plain: f64 = printed
        .trim()
        .strip_prefix("accuracy ")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (plain - accuracy).abs() < 1e-9,
        "plain burn {plain} vs the run's {accuracy}"
    );
}

#[test]
fn the_lockstep_specific_code_is_at_most_40_lines() {
    let main = include_str!("../src/main.rs");
    let code = |l: &&str| !l.trim().is_empty() && !l.trim_start().starts_with("//");
    let from_job = main[main.find("struct OwnSequence").unwrap()..]
        .lines()
        .filter(code)
        .count();
    let uses = main
        .lines()
        .filter(|l| l.starts_with("use lockstep"))
        .count();
    assert!(from_job + uses <= 40, "{} lines", from_job + uses);
}
