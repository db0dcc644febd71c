//! Tensor-parallel layers for users' own layer-sequence models (Megatron style):
//! [`ColumnParallelLinear`] (output features cut into `pieces` fixed column pieces) and
//! [`RowParallelLinear`] (input features cut into the same pieces, outputs summed exactly).
//!
//! Bitwise equality with one worker comes from the same rule as the transformer's
//! (`tensor_parallel.rs`): a layer is **always** computed as its `T = pieces` fixed pieces, one
//! matrix product per piece on operands of the same shapes and layout on every rank (each piece's
//! operand is copied into a fresh contiguous buffer first), and the pieces are summed **exactly**
//! ([`PieceSum`]: one worker [`LocalPieceSum`], a tensor-parallel group the driver's sum over its
//! communicator). So the bits depend only on the multiset of pieces, never on which rank computed
//! which.
//!
//! Each layer's pieces run inside one custom autodiff op with a hand-written backward (like
//! `streaming.rs`): the column op is Megatron's f (identity forward; backward: the input gradient
//! summed exactly over all `T` pieces), the row op is g (forward: the exact sum of the pieces'
//! partial products; backward: identity, each piece's input gradient local). The ops learn which
//! pieces this thread computes and how to sum from a thread-local **tp scope**
//! ([`in_tp_scope`]), which the pipeline driver's stage installs around its forward, backward
//! and evaluation; without a scope a layer computes all `T` pieces itself (one worker).
//!
//! Parameter layout, chosen so that every piece's slice of every split tensor is one contiguous
//! run of rows, in the canonical flat vector and in a rank's local one alike:
//! `ColumnParallelLinear.weight` is `[d_output, d_input]` (PyTorch's layout, rows = output
//! features), its bias `[d_output]`; `RowParallelLinear.weight` is `[d_input, d_output]` (burn's
//! layout, rows = input features), its bias `[d_output]` replicated. Every split tensor is cut
//! along its first dimension; a rank keeps the rows of its pieces ([`tp_param`] tells which
//! parameters are split, from a registry filled when the layers are initialised).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::module::{Module, Param, ParamId};
use burn::tensor::{Device, Distribution, Tensor, TensorData};

use crate::bf16::Products;
use crate::tensor_parallel::{LocalPieceSum, PieceSum};

// ---------------------------------------------------------------------------------------------
// Which parameters are split
// ---------------------------------------------------------------------------------------------

/// What a split parameter is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpParamKind {
    /// `ColumnParallelLinear.weight`, `[d_output, d_input]`.
    ColumnWeight,
    /// `ColumnParallelLinear.bias`, `[d_output]`.
    ColumnBias,
    /// `RowParallelLinear.weight`, `[d_input, d_output]`.
    RowWeight,
}

/// A parameter cut into `pieces` equal runs of rows (its first dimension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpParam {
    pub kind: TpParamKind,
    pub pieces: usize,
}

/// Split parameters by id (ids are unique per process and survive `Module::map`, `valid`,
/// `clone` and lockstep's flat writes).
static REGISTRY: LazyLock<Mutex<HashMap<ParamId, TpParam>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn register(id: ParamId, param: TpParam) {
    REGISTRY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id, param);
}

/// Whether the parameter `id` belongs to a tensor-parallel layer, and how it is split.
pub fn tp_param(id: ParamId) -> Option<TpParam> {
    REGISTRY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .copied()
}

/// Every float parameter of `module` in canonical (declaration) order: split or not.
pub fn tp_params_of<M: Module>(module: &M) -> Vec<Option<TpParam>> {
    struct Ids(Vec<Option<TpParam>>);
    impl burn::module::ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(tp_param(param.id));
        }
    }
    let mut v = Ids(Vec::new());
    module.visit(&mut v);
    v.0
}

/// `module` with every split parameter narrowed to the rows of pieces `local` of its `pieces`
/// (`pieces / tp` consecutive ones for tp rank `tp_rank`), as fresh autodiff leaves on `device`;
/// other parameters are kept. Parameter ids are kept.
pub fn narrow_to_pieces<M: Module>(module: M, tp: usize, tp_rank: usize, device: &Device) -> M {
    struct Narrow<'a> {
        tp: usize,
        tp_rank: usize,
        device: &'a Device,
    }
    impl burn::module::ModuleMapper for Narrow<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(split) = tp_param(param.id) else {
                return param;
            };
            let (tp, rank, device) = (self.tp, self.tp_rank, self.device);
            param.map(|t| {
                let rows = t.dims()[0];
                let per_rank = rows / split.pieces * (split.pieces / tp);
                let values = t.narrow(0, rank * per_rank, per_rank).into_data();
                Tensor::from_data(values, device).require_grad()
            })
        }
    }
    module.map(&mut Narrow {
        tp,
        tp_rank,
        device,
    })
}

// ---------------------------------------------------------------------------------------------
// The tp scope: which pieces this thread computes, and how it sums them
// ---------------------------------------------------------------------------------------------

struct Scope {
    tp: usize,
    tp_rank: usize,
    sum: Box<dyn PieceSum>,
    /// The first failed sum: later sums in the scope are skipped (their output is NaN).
    failure: Option<String>,
}

thread_local! {
    static SCOPE: RefCell<Option<Scope>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's tensor-parallel layers computing the pieces of tp rank `tp_rank`
/// of `tp` and summing them through `sum` (which is lent to the scope and handed back, also when
/// `f` panics). Returns `f`'s result and the first failed sum's message, if any: after a failure
/// the remaining sums in `f` are skipped and give NaN, so `f`'s result is then meaningless.
pub fn in_tp_scope<R>(
    tp: usize,
    tp_rank: usize,
    sum: &mut Box<dyn PieceSum>,
    f: impl FnOnce() -> R,
) -> (R, Option<String>) {
    struct Guard<'a> {
        sum: &'a mut Box<dyn PieceSum>,
        failure: Option<String>,
    }
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            if let Some(scope) = SCOPE.with(|s| s.borrow_mut().take()) {
                *self.sum = scope.sum;
                self.failure = scope.failure;
            }
        }
    }
    assert!(tp >= 1 && tp_rank < tp, "tp rank {tp_rank} of {tp}");
    let lent = std::mem::replace(sum, Box::new(LocalPieceSum));
    SCOPE.with(|s| {
        let mut s = s.borrow_mut();
        assert!(s.is_none(), "tensor-parallel scopes do not nest");
        *s = Some(Scope {
            tp,
            tp_rank,
            sum: lent,
            failure: None,
        });
    });
    let mut guard = Guard { sum, failure: None };
    let r = f();
    // Hand the sum back now (the guard's drop does it on unwinding too).
    if let Some(scope) = SCOPE.with(|s| s.borrow_mut().take()) {
        *guard.sum = scope.sum;
        guard.failure = scope.failure;
    }
    let failure = guard.failure.take();
    (r, failure)
}

/// The pieces this thread computes of a layer with `pieces`: (first, count).
fn local_pieces(pieces: usize, layer: &str) -> (usize, usize) {
    SCOPE.with(|s| match &*s.borrow() {
        None => (0, pieces),
        Some(scope) => {
            assert!(
                pieces.is_multiple_of(scope.tp),
                "{layer}: {} tensor-parallel ranks do not divide its {pieces} pieces",
                scope.tp
            );
            let per = pieces / scope.tp;
            (scope.tp_rank * per, per)
        }
    })
}

/// The exact sum of `parts` (this thread's pieces of `total`) into `out`: through the scope's
/// sum, or locally without a scope. A failure fills `out` with NaN (and is recorded in the scope).
fn sum_pieces(parts: &[&[f32]], total: usize, out: &mut [f32]) {
    let failed = SCOPE.with(|s| match &mut *s.borrow_mut() {
        None => LocalPieceSum.sum_pieces(parts, total, out).is_err(),
        Some(scope) => {
            if scope.failure.is_some() {
                return true;
            }
            match scope.sum.sum_pieces(parts, total, out) {
                Ok(()) => false,
                Err(message) => {
                    scope.failure = Some(message);
                    true
                }
            }
        }
    });
    if failed {
        out.fill(f32::NAN);
    }
}

// ---------------------------------------------------------------------------------------------
// Piece arithmetic on canonical (contiguous, own buffer) flex tensors
// ---------------------------------------------------------------------------------------------

/// `t` in a buffer of its own, row-major: the one layout every piece operand has.
fn canon(t: &FlexTensor) -> FlexTensor {
    t.to_contiguous()
}

fn f32s(t: &FlexTensor) -> &[f32] {
    let s = t.storage::<f32>();
    debug_assert_eq!(s.len(), t.layout().num_elements());
    s
}

fn dims2(t: &FlexTensor) -> [usize; 2] {
    let s = t.layout().shape();
    assert_eq!(s.num_dims(), 2, "tensor-parallel layers take matrices");
    [s[0], s[1]]
}

fn matrix(values: Vec<f32>, rows: usize, cols: usize) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, [rows, cols]))
}

/// Rows `start..start + len` of a matrix, in a buffer of their own.
fn rows_of(t: &FlexTensor, start: usize, len: usize) -> FlexTensor {
    canon(&t.narrow(0, start, len))
}

/// Columns `start..start + len` of a matrix, in a buffer of their own.
fn cols_of(t: &FlexTensor, start: usize, len: usize) -> FlexTensor {
    canon(&t.narrow(1, start, len))
}

fn matmul(a: FlexTensor, b: FlexTensor) -> FlexTensor {
    <Flex as FloatTensorOps<Flex>>::float_matmul(a, b)
}

/// Matrices `[n, w]` side by side: `[n, Σ w]`.
fn side_by_side(parts: &[FlexTensor]) -> FlexTensor {
    let n = dims2(&parts[0])[0];
    let widths: Vec<usize> = parts.iter().map(|p| dims2(p)[1]).collect();
    let total: usize = widths.iter().sum();
    let mut out = Vec::with_capacity(n * total);
    for i in 0..n {
        for (p, &w) in parts.iter().zip(&widths) {
            out.extend_from_slice(&f32s(p)[i * w..(i + 1) * w]);
        }
    }
    matrix(out, n, total)
}

/// Matrices `[r, c]` one under the other: `[Σ r, c]`.
fn stacked(parts: &[FlexTensor]) -> FlexTensor {
    let c = dims2(&parts[0])[1];
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(f32s(p));
    }
    let rows = out.len() / c.max(1);
    matrix(out, rows, c)
}

/// Which pieces, and their width, of a split dimension of `full` features.
#[derive(Debug, Clone, Copy)]
struct Pieces {
    total: usize,
    count: usize,
    width: usize,
}

impl Pieces {
    fn of(total: usize, full: usize, local_rows: usize, layer: &str) -> Pieces {
        let (first, count) = local_pieces(total, layer);
        let width = full / total;
        assert_eq!(
            local_rows,
            count * width,
            "{layer}: its weight holds {local_rows} of {full} split features, but this thread \
             computes pieces {first}..{} of {total} ({} features): the layer was not narrowed \
             for this tensor-parallel rank",
            first + count,
            count * width
        );
        Pieces {
            total,
            count,
            width,
        }
    }
}

/// Column-parallel forward: `[x·W_pᵀ + b_p]_p` over the local pieces (`weight` `[count·w, in]`).
fn column_forward(x: &FlexTensor, weight: &FlexTensor, bias: &FlexTensor, p: Pieces) -> FlexTensor {
    let n = dims2(x)[0];
    let b = canon(bias);
    let b = f32s(&b);
    let outs: Vec<FlexTensor> = (0..p.count)
        .map(|k| {
            let w = rows_of(weight, k * p.width, p.width);
            let mut y = canon(&matmul(x.clone(), w.transpose(0, 1)));
            let bk = &b[k * p.width..(k + 1) * p.width];
            for row in y.storage_mut::<f32>().chunks_mut(p.width).take(n) {
                for (v, bv) in row.iter_mut().zip(bk) {
                    *v += bv;
                }
            }
            y
        })
        .collect();
    side_by_side(&outs)
}

/// Row-parallel forward: the exact sum over all pieces of `x_p·W_p` (`x` `[n, count·h]`, `weight`
/// `[count·h, out]`), without bias.
fn row_forward(x: &FlexTensor, weight: &FlexTensor, p: Pieces) -> FlexTensor {
    let [n, _] = dims2(x);
    let out_dim = dims2(weight)[1];
    let partial: Vec<FlexTensor> = (0..p.count)
        .map(|k| {
            let xk = cols_of(x, k * p.width, p.width);
            let wk = rows_of(weight, k * p.width, p.width);
            canon(&matmul(xk, wk))
        })
        .collect();
    let refs: Vec<&[f32]> = partial.iter().map(f32s).collect();
    let mut out = vec![0f32; n * out_dim];
    sum_pieces(&refs, p.total, &mut out);
    matrix(out, n, out_dim)
}

// ---------------------------------------------------------------------------------------------
// The ops
// ---------------------------------------------------------------------------------------------

/// The layers' two custom ops (plain forward on flex; autodiff with a hand-written backward).
#[backend_extension(Flex, Autodiff)]
pub trait TpOps: Backend {
    /// `x` `[n, d_input]`, `weight` `[local rows, d_input]`, `bias` `[local rows]` of a layer of
    /// `d_output` features in `pieces` pieces: `[n, local rows]`.
    fn tp_column(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        pieces: usize,
        d_output: usize,
    ) -> FloatTensor<Self>;
    /// `x` `[n, local rows]`, `weight` `[local rows, d_output]` of a layer of `d_input` features
    /// in `pieces` pieces: the exact sum over all pieces, `[n, d_output]`.
    fn tp_row(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        pieces: usize,
        d_input: usize,
    ) -> FloatTensor<Self>;
}

const COLUMN: &str = "ColumnParallelLinear";
const ROW: &str = "RowParallelLinear";

impl TpOps for Flex {
    fn tp_column(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        pieces: usize,
        d_output: usize,
    ) -> FloatTensor<Self> {
        let p = Pieces::of(pieces, d_output, dims2(&weight)[0], COLUMN);
        column_forward(&canon(&x), &weight, &bias, p)
    }

    fn tp_row(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        pieces: usize,
        d_input: usize,
    ) -> FloatTensor<Self> {
        let p = Pieces::of(pieces, d_input, dims2(&weight)[0], ROW);
        row_forward(&canon(&x), &weight, p)
    }
}

#[derive(Debug)]
struct ColumnBackward {
    pieces: Pieces,
}

impl Backward<Flex, 3> for ColumnBackward {
    /// The input (canonical) and the local weight.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let p = self.pieces;
        let (x, weight) = ops.state;
        let dy = canon(&grads.consume::<Flex>(&ops.node));
        let [n, d_in] = dims2(&x);
        let [x_node, w_node, b_node] = ops.parents;
        let dys: Vec<FlexTensor> = (0..p.count)
            .map(|k| cols_of(&dy, k * p.width, p.width))
            .collect();
        if let Some(node) = w_node {
            let dw: Vec<FlexTensor> = dys
                .iter()
                .map(|dyk| canon(&matmul(dyk.transpose(0, 1), x.clone())))
                .collect();
            grads.register::<Flex>(node.id, stacked(&dw));
        }
        if let Some(node) = b_node {
            let mut db = vec![0f32; p.count * p.width];
            for (k, dyk) in dys.iter().enumerate() {
                let sums = &mut db[k * p.width..(k + 1) * p.width];
                for row in f32s(dyk).chunks(p.width) {
                    for (s, v) in sums.iter_mut().zip(row) {
                        *s += v;
                    }
                }
            }
            grads.register::<Flex>(
                node.id,
                FlexTensor::from_data(TensorData::new(db, [p.count * p.width])),
            );
        }
        if let Some(node) = x_node {
            // Megatron's f backward: the pieces' input gradients summed exactly over all pieces.
            let dx: Vec<FlexTensor> = dys
                .iter()
                .enumerate()
                .map(|(k, dyk)| canon(&matmul(dyk.clone(), rows_of(&weight, k * p.width, p.width))))
                .collect();
            let refs: Vec<&[f32]> = dx.iter().map(f32s).collect();
            let mut out = vec![0f32; n * d_in];
            sum_pieces(&refs, p.total, &mut out);
            grads.register::<Flex>(node.id, matrix(out, n, d_in));
        }
    }
}

#[derive(Debug)]
struct RowBackward {
    pieces: Pieces,
}

impl Backward<Flex, 2> for RowBackward {
    /// The input (canonical) and the local weight.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _c: &mut Checkpointer) {
        let p = self.pieces;
        let (x, weight) = ops.state;
        // g's backward is the identity: every piece gets the whole output gradient.
        let dy = canon(&grads.consume::<Flex>(&ops.node));
        let [x_node, w_node] = ops.parents;
        if let Some(node) = w_node {
            let dw: Vec<FlexTensor> = (0..p.count)
                .map(|k| {
                    let xk = cols_of(&x, k * p.width, p.width);
                    canon(&matmul(xk.transpose(0, 1), dy.clone()))
                })
                .collect();
            grads.register::<Flex>(node.id, stacked(&dw));
        }
        if let Some(node) = x_node {
            let dx: Vec<FlexTensor> = (0..p.count)
                .map(|k| {
                    let wk = rows_of(&weight, k * p.width, p.width);
                    canon(&matmul(dy.clone(), wk.transpose(0, 1)))
                })
                .collect();
            grads.register::<Flex>(node.id, side_by_side(&dx));
        }
    }
}

impl<C: CheckpointStrategy> TpOps for Autodiff<Flex, C> {
    fn tp_column(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        pieces: usize,
        d_output: usize,
    ) -> FloatTensor<Self> {
        let p = Pieces::of(pieces, d_output, dims2(weight.primitive())[0], COLUMN);
        let xc = canon(x.primitive());
        let out = column_forward(&xc, weight.primitive(), bias.primitive(), p);
        let w = weight.primitive().clone();
        match (ColumnBackward { pieces: p })
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((xc, w), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn tp_row(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        pieces: usize,
        d_input: usize,
    ) -> FloatTensor<Self> {
        let p = Pieces::of(pieces, d_input, dims2(weight.primitive())[0], ROW);
        let xc = canon(x.primitive());
        let out = row_forward(&xc, weight.primitive(), p);
        let w = weight.primitive().clone();
        match (RowBackward { pieces: p })
            .prepare::<C>([x.node(), weight.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((xc, w), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The modules
// ---------------------------------------------------------------------------------------------

/// Configuration of a [`ColumnParallelLinear`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColumnParallelLinearConfig {
    pub d_input: usize,
    pub d_output: usize,
    /// `T`: the fixed pieces the output features are cut into (must divide `d_output`); every
    /// tensor-parallel layer of a model has the same `T`, and `parallel.tp` must divide it.
    pub pieces: usize,
}

impl ColumnParallelLinearConfig {
    pub fn new(d_input: usize, d_output: usize, pieces: usize) -> Self {
        ColumnParallelLinearConfig {
            d_input,
            d_output,
            pieces,
        }
    }

    /// A layer initialised like burn's `Linear` (uniform in ±1/√d_input) on `device`.
    pub fn init(&self, device: &Device) -> ColumnParallelLinear {
        check_split(COLUMN, "d_output", self.d_output, self.pieces);
        let (weight, bias) = linear_params(
            [self.d_output, self.d_input],
            self.d_input,
            self.d_output,
            device,
        );
        let split = |kind| TpParam {
            kind,
            pieces: self.pieces,
        };
        register(weight.id, split(TpParamKind::ColumnWeight));
        register(bias.id, split(TpParamKind::ColumnBias));
        ColumnParallelLinear {
            weight,
            bias,
            pieces: self.pieces,
            d_output: self.d_output,
        }
    }
}

/// Configuration of a [`RowParallelLinear`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowParallelLinearConfig {
    pub d_input: usize,
    pub d_output: usize,
    /// `T`: the fixed pieces the input features are cut into (must divide `d_input`).
    pub pieces: usize,
}

impl RowParallelLinearConfig {
    pub fn new(d_input: usize, d_output: usize, pieces: usize) -> Self {
        RowParallelLinearConfig {
            d_input,
            d_output,
            pieces,
        }
    }

    /// A layer initialised like burn's `Linear` (uniform in ±1/√d_input) on `device`.
    pub fn init(&self, device: &Device) -> RowParallelLinear {
        check_split(ROW, "d_input", self.d_input, self.pieces);
        let (weight, bias) = linear_params(
            [self.d_input, self.d_output],
            self.d_input,
            self.d_output,
            device,
        );
        register(
            weight.id,
            TpParam {
                kind: TpParamKind::RowWeight,
                pieces: self.pieces,
            },
        );
        RowParallelLinear {
            weight,
            bias,
            pieces: self.pieces,
            d_input: self.d_input,
        }
    }
}

/// A linear layer's weight (of `weight_shape`, the layer's own layout) and bias `[d_output]`,
/// drawn in that order uniform in ±1/√d_input, like burn's `Linear`.
fn linear_params(
    weight_shape: [usize; 2],
    d_input: usize,
    d_output: usize,
    device: &Device,
) -> (Param<Tensor<2>>, Param<Tensor<1>>) {
    let uniform = {
        let bound = 1.0 / (d_input as f64).sqrt();
        Distribution::Uniform(-bound, bound)
    };
    (
        Param::from_tensor(Tensor::random(weight_shape, uniform, device)),
        Param::from_tensor(Tensor::random([d_output], uniform, device)),
    )
}

fn check_split(layer: &str, what: &str, features: usize, pieces: usize) {
    assert!(
        pieces >= 1 && features.is_multiple_of(pieces),
        "{layer}: {pieces} pieces must be ≥ 1 and divide {what} = {features}"
    );
}

/// `f` on `x` seen as `[rows, features]` (every leading dimension folded into the rows), its
/// result given back `x`'s leading dimensions.
fn on_rows<const D: usize>(x: Tensor<D>, f: impl FnOnce(Tensor<2>) -> Tensor<2>) -> Tensor<D> {
    let dims = x.dims();
    let y = f(x.reshape([dims[..D - 1].iter().product(), dims[D - 1]]));
    let mut out = dims;
    out[D - 1] = y.dims()[1];
    y.reshape(out)
}

/// A linear layer whose output features are cut into `pieces` fixed column pieces (Megatron's
/// column-parallel linear). On a tensor-parallel rank it holds and computes only its pieces: its
/// output is `[.., d_output · local / pieces]`, this rank's pieces side by side, meant for a
/// [`RowParallelLinear`] (elementwise functions such as ReLU may sit between them). The input
/// gradient is summed exactly over all pieces.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear {
    /// `[d_output, d_input]` (rows = output features, so a piece is a run of rows).
    pub weight: Param<Tensor<2>>,
    /// `[d_output]`.
    pub bias: Param<Tensor<1>>,
    #[module(skip)]
    pieces: usize,
    #[module(skip)]
    d_output: usize,
}

impl ColumnParallelLinear {
    /// `[.., d_input]` → `[.., local features]` (all `d_output` on one worker).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_in(x, Products::F32)
    }

    /// [`ColumnParallelLinear::forward`] with the input and weight taken as `products` says
    /// (`train.precision`: `lockstep::products(cfg)`).
    pub fn forward_in<const D: usize>(&self, x: Tensor<D>, products: Products) -> Tensor<D> {
        on_rows(x, |x| {
            Tensor::from_dispatch(<Dispatch as TpOps>::tp_column(
                products.operand(x).into_dispatch(),
                products.operand(self.weight.val()).into_dispatch(),
                self.bias.val().into_dispatch(),
                self.pieces,
                self.d_output,
            ))
        })
    }

    /// The fixed pieces `T`.
    pub fn pieces(&self) -> usize {
        self.pieces
    }
}

/// A linear layer whose input features are cut into `pieces` fixed row pieces (Megatron's
/// row-parallel linear): its input is a [`ColumnParallelLinear`]'s local pieces, its output the
/// exact sum over all pieces plus the (replicated) bias, the same on every tensor-parallel rank.
#[derive(Module, Debug)]
pub struct RowParallelLinear {
    /// `[d_input, d_output]` (rows = input features, so a piece is a run of rows).
    pub weight: Param<Tensor<2>>,
    /// `[d_output]`, replicated.
    pub bias: Param<Tensor<1>>,
    #[module(skip)]
    pieces: usize,
    #[module(skip)]
    d_input: usize,
}

impl RowParallelLinear {
    /// `[.., local features]` → `[.., d_output]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_in(x, Products::F32)
    }

    /// [`RowParallelLinear::forward`] with the input and weight taken as `products` says
    /// (`train.precision`: `lockstep::products(cfg)`).
    pub fn forward_in<const D: usize>(&self, x: Tensor<D>, products: Products) -> Tensor<D> {
        on_rows(x, |x| {
            let y = Tensor::<2>::from_dispatch(<Dispatch as TpOps>::tp_row(
                products.operand(x).into_dispatch(),
                products.operand(self.weight.val()).into_dispatch(),
                self.pieces,
                self.d_input,
            ));
            y + self.bias.val().unsqueeze::<2>()
        })
    }

    /// The fixed pieces `T`.
    pub fn pieces(&self) -> usize {
        self.pieces
    }
}

/// Simulated tensor-parallel groups on threads, for the tests of the tp layers.
#[cfg(test)]
pub(crate) mod test_group {
    use std::sync::{Arc, Barrier, Mutex};

    use burn::tensor::{Device, Tensor};

    use super::{in_tp_scope, PieceSum};

    /// A [`PieceSum`] over `tp` threads: every rank's pieces meet, in rank order, in one
    /// `sum_local` (what the communicator's one-bucket exact reduction computes).
    struct Exchange {
        rank: usize,
        slots: Arc<Mutex<Vec<Vec<Vec<f32>>>>>,
        barrier: Arc<Barrier>,
    }

    impl PieceSum for Exchange {
        fn sum_pieces(
            &mut self,
            local: &[&[f32]],
            total: usize,
            out: &mut [f32],
        ) -> Result<(), String> {
            self.slots.lock().unwrap()[self.rank] = local.iter().map(|p| p.to_vec()).collect();
            self.barrier.wait();
            {
                let slots = self.slots.lock().unwrap();
                let all: Vec<&[f32]> = slots.iter().flatten().map(|p| p.as_slice()).collect();
                lockstep_exact::sum_local(&all, total, out).map_err(|e| e.to_string())?;
            }
            self.barrier.wait();
            Ok(())
        }
    }

    /// The values of `t`.
    pub(crate) fn vals<const R: usize>(t: Tensor<R>) -> Vec<f32> {
        crate::params::f32_slice(&t.into_data()).to_vec()
    }

    /// The bits of `t`'s values.
    pub(crate) fn bits<const R: usize>(t: Tensor<R>) -> Vec<u32> {
        vals(t).iter().map(|v| v.to_bits()).collect()
    }

    /// The autodiff device the tests train on.
    pub(crate) fn ad() -> Device {
        Device::flex().autodiff()
    }

    /// `tp` ranks on threads, each running what `make(rank)` returns inside its tp scope over a
    /// shared [`Exchange`]; their results in rank order. Panics if a piece sum failed.
    pub(crate) fn run_ranks<F, R>(tp: usize, make: impl Fn(usize) -> F) -> Vec<R>
    where
        F: FnOnce() -> R + Send,
        R: Send,
    {
        let slots = Arc::new(Mutex::new(vec![Vec::new(); tp]));
        let barrier = Arc::new(Barrier::new(tp));
        std::thread::scope(|sc| {
            let handles: Vec<_> = (0..tp)
                .map(|rank| {
                    let f = make(rank);
                    let (slots, barrier) = (slots.clone(), barrier.clone());
                    sc.spawn(move || {
                        let mut sum: Box<dyn PieceSum> = Box::new(Exchange {
                            rank,
                            slots,
                            barrier,
                        });
                        let (r, failure) = in_tp_scope(tp, rank, &mut sum, f);
                        assert_eq!(failure, None);
                        r
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }
}

#[cfg(test)]
mod tests {
    //! The layers against the single-worker piecewise computation (and against plain dense
    //! algebra, approximately, for the hand-written backward), and 2 or 4 simulated tp ranks on
    //! threads against one worker, bit for bit.

    use super::test_group::{ad, bits, vals};
    use super::*;

    const N: usize = 5;
    const D_IN: usize = 12;
    const HIDDEN: usize = 16;
    const D_OUT: usize = 6;
    const T: usize = 4;

    fn input(device: &Device) -> Tensor<2> {
        let v: Vec<f32> = (0..N * D_IN).map(|i| (i as f32 * 0.37).sin()).collect();
        Tensor::from_data(TensorData::new(v, [N, D_IN]), device)
    }

    fn output_grad(device: &Device) -> Tensor<2> {
        let v: Vec<f32> = (0..N * D_OUT).map(|i| (i as f32 * 0.91).cos()).collect();
        Tensor::from_data(TensorData::new(v, [N, D_OUT]), device)
    }

    fn layers() -> (ColumnParallelLinear, RowParallelLinear) {
        let device = ad();
        (
            ColumnParallelLinearConfig::new(D_IN, HIDDEN, T).init(&device),
            RowParallelLinearConfig::new(HIDDEN, D_OUT, T).init(&device),
        )
    }

    /// What one rank computes: output, input gradient, then the gradients of column weight,
    /// column bias, row weight, row bias.
    struct Run {
        out: Tensor<2>,
        dx: Tensor<2>,
        grads: [Vec<f32>; 4],
    }

    fn run(col: &ColumnParallelLinear, row: &RowParallelLinear) -> Run {
        let device = ad();
        let x = input(&device).require_grad();
        let z = row.forward(burn::tensor::activation::relu(col.forward(x.clone())));
        let grads = (z.clone() * output_grad(&device)).sum().backward();
        let g2 = |p: &Param<Tensor<2>>| vals(p.val().grad(&grads).unwrap());
        let g1 = |p: &Param<Tensor<1>>| vals(p.val().grad(&grads).unwrap());
        Run {
            out: z.inner(),
            dx: x.grad(&grads).unwrap(),
            grads: [
                g2(&col.weight),
                g1(&col.bias),
                g2(&row.weight),
                g1(&row.bias),
            ],
        }
    }

    fn exact(parts: &[Vec<f32>]) -> Vec<f32> {
        let refs: Vec<&[f32]> = parts.iter().map(|p| p.as_slice()).collect();
        let mut out = vec![0f32; parts[0].len()];
        lockstep_exact::sum_local(&refs, refs.len(), &mut out).unwrap();
        out
    }

    /// Rows `r` of a row-major `[_, cols]` vector as a plain (non-autodiff) matrix.
    fn rows(v: &[f32], cols: usize, r: std::ops::Range<usize>) -> Tensor<2> {
        let data = v[r.start * cols..r.end * cols].to_vec();
        Tensor::from_data(TensorData::new(data, [r.len(), cols]), &Device::flex())
    }

    #[test]
    fn one_worker_is_the_piecewise_computation_bit_for_bit() {
        let (col, row) = layers();
        let got = run(&col, &row);
        let flex = Device::flex();
        let (w1, b1) = (vals(col.weight.val()), vals(col.bias.val()));
        let (w2, b2) = (vals(row.weight.val()), vals(row.bias.val()));
        let x = input(&flex);
        let w = HIDDEN / T;
        // Forward: each piece's column product + bias, ReLU, its row product; exact sum; bias.
        let mut hs = Vec::new();
        let mut partial = Vec::new();
        for p in 0..T {
            let wp = rows(&w1, D_IN, p * w..(p + 1) * w);
            let bp = rows(&b1, 1, p * w..(p + 1) * w).reshape([1, w]);
            let h = burn::tensor::activation::relu(x.clone().matmul(wp.transpose()) + bp);
            partial.push(vals(h.clone().matmul(rows(&w2, D_OUT, p * w..(p + 1) * w))));
            hs.push(h);
        }
        let sum = Tensor::<2>::from_data(TensorData::new(exact(&partial), [N, D_OUT]), &flex);
        let z = sum + rows(&b2, D_OUT, 0..1);
        assert_eq!(bits(got.out), bits(z), "output");
        // Backward, piece by piece.
        let dz = output_grad(&flex);
        let mut dw1 = Vec::new();
        let mut db1 = Vec::new();
        let mut dw2 = Vec::new();
        let mut dxs = Vec::new();
        for (p, h) in hs.iter().enumerate() {
            let w2p = rows(&w2, D_OUT, p * w..(p + 1) * w);
            dw2.extend(vals(h.clone().transpose().matmul(dz.clone())));
            let mask = h.clone().greater_elem(0.0).float();
            let dh = dz.clone().matmul(w2p.transpose()) * mask;
            dw1.extend(vals(dh.clone().transpose().matmul(x.clone())));
            let dh_v = vals(dh.clone());
            db1.extend((0..w).map(|j| {
                let mut s = 0f32;
                for i in 0..N {
                    s += dh_v[i * w + j];
                }
                s
            }));
            dxs.push(vals(dh.matmul(rows(&w1, D_IN, p * w..(p + 1) * w))));
        }
        let [gw1, gb1, gw2, _] = &got.grads;
        assert_eq!(gw1, &dw1, "column weight");
        assert_eq!(gb1, &db1, "column bias");
        assert_eq!(gw2, &dw2, "row weight");
        assert_eq!(vals(got.dx), exact(&dxs), "input gradient (f: exact sum)");
    }

    #[test]
    fn the_hand_written_backward_is_the_dense_gradient() {
        let (col, row) = layers();
        let got = run(&col, &row);
        let device = ad();
        let leaf = |t: Tensor<2>| Tensor::<2>::from_data(t.into_data(), &device).require_grad();
        let (w1, w2) = (leaf(col.weight.val()), leaf(row.weight.val()));
        let b1 = leaf(col.bias.val().unsqueeze::<2>());
        let b2 = leaf(row.bias.val().unsqueeze::<2>());
        let x = input(&device).require_grad();
        let h =
            burn::tensor::activation::relu(x.clone().matmul(w1.clone().transpose()) + b1.clone());
        let z = h.matmul(w2.clone()) + b2.clone();
        let grads = (z.clone() * output_grad(&device)).sum().backward();
        let close = |a: Vec<f32>, b: Vec<f32>, what: &str| {
            assert_eq!(a.len(), b.len(), "{what}");
            for (i, (u, v)) in a.iter().zip(&b).enumerate() {
                assert!(
                    (u - v).abs() <= 1e-5 * (1.0 + v.abs()),
                    "{what}[{i}]: {u} vs {v}"
                );
            }
        };
        close(vals(got.out), vals(z.inner()), "output");
        close(
            vals(got.dx),
            vals(x.grad(&grads).unwrap()),
            "input gradient",
        );
        let g = |t: &Tensor<2>| vals(t.grad(&grads).unwrap());
        let [gw1, gb1, gw2, gb2] = got.grads;
        close(gw1, g(&w1), "column weight");
        close(gb1, g(&b1), "column bias");
        close(gw2, g(&w2), "row weight");
        close(gb2, g(&b2), "row bias");
    }

    #[test]
    fn evaluation_forward_has_the_training_forward_bits() {
        let (col, row) = layers();
        let trained = run(&col, &row).out;
        let (col, row) = (col.valid(), row.valid());
        let x = input(&Device::flex());
        let z = row.forward(burn::tensor::activation::relu(col.forward(x)));
        assert!(!z.is_autodiff());
        assert_eq!(bits(z), bits(trained));
    }

    #[test]
    fn tensor_parallel_ranks_reproduce_one_worker() {
        let (col, row) = layers();
        let one = run(&col, &row);
        for tp in [2, 4] {
            let ranks = test_group::run_ranks(tp, |rank| {
                let col = narrow_to_pieces(col.clone(), tp, rank, &ad());
                let row = narrow_to_pieces(row.clone(), tp, rank, &ad());
                move || run(&col, &row)
            });
            let share = |whole: &[f32], rank: usize| {
                let per = whole.len() / tp;
                whole[rank * per..(rank + 1) * per].to_vec()
            };
            for (rank, r) in ranks.into_iter().enumerate() {
                assert_eq!(
                    bits(r.out),
                    bits(one.out.clone()),
                    "tp {tp} rank {rank}: output"
                );
                assert_eq!(bits(r.dx), bits(one.dx.clone()), "tp {tp} rank {rank}: dx");
                for (i, what) in ["column weight", "column bias", "row weight"]
                    .iter()
                    .enumerate()
                {
                    assert_eq!(
                        r.grads[i],
                        share(&one.grads[i], rank),
                        "tp {tp} rank {rank}: {what}"
                    );
                }
                assert_eq!(r.grads[3], one.grads[3], "tp {tp} rank {rank}: row bias");
            }
        }
    }

    #[test]
    fn split_parameters_are_registered_and_narrowed() {
        let (col, row) = layers();
        let kinds = |m: &[Option<TpParam>]| m.iter().map(|p| p.map(|p| p.kind)).collect::<Vec<_>>();
        assert_eq!(
            kinds(&tp_params_of(&col)),
            [
                Some(TpParamKind::ColumnWeight),
                Some(TpParamKind::ColumnBias)
            ]
        );
        assert_eq!(
            kinds(&tp_params_of(&row)),
            [Some(TpParamKind::RowWeight), None]
        );
        let narrowed = narrow_to_pieces(col.clone(), 2, 1, &ad());
        assert_eq!(narrowed.weight.dims(), [HIDDEN / 2, D_IN]);
        assert_eq!(tp_params_of(&narrowed), tp_params_of(&col), "ids survive");
        let whole = vals(col.weight.val());
        assert_eq!(vals(narrowed.weight.val()), whole[whole.len() / 2..]);
    }

    #[test]
    fn a_layer_not_narrowed_for_its_rank_is_refused() {
        let (col, _) = layers();
        let mut sum: Box<dyn PieceSum> = Box::new(LocalPieceSum);
        let (r, _) = in_tp_scope(2, 0, &mut sum, || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                col.forward(input(&ad()));
            }))
        });
        let e = r.unwrap_err();
        let m = e.downcast_ref::<String>().unwrap();
        assert!(m.contains("was not narrowed"), "{m}");
    }
}
