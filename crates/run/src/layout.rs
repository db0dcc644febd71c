//! The parallel plan of a run: how its world is laid out (dp × tp × pp), how its model state is
//! sharded (ZeRO), whether backward overlaps the gradient sum, and which pipeline schedule runs —
//! decided once from the config, the world size and what the model can do ([`ModelShape`]).
//!
//! Every capability rule lives here and only here ("ZeRO 3 needs layers", "ZeRO 2 excludes
//! overlap", "tensor-parallel ranks divide the model's pieces", …): the launcher makes the plan
//! from what a job declares before any worker starts, and every worker makes it again from the
//! model it built, with the same function, so a request is refused once, with one message naming
//! the setting and the reason. `summary.json` records the plan the run followed.

use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, DeviceKind, ModelKind, ScheduleKind, TrainConfig};
use crate::parallel_dims::ParallelDims;

/// What a model can do, as far as the layout is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelShape {
    /// One flat parameter vector trained whole (a user's `Job`):
    /// data parallelism only.
    Flat {
        /// The model hands out each parameter's gradient during backward, so the sum can
        /// overlap it (`dist.overlap`).
        streams_gradients: bool,
        /// How this job would become layered, for refusals ("implement lockstep::LayeredJob
        /// …").
        to_layer: String,
        /// Its products honour `train.precision = "bf16"` (see [`ModelShape::bf16_products`]).
        bf16_products: bool,
    },
    /// A sequence of layers (a user's `LayeredJob`, the built-in transformer): pipelines, ZeRO
    /// 3 layer by layer, tensor parallelism over its fixed pieces. `None`: not known until the
    /// model is built (the workers check it then).
    Layered {
        layers: Option<usize>,
        tp_pieces: Option<usize>,
        /// Where the pieces come from, for refusals ("model.tp_pieces = 4", "job `x`'s
        /// tensor-parallel layers").
        pieces_from: String,
        /// Its layers can run their forward again in backward (`train.recompute = "layers"`):
        /// a `LayeredJob` or `StagedJob` (the built-in models included).
        recomputes: bool,
        /// Its products honour `train.precision = "bf16"` (see [`ModelShape::bf16_products`]).
        bf16_products: bool,
    },
}

impl ModelShape {
    /// Whether the model rounds its products' operands to bf16 when the config asks for it: the
    /// built-in models do; a user's job declares it (`const BF16_PRODUCTS: bool = true`) once
    /// its layers take their operands through `lockstep::ops::Products`.
    pub fn bf16_products(&self) -> bool {
        match self {
            ModelShape::Flat { bf16_products, .. } | ModelShape::Layered { bf16_products, .. } => {
                *bf16_products
            }
        }
    }
}

/// The plan a run follows (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParallelPlan {
    pub world: usize,
    /// Data-parallel replicas.
    pub dp: usize,
    /// Tensor-parallel ranks per stage.
    pub tp: usize,
    /// Pipeline stages per replica.
    pub pp: usize,
    /// `parallel.zero`, over each stage's data-parallel group.
    pub zero: u8,
    /// Micro-batches per step, and the most one replica computes.
    pub microbatches: usize,
    pub microbatches_per_replica: usize,
    /// The pipeline schedule (one stage runs its micro-batches one after another).
    pub schedule: Option<ScheduleKind>,
    /// The model's fixed tensor-parallel pieces (1: none).
    pub tp_pieces: usize,
    /// Gradient buckets reduced while backward still runs.
    pub overlap: bool,
    /// The gradient sum: exact (fixed point, the same bits for every layout) or plain `f32`.
    pub exact_sum: bool,
    /// The products take bf16 operands (`train.precision = "bf16"`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bf16_products: bool,
}

fn invalid(field: &'static str, message: String) -> ConfigError {
    ConfigError::Invalid { field, message }
}

impl ParallelPlan {
    /// The plan of `cfg` on `world` ranks for a model of `shape`, or the one refusal that names
    /// the setting and why.
    pub fn new(cfg: &TrainConfig, world: usize, shape: &ModelShape) -> Result<Self, ConfigError> {
        let tp_pieces = Self::check_shape(cfg, shape)?;
        let dims = ParallelDims::from_config(cfg, world)?;
        let p = &cfg.parallel;
        let microbatches = cfg.microbatches_per_step();
        Ok(ParallelPlan {
            world,
            dp: dims.dp,
            tp: dims.tp,
            pp: dims.pp,
            zero: p.zero,
            microbatches,
            microbatches_per_replica: microbatches.div_ceil(dims.dp),
            schedule: (dims.pp > 1).then_some(p.schedule),
            tp_pieces,
            overlap: cfg.dist.overlap,
            exact_sum: cfg.dist.reproducible,
            bf16_products: cfg.train.precision == crate::config::Precision::Bf16,
        })
    }

    /// `train.recompute = "layers"`: a layered job (burn layers whose forward can run again), not
    /// with `dist.overlap`. With tensor parallelism a recomputed forward sums its pieces over the
    /// group again (as Megatron's recomputation repeats its all-reduces): more communication,
    /// the same bits.
    fn check_recompute(cfg: &TrainConfig, shape: &ModelShape) -> Result<(), ConfigError> {
        if cfg.train.recompute == crate::config::Recompute::None {
            return Ok(());
        }
        let why = match shape {
            ModelShape::Layered {
                recomputes: true, ..
            } if cfg.dist.overlap => {
                "is not available with dist.overlap, whose backward already runs layer by layer from a kept \
                 graph"
                    .to_string()
            }
            ModelShape::Layered {
                recomputes: true, ..
            } => return Ok(()),
            _ => "recomputes whole layers: a LayeredJob's or StagedJob's (the built-in models are \
                  one), and this model is not"
                .to_string(),
        };
        Err(invalid(
            "train.recompute",
            format!("\"layers\" {why}; set train.recompute = \"none\""),
        ))
    }

    /// The rules that need no world size (checked when a job's config is validated, before the
    /// world is known); returns the model's tensor-parallel pieces (1 when not known yet).
    pub fn check_shape(cfg: &TrainConfig, shape: &ModelShape) -> Result<usize, ConfigError> {
        let p = &cfg.parallel;
        Self::check_device(cfg, shape)?;
        if cfg.optimizer.clip_grad_norm > 0.0 && p.tp > 1 {
            return Err(invalid(
                "optimizer.clip_grad_norm",
                format!(
                    "clipping by global norm is not available with tensor parallelism \
                     (parallel.tp = {}): its ranks hold the replicated tensors once each, and \
                     the norm would count them {} times; clip with parallel.tp = 1 (any dp, pp \
                     and ZeRO level), or set optimizer.clip_grad_norm = 0",
                    p.tp, p.tp
                ),
            ));
        }
        Self::check_recompute(cfg, shape)?;
        Self::check_precision(cfg, shape)?;
        match shape {
            ModelShape::Flat {
                streams_gradients,
                to_layer,
                ..
            } => {
                let needs_layers = |field, what: String| {
                    Err(invalid(
                        field,
                        format!(
                            "{what} needs a layered model: {to_layer}; this job runs \
                             data-parallel only"
                        ),
                    ))
                };
                if p.pp > 1 {
                    return needs_layers("parallel.pp", format!("parallel.pp = {}", p.pp));
                }
                if p.tp > 1 {
                    return needs_layers(
                        "parallel.tp",
                        format!("tensor parallelism (parallel.tp = {})", p.tp),
                    );
                }
                if p.zero >= 3 {
                    return needs_layers(
                        "parallel.zero",
                        "ZeRO 3, which gathers the parameters layer by layer,".into(),
                    );
                }
                if cfg.dist.overlap && !streams_gradients {
                    return Err(invalid(
                        "dist.overlap",
                        "this job's model does not hand out its gradients during backward (a \
                         burn Module does not expose each parameter's place in its layer), so \
                         the sum cannot overlap it: set dist.overlap = false"
                            .into(),
                    ));
                }
                Self::check_overlap(cfg)?;
                Ok(1)
            }
            ModelShape::Layered {
                layers,
                tp_pieces,
                pieces_from,
                ..
            } => {
                if let Some(layers) = *layers {
                    if p.pp > layers {
                        return Err(invalid(
                            "parallel.pp",
                            format!("{} stages but the model has only {layers} layers", p.pp),
                        ));
                    }
                    p.check_stages(layers)?;
                }
                if cfg.dist.overlap && (p.pp > 1 || p.tp > 1) {
                    return Err(invalid(
                        "dist.overlap",
                        format!(
                            "overlapping the gradient sum with backward needs one pipeline stage \
                             and no tensor parallelism (parallel.pp = {}, parallel.tp = {}): a \
                             pipeline reduces after its schedule; set dist.overlap = false",
                            p.pp, p.tp
                        ),
                    ));
                }
                Self::check_overlap(cfg)?;
                let Some(pieces) = *tp_pieces else {
                    return Ok(1);
                };
                if p.tp > 1 && pieces == 1 {
                    return Err(invalid(
                        "parallel.tp",
                        format!(
                            "{} tensor-parallel ranks need the model's tensor-parallel pieces, \
                             and its layers have none ({pieces_from}; the built-in transformer: \
                             set model.tp_pieces to a multiple of parallel.tp; a LayeredJob: \
                             build its layers with lockstep::tp::ColumnParallelLinear and \
                             RowParallelLinear)",
                            p.tp
                        ),
                    ));
                }
                if !pieces.is_multiple_of(p.tp) {
                    return Err(invalid(
                        "parallel.tp",
                        format!(
                            "{} tensor-parallel ranks must divide the {pieces} fixed pieces \
                             ({pieces_from}); each rank computes an equal share of them",
                            p.tp
                        ),
                    ));
                }
                Ok(pieces)
            }
        }
    }

    /// Every model is burn code and runs on any device, but tensor parallelism (whose layers
    /// are custom ops of burn's flex backend) stays on the CPU.
    fn check_device(cfg: &TrainConfig, shape: &ModelShape) -> Result<(), ConfigError> {
        let device = cfg.train.device;
        if device == DeviceKind::Cpu {
            return Ok(());
        }
        if cfg.parallel.tp > 1 {
            return Err(invalid(
                "parallel.tp",
                format!(
                    "lockstep::tp layers are custom operations of burn's flex CPU backend, so \
                     tensor parallelism (parallel.tp = {}) needs train.device = \"cpu\" (asked: \
                     \"{device}\")",
                    cfg.parallel.tp
                ),
            ));
        }
        if let ModelShape::Layered {
            tp_pieces: Some(pieces),
            pieces_from,
            ..
        } = shape
        {
            if *pieces > 1 {
                return Err(invalid(
                    "train.device",
                    format!(
                        "a model of {pieces} tensor-parallel pieces ({pieces_from}) computes them \
                         with custom operations of burn's flex CPU backend, so it needs \
                         train.device = \"cpu\" (asked: \"{device}\")"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `train.precision = "bf16"`: a model whose products take it (the built-in models, or a
    /// job that declares it), on the CPU, where its rounding and products were checked bit for
    /// bit.
    fn check_precision(cfg: &TrainConfig, shape: &ModelShape) -> Result<(), ConfigError> {
        if cfg.train.precision == crate::config::Precision::F32 {
            return Ok(());
        }
        if !shape.bf16_products() {
            return Err(invalid(
                "train.precision",
                "\"bf16\" needs a model whose products take bf16 operands, and this job does not \
                 declare it: take each product's operands through lockstep::ops::Products \
                 (`lockstep::products(cfg).operand(x)`) and set `const BF16_PRODUCTS: bool = \
                 true` in the job; or set train.precision = \"f32\""
                    .into(),
            ));
        }
        if cfg.train.device != DeviceKind::Cpu {
            return Err(invalid(
                "train.precision",
                format!(
                    "\"bf16\" runs on the CPU (train.device = \"cpu\") in this version; asked: \
                     \"{}\", where lockstep's bf16 rounding would be burn's cast, not checked \
                     on a device yet",
                    cfg.train.device
                ),
            ));
        }
        Ok(())
    }

    /// ZeRO 2 reduce-scatters the gradient after backward: nothing to overlap it with.
    fn check_overlap(cfg: &TrainConfig) -> Result<(), ConfigError> {
        if cfg.parallel.zero >= 2 && cfg.dist.overlap {
            return Err(invalid(
                "dist.overlap",
                "parallel.zero = 2 reduce-scatters the gradient after backward, so it cannot \
                 overlap with backward: set dist.overlap = false or parallel.zero ≤ 1"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The layout's coordinates of ranks (`ParallelDims`).
    pub fn dims(&self) -> ParallelDims {
        ParallelDims {
            world: self.world,
            dp: self.dp,
            pp: self.pp,
            tp: self.tp,
        }
    }

    /// "dp 2 × tp 1 × pp 2, ZeRO 1, 1f1b, exact sum" for logs.
    pub fn describe(&self) -> String {
        let mut s = format!("dp {} × tp {} × pp {}", self.dp, self.tp, self.pp);
        if self.zero > 0 {
            s += &format!(", ZeRO {}", self.zero);
        }
        if let Some(k) = self.schedule {
            s += &format!(", {k}");
        }
        if self.tp_pieces > 1 {
            s += &format!(", {} tensor-parallel pieces", self.tp_pieces);
        }
        if self.overlap {
            s += ", overlapped";
        }
        s += if self.exact_sum {
            ", exact sum"
        } else {
            ", plain sum"
        };
        if self.bf16_products {
            s += ", bf16 products";
        }
        s
    }
}

/// The built-in models' side of the plan (an inherent impl of [`TrainConfig`] kept here, so that
/// `config.rs` needs nothing of the plan).
impl TrainConfig {
    /// The shape of the built-in model of this config, `layers` its pipeline layers.
    pub fn builtin_shape(&self, layers: usize) -> ModelShape {
        let transformer = self.model.kind == ModelKind::Transformer;
        ModelShape::Layered {
            layers: Some(layers),
            tp_pieces: Some(if transformer {
                self.model.tp_pieces.max(1)
            } else {
                1
            }),
            pieces_from: if transformer {
                format!("model.tp_pieces = {}", self.model.tp_pieces)
            } else {
                format!("model `{}` has no tensor-parallel layers", self.model.kind)
            },
            // Every built-in model is made of whole layers (the transformer with pieces, too: a
            // layered job of lockstep::tp layers), so each can recompute its layers.
            recomputes: true,
            bf16_products: true,
        }
    }

    /// A config of lockstep's built-in jobs from TOML `text`, with the checks that need nothing
    /// but the config (the model, the data, lockstep's sections, the layout's own rules) — not
    /// the memory limits, which need the model (`lockstep_train::ConfigLoad` applies them too).
    pub fn parse_builtin(
        text: &str,
        origin: &str,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let cfg = Self::parse(("", "built-in defaults"), text, origin, overrides)?;
        if let Some(key) = cfg.job.keys().next() {
            return Err(ConfigError::Invalid {
                field: "job",
                message: format!("`job.{key}`: lockstep's built-in models take no [job] settings"),
            });
        }
        cfg.validate_model_and_data()?;
        cfg.validate_sections()?;
        ParallelPlan::check_shape(&cfg, &cfg.builtin_shape(cfg.pipeline_layers()))?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(sets: &[&str]) -> TrainConfig {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        TrainConfig::parse(("", "defaults"), "", "test", &sets).unwrap()
    }

    fn flat(streams: bool) -> ModelShape {
        ModelShape::Flat {
            streams_gradients: streams,
            to_layer: "implement lockstep::LayeredJob".into(),
            bf16_products: false,
        }
    }

    fn layered(layers: usize, pieces: usize) -> ModelShape {
        ModelShape::Layered {
            layers: Some(layers),
            tp_pieces: Some(pieces),
            pieces_from: format!("model.tp_pieces = {pieces}"),
            recomputes: true,
            bf16_products: true,
        }
    }

    fn refused(cfg: &TrainConfig, world: usize, shape: &ModelShape) -> (&'static str, String) {
        match ParallelPlan::new(cfg, world, shape).unwrap_err() {
            ConfigError::Invalid { field, message } => (field, message),
            other => panic!("not a field error: {other}"),
        }
    }

    #[test]
    fn every_capability_rule_is_one_refusal_naming_the_setting() {
        for (sets, shape, field) in [
            (vec!["parallel.pp=2"], flat(true), "parallel.pp"),
            (vec!["parallel.tp=2"], flat(true), "parallel.tp"),
            (vec!["parallel.zero=3"], flat(true), "parallel.zero"),
            (vec!["dist.overlap=true"], flat(false), "dist.overlap"),
            (
                vec!["dist.overlap=true", "parallel.zero=2"],
                flat(true),
                "dist.overlap",
            ),
            (vec!["parallel.pp=4"], layered(3, 1), "parallel.pp"),
            (vec!["parallel.tp=2"], layered(4, 1), "parallel.tp"),
            (vec!["parallel.tp=2"], layered(4, 3), "parallel.tp"),
            (
                vec!["dist.overlap=true", "parallel.pp=2"],
                layered(4, 1),
                "dist.overlap",
            ),
            (
                vec!["dist.overlap=true", "parallel.zero=2"],
                layered(4, 1),
                "dist.overlap",
            ),
            (
                vec!["optimizer.clip_grad_norm=1.0", "parallel.tp=2"],
                layered(4, 2),
                "optimizer.clip_grad_norm",
            ),
            (
                vec!["train.recompute=\"layers\""],
                flat(true),
                "train.recompute",
            ),
            (
                vec!["train.precision=\"bf16\""],
                flat(true),
                "train.precision",
            ),
            (
                vec!["train.precision=\"bf16\"", "train.device=\"wgpu\""],
                layered(4, 1),
                "train.precision",
            ),
            (
                vec!["train.recompute=\"layers\"", "dist.overlap=true"],
                layered(4, 1),
                "train.recompute",
            ),
        ] {
            let c = cfg(&sets);
            let (got, message) = refused(&c, 4, &shape);
            assert_eq!(got, field, "{sets:?}: {message}");
        }
        let (_, m) = refused(&cfg(&["parallel.zero=3"]), 2, &flat(true));
        assert!(m.contains("implement lockstep::LayeredJob"), "{m}");
        // Every built-in model recomputes its layers, the transformer with tensor-parallel pieces
        // too, on one tp rank or several (whose recomputed forwards sum their pieces again).
        let recompute = cfg(&["train.recompute=\"layers\""]);
        let transformer = cfg(&["train.recompute=\"layers\"", "model.kind=transformer"]);
        assert!(ParallelPlan::new(&transformer, 2, &transformer.builtin_shape(4)).is_ok());
        let pieces = cfg(&[
            "train.recompute=\"layers\"",
            "model.kind=transformer",
            "model.tp_pieces=2",
        ]);
        assert!(ParallelPlan::new(&pieces, 2, &pieces.builtin_shape(4)).is_ok());
        let tp = cfg(&[
            "train.recompute=\"layers\"",
            "model.kind=transformer",
            "model.tp_pieces=2",
            "parallel.tp=2",
        ]);
        assert!(ParallelPlan::new(&tp, 2, &tp.builtin_shape(4)).is_ok());
        assert!(ParallelPlan::new(&recompute, 2, &layered(4, 1)).is_ok());
        for kind in ["mlp", "cnn"] {
            let c = cfg(&["train.recompute=\"layers\"", &format!("model.kind={kind}")]);
            assert!(
                ParallelPlan::new(&c, 2, &c.builtin_shape(3)).is_ok(),
                "{kind}"
            );
        }
    }

    #[test]
    fn every_model_runs_on_devices_and_tensor_parallelism_stays_on_the_cpu() {
        for device in ["wgpu", "cuda", "auto"] {
            let set = format!("train.device={device}");
            assert!(ParallelPlan::new(&cfg(&[&set]), 2, &flat(true)).is_ok());
            assert!(ParallelPlan::new(&cfg(&[&set, "parallel.pp=2"]), 2, &layered(4, 1)).is_ok());
            for kind in ["mlp", "cnn"] {
                let c = cfg(&[&set, &format!("model.kind={kind}"), "parallel.pp=2"]);
                assert!(
                    ParallelPlan::new(&c, 2, &c.builtin_shape(3)).is_ok(),
                    "{kind}"
                );
            }
            let c = cfg(&[&set, "model.kind=transformer"]);
            assert!(ParallelPlan::new(&c, 2, &c.builtin_shape(4)).is_ok());
            let c = cfg(&[&set, "model.kind=transformer", "model.tp_pieces=2"]);
            let (field, m) = refused(&c, 2, &c.builtin_shape(4));
            assert_eq!(field, "train.device", "{m}");
            let (field, m) = refused(&cfg(&[&set, "parallel.tp=2"]), 2, &layered(4, 2));
            assert_eq!(field, "parallel.tp", "{m}");
        }
        let c = cfg(&["model.kind=transformer"]);
        assert!(ParallelPlan::new(&c, 1, &c.builtin_shape(4)).is_ok());
    }

    #[test]
    fn clipping_composes_with_every_layout_but_tensor_parallel_ranks() {
        let clip = "optimizer.clip_grad_norm=1.0";
        for sets in [
            vec![clip, "parallel.pp=2", "parallel.zero=3"],
            vec![clip, "model.tp_pieces=2"],
        ] {
            assert!(
                ParallelPlan::new(&cfg(&sets), 4, &layered(4, 2)).is_ok(),
                "{sets:?}"
            );
        }
        let (_, m) = refused(&cfg(&[clip, "parallel.tp=2"]), 4, &layered(4, 2));
        assert!(m.contains("(parallel.tp = 2)") && !m.contains("  "), "{m}");
    }

    #[test]
    fn a_layered_model_on_one_stage_may_overlap() {
        let plan = ParallelPlan::new(&cfg(&["dist.overlap=true"]), 2, &layered(4, 1)).unwrap();
        assert!(plan.overlap);
    }

    #[test]
    fn a_plan_records_the_layout_and_the_paths() {
        let c = cfg(&[
            "parallel.pp=2",
            "parallel.zero=1",
            "parallel.microbatches=4",
        ]);
        let plan = ParallelPlan::new(&c, 4, &layered(4, 1)).unwrap();
        assert_eq!((plan.dp, plan.tp, plan.pp, plan.zero), (2, 1, 2, 1));
        assert_eq!(plan.microbatches_per_replica, 2);
        assert_eq!(plan.schedule, Some(ScheduleKind::OneFOneB));
        assert_eq!(plan.dims(), ParallelDims::new(4, 0, 1, 2).unwrap());
        assert_eq!(
            plan.describe(),
            "dp 2 × tp 1 × pp 2, ZeRO 1, 1f1b, exact sum"
        );
        // Layers not known yet (a user's layered job before it is built): checked later.
        let unknown = ModelShape::Layered {
            layers: None,
            tp_pieces: None,
            pieces_from: String::new(),
            recomputes: true,
            bf16_products: true,
        };
        assert!(ParallelPlan::check_shape(&cfg(&["parallel.pp=9"]), &unknown).is_ok());
        // A world the layout does not fit.
        assert!(ParallelPlan::new(&cfg(&["parallel.pp=2"]), 3, &layered(4, 1)).is_err());
    }
}
