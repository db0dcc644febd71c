//! A user job as the library's tests need one: a small MLP regressing a fixed function of 8
//! inputs (data generated from the index, so nothing to install), written only against the
//! public `lockstep` API. `[job] misbehave` switches on one of the failures a user's job can have,
//! so that the tests can check lockstep's answer to each.

use burn::data::dataset::{Dataset, InMemDataset};
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use lockstep::{BoxError, TrainConfig};
use serde::Deserialize;

const INPUTS: usize = 8;

#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    out: Linear,
}

impl Mlp {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out.forward(relu(self.hidden.forward(x)))
    }
}

#[derive(Clone, Debug)]
struct Item {
    x: Vec<f32>,
    y: f32,
}

/// The `[job]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    hidden: usize,
    train_samples: usize,
    /// "none", "short-dataset", "wrong-shape", "nan-loss", "panic-in-data".
    misbehave: String,
}

/// Deterministic inputs from the index; the target is a fixed smooth function of them. A
/// poisoned item has a NaN target; a truncated one lacks its last input (a shape bug).
fn item(i: usize, poison: bool, truncate: bool) -> Item {
    let mut x = vec![0f32; INPUTS];
    for (k, v) in x.iter_mut().enumerate() {
        let h = (i as u64 * 2654435761 + k as u64 * 40503) % 1000;
        *v = h as f32 / 500.0 - 1.0;
    }
    let y = x
        .iter()
        .enumerate()
        .map(|(k, v)| v * (k as f32 - 3.5) / 4.0)
        .sum::<f32>()
        + (x[0] * x[1]);
    if truncate {
        x.pop();
    }
    Item {
        x,
        y: if poison { f32::NAN } else { y },
    }
}

struct TestJob;

/// Sample whose target is NaN with `misbehave = "nan-loss"`.
const POISONED: usize = 37;

impl lockstep::Job for TestJob {
    type Model = Mlp;
    type Item = Item;
    type Batch = (Tensor<2>, Tensor<2>);

    fn name(&self) -> &str {
        "testjob"
    }

    fn config(&self) -> &str {
        "[train]\nsteps = 12\nglobal_batch = 32\nmicrobatch = 8\nlr = 0.05\nwarmup_steps = 0\n\
         eval_every = 6\n[checkpoint]\nevery = 4\n\
         [job]\nhidden = 16\ntrain_samples = 512\nmisbehave = \"none\"\n"
    }

    fn validate(&self, cfg: &TrainConfig) -> Result<(), String> {
        let s: Settings = cfg.job_section().map_err(|e| e.to_string())?;
        match s.misbehave.as_str() {
            "none" | "short-dataset" | "wrong-shape" | "nan-loss" | "panic-in-data" => Ok(()),
            other => Err(format!(
                "job.misbehave = `{other}` is not a known misbehaviour"
            )),
        }
    }

    fn model(&self, cfg: &TrainConfig, device: &Device) -> Mlp {
        let s: Settings = cfg.job_section().expect("validated");
        Mlp {
            hidden: LinearConfig::new(INPUTS, s.hidden).init(device),
            out: LinearConfig::new(s.hidden, 1).init(device),
        }
    }

    fn train_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Item>>, BoxError> {
        let s: Settings = cfg.job_section()?;
        let n = if s.misbehave == "short-dataset" {
            10
        } else {
            s.train_samples
        };
        let nan = s.misbehave == "nan-loss";
        let short = s.misbehave == "wrong-shape";
        let items = (0..n)
            .map(|i| item(i, nan && i == POISONED, short))
            .collect();
        Ok(Box::new(InMemDataset::new(items)))
    }

    fn eval_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Item>>, BoxError> {
        let s: Settings = cfg.job_section()?;
        if s.misbehave == "panic-in-data" {
            panic!("the evaluation files are missing (deliberate)");
        }
        Ok(Box::new(InMemDataset::new(
            (0..128)
                .map(|i| item(1_000_000 + i, false, false))
                .collect(),
        )))
    }

    fn batch(&self, items: Vec<Item>, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let n = items.len();
        let width = items[0].x.len();
        let x: Vec<f32> = items.iter().flat_map(|it| it.x.iter().copied()).collect();
        let y: Vec<f32> = items.iter().map(|it| it.y).collect();
        (
            Tensor::from_data(TensorData::new(x, [n, width]), device),
            Tensor::from_data(TensorData::new(y, [n, 1]), device),
        )
    }

    fn loss(&self, model: &Mlp, (x, y): &(Tensor<2>, Tensor<2>)) -> Tensor<1> {
        MseLoss::new().forward(model.forward(x.clone()), y.clone(), Reduction::Mean)
    }

    fn metrics(&self, model: &Mlp, (x, y): &(Tensor<2>, Tensor<2>)) -> Vec<(&'static str, f64)> {
        let abs = (model.forward(x.clone()) - y.clone()).abs().sum();
        vec![("mae", abs.into_scalar::<f32>() as f64)]
    }
}

fn main() {
    lockstep::main(TestJob)
}
