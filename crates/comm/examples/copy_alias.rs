//! `memcpy` against [`lockstep_comm::copy`] at every distance `(dst − src) mod 4096` that matters:
//! the 4 KiB-aliasing slow path of `rep movsb` on AMD Zen (see `crates/comm/src/copy.rs`).
//!
//! `cargo run --release -p lockstep-comm --example copy_alias [BYTES]` (default 447 KiB, a ring
//! segment of the benchmark MLP's exact sum). Prints GB/s per distance, best of 20 copies each.

use std::time::Instant;

fn best_gbps(n: usize, mut copy: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..20 {
        let t = Instant::now();
        copy();
        best = best.min(t.elapsed().as_secs_f64());
    }
    n as f64 / best / 1e9
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("BYTES: a number"))
        .unwrap_or(447 * 1024);
    let src = vec![1u8; n + 8192];
    let mut dst = vec![2u8; n + 8192];
    let src_at = src.as_ptr().align_offset(4096);
    println!("{n} bytes; distance = (dst − src) mod 4096");
    println!(
        "{:>8} {:>12} {:>12}",
        "distance", "memcpy GB/s", "copy GB/s"
    );
    for distance in [0usize, 1, 4, 8, 12, 15, 16, 32, 48, 63, 64, 128, 2048, 4095] {
        let dst_at = (src.as_ptr() as usize + src_at + distance - dst.as_ptr() as usize) % 4096;
        let s = &src[src_at..src_at + n];
        let std_gbps = best_gbps(n, || dst[dst_at..dst_at + n].copy_from_slice(s));
        let ours = best_gbps(n, || {
            lockstep_comm::copy::copy_from_slice(&mut dst[dst_at..dst_at + n], s)
        });
        println!("{distance:>8} {std_gbps:>12.1} {ours:>12.1}");
    }
}
