//! `lockstep train`: validate the request, then either be one worker (started by Slurm, mpirun or
//! torchrun) or launch this node's workers under supervision — alone on one node, or as this
//! node's agent of a job across several (`--nnodes N` or `MIN:MAX`).

use anyhow::{Context, Result};
use lockstep_train::faults::Fault;
use lockstep_train::TrainConfig;

use crate::supervise::{self, Boundary, RestartPolicy};
use crate::{
    agent, attempt_spec, check_layout, cluster_env, elastic, environment, flags, inject, job,
    job_store, launch, load_config, request, resolve_rdzv, run_dir, run_train_worker, TrainArgs,
};

pub(crate) fn run(a: TrainArgs) -> Result<()> {
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
    let (config_path, out) = match &a.resume {
        Some(dir) => (Some(dir.join("config.toml")), dir.clone()),
        None => (
            a.config.clone(),
            a.out.clone().unwrap_or_else(launch::default_out_dir),
        ),
    };
    // Everything is validated before anything is written or spawned.
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
    let engine = cluster_env::detect(&env)?.filter(|w| w.engine != cluster_env::Engine::Launcher);
    let world = engine
        .as_ref()
        .map_or(max_world * max_nodes, |w| w.world_size);
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
    let several = max_nodes > 1;
    if several && min_world != max_world {
        return Err(request::BadRequest(format!(
            "--nproc {} with --nnodes {}: elastic worker counts are for one node; with several nodes give a fixed --nproc (and MIN:MAX to --nnodes)",
            a.nproc, a.nodes.nnodes
        ))
        .into());
    }
    // Under an engine only rank 0 writes the run directory (and may already have when a slower
    // rank gets here): the others leave the checks to it. Likewise the launchers of nodes other
    // than 0 hold no run data (rank 0 writes it all), so starting one again — an agent rejoining
    // its job — is not refused.
    let writes_run_dir = engine
        .as_ref()
        .map_or(a.nodes.node_rank == 0, |w| w.rank == 0);
    // The request is valid: lock the run directory for this launcher's life, then check it under
    // the lock, so that two launchers can never both pass the checks.
    let created_out = !out.exists();
    let _lock = if writes_run_dir {
        Some(run_dir::RunDirLock::acquire(&out)?)
    } else {
        None
    };
    let mut fresh = run_dir::Fresh::default();
    if a.resume.is_some() {
        if let run_dir::Resume::Finished { steps, param_hash } = run_dir::check_resume(&out, &cfg)?
        {
            eprintln!(
                "lockstep: {} is a finished run ({steps} steps, param_hash {param_hash}); nothing \
                 to do and nothing changed. To train it longer: --resume {} --set train.steps=N \
                 with N > {steps}",
                out.display(),
                out.display()
            );
            return Ok(());
        }
    } else if writes_run_dir {
        fresh = run_dir::check_fresh(&out, &cfg, a.overwrite)?;
    }
    if cfg.checkpoint.every > 0 && writes_run_dir {
        run_dir::check_writable(&lockstep_train::checkpoint_dir(&cfg, &out))?;
    }

    // Started by Slurm / mpirun / torchrun: this process is one worker.
    if let Some(w) = engine {
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
            fresh.apply();
            // Written up front (not only with the summary) so that a failed job can be
            // resubmitted with `--resume <out>`.
            std::fs::create_dir_all(&out)
                .with_context(|| format!("creating run directory {}", out.display()))?;
            lockstep_train::write_atomic(
                &out.join("config.toml"),
                cfg.to_run_file(job().config_sections()).as_bytes(),
            )?;
        }
        return run_train_worker(w, &cfg, &out, false, a.resume.is_some(), &faults);
    }

    std::fs::create_dir_all(&out)
        .with_context(|| format!("creating run directory {}", out.display()))?;
    let plan = lockstep_run::ParallelPlan::new(&cfg, max_world * max_nodes, &job().shape(&cfg))?;
    eprintln!(
        "lockstep: training {} on {} worker(s) ({} node(s); {}), run directory {}",
        job().label(&cfg),
        max_world * max_nodes,
        a.nodes.nnodes,
        plan.describe(),
        out.display()
    );
    let policy = RestartPolicy {
        max_restarts: a.max_restarts,
    };
    let boundary = Boundary {
        checkpoint_every: cfg.checkpoint.every,
        total_steps: cfg.train.steps,
    };
    // Several nodes: one store for the job's life (node 0's), and this node's agent in it.
    let shared_store = if several {
        Some(job_store(&a.nodes, &env)?)
    } else {
        None
    };
    let mut coordinator: Box<dyn supervise::Coordinator> = match &shared_store {
        Some(st) => {
            let settings = agent::AgentSettings {
                node: a.nodes.node_rank,
                min_nodes,
                max_nodes,
                nproc: max_world,
                max_restarts: a.max_restarts,
                heartbeat_timeout,
                join_timeout: agent::JOIN_TIMEOUT,
                boundary,
                checkpoint_dir: lockstep_train::checkpoint_dir(&cfg, &out),
            };
            match agent::NodeAgent::join(
                resolve_rdzv(&st.store)?,
                &st.secret,
                &st.job_id,
                settings,
            )? {
                agent::Joined::Member(agent) => agent,
                agent::Joined::JobOver => {
                    eprintln!(
                        "lockstep: the job ended before node {} was admitted; nothing to do",
                        a.nodes.node_rank
                    );
                    return Ok(());
                }
            }
        }
        None => Box::new(elastic::LocalCoordinator::new(
            policy,
            (min_world, max_world),
            faults.clone(),
            boundary,
        )),
    };
    // The workers' config, written only now: a node other than 0 gets here after joining node
    // 0's store, which node 0 serves only once it has checked the run directory — so in a run
    // directory shared by all nodes, no other node's write can make node 0 refuse it as a run.
    // The replaced run (--overwrite) is removed only now, when nothing is left to refuse.
    fresh.apply();
    let resolved = out.join("config.toml");
    lockstep_train::write_atomic(
        &resolved,
        cfg.to_run_file(job().config_sections()).as_bytes(),
    )?;
    let mut servers = Vec::new();
    let sup = supervise::run(coordinator.as_mut(), a.max_restarts, |attempt, place| {
        let mut args: Vec<String> = vec![
            "train".into(),
            "--config".into(),
            resolved.display().to_string(),
            "--out".into(),
            out.display().to_string(),
        ];
        if attempt > 0 || a.resume.is_some() {
            args.push("--resume".into());
        }
        let active: Vec<Fault> = faults
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
        let mut spec = match &shared_store {
            Some(st) => {
                let moved = place.store.clone();
                let mut spec = attempt_spec(st, place, &env, args, attempt)?;
                // The store moves to another node if node 0 is lost.
                if let Some(store) = moved {
                    spec.store = store;
                }
                spec
            }
            None => {
                let st = job_store(&a.nodes, &env)?;
                let spec = attempt_spec(&st, place, &env, args, attempt)?;
                servers.push(st.server); // keep each attempt's store alive until it is done
                spec
            }
        };
        if let Some(t) = a.threads_per_worker {
            spec.threads_per_worker = t;
        }
        spec.stall_timeout = Some(stall_timeout);
        Ok(spec)
    });
    let sup = match sup {
        Ok(sup) => sup,
        Err(e) => {
            // Bad input before the first step (a dataset shorter than a batch, a job's model
            // that cannot be built) leaves no half-made run behind: fix it and run again.
            if a.resume.is_none() && writes_run_dir && e.is::<supervise::PermanentFailure>() {
                let ckpt = lockstep_train::checkpoint_dir(&cfg, &out);
                run_dir::remove_unstarted(&out, &ckpt, created_out);
            }
            return Err(e);
        }
    };
    let runs_rank0 = coordinator.runs_rank0();
    drop(coordinator);
    drop(shared_store);
    if runs_rank0 {
        supervise::annotate_summary(&out, &sup)?;
        supervise::write_report(&out, &sup)?;
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
    }
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
