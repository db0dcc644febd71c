//! Per-rank memory as plain figures: what `summary.json` reports for each rank ([`RankMemory`]),
//! the goal a worker's resident memory is held to, the process's resident memory from
//! `/proc/self/status`, and the one formula that predicts a layout's per-rank memory
//! ([`predict`]) — used by the resource limits and by `lockstep plan`.
//!
//! The figures of a real run are counted from the buffers its loop holds (`lockstep_train`'s
//! `ModelState`); this module holds only what needs no model. Resident memory comes from
//! `/proc/self/status` (`VmHWM`, the high-water mark, and `VmRSS`); elsewhere it reads as 0.

use serde::{Deserialize, Serialize};

use crate::config::{ModelKind, OptimizerKind, TrainConfig};

/// Bytes of one `f32`.
pub const F32: u64 = 4;
/// Bytes of one value of the exact reducer's fixed-point accumulator (`i64`).
pub const FIXED: u64 = 8;
/// The per-worker allowance of the memory goal on top of the model state: 0.5 GiB.
pub const BOUND_ALLOWANCE_BYTES: u64 = 512 << 20;
/// The per-worker factor of the memory goal on the model state.
pub const BOUND_FACTOR: f64 = 1.5;

/// One rank's memory (`summary.json`: `ranks[i].memory`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RankMemory {
    /// The flat parameters the loop keeps (its stage, its shard).
    pub params_bytes: u64,
    /// Every gradient buffer: one per local micro-batch, the reduced gradient, and the exact
    /// reducer's fixed-point accumulator.
    pub grads_bytes: u64,
    /// Optimizer state vectors (AdamW: 2 × parameters, SGD with momentum: 1 ×, plain SGD: 0).
    pub optimizer_bytes: u64,
    /// The model's estimate of the activations its autodiff graphs kept, at the most
    /// micro-batches held at once (0 when the job gives no estimate).
    pub activation_peak_bytes: u64,
    /// Peak resident memory of the worker process (`VmHWM`; 0 where unknown).
    pub peak_rss_bytes: u64,
}

impl RankMemory {
    /// Parameters + gradients + optimizer state + peak activations.
    pub fn model_state_bytes(&self) -> u64 {
        self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_peak_bytes
    }

    /// The goal for peak resident memory: 1.5 × the model state + 0.5 GiB.
    pub fn bound_bytes(&self) -> u64 {
        bound_bytes(self.model_state_bytes())
    }
}

/// 1.5 × `model_state` + 0.5 GiB.
pub fn bound_bytes(model_state: u64) -> u64 {
    (BOUND_FACTOR * model_state as f64) as u64 + BOUND_ALLOWANCE_BYTES
}

/// Parameter-sized copies burn keeps besides a loop's own buffers: the module's parameters and
/// the gradient tensors of a backward (before they are copied out).
pub const BURN_COPIES: u64 = 2;
/// Resident memory of a worker besides its model: the binary and its libraries, the dataset, the
/// transport's buffers, allocator slack. With it, [`predicted_peak_bytes`] was above every measured
/// peak of `bench/memory.json` (by 5–16% on the 22 M-parameter transformer, more on small models,
/// whose activation estimate is generous).
pub const PROCESS_BASE_BYTES: u64 = 64 << 20;

/// The peak resident memory a rank holding `state` for `stage_params` parameters is predicted
/// to reach: its model state, burn's copies of the parameters and the gradients, and the
/// process's base.
pub fn predicted_peak_bytes(state: &RankMemory, stage_params: usize) -> u64 {
    state.model_state_bytes() + BURN_COPIES * stage_params as u64 * F32 + PROCESS_BASE_BYTES
}

/// One `kB` field of `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_status_kib(&text, field).map(|kib| kib * 1024)
}

fn parse_status_kib(text: &str, field: &str) -> Option<u64> {
    let line = text.lines().find(|l| {
        l.strip_prefix(field)
            .is_some_and(|rest| rest.starts_with(':'))
    })?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Peak resident memory of this process so far (`VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    status_bytes("VmHWM")
}

/// Resident memory of this process now (`VmRSS`).
pub fn current_rss_bytes() -> Option<u64> {
    status_bytes("VmRSS")
}

/// What a rank of a layout would hold, for predictions: sizes in values, not buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateShape {
    /// Parameters of the rank's stage (the whole model without a pipeline).
    pub stage_params: usize,
    /// Micro-batches the rank computes per step (one gradient buffer each).
    pub local_microbatches: usize,
    /// Optimizer state vectors per parameter (AdamW 2, SGD with momentum 1, plain SGD 0).
    pub optimizer_vectors: usize,
    /// Exact (fixed-point) gradient sum: an `i64` accumulator per reduced value.
    pub reproducible: bool,
    /// Values of the stage's largest layer: ZeRO 3 reduce-scatters the gradient layer by
    /// layer, so its accumulator holds one layer at a time (0: unknown, counted whole).
    pub largest_layer: usize,
    /// Data-parallel replicas sharing the stage.
    pub dp: usize,
    /// ZeRO level on the data-parallel axis: optimizer state sharded at ≥ 1, the reduced
    /// gradient at ≥ 2, the parameters at 3.
    pub zero: u8,
    /// Estimated activation bytes one micro-batch's graph keeps on this rank.
    pub activation_bytes_per_microbatch: u64,
    /// Most micro-batches held at once (1 without a pipeline; GPipe: all local ones; 1F1B:
    /// at most the stages from this one to the last).
    pub peak_held: usize,
    /// The last local micro-batch's gradient goes to the sum layer by layer as its backward
    /// hands it out (ZeRO 2 or 3 on one stage of a layered model without tensor parallelism or
    /// recomputation, [`streams_last_microbatch`]): one layer's values instead of a gradient
    /// vector.
    pub streamed_last: bool,
    /// The streamed sum also steps the optimizer, each layer's chunk as soon as it is reduced
    /// ([`steps_in_backward`]): one layer's chunk of reduced gradient is held instead of the
    /// rank's whole shard.
    pub steps_in_backward: bool,
}

/// Whether a rank's last local micro-batch streams its gradient into the sum layer by layer
/// ([`StateShape::streamed_last`]): at ZeRO 2 and 3 (the sum is reduce-scattered, a layer's
/// segment at a time) on one pipeline stage of a layered model, without tensor parallelism (a
/// rank's layers would not be whole) or recomputation (a streamed forward keeps every layer's
/// graph, which recomputation exists to avoid). The trainer decides by it and `lockstep plan`
/// predicts by it.
pub fn streams_last_microbatch(
    zero: u8,
    pp: usize,
    tp: usize,
    layered: bool,
    recompute: bool,
) -> bool {
    zero >= 2 && pp == 1 && tp == 1 && layered && !recompute
}

/// Whether ZeRO 3 gathers a stage one layer at a time — each layer's parameters all-gathered
/// just before its forward and again before its recomputed backward, released after, so a rank
/// holds its chunks and one layer — rather than the whole stage for the step. It needs a stage
/// that takes its layers from a source (`stage_fetches`: a stage that recomputes its layers,
/// `train.recompute = "layers"`; with tensor parallelism, each tp rank its pieces of the
/// layer), a last micro-batch that does
/// not stream into the sum (a streamed backward keeps every layer's graph), and as many
/// micro-batches on every replica (`even`: each micro-batch's gathers are collectives of the
/// stage's data-parallel group, so every replica must make the same ones in the same order).
pub fn gathers_layers(zero: u8, stage_fetches: bool, streams_last: bool, even: bool) -> bool {
    zero >= 3 && stage_fetches && !streams_last && even
}

/// Whether a streamed last micro-batch ([`streams_last_microbatch`]) also steps the optimizer,
/// layer by layer, as each layer's chunk of the sum is final (the optimizer is elementwise:
/// the same bits as one step after the whole sum): not with gradient clipping
/// (`clipped`: `optimizer.clip_grad_norm` > 0), whose norm needs every chunk before any update.
pub fn steps_in_backward(streams_last: bool, clipped: bool) -> bool {
    streams_last && !clipped
}

/// The [`RankMemory`] a rank of `shape` would report (`peak_rss_bytes` = 0: not predicted here).
///
/// `params = P / (dp if zero = 3)`, `grads = m·P + P / (dp if zero ≥ 2)` (`(m − 1)·P` and
/// the largest layer when the last micro-batch streams, [`StateShape::streamed_last`]; the
/// largest layer's chunk instead of `P / dp` when it also steps the optimizer,
/// [`StateShape::steps_in_backward`]) plus `8·P` bytes of fixed-point accumulator in
/// reproducible mode (`8·` the largest layer at ZeRO 3 and in a streamed sum; an upper bound,
/// see `lockstep_train::memory::ModelState::exact_scratch`), `optimizer = k·P / (dp if
/// zero ≥ 1)`, activations = `peak_held ×` one micro-batch's. A shard is the ceiling of `P / dp`.
pub fn predict(shape: &StateShape) -> RankMemory {
    let p = shape.stage_params as u64;
    let dp = shape.dp.max(1) as u64;
    let shard = |zero_from: u8| {
        if shape.zero >= zero_from {
            p.div_ceil(dp)
        } else {
            p
        }
    };
    // ZeRO 3, and a streamed sum at ZeRO 2, reduce-scatter one layer's segment at a time.
    let by_layer = shape.zero >= 3 || shape.streamed_last;
    let accumulated = match shape.largest_layer as u64 {
        layer if by_layer && layer > 0 => layer.min(p),
        _ => p,
    };
    let fixed = if shape.reproducible {
        accumulated * FIXED
    } else {
        0
    };
    let m = shape.local_microbatches as u64;
    let vectors = match shape.streamed_last && m > 0 {
        true => (m - 1) * p + (shape.largest_layer as u64).min(p),
        false => m * p,
    };
    let reduced = match shape.steps_in_backward {
        true => (shape.largest_layer as u64).min(p).div_ceil(dp),
        false => shard(2),
    };
    RankMemory {
        params_bytes: shard(3) * F32,
        grads_bytes: (vectors + reduced) * F32 + fixed,
        optimizer_bytes: shape.optimizer_vectors as u64 * shard(1) * F32,
        activation_peak_bytes: shape.activation_bytes_per_microbatch
            * shape.peak_held.max(1) as u64,
        peak_rss_bytes: 0,
    }
}

/// Optimizer state vectors per parameter the config asks for (Adam(W) 2, SGD with momentum 1,
/// plain SGD 0; a job's own rule, whose count the config does not say, as many as Adam's).
pub fn optimizer_vectors(cfg: &TrainConfig) -> usize {
    match cfg.optimizer.kind {
        OptimizerKind::Adam | OptimizerKind::AdamW | OptimizerKind::Custom => 2,
        OptimizerKind::Sgd if cfg.optimizer.momentum != 0.0 => 1,
        OptimizerKind::Sgd => 0,
    }
}

/// Values per sample that a training forward of a built-in classifier (`model.kind` "mlp" or
/// "cnn") on `input` = `[channels, height, width]` with `classes` outputs keeps for its backward:
/// the input, each dense layer's pre- and post-activation values, each conv block's
/// convolution, activation and pooled outputs, the logits.
pub fn classifier_held_floats(cfg: &TrainConfig, input: [u128; 3], classes: u128) -> u128 {
    let m = &cfg.model;
    let [c, h, w] = input;
    match m.kind {
        ModelKind::Cnn => {
            let (mut hh, mut ww, mut sum) = (h, w, c * h * w);
            for &out in &m.conv {
                sum += 3 * out as u128 * hh * ww;
                hh /= 2;
                ww /= 2;
            }
            sum + 2 * m.cnn_hidden as u128 + classes
        }
        ModelKind::Mlp | ModelKind::Transformer => {
            c * h * w + m.hidden.iter().map(|&x| 2 * x as u128).sum::<u128>() + classes
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prediction_shards_by_zero_level() {
        let shape = |zero| StateShape {
            stage_params: 1001,
            local_microbatches: 2,
            optimizer_vectors: 2,
            reproducible: false,
            largest_layer: 400,
            dp: 2,
            zero,
            activation_bytes_per_microbatch: 10,
            peak_held: 1,
            streamed_last: false,
            steps_in_backward: false,
        };
        let z0 = predict(&shape(0));
        assert_eq!(
            (z0.params_bytes, z0.grads_bytes, z0.optimizer_bytes),
            (4004, 3 * 4004, 2 * 4004)
        );
        let z1 = predict(&shape(1));
        assert_eq!(z1.optimizer_bytes, 2 * 501 * 4);
        assert_eq!(z1.grads_bytes, z0.grads_bytes);
        let z2 = predict(&shape(2));
        assert_eq!(z2.grads_bytes, (2 * 1001 + 501) * 4);
        assert_eq!(z2.params_bytes, z0.params_bytes);
        let z3 = predict(&shape(3));
        assert_eq!(z3.params_bytes, 501 * 4);
        assert!(z3.model_state_bytes() < z2.model_state_bytes());
        let exact = predict(&StateShape {
            reproducible: true,
            ..shape(0)
        });
        assert_eq!(exact.grads_bytes, z0.grads_bytes + 8 * 1001);
        // ZeRO 3 reduce-scatters layer by layer: one layer's accumulator at a time.
        let exact3 = predict(&StateShape {
            reproducible: true,
            ..shape(3)
        });
        assert_eq!(exact3.grads_bytes, z3.grads_bytes + 8 * 400);
        // A streamed last micro-batch holds one layer (400 values), not a vector (1001).
        let streamed = predict(&StateShape {
            streamed_last: true,
            ..shape(3)
        });
        assert_eq!(streamed.grads_bytes, z3.grads_bytes - (1001 - 400) * 4);
        // Stepping the optimizer layer by layer: one layer's chunk (200 values), not the shard
        // (501).
        let stepping = predict(&StateShape {
            streamed_last: true,
            steps_in_backward: true,
            ..shape(3)
        });
        assert_eq!(stepping.grads_bytes, streamed.grads_bytes - (501 - 200) * 4);
    }

    #[test]
    fn status_fields_parse_in_bytes_and_are_present_here() {
        let text = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!(parse_status_kib(text, "VmHWM"), Some(2048));
        assert_eq!(parse_status_kib(text, "VmRSS"), Some(1024));
        assert_eq!(parse_status_kib(text, "VmPeak"), None);
        if cfg!(target_os = "linux") {
            // RSS first: the high-water mark read after it can only be at least as high (other
            // tests of this process allocate meanwhile).
            let current = current_rss_bytes().expect("VmRSS");
            let peak = peak_rss_bytes().expect("VmHWM on Linux");
            assert!(peak >= current && peak > 0, "{peak} < {current}");
        }
    }
}
