//! Learning-rate schedule: linear warmup, then cosine decay to a floor.

use serde::{Deserialize, Serialize};

/// `lr(step)` for 0-based optimizer steps:
/// - warmup, `step < warmup_steps`: `base_lr * (step + 1) / warmup_steps` (the first step
///   already moves; the last warmup step reaches `base_lr`);
/// - cosine, `warmup_steps <= step < total_steps`: with
///   `t = (step - warmup_steps) / (total_steps - warmup_steps)`,
///   `min_lr + (base_lr - min_lr) * (1 + cos(pi * t)) / 2`;
/// - `step >= total_steps`: `min_lr`.
///
/// Computed in f64 with our own cosine (a fixed Taylor polynomial, only IEEE arithmetic) so
/// every rank on every machine gets the same f32, whatever its libm.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub base_lr: f32,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Step at which the cosine reaches `min_lr`.
    pub total_steps: u64,
    /// Floor reached at `total_steps` and kept afterwards.
    pub min_lr: f32,
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f32) -> Self {
        LrSchedule {
            base_lr: lr,
            warmup_steps: 0,
            total_steps: 0,
            min_lr: lr,
        }
    }

    /// Learning rate for the 0-based step `step`.
    pub fn lr(&self, step: u64) -> f32 {
        let base = self.base_lr as f64;
        if step < self.warmup_steps {
            return (base * (step + 1) as f64 / self.warmup_steps as f64) as f32;
        }
        if step >= self.total_steps {
            return self.min_lr;
        }
        let min = self.min_lr as f64;
        let t = (step - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
        (min + (base - min) * 0.5 * (1.0 + cos_pi(t))) as f32
    }
}

/// `cos(pi * t)` for `t` in [0, 1], accurate to ~1e-16, from arithmetic only.
fn cos_pi(t: f64) -> f64 {
    let x = std::f64::consts::PI * t;
    // Reflect into [0, pi/2] where the series converges fast: cos(x) = -cos(pi - x).
    if x > std::f64::consts::FRAC_PI_2 {
        -cos_series(std::f64::consts::PI - x)
    } else {
        cos_series(x)
    }
}

/// Taylor series of cos to x^26 by Horner's rule; for |x| <= pi/2 the first omitted term is
/// below 1e-20.
fn cos_series(x: f64) -> f64 {
    let x2 = x * x;
    let mut acc = 1.0f64;
    // cos x = 1 - x^2/(1*2) (1 - x^2/(3*4) (1 - x^2/(5*6) (...)))
    for k in (1..=13u32).rev() {
        let d = ((2 * k - 1) * (2 * k)) as f64;
        acc = 1.0 - x2 / d * acc;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::cos_pi;

    #[test]
    fn cos_pi_matches_std_cos() {
        for i in 0..=1000 {
            let t = i as f64 / 1000.0;
            let want = (std::f64::consts::PI * t).cos();
            assert!((cos_pi(t) - want).abs() < 1e-15, "t = {t}");
        }
        assert_eq!(cos_pi(0.0), 1.0);
        assert_eq!(cos_pi(1.0), -1.0);
    }
}
