//! The workload: what one training step computes and moves, from the config (micro-batches,
//! reproducible mode, buckets, collective algorithm, optimizer, ZeRO level, schedule) and the
//! model's layers (parameters, activation bytes per sample sent and held), which [`model_layers`] reads from the model the trainer builds.

use lockstep_comm::collectives::DEFAULT_SEGMENT_BYTES;
use lockstep_comm::communicator::DEFAULT_SMALL_MESSAGE_THRESHOLD;
use lockstep_comm::Algorithm;
use serde::{Deserialize, Serialize};

use lockstep_run::config::{ScheduleKind, TrainConfig, TransportKind};

/// One layer a pipeline may cut after.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Layer {
    pub name: String,
    pub params: usize,
    /// Bytes this layer's output carries per sample to the next layer (0 for the last).
    pub activation_bytes_per_sample: usize,
    /// Bytes a training forward of this layer keeps per sample for its backward (the model's
    /// estimate; 0 when it gives none).
    #[serde(default)]
    pub held_activation_bytes_per_sample: usize,
    /// Parameters of this layer split across the tensor-parallel ranks (a transformer block's
    /// column- and row-parallel matrices); the rest is replicated on each rank.
    #[serde(default)]
    pub tp_split_params: usize,
}

impl Layer {
    /// Parameters one rank of a tensor-parallel group of `tp` holds.
    pub fn params_per_tp_rank(&self, tp: usize) -> usize {
        lockstep_run::parallel_dims::params_per_tp_rank(self.params, self.tp_split_params, tp)
    }
}

/// What one training step moves and computes, from the config and the model's shape.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Workload {
    pub params: usize,
    /// Micro-batches per step (all replicas together).
    pub microbatches: usize,
    /// Samples per micro-batch.
    pub microbatch: usize,
    pub reproducible: bool,
    pub overlap: bool,
    pub bucket_elems: usize,
    /// `dist.algorithm`.
    pub algorithm: Algorithm,
    pub small_message_threshold: usize,
    pub segment_bytes: usize,
    /// Layers in order; more than one only for models the trainer can pipeline.
    pub layers: Vec<Layer>,
    /// Optimizer state vectors per parameter (AdamW 2, SGD with momentum 1, plain SGD 0).
    #[serde(default)]
    pub optimizer_vectors: usize,
    /// `parallel.zero`: the ZeRO level on the data-parallel axis.
    #[serde(default)]
    pub zero: u8,
    /// `parallel.schedule` (how many micro-batches a pipeline stage holds at once).
    #[serde(default = "default_schedule")]
    pub schedule: ScheduleKind,
    /// The model's fixed tensor-parallel pieces (the transformer's `model.tp_pieces`, a user
    /// model's `lockstep::tp` layers'): tensor-parallel widths that divide it can be planned (1:
    /// none). `from_config` takes `model.tp_pieces`; `lockstep plan` sets the built model's.
    #[serde(default = "one")]
    pub tp_pieces: usize,
    /// `dist.transport` lets ranks of one node share memory ("auto" or "shm"): the exact sum of
    /// a one-node data-parallel group then reads the peers' gradients from shared windows
    /// (`lockstep_comm::shared_parts`) instead of the rings.
    #[serde(default)]
    pub shared_memory: bool,
    /// `train.recompute = "layers"`: training forwards keep each layer's input only.
    #[serde(default)]
    pub recompute: bool,
    /// `optimizer.clip_grad_norm` > 0: the optimizer waits for the whole gradient's norm (a
    /// streamed ZeRO 2 or 3 sum cannot step it layer by layer).
    #[serde(default)]
    pub clipped: bool,
}

fn one() -> usize {
    1
}

fn default_schedule() -> ScheduleKind {
    ScheduleKind::OneFOneB
}

impl Workload {
    pub fn from_config(cfg: &TrainConfig, layers: Vec<Layer>) -> Self {
        Self {
            params: layers.iter().map(|l| l.params).sum(),
            microbatches: cfg.microbatches_per_step(),
            microbatch: cfg.train.microbatch,
            reproducible: cfg.dist.reproducible,
            overlap: cfg.dist.overlap,
            bucket_elems: cfg.dist.bucket_elems.max(1),
            algorithm: cfg.dist.algorithm,
            small_message_threshold: DEFAULT_SMALL_MESSAGE_THRESHOLD,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            layers,
            optimizer_vectors: lockstep_run::memory::optimizer_vectors(cfg),
            zero: cfg.parallel.zero,
            schedule: cfg.parallel.schedule,
            tp_pieces: cfg.model.tp_pieces.max(1),
            shared_memory: matches!(cfg.dist.transport, TransportKind::Auto | TransportKind::Shm),
            recompute: cfg.train.recompute == lockstep_run::config::Recompute::Layers,
            clipped: cfg.optimizer.clip_grad_norm > 0.0,
        }
    }

    pub(super) fn algorithm(&self) -> Algorithm {
        self.algorithm
    }
}
