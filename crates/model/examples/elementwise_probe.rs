//! Times lockstep's GELU and softmax kernels on the Shakespeare transformer's shapes, against a
//! copy of the same number of bytes: `cargo run --release -p
//! lockstep-model --example elementwise_probe`.
use burn::tensor::{Device, Distribution, Tensor};
use lockstep_model::ops::{gelu, softmax_last};
use std::time::Instant;

fn time(label: &str, reps: usize, elems: usize, mut f: impl FnMut()) {
    f();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    let s = t.elapsed().as_secs_f64() / reps as f64;
    println!(
        "{label:<28} {:>8.3} ms  {:>6.2} ns/value",
        s * 1e3,
        s * 1e9 / elems as f64
    );
}

fn main() {
    let device = Device::flex();
    // One micro-batch of 8 × 64 tokens: the MLP's hidden activations [512, 512] and the
    // attention scores [8, 4, 64, 64].
    let h: Tensor<2> = Tensor::random([512, 512], Distribution::Normal(0.0, 1.0), &device);
    let s: Tensor<4> = Tensor::random([8, 4, 64, 64], Distribution::Normal(0.0, 1.0), &device);
    let n = 512 * 512;
    time("gelu forward [512, 512]", 200, n, || {
        let _ = gelu(h.clone()).into_data();
    });
    time("copy [512, 512]", 200, n, || {
        let _ = (h.clone() + 0.0).into_data();
    });
    time("softmax [8, 4, 64, 64]", 200, 8 * 4 * 64 * 64, || {
        let _ = softmax_last(s.clone()).into_data();
    });
}
