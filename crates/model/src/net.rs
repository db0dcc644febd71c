//! The built-in classifiers (MLP, CNN) as a sequence of burn layers: what lockstep's built-in job
//! trains through the public layered-job interface, and what [`crate::Model`] wraps for
//! single-device use and its tests.
//!
//! Canonical parameter order: the layers in order, each layer's `weight` then `bias` — for a
//! CNN the conv blocks first, then the two fully connected layers. Linear weights are stored
//! `[in, out]` (burn's row layout, `y = x W + b`), conv weights `[out, in, 3, 3]`. Every layer
//! takes and gives `[samples, features]` (a conv block reshapes to NCHW and back), so any cut
//! between layers is a pipeline boundary.

use crate::error::ModelError;
use crate::init;
use crate::params;
use crate::spec::ModelSpec;
use burn::module::{Module, Param};
use burn::nn::conv::Conv2d;
use burn::nn::{Linear, PaddingConfig2d};

use crate::bf16::Products;
use crate::dense::dense_linear;
use burn::tensor::activation::relu;
use burn::tensor::module::{conv2d, max_pool2d};
use burn::tensor::ops::{ConvOptions, MaxPoolOptions};
use burn::tensor::{Device, Tensor};

/// One layer of a built-in classifier.
#[derive(Module, Debug)]
pub enum ClassifierLayer {
    /// 3×3 convolution with padding 1, ReLU, and 2×2 max-pooling (stride 2, floor).
    Conv(ConvBlock),
    /// A fully connected layer followed by ReLU.
    Hidden(Linear),
    /// The output layer: the logits.
    Output(Linear),
}

/// A conv block and the shape of the image it reads from its input's features.
#[derive(Module, Debug)]
pub struct ConvBlock {
    conv: Conv2d,
    /// Channels, height and width of the input image (NCHW order within a sample's features).
    input: [usize; 3],
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

impl ClassifierLayer {
    /// The layer's output `[n, features']` for `x` `[n, features]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.forward_in(x, Products::F32)
    }

    /// [`ClassifierLayer::forward`] with its products' operands taken as `products` says
    /// (`train.precision`).
    pub fn forward_in(&self, x: Tensor<2>, products: Products) -> Tensor<2> {
        self.forward_tapped(x, &NoTap, &mut 0, products)
    }

    /// [`ClassifierLayer::forward_in`] with `tap` applied to each parameter; `index` is the
    /// canonical index of the layer's first parameter, advanced past its parameters.
    pub(crate) fn forward_tapped(
        &self,
        x: Tensor<2>,
        tap: &impl ParamTap,
        index: &mut usize,
        products: Products,
    ) -> Tensor<2> {
        let mut next = || {
            *index += 1;
            *index - 1
        };
        match self {
            ClassifierLayer::Conv(block) => {
                let [c, h, w] = block.input;
                let n = x.dims()[0];
                let img: Tensor<4> = x.reshape([n, c, h, w]);
                let weight = tap.tap(next(), block.conv.weight.val(), &img);
                let bias = block
                    .conv
                    .bias
                    .as_ref()
                    .map(|b| tap.tap(next(), b.val(), &img));
                let options = ConvOptions::new([1, 1], [1, 1], [1, 1], 1);
                let (img, weight) = (products.operand(img), products.operand(weight));
                let img = relu(conv2d(img, weight, bias, options));
                let img = max_pool2d(img, MaxPoolOptions::new([2, 2]).with_stride([2, 2]));
                let [n, c, h, w] = img.dims();
                img.reshape([n, c * h * w])
            }
            ClassifierLayer::Hidden(linear) | ClassifierLayer::Output(linear) => {
                let weight = tap.tap(next(), linear.weight.val(), &x);
                let bias = linear.bias.as_ref().expect("classifier layers have biases");
                let bias = tap.tap(next(), bias.val(), &x);
                let y = dense_linear(products.operand(x), products.operand(weight), bias);
                match self {
                    ClassifierLayer::Hidden(_) => relu(y),
                    _ => y,
                }
            }
        }
    }
}

/// The layers of `spec` with their initial values drawn from `seed` (He uniform before a ReLU,
/// LeCun uniform for the output layer, zero biases) on `device`: the same spec and seed give
/// the same bits on every process, machine and device.
pub fn classifier_layers(
    spec: &ModelSpec,
    seed: u64,
    device: &Device,
) -> Result<Vec<ClassifierLayer>, ModelError> {
    spec.validate()?;
    let layers = zero_layers(spec, device);
    let initial = init::initial_values(&params::layout(&layers), seed);
    Ok(params::write(layers, &initial, device))
}

/// The layers of `spec` with zero-filled parameters; the caller writes real values through the
/// flat-parameter mapper, so that initialisation and later writes share one path and one order.
pub(crate) fn zero_layers(spec: &ModelSpec, device: &Device) -> Vec<ClassifierLayer> {
    let linear = |d_in: usize, d_out: usize| Linear {
        weight: Param::from_tensor(Tensor::zeros([d_in, d_out], device)),
        bias: Some(Param::from_tensor(Tensor::zeros([d_out], device))),
    };
    let dense = |widths: &[usize]| -> Vec<ClassifierLayer> {
        let last = widths.len() - 2;
        widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| match i == last {
                true => ClassifierLayer::Output(linear(w[0], w[1])),
                false => ClassifierLayer::Hidden(linear(w[0], w[1])),
            })
            .collect()
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
            dense(&widths)
        }
        ModelSpec::Cnn {
            channels,
            height,
            width,
            conv,
            hidden,
            classes,
        } => {
            let (mut c_in, mut h, mut w) = (*channels, *height, *width);
            let mut layers: Vec<ClassifierLayer> = conv
                .iter()
                .map(|&c_out| {
                    let block = ConvBlock {
                        conv: Conv2d {
                            weight: Param::from_tensor(Tensor::zeros([c_out, c_in, 3, 3], device)),
                            bias: Some(Param::from_tensor(Tensor::zeros([c_out], device))),
                            stride: [1, 1],
                            kernel_size: [3, 3],
                            dilation: [1, 1],
                            groups: 1,
                            padding: PaddingConfig2d::Explicit(1, 1, 1, 1),
                        },
                        input: [c_in, h, w],
                    };
                    (c_in, h, w) = (c_out, h / 2, w / 2);
                    ClassifierLayer::Conv(block)
                })
                .collect();
            layers.extend(dense(&[c_in * h * w, *hidden, *classes]));
            layers
        }
    }
}
