//! A user job as the library's tests need one: a small MLP regressing a fixed function of 8
//! inputs (data generated from the index, so nothing to install), written only against the
//! public `lockstep` API. `[job] misbehave` switches on one of the failures a user's job can have,
//! so that the tests can check lockstep's answer to each. (`lockstep-testjob-layered` is the same
//! model as a `LayeredJob`.)

mod common;

use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use common::{Item, Settings, INPUTS};
use lockstep::{BoxError, TrainConfig};

#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    dropout: Dropout,
    out: Linear,
}

impl Mlp {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out
            .forward(self.dropout.forward(relu(self.hidden.forward(x))))
    }
}

struct TestJob;

impl lockstep::Job for TestJob {
    type Model = Mlp;
    type Item = Item;
    type Batch = (Tensor<2>, Tensor<2>);

    fn name(&self) -> &str {
        "testjob"
    }

    fn config(&self) -> &str {
        common::CONFIG
    }

    fn validate(&self, cfg: &TrainConfig) -> Result<(), String> {
        common::settings(cfg).map(drop)
    }

    fn model(&self, cfg: &TrainConfig, device: &Device) -> Mlp {
        let s: Settings = cfg.job_section().expect("validated");
        Mlp {
            hidden: LinearConfig::new(INPUTS, s.hidden).init(device),
            dropout: DropoutConfig::new(s.dropout).init(),
            out: LinearConfig::new(s.hidden, 1).init(device),
        }
    }

    fn train_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Item>>, BoxError> {
        Ok(Box::new(common::train_set(cfg)?))
    }

    fn eval_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Item>>, BoxError> {
        Ok(Box::new(common::eval_set(cfg)?))
    }

    fn batch(&self, items: Vec<Item>, device: &Device) -> (Tensor<2>, Tensor<2>) {
        common::batch(items, device)
    }

    fn loss(&self, model: &Mlp, (x, y): &(Tensor<2>, Tensor<2>)) -> Tensor<1> {
        MseLoss::new().forward(model.forward(x.clone()), y.clone(), Reduction::Mean)
    }

    const TRAIN_METRICS: &'static [&'static str] = &["mae"];

    fn update_rule(&self, _cfg: &TrainConfig) -> Option<Box<dyn lockstep::UpdateRule>> {
        Some(common::update_rule())
    }

    fn loss_and_metrics(
        &self,
        model: &Mlp,
        (x, y): &(Tensor<2>, Tensor<2>),
    ) -> (Tensor<1>, Vec<f64>) {
        let output = model.forward(x.clone());
        let mae = common::absolute_error(output.clone(), y);
        let loss = MseLoss::new().forward(output, y.clone(), Reduction::Mean);
        (loss, common::train_metrics(mae))
    }

    /// With `LOCKSTEP_TESTJOB_EVENTS=<file>`, each evaluation and checkpoint as a line of that
    /// file (the tests compare 1 and 3 workers); with `LOCKSTEP_TESTJOB_HOOK_PANIC` set, a panic
    /// at the first evaluation.
    fn on_event(&self, event: &lockstep::Event) {
        let line = match event {
            lockstep::Event::Evaluated { step, eval } => {
                if std::env::var_os("LOCKSTEP_TESTJOB_HOOK_PANIC").is_some() {
                    panic!("the hook cannot take evaluation {step} (deliberate)");
                }
                format!(
                    "evaluated {step} test_loss {:016x} mae {:016x}\n",
                    eval.test_loss.to_bits(),
                    eval.metrics["mae"].to_bits()
                )
            }
            lockstep::Event::Checkpointed { step, path } => format!(
                "checkpointed {step} {}\n",
                path.file_name().unwrap().to_string_lossy()
            ),
            _ => return,
        };
        if let Some(file) = std::env::var_os("LOCKSTEP_TESTJOB_EVENTS") {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(file)
                .expect("the events file opens");
            f.write_all(line.as_bytes())
                .expect("the events file takes a line");
        }
    }

    fn metrics(&self, model: &Mlp, (x, y): &(Tensor<2>, Tensor<2>)) -> Vec<(&'static str, f64)> {
        vec![("mae", common::absolute_error(model.forward(x.clone()), y))]
    }
}

fn main() {
    lockstep::main(TestJob)
}
