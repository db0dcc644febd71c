//! Node agents: with `--nnodes N` (or `MIN:MAX`) the launcher on every node is an agent of one
//! job; the agents restart the whole job together, drop lost nodes and admit nodes that join.
//!
//! Why: a worker that fails on one node takes its peers on every node down with it (their links
//! close or their collectives time out), but each launcher sees only its own workers. Without
//! agreement, node 0 would blame a casualty, node 1 the cause, and nobody could restart alone.
//!
//! How, over the job's rendezvous store (node 0's agent serves it for the job's whole life; each
//! agent holds its own authenticated connections):
//! 1. Join: each start of a node's agent is a new *incarnation* `c` (`join/{node}` counted up);
//!    it writes `agent/{node}/{c}` (host, workers per node, restart policy, node range) and
//!    heartbeats `hb/{node}/{c}` every [`HEARTBEAT_EVERY`]. Node 0 waits for all MAX nodes (or,
//!    elastic, for MIN and then one heartbeat timeout for the rest), checks that they agree and
//!    writes `agents/verdict` (the disagreement ends every agent with exit status 3 — node 0
//!    last, once each has read it), the first attempt's members `g0/members` and an admission
//!    `admit/{node}/{c}` per member.
//! 2. Attempt `a`: members read `g{a}/members` (node, incarnation, host; sorted by node), which
//!    gives each node its first rank and the world size. The workers meet under the namespace
//!    `g{a}/`. A watcher thread polls `g{a}/failed`, `g{a}/regroup` and the other members'
//!    heartbeats; when one fires it raises the launch's stop flag, so local workers that are still
//!    running — for example waiting in a collective for a peer that will never answer — are
//!    stopped at once rather than at their collective timeout. Node 0's watcher also looks for
//!    agents that joined (a new node, or a new incarnation of a lost one): at the next checkpoint
//!    boundary it posts `g{a}/regroup`.
//! 3. Settle: each agent posts `g{a}/end/{node}` (its local root cause, if its workers failed);
//!    node 0 waits for every live member's report, picks the job's root cause (a signal first,
//!    then bad input, then a lost node, then the first failure by rank), applies the restart
//!    policy ([`rule`]) and the node range, and writes `g{a}/decision`: done, end, or restart
//!    with the next members (lost ones dropped, joiners admitted via `admit/{node}/{c}`), which
//!    every agent follows. An agent left out of the next members ends, naming why.
//! 4. A late agent waits for its admission (or `agents/done`) and starts at that attempt.
//! 5. Node 0 lost: its agent served the store, so every other agent's connection breaks. The
//!    *leader* moves to the lowest-numbered surviving member, which serves a new store at its own
//!    address (same port); the others reconnect there and register again, and the new leader
//!    rules on the attempt: restart without node 0 — rank 0 moves with the leader — if a majority
//!    of the attempt's nodes reached it (else it could be the one cut off, and two jobs must never
//!    write one run) and the checkpoint rank 0 last wrote (the leader publishes rank 0's progress
//!    in `g{a}/progress`) is reachable from it (a shared `--out` or `checkpoint.dir`); otherwise
//!    the job ends by name, to be continued with `--resume` (see docs/src/clusters.md).
//!
//! Every wait has a deadline or ends with the store, and names what it waited for.
//!
//! This file is the agents' input and output (the store, threads, clocks); what the leader rules
//! is pure code in [`ruling`] (a state machine fed with what the store shows, with property
//! tests), and every store key is written down once in `store_keys.rs`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lockstep_comm::JobSecret;
use serde::{Deserialize, Serialize};

use crate::launch::{FailureKind, Outcome, WorkerFailure};
use crate::store_keys as keys;

use crate::supervise::{Boundary, Coordinator, Next, Placement, Ruling};

mod rendezvous;
mod ruling;
use rendezvous::{AgentStore, Generation, Rendezvous};
use ruling::{
    after_leader_loss, Action, CheckpointReach, Decision, EndReport, Event, Failure, LeaderLoss,
    Member, Rules, Settlement,
};

/// How long the agents wait for each other to join (nodes are started by hand or by a scheduler,
/// not at the same instant).
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(300);
/// How often an agent bumps its heartbeat.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);
/// How often a watcher looks at the store during an attempt.
const WATCH_EVERY: Duration = Duration::from_millis(100);

/// What an agent tells the others when it joins; every node must agree on all but `host`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Registration {
    host: String,
    /// The agent's address on its route to the store.
    ip: String,
    nproc: usize,
    max_restarts: usize,
    min_nodes: usize,
    max_nodes: usize,
}

impl Registration {
    /// How `self` (node `n`) differs from node 0's `base`, if it does.
    fn disagreement(&self, n: usize, base: &Registration) -> Option<String> {
        let settings = |r: &Registration| {
            format!(
                "--nproc {} --max-restarts {} --nnodes {}",
                r.nproc,
                r.max_restarts,
                if r.min_nodes == r.max_nodes {
                    r.max_nodes.to_string()
                } else {
                    format!("{}:{}", r.min_nodes, r.max_nodes)
                }
            )
        };
        (settings(self) != settings(base)).then(|| {
            format!(
                "node {n} ({}) runs {} but node 0 ({}) runs {}: every node must use the same",
                self.host,
                settings(self),
                base.host,
                settings(base)
            )
        })
    }
}

/// What a watcher saw by the time it stopped.
#[derive(Debug, Default)]
struct Watched {
    /// Members whose heartbeat stopped.
    silent: Vec<usize>,
    /// The leader: agents waiting to join whose heartbeat moves and whose settings agree.
    joiners: Vec<Member>,
    /// The last step rank 0 had completed, as the leader last published it.
    last_step: u64,
}

struct Watcher {
    done: Arc<AtomicBool>,
    handle: JoinHandle<Watched>,
}

/// Where the agents of a job meet (`--rdzv-backend`).
pub enum Backend {
    /// lockstep's store at `--rdzv HOST:PORT`, served by node 0's agent.
    Builtin(SocketAddr),
    /// An etcd cluster: `--rdzv etcd://h1:2379,h2:2379,...`.
    Etcd(String),
}

/// What a late agent's wait for admission ended with.
enum Admitted {
    /// Admitted at this attempt.
    At(usize),
    JobOver,
    /// Node 0 opened a newer generation of the job's keys (etcd).
    Superseded,
}

/// How a join ended.
enum JoinStep {
    Joined(Joined),
    /// Node 0 opened a newer generation of the job's keys while this agent waited in an older
    /// one (it started before node 0): join again there.
    Superseded,
}

/// What `lockstep train` tells its node's agent.
#[derive(Clone)]
pub struct AgentSettings {
    pub node: usize,
    pub min_nodes: usize,
    pub max_nodes: usize,
    pub nproc: usize,
    pub max_restarts: usize,
    /// A node whose heartbeat has not moved for this long is lost.
    pub heartbeat_timeout: Duration,
    pub join_timeout: Duration,
    /// Where membership may change without recomputing steps.
    pub boundary: Boundary,
    /// Where rank 0 finds checkpoints on this node: a new leader (node 0 lost) must reach them.
    pub checkpoint_dir: std::path::PathBuf,
}

/// This node's agent.
pub struct NodeAgent {
    s: AgentSettings,
    rdzv: Rendezvous,
    client: Box<dyn AgentStore>,
    /// The job's secret and id: the workers' store a leader serves authenticates with them.
    secret: JobSecret,
    job_id: String,
    /// etcd: the job's generations and the one this agent joined (see `rendezvous.rs`).
    generation: Option<(Generation, i64)>,
    me: Member,
    registration: Registration,
    /// The current attempt's members (node 0: also the next one's, once decided).
    members: Vec<Member>,
    first_attempt: usize,
    /// Restarts made so far (the policy's count; the leader applies it).
    restarts: usize,
    /// The node that runs rank 0 — the lowest-numbered member — and rules on each attempt: node
    /// 0, until it is lost. With the builtin store it also serves the store, which moves with it.
    leader: usize,
    /// The store this agent serves: the builtin store after it moved here, or (etcd) the
    /// workers' store while this node leads (node 0's builtin one is `lockstep train`'s).
    server: Option<lockstep_comm::store::StoreServer>,
    heartbeat: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
    watcher: Option<Watcher>,
}

/// Where a joining agent stands.
pub enum Joined {
    /// Take part from this agent's first attempt.
    Member(Box<NodeAgent>),
    /// The job ended before this node was admitted.
    JobOver,
}

impl NodeAgent {
    /// Register with the job's rendezvous; wait for the other agents (node 0) or for the verdict
    /// and this node's admission (the others).
    pub fn join(
        backend: Backend,
        secret: &JobSecret,
        job_id: &str,
        s: AgentSettings,
    ) -> Result<Joined> {
        let url = match backend {
            Backend::Builtin(addr) => {
                let rdzv = Rendezvous::Builtin {
                    addr,
                    secret: secret.clone(),
                    job_id: job_id.to_string(),
                    grace: s.heartbeat_timeout,
                };
                return match Self::join_at(rdzv, None, secret, job_id, s)? {
                    JoinStep::Joined(j) => Ok(j),
                    JoinStep::Superseded => unreachable!("the builtin store has no generations"),
                };
            }
            Backend::Etcd(url) => url,
        };
        let generations = Generation::of(&url, job_id)?;
        loop {
            let g = if s.node == 0 {
                generations.open()?
            } else {
                generations.current(s.join_timeout)?
            };
            let rdzv = generations.rendezvous(g);
            let at = Some((generations.clone(), g));
            if let JoinStep::Joined(j) = Self::join_at(rdzv, at, secret, job_id, s.clone())? {
                return Ok(j);
            }
            eprintln!(
                "lockstep: node 0 opened the job anew in etcd; node {} joins there",
                s.node
            );
        }
    }

    fn join_at(
        rdzv: Rendezvous,
        generation: Option<(Generation, i64)>,
        secret: &JobSecret,
        job_id: &str,
        s: AgentSettings,
    ) -> Result<JoinStep> {
        let mut client = rdzv.connect(s.join_timeout)?;
        let registration = Registration {
            host: crate::worker::hostname(),
            ip: rdzv.local_ip()?.to_string(),
            nproc: s.nproc,
            max_restarts: s.max_restarts,
            min_nodes: s.min_nodes,
            max_nodes: s.max_nodes,
        };
        let incarnation = client.add(&keys::join(s.node), 1)?;
        client.set(
            &keys::registration(s.node, incarnation),
            &serde_json::to_vec(&registration)?,
        )?;
        let me = Member {
            node: s.node,
            incarnation,
            host: registration.host.clone(),
            ip: registration.ip.clone(),
        };
        let mut agent = NodeAgent {
            s,
            rdzv,
            client,
            secret: secret.clone(),
            job_id: job_id.to_string(),
            generation,
            me,
            registration,
            members: Vec::new(),
            first_attempt: 0,
            restarts: 0,
            leader: 0,
            server: None,
            heartbeat: None,
            watcher: None,
        };
        agent.start_heartbeat()?;
        if agent.s.node == 0 {
            agent.gather()?;
            return Ok(JoinStep::Joined(Joined::Member(Box::new(agent))));
        }
        let Some(verdict) = agent.await_verdict()? else {
            return Ok(JoinStep::Superseded);
        };
        if verdict != b"ok" {
            agent.client.add(keys::VERDICT_READ, 1)?;
            return Err(
                crate::request::BadRequest(String::from_utf8_lossy(&verdict).into_owned()).into(),
            );
        }
        // A late agent checks itself against node 0 (which admits only agreeing ones).
        let base = agent.registration_of(0, 1)?;
        if let Some(why) = agent.registration.disagreement(agent.s.node, &base) {
            return Err(crate::request::BadRequest(why).into());
        }
        Ok(match agent.await_admission()? {
            Admitted::At(first) => {
                agent.first_attempt = first;
                JoinStep::Joined(Joined::Member(Box::new(agent)))
            }
            Admitted::JobOver => JoinStep::Joined(Joined::JobOver),
            Admitted::Superseded => JoinStep::Superseded,
        })
    }

    /// Node 0's verdict on the agents' settings; `None` when node 0 opened a newer generation
    /// meanwhile (etcd).
    fn await_verdict(&mut self) -> Result<Option<Vec<u8>>> {
        const WAITING: &str = "waiting for node 0's agent to admit the nodes (start `lockstep train` with the same --nnodes, --rdzv-backend and --rdzv on every node)";
        if self.generation.is_none() {
            let v = self.client.get(keys::VERDICT, self.s.join_timeout);
            return v.context(WAITING).map(Some);
        }
        let started = Instant::now();
        loop {
            if let Some(v) = self.client.try_get(keys::VERDICT)? {
                return Ok(Some(v));
            }
            if self.superseded()? {
                return Ok(None);
            }
            if started.elapsed() >= self.s.join_timeout {
                bail!(
                    "timed out after {:.0}s {WAITING}",
                    self.s.join_timeout.as_secs_f64()
                );
            }
            std::thread::sleep(WATCH_EVERY * 2);
        }
    }

    /// etcd: node 0 opened a newer generation of the job's keys than the one this agent joined.
    fn superseded(&self) -> Result<bool> {
        match &self.generation {
            Some((generations, g)) => generations.moved_past(*g),
            None => Ok(false),
        }
    }

    /// Node 0: wait for the agents, check they agree, and admit the first attempt's members.
    fn gather(&mut self) -> Result<()> {
        let (min, max) = (self.s.min_nodes, self.s.max_nodes);
        let started = Instant::now();
        let mut enough_since: Option<Instant> = None;
        let present = loop {
            let mut present: Vec<(usize, i64)> = Vec::new();
            for n in 0..max {
                let c = self.client.add(&keys::join(n), 0)?;
                if c > 0 {
                    present.push((n, c));
                }
            }
            if present.len() >= min {
                enough_since.get_or_insert_with(Instant::now);
            }
            let last_call_over =
                enough_since.is_some_and(|t| t.elapsed() >= self.s.heartbeat_timeout);
            if present.len() == max || last_call_over {
                break present;
            }
            if started.elapsed() >= self.s.join_timeout {
                let missing: Vec<String> = (0..max)
                    .filter(|n| !present.iter().any(|(p, _)| p == n))
                    .map(|n| format!("node {n}"))
                    .collect();
                bail!(
                    "timed out after {:.0}s waiting for {} to join (start `lockstep train` with the same --nnodes and --rdzv on every node; {} of at least {min} joined)",
                    self.s.join_timeout.as_secs_f64(),
                    missing.join(", "),
                    present.len()
                );
            }
            std::thread::sleep(WATCH_EVERY);
        };
        let mut members = Vec::new();
        let mut verdict = "ok".to_string();
        for &(n, c) in &present {
            let r = self.registration_of(n, c)?;
            if let Some(why) = r.disagreement(n, &self.registration) {
                verdict = why;
                break;
            }
            members.push(Member {
                node: n,
                incarnation: c,
                host: r.host,
                ip: r.ip,
            });
        }
        if verdict == "ok" {
            self.client
                .set(&keys::members(0), &serde_json::to_vec(&members)?)?;
            for m in &members {
                self.client
                    .set(&keys::admission(m.node, m.incarnation), b"0")?;
            }
            self.members = members;
        }
        self.client.set(keys::VERDICT, verdict.as_bytes())?;
        if verdict != "ok" {
            // Node 0 serves the store: it leaves only once every agent has read the verdict
            // (bounded), or the others would see the store close instead of the reason.
            let deadline = Instant::now() + self.s.heartbeat_timeout;
            while self.client.add(keys::VERDICT_READ, 0)? < (present.len() - 1) as i64
                && Instant::now() < deadline
            {
                std::thread::sleep(WATCH_EVERY);
            }
            return Err(crate::request::BadRequest(verdict).into());
        }
        Ok(())
    }

    fn registration_of(&mut self, node: usize, incarnation: i64) -> Result<Registration> {
        let key = keys::registration(node, incarnation);
        let raw = self.client.get(&key, self.s.join_timeout)?;
        serde_json::from_slice(&raw)
            .with_context(|| format!("store key {key}: not an agent registration"))
    }

    /// A node other than 0: wait until node 0 admits this incarnation (the attempt it joins), or
    /// the job ends, or (etcd) node 0 opens a newer generation.
    fn await_admission(&mut self) -> Result<Admitted> {
        let key = keys::admission(self.me.node, self.me.incarnation);
        let mut said = false;
        loop {
            let admitted = self.client.try_get(&key).with_context(|| {
                format!(
                    "{} waiting to be admitted (the job may have ended)",
                    self.store_lost()
                )
            })?;
            if let Some(raw) = admitted {
                let a = String::from_utf8_lossy(&raw)
                    .parse::<usize>()
                    .with_context(|| format!("store key {key}: not an attempt number"))?;
                if said {
                    eprintln!("lockstep: node {} admitted at attempt {a}", self.me.node);
                }
                return Ok(Admitted::At(a));
            }
            if self.client.try_get(keys::DONE)?.is_some() {
                return Ok(Admitted::JobOver);
            }
            if self.superseded()? {
                return Ok(Admitted::Superseded);
            }
            if !said {
                eprintln!(
                    "lockstep: node {} joined a running job; it is admitted at the job's next checkpoint",
                    self.me.node
                );
                said = true;
            }
            std::thread::sleep(WATCH_EVERY * 2);
        }
    }

    fn store_lost(&self) -> String {
        match &self.rdzv {
            Rendezvous::Builtin { addr, .. } => format!(
                "node agent {}: the job's store at {addr} ({}) does not answer",
                self.me.node,
                self.describe_node(self.leader)
            ),
            // The etcd client's error names the cluster and what each member said.
            Rendezvous::Etcd(_) => format!("node agent {}: lost its rendezvous", self.me.node),
        }
    }

    /// Name of node `n` for messages: "node 1 (hostname)".
    fn describe_node(&self, n: usize) -> String {
        ruling::describe_node(&self.members, n)
    }

    fn start_heartbeat(&mut self) -> Result<()> {
        let mut c = self.rdzv.connect(self.s.heartbeat_timeout)?;
        let stop = Arc::new(AtomicBool::new(false));
        let key = keys::heartbeat(self.me.node, self.me.incarnation);
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

    fn stop_heartbeat(&mut self) {
        if let Some((stop, handle)) = self.heartbeat.take() {
            stop.store(true, Ordering::SeqCst);
            let _ = handle.join();
        }
    }

    fn stop_watching(&mut self) -> Watched {
        let Some(w) = self.watcher.take() else {
            return Watched::default();
        };
        w.done.store(true, Ordering::SeqCst);
        w.handle.join().unwrap_or_default()
    }

    fn world(&self, members: &[Member]) -> usize {
        members.len() * self.s.nproc
    }

    /// After this node's workers of `attempt` ended: report, and follow the leader's decision —
    /// or, when the leader and with it the store are gone, move the store.
    fn settle_attempt(&mut self, a: usize, local: Outcome) -> Result<Ruling> {
        let watched = self.stop_watching();
        let seen_step = watched.last_step;
        let decision = match self.report_and_decide(a, &local, watched) {
            Ok(d) => d,
            // Only a broken connection means the store's host is gone (a slow answer does not).
            Err(_) if !self.is_leader() && self.client.is_broken() => {
                eprintln!("lockstep: {}", self.store_lost());
                self.move_store(a, seen_step)?
            }
            Err(e) => return Err(e),
        };
        self.follow(decision, local)
    }

    /// Post this node's end report; the leader decides and publishes; everyone reads the decision.
    fn report_and_decide(
        &mut self,
        a: usize,
        local: &Outcome,
        watched: Watched,
    ) -> Result<Decision> {
        let failure = local.failure.as_ref().map(|f| Failure {
            node: self.me.node,
            rank: f.rank,
            kind: f.kind,
            what: f.what.clone(),
            message: f.message.clone(),
            permanent: f.permanent,
            detection_seconds: f.detection_seconds,
        });
        if failure.is_some() {
            self.client
                .add(&keys::failed(a), 1)
                .with_context(|| self.store_lost())?;
        }
        let mine = EndReport {
            failure,
            stopped: local.stopped_from_outside,
            last_step: local.last_step,
            resumed_from: local.resumed_from,
        };
        self.client
            .set(
                &keys::end_report(a, self.me.node),
                &serde_json::to_vec(&mine)?,
            )
            .with_context(|| self.store_lost())?;
        if self.is_leader() {
            let decision = self.decide(a, mine, watched)?;
            return self.publish(a, decision);
        }
        if self.rdzv.is_etcd() {
            return self.await_decision(a, mine, watched);
        }
        self.read_decision(a)
    }

    /// etcd: the leader's decision on attempt `a` — or, when the leader is lost (its heartbeat
    /// stopped during the attempt or while this node waits), a survivor's ruling in its place.
    fn await_decision(&mut self, a: usize, mine: EndReport, watched: Watched) -> Result<Decision> {
        let deadline = Instant::now() + self.report_deadline();
        let leader = self.leader;
        let incarnation = self.member(leader).map_or(0, |m| m.incarnation);
        let mut beats = Beats::new(self.s.heartbeat_timeout);
        let mut lost_early = watched.silent.contains(&leader);
        loop {
            if let Some(raw) = self.client.try_get(&keys::decision(a))? {
                return parse_decision(&raw);
            }
            lost_early = lost_early
                || beats.silent(self.client.as_mut(), &keys::heartbeat(leader, incarnation));
            if lost_early {
                return self.take_over(a, mine, watched);
            }
            if Instant::now() >= deadline {
                bail!(
                    "timed out after {:.0}s waiting for {}'s decision on attempt {a}",
                    self.report_deadline().as_secs_f64(),
                    self.describe_node(leader)
                );
            }
            std::thread::sleep(WATCH_EVERY);
        }
    }

    /// etcd: the leader of attempt `a` is lost. The lowest-numbered member not known to be lost
    /// rules in its place (if it is lost too, the next one); the first decision written is the
    /// one every agent follows.
    fn take_over(&mut self, a: usize, mine: EndReport, watched: Watched) -> Result<Decision> {
        let deadline = Instant::now() + self.report_deadline();
        let mut lost: Vec<usize> = watched.silent.clone();
        if !lost.contains(&self.leader) {
            lost.push(self.leader);
        }
        eprintln!(
            "lockstep: {} (the leader) is lost; the lowest-numbered survivor rules on attempt {a}",
            self.describe_node(self.leader)
        );
        let mut beats = Beats::new(self.s.heartbeat_timeout);
        loop {
            if let Some(raw) = self.client.try_get(&keys::decision(a))? {
                return parse_decision(&raw);
            }
            let ruler = self
                .members
                .iter()
                .find(|m| !lost.contains(&m.node))
                .cloned();
            let Some(ruler) = ruler else {
                bail!("every member of attempt {a} is lost");
            };
            if ruler.node == self.me.node {
                return self.rule_without_leader(a, mine, lost, watched.last_step);
            }
            if beats.silent(
                self.client.as_mut(),
                &keys::heartbeat(ruler.node, ruler.incarnation),
            ) {
                lost.push(ruler.node);
            }
            if Instant::now() >= deadline {
                bail!(
                    "timed out after {:.0}s waiting for {}'s decision on attempt {a} (the leader was lost)",
                    self.report_deadline().as_secs_f64(),
                    self.describe_node(ruler.node)
                );
            }
            std::thread::sleep(WATCH_EVERY);
        }
    }

    /// etcd: this node rules on attempt `a` in the lost leader's place: the members in `lost`
    /// count as lost; rank 0's checkpoint of `seen_step` must be in this node's reach.
    fn rule_without_leader(
        &mut self,
        a: usize,
        mine: EndReport,
        lost: Vec<usize>,
        seen_step: u64,
    ) -> Result<Decision> {
        let old = self.leader;
        self.leader = self.me.node;
        let settlement = Settlement::new(
            a,
            self.members.clone(),
            self.me.node,
            self.restarts,
            vec![],
            false,
        );
        let mut events: Vec<Event> = lost
            .into_iter()
            .map(|node| Event::Silent { node })
            .collect();
        events.push(Event::Reported {
            node: self.me.node,
            report: mine,
        });
        let mut decision = self.settle_with(a, settlement, events)?;
        // Rank 0's progress is what the lost leader last published.
        decision.last_step = decision.last_step.or(Some(seen_step));
        for c in &mut decision.changes {
            c.step = c.step.or(Some(seen_step));
        }
        let reach = CheckpointReach {
            seen_step,
            every: self.s.boundary.checkpoint_every,
            newest: self.newest_checkpoint(),
            dir: &self.s.checkpoint_dir,
            here: self.describe_node(self.me.node),
            lost: self.describe_node(old),
        };
        let decision = ruling::unless_checkpoint_out_of_reach(decision, &reach);
        self.publish(a, decision)
    }

    /// The newest checkpoint this node can read (0: none).
    fn newest_checkpoint(&self) -> u64 {
        lockstep_train::checkpoint::list(&self.s.checkpoint_dir)
            .ok()
            .and_then(|l| l.iter().map(|(step, _)| *step).max())
            .unwrap_or(0)
    }

    fn member(&self, node: usize) -> Option<&Member> {
        self.members.iter().find(|m| m.node == node)
    }

    /// etcd: where attempt `attempt`'s workers meet — the store its leader serves (this node's,
    /// started on first use, when it leads) and publishes.
    fn workers_store(&mut self, attempt: usize) -> Result<String> {
        let key = keys::workers_store(attempt);
        if self.is_leader() {
            if self.server.is_none() {
                let bind = SocketAddr::new(self.rdzv.local_ip()?, 0);
                let server =
                    lockstep_comm::store::StoreServer::bind(bind, &self.secret, &self.job_id)
                        .with_context(|| format!("serving the workers' store on {bind}"))?;
                self.server = Some(server);
            }
            let addr = self
                .server
                .as_ref()
                .expect("just started")
                .local_addr()
                .to_string();
            self.client.set(&key, addr.as_bytes())?;
            return Ok(addr);
        }
        let raw = self
            .client
            .get(&key, self.report_deadline())
            .with_context(|| {
                format!(
                    "waiting for {} to serve attempt {attempt}'s store",
                    self.describe_node(self.leader)
                )
            })?;
        String::from_utf8(raw).with_context(|| format!("store key {key}: not an address"))
    }

    /// The leader's decision on attempt `a`, once it is posted.
    fn read_decision(&mut self, a: usize) -> Result<Decision> {
        let raw = self
            .client
            .get(&keys::decision(a), self.report_deadline())
            .with_context(|| {
                format!(
                    "waiting for {}'s decision on attempt {a}",
                    self.describe_node(self.leader)
                )
            })?;
        parse_decision(&raw)
    }

    /// The leader: make a decision on attempt `a` known (with the next attempt's members and the
    /// admissions of nodes that join). The first decision written stands: if another agent's
    /// came first (two survivors ruling for a lost leader), that one is returned.
    fn publish(&mut self, a: usize, decision: Decision) -> Result<Decision> {
        if !self
            .client
            .create(&keys::decision(a), &serde_json::to_vec(&decision)?)?
        {
            return self.read_decision(a);
        }
        if decision.next == Next::Restart {
            self.client.set(
                &keys::members(a + 1),
                &serde_json::to_vec(&decision.members)?,
            )?;
            for m in &decision.members {
                if !self.members.iter().any(|x| x == m) {
                    self.client.set(
                        &keys::admission(m.node, m.incarnation),
                        (a + 1).to_string().as_bytes(),
                    )?;
                }
            }
        }
        Ok(decision)
    }

    /// Every agent: the decision as this node's ruling.
    fn follow(&mut self, decision: Decision, local: Outcome) -> Result<Ruling> {
        if decision.next == Next::Restart && !decision.members.contains(&self.me) {
            bail!(
                "{} was dropped from the job by {} (its heartbeat was not seen for {:.1}s); start its agent again to rejoin",
                self.describe_node(self.me.node),
                self.describe_node(self.leader),
                self.s.heartbeat_timeout.as_secs_f64()
            );
        }
        if decision.next == Next::Restart && decision.failure.is_some() {
            self.restarts += 1;
        }
        let mut out = local;
        out.last_step = decision.last_step;
        out.resumed_from = decision.resumed_from;
        out.stopped_from_outside = false;
        out.failure = decision.failure.map(|f| WorkerFailure {
            rank: f.rank,
            // A lost node is named in the message already.
            message: if f.node == self.me.node
                || matches!(f.kind, FailureKind::NodeLost | FailureKind::StoreHostLost)
            {
                f.message
            } else {
                format!("on {}: {}", self.describe_node(f.node), f.message)
            },
            kind: f.kind,
            what: f.what,
            permanent: f.permanent,
            detection_seconds: f.detection_seconds,
        });
        Ok(Ruling {
            outcome: out,
            next: decision.next,
            changes: decision.changes,
        })
    }

    fn is_leader(&self) -> bool {
        self.leader == self.me.node
    }

    /// This node's agent registers (again) in the store it is connected to: a new incarnation,
    /// heartbeating.
    fn register(&mut self) -> Result<()> {
        let c = self.client.add(&keys::join(self.me.node), 1)?;
        self.client.set(
            &keys::registration(self.me.node, c),
            &serde_json::to_vec(&self.registration)?,
        )?;
        self.me.incarnation = c;
        self.stop_heartbeat();
        self.start_heartbeat()
    }

    /// The leader (node 0 at first) was lost during attempt `a`, and with it the store: the
    /// lowest-numbered surviving member serves a new store at its own address (same port) and
    /// rules on the attempt; the others reconnect there and follow. Rank 0 moves with the
    /// leader, so its checkpoints must be reachable from there (the same `--out` or
    /// `checkpoint.dir` on shared storage): if the newest checkpoint rank 0 had reported
    /// (`seen_step`) is not, the new leader ends the job by name instead.
    fn move_store(&mut self, a: usize, seen_step: u64) -> Result<Decision> {
        let old = self.leader;
        let lost = self.describe_node(old);
        let Some(next) = self.members.iter().find(|m| m.node != old).cloned() else {
            bail!("{lost} was lost and no other node is left to serve the job's store");
        };
        let ip: std::net::IpAddr = next
            .ip
            .parse()
            .with_context(|| format!("{}'s address {}", self.describe_node(next.node), next.ip))?;
        let Some(old_addr) = self.rdzv.builtin_addr() else {
            bail!("only the builtin store moves");
        };
        let addr = SocketAddr::new(ip, old_addr.port());
        eprintln!(
            "lockstep: {lost} (the store's host) is lost; the store moves to {} at {addr}",
            self.describe_node(next.node)
        );
        self.leader = next.node;
        self.rdzv.move_to(addr);
        if next.node != self.me.node {
            self.client = self.rdzv.connect(self.report_deadline()).with_context(|| {
                format!(
                    "reaching the job's store, moved to {} at {addr}",
                    self.describe_node(next.node)
                )
            })?;
            self.register()?;
            return self.read_decision(a);
        }
        let server = lockstep_comm::store::StoreServer::bind(addr, &self.secret, &self.job_id)
            .with_context(|| format!("serving the job's store on {addr} after {lost} was lost"))?;
        self.server = Some(server);
        self.client = self.rdzv.connect(self.report_deadline())?;
        self.register()?;
        // The other survivors re-register here; those that do not within the deadline are lost.
        let deadline = Instant::now() + self.report_deadline();
        let survivors: Vec<usize> = self
            .members
            .iter()
            .map(|m| m.node)
            .filter(|&n| n != old)
            .collect();
        let mut present: Vec<Member> = vec![self.me.clone()];
        while Instant::now() < deadline && present.len() < survivors.len() {
            for &n in &survivors {
                if present.iter().any(|m| m.node == n) {
                    continue;
                }
                let c = self.client.add(&keys::join(n), 0)?;
                if c > 0 {
                    let r = self.registration_of(n, c)?;
                    present.push(Member {
                        node: n,
                        incarnation: c,
                        host: r.host,
                        ip: r.ip,
                    });
                }
            }
            std::thread::sleep(WATCH_EVERY);
        }
        present.sort_by_key(|m| m.node);
        let newest_checkpoint = self.newest_checkpoint();
        let loss = LeaderLoss {
            attempt: a,
            members: &self.members,
            old_leader: old,
            me: self.me.node,
            present,
            restarts: self.restarts,
            seen_step,
            checkpoint_every: self.s.boundary.checkpoint_every,
            newest_checkpoint,
            checkpoint_dir: &self.s.checkpoint_dir,
        };
        let decision = after_leader_loss(loss, &self.rules());
        self.publish(a, decision)
    }

    /// How long node 0 waits for the other agents' reports: their workers are being stopped
    /// (SIGTERM, then SIGKILL after 3 s) once a failure is posted.
    fn report_deadline(&self) -> Duration {
        self.s.heartbeat_timeout * 2 + Duration::from_secs(10)
    }

    /// The leader: read the members' reports and heartbeats into the [`Settlement`] until every
    /// member has settled, and return its decision.
    fn decide(&mut self, a: usize, mine: EndReport, watched: Watched) -> Result<Decision> {
        let regroup = self.client.try_get(&keys::regroup(a))?.is_some();
        let leader = self.leader;
        let settlement = Settlement::new(
            a,
            self.members.clone(),
            leader,
            self.restarts,
            watched.joiners,
            regroup,
        );
        // What the watcher saw first: a member silent during the attempt stays lost.
        let mut events: Vec<Event> = watched
            .silent
            .into_iter()
            .map(|node| Event::Silent { node })
            .collect();
        events.push(Event::Reported {
            node: leader,
            report: mine,
        });
        self.settle_with(a, settlement, events)
    }

    /// Feeds `events`, then what the store shows of the members still missing (their end reports,
    /// their heartbeats), into the settlement until it decides.
    fn settle_with(
        &mut self,
        a: usize,
        mut settlement: Settlement,
        mut events: Vec<Event>,
    ) -> Result<Decision> {
        let deadline = Instant::now() + self.report_deadline();
        let rules = self.rules();
        let ruler = self.me.node;
        let mut beats = Beats::new(self.s.heartbeat_timeout);
        loop {
            for event in events.drain(..) {
                let (next, action) = settlement.step(event, &rules);
                settlement = next;
                if let Action::Publish(decision) = action {
                    return Ok(*decision);
                }
            }
            for node in settlement.missing() {
                let m = self.members.iter().find(|m| m.node == node).cloned();
                let Some(m) = m else { continue };
                let key = keys::end_report(a, node);
                if let Some(raw) = self.client.try_get(&key)? {
                    let report = serde_json::from_slice(&raw)
                        .with_context(|| format!("store key {key}: not an end report"))?;
                    events.push(Event::Reported { node, report });
                } else if node != ruler
                    && beats.silent(self.client.as_mut(), &keys::heartbeat(node, m.incarnation))
                {
                    events.push(Event::Silent { node });
                }
            }
            if !events.is_empty() {
                continue;
            }
            if Instant::now() >= deadline {
                let names: Vec<String> = settlement
                    .missing()
                    .iter()
                    .map(|&n| self.describe_node(n))
                    .collect();
                bail!(
                    "timed out after {:.0}s waiting for {} to report on attempt {a}",
                    self.report_deadline().as_secs_f64(),
                    names.join(", ")
                );
            }
            std::thread::sleep(WATCH_EVERY);
        }
    }

    /// The job's settings every ruling applies.
    fn rules(&self) -> Rules {
        Rules {
            nproc: self.s.nproc,
            min_nodes: self.s.min_nodes,
            max_nodes: self.s.max_nodes,
            heartbeat_timeout: self.s.heartbeat_timeout,
            max_restarts: self.s.max_restarts,
        }
    }
}

/// A decision as the store holds it.
fn parse_decision(raw: &[u8]) -> Result<Decision> {
    serde_json::from_slice(raw).context("store key decision: not a decision")
}

impl Coordinator for NodeAgent {
    fn first_attempt(&self) -> usize {
        self.first_attempt
    }

    fn placement(&mut self, attempt: usize) -> Result<Placement> {
        let key = keys::members(attempt);
        let raw = self
            .client
            .get(&key, self.report_deadline())
            .with_context(|| {
                format!(
                    "waiting for {}'s members of attempt {attempt}",
                    self.describe_node(self.leader)
                )
            })?;
        self.members = serde_json::from_slice(&raw)
            .with_context(|| format!("store key {key}: not a member list"))?;
        let Some(i) = self.members.iter().position(|m| *m == self.me) else {
            bail!(
                "{} is not a member of attempt {attempt}",
                self.describe_node(self.me.node)
            );
        };
        // Rank 0 and the ruling go with the lowest-numbered member.
        self.leader = self.members[0].node;
        let store = match self.rdzv.builtin_addr() {
            Some(addr) => addr.to_string(),
            None => self.workers_store(attempt)?,
        };
        Ok(Placement {
            first_rank: i * self.s.nproc,
            nproc: self.s.nproc,
            world: self.world(&self.members),
            store: Some(store),
        })
    }

    fn watch(&mut self, attempt: usize, progress: Arc<AtomicU64>) -> Result<Arc<AtomicBool>> {
        self.stop_watching();
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let c = self.rdzv.connect(self.s.heartbeat_timeout)?;
        let watch = AttemptWatch {
            c,
            attempt,
            me: self.me.node,
            members: self.members.clone(),
            beats: Beats::new(self.s.heartbeat_timeout),
            admit: self.is_leader().then(|| Admission {
                base: self.registration.clone(),
                max_nodes: self.s.max_nodes,
                boundary: self.s.boundary,
                waiting_since: None,
                regroup_posted: false,
            }),
            joiners: Vec::new(),
            progress,
            last_step: 0,
        };
        let (flag, finished) = (stop.clone(), done.clone());
        let handle = std::thread::spawn(move || watch.run(&flag, &finished));
        self.watcher = Some(Watcher { done, handle });
        Ok(stop)
    }

    fn settle(&mut self, attempt: usize, local: Outcome) -> Result<Ruling> {
        self.settle_attempt(attempt, local)
    }

    fn runs_rank0(&self) -> bool {
        self.is_leader()
    }

    fn finish(&mut self) {
        self.stop_watching();
        if self.is_leader() {
            // Agents still waiting to be admitted end quietly rather than at the store's close:
            // they look every 2 × WATCH_EVERY, so the store stays up a little longer than that.
            if self.client.set(keys::DONE, b"1").is_ok() {
                std::thread::sleep(WATCH_EVERY * 5);
            }
        }
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        self.stop_watching();
        self.stop_heartbeat();
    }
}

/// Node 0's part of a watcher: admit agents that joined, at a checkpoint boundary.
struct Admission {
    base: Registration,
    max_nodes: usize,
    boundary: Boundary,
    /// The step rank 0 had completed when new nodes were first seen waiting: they are admitted
    /// at the first checkpoint boundary reached from there. (The watcher polls every
    /// `WATCH_EVERY`, so it may not see the boundary step itself; a boundary passed since counts,
    /// and the few steps after it are recomputed.)
    waiting_since: Option<u64>,
    regroup_posted: bool,
}

/// A watcher thread's state over one attempt.
struct AttemptWatch {
    c: Box<dyn AgentStore>,
    attempt: usize,
    me: usize,
    members: Vec<Member>,
    beats: Beats,
    admit: Option<Admission>,
    joiners: Vec<Member>,
    /// Rank 0's completed steps: published by the leader (`g{a}/progress`), read by the others,
    /// so that a new leader knows which checkpoint it must reach if the store moves.
    progress: Arc<AtomicU64>,
    last_step: u64,
}

impl AttemptWatch {
    fn run(mut self, flag: &AtomicBool, finished: &AtomicBool) -> Watched {
        let a = self.attempt;
        let mut silent = Vec::new();
        while !finished.load(Ordering::SeqCst) {
            std::thread::sleep(WATCH_EVERY);
            // A failure posted by any node, a regroup, a member gone silent, or the store itself
            // gone (node 0 lost): the local workers cannot finish this attempt.
            let posted = |c: &mut dyn AgentStore, key: String| c.try_get(&key).map(|v| v.is_some());
            let stop = match (
                posted(self.c.as_mut(), keys::failed(a)),
                posted(self.c.as_mut(), keys::regroup(a)),
            ) {
                (Ok(f), Ok(r)) => f || r,
                _ => true,
            };
            if !stop {
                for m in self.members.iter().filter(|m| m.node != self.me) {
                    if self
                        .beats
                        .silent(self.c.as_mut(), &keys::heartbeat(m.node, m.incarnation))
                    {
                        silent.push(m.node);
                    }
                }
            }
            if !stop && silent.is_empty() {
                self.share_progress();
                self.look_for_joiners();
            }
            if stop || !silent.is_empty() {
                flag.store(true, Ordering::SeqCst);
                break;
            }
        }
        Watched {
            silent,
            joiners: self.joiners,
            last_step: self.last_step,
        }
    }

    /// The leader publishes rank 0's progress; the others keep the last value they read.
    fn share_progress(&mut self) {
        let key = keys::progress(self.attempt);
        if self.admit.is_some() {
            let step = self.progress.load(Ordering::SeqCst);
            if step != self.last_step && self.c.set(&key, step.to_string().as_bytes()).is_ok() {
                self.last_step = step;
            }
        } else if let Ok(Some(raw)) = self.c.try_get(&key) {
            if let Ok(step) = String::from_utf8_lossy(&raw).parse() {
                self.last_step = step;
            }
        }
    }

    /// Node 0: agents whose newest incarnation is not a member, heartbeats, and agrees; at a
    /// checkpoint boundary, post the regroup that admits them.
    fn look_for_joiners(&mut self) {
        let Some(adm) = self.admit.as_mut() else {
            return;
        };
        let mut joiners = Vec::new();
        for n in 0..adm.max_nodes {
            let Ok(c) = self.c.add(&keys::join(n), 0) else {
                return;
            };
            let current = self
                .members
                .iter()
                .find(|m| m.node == n)
                .map_or(0, |m| m.incarnation);
            if c <= current {
                continue;
            }
            if !self.beats.moving(self.c.as_mut(), &keys::heartbeat(n, c)) {
                continue;
            }
            let Ok(Some(raw)) = self.c.try_get(&keys::registration(n, c)) else {
                continue;
            };
            match serde_json::from_slice::<Registration>(&raw) {
                Ok(r) if r.disagreement(n, &adm.base).is_none() => joiners.push(Member {
                    node: n,
                    incarnation: c,
                    host: r.host,
                    ip: r.ip,
                }),
                // It refuses itself, naming the difference.
                _ => {}
            }
        }
        self.joiners = joiners;
        let new_nodes = self
            .joiners
            .iter()
            .any(|j| !self.members.iter().any(|m| m.node == j.node));
        let step = self.progress.load(Ordering::SeqCst);
        if !new_nodes {
            adm.waiting_since = None;
            return;
        }
        let since = *adm.waiting_since.get_or_insert(step);
        if !adm.regroup_posted && adm.boundary.reached_since(since, step) {
            let names: Vec<String> = self
                .joiners
                .iter()
                .map(|j| format!("node {}", j.node))
                .collect();
            if self
                .c
                .set(&keys::regroup(self.attempt), names.join(", ").as_bytes())
                .is_ok()
            {
                adm.regroup_posted = true;
            }
        }
    }
}

/// Heartbeat counters by key, and when each last moved.
struct Beats {
    last: HashMap<String, (i64, Instant, bool)>,
    timeout: Duration,
}

impl Beats {
    fn new(timeout: Duration) -> Beats {
        Beats {
            last: HashMap::new(),
            timeout,
        }
    }

    /// Read the counter at `key` (`add(0)` reads without changing it); remember when it moved.
    /// Returns (moved since first seen, time since it last moved).
    fn read(&mut self, c: &mut dyn AgentStore, key: &str) -> Option<(bool, Duration)> {
        let v = c.add(key, 0).ok()?;
        let now = Instant::now();
        let e = self.last.entry(key.to_string()).or_insert((v, now, false));
        if v != e.0 {
            *e = (v, now, true);
        }
        Some((e.2, now.duration_since(e.1)))
    }

    /// Has this counter not moved for the timeout? (An unreadable store says nothing here: the
    /// caller notices it on its own requests.)
    fn silent(&mut self, c: &mut dyn AgentStore, key: &str) -> bool {
        self.read(c, key)
            .is_some_and(|(_, since)| since >= self.timeout)
    }

    /// Has this counter moved recently (within the timeout)?
    fn moving(&mut self, c: &mut dyn AgentStore, key: &str) -> bool {
        self.read(c, key)
            .is_some_and(|(moved, since)| moved && since < self.timeout)
    }
}
