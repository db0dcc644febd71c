//! Which matrix-multiply kernel set burn flex runs on this CPU, and whether ranks agree on it.
//!
//! Why: flex multiplies matrices with the `gemm` crate, which picks its micro-kernels once per
//! process from the instruction set (`init_gemm_fn` in gemm-common: AVX-512F when built with its
//! `x86-v4` feature — our cargo feature `avx512` — else FMA, else scalar). Each set sums in a
//! different order, so results differ in the last bits between sets: a reproducible job needs
//! every rank on the same set, and a run should say which set produced its bits. This module
//! repeats gemm's choice with the same `is_x86_feature_detected!` tests, so it names the kernels
//! gemm really uses (it cannot see a `x86-v4` turned on by some other crate than this one).

use std::fmt;

/// A matrix-multiply kernel set, as named in `summary.json` (`compute.kernels`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// 512-bit AVX-512F kernels (cargo feature `avx512`, CPU with AVX-512F).
    Avx512f,
    /// 256-bit AVX2/FMA kernels.
    Fma,
    /// Portable kernels (no FMA, or not x86).
    Scalar,
}

impl Kernels {
    /// The set gemm picks in this process (same tests, same order as gemm-common 0.19).
    pub fn detect() -> Kernels {
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        {
            if cfg!(feature = "avx512") && std::arch::is_x86_feature_detected!("avx512f") {
                return Kernels::Avx512f;
            }
            if std::arch::is_x86_feature_detected!("fma") {
                return Kernels::Fma;
            }
        }
        Kernels::Scalar
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernels::Avx512f => "avx512f",
            Kernels::Fma => "fma",
            Kernels::Scalar => "scalar",
        }
    }
}

impl fmt::Display for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Every rank's kernel name (index = rank) against rank 0's: the first rank that differs, with
/// its name and rank 0's, or `None` when all agree.
pub fn first_mismatch(names: &[String]) -> Option<(usize, &str, &str)> {
    let ours = names.first()?;
    names
        .iter()
        .enumerate()
        .find(|(_, n)| *n != ours)
        .map(|(rank, n)| (rank, n.as_str(), ours.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn agreeing_ranks_pass() {
        assert_eq!(first_mismatch(&names(&["fma", "fma", "fma"])), None);
        assert_eq!(first_mismatch(&names(&["avx512f"])), None);
        assert_eq!(first_mismatch(&[]), None);
    }

    #[test]
    fn first_differing_rank_is_named() {
        assert_eq!(
            first_mismatch(&names(&["avx512f", "avx512f", "fma", "scalar"])),
            Some((2, "fma", "avx512f"))
        );
    }
}
