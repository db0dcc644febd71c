//! own-pipeline: a classifier written as a sequence of burn layers, which lockstep cuts into
//! pipeline stages (`parallel.pp`), on the handwritten digits committed in this repository
//! (data/digits/, 1,797 8×8 images). See README.md.

use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use lockstep::{BoxError, TrainConfig};
use own_pipeline::{batch, correct, cross_entropy, digits, Batch, Digit};
use serde::Deserialize;

/// One layer: a linear map, followed by a ReLU except at the output.
#[derive(Module, Debug)]
pub struct Dense {
    linear: Linear,
    #[module(skip)]
    relu: bool,
}

impl Dense {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let y = self.linear.forward(x);
        if self.relu {
            relu(y)
        } else {
            y
        }
    }
}

/// Widths 64 → hidden… → 10 as layers.
fn dense_layers(hidden: &[usize], device: &Device) -> Vec<Dense> {
    let widths: Vec<usize> = [64].iter().chain(hidden).chain(&[10]).copied().collect();
    let last = widths.len() - 2;
    (0..=last)
        .map(|i| Dense {
            linear: LinearConfig::new(widths[i], widths[i + 1]).init(device),
            relu: i != last,
        })
        .collect()
}

/// The `[job]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    hidden: Vec<usize>,
}

// ---- lockstep-specific code starts here ----
struct OwnPipeline;

impl lockstep::LayeredJob for OwnPipeline {
    type Layer = Dense;
    type Item = Digit;
    type Batch = Batch;
    fn name(&self) -> &str {
        "own-pipeline"
    }
    fn config(&self) -> &str {
        include_str!("../own-pipeline.toml")
    }
    fn layers(&self, cfg: &TrainConfig, device: &Device) -> Vec<Dense> {
        dense_layers(
            &cfg.job_section::<Settings>().expect("[job] hidden").hidden,
            device,
        )
    }
    fn train_data(&self, _cfg: &TrainConfig) -> Result<Box<dyn Dataset<Digit>>, BoxError> {
        Ok(Box::new(digits(false)?))
    }
    fn eval_data(&self, _cfg: &TrainConfig) -> Result<Box<dyn Dataset<Digit>>, BoxError> {
        Ok(Box::new(digits(true)?))
    }
    fn batch(&self, items: Vec<Digit>, device: &Device) -> Batch {
        batch(items, device)
    }
    fn input(&self, b: &Batch) -> Tensor<2> {
        b.pixels.clone()
    }
    fn forward(&self, layer: &Dense, x: Tensor<2>) -> Tensor<2> {
        layer.forward(x)
    }
    fn loss(&self, logits: Tensor<2>, b: &Batch) -> Tensor<1> {
        cross_entropy(logits, b)
    }
    fn metrics(&self, logits: Tensor<2>, b: &Batch) -> Vec<(&'static str, f64)> {
        vec![("accuracy", correct(logits, b))]
    }
}

fn main() {
    lockstep::main(lockstep::Pipelined(OwnPipeline))
}
