//! Helpers shared by the integration tests: small specs and deterministic synthetic data.
#![allow(dead_code)]

use lockstep_model::ModelSpec;

pub fn tiny_mlp() -> ModelSpec {
    ModelSpec::Mlp {
        input: 5,
        hidden: vec![7, 6],
        classes: 3,
    }
}

pub fn tiny_cnn() -> ModelSpec {
    ModelSpec::Cnn {
        channels: 2,
        height: 6,
        width: 5,
        conv: vec![3, 4],
        hidden: 5,
        classes: 3,
    }
}

/// Deterministic pseudo-random values in [-1, 1) (xorshift64*), independent of the crate's RNG.
pub fn noise(seed: u64, len: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = s.wrapping_mul(0x2545_F491_4F6C_DD1D);
            ((r >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

pub fn labels(seed: u64, n: usize, classes: usize) -> Vec<u8> {
    noise(seed, n)
        .iter()
        .map(|v| (((v + 1.0) * 0.5 * classes as f32) as usize).min(classes - 1) as u8)
        .collect()
}

/// A linearly separable problem: class c lives around the point 2 * e_c in `dim` dimensions,
/// with noise of amplitude 0.5.
pub fn blobs(n: usize, dim: usize, classes: usize, seed: u64) -> (Vec<f32>, Vec<u8>) {
    let eps = noise(seed, n * dim);
    let mut x = Vec::with_capacity(n * dim);
    let mut y = Vec::with_capacity(n);
    for i in 0..n {
        let c = i % classes;
        for d in 0..dim {
            let centre = if d == c { 2.0 } else { 0.0 };
            x.push(centre + 0.5 * eps[i * dim + d]);
        }
        y.push(c as u8);
    }
    (x, y)
}
