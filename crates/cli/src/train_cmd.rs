//! `lockstep train`: validate the request, then either be one worker (started by Slurm, mpirun or
//! torchrun) or launch this node's workers under supervision — alone on one node, or as this
//! node's agent of a job across several (`--nnodes N` or `MIN:MAX`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use lockstep_train::faults::Fault;
use lockstep_train::TrainConfig;

use crate::supervise::{self, Boundary, RestartPolicy};
use crate::{
    agent, attempt_spec, check_layout, cluster_env, elastic, environment, flags, inject, job,
    job_store, launch, load_config, request, resolve_rdzv, run_dir, run_train_worker, TrainArgs,
};

pub(crate) fn run(a: TrainArgs) -> Result<()> {
    let r = Request::validate(&a)?;
    let Some(dir) = RunDir::prepare(&a, &r)? else {
        return Ok(()); // a finished run: nothing to do
    };
    match r.engine.clone() {
        // Started by Slurm / mpirun / torchrun: this process is one worker.
        Some(w) => run_as_engine_worker(&a, &r, dir, w),
        None => launch_and_supervise(&a, &r, dir),
    }
}

/// A `lockstep train` request, every flag and the config checked (nothing read, written or
/// spawned yet).
struct Request {
    env: HashMap<String, String>,
    cfg: TrainConfig,
    out: PathBuf,
    stall_timeout: Duration,
    heartbeat_timeout: Duration,
    world: (usize, usize),
    nodes: (usize, usize),
    /// The cluster engine that started this process as a worker, if one did.
    engine: Option<cluster_env::WorkerEnv>,
    faults: Vec<Fault>,
    /// `--worker-memory-gib` in bytes: each of this node's workers in a memory cgroup capped
    /// at it (`memory_cap.rs`).
    memory_cap: Option<u64>,
    /// Whether this process writes the run directory (rank 0 under an engine, node 0's
    /// launcher otherwise).
    writes_run_dir: bool,
}

impl Request {
    fn validate(a: &TrainArgs) -> Result<Request> {
        // Every flag is range-checked before anything is read, written or spawned.
        let stall_timeout = flags::seconds(
            "--stall-timeout",
            a.stall_timeout,
            2.0 * crate::WORKER_HEARTBEAT_EVERY.as_secs_f64(),
        )?;
        let heartbeat_timeout = flags::seconds(
            "--heartbeat-timeout",
            a.nodes.heartbeat_timeout,
            2.0 * agent::HEARTBEAT_EVERY.as_secs_f64(),
        )?;
        if let Some(t) = a.threads_per_worker {
            flags::threads("--threads-per-worker", t)?;
        }
        flags::count("--max-restarts", a.max_restarts, 0, flags::MAX_RESTARTS)?;
        let env = environment();
        // The transport's knobs that workers read from the environment: checked here once.
        crate::tcp_options(&env).map_err(|e| request::BadRequest(format!("{e:#}")))?;
        let (config_path, out) = match &a.resume {
            Some(dir) => (Some(dir.join("config.toml")), dir.clone()),
            None => (
                a.config.clone(),
                a.out.clone().unwrap_or_else(launch::default_out_dir),
            ),
        };
        let mut sets = a.sets.clone();
        if let Some(device) = a.device {
            sets.push(format!("train.device={device}"));
        }
        let cfg = load_config(config_path.as_deref(), &sets)?;
        let (min_world, max_world) = parse_range(
            "--nproc",
            "worker count",
            &a.nproc,
            flags::MAX_LOCAL_WORKERS,
        )?;
        let (min_nodes, max_nodes) = a.nodes.range()?;
        a.nodes.check_rendezvous()?;
        let engine =
            cluster_env::detect(&env)?.filter(|w| w.engine != cluster_env::Engine::Launcher);
        let world = engine
            .as_ref()
            .map_or(max_world * max_nodes, |w| w.world_size);
        if engine.is_none() && a.nodes.several()? {
            // Every node needs the job's secret: checked before anything is written.
            crate::multi_node_secret(&env)?;
        }
        if engine.is_none() {
            request::check_world(&cfg, max_world, max_nodes)?;
            check_node_range(&cfg, max_world, (min_nodes, max_nodes))?;
        }
        check_layout(&cfg, &env, max_world * max_nodes, min_world != max_world)?;
        let faults = match &a.inject {
            Some(spec) => inject::parse(spec)
                .and_then(|f| {
                    inject::validate(&f, world, cfg.train.steps, cfg.checkpoint.every)?;
                    Ok(f)
                })
                .map_err(|e| request::BadRequest(format!("{e:#}")))?,
            None => Vec::new(),
        };
        let memory_cap = match a.worker_memory_gib {
            Some(_) if engine.is_some() => {
                return Err(request::BadRequest(
                    "--worker-memory-gib caps the workers lockstep's launcher starts; under a \
                     cluster engine, ask it for the memory (e.g. Slurm's --mem-per-cpu)"
                        .into(),
                )
                .into())
            }
            Some(gib) => {
                let bytes = flags::gib("--worker-memory-gib", gib)?;
                crate::memory_cap::MemoryCaps::check(bytes)
                    .map_err(|e| request::BadRequest(e.to_string()))?;
                Some(bytes)
            }
            None => None,
        };
        if max_nodes > 1 && min_world != max_world {
            return Err(request::BadRequest(format!(
                "--nproc {} with --nnodes {}: elastic worker counts are for one node; with \
                 several nodes give a fixed --nproc (and MIN:MAX to --nnodes)",
                a.nproc, a.nodes.nnodes
            ))
            .into());
        }
        // Under an engine only rank 0 writes the run directory (and may already have when a
        // slower rank gets here): the others leave the checks to it. Likewise the launchers of
        // nodes other than 0 hold no run data (rank 0 writes it all), so starting one again —
        // an agent rejoining its job — is not refused.
        let writes_run_dir = engine
            .as_ref()
            .map_or(a.nodes.node_rank == 0, |w| w.rank == 0);
        Ok(Request {
            env,
            cfg,
            out,
            stall_timeout,
            heartbeat_timeout,
            world: (min_world, max_world),
            nodes: (min_nodes, max_nodes),
            engine,
            faults,
            memory_cap,
            writes_run_dir,
        })
    }

    /// Workers launched in all: this node's times the nodes.
    fn launched(&self) -> usize {
        self.world.1 * self.nodes.1
    }
}

/// The run directory, locked for this launcher's life and checked under the lock.
struct RunDir {
    _lock: Option<run_dir::RunDirLock>,
    /// What a fresh run replaces (`--overwrite`), applied once nothing is left to refuse.
    fresh: run_dir::Fresh,
    /// Whether this launch created it (so a run that never started leaves nothing behind).
    created: bool,
}

impl RunDir {
    /// Lock and check the run directory (`None`: `--resume` of a finished run, said so).
    fn prepare(a: &TrainArgs, r: &Request) -> Result<Option<RunDir>> {
        // The request is valid: lock the run directory for this launcher's life, then check it
        // under the lock, so that two launchers can never both pass the checks.
        let created = !r.out.exists();
        let _lock = if r.writes_run_dir {
            Some(run_dir::RunDirLock::acquire(&r.out)?)
        } else {
            None
        };
        let mut fresh = run_dir::Fresh::default();
        if a.resume.is_some() {
            if let run_dir::Resume::Finished { steps, param_hash } =
                run_dir::check_resume(&r.out, &r.cfg)?
            {
                let out = r.out.display();
                eprintln!(
                    "lockstep: {out} is a finished run ({steps} steps, param_hash {param_hash}); \
                     nothing to do and nothing changed. To train it longer: --resume {out} --set \
                     train.steps=N with N > {steps}"
                );
                return Ok(None);
            }
        } else if r.writes_run_dir {
            fresh = run_dir::check_fresh(&r.out, &r.cfg, a.overwrite)?;
        }
        if r.cfg.checkpoint.every > 0 && r.writes_run_dir {
            run_dir::check_writable(&lockstep_train::checkpoint_dir(&r.cfg, &r.out))?;
        }
        Ok(Some(RunDir {
            _lock,
            fresh,
            created,
        }))
    }

    /// Write the run's config.toml (replacing what `--overwrite` replaces first).
    fn write_config(&mut self, r: &Request) -> Result<PathBuf> {
        std::mem::take(&mut self.fresh).apply();
        std::fs::create_dir_all(&r.out)
            .with_context(|| format!("creating run directory {}", r.out.display()))?;
        let path = r.out.join("config.toml");
        lockstep_train::write_atomic(&path, r.cfg.to_run_file(job().config_sections()).as_bytes())?;
        Ok(path)
    }
}

/// This process is one worker of a job started by a cluster engine.
fn run_as_engine_worker(
    a: &TrainArgs,
    r: &Request,
    mut dir: RunDir,
    w: cluster_env::WorkerEnv,
) -> Result<()> {
    // One write, so that lines of ranks sharing a terminal (mpirun) never interleave.
    let line = format!(
        "lockstep: rank {} of {} (local rank {}, started by {})\n",
        w.rank,
        w.world_size,
        w.local_rank,
        w.engine.name()
    );
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    if w.rank == 0 && a.resume.is_none() {
        // Written up front (not only with the summary) so that a failed job can be resubmitted
        // with `--resume <out>`.
        dir.write_config(r)?;
    }
    run_train_worker(w, &r.cfg, &r.out, false, a.resume.is_some(), &r.faults)
}

/// This node's workers launched and supervised: alone, or as this node's agent of a job across
/// several nodes.
fn launch_and_supervise(a: &TrainArgs, r: &Request, mut dir: RunDir) -> Result<()> {
    std::fs::create_dir_all(&r.out)
        .with_context(|| format!("creating run directory {}", r.out.display()))?;
    let plan = lockstep_run::ParallelPlan::new(&r.cfg, r.launched(), &job().shape(&r.cfg))?;
    eprintln!(
        "lockstep: training {} on {} worker(s) ({} node(s); {}), run directory {}",
        job().label(&r.cfg),
        r.launched(),
        a.nodes.nnodes,
        plan.describe(),
        r.out.display()
    );
    // Several nodes: one store for the job's life (node 0's), and this node's agent in it.
    let shared_store = if r.nodes.1 > 1 {
        Some(job_store(&a.nodes, &r.env)?)
    } else {
        None
    };
    let Some(mut coordinator) = coordinator(a, r, shared_store.as_ref())? else {
        eprintln!(
            "lockstep: the job ended before node {} was admitted; nothing to do",
            a.nodes.node_rank
        );
        return Ok(());
    };
    // The workers' config, written only now: a node other than 0 gets here after joining node
    // 0's store, which node 0 serves only once it has checked the run directory — so in a run
    // directory shared by all nodes, no other node's write can make node 0 refuse it as a run.
    // The replaced run (--overwrite) is removed only now, when nothing is left to refuse.
    let resolved = dir.write_config(r)?;
    let mut servers = Vec::new();
    let sup = supervise::run(coordinator.as_mut(), a.max_restarts, |attempt, place| {
        let args = worker_args(a, r, &resolved, attempt);
        let mut spec = match &shared_store {
            Some(st) => {
                let moved = place.store.clone();
                let mut spec = attempt_spec(st, place, &r.env, args, attempt)?;
                // The store moves to another node if node 0 is lost.
                if let Some(store) = moved {
                    spec.store = store;
                }
                spec
            }
            None => {
                let st = job_store(&a.nodes, &r.env)?;
                let spec = attempt_spec(&st, place, &r.env, args, attempt)?;
                servers.push(st.server); // keep each attempt's store alive until it is done
                spec
            }
        };
        if let Some(t) = a.threads_per_worker {
            spec.threads_per_worker = t;
        }
        spec.stall_timeout = Some(r.stall_timeout);
        spec.memory_cap = r.memory_cap;
        Ok(spec)
    });
    let sup = sup.inspect_err(|e| {
        // Bad input before the first step (a dataset shorter than a batch, a job's model that
        // cannot be built) leaves no half-made run behind: fix it and run again.
        if a.resume.is_none() && r.writes_run_dir && e.is::<supervise::PermanentFailure>() {
            let ckpt = lockstep_train::checkpoint_dir(&r.cfg, &r.out);
            run_dir::remove_unstarted(&r.out, &ckpt, dir.created);
        }
    })?;
    let runs_rank0 = coordinator.runs_rank0();
    drop(coordinator);
    drop(shared_store);
    if runs_rank0 {
        finish(&r.out, &sup)?;
    }
    Ok(())
}

/// The coordinator of this node's attempts: a node agent in the job's shared store, or the
/// local one (`None`: the multi-node job ended before this node was admitted).
fn coordinator(
    a: &TrainArgs,
    r: &Request,
    shared_store: Option<&crate::JobStore>,
) -> Result<Option<Box<dyn supervise::Coordinator>>> {
    let boundary = Boundary {
        checkpoint_every: r.cfg.checkpoint.every,
        total_steps: r.cfg.train.steps,
    };
    let Some(st) = shared_store else {
        let policy = RestartPolicy {
            max_restarts: a.max_restarts,
        };
        return Ok(Some(Box::new(elastic::LocalCoordinator::new(
            policy,
            r.world,
            r.faults.clone(),
            boundary,
        ))));
    };
    let settings = agent::AgentSettings {
        node: a.nodes.node_rank,
        min_nodes: r.nodes.0,
        max_nodes: r.nodes.1,
        nproc: r.world.1,
        max_restarts: a.max_restarts,
        heartbeat_timeout: r.heartbeat_timeout,
        join_timeout: agent::JOIN_TIMEOUT,
        boundary,
        checkpoint_dir: lockstep_train::checkpoint_dir(&r.cfg, &r.out),
    };
    let backend = if a.nodes.etcd()? {
        agent::Backend::Etcd(st.store.clone())
    } else {
        agent::Backend::Builtin(resolve_rdzv(&st.store)?)
    };
    Ok(
        match agent::NodeAgent::join(backend, &st.secret, &st.job_id, settings)? {
            agent::Joined::Member(agent) => Some(agent),
            agent::Joined::JobOver => None,
        },
    )
}

/// The arguments of attempt `attempt`'s workers: the resolved config, `--resume` after the
/// first attempt, and the faults still to inject.
fn worker_args(a: &TrainArgs, r: &Request, resolved: &Path, attempt: usize) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "train".into(),
        "--config".into(),
        resolved.display().to_string(),
        "--out".into(),
        r.out.display().to_string(),
    ];
    if attempt > 0 || a.resume.is_some() {
        args.push("--resume".into());
    }
    let active: Vec<Fault> = r
        .faults
        .iter()
        .filter(|f| attempt == 0 || !lockstep_train::faults::first_attempt_only(f))
        .copied()
        .collect();
    if !active.is_empty() {
        args.extend([
            "--faults".into(),
            serde_json::to_string(&active).expect("faults serialise"),
        ]);
    }
    args
}

/// The run's end on the node that ran rank 0: the summary annotated with the launcher's
/// records, the report, and where to find them.
fn finish(out: &Path, sup: &supervise::Supervision) -> Result<()> {
    supervise::annotate_summary(out, sup)?;
    supervise::write_report(out, sup)?;
    if sup.restarts > 0 || !sup.membership.is_empty() {
        eprintln!(
            "lockstep: survived {} failure(s) with {} restart(s), {} step(s) recomputed",
            sup.failures.len(),
            sup.restarts,
            sup.steps_recomputed
        );
    }
    eprintln!(
        "lockstep: done; summary in {}, report in {}",
        out.join("summary.json").display(),
        out.join("report.html").display()
    );
    Ok(())
}

/// `flag`'s "N" or "MIN:MAX" (1 ≤ MIN ≤ MAX ≤ `most`).
pub(crate) fn parse_range(
    flag: &str,
    what: &str,
    s: &str,
    most: usize,
) -> Result<(usize, usize), request::BadRequest> {
    let parse = |v: &str| {
        v.trim()
            .parse::<usize>()
            .map_err(|_| request::BadRequest(format!("{flag} {s}: `{v}` is not a {what}")))
    };
    let (lo, hi) = match s.split_once(':') {
        Some((a, b)) => (parse(a)?, parse(b)?),
        None => {
            let n = parse(s)?;
            (n, n)
        }
    };
    if lo == 0 || lo > hi || hi > most {
        return Err(request::BadRequest(format!(
            "{flag} {s}: need 1 ≤ MIN ≤ MAX ≤ {most}"
        )));
    }
    Ok((lo, hi))
}

/// An elastic node range: a lost node must take whole model replicas with it (its workers are
/// whole tensor-parallel groups and pipelines, `--nproc` a multiple of tp · pp) and the replica
/// count must follow the world (`parallel.dp` = 0, the default); every world in the range must
/// fit the layout.
fn check_node_range(
    cfg: &TrainConfig,
    nproc: usize,
    (min_nodes, max_nodes): (usize, usize),
) -> Result<()> {
    if min_nodes == max_nodes {
        return Ok(());
    }
    let model_parallel = cfg.parallel.tp * cfg.parallel.pp;
    if !nproc.is_multiple_of(model_parallel) {
        return Err(lockstep_train::ConfigError::Invalid {
            field: "parallel.tp",
            message: format!(
                "--nnodes {min_nodes}:{max_nodes} drops and admits whole nodes, so each node's --nproc {nproc} must be a multiple of parallel.tp · parallel.pp = {model_parallel} (whole model replicas per node)"
            ),
        }
        .into());
    }
    if cfg.parallel.dp != 0 {
        return Err(lockstep_train::ConfigError::Invalid {
            field: "parallel.dp",
            message: format!(
                "--nnodes {min_nodes}:{max_nodes} changes the number of replicas as nodes come and go: leave parallel.dp = 0 (world / (tp · pp)) rather than {}",
                cfg.parallel.dp
            ),
        }
        .into());
    }
    for nodes in min_nodes..=max_nodes {
        lockstep_train::ParallelDims::from_config(cfg, nodes * nproc).with_context(|| {
            format!("with {nodes} node(s) of {nproc} workers (--nnodes {min_nodes}:{max_nodes})")
        })?;
    }
    Ok(())
}
