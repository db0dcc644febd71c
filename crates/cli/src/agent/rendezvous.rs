//! Where the node agents meet: the pluggable rendezvous behind [`AgentStore`].
//!
//! - `builtin` (the default): lockstep's authenticated store, served by node 0's agent at
//!   `--rdzv HOST:PORT` for the job's life; the workers meet in the same store. If node 0 is lost,
//!   so is the store: the survivors move it by majority (see `mod.rs`).
//! - `etcd` (`--rdzv-backend etcd --rdzv etcd://h1:2379,h2:2379,h3:2379`): the agents meet in an
//!   etcd cluster, which outlives any one host — a write is committed by a majority of its
//!   members, so a host cut off with a minority cannot write, and losing node 0 needs no store
//!   move. Each attempt's leader serves the workers' own store (they still authenticate with the
//!   job's secret) and publishes its address. The agents' keys live under
//!   `/lockstep/{job_id}/{generation}/`: node 0 starts a new generation for every run of the job
//!   (a `--resume` included), so nothing a previous run left behind is mistaken for this one's.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use lockstep_comm::etcd::EtcdClient;
use lockstep_comm::store::StoreClient;
use lockstep_comm::JobSecret;

/// How often a waiting read looks at etcd again.
const POLL_EVERY: Duration = Duration::from_millis(100);

/// The operations the agents need from a rendezvous store (one connection per user: the agent,
/// its heartbeat thread and its watcher each hold their own).
pub(super) trait AgentStore: Send {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<()>;
    /// The value at `key`, waiting for it up to `timeout`.
    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Adds `delta` to the counter at `key` (absent = 0); returns the new value (`0` reads).
    fn add(&mut self, key: &str, delta: i64) -> Result<i64>;
    /// Writes `value` only if `key` is absent; whether this call wrote it. Of several agents
    /// racing to write one key, exactly one does.
    fn create(&mut self, key: &str, value: &[u8]) -> Result<bool>;
    /// The connection broke (the builtin store's host is gone); etcd never says so: a lost
    /// quorum is an error on the next request.
    fn is_broken(&self) -> bool;
}

impl AgentStore for StoreClient {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        Ok(StoreClient::set(self, key, value)?)
    }
    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        Ok(StoreClient::get(self, key, timeout)?)
    }
    fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(StoreClient::try_get(self, key)?)
    }
    fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        Ok(StoreClient::add(self, key, delta)?)
    }
    fn create(&mut self, key: &str, value: &[u8]) -> Result<bool> {
        // The store's counters are atomic: the first to count a claim writes.
        let first = StoreClient::add(self, &format!("{key}#claim"), 1)? == 1;
        if first {
            StoreClient::set(self, key, value)?;
        }
        Ok(first)
    }
    fn is_broken(&self) -> bool {
        StoreClient::is_broken(self)
    }
}

/// One generation of a job's keys in an etcd cluster.
#[derive(Clone)]
pub(super) struct EtcdNamespace {
    client: EtcdClient,
    /// `/lockstep/{job_id}/{generation}/`.
    prefix: String,
}

impl EtcdNamespace {
    fn full(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
}

impl AgentStore for EtcdNamespace {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        Ok(self.client.put(&self.full(key), value)?)
    }
    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let started = Instant::now();
        loop {
            if let Some(v) = self.try_get(key)? {
                return Ok(v);
            }
            if started.elapsed() >= timeout {
                return Err(anyhow!(
                    "timed out after {:.0}s waiting for key {key} in the etcd cluster at {}",
                    timeout.as_secs_f64(),
                    self.client.describe()
                ));
            }
            std::thread::sleep(POLL_EVERY);
        }
    }
    fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.client.get(&self.full(key))?.map(|v| v.value))
    }
    fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        Ok(self.client.add(&self.full(key), delta)?)
    }
    fn create(&mut self, key: &str, value: &[u8]) -> Result<bool> {
        Ok(self.client.put_if_absent(&self.full(key), value)?)
    }
    fn is_broken(&self) -> bool {
        false
    }
}

/// How an agent reaches its job's rendezvous.
#[derive(Clone)]
pub(super) enum Rendezvous {
    /// lockstep's store at `addr`, served by the leader.
    Builtin {
        addr: SocketAddr,
        secret: JobSecret,
        job_id: String,
        /// An answer that takes longer than this means the store's host is gone.
        grace: Duration,
    },
    Etcd(EtcdNamespace),
}

impl Rendezvous {
    /// A new connection (each thread of an agent holds its own).
    pub fn connect(&self, timeout: Duration) -> Result<Box<dyn AgentStore>> {
        match self {
            Rendezvous::Builtin {
                addr,
                secret,
                job_id,
                grace,
            } => {
                let c = StoreClient::connect(*addr, secret, job_id, timeout)
                    .with_context(|| {
                        format!("node agent joining the job's store at {addr} (served by node 0)")
                    })?
                    .with_answer_grace(*grace);
                Ok(Box::new(c))
            }
            Rendezvous::Etcd(ns) => Ok(Box::new(ns.clone())),
        }
    }

    /// This host's address on its route to the rendezvous (where it serves a store if it leads).
    pub fn local_ip(&self) -> Result<IpAddr> {
        let to = match self {
            Rendezvous::Builtin { addr, .. } => *addr,
            Rendezvous::Etcd(ns) => {
                let first = &ns.client.endpoints()[0];
                std::net::ToSocketAddrs::to_socket_addrs(first.as_str())
                    .with_context(|| format!("resolving etcd endpoint {first}"))?
                    .next()
                    .with_context(|| format!("etcd endpoint {first} resolves to nothing"))?
            }
        };
        route_ip(to).with_context(|| format!("finding this host's route to {to}"))
    }

    pub fn is_etcd(&self) -> bool {
        matches!(self, Rendezvous::Etcd(_))
    }

    /// The builtin store's address (`None` for etcd, where each leader serves the workers').
    pub fn builtin_addr(&self) -> Option<SocketAddr> {
        match self {
            Rendezvous::Builtin { addr, .. } => Some(*addr),
            Rendezvous::Etcd(_) => None,
        }
    }

    /// The builtin store moved to `addr` (node 0 was lost).
    pub fn move_to(&mut self, to: SocketAddr) {
        if let Rendezvous::Builtin { addr, .. } = self {
            *addr = to;
        }
    }
}

/// The counter of a job's generations in etcd: node 0 bumps it when it starts; the others read
/// it, and start over when it moves while they wait to be admitted (node 0 started after them).
#[derive(Clone)]
pub(super) struct Generation {
    client: EtcdClient,
    job_id: String,
    key: String,
}

impl Generation {
    pub fn of(url: &str, job_id: &str) -> Result<Generation> {
        let client = EtcdClient::from_url(url).with_context(|| format!("--rdzv {url}"))?;
        Ok(Generation {
            client,
            job_id: job_id.to_string(),
            key: format!("/lockstep/{job_id}/generation"),
        })
    }

    /// The agents' keys of generation `g`: `/lockstep/{job_id}/{g}/`.
    pub fn rendezvous(&self, g: i64) -> Rendezvous {
        Rendezvous::Etcd(EtcdNamespace {
            client: self.client.clone(),
            prefix: format!("/lockstep/{}/{g}/", self.job_id),
        })
    }

    /// Node 0: a new generation.
    pub fn open(&self) -> Result<i64> {
        Ok(self.client.add(&self.key, 1)?)
    }

    /// The newest generation, waiting up to `timeout` for node 0 to open the first.
    pub fn current(&self, timeout: Duration) -> Result<i64> {
        let started = Instant::now();
        loop {
            let g = self.client.add(&self.key, 0)?;
            if g > 0 {
                return Ok(g);
            }
            if started.elapsed() >= timeout {
                return Err(anyhow!(
                    "timed out after {:.0}s waiting for node 0's agent to open the job in the etcd cluster at {} (start `lockstep train` with the same --nnodes, --rdzv-backend and --rdzv on every node)",
                    timeout.as_secs_f64(),
                    self.client.describe()
                ));
            }
            std::thread::sleep(POLL_EVERY * 2);
        }
    }

    /// Whether node 0 opened a newer generation than `g`.
    pub fn moved_past(&self, g: i64) -> Result<bool> {
        Ok(self.client.add(&self.key, 0)? > g)
    }
}

/// The local address of the route to `to` (no packet is sent).
fn route_ip(to: SocketAddr) -> std::io::Result<IpAddr> {
    let bind = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    let s = UdpSocket::bind(bind)?;
    s.connect(to)?;
    Ok(s.local_addr()?.ip())
}
