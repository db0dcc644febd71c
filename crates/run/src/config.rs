//! The training configuration: TOML with a default for every field, `--set key=value` overrides,
//! and validation up front with errors that name the field.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Errors in a configuration file or override; each names the field (or file) at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {cause}")]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("override `{0}` must look like key=value (e.g. train.steps=20)")]
    BadOverride(String),
    #[error("override `{key}`: `{part}` is not a table in the config")]
    OverridePath { key: String, part: String },
    #[error("invalid config: {field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}

/// Largest learning rate accepted: anything above is a typo, not a schedule.
pub const MAX_LR: f32 = 1e4;
/// Shortest wait a collective may be given (seconds).
pub const MIN_TIMEOUT_SECS: f64 = 0.1;

pub fn invalid(field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        message: message.into(),
    }
}

/// Declares a config enum: serde spelling, `name()` and `Display` from one table.
macro_rules! config_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name {
            $($(#[$vdoc])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            /// The config's spelling.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl std::str::FromStr for $name {
            type Err = String;
            /// The config's spelling (for command-line flags).
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($text => Ok($name::$variant),)+
                    other => Err(format!(
                        "`{other}` is not one of {}",
                        [$(concat!("\"", $text, "\"")),+].join(", ")
                    )),
                }
            }
        }
    };
}

config_enum! {
    /// lockstep's built-in model (`model.kind`).
    ModelKind {
        Mlp => "mlp",
        Cnn => "cnn",
        /// Character-level language model (needs a text dataset).
        Transformer => "transformer",
    }
}

config_enum! {
    /// lockstep's built-in datasets (`data.dataset`).
    DatasetKind {
        /// sklearn digits, embedded (or `data.dir`/digits.csv.gz).
        Digits => "digits",
        /// IDX files from Debian's `dataset-fashion-mnist` (or `data.dir`).
        FashionMnist => "fashion-mnist",
        /// IDX files under `data.dir`.
        Mnist => "mnist",
        /// The embedded plays (or `data.dir`/{train,val}.txt): text for the transformer.
        Shakespeare => "shakespeare",
    }
}

config_enum! {
    /// `train.recompute`: what a training forward keeps for its backward.
    Recompute {
        /// Every layer's autodiff graph, until the micro-batch's backward.
        None => "none",
        /// Only each layer's input: the layer's forward runs again during backward (a user's
        /// `LayeredJob` / `StagedJob`; the same bits, less memory, about one more forward).
        Layers => "layers",
    }
}

fn is_no_recompute(r: &Recompute) -> bool {
    *r == Recompute::None
}

config_enum! {
    /// `train.precision`: the operands of the model's products (matrix products, convolutions,
    /// attention).
    Precision {
        /// `f32` operands.
        F32 => "f32",
        /// Operands rounded to bfloat16, each product summed in `f32`; the gradients of those
        /// operands rounded to bf16 too. Master weights, optimizer state and the exact gradient
        /// sum stay `f32` / fixed point.
        Bf16 => "bf16",
    }
}

fn is_f32(p: &Precision) -> bool {
    *p == Precision::F32
}

config_enum! {
    /// `optimizer.kind`.
    OptimizerKind {
        Sgd => "sgd",
        /// Adam with L2 weight decay added to the gradient (PyTorch's `Adam`).
        Adam => "adam",
        /// Adam with decoupled weight decay (PyTorch's `AdamW`).
        AdamW => "adamw",
        /// The job's own update rule (`Job::update_rule`).
        Custom => "custom",
    }
}

config_enum! {
    /// How ranks reach each other (`dist.transport`).
    TransportKind {
        /// Shared memory when all ranks share a host, else TCP.
        Auto => "auto",
        Shm => "shm",
        Tcp => "tcp",
        /// MPI point-to-point under mpirun (cargo feature `mpi`).
        Mpi => "mpi",
    }
}

config_enum! {
    /// Where a job's model, batches and autodiff live (`train.device`; `--device`).
    DeviceKind {
        /// burn's flex CPU backend (every model kind; lockstep's own CPU kernels for the
        /// built-in models).
        Cpu => "cpu",
        /// burn's wgpu backend on Vulkan (Metal on macOS); never a silent fall-back to OpenGL.
        Wgpu => "wgpu",
        /// burn's CUDA backend: GPU `local_rank mod count` (after `CUDA_VISIBLE_DEVICES`).
        Cuda => "cuda",
        /// CUDA if the binary has it and the machine has a GPU, else a hardware wgpu adapter
        /// (not a software one), else the CPU.
        Auto => "auto",
    }
}

config_enum! {
    /// Which schedule a pipeline runs (`parallel.schedule`).
    ScheduleKind {
        /// All forwards, then all backwards.
        GPipe => "gpipe",
        /// One forward, one backward in the steady state (fewer activations held).
        OneFOneB => "1f1b",
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
#[derive(Default)]
pub struct TrainConfig {
    pub model: ModelConfig,
    pub data: DataConfig,
    pub train: TrainSection,
    pub optimizer: OptimizerConfig,
    pub dist: DistConfig,
    pub parallel: ParallelConfig,
    pub checkpoint: CheckpointConfig,
    /// A user job's own settings (`[job]`), read by the job with [`TrainConfig::job_section`];
    /// part of the run's identity. lockstep's built-in jobs take none.
    #[serde(skip_serializing_if = "toml::Table::is_empty")]
    pub job: toml::Table,
}

/// Which sections of the config a job reads (what the run's config.toml shows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigSections {
    /// Every section, `[model]` and `[data]` included: lockstep's built-in models.
    All,
    /// lockstep's own sections and `[job]`: a user's job, whose model and data are its own.
    JobOwn,
}

/// Each float that is exactly an `f32` rewritten as that `f32`'s shortest decimal (which parses
/// back to the same `f32`). Settings are `f32` or `f64`; an `f64` setting holding exactly an
/// `f32` value keeps its value unless it was written with more digits than that `f32` needs.
fn shortest_floats(v: &mut toml::Value) {
    match v {
        toml::Value::Float(x) => {
            let narrow = *x as f32;
            if f64::from(narrow) == *x && narrow.is_finite() {
                *x = narrow
                    .to_string()
                    .parse()
                    .expect("an f32's decimal is a float");
            }
        }
        toml::Value::Table(t) => t.iter_mut().for_each(|(_, v)| shortest_floats(v)),
        toml::Value::Array(a) => a.iter_mut().for_each(shortest_floats),
        _ => {}
    }
}

/// How the model and the batch are split over the workers: `dp` data-parallel replicas of a
/// `pp`-stage pipeline (`dp · pp` = world size).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelConfig {
    /// Data-parallel replicas; 0 = world size / `pp`.
    pub dp: usize,
    /// Pipeline stages (1 = no pipeline). More than 1 needs `model.kind = "transformer"`.
    pub pp: usize,
    /// Tensor-parallel ranks per stage (1 = none); must divide `model.tp_pieces`, whose fixed
    /// pieces the ranks share (the transformer only).
    pub tp: usize,
    /// Micro-batches per global batch (over all replicas); 0 = `train.global_batch / train.microbatch`.
    /// Setting it sets the micro-batch size to `global_batch / microbatches`.
    pub microbatches: usize,
    /// Pipeline schedule: "gpipe" (all forwards, then all backwards) or "1f1b".
    pub schedule: ScheduleKind,
    /// First layer of stages 1..pp (pp − 1 increasing layer indices); empty = balance automatically
    /// from the measured cost of each layer.
    pub stage_cuts: Vec<usize>,
    /// Timed repetitions per layer when balancing automatically.
    pub profile_reps: usize,
    /// ZeRO sharding of the model state over each data-parallel group (never changes the bits):
    /// 0 = none; 1 = optimizer state sharded (each replica updates its shard, the parameters
    /// are all-gathered); 2 = also the reduced gradient (the exact sum is reduce-scattered);
    /// 3 = also the parameters (gathered layer by layer; layered models only).
    pub zero: u8,
    /// ZeRO 3 one layer at a time: layers gathered ahead of the one computing (0 = each when
    /// it is needed, on the stage's thread; 1 = the next one while the current one computes).
    /// At most [`MAX_PREFETCH_LAYERS`]; never changes the bits.
    pub prefetch_layers: usize,
}

/// The most layers `parallel.prefetch_layers` gathers ahead: each holds a whole layer's
/// parameters, and on a stage that computes one layer at a time a deeper queue hides no more.
pub const MAX_PREFETCH_LAYERS: usize = 4;

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            dp: 0,
            pp: 1,
            tp: 1,
            microbatches: 0,
            schedule: ScheduleKind::OneFOneB,
            stage_cuts: Vec::new(),
            profile_reps: 3,
            zero: 0,
            prefetch_layers: 1,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Save every this many steps (0 = never). A failure recomputes at most this many steps.
    pub every: u64,
    /// How many of the newest checkpoints to keep.
    pub keep: usize,
    /// Directory; empty = `<run dir>/checkpoints`.
    pub dir: String,
    /// Write checkpoints in the background while training goes on (the writer holds the step's
    /// state until written: the training buffers themselves where they hold it, else what was
    /// gathered for it). Not written when false, so older configs keep their text.
    #[serde(rename = "async", skip_serializing_if = "std::ops::Not::not")]
    pub background: bool,
    /// Every rank writes its own shard of the model state (a `step-<N>.shards` set with a
    /// manifest) instead of rank 0 the whole model: no rank holds the whole state for a
    /// checkpoint. `checkpoint.dir` must then be a directory every rank sees. Not written when
    /// false.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub sharded: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            every: 50,
            keep: 3,
            dir: String::new(),
            background: false,
            sharded: false,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// "mlp", "cnn" or "transformer" (character-level language model; needs a text dataset).
    pub kind: ModelKind,
    /// Hidden layer widths of the MLP.
    pub hidden: Vec<usize>,
    /// Output channels of each 3×3 conv (+ReLU, +2×2 max-pool) of the CNN.
    pub conv: Vec<usize>,
    /// Width of the CNN's fully connected hidden layer.
    pub cnn_hidden: usize,
    /// Transformer: width of the residual stream.
    pub d_model: usize,
    /// Transformer: attention heads per block (must divide `d_model`).
    pub heads: usize,
    /// Transformer: number of blocks (attention + MLP). The layer sequence that pipeline stages cut
    /// is embedding, blocks…, head: `blocks + 2` layers.
    pub blocks: usize,
    /// Transformer: context length in characters.
    pub context: usize,
    /// Transformer: hidden width of each block's MLP; 0 = 4 · `d_model`.
    pub d_ff: usize,
    /// Transformer: the canonical tensor-parallel split. 1 = blocks computed whole; T > 1 = each
    /// block's attention and MLP computed as T fixed pieces (heads, MLP columns) whose outputs
    /// are summed exactly, on any number of `parallel.tp` ranks (which must divide T) with the
    /// same bits. Must divide `heads` and `d_ff`.
    pub tp_pieces: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// "digits" (embedded), "fashion-mnist" or "mnist" (IDX files under `dir`), "shakespeare"
    /// (embedded text, for the transformer).
    pub dataset: DatasetKind,
    /// Where the files are; empty = the dataset's default location.
    pub dir: String,
    /// Held-out fraction for datasets without an official test split (digits).
    pub test_fraction: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    /// Optimizer steps; 0 = derive from `epochs`.
    pub steps: u64,
    /// Used when `steps` = 0.
    pub epochs: u64,
    /// Samples per optimizer step, over all workers together. Fixed whatever the world size.
    pub global_batch: usize,
    /// Samples per micro-batch: the unit of work whose composition never depends on the world size.
    pub microbatch: usize,
    pub lr: f32,
    pub min_lr: f32,
    pub warmup_steps: u64,
    pub seed: u64,
    /// Evaluate on the test set every this many steps (0 = only at the end).
    pub eval_every: u64,
    /// Progress line every this many steps.
    pub log_every: u64,
    /// Where the model computes (every model; tensor-parallel pieces only on the CPU).
    pub device: DeviceKind,
    /// Start from the parameters of this burn record (a `lockstep export` of another run, or a
    /// user's `module.save_file(…)`) instead of the seeded initialisation: fine-tuning. A user's
    /// `Job` / `LayeredJob` only. Empty (the default) = initialise from `seed`; not written when
    /// empty, so the identity of runs without it is as before.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub init_from: String,
    /// Activation recomputation (`"none"` or `"layers"`): never changes a bit, so not part of
    /// a run's identity, and not written when `"none"`.
    #[serde(skip_serializing_if = "is_no_recompute")]
    pub recompute: Recompute,
    /// `"f32"` (the default) or `"bf16"` products: part of the run's identity (bf16 changes the
    /// bits), not written when `"f32"`, so the identity of runs without it is as before.
    #[serde(skip_serializing_if = "is_f32")]
    pub precision: Precision,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    /// "sgd", "adam", "adamw", or "custom" (the job's own update rule).
    pub kind: OptimizerKind,
    pub momentum: f32,
    pub nesterov: bool,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Clip the summed gradient to this global L2 norm before the update (0 = off, the default):
    /// every gradient value is scaled by `min(1, clip / (norm + 1e-6))`, the norm being one exact
    /// sum of squares over the whole model, so the same on every layout. Not written when off,
    /// so the identity of runs without it is as before.
    #[serde(skip_serializing_if = "is_zero")]
    pub clip_grad_norm: f32,
}

fn is_zero(v: &f32) -> bool {
    *v == 0.0
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// Exact, order-independent gradient sum: same bits for any world size. Off = plain f32 ring sum
    /// (deterministic run to run at a fixed world size only).
    pub reproducible: bool,
    /// Gradient values per all-reduce bucket (and per shared exponent in reproducible mode).
    pub bucket_elems: usize,
    /// Reduce gradient buckets on a communication thread while backward is still running (the
    /// last local micro-batch streams its gradients out). Same result bits either way. Off by
    /// default: on a CPU-only host whose cores are all busy computing (the default
    /// `--threads-per-worker`), the thread's work (fixed-point conversion, shared-memory copies) is
    /// CPU work too and slows backward by about what it hides, so steps get slower, not faster.
    /// Worth turning on when communication leaves CPUs idle (network-bound multi-node jobs) or
    /// cores are spare. Models that fit in one bucket run the plain schedule either way.
    pub overlap: bool,
    /// Seconds any collective may wait for a peer before failing with the peer's name.
    pub timeout_secs: f64,
    /// "auto" (shared memory when all ranks share a host, else TCP), "shm", "tcp" or "mpi" (MPI
    /// point-to-point under mpirun; needs the cargo feature `mpi`).
    pub transport: TransportKind,
    /// "auto", "ring" or "recursive-doubling".
    pub algorithm: lockstep_comm::Algorithm,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            kind: ModelKind::Mlp,
            hidden: vec![128, 64],
            conv: vec![16, 32],
            cnn_hidden: 64,
            d_model: 128,
            heads: 4,
            blocks: 4,
            context: 64,
            d_ff: 0,
            tp_pieces: 1,
        }
    }
}
impl Default for DataConfig {
    fn default() -> Self {
        Self {
            dataset: DatasetKind::Digits,
            dir: String::new(),
            test_fraction: 0.2,
        }
    }
}
impl Default for TrainSection {
    fn default() -> Self {
        Self {
            steps: 300,
            epochs: 0,
            global_batch: 64,
            microbatch: 16,
            lr: 0.1,
            min_lr: 0.001,
            warmup_steps: 20,
            seed: 42,
            eval_every: 100,
            log_every: 10,
            device: DeviceKind::Cpu,
            init_from: String::new(),
            recompute: Recompute::None,
            precision: Precision::F32,
        }
    }
}
impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::Sgd,
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            clip_grad_norm: 0.0,
        }
    }
}
impl Default for DistConfig {
    fn default() -> Self {
        Self {
            reproducible: true,
            bucket_elems: 1 << 16,
            overlap: false,
            timeout_secs: 60.0,
            transport: TransportKind::Auto,
            algorithm: lockstep_comm::Algorithm::Auto,
        }
    }
}

/// A job's `[job]` settings type, named once (`const SETTINGS: JobSettings =
/// JobSettings::of::<MySettings>();` in its `Job`) so that lockstep checks the table against it
/// before any worker starts, with errors naming the field (`#[serde(deny_unknown_fields)]` on the
/// type makes a misspelt key one). The job reads it typed with [`TrainConfig::job_section`].
#[derive(Clone, Copy)]
pub struct JobSettings {
    check: Option<SettingsCheck>,
}

/// Reads a config's `[job]` table as one settings type.
type SettingsCheck = fn(&TrainConfig) -> Result<(), ConfigError>;

impl JobSettings {
    /// No settings type: the `[job]` table is the job's own business (its `validate`).
    pub const NONE: JobSettings = JobSettings { check: None };

    /// The settings type `T`.
    pub const fn of<T: serde::de::DeserializeOwned>() -> JobSettings {
        JobSettings {
            check: Some(check_as::<T>),
        }
    }

    /// `cfg`'s `[job]` table read as the settings type (nothing to check without one).
    pub fn check(&self, cfg: &TrainConfig) -> Result<(), ConfigError> {
        self.check.map_or(Ok(()), |check| check(cfg))
    }
}

fn check_as<T: serde::de::DeserializeOwned>(cfg: &TrainConfig) -> Result<(), ConfigError> {
    cfg.job_section::<T>().map(drop)
}

impl std::fmt::Debug for JobSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.check.is_some() {
            "JobSettings(typed)"
        } else {
            "JobSettings::NONE"
        })
    }
}

impl TrainConfig {
    /// The job's `[job]` table as the job's own settings type.
    pub fn job_section<T: serde::de::DeserializeOwned>(&self) -> Result<T, ConfigError> {
        toml::Value::Table(self.job.clone())
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                origin: "[job]".into(),
                message: e.to_string().trim().replace('\n', " "),
            })
    }

    /// `parallel.microbatches`, when set, decides the micro-batch size (it must divide the batch;
    /// an explicit `train.microbatch` must agree with it).
    pub fn resolve_microbatches(&mut self, both_given: bool) -> Result<(), ConfigError> {
        let m = self.parallel.microbatches;
        if m == 0 {
            return Ok(());
        }
        let b = self.train.global_batch;
        if b == 0 || !b.is_multiple_of(m) {
            return Err(invalid(
                "parallel.microbatches",
                format!("{m} micro-batches do not divide train.global_batch = {b}"),
            ));
        }
        if both_given && self.train.microbatch != b / m {
            return Err(invalid(
                "parallel.microbatches",
                format!(
                    "{m} micro-batches of train.global_batch = {b} means micro-batches of {}, \
                     but train.microbatch = {} (set one of them)",
                    b / m,
                    self.train.microbatch
                ),
            ));
        }
        self.train.microbatch = b / m;
        Ok(())
    }

    /// The resolved configuration as TOML, every section, floats as stored (`f32` widened): the
    /// text the config and identity hashes are taken of.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("config serialises")
    }

    /// The run directory's config.toml, for people and for `--resume`: the sections the job
    /// reads (`sections`; `[model]` and `[data]` also when they differ from the defaults, so
    /// the file still loads back to this config), and each `f32` setting in its shortest
    /// decimal form (`lr = 0.05`, not `0.05000000074505806`). Loading it gives back `self`, so
    /// its hashes are the same as `to_toml`'s text gives.
    pub fn to_run_file(&self, sections: ConfigSections) -> String {
        let mut value = toml::Value::try_from(self).expect("config serialises");
        shortest_floats(&mut value);
        let toml::Value::Table(mut all) = value else {
            unreachable!("a struct serialises as a table")
        };
        let defaults = TrainConfig::default();
        let own = sections == ConfigSections::JobOwn;
        let unused = |name: &str| match name {
            "model" => own && self.model == defaults.model,
            "data" => own && self.data == defaults.data,
            _ => false,
        };
        // Section by section, in the struct's order (a table alone would sort them); a section
        // missing from this list still comes last, never dropped.
        const ORDER: [&str; 8] = [
            "model",
            "data",
            "train",
            "optimizer",
            "dist",
            "parallel",
            "checkpoint",
            "job",
        ];
        let mut sections: Vec<(String, toml::Value)> = ORDER
            .iter()
            .filter_map(|name| Some((name.to_string(), all.remove(*name)?)))
            .collect();
        sections.extend(all);
        let mut out = String::new();
        for (name, section) in sections.into_iter().filter(|(n, _)| !unused(n)) {
            let mut one = toml::Table::new();
            one.insert(name, section);
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(&toml::to_string_pretty(&one).expect("config serialises"));
        }
        out
    }

    /// SHA-256 of the resolved config: identifies "the same run" (checkpoints, reports).
    pub fn hash_hex(&self) -> String {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(self.to_toml().as_bytes()))
    }

    /// SHA-256 of the settings that determine the training trajectory (see
    /// [`TrainConfig::identity_config`]); a checkpoint whose identity differs is refused.
    pub fn identity_hash(&self) -> String {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(
            self.identity_config().to_toml().as_bytes(),
        ))
    }

    /// The settings that determine the training trajectory: model, data, training (except its
    /// length), optimizer, and the gradient-sum mode and buckets (which fix the bits in
    /// reproducible mode). Logging, evaluation, timeouts, transport, overlap, checkpoint settings
    /// and the layout are reset to their defaults, so a run can resume with those changed.
    pub fn identity_config(&self) -> TrainConfig {
        let mut c = self.clone();
        c.train.eval_every = 0;
        c.train.log_every = 1;
        // A run may be extended (`--resume DIR --set train.steps=…`): its length is not its
        // identity. (The learning-rate schedule then spans the new length from the resumed step.)
        c.train.steps = 0;
        c.train.epochs = 0;
        c.train.recompute = Recompute::None;
        c.dist = DistConfig {
            reproducible: self.dist.reproducible,
            bucket_elems: self.dist.bucket_elems,
            ..DistConfig::default()
        };
        c.checkpoint = CheckpointConfig::default();
        // The layout (replicas, stages, schedule, cuts) never changes the bits; only the
        // micro-batch size does, and that is in `train.microbatch`.
        c.parallel = ParallelConfig::default();
        c
    }

    /// The config of `text` (from `origin`) on top of `defaults` (a job's default config; empty
    /// for lockstep's built-in defaults), with `key=value` overrides applied and the micro-batch
    /// keys resolved: the TOML mechanics only. Loading a job's config with every check is
    /// `lockstep_train`'s `ConfigLoad`.
    pub fn parse(
        defaults: (&str, &str),
        text: &str,
        origin: &str,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let parse = |text: &str, origin: &str| {
            text.parse::<toml::Table>()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    origin: origin.into(),
                    message: e.to_string(),
                })
        };
        let mut table = parse(defaults.0, defaults.1)?;
        merge(&mut table, parse(text, origin)?);
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let both_micro = table_has(&table, "train", "microbatch")
            && table_has(&table, "parallel", "microbatches");
        let mut cfg: TrainConfig =
            toml::Value::Table(table)
                .try_into()
                .map_err(|e: toml::de::Error| {
                    let origin = if overrides.is_empty() {
                        origin.to_string()
                    } else {
                        format!("{origin} with --set overrides")
                    };
                    ConfigError::Parse {
                        origin,
                        message: e.to_string().trim().replace('\n', " "),
                    }
                })?;
        cfg.resolve_microbatches(both_micro)?;
        Ok(cfg)
    }

    /// The keys lockstep writes for this config (every key of [`TrainConfig::to_run_file`] for a
    /// job reading `sections`) that the TOML `text` lacks, as "section.key". A run's
    /// `config.toml` is written whole, so a missing key means the file was cut or edited: loading
    /// it would silently take a default instead.
    pub fn missing_keys(&self, text: &str, sections: ConfigSections) -> Vec<String> {
        let Ok(file) = text.parse::<toml::Table>() else {
            return vec!["(the whole file: not TOML)".into()];
        };
        let ours: toml::Table = self.to_run_file(sections).parse().expect("our TOML parses");
        let mut missing = Vec::new();
        for (section, v) in &ours {
            match (v, file.get(section)) {
                (toml::Value::Table(keys), Some(toml::Value::Table(have))) => missing.extend(
                    keys.keys()
                        .filter(|k| !have.contains_key(*k))
                        .map(|k| format!("{section}.{k}")),
                ),
                (_, None) => missing.push(section.clone()),
                _ => {}
            }
        }
        missing
    }

    /// The identity settings in which `other` differs from `self`, as "key: ours → theirs".
    pub fn identity_differences(&self, other: &TrainConfig) -> Vec<String> {
        fn flatten(prefix: &str, v: &toml::Value, out: &mut Vec<(String, String)>) {
            match v {
                toml::Value::Table(t) => {
                    for (k, v) in t {
                        let key = if prefix.is_empty() {
                            k.clone()
                        } else {
                            format!("{prefix}.{k}")
                        };
                        flatten(&key, v, out);
                    }
                }
                other => out.push((prefix.to_string(), other.to_string())),
            }
        }
        let table = |c: &TrainConfig| {
            let mut out = Vec::new();
            // Through the TOML text, so an f32 reads as written (0.2, not 0.20000000298…).
            let text = c.identity_config().to_toml();
            let v: toml::Value = toml::Value::Table(text.parse().expect("our TOML parses"));
            flatten("", &v, &mut out);
            out
        };
        let (ours, theirs) = (table(self), table(other));
        ours.iter()
            .zip(&theirs)
            .filter(|(a, b)| a != b)
            .map(|((key, a), (_, b))| format!("{key}: {a} → {b}"))
            .collect()
    }

    /// Number of micro-batches in each global batch.
    pub fn microbatches_per_step(&self) -> usize {
        self.train.global_batch / self.train.microbatch
    }

    pub fn validate_model_and_data(&self) -> Result<(), ConfigError> {
        let text_data = self.data.dataset == DatasetKind::Shakespeare;
        if (self.model.kind == ModelKind::Transformer) != text_data {
            return Err(invalid(
                "model.kind",
                format!(
                    "model `{}` cannot train on dataset `{}`: the transformer is a character-level \
                     language model for \"shakespeare\"; \"mlp\"/\"cnn\" classify images",
                    self.model.kind, self.data.dataset
                ),
            ));
        }
        if self.model.kind == ModelKind::Transformer {
            self.validate_transformer()?;
        }
        self.validate_parallel(Some(self.pipeline_layers()))?;
        if self.model.kind == ModelKind::Cnn && self.model.conv.is_empty() {
            return Err(invalid("model.conv", "a CNN needs at least one conv layer"));
        }
        if self.model.hidden.contains(&0) {
            return Err(invalid("model.hidden", "layer widths must be ≥ 1"));
        }
        if self.data.dataset == DatasetKind::Mnist && self.data.dir.is_empty() {
            return Err(invalid(
                "data.dir",
                "dataset \"mnist\" needs data.dir: the folder holding its IDX files",
            ));
        }
        if !(0.0 < self.data.test_fraction && self.data.test_fraction < 1.0) {
            return Err(invalid(
                "data.test_fraction",
                format!("{} is not in (0, 1)", self.data.test_fraction),
            ));
        }
        Ok(())
    }

    /// train, optimizer, checkpoint and dist.
    pub fn validate_sections(&self) -> Result<(), ConfigError> {
        let t = &self.train;
        if t.steps == 0 && t.epochs == 0 {
            return Err(invalid(
                "train.steps",
                "set train.steps or train.epochs to at least 1",
            ));
        }
        if t.global_batch == 0 {
            return Err(invalid("train.global_batch", "must be ≥ 1"));
        }
        if t.microbatch == 0
            || t.microbatch > t.global_batch
            || !t.global_batch.is_multiple_of(t.microbatch)
        {
            return Err(invalid(
                "train.microbatch",
                format!(
                    "{} must be ≥ 1 and divide train.global_batch = {}",
                    t.microbatch, t.global_batch
                ),
            ));
        }
        if !(t.lr.is_finite() && t.lr > 0.0 && t.lr <= MAX_LR) {
            return Err(invalid(
                "train.lr",
                format!("{} must be a positive number up to {MAX_LR}", t.lr),
            ));
        }
        if !(t.min_lr.is_finite() && t.min_lr >= 0.0 && t.min_lr <= t.lr) {
            return Err(invalid(
                "train.min_lr",
                format!("{} must be in [0, train.lr]", t.min_lr),
            ));
        }
        if t.log_every == 0 {
            return Err(invalid("train.log_every", "must be ≥ 1"));
        }
        let o = &self.optimizer;
        if !(0.0..1.0).contains(&o.momentum) {
            return Err(invalid(
                "optimizer.momentum",
                format!("{} is not in [0, 1)", o.momentum),
            ));
        }
        if !(0.0..1.0).contains(&o.beta1) || !(0.0..1.0).contains(&o.beta2) {
            return Err(invalid(
                "optimizer.beta1",
                "beta1 and beta2 must be in [0, 1)",
            ));
        }
        // Written as containment tests so that NaN and infinity fail them too.
        if !(o.eps > 0.0 && o.eps <= 1.0) {
            return Err(invalid(
                "optimizer.eps",
                format!("{} is not in (0, 1]", o.eps),
            ));
        }
        if !(o.clip_grad_norm >= 0.0 && o.clip_grad_norm.is_finite()) {
            return Err(invalid(
                "optimizer.clip_grad_norm",
                format!("{} is not a finite norm ≥ 0 (0 = off)", o.clip_grad_norm),
            ));
        }
        if !(0.0..=1.0).contains(&o.weight_decay) {
            return Err(invalid(
                "optimizer.weight_decay",
                format!("{} is not in [0, 1]", o.weight_decay),
            ));
        }
        if self.checkpoint.keep == 0 {
            return Err(invalid("checkpoint.keep", "must be ≥ 1"));
        }
        let d = &self.dist;
        if d.bucket_elems == 0 {
            return Err(invalid("dist.bucket_elems", "must be ≥ 1"));
        }
        if !(d.timeout_secs.is_finite() && d.timeout_secs >= MIN_TIMEOUT_SECS) {
            return Err(invalid(
                "dist.timeout_secs",
                format!(
                    "{} must be a number of seconds ≥ {MIN_TIMEOUT_SECS} (a shorter wait fails \
                     every collective before a peer can answer)",
                    d.timeout_secs
                ),
            ));
        }
        if d.transport == TransportKind::Mpi && !cfg!(feature = "mpi") {
            return Err(invalid(
                "dist.transport",
                "\"mpi\" needs lockstep built with the cargo feature `mpi` \
                 (cargo build --release -p lockstep-cli --features mpi; needs an MPI library)",
            ));
        }
        Ok(())
    }
}

impl TrainConfig {
    /// Layers the pipeline can cut between: embedding, blocks, head (transformer); the hidden
    /// and output layers (MLP); the conv blocks, the hidden and the output layer (CNN).
    pub fn pipeline_layers(&self) -> usize {
        match self.model.kind {
            ModelKind::Transformer => self.model.blocks + 2,
            ModelKind::Mlp => self.model.hidden.len() + 1,
            ModelKind::Cnn => self.model.conv.len() + 2,
        }
    }

    fn validate_transformer(&self) -> Result<(), ConfigError> {
        let m = &self.model;
        if m.d_model == 0 {
            return Err(invalid("model.d_model", "0 must be ≥ 1"));
        }
        if m.heads == 0 || !m.d_model.is_multiple_of(m.heads) {
            return Err(invalid(
                "model.heads",
                format!(
                    "{} heads must be ≥ 1 and divide model.d_model = {}",
                    m.heads, m.d_model
                ),
            ));
        }
        if m.blocks == 0 {
            return Err(invalid(
                "model.blocks",
                "a transformer needs at least one block",
            ));
        }
        if m.context < 2 {
            return Err(invalid(
                "model.context",
                format!("{} must be ≥ 2", m.context),
            ));
        }
        let d_ff = if m.d_ff == 0 { 4 * m.d_model } else { m.d_ff };
        if m.tp_pieces == 0
            || !m.heads.is_multiple_of(m.tp_pieces)
            || !d_ff.is_multiple_of(m.tp_pieces)
        {
            return Err(invalid(
                "model.tp_pieces",
                format!(
                    "{} must be ≥ 1 and divide model.heads = {} and model.d_ff = {d_ff} (each \
                     tensor-parallel piece owns whole heads and an equal share of the MLP)",
                    m.tp_pieces, m.heads
                ),
            ));
        }
        Ok(())
    }

    /// Checks of `[parallel]` that need no world size (see [`crate::ParallelDims`] for the rest);
    /// with the model's layer count when it is known from the config (the built-in jobs).
    pub fn validate_parallel(&self, layers: Option<usize>) -> Result<(), ConfigError> {
        let p = &self.parallel;
        if p.pp == 0 {
            return Err(invalid("parallel.pp", "must be ≥ 1"));
        }
        if p.profile_reps == 0 {
            return Err(invalid("parallel.profile_reps", "must be ≥ 1"));
        }
        if p.prefetch_layers > MAX_PREFETCH_LAYERS {
            return Err(invalid(
                "parallel.prefetch_layers",
                format!(
                    "{} is more than {MAX_PREFETCH_LAYERS}: each layer gathered ahead holds a \
                     whole layer's parameters, and a stage computes one layer at a time",
                    p.prefetch_layers
                ),
            ));
        }
        if p.zero > 3 {
            return Err(invalid(
                "parallel.zero",
                format!("{} is not a ZeRO stage: use 0, 1, 2 or 3", p.zero),
            ));
        }
        if p.tp == 0 {
            return Err(invalid("parallel.tp", "must be ≥ 1"));
        }
        let m = &self.model;
        if m.tp_pieces > 1 && m.kind != ModelKind::Transformer {
            return Err(invalid(
                "model.tp_pieces",
                format!(
                    "model.tp_pieces = {} splits the transformer's blocks; model `{}` has none",
                    m.tp_pieces, m.kind
                ),
            ));
        }
        // What the model can do against the layout is `ParallelPlan::check_shape`'s (layout.rs).
        let _ = layers;
        Ok(())
    }
}

impl ParallelConfig {
    /// `stage_cuts` against a model of `layers` layers.
    pub fn check_stages(&self, layers: usize) -> Result<(), ConfigError> {
        let p = self;
        if !p.stage_cuts.is_empty() {
            let ok = p.stage_cuts.len() == p.pp - 1
                && p.stage_cuts.windows(2).all(|w| w[0] < w[1])
                && p.stage_cuts.first().is_some_and(|&c| c >= 1)
                && p.stage_cuts.last().is_some_and(|&c| c < layers);
            if !ok {
                return Err(invalid(
                    "parallel.stage_cuts",
                    format!(
                        "{:?} must be {} increasing layer indices in 1..{layers} (the first layer \
                         of stages 1..{}), or empty for automatic balancing",
                        p.stage_cuts,
                        p.pp - 1,
                        p.pp
                    ),
                ));
            }
        }
        Ok(())
    }
}

pub fn table_has(table: &toml::Table, section: &str, key: &str) -> bool {
    table
        .get(section)
        .and_then(|s| s.as_table())
        .is_some_and(|s| s.contains_key(key))
}

/// Apply `a.b.c=value` to a TOML table. The value is parsed as a TOML value when it is one
/// (numbers, booleans, arrays, quoted strings) and taken as a bare string otherwise.
pub fn apply_override(table: &mut toml::Table, spec: &str) -> Result<(), ConfigError> {
    let (key, raw) = spec
        .split_once('=')
        .ok_or_else(|| ConfigError::BadOverride(spec.to_string()))?;
    let key = key.trim();
    if key.is_empty() {
        return Err(ConfigError::BadOverride(spec.to_string()));
    }
    let value = parse_value(raw.trim());
    let parts: Vec<&str> = key.split('.').collect();
    let mut cur = table;
    for part in &parts[..parts.len() - 1] {
        let entry = cur
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry
            .as_table_mut()
            .ok_or_else(|| ConfigError::OverridePath {
                key: key.to_string(),
                part: part.to_string(),
            })?;
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

fn parse_value(raw: &str) -> toml::Value {
    let doc = format!("v = {raw}");
    match doc.parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").expect("parsed key"),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

/// Deep-merge `top` over `base`: tables merge key by key, anything else in `top` replaces.
pub fn merge(base: &mut toml::Table, top: toml::Table) {
    for (key, value) in top {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(t)) => merge(b, t),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
mod run_file_tests {
    use super::*;

    #[test]
    fn the_run_file_loads_back_to_the_same_config_with_short_floats() {
        let mut c = TrainConfig::default();
        c.train.lr = 0.05;
        c.optimizer.momentum = 0.9;
        c.dist.timeout_secs = 12.345678901234;
        for sections in [ConfigSections::All, ConfigSections::JobOwn] {
            let text = c.to_run_file(sections);
            assert!(text.contains("lr = 0.05\n"), "{text}");
            assert!(text.contains("momentum = 0.9\n"), "{text}");
            assert!(text.contains("timeout_secs = 12.345678901234\n"), "{text}");
            let back: TrainConfig = toml::from_str(&text).unwrap();
            assert_eq!(back, c, "{sections:?}");
            assert_eq!(back.identity_hash(), c.identity_hash());
        }
        assert!(c.to_run_file(ConfigSections::All).contains("[model]"));
        let own = c.to_run_file(ConfigSections::JobOwn);
        assert!(!own.contains("[model]") && !own.contains("[data]"), "{own}");
        // A user job's run that did set [model] keys still writes them (or they would be lost).
        c.model.d_model = 64;
        assert!(c.to_run_file(ConfigSections::JobOwn).contains("[model]"));
    }
}
