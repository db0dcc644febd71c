//! The burn module behind [`crate::Model`] and its forward pass.
//!
//! One struct covers both architectures so that parameter names and order come from a single
//! `#[derive(Module)]`: `convs` (empty for an MLP) then `layers`, each layer `weight` then
//! `bias`. That declaration order is the canonical parameter order of the whole crate.

use crate::spec::ModelSpec;
use burn::module::{Module, Param};
use burn::nn::conv::Conv2d;
use burn::nn::{Linear, PaddingConfig2d};

use crate::dense::dense_linear;
use burn::tensor::activation::relu;
use burn::tensor::module::{conv2d, linear, max_pool2d};
use burn::tensor::ops::{ConvOptions, MaxPoolOptions};
use burn::tensor::{Device, Tensor};

/// Burn module of a [`ModelSpec`]. Linear weights are stored `[in, out]` (burn's row layout,
/// `y = x W + b`), conv weights `[out, in, 3, 3]`.
#[derive(Module, Debug)]
pub(crate) struct Net {
    pub(crate) convs: Vec<Conv2d>,
    pub(crate) layers: Vec<Linear>,
}

/// Lets a forward pass substitute each parameter tensor just before use, by canonical index.
/// The plain forward passes parameters through unchanged; the streaming backward wraps each one
/// in an identity op whose backward reports the gradient. `anchor` is the input of the layer
/// that uses the parameter (see `streaming` for why the op needs it).
pub(crate) trait ParamTap {
    fn tap<const D: usize, const A: usize>(
        &self,
        index: usize,
        param: Tensor<D>,
        anchor: &Tensor<A>,
    ) -> Tensor<D>;
}

/// Uses every parameter as it is.
pub(crate) struct NoTap;

impl ParamTap for NoTap {
    fn tap<const D: usize, const A: usize>(
        &self,
        _index: usize,
        param: Tensor<D>,
        _anchor: &Tensor<A>,
    ) -> Tensor<D> {
        param
    }
}

impl Net {
    /// Builds the module with zero-filled parameters of the right shapes on `device`; the caller
    /// then writes real values through the flat-parameter mapper, so that initialisation and
    /// `set_params_flat` share one code path and one order.
    pub(crate) fn zeros(spec: &ModelSpec, device: &Device) -> Net {
        let linear = |d_in: usize, d_out: usize| Linear {
            weight: Param::from_tensor(Tensor::zeros([d_in, d_out], device)),
            bias: Some(Param::from_tensor(Tensor::zeros([d_out], device))),
        };
        match spec {
            ModelSpec::Mlp {
                input,
                hidden,
                classes,
            } => {
                let widths: Vec<usize> = std::iter::once(*input)
                    .chain(hidden.iter().copied())
                    .chain(std::iter::once(*classes))
                    .collect();
                Net {
                    convs: Vec::new(),
                    layers: widths.windows(2).map(|w| linear(w[0], w[1])).collect(),
                }
            }
            ModelSpec::Cnn {
                channels,
                conv,
                hidden,
                classes,
                ..
            } => {
                let mut c_in = *channels;
                let convs = conv
                    .iter()
                    .map(|&c_out| {
                        let layer = Conv2d {
                            weight: Param::from_tensor(Tensor::zeros([c_out, c_in, 3, 3], device)),
                            bias: Some(Param::from_tensor(Tensor::zeros([c_out], device))),
                            stride: [1, 1],
                            kernel_size: [3, 3],
                            dilation: [1, 1],
                            groups: 1,
                            padding: PaddingConfig2d::Explicit(1, 1, 1, 1),
                        };
                        c_in = c_out;
                        layer
                    })
                    .collect();
                let (h, w) = spec.cnn_feature_hw();
                Net {
                    convs,
                    layers: vec![linear(c_in * h * w, *hidden), linear(*hidden, *classes)],
                }
            }
        }
    }

    /// Logits `[n, classes]` for `x` (`[n, features]` for an MLP, `[n, c, h, w]` flattened to
    /// `[n, c*h*w]` for a CNN: the caller always passes `[n, input_len]`).
    pub(crate) fn forward(&self, spec: &ModelSpec, x: Tensor<2>, tap: &impl ParamTap) -> Tensor<2> {
        let mut index = 0;
        let mut next = || {
            index += 1;
            index - 1
        };
        let mut x = x;
        if let ModelSpec::Cnn {
            channels,
            height,
            width,
            ..
        } = spec
        {
            let n = x.dims()[0];
            let mut img: Tensor<4> = x.reshape([n, *channels, *height, *width]);
            for conv in &self.convs {
                let w = tap.tap(next(), conv.weight.val(), &img);
                let b = conv.bias.as_ref().map(|b| tap.tap(next(), b.val(), &img));
                let options = ConvOptions::new([1, 1], [1, 1], [1, 1], 1);
                img = relu(conv2d(img, w, b, options));
                img = max_pool2d(img, MaxPoolOptions::new([2, 2]).with_stride([2, 2]));
            }
            let [n, c, h, w] = img.dims();
            x = img.reshape([n, c * h * w]);
        }
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            let w = tap.tap(next(), layer.weight.val(), &x);
            let b = layer.bias.as_ref().map(|b| tap.tap(next(), b.val(), &x));
            x = match b {
                Some(b) => dense_linear(x, w, b),
                None => linear(x, w, None),
            };
            if i != last {
                x = relu(x);
            }
        }
        x
    }
}
