//! The model and data of own-sequence, as plain burn code (no lockstep): a sequence of token ids
//! is classified by whether low tokens (< 4) outnumber high ones. `own-sequence` trains it with
//! lockstep; `own-sequence-eval` evaluates an exported model with burn alone.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Dropout, DropoutConfig, Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::nn::{Lstm, LstmConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// Tokens per sequence, distinct tokens, embedding and hidden widths.
pub const LEN: usize = 12;
pub const VOCAB: usize = 8;
const EMBED: usize = 8;
const HIDDEN: usize = 24;

/// One layer of the classifier. Each maps `[samples, width]` to `[samples, width]`, so that a
/// pipeline can cut between any two (sequences travel flattened).
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)] // three layers in a Vec: their size is of no account
pub enum Layer {
    /// Token ids `[n, LEN]` → embeddings `[n, LEN · EMBED]`.
    Embed(Embedding),
    /// Embeddings → LSTM → mean over time → dropout: `[n, HIDDEN]`.
    Recurrent(Recurrent),
    /// `[n, HIDDEN]` → two logits.
    Head(Linear),
}

/// An LSTM whose outputs are averaged over time, then dropped out.
#[derive(Module, Debug)]
pub struct Recurrent {
    lstm: Lstm,
    dropout: Dropout,
}

/// The three layers, freshly initialised on `device`; `dropout` after the recurrent one.
pub fn layers(dropout: f64, device: &Device) -> Vec<Layer> {
    vec![
        Layer::Embed(EmbeddingConfig::new(VOCAB, EMBED).init(device)),
        Layer::Recurrent(Recurrent {
            lstm: LstmConfig::new(EMBED, HIDDEN, true).init(device),
            dropout: DropoutConfig::new(dropout).init(),
        }),
        Layer::Head(LinearConfig::new(HIDDEN, 2).init(device)),
    ]
}

impl Layer {
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let n = x.dims()[0];
        match self {
            Layer::Embed(e) => e.forward(x.int()).reshape([n, LEN * EMBED]),
            Layer::Recurrent(r) => {
                let (out, _) = r.lstm.forward(x.reshape([n, LEN, EMBED]), None);
                r.dropout.forward(out.mean_dim(1).reshape([n, HIDDEN]))
            }
            Layer::Head(linear) => linear.forward(x),
        }
    }
}

/// The whole model over a batch's token ids.
pub fn forward(layers: &[Layer], tokens: Tensor<2>) -> Tensor<2> {
    layers.iter().fold(tokens, |x, layer| layer.forward(x))
}

/// One sequence and its class.
#[derive(Clone, Debug)]
pub struct Sequence {
    pub tokens: [u8; LEN],
    pub label: u8,
}

/// Sequence `i` (a fixed function of `i`; training and test sets are disjoint ranges).
pub fn sequence(i: usize) -> Sequence {
    let mut h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5851_f42d_4c95_7f2d;
    let tokens = std::array::from_fn(|_| {
        h ^= h >> 29;
        h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        ((h >> 40) % VOCAB as u64) as u8
    });
    let low = tokens.iter().filter(|&&t| t < 4).count();
    Sequence {
        tokens,
        label: u8::from(low * 2 > LEN),
    }
}

/// Training (`0..4096`) or test (`1_000_000..1_001_024`) sequences.
pub fn sequences(test: bool) -> Vec<Sequence> {
    let range = if test { 1_000_000..1_001_024 } else { 0..4096 };
    range.map(sequence).collect()
}

/// Token ids `[n, LEN]` (as floats: a layered model's activations) and labels `[n]`.
pub fn batch(items: &[Sequence], device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
    let n = items.len();
    let ids: Vec<f32> = items.iter().flat_map(|s| s.tokens.map(f32::from)).collect();
    let labels: Vec<i64> = items.iter().map(|s| i64::from(s.label)).collect();
    (
        Tensor::from_data(TensorData::new(ids, [n, LEN]), device),
        Tensor::from_data(TensorData::new(labels, [n]), device),
    )
}

/// Mean cross-entropy of `logits` against `labels`.
pub fn loss(logits: Tensor<2>, labels: &Tensor<1, Int>) -> Tensor<1> {
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, labels.clone())
}

/// How many of `logits`' predictions equal `labels`.
pub fn correct(logits: Tensor<2>, labels: &Tensor<1, Int>) -> f64 {
    let predicted = logits.argmax(1).flatten::<1>(0, 1);
    predicted
        .equal(labels.clone())
        .int()
        .sum()
        .into_scalar::<i64>() as f64
}
