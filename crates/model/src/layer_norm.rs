//! `layer_norm`: layer normalisation over the last dimension as one pass per row forward and one
//! backward.
//!
//! Why: composed of burn ops, a layer norm is nine tracked ops (`mean_dim`, `sub`, `square`,
//! `mean_dim`, `add_scalar`, `sqrt`, `div`, `mul`, `add`), each a full pass with its own buffer
//! and its own backward. Here, per row of width `D`: `mean = Σx / D`, `c = x − mean`,
//! `var = Σc² / D`, `x̂ = c / √(var + ε)`, `y = x̂·gain + bias` (the same formula, ε = 10⁻⁵; sums
//! left to right). The backward, from the saved `x̂` and `1/√(var + ε)`:
//! `dbias = Σ_rows dy`, `dgain = Σ_rows dy·x̂`,
//! `dx = (g − mean(g) − x̂·mean(g·x̂)) / √(var + ε)` with `g = dy·gain`.
//!
//! Bits: rows are independent, and the gain and bias gradients are summed over fixed blocks of
//! rows whose partial sums are added in block order, so the worker's threads
//! ([`crate::compute_threads`]) split rows and blocks with the same bits at any count (tested).
//! Against burn's composed layer norm (tests): within 10⁻⁵ relative per value.

use std::sync::Arc;

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::flex::FlexTensor;
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::{Tensor, TensorData};
use rayon::prelude::*;

use crate::flex_values::{shape, values};

const EPS: f32 = 1e-5;

/// Rows per block of the gain and bias gradients' sums (fixed: the bits depend on it).
const BLOCK_ROWS: usize = 64;

#[backend_extension(Flex, Autodiff)]
pub trait RowLayerNorm: Backend {
    /// Layer norm of `x` over its last dimension, scaled by `gain` and shifted by `bias`.
    fn row_layer_norm(
        x: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl RowLayerNorm for Flex {
    fn row_layer_norm(
        x: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        forward(&x, &gain, &bias).0
    }
}

/// `x̂·gain + bias` over the last dimension of `x`, with its own backward.
/// Off the flex backend: composed of burn's operations (the same function, other bits).
pub fn layer_norm<const D: usize>(x: Tensor<D>, gain: Tensor<1>, bias: Tensor<1>) -> Tensor<D> {
    if !crate::flex_values::on_flex(&x) {
        let mean = x.clone().mean_dim(D - 1);
        let centred = x - mean;
        let var = centred.clone().square().mean_dim(D - 1);
        let y = centred / var.add_scalar(EPS).sqrt();
        return y * gain.unsqueeze() + bias.unsqueeze();
    }
    Tensor::from_dispatch(<Dispatch as RowLayerNorm>::row_layer_norm(
        x.into_dispatch(),
        gain.into_dispatch(),
        bias.into_dispatch(),
    ))
}

/// What the backward needs: `x̂` (row-major, as `x`), each row's `1/√(var + ε)`, and `gain`.
#[derive(Debug, Clone)]
struct Saved {
    x_hat: Arc<Vec<f32>>,
    inv_std: Arc<Vec<f32>>,
    gain: Arc<Vec<f32>>,
    shape: Vec<usize>,
}

/// Values of `x` above which its rows are split between threads, `BLOCK_ROWS` rows per piece.
const SPLIT_MIN: usize = 1 << 14;

fn forward_rows(
    x: &[f32],
    gain: &[f32],
    bias: &[f32],
    y: &mut [f32],
    x_hat: &mut [f32],
    inv_std: &mut [f32],
) {
    let width = gain.len();
    let grouped = inv_std.len() / GROUP * GROUP;
    let (x0, x1) = x.split_at(grouped * width);
    let (y0, y1) = y.split_at_mut(grouped * width);
    let (h0, h1) = x_hat.split_at_mut(grouped * width);
    let (s0, s1) = inv_std.split_at_mut(grouped);
    let groups = x0
        .chunks_exact(GROUP * width)
        .zip(y0.chunks_exact_mut(GROUP * width))
        .zip(h0.chunks_exact_mut(GROUP * width))
        .zip(s0.chunks_exact_mut(GROUP));
    for (((x, y), h), s) in groups {
        forward_group::<GROUP>(x, gain, bias, y, h, s);
    }
    let rest = x1
        .chunks_exact(width)
        .zip(y1.chunks_exact_mut(width))
        .zip(h1.chunks_exact_mut(width))
        .zip(s1.chunks_exact_mut(1));
    for (((x, y), h), s) in rest {
        forward_group::<1>(x, gain, bias, y, h, s);
    }
}

/// Rows taken [`GROUP`] at a time by the forward and the backward: each row's sums are still
/// one chain, left to right, but the group's chains advance side by side, so the additions of
/// one row no longer wait on each other's latency. The same operations per row: the same bits.
const GROUP: usize = 8;

/// [`forward_rows`] of `R` rows: `mean = Σx / D`, `c = x − mean`, `var = Σc² / D`, then per row
/// `x̂ = c / √(var + ε)` and `y = x̂·gain + bias`.
// Indexed loops: column `i` of every row of the group, so that the rows' chains advance together.
#[allow(clippy::needless_range_loop)]
fn forward_group<const R: usize>(
    x: &[f32],
    gain: &[f32],
    bias: &[f32],
    y: &mut [f32],
    x_hat: &mut [f32],
    inv_std: &mut [f32],
) {
    let width = gain.len();
    let x: [&[f32]; R] = std::array::from_fn(|r| &x[r * width..(r + 1) * width]);
    let mut sum = [0f32; R];
    for i in 0..width {
        for r in 0..R {
            sum[r] += x[r][i];
        }
    }
    let mean = sum.map(|s| s / width as f32);
    let mut sq = [0f32; R];
    {
        let h: [&mut [f32]; R] = split_rows(x_hat, width);
        for i in 0..width {
            for r in 0..R {
                let c = x[r][i] - mean[r];
                h[r][i] = c;
                sq[r] += c * c;
            }
        }
    }
    let rows = y
        .chunks_exact_mut(width)
        .zip(x_hat.chunks_exact_mut(width))
        .zip(inv_std.iter_mut())
        .zip(sq);
    for (((yr, hr), is), sq) in rows {
        let std = (sq / width as f32 + EPS).sqrt();
        *is = 1.0 / std;
        for ((o, h), (&g, &b)) in yr.iter_mut().zip(hr.iter_mut()).zip(gain.iter().zip(bias)) {
            *h /= std;
            *o = *h * g + b;
        }
    }
}

/// `v`'s first `R` rows of `width` values, each its own slice.
fn split_rows<const R: usize>(v: &mut [f32], width: usize) -> [&mut [f32]; R] {
    let mut rows = v.chunks_exact_mut(width);
    std::array::from_fn(|_| rows.next().expect("R rows"))
}

/// `(y, saved)`.
fn forward(x: &FlexTensor, gain: &FlexTensor, bias: &FlexTensor) -> (FlexTensor, Saved) {
    let dims = shape(x);
    let width = *dims
        .last()
        .expect("layer_norm: a scalar has no last dimension");
    let (xv, gv, bv) = (values(x), values(gain), values(bias));
    assert_eq!(gv.len(), width, "layer_norm: gain length");
    assert_eq!(bv.len(), width, "layer_norm: bias length");
    let rows = xv.len().checked_div(width).unwrap_or(0);
    let mut y = vec![0f32; xv.len()];
    let mut x_hat = vec![0f32; xv.len()];
    let mut inv_std = vec![0f32; rows];
    if crate::split_between_threads(xv.len(), SPLIT_MIN) {
        let block = BLOCK_ROWS * width;
        y.par_chunks_mut(block)
            .zip(x_hat.par_chunks_mut(block))
            .zip(inv_std.par_chunks_mut(BLOCK_ROWS))
            .zip(xv.par_chunks(block))
            .for_each(|(((y, h), s), x)| forward_rows(x, &gv, &bv, y, h, s));
    } else if width > 0 {
        forward_rows(&xv, &gv, &bv, &mut y, &mut x_hat, &mut inv_std);
    }
    let saved = Saved {
        x_hat: Arc::new(x_hat),
        inv_std: Arc::new(inv_std),
        gain: Arc::new(gv.into_owned()),
        shape: dims.clone(),
    };
    (FlexTensor::from_data(TensorData::new(y, dims)), saved)
}

/// One block of rows: `dx` for each, and the block's partial sums of `dy·x̂` and `dy`.
fn backward_rows(s: &Saved, dy: &[f32], first_row: usize, dx: &mut [f32]) -> (Vec<f32>, Vec<f32>) {
    let width = s.gain.len();
    let mut sums = (vec![0f32; width], vec![0f32; width]);
    let at = first_row * width;
    let x_hat = &s.x_hat[at..at + dy.len()];
    let rows = dy.len() / width;
    let mut r = 0;
    // Groups of GROUP rows, then the rest one by one (rows in order: the gain and bias sums
    // add them in row order either way).
    while r < rows {
        let (span, one) = match rows - r >= GROUP {
            true => (GROUP * width, false),
            false => (width, true),
        };
        let (dy, x_hat) = (&dy[r * width..][..span], &x_hat[r * width..][..span]);
        let (dx, inv) = (&mut dx[r * width..][..span], &s.inv_std[first_row + r..]);
        match one {
            false => backward_group::<GROUP>(&s.gain, dy, x_hat, inv, dx, &mut sums),
            true => backward_group::<1>(&s.gain, dy, x_hat, inv, dx, &mut sums),
        }
        r += span / width;
    }
    sums
}

/// [`backward_rows`] of `R` rows: `dgain += dy·x̂`, `dbias += dy` row after row;
/// `g = dy·gain`; `dx = (g − mean(g) − x̂·mean(g·x̂))·inv_std` per row.
fn backward_group<const R: usize>(
    gain: &[f32],
    dy: &[f32],
    x_hat: &[f32],
    inv_std: &[f32],
    dx: &mut [f32],
    (dgain, dbias): &mut (Vec<f32>, Vec<f32>),
) {
    let width = gain.len();
    let d: [&[f32]; R] = std::array::from_fn(|r| &dy[r * width..(r + 1) * width]);
    let h: [&[f32]; R] = std::array::from_fn(|r| &x_hat[r * width..(r + 1) * width]);
    // The gain and bias sums row after row, each row one vector pass over the columns.
    for (d, h) in d.iter().zip(&h) {
        for ((dg, db), (&d, &h)) in dgain.iter_mut().zip(dbias.iter_mut()).zip(d.iter().zip(*h)) {
            *dg += d * h;
            *db += d;
        }
    }
    let (mut mean_g, mut mean_gh) = ([0f32; R], [0f32; R]);
    for (i, &g) in gain.iter().enumerate() {
        for r in 0..R {
            let (d, h) = (d[r][i], h[r][i]);
            let gd = d * g;
            mean_g[r] += gd;
            mean_gh[r] += gd * h;
        }
    }
    for (r, dxr) in dx.chunks_exact_mut(width).enumerate() {
        let (mean_g, mean_gh) = (mean_g[r] / width as f32, mean_gh[r] / width as f32);
        let inv = inv_std[r];
        for ((o, (&d, &h)), &g) in dxr.iter_mut().zip(d[r].iter().zip(h[r])).zip(gain) {
            *o = (d * g - mean_g - h * mean_gh) * inv;
        }
    }
}

/// `(dx, dgain, dbias)`.
fn backward(s: &Saved, dy: FlexTensor) -> (FlexTensor, FlexTensor, FlexTensor) {
    let width = s.gain.len();
    let dyv = values(&dy);
    assert_eq!(shape(&dy), s.shape, "layer_norm: gradient shape");
    let mut dx = vec![0f32; dyv.len()];
    let (mut dgain, mut dbias) = (vec![0f32; width], vec![0f32; width]);
    if width > 0 {
        let block = BLOCK_ROWS * width;
        // Blocks of BLOCK_ROWS rows on any number of threads; their partial sums added in order.
        let partials: Vec<(Vec<f32>, Vec<f32>)> =
            if crate::split_between_threads(dyv.len(), SPLIT_MIN) {
                dx.par_chunks_mut(block)
                    .zip(dyv.par_chunks(block))
                    .enumerate()
                    .map(|(i, (dx, dy))| backward_rows(s, dy, i * BLOCK_ROWS, dx))
                    .collect()
            } else {
                dx.chunks_mut(block)
                    .zip(dyv.chunks(block))
                    .enumerate()
                    .map(|(i, (dx, dy))| backward_rows(s, dy, i * BLOCK_ROWS, dx))
                    .collect()
            };
        for (pg, pb) in partials {
            for (a, b) in dgain.iter_mut().zip(&pg) {
                *a += b;
            }
            for (a, b) in dbias.iter_mut().zip(&pb) {
                *a += b;
            }
        }
    }
    (
        FlexTensor::from_data(TensorData::new(dx, s.shape.clone())),
        FlexTensor::from_data(TensorData::new(dgain, [width])),
        FlexTensor::from_data(TensorData::new(dbias, [width])),
    )
}

#[derive(Debug)]
struct LayerNormBackward;

impl Backward<Flex, 3> for LayerNormBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_gain, node_bias] = ops.parents;
        let dy = grads.consume::<Flex>(&ops.node);
        let (dx, dgain, dbias) = backward(&ops.state, dy);
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, dx);
        }
        if let Some(node) = node_gain {
            grads.register::<Flex>(node.id, dgain);
        }
        if let Some(node) = node_bias {
            grads.register::<Flex>(node.id, dbias);
        }
    }
}

impl<C: CheckpointStrategy> RowLayerNorm for Autodiff<Flex, C> {
    fn row_layer_norm(
        x: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match LayerNormBackward
            .prepare::<C>([x.node(), gain.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, saved) = forward(
                    &x.into_primitive(),
                    &gain.into_primitive(),
                    &bias.into_primitive(),
                );
                prep.finish(saved, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(
                forward(
                    &x.into_primitive(),
                    &gain.into_primitive(),
                    &bias.into_primitive(),
                )
                .0,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn data(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104729) % 2003) as f32 / 500.0 - 2.0)
            .collect()
    }

    /// burn's composed layer norm, as `transformer.rs` computed it before.
    fn composed(x: Tensor<3>, gain: Tensor<1>, bias: Tensor<1>) -> Tensor<3> {
        let mean = x.clone().mean_dim(2);
        let centred = x - mean;
        let var = centred.clone().square().mean_dim(2);
        let y = centred / var.add_scalar(1e-5).sqrt();
        y * gain.unsqueeze() + bias.unsqueeze()
    }

    /// `(y, dx, dgain, dbias)` of `Σ y·w`.
    fn run(ours: bool, [n, t, d]: [usize; 3]) -> [Vec<f32>; 4] {
        let dev = Device::flex().autodiff();
        let leaf = |v: Vec<f32>, s: [usize; 3]| Tensor::<3>::from_data(TensorData::new(v, s), &dev);
        let x = leaf(data(n * t * d, 1), [n, t, d]).require_grad();
        let g = Tensor::<1>::from_data(TensorData::new(data(d, 2), [d]), &dev).require_grad();
        let b = Tensor::<1>::from_data(TensorData::new(data(d, 3), [d]), &dev).require_grad();
        let w = leaf(data(n * t * d, 4), [n, t, d]);
        let y = if ours {
            layer_norm(x.clone(), g.clone(), b.clone())
        } else {
            composed(x.clone(), g.clone(), b.clone())
        };
        let grads = (y.clone() * w).sum().backward();
        let v = |t: Tensor<3>| t.into_data().iter::<f32>().collect::<Vec<f32>>();
        let v1 = |t: Tensor<1>| t.into_data().iter::<f32>().collect::<Vec<f32>>();
        [
            v(y),
            v(x.grad(&grads).unwrap()),
            v1(g.grad(&grads).unwrap()),
            v1(b.grad(&grads).unwrap()),
        ]
    }

    /// Forward and all three gradients within 10⁻⁵ (relative to each tensor's largest value) of
    /// burn's composed layer norm, on the transformer's shape and on odd ones.
    #[test]
    fn matches_burns_composed_layer_norm() {
        for shape in [[8, 64, 128], [3, 5, 7], [1, 1, 1], [2, 200, 33]] {
            let (ours, theirs) = (run(true, shape), run(false, shape));
            for (k, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
                for (i, (p, q)) in a.iter().zip(b).enumerate() {
                    assert!(
                        (p - q).abs() <= 1e-5 * scale,
                        "{shape:?} output {k}[{i}]: {p} vs {q}"
                    );
                }
            }
        }
    }

    /// 1–4 threads give the same bits in every output.
    #[test]
    fn threads_give_the_same_bits() {
        let bits =
            |o: [Vec<f32>; 4]| o.map(|v| v.into_iter().map(f32::to_bits).collect::<Vec<_>>());
        let on = |threads: usize| crate::on_threads(threads, || bits(run(true, [8, 67, 128])));
        let want = on(1);
        for threads in 2..=4 {
            assert!(on(threads) == want, "{threads} threads");
        }
    }

    /// The row-by-row forward and backward this file had before rows were grouped: the
    /// reference for their bits.
    fn forward_rows_one_by_one(
        x: &[f32],
        gain: &[f32],
        bias: &[f32],
        y: &mut [f32],
        x_hat: &mut [f32],
        inv_std: &mut [f32],
    ) {
        let width = gain.len();
        let rows = x
            .chunks_exact(width)
            .zip(y.chunks_exact_mut(width))
            .zip(x_hat.chunks_exact_mut(width))
            .zip(inv_std.iter_mut());
        for (((xr, yr), hr), is) in rows {
            let mut sum = 0f32;
            for &v in xr {
                sum += v;
            }
            let mean = sum / width as f32;
            let mut sq = 0f32;
            for (h, &v) in hr.iter_mut().zip(xr) {
                let c = v - mean;
                *h = c;
                sq += c * c;
            }
            let std = (sq / width as f32 + EPS).sqrt();
            *is = 1.0 / std;
            for ((o, h), (&g, &b)) in yr.iter_mut().zip(hr.iter_mut()).zip(gain.iter().zip(bias)) {
                *h /= std;
                *o = *h * g + b;
            }
        }
    }

    fn backward_rows_one_by_one(
        s: &Saved,
        dy: &[f32],
        first_row: usize,
        dx: &mut [f32],
    ) -> (Vec<f32>, Vec<f32>) {
        let width = s.gain.len();
        let (mut dgain, mut dbias) = (vec![0f32; width], vec![0f32; width]);
        let at = first_row * width;
        let x_hat = &s.x_hat[at..at + dy.len()];
        let rows = dy
            .chunks_exact(width)
            .zip(x_hat.chunks_exact(width))
            .zip(dx.chunks_exact_mut(width));
        for (r, ((dyr, hr), dxr)) in rows.enumerate() {
            let (mut mean_g, mut mean_gh) = (0f32, 0f32);
            for (((&d, &h), &g), (dg, db)) in dyr
                .iter()
                .zip(hr)
                .zip(s.gain.iter())
                .zip(dgain.iter_mut().zip(dbias.iter_mut()))
            {
                *dg += d * h;
                *db += d;
                let gd = d * g;
                mean_g += gd;
                mean_gh += gd * h;
            }
            let (mean_g, mean_gh) = (mean_g / width as f32, mean_gh / width as f32);
            let inv = s.inv_std[first_row + r];
            for ((o, (&d, &h)), &g) in dxr.iter_mut().zip(dyr.iter().zip(hr)).zip(s.gain.iter()) {
                *o = (d * g - mean_g - h * mean_gh) * inv;
            }
        }
        (dgain, dbias)
    }

    /// Grouped rows give the row-by-row bits: every output, on widths and row counts below,
    /// at and above a group, and on the transformer's shape.
    #[test]
    fn grouped_rows_keep_the_row_by_row_bits() {
        for (rows, width) in [
            (1, 1),
            (7, 5),
            (8, 128),
            (9, 33),
            (67, 128),
            (130, 64),
            (17, 1),
        ] {
            let (gain, bias, x) = (data(width, 2), data(width, 3), data(rows * width, 1));
            let run = |grouped: bool| {
                let (mut y, mut h, mut s) =
                    (vec![0f32; x.len()], vec![0f32; x.len()], vec![0f32; rows]);
                match grouped {
                    true => forward_rows(&x, &gain, &bias, &mut y, &mut h, &mut s),
                    false => forward_rows_one_by_one(&x, &gain, &bias, &mut y, &mut h, &mut s),
                }
                let saved = Saved {
                    x_hat: Arc::new(h.clone()),
                    inv_std: Arc::new(s.clone()),
                    gain: Arc::new(gain.clone()),
                    shape: vec![rows, width],
                };
                let dy = data(rows * width, 4);
                // From row 1 on, as a later block of rows is.
                let first = usize::from(rows > 1);
                let mut dx = vec![0f32; dy.len() - first * width];
                let (dg, db) = match grouped {
                    true => backward_rows(&saved, &dy[first * width..], first, &mut dx),
                    false => backward_rows_one_by_one(&saved, &dy[first * width..], first, &mut dx),
                };
                [y, h, s, dx, dg, db].map(|v| v.into_iter().map(f32::to_bits).collect::<Vec<_>>())
            };
            assert!(run(true) == run(false), "{rows} rows of {width}");
        }
    }
}
