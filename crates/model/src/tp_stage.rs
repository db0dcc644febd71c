//! [`TpStage`]: a range of the transformer's layers computed as the fixed pieces of the
//! canonical split (`tensor_parallel.rs`), of which this rank holds some; the same contract as
//! [`crate::Stage`] (forward and backward split apart, graphs kept per micro-batch, input
//! gradients out) over a local flat parameter vector.
//!
//! Each block is two sublayers (attention, MLP), each cut into separate autodiff graphs so that
//! no sum over pieces is ever taken in float by autodiff:
//!
//! ```text
//! segment j (replicated):  x_j = x_{j-1} + u_{j-1} + bias_{j-1};  h_j = LN_j(x_j)
//! piece p of sublayer j:   u_{j,p} = piece_p(leaf copy of h_j)          (local pieces only)
//! g (row-parallel out):    u_j = exact Σ_p u_{j,p}                      (PieceSum)
//! ```
//!
//! Backward runs the graphs in reverse: the next segment's gradient for its `u` leaf goes to
//! every piece unchanged (g's backward is the identity), the pieces' input gradients are summed
//! exactly (f's backward, PieceSum again) and enter segment `j`'s backward from
//! `sum(x_j · dx_j) + sum(h_j · dh_j)`. Every parameter lives in exactly one graph, so its
//! gradient comes from one backward call. Replicated graphs see the same inputs on every rank of
//! a tensor-parallel group and so produce the same bits there.

use std::ops::Range;

use crate::gelu::gelu;
use crate::layer_norm::layer_norm;
use burn::tensor::{Device, Tensor, TensorData};

use crate::params;
use crate::stage::{
    check_grad_len, check_stage_layers, check_targets, end_forward, input_tensor, start_backward,
    EvalForward, KeptGraphs, PendingOutput, StageContract, StageEval, StageInput, StageOutput,
};
use crate::tensor_parallel::{LayerSlots, PieceSum, TpLayout, TpSplit};
use crate::transformer::{attend, embed_tokens, head_logits, linear3, TransformerSpec};
use crate::ModelError as E;

/// One replicated segment's graph: its leaves and outputs.
struct Segment {
    /// The residual stream coming in (the stage input leaf for the first segment of a non-first
    /// stage; `None` after the embedding or outside training).
    x_in: Option<Tensor<3>>,
    /// The exact piece sum coming in (none for the first segment).
    u_in: Option<Tensor<3>>,
    x_out: Tensor<3>,
    /// The layer norm's output, the pieces' input (absent on the final segment).
    h_out: Option<Tensor<3>>,
}

/// One piece's graph.
struct Piece {
    h_in: Tensor<3>,
    u_out: Tensor<3>,
}

struct Pending {
    /// Segments `0..S` (those followed by pieces).
    segments: Vec<Segment>,
    /// Per sublayer, the local pieces' graphs.
    pieces: Vec<Vec<Piece>>,
    /// The final segment (its `x_out` is the stage output or the head's input).
    last: Segment,
    /// The stage output or the loss.
    end: PendingOutput,
}

/// A forward's graphs: the segments followed by pieces, the pieces of each sublayer, the final
/// segment.
type Graphs = (Vec<Segment>, Vec<Vec<Piece>>, Segment);

/// Which sublayer: attention or MLP of the block at slot index `slot`.
#[derive(Clone, Copy)]
enum Sub {
    Attn(usize),
    Mlp(usize),
}

/// Layers of a transformer as tensor-parallel pieces on burn's flex backend with autodiff.
pub struct TpStage {
    spec: TransformerSpec,
    layers: Range<usize>,
    split: TpSplit,
    device: Device,
    layout: TpLayout,
    /// One leaf per local tensor (vectors as `[1, n]`).
    params: Vec<Tensor<2>>,
    sum: Box<dyn PieceSum>,
    pending: KeptGraphs<Pending>,
}

impl std::fmt::Debug for TpStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpStage")
            .field("layers", &self.layers)
            .field("split", &self.split)
            .finish_non_exhaustive()
    }
}

/// Values of a tensor as `f32`s.
fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    params::f32_slice(&t.into_data()).to_vec()
}

impl TpStage {
    /// Layers `layers` of `spec` under `split`, initialised from `seed` exactly like the same
    /// slices of the whole model; `sum` adds pieces across the split's ranks.
    pub fn new(
        spec: &TransformerSpec,
        layers: Range<usize>,
        seed: u64,
        split: TpSplit,
        sum: Box<dyn PieceSum>,
    ) -> Result<TpStage, E> {
        spec.validate()?;
        let split = TpSplit::new(spec, split.pieces, split.tp, split.tp_rank)?;
        check_stage_layers(spec, &layers)?;
        let layout = TpLayout::new(spec, layers.clone(), split);
        let initial = crate::tensor_parallel::gather_map(
            &spec.initial_params(layers.clone(), seed),
            &layout.index_map(),
        );
        let mut stage = TpStage {
            spec: spec.clone(),
            layers,
            split,
            device: Device::flex().autodiff(),
            layout,
            params: Vec::new(),
            sum,
            pending: KeptGraphs::new(),
        };
        stage.set_params_flat(&initial)?;
        Ok(stage)
    }

    pub fn layout(&self) -> &TpLayout {
        &self.layout
    }

    fn vec1(&self, i: usize) -> Tensor<1> {
        let n = self.layout.tensors[i].len();
        self.params[i].clone().reshape([n])
    }
    fn mat(&self, i: usize) -> Tensor<2> {
        self.params[i].clone()
    }

    fn sublayers(&self) -> Vec<Sub> {
        let mut out = Vec::new();
        for (i, s) in self.layout.slots.iter().enumerate() {
            if matches!(s, LayerSlots::Block { .. }) {
                out.extend([Sub::Attn(i), Sub::Mlp(i)]);
            }
        }
        out
    }

    fn block(&self, slot: usize) -> &LayerSlots {
        &self.layout.slots[slot]
    }

    /// The layer norm in front of a sublayer.
    fn norm(&self, sub: Sub, x: Tensor<3>) -> Tensor<3> {
        let (Sub::Attn(s) | Sub::Mlp(s)) = sub;
        let LayerSlots::Block { ln1, ln2, .. } = self.block(s) else {
            unreachable!("sublayers are blocks")
        };
        let [g, b] = if matches!(sub, Sub::Attn(_)) {
            *ln1
        } else {
            *ln2
        };
        layer_norm(x, self.vec1(g), self.vec1(b))
    }

    /// The replicated bias added after a sublayer's piece sum (row-parallel output's bias).
    fn out_bias(&self, sub: Sub) -> Tensor<1> {
        let (Sub::Attn(s) | Sub::Mlp(s)) = sub;
        let LayerSlots::Block { proj_b, fc2_b, .. } = self.block(s) else {
            unreachable!("sublayers are blocks")
        };
        self.vec1(if matches!(sub, Sub::Attn(_)) {
            *proj_b
        } else {
            *fc2_b
        })
    }

    /// Local piece `k`'s partial output of a sublayer: `[n, t, d]`, without bias.
    fn piece(&self, sub: Sub, k: usize, h: Tensor<3>) -> Tensor<3> {
        let (Sub::Attn(s) | Sub::Mlp(s)) = sub;
        let LayerSlots::Block { attn, mlp, .. } = self.block(s) else {
            unreachable!("sublayers are blocks")
        };
        let [n, t, _] = h.dims();
        let (d, p) = (self.spec.d_model, self.spec.products);
        let rows = |x: Tensor<3>| {
            let [_, _, w] = x.dims();
            x.reshape([n * t, w])
        };
        match sub {
            Sub::Attn(_) => {
                let [w, b, proj] = attn[k];
                let heads = self.spec.heads / self.split.pieces;
                let qkv = p.operand(linear3(h, self.mat(w), self.vec1(b), p));
                let a = p.operand(rows(attend(qkv, heads)));
                a.matmul(p.operand(self.mat(proj))).reshape([n, t, d])
            }
            Sub::Mlp(_) => {
                let [w1, b1, w2] = mlp[k];
                let a = p.operand(rows(gelu(linear3(h, self.mat(w1), self.vec1(b1), p))));
                a.matmul(p.operand(self.mat(w2))).reshape([n, t, d])
            }
        }
    }

    fn exact_sum(&mut self, parts: &[Vec<f32>], what: &str) -> Result<Vec<f32>, E> {
        let refs: Vec<&[f32]> = parts.iter().map(|p| p.as_slice()).collect();
        let mut out = vec![0f32; parts[0].len()];
        self.sum
            .sum_pieces(&refs, self.split.pieces, &mut out)
            .map_err(|message| E::PieceSum {
                what: what.to_string(),
                message,
            })?;
        Ok(out)
    }

    fn leaf(&self, v: Vec<f32>, dims: [usize; 3], grad: bool) -> Tensor<3> {
        let t = Tensor::<3>::from_data(TensorData::new(v, dims), &self.device);
        if grad {
            t.require_grad()
        } else {
            t
        }
    }

    /// The forward of every graph; `training` makes the cut points leaves that require grads.
    fn run(&mut self, input: StageInput<'_>, n: usize, training: bool) -> Result<Graphs, E> {
        let (input_leaf, mut x) = input_tensor(
            &self.spec,
            self.is_first(),
            input,
            n,
            training,
            &self.device,
            |tok| match self.layout.slots[0] {
                LayerSlots::Embedding { tok: a, pos } => {
                    embed_tokens(self.mat(a), self.mat(pos), tok)
                }
                _ => unreachable!("the first stage starts with the embedding"),
            },
        )?;
        let dims = x.dims();
        let (mut x_in, mut u_in) = (input_leaf, None);
        let mut segments = Vec::new();
        let mut pieces = Vec::new();
        for sub in self.sublayers() {
            let h = self.norm(sub, x.clone());
            let h_values = values(h.clone());
            let mut graphs = Vec::new();
            let mut outs = Vec::new();
            for k in 0..self.split.local().len() {
                let h_in = self.leaf(h_values.clone(), dims, training);
                let u = self.piece(sub, k, h_in.clone());
                outs.push(values(u.clone()));
                if training {
                    graphs.push(Piece { h_in, u_out: u });
                }
            }
            let u = self.exact_sum(&outs, "a row-parallel output")?;
            segments.push(Segment {
                x_in: x_in.take(),
                u_in: u_in.take(),
                x_out: x.clone(),
                h_out: Some(h),
            });
            pieces.push(graphs);
            let xl = self.leaf(values(x), dims, training);
            let ul = self.leaf(u, dims, training);
            x = xl.clone() + ul.clone() + self.out_bias(sub).unsqueeze();
            (x_in, u_in) = (Some(xl), Some(ul));
        }
        let last = Segment {
            x_in,
            u_in,
            x_out: x,
            h_out: None,
        };
        Ok((segments, pieces, last))
    }

    fn logits(&self, x: Tensor<3>) -> Tensor<2> {
        let Some(LayerSlots::Head { ln, out_w, out_b }) = self.layout.slots.last() else {
            unreachable!("logits on a stage without the head")
        };
        head_logits(
            x,
            self.vec1(ln[0]),
            self.vec1(ln[1]),
            self.mat(*out_w),
            self.vec1(*out_b),
            self.spec.products,
        )
    }

    /// Copy the gradients of every local parameter in `grads` into `out`.
    fn take_param_grads(&self, grads: &mut burn::tensor::Gradients, out: &mut [f32]) {
        for (p, t) in self.params.iter().zip(&self.layout.tensors) {
            if let Some(g) = p.grad_remove(grads) {
                out[t.offset..t.offset + t.len()]
                    .copy_from_slice(params::f32_slice(&g.into_data()));
            }
        }
    }

    fn grad_of(t: &Option<Tensor<3>>, grads: &mut burn::tensor::Gradients) -> Option<Vec<f32>> {
        t.as_ref().map(|leaf| {
            leaf.grad_remove(grads)
                .map(|g| params::f32_slice(&g.into_data()).to_vec())
                .unwrap_or_else(|| vec![0.0; leaf.dims().iter().product()])
        })
    }

    /// The evaluation forward on burn's plain backend, from input to output (the head
    /// included): the parameters moved off autodiff (same storage) and every leaf made on the
    /// inner device. Detached copies on the autodiff device are not enough, and neither is a
    /// head computed from the tracked parameters: either keeps operations that no backward
    /// ever frees, so resident memory would grow with every validation chunk (on the 22 M-parameter
    /// config at tp = 2, to many times the model state over one validation pass).
    fn eval_forward(&mut self, input: StageInput<'_>, n: usize) -> Result<EvalForward, E> {
        let plain = self.params.iter().map(|p| p.clone().inner()).collect();
        let tracked = std::mem::replace(&mut self.params, plain);
        let inner = self.device.clone().without_autodiff();
        let autodiff = std::mem::replace(&mut self.device, inner);
        let ran = self.run(input, n, false).map(|(_, _, last)| {
            if self.is_last() {
                EvalForward::Logits(self.logits(last.x_out))
            } else {
                EvalForward::Activations(last.x_out)
            }
        });
        self.params = tracked;
        self.device = autodiff;
        ran
    }
}

impl StageContract for TpStage {
    fn spec(&self) -> &TransformerSpec {
        &self.spec
    }
    fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }
    fn num_params(&self) -> usize {
        self.layout.num_params()
    }
    /// Micro-batches whose graphs are held.
    fn held(&self) -> usize {
        self.pending.len()
    }

    fn params_flat(&self) -> Vec<f32> {
        assert!(
            self.params.len() == self.layout.tensors.len(),
            "the stage's parameters were released"
        );
        self.params.iter().flat_map(|p| values(p.clone())).collect()
    }

    /// Drop the local parameters (ZeRO 3 between steps: the training loop keeps its chunks);
    /// [`StageContract::set_params_flat`] brings them back. Refused while graphs are pending.
    fn release_params(&mut self) {
        self.pending.assert_none_for("released");
        self.params = Vec::new();
    }

    /// Replace the local parameters. Refused while graphs are pending.
    fn set_params_flat(&mut self, p: &[f32]) -> Result<(), E> {
        if p.len() != self.num_params() {
            return Err(E::ParamLength {
                what: "tensor-parallel stage set_params_flat",
                expected: self.num_params(),
                got: p.len(),
            });
        }
        self.pending.assert_none_for("replaced");
        self.params = self
            .layout
            .tensors
            .iter()
            .map(|t| {
                let data =
                    TensorData::new(p[t.offset..t.offset + t.len()].to_vec(), [t.rows, t.cols]);
                Tensor::<2>::from_data(data, &self.device).require_grad()
            })
            .collect();
        Ok(())
    }
    fn forward(
        &mut self,
        id: u64,
        input: StageInput<'_>,
        n: usize,
        targets: Option<&[i64]>,
        scale: f32,
    ) -> Result<StageOutput, E> {
        self.pending.check_free(id)?;
        let targets = if self.is_last() {
            Some(check_targets(&self.spec, targets, n)?.to_vec())
        } else {
            None
        };
        let (segments, pieces, last) = self.run(input, n, true)?;
        let x_out = last.x_out.clone();
        let (end, out) = end_forward(
            x_out,
            targets.as_deref(),
            |x| self.logits(x),
            scale,
            n,
            &self.device,
        )?;
        self.pending.keep(
            id,
            Pending {
                segments,
                pieces,
                last,
                end,
            },
        );
        Ok(out)
    }
    fn backward(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        grad_params: &mut [f32],
    ) -> Result<Option<Vec<f32>>, E> {
        let what = "tensor-parallel stage grad_params";
        check_grad_len(what, self.num_params(), grad_params.len())?;
        let Pending {
            segments,
            mut pieces,
            last,
            end,
        } = self.pending.take(id)?;
        let dims = last.x_out.dims();
        grad_params.fill(0.0);
        let mut grads = start_backward(end, grad_output, &self.device)?;
        self.take_param_grads(&mut grads, grad_params);
        let mut dx = Self::grad_of(&last.x_in, &mut grads);
        let mut du = Self::grad_of(&last.u_in, &mut grads);
        for (seg, graphs) in segments.into_iter().zip(pieces.drain(..)).rev() {
            // g's backward: every piece gets the output gradient; f's: their input gradients
            // summed exactly.
            let du_t = self.leaf(
                du.take().expect("a piece sum feeds the next segment"),
                dims,
                false,
            );
            let mut dh = Vec::with_capacity(graphs.len());
            for p in graphs {
                let mut g = (p.u_out * du_t.clone()).sum().backward();
                self.take_param_grads(&mut g, grad_params);
                dh.push(Self::grad_of(&Some(p.h_in), &mut g).expect("piece input"));
            }
            let dh = self.exact_sum(&dh, "a column-parallel input gradient")?;
            let dx_t = self.leaf(
                dx.take().expect("the residual feeds the next segment"),
                dims,
                false,
            );
            let h_out = seg.h_out.expect("a segment followed by pieces");
            let mut g =
                ((seg.x_out * dx_t).sum() + (h_out * self.leaf(dh, dims, false)).sum()).backward();
            self.take_param_grads(&mut g, grad_params);
            dx = Self::grad_of(&seg.x_in, &mut g);
            du = Self::grad_of(&seg.u_in, &mut g);
        }
        Ok(dx)
    }

    fn evaluate(
        &mut self,
        input: StageInput<'_>,
        n: usize,
        targets: Option<&[i64]>,
    ) -> Result<StageEval, E> {
        let targets = if self.is_last() {
            Some(check_targets(&self.spec, targets, n)?)
        } else {
            None
        };
        Ok(self
            .eval_forward(input, n)?
            .read_out(targets, self.spec.vocab))
    }
    fn index_map(&self) -> Vec<Range<usize>> {
        self.layout.index_map()
    }
    fn grad_buckets(&self, bucket_elems: usize) -> Option<Vec<Range<usize>>> {
        Some(self.layout.grad_buckets(bucket_elems))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::chain::{self, batch};
    use crate::tensor_parallel::{scatter_map, LocalPieceSum};
    use crate::Stage;

    fn spec() -> TransformerSpec {
        chain::small_spec(4, 2)
    }

    /// `cuts` as a chain of stages of `pieces` on one rank, one micro-batch: the loss and the
    /// whole model's gradient in canonical order.
    fn run(pieces: usize, cuts: &[usize], s: &TransformerSpec) -> (f32, Vec<f32>) {
        let (loss, grads, stages) = chain::run(cuts, s, |layers| {
            let split = TpSplit::whole(pieces);
            TpStage::new(s, layers, 3, split, Box::new(LocalPieceSum)).unwrap()
        });
        let mut whole = Vec::new();
        for (st, g) in stages.iter().zip(&grads) {
            let mut stage = vec![0f32; g.len()];
            scatter_map(g, &st.layout().index_map(), &mut stage);
            whole.extend(stage);
        }
        (loss, whole)
    }

    #[test]
    fn pieces_compute_the_whole_layer_up_to_rounding() {
        let s = spec();
        let mut plain = Stage::new(&s, 0..s.num_layers(), 3).unwrap();
        let (x, y) = batch(2, &s);
        let StageOutput::Loss(loss) = plain
            .forward(9, StageInput::Tokens(&x), 2, Some(&y), 0.25)
            .unwrap()
        else {
            panic!("loss")
        };
        let mut grad = vec![0f32; plain.num_params()];
        plain.backward(9, None, &mut grad).unwrap();
        let scale = grad.iter().fold(0f32, |m, g| m.max(g.abs()));
        for pieces in [1, 2, 4] {
            let (l, g) = run(pieces, &[], &s);
            assert!(
                (l - loss).abs() <= 1e-5 * loss.abs(),
                "{pieces}: {l} vs {loss}"
            );
            for (i, (a, b)) in g.iter().zip(&grad).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * scale,
                    "{pieces} pieces, element {i}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn evaluation_records_no_autodiff_graph() {
        let s = spec();
        let (x, _) = batch(2, &s);
        let acts = vec![0.1f32; s.activation_len(2)];
        for layers in [0..1, 1..3, 3..s.num_layers(), 0..s.num_layers()] {
            let sum = Box::new(LocalPieceSum);
            let mut st = TpStage::new(&s, layers.clone(), 3, TpSplit::whole(4), sum).unwrap();
            let input = if st.is_first() {
                StageInput::Tokens(&x)
            } else {
                StageInput::Activations(&acts)
            };
            // From input to output (the head included) on the plain backend…
            let out = st.eval_forward(input, 2).unwrap();
            assert!(
                !out.is_autodiff(),
                "evaluation of layers {layers:?} is tracked"
            );
            // …and training still on autodiff afterwards.
            assert!(st
                .params
                .iter()
                .all(|p| p.is_autodiff() && p.is_require_grad()));
            assert_eq!(st.held(), 0);
        }
    }

    #[test]
    fn cut_piece_stages_give_the_uncut_bits() {
        let s = spec();
        chain::assert_cuts_agree(|cuts| run(4, cuts, &s), &[&[1], &[2], &[3], &[1, 2, 3]]);
    }

    #[test]
    fn evaluation_scores_the_whole_layer_and_misuse_is_refused() {
        let s = spec();
        let (x, y) = batch(3, &s);
        let mut plain = Stage::new(&s, 0..s.num_layers(), 3).unwrap();
        let want = plain.evaluate(StageInput::Tokens(&x), 3, Some(&y)).unwrap();
        let split = TpSplit::whole(4);
        let sum = Box::new(LocalPieceSum);
        let mut st = TpStage::new(&s, 0..s.num_layers(), 3, split, sum).unwrap();
        let got = st.evaluate(StageInput::Tokens(&x), 3, Some(&y)).unwrap();
        let (
            StageEval::Scores {
                loss_sum: a,
                correct: ca,
            },
            StageEval::Scores {
                loss_sum: b,
                correct: cb,
            },
        ) = (got, want)
        else {
            panic!("the head scores")
        };
        assert!((a - b).abs() < 1e-5 * b && ca == cb, "{a} {ca} vs {b} {cb}");
        // A second forward of a pending id, a backward without its forward, a bad split.
        chain::assert_misuse_refused(&mut st, &x, &y, 3);
        let bad = TpStage::new(&s, 0..2, 3, TpSplit::whole(3), Box::new(LocalPieceSum));
        assert!(bad.unwrap_err().to_string().contains("tp_pieces = 3"));
    }
}
