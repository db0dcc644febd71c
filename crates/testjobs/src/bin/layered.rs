//! The test job's model as a `LayeredJob` (hidden linear + ReLU, then the output linear), so
//! that the tests can cut it into pipeline stages and make a stage misbehave.

#[path = "../common.rs"]
mod common;

use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::module::linear;
use burn::tensor::{Device, Tensor};
use common::{Item, Settings, INPUTS};
use lockstep::{BoxError, TrainConfig};

#[derive(Module, Debug)]
struct Layer {
    linear: Linear,
    dropout: Dropout,
    #[module(skip)]
    relu: bool,
    /// `train.precision`: the product's operands as `lockstep::products(cfg)` takes them.
    #[module(skip)]
    products: lockstep::ops::Products,
}

struct LayeredTestJob;

impl lockstep::LayeredJob for LayeredTestJob {
    type Layer = Layer;
    type Item = Item;
    type Batch = (Tensor<2>, Tensor<2>);

    fn name(&self) -> &str {
        "testjob-layered"
    }

    fn config(&self) -> &str {
        common::CONFIG
    }

    fn validate(&self, cfg: &TrainConfig) -> Result<(), String> {
        common::settings(cfg).map(drop)
    }

    fn layers(&self, cfg: &TrainConfig, device: &Device) -> Vec<Layer> {
        let s: Settings = cfg.job_section().expect("validated");
        let products = lockstep::products(cfg);
        vec![
            Layer {
                linear: LinearConfig::new(INPUTS, s.hidden).init(device),
                dropout: DropoutConfig::new(s.dropout).init(),
                relu: true,
                products,
            },
            Layer {
                linear: LinearConfig::new(s.hidden, 1).init(device),
                dropout: DropoutConfig::new(0.0).init(),
                relu: false,
                products,
            },
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
        // burn's `Linear::forward`, its operands taken as the config says.
        let p = layer.products;
        let (weight, bias) = (layer.linear.weight.val(), layer.linear.bias.as_ref());
        // `Linear::forward`'s own check, so a batch of the wrong width is named as it names it.
        let (d_input, width) = (weight.dims()[0], x.dims()[1]);
        assert!(
            width == d_input,
            "input features: expected {d_input}, got {width}"
        );
        let y = linear(p.operand(x), p.operand(weight), bias.map(|b| b.val()));
        if layer.relu {
            layer.dropout.forward(relu(y))
        } else {
            y
        }
    }

    fn loss(&self, output: Tensor<2>, (_, y): &(Tensor<2>, Tensor<2>)) -> Tensor<1> {
        MseLoss::new().forward(output, y.clone(), Reduction::Mean)
    }

    const TRAIN_METRICS: &'static [&'static str] = &["mae"];
    const BF16_PRODUCTS: bool = true;

    fn update_rule(&self, _cfg: &TrainConfig) -> Option<Box<dyn lockstep::UpdateRule>> {
        Some(common::update_rule())
    }

    fn loss_and_metrics(
        &self,
        output: Tensor<2>,
        (_, y): &(Tensor<2>, Tensor<2>),
    ) -> (Tensor<1>, Vec<f64>) {
        let mae = common::absolute_error(output.clone(), y);
        let loss = MseLoss::new().forward(output, y.clone(), Reduction::Mean);
        (loss, common::train_metrics(mae))
    }

    fn metrics(
        &self,
        output: Tensor<2>,
        (_, y): &(Tensor<2>, Tensor<2>),
    ) -> Vec<(&'static str, f64)> {
        vec![("mae", common::absolute_error(output, y))]
    }
}

/// Through the library entry that returns to `main` (the other test job uses `lockstep::main`).
fn main() -> std::process::ExitCode {
    match lockstep::Trainer::new(lockstep::Pipelined(LayeredTestJob)).run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockstep: error: {e}");
            std::process::ExitCode::from(e.exit_code() as u8)
        }
    }
}
