//! Optimizers on flat f32 slices.
//!
//! Why flat and here: the state is one vector per moment, the same length and order as the
//! parameters, so it is independent of the world size, trivially checkpointed, and can be
//! sharded by element range. Updates are plain elementwise loops in f32 with no fused
//! multiply-add (Rust never contracts `a * b + c`), so every machine computes the same bits.
//! Being elementwise, an update is also split between the worker's threads
//! ([`crate::compute_threads`]) in chunks of [`CHUNK`] values, with the same bits at any count.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Values per piece of work when an update runs on several threads: large enough that a piece
/// costs far more than handing it to a thread (≈ 0.1 ms of memory traffic), small enough to
/// balance the benchmark MLP's 670k values over a few threads.
const CHUNK: usize = 1 << 15;

/// Which optimizer, with its hyper-parameters (the learning rate comes from the schedule).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimizerSpec {
    /// SGD with PyTorch's semantics: `g = grad + wd * p`; `buf = momentum * buf + g`;
    /// step along `g + momentum * buf` (Nesterov) or `buf`; no dampening. With
    /// `momentum == 0` there is no state.
    Sgd {
        /// Momentum factor (0 disables momentum).
        momentum: f32,
        /// L2 penalty added to the gradient.
        weight_decay: f32,
        /// Use Nesterov momentum.
        nesterov: bool,
    },
    /// Adam (Kingma & Ba) with PyTorch's `Adam` semantics: L2 penalty `g = grad + wd * p`, then
    /// bias-corrected moments as AdamW's.
    Adam {
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Denominator stabiliser.
        eps: f32,
        /// L2 penalty added to the gradient.
        weight_decay: f32,
    },
    /// AdamW (Loshchilov & Hutter): decoupled weight decay `p *= 1 - lr * wd`, then Adam with
    /// bias-corrected moments: `p -= lr * m_hat / (sqrt(v_hat) + eps)`.
    AdamW {
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Denominator stabiliser.
        eps: f32,
        /// Decoupled weight decay.
        weight_decay: f32,
    },
}

/// Optimizer state: moment vectors plus the number of steps taken.
#[derive(Debug, Clone)]
pub struct Optimizer {
    spec: OptimizerSpec,
    num_params: usize,
    /// SGD with momentum: `[momentum]`; Adam(W): `[exp_avg, exp_avg_sq]`; SGD without: `[]`.
    state: Vec<Vec<f32>>,
    steps: u64,
}

impl Optimizer {
    /// Fresh optimizer (zero moments, zero steps) for `num_params` parameters.
    pub fn new(spec: &OptimizerSpec, num_params: usize) -> Self {
        let vectors = match spec {
            OptimizerSpec::Sgd { momentum, .. } if *momentum == 0.0 => 0,
            OptimizerSpec::Sgd { .. } => 1,
            OptimizerSpec::Adam { .. } | OptimizerSpec::AdamW { .. } => 2,
        };
        Optimizer {
            spec: spec.clone(),
            num_params,
            state: vec![vec![0.0; num_params]; vectors],
            steps: 0,
        }
    }

    /// The optimizer's spec.
    pub fn spec(&self) -> &OptimizerSpec {
        &self.spec
    }

    /// Names of the state vectors, in the order of [`Optimizer::state`] (for checkpoints).
    pub fn state_names(&self) -> &'static [&'static str] {
        match self.state.len() {
            0 => &[],
            1 => &["momentum"],
            _ => &["exp_avg", "exp_avg_sq"],
        }
    }

    /// State vectors, each `num_params` long, in canonical parameter order.
    pub fn state(&self) -> Vec<&[f32]> {
        self.state.iter().map(|v| v.as_slice()).collect()
    }

    /// Mutable state vectors (to restore a checkpoint).
    pub fn state_mut(&mut self) -> Vec<&mut [f32]> {
        self.state.iter_mut().map(|v| v.as_mut_slice()).collect()
    }

    /// Completed steps (AdamW's bias correction uses it).
    pub fn steps_taken(&self) -> u64 {
        self.steps
    }

    /// Sets the step count (to restore a checkpoint).
    pub fn set_steps_taken(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// One full update of all parameters. Panics if `params` or `grad` is not `num_params`
    /// long: that is a wiring bug of the caller, not a data error.
    pub fn step(&mut self, params: &mut [f32], grad: &[f32], lr: f32) {
        assert_eq!(
            params.len(),
            self.num_params,
            "Optimizer::step: params has {} values, optimizer was built for {}",
            params.len(),
            self.num_params
        );
        self.step_range(0, params, grad, lr);
        self.finish_step();
    }

    /// Updates only elements `offset..offset + params.len()` (a shard owned by this rank) with
    /// the current step count; call [`Optimizer::finish_step`] once after all ranges of a step.
    /// The result is bitwise the same as a full [`Optimizer::step`] restricted to the range.
    pub fn step_range(&mut self, offset: usize, params: &mut [f32], grad: &[f32], lr: f32) {
        assert_eq!(
            params.len(),
            grad.len(),
            "Optimizer::step_range: params has {} values but grad has {}",
            params.len(),
            grad.len()
        );
        let end = offset + params.len();
        assert!(
            end <= self.num_params,
            "Optimizer::step_range: range {offset}..{end} exceeds the {} parameters",
            self.num_params
        );
        match self.spec.clone() {
            OptimizerSpec::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                let sgd = |p: &mut [f32], g: &[f32], b: Option<&mut [f32]>| {
                    sgd(p, g, b, lr, momentum, weight_decay, nesterov)
                };
                let threaded = crate::split_between_threads(params.len(), CHUNK);
                match self.state.first_mut().map(|b| &mut b[offset..end]) {
                    Some(buf) if threaded => params
                        .par_chunks_mut(CHUNK)
                        .zip(grad.par_chunks(CHUNK))
                        .zip(buf.par_chunks_mut(CHUNK))
                        .for_each(|((p, g), b)| sgd(p, g, Some(b))),
                    None if threaded => params
                        .par_chunks_mut(CHUNK)
                        .zip(grad.par_chunks(CHUNK))
                        .for_each(|(p, g)| sgd(p, g, None)),
                    buf => sgd(params, grad, buf),
                }
            }
            OptimizerSpec::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
            }
            | OptimizerSpec::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                // The one difference: where the weight decay goes.
                let (l2, decoupled) = match self.spec {
                    OptimizerSpec::Adam { .. } => (weight_decay, 0.0),
                    _ => (0.0, weight_decay),
                };
                let t = self.steps + 1;
                let bc1 = (1.0 - powi_exact(beta1 as f64, t)) as f32;
                let bc2 = (1.0 - powi_exact(beta2 as f64, t)) as f32;
                let (m, v) = self.state.split_at_mut(1);
                let hp = AdamParams {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay: decoupled,
                    l2,
                    bc1,
                    bc2,
                };
                let (m, v) = (&mut m[0][offset..end], &mut v[0][offset..end]);
                if crate::split_between_threads(params.len(), CHUNK) {
                    params
                        .par_chunks_mut(CHUNK)
                        .zip(grad.par_chunks(CHUNK))
                        .zip(m.par_chunks_mut(CHUNK))
                        .zip(v.par_chunks_mut(CHUNK))
                        .for_each(|(((p, g), m), v)| adamw(p, g, m, v, &hp));
                } else {
                    adamw(params, grad, m, v, &hp);
                }
            }
        }
    }

    /// Counts one completed step (after all [`Optimizer::step_range`] calls of that step).
    pub fn finish_step(&mut self) {
        self.steps += 1;
    }
}

fn sgd(
    params: &mut [f32],
    grad: &[f32],
    buf: Option<&mut [f32]>,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
) {
    match buf {
        None => {
            for (p, &g) in params.iter_mut().zip(grad) {
                let g = if weight_decay != 0.0 {
                    g + weight_decay * *p
                } else {
                    g
                };
                *p -= lr * g;
            }
        }
        Some(buf) => {
            for ((p, &g), b) in params.iter_mut().zip(grad).zip(buf.iter_mut()) {
                let g = if weight_decay != 0.0 {
                    g + weight_decay * *p
                } else {
                    g
                };
                // A zero buffer makes the first step buf = g, as in PyTorch.
                *b = momentum * *b + g;
                let d = if nesterov { g + momentum * *b } else { *b };
                *p -= lr * d;
            }
        }
    }
}

struct AdamParams {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    /// Decoupled weight decay (AdamW).
    weight_decay: f32,
    /// L2 penalty added to the gradient (Adam).
    l2: f32,
    bc1: f32,
    bc2: f32,
}

fn adamw(params: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32], hp: &AdamParams) {
    let decay = 1.0 - hp.lr * hp.weight_decay;
    let (one_m_b1, one_m_b2) = (1.0 - hp.beta1, 1.0 - hp.beta2);
    for (((p, &g), m), v) in params.iter_mut().zip(grad).zip(m).zip(v) {
        let g = if hp.l2 != 0.0 { g + hp.l2 * *p } else { g };
        *p *= decay;
        *m = hp.beta1 * *m + one_m_b1 * g;
        *v = hp.beta2 * *v + one_m_b2 * (g * g);
        let m_hat = *m / hp.bc1;
        let v_hat = *v / hp.bc2;
        *p -= hp.lr * (m_hat / (v_hat.sqrt() + hp.eps));
    }
}

/// `base^exp` by repeated squaring: only IEEE multiplications, so unlike `powf`/`powi` (libm
/// or compiler-dependent) it gives the same bits everywhere.
fn powi_exact(base: f64, mut exp: u64) -> f64 {
    let (mut acc, mut b) = (1.0f64, base);
    while exp > 0 {
        if exp & 1 == 1 {
            acc *= b;
        }
        b *= b;
        exp >>= 1;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::{powi_exact, Optimizer, OptimizerSpec, CHUNK};

    #[test]
    fn powi_exact_matches_closed_form() {
        assert_eq!(powi_exact(0.5, 10), 1.0 / 1024.0);
        assert_eq!(powi_exact(3.0, 0), 1.0);
        assert!((powi_exact(0.999, 1000) - 0.999f64.powf(1000.0)).abs() < 1e-12);
    }

    /// Split between threads (values above one chunk), every optimizer gives the bits of one
    /// thread, step after step, on a length that leaves a short last chunk.
    #[test]
    fn updates_have_the_same_bits_on_any_number_of_threads() {
        let len = 3 * CHUNK + 123;
        let specs = [
            OptimizerSpec::Sgd {
                momentum: 0.0,
                weight_decay: 0.0,
                nesterov: false,
            },
            OptimizerSpec::Sgd {
                momentum: 0.9,
                weight_decay: 1e-4,
                nesterov: true,
            },
            OptimizerSpec::AdamW {
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.01,
            },
            OptimizerSpec::Adam {
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.01,
            },
        ];
        let run = |spec: &OptimizerSpec, threads: usize| {
            crate::on_threads(threads, || {
                assert_eq!(crate::compute_threads(), threads);
                let mut opt = Optimizer::new(spec, len);
                let mut params: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
                for step in 0..3 {
                    let grad: Vec<f32> = (0..len)
                        .map(|i| ((i * 7 + step) as f32 * 0.11).cos() * 1e-2)
                        .collect();
                    opt.step(&mut params, &grad, 0.05);
                }
                let state: Vec<u32> = opt.state().concat().iter().map(|v| v.to_bits()).collect();
                (
                    params.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    state,
                )
            })
        };
        for spec in &specs {
            let want = run(spec, 1);
            for threads in 2..=4 {
                assert!(run(spec, threads) == want, "{spec:?} on {threads} threads");
            }
        }
    }

    /// Adam's weight decay is an L2 penalty on the gradient (PyTorch's `Adam`): its step is
    /// AdamW's without decay on `grad + wd · p`, bit for bit, and differs from AdamW's decoupled
    /// decay.
    #[test]
    fn adam_adds_the_decay_to_the_gradient() {
        let (wd, lr) = (0.1f32, 0.01f32);
        let params = vec![1.0f32, -2.0, 0.5];
        let grad = vec![0.5f32, 0.25, -1.0];
        let adam = |wd, g: &[f32], decoupled: bool| {
            let (beta1, beta2, eps) = (0.9, 0.999, 1e-8);
            let spec = if decoupled {
                OptimizerSpec::AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay: wd,
                }
            } else {
                OptimizerSpec::Adam {
                    beta1,
                    beta2,
                    eps,
                    weight_decay: wd,
                }
            };
            let mut o = Optimizer::new(&spec, params.len());
            let mut p = params.clone();
            o.step(&mut p, g, lr);
            p
        };
        let l2: Vec<f32> = grad.iter().zip(&params).map(|(g, p)| g + wd * p).collect();
        assert_eq!(adam(wd, &grad, false), adam(0.0, &l2, true));
        assert_ne!(adam(wd, &grad, false), adam(wd, &grad, true));
        // Closed form of a first step: m̂ = g, v̂ = g², so p − lr · g / (|g| + eps).
        let first = adam(0.0, &grad, false);
        for ((p, g), got) in params.iter().zip(&grad).zip(first) {
            let want = p - lr * (g / (g.abs() + 1e-8));
            assert!((got - want).abs() <= 1e-6, "{got} vs {want}");
        }
    }
}
