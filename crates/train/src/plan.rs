//! The performance model behind `lockstep plan`: predicted step time, speedup and efficiency of
//! data-parallel, pipeline and combined layouts on a described cluster, calibrated from a real run.
//!
//! The model follows what the code does, message by message (equations and their validation on
//! shaped links: `docs/plan.md`):
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
//! Calibration ([`calibrate`]) reads `c`, `o`, `x` and `κ` from a run's records: medians over the
//! steady steps (warm-up skipped as in [`crate::scaling`]) of the critical rank's phases. `κ` is what
//! is left of the measured synchronisation time after the model of *the calibration run's own*
//! links ([`Link`] given by the caller) has taken its share.
//!
//! Everything here is a pure function of its arguments except [`model_layers`], which reads the
//! dataset to learn the model's shape, exactly as the trainer does.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use lockstep_comm::collectives::DEFAULT_SEGMENT_BYTES;
use lockstep_comm::communicator::DEFAULT_SMALL_MESSAGE_THRESHOLD;
use lockstep_comm::Algorithm;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::metrics::{StepRecord, Summary};
use crate::scaling::warmup_steps;

/// Defaults for links inside one node, measured on the reference machine (2-core VM,
/// `lockstep bench-collectives`, 2 ranks, 1–64 MiB): shared memory ≈ 5 GB/s bus bandwidth,
/// a few µs per message; TCP over loopback ≈ 4 GB/s, ≈ 12 µs.
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

/// `--link-gbps / link_gbps`: how a cluster key is spelled as a flag and in the TOML file.
fn key_name(key: &str) -> String {
    format!("--{} (`{key}` in a cluster file)", key.replace('_', "-"))
}

fn cluster_error(key: &str, message: impl Into<String>) -> PlanError {
    PlanError::Cluster {
        key: key_name(key),
        message: message.into(),
    }
}

// ---------------------------------------------------------------------------------------------
// Links and the cluster
// ---------------------------------------------------------------------------------------------

/// One class of link: latency α, payload bandwidth β and, for a shaped link, its token bucket.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Link {
    /// One-way latency of one message (seconds).
    pub latency_s: f64,
    /// Payload bytes per second for one flow alone on the link.
    pub bytes_per_s: f64,
    /// Token-bucket capacity of a shaped link (bytes); 0 for a plain line-rate link.
    pub burst_bytes: f64,
}

impl Link {
    pub fn new(latency_s: f64, bytes_per_s: f64) -> Self {
        Self {
            latency_s,
            bytes_per_s,
            burst_bytes: 0.0,
        }
    }

    /// Seconds to deliver one message of `bytes` while `share` flows split the link, in a busy
    /// stretch (the bucket refilled only while the message waited out its latency):
    /// `α + max(0, s − min(b, αβ)/k)·k/β`. Empty messages are never sent (0 s).
    pub fn message_seconds(&self, bytes: f64, share: f64) -> f64 {
        let refill = self.burst_bytes.min(self.latency_s * self.bytes_per_s);
        self.send_seconds(bytes, share, refill)
    }

    /// The same for the first message after the link was idle (e.g. during compute), when the
    /// bucket is full: `α + max(0, s − b/k)·k/β`.
    pub fn first_message_seconds(&self, bytes: f64, share: f64) -> f64 {
        self.send_seconds(bytes, share, self.burst_bytes)
    }

    fn send_seconds(&self, bytes: f64, share: f64, tokens: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        let k = share.max(1.0);
        self.latency_s + (bytes - tokens / k).max(0.0) * k / self.bytes_per_s
    }
}

/// A cluster of identical nodes, as the model sees it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Cluster {
    pub nodes: usize,
    pub workers_per_node: usize,
    /// Between nodes: each node's connection to the others (full duplex).
    pub inter: Link,
    /// Between workers of one node when the job spans nodes (TCP over loopback).
    pub intra: Link,
    /// Between workers when the whole job is on one node (shared memory).
    pub shm: Link,
    /// Per-worker compute speed relative to the calibration run (2 = twice as fast).
    pub compute_scale: f64,
}

impl Cluster {
    pub fn capacity(&self) -> usize {
        self.nodes * self.workers_per_node
    }

    /// One node holding `world` workers whose every link is `link` (how a calibration run's own
    /// links are described).
    pub fn uniform(world: usize, link: Link) -> Self {
        Self {
            nodes: 1,
            workers_per_node: world.max(1),
            inter: link,
            intra: link,
            shm: link,
            compute_scale: 1.0,
        }
    }
}

/// A cluster as a user describes it (TOML file and/or flags): human units, every field optional
/// until [`ClusterSpec::resolve`].
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub nodes: Option<usize>,
    pub workers_per_node: Option<usize>,
    /// Line rate between nodes, Gbit/s.
    pub link_gbps: Option<f64>,
    /// One-way latency between nodes, µs.
    pub link_latency_us: Option<f64>,
    /// Token-bucket burst of a shaped inter-node link, KiB (0 = not shaped).
    pub link_burst_kib: Option<f64>,
    /// Payload fraction of the line rate (headers, ACKs).
    pub link_efficiency: Option<f64>,
    /// TCP between workers of one node in a multi-node job: payload GB/s and µs.
    pub intra_gbytes_per_s: Option<f64>,
    pub intra_latency_us: Option<f64>,
    /// Shared memory in a one-node job: bus bandwidth GB/s and µs.
    pub shm_gbytes_per_s: Option<f64>,
    pub shm_latency_us: Option<f64>,
    /// Per-worker compute speed relative to the calibration run.
    pub compute_scale: Option<f64>,
}

impl ClusterSpec {
    /// Parse a cluster file; unknown keys and wrong types are errors naming `origin`.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, PlanError> {
        toml::from_str(text).map_err(|e: toml::de::Error| PlanError::Cluster {
            key: origin.to_string(),
            message: e.to_string().trim().to_string(),
        })
    }

    /// Field by field, `self` where set, else `base` (flags over a file).
    pub fn or(self, base: ClusterSpec) -> ClusterSpec {
        ClusterSpec {
            nodes: self.nodes.or(base.nodes),
            workers_per_node: self.workers_per_node.or(base.workers_per_node),
            link_gbps: self.link_gbps.or(base.link_gbps),
            link_latency_us: self.link_latency_us.or(base.link_latency_us),
            link_burst_kib: self.link_burst_kib.or(base.link_burst_kib),
            link_efficiency: self.link_efficiency.or(base.link_efficiency),
            intra_gbytes_per_s: self.intra_gbytes_per_s.or(base.intra_gbytes_per_s),
            intra_latency_us: self.intra_latency_us.or(base.intra_latency_us),
            shm_gbytes_per_s: self.shm_gbytes_per_s.or(base.shm_gbytes_per_s),
            shm_latency_us: self.shm_latency_us.or(base.shm_latency_us),
            compute_scale: self.compute_scale.or(base.compute_scale),
        }
    }

    /// Check every value and fill the defaults. Errors name the flag and the file key.
    pub fn resolve(&self) -> Result<Cluster, PlanError> {
        let count = |key: &str, v: Option<usize>, default: Option<usize>| match v.or(default) {
            None => Err(cluster_error(key, "is required")),
            Some(0) => Err(cluster_error(key, "must be at least 1")),
            Some(n) => Ok(n),
        };
        let nodes = count("nodes", self.nodes, Some(1))?;
        let workers_per_node = count("workers_per_node", self.workers_per_node, None)?;
        let positive = |key: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(cluster_error(
                    key,
                    format!("must be a positive number, got {v}"),
                ))
            }
        };
        let non_negative = |key: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(v)
            } else {
                Err(cluster_error(key, format!("must be ≥ 0, got {v}")))
            }
        };
        let link_gbps = match self.link_gbps {
            Some(v) => positive("link_gbps", v)?,
            None if nodes > 1 => {
                return Err(cluster_error(
                    "link_gbps",
                    format!("is required for {nodes} nodes: the line rate between nodes in Gbit/s"),
                ))
            }
            None => 1.0, // unused: one node never crosses the inter-node link
        };
        let efficiency = self.link_efficiency.unwrap_or(DEFAULT_LINK_EFFICIENCY);
        if !(efficiency.is_finite() && efficiency > 0.0 && efficiency <= 1.0) {
            return Err(cluster_error(
                "link_efficiency",
                format!("must be in (0, 1], got {efficiency}"),
            ));
        }
        let us = |key: &str, v: Option<f64>, default: f64| {
            non_negative(key, v.unwrap_or(default)).map(|v| v * 1e-6)
        };
        let gbytes = |key: &str, v: Option<f64>, default: f64| {
            positive(key, v.unwrap_or(default)).map(|v| v * 1e9)
        };
        let inter = Link {
            latency_s: us(
                "link_latency_us",
                self.link_latency_us,
                DEFAULT_LINK_LATENCY_US,
            )?,
            bytes_per_s: link_gbps * 1e9 / 8.0 * efficiency,
            burst_bytes: non_negative("link_burst_kib", self.link_burst_kib.unwrap_or(0.0))?
                * 1024.0,
        };
        let intra = Link::new(
            us(
                "intra_latency_us",
                self.intra_latency_us,
                DEFAULT_INTRA_LATENCY_US,
            )?,
            gbytes(
                "intra_gbytes_per_s",
                self.intra_gbytes_per_s,
                DEFAULT_INTRA_GBYTES_PER_S,
            )?,
        );
        let shm = Link::new(
            us(
                "shm_latency_us",
                self.shm_latency_us,
                DEFAULT_SHM_LATENCY_US,
            )?,
            gbytes(
                "shm_gbytes_per_s",
                self.shm_gbytes_per_s,
                DEFAULT_SHM_GBYTES_PER_S,
            )?,
        );
        let compute_scale = positive("compute_scale", self.compute_scale.unwrap_or(1.0))?;
        Ok(Cluster {
            nodes,
            workers_per_node,
            inter,
            intra,
            shm,
            compute_scale,
        })
    }
}

/// The link a calibration run used, from its transport: this machine's shared memory or loopback
/// TCP defaults, unless the caller measured better (`gbytes_per_s`, `latency_us`).
pub fn calibration_link(
    transport: &str,
    gbytes_per_s: Option<f64>,
    latency_us: Option<f64>,
) -> Result<Link, PlanError> {
    let (g, l) = match transport {
        "shm" => (DEFAULT_SHM_GBYTES_PER_S, DEFAULT_SHM_LATENCY_US),
        _ => (DEFAULT_INTRA_GBYTES_PER_S, DEFAULT_INTRA_LATENCY_US),
    };
    let g = gbytes_per_s.unwrap_or(g);
    let l = latency_us.unwrap_or(l);
    let flag = |key: &str, message: String| PlanError::Cluster {
        key: key.to_string(),
        message,
    };
    if !(g.is_finite() && g > 0.0) {
        return Err(flag(
            "--calib-gbytes-per-s",
            format!("must be a positive number, got {g}"),
        ));
    }
    if !(l.is_finite() && l >= 0.0) {
        return Err(flag("--calib-latency-us", format!("must be ≥ 0, got {l}")));
    }
    Ok(Link::new(l * 1e-6, g * 1e9))
}

// ---------------------------------------------------------------------------------------------
// The workload
// ---------------------------------------------------------------------------------------------

/// One layer a pipeline may cut after.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Layer {
    pub name: String,
    pub params: usize,
    /// Bytes this layer's output carries per sample to the next layer (0 for the last).
    pub activation_bytes_per_sample: usize,
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
    /// "auto", "ring" or "recursive-doubling" (`dist.algorithm`).
    pub algorithm: String,
    pub small_message_threshold: usize,
    pub segment_bytes: usize,
    /// Layers in order; more than one only for models the trainer can pipeline.
    pub layers: Vec<Layer>,
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
            algorithm: cfg.dist.algorithm.clone(),
            small_message_threshold: DEFAULT_SMALL_MESSAGE_THRESHOLD,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            layers,
        }
    }

    fn algorithm(&self) -> Algorithm {
        self.algorithm.parse().unwrap_or_default()
    }
}

/// The layers of `cfg`'s model as the trainer builds it. Not pure: it reads the dataset for the
/// input shape and classes (MLP, CNN) or the vocabulary (transformer).
pub fn model_layers(cfg: &TrainConfig) -> Result<Vec<Layer>, PlanError> {
    let model_err = |e: &dyn fmt::Display| PlanError::Model(e.to_string());
    if cfg.model.kind == "transformer" {
        let corpus = lockstep_data::load_shakespeare_embedded().map_err(|e| model_err(&e))?;
        let m = &cfg.model;
        let spec = lockstep_model::TransformerSpec {
            vocab: corpus.vocab.len(),
            context: m.context,
            d_model: m.d_model,
            heads: m.heads,
            blocks: m.blocks,
            d_ff: if m.d_ff == 0 { 4 * m.d_model } else { m.d_ff },
        };
        let counts = spec.layer_param_counts();
        let last = counts.len() - 1;
        return Ok(counts
            .into_iter()
            .enumerate()
            .map(|(i, params)| Layer {
                name: match spec.layer_kind(i) {
                    lockstep_model::LayerKind::Embedding => "embedding".into(),
                    lockstep_model::LayerKind::Block(b) => format!("block {b}"),
                    lockstep_model::LayerKind::Head => "head".into(),
                },
                params,
                activation_bytes_per_sample: if i == last {
                    0
                } else {
                    m.context * m.d_model * 4
                },
            })
            .collect());
    }
    let (train, _) = crate::datasets::load(&cfg.data, cfg.train.seed).map_err(|e| model_err(&e))?;
    let spec = crate::trainer::model_spec(cfg, &train);
    let model = lockstep_model::Model::new(&spec, cfg.train.seed).map_err(|e| model_err(&e))?;
    Ok(vec![Layer {
        name: cfg.model.kind.clone(),
        params: model.num_params(),
        activation_bytes_per_sample: 0,
    }])
}

// ---------------------------------------------------------------------------------------------
// Layouts
// ---------------------------------------------------------------------------------------------

/// `dp` data-parallel replicas of a `pp`-stage pipeline; rank = replica · pp + stage.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Layout {
    pub dp: usize,
    pub pp: usize,
}

impl Layout {
    pub fn world(&self) -> usize {
        self.dp * self.pp
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.pp == 1 {
            write!(f, "dp={}", self.dp)
        } else {
            write!(f, "dp={}×pp={}", self.dp, self.pp)
        }
    }
}

impl FromStr for Layout {
    type Err = PlanError;
    /// `DPxPP` (e.g. `2x2`) or `DP` alone (pipeline of one stage).
    fn from_str(s: &str) -> Result<Self, PlanError> {
        let bad = |m: &str| PlanError::Layout {
            layout: s.to_string(),
            message: m.to_string(),
        };
        let t = s.trim();
        let (dp, pp) = match t.split_once(['x', 'X', '×']) {
            Some((a, b)) => (a, b),
            None => (t, "1"),
        };
        let num = |v: &str| v.trim().parse::<usize>().ok().filter(|&n| n >= 1);
        match (num(dp), num(pp)) {
            (Some(dp), Some(pp)) => Ok(Layout { dp, pp }),
            _ => Err(bad(
                "expected DPxPP with whole numbers ≥ 1 (e.g. 4x1, 2x2) or DP alone (e.g. 4)",
            )),
        }
    }
}

/// Parse a comma-separated layout list, e.g. `1,2,4x1,2x2`.
pub fn parse_layouts(spec: &str) -> Result<Vec<Layout>, PlanError> {
    let v: Vec<Layout> = spec
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    if v.is_empty() {
        return Err(PlanError::Layout {
            layout: spec.to_string(),
            message: "no layout given (e.g. --layouts 2,4,2x2)".into(),
        });
    }
    Ok(v)
}

/// Layouts worth comparing on `cluster`: world sizes 1, powers of two and whole nodes, each split
/// into every pipeline depth the model allows.
pub fn candidate_layouts(cluster: &Cluster, workload: &Workload) -> Vec<Layout> {
    let cap = cluster.capacity();
    let mut worlds: Vec<usize> = std::iter::successors(Some(1usize), |w| Some(w * 2))
        .take_while(|&w| w <= cap)
        .chain((1..=cluster.nodes).map(|k| k * cluster.workers_per_node))
        .collect();
    worlds.sort_unstable();
    worlds.dedup();
    let layers = workload.layers.len().max(1);
    let mut out = Vec::new();
    for w in worlds {
        for pp in (1..=w.min(layers)).filter(|pp| w % pp == 0) {
            out.push(Layout { dp: w / pp, pp });
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Communication cost on a placement
// ---------------------------------------------------------------------------------------------

/// Time and bytes of some communication.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Cost {
    seconds: f64,
    /// Mean payload bytes sent per rank of the groups involved.
    bytes_per_rank: f64,
}

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            seconds: self.seconds + o.seconds,
            bytes_per_rank: self.bytes_per_rank + o.bytes_per_rank,
        }
    }
}

/// `world` ranks packed onto the nodes of a cluster.
struct Placement<'a> {
    cluster: &'a Cluster,
    nodes_used: usize,
}

impl<'a> Placement<'a> {
    fn new(cluster: &'a Cluster, world: usize) -> Self {
        Self {
            cluster,
            nodes_used: world.div_ceil(cluster.workers_per_node).max(1),
        }
    }

    fn node(&self, rank: usize) -> usize {
        rank / self.cluster.workers_per_node
    }

    fn transport(&self) -> &'static str {
        if self.nodes_used == 1 {
            "shm"
        } else {
            "tcp"
        }
    }

    fn link(&self, a: usize, b: usize) -> Link {
        if self.node(a) != self.node(b) {
            self.cluster.inter
        } else if self.nodes_used == 1 {
            self.cluster.shm
        } else {
            self.cluster.intra
        }
    }

    /// Seconds each flow `(from, to, bytes)` of one round needs to deliver its message, the flows
    /// crossing nodes sharing each node's egress and ingress.
    /// `fresh`: the links were idle before this round, so their buckets are full.
    fn flow_seconds(&self, flows: &[(usize, usize, f64)], fresh: bool) -> Vec<f64> {
        let mut egress: BTreeMap<usize, usize> = BTreeMap::new();
        let mut ingress: BTreeMap<usize, usize> = BTreeMap::new();
        let crosses = |a: usize, b: usize| self.node(a) != self.node(b);
        for &(a, b, bytes) in flows {
            if bytes > 0.0 && crosses(a, b) {
                *egress.entry(self.node(a)).or_default() += 1;
                *ingress.entry(self.node(b)).or_default() += 1;
            }
        }
        flows
            .iter()
            .map(|&(a, b, bytes)| {
                let share = if crosses(a, b) {
                    let out = egress.get(&self.node(a)).copied().unwrap_or(1);
                    let inc = ingress.get(&self.node(b)).copied().unwrap_or(1);
                    out.max(inc) as f64
                } else {
                    1.0
                };
                let link = self.link(a, b);
                if fresh {
                    link.first_message_seconds(bytes, share)
                } else {
                    link.message_seconds(bytes, share)
                }
            })
            .collect()
    }

    /// Seconds until every flow of one round has delivered its message.
    fn round_seconds(&self, flows: &[(usize, usize, f64)], fresh: bool) -> f64 {
        self.flow_seconds(flows, fresh)
            .into_iter()
            .fold(0.0, f64::max)
    }

    /// All-reduce of `elems` elements of `esz` bytes, run at once by every group in `groups`
    /// (global ranks in group order, all of one size), with the algorithm the communicator picks.
    /// `fresh`: the first round finds the links' buckets full (the step's first large message).
    fn all_reduce(
        &self,
        groups: &[Vec<usize>],
        elems: usize,
        esz: usize,
        w: &Workload,
        fresh: bool,
    ) -> Cost {
        let n = groups.first().map_or(1, Vec::len);
        if n <= 1 || elems == 0 {
            return Cost::default();
        }
        let ring = match w.algorithm() {
            Algorithm::Auto => elems * esz >= w.small_message_threshold,
            Algorithm::Ring => true,
            Algorithm::RecursiveDoubling => false,
        };
        let seg_elems = (w.segment_bytes / esz).max(1);
        if ring {
            // ring.rs: 2(n−1) steps; every chunk is cut into as many segments as the largest.
            let chunk0 = elems.div_ceil(n);
            let nseg = chunk0.div_ceil(seg_elems).max(1);
            let seg = (chunk0.div_ceil(nseg) * esz) as f64;
            let flows: Vec<(usize, usize, f64)> = groups
                .iter()
                .flat_map(|g| (0..n).map(move |i| (g[i], g[(i + 1) % n], seg)))
                .collect();
            Cost {
                seconds: self.round_seconds(&flows, fresh)
                    + (2 * (n - 1) * nseg - 1) as f64 * self.round_seconds(&flows, false),
                bytes_per_rank: 2.0 * (n - 1) as f64 / n as f64 * (elems * esz) as f64,
            }
        } else {
            // recursive_doubling.rs: fold, log2 p butterfly exchanges, unfold; whole buffer each.
            let p = 1usize << n.ilog2();
            let rem = n - p;
            let nseg = elems.div_ceil(seg_elems).max(1);
            let seg = (elems.div_ceil(nseg) * esz) as f64;
            let mut rounds: Vec<Vec<(usize, usize, f64)>> = Vec::new();
            if rem > 0 {
                rounds.push(
                    groups
                        .iter()
                        .flat_map(|g| (0..rem).map(move |i| (g[2 * i], g[2 * i + 1], seg)))
                        .collect(),
                );
            }
            let old = |new: usize| if new < rem { 2 * new + 1 } else { new + rem };
            let mut mask = 1;
            while mask < p {
                rounds.push(
                    groups
                        .iter()
                        .flat_map(|g| (0..p).map(move |r| (g[old(r)], g[old(r ^ mask)], seg)))
                        .collect(),
                );
                mask <<= 1;
            }
            if rem > 0 {
                rounds.push(
                    groups
                        .iter()
                        .flat_map(|g| (0..rem).map(move |i| (g[2 * i + 1], g[2 * i], seg)))
                        .collect(),
                );
            }
            let seconds = rounds
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let first = self.round_seconds(r, fresh && i == 0);
                    first + (nseg - 1) as f64 * self.round_seconds(r, false)
                })
                .sum();
            let total = (2 * rem + p * p.ilog2() as usize) as f64 * (elems * esz) as f64;
            Cost {
                seconds,
                bytes_per_rank: total / n as f64,
            }
        }
    }

    /// The loss exchange of every step (`GradSync::exchange_loss`): an exact one-value sum, i.e.
    /// an all-reduce of one i32 exponent and one of one i64.
    fn loss_exchange(&self, world: usize, w: &Workload) -> Cost {
        let g = [(0..world).collect::<Vec<_>>()];
        self.all_reduce(&g, 1, 4, w, false) + self.all_reduce(&g, 1, 8, w, false)
    }

    /// The gradient sum of `params` values within each group (`GradSync::sync` or, with
    /// overlap, one bucket at a time; overlap is assumed to hide nothing). Its first large
    /// message is the step's first: the links were idle during compute.
    fn gradient_sync(&self, groups: &[Vec<usize>], params: usize, w: &Workload) -> Cost {
        let be = w.bucket_elems;
        if w.reproducible && !w.overlap {
            return self.all_reduce(groups, params.div_ceil(be), 4, w, false)
                + self.all_reduce(groups, params, 8, w, true);
        }
        let bucket = |len: usize, fresh: bool| -> Cost {
            if w.reproducible {
                self.all_reduce(groups, 1, 4, w, false) + self.all_reduce(groups, len, 8, w, fresh)
            } else {
                self.all_reduce(groups, len, 4, w, fresh)
            }
        };
        let (full, last) = (params / be, params % be);
        let mut c = Cost::default();
        if full > 0 {
            c = bucket(be, true);
            let rest = bucket(be, false);
            c.seconds += rest.seconds * (full - 1) as f64;
            c.bytes_per_rank += rest.bytes_per_rank * (full - 1) as f64;
        }
        if last > 0 {
            c = c + bucket(last, full == 0);
        }
        c
    }

    /// Pipeline point-to-point for one micro-batch over every stage boundary of every replica at
    /// once (`bytes[s]` crosses boundary `s → s+1`, forward as activations, back as gradients),
    /// each message in segments. Returns `(busiest, first)`: the longest one-way transfer per
    /// micro-batch once the pipeline is streaming (a link direction is a pipeline resource like a
    /// stage), and the first micro-batch's transfers along its path forward and back, found with
    /// the buckets full.
    fn pipeline_p2p(&self, layout: Layout, bytes: &[f64], w: &Workload) -> (f64, f64) {
        let mut busiest = 0.0f64;
        let mut first = 0.0f64;
        for forward in [true, false] {
            let mut flows = Vec::new();
            let mut nsegs = Vec::new();
            for r in 0..layout.dp {
                for (s, &b) in bytes.iter().enumerate() {
                    let (a, c) = (r * layout.pp + s, r * layout.pp + s + 1);
                    let nseg = (b as usize).div_ceil(w.segment_bytes).max(1) as f64;
                    flows.push(if forward {
                        (a, c, b / nseg)
                    } else {
                        (c, a, b / nseg)
                    });
                    nsegs.push(nseg);
                }
            }
            let busy = self.flow_seconds(&flows, false);
            let fresh = self.flow_seconds(&flows, true);
            // Per boundary, the slowest replica's; the path crosses every boundary once.
            let mut path = vec![0.0f64; bytes.len()];
            for (i, n) in nsegs.iter().enumerate() {
                busiest = busiest.max(n * busy[i]);
                let one = fresh[i] + (n - 1.0) * busy[i];
                let s = i % bytes.len().max(1);
                path[s] = path[s].max(one);
            }
            first += path.iter().sum::<f64>();
        }
        (busiest, first)
    }
}

/// Gradient passes on the CPU outside the wire (`U`): reproducible mode converts each local
/// micro-batch gradient to fixed point (exponent scan + accumulate) and the sum back; plain mode
/// adds the local gradients. The ring's own adds are part of a link's measured bandwidth.
fn sync_units(params: usize, local_microbatches: usize, reproducible: bool) -> f64 {
    let passes = if reproducible {
        local_microbatches + 1
    } else {
        local_microbatches.max(1)
    };
    (params * passes) as f64
}

/// Bytes crossing each stage boundary per micro-batch (the last layer of each stage but the last).
fn boundary_bytes(w: &Workload, stages: &[(usize, usize)]) -> Vec<f64> {
    stages[..stages.len().saturating_sub(1)]
        .iter()
        .map(|&(_, end)| (w.layers[end - 1].activation_bytes_per_sample * w.microbatch) as f64)
        .collect()
}

/// Mean point-to-point bytes a rank sends per step: every boundary carries one activation forward
/// and one gradient back per micro-batch, `2·m·Σ boundary / pp` per rank.
fn p2p_bytes_per_rank(layout: Layout, boundary: &[f64], m: usize) -> f64 {
    2.0 * m as f64 * boundary.iter().sum::<f64>() / layout.pp as f64
}

/// Contiguous cut of `shares` into `parts` stages minimising the largest stage sum (exact dynamic
/// programme; ties go to the earliest cut). Returns `[start, end)` per stage.
pub fn balanced_stages(shares: &[f64], parts: usize) -> Vec<(usize, usize)> {
    let n = shares.len();
    assert!(parts >= 1 && parts <= n, "{parts} stages of {n} layers");
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(shares.iter().scan(0.0, |s, &x| {
            *s += x;
            Some(*s)
        }))
        .collect();
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[k][i]: smallest max-stage over the first i layers in k stages; cut[k][i]: last start.
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut cut = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for k in 1..=parts {
        for i in k..=n {
            for j in (k - 1)..i {
                let v = best[k - 1][j].max(sum(j, i));
                if v < best[k][i] - 1e-15 {
                    best[k][i] = v;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut stages = Vec::with_capacity(parts);
    let mut end = n;
    for k in (1..=parts).rev() {
        let start = cut[k][end];
        stages.push((start, end));
        end = start;
    }
    stages.reverse();
    stages
}

// ---------------------------------------------------------------------------------------------
// Calibration
// ---------------------------------------------------------------------------------------------

/// What a real run says about this machine and model.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Calibration {
    pub world: usize,
    pub dp: usize,
    pub pp: usize,
    pub transport: String,
    /// Steady-state steps the medians are taken over.
    pub steps_used: usize,
    /// Median over steady steps of the slowest rank's step time.
    pub measured_step_s: f64,
    /// Data + forward + backward seconds per sample (`c`), under the run's concurrency.
    pub work_per_sample_s: f64,
    /// Optimizer seconds per parameter (`o`).
    pub optimizer_per_param_s: f64,
    /// Seconds per gradient value per CPU pass of the synchronisation (`κ`).
    pub sync_cpu_per_unit_s: f64,
    /// Remaining per-step seconds (`x`).
    pub overhead_s: f64,
    /// Median measured synchronisation (communication + waiting) of the critical rank.
    pub measured_sync_s: f64,
    /// The model's network time for the run's own links (subtracted to get `κ`).
    pub modelled_network_s: f64,
    /// The calibration run's links as given.
    pub link: Link,
    /// Share of the compute per layer (from the run's measured layer costs, else even).
    pub layer_shares: Vec<f64>,
    pub layer_shares_from: String,
    /// Bytes sent per rank per steady step: measured (mean over ranks of each rank's median) and
    /// as the model counts them.
    pub measured_bytes_per_rank_step: f64,
    pub modelled_bytes_per_rank_step: f64,
    /// Things the user should know about this calibration.
    pub notes: Vec<String>,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Calibrate from a finished run (`summary.json` + `metrics.jsonl` records) of `workload`, whose
/// links are described by `link`.
pub fn calibrate(
    summary: &Summary,
    records: &[StepRecord],
    workload: &Workload,
    link: &Link,
) -> Result<Calibration, PlanError> {
    let bad = |m: String| Err(PlanError::Calibration(m));
    let world = summary.world_size.max(1);
    let (dp, pp, m_rep) = match &summary.pipeline {
        Some(p) => (p.dp.max(1), p.pp.max(1), p.microbatches_per_replica.max(1)),
        None => (world, 1, 0),
    };
    if dp * pp != world {
        return bad(format!(
            "summary.json says {world} workers but a layout of dp {dp} × pp {pp}"
        ));
    }
    if workload.params == 0 {
        return bad("the model has no parameters".into());
    }
    let total = records.iter().map(|r| r.step + 1).max().unwrap_or(0);
    let skip = warmup_steps(total);
    let mut by_step: BTreeMap<u64, Vec<&StepRecord>> = BTreeMap::new();
    for r in records
        .iter()
        .filter(|r| r.step >= skip && r.eval.is_none())
    {
        by_step.entry(r.step).or_default().push(r);
    }
    let mb = workload.microbatch.max(1) as f64;
    let work = |r: &StepRecord| r.seconds.data + r.seconds.forward + r.seconds.backward;
    let busy = |r: &StepRecord| match &r.pipeline {
        Some(p) => r.seconds.data + p.schedule_seconds,
        None => work(r),
    };
    // Per step: (per-sample compute, sync, optimizer, overhead, step).
    let mut rows: Vec<[f64; 5]> = Vec::new();
    for recs in by_step.values() {
        let step = recs.iter().map(|r| r.step_seconds).fold(0.0, f64::max);
        let crit = *recs
            .iter()
            .max_by(|a, b| busy(a).total_cmp(&busy(b)))
            .expect("a step has records");
        let per_sample = if pp == 1 {
            if crit.samples == 0 {
                continue;
            }
            work(crit) / crit.samples as f64
        } else {
            // A replica's stages together compute each of its samples once.
            let rep = |r: &StepRecord| r.rank / pp;
            let mut sums: BTreeMap<usize, f64> = BTreeMap::new();
            for r in recs {
                *sums.entry(rep(r)).or_default() += work(r);
            }
            sums.values().copied().fold(0.0, f64::max) / (m_rep as f64 * mb)
        };
        let sync = crit.seconds.communication + crit.seconds.waiting;
        let other = (step - busy(crit) - sync - crit.seconds.optimizer).max(0.0);
        rows.push([per_sample, sync, crit.seconds.optimizer, other, step]);
    }
    if rows.is_empty() {
        return bad(format!(
            "no steady-state steps to measure: the run has {total} step(s) and the first {skip} are warm-up; run more steps (e.g. --set train.steps=40)"
        ));
    }
    let col = |i: usize| median(rows.iter().map(|r| r[i]).collect());
    let (work_per_sample_s, measured_sync_s, opt_s, overhead_s, measured_step_s) =
        (col(0), col(1), col(2), col(3), col(4));

    let (layer_shares, layer_shares_from) = match &summary.pipeline {
        Some(p)
            if p.layer_seconds.len() == workload.layers.len()
                && p.layer_seconds.iter().sum::<f64>() > 0.0 =>
        {
            let s: f64 = p.layer_seconds.iter().sum();
            (
                p.layer_seconds.iter().map(|x| x / s).collect(),
                "measured layer costs (summary.json pipeline.layer_seconds)".to_string(),
            )
        }
        _ => (
            even(workload.layers.len()),
            "even split over layers (no measured layer costs in the run)".to_string(),
        ),
    };
    if pp > workload.layers.len() {
        return bad(format!(
            "the run has {pp} pipeline stages but its model has {} layer(s)",
            workload.layers.len()
        ));
    }

    // The calibration run's layout on its own links.
    let cluster = Cluster::uniform(world, *link);
    let place = Placement::new(&cluster, world);
    let (stage_params, groups) = stage_groups(workload, Layout { dp, pp }, &layer_shares);
    let local = if pp == 1 {
        workload.microbatches.div_ceil(world)
    } else {
        m_rep
    };
    let net =
        place.loss_exchange(world, workload) + place.gradient_sync(&groups, stage_params, workload);
    let mut notes = Vec::new();
    let units = sync_units(stage_params, local, workload.reproducible);
    let cpu = measured_sync_s - net.seconds;
    if cpu < 0.0 {
        notes.push(format!(
            "the run's synchronisation ({:.2} ms) took less than the model of its links predicts ({:.2} ms): its links are faster than described (calibration link {:.2} GB/s, {:.1} µs)",
            measured_sync_s * 1e3,
            net.seconds * 1e3,
            link.bytes_per_s / 1e9,
            link.latency_s * 1e6
        ));
    }
    // Bytes: each rank's median per steady step, averaged over ranks.
    let mut per_rank: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for recs in by_step.values() {
        for r in recs {
            per_rank
                .entry(r.rank)
                .or_default()
                .push(r.bytes_sent as f64);
        }
    }
    let measured_bytes = per_rank.into_values().map(median).sum::<f64>() / world as f64;
    // A pipeline run's activations and gradients between stages, cut where the run cut.
    let p2p_bytes = match &summary.pipeline {
        Some(p) if pp > 1 => {
            let valid = p.stage_layers.len() == pp
                && p.stage_layers
                    .iter()
                    .all(|&(a, b)| a < b && b <= workload.layers.len());
            let stages = if valid {
                p.stage_layers.clone()
            } else {
                balanced_stages(&layer_shares, pp)
            };
            p2p_bytes_per_rank(Layout { dp, pp }, &boundary_bytes(workload, &stages), m_rep)
        }
        _ => 0.0,
    };
    Ok(Calibration {
        world,
        dp,
        pp,
        transport: summary.transport.clone(),
        steps_used: rows.len(),
        measured_step_s,
        work_per_sample_s,
        optimizer_per_param_s: opt_s / stage_params.max(1) as f64,
        sync_cpu_per_unit_s: if units > 0.0 {
            cpu.max(0.0) / units
        } else {
            0.0
        },
        overhead_s,
        measured_sync_s,
        modelled_network_s: net.seconds,
        link: *link,
        layer_shares,
        layer_shares_from,
        measured_bytes_per_rank_step: measured_bytes,
        modelled_bytes_per_rank_step: net.bytes_per_rank + p2p_bytes,
        notes,
    })
}

fn even(n: usize) -> Vec<f64> {
    vec![1.0 / n.max(1) as f64; n.max(1)]
}

/// The largest stage's parameter count and every stage's data-parallel group (global ranks).
fn stage_groups(w: &Workload, layout: Layout, shares: &[f64]) -> (usize, Vec<Vec<usize>>) {
    let groups = (0..layout.pp)
        .map(|s| (0..layout.dp).map(|r| r * layout.pp + s).collect())
        .collect();
    if layout.pp == 1 {
        return (w.params, groups);
    }
    let stages = balanced_stages(shares, layout.pp);
    let largest = stages
        .iter()
        .map(|&(a, b)| w.layers[a..b].iter().map(|l| l.params).sum::<usize>())
        .max()
        .unwrap_or(w.params);
    (largest, groups)
}

// ---------------------------------------------------------------------------------------------
// Prediction and recommendation
// ---------------------------------------------------------------------------------------------

/// The model's figures for one layout.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Prediction {
    pub layout: Layout,
    pub workers: usize,
    pub nodes_used: usize,
    /// "shm" (one node) or "tcp".
    pub transport: String,
    pub microbatches_per_replica: usize,
    /// Layer range `[first, end)` of every stage.
    pub stage_layers: Vec<(usize, usize)>,
    pub step_s: f64,
    /// Critical rank's compute (pipeline: the slowest stage's, all micro-batches).
    pub compute_s: f64,
    /// CPU work of the gradient sum (`κ·U`).
    pub sync_cpu_s: f64,
    /// Loss exchange and gradient all-reduces on the wire.
    pub network_s: f64,
    /// Pipeline point-to-point on the critical path.
    pub p2p_s: f64,
    /// Pipeline fill and drain: `(p − 1)·t_stage`.
    pub bubble_s: f64,
    /// Optimizer and per-step overhead.
    pub other_s: f64,
    /// Bubble / schedule time (0 without a pipeline).
    pub bubble_fraction: f64,
    /// Against one worker on this cluster.
    pub speedup: f64,
    pub efficiency: f64,
    pub bytes_per_rank_step: f64,
}

impl Prediction {
    /// Everything that is not compute: synchronisation, point-to-point and the bubble.
    pub fn communication_s(&self) -> f64 {
        self.sync_cpu_s + self.network_s + self.p2p_s
    }
}

/// Predict one layout, or say why it cannot run.
pub fn predict(
    cluster: &Cluster,
    w: &Workload,
    cal: &Calibration,
    layout: Layout,
) -> Result<Prediction, String> {
    let world = layout.world();
    if world > cluster.capacity() {
        return Err(format!(
            "needs {world} workers, the cluster has {} ({} nodes × {})",
            cluster.capacity(),
            cluster.nodes,
            cluster.workers_per_node
        ));
    }
    if w.microbatches < layout.dp {
        return Err(format!(
            "{} replicas need at least {} micro-batches per step, the config has {}",
            layout.dp, layout.dp, w.microbatches
        ));
    }
    if layout.pp > 1 && w.layers.len() < 2 {
        return Err(format!(
            "{} pipeline stages need a layered model (model.kind = \"transformer\")",
            layout.pp
        ));
    }
    if layout.pp > w.layers.len() {
        return Err(format!(
            "{} stages but the model has {} layers",
            layout.pp,
            w.layers.len()
        ));
    }
    let shares = if cal.layer_shares.len() == w.layers.len() {
        cal.layer_shares.clone()
    } else {
        even(w.layers.len())
    };
    let place = Placement::new(cluster, world);
    let cs = cluster.compute_scale;
    let per_sample = cal.work_per_sample_s / cs;
    let mb = w.microbatch as f64;
    let m = w.microbatches.div_ceil(layout.dp);
    let (stage_params, groups) = stage_groups(w, layout, &shares);
    let (compute_s, bubble_s, p2p_s, stage_layers) = if layout.pp == 1 {
        (
            m as f64 * mb * per_sample,
            0.0,
            0.0,
            vec![(0, w.layers.len())],
        )
    } else {
        let stages = balanced_stages(&shares, layout.pp);
        let t: Vec<f64> = stages
            .iter()
            .map(|&(a, b)| shares[a..b].iter().sum::<f64>() * mb * per_sample)
            .collect();
        let t_max = t.iter().copied().fold(0.0, f64::max);
        let t_sum: f64 = t.iter().sum();
        let (x_busiest, x_first) = place.pipeline_p2p(layout, &boundary_bytes(w, &stages), w);
        // The slowest resource (stage or link direction) paces m − 1 micro-batches; the first
        // one crosses every stage and every link forward and back.
        let schedule = (m as f64 - 1.0) * t_max.max(x_busiest) + t_sum + x_first;
        let compute = m as f64 * t_max;
        let bubble = t_sum - t_max;
        (compute, bubble, schedule - compute - bubble, stages)
    };
    let net = place.loss_exchange(world, w) + place.gradient_sync(&groups, stage_params, w);
    let sync_cpu_s = cal.sync_cpu_per_unit_s * sync_units(stage_params, m, w.reproducible) / cs;
    let other_s = (cal.optimizer_per_param_s * stage_params as f64 + cal.overhead_s) / cs;
    let step_s = compute_s + bubble_s + p2p_s + sync_cpu_s + net.seconds + other_s;
    let schedule = compute_s + bubble_s + p2p_s;
    let p2p_bytes = p2p_bytes_per_rank(layout, &boundary_bytes(w, &stage_layers), m);
    Ok(Prediction {
        layout,
        workers: world,
        nodes_used: place.nodes_used,
        transport: place.transport().to_string(),
        microbatches_per_replica: m,
        stage_layers,
        step_s,
        compute_s,
        sync_cpu_s,
        network_s: net.seconds,
        p2p_s,
        bubble_s,
        other_s,
        bubble_fraction: if layout.pp > 1 && schedule > 0.0 {
            bubble_s / schedule
        } else {
            0.0
        },
        speedup: 1.0,
        efficiency: 1.0,
        bytes_per_rank_step: net.bytes_per_rank + p2p_bytes,
    })
}

/// A layout the model did not predict, and why.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Skipped {
    pub layout: Layout,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Recommendation {
    pub layout: Layout,
    pub step_s: f64,
    pub why: String,
}

/// Everything `lockstep plan` prints and writes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Plan {
    pub cluster: Cluster,
    pub workload: Workload,
    pub calibration: Calibration,
    /// Predicted step of one worker on this cluster: the speedup baseline.
    pub single_worker_step_s: f64,
    pub predictions: Vec<Prediction>,
    pub skipped: Vec<Skipped>,
    pub recommendation: Option<Recommendation>,
}

/// Predict `layouts` (default: [`candidate_layouts`]) and recommend the fastest.
pub fn plan(
    cluster: &Cluster,
    workload: &Workload,
    calibration: &Calibration,
    layouts: Option<&[Layout]>,
) -> Plan {
    let layouts = match layouts {
        Some(l) => l.to_vec(),
        None => candidate_layouts(cluster, workload),
    };
    let one = predict(cluster, workload, calibration, Layout { dp: 1, pp: 1 })
        .expect("one worker always fits")
        .step_s;
    let mut predictions = Vec::new();
    let mut skipped = Vec::new();
    for l in layouts {
        match predict(cluster, workload, calibration, l) {
            Ok(mut p) => {
                p.speedup = one / p.step_s;
                p.efficiency = p.speedup / p.workers as f64;
                predictions.push(p);
            }
            Err(reason) => skipped.push(Skipped { layout: l, reason }),
        }
    }
    let recommendation = recommend(&predictions, cluster);
    Plan {
        cluster: cluster.clone(),
        workload: workload.clone(),
        calibration: calibration.clone(),
        single_worker_step_s: one,
        predictions,
        skipped,
        recommendation,
    }
}

/// The fastest layout (fewer workers on a tie), with the reasons in one sentence.
pub fn recommend(predictions: &[Prediction], cluster: &Cluster) -> Option<Recommendation> {
    let mut order: Vec<&Prediction> = predictions.iter().collect();
    order.sort_by(|a, b| {
        a.step_s
            .total_cmp(&b.step_s)
            .then(a.workers.cmp(&b.workers))
    });
    let best = *order.first()?;
    let ms = |s: f64| s * 1e3;
    let pct = |part: f64| 100.0 * part / best.step_s;
    let mut why = format!(
        "{} on {} node(s): {:.1} ms/step, {:.2}× one worker ({:.0}% efficient)",
        best.layout,
        best.nodes_used,
        ms(best.step_s),
        best.speedup,
        best.efficiency * 100.0
    );
    match order.get(1) {
        Some(next) => {
            why += &format!(
                "; the fastest of {} layouts, {:.0}% faster than the next, {} ({:.1} ms)",
                order.len(),
                100.0 * (next.step_s / best.step_s - 1.0),
                next.layout,
                ms(next.step_s)
            )
        }
        None => why += "; the only layout that fits",
    }
    why += &format!(
        "; its step is {:.0}% compute, {:.0}% communication{}",
        pct(best.compute_s),
        pct(best.communication_s()),
        if best.bubble_s > 0.0 {
            format!(", {:.0}% pipeline bubble", pct(best.bubble_s))
        } else {
            String::new()
        }
    );
    let bigger: Vec<&&Prediction> = order.iter().filter(|p| p.workers > best.workers).collect();
    if let Some(b) = bigger.iter().min_by(|a, b| a.step_s.total_cmp(&b.step_s)) {
        let crosses = b.nodes_used > 1 && best.nodes_used == 1;
        why += &format!(
            "; more workers do not pay: {} would spend {:.1} ms communicating{} to save {:.1} ms of compute",
            b.layout,
            ms(b.communication_s() + b.bubble_s),
            if crosses {
                format!(
                    " (over {:.3} GB/s, {:.0} µs links between nodes)",
                    cluster.inter.bytes_per_s / 1e9,
                    cluster.inter.latency_s * 1e6
                )
            } else {
                String::new()
            },
            ms((best.compute_s - b.compute_s).max(0.0))
        );
    }
    Some(Recommendation {
        layout: best.layout,
        step_s: best.step_s,
        why,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{PhaseSeconds, PipelineSummary};

    const MIB: usize = 1 << 20;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1e-12)
    }

    fn workload(params: usize) -> Workload {
        Workload {
            params,
            microbatches: 4,
            microbatch: 64,
            reproducible: true,
            overlap: false,
            bucket_elems: 1 << 16,
            algorithm: "auto".into(),
            small_message_threshold: 256 * 1024,
            segment_bytes: 512 * 1024,
            layers: vec![Layer {
                name: "mlp".into(),
                params,
                activation_bytes_per_sample: 0,
            }],
        }
    }

    /// `world` ranks on one node whose links are all `link`.
    fn one_node(world: usize, link: Link) -> Cluster {
        Cluster::uniform(world, link)
    }

    #[test]
    fn a_message_costs_latency_plus_size_over_bandwidth_and_a_bucket_hides_latency() {
        let l = Link::new(1e-3, 1e6);
        assert!(close(l.message_seconds(5e5, 1.0), 1e-3 + 0.5));
        assert!(close(l.message_seconds(5e5, 2.0), 1e-3 + 1.0));
        assert_eq!(l.message_seconds(0.0, 1.0), 0.0);
        // A bucket refills α·β = 1000 bytes during the latency: a large message costs s/β.
        let shaped = Link {
            burst_bytes: 1e9,
            ..l
        };
        assert!(close(shaped.message_seconds(5e5, 1.0), 0.5));
        // ... and a small one its latency alone; a small bucket caps the refill.
        assert!(close(shaped.message_seconds(10.0, 1.0), 1e-3));
        let small = Link {
            burst_bytes: 400.0,
            ..l
        };
        assert!(close(
            small.message_seconds(5e5, 1.0),
            1e-3 + (5e5 - 400.0) / 1e6
        ));
    }

    #[test]
    fn after_idle_time_a_full_bucket_sends_its_burst_at_once() {
        let l = Link {
            burst_bytes: 4e5,
            ..Link::new(1e-3, 1e6)
        };
        // Busy: only α·β = 1000 bytes refilled; fresh: the whole 400 kB bucket.
        assert!(close(l.message_seconds(5e5, 1.0), 1e-3 + (5e5 - 1e3) / 1e6));
        assert!(close(l.first_message_seconds(5e5, 1.0), 1e-3 + 0.1));
        assert!(close(
            l.first_message_seconds(5e5, 2.0),
            1e-3 + (5e5 - 2e5) * 2.0 / 1e6
        ));
        assert!(close(l.first_message_seconds(3e5, 1.0), 1e-3));
        // A ring's first round gets it: 2(n−1) rounds, one of them fresh.
        let c = one_node(2, l);
        let place = Placement::new(&c, 2);
        let g = vec![vec![0, 1]];
        let elems = 2 * 100_000; // chunks of 400 kB f32: one segment each
        let fresh = place.all_reduce(&g, elems, 4, &workload(1), true).seconds;
        let busy = place.all_reduce(&g, elems, 4, &workload(1), false).seconds;
        assert!(close(busy, 2.0 * (1e-3 + (4e5 - 1e3) / 1e6)), "{busy}");
        assert!(close(fresh, 1e-3 + (1e-3 + (4e5 - 1e3) / 1e6)), "{fresh}");
    }

    #[test]
    fn ring_all_reduce_matches_its_closed_form() {
        let (a, b) = (20e-6, 2e9);
        let w = workload(1);
        for n in [2usize, 3, 4, 8] {
            let c = one_node(n, Link::new(a, b));
            let place = Placement::new(&c, n);
            let g = vec![(0..n).collect::<Vec<_>>()];
            // 8 MiB of f32 divisible by n·segments: chunk S/n in g = ⌈(S/n)/512 KiB⌉ segments.
            let elems = 2 * MIB * 3 * 5 * 7;
            let s = (elems * 4) as f64;
            let chunk = s / n as f64;
            let nseg = (chunk / (512.0 * 1024.0)).ceil();
            let expect = 2.0 * (n - 1) as f64 * nseg * (a + chunk / nseg / b);
            let got = place.all_reduce(&g, elems, 4, &w, false);
            assert!(
                close(got.seconds, expect),
                "n={n}: {} vs {expect}",
                got.seconds
            );
            assert!(close(
                got.bytes_per_rank,
                2.0 * (n - 1) as f64 / n as f64 * s
            ));
        }
    }

    #[test]
    fn recursive_doubling_matches_its_closed_form() {
        let (a, b) = (20e-6, 2e9);
        let w = workload(1);
        let s = 64.0 * 1024.0; // below the 256 KiB threshold: one segment
        for (n, rounds, sent) in [
            (2usize, 1.0, 1.0),
            (4, 2.0, 2.0),
            (8, 3.0, 3.0),
            (3, 3.0, 4.0 / 3.0),
            (6, 4.0, 2.0),
        ] {
            let c = one_node(n, Link::new(a, b));
            let place = Placement::new(&c, n);
            let g = vec![(0..n).collect::<Vec<_>>()];
            let got = place.all_reduce(&g, 16 * 1024, 4, &w, false);
            // log2 p rounds, plus fold and unfold when n is not a power of two.
            assert!(
                close(got.seconds, rounds * (a + s / b)),
                "n={n}: {}",
                got.seconds
            );
            // (2·rem + p·log2 p)·S / n bytes per rank.
            assert!(
                close(got.bytes_per_rank, sent * s),
                "n={n}: {}",
                got.bytes_per_rank
            );
        }
    }

    #[test]
    fn the_algorithm_is_chosen_by_size_like_the_communicator() {
        let c = one_node(4, Link::new(1e-3, 1e12));
        let place = Placement::new(&c, 4);
        let g = vec![(0..4).collect::<Vec<_>>()];
        let w = workload(1);
        // Just under 256 KiB: recursive doubling, 2 rounds of one message.
        let rd = place.all_reduce(&g, 64 * 1024 - 1, 4, &w, false);
        assert!((rd.seconds - 2e-3).abs() < 1e-6, "{}", rd.seconds);
        // At 256 KiB: ring, 2(n−1) = 6 rounds.
        let ring = place.all_reduce(&g, 64 * 1024, 4, &w, false);
        assert!((ring.seconds - 6e-3).abs() < 1e-6, "{}", ring.seconds);
        let forced = Workload {
            algorithm: "ring".into(),
            ..workload(1)
        };
        assert!((place.all_reduce(&g, 10, 4, &forced, false).seconds - 6e-3).abs() < 1e-6);
    }

    #[test]
    fn bytes_per_step_equal_what_the_bench_mlp_runs_sent() {
        // MLP 784-512-512-10 (669,706 parameters), reproducible: measured on 2 and 4 workers
        // (runs of configs/bench-mlp784.toml): 5,357,704 and 8,036,584 bytes per rank and step.
        let w = workload(669_706);
        for (n, measured) in [(2usize, 5_357_704.0), (4, 8_036_584.0)] {
            let c = one_node(n, Link::new(1e-5, 1e9));
            let place = Placement::new(&c, n);
            let g = vec![(0..n).collect::<Vec<_>>()];
            let b =
                (place.loss_exchange(n, &w) + place.gradient_sync(&g, w.params, &w)).bytes_per_rank;
            assert!(close(b, measured), "n={n}: {b} vs {measured}");
        }
    }

    #[test]
    fn flows_across_nodes_share_the_link() {
        // 2 nodes × 2 workers: recursive doubling pairs (0,1),(2,3) inside nodes, then (0,2),(1,3)
        // across: two flows each way share the inter-node link.
        let c = Cluster {
            nodes: 2,
            workers_per_node: 2,
            inter: Link::new(100e-6, 1e8),
            intra: Link::new(10e-6, 1e10),
            shm: Link::new(1e-6, 1e11),
            compute_scale: 1.0,
        };
        let place = Placement::new(&c, 4);
        assert_eq!(place.transport(), "tcp");
        let g = vec![vec![0, 1, 2, 3]];
        let s = 100_000.0;
        let got = place.all_reduce(&g, 25_000, 4, &workload(1), false).seconds;
        let expect = (10e-6 + s / 1e10) + (100e-6 + 2.0 * s / 1e8);
        assert!(close(got, expect), "{got} vs {expect}");
        // A ring over the same ranks: links 1→2 and 3→0 cross, one flow each way.
        let elems = 4 * MIB;
        let ring = place.all_reduce(&g, elems, 4, &workload(1), false).seconds;
        let seg = 512.0 * 1024.0;
        assert!(close(ring, 6.0 * 8.0 * (100e-6 + seg / 1e8)), "{ring}");
    }

    fn rec(
        rank: usize,
        step: u64,
        work: f64,
        sync: f64,
        opt: f64,
        total: f64,
        samples: usize,
    ) -> StepRecord {
        StepRecord {
            rank,
            step,
            loss: 1.0,
            lr: 0.1,
            samples,
            samples_per_sec: 1.0,
            step_seconds: total,
            seconds: PhaseSeconds {
                data: work * 0.1,
                forward: work * 0.3,
                backward: work * 0.6,
                communication: sync * 0.8,
                waiting: sync * 0.2,
                optimizer: opt,
                overlapped_communication: 0.0,
            },
            bytes_sent: 1000,
            eval: None,
            pipeline: None,
        }
    }

    fn summary(world: usize, transport: &str) -> Summary {
        Summary {
            world_size: world,
            steps: 20,
            global_batch: 256,
            microbatch: 64,
            reproducible: true,
            transport: transport.into(),
            final_loss: 1.0,
            test_loss: 1.0,
            test_accuracy: 0.5,
            param_hash: "00".into(),
            config_hash: "00".into(),
            wall_seconds: 1.0,
            samples_per_sec: 1.0,
            imbalance: 1.0,
            straggler: None,
            bytes_sent_total: 0,
            communication_fraction: 0.0,
            evals: vec![],
            ranks: vec![],
            pipeline: None,
        }
    }

    #[test]
    fn calibration_recovers_the_synthetic_run() {
        // 2 workers, 2 micro-batches of 64 each; rank 1 is the slower. Steps 0–1 are warm-up
        // (10% of 20) and step 5 is wildly slow: the medians must ignore both.
        let p = 1_000_000;
        let w = workload(p);
        let link = Link::new(10e-6, 4e9);
        let mut records = Vec::new();
        for step in 0..20u64 {
            let slow = if step < 2 || step == 5 { 10.0 } else { 1.0 };
            records.push(rec(0, step, 0.010, 0.012, 0.002, 0.0245, 128));
            records.push(rec(
                1,
                step,
                0.0128 * slow,
                0.011,
                0.002,
                0.0275 * slow,
                128,
            ));
        }
        let cal = calibrate(&summary(2, "tcp"), &records, &w, &link).unwrap();
        assert_eq!(cal.steps_used, 18);
        assert!(
            close(cal.work_per_sample_s, 0.0128 / 128.0),
            "{}",
            cal.work_per_sample_s
        );
        assert!(close(cal.measured_step_s, 0.0275));
        assert!(close(cal.optimizer_per_param_s, 0.002 / p as f64));
        // Overhead: 27.5 − 12.8 − 11 − 2 ms on the critical rank.
        assert!(
            (cal.overhead_s - 0.0017).abs() < 1e-12,
            "{}",
            cal.overhead_s
        );
        // κ: the critical rank's 11 ms of sync less the modelled network, over P·(2+1) passes.
        let own = Cluster::uniform(2, link);
        let place = Placement::new(&own, 2);
        let g = vec![vec![0, 1]];
        let net = (place.loss_exchange(2, &w) + place.gradient_sync(&g, p, &w)).seconds;
        assert!(close(cal.modelled_network_s, net));
        assert!(close(
            cal.sync_cpu_per_unit_s,
            (0.011 - net) / (3 * p) as f64
        ));
        // And the model then predicts the calibration run's own step from its parts.
        let c = Cluster::uniform(2, link);
        let pred = predict(&c, &w, &cal, Layout { dp: 2, pp: 1 }).unwrap();
        assert!((pred.step_s - 0.0275).abs() < 1e-9, "{}", pred.step_s);
        assert_eq!(cal.layer_shares, vec![1.0]);
    }

    #[test]
    fn calibration_without_steady_steps_says_what_to_do() {
        // A one-step run: its only step is the last, which also evaluates: nothing steady.
        let mut last = rec(0, 0, 0.01, 0.0, 0.001, 0.011, 256);
        last.eval = Some(crate::metrics::Eval {
            test_loss: 1.0,
            test_accuracy: 0.5,
        });
        let records = vec![last];
        let e = calibrate(
            &summary(1, "shm"),
            &records,
            &workload(10),
            &Link::new(0.0, 1e9),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("steady-state") && e.contains("train.steps"),
            "{e}"
        );
    }

    fn pipeline_workload(layers: usize, act: usize) -> Workload {
        Workload {
            microbatches: 8,
            microbatch: 4,
            layers: (0..layers)
                .map(|i| Layer {
                    name: format!("l{i}"),
                    params: 1000,
                    activation_bytes_per_sample: if i + 1 == layers { 0 } else { act },
                })
                .collect(),
            ..workload(1000 * layers)
        }
    }

    fn flat_calibration(per_sample: f64, layers: usize) -> Calibration {
        Calibration {
            world: 1,
            dp: 1,
            pp: 1,
            transport: "shm".into(),
            steps_used: 10,
            measured_step_s: 0.0,
            work_per_sample_s: per_sample,
            optimizer_per_param_s: 0.0,
            sync_cpu_per_unit_s: 0.0,
            overhead_s: 0.0,
            measured_sync_s: 0.0,
            modelled_network_s: 0.0,
            link: Link::new(0.0, 1e9),
            layer_shares: even(layers),
            layer_shares_from: "even".into(),
            measured_bytes_per_rank_step: 0.0,
            modelled_bytes_per_rank_step: 0.0,
            notes: vec![],
        }
    }

    #[test]
    fn pipeline_step_has_the_ideal_bubble_on_a_free_network() {
        // 4 equal layers on 4 stages, m = 8 micro-batches of 4 samples, 1 ms per sample.
        let w = pipeline_workload(4, 1024);
        let cal = flat_calibration(1e-3, 4);
        let free = Link::new(0.0, 1e18);
        let c = Cluster::uniform(4, free);
        let p = predict(&c, &w, &cal, Layout { dp: 1, pp: 4 }).unwrap();
        let t_stage = 0.25 * 4.0 * 1e-3;
        assert!(close(p.compute_s + p.bubble_s, (8.0 + 3.0) * t_stage));
        assert!(
            close(p.bubble_fraction, 3.0 / 11.0),
            "{}",
            p.bubble_fraction
        );
        assert_eq!(p.stage_layers, vec![(0, 1), (1, 2), (2, 3), (3, 4)]);
        // 3 boundaries × 8 micro-batches × 4 KiB each way over 4 ranks, plus the loss exchange
        // (recursive doubling on 4 ranks: 2 rounds of 4 + 8 bytes).
        assert_eq!(p.bytes_per_rank_step, 2.0 * 8.0 * 3.0 * 4096.0 / 4.0 + 24.0);
        // Latency α = 2 ms per message, more than a stage's 1 ms: the links pace the pipeline.
        // (m − 1)·α for the stream, p·t_stage and 2(p − 1)·α for the first micro-batch's path.
        let slow = Cluster::uniform(4, Link::new(2e-3, 1e18));
        let q = predict(&slow, &w, &cal, Layout { dp: 1, pp: 4 }).unwrap();
        let schedule = 7.0 * 2e-3 + 4.0 * t_stage + 6.0 * 2e-3;
        assert!(close(q.compute_s + q.bubble_s + q.p2p_s, schedule), "{q:?}");
        assert!(close(q.p2p_s, schedule - 11.0 * t_stage), "{}", q.p2p_s);
    }

    #[test]
    fn stages_are_balanced_by_measured_layer_cost() {
        assert_eq!(
            balanced_stages(&[1.0, 1.0, 1.0, 1.0, 4.0], 2),
            vec![(0, 4), (4, 5)]
        );
        assert_eq!(
            balanced_stages(&[3.0, 1.0, 1.0, 1.0], 2),
            vec![(0, 1), (1, 4)]
        );
        assert_eq!(
            balanced_stages(&[1.0, 2.0, 3.0], 3),
            vec![(0, 1), (1, 2), (2, 3)]
        );
    }

    #[test]
    fn recommendation_picks_the_fastest_feasible_layout() {
        let w = workload(669_706);
        let mut cal = flat_calibration(1e-4, 1);
        cal.sync_cpu_per_unit_s = 1e-9;
        let spec = |nodes: usize, gbps: f64| ClusterSpec {
            nodes: Some(nodes),
            workers_per_node: Some(1),
            link_gbps: Some(gbps),
            link_latency_us: Some(50.0),
            ..Default::default()
        };
        // A fast network: all four workers (a dp of 8 is skipped: only 4 micro-batches).
        let fast = spec(8, 400.0).resolve().unwrap();
        let p = plan(
            &fast,
            &w,
            &cal,
            Some(&[
                Layout { dp: 1, pp: 1 },
                Layout { dp: 2, pp: 1 },
                Layout { dp: 4, pp: 1 },
                Layout { dp: 8, pp: 1 },
            ]),
        );
        assert_eq!(
            p.recommendation.as_ref().unwrap().layout,
            Layout { dp: 4, pp: 1 }
        );
        assert_eq!(p.skipped.len(), 1);
        assert!(
            p.skipped[0].reason.contains("micro-batches"),
            "{}",
            p.skipped[0].reason
        );
        let best = p
            .predictions
            .iter()
            .map(|x| x.step_s)
            .fold(f64::INFINITY, f64::min);
        assert_eq!(p.recommendation.as_ref().unwrap().step_s, best);
        // A slow network: the gradient (5.4 MB) costs more than the compute it saves.
        let slow = spec(4, 0.1).resolve().unwrap();
        let p = plan(&slow, &w, &cal, None);
        let r = p.recommendation.unwrap();
        assert_eq!(r.layout, Layout { dp: 1, pp: 1 });
        assert!(r.why.contains("more workers do not pay"), "{}", r.why);
        // Speedup and efficiency are against one worker.
        for x in &p.predictions {
            assert!(close(x.speedup, p.single_worker_step_s / x.step_s));
            assert!(close(x.efficiency, x.speedup / x.workers as f64));
        }
    }

    #[test]
    fn candidates_cover_worlds_and_pipeline_depths() {
        let c = ClusterSpec {
            nodes: Some(3),
            workers_per_node: Some(2),
            link_gbps: Some(10.0),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        let flat: Vec<String> = candidate_layouts(&c, &workload(10))
            .iter()
            .map(|l| l.to_string())
            .collect();
        assert_eq!(flat, ["dp=1", "dp=2", "dp=4", "dp=6"]);
        let deep: Vec<String> = candidate_layouts(&c, &pipeline_workload(3, 8))
            .iter()
            .map(|l| l.to_string())
            .collect();
        assert_eq!(
            deep,
            [
                "dp=1",
                "dp=2",
                "dp=1×pp=2",
                "dp=4",
                "dp=2×pp=2",
                "dp=6",
                "dp=3×pp=2",
                "dp=2×pp=3"
            ]
        );
    }

    #[test]
    fn bad_cluster_descriptions_name_the_flag() {
        let err = |s: ClusterSpec| s.resolve().unwrap_err().to_string();
        let base = ClusterSpec {
            nodes: Some(2),
            workers_per_node: Some(2),
            link_gbps: Some(1.0),
            ..Default::default()
        };
        let e = err(ClusterSpec {
            link_gbps: Some(0.0),
            ..base.clone()
        });
        assert!(
            e.contains("--link-gbps") && e.contains("link_gbps") && e.contains("positive"),
            "{e}"
        );
        let e = err(ClusterSpec {
            link_gbps: None,
            ..base.clone()
        });
        assert!(
            e.contains("--link-gbps") && e.contains("required for 2 nodes"),
            "{e}"
        );
        let e = err(ClusterSpec {
            workers_per_node: None,
            ..base.clone()
        });
        assert!(
            e.contains("--workers-per-node") && e.contains("required"),
            "{e}"
        );
        let e = err(ClusterSpec {
            nodes: Some(0),
            ..base.clone()
        });
        assert!(e.contains("--nodes") && e.contains("at least 1"), "{e}");
        let e = err(ClusterSpec {
            link_efficiency: Some(1.5),
            ..base.clone()
        });
        assert!(e.contains("--link-efficiency"), "{e}");
        let e = err(ClusterSpec {
            link_latency_us: Some(-1.0),
            ..base.clone()
        });
        assert!(e.contains("--link-latency-us"), "{e}");
        let e = err(ClusterSpec {
            compute_scale: Some(f64::NAN),
            ..base.clone()
        });
        assert!(e.contains("--compute-scale"), "{e}");
        let e = ClusterSpec::from_toml_str("nodes = 2\nlink_gbs = 1", "cluster.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cluster.toml") && e.contains("link_gbs"), "{e}");
        // Flags win over the file; the file fills the rest.
        let file =
            ClusterSpec::from_toml_str("nodes = 2\nworkers_per_node = 4\nlink_gbps = 10", "f")
                .unwrap();
        let c = ClusterSpec {
            nodes: Some(3),
            ..Default::default()
        }
        .or(file)
        .resolve()
        .unwrap();
        assert_eq!((c.nodes, c.workers_per_node), (3, 4));
        assert!(close(
            c.inter.bytes_per_s,
            10e9 / 8.0 * DEFAULT_LINK_EFFICIENCY
        ));
    }

    #[test]
    fn the_calibration_link_defaults_by_transport_and_checks_its_flags() {
        let shm = calibration_link("shm", None, None).unwrap();
        assert!(close(shm.bytes_per_s, DEFAULT_SHM_GBYTES_PER_S * 1e9));
        let tcp = calibration_link("tcp", Some(1.5), Some(20.0)).unwrap();
        assert!(close(tcp.bytes_per_s, 1.5e9) && close(tcp.latency_s, 20e-6));
        let e = calibration_link("tcp", Some(0.0), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--calib-gbytes-per-s"), "{e}");
    }

    #[test]
    fn layouts_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_layouts("1, 4x1,2x2").unwrap(),
            vec![
                Layout { dp: 1, pp: 1 },
                Layout { dp: 4, pp: 1 },
                Layout { dp: 2, pp: 2 }
            ]
        );
        let e = parse_layouts("2,0x2").unwrap_err().to_string();
        assert!(e.contains("`0x2`"), "{e}");
        assert!(parse_layouts("2y2").is_err());
        assert!(parse_layouts("").is_err());
    }

    #[test]
    fn pipeline_calibration_sums_a_replicas_stages() {
        // dp 1 × pp 2: stage 0 computes 3 ms, stage 1 5 ms per step over 2 micro-batches of 64.
        let w = Workload {
            microbatches: 2,
            ..pipeline_workload(2, 256)
        };
        let mut s = summary(2, "shm");
        s.pipeline = Some(PipelineSummary {
            dp: 1,
            pp: 2,
            microbatches_per_replica: 2,
            schedule: "1f1b".into(),
            stage_layers: vec![(0, 1), (1, 2)],
            cuts_from: "auto".into(),
            layer_seconds: vec![0.001, 0.003],
            bubble_fraction: 0.3,
            ideal_bubble_fraction: 1.0 / 3.0,
            peak_activations: vec![2, 1],
            stage_compute_seconds: vec![0.003, 0.005],
        });
        let mut records = Vec::new();
        for step in 0..20 {
            records.push(rec(0, step, 0.003, 0.001, 0.0005, 0.012, 0));
            records.push(rec(1, step, 0.005, 0.001, 0.0005, 0.012, 0));
        }
        let w = Workload {
            microbatch: 64,
            ..w
        };
        let cal = calibrate(&s, &records, &w, &Link::new(1e-6, 1e10)).unwrap();
        assert!(
            close(cal.work_per_sample_s, 0.008 / 128.0),
            "{}",
            cal.work_per_sample_s
        );
        assert_eq!(cal.layer_shares, vec![0.25, 0.75]);
        assert_eq!((cal.dp, cal.pp), (1, 2));
        // Per step: one activation forward and one gradient back per micro-batch over the one
        // boundary (256 B × 64 samples), half of it per rank, plus the 12-byte loss exchange.
        assert_eq!(
            cal.modelled_bytes_per_rank_step,
            2.0 * 2.0 * 16384.0 / 2.0 + 12.0
        );
    }
}
