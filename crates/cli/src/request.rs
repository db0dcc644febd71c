//! Checks of a `train` request that need no worker: world size against what the transports and
//! the host can hold, injected faults against the world. Each failure is a [`BadRequest`]: exit
//! status 3, nothing spawned, nothing written.

use lockstep_train::TrainConfig;

/// A request that cannot run as given. Bad input: never retried.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

/// Refuse a world no transport can connect, or more workers than this host's memory holds.
/// `local` is the workers started on this host; `nodes` the hosts of the job.
pub fn check_world(cfg: &TrainConfig, local: usize, nodes: usize) -> Result<(), BadRequest> {
    use lockstep_comm::shm::MAX_WORLD;
    let shm_possible = matches!(
        cfg.dist.transport,
        lockstep_train::config::TransportKind::Auto | lockstep_train::config::TransportKind::Shm
    );
    if nodes == 1 && shm_possible && local > MAX_WORLD {
        return Err(BadRequest(format!(
            "--nproc {local}: shared memory connects at most {MAX_WORLD} workers on one host \
             (dist.transport = \"{}\"); use fewer workers or dist.transport = \"tcp\"",
            cfg.dist.transport
        )));
    }
    let per_worker = lockstep_train::limits::memory_estimate(cfg);
    let memory = lockstep_train::limits::host_memory_bytes();
    if per_worker.saturating_mul(local as u128) > memory {
        return Err(BadRequest(format!(
            "--nproc {local}: {local} workers of about {:.2} GiB each do not fit this host's \
             {:.1} GiB of memory",
            per_worker as f64 / (1u64 << 30) as f64,
            memory as f64 / (1u64 << 30) as f64
        )));
    }
    Ok(())
}
