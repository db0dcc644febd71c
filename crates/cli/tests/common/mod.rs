//! Shared by the end-to-end test files: how to start the real `lockstep` binary and read its output.
#![allow(dead_code)] // each test file uses a different subset

use std::path::Path;
use std::process::{Command, Output, Stdio};

pub const BIN: &str = env!("CARGO_BIN_EXE_lockstep");

/// A `lockstep` command that does not inherit cluster-engine variables from the test's own
/// environment (which would turn the launcher into a worker).
pub fn lockstep(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args).stdin(Stdio::null());
    for k in [
        "RANK",
        "WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "LOCKSTEP_RANK",
    ] {
        c.env_remove(k);
    }
    c
}

/// Panic with both output streams unless the run succeeded.
pub fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "lockstep failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn summary(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("summary.json")).expect("summary.json written");
    serde_json::from_str(&text).expect("summary.json is JSON")
}

/// `lockstep train` of `configs/shakespeare.toml` (the transformer) on `nproc` workers into
/// `out`, with `--set` for each of `base` then `sets`, then the `extra` arguments.
pub fn train_transformer(
    out: &Path,
    nproc: &str,
    base: &[&str],
    sets: &[&str],
    extra: &[&str],
) -> Output {
    let mut args = vec![
        "train",
        "--config",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../configs/shakespeare.toml"
        ),
        "--nproc",
        nproc,
        "--out",
        out.to_str().unwrap(),
    ];
    for s in base.iter().chain(sets) {
        args.extend_from_slice(&["--set", s]);
    }
    args.extend_from_slice(extra);
    lockstep(&args).output().expect("spawn lockstep")
}

/// The run's `param_hash`.
pub fn param_hash(dir: &Path) -> String {
    summary(dir)["param_hash"].as_str().unwrap().to_string()
}
