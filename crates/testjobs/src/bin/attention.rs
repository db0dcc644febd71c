//! The test job's data through a small tensor-parallel transformer written as a user would,
//! with `lockstep::tp` layers: the 8 inputs are a sequence of 8 positions, each embedded to
//! `hidden` features; then a block of `ParallelSelfAttention` (heads in 4 pieces) and a
//! column → ReLU → row MLP, each with its residual; then a linear read-out. So that the tests
//! can split the heads across `parallel.tp` ranks, alone or with data and pipeline parallelism.

// Shared with the other test jobs, whose custom update rule and metrics this one does not use.
#[path = "../common.rs"]
#[allow(dead_code)]
mod common;

use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use common::{Item, Settings, INPUTS};
use lockstep::tp::{
    ColumnParallelLinear, ColumnParallelLinearConfig, ParallelSelfAttention,
    ParallelSelfAttentionConfig, RowParallelLinear, RowParallelLinearConfig,
};
use lockstep::{BoxError, TrainConfig};

/// Heads of the attention layer, and the fixed pieces of every tensor-parallel layer.
const HEADS: usize = 4;
const PIECES: usize = 4;

/// Each position's input value to `hidden` features, plus a learned vector per position.
#[derive(Module, Debug)]
struct Embed {
    value: Linear,
    /// `[hidden, INPUTS]`: position `i`'s vector is column `i`.
    position: Linear,
}

/// Column → ReLU → row.
#[derive(Module, Debug)]
struct Mlp {
    up: ColumnParallelLinear,
    down: RowParallelLinear,
}

/// One layer; between layers a `[batch, INPUTS · hidden]` tensor (the sequence, flattened).
#[derive(Module, Debug)]
enum Layer {
    Embed(Embed),
    /// `x + attention(x)`.
    Attention(ParallelSelfAttention),
    /// `x + mlp(x)`.
    Mlp(Mlp),
    /// The flattened sequence to the one output.
    ReadOut(Linear),
}

struct AttentionTestJob;

fn hidden(cfg: &TrainConfig) -> usize {
    let s: Settings = cfg.job_section().expect("validated");
    s.hidden
}

impl lockstep::LayeredJob for AttentionTestJob {
    type Layer = Layer;
    type Item = Item;
    type Batch = (Tensor<2>, Tensor<2>);

    fn name(&self) -> &str {
        "testjob-attention"
    }

    fn config(&self) -> &str {
        common::CONFIG
    }

    fn validate(&self, cfg: &TrainConfig) -> Result<(), String> {
        let s = common::settings(cfg)?;
        if s.hidden % HEADS != 0 {
            return Err(format!(
                "job.hidden = {} must be a multiple of {HEADS}",
                s.hidden
            ));
        }
        Ok(())
    }

    fn layers(&self, cfg: &TrainConfig, device: &Device) -> Vec<Layer> {
        let d = hidden(cfg);
        vec![
            Layer::Embed(Embed {
                value: LinearConfig::new(1, d).init(device),
                position: LinearConfig::new(d, INPUTS).with_bias(false).init(device),
            }),
            Layer::Attention(ParallelSelfAttentionConfig::new(d, HEADS, PIECES).init(device)),
            Layer::Mlp(Mlp {
                up: ColumnParallelLinearConfig::new(d, 2 * d, PIECES).init(device),
                down: RowParallelLinearConfig::new(2 * d, d, PIECES).init(device),
            }),
            Layer::ReadOut(LinearConfig::new(INPUTS * d, 1).init(device)),
        ]
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

    fn input(&self, (x, _): &(Tensor<2>, Tensor<2>)) -> Tensor<2> {
        x.clone()
    }

    fn forward(&self, layer: &Layer, x: Tensor<2>) -> Tensor<2> {
        let n = x.dims()[0];
        match layer {
            Layer::Embed(Embed { value, position }) => {
                let d = value.weight.dims()[1];
                let e = value
                    .forward(x.reshape([n * INPUTS, 1]))
                    .reshape([n, INPUTS, d]);
                // burn's Linear weight is [d_input, d_output]: its transpose's rows, per position.
                let positions = position.weight.val().transpose().unsqueeze::<3>();
                (e + positions).reshape([n, INPUTS * d])
            }
            Layer::Attention(attention) => {
                let d = x.dims()[1] / INPUTS;
                let seq = x.reshape([n, INPUTS, d]);
                (seq.clone() + attention.forward(seq)).reshape([n, INPUTS * d])
            }
            Layer::Mlp(Mlp { up, down }) => {
                let d = x.dims()[1] / INPUTS;
                let seq = x.reshape([n, INPUTS, d]);
                (seq.clone() + down.forward(relu(up.forward(seq)))).reshape([n, INPUTS * d])
            }
            Layer::ReadOut(out) => out.forward(x),
        }
    }

    fn loss(&self, output: Tensor<2>, (_, y): &(Tensor<2>, Tensor<2>)) -> Tensor<1> {
        MseLoss::new().forward(output, y.clone(), Reduction::Mean)
    }

    fn metrics(
        &self,
        output: Tensor<2>,
        (_, y): &(Tensor<2>, Tensor<2>),
    ) -> Vec<(&'static str, f64)> {
        vec![("mae", common::absolute_error(output, y))]
    }
}

fn main() {
    lockstep::main(lockstep::Pipelined(AttentionTestJob))
}
