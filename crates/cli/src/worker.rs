//! Worker bootstrap: from a [`WorkerEnv`] to a ready [`Communicator`].
//!
//! 1. connect to the rendezvous store (rank 0 serves it under external engines);
//! 2. publish this process's host identity and pick the transport: shared memory when every rank is
//!    on this host (and `transport` allows it), TCP otherwise;
//! 3. establish the transport mesh and wrap it in a communicator with the job's timeout.

use lockstep_train::config::TransportKind;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use lockstep_comm::shm::{ShmOptions, ShmTransport};
use lockstep_comm::store::{StoreClient, StoreServer};
use lockstep_comm::tcp::{TcpOptions, TcpTransport};
use lockstep_comm::{Communicator, Transport};

use crate::cluster_env::WorkerEnv;

/// A connected worker. Keeps the store (and, on rank 0 under an engine, its server) alive.
pub struct Worker {
    pub comm: Communicator,
    pub host: String,
    /// Held so the store connection (and, on rank 0 under an engine, the server) outlive setup
    /// (none with the MPI transport).
    _store: Option<StoreClient>,
    _server: Option<StoreServer>,
}

/// Identity of "the same machine": hostname, boot id and network namespace. Ranks in different
/// network namespaces (our simulated hosts) must not be taken for neighbours even though they share
/// a kernel and /dev/shm.
pub fn host_identity() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!(
        "{}|{}|{}",
        hostname(),
        read("/proc/sys/kernel/random/boot_id"),
        netns
    )
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

fn resolve(store: &str) -> Result<SocketAddr> {
    store
        .to_socket_addrs()
        .with_context(|| format!("resolving rendezvous address {store}"))?
        .next()
        .with_context(|| format!("rendezvous address {store} resolves to nothing"))
}

/// Workers start at different times (process start-up, dataset loading), so joining gets at least
/// this long even when collectives have a short timeout.
const MIN_SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// `timeout`: for every collective (and for setup, at least [`MIN_SETUP_TIMEOUT`]).
pub fn connect(
    env: WorkerEnv,
    transport: TransportKind,
    timeout: Duration,
    tcp: &TcpOptions,
) -> Result<Worker> {
    if transport == TransportKind::Mpi {
        return connect_mpi(env, timeout);
    }
    if env.store.is_empty() {
        bail!(
            "{} (only dist.transport = \"mpi\" works without a rendezvous store)",
            crate::cluster_env::missing_master_addr(env.engine, env.rank, env.world_size)
        );
    }
    let collective_timeout = timeout;
    let timeout = timeout.max(MIN_SETUP_TIMEOUT);
    let addr = resolve(&env.store)?;
    let server = if env.serve_store {
        let bind: SocketAddr = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), addr.port());
        Some(
            StoreServer::bind(bind, &env.secret, &env.job_id).with_context(|| {
                format!(
                    "rank 0 serving the rendezvous store on port {}",
                    addr.port()
                )
            })?,
        )
    } else {
        None
    };
    let mut store = StoreClient::connect(addr, &env.secret, &env.job_id, timeout)
        .with_context(|| format!("rank {} joining rendezvous at {}", env.rank, env.store))?;
    // Each attempt of a restarted job meets under its own keys and names its links apart.
    let link_id = if env.attempt == 0 {
        env.job_id.clone()
    } else {
        store = store.with_namespace(crate::store_keys::attempt_namespace(env.attempt as usize));
        format!("{}-g{}", env.job_id, env.attempt)
    };

    let me = host_identity();
    store.set(&format!("host/{}", env.rank), me.as_bytes())?;
    let mut same_host = true;
    for r in 0..env.world_size {
        let other = store
            .get(&format!("host/{r}"), timeout)
            .with_context(|| format!("waiting for rank {r} to join"))?;
        same_host &= other == me.as_bytes();
    }
    let use_shm = match transport {
        TransportKind::Shm if !same_host => bail!("dist.transport = \"shm\" but the ranks are on different hosts; use \"tcp\" or \"auto\""),
        TransportKind::Shm => true,
        TransportKind::Tcp => false,
        TransportKind::Auto | TransportKind::Mpi => same_host,
    };
    let t: Arc<dyn Transport> = if use_shm {
        Arc::new(
            // Names keyed by the job secret: nobody without it can take them first.
            ShmTransport::establish_keyed(
                env.rank,
                env.world_size,
                &link_id,
                timeout,
                &ShmOptions::default(),
                &env.secret,
            )
            .context("setting up shared-memory transport")?,
        )
    } else {
        let mut opts = tcp.clone();
        opts.connect_timeout = timeout;
        if opts.advertise_ip.is_none() {
            opts.advertise_ip = Some(store.local_ip()?);
        }
        Arc::new(
            TcpTransport::establish(
                &mut store,
                env.rank,
                env.world_size,
                &env.secret,
                &link_id,
                &opts,
            )
            .context("setting up TCP transport")?,
        )
    };
    let comm = Communicator::new(t, collective_timeout);
    Ok(Worker {
        comm,
        host: hostname(),
        _store: Some(store),
        _server: server,
    })
}

/// The MPI transport: rank and world from MPI itself, no rendezvous store. The launcher's
/// variables must agree with MPI's view (a process not started by mpirun is a world of one).
#[cfg(feature = "mpi")]
fn connect_mpi(env: WorkerEnv, timeout: Duration) -> Result<Worker> {
    let t = lockstep_comm::mpi::MpiTransport::init().context("initialising MPI")?;
    if t.rank() != env.rank || t.world_size() != env.world_size {
        bail!(
            "dist.transport = \"mpi\": MPI says this is rank {} of {}, but {} announced rank {} of {} \
             (start the job with mpirun)",
            t.rank(),
            t.world_size(),
            env.engine.name(),
            env.rank,
            env.world_size
        );
    }
    Ok(Worker {
        comm: Communicator::new(Arc::new(t), timeout),
        host: hostname(),
        _store: None,
        _server: None,
    })
}

#[cfg(not(feature = "mpi"))]
fn connect_mpi(_env: WorkerEnv, _timeout: Duration) -> Result<Worker> {
    bail!("dist.transport = \"mpi\": this lockstep was built without the cargo feature `mpi` (cargo build --release -p lockstep-cli --features mpi)")
}
