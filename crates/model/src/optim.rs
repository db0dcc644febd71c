//! Optimizers on flat f32 slices.
//!
//! Why flat and here: the state is one vector per moment, the same length and order as the
//! parameters, so it is independent of the world size, trivially checkpointed, and can be
//! sharded by element range. Updates are plain elementwise loops in f32 with no fused
//! multiply-add (Rust never contracts `a * b + c`), so every machine computes the same bits.
//! Being elementwise, an update is also split between the worker's threads
//! ([`crate::compute_threads`]) in chunks of [`CHUNK`] values, with the same bits at any count.

use std::sync::Arc;

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
    /// A job's own [`UpdateRule`], by its name ([`Optimizer::with_rule`] builds it).
    Custom {
        /// [`UpdateRule::name`].
        name: String,
    },
}

/// Your own optimizer update, on flat slices of the parameters (`optimizer.kind = "custom"`).
///
/// lockstep calls [`UpdateRule::update`] on contiguous runs of the canonical parameter vector:
/// the whole vector on one worker, each rank's shard with ZeRO 1–3, pieces of either on several
/// threads. So that every layout gives the same bits, the update must be **elementwise**: each
/// element's new value (and state) may depend only on that element's parameter, gradient and
/// state values, the step and the learning rate — never on its position or on other elements
/// (per-tensor norms, as in LARS or LAMB, are not elementwise). lockstep checks this before any
/// worker starts ([`check_elementwise`]) and refuses a rule that is not.
///
/// ```
/// use lockstep_model::UpdateRule;
///
/// /// Sign descent with momentum (Lion-like).
/// struct SignMomentum { beta: f32 }
///
/// impl UpdateRule for SignMomentum {
///     fn name(&self) -> &str { "sign-momentum" }
///     fn state_names(&self) -> Vec<String> { vec!["momentum".into()] }
///     fn update(&self, _step: u64, lr: f32, p: &mut [f32], g: &[f32], state: &mut [&mut [f32]]) {
///         for ((p, &g), m) in p.iter_mut().zip(g).zip(state[0].iter_mut()) {
///             *m = self.beta * *m + (1.0 - self.beta) * g;
///             *p -= lr * m.signum();
///         }
///     }
/// }
/// ```
pub trait UpdateRule: Send + Sync {
    /// A short name: the run's optimizer in its outputs, and part of its checkpoints' identity.
    fn name(&self) -> &str;
    /// Names of the state vectors the rule keeps per parameter (default: none). Each is as long
    /// as the parameters, zero at the start, sharded with the optimizer (ZeRO 1–3) and saved in
    /// checkpoints.
    fn state_names(&self) -> Vec<String> {
        Vec::new()
    }
    /// One update of a contiguous run of parameters `params` with their summed gradient `grad`
    /// (the same length) and the same run of each state vector (`state[k]`, in
    /// [`UpdateRule::state_names`]' order); `step` counts from 1, `lr` is the schedule's.
    fn update(
        &self,
        step: u64,
        lr: f32,
        params: &mut [f32],
        grad: &[f32],
        state: &mut [&mut [f32]],
    );
}

/// Checks that `rule` is elementwise ([`UpdateRule`]): three steps of updates on 1,000 values of
/// several magnitudes (and signs) give the same bits in one call as cut into runs of uneven
/// lengths. Returns what differed (or the rule's panic) otherwise.
pub fn check_elementwise(rule: &dyn UpdateRule) -> Result<(), String> {
    const N: usize = 1000;
    let cuts = [0, 1, 37, 38, 500, 999, N];
    let states = rule.state_names().len();
    let value = |i: usize, salt: u64| {
        // SplitMix64's finaliser: well-spread bits from the index and the salt.
        let mut h = (i as u64 ^ (salt << 32)).wrapping_add(0x9E37_79B9_7F4A_7C15);
        h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h ^= h >> 31;
        let mantissa = (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        mantissa * [1e-3f32, 1.0, 30.0][(h % 3) as usize]
    };
    let mut whole: Vec<f32> = (0..N).map(|i| value(i, 1)).collect();
    let mut cut = whole.clone();
    let mut whole_state = vec![vec![0f32; N]; states];
    let mut cut_state = whole_state.clone();
    for step in 1..=3u64 {
        let grad: Vec<f32> = (0..N).map(|i| value(i, 1 + step)).collect();
        let run = |params: &mut [f32], state: &mut [Vec<f32>], ranges: &[usize]| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                for w in ranges.windows(2) {
                    let mut st: Vec<&mut [f32]> =
                        state.iter_mut().map(|v| &mut v[w[0]..w[1]]).collect();
                    rule.update(
                        step,
                        0.01,
                        &mut params[w[0]..w[1]],
                        &grad[w[0]..w[1]],
                        &mut st,
                    );
                }
            }))
            .map_err(|p| {
                let text = p
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| p.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)");
                format!("it panicked on a run of the parameters: {text}")
            })
        };
        run(&mut whole, &mut whole_state, &[0, N])?;
        run(&mut cut, &mut cut_state, &cuts)?;
        let differs = |a: &[f32], b: &[f32]| (0..N).find(|&i| a[i].to_bits() != b[i].to_bits());
        if let Some(i) = differs(&whole, &cut) {
            return Err(format!(
                "at step {step}, parameter {i} is {} when updated with all 1000 values at once \
                 but {} when they come in runs (so its bits would depend on the layout)",
                whole[i], cut[i]
            ));
        }
        for (k, name) in rule.state_names().iter().enumerate() {
            if let Some(i) = differs(&whole_state[k], &cut_state[k]) {
                return Err(format!(
                    "at step {step}, state `{name}` of parameter {i} differs when the values come \
                     in runs (so its bits would depend on the layout)"
                ));
            }
        }
    }
    Ok(())
}

/// An [`UpdateRule`] as the optimizer holds it.
#[derive(Clone)]
struct Rule(Arc<dyn UpdateRule>);

impl std::fmt::Debug for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UpdateRule({})", self.0.name())
    }
}

/// Optimizer state: moment vectors plus the number of steps taken.
#[derive(Debug, Clone)]
pub struct Optimizer {
    spec: OptimizerSpec,
    num_params: usize,
    /// SGD with momentum: `[momentum]`; Adam(W): `[exp_avg, exp_avg_sq]`; SGD without: `[]`;
    /// a custom rule: its own. Shared with snapshots ([`Optimizer::shared_state`]) until the
    /// next update, which copies a vector only if a snapshot still holds it.
    state: Vec<Arc<Vec<f32>>>,
    steps: u64,
    /// The rule of [`OptimizerSpec::Custom`].
    rule: Option<Rule>,
}

impl Optimizer {
    /// Fresh optimizer (zero moments, zero steps) for `num_params` parameters. Panics for
    /// [`OptimizerSpec::Custom`], which needs its rule ([`Optimizer::with_rule`]).
    pub fn new(spec: &OptimizerSpec, num_params: usize) -> Self {
        let vectors = match spec {
            OptimizerSpec::Sgd { momentum, .. } if *momentum == 0.0 => 0,
            OptimizerSpec::Sgd { .. } => 1,
            OptimizerSpec::Adam { .. } | OptimizerSpec::AdamW { .. } => 2,
            OptimizerSpec::Custom { name } => {
                panic!("Optimizer::new: the custom rule `{name}` needs Optimizer::with_rule")
            }
        };
        Optimizer {
            spec: spec.clone(),
            num_params,
            state: zeroed(vectors, num_params),
            steps: 0,
            rule: None,
        }
    }

    /// Fresh optimizer running a job's own `rule` for `num_params` parameters.
    pub fn with_rule(rule: Arc<dyn UpdateRule>, num_params: usize) -> Self {
        Optimizer {
            spec: OptimizerSpec::Custom {
                name: rule.name().to_string(),
            },
            num_params,
            state: zeroed(rule.state_names().len(), num_params),
            steps: 0,
            rule: Some(Rule(rule)),
        }
    }

    /// A fresh optimizer of the same kind (and rule) for `num_params` parameters.
    pub fn fresh(&self, num_params: usize) -> Self {
        match &self.rule {
            Some(Rule(rule)) => Optimizer::with_rule(rule.clone(), num_params),
            None => Optimizer::new(&self.spec, num_params),
        }
    }

    /// The optimizer's spec.
    pub fn spec(&self) -> &OptimizerSpec {
        &self.spec
    }

    /// Names of the state vectors, in the order of [`Optimizer::state`] (for checkpoints).
    pub fn state_names(&self) -> Vec<String> {
        if let Some(Rule(rule)) = &self.rule {
            return rule.state_names();
        }
        let names: &[&str] = match self.state.len() {
            0 => &[],
            1 => &["momentum"],
            _ => &["exp_avg", "exp_avg_sq"],
        };
        names.iter().map(|n| n.to_string()).collect()
    }

    /// State vectors, each `num_params` long, in canonical parameter order.
    pub fn state(&self) -> Vec<&[f32]> {
        self.state.iter().map(|v| v.as_slice()).collect()
    }

    /// Mutable state vectors (to restore a checkpoint).
    pub fn state_mut(&mut self) -> Vec<&mut [f32]> {
        writable(&mut self.state)
    }

    /// The state vectors as they are now, without a copy (a checkpoint written in the background
    /// reads them while training goes on): the next update writes in place when every snapshot
    /// has been dropped by then, and otherwise first copies the vectors still held (copy on
    /// write), so a snapshot never changes.
    pub fn shared_state(&self) -> Vec<Arc<Vec<f32>>> {
        self.state.clone()
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
        if let Some(Rule(rule)) = &self.rule {
            let step = self.steps + 1;
            rule_range(
                &**rule,
                step,
                lr,
                params,
                grad,
                writable(&mut self.state),
                offset..end,
            );
            return;
        }
        match self.spec.clone() {
            OptimizerSpec::Custom { name } => {
                unreachable!("the custom rule `{name}` is held (Optimizer::with_rule)")
            }
            OptimizerSpec::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                let sgd = |p: &mut [f32], g: &[f32], b: Option<&mut [f32]>| {
                    sgd(p, g, b, lr, momentum, weight_decay, nesterov)
                };
                let threaded = crate::split_between_threads(params.len(), CHUNK);
                let buf = self
                    .state
                    .first_mut()
                    .map(|b| &mut Arc::make_mut(b)[offset..end]);
                match buf {
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
                let m = &mut Arc::make_mut(&mut m[0])[offset..end];
                let v = &mut Arc::make_mut(&mut v[0])[offset..end];
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

/// `vectors` fresh zero vectors of `len` values, none shared.
fn zeroed(vectors: usize, len: usize) -> Vec<Arc<Vec<f32>>> {
    (0..vectors).map(|_| Arc::new(vec![0.0; len])).collect()
}

/// The state vectors to update: each copied first if a snapshot still holds it.
fn writable(state: &mut [Arc<Vec<f32>>]) -> Vec<&mut [f32]> {
    state
        .iter_mut()
        .map(|v| Arc::make_mut(v).as_mut_slice())
        .collect()
}

/// A custom rule's update of `range` of the parameters (`params`, `grad`) and of each state
/// vector, in [`CHUNK`]s on several threads when large: elementwise, so the same bits.
fn rule_range(
    rule: &dyn UpdateRule,
    step: u64,
    lr: f32,
    params: &mut [f32],
    grad: &[f32],
    state: Vec<&mut [f32]>,
    range: std::ops::Range<usize>,
) {
    let chunks = params.len().div_ceil(CHUNK).max(1);
    let size = if crate::split_between_threads(params.len(), CHUNK) {
        CHUNK
    } else {
        params.len().max(1)
    };
    let mut per_chunk: Vec<Vec<&mut [f32]>> = (0..chunks).map(|_| Vec::new()).collect();
    for v in state {
        for (c, piece) in v[range.clone()].chunks_mut(size).enumerate() {
            per_chunk[c].push(piece);
        }
    }
    params
        .par_chunks_mut(size)
        .zip(grad.par_chunks(size))
        .zip(per_chunk.par_iter_mut())
        .for_each(|((p, g), st)| rule.update(step, lr, p, g, st));
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
    use super::{check_elementwise, powi_exact, Optimizer, OptimizerSpec, UpdateRule, CHUNK};
    use std::sync::Arc;

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

    /// Heavy-ball momentum written as a user's rule: elementwise.
    struct Momentum;

    impl UpdateRule for Momentum {
        fn name(&self) -> &str {
            "momentum"
        }
        fn state_names(&self) -> Vec<String> {
            vec!["buf".into()]
        }
        fn update(&self, step: u64, lr: f32, p: &mut [f32], g: &[f32], st: &mut [&mut [f32]]) {
            for ((p, &g), b) in p.iter_mut().zip(g).zip(st[0].iter_mut()) {
                *b = 0.9 * *b + g;
                *p -= lr * *b / step as f32;
            }
        }
    }

    /// Steps scaled by the first gradient of the slice it is given: not elementwise.
    struct ByFirst;

    impl UpdateRule for ByFirst {
        fn name(&self) -> &str {
            "by-first"
        }
        fn update(&self, _: u64, lr: f32, p: &mut [f32], g: &[f32], _: &mut [&mut [f32]]) {
            let first = g.first().copied().unwrap_or(1.0);
            for (p, &g) in p.iter_mut().zip(g) {
                *p -= lr * g * first;
            }
        }
    }

    struct Panics;

    impl UpdateRule for Panics {
        fn name(&self) -> &str {
            "panics"
        }
        fn update(&self, _: u64, _: f32, p: &mut [f32], _: &[f32], _: &mut [&mut [f32]]) {
            assert!(p.len() > 1, "a run of one value");
        }
    }

    #[test]
    fn only_elementwise_rules_pass_the_check() {
        assert_eq!(check_elementwise(&Momentum), Ok(()));
        let e = check_elementwise(&ByFirst).unwrap_err();
        assert!(e.contains("at step 1, parameter"), "{e}");
        let e = check_elementwise(&Panics).unwrap_err();
        assert!(
            e.contains("panicked") && e.contains("a run of one value"),
            "{e}"
        );
    }

    /// A snapshot of the state (a checkpoint written in the background) keeps the values it
    /// was taken with while later updates go on, and those updates give the bits of an optimizer
    /// nobody held a snapshot of; a snapshot dropped before the update costs no copy.
    #[test]
    fn a_state_snapshot_never_changes_and_changes_no_update() {
        let len = 1000;
        let spec = OptimizerSpec::AdamW {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let grad: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
        let (mut plain, mut snapped) = (Optimizer::new(&spec, len), Optimizer::new(&spec, len));
        let (mut a, mut b) = (vec![0.5f32; len], vec![0.5f32; len]);
        plain.step(&mut a, &grad, 0.01);
        snapped.step(&mut b, &grad, 0.01);
        let snapshot = snapped.shared_state();
        let taken: Vec<Vec<f32>> = snapshot.iter().map(|v| v.to_vec()).collect();
        plain.step(&mut a, &grad, 0.01);
        snapped.step(&mut b, &grad, 0.01);
        assert_eq!(snapped.state(), plain.state());
        assert_ne!(
            snapped.state()[0],
            &taken[0][..],
            "the update must change the moments"
        );
        for (held, was) in snapshot.iter().zip(&taken) {
            assert_eq!(&held[..], &was[..], "a snapshot changed under an update");
        }
        // Dropped before the next update: the update writes in place.
        let at = snapped.state()[0].as_ptr();
        drop(snapshot);
        snapped.step(&mut b, &grad, 0.01);
        assert_eq!(snapped.state()[0].as_ptr(), at);
        // Built with vectors of their own: one vector's update copies no other.
        let fresh = Optimizer::new(&spec, len);
        assert_ne!(fresh.state()[0].as_ptr(), fresh.state()[1].as_ptr());
    }

    /// A custom rule's optimizer: its state is the rule's, it survives `fresh`, and shards on
    /// several threads give the bits of one full update, step after step.
    #[test]
    fn a_custom_rule_has_the_same_bits_whole_sharded_and_threaded() {
        let len = 2 * CHUNK + 77;
        let params: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
        let grad: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut whole = Optimizer::with_rule(Arc::new(Momentum), len);
        assert_eq!(whole.state_names(), ["buf"]);
        assert_eq!(
            whole.spec(),
            &OptimizerSpec::Custom {
                name: "momentum".into()
            }
        );
        let mut sharded = whole.fresh(len);
        let (mut a, mut b) = (params.clone(), params.clone());
        for _ in 0..3 {
            whole.step(&mut a, &grad, 0.01);
            let cut = CHUNK + 5;
            let (b1, b2) = b.split_at_mut(cut);
            rayon::ThreadPoolBuilder::new()
                .num_threads(3)
                .build()
                .unwrap()
                .install(|| {
                    sharded.step_range(0, b1, &grad[..cut], 0.01);
                    sharded.step_range(cut, b2, &grad[cut..], 0.01);
                });
            sharded.finish_step();
        }
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert_eq!(whole.state()[0], sharded.state()[0]);
        assert_ne!(a, params);
    }
}
