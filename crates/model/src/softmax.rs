//! `softmax_last`: softmax over the last dimension as one pass forward and one backward.
//!
//! Why: burn's autodiff computes softmax as five tracked ops (`max_dim`, `sub`, `exp`, `sum_dim`,
//! `div`), each a full pass with its own buffer and its own backward, with `exp` through glibc's
//! scalar `expf` (whose underflow path, taken by every masked score of the causal attention,
//! was 3% of the Shakespeare transformer's step on its own). Here each row is one pass: its
//! maximum, `exp(x − max)` by the vectorised `vector_math::exp_nonpositive` (every argument is
//! ≤ 0; masked scores give exactly 0), the sum, the division; the backward is
//! `dx = y · (dy − Σ dy·y)` per row from the saved output.
//!
//! Bits: each row's sums run left to right, so a row's result depends on nothing else; rows are
//! split between the worker's threads ([`crate::compute_threads`]) with the same bits at any
//! count, and the vector copies agree (tested). Against burn's softmax (tests): within 2·10⁻⁷
//! absolute per value (outputs lie in [0, 1]); a NaN anywhere in a row makes the row NaN, as in
//! burn's.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{unary, Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::ActivationOps;
use burn::backend::{
    backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex, TensorMetadata,
};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use crate::flex_values::{shape, values};
use crate::vector_math::{dispatched, exp_nonpositive, tier, Tier};

#[backend_extension(Flex, Autodiff)]
pub trait RowSoftmax: Backend {
    /// Softmax over the last dimension.
    fn row_softmax(x: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl RowSoftmax for Flex {
    fn row_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        forward(x)
    }
}

/// Softmax of `x` over its last dimension, with its own backward.
/// Off the flex backend: burn's softmax.
pub fn softmax_last<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !crate::flex_values::on_flex(&x) {
        return burn::tensor::activation::softmax(x, D - 1);
    }
    Tensor::from_dispatch(<Dispatch as RowSoftmax>::row_softmax(x.into_dispatch()))
}

/// Values per piece of work when rows are split between threads.
const CHUNK: usize = 1 << 14;

#[inline(always)]
fn forward_rows_any(x: &[f32], y: &mut [f32], width: usize) {
    for (xr, yr) in x.chunks_exact(width).zip(y.chunks_exact_mut(width)) {
        let max = xr
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
        for (o, &v) in yr.iter_mut().zip(xr) {
            *o = exp_nonpositive(v - max);
        }
        let mut sum = 0f32;
        for &e in yr.iter() {
            sum += e;
        }
        for o in yr.iter_mut() {
            *o /= sum;
        }
    }
}

#[inline(always)]
fn backward_rows_any(y: &[f32], dy: &[f32], dx: &mut [f32], width: usize) {
    let rows = y.chunks_exact(width).zip(dy.chunks_exact(width));
    for ((yr, gr), dr) in rows.zip(dx.chunks_exact_mut(width)) {
        let mut dot = 0f32;
        for (&a, &b) in yr.iter().zip(gr) {
            dot += a * b;
        }
        for ((o, &a), &b) in dr.iter_mut().zip(yr).zip(gr) {
            *o = a * (b - dot);
        }
    }
}

dispatched!(pub(crate) forward_rows(x: &[f32], y: &mut [f32], width: usize) = forward_rows_any);
dispatched!(pub(crate) backward_rows(y: &[f32], dy: &[f32], dx: &mut [f32], width: usize) = backward_rows_any);

/// Whole rows per piece of work, or `None` when the work stays on this thread.
fn rows_per_piece(len: usize, width: usize) -> Option<usize> {
    crate::split_between_threads(len, CHUNK).then(|| (CHUNK / width).max(1) * width)
}

fn forward(x: FlexTensor) -> FlexTensor {
    let dims = shape(&x);
    let width = dims.last().copied().unwrap_or(0);
    if x.dtype() != DType::F32 || width == 0 {
        return Flex::softmax(x, dims.len().saturating_sub(1));
    }
    let v = values(&x);
    let mut out = vec![0f32; v.len()];
    let t = tier();
    match rows_per_piece(v.len(), width) {
        Some(piece) => out
            .par_chunks_mut(piece)
            .zip(v.par_chunks(piece))
            .for_each(|(o, x)| forward_rows(t, x, o, width)),
        None => forward_rows(t, &v, &mut out, width),
    }
    FlexTensor::from_data(TensorData::new(out, dims))
}

fn backward(y: FlexTensor, dy: FlexTensor) -> FlexTensor {
    let dims = shape(&y);
    let width = dims.last().copied().unwrap_or(0);
    assert_eq!(dims, shape(&dy), "softmax_last: gradient shape");
    assert!(
        y.dtype() == DType::F32 && dy.dtype() == DType::F32,
        "softmax_last: f32 only (the forward pass fell back to burn's for other types)"
    );
    let (yv, gv) = (values(&y), values(&dy));
    let mut out = vec![0f32; yv.len()];
    if width > 0 {
        let t = tier();
        match rows_per_piece(yv.len(), width) {
            Some(piece) => out
                .par_chunks_mut(piece)
                .zip(yv.par_chunks(piece).zip(gv.par_chunks(piece)))
                .for_each(|(o, (y, g))| backward_rows(t, y, g, o, width)),
            None => backward_rows(t, &yv, &gv, &mut out, width),
        }
    }
    FlexTensor::from_data(TensorData::new(out, dims))
}

#[derive(Debug)]
struct SoftmaxBackward;

impl Backward<Flex, 1> for SoftmaxBackward {
    /// The forward pass's output.
    type State = FlexTensor;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let y = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |dy| backward(y, dy));
    }
}

impl<C: CheckpointStrategy> RowSoftmax for Autodiff<Flex, C> {
    fn row_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if x.dtype() != DType::F32 {
            // burn's own softmax, differentiated op by op.
            let dim = x.shape().num_dims() - 1;
            return <Self as ActivationOps<Self>>::softmax(x, dim);
        }
        match SoftmaxBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = forward(x.into_primitive());
                prep.finish(y.clone(), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward(x.into_primitive())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn flex(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
        FlexTensor::from_data(TensorData::new(values, shape))
    }

    fn f32s(t: FlexTensor) -> Vec<f32> {
        t.into_data().iter::<f32>().collect()
    }

    /// Attention-like rows: scaled scores, a causal −1e9 mask, a row of one value, wide rows.
    fn rows(width: usize, count: usize) -> Vec<f32> {
        (0..width * count)
            .map(|i| {
                let (r, c) = (i / width, i % width);
                if c > r % width {
                    -1e9 + (i as f32 * 0.37).sin()
                } else {
                    (i as f32 * 0.731).sin() * (1 + r % 9) as f32
                }
            })
            .collect()
    }

    /// The forward pass within 2·10⁻⁷ of burn's softmax, and the gradient of `Σ y·w` within
    /// 2·10⁻⁷ · max(1, |w|) of burn's autodiff through its five ops.
    #[test]
    fn both_passes_match_burns_softmax() {
        let dev = Device::flex().autodiff();
        for (width, count) in [(64, 300), (1, 5), (7, 40), (300, 3)] {
            let x = rows(width, count);
            let w: Vec<f32> = (0..x.len())
                .map(|i| (i as f32 * 0.13).cos() * 3.0)
                .collect();
            let run = |ours: bool| {
                let xt = Tensor::<2>::from_data(TensorData::new(x.clone(), [count, width]), &dev)
                    .require_grad();
                let wt = Tensor::<2>::from_data(TensorData::new(w.clone(), [count, width]), &dev);
                let y = if ours {
                    softmax_last(xt.clone())
                } else {
                    burn::tensor::activation::softmax(xt.clone(), 1)
                };
                let g = (y.clone() * wt).sum().backward();
                let grad: Vec<f32> = xt.grad(&g).unwrap().into_data().iter::<f32>().collect();
                (y.into_data().iter::<f32>().collect::<Vec<f32>>(), grad)
            };
            let ((y1, g1), (y0, g0)) = (run(true), run(false));
            for i in 0..x.len() {
                assert!(
                    (y1[i] - y0[i]).abs() <= 2e-7,
                    "y[{i}] width {width}: {} vs {}",
                    y1[i],
                    y0[i]
                );
                let tol = 2e-7 * w[i].abs().max(1.0) * 4.0;
                assert!(
                    (g1[i] - g0[i]).abs() <= tol,
                    "dx[{i}] width {width}: {} vs {}",
                    g1[i],
                    g0[i]
                );
            }
        }
    }

    /// A NaN in a row makes that row NaN and leaves the others alone, as burn's does.
    #[test]
    fn a_nan_poisons_its_row_only() {
        let mut x = rows(8, 3);
        x[8 + 3] = f32::NAN;
        let y = f32s(forward(flex(x, vec![3, 8])));
        assert!(y[..8].iter().all(|v| v.is_finite()));
        assert!(y[8..16].iter().all(|v| v.is_nan()), "{y:?}");
        assert!(y[16..].iter().all(|v| v.is_finite()));
    }

    /// Rows split between 1–4 threads and every compiled copy give the same bits.
    #[test]
    fn threads_and_instruction_sets_give_the_same_bits() {
        let (width, count) = (64, 2048);
        let x = rows(width, count);
        let dy: Vec<f32> = (0..x.len()).map(|i| (i as f32 * 0.29).sin()).collect();
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let run = |threads: usize| {
            crate::on_threads(threads, || {
                let y = forward(flex(x.clone(), vec![count, width]));
                let dx = backward(y.clone(), flex(dy.clone(), vec![count, width]));
                (bits(f32s(y)), bits(f32s(dx)))
            })
        };
        let want = run(1);
        for threads in 2..=4 {
            assert!(run(threads) == want, "{threads} threads");
        }
        let (mut y, mut dx) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        forward_rows(Tier::Portable, &x, &mut y, width);
        backward_rows(Tier::Portable, &y, &dy, &mut dx, width);
        assert!((bits(y), bits(dx)) == want, "portable copy");
    }
}
