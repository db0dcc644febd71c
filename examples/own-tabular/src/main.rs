//! own-tabular: predict a penguin's body mass from its measurements, species and sex (Palmer
//! penguins, CC0, data/penguins/) with a small MLP; the metric is the mean absolute error in
//! grams. The table is read with burn's `InMemDataset::from_csv`. See README.md.

use burn::data::dataset::{Dataset, InMemDataset};
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use lockstep::{BoxError, TrainConfig};
use serde::Deserialize;

/// One row of penguins.csv; "NA" cells read as `None`.
#[derive(Deserialize, Clone, Debug)]
struct Row {
    species: String,
    #[serde(deserialize_with = "csv::invalid_option")]
    bill_length_mm: Option<f32>,
    #[serde(deserialize_with = "csv::invalid_option")]
    bill_depth_mm: Option<f32>,
    #[serde(deserialize_with = "csv::invalid_option")]
    flipper_length_mm: Option<f32>,
    #[serde(deserialize_with = "csv::invalid_option")]
    body_mass_g: Option<f32>,
    sex: String,
}

const FEATURES: usize = 8;

/// Model inputs (scaled measurements, one-hot species and sex) and the mass in kilograms.
#[derive(Clone, Debug)]
pub struct Penguin {
    features: [f32; FEATURES],
    mass_kg: f32,
}

impl Penguin {
    fn from_row(r: &Row) -> Option<Penguin> {
        let species = ["Adelie", "Chinstrap", "Gentoo"]
            .iter()
            .position(|s| *s == r.species)?;
        let sex = ["female", "male"].iter().position(|s| *s == r.sex)?;
        let mut features = [0f32; FEATURES];
        features[0] = r.bill_length_mm? / 50.0;
        features[1] = r.bill_depth_mm? / 20.0;
        features[2] = r.flipper_length_mm? / 200.0;
        features[3 + species] = 1.0;
        features[6 + sex] = 1.0;
        Some(Penguin {
            features,
            mass_kg: r.body_mass_g? / 1000.0,
        })
    }
}

/// The complete rows of the table; every fifth is held out for evaluation.
fn penguins(settings: Settings, held_out: bool) -> Result<InMemDataset<Penguin>, BoxError> {
    let path = &settings.csv;
    let rows = InMemDataset::<Row>::from_csv(path, &csv::ReaderBuilder::new())
        .map_err(|e| format!("{path}: {e}"))?;
    let all: Vec<Penguin> = rows
        .iter()
        .filter_map(|r| Penguin::from_row(&r.ok()?))
        .collect();
    let split = all
        .into_iter()
        .enumerate()
        .filter(|(i, _)| (i % 5 == 0) == held_out);
    Ok(InMemDataset::new(split.map(|(_, p)| p).collect()))
}

#[derive(Module, Debug)]
pub struct Regressor {
    hidden: Linear,
    out: Linear,
}

impl Regressor {
    fn new(hidden: usize, device: &Device) -> Self {
        Regressor {
            hidden: LinearConfig::new(FEATURES, hidden).init(device),
            out: LinearConfig::new(hidden, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out.forward(relu(self.hidden.forward(x)))
    }

    /// Mean squared error in kg².
    fn loss(&self, b: &Batch) -> Tensor<1> {
        let predicted = self.forward(b.features.clone());
        MseLoss::new().forward(predicted, b.mass_kg.clone(), Reduction::Mean)
    }

    /// Sum over the batch of the absolute error, in grams.
    fn error_grams(&self, b: &Batch) -> f64 {
        let error_kg = (self.forward(b.features.clone()) - b.mass_kg.clone())
            .abs()
            .sum();
        error_kg.into_scalar::<f32>() as f64 * 1000.0
    }
}

pub struct Batch {
    features: Tensor<2>,
    mass_kg: Tensor<2>,
}

fn batch(items: Vec<Penguin>, device: &Device) -> Batch {
    let n = items.len();
    let x: Vec<f32> = items.iter().flat_map(|p| p.features).collect();
    let y: Vec<f32> = items.iter().map(|p| p.mass_kg).collect();
    Batch {
        features: Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
        mass_kg: Tensor::from_data(TensorData::new(y, [n, 1]), device),
    }
}

/// The `[job]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    #[serde(default = "committed_table")]
    csv: String,
    hidden: usize,
}

/// The table committed in this repository (data/penguins/, CC0).
fn committed_table() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/penguins/penguins.csv"
    )
    .into()
}

// ---- lockstep-specific code starts here ----
struct OwnTabular;

impl lockstep::Job for OwnTabular {
    type Model = Regressor;
    type Item = Penguin;
    type Batch = Batch;
    fn name(&self) -> &str {
        "own-tabular"
    }
    fn config(&self) -> &str {
        include_str!("../own-tabular.toml")
    }
    fn validate(&self, cfg: &TrainConfig) -> Result<(), String> {
        cfg.job_section::<Settings>()
            .map(drop)
            .map_err(|e| e.to_string())
    }
    fn model(&self, cfg: &TrainConfig, device: &Device) -> Regressor {
        let hidden = cfg.job_section::<Settings>().expect("validated").hidden;
        Regressor::new(hidden, device)
    }
    fn train_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Penguin>>, BoxError> {
        Ok(Box::new(penguins(cfg.job_section()?, false)?))
    }
    fn eval_data(&self, cfg: &TrainConfig) -> Result<Box<dyn Dataset<Penguin>>, BoxError> {
        Ok(Box::new(penguins(cfg.job_section()?, true)?))
    }
    fn batch(&self, items: Vec<Penguin>, device: &Device) -> Batch {
        batch(items, device)
    }
    fn loss(&self, model: &Regressor, b: &Batch) -> Tensor<1> {
        model.loss(b)
    }
    fn metrics(&self, model: &Regressor, b: &Batch) -> Vec<(&'static str, f64)> {
        vec![("mae_grams", model.error_grams(b))]
    }
}

fn main() {
    lockstep::main(OwnTabular)
}
