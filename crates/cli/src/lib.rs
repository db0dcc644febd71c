//! The lockstep command line as a library: `lockstep` (the built-in jobs) and every binary built
//! with `lockstep::main(MyJob)` run [`run`], so a user's binary accepts exactly what `lockstep`
//! accepts (`train`, `scale`, `plan`, launchers' variables, …) and re-executes itself as the
//! workers. The only place that reads argv and the environment.

/// Reports a worker's failed allocation to its launcher as a typed message (see [`oom`]).
#[cfg(feature = "report-oom")]
#[global_allocator]
static ALLOCATOR: oom::ReportingAllocator = oom::ReportingAllocator;

mod agent;
mod bench;
mod bench_train;
mod cluster_env;
mod decimal;
mod elastic;
mod export;
mod flags;
mod inject;
mod launch;
mod memory_cap;
// Its allocator is unused when the feature is off.
#[cfg_attr(not(feature = "report-oom"), allow(dead_code))]
mod oom;
mod orphan;
mod plan;
mod protocol;
mod request;
mod run_dir;
mod scale;
mod store_keys;
mod supervise;
mod train_cmd;
mod worker;

use lockstep_train::ConfigLoad;
use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use lockstep_comm::store::StoreServer;
use lockstep_comm::tcp::TcpOptions;
use lockstep_comm::{Algorithm, JobSecret};
use lockstep_train::config::TransportKind;
use lockstep_train::faults::Fault;
use lockstep_train::{Event, JobSpec, TrainConfig, WorkerContext};

use crate::cluster_env::WorkerEnv;
use crate::launch::LaunchSpec;
use crate::protocol::{FailureRecord, WorkerMessage};

#[derive(Parser)]
#[command(
    name = "lockstep",
    version,
    about = "Distributed training across worker processes and hosts, bitwise reproducible."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model on N workers (default: the digits MLP on 2 workers).
    Train(TrainArgs),
    /// Time collectives across worker processes (nccl-tests style), with memcpy as the reference.
    BenchCollectives(BenchArgs),
    /// Run the same training at several worker counts and compare speed, balance and result.
    Scale(ScaleArgs),
    /// Training benchmark: 1 worker, N exact, N plain and N never communicating, interleaved.
    Bench(bench_train::BenchTrainArgs),
    /// Print a fresh job secret (64 hex digits) for multi-node jobs or external launchers.
    Secret,
    /// Predict step time, speedup and efficiency of layouts on a described cluster, calibrated
    /// from a finished run (see docs/src/plan.md).
    Plan(PlanArgs),
    /// Write a run's trained model (a checkpoint) as a burn record your own Module loads with
    /// `load_file` (a user's Job or LayeredJob).
    Export(export::ExportArgs),
    /// Internal: the worker process started by the launcher.
    #[command(hide = true)]
    Worker {
        #[command(subcommand)]
        role: WorkerRole,
    },
}

#[derive(Args, Clone)]
struct TrainArgs {
    /// TOML config (default: the built-in digits MLP, as in configs/digits-mlp.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Worker processes on this node: N, or MIN:MAX for an elastic job that goes on with fewer
    /// workers (never below MIN) when one cannot come back.
    #[arg(long, default_value = "2")]
    nproc: String,
    /// Continue the run in this directory from its last good checkpoint (its config.toml is used).
    #[arg(long, value_name = "DIR", conflicts_with = "config")]
    resume: Option<PathBuf>,
    /// Restart the worker group from the last good checkpoint at most this many times.
    #[arg(long, default_value_t = 3)]
    max_restarts: usize,
    /// Seconds a worker may make no progress outside any collective (or send no heartbeat)
    /// before its launcher names it hung and restarts the job. Longer than the slowest
    /// micro-batch, evaluation chunk or checkpoint write.
    #[arg(long, default_value_t = 60.0)]
    stall_timeout: f64,
    /// Deliberate faults, e.g. "kill:rank=1,step=30", "hang:rank=0,step=5", "slow:rank=1,factor=3",
    /// "corrupt-checkpoint:step=20", "kill-while-checkpointing:step=20", "lose:rank=3,step=40",
    /// "slow-checkpoint-write:step=20,seconds=2" (separate several with `;`).
    #[arg(long, value_name = "SPEC")]
    inject: Option<String>,
    /// Threads each worker may use, passed on as RAYON_NUM_THREADS (default: this host's cores /
    /// --nproc). The built-in models' dense layers' matrix products (MLP, CNN head, transformer
    /// linears), the transformer's attention, GELU, softmax and layer norm, the per-step parameter
    /// and gradient copies, the optimizer and the one-worker exact sum run on them, with the same
    /// bits at any count; every other burn kernel runs on one
    /// thread per worker, since burn flex's multi-threaded kernels are left out of the build
    /// (their parallel reductions do not add in a fixed order; docs/src/reproducibility.md). More
    /// workers use cores better.
    #[arg(long)]
    threads_per_worker: Option<usize>,
    /// Cap each of this node's workers at this much memory, GiB, enforced by the kernel (a
    /// memory cgroup per worker: root, or a delegated cgroup v2 subtree). A worker over its cap
    /// is OOM-killed and the job ends with exit status 3 (the cap would be met again).
    #[arg(long, value_name = "GIB")]
    worker_memory_gib: Option<f64>,
    /// Run directory (default: runs/run-<time>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Override a config value, e.g. --set train.steps=20 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Where the model computes: cpu, wgpu, cuda or auto (= --set train.device=…). Devices other
    /// than cpu are for a user's own burn Job / LayeredJob, in a binary built with the cargo
    /// feature of that name.
    #[arg(long, value_name = "DEVICE")]
    device: Option<lockstep_run::config::DeviceKind>,
    /// Replace the run already in --out (its config, metrics, summary, report and checkpoints).
    /// Without it, a directory holding a run is refused.
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    #[command(flatten)]
    nodes: NodeArgs,
}

#[derive(Args, Clone)]
struct ScaleArgs {
    #[arg(long)]
    config: Option<PathBuf>,
    /// Worker counts to compare, the first being the baseline, e.g. 1,2,4.
    #[arg(long, default_value = "1,2")]
    nproc: String,
    /// Layouts to run: `dp` (data parallel at each --nproc size; the default), `pp` (one
    /// pipeline with as many stages as workers, at each size), `dpAxppB` such as dp2xpp2
    /// (A replicas × B stages, run once), comma-separated.
    #[arg(long, value_name = "LIST")]
    layouts: Option<String>,
    /// Threads per worker (RAYON_NUM_THREADS), the same for every size (default 1, so that a
    /// larger world size is more compute, not the same cores split differently). Only lockstep's
    /// own loops use more than one (see `train --help`).
    #[arg(long, default_value_t = 1)]
    threads_per_worker: usize,
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Directory for the runs (dp-N/, pp-N/, dpAxppB/), scale.json and scale_report.{md,html}.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args, Clone)]
struct NodeArgs {
    /// Number of nodes (hosts) in the job, each running `lockstep train` with its --node-rank:
    /// N, or MIN:MAX for an elastic job that drops lost nodes (never below MIN) and admits nodes
    /// that (re)join at its next checkpoint.
    #[arg(long, default_value = "1")]
    nnodes: String,
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Where the nodes meet (needed when --nnodes > 1): HOST:PORT of the store node 0 serves
    /// (`--rdzv-backend builtin`), or `etcd://h1:2379,h2:2379,h3:2379` (`--rdzv-backend etcd`).
    #[arg(long)]
    rdzv: Option<String>,
    /// `builtin` (node 0 serves the store; it moves to a survivor by majority if node 0 is lost)
    /// or `etcd` (an etcd cluster, which outlives any one host).
    #[arg(long, default_value = "builtin")]
    rdzv_backend: String,
    /// Seconds without a heartbeat after which another node's agent counts as lost
    /// (--nnodes > 1).
    #[arg(long, default_value_t = 10.0)]
    heartbeat_timeout: f64,
}

impl NodeArgs {
    /// One node, no rendezvous address: `train` as `scale`, `bench` and the default run use it.
    fn single() -> NodeArgs {
        NodeArgs {
            nnodes: "1".into(),
            node_rank: 0,
            rdzv: None,
            rdzv_backend: "builtin".into(),
            heartbeat_timeout: 10.0,
        }
    }

    /// `--nnodes N` or `MIN:MAX`, checked against `--node-rank`.
    fn range(&self) -> Result<(usize, usize), request::BadRequest> {
        let (lo, hi) =
            train_cmd::parse_range("--nnodes", "node count", &self.nnodes, flags::MAX_NODES)?;
        if self.node_rank >= hi {
            return Err(request::BadRequest(format!(
                "--node-rank {} must be below --nnodes {}",
                self.node_rank, self.nnodes
            )));
        }
        Ok((lo, hi))
    }

    /// Is this one job across several nodes (with agents and a shared store)?
    fn several(&self) -> Result<bool, request::BadRequest> {
        Ok(self.range()?.1 > 1)
    }

    /// `--rdzv-backend` and, for etcd, `--rdzv`'s endpoints, checked before anything is written.
    fn check_rendezvous(&self) -> Result<(), request::BadRequest> {
        if self.etcd()? && self.several()? {
            let url = self.rdzv.as_deref().unwrap_or_default();
            lockstep_comm::etcd::EtcdClient::from_url(url)
                .map_err(|e| request::BadRequest(format!("--rdzv {url}: {e}")))?;
        }
        Ok(())
    }

    /// Whether the agents meet in etcd (`--rdzv-backend`).
    fn etcd(&self) -> Result<bool, request::BadRequest> {
        match self.rdzv_backend.as_str() {
            "builtin" => Ok(false),
            "etcd" => Ok(true),
            other => Err(request::BadRequest(format!(
                "--rdzv-backend {other:?}: expected builtin or etcd"
            ))),
        }
    }
}

#[derive(Args, Clone)]
struct BenchArgs {
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// "shm", "tcp" or "mpi" (run under mpirun; needs the cargo feature `mpi`).
    #[arg(long, default_value = "shm")]
    transport: String,
    /// all_reduce, broadcast, all_gather or reduce_scatter.
    #[arg(long, default_value = "all_reduce")]
    op: String,
    /// Sizes in bytes: a power-of-two range "4K..256M" or a list "4K,64M".
    #[arg(long, default_value = "4K..64M")]
    sizes: String,
    /// auto, ring or recursive-doubling.
    #[arg(long, default_value = "auto")]
    algorithm: String,
    /// Largest piece a ring step moves at once (bytes; default: the communicator's).
    #[arg(long)]
    segment_bytes: Option<usize>,
    /// Write {memcpy_gbps, rows} here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args, Clone)]
struct PlanArgs {
    /// Finished run to calibrate from (its config.toml, summary.json and metrics.jsonl).
    #[arg(long, value_name = "RUN_DIR")]
    from: PathBuf,
    /// Cluster description: TOML with the keys of the flags below (e.g. `link_gbps = 10`); flags
    /// override it.
    #[arg(long, value_name = "FILE")]
    cluster: Option<PathBuf>,
    /// Nodes (hosts) [default: 1].
    #[arg(long)]
    nodes: Option<usize>,
    /// Workers per node.
    #[arg(long)]
    workers_per_node: Option<usize>,
    /// Line rate between nodes, Gbit/s (needed with more than one node).
    #[arg(long)]
    link_gbps: Option<f64>,
    /// One-way latency between nodes, µs [default: 50].
    #[arg(long)]
    link_latency_us: Option<f64>,
    /// Token bucket of a shaped link between nodes (tc tbf burst), KiB [default: 0 = not shaped].
    #[arg(long)]
    link_burst_kib: Option<f64>,
    /// Payload share of the line rate [default: 0.94, TCP/IP/Ethernet headers and ACKs].
    #[arg(long)]
    link_efficiency: Option<f64>,
    /// TCP between workers of one node in a multi-node job, GB/s [default: 4].
    #[arg(long)]
    intra_gbytes_per_s: Option<f64>,
    /// ... and its latency, µs [default: 12].
    #[arg(long)]
    intra_latency_us: Option<f64>,
    /// Shared memory in a one-node job, GB/s [default: 5].
    #[arg(long)]
    shm_gbytes_per_s: Option<f64>,
    /// ... and its latency, µs [default: 3].
    #[arg(long)]
    shm_latency_us: Option<f64>,
    /// Per-worker compute speed relative to the calibration run [default: 1].
    #[arg(long)]
    compute_scale: Option<f64>,
    /// The calibration run's own links, GB/s [default: this machine's shm or loopback TCP].
    #[arg(long)]
    calib_gbytes_per_s: Option<f64>,
    /// ... and their latency, µs.
    #[arg(long)]
    calib_latency_us: Option<f64>,
    /// Layouts to compare, DPxPP or DP: e.g. "1,2,4" or "4x1,2x2" [default: 1 worker, powers of
    /// two and whole nodes, every pipeline depth the model allows].
    #[arg(long, value_name = "LIST")]
    layouts: Option<String>,
    /// Memory of one worker, GiB: layouts whose fullest rank is predicted to need more are
    /// marked as not fitting and never recommended.
    #[arg(long, value_name = "GIB")]
    memory_gib: Option<f64>,
    /// Predict for this ZeRO level (0–3) instead of the calibration run's: what sharding would
    /// save, e.g. with --memory-gib, before running it.
    #[arg(long, value_name = "LEVEL")]
    zero: Option<u8>,
    /// Write the plan (cluster, calibration, predictions, recommendation) as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

#[derive(Subcommand)]
enum WorkerRole {
    Train {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// Continue from the last good checkpoint in <out>/checkpoints, if any.
        #[arg(long)]
        resume: bool,
        /// Injected faults, as JSON (the launcher passes only those due on this attempt).
        #[arg(long)]
        faults: Option<String>,
    },
    Bench {
        #[arg(long)]
        transport: String,
        #[arg(long)]
        op: String,
        #[arg(long)]
        sizes: String,
        #[arg(long)]
        algorithm: String,
        #[arg(long)]
        segment_bytes: Option<usize>,
    },
}

/// The job this process runs (the binary is the job): set by [`run`] / [`try_run`], each call
/// replacing the last (a program may run several jobs in turn).
static JOB: std::sync::RwLock<Option<&'static dyn JobSpec>> = std::sync::RwLock::new(None);

/// The job given to [`try_run`]; lockstep's built-in jobs before that (unit tests).
fn job() -> &'static dyn JobSpec {
    let held = *JOB
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    held.unwrap_or(&lockstep_train::BuiltinJob)
}

/// `key=value` overrides and an optional file on top of the job's defaults, validated.
fn load_config(path: Option<&std::path::Path>, sets: &[String]) -> Result<TrainConfig> {
    Ok(TrainConfig::load_for(job(), path, sets)?)
}

/// Why a command failed: the error chain, and whether it was bad input (a config, flag, path,
/// dataset or job's misbehaviour that no retry can cure).
#[derive(Debug)]
pub struct RunError {
    error: anyhow::Error,
    bad_input: bool,
}

impl RunError {
    /// Bad input (exit status 3), as opposed to a failure a retry might not meet (1).
    pub fn is_bad_input(&self) -> bool {
        self.bad_input
    }
    /// The exit status lockstep's own `main` ends with for this error: 3 for bad input, else 1.
    pub fn exit_code(&self) -> i32 {
        if self.bad_input {
            launch::EXIT_PERMANENT
        } else {
            1
        }
    }
}

impl From<anyhow::Error> for RunError {
    fn from(error: anyhow::Error) -> Self {
        RunError {
            bad_input: is_bad_input(&error),
            error,
        }
    }
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.error)
    }
}

impl std::error::Error for RunError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

/// Parse argv, run the command for `job`, exit: status 0, 3 for bad input (see `launch`), 1
/// otherwise, with the error on stderr.
pub fn run(job: Box<dyn JobSpec>) -> ! {
    match try_run(job, std::env::args_os()) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            // Not eprintln!: stderr may be a closed pipe, and a panic here would replace the
            // real exit status with 101.
            let _ = std::io::stderr().write_all(format!("lockstep: error: {e}\n").as_bytes());
            std::process::exit(e.exit_code());
        }
    }
}

/// Run the command line `args` (the program name first, as `std::env::args_os`) for `job` and
/// return its outcome instead of exiting: `--help` and `--version` print and return `Ok`. The
/// worker processes lockstep starts are this same program run with an internal `worker`
/// command, which ends its process itself.
pub fn try_run<I, T>(job: Box<dyn JobSpec>, args: I) -> Result<(), RunError>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    *JOB.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Box::leak(job));
    let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    let cli = match command(args.first())
        .try_get_matches_from(args)
        .and_then(|m| Cli::from_arg_matches(&m))
    {
        Ok(cli) => cli,
        // A malformed command line is bad input like any other (exit status 3, not clap's 2).
        Err(e) if e.use_stderr() => {
            return Err(RunError {
                error: anyhow::anyhow!("{}", e.render().to_string().trim_end()),
                bad_input: true,
            })
        }
        Err(e) => {
            let _ = e.print();
            return Ok(());
        }
    };
    // Keep big step buffers in the heap instead of re-faulting them every step (see lockstep-model).
    lockstep_model::tune_allocator_for_training();
    let result = match cli.command {
        None => train_cmd::run(TrainArgs {
            config: None,
            nproc: "2".into(),
            resume: None,
            max_restarts: 3,
            stall_timeout: 60.0,
            inject: None,
            threads_per_worker: None,
            worker_memory_gib: None,
            out: None,
            sets: Vec::new(),
            device: None,
            overwrite: false,
            nodes: NodeArgs::single(),
        }),
        Some(Command::Train(a)) => train_cmd::run(a),
        Some(Command::BenchCollectives(a)) => cmd_bench(a),
        Some(Command::Scale(a)) => cmd_scale(a),
        Some(Command::Bench(a)) => bench_train::run(a),
        Some(Command::Secret) => JobSecret::generate()
            .map(|s| println!("{}", s.to_hex()))
            .map_err(Into::into),
        Some(Command::Plan(a)) => plan::run(&a),
        Some(Command::Export(a)) => export::run(&a),
        Some(Command::Worker { role }) => worker_exit(cmd_worker(role)),
    };
    result.map_err(RunError::from)
}

/// A worker's end: its process exits here with its status, after the typed failure record its
/// launcher reads.
fn worker_exit(result: Result<()>) -> ! {
    let Err(e) = result.map_err(RunError::from) else {
        std::process::exit(0)
    };
    let permanent = e.is_bad_input();
    // A worker that failed for want of a peer may be part of an orphaned group whose
    // re-parenting is still under way: give the kernel a moment to tell (see orphan.rs).
    let settle = if permanent {
        std::time::Duration::ZERO
    } else {
        std::time::Duration::from_millis(500)
    };
    orphan::exit_if_orphaned("", settle);
    // For the launcher's blame and restart decision, typed; then the message for people.
    // Not eprintln!: an orphaned worker's stderr may be a closed pipe.
    let record = WorkerMessage::Failure(FailureRecord {
        waited_for: protocol::waited_for(&e.error),
        lost_peer: protocol::lost_peer(&e.error),
        permanent,
        message: e.to_string(),
    });
    let _ = std::io::stderr().write_all(format!("{}\n", record.line()).as_bytes());
    // A worker stopped by bad input leaves the telling to its launcher, which says it once for
    // the job (every rank usually meets the same bad input).
    if !permanent {
        let _ = std::io::stderr().write_all(format!("lockstep: error: {e}\n").as_bytes());
    }
    std::process::exit(e.exit_code());
}

/// The command line, presenting a user's binary as itself: its file name (`program`, the first
/// argument) in the usage lines, the job's `about` and version (with lockstep's), and `train`
/// described as training the job.
fn command(program: Option<&std::ffi::OsString>) -> clap::Command {
    let cmd = Cli::command();
    let Some(about) = job().binary() else {
        return cmd;
    };
    let name = job().name();
    let bin = program
        .and_then(|a| {
            Some(
                std::path::Path::new(a)
                    .file_name()?
                    .to_string_lossy()
                    .into_owned(),
            )
        })
        .unwrap_or_else(|| name.clone());
    let lockstep = env!("CARGO_PKG_VERSION");
    let version = match about.version.as_str() {
        "" => format!("(lockstep {lockstep})"),
        v => format!("{v} (lockstep {lockstep})"),
    };
    let what = match about.about.as_str() {
        "" => format!(
            "{name}: a burn model trained across worker processes and hosts by lockstep, bitwise \
             reproducible."
        ),
        a => a.to_string(),
    };
    cmd.name(bin.clone())
        .bin_name(bin)
        .version(version)
        .about(what)
        .mut_subcommand("train", |c| {
            c.about(format!("Train {name} on N workers (default: 2)"))
                .mut_arg("config", |a| {
                    a.help(format!("TOML config on top of {name}'s defaults"))
                })
        })
}

/// Refuse a layout that cannot work before any worker starts: `dp · pp` must be the world size
/// (the world a cluster engine announces, when there is one), every replica needs a micro-batch,
/// and a pipeline cannot shrink elastically (a lost worker takes a stage out of its replica).
fn check_layout(
    cfg: &TrainConfig,
    env: &HashMap<String, String>,
    launched_world: usize,
    elastic: bool,
) -> Result<()> {
    match cluster_env::detect(env)? {
        // Every rank refuses the same way, before any collective: name the world the engine
        // announced next to the layout (the ConfigError stays in the chain: exit status 3).
        Some(w) if w.engine != cluster_env::Engine::Launcher => {
            lockstep_run::ParallelPlan::new(cfg, w.world_size, &job().shape(cfg)).with_context(
                || {
                    let dp = match cfg.parallel.dp {
                        0 => "world / (tp · pp)".to_string(),
                        dp => dp.to_string(),
                    };
                    format!(
                        "rank {}: {} started {} ranks, which does not fit the config's layout \
                     (parallel.pp = {}, parallel.tp = {}, parallel.dp = {dp})",
                        w.rank,
                        w.engine.name(),
                        w.world_size,
                        cfg.parallel.pp,
                        cfg.parallel.tp,
                    )
                },
            )?;
        }
        _ => {
            if cfg.dist.transport == TransportKind::Mpi {
                // MPI's ranks come from mpirun; processes spawned by lockstep's own launcher would
                // each be a world of one. Refused up front (exit 3, no restarts).
                return Err(lockstep_train::ConfigError::Invalid {
                    field: "dist.transport",
                    message: "\"mpi\" needs the ranks started by mpirun (mpirun -np N lockstep \
                              train …), not by lockstep's launcher"
                        .into(),
                }
                .into());
            }
            lockstep_run::ParallelPlan::new(cfg, launched_world, &job().shape(cfg))?;
        }
    }
    // The device, asked for before any worker starts: built into this binary, and present.
    lockstep_train::device::Placement::probe(cfg.train.device)?;
    if elastic && cfg.parallel.tp > 1 {
        return Err(lockstep_train::ConfigError::Invalid {
            field: "parallel.tp",
            message: format!(
                "an elastic world (--nproc MIN:MAX) needs parallel.tp = 1: with {} \
                 tensor-parallel ranks a lost worker leaves its stage without some pieces",
                cfg.parallel.tp
            ),
        }
        .into());
    }
    if elastic && cfg.parallel.pp > 1 {
        return Err(lockstep_train::ConfigError::Invalid {
            field: "parallel.pp",
            message: format!(
                "an elastic world (--nproc MIN:MAX) needs parallel.pp = 1: with {} stages a lost \
                 worker leaves its replica without a stage",
                cfg.parallel.pp
            ),
        }
        .into());
    }
    Ok(())
}

/// Errors that a restart cannot cure: the input itself is wrong, or the disk is full.
fn is_bad_input(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.is::<lockstep_train::ConfigError>()
            || c.is::<run_dir::RunDirError>()
            || c.is::<request::BadRequest>()
            || c.is::<supervise::PermanentFailure>()
            || c.is::<lockstep_report::plan::PlanError>()
            || c.is::<lockstep_train::device::DeviceError>()
            || c.is::<lockstep_report::scaling::LayoutError>()
            || c.is::<lockstep_train::export::ExportError>()
            || c.downcast_ref::<lockstep_comm::CommError>()
                .is_some_and(|e| e.is_permanent())
            || c.downcast_ref::<lockstep_train::TrainError>()
                .is_some_and(|t| t.is_permanent())
            || c.downcast_ref::<lockstep_train::checkpoint::CheckpointError>()
                .is_some_and(|e| {
                    matches!(
                        e,
                        lockstep_train::checkpoint::CheckpointError::NoSpace { .. }
                            | lockstep_train::checkpoint::CheckpointError::NotRegular { .. }
                    )
                })
    })
}

fn environment() -> HashMap<String, String> {
    std::env::vars().collect()
}

fn parse_algorithm(s: &str) -> Result<Algorithm> {
    Ok(match s {
        "auto" => Algorithm::Auto,
        "ring" => Algorithm::Ring,
        "recursive-doubling" => Algorithm::RecursiveDoubling,
        other => {
            return Err(request::BadRequest(format!(
                "--algorithm {other} is not one of auto, ring, recursive-doubling"
            ))
            .into())
        }
    })
}

/// Test-only knobs for the TCP transport (latency emulation: this kernel has no netem).
fn tcp_options(env: &HashMap<String, String>) -> Result<TcpOptions> {
    let mut o = TcpOptions::default();
    if let Some(us) = env.get("LOCKSTEP_TEST_LATENCY_US") {
        let us: u64 = us.parse().with_context(|| {
            format!("LOCKSTEP_TEST_LATENCY_US={us} is not a number of microseconds")
        })?;
        o.emulated_latency = Some(Duration::from_micros(us));
    }
    if let Some(b) = env.get("LOCKSTEP_TCP_RECV_LOW_WATER") {
        o.recv_low_water = b
            .parse()
            .with_context(|| format!("LOCKSTEP_TCP_RECV_LOW_WATER={b} is not a number of bytes"))?;
    }
    Ok(o)
}

/// Where a job's workers meet: the store's address, the job's secret and id, and (node 0) the
/// server itself, which must outlive every attempt that uses it.
struct JobStore {
    store: String,
    secret: JobSecret,
    job_id: String,
    server: Option<StoreServer>,
}

/// The secret every node of a multi-node job shares (`LOCKSTEP_SECRET`); its absence or a
/// malformed one is bad input, said before anything is written.
fn multi_node_secret(env: &HashMap<String, String>) -> Result<JobSecret> {
    let hex = env.get("LOCKSTEP_SECRET").ok_or_else(|| {
        request::BadRequest(
            "--nnodes > 1 needs the same LOCKSTEP_SECRET on every node: run `lockstep secret` \
             once and export it everywhere"
                .into(),
        )
    })?;
    JobSecret::from_hex(hex)
        .map_err(|e| request::BadRequest(format!("LOCKSTEP_SECRET: {e}")).into())
}

/// The rendezvous store of a job: on an ephemeral loopback port for one node (fresh per attempt,
/// with a fresh secret), on the --rdzv address for several (one for the job's whole life, served
/// by node 0's agent).
fn job_store(nodes: &NodeArgs, env: &HashMap<String, String>) -> Result<JobStore> {
    let several = nodes.several()?;
    nodes.etcd()?;
    let (store, secret, job_id) = if several {
        let rdzv = nodes.rdzv.clone().context(
            "--nnodes > 1 needs --rdzv HOST:PORT (node 0 serves the store there) or --rdzv-backend etcd --rdzv etcd://HOST:PORT,...",
        )?;
        nodes.check_rendezvous()?;
        let secret = multi_node_secret(env)?;
        let job = env
            .get("LOCKSTEP_JOB_ID")
            .cloned()
            .unwrap_or_else(|| cluster_env::job_id_from_secret(&secret));
        (rdzv, secret, job)
    } else {
        let secret = JobSecret::generate()?;
        let job = format!(
            "{}{:x}",
            &cluster_env::job_id_from_secret(&secret)[..8],
            std::process::id() & 0xffff
        );
        (String::new(), secret, job)
    };
    let mut store = store;
    // With etcd each attempt's leader serves the workers' store itself (agent/rendezvous.rs).
    let server = if nodes.node_rank == 0 && !(several && nodes.etcd()?) {
        let bind: SocketAddr = if several {
            resolve_rdzv(&store)?
        } else {
            "127.0.0.1:0".parse().expect("literal address")
        };
        let server = StoreServer::bind(bind, &secret, &job_id)
            .with_context(|| format!("serving the rendezvous store on {bind}"))?;
        if !several {
            store = server.local_addr().to_string();
        }
        Some(server)
    } else {
        None
    };
    Ok(JobStore {
        store,
        secret,
        job_id,
        server,
    })
}

fn resolve_rdzv(store: &str) -> Result<SocketAddr> {
    store
        .to_socket_addrs()
        .with_context(|| format!("resolving --rdzv {store}"))?
        .next()
        .context("--rdzv resolves to nothing")
}

/// One attempt's launch of this node's workers (`place`), meeting at `store`.
fn attempt_spec(
    store: &JobStore,
    place: supervise::Placement,
    env: &HashMap<String, String>,
    worker_args: Vec<String>,
    attempt: usize,
) -> Result<LaunchSpec> {
    if place.nproc == 0 {
        bail!("--nproc must be at least 1");
    }
    let extra_env = env
        .iter()
        .filter(|(k, _)| k.starts_with("LOCKSTEP_TEST_"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(LaunchSpec {
        worker_args,
        nproc: place.nproc,
        first_rank: place.first_rank,
        world: place.world,
        store: store.store.clone(),
        secret: store.secret.clone(),
        job_id: store.job_id.clone(),
        threads_per_worker: launch::default_threads(place.nproc),
        extra_env,
        attempt: attempt as u64,
        stop: None,
        stall_timeout: None,
        progress: None,
        memory_cap: None,
    })
}

/// Prepare a one-node launch of `nproc` workers with a store of its own (kept alive by the
/// returned server).
fn launch_spec(
    nproc: usize,
    env: &HashMap<String, String>,
    worker_args: Vec<String>,
) -> Result<(LaunchSpec, Option<StoreServer>)> {
    let store = job_store(&NodeArgs::single(), env)?;
    let place = supervise::Placement {
        first_rank: 0,
        nproc,
        world: nproc,
        store: None,
    };
    let spec = attempt_spec(&store, place, env, worker_args, 0)?;
    Ok((spec, store.server))
}

fn cmd_scale(a: ScaleArgs) -> Result<()> {
    flags::threads("--threads-per-worker", a.threads_per_worker)?;
    let sizes = scale::parse_nprocs(&a.nproc)?;
    // Every layout is checked against the config before the first run starts.
    let plan = scale::plan(a.layouts.as_deref(), &sizes, a.config.as_deref(), &a.sets)?;
    // A sweep never replaces earlier runs: every run directory is checked before the first run.
    let base = load_config(a.config.as_deref(), &a.sets)?;
    for layout in &plan {
        let _nothing_to_remove =
            run_dir::check_fresh(&scale::run_dir(&a.out, layout), &base, false)?;
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let names: Vec<&str> = plan.iter().map(|l| l.name.as_str()).collect();
    eprintln!(
        "lockstep scale: {} run(s): {} (baseline {})",
        plan.len(),
        names.join(", "),
        names[0]
    );
    let started = std::time::Instant::now();
    let mut runs = Vec::new();
    for (i, layout) in plan.iter().enumerate() {
        eprintln!(
            "lockstep scale: run {}/{}: {} ({}), {:.0}s into the sweep",
            i + 1,
            plan.len(),
            layout.name,
            layout.describe(),
            started.elapsed().as_secs_f64()
        );
        let dir = scale::run_dir(&a.out, layout);
        train_cmd::run(TrainArgs {
            config: a.config.clone(),
            nproc: layout.world().to_string(),
            resume: None,
            max_restarts: 0,
            stall_timeout: 60.0,
            inject: None,
            threads_per_worker: Some(a.threads_per_worker),
            worker_memory_gib: None,
            out: Some(dir.clone()),
            sets: scale::layout_sets(layout, &a.sets),
            device: None,
            overwrite: false,
            nodes: NodeArgs::single(),
        })
        .with_context(|| format!("the {} run ({})", layout.name, layout.describe()))?;
        let (summary, records) = scale::load_run(&dir)?;
        runs.push(lockstep_report::scaling::Run {
            layout: layout.clone(),
            summary,
            records,
        });
    }
    let report = lockstep_report::scaling::compare(&runs);
    print!("{}", scale::format_table(&report));
    for path in scale::write_outputs(&a.out, &report, &runs)? {
        eprintln!("lockstep scale: wrote {}", path.display());
    }
    Ok(())
}

fn cmd_bench(a: BenchArgs) -> Result<()> {
    let sizes = bench::parse_sizes(&a.sizes)?;
    parse_algorithm(&a.algorithm)?;
    if !bench::OPS.contains(&a.op.as_str()) {
        return Err(
            request::BadRequest(format!("--op {} is not one of {:?}", a.op, bench::OPS)).into(),
        );
    }
    if let Some(path) = &a.json {
        flags::output_file("--json", path)?;
    }
    if let Some(b) = a.segment_bytes {
        flags::count("--segment-bytes", b, 1, bench::MAX_SIZE as usize)?;
    }
    if a.transport == "mpi" {
        return bench_under_mpi(&a);
    }
    if !matches!(a.transport.as_str(), "shm" | "tcp") {
        return Err(request::BadRequest(format!(
            "--transport {} is not one of shm, tcp, mpi",
            a.transport
        ))
        .into());
    }
    flags::count("--nproc", a.nproc, 1, flags::MAX_LOCAL_WORKERS)?;
    bench::check_memory(&sizes, a.nproc)?;
    let memcpy = bench::memcpy_gbps(64 << 20);
    let env = environment();
    let (mut spec, _server) = launch_spec(
        a.nproc,
        &env,
        vec![
            "bench".into(),
            "--transport".into(),
            a.transport.clone(),
            "--op".into(),
            a.op.clone(),
            "--sizes".into(),
            a.sizes.clone(),
            "--algorithm".into(),
            a.algorithm.clone(),
        ],
    )?;
    if let Some(b) = a.segment_bytes {
        spec.worker_args
            .extend(["--segment-bytes".to_string(), b.to_string()]);
    }
    eprintln!(
        "lockstep: {} over {} on {} ranks, {} sizes",
        a.op,
        a.transport,
        a.nproc,
        sizes.len()
    );
    let outcome = launch::run(&spec)?;
    if let Some(f) = outcome.failure {
        bail!(f.message);
    }
    let mut rows = Vec::new();
    for r in outcome.results {
        rows.push(
            serde_json::from_value::<bench::Row>(r)
                .context("worker sent a malformed result row")?,
        );
    }
    let report = bench::Report {
        memcpy_gbps: memcpy,
        rows,
    };
    print!("{}", bench::format_table(&report));
    if let Some(path) = a.json {
        lockstep_train::write_atomic(
            &path,
            (serde_json::to_string_pretty(&report)? + "\n").as_bytes(),
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// `bench-collectives --transport mpi`: mpirun starts the ranks (every process runs this), rank 0
/// measures memcpy and prints the table.
fn bench_under_mpi(a: &BenchArgs) -> Result<()> {
    let env = environment();
    let w = cluster_env::detect(&env)?
        .filter(|w| w.engine != cluster_env::Engine::Launcher)
        .context(
            "--transport mpi: start the benchmark under mpirun, e.g. \
             mpirun -np 2 -x LOCKSTEP_SECRET lockstep bench-collectives --transport mpi",
        )?;
    let sizes = bench::parse_sizes(&a.sizes)?;
    let algorithm = parse_algorithm(&a.algorithm)?;
    let rank = w.rank;
    let memcpy = if rank == 0 {
        bench::memcpy_gbps(64 << 20)
    } else {
        0.0
    };
    let mut worker = worker::connect(
        w,
        TransportKind::Mpi,
        Duration::from_secs(60),
        &TcpOptions::default(),
    )?;
    if let Some(b) = a.segment_bytes {
        worker.comm.set_segment_bytes(b);
    }
    if rank == 0 {
        eprintln!(
            "lockstep: {} over mpi on {} ranks, {} sizes",
            a.op,
            worker.comm.size(),
            sizes.len()
        );
    }
    let rows = bench::run_worker(&mut worker.comm, &a.op, &sizes, algorithm)?;
    if rank == 0 {
        let report = bench::Report {
            memcpy_gbps: memcpy,
            rows,
        };
        print!("{}", bench::format_table(&report));
        if let Some(path) = &a.json {
            lockstep_train::write_atomic(
                path,
                (serde_json::to_string_pretty(&report)? + "\n").as_bytes(),
            )
            .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

fn cmd_worker(role: WorkerRole) -> Result<()> {
    let env = environment();
    let w = cluster_env::detect(&env)?.ok_or_else(|| {
        request::BadRequest(
            "`lockstep worker` is started by the launcher (LOCKSTEP_RANK etc. are missing)".into(),
        )
    })?;
    match role {
        WorkerRole::Train {
            config,
            out,
            resume,
            faults,
        } => {
            let cfg = load_config(Some(&config), &[])?;
            let faults: Vec<Fault> = match faults {
                Some(j) => serde_json::from_str(&j).context("--faults is not valid fault JSON")?,
                None => Vec::new(),
            };
            run_train_worker(w, &cfg, &out, true, resume, &faults)
        }
        WorkerRole::Bench {
            transport,
            op,
            sizes,
            algorithm,
            segment_bytes,
        } => {
            let timeout = Duration::from_secs(60);
            let transport: TransportKind = transport.parse().map_err(anyhow::Error::msg)?;
            let mut worker = worker::connect(w, transport, timeout, &tcp_options(&env)?)?;
            if let Some(b) = segment_bytes {
                worker.comm.set_segment_bytes(b);
            }
            let rows = bench::run_worker(
                &mut worker.comm,
                &op,
                &bench::parse_sizes(&sizes)?,
                parse_algorithm(&algorithm)?,
            )?;
            for r in rows {
                let row = serde_json::to_value(&r)?;
                println!("{}", WorkerMessage::BenchRow { row }.line());
            }
            Ok(())
        }
    }
}

/// How often a worker under a launcher says it is alive (see `WorkerMessage::Heartbeat`).
pub(crate) const WORKER_HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

/// A thread that reports this worker's liveness to its launcher: a heartbeat that stops means a
/// frozen process; one that says "not waiting, idle for long" means code stuck outside any
/// collective (data loading, say), which no peer's deadline would blame correctly.
fn start_heartbeat(rank: usize) {
    lockstep_comm::activity::touch();
    std::thread::spawn(move || loop {
        std::thread::sleep(WORKER_HEARTBEAT_EVERY);
        let (waiting, idle) = lockstep_comm::activity::snapshot();
        let beat = WorkerMessage::Heartbeat {
            waiting,
            idle_secs: idle.as_secs_f64(),
        };
        orphan::emit(rank, true, &beat.line());
    });
}

/// Makes this thread one of the worker's compute threads: rayon's global pool, sized by
/// `RAYON_NUM_THREADS` (`--threads-per-worker`), with this thread as its first member. Why: the
/// training loop then takes part in the threaded loops (gemm, the transformer's attention, GELU,
/// softmax and layer norm, the copies, the optimizer, the one-worker exact sum) instead of waiting
/// beside a pool of its own size; with a separate pool, its threads kept spinning for work after
/// each product on the cores the loop's single-threaded kernels needed, and steps were
/// measurably slower. A pool built earlier (a user's binary may build its own) is kept.
fn join_compute_threads() {
    let _ = rayon::ThreadPoolBuilder::new()
        .use_current_thread()
        .build_global();
}

fn run_train_worker(
    w: WorkerEnv,
    cfg: &TrainConfig,
    out: &std::path::Path,
    under_launcher: bool,
    resume: bool,
    faults: &[Fault],
) -> Result<()> {
    let rank = w.rank;
    if under_launcher {
        // First: a worker whose launcher dies at any later point (while its threads start, while
        // it connects) ends within a second.
        orphan::watch_launcher(rank);
        start_heartbeat(rank);
        oom::enable();
    }
    join_compute_threads();
    // The device first: one that cannot be opened ends this worker with exit 3 (the launcher
    // probed it already; a cluster engine's ranks learn it here).
    let device = lockstep_train::device::Placement::open(cfg.train.device, w.local_rank)
        .with_context(|| format!("rank {rank}"))?;
    let env = environment();
    let timeout = Duration::from_secs_f64(cfg.dist.timeout_secs);
    let mut worker = worker::connect(w, cfg.dist.transport, timeout, &tcp_options(&env)?)?;
    worker.comm.set_algorithm(cfg.dist.algorithm);
    // The job's own hook first (rank 0's events), its panic kept to end the run with.
    let mut hook_panic: Option<String> = None;
    let mut on_event = |e: Event| {
        if rank == 0 && hook_panic.is_none() {
            hook_panic = job().hook(&e).err();
        }
        show_event(e, rank, under_launcher)
    };
    let host = worker.host.clone();
    let summary = lockstep_train::train(
        job(),
        cfg,
        WorkerContext {
            comm: &mut worker.comm,
            host,
            device,
            out_dir: out,
            on_event: &mut on_event,
            resume,
            faults,
        },
    )
    .with_context(|| format!("rank {rank}"))?;
    if let Some(p) = hook_panic {
        return Err(lockstep_train::TrainError::JobSetup {
            job: job().name(),
            message: format!(
                "its on_event hook panicked: {p} (the run finished and its outputs are written)"
            ),
        })
        .with_context(|| format!("rank {rank}"));
    }
    finish_worker(rank, cfg, &summary)
}

/// An event of the training loop on this worker's output: typed for its launcher, a line for
/// people.
fn show_event(e: Event, rank: usize, under_launcher: bool) {
    match e {
        Event::Progress(p) if under_launcher => {
            let progress = WorkerMessage::Progress(protocol::Progress {
                step: p.step,
                total_steps: p.total_steps,
                loss: p.loss,
                samples_per_sec: p.samples_per_sec,
                eta_seconds: p.eta_seconds,
            });
            orphan::emit(rank, true, &progress.line());
        }
        Event::Progress(p) => orphan::emit(
            rank,
            false,
            &format!(
                "step {}/{} loss {:.4} {:.0} samples/s ETA {:.0}s",
                p.step, p.total_steps, p.loss, p.samples_per_sec, p.eta_seconds
            ),
        ),
        Event::StepDone(step) if under_launcher => {
            orphan::emit(rank, true, &WorkerMessage::StepDone { step }.line())
        }
        Event::Resumed(step) => {
            if under_launcher {
                orphan::emit(rank, true, &WorkerMessage::Resumed { step }.line());
            }
            orphan::emit(
                rank,
                false,
                &format!("resumed from the checkpoint of step {step}"),
            );
        }
        Event::Notice(text) => orphan::emit(rank, false, &text),
        _ => {}
    }
}

/// Rank 0's final line: loss, test figures, speed and the parameter hash.
fn finish_worker(rank: usize, cfg: &TrainConfig, summary: &lockstep_train::Summary) -> Result<()> {
    if rank == 0 {
        // A language model's test figures are validation nats per character and next-character
        // accuracy; a classifier's, its test accuracy; any job's, its own metrics.
        let test = if job().evaluates_per_character(cfg) {
            format!(
                "validation loss {:.4} nats/char, next-char accuracy {:.2}%",
                summary.test_loss,
                summary.test_accuracy * 100.0
            )
        } else {
            let mut parts = Vec::new();
            if summary.test_accuracy.is_finite() {
                parts.push(format!(
                    "test accuracy {:.2}%",
                    summary.test_accuracy * 100.0
                ));
            } else {
                parts.push(format!("test loss {:.4}", summary.test_loss));
            }
            for (name, v) in &summary.test_metrics {
                parts.push(format!("test {name} {v:.4}"));
            }
            parts.join(", ")
        };
        orphan::emit(
            rank,
            false,
            &format!(
                "final loss {:.4}, {test}, {:.0} samples/s, param_hash {}",
                summary.final_loss, summary.samples_per_sec, summary.param_hash
            ),
        );
    }
    Ok(())
}
