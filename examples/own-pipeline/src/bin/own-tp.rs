//! own-tp: the digits classifier of own-pipeline with tensor-parallel layers
//! (`lockstep::tp::ColumnParallelLinear` → ReLU → `RowParallelLinear`, twice, then a plain
//! output layer), so that `parallel.tp` ranks split its hidden layers — alone or with data and
//! pipeline parallelism — and every layout ends with the one-worker parameters. See README.md.

use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use lockstep::tp::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
};
use lockstep::{BoxError, TrainConfig};
use own_pipeline::{batch, correct, cross_entropy, digits, Batch, Digit};
use serde::Deserialize;

/// One layer. A column-parallel layer's output is the rank's pieces of its features; the
/// row-parallel layer after it sums all pieces (ReLU between them is elementwise, so it works on
/// any rank's pieces).
#[derive(Module, Debug)]
pub enum Layer {
    /// Column-parallel linear, then ReLU.
    Column(ColumnParallelLinear),
    /// Row-parallel linear, then ReLU.
    Row(RowParallelLinear),
    /// The replicated output layer (logits).
    Output(Linear),
}

impl Layer {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        match self {
            Layer::Column(l) => relu(l.forward(x)),
            Layer::Row(l) => relu(l.forward(x)),
            Layer::Output(l) => l.forward(x),
        }
    }
}

/// The `[job]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    /// Width of the column-parallel layers' outputs.
    hidden: usize,
    /// Width between the blocks.
    width: usize,
    /// Blocks of Column → ReLU → Row → ReLU.
    blocks: usize,
    /// The fixed pieces of every tensor-parallel layer (`parallel.tp` must divide it).
    pieces: usize,
}

// ---- lockstep-specific code starts here ----
struct OwnTp;

impl lockstep::LayeredJob for OwnTp {
    type Layer = Layer;
    type Item = Digit;
    type Batch = Batch;
    fn name(&self) -> &str {
        "own-tp"
    }
    fn config(&self) -> &str {
        include_str!("../../own-tp.toml")
    }
    fn validate(&self, cfg: &TrainConfig) -> Result<(), String> {
        let s = cfg.job_section::<Settings>().map_err(|e| e.to_string())?;
        if s.pieces == 0 || s.hidden % s.pieces != 0 || s.blocks == 0 {
            return Err(format!(
                "pieces = {} must divide hidden = {}, and blocks ≥ 1",
                s.pieces, s.hidden
            ));
        }
        Ok(())
    }
    fn layers(&self, cfg: &TrainConfig, device: &Device) -> Vec<Layer> {
        let s = cfg.job_section::<Settings>().expect("validated [job]");
        let mut layers = Vec::new();
        let mut width = 64;
        for _ in 0..s.blocks {
            let col = ColumnParallelLinearConfig::new(width, s.hidden, s.pieces);
            layers.push(Layer::Column(col.init(device)));
            let row = RowParallelLinearConfig::new(s.hidden, s.width, s.pieces);
            layers.push(Layer::Row(row.init(device)));
            width = s.width;
        }
        layers.push(Layer::Output(LinearConfig::new(width, 10).init(device)));
        layers
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
    fn forward(&self, layer: &Layer, x: Tensor<2>) -> Tensor<2> {
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
    lockstep::main(lockstep::Pipelined(OwnTp))
}
