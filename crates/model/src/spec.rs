//! Model specifications: plain data that every rank can compare, serialise and hash.

use crate::error::ModelError;
use serde::{Deserialize, Serialize};

/// Architecture of a classifier. Every hidden layer is followed by ReLU; the last layer
/// outputs `classes` logits trained with softmax cross-entropy.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ModelSpec {
    /// Multi-layer perceptron: `input -> hidden[0] -> ... -> classes`.
    Mlp {
        /// Features per sample.
        input: usize,
        /// Widths of the hidden layers (may be empty: logistic regression).
        hidden: Vec<usize>,
        /// Number of classes.
        classes: usize,
    },
    /// Small convolutional network on NCHW images: for each entry of `conv`, a 3x3 convolution
    /// with padding 1 and that many output channels, ReLU, and 2x2 max-pooling (stride 2, floor);
    /// then flatten, one hidden fully connected layer with ReLU, and the output layer.
    Cnn {
        /// Input channels.
        channels: usize,
        /// Input height.
        height: usize,
        /// Input width.
        width: usize,
        /// Output channels of each conv block.
        conv: Vec<usize>,
        /// Width of the fully connected hidden layer.
        hidden: usize,
        /// Number of classes.
        classes: usize,
    },
}

impl ModelSpec {
    /// f32 values per input sample (`input`, or `channels * height * width` in NCHW order).
    pub fn input_len(&self) -> usize {
        match self {
            ModelSpec::Mlp { input, .. } => *input,
            ModelSpec::Cnn {
                channels,
                height,
                width,
                ..
            } => channels * height * width,
        }
    }

    /// Number of output classes.
    pub fn classes(&self) -> usize {
        match self {
            ModelSpec::Mlp { classes, .. } | ModelSpec::Cnn { classes, .. } => *classes,
        }
    }

    /// Refuses specs that cannot be built, naming the offending field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |msg: String| Err(ModelError::InvalidSpec(msg));
        let classes = self.classes();
        if !(2..=256).contains(&classes) {
            // Labels are u8, and one class cannot be learned.
            return bad(format!("classes = {classes}: must be in 2..=256"));
        }
        match self {
            ModelSpec::Mlp { input, hidden, .. } => {
                if *input == 0 {
                    return bad("mlp input = 0: must be at least 1".into());
                }
                if let Some(i) = hidden.iter().position(|&h| h == 0) {
                    return bad(format!("mlp hidden[{i}] = 0: every layer needs a width"));
                }
            }
            ModelSpec::Cnn {
                channels,
                height,
                width,
                conv,
                hidden,
                ..
            } => {
                if *channels == 0 || *height == 0 || *width == 0 {
                    return bad(format!(
                        "cnn input {channels}x{height}x{width}: every dimension must be at least 1"
                    ));
                }
                if conv.is_empty() {
                    return bad("cnn conv = []: at least one conv block (use Mlp otherwise)".into());
                }
                if let Some(i) = conv.iter().position(|&c| c == 0) {
                    return bad(format!("cnn conv[{i}] = 0: every conv needs channels"));
                }
                if *hidden == 0 {
                    return bad("cnn hidden = 0: must be at least 1".into());
                }
                let (h, w) = self.cnn_feature_hw();
                if h == 0 || w == 0 {
                    return bad(format!(
                        "cnn input {height}x{width} is too small for {} 2x2 poolings",
                        conv.len()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Spatial size after all conv blocks (each halves with floor). (0, 0) for an MLP.
    pub(crate) fn cnn_feature_hw(&self) -> (usize, usize) {
        match self {
            ModelSpec::Mlp { .. } => (0, 0),
            ModelSpec::Cnn {
                height,
                width,
                conv,
                ..
            } => conv
                .iter()
                .fold((*height, *width), |(h, w), _| (h / 2, w / 2)),
        }
    }

    /// Stable byte encoding of everything that shapes the forward pass, for the structure hash:
    /// two CNNs can have identical parameter shapes yet read their input differently (e.g.
    /// 8x8 vs 4x16 images both pool to 16 features), so the shapes alone are not enough.
    pub(crate) fn canonical_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut put = |v: usize| out.extend_from_slice(&(v as u64).to_le_bytes());
        match self {
            ModelSpec::Mlp {
                input,
                hidden,
                classes,
            } => {
                put(1);
                put(*input);
                put(hidden.len());
                hidden.iter().for_each(|&h| put(h));
                put(*classes);
            }
            ModelSpec::Cnn {
                channels,
                height,
                width,
                conv,
                hidden,
                classes,
            } => {
                put(2);
                put(*channels);
                put(*height);
                put(*width);
                put(conv.len());
                conv.iter().for_each(|&c| put(c));
                put(*hidden);
                put(*classes);
            }
        }
        out
    }
}
