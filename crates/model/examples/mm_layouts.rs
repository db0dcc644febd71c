//! Matrix-multiply layouts in burn flex: why `dense.rs` computes a linear layer's input gradient
//! as `(W · dyᵀ)ᵀ`. `cargo run --release -p lockstep-model --example mm_layouts` prints the median
//! time of a layer's forward and of its input gradient computed burn's way (`dy · Wᵀ`, a
//! transposed view of the weight) and this crate's way, at the benchmark MLPs' shapes.
use burn::tensor::{Device, Tensor, TensorData};
use std::time::Instant;
fn t(r: usize, c: usize, dev: &Device) -> Tensor<2> {
    let v: Vec<f32> = (0..r * c)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    Tensor::from_data(TensorData::new(v, [r, c]), dev)
}
fn time(name: &str, f: impl Fn() -> Tensor<2>) {
    let _ = f();
    let mut v = Vec::new();
    for _ in 0..30 {
        let s = Instant::now();
        let o = f();
        let _ = o.into_data();
        v.push(s.elapsed().as_secs_f64() * 1e3);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    println!("{name:40} {:.3} ms", v[15]);
}
fn tr(x: &Tensor<2>, dev: &Device) -> Tensor<2> {
    let [r, c] = x.dims();
    let v = x.clone().into_data().try_to_vec::<f32>().unwrap();
    let mut o = vec![0f32; r * c];
    const B: usize = 32;
    for i0 in (0..r).step_by(B) {
        for j0 in (0..c).step_by(B) {
            for i in i0..(i0 + B).min(r) {
                for j in j0..(j0 + B).min(c) {
                    o[j * r + i] = v[i * c + j];
                }
            }
        }
    }
    Tensor::from_data(TensorData::new(o, [c, r]), dev)
}
fn main() {
    let dev = Device::flex();
    for (b, i, o) in [(64, 512, 512), (128, 2048, 2048)] {
        println!("b={b} i={i} o={o}");
        let x = t(b, i, &dev);
        let w = t(i, o, &dev);
        let dy = t(b, o, &dev);
        time("  fwd x @ w", || x.clone().matmul(w.clone()));
        time("  dX = dy @ w^T (view)", || {
            dy.clone().matmul(w.clone().transpose())
        });
        time("  dX = (w @ dy^T contig)^T, both tr", || {
            tr(&w.clone().matmul(tr(&dy, &dev)), &dev)
        });
        time("  dW = x^T (view) @ dy", || {
            x.clone().transpose().matmul(dy.clone())
        });
        time("  dW = tr(x) @ dy", || tr(&x, &dev).matmul(dy.clone()));
        time("  tr(dy) alone", || tr(&dy, &dev));
        time("  burn transpose+into_data dy", || {
            let d = dy.clone().transpose().into_data();
            Tensor::from_data(d, &dev)
        });
    }
}
