//! own-cnn: your own CNN on Fashion-MNIST, trained by lockstep on any number of workers.
//!
//! Everything above `impl lockstep::Job` is plain burn code a burn user already has: the model,
//! a `Dataset` over the IDX files, batching and the loss. See README.md.

mod fashion;

use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use fashion::{FashionMnist, Image};
use lockstep::{BoxError, TrainConfig};

/// conv 3×3 (8) → pool → conv 3×3 (16) → pool → 64 → 10: the shape of lockstep's built-in CNN
/// with `model.conv = [8, 16]`, `model.cnn_hidden = 64`.
#[derive(Module, Debug)]
pub struct Cnn {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: MaxPool2d,
    fc1: Linear,
    fc2: Linear,
}

impl Cnn {
    pub fn new(device: &Device) -> Self {
        let conv = |c_in, c_out| {
            Conv2dConfig::new([c_in, c_out], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device)
        };
        Cnn {
            conv1: conv(1, 8),
            conv2: conv(8, 16),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            fc1: LinearConfig::new(16 * 7 * 7, 64).init(device),
            fc2: LinearConfig::new(64, 10).init(device),
        }
    }

    /// Mean cross-entropy of a batch.
    pub fn loss(&self, b: &Batch) -> Tensor<1> {
        let logits = self.forward(b.images.clone());
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, b.labels.clone())
    }

    /// How many images of the batch are classified correctly.
    pub fn correct(&self, b: &Batch) -> i64 {
        let predicted = self.forward(b.images.clone()).argmax(1).flatten::<1>(0, 1);
        predicted
            .equal(b.labels.clone())
            .int()
            .sum()
            .into_scalar::<i64>()
    }

    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.pool.forward(relu(self.conv1.forward(images)));
        let x = self.pool.forward(relu(self.conv2.forward(x)));
        let x: Tensor<2> = x.flatten(1, 3);
        self.fc2.forward(relu(self.fc1.forward(x)))
    }
}

pub struct Batch {
    images: Tensor<4>,
    labels: Tensor<1, Int>,
}

pub fn batch(items: Vec<Image>, device: &Device) -> Batch {
    let n = items.len();
    let pixels: Vec<f32> = items
        .iter()
        .flat_map(|it| it.pixels.iter().map(|&p| p as f32 / 255.0))
        .collect();
    let labels: Vec<i64> = items.iter().map(|it| it.label as i64).collect();
    Batch {
        images: Tensor::from_data(TensorData::new(pixels, [n, 1, 28, 28]), device),
        labels: Tensor::from_data(TensorData::new(labels, [n]), device),
    }
}

// ---- lockstep-specific code starts here ----
struct OwnCnn;

impl lockstep::Job for OwnCnn {
    type Model = Cnn;
    type Item = Image;
    type Batch = Batch;
    fn name(&self) -> &str {
        "own-cnn"
    }
    fn config(&self) -> &str {
        include_str!("../own-cnn.toml")
    }
    fn model(&self, _cfg: &TrainConfig, device: &Device) -> Cnn {
        Cnn::new(device)
    }
    fn train_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Image>>, BoxError> {
        Ok(Box::new(FashionMnist::open(cfg.job_section()?, "train")?))
    }
    fn eval_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Image>>, BoxError> {
        Ok(Box::new(FashionMnist::open(cfg.job_section()?, "t10k")?))
    }
    fn batch(&self, items: Vec<Image>, device: &Device) -> Batch {
        batch(items, device)
    }
    fn loss(&self, model: &Cnn, b: &Batch) -> Tensor<1> {
        model.loss(b)
    }
    fn metrics(&self, model: &Cnn, b: &Batch) -> Vec<(&'static str, f64)> {
        vec![("accuracy", model.correct(b) as f64)]
    }
}

fn main() {
    lockstep::main(OwnCnn)
}
