//! Supervision: run the worker group, and when a worker dies, hangs (its peers time out) or is
//! lost, stop the rest and restart the whole group from the last good checkpoint, up to
//! `max_restarts` times; with several nodes, all nodes together (see `agent.rs`). In elastic mode (`--nproc MIN:MAX`) a lost worker's slot is dropped and
//! the group restarts smaller, never below MIN; with reproducible gradients the result is the same
//! bits as the fault-free run.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use lockstep_train::faults::Fault;
use serde::Serialize;

use crate::agent::NodeAgent;
use crate::launch::{self, LaunchSpec, WorkerFailure};

/// One failure survived (or not), as recorded in `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct FailureRecord {
    pub attempt: usize,
    pub rank: usize,
    pub world_size: usize,
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

#[derive(Debug, Default, Serialize)]
pub struct Supervision {
    pub restarts: usize,
    pub steps_recomputed: u64,
    pub failures: Vec<FailureRecord>,
    pub final_world_size: usize,
    pub wall_seconds_total: f64,
}

pub struct Policy {
    pub max_restarts: usize,
    /// Smallest and largest world size (equal unless elastic).
    pub min_world: usize,
    pub max_world: usize,
    pub faults: Vec<Fault>,
}

/// A worker failed in a way a restart cannot cure (bad input, a full disk, out of memory): the
/// launcher ends with exit status 3 too.
#[derive(Debug, thiserror::Error)]
#[error("{0} (bad input: not restarting)")]
pub struct PermanentFailure(pub String);

fn detected_by(f: &WorkerFailure) -> String {
    if f.what.starts_with("killed by signal") {
        "worker process died (the launcher saw it exit)".into()
    } else if f.what.starts_with("stopped making progress") || f.message.contains("timed out") {
        "collective timeout on a peer (the worker stopped making progress)".into()
    } else if f.message.contains("closed")
        || f.message.contains("gone")
        || f.message.contains("exited")
    {
        "a peer saw its link close".into()
    } else {
        "worker exited with an error".into()
    }
}

/// Run to completion under `policy`. `make_spec(attempt, world)` builds each attempt's launch.
/// With several nodes, `agent` (this node's) makes every attempt job-wide: it stops the local
/// workers when another node fails and turns the local outcome into node 0's decision, so all
/// nodes restart together (the same policy applied to the same root cause).
pub fn run(
    policy: &Policy,
    mut make_spec: impl FnMut(usize, usize) -> Result<LaunchSpec>,
    mut agent: Option<&mut NodeAgent>,
) -> Result<Supervision> {
    let started = Instant::now();
    let mut sup = Supervision::default();
    let mut world = policy.max_world;
    for attempt in 0.. {
        let mut spec = make_spec(attempt, world)?;
        if let Some(agent) = agent.as_deref_mut() {
            spec.stop = Some(agent.watch(attempt)?);
        }
        let outcome = launch::run(&spec)?;
        let outcome = match agent.as_deref_mut() {
            Some(agent) => agent.settle(attempt, outcome)?,
            None => outcome,
        };
        if let Some(prev) = sup.failures.last_mut() {
            if prev.resumed_from.is_none() && attempt > 0 {
                let from = outcome.resumed_from.unwrap_or(0);
                prev.resumed_from = Some(from);
                prev.steps_recomputed = prev.step.map(|s| s.saturating_sub(from));
                sup.steps_recomputed += prev.steps_recomputed.unwrap_or(0);
            }
        }
        let Some(failure) = outcome.failure else {
            sup.final_world_size = world;
            sup.wall_seconds_total = started.elapsed().as_secs_f64();
            return Ok(sup);
        };
        eprintln!("lockstep: {}", failure.message);
        sup.failures.push(FailureRecord {
            attempt,
            rank: failure.rank,
            world_size: world,
            what: failure.what.clone(),
            detected_by: detected_by(&failure),
            detection_seconds: failure.detection_seconds,
            step: outcome.last_step,
            resumed_from: None,
            steps_recomputed: None,
        });
        if failure.permanent {
            return Err(PermanentFailure(failure.message).into());
        }
        if sup.restarts >= policy.max_restarts {
            bail!(
                "{}\ngiving up after {} restart(s) (max_restarts = {})",
                failure.message,
                sup.restarts,
                policy.max_restarts
            );
        }
        // A worker that cannot come back (here: an injected `lose` fault on the first attempt)
        // shrinks an elastic job; a fixed-size job just restarts at the same size.
        let lost = attempt == 0
            && policy
                .faults
                .iter()
                .any(|f| matches!(*f, Fault::Lose { rank, .. } if rank == failure.rank));
        if lost {
            if world > policy.min_world {
                world -= 1;
                eprintln!("lockstep: rank {} cannot come back; continuing elastically with {world} workers", failure.rank);
            } else {
                bail!("{}\nrank {} cannot come back and the job is already at its minimum of {} workers", failure.message, failure.rank, policy.min_world);
            }
        }
        sup.restarts += 1;
        eprintln!(
            "lockstep: restart {}/{} from the last good checkpoint with {world} workers",
            sup.restarts, policy.max_restarts
        );
    }
    unreachable!("the loop returns or fails")
}

/// Add the supervision record to the run's `summary.json` (atomically).
pub fn annotate_summary(out: &Path, sup: &Supervision) -> Result<()> {
    let path = out.join("summary.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let obj = v.as_object_mut().context("summary.json is not an object")?;
    obj.insert("restarts".into(), sup.restarts.into());
    obj.insert("steps_recomputed".into(), sup.steps_recomputed.into());
    obj.insert("failures".into(), serde_json::to_value(&sup.failures)?);
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
    };
    let marks: Vec<lockstep_report::report::FailureMark> = sup
        .failures
        .iter()
        .map(|f| lockstep_report::report::FailureMark {
            attempt: f.attempt,
            rank: f.rank,
            world_size: f.world_size,
            what: f.what.clone(),
            step: f.step,
            resumed_from: f.resumed_from,
        })
        .collect();
    let (md, html) =
        lockstep_report::report::render_with_failures(&summary, &records, &recovery, &marks);
    lockstep_train::write_atomic(&out.join("report.md"), md.as_bytes())?;
    lockstep_train::write_atomic(&out.join("report.html"), html.as_bytes())?;
    Ok(())
}
