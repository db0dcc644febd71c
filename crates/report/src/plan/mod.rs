//! The performance model behind `lockstep plan`: predicted step time, speedup and efficiency of
//! data-parallel, pipeline and combined layouts on a described cluster, calibrated from a real run.
//!
//! The model follows what the code does, message by message (equations and their validation on
//! shaped links: `docs/src/plan.md`):
//!
//! - **Link** (latency α, payload bandwidth β, token-bucket burst b; `k` flows share it): one
//!   message of `s` bytes takes `t(s) = α + max(0, s − min(b, αβ)/k) · k/β`. A plain line-rate link
//!   has `b = 0`, i.e. `α + s·k/β`. A shaped link (tc tbf, cloud bandwidth credits) refills its
//!   bucket while a message waits out its latency, so a bandwidth-bound message hides up to
//!   `min(b, αβ)` bytes of it; the step's first large message, after the link sat idle during
//!   compute, finds the bucket full: `α + max(0, s − b/k)·k/β`.
//! - **Where ranks are**: packed by node (`rank / workers_per_node`, as the launcher numbers them).
//!   A job on one node uses shared memory; a job spanning nodes uses TCP for every link (what
//!   `cli/worker.rs` picks), loopback inside a node. Inter-node flows of one step share their source
//!   node's egress and their destination node's ingress: `k = max(egress flows, ingress flows)`.
//! - **All-reduce** of `S` bytes over `n` ranks (auto choice by size like `Communicator`):
//!   ring (`S ≥ 256 KiB`): `2(n−1)` steps of `g` segments of `⌈S/n⌉/g` bytes,
//!   `T = 2(n−1)·g·max_link t(seg)`, `2(n−1)/n·S` bytes sent per rank;
//!   recursive doubling (`S < 256 KiB`): with `p = 2^⌊log2 n⌋`, `r = n − p`: a fold (if `r > 0`),
//!   `log2 p` exchanges of the whole buffer, an unfold; each round `g·t(S/g)`.
//!   `g` = segments of at most 512 KiB (`DEFAULT_SEGMENT_BYTES`).
//! - **Data-parallel step** (critical rank with `m = ⌈M/dp⌉` of the `M` micro-batches of `mb` samples):
//!   `T = m·mb·c + κ·U + T_net + o·P + x`, where `c` is measured compute per sample (data, forward,
//!   backward), `U` the CPU passes over the gradient outside the wire (`P·(m+1)` in reproducible mode:
//!   one fixed-point pass per local micro-batch, one back; `P·m` in plain mode), `κ` their measured
//!   cost, `T_net` the loss exchange (two one-element all-reduces) plus the gradient all-reduces
//!   (reproducible: `B` i32 exponents + `P` i64; plain: one f32 all-reduce per bucket), `o` optimizer
//!   seconds per parameter and `x` the remaining per-step overhead. CPU terms are divided by
//!   `compute_scale`.
//! - **Pipeline** of `p` stages (contiguous layers, balanced by measured layer cost), `m = ⌈M/dp⌉`
//!   micro-batches per replica, stage times `t_s` per micro-batch (forward + backward), `x` the
//!   one-way transfer of one micro-batch's activations (or gradients) over the busiest boundary:
//!   `T_sched = (m − 1)·max(max_s t_s, x) + Σ_s t_s + Σ_boundaries (x_fwd + x_bwd of the first
//!   micro-batch)`. Each link direction is a pipeline resource like a stage (a send completes into
//!   the socket buffer, so transfers overlap compute); with a free network this is the ideal
//!   `(m + p − 1)·t` and a bubble of `(p−1)/(m+p−1)`. Then the dp all-reduce of the largest
//!   stage (all stages' groups at once) and its optimizer step.
//!
//! - **Memory** per rank (`memory.rs`): the fullest rank's parameters, gradients (one buffer per
//!   local micro-batch, the reduced gradient, the exact sum's `i64` accumulator), optimizer state
//!   (sharded by `parallel.zero`) and the activations of the micro-batches its stage holds at once
//!   (1F1B: `min(m, p − s)`, GPipe: `m`), plus burn's copies and the process's base for the
//!   predicted peak resident memory; `--memory-gib` marks the layouts whose peak exceeds it.
//!
//! Calibration ([`calibrate`](fn@calibrate)) reads `c`, `o`, `x` and `κ` from a run's records:
//! medians over the steady steps (warm-up skipped as in [`crate::scaling`]) of the critical rank's
//! phases. `κ` is what is left of the measured synchronisation time after the model of *the
//! calibration run's own* links ([`Link`] given by the caller) has taken its share.
//!
//! Everything here is a pure function of its arguments; the model's layers come from the caller
//! (`lockstep plan` builds the job's model to learn them, exactly as the trainer does).

// One file per part of the model, in the order a plan is made: describe the cluster and the
// workload, list layouts, cut pipeline stages, cost the communication, calibrate from a run,
// predict each rank's memory, predict and recommend.
mod calibrate;
mod cluster;
mod cost;
mod layout;
mod memory;
mod predict;
mod stages;
#[cfg(test)]
mod test_support;
mod workload;

pub use calibrate::{calibrate, Calibration};
pub use cluster::{calibration_link, Cluster, ClusterSpec, Link};
pub use layout::{candidate_layouts, parse_layouts, Layout};
pub use memory::gib_bytes;
pub use predict::{plan, predict, recommend, Plan, Prediction, Recommendation, Skipped};
pub use stages::balanced_stages;
pub use workload::{Layer, Workload};

/// Defaults for links inside one node, of the order `lockstep bench-collectives` measures with 2
/// ranks and 1–64 MiB on a small VM: shared memory ≈ 5 GB/s bus bandwidth, a few µs per message;
/// TCP over loopback ≈ 4 GB/s, ≈ 12 µs. `lockstep plan`'s flags (`--shm-gbytes-per-s`, …) set
/// the figures of the machine at hand.
pub const DEFAULT_SHM_GBYTES_PER_S: f64 = 5.0;
pub const DEFAULT_SHM_LATENCY_US: f64 = 3.0;
pub const DEFAULT_INTRA_GBYTES_PER_S: f64 = 4.0;
pub const DEFAULT_INTRA_LATENCY_US: f64 = 12.0;
/// One-way latency of a TCP message between nodes when the description gives none.
pub const DEFAULT_LINK_LATENCY_US: f64 = 50.0;
/// TCP payload per byte on the wire at MTU 1500: 1448 of 1514 bytes (Ethernet, IP and TCP headers
/// with timestamps), less ≈ 2% for the ACKs that share the reverse direction with ring traffic.
pub const DEFAULT_LINK_EFFICIENCY: f64 = 0.94;

/// Why a plan cannot be made; each names the flag, key or file part at fault.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("cluster description: {key}: {message}")]
    Cluster { key: String, message: String },
    #[error("calibration: {0}")]
    Calibration(String),
    #[error("layout `{layout}`: {message}")]
    Layout { layout: String, message: String },
    #[error("model: {0}")]
    Model(String),
}
