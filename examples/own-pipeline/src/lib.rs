//! The digits (data/digits/, 1,797 8×8 images, every fifth held out) as burn datasets and
//! batches, and the loss and accuracy of a classifier's logits: what own-pipeline's two binaries
//! (`own-pipeline`, `own-tp`) share. Nothing here is specific to lockstep.

use std::io::Read;

use burn::data::dataset::InMemDataset;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use lockstep::BoxError;

#[derive(Clone, Debug)]
pub struct Digit {
    pixels: Vec<f32>,
    label: i64,
}

/// The committed digits table (gzipped CSV: 64 pixels 0–16, then the label); every fifth row is
/// held out for evaluation.
pub fn digits(held_out: bool) -> Result<InMemDataset<Digit>, BoxError> {
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
    pub pixels: Tensor<2>,
    pub labels: Tensor<1, Int>,
}

pub fn batch(items: Vec<Digit>, device: &Device) -> Batch {
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

pub fn cross_entropy(logits: Tensor<2>, b: &Batch) -> Tensor<1> {
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, b.labels.clone())
}

pub fn correct(logits: Tensor<2>, b: &Batch) -> f64 {
    let predicted = logits.argmax(1).flatten::<1>(0, 1);
    predicted
        .equal(b.labels.clone())
        .int()
        .sum()
        .into_scalar::<i64>() as f64
}
