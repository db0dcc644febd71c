//! [`Model`]: a burn network behind a flat-parameter interface.
//!
//! The distribution layer sees only `Vec<f32>`/`&[f32]` in the canonical order described by
//! [`Model::layout`]; burn types never leave this crate.

use crate::bf16::Products;
use crate::error::ModelError;
use crate::net::{zero_layers, ClassifierLayer, NoTap, ParamTap};
use crate::params::{self, ParamInfo};
use crate::spec::ModelSpec;
use crate::streaming::{DoneOnDrop, Msg, StreamTap};
use crate::{init, loss};
use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};
use sha2::{Digest, Sha256};

/// A classifier on burn's flex CPU backend with autodiff.
///
/// Canonical parameter order (= `layout()`, `params_flat()`, gradients): for a CNN first
/// `convs.0.weight`, `convs.0.bias`, `convs.1.weight`, ..., then for both kinds
/// `layers.0.weight`, `layers.0.bias`, ..., `layers.{last}.bias`. Linear weights are `[in, out]`
/// row-major, conv weights `[out, in, 3, 3]`.
pub struct Model {
    spec: ModelSpec,
    device: Device,
    layers: Vec<ClassifierLayer>,
    layout: Vec<ParamInfo>,
    num_params: usize,
    structure_hash: [u8; 32],
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("spec", &self.spec)
            .field("num_params", &self.num_params)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Builds the network for `spec` with parameters drawn deterministically from `seed`:
    /// same spec and seed give the same bits on every process and machine.
    pub fn new(spec: &ModelSpec, seed: u64) -> Result<Model, ModelError> {
        spec.validate()?;
        let device = Device::flex().autodiff();
        let net = zero_layers(spec, &device);
        let layout = params::layout(&net);
        let num_params = layout.iter().map(|p| p.len).sum();
        let structure_hash = structure_hash(spec, &layout);
        let initial = init::initial_values(&layout, seed);
        let layers = params::write(net, &initial, &device);
        Ok(Model {
            spec: spec.clone(),
            device,
            layers,
            layout,
            num_params,
            structure_hash,
        })
    }

    /// The spec this model was built from.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Total number of f32 parameters.
    pub fn num_params(&self) -> usize {
        self.num_params
    }

    /// Name, shape and flat position of every parameter tensor, in canonical order.
    pub fn layout(&self) -> Vec<ParamInfo> {
        self.layout.clone()
    }

    /// SHA-256 over the spec's architecture and every parameter's name and shape in canonical
    /// order. Ranks compare it before training to refuse mismatched models.
    pub fn structure_hash(&self) -> [u8; 32] {
        self.structure_hash
    }

    /// All parameters in canonical order.
    pub fn params_flat(&self) -> Vec<f32> {
        params::read(&self.layers, self.num_params)
    }

    /// Replaces all parameters (canonical order). Refuses a vector of the wrong length.
    pub fn set_params_flat(&mut self, p: &[f32]) -> Result<(), ModelError> {
        check_len("set_params_flat", self.num_params, p.len())?;
        // `map` consumes the module; swap in an empty one meanwhile (no tensors allocated).
        let layers = std::mem::take(&mut self.layers);
        self.layers = params::write(layers, p, &self.device);
        Ok(())
    }

    /// Forward and backward on one micro-batch of `n` samples.
    ///
    /// The loss is `scale * sum_i CE(x_i, y_i)`: with `scale = 1 / global_batch`, gradients of
    /// the micro-batches of a global batch add up to the gradient of its mean loss. Writes
    /// d(loss)/d(params) into `grad_out` (canonical order, overwriting it) and returns the
    /// scaled loss. `x` holds `n * spec.input_len()` values (NCHW per sample for a CNN).
    ///
    /// A NaN or infinite loss is an error ([`ModelError::NonFiniteLoss`]): the gradients written
    /// are then meaningless and must not be averaged into other ranks' gradients.
    pub fn loss_and_grad(
        &self,
        x: &[f32],
        y: &[u8],
        n: usize,
        scale: f32,
        grad_out: &mut [f32],
    ) -> Result<f32, ModelError> {
        self.loss_and_grad_timed(x, y, n, scale, grad_out)
            .map(|t| t.loss)
    }

    /// [`Model::loss_and_grad`] that also reports how long the forward pass and the backward pass
    /// (including copying the gradients out) took. flex executes eagerly, so the split is real.
    pub fn loss_and_grad_timed(
        &self,
        x: &[f32],
        y: &[u8],
        n: usize,
        scale: f32,
        grad_out: &mut [f32],
    ) -> Result<TimedLoss, ModelError> {
        check_len("grad_out", self.num_params, grad_out.len())?;
        let start = std::time::Instant::now();
        let loss = self.scaled_loss(x, y, n, scale, &NoTap)?;
        let forward_done = std::time::Instant::now();
        let grads = loss.backward();
        let value = params::f32_slice(&loss.into_data())[0];
        params::read_grads(&self.layers, grads, grad_out);
        let loss = finite(value, n)?;
        Ok(TimedLoss {
            loss,
            forward_seconds: (forward_done - start).as_secs_f64(),
            backward_seconds: forward_done.elapsed().as_secs_f64(),
        })
    }

    /// Like [`Model::loss_and_grad`], but hands each parameter's gradient to `on_grad` (canonical
    /// index, values) as soon as backward has computed it, instead of writing a flat vector:
    /// gradients arrive in reverse layer order (output layer first), while backward continues
    /// below, so the caller can start communicating them early. `on_grad` runs on a helper
    /// thread, once per parameter tensor, and has returned for all of them when this returns.
    /// The values are bitwise those `loss_and_grad` writes. A non-finite loss is reported as in
    /// `loss_and_grad`, after the (meaningless) gradients have been delivered.
    pub fn loss_and_grad_streaming(
        &self,
        x: &[f32],
        y: &[u8],
        n: usize,
        scale: f32,
        on_grad: &(dyn Fn(usize, &[f32]) + Sync),
    ) -> Result<f32, ModelError> {
        let tensors = self.layout.len();
        let (tx, rx) = std::sync::mpsc::channel();
        let tap = StreamTap { tx: tx.clone() };
        std::thread::scope(|scope| {
            let drain = scope.spawn(move || {
                let mut delivered = vec![0usize; tensors];
                while let Ok(Msg::Grad(index, values)) = rx.recv() {
                    on_grad(index, &values);
                    delivered[index] += 1;
                }
                delivered
            });
            let done = DoneOnDrop(tx);
            let result = self.scaled_loss(x, y, n, scale, &tap).map(|loss| {
                let _grads = loss.backward();
                params::f32_slice(&loss.into_data())[0]
            });
            drop(done);
            let delivered = match drain.join() {
                Ok(d) => d,
                Err(panic) => std::panic::resume_unwind(panic),
            };
            if result.is_ok() {
                // Every parameter is used exactly once in forward, so each tap fires once.
                assert!(
                    delivered.iter().all(|&c| c == 1),
                    "streaming backward delivered gradient counts {delivered:?} (expected one each)"
                );
            }
            finite(result?, n)
        })
    }

    /// Evaluation without gradients: (sum over samples of the cross-entropy, number of samples
    /// whose arg-max logit, first index on ties, equals the label). The loss is accumulated in
    /// f64, so it can differ from `loss_and_grad`'s f32 value in the last bits.
    pub fn evaluate(&self, x: &[f32], y: &[u8], n: usize) -> Result<(f64, usize), ModelError> {
        self.check_batch(x, y, n)?;
        let layers = self.layers.valid();
        let device = self.device.clone().inner();
        let x = self.input_tensor(x, n, &device);
        let logits = forward(&layers, x, &NoTap).into_data();
        Ok(loss::sum_ce_and_correct(
            params::f32_slice(&logits),
            y,
            self.spec.classes(),
        ))
    }

    /// Scaled loss tensor on the autodiff device; `tap` sees every parameter before use.
    pub(crate) fn scaled_loss(
        &self,
        x: &[f32],
        y: &[u8],
        n: usize,
        scale: f32,
        tap: &impl ParamTap,
    ) -> Result<Tensor<1>, ModelError> {
        self.check_batch(x, y, n)?;
        let x = self.input_tensor(x, n, &self.device);
        let logits = forward(&self.layers, x, tap);
        Ok(loss::scaled_cross_entropy(logits, y, scale, &self.device))
    }

    fn input_tensor(&self, x: &[f32], n: usize, device: &Device) -> Tensor<2> {
        let data = TensorData::new(x.to_vec(), [n, self.spec.input_len()]);
        Tensor::from_data(data, device)
    }

    fn check_batch(&self, x: &[f32], y: &[u8], n: usize) -> Result<(), ModelError> {
        if n == 0 {
            return Err(ModelError::EmptyBatch);
        }
        let per_sample = self.spec.input_len();
        if x.len() != n * per_sample {
            return Err(ModelError::InputLength {
                n,
                per_sample,
                expected: n * per_sample,
                got: x.len(),
            });
        }
        if y.len() != n {
            return Err(ModelError::LabelLength {
                expected: n,
                got: y.len(),
            });
        }
        let classes = self.spec.classes();
        if let Some(index) = y.iter().position(|&l| l as usize >= classes) {
            return Err(ModelError::LabelOutOfRange {
                index,
                label: y[index],
                classes,
            });
        }
        Ok(())
    }
}

/// Logits `[n, classes]` of `x` `[n, input_len]` through every layer.
fn forward(layers: &[ClassifierLayer], x: Tensor<2>, tap: &impl ParamTap) -> Tensor<2> {
    let mut index = 0;
    layers.iter().fold(x, |x, layer| {
        layer.forward_tapped(x, tap, &mut index, Products::F32)
    })
}

fn finite(loss: f32, n: usize) -> Result<f32, ModelError> {
    if loss.is_finite() {
        Ok(loss)
    } else {
        Err(ModelError::NonFiniteLoss { loss, n })
    }
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), ModelError> {
    if expected == got {
        Ok(())
    } else {
        Err(ModelError::ParamLength {
            what,
            expected,
            got,
        })
    }
}

fn structure_hash(spec: &ModelSpec, layout: &[ParamInfo]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"lockstep-model structure v1\0");
    h.update(spec.canonical_bytes());
    params::hash_layout(&mut h, layout);
    h.finalize().into()
}

/// SHA-256 (lower-case hex) of the parameters' little-endian bytes: a compact fingerprint
/// ranks and checkpoints compare to prove bitwise agreement.
pub fn param_hash(params: &[f32]) -> String {
    let mut h = ParamHasher::default();
    h.update(params);
    h.finish()
}

/// [`param_hash`] of a vector fed in consecutive pieces (a model arriving stage by stage, never
/// whole in memory): the same hash as of the pieces concatenated.
#[derive(Default)]
pub struct ParamHasher {
    sha: Sha256,
    buf: Vec<u8>,
}

impl ParamHasher {
    /// The next values of the vector.
    pub fn update(&mut self, params: &[f32]) {
        // Fed in blocks: one `update` per float would dominate the cost.
        for chunk in params.chunks(4096) {
            self.buf.clear();
            for v in chunk {
                self.buf.extend_from_slice(&v.to_le_bytes());
            }
            self.sha.update(&self.buf);
        }
    }

    pub fn finish(self) -> String {
        hex::encode(self.sha.finalize())
    }
}

/// Result of [`Model::loss_and_grad_timed`].
#[derive(Debug, Clone, Copy)]
pub struct TimedLoss {
    pub loss: f32,
    pub forward_seconds: f64,
    pub backward_seconds: f64,
}
