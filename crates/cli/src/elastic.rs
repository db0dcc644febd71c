//! One node's coordinator: the launcher alone decides what follows an attempt, for a fixed
//! `--nproc N` or an elastic `--nproc MIN:MAX` world.
//!
//! Elastic: a worker slot that cannot come back (an injected `lose` fault on the first attempt)
//! is dropped and the group restarts smaller, never below MIN. A slot is given back with
//! `kill -USR1 <launcher pid>` (one slot per signal, up to MAX): at the next checkpoint boundary
//! — the step after which a checkpoint was just written — the workers are stopped and the group
//! restarts one larger from that checkpoint, so nothing is recomputed. A slot given back while a
//! failure restart is under way is taken at that restart.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Result;
use lockstep_train::faults::Fault;

use crate::launch::Outcome;
use crate::supervise::{
    rule, Boundary, Coordinator, MembershipChange, Next, Placement, RestartPolicy, Ruling,
};

/// Worker slots given back with SIGUSR1 since the launcher started.
static SLOTS_GIVEN_BACK: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_sigusr1(_: libc::c_int) {
    // Only an atomic add: async-signal-safe.
    SLOTS_GIVEN_BACK.fetch_add(1, Ordering::SeqCst);
}

/// How often the watcher looks for a slot given back at a boundary.
const WATCH_EVERY: Duration = Duration::from_millis(50);

/// The single-node launcher's coordinator.
pub struct LocalCoordinator {
    policy: RestartPolicy,
    min_world: usize,
    max_world: usize,
    world: usize,
    restarts: usize,
    /// Slots given back that the world has already grown by.
    slots_taken: usize,
    faults: Vec<Fault>,
    boundary: Boundary,
    /// Raised by the watcher when it stopped the workers to regrow.
    regrow: Arc<AtomicBool>,
    watcher: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

impl LocalCoordinator {
    pub fn new(
        policy: RestartPolicy,
        (min_world, max_world): (usize, usize),
        faults: Vec<Fault>,
        boundary: Boundary,
    ) -> LocalCoordinator {
        if min_world < max_world {
            // SAFETY: installs a handler that only does an atomic add.
            unsafe {
                libc::signal(
                    libc::SIGUSR1,
                    on_sigusr1 as extern "C" fn(libc::c_int) as libc::sighandler_t,
                );
            }
        }
        LocalCoordinator {
            policy,
            min_world,
            max_world,
            world: max_world,
            restarts: 0,
            slots_taken: 0,
            faults,
            boundary,
            regrow: Arc::new(AtomicBool::new(false)),
            watcher: None,
        }
    }

    /// Slots given back and not yet taken, as far as MAX allows.
    fn slots_waiting(&self) -> usize {
        SLOTS_GIVEN_BACK
            .load(Ordering::SeqCst)
            .saturating_sub(self.slots_taken)
            .min(self.max_world - self.world)
    }

    fn stop_watching(&mut self) {
        if let Some((done, handle)) = self.watcher.take() {
            done.store(true, Ordering::SeqCst);
            let _ = handle.join();
        }
    }
}

impl Coordinator for LocalCoordinator {
    fn placement(&mut self, _attempt: usize) -> Result<Placement> {
        Ok(Placement {
            first_rank: 0,
            nproc: self.world,
            world: self.world,
            store: None,
        })
    }

    fn watch(&mut self, _attempt: usize, progress: Arc<AtomicU64>) -> Result<Arc<AtomicBool>> {
        self.stop_watching();
        let stop = Arc::new(AtomicBool::new(false));
        self.regrow.store(false, Ordering::SeqCst);
        if self.world == self.max_world {
            // Nothing to give back at full size: such a signal is spent.
            self.slots_taken = SLOTS_GIVEN_BACK.load(Ordering::SeqCst);
        } else {
            let done = Arc::new(AtomicBool::new(false));
            let (flag, finished, regrow) = (stop.clone(), done.clone(), self.regrow.clone());
            let (taken, boundary) = (self.slots_taken, self.boundary);
            let handle = std::thread::spawn(move || {
                // The step when a slot was first seen given back: it regrows at the first
                // boundary from there (a poll can miss the boundary step itself).
                let mut since = None;
                while !finished.load(Ordering::SeqCst) {
                    std::thread::sleep(WATCH_EVERY);
                    let step = progress.load(Ordering::SeqCst);
                    if SLOTS_GIVEN_BACK.load(Ordering::SeqCst) <= taken {
                        continue;
                    }
                    if boundary.reached_since(*since.get_or_insert(step), step) {
                        regrow.store(true, Ordering::SeqCst);
                        flag.store(true, Ordering::SeqCst);
                        return;
                    }
                }
            });
            self.watcher = Some((done, handle));
        }
        Ok(stop)
    }

    fn settle(&mut self, attempt: usize, local: Outcome) -> Result<Ruling> {
        self.stop_watching();
        let regroup = local.failure.is_none()
            && local.stopped_from_outside
            && self.regrow.load(Ordering::SeqCst);
        let mut next = rule(self.policy, self.restarts, local.failure.as_ref(), regroup);
        let mut changes = Vec::new();
        let mut change = |what: &str, who: String, before: usize, after: usize| {
            changes.push(MembershipChange {
                attempt,
                change: what.into(),
                who,
                world_before: before,
                world_after: after,
                step: local.last_step,
                resumed_from: None,
                steps_recomputed: None,
            })
        };
        if next == Next::Restart {
            if let Some(f) = &local.failure {
                self.restarts += 1;
                // A worker that cannot come back (an injected `lose` fault on the first attempt)
                // shrinks an elastic job; a fixed-size job just restarts at the same size.
                let lost = attempt == 0
                    && self
                        .faults
                        .iter()
                        .any(|x| matches!(*x, Fault::Lose { rank, .. } if rank == f.rank));
                if lost && self.world > self.min_world {
                    change(
                        "worker lost",
                        format!("rank {}", f.rank),
                        self.world,
                        self.world - 1,
                    );
                    self.world -= 1;
                    eprintln!(
                        "lockstep: rank {} cannot come back; continuing elastically with {} workers",
                        f.rank, self.world
                    );
                } else if lost {
                    next = Next::End {
                        message: format!(
                            "{}\nrank {} cannot come back and the job is already at its minimum of {} workers",
                            f.message, f.rank, self.min_world
                        ),
                        permanent: false,
                    };
                }
            }
        }
        if next == Next::Restart {
            let grow = self.slots_waiting();
            if grow > 0 {
                change(
                    "worker slot given back",
                    format!("{grow} slot(s) (SIGUSR1)"),
                    self.world,
                    self.world + grow,
                );
                self.world += grow;
                self.slots_taken += grow;
            }
        }
        Ok(Ruling {
            outcome: local,
            next,
            changes,
        })
    }

    fn finish(&mut self) {
        self.stop_watching();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::WorkerFailure;

    fn failure(rank: usize) -> WorkerFailure {
        WorkerFailure {
            rank,
            kind: crate::launch::FailureKind::Killed { signal: 9 },
            what: "killed by signal 9 (SIGKILL)".into(),
            message: format!("worker rank {rank} failed"),
            permanent: false,
            detection_seconds: 0.1,
        }
    }

    fn failed(rank: usize, step: u64) -> Outcome {
        Outcome {
            failure: Some(failure(rank)),
            last_step: Some(step),
            ..Outcome::default()
        }
    }

    #[test]
    fn a_lost_slot_shrinks_an_elastic_world_down_to_its_minimum_only() {
        let lose = |rank| Fault::Lose { rank, step: 3 };
        let boundary = Boundary {
            checkpoint_every: 5,
            total_steps: 40,
        };
        let policy = RestartPolicy { max_restarts: 3 };
        let mut c = LocalCoordinator::new(policy, (3, 4), vec![lose(1)], boundary);
        assert_eq!(c.placement(0).unwrap().world, 4);
        let r = c.settle(0, failed(1, 3)).unwrap();
        assert_eq!(r.next, Next::Restart);
        assert_eq!(r.changes.len(), 1);
        assert_eq!(
            (r.changes[0].world_before, r.changes[0].world_after),
            (4, 3)
        );
        assert_eq!(c.placement(1).unwrap().world, 3);
        // A fixed world cannot shrink: the job ends naming the rank.
        let mut c = LocalCoordinator::new(policy, (4, 4), vec![lose(2)], boundary);
        match c.settle(0, failed(2, 3)).unwrap().next {
            Next::End { message, permanent } => {
                assert!(!permanent);
                assert!(message.contains("rank 2 cannot come back"), "{message}");
            }
            other => panic!("expected the end, got {other:?}"),
        }
    }

    #[test]
    fn restarts_stop_at_the_policy_limit() {
        let boundary = Boundary {
            checkpoint_every: 0,
            total_steps: 10,
        };
        let mut c =
            LocalCoordinator::new(RestartPolicy { max_restarts: 1 }, (2, 2), vec![], boundary);
        assert_eq!(c.settle(0, failed(0, 2)).unwrap().next, Next::Restart);
        match c.settle(1, failed(0, 4)).unwrap().next {
            Next::End { message, .. } => assert!(message.contains("giving up after 1 restart")),
            other => panic!("expected the end, got {other:?}"),
        }
        // A finished attempt is done.
        assert_eq!(c.settle(2, Outcome::default()).unwrap().next, Next::Done);
    }

    #[test]
    fn boundaries_are_checkpoint_steps_before_the_last() {
        let b = Boundary {
            checkpoint_every: 10,
            total_steps: 30,
        };
        let at: Vec<u64> = (0..=30).filter(|&s| b.at(s)).collect();
        assert_eq!(at, vec![10, 20]);
        let none = Boundary {
            checkpoint_every: 0,
            total_steps: 30,
        };
        assert!(!(0..=30).any(|s| none.at(s)));
        // A poll that missed step 10 still regroups at 13; none after the last boundary.
        assert!(b.reached_since(7, 13));
        assert!(b.reached_since(10, 10));
        assert!(!b.reached_since(11, 19));
        assert!(b.reached_since(11, 21));
        assert!(!b.reached_since(21, 30));
        assert!(!none.reached_since(5, 25));
    }
}
