//! own-sequence: the classifier of `lib.rs` trained by lockstep as a `LayeredJob` — every line
//! of lockstep-specific code is in this file. See README.md.

use burn::data::dataset::{Dataset, InMemDataset};
use burn::tensor::{Device, Int, Tensor};
use lockstep::{BoxError, TrainConfig};
use own_sequence::{batch, correct, layers, loss, sequences, Layer, Sequence};

struct OwnSequence;

impl lockstep::LayeredJob for OwnSequence {
    type Layer = Layer;
    type Item = Sequence;
    type Batch = (Tensor<2>, Tensor<1, Int>);
    fn name(&self) -> &str {
        "own-sequence"
    }
    fn config(&self) -> &str {
        include_str!("../own-sequence.toml")
    }
    fn layers(&self, cfg: &TrainConfig, device: &Device) -> Vec<Layer> {
        layers(cfg.job["dropout"].as_float().unwrap_or(0.0), device)
    }
    fn train_data(&self, _: &TrainConfig) -> Result<Box<dyn Dataset<Sequence>>, BoxError> {
        Ok(Box::new(InMemDataset::new(sequences(false))))
    }
    fn eval_data(&self, _: &TrainConfig) -> Result<Box<dyn Dataset<Sequence>>, BoxError> {
        Ok(Box::new(InMemDataset::new(sequences(true))))
    }
    fn batch(&self, items: Vec<Sequence>, device: &Device) -> Self::Batch {
        batch(&items, device)
    }
    fn input(&self, (tokens, _): &Self::Batch) -> Tensor<2> {
        tokens.clone()
    }
    fn forward(&self, layer: &Layer, x: Tensor<2>) -> Tensor<2> {
        layer.forward(x)
    }
    fn loss(&self, logits: Tensor<2>, (_, labels): &Self::Batch) -> Tensor<1> {
        loss(logits, labels)
    }
    fn metrics(&self, logits: Tensor<2>, (_, labels): &Self::Batch) -> Vec<(&'static str, f64)> {
        vec![("accuracy", correct(logits, labels))]
    }
}

fn main() {
    lockstep::main(lockstep::Pipelined(OwnSequence))
}
