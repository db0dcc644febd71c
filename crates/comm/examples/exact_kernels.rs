//! The exact sum's loops in the copy this CPU runs against the portable copy, in one process,
//! interleaved: `cargo run --release -p lockstep-comm --example exact_kernels [-- OUT.json]`.
//! Case: one worker's exact sum of `PARTS` micro-batch gradients of `LEN` values (default: the
//! benchmark MLP 784-512-512-10, 669,706 values, 4 micro-batches), as a 1-worker step runs it
//! (`reduce_local_with_buckets`). Prints and writes the median time of each copy, their range
//! over `REPS` repetitions, and checks both give the same bits.
use std::time::Instant;

use lockstep_comm::exact::ExactReducer;
use lockstep_comm::fixed_point::{portable_only, tier};

fn env(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let (len, parts, reps) = (env("LEN", 669_706), env("PARTS", 4), env("REPS", 21));
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let grads: Vec<Vec<f32>> = (0..parts)
        .map(|_| {
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1e-2
                })
                .collect()
        })
        .collect();
    let refs: Vec<&[f32]> = grads.iter().map(|g| g.as_slice()).collect();
    let mut reducer = ExactReducer::new(1 << 20);
    let buckets: Vec<_> = reducer.buckets(len).map(|(s, e)| s..e).collect();
    let mut run = |out: &mut Vec<f32>| {
        let t = Instant::now();
        reducer
            .reduce_local_with_buckets(&refs, parts, out, &buckets)
            .unwrap();
        t.elapsed().as_secs_f64()
    };
    let (mut best_out, mut portable_out) = (vec![0f32; len], vec![0f32; len]);
    let (mut best, mut portable) = (Vec::new(), Vec::new());
    for r in 0..reps + 2 {
        // Alternate which copy goes first; the first two repetitions warm up.
        let (b, p) = if r % 2 == 0 {
            let b = run(&mut best_out);
            (b, portable_only(|| run(&mut portable_out)))
        } else {
            let p = portable_only(|| run(&mut portable_out));
            (run(&mut best_out), p)
        };
        if r >= 2 {
            best.push(b);
            portable.push(p);
        }
    }
    let same = best_out
        .iter()
        .zip(&portable_out)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    let ratios: Vec<f64> = portable.iter().zip(&best).map(|(p, b)| p / b).collect();
    let (rmin, rmax) = ratios
        .iter()
        .fold((f64::MAX, 0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
    let (mb, mp) = (median(&mut best), median(&mut portable));
    let json = format!(
        "{{\"len\": {len}, \"parts\": {parts}, \"reps\": {reps}, \"tier\": \"{}\", \"median_ms\": {:.4}, \"portable_median_ms\": {:.4}, \"speedup_median\": {:.3}, \"speedup_min\": {rmin:.3}, \"speedup_max\": {rmax:.3}, \"same_bits\": {same}}}",
        tier().name(),
        mb * 1e3,
        mp * 1e3,
        mp / mb
    );
    println!("{json}");
    if let Some(path) = std::env::args().nth(1) {
        std::fs::write(path, json + "\n").expect("writing the JSON");
    }
    assert!(same, "the copies gave different bits");
}
