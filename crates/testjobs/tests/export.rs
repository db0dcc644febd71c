//! Models out of lockstep and back in: a trained user job's model exported as a burn record is
//! loaded by plain burn code (the job's own module types, no lockstep call) and gives the run's
//! parameters (the same hash) and its test metric; `train.init_from` starts a run from it.

#[path = "../src/common.rs"]
#[allow(dead_code)]
mod common;

use std::path::Path;
use std::process::{Command, Output};

use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

/// The test job's model, as a user's inference code would declare it (same fields).
#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    dropout: Dropout,
    out: Linear,
}

impl Mlp {
    fn new(hidden: usize, device: &Device) -> Self {
        Mlp {
            hidden: LinearConfig::new(common::INPUTS, hidden).init(device),
            dropout: DropoutConfig::new(0.0).init(),
            out: LinearConfig::new(hidden, 1).init(device),
        }
    }
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out
            .forward(self.dropout.forward(relu(self.hidden.forward(x))))
    }
}

fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("spawn the test job")
}

fn ok(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "failed: {err}");
    err
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

/// Plain burn's mean absolute error of `model` over the test job's evaluation set.
fn eval_mae(model: &Mlp, device: &Device) -> f64 {
    let items: Vec<common::Item> = (0..128)
        .map(|i| common::item(1_000_000 + i, false, false))
        .collect();
    let n = items.len();
    let (x, y) = common::batch(items, device);
    let abs = (model.forward(x) - y).abs().sum().into_scalar::<f32>();
    f64::from(abs) / n as f64
}

#[test]
fn an_exported_model_loads_into_plain_burn_with_the_runs_parameters_and_metric() {
    let bin = env!("CARGO_BIN_EXE_lockstep-testjob");
    let tmp = tempfile::tempdir().unwrap();
    let run_dir = tmp.path().join("run");
    let dir = run_dir.to_str().unwrap();
    ok(&run(
        bin,
        &[
            "train",
            "--nproc",
            "2",
            "--out",
            dir,
            "--set",
            "job.dropout=0.2",
        ],
    ));
    let record = tmp.path().join("model.bpk");
    let err = ok(&run(
        bin,
        &["export", dir, "--out", record.to_str().unwrap()],
    ));
    let s = summary(&run_dir);
    let hash = s["param_hash"].as_str().unwrap();
    assert!(
        err.contains(hash),
        "export names the run's param_hash: {err}"
    );

    // Plain burn: the user's own module type, burn's loader.
    let device = Device::flex();
    let model = Mlp::new(16, &device).load_file(&record);
    let values = lockstep::flat::read(
        &model,
        lockstep::flat::layout(&model).iter().map(|p| p.len).sum(),
    );
    assert_eq!(
        lockstep::param_hash(&values),
        hash,
        "the loaded parameters are the run's"
    );
    let mae = eval_mae(&model, &device);
    let reported = s["test_metrics"]["mae"].as_f64().unwrap();
    assert!(
        (mae - reported).abs() <= 1e-5 * reported.max(1.0),
        "plain burn's test mae {mae} vs the run's {reported}"
    );

    // An existing file is not replaced without --overwrite; a step without a checkpoint is named.
    let again = run(bin, &["export", dir, "--out", record.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(3));
    let none = run(
        bin,
        &["export", dir, "--step", "5", "--out", "/tmp/never.bpk"],
    );
    assert_eq!(none.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&none.stderr).contains("no checkpoint after step 5"));

    // Fine-tuning: a run started from the record begins where the first one ended (its first
    // evaluation-free step 0 loss equals the exported model's), and is its own run.
    let tuned = tmp.path().join("tuned");
    let init = format!("train.init_from=\"{}\"", record.display());
    ok(&run(
        bin,
        &[
            "train",
            "--nproc",
            "1",
            "--out",
            tuned.to_str().unwrap(),
            "--set",
            &init,
            "--set",
            "train.steps=1",
        ],
    ));
    let first_loss = first_step_loss(&tuned);
    let scratch = tmp.path().join("scratch");
    ok(&run(
        bin,
        &[
            "train",
            "--nproc",
            "1",
            "--out",
            scratch.to_str().unwrap(),
            "--set",
            "train.steps=1",
        ],
    ));
    assert!(
        first_loss < first_step_loss(&scratch) * 0.8,
        "fine-tuning starts from the trained model: {first_loss} vs {}",
        first_step_loss(&scratch)
    );
    let bad = run(
        bin,
        &[
            "train",
            "--out",
            tmp.path().join("bad").to_str().unwrap(),
            "--set",
            "train.init_from=\"/nonexistent.bpk\"",
        ],
    );
    assert_eq!(bad.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("train.init_from"));
}

fn first_step_loss(dir: &Path) -> f64 {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    first["loss"].as_f64().unwrap()
}

/// The layered test job's layer, as a user's inference code would declare it.
#[derive(Module, Debug)]
struct Layer {
    linear: Linear,
    dropout: Dropout,
    #[module(skip)]
    relu: bool,
}

#[test]
fn a_pipelines_model_exports_as_its_layers_with_the_one_worker_parameters() {
    let bin = env!("CARGO_BIN_EXE_lockstep-testjob-layered");
    let tmp = tempfile::tempdir().unwrap();
    let run_dir = tmp.path().join("pp2");
    let dir = run_dir.to_str().unwrap();
    ok(&run(
        bin,
        &[
            "train",
            "--nproc",
            "2",
            "--out",
            dir,
            "--set",
            "parallel.pp=2",
        ],
    ));
    let record = tmp.path().join("layers.bpk");
    ok(&run(
        bin,
        &["export", dir, "--out", record.to_str().unwrap()],
    ));
    let device = Device::flex();
    let layer = |i: usize, o: usize, relu| Layer {
        linear: LinearConfig::new(i, o).init(&device),
        dropout: DropoutConfig::new(0.0).init(),
        relu,
    };
    let layers = vec![layer(common::INPUTS, 16, true), layer(16, 1, false)].load_file(&record);
    let n = lockstep::flat::layout(&layers).iter().map(|p| p.len).sum();
    assert_eq!(
        lockstep::param_hash(&lockstep::flat::read(&layers, n)),
        summary(&run_dir)["param_hash"].as_str().unwrap()
    );
}
