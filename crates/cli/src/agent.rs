//! Node agents: with `--nnodes N > 1` the launcher on every node is an agent of one job, and the
//! agents restart the whole job together.
//!
//! Why: a worker that fails on one node takes its peers on every node down with it (their links
//! close or their collectives time out), but each launcher sees only its own workers. Without
//! agreement, node 0 would blame a casualty, node 1 the cause, and nobody could restart alone.
//!
//! How, over the job's rendezvous store (node 0's agent serves it for the job's whole life; each
//! agent holds its own authenticated connections):
//! 1. Join: each agent writes `agent/{node}` (host, workers per node, max restarts) and waits for
//!    all N; node 0 checks that they agree and writes `agents/verdict` (ok, or the disagreement,
//!    which ends every agent with exit status 3 — node 0 last, once each has read it).
//! 2. Heartbeat: a thread per agent bumps `hb/{node}` every [`HEARTBEAT_EVERY`].
//! 3. Attempt `a`: the workers meet under the namespace `g{a}/`. A watcher thread polls
//!    `g{a}/failed` and the other agents' heartbeats; when a failure is posted (or a node's
//!    heartbeat stops for the heartbeat timeout) it raises the launch's stop flag, so local
//!    workers that are still running — for example waiting in a collective for a peer that will
//!    never answer — are stopped at once rather than at their collective timeout.
//! 4. Settle: each agent posts `g{a}/end/{node}` (its local root cause, if its workers failed);
//!    node 0 waits for every live node's report, picks the job's root cause (a signal first, then
//!    bad input, then the first failure by rank) and writes `g{a}/decision`, which every agent
//!    follows: done, restart (attempt a + 1 with `--resume`), or stop. All agents apply the same
//!    restart policy to the same decision, so they restart together or end together.
//!
//! Every wait has a deadline and names what it waited for (a node that never joined, never
//! reported, or whose heartbeat stopped). Node 0 hosts the store: if node 0 is lost, the other
//! agents lose their store connection and end naming it; the job is then continued with
//! `--resume` (its checkpoints are node 0's).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lockstep_comm::store::StoreClient;
use lockstep_comm::JobSecret;
use serde::{Deserialize, Serialize};

use crate::launch::{Outcome, WorkerFailure};

/// How long the agents wait for each other to join (nodes are started by hand or by a scheduler,
/// not at the same instant).
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(300);
/// How often an agent bumps its heartbeat.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);
/// How often a watcher looks at the store during an attempt.
const WATCH_EVERY: Duration = Duration::from_millis(100);

/// What an agent tells the others when it joins.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Registration {
    host: String,
    nproc: usize,
    max_restarts: usize,
}

/// One node's account of an attempt.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct EndReport {
    /// The local root cause, if its workers failed by themselves.
    failure: Option<Failure>,
    /// Node 0 only: the last step rank 0 completed and the step it resumed from.
    last_step: Option<u64>,
    resumed_from: Option<u64>,
}

/// A [`WorkerFailure`] as it travels between agents.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Failure {
    node: usize,
    rank: usize,
    what: String,
    message: String,
    permanent: bool,
    detection_seconds: f64,
}

/// Node 0's ruling on an attempt, followed by every agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Decision {
    /// The job's root cause; `None` = every node finished.
    failure: Option<Failure>,
    /// Nodes whose heartbeat stopped (they cannot take part in a restart).
    lost: Vec<usize>,
    last_step: Option<u64>,
    resumed_from: Option<u64>,
}

/// This node's agent.
pub struct NodeAgent {
    node: usize,
    nnodes: usize,
    addr: SocketAddr,
    secret: JobSecret,
    job_id: String,
    client: StoreClient,
    hosts: Vec<String>,
    /// A node whose heartbeat has not moved for this long is lost.
    heartbeat_timeout: Duration,
    heartbeat: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
    watcher: Option<Watcher>,
}

struct Watcher {
    done: Arc<AtomicBool>,
    /// The node whose heartbeat it saw stop, if that is why it raised the flag.
    handle: JoinHandle<Option<usize>>,
}

/// An agent's connection to the job's store; an answer that takes longer than `grace` means the
/// store's host (node 0) is gone.
fn connect(
    addr: SocketAddr,
    secret: &JobSecret,
    job_id: &str,
    timeout: Duration,
    grace: Duration,
) -> Result<StoreClient> {
    Ok(StoreClient::connect(addr, secret, job_id, timeout)
        .with_context(|| {
            format!("node agent joining the job's store at {addr} (served by node 0)")
        })?
        .with_answer_grace(grace))
}

impl NodeAgent {
    /// Register with the job's store and wait (up to `join_timeout`) for every node's agent.
    #[allow(clippy::too_many_arguments)]
    pub fn join(
        addr: SocketAddr,
        secret: &JobSecret,
        job_id: &str,
        node: usize,
        nnodes: usize,
        nproc: usize,
        max_restarts: usize,
        heartbeat_timeout: Duration,
        join_timeout: Duration,
    ) -> Result<NodeAgent> {
        let mut client = connect(addr, secret, job_id, join_timeout, heartbeat_timeout)?;
        let me = Registration {
            host: crate::worker::hostname(),
            nproc,
            max_restarts,
        };
        client.set(&format!("agent/{node}"), &serde_json::to_vec(&me)?)?;
        let keys: Vec<String> = (0..nnodes).map(|n| format!("agent/{n}")).collect();
        client
            .wait_all(&keys, join_timeout)
            .context("waiting for every node's agent to join (start `lockstep train` with the same --nnodes and --rdzv on every node)")?;
        let mut regs = Vec::with_capacity(nnodes);
        for k in &keys {
            let raw = client.get(k, join_timeout)?;
            regs.push(
                serde_json::from_slice::<Registration>(&raw)
                    .with_context(|| format!("store key {k}: not an agent registration"))?,
            );
        }
        if node == 0 {
            let verdict = match regs.iter().enumerate().find(|(_, r)| {
                r.nproc != regs[0].nproc || r.max_restarts != regs[0].max_restarts
            }) {
                Some((n, r)) => format!(
                    "node {n} ({}) runs --nproc {} --max-restarts {} but node 0 ({}) runs --nproc {} --max-restarts {}: every node must use the same",
                    r.host, r.nproc, r.max_restarts, regs[0].host, regs[0].nproc, regs[0].max_restarts
                ),
                None => "ok".into(),
            };
            client.set("agents/verdict", verdict.as_bytes())?;
        }
        let verdict = client.get("agents/verdict", join_timeout)?;
        if verdict != b"ok" {
            // Node 0 serves the store: it leaves only once every agent has read the verdict
            // (bounded), or the others would see the store close instead of the reason.
            if node == 0 {
                let deadline = Instant::now() + heartbeat_timeout;
                while client.add("agents/verdict-read", 0)? < (nnodes - 1) as i64
                    && Instant::now() < deadline
                {
                    std::thread::sleep(WATCH_EVERY);
                }
            } else {
                client.add("agents/verdict-read", 1)?;
            }
            return Err(
                crate::request::BadRequest(String::from_utf8_lossy(&verdict).into_owned()).into(),
            );
        }
        let mut agent = NodeAgent {
            node,
            nnodes,
            addr,
            secret: secret.clone(),
            job_id: job_id.to_string(),
            client,
            hosts: regs.into_iter().map(|r| r.host).collect(),
            heartbeat_timeout,
            heartbeat: None,
            watcher: None,
        };
        agent.start_heartbeat()?;
        Ok(agent)
    }

    fn store_lost(&self) -> String {
        format!(
            "node agent {}: the job's store at {} ({}) does not answer",
            self.node,
            self.addr,
            self.describe_node(0)
        )
    }

    /// Name of node `n` for messages: "node 1 (hostname)".
    pub fn describe_node(&self, n: usize) -> String {
        format!(
            "node {n} ({})",
            self.hosts.get(n).map_or("?", |h| h.as_str())
        )
    }

    /// One more connection to the job's store for a thread of this agent (a client serves one
    /// caller at a time).
    fn connection(&self) -> Result<StoreClient> {
        connect(
            self.addr,
            &self.secret,
            &self.job_id,
            self.heartbeat_timeout,
            self.heartbeat_timeout,
        )
    }

    fn start_heartbeat(&mut self) -> Result<()> {
        let mut c = self.connection()?;
        let stop = Arc::new(AtomicBool::new(false));
        let key = format!("hb/{}", self.node);
        c.add(&key, 1)?;
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                std::thread::sleep(HEARTBEAT_EVERY);
                // A failed beat is not fatal here: the store is node 0's, and losing it shows up
                // in the agent's own next request with the reason.
                if c.add(&key, 1).is_err() {
                    return;
                }
            }
        });
        self.heartbeat = Some((stop, handle));
        Ok(())
    }

    /// Start watching attempt `attempt`: the returned flag is raised when another node posts a
    /// failure or a node's heartbeat stops. Give it to the attempt's `LaunchSpec::stop`.
    pub fn watch(&mut self, attempt: usize) -> Result<Arc<AtomicBool>> {
        self.stop_watching();
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let mut c = self.connection()?;
        let (flag, finished) = (stop.clone(), done.clone());
        let (node, nnodes, timeout) = (self.node, self.nnodes, self.heartbeat_timeout);
        let failed_key = format!("g{attempt}/failed");
        let handle = std::thread::spawn(move || {
            let mut beats = HeartbeatWatch::new(nnodes, node, timeout);
            while !finished.load(Ordering::SeqCst) {
                std::thread::sleep(WATCH_EVERY);
                // A failure posted by any node, a node gone silent, or the store itself gone
                // (node 0 lost): the local workers cannot finish this attempt.
                let (stop, lost) = match c.try_get(&failed_key) {
                    Ok(Some(_)) => (true, None),
                    Ok(None) => match beats.poll(&mut c) {
                        Some(n) => (true, Some(n)),
                        None => (false, None),
                    },
                    Err(_) => (true, None),
                };
                if stop {
                    flag.store(true, Ordering::SeqCst);
                    return lost;
                }
            }
            None
        });
        self.watcher = Some(Watcher { done, handle });
        Ok(stop)
    }

    /// Stop the watcher; the node it found silent, if any.
    fn stop_watching(&mut self) -> Option<usize> {
        let w = self.watcher.take()?;
        w.done.store(true, Ordering::SeqCst);
        w.handle.join().ok().flatten()
    }

    /// After this node's workers of `attempt` ended: report, and return the job-wide outcome
    /// decided by node 0 (the root cause on whichever node it happened).
    pub fn settle(&mut self, attempt: usize, local: Outcome) -> Result<Outcome> {
        let silent = self.stop_watching();
        let a = attempt;
        let failure = local.failure.as_ref().map(|f| Failure {
            node: self.node,
            rank: f.rank,
            what: f.what.clone(),
            message: f.message.clone(),
            permanent: f.permanent,
            detection_seconds: f.detection_seconds,
        });
        if failure.is_some() {
            self.client
                .add(&format!("g{a}/failed"), 1)
                .with_context(|| self.store_lost())?;
        }
        let mine = EndReport {
            failure,
            last_step: local.last_step,
            resumed_from: local.resumed_from,
        };
        self.client
            .set(
                &format!("g{a}/end/{}", self.node),
                &serde_json::to_vec(&mine)?,
            )
            .with_context(|| self.store_lost())?;
        if self.node == 0 {
            let decision = self.decide(a, mine, silent)?;
            self.client
                .set(&format!("g{a}/decision"), &serde_json::to_vec(&decision)?)?;
        }
        let raw = self
            .client
            .get(&format!("g{a}/decision"), self.report_deadline())
            .with_context(|| {
                format!(
                    "waiting for {}'s decision on attempt {a}",
                    self.describe_node(0)
                )
            })?;
        let decision: Decision =
            serde_json::from_slice(&raw).context("store key decision: not a decision")?;
        let mut out = local;
        out.last_step = decision.last_step;
        out.resumed_from = decision.resumed_from;
        out.stopped_from_outside = false;
        out.failure = decision.failure.map(|f| WorkerFailure {
            rank: f.rank,
            what: f.what,
            message: if f.node == self.node {
                f.message
            } else {
                format!("on {}: {}", self.describe_node(f.node), f.message)
            },
            permanent: f.permanent,
            detection_seconds: f.detection_seconds,
        });
        if !decision.lost.is_empty() {
            let names: Vec<String> = decision
                .lost
                .iter()
                .map(|&n| self.describe_node(n))
                .collect();
            bail!(
                "{} lost (no heartbeat for {:.1}s); the job cannot restart without it — continue with --resume once it is back",
                names.join(", "),
                self.heartbeat_timeout.as_secs_f64()
            );
        }
        Ok(out)
    }

    /// How long node 0 waits for the other agents' reports: their workers are being stopped
    /// (SIGTERM, then SIGKILL after 3 s) once a failure is posted.
    fn report_deadline(&self) -> Duration {
        self.heartbeat_timeout * 2 + Duration::from_secs(10)
    }

    /// Node 0: wait for every live node's report and pick the job's root cause.
    fn decide(&mut self, a: usize, mine: EndReport, silent: Option<usize>) -> Result<Decision> {
        let deadline = Instant::now() + self.report_deadline();
        let mut reports: Vec<Option<EndReport>> = vec![None; self.nnodes];
        reports[0] = Some(mine);
        let mut beats = HeartbeatWatch::new(self.nnodes, 0, self.heartbeat_timeout);
        let mut lost: Vec<usize> = silent.into_iter().collect();
        loop {
            for (n, report) in reports.iter_mut().enumerate().skip(1) {
                if report.is_none() {
                    if let Some(raw) = self.client.try_get(&format!("g{a}/end/{n}"))? {
                        *report = Some(serde_json::from_slice(&raw).with_context(|| {
                            format!("store key g{a}/end/{n}: not an end report")
                        })?);
                    }
                }
            }
            if let Some(n) = beats.poll(&mut self.client) {
                if reports[n].is_none() && !lost.contains(&n) {
                    lost.push(n);
                }
            }
            let missing: Vec<usize> = (0..self.nnodes)
                .filter(|n| reports[*n].is_none() && !lost.contains(n))
                .collect();
            if missing.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                let names: Vec<String> = missing.iter().map(|&n| self.describe_node(n)).collect();
                bail!(
                    "timed out after {:.0}s waiting for {} to report on attempt {a}",
                    self.report_deadline().as_secs_f64(),
                    names.join(", ")
                );
            }
            std::thread::sleep(WATCH_EVERY);
        }
        let failures: Vec<Failure> = reports
            .iter()
            .flatten()
            .filter_map(|r| r.failure.clone())
            .collect();
        let root = failures
            .iter()
            .find(|f| f.what.starts_with("killed by signal"))
            .or_else(|| failures.iter().find(|f| f.permanent))
            .or_else(|| failures.iter().min_by_key(|f| f.rank))
            .cloned();
        let root = root.or_else(|| {
            lost.first().map(|&n| Failure {
                node: n,
                rank: n, // no rank of its own: the node is named in `what`
                what: format!("{} lost (no heartbeat)", self.describe_node(n)),
                message: format!(
                    "{} stopped heartbeating for {:.1}s",
                    self.describe_node(n),
                    self.heartbeat_timeout.as_secs_f64()
                ),
                permanent: false,
                detection_seconds: self.heartbeat_timeout.as_secs_f64(),
            })
        });
        let node0 = reports[0].as_ref().expect("node 0's own report");
        Ok(Decision {
            failure: root,
            lost,
            last_step: node0.last_step,
            resumed_from: node0.resumed_from,
        })
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        self.stop_watching();
        if let Some((stop, handle)) = self.heartbeat.take() {
            stop.store(true, Ordering::SeqCst);
            let _ = handle.join();
        }
    }
}

/// The other nodes' heartbeat counters, and when each last moved.
struct HeartbeatWatch {
    last: Vec<(i64, Instant)>,
    me: usize,
    timeout: Duration,
}

impl HeartbeatWatch {
    fn new(nnodes: usize, me: usize, timeout: Duration) -> HeartbeatWatch {
        HeartbeatWatch {
            last: vec![(i64::MIN, Instant::now()); nnodes],
            me,
            timeout,
        }
    }

    /// Read every other node's counter; the first node whose counter has not moved for the
    /// timeout, if any.
    fn poll(&mut self, c: &mut StoreClient) -> Option<usize> {
        let now = Instant::now();
        for n in 0..self.last.len() {
            if n == self.me {
                continue;
            }
            // `add(0)` reads a counter without changing it.
            let Ok(v) = c.add(&format!("hb/{n}"), 0) else {
                return None;
            };
            if v != self.last[n].0 {
                self.last[n] = (v, now);
            } else if now.duration_since(self.last[n].1) >= self.timeout {
                return Some(n);
            }
        }
        None
    }
}
