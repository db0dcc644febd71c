//! `gelu`: the exact (erf) GELU, `x · Φ(x)`, as one vectorised pass forward and one backward.
//!
//! Why: burn flex computes GELU element by element through `libm`'s scalar `erf` (and `exp` in the
//! backward): a large share of the Shakespeare transformer's step at one thread. Here every value
//! goes through the same short branch-free sequence of IEEE operations, which the compiler turns
//! into vector code (AVX-512, AVX2 or SSE2 copies, picked at run time); the copies perform the same
//! operations per value (Rust never fuses a multiply and an add), so the bits do not depend on the
//! CPU's vector width (tested). Being elementwise, a pass is split between the worker's threads
//! with the same bits at any count (tested).
//!
//! Math, for `z = |x|/√2` and `e = exp(−z²) = exp(−x²/2)`:
//! - `erfc(z) ≈ q = t·(a1 + t·(a2 + t·(a3 + t·(a4 + t·a5))))·e`, `t = 1/(1 + p·z)` (Abramowitz &
//!   Stegun 7.1.26; |erf error| ≤ 1.5·10⁻⁷);
//! - `Φ(x) = 1 − q/2` for `x ≥ 0`, `q/2` for `x < 0`: the lower tail straight from `erfc`, with
//!   no `1 + erf` cancellation (burn's form loses all digits there below x ≈ −5); for `z < 0.5`,
//!   `Φ(x) = 1/2 + erf(x/√2)/2` with erf's Taylor series to `z¹³` instead (both are computed and
//!   one is selected: no branch);
//! - forward `x·Φ(x)`; backward `dy·(Φ(x) + x·φ(x))`, `φ(x) = e/√(2π)` (the same `e`).
//!
//! `exp` is `vector_math::exp_nonpositive`.
//!
//! Against the f64 GELU (tests): forward and input gradient within 2·10⁻⁷·max(1, |x|) over
//! [−12, 12] (the gradient per unit of `dy`); NaN and infinities as burn's GELU gives them.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{unary, Backward, Ops, OpsKind},
    Autodiff, NodeId,
};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::ActivationOps;
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};

use rayon::prelude::*;

use crate::flex_values::{shape, values};
use crate::vector_math::{dispatched, exp_nonpositive, tier, Tier};

#[backend_extension(Flex, Autodiff)]
pub trait ExactGelu: Backend {
    /// `x · Φ(x)`, elementwise.
    fn exact_gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl ExactGelu for Flex {
    fn exact_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        forward(x)
    }
}

/// The GELU of every value of `x` (exact erf form), with its own backward.
/// Off the flex backend: burn's exact (erf) GELU.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !crate::flex_values::on_flex(&x) {
        return burn::tensor::activation::gelu(x);
    }
    Tensor::from_dispatch(<Dispatch as ExactGelu>::exact_gelu(x.into_dispatch()))
}

const P: f32 = 0.327_591_1;
const A1: f32 = 0.254_829_6;
const A2: f32 = -0.284_496_74;
const A3: f32 = 1.421_413_8;
const A4: f32 = -1.453_152;
const A5: f32 = 1.061_405_4;
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const FRAC_2_SQRT_PI: f32 = std::f32::consts::FRAC_2_SQRT_PI;
/// 1/√(2π).
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `(Φ(x), e)` with `e = exp(−x²/2)`.
#[inline(always)]
fn cdf_and_gauss(x: f32) -> (f32, f32) {
    let z = x.abs() * FRAC_1_SQRT_2;
    let e = exp_nonpositive(-(z * z));
    let t = 1.0 / (1.0 + P * z);
    let poly = t * (A1 + t * (A2 + t * (A3 + t * (A4 + t * A5))));
    let half_q = 0.5 * (poly * e);
    let tail = if x < 0.0 { half_q } else { 1.0 - half_q };
    // Near 0, erf's Taylor series (to z¹³; the next term is < 10⁻⁹ for z < 0.5) is closer
    // than 7.1.26's absolute 1.5·10⁻⁷, which is large next to Φ's ulp there.
    let w = z * z;
    let series = 1.0
        + w * (-1.0 / 3.0
            + w * (1.0 / 10.0
                + w * (-1.0 / 42.0
                    + w * (1.0 / 216.0 + w * (-1.0 / 1320.0 + w * (1.0 / 9360.0))))));
    let central = 0.5 + (0.5 * FRAC_2_SQRT_PI) * ((x * FRAC_1_SQRT_2) * series);
    let cdf = if z < 0.5 { central } else { tail };
    (cdf, e)
}

#[inline(always)]
fn forward_any(x: &[f32], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(x) {
        let (cdf, _) = cdf_and_gauss(x);
        *o = x * cdf;
    }
}

#[inline(always)]
fn backward_any(x: &[f32], dy: &[f32], out: &mut [f32]) {
    for ((o, &x), &g) in out.iter_mut().zip(x).zip(dy) {
        let (cdf, e) = cdf_and_gauss(x);
        *o = g * (cdf + x * (e * INV_SQRT_2PI));
    }
}

dispatched!(forward_pass(x: &[f32], out: &mut [f32]) = forward_any);
dispatched!(backward_pass(x: &[f32], dy: &[f32], out: &mut [f32]) = backward_any);

/// Values per piece of work when a pass is split between the worker's threads (elementwise: the
/// same bits at any count).
const CHUNK: usize = 1 << 14;

fn forward(x: FlexTensor) -> FlexTensor {
    if x.dtype() != DType::F32 {
        return Flex::gelu(x);
    }
    let v = values(&x);
    let mut out = vec![0f32; v.len()];
    let t = tier();
    if crate::split_between_threads(v.len(), CHUNK) {
        out.par_chunks_mut(CHUNK)
            .zip(v.par_chunks(CHUNK))
            .for_each(|(o, x)| forward_pass(t, x, o));
    } else {
        forward_pass(t, &v, &mut out);
    }
    FlexTensor::from_data(TensorData::new(out, shape(&x)))
}

fn backward(x: FlexTensor, dy: FlexTensor) -> FlexTensor {
    if x.dtype() != DType::F32 || dy.dtype() != DType::F32 || shape(&x) != shape(&dy) {
        return Flex::gelu_backward(x, dy);
    }
    let (xv, dv) = (values(&x), values(&dy));
    let mut out = vec![0f32; xv.len()];
    let t = tier();
    if crate::split_between_threads(xv.len(), CHUNK) {
        out.par_chunks_mut(CHUNK)
            .zip(xv.par_chunks(CHUNK).zip(dv.par_chunks(CHUNK)))
            .for_each(|(o, (x, g))| backward_pass(t, x, g, o));
    } else {
        backward_pass(t, &xv, &dv, &mut out);
    }
    FlexTensor::from_data(TensorData::new(out, shape(&x)))
}

#[derive(Debug)]
struct GeluBackward;

impl Backward<Flex, 1> for GeluBackward {
    type State = NodeId;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let x: FloatTensor<Flex> = checkpointer.retrieve_node_output(ops.state);
        unary::<Flex, _>(ops.parents, ops.node, grads, |dy| backward(x, dy));
    }
}

impl<C: CheckpointStrategy> ExactGelu for Autodiff<Flex, C> {
    fn exact_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match GeluBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = prep.checkpoint(&x);
                prep.finish(state, forward(x.into_primitive()))
            }
            OpsKind::UnTracked(prep) => prep.finish(forward(x.into_primitive())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn flex(values: Vec<f32>) -> FlexTensor {
        let n = values.len();
        FlexTensor::from_data(TensorData::new(values, [n]))
    }

    fn f32s(t: FlexTensor) -> Vec<f32> {
        t.into_data().iter::<f32>().collect()
    }

    /// [−12, 12] in steps of 1/1024, and the values where the approximations switch form.
    fn grid() -> Vec<f32> {
        let mut v: Vec<f32> = (-12 * 1024..=12 * 1024)
            .map(|i| i as f32 / 1024.0)
            .collect();
        v.extend([
            1e-30, -1e-30, 1e-7, -1e-7, 0.0, -0.0, 40.0, -40.0, 200.0, -200.0,
        ]);
        v
    }

    /// burn's GELU in f64 (flex's `erf_f64`): the reference for both passes.
    fn reference(x: &[f32], dy: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let dy64: Vec<f64> = dy.iter().map(|&v| v as f64).collect();
        let t = |v: Vec<f64>| {
            let n = v.len();
            FlexTensor::from_data(TensorData::new(v, [n]))
        };
        let f = Flex::gelu(t(x64.clone()))
            .into_data()
            .iter::<f64>()
            .collect();
        let b = Flex::gelu_backward(t(x64), t(dy64))
            .into_data()
            .iter::<f64>()
            .collect();
        (f, b)
    }

    /// Both passes within 2·10⁻⁷ of the f64 GELU, scaled by the value's size (|x| for the forward,
    /// |dy|·max(1, |x|) for the gradient).
    #[test]
    fn both_passes_match_the_f64_gelu() {
        let x = grid();
        let dy: Vec<f32> = x.iter().map(|v| 1.0 + (v * 3.1).sin() * 0.5).collect();
        let (want_f, want_b) = reference(&x, &dy);
        let got_f = f32s(forward(flex(x.clone())));
        let got_b = f32s(backward(flex(x.clone()), flex(dy.clone())));
        for i in 0..x.len() {
            let scale = (x[i].abs() as f64).max(1.0);
            let ef = (got_f[i] as f64 - want_f[i]).abs() / scale;
            let eb = (got_b[i] as f64 - want_b[i]).abs() / (dy[i].abs() as f64 * scale);
            assert!(
                ef <= 2e-7,
                "forward at {}: {} vs {}",
                x[i],
                got_f[i],
                want_f[i]
            );
            assert!(
                eb <= 2e-7,
                "gradient at {}: {} vs {}",
                x[i],
                got_b[i],
                want_b[i]
            );
        }
    }

    /// NaN stays NaN; ±∞ give what burn's GELU gives (∞, NaN; gradient NaN at ±∞ as burn's).
    #[test]
    fn non_finite_values_behave_as_burns() {
        let x = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
        let dy = vec![1.0; 3];
        let ours = f32s(forward(flex(x.clone())));
        let burns = f32s(Flex::gelu(flex(x.clone())));
        let grad = f32s(backward(flex(x.clone()), flex(dy.clone())));
        let burn_grad = f32s(Flex::gelu_backward(flex(x), flex(dy)));
        for (a, b) in ours.iter().zip(&burns).chain(grad.iter().zip(&burn_grad)) {
            assert!(
                a == b || (a.is_nan() && b.is_nan()),
                "{ours:?} vs {burns:?}, {grad:?} vs {burn_grad:?}"
            );
        }
    }

    /// Every compiled copy computes the same bits (the vector width never changes a value).
    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        let x: Vec<f32> = grid()
            .into_iter()
            .chain([
                f32::NAN,
                f32::INFINITY,
                f32::NEG_INFINITY,
                1e-45,
                -87.5,
                87.5,
            ])
            .collect();
        let dy: Vec<f32> = x.iter().map(|v| (v * 0.7).cos()).collect();
        // NaN's sign and payload depend on operand order, which vector code may change; a NaN
        // stops training either way (the loss is checked), so all NaNs count as one.
        let bits = |v: &[f32]| {
            v.iter()
                .map(|x| {
                    if x.is_nan() {
                        f32::NAN.to_bits()
                    } else {
                        x.to_bits()
                    }
                })
                .collect::<Vec<_>>()
        };
        let run = |tier: Tier| {
            let (mut f, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
            forward_pass(tier, &x, &mut f);
            backward_pass(tier, &x, &dy, &mut b);
            (bits(&f), bits(&b))
        };
        let portable = run(Tier::Portable);
        let mut tiers = vec![Tier::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                tiers.push(Tier::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                tiers.push(Tier::Avx512);
            }
        }
        for t in tiers {
            assert!(run(t) == portable, "{t:?}");
        }
    }

    /// Split between 1–4 threads, both passes give one thread's bits.
    #[test]
    fn threads_give_the_same_bits() {
        let x: Vec<f32> = (0..100_003).map(|i| (i as f32 * 0.001) - 50.0).collect();
        let dy: Vec<f32> = x.iter().map(|v| (v * 0.7).cos()).collect();
        let run = |threads: usize| {
            crate::on_threads(threads, || {
                let f = f32s(forward(flex(x.clone())));
                let b = f32s(backward(flex(x.clone()), flex(dy.clone())));
                (
                    f.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                )
            })
        };
        let want = run(1);
        for threads in 2..=4 {
            assert!(run(threads) == want, "{threads} threads");
        }
    }

    /// Through autodiff on a non-contiguous (transposed) input: the forward pass's values and
    /// the backward pass's gradient, with the shape kept.
    #[test]
    fn autodiff_uses_the_backward_pass() {
        let dev = Device::flex().autodiff();
        let v: Vec<f32> = (0..6 * 7).map(|i| i as f32 * 0.25 - 5.0).collect();
        let x = Tensor::<2>::from_data(TensorData::new(v, [6, 7]), &dev).require_grad();
        let xt = x.clone().transpose();
        let y = gelu(xt.clone());
        assert_eq!(y.dims(), [7, 6]);
        let grads = y.clone().sum().backward();
        let g = x.grad(&grads).unwrap();
        let plain: Vec<f32> = xt.clone().into_data().iter::<f32>().collect();
        let want_y = f32s(forward(flex(plain.clone())));
        let got_y: Vec<f32> = y.into_data().iter::<f32>().collect();
        assert_eq!(got_y, want_y);
        let xs: Vec<f32> = x.into_data().iter::<f32>().collect();
        let want_g = f32s(backward(flex(xs.clone()), flex(vec![1.0; xs.len()])));
        let got_g: Vec<f32> = g.into_data().iter::<f32>().collect();
        assert_eq!(got_g, want_g);
    }
}
