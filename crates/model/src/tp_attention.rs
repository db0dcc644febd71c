//! [`ParallelSelfAttention`]: causal multi-head self-attention split by heads across a
//! tensor-parallel group (Megatron style), for users' own transformers — the same split as the
//! built-in transformer's (`tensor_parallel.rs`): piece `p` of `T` owns heads
//! `[p·H/T, (p+1)·H/T)`, their Q, K and V projections and their rows of the output projection.
//!
//! Made of the two tensor-parallel linear layers (`tp_layers.rs`) and one attention op:
//!
//! ```text
//! x [n, t, d] ─ qkv: ColumnParallelLinear d → 3d ─ [n, t, local·3w]   (w = d / T; piece p's 3w
//!                                                                      columns = [Q_p | K_p | V_p])
//!   pieces into the batch: [local·n, t, 3w] ─ causal attention, H/T heads ─ [local·n, t, w]
//!   back side by side: [n, t, local·w] ─ proj: RowParallelLinear d → d (exact sum) ─ [n, t, d]
//! ```
//!
//! Attention needs nothing from other pieces, so a rank computes its pieces' heads alone; the
//! column layer's backward sums the input gradient of all pieces exactly and the row layer's
//! forward sums their outputs exactly, so every `parallel.tp` that divides `T` gives the bits of
//! one worker. The pieces go into the batch dimension and back by reshapes and permutations
//! (whose gradients move values without adding any), and each (sequence, head) pair's attention
//! is computed on its own, so a piece's values do not depend on how many pieces a rank holds.

use burn::module::Module;
use burn::tensor::{Device, Tensor};

use crate::bf16::Products;
use crate::tp_layers::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
};
use crate::transformer::attend;

/// How to build a [`ParallelSelfAttention`].
#[derive(Debug, Clone, Copy)]
pub struct ParallelSelfAttentionConfig {
    d_model: usize,
    heads: usize,
    pieces: usize,
}

impl ParallelSelfAttentionConfig {
    /// `heads` heads of width `d_model / heads`, in `pieces` fixed pieces of `heads / pieces`
    /// heads each.
    pub fn new(d_model: usize, heads: usize, pieces: usize) -> Self {
        ParallelSelfAttentionConfig {
            d_model,
            heads,
            pieces,
        }
    }

    /// The layer, initialised like two burn `Linear`s (uniform in ±1/√d_model), `qkv` first.
    /// Panics unless `pieces ≥ 1` divides `heads` and `heads ≥ 1` divides `d_model`.
    pub fn init(&self, device: &Device) -> ParallelSelfAttention {
        let (d, h, t) = (self.d_model, self.heads, self.pieces);
        assert!(
            h >= 1 && d.is_multiple_of(h) && t >= 1 && h.is_multiple_of(t),
            "ParallelSelfAttention: {t} pieces must divide {h} heads, and the heads d_model = {d}"
        );
        ParallelSelfAttention {
            qkv: ColumnParallelLinearConfig::new(d, 3 * d, t).init(device),
            proj: RowParallelLinearConfig::new(d, d, t).init(device),
            heads: h,
            d_model: d,
        }
    }
}

/// Causal multi-head self-attention whose heads are cut into `pieces` fixed pieces: on a
/// tensor-parallel rank it holds and computes only its pieces' heads; its output, the exact sum
/// over all pieces plus the replicated bias, is the same on every rank of the group.
#[derive(Module, Debug)]
pub struct ParallelSelfAttention {
    /// The Q, K and V projections, `d_model → 3·d_model`: its weight's rows are ordered piece by
    /// piece, each piece's Q rows, K rows and V rows of its heads (in head order), so that a
    /// piece is one run of rows.
    pub qkv: ColumnParallelLinear,
    /// The output projection, `d_model → d_model`, its input rows cut into the same pieces.
    pub proj: RowParallelLinear,
    #[module(skip)]
    heads: usize,
    #[module(skip)]
    d_model: usize,
}

impl ParallelSelfAttention {
    /// `[n, t, d_model]` → `[n, t, d_model]`, position `i` attending to positions `≤ i`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_in(x, Products::F32)
    }

    /// [`ParallelSelfAttention::forward`] with every product's operands taken as `products`
    /// says (`train.precision`: `lockstep::products(cfg)`): the projections' inputs and weights,
    /// and Q, K, V.
    pub fn forward_in(&self, x: Tensor<3>, products: Products) -> Tensor<3> {
        let [n, t, _] = x.dims();
        let pieces = self.qkv.pieces();
        let w = self.d_model / pieces;
        let qkv = products.operand(self.qkv.forward_in(x, products));
        let local = qkv.dims()[2] / (3 * w);
        let batched = qkv
            .reshape([n, t, local, 3 * w])
            .permute([2, 0, 1, 3])
            .reshape([local * n, t, 3 * w]);
        let attended = attend(batched, self.heads / pieces)
            .reshape([local, n, t, w])
            .permute([1, 2, 0, 3])
            .reshape([n, t, local * w]);
        self.proj.forward_in(attended, products)
    }

    /// The fixed pieces `T`.
    pub fn pieces(&self) -> usize {
        self.qkv.pieces()
    }

    /// The heads `H` (all pieces').
    pub fn heads(&self) -> usize {
        self.heads
    }
}

#[cfg(test)]
mod tests {
    //! One worker against the piecewise computation and against plain multi-head attention, and
    //! 2 or 4 simulated tp ranks on threads against one worker, bit for bit.

    use burn::module::Param;
    use burn::tensor::TensorData;

    use super::*;
    use crate::tp_layers::narrow_to_pieces;
    use crate::tp_layers::test_group::{ad, bits, run_ranks, vals};

    const N: usize = 3;
    const T_LEN: usize = 5;
    const D: usize = 16;
    const HEADS: usize = 4;
    const PIECES: usize = 4;

    fn input(device: &Device) -> Tensor<3> {
        let v: Vec<f32> = (0..N * T_LEN * D)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        Tensor::from_data(TensorData::new(v, [N, T_LEN, D]), device)
    }

    fn output_grad(device: &Device) -> Tensor<3> {
        let v: Vec<f32> = (0..N * T_LEN * D)
            .map(|i| (i as f32 * 0.91).cos())
            .collect();
        Tensor::from_data(TensorData::new(v, [N, T_LEN, D]), device)
    }

    fn layer() -> ParallelSelfAttention {
        ParallelSelfAttentionConfig::new(D, HEADS, PIECES).init(&ad())
    }

    /// Output, input gradient, and the gradients of qkv weight, qkv bias, proj weight, proj bias.
    struct Run {
        out: Tensor<3>,
        dx: Tensor<3>,
        grads: [Vec<f32>; 4],
    }

    fn run(a: &ParallelSelfAttention) -> Run {
        let device = ad();
        let x = input(&device).require_grad();
        let z = a.forward(x.clone());
        let grads = (z.clone() * output_grad(&device)).sum().backward();
        let g2 = |p: &Param<Tensor<2>>| vals(p.val().grad(&grads).unwrap());
        let g1 = |p: &Param<Tensor<1>>| vals(p.val().grad(&grads).unwrap());
        Run {
            out: z.inner(),
            dx: x.grad(&grads).unwrap(),
            grads: [
                g2(&a.qkv.weight),
                g1(&a.qkv.bias),
                g2(&a.proj.weight),
                g1(&a.proj.bias),
            ],
        }
    }

    fn plain<const R: usize>(v: Vec<f32>, shape: [usize; R]) -> Tensor<R> {
        Tensor::from_data(TensorData::new(v, shape), &Device::flex())
    }

    #[test]
    fn one_worker_is_the_piecewise_computation_bit_for_bit() {
        let a = layer();
        let got = run(&a);
        let (wq, bq) = (vals(a.qkv.weight.val()), vals(a.qkv.bias.val()));
        let (wp, bp) = (vals(a.proj.weight.val()), vals(a.proj.bias.val()));
        let w = D / PIECES;
        let x = input(&Device::flex()).reshape([N * T_LEN, D]);
        let mut partial = Vec::new();
        for p in 0..PIECES {
            let rows = p * 3 * w..(p + 1) * 3 * w;
            let weight = plain(wq[rows.start * D..rows.end * D].to_vec(), [3 * w, D]);
            let bias = plain(bq[rows].to_vec(), [3 * w]);
            let qkv = x.clone().matmul(weight.transpose()) + bias.unsqueeze();
            let heads = attend(qkv.reshape([N, T_LEN, 3 * w]), HEADS / PIECES);
            let heads = heads.reshape([N * T_LEN, w]);
            let proj = plain(wp[p * w * D..(p + 1) * w * D].to_vec(), [w, D]);
            partial.push(vals(heads.matmul(proj)));
        }
        let refs: Vec<&[f32]> = partial.iter().map(|p| p.as_slice()).collect();
        let mut sum = vec![0f32; N * T_LEN * D];
        lockstep_exact::sum_local(&refs, PIECES, &mut sum).unwrap();
        let want = plain(sum, [N * T_LEN, D]) + plain(bp, [1, D]);
        assert_eq!(bits(got.out.reshape([N * T_LEN, D])), bits(want));
    }

    #[test]
    fn it_is_multi_head_attention_with_its_rows_in_piece_order() {
        let a = layer();
        let got = run(&a);
        // The same weights as one fused [Q | K | V] projection in the usual order, then burn's
        // composed attention over all heads and a plain output projection.
        let (wq, bq) = (vals(a.qkv.weight.val()), vals(a.qkv.bias.val()));
        let w = D / PIECES;
        let mut order = Vec::new();
        for part in 0..3 {
            for p in 0..PIECES {
                order.extend((p * 3 + part) * w..(p * 3 + part + 1) * w);
            }
        }
        let weight: Vec<f32> = order
            .iter()
            .flat_map(|&r| wq[r * D..(r + 1) * D].to_vec())
            .collect();
        let bias: Vec<f32> = order.iter().map(|&r| bq[r]).collect();
        let x = input(&Device::flex());
        let qkv = x.matmul(plain(weight, [3 * D, D]).transpose().unsqueeze())
            + plain(bias, [3 * D]).unsqueeze();
        let mask = crate::transformer::causal_mask(T_LEN, &Device::flex());
        let heads = crate::transformer::attend_composed(qkv, HEADS, &mask);
        let want = heads
            .reshape([N * T_LEN, D])
            .matmul(a.proj.weight.val().inner())
            + a.proj.bias.val().inner().unsqueeze();
        for (i, (u, v)) in vals(got.out).iter().zip(vals(want)).enumerate() {
            assert!((u - v).abs() <= 1e-5 * (1.0 + v.abs()), "[{i}]: {u} vs {v}");
        }
    }

    #[test]
    fn tensor_parallel_ranks_reproduce_one_worker() {
        let a = layer();
        let one = run(&a);
        for tp in [2, 4] {
            let ranks = run_ranks(tp, |rank| {
                let a = narrow_to_pieces(a.clone(), tp, rank, &ad());
                move || run(&a)
            });
            let share = |whole: &[f32], rank: usize| {
                let per = whole.len() / tp;
                whole[rank * per..(rank + 1) * per].to_vec()
            };
            for (rank, r) in ranks.into_iter().enumerate() {
                let at = format!("tp {tp} rank {rank}");
                assert_eq!(bits(r.out), bits(one.out.clone()), "{at}: output");
                assert_eq!(bits(r.dx), bits(one.dx.clone()), "{at}: dx");
                for (i, what) in ["qkv weight", "qkv bias", "proj weight"].iter().enumerate() {
                    assert_eq!(r.grads[i], share(&one.grads[i], rank), "{at}: {what}");
                }
                assert_eq!(r.grads[3], one.grads[3], "{at}: proj bias");
            }
        }
    }

    #[test]
    #[should_panic(expected = "3 pieces must divide 4 heads")]
    fn pieces_that_do_not_divide_the_heads_are_refused() {
        ParallelSelfAttentionConfig::new(D, HEADS, 3).init(&ad());
    }
}
