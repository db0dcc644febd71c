//! The local launcher: start N workers of this job on this host, stream their output with rank
//! prefixes, watch them, and fail loudly (naming the rank and the reason) when any of them fails.
//!
//! Workers are this same executable started as `lockstep worker …`; they learn their place from
//! `LOCKSTEP_*` variables (see `cluster_env`). The launcher of node 0 serves the rendezvous store.
//! Lines a worker prints with the protocol prefix are typed messages (`protocol.rs`), not log:
//! progress is drawn as one status line, steps and resumes counted, bench rows handed back to the
//! caller, and a failing worker's failure record (whom it timed out waiting for, whether a
//! restart can help) used to blame the root cause.

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use lockstep_comm::JobSecret;
use serde::{Deserialize, Serialize};

use crate::memory_cap::{self, MemoryCaps};
use crate::protocol::{FailureRecord, Progress, WorkerMessage};

/// Exit status of a worker that failed on bad input (config, data, checkpoint of another run):
/// restarting cannot help.
pub const EXIT_PERMANENT: i32 = 3;

/// What one launch of the worker group produced.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Bench result rows in arrival order.
    pub results: Vec<serde_json::Value>,
    /// Last step rank 0 reported complete, and the step it resumed from.
    pub last_step: Option<u64>,
    pub resumed_from: Option<u64>,
    /// Set when the group failed.
    pub failure: Option<WorkerFailure>,
    /// The workers were stopped because `LaunchSpec::stop` was set (before any of them failed).
    pub stopped_from_outside: bool,
}

/// What happened to the worker (or node) a failure blames, decided where it was observed — from
/// exit statuses, heartbeats, the workers' typed records and the agents' own state — and never
/// read back from the text of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum FailureKind {
    /// Killed by a signal the launcher had not sent.
    Killed { signal: i32 },
    /// Stopped on bad input, a misbehaving job or a full disk (exit status 3).
    BadInput,
    /// Its heartbeat stopped: the process is frozen.
    Frozen,
    /// Its heartbeat showed no progress outside any collective.
    Idle,
    /// The ranks that failed all timed out waiting for it, and it never exited: hung.
    Hung,
    /// It exited after timing out waiting for `peer`.
    PeerTimedOut { peer: usize },
    /// It exited after the link to `peer` closed.
    PeerGone { peer: usize },
    /// It exited with an error status (`None`: ended abnormally, without one).
    Exited { status: Option<i32> },
    /// Its node's agent stopped heartbeating.
    NodeLost,
    /// Its node served the job's store and stopped answering.
    StoreHostLost,
    /// Its node's agent lost the job's store and stopped its workers.
    StoreLost,
    /// Its allocator failed to find `bytes` (the worker reported it, then aborted): recurs on
    /// every attempt.
    OutOfMemory { bytes: u64 },
    /// The kernel's OOM killer killed it at its `--worker-memory-gib` cap of `limit_bytes` (its
    /// memory cgroup's `oom_kill` count): recurs on every attempt.
    MemoryCap { limit_bytes: u64 },
}

impl FailureKind {
    /// How the launcher learned of it (summary.json's `detected_by`).
    pub fn detected_by(self) -> &'static str {
        match self {
            FailureKind::Killed { .. } => "worker process died (the launcher saw it exit)",
            FailureKind::NodeLost => "its node agent's heartbeat stopped",
            FailureKind::StoreHostLost => "the other agents lost their connection to its store",
            FailureKind::Idle => {
                "its launcher: the worker's heartbeats showed no progress outside any collective"
            }
            FailureKind::Frozen => "its launcher: the worker's heartbeat stopped",
            FailureKind::Hung | FailureKind::PeerTimedOut { .. } => {
                "collective timeout on a peer (the worker stopped making progress)"
            }
            FailureKind::PeerGone { .. } => "a peer saw its link close",
            FailureKind::OutOfMemory { .. } => {
                "the worker reported a failed allocation, then aborted"
            }
            FailureKind::MemoryCap { .. } => {
                "its memory cgroup counted an OOM kill (the kernel enforced --worker-memory-gib)"
            }
            FailureKind::BadInput | FailureKind::Exited { .. } | FailureKind::StoreLost => {
                "worker exited with an error"
            }
        }
    }

    /// A node, not one of its workers, failed (the failure names the node).
    pub fn is_node(self) -> bool {
        matches!(
            self,
            FailureKind::NodeLost | FailureKind::StoreHostLost | FailureKind::StoreLost
        )
    }
}

/// The root cause of a failed launch.
#[derive(Debug, Clone)]
pub struct WorkerFailure {
    pub rank: usize,
    pub kind: FailureKind,
    /// e.g. "killed by signal 9 (SIGKILL)", "exited with status 1".
    pub what: String,
    /// The full message for the user (with the worker's last output).
    pub message: String,
    /// Bad input: do not restart.
    pub permanent: bool,
    /// Seconds from rank 0's last progress to the launcher noticing the failure.
    pub detection_seconds: f64,
}

/// What to start.
pub struct LaunchSpec {
    /// Arguments after `lockstep worker`.
    pub worker_args: Vec<String>,
    /// Workers started here: ranks `first_rank .. first_rank + nproc` of `world`.
    pub nproc: usize,
    pub first_rank: usize,
    pub world: usize,
    /// host:port of the store (served by node 0).
    pub store: String,
    pub secret: JobSecret,
    pub job_id: String,
    /// Compute threads per worker (burn's rayon pool), so N workers don't oversubscribe the cores.
    pub threads_per_worker: usize,
    /// Extra environment for the workers (e.g. test-only options).
    pub extra_env: Vec<(String, String)>,
    /// Which attempt this is (0, then +1 per restart): the workers' `LOCKSTEP_ATTEMPT`.
    pub attempt: u64,
    /// Set by someone else (a node agent that learned of a failure on another node): stop the
    /// workers and return with `Outcome::stopped_from_outside`.
    pub stop: Option<Arc<AtomicBool>>,
    /// A worker whose heartbeat stops, or that reports no progress outside any collective, for
    /// this long is hung: it is killed and blamed (`None`: heartbeats are not judged).
    pub stall_timeout: Option<Duration>,
    /// Where the launch publishes the last step rank 0 completed (its checkpoint, when one was
    /// due, is on disk by then), for whoever decides when to regroup.
    pub progress: Option<Arc<AtomicU64>>,
    /// `--worker-memory-gib` in bytes: each worker in a memory cgroup of its own capped at it.
    pub memory_cap: Option<u64>,
}

/// Default threads per worker: the cores of this host shared among its workers.
pub fn default_threads(nproc: usize) -> usize {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    (cores / nproc.max(1)).max(1)
}

enum Event {
    Line {
        rank: usize,
        stderr: bool,
        line: String,
    },
    Exited {
        rank: usize,
        status: ExitStatus,
    },
}

/// Run the workers to completion. A worker failure is reported in `Outcome::failure` (the other
/// workers are stopped); `Err` is for failures to start at all.
pub fn run(spec: &LaunchSpec) -> Result<Outcome> {
    let (tx, rx) = mpsc::channel::<Event>();
    let (children, caps) = spawn_workers(spec, &tx)?;
    let mut launch = Launch::new(spec, children, caps, tx);
    while launch.running > 0 {
        launch.watch();
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(Event::Line { rank, stderr, line }) => launch.on_line(rank, stderr, line),
            Ok(Event::Exited { rank, status }) => launch.on_exit(rank, status),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // The last lines the workers wrote before they exited.
    while let Ok(ev) = rx.recv_timeout(Duration::from_millis(100)) {
        if let Event::Line { rank, line, .. } = ev {
            launch.on_late_line(rank, line);
        }
    }
    Ok(launch.conclude())
}

/// Starts this node's workers, each with its output pumped into `tx`.
fn spawn_workers(
    spec: &LaunchSpec,
    tx: &mpsc::Sender<Event>,
) -> Result<(Vec<Running>, Option<MemoryCaps>)> {
    let exe = std::env::current_exe().context("locating the lockstep executable")?;
    let mut children: Vec<Running> = Vec::new();
    // Named by job, attempt and first rank: unique even with several nodes on one kernel.
    let label = format!("{}-a{}-r{}", spec.job_id, spec.attempt, spec.first_rank);
    let mut caps = spec
        .memory_cap
        .map(|bytes| MemoryCaps::create(&label, bytes))
        .transpose()?;
    for local in 0..spec.nproc {
        let rank = spec.first_rank + local;
        let mut cmd = Command::new(&exe);
        if let Some(caps) = caps.as_mut() {
            let procs = caps.rank(rank)?;
            // SAFETY: the closure only makes system calls (`join_in_child`).
            unsafe {
                cmd.pre_exec(move || memory_cap::join_in_child(&procs));
            }
        }
        cmd.arg("worker")
            .args(&spec.worker_args)
            .env("LOCKSTEP_RANK", rank.to_string())
            .env("LOCKSTEP_WORLD_SIZE", spec.world.to_string())
            .env("LOCKSTEP_LOCAL_RANK", local.to_string())
            .env("LOCKSTEP_STORE", &spec.store)
            .env("LOCKSTEP_SECRET", spec.secret.to_hex())
            .env("LOCKSTEP_JOB_ID", &spec.job_id)
            .env("LOCKSTEP_ATTEMPT", spec.attempt.to_string())
            .env("RAYON_NUM_THREADS", spec.threads_per_worker.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &spec.extra_env {
            cmd.env(k, v);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut children);
                return Err(e)
                    .with_context(|| format!("starting worker rank {rank} ({})", exe.display()));
            }
        };
        pump(rank, false, child.stdout.take().expect("piped"), tx.clone());
        pump(rank, true, child.stderr.take().expect("piped"), tx.clone());
        children.push(Running {
            rank,
            child,
            exited: false,
        });
    }
    Ok((children, caps))
}

/// One launch of this node's workers while they run: what they said and how they ended.
struct Launch<'a> {
    spec: &'a LaunchSpec,
    world: usize,
    tx: mpsc::Sender<Event>,
    children: Vec<Running>,
    running: usize,
    fancy: bool,
    progress_shown: bool,
    outcome: Outcome,
    last_progress: Instant,
    first_failure_at: Option<Instant>,
    /// Abnormal exits in arrival order. The first one starts a short grace period before the
    /// rest are stopped: a worker that dies takes its peers down with it within milliseconds
    /// (they see the broken link), and the launcher should blame the cause, not the first
    /// casualty it polls.
    failures: Vec<(usize, ExitStatus)>,
    stop_at: Option<Instant>,
    stopped: bool,
    tails: Tails,
    records: Vec<Option<FailureRecord>>,
    /// Per rank: the size of an allocation it reported failed (it aborts next).
    out_of_memory: Vec<Option<u64>>,
    /// The workers' memory cgroups (`--worker-memory-gib`), removed when the launch ends.
    caps: Option<MemoryCaps>,
    /// Per rank: when its last heartbeat arrived, and what it said (waiting, idle seconds).
    beats: Vec<Option<(Instant, bool, f64)>>,
    /// A worker this launcher found hung by its heartbeat (and killed): the root cause.
    hung: Option<(usize, FailureKind, String)>,
}

impl<'a> Launch<'a> {
    fn new(
        spec: &'a LaunchSpec,
        children: Vec<Running>,
        caps: Option<MemoryCaps>,
        tx: mpsc::Sender<Event>,
    ) -> Launch<'a> {
        let world = spec.world;
        Launch {
            spec,
            world,
            tx,
            running: children.len(),
            children,
            fancy: std::io::stderr().is_terminal(),
            progress_shown: false,
            outcome: Outcome::default(),
            last_progress: Instant::now(),
            first_failure_at: None,
            failures: Vec::new(),
            stop_at: None,
            stopped: false,
            tails: Tails::new(world),
            records: vec![None; world],
            out_of_memory: vec![None; world],
            caps,
            beats: vec![None; world],
            hung: None,
        }
    }

    /// Between events: stop the workers when due, notice exits, hung workers and a stop from
    /// outside.
    fn watch(&mut self) {
        if !self.stopped && self.stop_at.is_some_and(|t| Instant::now() >= t) {
            stop_all(&mut self.children);
            self.stopped = true;
        }
        for w in self.children.iter_mut().filter(|w| !w.exited) {
            if let Ok(Some(status)) = w.child.try_wait() {
                w.exited = true;
                let _ = self.tx.send(Event::Exited {
                    rank: w.rank,
                    status,
                });
            }
        }
        let quiet = !self.stopped && self.failures.is_empty();
        if let (Some(limit), true) = (self.spec.stall_timeout, quiet) {
            if let Some((rank, kind, what)) = find_stalled(&self.children, &self.beats, limit) {
                eprintln!("lockstep: worker rank {rank} {what}; stopping it");
                if let Some(w) = self.children.iter_mut().find(|w| w.rank == rank) {
                    let _ = w.child.kill();
                }
                self.hung = Some((rank, kind, what));
                self.first_failure_at.get_or_insert_with(Instant::now);
                self.stop_at = Some(Instant::now());
            }
        }
        // Stopped from outside only while no local worker has failed, and only once every exit
        // seen so far has been handled: a local worker that died first is a root cause to
        // report, not a casualty of the stop.
        if quiet
            && self.running == self.children.iter().filter(|w| !w.exited).count()
            && self
                .spec
                .stop
                .as_ref()
                .is_some_and(|s| s.load(Ordering::SeqCst))
        {
            stop_all(&mut self.children);
            self.stopped = true;
            self.outcome.stopped_from_outside = true;
        }
    }

    fn on_line(&mut self, rank: usize, stderr: bool, line: String) {
        match WorkerMessage::parse(&line) {
            Some(Ok(WorkerMessage::Heartbeat { waiting, idle_secs })) => {
                self.beats[rank % self.world] = Some((Instant::now(), waiting, idle_secs));
            }
            Some(Ok(message)) => {
                let step_done = matches!(message, WorkerMessage::StepDone { .. });
                if let WorkerMessage::Progress(p) = &message {
                    draw_progress(p, self.fancy);
                    self.progress_shown = self.fancy;
                }
                self.handle(message, rank);
                if step_done {
                    self.last_progress = Instant::now();
                    if let (Some(p), Some(step)) = (&self.spec.progress, self.outcome.last_step) {
                        p.store(step, Ordering::SeqCst);
                    }
                }
            }
            parsed => {
                if self.progress_shown {
                    eprint!("\r\x1b[2K");
                }
                // A malformed protocol line is shown as what it is, with the parse error.
                let line = match parsed {
                    Some(Err(e)) => e,
                    _ => line,
                };
                self.tails.push(rank % self.world, &line);
                if stderr {
                    eprintln!("[rank {rank}] {line}");
                } else {
                    println!("[rank {rank}] {line}");
                }
            }
        }
    }

    /// A line that arrived after every worker exited (no progress bar any more).
    fn on_late_line(&mut self, rank: usize, line: String) {
        match WorkerMessage::parse(&line) {
            Some(Ok(WorkerMessage::Progress(_))) => {}
            Some(Ok(message)) => self.handle(message, rank),
            Some(Err(e)) => eprintln!("[rank {rank}] {e}"),
            None => {
                self.tails.push(rank % self.world, &line);
                eprintln!("[rank {rank}] {line}");
            }
        }
    }

    fn on_exit(&mut self, rank: usize, status: ExitStatus) {
        self.running -= 1;
        if !status.success() && !self.stopped {
            self.failures.push((rank, status));
            self.first_failure_at.get_or_insert_with(Instant::now);
            self.stop_at
                .get_or_insert_with(|| Instant::now() + FAILURE_GRACE);
        }
    }

    /// A protocol message from `rank` into the outcome.
    fn handle(&mut self, message: WorkerMessage, rank: usize) {
        let r = rank % self.world;
        match message {
            WorkerMessage::Progress(_) | WorkerMessage::Heartbeat { .. } => {}
            WorkerMessage::StepDone { step } => self.outcome.last_step = Some(step),
            WorkerMessage::Resumed { step } => self.outcome.resumed_from = Some(step),
            WorkerMessage::BenchRow { row } => self.outcome.results.push(row),
            WorkerMessage::Failure(record) => self.records[r] = Some(record),
            WorkerMessage::OutOfMemory { bytes } => self.out_of_memory[r] = Some(bytes),
        }
    }

    /// The outcome, with the root cause of a failure named and described.
    fn conclude(mut self) -> Outcome {
        if self.progress_shown {
            eprintln!();
        }
        let root = self
            .hung
            .take()
            .or_else(|| blame(&self.failures, &self.records));
        let caps = self.caps.as_ref();
        let Some((rank, kind, what)) = root
            .map(|r| with_out_of_memory(r, &self.out_of_memory))
            .map(|r| with_memory_cap(r, caps))
        else {
            return self.outcome;
        };
        // Bad input or a full disk (exit status 3) and running out of memory recur on every
        // attempt: not worth a restart. Judged on the root cause: its peers fail only because
        // it left.
        let bad_input = self
            .failures
            .iter()
            .any(|(r, s)| *r == rank && s.code() == Some(EXIT_PERMANENT));
        let permanent = bad_input
            || matches!(
                kind,
                FailureKind::OutOfMemory { .. } | FailureKind::MemoryCap { .. }
            );
        let message = self.failure_message(rank, &what, bad_input);
        let detected = self.first_failure_at.unwrap_or_else(Instant::now);
        self.outcome.failure = Some(WorkerFailure {
            rank,
            kind,
            what,
            message,
            permanent,
            detection_seconds: detected
                .saturating_duration_since(self.last_progress)
                .as_secs_f64(),
        });
        self.outcome
    }

    /// "worker rank R failed: WHAT; its last output: … (then: the others)".
    fn failure_message(&self, rank: usize, what: &str, bad_input: bool) -> String {
        let mut tail = self.tails.last(rank % self.world).join("\n    ");
        if tail.is_empty() || bad_input {
            // A worker stopped by bad input reports it only in its typed record (its launcher
            // says it once, here), after whatever it printed before.
            if let Some(r) = self.records.get(rank % self.world).and_then(Option::as_ref) {
                let error = format!("lockstep: error: {}", r.message);
                tail = if tail.is_empty() {
                    error
                } else {
                    format!("{tail}\n    {error}")
                };
            }
        }
        let others: Vec<String> = self
            .failures
            .iter()
            .filter(|(r, _)| *r != rank)
            .map(|(r, s)| format!("rank {r} {}", describe(*s)))
            .collect();
        format!(
            "worker rank {rank} failed: {what}{}{}",
            if tail.is_empty() {
                String::new()
            } else {
                format!("; its last output:\n    {tail}")
            },
            if others.is_empty() {
                String::new()
            } else {
                format!("\n  (then: {})", others.join(", "))
            }
        )
    }
}

/// What each worker printed last (for the failure message).
struct Tails {
    last: Vec<Vec<String>>,
}

impl Tails {
    /// Lines kept per worker for the failure message.
    const KEEP: usize = 5;

    fn new(world: usize) -> Tails {
        Tails {
            last: vec![Vec::new(); world],
        }
    }

    fn push(&mut self, rank: usize, line: &str) {
        let keep = &mut self.last[rank];
        keep.push(line.to_string());
        if keep.len() > Self::KEEP {
            keep.remove(0);
        }
    }

    fn last(&self, rank: usize) -> &[String] {
        &self.last[rank]
    }
}

/// The root cause as out of memory when it is: it reported a failed allocation, then aborted
/// (SIGABRT). A reported failure the program survived (`try_reserve`) is no abort, and an abort
/// without a report is an ordinary crash.
fn with_out_of_memory(
    (rank, kind, what): (usize, FailureKind, String),
    reported: &[Option<u64>],
) -> (usize, FailureKind, String) {
    match (kind, reported[rank % reported.len()]) {
        (FailureKind::Killed { signal }, Some(bytes)) if signal == libc::SIGABRT => (
            rank,
            FailureKind::OutOfMemory { bytes },
            format!("ran out of memory (an allocation of {bytes} bytes failed) and aborted"),
        ),
        _ => (rank, kind, what),
    }
}

/// A root cause killed by SIGKILL whose memory cgroup counted an OOM kill: the kernel enforced
/// its `--worker-memory-gib` cap.
fn with_memory_cap(
    (rank, kind, what): (usize, FailureKind, String),
    caps: Option<&MemoryCaps>,
) -> (usize, FailureKind, String) {
    match (kind, caps) {
        (FailureKind::Killed { signal }, Some(caps))
            if signal == libc::SIGKILL && caps.oom_killed(rank) =>
        {
            let limit_bytes = caps.limit_bytes();
            (
                rank,
                FailureKind::MemoryCap { limit_bytes },
                format!(
                    "killed by the kernel's OOM killer at its memory cap of {:.3} GiB \
                     (--worker-memory-gib)",
                    limit_bytes as f64 / (1u64 << 30) as f64
                ),
            )
        }
        _ => (rank, kind, what),
    }
}

/// The first live worker that is hung by its heartbeats: none for `limit` (a frozen process), or
/// the last one says it is outside any communication operation and has not moved for `limit`.
/// Workers that have not sent a first heartbeat yet (starting up) are not judged.
fn find_stalled(
    children: &[Running],
    beats: &[Option<(Instant, bool, f64)>],
    limit: Duration,
) -> Option<(usize, FailureKind, String)> {
    let now = Instant::now();
    children.iter().filter(|w| !w.exited).find_map(|w| {
        let (at, waiting, idle) = beats[w.rank % beats.len()]?;
        let silent = now.duration_since(at);
        if silent >= limit {
            Some((
                w.rank,
                FailureKind::Frozen,
                format!(
                    "sent no heartbeat for {:.1}s (frozen)",
                    silent.as_secs_f64()
                ),
            ))
        } else if !waiting && idle + silent.as_secs_f64() >= limit.as_secs_f64() {
            Some((
                w.rank,
                FailureKind::Idle,
                format!(
                    "stopped making progress outside any collective for {:.1}s (its heartbeat)",
                    idle + silent.as_secs_f64()
                ),
            ))
        } else {
            None
        }
    })
}

/// How long after the first abnormal exit the launcher waits for the others before stopping them.
const FAILURE_GRACE: Duration = Duration::from_millis(500);

/// Which rank to blame, and what happened to it: a worker killed by a signal (the launcher had
/// sent none yet) over workers that exited with an error; then a worker that exited on bad input
/// (status 3) over the peers that lost it; among the rest, a rank that the failed
/// workers all timed out *waiting for* but that never exited itself is hung, and is the cause;
/// otherwise the first to exit.
fn blame(
    failures: &[(usize, ExitStatus)],
    records: &[Option<FailureRecord>],
) -> Option<(usize, FailureKind, String)> {
    use std::os::unix::process::ExitStatusExt;
    let blamed = |rank: usize, status: ExitStatus| {
        (
            rank,
            kind_of(status, records.get(rank).and_then(Option::as_ref)),
            describe(status),
        )
    };
    if let Some((rank, status)) = failures.iter().find(|(_, s)| s.signal().is_some()) {
        return Some(blamed(*rank, *status));
    }
    // A worker that stopped on bad input failed by itself, whoever noticed its absence first;
    // of several, the lowest rank (its message does not depend on which exited first).
    if let Some((rank, status)) = failures
        .iter()
        .filter(|(_, s)| s.code() == Some(EXIT_PERMANENT))
        .min_by_key(|(r, _)| *r)
    {
        return Some(blamed(*rank, *status));
    }
    let waited_for: Vec<usize> = failures
        .iter()
        .filter_map(|(r, _)| records.get(*r)?.as_ref()?.waited_for)
        .collect();
    if let Some(&hung) = waited_for.first() {
        if waited_for.iter().all(|&r| r == hung) && !failures.iter().any(|(r, _)| *r == hung) {
            let who: Vec<String> = failures.iter().map(|(r, _)| r.to_string()).collect();
            return Some((
                hung,
                FailureKind::Hung,
                format!(
                    "stopped making progress (ranks {} timed out waiting for it)",
                    who.join(", ")
                ),
            ));
        }
    }
    failures.first().map(|(r, s)| blamed(*r, *s))
}

/// What an exit `status` (and the worker's typed `record`, when it wrote one) says happened.
fn kind_of(status: ExitStatus, record: Option<&FailureRecord>) -> FailureKind {
    use std::os::unix::process::ExitStatusExt;
    if let Some(signal) = status.signal() {
        return FailureKind::Killed { signal };
    }
    if status.code() == Some(EXIT_PERMANENT) {
        return FailureKind::BadInput;
    }
    match record {
        Some(FailureRecord {
            waited_for: Some(peer),
            ..
        }) => FailureKind::PeerTimedOut { peer: *peer },
        Some(FailureRecord {
            lost_peer: Some(peer),
            ..
        }) => FailureKind::PeerGone { peer: *peer },
        _ => FailureKind::Exited {
            status: status.code(),
        },
    }
}

struct Running {
    rank: usize,
    child: Child,
    /// Its exit has been turned into an `Event::Exited`.
    exited: bool,
}

fn pump(
    rank: usize,
    stderr: bool,
    stream: impl std::io::Read + Send + 'static,
    tx: mpsc::Sender<Event>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if tx.send(Event::Line { rank, stderr, line }).is_err() {
                break;
            }
        }
    });
}

/// SIGTERM every live worker, give them a moment, then SIGKILL.
fn stop_all(children: &mut [Running]) {
    for w in children.iter().filter(|w| !w.exited) {
        if let Ok(pid) = i32::try_from(w.child.id()) {
            // SAFETY: plain syscall on a pid we spawned and have not reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    for w in children.iter_mut().filter(|w| !w.exited) {
        while Instant::now() < deadline {
            if let Ok(Some(_)) = w.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = w.child.kill();
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!(
            "killed by signal {s}{}",
            if s == 9 {
                " (SIGKILL)"
            } else if s == 15 {
                " (SIGTERM)"
            } else {
                ""
            }
        ),
        _ => "ended abnormally".into(),
    }
}

fn draw_progress(p: &Progress, fancy: bool) {
    let width = 30usize;
    let filled = if p.total_steps == 0 {
        width
    } else {
        (p.step as usize * width) / p.total_steps as usize
    };
    let bar: String = "#".repeat(filled) + &"-".repeat(width - filled.min(width));
    let text = format!(
        "[{bar}] step {}/{}  loss {:.4}  {:.0} samples/s  ETA {:.0}s",
        p.step, p.total_steps, p.loss, p.samples_per_sec, p.eta_seconds
    );
    let mut err = std::io::stderr().lock();
    if fancy {
        let _ = write!(err, "\r\x1b[2K{text}");
    } else {
        let _ = writeln!(err, "{text}");
    }
    let _ = err.flush();
}

/// Default run directory: `runs/<unix seconds>`.
pub fn default_out_dir() -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    PathBuf::from("runs").join(format!("run-{secs}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn exited(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }

    /// Out of memory takes both the typed report and the abort after it.
    #[test]
    fn out_of_memory_needs_the_report_and_the_abort() {
        let killed = |signal| (1, FailureKind::Killed { signal }, String::from("killed"));
        let reported = [None, Some(1u64 << 45)];
        let (_, kind, what) = with_out_of_memory(killed(libc::SIGABRT), &reported);
        assert_eq!(kind, FailureKind::OutOfMemory { bytes: 1 << 45 });
        assert!(
            what.contains("an allocation of 35184372088832 bytes failed"),
            "{what}"
        );
        // Killed by something else after a report it survived; an abort without a report.
        let (_, kind, _) = with_out_of_memory(killed(libc::SIGKILL), &reported);
        assert_eq!(
            kind,
            FailureKind::Killed {
                signal: libc::SIGKILL
            }
        );
        let (_, kind, _) = with_out_of_memory(killed(libc::SIGABRT), &[None, None]);
        assert_eq!(
            kind,
            FailureKind::Killed {
                signal: libc::SIGABRT
            }
        );
        let exited = (1, FailureKind::Exited { status: Some(1) }, String::new());
        let (_, kind, _) = with_out_of_memory(exited, &reported);
        assert_eq!(kind, FailureKind::Exited { status: Some(1) });
    }

    #[test]
    fn a_worker_that_stopped_on_bad_input_is_blamed_over_the_peer_that_noticed_first() {
        let lines = vec![None, None];
        let failures = [(0, exited(1)), (1, exited(EXIT_PERMANENT))];
        assert_eq!(blame(&failures, &lines).map(|b| b.0), Some(1));
        // Without one, the first to exit.
        let failures = [(0, exited(1)), (1, exited(1))];
        assert_eq!(blame(&failures, &lines).map(|b| b.0), Some(0));
        // Everyone that failed timed out waiting for the same rank, which never exited: it hung.
        let waiting = |peer| {
            Some(FailureRecord {
                waited_for: Some(peer),
                lost_peer: None,
                permanent: false,
                message: String::new(),
            })
        };
        let records = vec![waiting(1), None, waiting(1)];
        let failures = [(0, exited(1)), (2, exited(1))];
        let (rank, kind, what) = blame(&failures, &records).unwrap();
        assert_eq!((rank, kind), (1, FailureKind::Hung));
        assert!(what.contains("stopped making progress (ranks 0, 2 timed out waiting for it)"));
        // A signal still wins: the worker was killed.
        let failures = [(1, exited(EXIT_PERMANENT)), (0, ExitStatus::from_raw(9))];
        let (rank, kind, _) = blame(&failures, &lines).unwrap();
        assert_eq!((rank, kind), (0, FailureKind::Killed { signal: 9 }));
        // Bad input, and a peer's typed record: a timeout waiting, a link closed.
        let failures = [(0, exited(1)), (1, exited(EXIT_PERMANENT))];
        assert_eq!(blame(&failures, &lines).unwrap().1, FailureKind::BadInput);
        let gone = Some(FailureRecord {
            waited_for: None,
            lost_peer: Some(2),
            permanent: false,
            message: "recv: connection closed by peer".into(),
        });
        let failures = [(0, exited(1))];
        assert_eq!(
            blame(&failures, &[gone]).unwrap().1,
            FailureKind::PeerGone { peer: 2 }
        );
        // (Rank 3 exited too, so it did not hang: rank 0 timed out on a peer that failed.)
        let both = [(0, exited(1)), (3, exited(1))];
        assert_eq!(
            blame(&both, &[waiting(3), None, None, None]).unwrap(),
            (
                0,
                FailureKind::PeerTimedOut { peer: 3 },
                "exited with status 1".into()
            )
        );
        assert_eq!(
            blame(&failures, &[None]).unwrap().1,
            FailureKind::Exited { status: Some(1) }
        );
    }
}
