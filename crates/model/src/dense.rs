//! `dense_linear`: burn's linear layer computed by direct `gemm` calls on flex's tensors, with
//! unchanged bits.
//!
//! Why: through burn each product allocates a zero-filled output (flex's `FlexTensor::empty`)
//! that gemm then overwrites, and burn computes the input gradient `dy · Wᵀ` with `Wᵀ` a
//! transposed view of the weight, which gemm packs element by element: about half the speed of
//! the same product on contiguous operands for large weights (`examples/mm_layouts.rs`; figures on
//! docs/src/performance.md). Here every product is one `gemm::gemm`
//! call on the operands' storage at their own strides, written into a buffer that is never
//! zero-filled; for the input gradient, the transposed copies are only made where they are
//! cheaper than gemm's packing (below).
//!
//! Bits. The forward (`x · W`, then the bias added to each row) and the weight gradient
//! (`xᵀ · dy`) are the gemm calls burn flex's `matmul_2d_strided` makes for burn's `linear` and
//! `linear_weight_backward`, argument for argument, and the bias is added by the same single
//! IEEE addition per element: bit for bit burn's. The bias gradient is burn's
//! `linear_bias_backward` itself. The input gradient keeps the bits of this op's previous version,
//! `(W · contiguous(dyᵀ))ᵀ` with burn ops, in one of three forms:
//! - in place, `dxᵀ = W · dyᵀ` in one gemm call reading `W` and `dy` where they lie and writing
//!   `dxᵀ` column-major, which is `dx` row-major: no copy, but gemm then packs `W` as its left
//!   operand row by row, slow for long rows. Used when `out` ≤ 128 and `W` has at most twice as
//!   many elements as `dy` and `dx` together (`examples/gemm_probe.rs` times both forms by shape:
//!   in place wins by far for a narrow head such as 10 classes, and loses by far for a wide
//!   square weight such as 2048 × 2048);
//! - weight transposed, where `W` is smaller than `dy` and `dx` together (the transformer's
//!   widening layers): `dx = dy · contiguous(Wᵀ)` in one gemm call on row-major operands, `dx`
//!   written row-major — one copy of the weight instead of two of the activations;
//! - transposed, otherwise: the previous version's own gemm call on `contiguous(dyᵀ)`, then `dxᵀ`
//!   transposed to `dx`, minus the zero-filled buffer; on several threads, both transposes are
//!   split between them.
//!
//! gemm's result does not depend on where its operands lie in memory as long as it runs its
//! micro-kernel (each output is one fused multiply-add chain over the sum in order, cut into
//! blocks by a depth that only depends on the sizes), which is why the forms agree; the in-place
//! and weight-transposed forms are only used where no form falls to gemm's gemv, gevv or small
//! dot-product paths.
//! The unit tests check all of this bit for bit on the benchmark models' shapes and on odd,
//! one-row and strided ones.
//!
//! Threads: these products run on the worker's threads (`parallelism`, `crate::compute_threads`), with the same bits at
//! any thread count; burn flex runs its own gemm calls on one thread.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff, NodeId,
};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::{FloatTensorOps, ModuleOps};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;
use std::mem::MaybeUninit;

use crate::flex_values::{shape, values};
use crate::gemm_call::{product, Operand};

#[backend_extension(Flex, Autodiff)]
pub trait DenseLinear: Backend {
    /// `x · weight + bias` (`x` `[n, in]`, `weight` `[in, out]`, `bias` `[out]`).
    fn dense_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl DenseLinear for Flex {
    fn dense_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        forward(x, weight, bias)
    }
}

/// gemm's threading for a product here: the calling thread's rayon pool, which the launcher sizes
/// to the worker's threads (`RAYON_NUM_THREADS` = `--threads-per-worker`, by default cores /
/// nproc). One thread runs `None`, the call burn flex's `matmul_2d_strided` makes (flex asks for
/// `Rayon(0)` only when built with its `rayon` feature, which this workspace leaves off, so flex's
/// own products run on one thread whatever `--threads-per-worker` says). Several threads run
/// `Rayon(n)`: gemm splits the rows and columns of the output between them, never the sum (the
/// depth blocks depend on the sizes only), so every output is the same multiply-add chain and
/// the bits do not depend on the thread count (tested below on every shape at 2–4 threads).
/// gemm keeps products under 48 × 48 × 256 multiply-adds on one thread.
fn parallelism() -> gemm::Parallelism {
    match crate::compute_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// How a product's `m × n` result lies in its fresh, densely packed buffer.
#[derive(Clone, Copy)]
enum Dst {
    RowMajor,
    ColMajor,
}

/// `lhs · rhs` (`[m, k] · [k, n]`) by one gemm call with the arguments burn flex's
/// `matmul_2d_strided` passes ([`product`]), on the worker's threads, into a fresh buffer that is
/// never zero-filled.
fn gemm_new(lhs: Operand, rhs: Operand, dst: Dst) -> Vec<f32> {
    let (m, n) = (lhs.rows(), rhs.cols());
    let len = m
        .checked_mul(n)
        .expect("dense_linear: output size overflows");
    let (dst_rs, dst_cs) = match dst {
        Dst::RowMajor => (n as isize, 1),
        Dst::ColMajor => (1, m as isize),
    };
    let mut out = Vec::<f32>::with_capacity(len);
    // SAFETY: the destination strides map the m × n indices one to one onto `0..len`, inside
    // `out`'s capacity, which nothing else touches. gemm never reads the destination before
    // writing it, and writes every one of its elements (the micro-kernel, gemv and gevv paths,
    // and zeros when k = 0: gemm-common 0.19's `gemm_basic_generic`), so all `len` values are
    // initialised when `set_len` runs.
    unsafe {
        product(lhs, rhs, out.as_mut_ptr(), dst_rs, dst_cs, parallelism());
        out.set_len(len);
    }
    out
}

fn f32_tensor(values: Vec<f32>, shape: [usize; 2]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

fn all_f32(ts: &[&FlexTensor]) -> bool {
    ts.iter().all(|t| t.dtype() == DType::F32)
}

/// `x · weight + bias`: burn's `linear` (a matmul, then the bias added to each row) with the
/// matmul's output written in place of a zero-filled one.
fn forward(x: FlexTensor, weight: FlexTensor, bias: FlexTensor) -> FlexTensor {
    if !all_f32(&[&x, &weight, &bias]) {
        return Flex::linear(x, weight, Some(bias));
    }
    let (xm, wm) = (Operand::of(&x), Operand::of(&weight));
    let (rows, out) = (xm.rows(), wm.cols());
    let mut y = gemm_new(xm, wm, Dst::RowMajor);
    assert_eq!(shape(&bias), [out], "dense_linear: bias of length {out}");
    let b = values(&bias);
    if out > 0 {
        for row in y.chunks_exact_mut(out) {
            for (v, b) in row.iter_mut().zip(b.iter()) {
                // burn flex's float_add: `output + bias`, one IEEE addition per element.
                *v += *b;
            }
        }
    }
    f32_tensor(y, [rows, out])
}

/// `xᵀ · dy`: burn's `linear_weight_backward` (the same gemm call on the transposed view of `x`),
/// with its output written in place of a zero-filled one.
fn weight_grad(x: FlexTensor, dy: FlexTensor) -> FlexTensor {
    if !all_f32(&[&x, &dy]) {
        return Flex::linear_weight_backward(x, dy);
    }
    let (xt, d) = (Operand::of(&x).t(), Operand::of(&dy));
    let shape = [xt.rows(), d.cols()];
    f32_tensor(gemm_new(xt, d, Dst::RowMajor), shape)
}

/// `dy · Wᵀ` as the previous version of this op computed it, `(W · contiguous(dyᵀ))ᵀ` with burn
/// ops: the reference for [`input_grad`]'s bits, and its path for tiny products.
fn input_grad_burn(weight: FlexTensor, dy: FlexTensor) -> FlexTensor {
    let dy_t = Flex::float_swap_dims(dy, 0, 1).to_contiguous();
    let dx_t = Flex::float_matmul(weight, dy_t);
    Flex::float_swap_dims(dx_t, 0, 1).to_contiguous()
}

/// `dy · Wᵀ` (`dy` `[n, out]`, `W` `[in, out]`) with [`input_grad_burn`]'s bits, in whichever of
/// three forms is faster for the shape (see the module documentation):
/// - in place: `dxᵀ = W · dyᵀ` in one gemm call that reads `W` and `dy` where they lie (`dyᵀ` a
///   strided view) and writes `dxᵀ` column-major, which is `dx` row-major: no copy at all, but gemm
///   then packs `W` as its left operand row by row, which is slow for long rows (wide `out`);
/// - weight transposed: `dy · contiguous(Wᵀ)`, where the weight is the smaller copy;
/// - transposed: `input_grad_burn`'s own gemm call (`W · contiguous(dyᵀ)`, then `dxᵀ` transposed
///   to `dx`), minus the zero-filling of `dxᵀ`'s buffer.
fn input_grad(weight: FlexTensor, dy: FlexTensor) -> FlexTensor {
    if !all_f32(&[&weight, &dy]) {
        return input_grad_burn(weight, dy);
    }
    let (w, d) = (Operand::of(&weight), Operand::of(&dy));
    let (rows, inp, out) = (d.rows(), w.rows(), w.cols());
    assert_eq!(d.cols(), out, "dense_linear: gradient width");
    // The forms lay gemm's operands out differently. gemm's result does not depend on the
    // layout when both run its micro-kernel, which they do when no side of the product is 1
    // (gemv), the sums are longer than 2 (gevv) and there are more than 16 × 16 outputs (below
    // that, gemm sums a row-major left operand times a column-major right one, which the in-place
    // form's are, as dot products in another order).
    let same_path = rows >= 2 && inp >= 2 && out >= 3 && rows * inp > 16 * 16;
    // Measured (`examples/gemm_probe.rs`): in place is faster up to `out` = 128 when `W` has at most
    // twice as many elements as `dy` and `dx` together; beyond, the two transposes cost less
    // than packing `W` row by row.
    let in_place_faster = out <= 128 && inp * out <= 2 * rows * (inp + out);
    if same_path && in_place_faster {
        let w_plain;
        let w = if w.is_plain() {
            w
        } else {
            w_plain = weight.to_contiguous();
            Operand::of(&w_plain)
        };
        let d_plain;
        let d = if d.is_plain() {
            d
        } else {
            d_plain = dy.to_contiguous();
            Operand::of(&d_plain)
        };
        return f32_tensor(gemm_new(w, d.t(), Dst::ColMajor), [rows, inp]);
    }
    // A weight smaller than the two activation copies (the transformer's `[Q | K | V]` and MLP
    // widening layers at 512 rows: 49 or 65 thousand values against 262 or 327 thousand) is
    // transposed instead: `dx = dy · contiguous(Wᵀ)`, row-major operands, `dx` written in place.
    // Each output is the same multiply-add chain over `out` (gemm's depth blocks depend on the
    // sum's length only, and `same_path` keeps both forms on its micro-kernel).
    if same_path && inp * out <= rows * (inp + out) {
        return weight_transposed(&weight, dy, [rows, inp, out]);
    }
    if crate::compute_threads() == 1 {
        let dy_t = dy.transpose(0, 1).to_contiguous();
        let dx_t = gemm_new(Operand::of(&weight), Operand::of(&dy_t), Dst::RowMajor);
        return f32_tensor(dx_t, [inp, rows])
            .transpose(0, 1)
            .to_contiguous();
    }
    // On several threads, flex's single-threaded copies were 7% of the transformer's step on the
    // training thread: both transposes are split between the threads instead. (Writing `dxᵀ`
    // column-major, which is `dx`, would save the second, but gemm then packs `W` on one thread:
    // the MLP's 512 × 512 layer went from 6.2 to 8.3 ms per step at 2 threads.) On one thread,
    // flex's tiled copies measured faster than this loop (153 against 155 ms per step).
    let dy_values = values(&dy);
    let dy_t = transposed(&dy_values, rows, out);
    let dy_t = Operand::rows_of(&dy_t, 0, out, rows, rows as isize);
    let dx_t = gemm_new(Operand::of(&weight), dy_t, Dst::RowMajor);
    f32_tensor(transposed(&dx_t, inp, rows), [rows, inp])
}

/// [`input_grad`]'s third form: `dy · contiguous(Wᵀ)` into `dx` row-major, `[rows, inp, out]`
/// the product's sizes.
fn weight_transposed(
    weight: &FlexTensor,
    dy: FlexTensor,
    [rows, inp, out]: [usize; 3],
) -> FlexTensor {
    // On one thread flex's tiled copy, on several the split one (as for the activations below).
    let flex_copy;
    let w_t = match crate::compute_threads() {
        1 => {
            flex_copy = weight.clone().transpose(0, 1).to_contiguous();
            values(&flex_copy)
        }
        _ => std::borrow::Cow::Owned(transposed(&values(weight), inp, out)),
    };
    let w_t = Operand::rows_of(&w_t, 0, out, inp, inp as isize);
    let d_plain;
    let d = match Operand::of(&dy) {
        d if d.is_plain() => d,
        _ => {
            d_plain = dy.to_contiguous();
            Operand::of(&d_plain)
        }
    };
    f32_tensor(gemm_new(d, w_t, Dst::RowMajor), [rows, inp])
}

/// Output rows per piece of a transpose, and the side of the square tiles it copies.
const TILE: usize = 32;

/// `src` (`rows × cols`, row-major) transposed, blocks of [`TILE`] output rows split between the
/// worker's threads (a copy: the same values at any count).
fn transposed(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let len = rows * cols;
    assert_eq!(src.len(), len, "transpose: shape");
    let mut out = Vec::with_capacity(len);
    if len == 0 {
        return out;
    }
    // Output rows c0..c0 + width (input columns), copied in TILE × TILE tiles.
    let fill = |(block, dst): (usize, &mut [MaybeUninit<f32>])| {
        let (c0, width) = (block * TILE, dst.len() / rows);
        for r0 in (0..rows).step_by(TILE) {
            for c in 0..width {
                let line = &mut dst[c * rows..(c + 1) * rows];
                for r in r0..(r0 + TILE).min(rows) {
                    line[r].write(src[r * cols + c0 + c]);
                }
            }
        }
    };
    let spare = &mut out.spare_capacity_mut()[..len];
    if crate::split_between_threads(len, TILE * rows) {
        spare.par_chunks_mut(TILE * rows).enumerate().for_each(fill);
    } else {
        spare.chunks_mut(TILE * rows).enumerate().for_each(fill);
    }
    // SAFETY: the blocks cover `0..len` (chunks of whole output rows), and `fill` writes every
    // element of its block: each of its `width` lines at every `r < rows`.
    unsafe { out.set_len(len) };
    out
}

#[derive(Debug)]
struct DenseLinearBackward;

impl Backward<Flex, 3> for DenseLinearBackward {
    type State = (Option<NodeId>, Option<NodeId>);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_weight, node_bias] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        let (x_state, weight_state) = ops.state;
        let x = x_state.map(|id| checkpointer.retrieve_node_output::<FloatTensor<Flex>>(id));
        let weight =
            weight_state.map(|id| checkpointer.retrieve_node_output::<FloatTensor<Flex>>(id));
        if let Some(node) = node_x {
            let dx = input_grad(
                weight.expect("checkpointed when x is tracked"),
                grad.clone(),
            );
            grads.register::<Flex>(node.id, dx);
        }
        if let Some(node) = node_weight {
            let dw = weight_grad(x.expect("checkpointed when W is tracked"), grad.clone());
            grads.register::<Flex>(node.id, dw);
        }
        if let Some(node) = node_bias {
            grads.register::<Flex>(node.id, Flex::linear_bias_backward(grad));
        }
    }
}

impl<C: CheckpointStrategy> DenseLinear for Autodiff<Flex, C> {
    fn dense_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (x_tracked, weight_tracked) = (x.is_tracked(), weight.is_tracked());
        match DenseLinearBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                // x is only needed for the weight gradient, and the weight for x's.
                let x_state = weight_tracked.then(|| prep.checkpoint(&x));
                let weight_state = x_tracked.then(|| prep.checkpoint(&weight));
                prep.finish(
                    (x_state, weight_state),
                    forward(
                        x.into_primitive(),
                        weight.into_primitive(),
                        bias.into_primitive(),
                    ),
                )
            }
            OpsKind::UnTracked(prep) => prep.finish(forward(
                x.into_primitive(),
                weight.into_primitive(),
                bias.into_primitive(),
            )),
        }
    }
}

/// `x · weight + bias` with its own one-pass backward.
/// Off the flex backend: burn's own product and broadcast add.
pub fn dense_linear(x: Tensor<2>, weight: Tensor<2>, bias: Tensor<1>) -> Tensor<2> {
    if !crate::flex_values::on_flex(&x) {
        return x.matmul(weight) + bias.unsqueeze();
    }
    Tensor::from_dispatch(<Dispatch as DenseLinear>::dense_linear(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::flex::Layout;
    use burn::tensor::Device;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104729) % 2003) as f32 / 1001.0 - 1.0)
            .collect()
    }

    fn leaf(rows: usize, cols: usize, seed: usize, dev: &Device) -> Tensor<2> {
        let v = values(rows * cols, seed);
        Tensor::<2>::from_data(TensorData::new(v, [rows, cols]), dev).require_grad()
    }

    fn bits(t: Tensor<2>) -> Vec<u32> {
        t.into_data().iter::<f32>().map(f32::to_bits).collect()
    }

    fn flex(rows: usize, cols: usize, seed: usize) -> FlexTensor {
        f32_tensor(values(rows * cols, seed), [rows, cols])
    }

    fn flex_bits(t: FlexTensor) -> Vec<u32> {
        let shape = t.layout().shape().clone();
        let data = t.into_data();
        assert_eq!(data.shape(), &shape);
        data.iter::<f32>().map(f32::to_bits).collect()
    }

    /// The benchmark models' layers (MLP 784-512-512-10 and 784-2048×3-10 at micro-batch 64 and
    /// 128, the Fashion-MNIST CNN's head, the digits MLP at micro-batch 16), odd sizes, one row,
    /// and both sides of each bound in `input_grad`'s choice of form.
    const SHAPES: &[(usize, usize, usize)] = &[
        (128, 784, 512),
        (128, 512, 512),
        (512, 128, 384),
        (512, 128, 512),
        (512, 128, 128),
        (512, 512, 128),
        (512, 128, 65),
        (128, 512, 10),
        (64, 784, 512),
        (64, 2048, 2048),
        (64, 2048, 10),
        (64, 1568, 64),
        (64, 64, 10),
        (16, 128, 64),
        (16, 64, 10),
        (7, 33, 20),
        (1, 33, 20),
        (1, 784, 512),
        (2, 128, 3),
        (2, 129, 3),
        (16, 16, 20),
        (16, 17, 20),
        (65, 65, 2),
        (65, 65, 3),
        (300, 1, 5),
        (300, 2, 5),
        (5, 40, 1),
        (3, 70, 700),
        (128, 512, 128),
        (128, 512, 129),
        (16, 512, 96),
        (16, 256, 96),
    ];

    /// `(y, dx, dW, db)` of `x · W + b` with `dy` as the output gradient, by `dense_linear` or by
    /// burn's `linear`.
    fn run(
        ours: bool,
        (n, i, o): (usize, usize, usize),
        dev: &Device,
    ) -> (Vec<u32>, Tensor<2>, Vec<u32>, Vec<u32>) {
        let (x, w) = (leaf(n, i, 1, dev), leaf(i, o, 2, dev));
        let b_leaf = leaf(1, o, 3, dev);
        let b = b_leaf.clone().reshape([o]);
        let y = if ours {
            dense_linear(x.clone(), w.clone(), b.clone())
        } else {
            burn::tensor::module::linear(x.clone(), w.clone(), Some(b.clone()))
        };
        let dy = leaf(n, o, 4, dev).detach();
        let grads = (y.clone() * dy).sum().backward();
        (
            bits(y),
            x.grad(&grads).unwrap(),
            bits(w.grad(&grads).unwrap()),
            bits(b_leaf.grad(&grads).unwrap()),
        )
    }

    /// Against burn's own linear: the same forward, weight and bias gradients bit for bit, and an
    /// input gradient equal up to the order of the sum (relative 1e-5).
    #[test]
    fn dense_linear_matches_burns_linear() {
        let dev = Device::flex().autodiff();
        for &shape in SHAPES {
            let (y1, dx1, dw1, db1) = run(true, shape, &dev);
            let (y0, dx0, dw0, db0) = run(false, shape, &dev);
            assert_eq!(y1, y0, "forward {shape:?}");
            assert_eq!(dw1, dw0, "weight gradient {shape:?}");
            assert_eq!(db1, db0, "bias gradient {shape:?}");
            let (a, b): (Vec<f32>, Vec<f32>) = (
                dx1.to_data().try_to_vec::<f32>().unwrap(),
                dx0.to_data().try_to_vec::<f32>().unwrap(),
            );
            for (k, (p, q)) in a.iter().zip(&b).enumerate() {
                assert!(
                    (p - q).abs() <= 1e-5 * q.abs().max(1.0),
                    "dx[{k}] {shape:?}: {p} vs {q}"
                );
            }
        }
    }

    /// The input gradient bit for bit as the previous version computed it, `(W · contiguous(dyᵀ))ᵀ`
    /// with burn ops, through autodiff and on the flex tensors directly.
    #[test]
    fn input_grad_keeps_previous_bits() {
        let dev = Device::flex().autodiff();
        for &(n, i, o) in SHAPES {
            let (w, dy) = (flex(i, o, 2), flex(n, o, 4));
            let reference = flex_bits(input_grad_burn(w.clone(), dy.clone()));
            assert_eq!(flex_bits(input_grad(w, dy)), reference, "{:?}", (n, i, o));

            // `run` builds W and dy from these same values.
            let (_, dx, _, _) = run(true, (n, i, o), &dev);
            assert_eq!(bits(dx), reference, "autodiff {:?}", (n, i, o));
        }
    }

    /// Several threads per worker: every product gives the bits of one thread, on every shape
    /// (the benchmark models' 2048 × 2048 layers are far above gemm's threading threshold).
    #[test]
    fn thread_count_does_not_change_the_bits() {
        let products = |(n, i, o): (usize, usize, usize)| {
            let (x, w, dy) = (flex(n, i, 1), flex(i, o, 2), flex(n, o, 4));
            let b = FlexTensor::from_data(TensorData::new(values(o, 3), [o]));
            [
                flex_bits(forward(x.clone(), w.clone(), b)),
                flex_bits(weight_grad(x, dy.clone())),
                flex_bits(input_grad(w, dy)),
            ]
        };
        let shapes: Vec<_> = SHAPES.iter().copied().chain([(256, 2048, 2048)]).collect();
        let reference: Vec<_> =
            crate::on_threads(1, || shapes.iter().map(|&s| products(s)).collect());
        for threads in 2..=4 {
            crate::on_threads(threads, || {
                assert!(matches!(parallelism(), gemm::Parallelism::Rayon(t) if t == threads));
                for (&shape, expected) in shapes.iter().zip(&reference) {
                    assert_eq!(&products(shape), expected, "{threads} threads, {shape:?}");
                }
            });
        }
    }

    /// Operands that are views: a transposed weight, a column-major gradient, row-narrowed and
    /// column-narrowed inputs, a strided bias. Same bits as burn's ops on the same views, for an
    /// input gradient computed in each of `input_grad`'s three forms.
    #[test]
    fn strided_operands_keep_the_bits() {
        for (n, i, o) in [(96, 200, 48), (40, 60, 300), (200, 60, 300)] {
            strided_operands(n, i, o);
        }
    }

    fn strided_operands(n: usize, i: usize, o: usize) {
        let narrow_cols = |t: FlexTensor, cols: usize| t.narrow(1, 3, cols);
        let weights = [
            flex(i, o, 2),
            flex(o, i, 2).transpose(0, 1),
            narrow_cols(flex(i, o + 5, 2), o),
        ];
        let dys = [
            flex(n, o, 4),
            flex(o, n, 4).transpose(0, 1),
            narrow_cols(flex(n, o + 7, 4), o),
            flex(n + 9, o, 4).narrow(0, 2, n),
        ];
        let xs = [
            flex(n, i, 1),
            flex(i, n, 1).transpose(0, 1),
            narrow_cols(flex(n, i + 4, 1), i),
        ];
        let biases = [
            FlexTensor::from_data(TensorData::new(values(o, 3), [o])),
            FlexTensor::from_data(TensorData::new(values(2 * o, 3), [2 * o]))
                .with_layout(Layout::new([o].into(), vec![2], 1)),
        ];
        for (a, w) in weights.iter().enumerate() {
            for (b, dy) in dys.iter().enumerate() {
                assert_eq!(
                    flex_bits(input_grad(w.clone(), dy.clone())),
                    flex_bits(input_grad_burn(w.clone(), dy.clone())),
                    "input gradient, weight {a}, dy {b}"
                );
            }
            for (c, x) in xs.iter().enumerate() {
                for (d, bias) in biases.iter().enumerate() {
                    assert_eq!(
                        flex_bits(forward(x.clone(), w.clone(), bias.clone())),
                        flex_bits(Flex::linear(x.clone(), w.clone(), Some(bias.clone()))),
                        "forward, weight {a}, x {c}, bias {d}"
                    );
                }
            }
        }
        for (c, x) in xs.iter().enumerate() {
            for (b, dy) in dys.iter().enumerate() {
                assert_eq!(
                    flex_bits(weight_grad(x.clone(), dy.clone())),
                    flex_bits(Flex::linear_weight_backward(x.clone(), dy.clone())),
                    "weight gradient, x {c}, dy {b}"
                );
            }
        }
    }
}
