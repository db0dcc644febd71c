//! `lockstep`: the command-line front end. The only place that reads argv and the environment.

mod bench;
mod cluster_env;
mod launch;
mod scale;
mod worker;

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use lockstep_comm::store::StoreServer;
use lockstep_comm::tcp::TcpOptions;
use lockstep_comm::{Algorithm, JobSecret};
use lockstep_train::{Progress, TrainConfig, WorkerContext};

use crate::cluster_env::WorkerEnv;
use crate::launch::{LaunchSpec, PROGRESS_PREFIX, RESULT_PREFIX};

#[derive(Parser)]
#[command(name = "lockstep", version, about = "Distributed training across worker processes and hosts, bitwise reproducible.")]
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
    /// Print a fresh job secret (64 hex digits) for multi-node jobs or external launchers.
    Secret,
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
    /// Worker processes on this node.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Compute threads per worker (default: this host's cores / --nproc).
    #[arg(long)]
    threads_per_worker: Option<usize>,
    /// Run directory (default: runs/run-<time>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Override a config value, e.g. --set train.steps=20 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
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
    /// Compute threads per worker, the same for every size (default 1, so that a larger world
    /// size is more compute, not the same cores split differently).
    #[arg(long, default_value_t = 1)]
    threads_per_worker: usize,
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Directory for the runs (nproc-N/) and scale.json.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args, Clone)]
struct NodeArgs {
    /// Number of nodes (hosts) in the job; each runs `lockstep train` with its --node-rank.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// host:port of the rendezvous store, served by node 0 (needed when --nnodes > 1).
    #[arg(long)]
    rdzv: Option<String>,
}

#[derive(Args, Clone)]
struct BenchArgs {
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// "shm" or "tcp".
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

#[derive(Subcommand)]
enum WorkerRole {
    Train {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        out: PathBuf,
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

fn main() {
    let cli = Cli::parse();
    // Keep big step buffers in the heap instead of re-faulting them every step (see lockstep-model).
    lockstep_model::tune_allocator_for_training();
    let result = match cli.command {
        None => cmd_train(TrainArgs {
            config: None,
            nproc: 2,
            threads_per_worker: None,
            out: None,
            sets: Vec::new(),
            nodes: NodeArgs { nnodes: 1, node_rank: 0, rdzv: None },
        }),
        Some(Command::Train(a)) => cmd_train(a),
        Some(Command::BenchCollectives(a)) => cmd_bench(a),
        Some(Command::Scale(a)) => cmd_scale(a),
        Some(Command::Secret) => JobSecret::generate().map(|s| println!("{}", s.to_hex())).map_err(Into::into),
        Some(Command::Worker { role }) => cmd_worker(role),
    };
    if let Err(e) = result {
        eprintln!("lockstep: error: {e:#}");
        std::process::exit(1);
    }
}

fn environment() -> HashMap<String, String> {
    std::env::vars().collect()
}

fn parse_algorithm(s: &str) -> Result<Algorithm> {
    Ok(match s {
        "auto" => Algorithm::Auto,
        "ring" => Algorithm::Ring,
        "recursive-doubling" => Algorithm::RecursiveDoubling,
        other => bail!("algorithm `{other}` is not one of auto, ring, recursive-doubling"),
    })
}

/// Test-only knobs for the TCP transport (latency emulation: this kernel has no netem).
fn tcp_options(env: &HashMap<String, String>) -> Result<TcpOptions> {
    let mut o = TcpOptions::default();
    if let Some(us) = env.get("LOCKSTEP_TEST_LATENCY_US") {
        let us: u64 = us.parse().with_context(|| format!("LOCKSTEP_TEST_LATENCY_US={us} is not a number of microseconds"))?;
        o.emulated_latency = Some(Duration::from_micros(us));
    }
    Ok(o)
}

fn cmd_train(a: TrainArgs) -> Result<()> {
    let env = environment();
    let cfg = TrainConfig::load(a.config.as_deref(), &a.sets)?;
    let out = a.out.clone().unwrap_or_else(launch::default_out_dir);

    // Started by Slurm / mpirun / torchrun: this process is one worker.
    if let Some(w) = cluster_env::detect(&env)? {
        if w.engine != cluster_env::Engine::Launcher {
            eprintln!(
                "lockstep: rank {} of {} (local rank {}, started by {})",
                w.rank,
                w.world_size,
                w.local_rank,
                w.engine.name()
            );
            return run_train_worker(w, &cfg, &out, false);
        }
    }

    std::fs::create_dir_all(&out).with_context(|| format!("creating run directory {}", out.display()))?;
    let resolved = out.join("config.toml");
    lockstep_train::trainer::write_atomic(&resolved, cfg.to_toml().as_bytes())?;
    let (mut spec, _server) = launch_spec(&a.nodes, a.nproc, &env, vec![
        "train".into(),
        "--config".into(),
        resolved.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ])?;
    if let Some(t) = a.threads_per_worker {
        spec.threads_per_worker = t.max(1);
    }
    eprintln!(
        "lockstep: training {} on {} worker(s) ({} node(s)), run directory {}",
        cfg.data.dataset,
        a.nproc * a.nodes.nnodes,
        a.nodes.nnodes,
        out.display()
    );
    let results = launch::run(&spec)?;
    for r in results {
        println!("{r}");
    }
    if a.nodes.node_rank == 0 {
        eprintln!("lockstep: done; summary in {}", out.join("summary.json").display());
    }
    Ok(())
}

/// Prepare the workers' launch; node 0 also starts the rendezvous store (kept alive by the returned
/// server): on an ephemeral loopback port for one node, on the --rdzv address for several.
fn launch_spec(
    nodes: &NodeArgs,
    nproc: usize,
    env: &HashMap<String, String>,
    worker_args: Vec<String>,
) -> Result<(LaunchSpec, Option<StoreServer>)> {
    if nproc == 0 {
        bail!("--nproc must be at least 1");
    }
    if nodes.nnodes == 0 || nodes.node_rank >= nodes.nnodes {
        bail!("--node-rank {} must be below --nnodes {}", nodes.node_rank, nodes.nnodes);
    }
    let (store, secret, job_id) = if nodes.nnodes > 1 {
        let rdzv = nodes.rdzv.clone().context("--nnodes > 1 needs --rdzv HOST:PORT (node 0 serves the store there)")?;
        let hex = env.get("LOCKSTEP_SECRET").context(
            "--nnodes > 1 needs the same LOCKSTEP_SECRET on every node: run `lockstep secret` once and export it everywhere",
        )?;
        let secret = JobSecret::from_hex(hex).context("LOCKSTEP_SECRET")?;
        let job = env.get("LOCKSTEP_JOB_ID").cloned().unwrap_or_else(|| cluster_env::job_id_from_secret(&secret));
        (rdzv, secret, job)
    } else {
        let secret = JobSecret::generate()?;
        let job = format!("{}{:x}", &cluster_env::job_id_from_secret(&secret)[..8], std::process::id() & 0xffff);
        (String::new(), secret, job)
    };
    let mut store = store;
    let server = if nodes.node_rank == 0 {
        let bind: SocketAddr = if nodes.nnodes > 1 {
            store.to_socket_addrs().with_context(|| format!("resolving --rdzv {store}"))?.next().context("--rdzv resolves to nothing")?
        } else {
            "127.0.0.1:0".parse().expect("literal address")
        };
        let server = StoreServer::bind(bind, &secret, &job_id).with_context(|| format!("serving the rendezvous store on {bind}"))?;
        if nodes.nnodes == 1 {
            store = server.local_addr().to_string();
        }
        Some(server)
    } else {
        None
    };
    let extra_env = env.iter().filter(|(k, _)| k.starts_with("LOCKSTEP_TEST_")).map(|(k, v)| (k.clone(), v.clone())).collect();
    let spec = LaunchSpec {
        worker_args,
        nproc,
        nnodes: nodes.nnodes,
        node_rank: nodes.node_rank,
        store,
        secret,
        job_id,
        threads_per_worker: launch::default_threads(nproc),
        extra_env,
    };
    Ok((spec, server))
}

fn cmd_scale(a: ScaleArgs) -> Result<()> {
    let sizes = scale::parse_nprocs(&a.nproc)?;
    TrainConfig::load(a.config.as_deref(), &a.sets)?; // fail on a bad config before the first run
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut runs = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        eprintln!("lockstep scale: run {}/{}: {n} worker(s)", i + 1, sizes.len());
        let dir = scale::run_dir(&a.out, n);
        cmd_train(TrainArgs {
            config: a.config.clone(),
            nproc: n,
            threads_per_worker: Some(a.threads_per_worker),
            out: Some(dir.clone()),
            sets: a.sets.clone(),
            nodes: NodeArgs { nnodes: 1, node_rank: 0, rdzv: None },
        })
        .with_context(|| format!("the {n}-worker run"))?;
        runs.push(scale::load_run(&dir)?);
    }
    let report = lockstep_train::scaling::compare(&runs);
    print!("{}", scale::format_table(&report));
    let path = a.out.join("scale.json");
    lockstep_train::trainer::write_atomic(&path, (serde_json::to_string_pretty(&report)? + "\n").as_bytes())?;
    eprintln!("lockstep scale: wrote {}", path.display());
    Ok(())
}

fn cmd_bench(a: BenchArgs) -> Result<()> {
    let sizes = bench::parse_sizes(&a.sizes)?;
    parse_algorithm(&a.algorithm)?;
    if !bench::OPS.contains(&a.op.as_str()) {
        bail!("--op {} is not one of {:?}", a.op, bench::OPS);
    }
    if !matches!(a.transport.as_str(), "shm" | "tcp") {
        bail!("--transport {} is not one of shm, tcp", a.transport);
    }
    let memcpy = bench::memcpy_gbps(64 << 20);
    let env = environment();
    let (mut spec, _server) = launch_spec(&NodeArgs { nnodes: 1, node_rank: 0, rdzv: None }, a.nproc, &env, vec![
        "bench".into(),
        "--transport".into(),
        a.transport.clone(),
        "--op".into(),
        a.op.clone(),
        "--sizes".into(),
        a.sizes.clone(),
        "--algorithm".into(),
        a.algorithm.clone(),
    ])?;
    if let Some(b) = a.segment_bytes {
        spec.worker_args.extend(["--segment-bytes".to_string(), b.to_string()]);
    }
    eprintln!("lockstep: {} over {} on {} ranks, {} sizes", a.op, a.transport, a.nproc, sizes.len());
    let results = launch::run(&spec)?;
    let mut rows = Vec::new();
    for r in results {
        rows.push(serde_json::from_str::<bench::Row>(&r).context("worker sent a malformed result row")?);
    }
    let report = bench::Report { memcpy_gbps: memcpy, rows };
    print!("{}", bench::format_table(&report));
    if let Some(path) = a.json {
        std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn cmd_worker(role: WorkerRole) -> Result<()> {
    let env = environment();
    let w = cluster_env::detect(&env)?.context("`lockstep worker` is started by the launcher (LOCKSTEP_RANK etc. are missing)")?;
    match role {
        WorkerRole::Train { config, out } => {
            let cfg = TrainConfig::load(Some(&config), &[])?;
            run_train_worker(w, &cfg, &out, true)
        }
        WorkerRole::Bench { transport, op, sizes, algorithm, segment_bytes } => {
            let timeout = Duration::from_secs(60);
            let mut worker = worker::connect(w, &transport, timeout, &tcp_options(&env)?)?;
            if let Some(b) = segment_bytes {
                worker.comm.set_segment_bytes(b);
            }
            let rows = bench::run_worker(&mut worker.comm, &op, &bench::parse_sizes(&sizes)?, parse_algorithm(&algorithm)?)?;
            for r in rows {
                println!("{RESULT_PREFIX}{}", serde_json::to_string(&r)?);
            }
            Ok(())
        }
    }
}

fn run_train_worker(w: WorkerEnv, cfg: &TrainConfig, out: &std::path::Path, under_launcher: bool) -> Result<()> {
    let env = environment();
    let timeout = Duration::from_secs_f64(cfg.dist.timeout_secs);
    let rank = w.rank;
    let mut worker = worker::connect(w, &cfg.dist.transport, timeout, &tcp_options(&env)?)?;
    worker.comm.set_algorithm(parse_algorithm(&cfg.dist.algorithm)?);
    let mut on_progress = |p: Progress| {
        if under_launcher {
            println!(
                "{PROGRESS_PREFIX}{{\"step\":{},\"total_steps\":{},\"loss\":{},\"samples_per_sec\":{},\"eta_seconds\":{}}}",
                p.step, p.total_steps, p.loss, p.samples_per_sec, p.eta_seconds
            );
        } else {
            eprintln!("step {}/{} loss {:.4} {:.0} samples/s ETA {:.0}s", p.step, p.total_steps, p.loss, p.samples_per_sec, p.eta_seconds);
        }
    };
    let host = worker.host.clone();
    let summary = lockstep_train::train(
        cfg,
        WorkerContext { comm: &mut worker.comm, host, out_dir: out, on_progress: &mut on_progress },
    )
    .with_context(|| format!("rank {rank}"))?;
    if rank == 0 {
        eprintln!(
            "final loss {:.4}, test accuracy {:.2}%, {:.0} samples/s, param_hash {}",
            summary.final_loss,
            summary.test_accuracy * 100.0,
            summary.samples_per_sec,
            summary.param_hash
        );
    }
    Ok(())
}
