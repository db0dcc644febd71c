//! lockstep for your own burn model.
//!
//! Write a [`Job`] (your `Module`, your `Dataset`s, a batch function and the loss of a
//! micro-batch) and hand it to [`main`] — or to a [`Trainer`], which returns a `Result` to your
//! own `main` instead of exiting:
//!
//! ```no_run
//! # use lockstep::burn;
//! # use burn::data::dataset::{Dataset, InMemDataset};
//! # use burn::nn::{Linear, LinearConfig};
//! # use burn::tensor::{Device, Tensor, TensorData};
//! # use lockstep::{BoxError, TrainConfig};
//! # struct MyJob;
//! # impl lockstep::Job for MyJob {
//! #     type Model = Linear;
//! #     type Item = f32;
//! #     type Batch = Tensor<2>;
//! #     fn name(&self) -> &str { "my-job" }
//! #     fn model(&self, _: &TrainConfig, device: &Device) -> Linear {
//! #         LinearConfig::new(1, 1).init(device)
//! #     }
//! #     fn train_data(&self, _: &TrainConfig) -> Result<Box<dyn Dataset<f32>>, BoxError> {
//! #         Ok(Box::new(InMemDataset::new(vec![1.0; 256])))
//! #     }
//! #     fn eval_data(&self, c: &TrainConfig) -> Result<Box<dyn Dataset<f32>>, BoxError> {
//! #         self.train_data(c)
//! #     }
//! #     fn batch(&self, items: Vec<f32>, device: &Device) -> Tensor<2> {
//! #         let n = items.len();
//! #         Tensor::from_data(TensorData::new(items, [n, 1]), device)
//! #     }
//! #     fn loss(&self, model: &Linear, x: &Tensor<2>) -> Tensor<1> {
//! #         (model.forward(x.clone()) - x.clone()).powi_scalar(2).mean()
//! #     }
//! # }
//! fn main() -> std::process::ExitCode {
//!     match lockstep::Trainer::new(MyJob).run() {
//!         Ok(()) => std::process::ExitCode::SUCCESS,
//!         Err(e) => {
//!             eprintln!("my-job: {e}");
//!             std::process::ExitCode::from(e.exit_code() as u8)
//!         }
//!     }
//! }
//! ```
//!
//! Your binary then is a complete lockstep: `my-job train --nproc 4` starts four worker processes
//! (it re-executes itself as them), sums gradients exactly so the parameters are bitwise the same
//! for any worker count, checkpoints, restarts failed workers (`--max-restarts`, `--nproc
//! MIN:MAX`), runs under Slurm, `mpirun` and torchrun-style variables, and writes metrics.jsonl,
//! summary.json and report.md/.html with your metrics; `scale` and `plan` work as well. See
//! docs/src/your-own-model.md.
//!
//! A model written as a sequence of layers can implement [`LayeredJob`] instead and run as
//! `lockstep::main(lockstep::Pipelined(MyJob))`: then `parallel.pp` cuts it into pipeline stages
//! (GPipe or 1F1B) with the same parameter bits as one worker. Its layers may use the
//! tensor-parallel layers of [`tp`]; then `parallel.tp` splits them across ranks, again with the
//! one-worker bits.
//!
//! Configuration: lockstep's config file (`[train]`, `[optimizer]`, `[dist]`, `[checkpoint]`,
//! `[parallel]`) plus your job's own `[job]` table, read with [`TrainConfig::job_section`]. Your
//! [`Job::config`] gives the defaults; `--config` and `--set` apply on top.

#![deny(missing_docs)]

pub use burn;
pub use lockstep_cli::RunError;
pub use lockstep_model::flat;
/// The hash summary.json reports as `param_hash` (SHA-256 of the parameters' little-endian f32
/// values in declaration order): check a model you loaded against its run.
pub use lockstep_model::param_hash;
pub use lockstep_model::UpdateRule;
pub use lockstep_run::ModelShape;
pub use lockstep_train::config::{ConfigSections, JobSettings};
pub use lockstep_train::device::Placement;
pub use lockstep_train::draws::{DrawPart, Draws};
pub use lockstep_train::job::BinaryAbout;
pub use lockstep_train::job::{
    Activation, ActivationError, BoxError, BurnLayered, BurnReplica, Computed, EvalSums, Job,
    JobSpec, LayeredJob, LossReduction, Part, PartKind, Parts, Pipelined, Replica, ReplicaError,
    StagedJob, Trainable,
};
pub use lockstep_train::metrics::Eval;
pub use lockstep_train::pipeline::layered::{
    Evaluated, Forwarded, LayerSource, LayerStage, Layered,
};
/// How the config has your layers take each product's operands (`train.precision`):
/// `lockstep::products(cfg).operand(x)` is `x` for `"f32"` and `x` rounded to bf16 (its gradient
/// too) for `"bf16"`; a job that does this for every product declares
/// `const BF16_PRODUCTS: bool = true` (otherwise `"bf16"` is refused).
pub use lockstep_train::precision::products;
pub use lockstep_train::{ConfigError, ConfigLoad, Event, Progress, TrainConfig, TrainError};

/// Tensor parallelism of your own [`LayeredJob`] (Megatron style): put these burn modules in your
/// layers and `parallel.tp` ranks split them; every layout gives the one-worker parameters bit
/// for bit. A [`ColumnParallelLinear`](tp::ColumnParallelLinear) (output features in `pieces`
/// fixed pieces; on a tp rank its output is its pieces) feeds a
/// [`RowParallelLinear`](tp::RowParallelLinear) (input features in the same pieces; output
/// summed exactly over all pieces), with elementwise functions (ReLU, GELU) between them; a
/// [`ParallelSelfAttention`](tp::ParallelSelfAttention) is causal multi-head self-attention with
/// its heads in those pieces (the built-in transformer's split). All tensor-parallel layers of a
/// model have the same `pieces`, which `parallel.tp` must divide.
/// See docs/src/your-own-model.md, "Tensor parallelism of your own model".
pub mod tp {
    pub use lockstep_model::{
        ColumnParallelLinear, ColumnParallelLinearConfig, ParallelSelfAttention,
        ParallelSelfAttentionConfig, RowParallelLinear, RowParallelLinearConfig,
    };
}

/// lockstep's CPU kernels as burn operations for your own model: `dense_linear` (`x · W + b`),
/// `layer_norm`, exact `gelu`, `softmax_last`, `causal_self_attention` (over a fused `[Q | K | V]`),
/// and `bf16_operand` / [`Products`](ops::Products) for `train.precision = "bf16"`.
/// On the flex CPU backend they run lockstep's kernels, whose bits do not depend on
/// `--threads-per-worker` (burn flex's own matrix product is single-threaded in lockstep's build);
/// on any other device (`train.device`) they are the same functions of burn's operations.
pub mod ops {
    pub use lockstep_model::ops::*;
}

/// The user guide's Rust snippets (docs/src, an mdBook), compiled and run as doctests of this
/// crate by `cargo test -p lockstep --doc`: one module per chapter that holds Rust code.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/src/your-own-model.md")]
mod guide_your_own_model {}

/// Run the lockstep command line for `job` (`train`, `scale`, `plan`, `export`, …; see `--help`)
/// and exit: status 0 on success, 3 for bad input (config, data, a misbehaving job), 1 otherwise.
/// The same as [`Trainer::run`] followed by that exit.
pub fn main<J: JobSpec + 'static>(job: J) -> ! {
    lockstep_cli::run(Box::new(job))
}

/// The library entry for your own `main`: runs the lockstep command line for a job and returns
/// its outcome ([`RunError`] says whether it was bad input and which exit status lockstep itself
/// would end with). It may be called more than once in a program, one job after another.
pub struct Trainer {
    job: Box<dyn JobSpec>,
}

impl Trainer {
    /// A trainer for `job` (a [`Job`], or a [`LayeredJob`] as [`Pipelined`]).
    pub fn new<J: JobSpec + 'static>(job: J) -> Self {
        Trainer { job: Box::new(job) }
    }

    /// Run the command line of this process (`std::env::args_os`).
    pub fn run(self) -> Result<(), RunError> {
        lockstep_cli::try_run(self.job, std::env::args_os())
    }

    /// Run the command line `args`, program name first (`["my-job", "train", "--nproc", "2"]`).
    /// The workers lockstep starts are this program again, run with its own arguments: call
    /// [`Trainer::run`] first thing in `main` so that they find their way.
    pub fn run_with_args<I, T>(self, args: I) -> Result<(), RunError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        lockstep_cli::try_run(self.job, args)
    }
}
