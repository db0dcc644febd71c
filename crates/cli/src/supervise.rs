//! Supervision: run the worker group, and when a worker dies, hangs (its peers time out) or is
//! lost, stop the rest and restart the whole group from the last good checkpoint, up to
//! `max_restarts` times.
//!
//! Who decides what follows an attempt is a [`Coordinator`]: this launcher alone on one node
//! ([`crate::elastic::LocalCoordinator`]), or node 0's ruling followed by every node's agent
//! ([`crate::agent::NodeAgent`]). Both apply the same [`rule`]. A coordinator may also change the
//! job's membership between attempts — drop a lost worker slot or node, admit a slot given back
//! or a node that (re)joined — never below the minimum; with reproducible gradients the result is
//! the same bits as the fault-free run at any world size, so every change is only a restart at a
//! checkpoint boundary.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::launch::{self, FailureKind, LaunchSpec, Outcome, WorkerFailure};

/// One failure survived (or not), as recorded in `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct FailureRecord {
    pub attempt: usize,
    pub rank: usize,
    pub world_size: usize,
    /// What happened, typed: `"kind": "killed", "signal": 9` beside the other fields.
    #[serde(flatten)]
    pub kind: FailureKind,
    /// What happened to the worker, e.g. "killed by signal 9 (SIGKILL)".
    pub what: String,
    /// How the launcher learned of it.
    pub detected_by: String,
    /// Seconds from the last progress rank 0 reported to the launcher noticing the failure.
    pub detection_seconds: f64,
    /// Last step rank 0 completed before the failure.
    pub step: Option<u64>,
    /// Step the next attempt resumed from (None: not restarted).
    pub resumed_from: Option<u64>,
    pub steps_recomputed: Option<u64>,
}

/// A change of the job's workers between two attempts (`summary.json`'s `membership`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MembershipChange {
    /// The attempt after which it took effect.
    pub attempt: usize,
    /// "node lost", "node joined", "worker lost" or "worker slot given back".
    pub change: String,
    /// e.g. "node 2 (hostC)" or "rank 3".
    pub who: String,
    pub world_before: usize,
    pub world_after: usize,
    /// Last step rank 0 completed before it.
    pub step: Option<u64>,
    /// Step the next attempt resumed from, and the steps done again.
    pub resumed_from: Option<u64>,
    pub steps_recomputed: Option<u64>,
}

#[derive(Debug, Default, Serialize)]
pub struct Supervision {
    pub restarts: usize,
    pub steps_recomputed: u64,
    pub failures: Vec<FailureRecord>,
    pub membership: Vec<MembershipChange>,
    pub final_world_size: usize,
    pub wall_seconds_total: f64,
}

/// The restart policy, the same on every node.
#[derive(Debug, Clone, Copy)]
pub struct RestartPolicy {
    pub max_restarts: usize,
}

/// Where this node's workers sit in one attempt: ranks `first_rank .. first_rank + nproc` of
/// `world`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub first_rank: usize,
    pub nproc: usize,
    pub world: usize,
    /// The store the workers meet at, when the coordinator says (it moves if node 0 is lost).
    pub store: Option<String>,
}

/// What follows an attempt.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum Next {
    /// The job is complete.
    Done,
    /// Run the next attempt from the newest checkpoint (after a failure, or to change membership).
    Restart,
    /// Give up; `permanent` = bad input (exit status 3).
    End { message: String, permanent: bool },
}

/// A coordinator's account of an attempt: the job-wide outcome (the root cause on whichever node
/// it happened), what follows, and the membership changes that take effect before the next one.
pub struct Ruling {
    pub outcome: Outcome,
    pub next: Next,
    pub changes: Vec<MembershipChange>,
}

/// Who decides an attempt's place and what follows it.
pub trait Coordinator {
    /// The first attempt this node takes part in (a node admitted late starts later).
    fn first_attempt(&self) -> usize {
        0
    }
    /// Where this node's workers sit in `attempt`.
    fn placement(&mut self, attempt: usize) -> Result<Placement>;
    /// Start watching `attempt`, whose launch publishes rank 0's completed steps in `progress`;
    /// the returned flag, raised to stop the local workers, is the launch's `LaunchSpec::stop`.
    fn watch(&mut self, attempt: usize, progress: Arc<AtomicU64>) -> Result<Arc<AtomicBool>>;
    /// After this node's workers of `attempt` ended.
    fn settle(&mut self, attempt: usize, local: Outcome) -> Result<Ruling>;
    /// Does this node run rank 0 (and so write the run's outputs) at the end?
    fn runs_rank0(&self) -> bool {
        true
    }
    /// The job is over (done or given up), whatever this node's part in it.
    fn finish(&mut self) {}
}

/// Is the step rank 0 just completed a checkpoint boundary, where the job can change membership
/// without recomputing anything? (Its checkpoint is on disk before rank 0 reports the step.)
#[derive(Debug, Clone, Copy)]
pub struct Boundary {
    pub checkpoint_every: u64,
    pub total_steps: u64,
}

impl Boundary {
    pub fn at(&self, step: u64) -> bool {
        self.checkpoint_every > 0
            && step > 0
            && step.is_multiple_of(self.checkpoint_every)
            && step < self.total_steps
    }

    /// Whether a boundary lies in `(since, step]` or `step` is one: a poll that missed the
    /// boundary step itself still regroups soon after it (recomputing the steps past it).
    pub fn reached_since(&self, since: u64, step: u64) -> bool {
        if self.at(step) {
            return true;
        }
        let crossed = |e| step / e > since / e;
        step < self.total_steps
            && std::num::NonZeroU64::new(self.checkpoint_every).is_some_and(|e| crossed(e.get()))
    }
}

/// The restart policy applied to an attempt's root cause (`None`: every worker finished, or the
/// attempt was stopped only to regroup). `restarts` is how many were made so far.
pub fn rule(
    policy: RestartPolicy,
    restarts: usize,
    failure: Option<&WorkerFailure>,
    regroup: bool,
) -> Next {
    match failure {
        None if regroup => Next::Restart,
        None => Next::Done,
        Some(f) if f.permanent => Next::End {
            message: format!(
                "{} ({}: not restarting)",
                f.message,
                match f.kind {
                    FailureKind::OutOfMemory { .. } | FailureKind::MemoryCap { .. } => {
                        "out of memory"
                    }
                    _ => "bad input",
                }
            ),
            permanent: true,
        },
        Some(f) if restarts >= policy.max_restarts => Next::End {
            message: format!(
                "{}\ngiving up after {restarts} restart(s) (max_restarts = {})",
                f.message, policy.max_restarts
            ),
            permanent: false,
        },
        Some(_) => Next::Restart,
    }
}

/// A worker failed in a way a restart cannot cure (bad input, a full disk, out of memory): the
/// launcher ends with exit status 3 too.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PermanentFailure(pub String);

/// Run to completion. `make_spec(attempt, placement)` builds each attempt's launch; `coord`
/// decides what follows each attempt (see [`Coordinator`]).
pub fn run(
    coord: &mut dyn Coordinator,
    max_restarts: usize,
    mut make_spec: impl FnMut(usize, Placement) -> Result<LaunchSpec>,
) -> Result<Supervision> {
    let started = Instant::now();
    let mut sup = Supervision::default();
    let mut attempt = coord.first_attempt();
    let ended = loop {
        let place = coord.placement(attempt)?;
        let mut spec = make_spec(attempt, place.clone())?;
        let progress = Arc::new(AtomicU64::new(0));
        spec.progress = Some(progress.clone());
        spec.stop = Some(coord.watch(attempt, progress)?);
        let local = launch::run(&spec)?;
        let Ruling {
            outcome,
            next,
            changes,
        } = coord.settle(attempt, local)?;
        note_resume(&mut sup, attempt, outcome.resumed_from);
        if let Some(failure) = &outcome.failure {
            if matches!(next, Next::Restart) {
                // Ending instead: the final error says it.
                eprintln!("lockstep: {}", failure.message);
            }
            sup.failures.push(FailureRecord {
                attempt,
                rank: failure.rank,
                world_size: place.world,
                what: failure.what.clone(),
                kind: failure.kind,
                detected_by: failure.kind.detected_by().into(),
                detection_seconds: failure.detection_seconds,
                step: outcome.last_step,
                resumed_from: None,
                steps_recomputed: None,
            });
        }
        for c in changes {
            eprintln!(
                "lockstep: {}: {} after step {}; world {} -> {}",
                c.change,
                c.who,
                c.step.map_or("?".into(), |s| s.to_string()),
                c.world_before,
                c.world_after
            );
            sup.membership.push(c);
        }
        match next {
            Next::Done => {
                sup.final_world_size = place.world;
                break Ok(());
            }
            Next::End { message, permanent } => {
                break Err(if permanent {
                    anyhow::Error::new(PermanentFailure(message))
                } else {
                    anyhow::anyhow!(message)
                })
            }
            Next::Restart if outcome.failure.is_some() => {
                sup.restarts += 1;
                eprintln!(
                    "lockstep: restart {}/{max_restarts} from the last good checkpoint",
                    sup.restarts
                );
            }
            Next::Restart => {
                eprintln!("lockstep: regrouping from the checkpoint just written");
            }
        }
        attempt += 1;
    };
    coord.finish();
    sup.wall_seconds_total = started.elapsed().as_secs_f64();
    ended.map(|()| sup)
}

/// The attempt after a failure or a membership change resumed from `from`: fill in the records
/// still waiting for it, and count the steps done again.
fn note_resume(sup: &mut Supervision, attempt: usize, from: Option<u64>) {
    let Some(prev) = attempt.checked_sub(1) else {
        return;
    };
    let from = from.unwrap_or(0);
    let mut recomputed = None;
    for f in sup.failures.iter_mut().filter(|f| f.attempt == prev) {
        f.resumed_from = Some(from);
        f.steps_recomputed = f.step.map(|s| s.saturating_sub(from));
        recomputed = recomputed.or(f.steps_recomputed);
    }
    for c in sup.membership.iter_mut().filter(|c| c.attempt == prev) {
        c.resumed_from = Some(from);
        c.steps_recomputed = c.step.map(|s| s.saturating_sub(from));
        recomputed = recomputed.or(c.steps_recomputed);
    }
    sup.steps_recomputed += recomputed.unwrap_or(0);
}

/// Add the supervision record to the run's `summary.json` (atomically).
pub fn annotate_summary(out: &Path, sup: &Supervision) -> Result<()> {
    let path = out.join("summary.json");
    let text = lockstep_run::read::read_text(&path, lockstep_run::read::SUMMARY_MAX_BYTES)
        .with_context(|| format!("reading {}", path.display()))?;
    let mut v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let obj = v.as_object_mut().context("summary.json is not an object")?;
    obj.insert("restarts".into(), sup.restarts.into());
    obj.insert("steps_recomputed".into(), sup.steps_recomputed.into());
    obj.insert("failures".into(), serde_json::to_value(&sup.failures)?);
    obj.insert("membership".into(), serde_json::to_value(&sup.membership)?);
    obj.insert(
        "wall_seconds_including_restarts".into(),
        sup.wall_seconds_total.into(),
    );
    lockstep_train::write_atomic(&path, (serde_json::to_string_pretty(&v)? + "\n").as_bytes())?;
    Ok(())
}

/// Write `report.md` and `report.html` next to `summary.json` (node 0, after a successful run).
pub fn write_report(out: &Path, sup: &Supervision) -> Result<()> {
    let (summary, records) = crate::scale::load_run(out)?;
    let recovery = lockstep_report::report::Recovery {
        restarts: sup.restarts as u64,
        steps_recomputed: sup.steps_recomputed,
        failures: sup
            .failures
            .iter()
            .map(|f| {
                format!(
                    "attempt {}: rank {} of {} {} at step {}; detected by {} after {:.2}s; resumed from step {}, {} step(s) recomputed",
                    f.attempt,
                    f.rank,
                    f.world_size,
                    f.what,
                    f.step.map_or("?".into(), |s| s.to_string()),
                    f.detected_by,
                    f.detection_seconds,
                    f.resumed_from.map_or("?".into(), |s| s.to_string()),
                    f.steps_recomputed.map_or("?".into(), |s| s.to_string())
                )
            })
            .collect(),
        membership: sup
            .membership
            .iter()
            .map(|c| {
                format!(
                    "after attempt {}: {}: {} at step {}, world {} -> {}; resumed from step {}, {} step(s) recomputed",
                    c.attempt,
                    c.change,
                    c.who,
                    c.step.map_or("?".into(), |s| s.to_string()),
                    c.world_before,
                    c.world_after,
                    c.resumed_from.map_or("?".into(), |s| s.to_string()),
                    c.steps_recomputed.map_or("?".into(), |s| s.to_string())
                )
            })
            .collect(),
    };
    use lockstep_report::report::FailureMark;
    // Every attempt that ended early is a mark on the timeline: by a failure, or to regroup.
    let mut marks: Vec<FailureMark> = sup
        .failures
        .iter()
        .map(|f| FailureMark {
            attempt: f.attempt,
            // A lost node names itself in `what`.
            who: if f.kind.is_node() {
                String::new()
            } else {
                format!("rank {}", f.rank)
            },
            world_size: f.world_size,
            what: f.what.clone(),
            step: f.step,
            resumed_from: f.resumed_from,
        })
        .collect();
    for c in &sup.membership {
        if !marks.iter().any(|m| m.attempt == c.attempt) {
            marks.push(FailureMark {
                attempt: c.attempt,
                who: String::new(),
                world_size: c.world_before,
                what: format!("{}: {}", c.change, c.who),
                step: c.step,
                resumed_from: c.resumed_from,
            });
        }
    }
    let (md, html) =
        lockstep_report::report::render_with_failures(&summary, &records, &recovery, &marks);
    lockstep_train::write_atomic(&out.join("report.md"), md.as_bytes())?;
    lockstep_train::write_atomic(&out.join("report.html"), html.as_bytes())?;
    Ok(())
}
