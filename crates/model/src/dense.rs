//! `dense_linear`: burn's linear layer with a faster input gradient.
//!
//! Why: burn computes a linear layer's input gradient as `dy · Wᵀ` with `Wᵀ` a transposed view
//! of the weight, and burn flex's matrix multiply (the `gemm` crate) packs such a strided right
//! operand element by element: measured on this project's 2-core VM, `[128, 2048] · [2048,
//! 2048]ᵀ` takes 22 ms against 11.5 ms for the same product with contiguous operands (1.2 ms
//! against 0.4 ms at `[64, 512] · [512, 512]ᵀ`; `examples/mm_layouts.rs`). This op computes the
//! same product as `(W · dyᵀ)ᵀ`, transposing only the two small activation-sized matrices into
//! contiguous buffers (`[n, out]` and `[in, n]`, never the weight), which multiplies at the fast
//! layout.
//!
//! Forward, weight gradient and bias gradient are burn's own (`linear`,
//! `linear_weight_backward`, `linear_bias_backward`): their bits are unchanged. The input
//! gradient is the same product with gemm's operands in another layout; gemm does not promise the
//! same summation order for both, so its last bits may differ from burn's (on the benchmark MLPs
//! they did not: `param_hash` unchanged). Either way it is the same computation on every rank and
//! at every world size, which is what reproducibility needs. Measured end to end (1 worker, 1
//! thread, 2 interleaved pairs of runs): MLP 784-2048×3-10 251 → 212 ms per step (−15%).

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff, NodeId,
};
use burn::backend::ops::{FloatTensorOps, ModuleOps};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::Tensor;

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
        Flex::linear(x, weight, Some(bias))
    }
}

/// `dy · Wᵀ` as `(W · dyᵀ)ᵀ` with contiguous operands (see the module documentation).
fn input_grad(weight: FloatTensor<Flex>, dy: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let dy_t = Flex::float_swap_dims(dy, 0, 1).to_contiguous();
    let dx_t = Flex::float_matmul(weight, dy_t);
    Flex::float_swap_dims(dx_t, 0, 1).to_contiguous()
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
            let dw = Flex::linear_weight_backward(
                x.expect("checkpointed when W is tracked"),
                grad.clone(),
            );
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
                    Flex::linear(
                        x.into_primitive(),
                        weight.into_primitive(),
                        Some(bias.into_primitive()),
                    ),
                )
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::linear(
                x.into_primitive(),
                weight.into_primitive(),
                Some(bias.into_primitive()),
            )),
        }
    }
}

/// `x · weight + bias` with [`DenseLinear`]'s backward.
pub fn dense_linear(x: Tensor<2>, weight: Tensor<2>, bias: Tensor<1>) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as DenseLinear>::dense_linear(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    fn leaf(rows: usize, cols: usize, seed: usize, dev: &Device) -> Tensor<2> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 + seed * 104729) % 2003) as f32 / 1001.0 - 1.0)
            .collect();
        Tensor::<2>::from_data(TensorData::new(v, [rows, cols]), dev).require_grad()
    }

    fn bits(t: Tensor<2>) -> Vec<u32> {
        t.into_data().iter::<f32>().map(f32::to_bits).collect()
    }

    /// Against burn's own linear: the same forward, weight and bias gradients bit for bit, and an
    /// input gradient equal up to the order of the sum (relative 1e-5).
    #[test]
    fn dense_linear_matches_burns_linear() {
        let dev = Device::flex().autodiff();
        let (n, i, o) = (7, 33, 20);
        let run = |ours: bool| {
            let (x, w) = (leaf(n, i, 1, &dev), leaf(i, o, 2, &dev));
            let b_leaf = leaf(1, o, 3, &dev);
            let b = b_leaf.clone().reshape([o]);
            let y = if ours {
                dense_linear(x.clone(), w.clone(), b.clone())
            } else {
                burn::tensor::module::linear(x.clone(), w.clone(), Some(b.clone()))
            };
            let dy = leaf(n, o, 4, &dev).detach();
            let grads = (y.clone() * dy).sum().backward();
            (
                bits(y),
                x.grad(&grads).unwrap(),
                bits(w.grad(&grads).unwrap()),
                bits(b_leaf.grad(&grads).unwrap()),
            )
        };
        let (y1, dx1, dw1, db1) = run(true);
        let (y0, dx0, dw0, db0) = run(false);
        assert_eq!(y1, y0, "forward");
        assert_eq!(dw1, dw0, "weight gradient");
        assert_eq!(db1, db0, "bias gradient");
        let (a, b): (Vec<f32>, Vec<f32>) = (
            dx1.to_data().try_to_vec::<f32>().unwrap(),
            dx0.to_data().try_to_vec::<f32>().unwrap(),
        );
        for (k, (p, q)) in a.iter().zip(&b).enumerate() {
            assert!(
                (p - q).abs() <= 1e-5 * q.abs().max(1.0),
                "dx[{k}]: {p} vs {q}"
            );
        }
    }
}
