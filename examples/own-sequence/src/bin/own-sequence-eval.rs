//! Plain burn, no lockstep: load a model exported by `own-sequence export RUN --out model.bpk`
//! and print its accuracy on the test sequences.

use burn::module::Module;
use burn::tensor::Device;
use own_sequence::{batch, correct, forward, layers, sequences};

fn main() {
    let path = std::env::args()
        .nth(1)
        .expect("usage: own-sequence-eval MODEL.bpk");
    let device = Device::flex();
    let model = layers(0.0, &device).load_file(&path);
    let test = sequences(true);
    let (tokens, labels) = batch(&test, &device);
    let accuracy = correct(forward(&model, tokens), &labels) / test.len() as f64;
    println!("accuracy {accuracy}");
}
