//! Closed forms of the collective sweep, shared by `tests/collectives.rs` (threads on the
//! in-process transport) and `examples/mpi_sweep.rs` (processes under mpirun): every rank's data
//! and what each reduction must give, exactly, for any world size.
#![allow(dead_code)] // each user takes a different subset

use lockstep_comm::{Algorithm, Element, ReduceOp};

pub trait TestElem: Element + std::fmt::Debug {
    fn from_i64(v: i64) -> Self;
}
impl TestElem for f32 {
    fn from_i64(v: i64) -> Self {
        v as f32
    }
}
impl TestElem for f64 {
    fn from_i64(v: i64) -> Self {
        v as f64
    }
}
impl TestElem for i32 {
    fn from_i64(v: i64) -> Self {
        v as i32
    }
}
impl TestElem for i64 {
    fn from_i64(v: i64) -> Self {
        v
    }
}

/// Rank `rank`'s element `i`: `v(i) · w` with `v(i) = i mod 101 − 50` and a weight `w ∈ 1..=n`
/// that is a permutation over the ranks for every `i`, so the largest contribution moves around.
/// All values and sums are small integers, exact in f32.
pub fn contribution(rank: usize, n: usize, i: usize) -> i64 {
    (i as i64 % 101 - 50) * ((rank + i) % n + 1) as i64
}

pub fn expected<T: TestElem>(n: usize, i: usize, op: ReduceOp) -> T {
    let v = i as i64 % 101 - 50;
    let n64 = n as i64;
    let sum = v * n64 * (n64 + 1) / 2;
    match op {
        ReduceOp::Sum => T::from_i64(sum),
        ReduceOp::Mean => T::from_i64(sum).div_count(n),
        ReduceOp::Max => T::from_i64(if v >= 0 { v * n64 } else { v }),
        ReduceOp::Min => T::from_i64(if v >= 0 { v } else { v * n64 }),
    }
}

pub fn local_data<T: TestElem>(rank: usize, n: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_i64(contribution(rank, n, i)))
        .collect()
}

pub const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];
pub const ALGS: [Algorithm; 3] = [
    Algorithm::Ring,
    Algorithm::RecursiveDoubling,
    Algorithm::Auto,
];
