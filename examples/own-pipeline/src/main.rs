//! own-pipeline: a classifier written as a sequence of burn layers, which lockstep cuts into
//! pipeline stages (`parallel.pp`), on the handwritten digits committed in this repository
//! (data/digits/, 1,797 8×8 images). See README.md.

use std::io::Read;

use burn::data::dataset::{Dataset, InMemDataset};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use lockstep::{BoxError, TrainConfig};
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

#[derive(Clone, Debug)]
pub struct Digit {
    pixels: Vec<f32>,
    label: i64,
}

/// The committed digits table (gzipped CSV: 64 pixels 0–16, then the label); every fifth row is
/// held out for evaluation.
fn digits(held_out: bool) -> Result<InMemDataset<Digit>, BoxError> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/digits/digits.csv.gz"
    );
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path)?).read_to_string(&mut text)?;
    let mut rows = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(i, _)| (i % 5 == 0) == held_out)
    {
        let v: Vec<f32> = line
            .split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{path}: line {}: {e}", i + 1))?;
        let (pixels, label) = v.split_at(64);
        let pixels = pixels.iter().map(|p| p / 16.0).collect();
        rows.push(Digit {
            pixels,
            label: label[0] as i64,
        });
    }
    Ok(InMemDataset::new(rows))
}

pub struct Batch {
    pixels: Tensor<2>,
    labels: Tensor<1, Int>,
}

fn batch(items: Vec<Digit>, device: &Device) -> Batch {
    let n = items.len();
    let pixels: Vec<f32> = items
        .iter()
        .flat_map(|d| d.pixels.iter().copied())
        .collect();
    let labels: Vec<i64> = items.iter().map(|d| d.label).collect();
    Batch {
        pixels: Tensor::from_data(TensorData::new(pixels, [n, 64]), device),
        labels: Tensor::from_data(TensorData::new(labels, [n]), device),
    }
}

fn cross_entropy(logits: Tensor<2>, b: &Batch) -> Tensor<1> {
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, b.labels.clone())
}

fn correct(logits: Tensor<2>, b: &Batch) -> f64 {
    let predicted = logits.argmax(1).flatten::<1>(0, 1);
    predicted
        .equal(b.labels.clone())
        .int()
        .sum()
        .into_scalar::<i64>() as f64
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
