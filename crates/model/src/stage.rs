//! [`Stage`]: a contiguous range of the transformer's layers behind a flat-parameter interface,
//! with forward and backward split apart so that a pipeline can run them at different times.
//!
//! A forward keeps its autodiff graph under the caller's micro-batch id until the matching
//! backward. Between stages only plain `f32` vectors travel: the input activations are rebuilt as
//! a fresh leaf that requires a gradient, and the backward of a non-last stage starts from
//! `sum(output · grad_output)`, whose gradient with respect to `output` is exactly
//! `grad_output`. So the parameter gradients of a cut model are bitwise those of the uncut one
//! (measured in this crate's tests), which is what lets pipeline layouts reproduce the
//! single-stage run.

use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Device, Gradients, Int, Tensor, TensorData};

use crate::loss;
use crate::params::{self, ParamInfo};
use crate::transformer::{LayerKind, StageNet, TransformerSpec};
use crate::ModelError as E;

/// What a stage consumes.
#[derive(Debug, Clone, Copy)]
pub enum StageInput<'a> {
    /// Token ids `[n, context]` (the first stage).
    Tokens(&'a [i64]),
    /// The previous stage's output `[n, context, d_model]`.
    Activations(&'a [f32]),
}

/// What a training forward produced.
#[derive(Debug, Clone, PartialEq)]
pub enum StageOutput {
    /// To be sent to the next stage.
    Activations(Vec<f32>),
    /// The scaled loss of the micro-batch (the last stage).
    Loss(f32),
}

/// What an evaluation forward produced.
#[derive(Debug, Clone, PartialEq)]
pub enum StageEval {
    Activations(Vec<f32>),
    /// Sum of per-character cross-entropy (f64) and the number of correct next-character guesses.
    Scores {
        loss_sum: f64,
        correct: usize,
    },
}

/// Where a stage that holds none of its parameters between layers takes each layer's from, just
/// before the layer runs (ZeRO 3 per layer: an all-gather of the layer's chunks over the
/// data-parallel group). A failure's message is the stage's error; the caller keeps the cause.
pub trait LayerSource {
    /// The whole parameters of the stage's layer `k` (stage-relative), as its slice of the
    /// stage's flat vector.
    fn layer(&mut self, k: usize) -> Result<Vec<f32>, String>;
}

/// `layers` must be a non-empty range of `spec`'s layers (every stage's constructor).
pub(crate) fn check_stage_layers(spec: &TransformerSpec, layers: &Range<usize>) -> Result<(), E> {
    if layers.is_empty() || layers.end > spec.num_layers() {
        return Err(E::InvalidSpec(format!(
            "stage layers {layers:?} must be a non-empty range within 0..{}",
            spec.num_layers()
        )));
    }
    Ok(())
}

/// One autodiff graph kept from forward to backward: the whole stage, or (a streamed forward)
/// one of its layers.
struct Graph {
    /// The input leaf: the stage's (non-first stages) or the cut before this layer; its gradient
    /// goes back to the previous stage or graph.
    input: Option<Tensor<3>>,
    /// Activations out (to the next stage or graph) or the loss (the last stage's last graph).
    output: PendingOutput,
    /// The stage's layers it computes (indices within the stage).
    layers: Range<usize>,
}

/// What a training forward keeps until its micro-batch's backward.
enum Pending {
    /// Its graphs, in forward order: one for the stage, or one per layer (streamed).
    Graphs(Vec<Graph>),
    /// Only each layer's input (`train.recompute = "layers"`): the backward runs each layer's
    /// forward again, last layer first.
    Inputs(KeptInputs),
}

/// A recomputed micro-batch's inputs: the stage's, then each later layer's values.
struct KeptInputs {
    first: KeptInput,
    /// Layer `k`'s input (`[n, context, d_model]`) at index `k − 1`.
    later: Vec<Vec<f32>>,
    n: usize,
    targets: Option<Vec<i64>>,
    scale: f32,
}

enum KeptInput {
    Tokens(Vec<i64>),
    Activations(Vec<f32>),
}

impl KeptInput {
    fn of(input: StageInput<'_>) -> KeptInput {
        match input {
            StageInput::Tokens(t) => KeptInput::Tokens(t.to_vec()),
            StageInput::Activations(a) => KeptInput::Activations(a.to_vec()),
        }
    }

    fn as_input(&self) -> StageInput<'_> {
        match self {
            KeptInput::Tokens(t) => StageInput::Tokens(t),
            KeptInput::Activations(a) => StageInput::Activations(a),
        }
    }
}

pub(crate) enum PendingOutput {
    Activations(Tensor<3>),
    Loss(Tensor<1>),
}

/// The last stage's loss `scale · Σ cross-entropy` of `logits` against `targets` (`n`
/// sequences), refused when not finite.
pub(crate) fn scaled_loss(
    logits: Tensor<2>,
    targets: &[i64],
    scale: f32,
    n: usize,
    device: &Device,
) -> Result<(PendingOutput, StageOutput), E> {
    let loss = loss::scaled_cross_entropy_ids(logits, targets.to_vec(), scale, device);
    let value = params::f32_slice(&loss.to_data())[0];
    if !value.is_finite() {
        return Err(E::NonFiniteLoss { loss: value, n });
    }
    Ok((PendingOutput::Loss(loss), StageOutput::Loss(value)))
}

/// Backward from a stage's output: the loss itself (last stage), or `sum(output · grad_output)`,
/// whose gradient with respect to the output is exactly `grad_output`.
pub(crate) fn start_backward(
    output: PendingOutput,
    grad_output: Option<&[f32]>,
    device: &Device,
) -> Result<Gradients, E> {
    match (output, grad_output) {
        (PendingOutput::Loss(loss), None) => Ok(loss.backward()),
        (PendingOutput::Activations(out), Some(g)) => {
            let dims = out.dims();
            if g.len() != dims.iter().product::<usize>() {
                return Err(E::InputLength {
                    n: dims[0],
                    per_sample: dims[1] * dims[2],
                    expected: dims.iter().product(),
                    got: g.len(),
                });
            }
            let g = Tensor::<3>::from_data(TensorData::new(g.to_vec(), dims), device);
            Ok((out * g).sum().backward())
        }
        (PendingOutput::Loss(_), Some(_)) => Err(E::InvalidSpec(
            "the last stage's backward takes no output gradient".into(),
        )),
        (PendingOutput::Activations(_), None) => Err(E::InvalidSpec(
            "a non-last stage's backward needs the next stage's input gradient".into(),
        )),
    }
}

/// Forward graphs kept until their micro-batch's backward, by micro-batch id: what a [`Stage`]
/// holds between the two passes.
pub(crate) struct KeptGraphs<P>(HashMap<u64, P>);

impl<P> KeptGraphs<P> {
    pub(crate) fn new() -> Self {
        KeptGraphs(HashMap::new())
    }

    /// How many micro-batches' graphs are kept.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Refused unless no graphs are kept: `what` (replacing or releasing the parameters) would
    /// leave the kept graphs referencing the old ones.
    pub(crate) fn assert_none_for(&self, what: &str) {
        assert!(
            self.0.is_empty(),
            "parameters {what} with {} forward graphs pending",
            self.0.len()
        );
    }

    /// Refuses a second forward of micro-batch `id` before its backward.
    pub(crate) fn check_free(&self, id: u64) -> Result<(), E> {
        if self.0.contains_key(&id) {
            return Err(E::InvalidSpec(format!(
                "micro-batch {id} already has a pending forward on this stage"
            )));
        }
        Ok(())
    }

    pub(crate) fn keep(&mut self, id: u64, graph: P) {
        self.0.insert(id, graph);
    }

    /// The graph of micro-batch `id`'s forward, taken for its backward.
    pub(crate) fn take(&mut self, id: u64) -> Result<P, E> {
        self.0.remove(&id).ok_or_else(|| {
            E::InvalidSpec(format!("backward of micro-batch {id} without its forward"))
        })
    }
}

/// A backward's parameter-gradient buffer must have the stage's `expected` length.
pub(crate) fn check_grad_len(what: &'static str, expected: usize, got: usize) -> Result<(), E> {
    if got != expected {
        return Err(E::ParamLength {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// The end of a training forward whose last layers produced `x`: on the last stage (`targets`
/// given) the loss of `logits(x)` scaled by `scale`, elsewhere the activations `x`.
pub(crate) fn end_forward(
    x: Tensor<3>,
    targets: Option<&[i64]>,
    logits: impl FnOnce(Tensor<3>) -> Tensor<2>,
    scale: f32,
    n: usize,
    device: &Device,
) -> Result<(PendingOutput, StageOutput), E> {
    match targets {
        Some(targets) => scaled_loss(logits(x), targets, scale, n, device),
        None => {
            let values = params::f32_slice(&x.to_data()).to_vec();
            Ok((
                PendingOutput::Activations(x),
                StageOutput::Activations(values),
            ))
        }
    }
}

/// What an evaluation forward computed, before it is read out.
pub(crate) enum EvalForward {
    Activations(Tensor<3>),
    Logits(Tensor<2>),
}

impl EvalForward {
    /// The activations' values, or the logits' loss sum and correct count against `targets`
    /// (the last stage's, already checked).
    pub(crate) fn read_out(self, targets: Option<&[i64]>, vocab: usize) -> StageEval {
        match self {
            EvalForward::Activations(x) => {
                StageEval::Activations(params::f32_slice(&x.into_data()).to_vec())
            }
            EvalForward::Logits(logits) => {
                let targets = targets.expect("the last stage's targets were checked");
                let labels: Vec<u8> = targets.iter().map(|&t| t as u8).collect();
                let (loss_sum, correct) = loss::sum_ce_and_correct(
                    params::f32_slice(&logits.into_data()),
                    &labels,
                    vocab,
                );
                StageEval::Scores { loss_sum, correct }
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn is_autodiff(&self) -> bool {
        match self {
            EvalForward::Activations(x) => x.is_autodiff(),
            EvalForward::Logits(l) => l.is_autodiff(),
        }
    }
}

/// Layers `layers` of a transformer on an autodiff device: burn's flex backend with lockstep's
/// own kernels ([`Stage::new`]), or any other burn device with the same functions composed of
/// burn's operations ([`Stage::new_on`]).
pub struct Stage {
    spec: TransformerSpec,
    layers: Range<usize>,
    device: Device,
    net: StageNet,
    layout: Vec<ParamInfo>,
    num_params: usize,
    pending: KeptGraphs<Pending>,
    /// The parameters' tensors were dropped ([`Stage::release_params`]); the next
    /// [`Stage::set_params_flat`] builds them again.
    released: bool,
    /// `train.recompute = "layers"`: a training forward keeps only each layer's input.
    recompute: bool,
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("layers", &self.layers)
            .field("num_params", &self.num_params)
            .finish_non_exhaustive()
    }
}

impl Stage {
    /// Layers `layers` of `spec`, initialised from `seed` exactly like the same slice of the
    /// whole model.
    pub fn new(spec: &TransformerSpec, layers: Range<usize>, seed: u64) -> Result<Stage, E> {
        Self::new_on(spec, layers, seed, Device::flex().autodiff())
    }

    /// [`Stage::new`] on `device` (an autodiff device). The initial values are the same on every
    /// device (lockstep's own generator); the computed bits are each backend's.
    pub fn new_on(
        spec: &TransformerSpec,
        layers: Range<usize>,
        seed: u64,
        device: Device,
    ) -> Result<Stage, E> {
        spec.validate()?;
        check_stage_layers(spec, &layers)?;
        let net = StageNet::zeros(spec, layers.clone(), &device);
        let layout = spec.layout(layers.clone());
        let num_params = layout.iter().map(|p| p.len).sum();
        let net = params::write(net, &spec.initial_params(layers.clone(), seed), &device);
        Ok(Stage {
            spec: spec.clone(),
            layers,
            device,
            net,
            layout,
            num_params,
            pending: KeptGraphs::new(),
            released: false,
            recompute: false,
        })
    }

    /// With `on`, a training forward keeps only each layer's input and the backward runs each
    /// layer's forward again (`train.recompute = "layers"`): the bits of a kept graph, with one
    /// layer's graph alive at a time.
    pub fn with_recompute(mut self, on: bool) -> Stage {
        self.recompute = on;
        self
    }

    /// Global names, shapes and stage-relative offsets of this stage's parameters.
    pub fn layout(&self) -> &[ParamInfo] {
        &self.layout
    }
    /// The evaluation forward on burn's plain backend: the layers as `Module::valid` copies
    /// (no autodiff, no gradient required) on the inner device, so no operation is recorded in
    /// an autodiff graph. Recorded operations of a forward that never runs backward are what a
    /// validation pass would otherwise pile up: resident memory would grow with every
    /// validation chunk until the pass ends.
    fn eval_forward(&self, input: StageInput<'_>, n: usize) -> Result<EvalForward, E> {
        let net = self.net.valid();
        let (_, x) = self.input_tensor(&net, input, n, false)?;
        let x = net.blocks(x, &self.spec);
        Ok(if self.is_last() {
            EvalForward::Logits(net.logits(x, self.spec.products))
        } else {
            EvalForward::Activations(x)
        })
    }

    /// Seconds for forward + backward of each layer alone on a micro-batch of `n` sequences (the
    /// median of `reps` timed runs after one warm-up), from synthetic inputs: the cost a pipeline
    /// balances. Every layer is measured the way a stage runs it.
    pub fn profile_layers(spec: &TransformerSpec, n: usize, reps: usize) -> Result<Vec<f64>, E> {
        let tokens: Vec<i64> = (0..n * spec.context)
            .map(|i| (i * 7 % spec.vocab) as i64)
            .collect();
        let acts: Vec<f32> = (0..spec.activation_len(n))
            .map(|i| ((i % 13) as f32 - 6.0) * 0.1)
            .collect();
        let mut out = Vec::with_capacity(spec.num_layers());
        for l in 0..spec.num_layers() {
            let mut stage = Stage::new(spec, l..l + 1, 0)?;
            let mut grads = vec![0f32; stage.num_params()];
            let mut times = Vec::with_capacity(reps);
            for rep in 0..=reps {
                let input = if l == 0 {
                    StageInput::Tokens(&tokens)
                } else {
                    StageInput::Activations(&acts)
                };
                let targets = stage.is_last().then_some(&tokens[..]);
                let start = Instant::now();
                stage.forward(rep as u64, input, n, targets, 1.0)?;
                let g = (!stage.is_last()).then_some(&acts[..]);
                stage.backward(rep as u64, g, &mut grads)?;
                if rep > 0 {
                    times.push(start.elapsed().as_secs_f64());
                }
            }
            times.sort_by(f64::total_cmp);
            out.push(times[times.len() / 2]);
        }
        Ok(out)
    }

    /// The stage input as a tensor: token ids embedded (first stage) or activations as a fresh
    /// leaf, which requires a gradient when training (its gradient goes back a stage). When not
    /// training, everything is on the inner (non-autodiff) device and `net` is the `valid` copy.
    fn input_tensor(
        &self,
        net: &StageNet,
        input: StageInput<'_>,
        n: usize,
        training: bool,
    ) -> Result<(Option<Tensor<3>>, Tensor<3>), E> {
        let device = if training {
            self.device.clone()
        } else {
            self.device.clone().without_autodiff()
        };
        input_tensor(
            &self.spec,
            self.is_first(),
            input,
            n,
            training,
            &device,
            |t| net.embed(t),
        )
    }

    fn check_targets<'t>(&self, targets: Option<&'t [i64]>, n: usize) -> Result<&'t [i64], E> {
        check_targets(&self.spec, targets, n)
    }

    /// The checks every training forward of micro-batch `id` starts with: `id` is not in flight,
    /// and the last stage has `n` sequences' targets. Returns the targets (on the last stage).
    fn begin_forward<'t>(
        &self,
        id: u64,
        targets: Option<&'t [i64]>,
        n: usize,
    ) -> Result<Option<&'t [i64]>, E> {
        self.pending.check_free(id)?;
        match self.is_last() {
            true => self.check_targets(targets, n).map(Some),
            false => Ok(None),
        }
    }

    /// Each of the stage's layers' range of its flat vector.
    fn layer_ranges(&self) -> Vec<Range<usize>> {
        let offsets = self.spec.layer_offsets();
        let base = offsets[self.layers.start];
        self.layers
            .clone()
            .map(|l| offsets[l] - base..offsets[l + 1] - base)
            .collect()
    }

    /// A training forward kept as one graph, or with `cut` as one graph per layer: each
    /// layer's output values enter the next layer as a fresh leaf, exactly as between pipeline
    /// stages, so the backward's bits are the same either way.
    fn forward_graphs(
        &mut self,
        id: u64,
        input: StageInput<'_>,
        n: usize,
        targets: Option<&[i64]>,
        scale: f32,
        cut: bool,
    ) -> Result<StageOutput, E> {
        let targets = self.begin_forward(id, targets, n)?;
        let (mut leaf, mut x) = self.input_tensor(&self.net, input, n, true)?;
        let count = self.layers.len();
        let (mut graphs, mut from) = (Vec::new(), 0);
        for k in 0..count {
            x = self.run_layer(&self.net, k, x);
            if cut && k + 1 < count {
                let (values, dims) = (params::f32_slice(&x.to_data()).to_vec(), x.dims());
                graphs.push(Graph {
                    input: leaf.take(),
                    output: PendingOutput::Activations(x),
                    layers: from..k + 1,
                });
                let next = Tensor::<3>::from_data(TensorData::new(values, dims), &self.device)
                    .require_grad();
                (leaf, x, from) = (Some(next.clone()), next, k + 1);
            }
        }
        let (output, result) = self.end_forward(&self.net, x, targets, scale, n)?;
        graphs.push(Graph {
            input: leaf,
            output,
            layers: from..count,
        });
        self.pending.keep(id, Pending::Graphs(graphs));
        Ok(result)
    }

    /// The backward of micro-batch `id`'s graphs, the last first (a recomputed micro-batch's
    /// built again one layer at a time): each graph's parameter gradients go to
    /// `take(net, its layers, gradients)`, its input gradient to the graph before it; returns
    /// the stage's input gradient (`None` on the first stage).
    fn backward_graphs(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        mut source: Option<&mut dyn LayerSource>,
        mut take: impl FnMut(&StageNet, Range<usize>, Gradients),
    ) -> Result<Option<Vec<f32>>, E> {
        let mut grad = grad_output.map(<[f32]>::to_vec);
        match self.pending.take(id)? {
            Pending::Graphs(_) if source.is_some() => {
                return Err(E::InvalidSpec(format!(
                    "micro-batch {id}'s forward kept its graphs: its backward needs the stage's \
                     parameters"
                )))
            }
            Pending::Graphs(graphs) => {
                for graph in graphs.into_iter().rev() {
                    grad = self.backward_graph(graph, grad, &mut take)?;
                }
            }
            Pending::Inputs(kept) => {
                for (k, range) in self.layer_ranges().into_iter().enumerate().rev() {
                    if let Some(source) = source.as_deref_mut() {
                        self.fetch_layer(k, range, source)?;
                    }
                    let graph = self.recompute_layer(&kept, k)?;
                    grad = self.backward_graph(graph, grad, &mut take)?;
                    if source.is_some() {
                        self.drop_layer(k);
                    }
                }
            }
        }
        Ok(grad)
    }

    /// [`Stage::backward`], each layer's parameters taken from `source` when given
    /// ([`Stage::backward_from`]).
    fn backward_into(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        grad_params: &mut [f32],
        source: Option<&mut dyn LayerSource>,
    ) -> Result<Option<Vec<f32>>, E> {
        check_grad_len("stage grad_params", self.num_params, grad_params.len())?;
        let ranges = self.layer_ranges();
        self.backward_graphs(id, grad_output, source, |net, layers, grads| {
            let part = ranges[layers.start].start..ranges[layers.end - 1].end;
            read_graph_grads(net, layers, grads, &mut grad_params[part]);
        })
    }

    /// One graph's backward from `grad` (its output's gradient; `None` for the loss).
    fn backward_graph(
        &self,
        graph: Graph,
        grad: Option<Vec<f32>>,
        take: &mut impl FnMut(&StageNet, Range<usize>, Gradients),
    ) -> Result<Option<Vec<f32>>, E> {
        let grads = start_backward(graph.output, grad.as_deref(), &self.device)?;
        let input_grad = graph.input.map(|leaf| {
            leaf.grad(&grads)
                .map(|g| params::f32_slice(&g.into_data()).to_vec())
                .unwrap_or_else(|| vec![0.0; leaf.dims().iter().product()])
        });
        take(&self.net, graph.layers, grads);
        Ok(input_grad)
    }

    /// The stage's layer `k` of `net` on `x`: a block runs, the embedding and the head pass `x`
    /// through (the embedding is the input's, [`Self::input_tensor`]; the head the loss's,
    /// [`Self::end_forward`]). Every training forward (kept, cut, recomputed) runs layers here.
    fn run_layer(&self, net: &StageNet, k: usize, x: Tensor<3>) -> Tensor<3> {
        match self.spec.layer_kind(self.layers.start + k) {
            LayerKind::Block(_) => {
                net.block(k - usize::from(self.layers.start == 0), x, &self.spec)
            }
            LayerKind::Embedding | LayerKind::Head => x,
        }
    }

    /// The stage's output after its last layer: activations, or (last stage) the scaled loss
    /// of `net`'s logits.
    fn end_forward(
        &self,
        net: &StageNet,
        x: Tensor<3>,
        targets: Option<&[i64]>,
        scale: f32,
        n: usize,
    ) -> Result<(PendingOutput, StageOutput), E> {
        let products = self.spec.products;
        end_forward(
            x,
            targets,
            |x| net.logits(x, products),
            scale,
            n,
            &self.device,
        )
    }

    /// Layer `k`'s parameters written from `source` (the stage's parameters released).
    fn fetch_layer(
        &mut self,
        k: usize,
        range: Range<usize>,
        source: &mut dyn LayerSource,
    ) -> Result<(), E> {
        let values = source
            .layer(k)
            .map_err(|message| E::LayerFetch { layer: k, message })?;
        check_grad_len("a fetched layer's parameters", range.len(), values.len())?;
        let layout = params::layout_within(&self.layout, &range);
        let net = std::mem::replace(&mut self.net, StageNet::empty());
        self.net = net.with_layer(k, Some(&values), &layout, &self.device);
        Ok(())
    }

    /// Layer `k`'s parameters released again (empty tensors).
    fn drop_layer(&mut self, k: usize) {
        let net = std::mem::replace(&mut self.net, StageNet::empty());
        self.net = net.with_layer(k, None, &[], &self.device);
    }

    /// [`Stage::forward_from`]'s and [`Stage::backward_from`]'s condition.
    fn check_fetching(&self) -> Result<(), E> {
        match self.recompute && self.released {
            true => Ok(()),
            false => Err(E::InvalidSpec(
                "a stage takes its layers one at a time only when it recomputes them and holds \
                 no parameters (released)"
                    .into(),
            )),
        }
    }

    /// A training forward that keeps only each layer's input: the layers run with parameters
    /// that track no gradient, so autodiff records nothing and nothing is kept alive. With a
    /// `source`, each layer's parameters are taken from it just before the layer runs and
    /// released after ([`Stage::forward_from`]).
    fn forward_recomputed(
        &mut self,
        id: u64,
        input: StageInput<'_>,
        n: usize,
        targets: Option<&[i64]>,
        scale: f32,
        mut source: Option<&mut dyn LayerSource>,
    ) -> Result<StageOutput, E> {
        let targets = self.begin_forward(id, targets, n)?;
        let (ranges, first) = (self.layer_ranges(), self.is_first());
        let mut later = Vec::with_capacity(ranges.len().saturating_sub(1));
        let (mut x, mut result): (Option<Tensor<3>>, _) = (None, None);
        for (k, range) in ranges.iter().enumerate() {
            if let Some(source) = source.as_deref_mut() {
                self.fetch_layer(k, range.clone(), source)?;
            }
            let frozen = self.net.clone().no_grad();
            let h = match x.take() {
                None => {
                    input_tensor(&self.spec, first, input, n, false, &self.device, |t| {
                        frozen.embed(t)
                    })?
                    .1
                }
                Some(h) => {
                    later.push(params::f32_slice(&h.to_data()).to_vec());
                    h
                }
            };
            let h = self.run_layer(&frozen, k, h);
            match k + 1 == ranges.len() {
                true => result = Some(self.end_forward(&frozen, h, targets, scale, n)?.1),
                false => x = Some(h),
            }
            drop(frozen);
            if source.is_some() {
                self.drop_layer(k);
            }
        }
        let kept = KeptInputs {
            first: KeptInput::of(input),
            later,
            n,
            targets: targets.map(<[i64]>::to_vec),
            scale,
        };
        self.pending.keep(id, Pending::Inputs(kept));
        Ok(result.expect("a stage has at least one layer"))
    }

    /// Layer `k`'s graph of a recomputed micro-batch, from its kept input: the graph a
    /// streamed forward cuts there (so its backward gives that forward's bits).
    fn recompute_layer(&self, kept: &KeptInputs, k: usize) -> Result<Graph, E> {
        let (input, mut x) = if k == 0 {
            self.input_tensor(&self.net, kept.first.as_input(), kept.n, true)?
        } else {
            let dims = [kept.n, self.spec.context, self.spec.d_model];
            let values = TensorData::new(kept.later[k - 1].clone(), dims);
            let leaf = Tensor::<3>::from_data(values, &self.device).require_grad();
            (Some(leaf.clone()), leaf)
        };
        x = self.run_layer(&self.net, k, x);
        let output = if k + 1 == self.layers.len() {
            let targets = kept.targets.as_deref();
            self.end_forward(&self.net, x, targets, kept.scale, kept.n)?
                .0
        } else {
            PendingOutput::Activations(x)
        };
        Ok(Graph {
            input,
            output,
            layers: k..k + 1,
        })
    }
}

/// The stage's contract with the training crate: forward and backward split apart, each
/// forward's graph kept under its micro-batch id until the matching backward, plain `f32`
/// activations and gradients in and out, parameters as one flat vector.
impl Stage {
    pub fn is_first(&self) -> bool {
        self.layers.start == 0
    }
    pub fn is_last(&self) -> bool {
        self.layers.end == self.spec.num_layers()
    }
    pub fn spec(&self) -> &TransformerSpec {
        &self.spec
    }
    /// The layers of the whole model this stage computes.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }
    /// Values of [`Stage::params_flat`].
    pub fn num_params(&self) -> usize {
        self.num_params
    }
    /// Micro-batches whose forward graphs are held, waiting for their backward.
    pub fn held(&self) -> usize {
        self.pending.len()
    }

    /// The parameters this stage holds, flat. Panics after [`Stage::release_params`].
    pub fn params_flat(&self) -> Vec<f32> {
        assert!(!self.released, "the stage's parameters were released");
        params::read(&self.net, self.num_params)
    }

    pub fn set_params_flat(&mut self, p: &[f32]) -> Result<(), E> {
        if p.len() != self.num_params {
            return Err(E::ParamLength {
                what: "stage set_params_flat",
                expected: self.num_params,
                got: p.len(),
            });
        }
        self.pending.assert_none_for("replaced");
        let net = std::mem::replace(&mut self.net, StageNet::empty());
        // Released tensors are empty: their shapes come from the layout.
        self.net = params::write_shaped(net, p, &self.device, &self.layout);
        self.released = false;
        Ok(())
    }

    /// Drop the parameters' tensors until the next [`Stage::set_params_flat`] (ZeRO 3
    /// keeps only its chunk of them between steps). Refused while graphs are pending.
    pub fn release_params(&mut self) {
        self.pending.assert_none_for("released");
        let net = std::mem::replace(&mut self.net, StageNet::empty());
        // Empty tensors in the same structure: layers can be written back one at a time.
        self.net = params::release(net, &self.device);
        self.released = true;
    }

    /// Forward of micro-batch `id` (`n` sequences), keeping its graph for
    /// [`Stage::backward`]. The last stage needs `targets` (`n · context` ids) and
    /// returns the loss `scale · Σ cross-entropy`; other stages return their output activations.
    pub fn forward(
        &mut self,
        id: u64,
        input: StageInput<'_>,
        n: usize,
        targets: Option<&[i64]>,
        scale: f32,
    ) -> Result<StageOutput, E> {
        if self.recompute {
            return self.forward_recomputed(id, input, n, targets, scale, None);
        }
        self.forward_graphs(id, input, n, targets, scale, false)
    }

    /// [`Stage::forward`] of a micro-batch whose backward will stream layer by layer
    /// ([`Stage::backward_streaming`]): a stage that can keeps each layer's graph apart
    /// (cut like pipeline stages, so the bits are the uncut ones). Default: the plain forward.
    pub fn forward_streamed(
        &mut self,
        id: u64,
        input: StageInput<'_>,
        n: usize,
        targets: Option<&[i64]>,
        scale: f32,
    ) -> Result<StageOutput, E> {
        self.forward_graphs(id, input, n, targets, scale, true)
    }

    /// Backward of micro-batch `id`: writes d(loss)/d(this stage's parameters) into
    /// `grad_params` and returns d(loss)/d(input activations) for the previous stage (`None` on
    /// the first stage). `grad_output` is the next stage's input gradient (`None` on the last).
    pub fn backward(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        grad_params: &mut [f32],
    ) -> Result<Option<Vec<f32>>, E> {
        self.backward_into(id, grad_output, grad_params, None)
    }

    /// [`Stage::backward`] of micro-batch `id` handing each layer's parameter gradient
    /// (`layers[k]`, the stage's flat range of its layer `k`) to `on_layer(k, values)` as soon as
    /// it exists, the last layer first: bitwise what `backward` writes. Default: one backward,
    /// then every layer handed out.
    pub fn backward_streaming(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        layers: &[Range<usize>],
        on_layer: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<Option<Vec<f32>>, E> {
        let ranges = self.layer_ranges();
        if layers != ranges.as_slice() {
            return Err(E::InvalidSpec(format!(
                "streamed backward: layer ranges {layers:?}, but the stage's are {ranges:?}"
            )));
        }
        self.backward_graphs(id, grad_output, None, |net, graph_layers, grads| {
            let base = ranges[graph_layers.start].start;
            let mut grad = vec![0f32; ranges[graph_layers.end - 1].end - base];
            read_graph_grads(net, graph_layers.clone(), grads, &mut grad);
            for k in graph_layers.rev() {
                let r = &ranges[k];
                on_layer(k, &grad[r.start - base..r.end - base]);
            }
        })
    }

    /// Whether the stage can run [`Stage::forward_from`] and
    /// [`Stage::backward_from`] (a stage that recomputes its layers whole).
    pub fn fetches_layers(&self) -> bool {
        self.recompute
    }

    /// [`Stage::forward`] of a recomputing stage whose parameters are released: each
    /// layer's are taken from `source` just before the layer runs and released after it, so at
    /// most one layer's parameters are held. The same bits as with the stage's parameters set.
    pub fn forward_from(
        &mut self,
        id: u64,
        input: StageInput<'_>,
        n: usize,
        targets: Option<&[i64]>,
        scale: f32,
        source: &mut dyn LayerSource,
    ) -> Result<StageOutput, E> {
        self.check_fetching()?;
        self.forward_recomputed(id, input, n, targets, scale, Some(source))
    }

    /// [`Stage::backward`] of a micro-batch that [`Stage::forward_from`] ran:
    /// each layer's parameters taken from `source` again for its recomputed forward and
    /// backward, and released after.
    pub fn backward_from(
        &mut self,
        id: u64,
        grad_output: Option<&[f32]>,
        grad_params: &mut [f32],
        source: &mut dyn LayerSource,
    ) -> Result<Option<Vec<f32>>, E> {
        self.check_fetching()?;
        self.backward_into(id, grad_output, grad_params, Some(source))
    }

    /// Forward without keeping anything, for evaluation. The last stage needs `targets`.
    pub fn evaluate(
        &mut self,
        input: StageInput<'_>,
        n: usize,
        targets: Option<&[i64]>,
    ) -> Result<StageEval, E> {
        let out = self.eval_forward(input, n)?;
        let targets = match out {
            EvalForward::Logits(_) => Some(self.check_targets(targets, n)?),
            EvalForward::Activations(_) => None,
        };
        Ok(out.read_out(targets, self.spec.vocab))
    }
}

/// The parameter gradients of one kept graph, which computes either one layer of the stage
/// (`layers`, indices within it: a cut or recomputed graph) or all of them, into `out` (those
/// layers' part of the stage's flat vector).
fn read_graph_grads(net: &StageNet, layers: Range<usize>, grads: Gradients, out: &mut [f32]) {
    if layers.len() == 1 {
        net.read_layer_grads(layers.start, grads, out);
    } else {
        params::read_grads(net, grads, out);
    }
}

/// A stage input as a tensor: token ids embedded by `embed` (first stage) or activations as a
/// fresh leaf, which requires a gradient when training (its gradient goes back a stage).
pub(crate) fn input_tensor(
    spec: &TransformerSpec,
    is_first: bool,
    input: StageInput<'_>,
    n: usize,
    training: bool,
    device: &Device,
    embed: impl FnOnce(Tensor<2, Int>) -> Tensor<3>,
) -> Result<(Option<Tensor<3>>, Tensor<3>), E> {
    let (t, d) = (spec.context, spec.d_model);
    match (input, is_first) {
        (StageInput::Tokens(ids), true) => {
            if ids.len() != n * t || n == 0 {
                return Err(E::InputLength {
                    n,
                    per_sample: t,
                    expected: n * t,
                    got: ids.len(),
                });
            }
            if let Some(&bad) = ids.iter().find(|&&i| i < 0 || i as usize >= spec.vocab) {
                return Err(E::InvalidSpec(format!(
                    "token id {bad} outside the vocabulary of {}",
                    spec.vocab
                )));
            }
            let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids.to_vec(), [n, t]), device);
            Ok((None, embed(tokens)))
        }
        (StageInput::Activations(a), false) => {
            if a.len() != n * t * d || n == 0 {
                return Err(E::InputLength {
                    n,
                    per_sample: t * d,
                    expected: n * t * d,
                    got: a.len(),
                });
            }
            let x = Tensor::<3>::from_data(TensorData::new(a.to_vec(), [n, t, d]), device);
            if training {
                let leaf = x.require_grad();
                Ok((Some(leaf.clone()), leaf))
            } else {
                Ok((None, x))
            }
        }
        (StageInput::Tokens(_), false) => Err(E::InvalidSpec(
            "token ids given to a stage without the embedding".into(),
        )),
        (StageInput::Activations(_), true) => Err(E::InvalidSpec(
            "activations given to the first stage (it embeds token ids)".into(),
        )),
    }
}

/// The last stage's targets: `n · context` ids within the vocabulary.
pub(crate) fn check_targets<'t>(
    spec: &TransformerSpec,
    targets: Option<&'t [i64]>,
    n: usize,
) -> Result<&'t [i64], E> {
    let t = targets.ok_or_else(|| E::InvalidSpec("the last stage needs targets".into()))?;
    let want = n * spec.context;
    if t.len() != want {
        return Err(E::LabelLength {
            expected: want,
            got: t.len(),
        });
    }
    if let Some(&bad) = t.iter().find(|&&i| i < 0 || i as usize >= spec.vocab) {
        return Err(E::InvalidSpec(format!(
            "target id {bad} outside the vocabulary of {}",
            spec.vocab
        )));
    }
    Ok(t)
}

/// A chain of stages through one micro-batch, for the tests of [`Stage`].
#[cfg(test)]
pub(crate) mod chain {
    use super::*;

    /// Forward of one micro-batch (id 9, scale 0.25) through `stage`.
    fn fwd(stage: &mut Stage, input: StageInput<'_>, n: usize, y: Option<&[i64]>) -> StageOutput {
        stage.forward(9, input, n, y, 0.25).unwrap()
    }

    /// Its backward: the input gradient and the parameter gradients.
    fn bwd(stage: &mut Stage, g: Option<&[f32]>) -> (Option<Vec<f32>>, Vec<f32>) {
        let mut gp = vec![0f32; stage.num_params()];
        (stage.backward(9, g, &mut gp).unwrap(), gp)
    }

    /// A small transformer for the stage tests.
    pub(crate) fn small_spec(heads: usize, blocks: usize) -> TransformerSpec {
        TransformerSpec {
            vocab: 13,
            context: 8,
            d_model: 16,
            heads,
            blocks,
            d_ff: 24,
            products: Default::default(),
        }
    }

    /// The contract's misuse, refused: a second forward of a pending id, a backward of an id
    /// with no forward (`stage` holds every layer; `x`, `y` a batch of `n`).
    pub(crate) fn assert_misuse_refused(stage: &mut Stage, x: &[i64], y: &[i64], n: usize) {
        stage
            .forward(0, StageInput::Tokens(x), n, Some(y), 1.0)
            .unwrap();
        assert!(stage
            .forward(0, StageInput::Tokens(x), n, Some(y), 1.0)
            .is_err());
        let mut g = vec![0f32; stage.num_params()];
        stage.backward(0, None, &mut g).unwrap();
        assert!(stage.backward(0, None, &mut g).is_err());
        assert_eq!(stage.held(), 0);
    }

    /// Tokens and targets of `n` sequences.
    pub(crate) fn batch(n: usize, s: &TransformerSpec) -> (Vec<i64>, Vec<i64>) {
        let x: Vec<i64> = (0..n * s.context)
            .map(|i| ((i * 5 + 3) % s.vocab) as i64)
            .collect();
        let y: Vec<i64> = (0..n * s.context)
            .map(|i| ((i * 3 + 1) % s.vocab) as i64)
            .collect();
        (x, y)
    }

    /// The stages `make` builds for the layers between `cuts`, through one micro-batch of 2
    /// sequences: the loss, each stage's parameter gradients, the stages.
    pub(crate) fn run(
        cuts: &[usize],
        s: &TransformerSpec,
        make: impl Fn(Range<usize>) -> Stage,
    ) -> (f32, Vec<Vec<f32>>, Vec<Stage>) {
        let bounds: Vec<usize> = std::iter::once(0)
            .chain(cuts.iter().copied())
            .chain(std::iter::once(s.num_layers()))
            .collect();
        let mut stages: Vec<Stage> = bounds.windows(2).map(|w| make(w[0]..w[1])).collect();
        let n = 2;
        let (x, y) = batch(n, s);
        let mut act = Vec::new();
        let mut loss = f32::NAN;
        let last = stages.len() - 1;
        for (i, st) in stages.iter_mut().enumerate() {
            let input = if i == 0 {
                StageInput::Tokens(&x)
            } else {
                StageInput::Activations(&act)
            };
            match fwd(st, input, n, (i == last).then_some(&y[..])) {
                StageOutput::Activations(a) => act = a,
                StageOutput::Loss(l) => loss = l,
            }
        }
        let mut grads: Vec<Vec<f32>> = Vec::new();
        let mut g: Option<Vec<f32>> = None;
        for st in stages.iter_mut().rev() {
            let (input_grad, gp) = bwd(st, g.as_deref());
            g = input_grad;
            grads.push(gp);
            assert_eq!(st.held(), 0);
        }
        assert!(g.is_none(), "the first stage returns no input gradient");
        grads.reverse();
        (loss, grads, stages)
    }

    /// `run(cuts)` (loss, whole-model gradient) gives the uncut bits for every one of `cuts`.
    pub(crate) fn assert_cuts_agree(run: impl Fn(&[usize]) -> (f32, Vec<f32>), cuts: &[&[usize]]) {
        let (loss, whole) = run(&[]);
        assert!(loss.is_finite() && whole.iter().any(|&g| g != 0.0));
        for cuts in cuts {
            let (l, g) = run(cuts);
            assert_eq!(l.to_bits(), loss.to_bits(), "loss with cuts {cuts:?}");
            assert!(
                g.iter()
                    .zip(&whole)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "gradients differ with cuts {cuts:?}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::chain::{self, batch};
    use super::*;

    fn spec() -> TransformerSpec {
        chain::small_spec(2, 3)
    }

    /// Run `cuts` as a chain of stages on one micro-batch; return (loss, whole-model gradient).
    fn run_cut(cuts: &[usize], s: &TransformerSpec) -> (f32, Vec<f32>) {
        let (loss, grads, _) = chain::run(cuts, s, |layers| Stage::new(s, layers, 3).unwrap());
        (loss, grads.concat())
    }

    #[test]
    fn cut_models_give_the_uncut_gradients_bit_for_bit() {
        let s = spec();
        chain::assert_cuts_agree(
            |cuts| run_cut(cuts, &s),
            &[&[1], &[2], &[4], &[1, 3], &[1, 2, 3, 4]],
        );
    }

    #[test]
    fn evaluation_matches_training_loss_and_misuse_is_refused() {
        let s = spec();
        let mut st = Stage::new(&s, 0..s.num_layers(), 3).unwrap();
        let (x, y) = batch(2, &s);
        let StageOutput::Loss(l) = st
            .forward(0, StageInput::Tokens(&x), 2, Some(&y), 1.0)
            .unwrap()
        else {
            panic!("last stage returns a loss")
        };
        let StageEval::Scores { loss_sum, .. } =
            st.evaluate(StageInput::Tokens(&x), 2, Some(&y)).unwrap()
        else {
            panic!("scores")
        };
        assert!(
            (loss_sum - l as f64).abs() < 1e-3 * loss_sum,
            "{loss_sum} vs {l}"
        );
        // Initial loss near ln(vocab) per character (unit-variance logits add about ½ nat).
        let per_char = loss_sum / (2 * s.context) as f64;
        assert!((per_char - (s.vocab as f64).ln()).abs() < 1.0, "{per_char}");
        let mut g = vec![0f32; st.num_params()];
        st.backward(0, None, &mut g).unwrap();
        chain::assert_misuse_refused(&mut st, &x, &y, 2);
        let mut mid = Stage::new(&s, 1..2, 3).unwrap();
        assert!(mid
            .forward(1, StageInput::Tokens(&x), 2, None, 1.0)
            .is_err());
        assert!(mid
            .forward(1, StageInput::Activations(&[0.0; 5]), 2, None, 1.0)
            .is_err());
        assert!(Stage::new(&s, 2..9, 3).is_err());
    }

    #[test]
    fn evaluation_records_no_autodiff_graph() {
        let s = spec();
        let (x, _) = batch(2, &s);
        let acts = vec![0.1f32; s.activation_len(2)];
        let last = s.num_layers();
        for layers in [0..1, 1..3, 3..last, 0..last] {
            let st = Stage::new(&s, layers.clone(), 3).unwrap();
            let input = if st.is_first() {
                StageInput::Tokens(&x)
            } else {
                StageInput::Activations(&acts)
            };
            // Training records its graph (what evaluation must not do)…
            let (_, train_x) = st.input_tensor(&st.net, input, 2, true).unwrap();
            assert!(train_x.is_autodiff(), "{layers:?}");
            // …evaluation runs on the plain backend from input to output.
            let eval_autodiff = st.eval_forward(input, 2).unwrap().is_autodiff();
            assert!(!eval_autodiff, "evaluation of layers {layers:?} is tracked");
            assert_eq!(st.held(), 0);
        }
    }

    /// A stage's inputs for the comparisons below: token ids or activations, the targets on
    /// the last stage, the next stage's gradient elsewhere.
    struct Feed {
        x: Vec<i64>,
        y: Vec<i64>,
        acts: Vec<f32>,
        g_next: Vec<f32>,
    }

    impl Feed {
        fn new(s: &TransformerSpec) -> Feed {
            let (x, y) = batch(2, s);
            let len = s.activation_len(2);
            Feed {
                x,
                y,
                acts: (0..len).map(|i| (i as f32 * 0.7).cos()).collect(),
                g_next: (0..len).map(|i| (i as f32 * 0.3).sin() * 0.01).collect(),
            }
        }

        fn input(&self, st: &Stage) -> StageInput<'_> {
            match st.is_first() {
                true => StageInput::Tokens(&self.x),
                false => StageInput::Activations(&self.acts),
            }
        }

        fn targets(&self, st: &Stage) -> Option<&[i64]> {
            st.is_last().then_some(&self.y[..])
        }

        fn grad_output(&self, st: &Stage) -> Option<&[f32]> {
            (!st.is_last()).then_some(&self.g_next[..])
        }
    }

    /// Stages covering the whole model, its first, a middle, its last and a single layer.
    fn stage_shapes(s: &TransformerSpec) -> [Range<usize>; 5] {
        let last = s.num_layers();
        [0..last, 1..4, 0..2, 3..last, 2..3]
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|g| g.to_bits()).collect()
    }

    #[test]
    fn a_streamed_backward_hands_out_the_plain_gradients_layer_by_layer() {
        let s = spec();
        let feed = Feed::new(&s);
        for layers in stage_shapes(&s) {
            let mut plain = Stage::new(&s, layers.clone(), 3).unwrap();
            let mut streamed = Stage::new(&s, layers.clone(), 3).unwrap();
            let (input, targets) = (feed.input(&plain), feed.targets(&plain));
            let a = plain.forward(1, input, 2, targets, 0.5).unwrap();
            let b = streamed
                .forward_streamed(1, input, 2, targets, 0.5)
                .unwrap();
            assert_eq!(a, b, "{layers:?}: forward");
            let g_out = feed.grad_output(&plain);
            let mut want = vec![0f32; plain.num_params()];
            let want_input = plain.backward(1, g_out, &mut want).unwrap();
            let ranges = streamed.layer_ranges();
            let (mut got, mut order) = (vec![f32::NAN; want.len()], Vec::new());
            let got_input = streamed
                .backward_streaming(1, g_out, &ranges, &mut |k, v| {
                    got[ranges[k].clone()].copy_from_slice(v);
                    order.push(k);
                })
                .unwrap();
            assert_eq!(bits(&got), bits(&want), "{layers:?}: parameter gradients");
            assert_eq!(
                got_input.as_deref().map(bits),
                want_input.as_deref().map(bits),
                "{layers:?}: input gradient"
            );
            assert_eq!(order, (0..layers.len()).rev().collect::<Vec<_>>());
            assert_eq!(streamed.held(), 0);
        }
    }

    #[test]
    fn a_recomputed_forward_keeps_inputs_only_and_gives_the_kept_graphs_bits() {
        let s = spec();
        let feed = Feed::new(&s);
        for layers in stage_shapes(&s) {
            let mut plain = Stage::new(&s, layers.clone(), 3).unwrap();
            let mut again = Stage::new(&s, layers.clone(), 3)
                .unwrap()
                .with_recompute(true);
            let (input, targets) = (feed.input(&plain), feed.targets(&plain));
            // Two micro-batches in flight, their backwards in reverse order.
            for id in [1, 2] {
                let a = plain.forward(id, input, 2, targets, 0.5).unwrap();
                let b = again.forward(id, input, 2, targets, 0.5).unwrap();
                assert_eq!(a, b, "{layers:?}: forward");
            }
            assert_eq!(again.held(), 2);
            let g_out = feed.grad_output(&plain);
            for id in [2, 1] {
                let mut want = vec![0f32; plain.num_params()];
                let want_input = plain.backward(id, g_out, &mut want).unwrap();
                let mut got = vec![f32::NAN; want.len()];
                let got_input = again.backward(id, g_out, &mut got).unwrap();
                assert_eq!(bits(&got), bits(&want), "{layers:?}: parameter gradients");
                assert_eq!(
                    got_input.as_deref().map(bits),
                    want_input.as_deref().map(bits),
                    "{layers:?}: input gradient"
                );
            }
            assert_eq!(again.held(), 0);
        }
    }

    /// A [`LayerSource`] serving layers from a whole stage's parameters, recording which it
    /// served and what the stage held when asked.
    struct Served {
        whole: Vec<f32>,
        ranges: Vec<Range<usize>>,
        asked: Vec<usize>,
    }

    impl LayerSource for Served {
        fn layer(&mut self, k: usize) -> Result<Vec<f32>, String> {
            self.asked.push(k);
            Ok(self.whole[self.ranges[k].clone()].to_vec())
        }
    }

    /// Values of the parameters' tensors a stage holds now.
    fn held_values(st: &Stage) -> usize {
        burn::module::Module::num_params(&st.net)
    }

    #[test]
    fn layers_taken_one_at_a_time_give_the_bits_of_the_whole_stage() {
        let s = spec();
        let feed = Feed::new(&s);
        for layers in stage_shapes(&s) {
            let mut whole = Stage::new(&s, layers.clone(), 3)
                .unwrap()
                .with_recompute(true);
            let mut fetching = Stage::new(&s, layers.clone(), 3)
                .unwrap()
                .with_recompute(true);
            let mut source = Served {
                whole: whole.params_flat(),
                ranges: whole.layer_ranges(),
                asked: Vec::new(),
            };
            let (input, targets) = (feed.input(&whole), feed.targets(&whole));
            // Refused while the parameters are held: the caller releases them first.
            assert!(fetching
                .forward_from(1, input, 2, targets, 0.5, &mut source)
                .is_err());
            fetching.release_params();
            assert_eq!(held_values(&fetching), 0);
            let count = layers.len();
            for id in [1, 2] {
                let a = whole.forward(id, input, 2, targets, 0.5).unwrap();
                let b = fetching
                    .forward_from(id, input, 2, targets, 0.5, &mut source)
                    .unwrap();
                assert_eq!(a, b, "{layers:?}: forward");
                assert_eq!(held_values(&fetching), 0, "{layers:?}: released after");
            }
            let g_out = feed.grad_output(&whole);
            for id in [2, 1] {
                let mut want = vec![0f32; whole.num_params()];
                let want_input = whole.backward(id, g_out, &mut want).unwrap();
                let mut got = vec![f32::NAN; want.len()];
                let got_input = fetching
                    .backward_from(id, g_out, &mut got, &mut source)
                    .unwrap();
                assert_eq!(bits(&got), bits(&want), "{layers:?}: parameter gradients");
                assert_eq!(
                    got_input.as_deref().map(bits),
                    want_input.as_deref().map(bits),
                    "{layers:?}: input gradient"
                );
                assert_eq!(held_values(&fetching), 0, "{layers:?}: released after");
            }
            // Each forward asks for the layers in order, each backward in reverse.
            let up: Vec<usize> = (0..count).collect();
            let down: Vec<usize> = (0..count).rev().collect();
            let want: Vec<usize> = [&up[..], &up, &down, &down].concat();
            assert_eq!(source.asked, want, "{layers:?}");
            // The parameters set whole again: the plain forward works as before.
            fetching.set_params_flat(&source.whole).unwrap();
            assert_eq!(fetching.params_flat(), source.whole);
        }
    }

    #[test]
    fn profiling_gives_a_positive_cost_per_layer() {
        let s = spec();
        let costs = Stage::profile_layers(&s, 2, 1).unwrap();
        assert_eq!(costs.len(), s.num_layers());
        assert!(costs.iter().all(|&c| c > 0.0));
    }
}
