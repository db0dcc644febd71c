//! The measured limit of this CPU for lockstep's matrix products: one core's f32 GEMM throughput
//! with the kernel set the dense layers use (`gemm`, single-threaded, square `n × n × n`), so that
//! a benchmark reads its achieved FLOP/s against what the hardware does, not only against
//! another framework. Best of several timed trials: a peak, not a typical figure.
//!
//! [`measure_instruction_peaks`] adds what the core's vector units do at all, with no memory in
//! the way: independent chains of AVX-512 f32 FMAs, and of AVX512-BF16 dot products (`vdpbf16ps`:
//! bf16 pairs multiplied and summed into f32) where the CPU has them, and whether it reports
//! AMX tiles. They say how far the GEMM is from the units' limit, and what bf16 products could
//! gain on this CPU before any kernel is written for them.

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
    // The first run warms caches, page faults and the kernel's packing buffers.
    let gflops = best_gflops(trial, trials, 2.0 * (n as f64).powi(3), &mut run);
    std::hint::black_box(&c);
    GemmPeak { gflops, n }
}

/// GFLOP/s of `run` (`flops` per call), the fastest of `trials` timed trials of at least `trial`
/// each, after one untimed call.
fn best_gflops(trial: Duration, trials: usize, flops: f64, mut run: impl FnMut()) -> f64 {
    run();
    (0..trials.max(1))
        .map(|_| {
            let (start, mut done) = (Instant::now(), 0u64);
            while start.elapsed() < trial || done == 0 {
                run();
                done += 1;
            }
            done as f64 * flops / start.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// One core's instruction throughput, GFLOP/s (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InstructionPeaks {
    /// AVX-512 f32 fused multiply-adds (32 flops each); `None` without AVX-512F.
    pub f32_fma_gflops: Option<f64>,
    /// AVX512-BF16 dot products (64 flops each); `None` without AVX512-BF16.
    pub bf16_dot_gflops: Option<f64>,
    /// Whether CPUID reports AMX tiles with bf16 (`AMX-TILE` and `AMX-BF16`); a VM may hide them.
    pub amx_bf16: bool,
}

/// Whether CPUID reports AMX tiles with bf16 (see [`InstructionPeaks::amx_bf16`]), without
/// measuring anything.
pub fn amx_bf16_reported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        units::amx_bf16()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Measure [`InstructionPeaks`] on this thread: each kernel run for at least `trial`, `trials`
/// times, the fastest trial kept.
pub fn measure_instruction_peaks(trial: Duration, trials: usize) -> InstructionPeaks {
    #[cfg(target_arch = "x86_64")]
    {
        let fma = std::arch::is_x86_feature_detected!("avx512f")
            .then(|| best_rate(trial, trials, 24 * 32, |n| unsafe { units::fma_chains(n) }));
        let bf16 = std::arch::is_x86_feature_detected!("avx512bf16")
            .then(|| best_rate(trial, trials, 24 * 64, |n| unsafe { units::bf16_chains(n) }));
        InstructionPeaks {
            f32_fma_gflops: fma,
            bf16_dot_gflops: bf16,
            amx_bf16: units::amx_bf16(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (trial, trials);
        InstructionPeaks {
            f32_fma_gflops: None,
            bf16_dot_gflops: None,
            amx_bf16: false,
        }
    }
}

/// GFLOP/s of `round` (`flops_per_iteration` × [`units::ITERATIONS`] per call), through
/// [`best_gflops`] (whose untimed call also wakes the vector units' power state).
#[cfg(target_arch = "x86_64")]
fn best_rate(
    trial: Duration,
    trials: usize,
    flops_per_iteration: u64,
    round: impl Fn(u64) -> f32,
) -> f64 {
    // The count goes through black_box on every call: a call with arguments the compiler can
    // see would be one it may hoist out of the timing loop (the kernels read no memory).
    let flops = (flops_per_iteration * units::ITERATIONS) as f64;
    best_gflops(trial, trials, flops, || {
        std::hint::black_box(round(std::hint::black_box(units::ITERATIONS)));
    })
}

/// The vector kernels: 24 independent accumulator chains (more than latency × ports on any
/// AVX-512 core, so throughput, not latency, bounds them).
#[cfg(target_arch = "x86_64")]
mod units {
    use std::arch::x86_64::*;

    /// Iterations of the 24 chains per timed call.
    pub(super) const ITERATIONS: u64 = 20_000;

    /// 24 chains `acc ← step(acc)`, `iterations` times, summed at the end (inlined into each
    /// kernel, with its instruction set).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn chains(iterations: u64, step: impl Fn(__m512) -> __m512) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 24];
        for _ in 0..iterations {
            for x in acc.iter_mut() {
                *x = step(*x);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x));
        _mm512_reduce_add_ps(sum)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma_chains(iterations: u64) -> f32 {
        let (a, b) = (_mm512_set1_ps(1.0), _mm512_set1_ps(1e-30));
        chains(iterations, |x| _mm512_fmadd_ps(a, b, x))
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn bf16_chains(iterations: u64) -> f32 {
        // bf16 1.0 and 2^-126 (the smallest normal): the sums stay tiny.
        let one: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi16(0x3f80)) };
        let tiny: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi16(0x0080)) };
        chains(iterations, |x| _mm512_dpbf16_ps(x, one, tiny))
    }

    /// CPUID leaf 7: EDX bit 22 (AMX-BF16) and bit 24 (AMX-TILE).
    pub(super) fn amx_bf16() -> bool {
        // On a CPU without leaf 7, CPUID answers with zeros (or another leaf's bits), which read
        // as "no AMX" in every CPU this code meets.
        let leaf = __cpuid_count(7, 0);
        leaf.edx & (1 << 22) != 0 && leaf.edx & (1 << 24) != 0
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

    #[test]
    fn instruction_peaks_are_positive_where_the_cpu_has_the_units() {
        let p = measure_instruction_peaks(Duration::from_millis(5), 1);
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(
                p.f32_fma_gflops.is_some(),
                std::arch::is_x86_feature_detected!("avx512f")
            );
            assert_eq!(
                p.bf16_dot_gflops.is_some(),
                std::arch::is_x86_feature_detected!("avx512bf16")
            );
        }
        for rate in [p.f32_fma_gflops, p.bf16_dot_gflops].into_iter().flatten() {
            assert!(rate > 0.0 && rate.is_finite(), "{p:?}");
        }
    }
}
