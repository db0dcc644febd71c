//! `lockstep::Trainer`: the library entry returns to the caller — help and version as `Ok`, bad
//! input as an error that says so (exit status 3) — and may run one job after another in one
//! program.

use lockstep::burn;

use burn::data::dataset::{Dataset, InMemDataset};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor, TensorData};
use lockstep::{BoxError, TrainConfig};

struct Identity(&'static str);

impl lockstep::Job for Identity {
    type Model = Linear;
    type Item = f32;
    type Batch = Tensor<2>;
    fn name(&self) -> &str {
        self.0
    }
    fn model(&self, _: &TrainConfig, device: &Device) -> Linear {
        LinearConfig::new(1, 1).init(device)
    }
    fn train_data(&self, _: &TrainConfig) -> Result<Box<dyn Dataset<f32>>, BoxError> {
        Ok(Box::new(InMemDataset::new(vec![1.0; 256])))
    }
    fn eval_data(&self, c: &TrainConfig) -> Result<Box<dyn Dataset<f32>>, BoxError> {
        self.train_data(c)
    }
    fn batch(&self, items: Vec<f32>, device: &Device) -> Tensor<2> {
        let n = items.len();
        Tensor::from_data(TensorData::new(items, [n, 1]), device)
    }
    fn loss(&self, model: &Linear, x: &Tensor<2>) -> Tensor<1> {
        (model.forward(x.clone()) - x.clone()).powi_scalar(2).mean()
    }
}

#[test]
fn the_trainer_returns_its_outcome_and_runs_again() {
    for name in ["first", "second"] {
        lockstep::Trainer::new(Identity(name))
            .run_with_args(["prog", "--version"])
            .expect("--version is a success");
    }
    let e = lockstep::Trainer::new(Identity("third"))
        .run_with_args(["prog", "train", "--no-such-flag"])
        .unwrap_err();
    assert!(e.is_bad_input() && e.exit_code() == 3, "{e}");
    assert!(e.to_string().contains("--no-such-flag"), "{e}");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let e = lockstep::Trainer::new(Identity("fourth"))
        .run_with_args([
            "prog",
            "export",
            out.to_str().unwrap(),
            "--out",
            tmp.path().join("m.bpk").to_str().unwrap(),
        ])
        .unwrap_err();
    assert!(e.is_bad_input(), "{e}");
    assert!(e.to_string().contains("not a run directory"), "{e}");
    // A job without an update rule: `optimizer.kind = "custom"` is refused before any worker.
    let e = lockstep::Trainer::new(Identity("fifth"))
        .run_with_args([
            "prog",
            "train",
            "--out",
            out.to_str().unwrap(),
            "--set",
            "optimizer.kind=\"custom\"",
        ])
        .unwrap_err();
    assert!(e.is_bad_input(), "{e}");
    assert!(
        e.to_string().contains("optimizer.kind") && e.to_string().contains("gives none"),
        "{e}"
    );
    assert!(!out.exists(), "nothing written");
}
