//! The measured limit of this CPU for lockstep's matrix products: one core's f32 GEMM throughput
//! with the kernel set the dense layers use (`gemm`, single-threaded, square `n × n × n`), so that
//! a benchmark reads its achieved FLOP/s against what the hardware does, not only against
//! another framework. Best of several timed trials: a peak, not a typical figure.

use std::time::{Duration, Instant};

use crate::gemm_call::{product, Operand};

/// One core's measured f32 matrix-multiply peak.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmPeak {
    /// Billions of floating-point operations per second (`2·n³` per product).
    pub gflops: f64,
    /// The square size measured.
    pub n: usize,
}

/// Measure [`GemmPeak`] at `n × n × n` on this thread: products repeated for at least `trial`,
/// `trials` times, the fastest trial kept.
pub fn measure_gemm_peak(n: usize, trial: Duration, trials: usize) -> GemmPeak {
    let a: Vec<f32> = (0..n * n)
        .map(|i| ((i % 97) as f32 - 48.0) / 64.0)
        .collect();
    let b: Vec<f32> = (0..n * n)
        .map(|i| ((i % 89) as f32 - 44.0) / 64.0)
        .collect();
    let mut c = vec![0f32; n * n];
    let lhs = Operand::rows_of(&a, 0, n, n, n as isize);
    let rhs = Operand::rows_of(&b, 0, n, n, n as isize);
    let mut run = || {
        // SAFETY: `c` holds n × n values, row-major, written only here.
        unsafe {
            product(
                lhs,
                rhs,
                c.as_mut_ptr(),
                n as isize,
                1,
                gemm::Parallelism::None,
            )
        }
    };
    run(); // warm-up: caches, page faults, the kernel's packing buffers
    let flops = 2.0 * (n as f64).powi(3);
    let best = (0..trials.max(1))
        .map(|_| {
            let (start, mut done) = (Instant::now(), 0u64);
            while start.elapsed() < trial || done == 0 {
                run();
                done += 1;
            }
            done as f64 * flops / start.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max);
    std::hint::black_box(&c);
    GemmPeak {
        gflops: best / 1e9,
        n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_a_positive_finite_rate() {
        let p = measure_gemm_peak(64, Duration::from_millis(5), 2);
        assert!(p.gflops > 0.0 && p.gflops.is_finite(), "{p:?}");
        assert_eq!(p.n, 64);
    }
}
