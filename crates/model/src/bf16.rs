//! bf16 products (`train.precision = "bf16"`): the operands of a product rounded to bfloat16
//! before it, the product itself summed in `f32`.
//!
//! What a model computes in bf16 ([`Products::operand`] on each operand of each product):
//! - forward: every operand of a product (activations and weights) is rounded to the nearest
//!   bf16 value, ties to even (`f32` values with the low 16 bits zero); the product of two such
//!   values is exact in `f32` (8 + 8 significant bits), so a product of bf16 operands summed in
//!   `f32` is what bf16 matrix units with `f32` accumulation compute, up to their order of
//!   summation. The product's output stays `f32` (it is not rounded to bf16, unlike PyTorch's
//!   autocast, which returns bf16), and so does everything that is not a product (biases, layer
//!   norms, softmax, GELU, the loss);
//! - backward: the gradient that reaches a rounded operand is rounded to bf16 too (the gradient
//!   of a cast to bf16, as under autocast), so the weights' gradients leave the backward as bf16
//!   values;
//! - the master weights, the optimizer state and the exact gradient sum stay `f32` / fixed point.
//!
//! On the flex CPU backend the rounding is one elementwise pass ([`bf16_operand`], split
//! between the worker's threads; the same bits at any count) and the products run on the `f32`
//! kernels. Off flex it is burn's own cast to bf16 and back.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{unary, Backward, Ops},
    Autodiff,
};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use crate::flex_values::{shape, values};

/// How a model's products take their operands: as they are (`f32`), or rounded to bf16.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Products {
    /// `f32` operands (the default).
    #[default]
    F32,
    /// Operands rounded to bf16, products summed in `f32` (see the module documentation).
    Bf16,
}

impl Products {
    /// `t` as an operand of a product: unchanged for [`Products::F32`], rounded to bf16 (and its
    /// gradient rounded to bf16 in backward) for [`Products::Bf16`].
    pub fn operand<const D: usize>(self, t: Tensor<D>) -> Tensor<D> {
        match self {
            Products::F32 => t,
            Products::Bf16 => bf16_operand(t),
        }
    }
}

/// `x` rounded to the nearest bfloat16 (ties to even; NaN stays NaN, values beyond bf16's range
/// become infinities), kept as `f32`: the function [`bf16_operand`] applies to every value (and,
/// in backward, to every gradient value).
pub fn round_to_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    if x.is_nan() {
        // Quiet, with the sign and the payload's top bits kept (as `half`'s conversion does).
        return f32::from_bits((bits | 0x0040_0000) & 0xFFFF_0000);
    }
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1));
    f32::from_bits(rounded & 0xFFFF_0000)
}

#[backend_extension(Flex, Autodiff)]
pub trait Bf16Operand: Backend {
    /// Every value rounded to bf16 (kept as `f32`).
    fn bf16_operand(x: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl Bf16Operand for Flex {
    fn bf16_operand(x: FloatTensor<Self>) -> FloatTensor<Self> {
        round(x)
    }
}

/// `t` with every value rounded to bf16 ([`round_to_bf16`]), as an operand of a product; the
/// gradient flowing back through it is rounded the same way.
pub fn bf16_operand<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    if !crate::flex_values::on_flex(&t) || t.dtype() != DType::F32 {
        return t.cast(DType::BF16).cast(DType::F32);
    }
    Tensor::from_dispatch(<Dispatch as Bf16Operand>::bf16_operand(t.into_dispatch()))
}

/// Values per piece of work when a pass is split between the worker's threads.
const CHUNK: usize = 1 << 15;

fn round(x: FlexTensor) -> FlexTensor {
    let dtype = x.dtype();
    if dtype != DType::F32 {
        // Not reached from `bf16_operand` (which takes `f32` tensors here); burn's casts for any
        // other float type.
        return Flex::float_cast(Flex::float_cast(x, DType::BF16.into()), dtype.into());
    }
    let v = values(&x);
    // Collected, not written into a zero-filled buffer (whose memset cost as much as the pass).
    let out: Vec<f32> = if crate::split_between_threads(v.len(), CHUNK) {
        v.par_iter()
            .with_min_len(CHUNK)
            .map(|&x| round_to_bf16(x))
            .collect()
    } else {
        v.iter().map(|&x| round_to_bf16(x)).collect()
    };
    FlexTensor::from_data(TensorData::new(out, shape(&x)))
}

#[derive(Debug)]
struct RoundBackward;

impl Backward<Flex, 1> for RoundBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        unary::<Flex, _>(ops.parents, ops.node, grads, round);
    }
}

impl<C: CheckpointStrategy> Bf16Operand for Autodiff<Flex, C> {
    fn bf16_operand(x: FloatTensor<Self>) -> FloatTensor<Self> {
        RoundBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateless(round(x.into_primitive()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    /// The definition, in `f64`: the nearest bf16 value (8 significant bits), ties to the one
    /// whose last bit is 0; for finite values in bf16's normal range.
    fn nearest_bf16(x: f32) -> f32 {
        if x == 0.0 {
            return x;
        }
        let e = (x.abs() as f64).log2().floor() as i32;
        let ulp = 2f64.powi(e - 7);
        let q = x as f64 / ulp;
        let (lo, frac) = (q.floor(), q - q.floor());
        let n = if frac > 0.5 || (frac == 0.5 && lo.rem_euclid(2.0) == 1.0) {
            lo + 1.0
        } else {
            lo
        };
        (n * ulp) as f32
    }

    #[test]
    fn rounding_is_to_the_nearest_bf16_with_ties_to_even() {
        // Exact bf16 values stay; halfway cases go to the even neighbour; just above or below
        // halfway to the nearest.
        let one = 1.0f32;
        let ulp = 2f32.powi(-7);
        assert_eq!(round_to_bf16(one), one);
        assert_eq!(round_to_bf16(one + ulp / 2.0), one); // tie → even (1.0)
        assert_eq!(round_to_bf16(one + 1.5 * ulp), one + 2.0 * ulp); // tie → even (1 + 2 ulp)
        assert_eq!(round_to_bf16(one + ulp / 2.0 + 2f32.powi(-20)), one + ulp);
        assert_eq!(round_to_bf16(-(one + ulp / 2.0 - 2f32.powi(-20))), -one);
        let mut s = 0x9E37_79B9u32;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let x = f32::from_bits(s);
            if !x.is_finite() || x.abs() < f32::MIN_POSITIVE * 256.0 || x.abs() > 1e38 {
                continue;
            }
            assert_eq!(round_to_bf16(x), nearest_bf16(x), "{x:e} ({s:#010x})");
            assert_eq!(round_to_bf16(x).to_bits() & 0xFFFF, 0);
        }
    }

    #[test]
    fn special_values_keep_their_meaning() {
        assert_eq!(round_to_bf16(0.0).to_bits(), 0);
        assert_eq!(round_to_bf16(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(round_to_bf16(f32::INFINITY), f32::INFINITY);
        assert_eq!(round_to_bf16(f32::NEG_INFINITY), f32::NEG_INFINITY);
        assert!(round_to_bf16(f32::NAN).is_nan());
        assert!(round_to_bf16(f32::from_bits(0x7F80_0001)).is_nan()); // payload below bit 16
                                                                      // Beyond bf16's largest value.
        assert_eq!(round_to_bf16(f32::MAX), f32::INFINITY);
        // The same bits as burn's own cast to bf16 and back (the path off the flex backend).
        let xs: Vec<f32> = (0..4096).map(|i| (i as f32 - 2048.0) * 0.377_31).collect();
        let via_burn: Vec<f32> =
            Tensor::<1>::from_data(TensorData::new(xs.clone(), [4096]), &Device::flex())
                .cast(DType::BF16)
                .cast(DType::F32)
                .into_data()
                .iter::<f32>()
                .collect();
        let ours: Vec<f32> = xs.iter().map(|&x| round_to_bf16(x)).collect();
        assert_eq!(ours, via_burn);
    }

    #[test]
    fn the_op_rounds_values_and_gradients_at_any_thread_count() {
        let n = 3 * CHUNK + 17;
        let xs: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 10007) as f32 / 3001.0 - 1.3)
            .collect();
        let run = || {
            let dev = Device::flex().autodiff();
            let x =
                Tensor::<2>::from_data(TensorData::new(xs.clone(), [n, 1]), &dev).require_grad();
            let y = bf16_operand(x.clone());
            // d(sum(y · w))/dx = round(w): the gradient rounded on its way back.
            let w = Tensor::<2>::from_data(TensorData::new(xs.clone(), [n, 1]), &dev);
            let grads = (y.clone() * w).sum().backward();
            let gx: Vec<f32> = x.grad(&grads).unwrap().into_data().iter::<f32>().collect();
            let yv: Vec<f32> = y.into_data().iter::<f32>().collect();
            (yv, gx)
        };
        let (y1, g1) = crate::on_threads(1, run);
        let expected: Vec<f32> = xs.iter().map(|&x| round_to_bf16(x)).collect();
        assert_eq!(y1, expected);
        assert_eq!(g1, expected);
        assert_eq!(crate::on_threads(3, run), (y1, g1));
    }

    #[test]
    fn f32_products_leave_operands_alone() {
        let x = Tensor::<1>::from_data(
            TensorData::new(vec![1.0 + 2f32.powi(-10)], [1]),
            &Device::flex(),
        );
        let same: Vec<f32> = Products::F32
            .operand(x.clone())
            .into_data()
            .iter::<f32>()
            .collect();
        let rounded: Vec<f32> = Products::Bf16
            .operand(x)
            .into_data()
            .iter::<f32>()
            .collect();
        assert_eq!((same[0], rounded[0]), (1.0 + 2f32.powi(-10), 1.0));
    }
}
