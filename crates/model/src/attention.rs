//! `causal_attention`: the transformer's causal self-attention as one op, forward and backward,
//! by direct `gemm` calls on each (sequence, head) pair where its operands lie.
//!
//! Why: composed of burn ops, attention splits `qkv` into three narrowed, reshaped and transposed
//! views, multiplies, scales, adds a `[t, t]` mask, takes the softmax, multiplies again and
//! transposes the heads back side by side: each transpose of a result is a copy, each op a tracked
//! node, and the backward adds three zero-padded gradients back into one `qkv` gradient. burn
//! flex runs its batched products on one thread. Here, per pair (sequence `b`, head `h`), with
//! `Q`, `K`, `V` the `[t, dh]` blocks of `qkv` at row stride `3w` and `s = 1/√dh`:
//! - forward: `S = Q·Kᵀ` (gemm, `t × t × dh`); `X = S·s + M` with `M` 0 on and below the diagonal,
//!   −10⁹ above; `P = softmax(X)` per row (`softmax.rs`'s rows); `O = P·V` (gemm, `t × dh × t`),
//!   written straight into the output `[n, t, w]` at columns `h·dh..`;
//! - backward, from the saved `P` and `qkv`: `dP = dO·Vᵀ`; `dX = P·(dP − Σ dP·P)` per row;
//!   `dS = dX·s`; `dQ = dS·K`; `dKᵀ = Qᵀ·dS`; `dV = Pᵀ·dO`, each written straight into its block
//!   of the `qkv` gradient.
//!
//! Bits: these are the products, with the same sizes and arguments, and the elementwise steps,
//! in the same order, that burn's composition (`attend_composed` in `transformer.rs`) computes;
//! gemm's result does not depend on where its operands lie when it runs its micro-kernel
//! (`dense.rs`), so the output and the gradient are burn's bit for bit (tested, and the
//! Shakespeare run's `param_hash` is unchanged). For tiny products (a few positions or a head
//! width of 1–2, where gemm switches to its gemv and dot-product paths, whose order can depend on
//! the layout) the bits may differ from burn's, still the same on every run, rank and thread
//! count. Pairs are independent, so they are split between
//! the worker's threads ([`crate::compute_threads`]), each product on one thread: the same bits
//! at any thread count (tested).

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{unary, Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::flex::FlexTensor;
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use crate::flex_values::{shape, values};
use crate::gemm_call::{product, Operand};
use crate::softmax::{backward_rows as softmax_backward, forward_rows as softmax_forward};
use crate::vector_math::tier;

/// Each pair's products run on the thread that took the pair (pairs are what the threads split).
const ONE_THREAD: gemm::Parallelism = gemm::Parallelism::None;

/// The additive mask's value above the diagonal (as `causal_mask` in `transformer.rs`).
pub(crate) const MASKED: f32 = -1e9;

#[backend_extension(Flex, Autodiff)]
pub trait CausalAttention: Backend {
    /// Causal self-attention of `heads` heads over `qkv = [Q | K | V]` (`[n, t, 3·w]`): `[n, t, w]`.
    fn causal_attention(qkv: FloatTensor<Self>, heads: usize) -> FloatTensor<Self>;
}

impl CausalAttention for Flex {
    fn causal_attention(qkv: FloatTensor<Self>, heads: usize) -> FloatTensor<Self> {
        forward(&qkv, heads).0
    }
}

/// Causal self-attention of `heads` heads over `qkv` (`[n, t, 3·w]`, f32), with its own backward.
pub(crate) fn causal_attention(qkv: Tensor<3>, heads: usize) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as CausalAttention>::causal_attention(
        qkv.into_dispatch(),
        heads,
    ))
}

/// Sizes of one call: `n` sequences of `t` positions, `heads` heads of width `dh`.
#[derive(Clone, Copy, Debug)]
struct Dims {
    n: usize,
    t: usize,
    heads: usize,
    dh: usize,
}

impl Dims {
    fn of(qkv_shape: &[usize], heads: usize) -> Dims {
        assert_eq!(
            qkv_shape.len(),
            3,
            "causal_attention: qkv must be [n, t, 3·w]"
        );
        let (n, t, w3) = (qkv_shape[0], qkv_shape[1], qkv_shape[2]);
        assert!(
            heads > 0 && w3 % (3 * heads) == 0,
            "causal_attention: width {w3} is not 3 × {heads} heads"
        );
        Dims {
            n,
            t,
            heads,
            dh: w3 / (3 * heads),
        }
    }
    fn w(&self) -> usize {
        self.heads * self.dh
    }
    fn pairs(&self) -> usize {
        self.n * self.heads
    }
    /// Where pair `p`'s block of `which` (0 = Q, 1 = K, 2 = V) starts in `qkv`.
    fn qkv_at(&self, p: usize, which: usize) -> usize {
        let (b, h) = (p / self.heads, p % self.heads);
        b * self.t * 3 * self.w() + which * self.w() + h * self.dh
    }
    /// Pair `p`'s `Q`, `K` and `V` (`[t, dh]` each) where they lie in `qkv`'s values.
    fn qkv_blocks<'a>(&self, qkv: &'a [f32], p: usize) -> [Operand<'a>; 3] {
        let stride = 3 * self.w() as isize;
        [0, 1, 2].map(|which| Operand::rows_of(qkv, self.qkv_at(p, which), self.t, self.dh, stride))
    }
    /// Where pair `p`'s block starts in an `[n, t, w]` tensor.
    fn out_at(&self, p: usize) -> usize {
        let (b, h) = (p / self.heads, p % self.heads);
        b * self.t * self.w() + h * self.dh
    }
}

/// A pointer that pairs on other threads write through: each pair writes only its own blocks.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: the pairs' blocks are disjoint (`Dims::qkv_at` / `out_at`: distinct sequences, or
// distinct column ranges of the same rows), so no element is written by two threads or read
// while written.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// The place `i` elements on (a method, so that closures capture the whole `Shared`).
    fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Runs `f(p)` for every pair, on the worker's threads when there are any.
fn for_each_pair(d: Dims, f: impl Fn(usize) + Sync + Send) {
    if d.pairs() > 1 && crate::compute_threads() > 1 {
        (0..d.pairs()).into_par_iter().for_each(f);
    } else {
        (0..d.pairs()).for_each(f);
    }
}

/// `(output [n, t, w], probabilities [n, heads, t, t])`.
fn forward(qkv: &FlexTensor, heads: usize) -> (FlexTensor, FlexTensor) {
    assert_eq!(qkv.dtype(), DType::F32, "causal_attention: f32 only");
    let d = Dims::of(&shape(qkv), heads);
    let x = values(qkv);
    let (t, dh, w) = (d.t, d.dh, d.w());
    let scale = 1.0 / (dh as f32).sqrt();
    let mut probs = vec![0f32; d.pairs() * t * t];
    let mut out = vec![0f32; d.n * t * w];
    let out_ptr = Shared(out.as_mut_ptr());
    let probs_ptr = Shared(probs.as_mut_ptr());
    let simd = tier();
    for_each_pair(d, |p| {
        let [q, k, v] = d.qkv_blocks(&x, p);
        let mut scores = vec![0f32; t * t];
        // SAFETY: `scores` is t × t, row-major.
        unsafe { product(q, k.t(), scores.as_mut_ptr(), t as isize, 1, ONE_THREAD) };
        for (i, row) in scores.chunks_exact_mut(t).enumerate() {
            for (j, s) in row.iter_mut().enumerate() {
                *s = *s * scale + if j > i { MASKED } else { 0.0 };
            }
        }
        // SAFETY: pair p's t × t block of `probs` is written by this pair only.
        let p_block = unsafe { std::slice::from_raw_parts_mut(probs_ptr.at(p * t * t), t * t) };
        softmax_forward(simd, &scores, p_block, t);
        let pm = Operand::rows_of(p_block, 0, t, t, t as isize);
        // SAFETY: pair p's block of `out` (rows of sequence b, columns h·dh..(h+1)·dh) is written
        // by this pair only, and lies inside `out`.
        unsafe { product(pm, v, out_ptr.at(d.out_at(p)), w as isize, 1, ONE_THREAD) };
    });
    (
        FlexTensor::from_data(TensorData::new(out, [d.n, t, w])),
        FlexTensor::from_data(TensorData::new(probs, [d.n, d.heads, t, t])),
    )
}

/// The `qkv` gradient `[n, t, 3·w]` from the output gradient `dy` (`[n, t, w]`).
fn backward(s: &Saved, dy: &FlexTensor) -> FlexTensor {
    let qkv_shape = shape(&s.qkv);
    let d = Dims::of(&qkv_shape, s.heads);
    assert_eq!(
        shape(dy),
        [d.n, d.t, d.w()],
        "causal_attention: gradient shape"
    );
    let (x, p_all, g) = (values(&s.qkv), values(&s.probs), values(dy));
    let (t, dh, w) = (d.t, d.dh, d.w());
    let scale = 1.0 / (dh as f32).sqrt();
    let mut dqkv = vec![0f32; x.len()];
    let dqkv_ptr = Shared(dqkv.as_mut_ptr());
    let simd = tier();
    let stride = 3 * w as isize;
    for_each_pair(d, |p| {
        let [q, k, v] = d.qkv_blocks(&x, p);
        let probs = &p_all[p * t * t..(p + 1) * t * t];
        let pm = Operand::rows_of(probs, 0, t, t, t as isize);
        let dout = Operand::rows_of(&g, d.out_at(p), t, dh, w as isize);
        let mut dp = vec![0f32; t * t];
        let mut ds = vec![0f32; t * t];
        // SAFETY: `dp` is t × t, row-major.
        unsafe { product(dout, v.t(), dp.as_mut_ptr(), t as isize, 1, ONE_THREAD) };
        softmax_backward(simd, probs, &dp, &mut ds, t);
        for v in ds.iter_mut() {
            *v *= scale;
        }
        let dsm = Operand::rows_of(&ds, 0, t, t, t as isize);
        // SAFETY: pair p's Q, K and V blocks of `dqkv` (rows of sequence b, columns h·dh.. of
        // each third) are written by this pair only, and lie inside `dqkv`; dKᵀ is written with
        // its row and column strides swapped, i.e. as dK.
        unsafe {
            product(dsm, k, dqkv_ptr.at(d.qkv_at(p, 0)), stride, 1, ONE_THREAD);
            product(
                q.t(),
                dsm,
                dqkv_ptr.at(d.qkv_at(p, 1)),
                1,
                stride,
                ONE_THREAD,
            );
            product(
                pm.t(),
                dout,
                dqkv_ptr.at(d.qkv_at(p, 2)),
                stride,
                1,
                ONE_THREAD,
            );
        }
    });
    FlexTensor::from_data(TensorData::new(dqkv, qkv_shape))
}

/// What the backward needs: the input and the softmax's output.
#[derive(Clone, Debug)]
struct Saved {
    qkv: FlexTensor,
    probs: FlexTensor,
    heads: usize,
}

#[derive(Debug)]
struct AttentionBackward;

impl Backward<Flex, 1> for AttentionBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let saved = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |dy| backward(&saved, &dy));
    }
}

impl<C: CheckpointStrategy> CausalAttention for Autodiff<Flex, C> {
    fn causal_attention(qkv: FloatTensor<Self>, heads: usize) -> FloatTensor<Self> {
        match AttentionBackward
            .prepare::<C>([qkv.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let qkv = qkv.into_primitive();
                let (y, probs) = forward(&qkv, heads);
                prep.finish(Saved { qkv, probs, heads }, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward(&qkv.into_primitive(), heads).0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transformer::{attend_composed, causal_mask};
    use burn::tensor::Device;

    fn data(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104729) % 2003) as f32 / 400.0 - 2.5)
            .collect()
    }

    fn bits(t: Tensor<3>) -> Vec<u32> {
        t.into_data().iter::<f32>().map(f32::to_bits).collect()
    }

    /// Output and `qkv` gradient of `Σ attention(qkv)·w`, by this op or burn's composition.
    fn run(ours: bool, n: usize, t: usize, heads: usize, dh: usize) -> (Vec<u32>, Vec<u32>) {
        let dev = Device::flex().autodiff();
        let w = heads * dh;
        let qkv =
            Tensor::<3>::from_data(TensorData::new(data(n * t * 3 * w, 1), [n, t, 3 * w]), &dev)
                .require_grad();
        let weights = Tensor::<3>::from_data(TensorData::new(data(n * t * w, 2), [n, t, w]), &dev);
        let y = if ours {
            causal_attention(qkv.clone(), heads)
        } else {
            attend_composed(qkv.clone(), heads, &causal_mask(t, &dev))
        };
        let grads = (y.clone() * weights).sum().backward();
        (bits(y), bits(qkv.grad(&grads).unwrap()))
    }

    /// The transformer's shapes (micro-batches of 8 × 64 positions, 4 heads of 32; one
    /// tensor-parallel piece of 2 heads) and small odd ones: burn's bits, both passes.
    #[test]
    fn both_passes_give_burns_bits() {
        for (n, t, heads, dh) in [
            (8, 64, 4, 32),
            (2, 64, 2, 32),
            (3, 40, 3, 24),
            (2, 33, 2, 20),
        ] {
            let ours = run(true, n, t, heads, dh);
            let burns = run(false, n, t, heads, dh);
            assert!(
                ours.0 == burns.0,
                "output, n {n} t {t} heads {heads} dh {dh}"
            );
            assert!(
                ours.1 == burns.1,
                "gradient, n {n} t {t} heads {heads} dh {dh}"
            );
        }
    }

    /// Pairs split between 1–4 threads give the same bits.
    #[test]
    fn threads_give_the_same_bits() {
        let on = |threads: usize| crate::on_threads(threads, || run(true, 8, 64, 4, 32));
        let want = on(1);
        for threads in 2..=4 {
            assert!(on(threads) == want, "{threads} threads");
        }
    }
}
