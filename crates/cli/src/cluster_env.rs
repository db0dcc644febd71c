//! Who am I in the job? Detects how this process was started and derives rank, world size and the
//! rendezvous address.
//!
//! Sources, first match wins:
//! 1. `lockstep` launcher: `LOCKSTEP_RANK`, `LOCKSTEP_WORLD_SIZE`, `LOCKSTEP_LOCAL_RANK`,
//!    `LOCKSTEP_STORE` (host:port), `LOCKSTEP_SECRET`, `LOCKSTEP_JOB_ID`, `LOCKSTEP_ATTEMPT`.
//! 2. Slurm (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_JOB_ID`.
//! 3. OpenMPI (`mpirun`): `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`.
//! 4. torchrun style: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`.
//!
//! For 2–4 the store is served by rank 0 at `MASTER_ADDR:MASTER_PORT` (default port 29500), and the
//! per-job secret comes from `LOCKSTEP_SECRET` or the file named by `LOCKSTEP_SECRET_FILE` (an
//! unauthenticated job is never started: make one with `lockstep secret`).
//! Invariant: this module and main.rs are the only readers of the environment.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};
use lockstep_comm::JobSecret;
use sha2::Digest;

/// How the process was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Launcher,
    Slurm,
    OpenMpi,
    Torchrun,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Launcher => "lockstep launcher",
            Engine::Slurm => "Slurm",
            Engine::OpenMpi => "OpenMPI mpirun",
            Engine::Torchrun => "torchrun-style environment",
        }
    }
}

/// This worker's place in the job.
#[derive(Debug, Clone)]
pub struct WorkerEnv {
    pub engine: Engine,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    /// Rendezvous store address (host:port); empty under mpirun without `MASTER_ADDR` (only the
    /// MPI transport works then).
    pub store: String,
    /// True when this process must serve the store itself (rank 0 under an external engine).
    pub serve_store: bool,
    pub secret: JobSecret,
    pub job_id: String,
    /// The launcher's attempt (`LOCKSTEP_ATTEMPT`: 0 first, +1 per restart; always 0 under an
    /// external engine). The workers of attempt `a > 0` meet under the store namespace `g{a}/`
    /// and name their links `{job_id}-g{a}`, so nothing of an earlier attempt is ever mistaken
    /// for theirs on a store that outlives attempts (the node agents').
    pub attempt: u64,
}

/// Detect the engine from `env`; `None` when the process was started by none of them. A
/// malformed or incomplete engine environment is bad input ([`crate::request::BadRequest`]:
/// exit status 3, never restarted).
pub fn detect(env: &HashMap<String, String>) -> Result<Option<WorkerEnv>> {
    detect_engine(env).map_err(|e| crate::request::BadRequest(format!("{e:#}")).into())
}

fn detect_engine(env: &HashMap<String, String>) -> Result<Option<WorkerEnv>> {
    let get = |k: &str| {
        env.get(k)
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    let num = |k: &str| -> Result<Option<usize>> {
        get(k)
            .map(|v| {
                v.parse::<usize>().with_context(|| {
                    format!("environment variable {k}={v} is not a non-negative integer")
                })
            })
            .transpose()
    };

    if let Some(rank) = num("LOCKSTEP_RANK")? {
        let world = num("LOCKSTEP_WORLD_SIZE")?
            .ok_or_else(|| anyhow!("LOCKSTEP_RANK is set but LOCKSTEP_WORLD_SIZE is not"))?;
        let store = get("LOCKSTEP_STORE")
            .ok_or_else(|| anyhow!("LOCKSTEP_RANK is set but LOCKSTEP_STORE is not"))?;
        let secret = secret_from(env)?
            .ok_or_else(|| anyhow!("LOCKSTEP_RANK is set but LOCKSTEP_SECRET is not"))?;
        let job_id = get("LOCKSTEP_JOB_ID").unwrap_or_else(|| job_id_from_secret(&secret));
        let attempt = num("LOCKSTEP_ATTEMPT")?.unwrap_or(0) as u64;
        return finish(
            Engine::Launcher,
            rank,
            world,
            num("LOCKSTEP_LOCAL_RANK")?.unwrap_or(0),
            store,
            false,
            secret,
            job_id,
        )
        .map(|w| w.map(|w| WorkerEnv { attempt, ..w }));
    }

    let found = if let (Some(r), Some(w)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
        Some((
            Engine::Slurm,
            r,
            w,
            num("SLURM_LOCALID")?.unwrap_or(0),
            get("SLURM_JOB_ID"),
        ))
    } else if let (Some(r), Some(w)) = (num("OMPI_COMM_WORLD_RANK")?, num("OMPI_COMM_WORLD_SIZE")?)
    {
        Some((
            Engine::OpenMpi,
            r,
            w,
            num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0),
            get("OMPI_MCA_ess_base_jobid"),
        ))
    } else if let (Some(r), Some(w)) = (num("RANK")?, num("WORLD_SIZE")?) {
        Some((
            Engine::Torchrun,
            r,
            w,
            num("LOCAL_RANK")?.unwrap_or(0),
            get("TORCHELASTIC_RUN_ID"),
        ))
    } else {
        None
    };
    let Some((engine, rank, world, local_rank, engine_job)) = found else {
        return Ok(None);
    };
    // Under mpirun the MPI transport (dist.transport = "mpi") needs no store: MASTER_ADDR may be
    // missing there, and `worker::connect` asks for it when another transport needs the store.
    let addr = match get("MASTER_ADDR") {
        Some(a) => a,
        None if engine == Engine::OpenMpi => String::new(),
        None => bail!("{}", missing_master_addr(engine, rank, world)),
    };
    let port = match get("MASTER_PORT") {
        Some(p) => p
            .parse::<u16>()
            .with_context(|| format!("MASTER_PORT={p} is not a port number"))?,
        None => 29500,
    };
    let secret = secret_from(env)?.ok_or_else(|| {
        anyhow!(
            "started by {} but no job secret: export LOCKSTEP_SECRET (64 hex digits, e.g. from `lockstep secret`) or LOCKSTEP_SECRET_FILE on every rank",
            engine.name()
        )
    })?;
    let job_id = get("LOCKSTEP_JOB_ID")
        .or(engine_job.map(|j| sanitize_job_id(&j)))
        .unwrap_or_else(|| job_id_from_secret(&secret));
    let store = if addr.is_empty() {
        String::new()
    } else if addr.contains(':') && !addr.starts_with('[') {
        format!("[{addr}]:{port}")
    } else {
        format!("{addr}:{port}")
    };
    let serve_store = rank == 0 && !store.is_empty();
    finish(
        engine,
        rank,
        world,
        local_rank,
        store,
        serve_store,
        secret,
        job_id,
    )
}

/// The error for a rendezvous without `MASTER_ADDR`.
pub fn missing_master_addr(engine: Engine, rank: usize, world: usize) -> String {
    format!(
        "started by {} (rank {rank} of {world}) but MASTER_ADDR is not set: export MASTER_ADDR \
         (the host of rank 0) and optionally MASTER_PORT",
        engine.name()
    )
}

#[allow(clippy::too_many_arguments)]
fn finish(
    engine: Engine,
    rank: usize,
    world_size: usize,
    local_rank: usize,
    store: String,
    serve_store: bool,
    secret: JobSecret,
    job_id: String,
) -> Result<Option<WorkerEnv>> {
    if world_size == 0 {
        bail!("{}: world size is 0", engine.name());
    }
    if rank >= world_size {
        bail!(
            "{}: rank {rank} is not below the world size {world_size}",
            engine.name()
        );
    }
    Ok(Some(WorkerEnv {
        engine,
        rank,
        world_size,
        local_rank,
        store,
        serve_store,
        secret,
        job_id,
        attempt: 0,
    }))
}

fn secret_from(env: &HashMap<String, String>) -> Result<Option<JobSecret>> {
    if let Some(hex) = env.get("LOCKSTEP_SECRET").filter(|s| !s.trim().is_empty()) {
        return Ok(Some(JobSecret::from_hex(hex).context("LOCKSTEP_SECRET")?));
    }
    if let Some(path) = env
        .get("LOCKSTEP_SECRET_FILE")
        .filter(|s| !s.trim().is_empty())
    {
        // A secret is 64 hex digits: a file of more than a page is not one.
        let text = lockstep_run::read::read_text(std::path::Path::new(path), 4096)
            .with_context(|| format!("reading LOCKSTEP_SECRET_FILE {path}"))?;
        return Ok(Some(
            JobSecret::from_hex(&text).with_context(|| format!("secret in {path}"))?,
        ));
    }
    Ok(None)
}

/// A job id all ranks agree on without talking: a hash of the secret (not reversible to it).
pub fn job_id_from_secret(secret: &JobSecret) -> String {
    let digest =
        sha2::Sha256::digest([b"lockstep-job-id|".as_slice(), secret.to_hex().as_bytes()].concat());
    hex::encode(&digest[..6])
}

fn sanitize_job_id(raw: &str) -> String {
    raw.chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .take(32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
    const SECRET: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    #[test]
    fn plain_process_is_not_a_worker() {
        assert!(detect(&env(&[("HOME", "/root")])).unwrap().is_none());
    }

    #[test]
    fn torchrun_variables() {
        let w = detect(&env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "1234"),
            ("LOCKSTEP_SECRET", SECRET),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (w.engine, w.rank, w.world_size, w.local_rank),
            (Engine::Torchrun, 3, 4, 1)
        );
        assert_eq!(w.store, "10.1.2.3:1234");
        assert!(!w.serve_store);
        assert_eq!(w.job_id.len(), 12);
    }

    #[test]
    fn slurm_wins_over_torchrun_and_rank0_serves() {
        let w = detect(&env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_JOB_ID", "4711"),
            ("RANK", "5"),
            ("WORLD_SIZE", "6"),
            ("MASTER_ADDR", "node01"),
            ("LOCKSTEP_SECRET", SECRET),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((w.engine, w.rank, w.world_size), (Engine::Slurm, 0, 8));
        assert!(w.serve_store);
        assert_eq!(w.store, "node01:29500");
        assert_eq!(w.job_id, "4711");
    }

    #[test]
    fn openmpi_variables() {
        let w = detect(&env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("LOCKSTEP_SECRET", SECRET),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (w.engine, w.rank, w.world_size, w.local_rank),
            (Engine::OpenMpi, 1, 2, 1)
        );
    }

    #[test]
    fn mpirun_without_master_addr_has_no_store() {
        // Only the MPI transport works then; worker::connect asks for MASTER_ADDR otherwise.
        let w = detect(&env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("LOCKSTEP_SECRET", SECRET),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((w.engine, w.rank, w.world_size), (Engine::OpenMpi, 0, 3));
        assert!(w.store.is_empty());
        assert!(!w.serve_store, "nothing to serve without an address");
    }

    #[test]
    fn errors_name_the_variable() {
        let e = detect(&env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCKSTEP_SECRET", SECRET),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        let e = detect(&env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("LOCKSTEP_SECRET"), "{e}");
        let e = detect(&env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("RANK=x"), "{e}");
        let e = detect(&env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("LOCKSTEP_SECRET", SECRET),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("rank 2"), "{e}");
        let e = detect(&env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("LOCKSTEP_SECRET", "nothex"),
        ]))
        .unwrap_err();
        assert!(format!("{e:#}").contains("LOCKSTEP_SECRET"), "{e:#}");
        assert!(
            !format!("{e:#}").contains("nothex"),
            "the secret's value must not be echoed: {e:#}"
        );
    }
}
