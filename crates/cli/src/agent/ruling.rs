//! The leader's rulings, as pure code: no store, no clock, no threads. The agent (`mod.rs`) reads
//! the store and turns what it finds into [`Event`]s; [`Settlement::step`] says what to do next;
//! when every member of the attempt has settled it hands back the [`Decision`] to publish.
//! [`after_leader_loss`] is the ruling of a survivor that takes over the store. Both are tested
//! with properties over interleaved, duplicate and late events (at the end of this file).
//!
//! The rules:
//! - every member settles exactly once: by its end report or by its heartbeat stopping,
//!   whichever the leader learns first; a later event about it (a duplicate report, a report
//!   after it was counted lost, a silence after it reported) and events about non-members change
//!   nothing — so the decision depends on that first event per member, never on the order in
//!   which members settle;
//! - the job's root cause: a killed worker first, then a failure a restart cannot cure, then a
//!   lost node, then the lowest-ranked failure; with none, a node whose workers were stopped from
//!   outside (its agent lost the store) unless the attempt stopped to regroup;
//! - the restart policy is `supervise::rule`, shared with the single-node launcher;
//! - a restart drops lost nodes, admits joiners up to `max_nodes`, never goes below
//!   `min_nodes`, and lists members sorted by node (so rank 0 is on the lowest-numbered one);
//! - a survivor that takes over the store goes on only with a strict majority of the attempt's
//!   nodes (two jobs must never write one run), at least `min_nodes`, and rank 0's newest
//!   checkpoint within its reach.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::launch::{FailureKind, WorkerFailure};
use crate::supervise::{rule, MembershipChange, Next, RestartPolicy};

/// A node in an attempt: which start of its agent (a restarted agent is a new incarnation, with a
/// heartbeat of its own) and its host, for messages.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(super) struct Member {
    pub node: usize,
    pub incarnation: i64,
    pub host: String,
    /// Its address on the route to the store: where it serves the store if it becomes leader.
    pub ip: String,
}

/// One node's account of an attempt.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct EndReport {
    /// The local root cause, if its workers failed by themselves.
    pub failure: Option<Failure>,
    /// Its workers were stopped from outside (by its watcher).
    pub stopped: bool,
    /// The leader only: the last step rank 0 completed and the step it resumed from.
    pub last_step: Option<u64>,
    pub resumed_from: Option<u64>,
}

/// A [`WorkerFailure`] as it travels between agents.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Failure {
    pub node: usize,
    pub rank: usize,
    pub kind: FailureKind,
    pub what: String,
    pub message: String,
    pub permanent: bool,
    pub detection_seconds: f64,
}

impl Failure {
    pub fn as_worker_failure(&self) -> WorkerFailure {
        WorkerFailure {
            rank: self.rank,
            kind: self.kind,
            what: self.what.clone(),
            message: self.message.clone(),
            permanent: self.permanent,
            detection_seconds: self.detection_seconds,
        }
    }
}

/// The leader's ruling on an attempt, followed by every agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Decision {
    /// The job's root cause; `None` = every node finished, or the attempt stopped to regroup.
    pub failure: Option<Failure>,
    pub next: Next,
    /// The next attempt's members (when `next` is a restart).
    pub members: Vec<Member>,
    pub changes: Vec<MembershipChange>,
    pub last_step: Option<u64>,
    pub resumed_from: Option<u64>,
}

/// The job's settings that every ruling applies (the same on every node).
#[derive(Debug, Clone, Copy)]
pub(super) struct Rules {
    pub nproc: usize,
    pub min_nodes: usize,
    pub max_nodes: usize,
    pub heartbeat_timeout: Duration,
    pub max_restarts: usize,
}

impl Rules {
    fn world(&self, members: &[Member]) -> usize {
        members.len() * self.nproc
    }

    /// The restart policy applied to the job's root cause, after `restarts` restarts.
    fn next(&self, restarts: usize, root: Option<&Failure>, regroup: bool) -> Next {
        let policy = RestartPolicy {
            max_restarts: self.max_restarts,
        };
        let as_worker = root.map(Failure::as_worker_failure);
        rule(policy, restarts, as_worker.as_ref(), regroup)
    }
}

/// Name of node `n` for messages: "node 1 (hostname)".
pub(super) fn describe_node(members: &[Member], n: usize) -> String {
    let host = members
        .iter()
        .find(|m| m.node == n)
        .map_or("?", |m| m.host.as_str());
    format!("node {n} ({host})")
}

fn change(
    members: &[Member],
    a: usize,
    what: &str,
    n: usize,
    (before, after): (usize, usize),
    step: Option<u64>,
) -> MembershipChange {
    MembershipChange {
        attempt: a,
        change: what.into(),
        who: describe_node(members, n),
        world_before: before,
        world_after: after,
        step,
        resumed_from: None,
        steps_recomputed: None,
    }
}

/// What the leader learns while an attempt settles.
#[derive(Debug, Clone)]
pub(super) enum Event {
    /// A node's end report (the leader's own included).
    Reported { node: usize, report: EndReport },
    /// A node's heartbeat has not moved for the heartbeat timeout.
    Silent { node: usize },
}

/// What the leader does after an event.
#[derive(Debug, Clone)]
pub(super) enum Action {
    /// Keep reading the store: some members have neither reported nor gone silent
    /// ([`Settlement::missing`]).
    Wait,
    /// Every member settled: publish this decision (handed out once).
    Publish(Box<Decision>),
    /// The decision was published already; nothing more to do.
    Settled,
}

/// The leader's view of attempt `attempt` while it settles.
#[derive(Debug, Clone)]
pub(super) struct Settlement {
    attempt: usize,
    members: Vec<Member>,
    /// The leader's node: its report carries rank 0's steps.
    leader: usize,
    /// Restarts made before this attempt.
    restarts: usize,
    /// Agents the leader's watcher saw waiting to join, in the order it saw them.
    joiners: Vec<Member>,
    /// The attempt stopped because the leader posted a regroup (to admit joiners).
    regroup: bool,
    reports: BTreeMap<usize, EndReport>,
    lost: BTreeSet<usize>,
    decided: bool,
}

impl Settlement {
    pub fn new(
        attempt: usize,
        members: Vec<Member>,
        leader: usize,
        restarts: usize,
        joiners: Vec<Member>,
        regroup: bool,
    ) -> Settlement {
        Settlement {
            attempt,
            members,
            leader,
            restarts,
            joiners,
            regroup,
            reports: BTreeMap::new(),
            lost: BTreeSet::new(),
            decided: false,
        }
    }

    /// The members that have not settled yet.
    pub fn missing(&self) -> Vec<usize> {
        self.members
            .iter()
            .map(|m| m.node)
            .filter(|n| !self.reports.contains_key(n) && !self.lost.contains(n))
            .collect()
    }

    /// One event in; the new state and what to do.
    pub fn step(mut self, event: Event, rules: &Rules) -> (Settlement, Action) {
        if self.decided {
            return (self, Action::Settled);
        }
        let node = match &event {
            Event::Reported { node, .. } | Event::Silent { node } => *node,
        };
        // Only a member's first event counts; the leader itself is never silent to itself.
        let fresh = self.missing().contains(&node);
        match event {
            Event::Reported { node, report } if fresh => {
                self.reports.insert(node, report);
            }
            Event::Silent { node } if fresh && node != self.leader => {
                self.lost.insert(node);
            }
            _ => {}
        }
        if !self.missing().is_empty() {
            return (self, Action::Wait);
        }
        self.decided = true;
        let decision = self.decide(rules);
        (self, Action::Publish(Box::new(decision)))
    }

    /// The root cause among the settled members (see the module docs for the order).
    fn root_cause(&self, rules: &Rules) -> Option<Failure> {
        let failures: Vec<&Failure> = self
            .members
            .iter()
            .filter_map(|m| self.reports.get(&m.node)?.failure.as_ref())
            .collect();
        let lost = self.lost.first().map(|&n| Failure {
            node: n,
            rank: self.members.iter().position(|m| m.node == n).unwrap_or(0) * rules.nproc,
            kind: FailureKind::NodeLost,
            what: format!("{} lost (no heartbeat)", describe_node(&self.members, n)),
            message: format!(
                "{} lost (no heartbeat for {:.1}s)",
                describe_node(&self.members, n),
                rules.heartbeat_timeout.as_secs_f64()
            ),
            permanent: false,
            detection_seconds: rules.heartbeat_timeout.as_secs_f64(),
        });
        let root = failures
            .iter()
            .find(|f| matches!(f.kind, FailureKind::Killed { .. }))
            .or_else(|| failures.iter().find(|f| f.permanent))
            .copied()
            .or(lost.as_ref())
            .or_else(|| failures.iter().min_by_key(|f| f.rank).copied())
            .cloned();
        if root.is_some() || self.regroup {
            return root;
        }
        // Workers stopped from outside with nothing to show for it: a watcher lost the store.
        let n = self
            .members
            .iter()
            .find(|m| self.reports.get(&m.node).is_some_and(|r| r.stopped))?
            .node;
        let who = describe_node(&self.members, n);
        Some(Failure {
            node: n,
            rank: 0,
            kind: FailureKind::StoreLost,
            what: format!("{who} stopped its workers"),
            message: format!("{who} stopped its workers: its agent lost the job's store"),
            permanent: false,
            detection_seconds: 0.0,
        })
    }

    fn decide(&self, rules: &Rules) -> Decision {
        let a = self.attempt;
        let (last_step, resumed_from) = self
            .reports
            .get(&self.leader)
            .map_or((None, None), |r| (r.last_step, r.resumed_from));
        let root = self.root_cause(rules);
        let mut next = rules.next(self.restarts, root.as_ref(), self.regroup);
        let mut members: Vec<Member> = self
            .members
            .iter()
            .filter(|m| !self.lost.contains(&m.node))
            .cloned()
            .collect();
        let mut changes = Vec::new();
        let before = rules.world(&self.members);
        if next == Next::Restart && members.len() < rules.min_nodes {
            let names: Vec<String> = self
                .lost
                .iter()
                .map(|&n| describe_node(&self.members, n))
                .collect();
            next = Next::End {
                message: format!(
                    "{} lost (no heartbeat for {:.1}s); {} node(s) remain, below the minimum of {} (--nnodes) — continue with --resume once it is back",
                    names.join(", "),
                    rules.heartbeat_timeout.as_secs_f64(),
                    members.len(),
                    rules.min_nodes
                ),
                permanent: false,
            };
        } else if next == Next::Restart {
            let without = rules.world(&members);
            for &n in &self.lost {
                let sizes = (before, without);
                changes.push(change(&self.members, a, "node lost", n, sizes, last_step));
            }
            for j in &self.joiners {
                if members.len() < rules.max_nodes && !members.iter().any(|m| m.node == j.node) {
                    members.push(j.clone());
                    let sizes = (without, rules.world(&members));
                    let mut c = change(&members, a, "node joined", j.node, sizes, last_step);
                    c.who = format!("node {} ({})", j.node, j.host);
                    changes.push(c);
                }
            }
            members.sort_by_key(|m| m.node);
        }
        Decision {
            failure: root,
            next,
            members,
            changes,
            last_step,
            resumed_from,
        }
    }
}

/// What a survivor that takes over the store knows when it rules on attempt `a`.
pub(super) struct LeaderLoss<'a> {
    pub attempt: usize,
    /// The attempt's members, the lost leader included.
    pub members: &'a [Member],
    pub old_leader: usize,
    /// The new leader.
    pub me: usize,
    /// The survivors that reached the moved store (the new leader included), sorted by node.
    pub present: Vec<Member>,
    pub restarts: usize,
    /// Rank 0's last completed step, as the old leader last published it.
    pub seen_step: u64,
    pub checkpoint_every: u64,
    /// The newest checkpoint the new leader can read.
    pub newest_checkpoint: u64,
    /// Where it looked, for the message.
    pub checkpoint_dir: &'a std::path::Path,
}

/// The new leader's ruling on the attempt whose leader (and store) was lost.
pub(super) fn after_leader_loss(l: LeaderLoss<'_>, rules: &Rules) -> Decision {
    let lost = describe_node(l.members, l.old_leader);
    let failure = Failure {
        node: l.old_leader,
        rank: 0,
        kind: FailureKind::StoreHostLost,
        what: format!("{lost} lost (the store's host)"),
        message: format!("{lost} lost: its agent, which served the job's store, stopped answering"),
        permanent: false,
        detection_seconds: 0.0,
    };
    let me = describe_node(l.members, l.me);
    let mut next = rules.next(l.restarts, Some(&failure), false);
    if next == Next::Restart && l.present.len() * 2 <= l.members.len() {
        // Fewer than a majority of the attempt's nodes reached the new store: this node cannot
        // tell the leader's loss from its own cut-off, and two jobs must never write one run.
        next = Next::End {
            message: format!(
                "{lost} does not answer, and only {} of the attempt's {} nodes reached the store moved to {me}: without a majority this cannot be told from a cut-off of this node — continue with --resume on node 0's run directory",
                l.present.len(),
                l.members.len(),
            ),
            permanent: false,
        };
    } else if next == Next::Restart && l.present.len() < rules.min_nodes {
        next = Next::End {
            message: format!(
                "{lost} lost; {} node(s) remain, below the minimum of {} (--nnodes) — continue with --resume on node 0's run directory",
                l.present.len(),
                rules.min_nodes
            ),
            permanent: false,
        };
    }
    let sizes = (rules.world(l.members), rules.world(&l.present));
    let gone = l
        .members
        .iter()
        .map(|m| m.node)
        .filter(|&n| n != l.old_leader && !l.present.iter().any(|m| m.node == n));
    let changes = std::iter::once(l.old_leader)
        .chain(gone)
        .map(|n| {
            change(
                l.members,
                l.attempt,
                "node lost",
                n,
                sizes,
                Some(l.seen_step),
            )
        })
        .collect();
    let decision = Decision {
        failure: Some(failure),
        next,
        members: l.present,
        changes,
        last_step: Some(l.seen_step),
        resumed_from: None,
    };
    let reach = CheckpointReach {
        seen_step: l.seen_step,
        every: l.checkpoint_every,
        newest: l.newest_checkpoint,
        dir: l.checkpoint_dir,
        here: me,
        lost,
    };
    unless_checkpoint_out_of_reach(decision, &reach)
}

/// What a new leader knows of rank 0's checkpoints when the old leader is lost.
pub(super) struct CheckpointReach<'a> {
    /// Rank 0's last completed step, as the old leader last published it.
    pub seen_step: u64,
    pub every: u64,
    /// The newest checkpoint the new leader can read.
    pub newest: u64,
    /// Where it looked.
    pub dir: &'a std::path::Path,
    /// The new leader and the lost one, for the message.
    pub here: String,
    pub lost: String,
}

/// Rank 0 moves to the new leader, so a restart needs the checkpoint rank 0 had written last
/// (of the boundary at or before `seen_step`) in its reach; otherwise the job ends by name.
pub(super) fn unless_checkpoint_out_of_reach(mut d: Decision, r: &CheckpointReach<'_>) -> Decision {
    let expected = r.seen_step.checked_div(r.every).map_or(0, |q| q * r.every);
    if d.next == Next::Restart && r.newest < expected {
        d.next = Next::End {
            message: format!(
                "{} lost; rank 0 had written the checkpoint of step {expected}, but the newest {} reaches in {} is of step {}: the job cannot go on here — continue with --resume on node 0's run directory (put --out or checkpoint.dir on storage every node reaches to let the job go on by itself)",
                r.lost,
                r.here,
                r.dir.display(),
                r.newest
            ),
            permanent: false,
        };
    }
    d
}

/// Properties of the rulings over generated attempts: members that report (fine, failed,
/// stopped) or go silent, joiners, regroups, restart budgets, a lost leader whose place a
/// survivor takes (etcd) or that moves the store (builtin) — delivered in every interleaving,
/// with duplicate reports, late events about members that settled already, events about nodes
/// that are not members, and the leader "silent" to itself.
#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NPROC: usize = 2;

    /// How a member ends the attempt, as the leader first learns it.
    #[derive(Debug, Clone)]
    enum End {
        Fine,
        Failed(FailureKind, bool),
        Stopped,
        Silent,
    }

    fn member(node: usize, incarnation: i64) -> Member {
        Member {
            node,
            incarnation,
            host: format!("h{node}"),
            ip: "127.0.0.1".into(),
        }
    }

    fn report(node: usize, rank: usize, end: &End, last_step: u64) -> EndReport {
        let failure = match end {
            End::Failed(kind, permanent) => Some(Failure {
                node,
                rank,
                kind: *kind,
                what: format!("{kind:?}"),
                message: format!("{kind:?} on node {node}"),
                permanent: *permanent,
                detection_seconds: 0.5,
            }),
            _ => None,
        };
        EndReport {
            failure,
            stopped: matches!(end, End::Stopped),
            last_step: Some(last_step),
            resumed_from: None,
        }
    }

    fn end_strategy() -> impl Strategy<Value = End> {
        prop_oneof![
            3 => Just(End::Fine),
            1 => Just(End::Failed(FailureKind::Killed { signal: 9 }, false)),
            1 => Just(End::Failed(FailureKind::Exited { status: Some(1) }, false)),
            1 => Just(End::Failed(FailureKind::PeerGone { peer: 0 }, false)),
            1 => Just(End::Failed(FailureKind::BadInput, true)),
            1 => Just(End::Stopped),
            2 => Just(End::Silent),
        ]
    }

    /// One generated attempt.
    #[derive(Debug, Clone)]
    struct Case {
        members: Vec<Member>,
        ends: Vec<End>,
        joiners: Vec<Member>,
        regroup: bool,
        restarts: usize,
        rules: Rules,
        /// A permutation seed for the interleaving, and the noise events.
        order: Vec<usize>,
        noise: Vec<(usize, u8)>,
        /// The member that rules: the first, or — its leader lost (etcd) — the second, with the
        /// first silent.
        ruler: usize,
    }

    fn case() -> impl Strategy<Value = Case> {
        (
            prop::collection::btree_set(0usize..6, 1..=4),
            prop::collection::vec(end_strategy(), 4),
            prop::collection::vec(0usize..7, 0..3),
            any::<bool>(),
            0usize..3,
            0usize..3,
            (0usize..5, 0usize..3),
            prop::collection::vec(any::<usize>(), 16),
            prop::collection::vec((0usize..8, 0u8..3), 0..6),
            any::<bool>(),
        )
            .prop_map(
                |(
                    nodes,
                    ends,
                    joiners,
                    regroup,
                    restarts,
                    max_restarts,
                    (lo, hi),
                    order,
                    noise,
                    leader_lost,
                )| {
                    let members: Vec<Member> = nodes.iter().map(|&n| member(n, 1)).collect();
                    let n = members.len();
                    let mut ends: Vec<End> = ends.into_iter().take(n).collect();
                    let ruler = usize::from(leader_lost && n > 1);
                    if ruler == 1 {
                        ends[0] = End::Silent;
                    }
                    // The ruler reports; it is never silent to itself.
                    if matches!(ends[ruler], End::Silent) {
                        ends[ruler] = End::Fine;
                    }
                    let min_nodes = 1 + lo % n;
                    let rules = Rules {
                        nproc: NPROC,
                        min_nodes,
                        max_nodes: n + hi,
                        heartbeat_timeout: Duration::from_secs(3),
                        max_restarts,
                    };
                    // A joiner is a new incarnation of any node (a lost member's included).
                    let joiners = joiners.into_iter().map(|j| member(j, 2)).collect();
                    Case {
                        members,
                        ends,
                        joiners,
                        regroup,
                        restarts,
                        rules,
                        order,
                        noise,
                        ruler,
                    }
                },
            )
    }

    fn first_event(c: &Case, i: usize) -> Event {
        let node = c.members[i].node;
        match &c.ends[i] {
            End::Silent => Event::Silent { node },
            end => Event::Reported {
                node,
                report: report(node, i * NPROC, end, 40),
            },
        }
    }

    /// Noise: a second, different report or a silence about a member after its first event, an
    /// event about a node that is not a member, or the leader silent.
    fn noise_event(c: &Case, (pick, what): (usize, u8)) -> (Option<usize>, Event) {
        let leader = c.members[c.ruler].node;
        match what {
            0 => {
                let i = pick % c.members.len();
                let node = c.members[i].node;
                let end = End::Failed(FailureKind::Killed { signal: 15 }, false);
                (
                    Some(i),
                    Event::Reported {
                        node,
                        report: report(node, 0, &end, 99),
                    },
                )
            }
            1 => {
                let i = pick % c.members.len();
                (
                    Some(i),
                    Event::Silent {
                        node: c.members[i].node,
                    },
                )
            }
            _ if pick % 2 == 0 => (None, Event::Silent { node: leader }),
            _ => {
                let end = End::Failed(FailureKind::Killed { signal: 9 }, false);
                (
                    None,
                    Event::Reported {
                        node: 100 + pick % 3,
                        report: report(100, 0, &end, 7),
                    },
                )
            }
        }
    }

    /// The events in the order the case's permutation gives, each member's first event before
    /// any noise about it.
    fn interleaving(c: &Case) -> Vec<Event> {
        let mut tagged: Vec<(Option<usize>, bool, Event)> = (0..c.members.len())
            .map(|i| (Some(i), true, first_event(c, i)))
            .collect();
        for &n in &c.noise {
            let (who, e) = noise_event(c, n);
            tagged.push((who, false, e));
        }
        // A permutation from the seeds, then each member's first event moved to the front of
        // its own events.
        let len = tagged.len();
        for k in (1..len).rev() {
            tagged.swap(k, c.order[k % c.order.len()] % (k + 1));
        }
        for i in 0..c.members.len() {
            let positions: Vec<usize> = (0..len).filter(|&p| tagged[p].0 == Some(i)).collect();
            let first = positions.iter().copied().find(|&p| tagged[p].1).unwrap();
            tagged.swap(positions[0], first);
        }
        tagged.into_iter().map(|(_, _, e)| e).collect()
    }

    /// Runs the events; the decision and the index of the event that produced it.
    fn run(c: &Case, events: Vec<Event>) -> (Decision, usize) {
        let mut s = Settlement::new(
            3,
            c.members.clone(),
            c.members[c.ruler].node,
            c.restarts,
            c.joiners.clone(),
            c.regroup,
        );
        let mut published = None;
        for (k, e) in events.into_iter().enumerate() {
            let (next, action) = s.step(e, &c.rules);
            s = next;
            match action {
                Action::Publish(d) => {
                    assert!(published.is_none(), "a second decision");
                    published = Some((*d, k));
                }
                Action::Settled => assert!(published.is_some(), "settled before deciding"),
                Action::Wait => assert!(published.is_none(), "waiting after deciding"),
            }
        }
        published.expect("every member settled, so there is a decision")
    }

    fn json(d: &Decision) -> String {
        serde_json::to_string(d).unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

        /// The decision depends on each member's first event only: any interleaving, with any
        /// duplicates, late events and strangers, gives the same decision, published once, at
        /// the event that settled the last member.
        #[test]
        fn the_decision_does_not_depend_on_the_order_of_events(c in case()) {
            let canonical: Vec<Event> = (0..c.members.len()).map(|i| first_event(&c, i)).collect();
            let (want, _) = run(&c, canonical);
            let events = interleaving(&c);
            let last_first = {
                // The position of the last member's first event in the interleaving.
                let mut seen = std::collections::BTreeSet::new();
                let mut at = 0;
                for (k, e) in events.iter().enumerate() {
                    let node = match e { Event::Reported { node, .. } | Event::Silent { node } => *node };
                    let member = c.members.iter().any(|m| m.node == node);
                    let leader_silence = matches!(e, Event::Silent { node } if *node == c.members[c.ruler].node);
                    if member && !leader_silence && seen.insert(node) {
                        at = k;
                    }
                }
                at
            };
            let (got, k) = run(&c, events);
            prop_assert_eq!(json(&got), json(&want));
            prop_assert_eq!(k, last_first);
        }

        /// What every decision guarantees.
        #[test]
        fn decisions_keep_the_membership_and_restart_rules(c in case()) {
            let (d, _) = run(&c, interleaving(&c));
            let lost: Vec<&Member> = c.members.iter().zip(&c.ends)
                .filter(|(_, e)| matches!(e, End::Silent)).map(|(m, _)| m).collect();
            let failed: Vec<&End> = c.ends.iter().filter(|e| matches!(e, End::Failed(..))).collect();
            // The root cause: a killed worker first, then a failure a restart cannot cure.
            if failed.iter().any(|e| matches!(e, End::Failed(FailureKind::Killed { .. }, _))) {
                let killed = matches!(d.failure.as_ref().map(|f| f.kind), Some(FailureKind::Killed { .. }));
                prop_assert!(killed);
            } else if failed.iter().any(|e| matches!(e, End::Failed(_, true))) {
                let permanent = matches!(d.next, Next::End { permanent: true, .. });
                prop_assert!(permanent, "{:?}", d.next);
            } else if !lost.is_empty() {
                prop_assert_eq!(d.failure.as_ref().map(|f| f.kind), Some(FailureKind::NodeLost));
            }
            // A failure never restarts beyond the budget.
            if d.failure.is_some() && c.restarts >= c.rules.max_restarts {
                prop_assert!(d.next != Next::Restart);
            }
            // All finished, nobody lost or stopped, no regroup: done.
            if failed.is_empty() && lost.is_empty() && !c.regroup
                && !c.ends.iter().any(|e| matches!(e, End::Stopped)) {
                prop_assert_eq!(&d.next, &Next::Done);
                prop_assert!(d.failure.is_none());
            }
            if d.next == Next::Restart {
                let nodes: Vec<usize> = d.members.iter().map(|m| m.node).collect();
                prop_assert!(nodes.windows(2).all(|w| w[0] < w[1]), "{:?}", nodes);
                prop_assert!(d.members.len() >= c.rules.min_nodes);
                prop_assert!(d.members.len() <= c.rules.max_nodes);
                for m in &lost {
                    prop_assert!(!d.members.contains(m), "lost {:?} kept", m.node);
                }
                for (m, e) in c.members.iter().zip(&c.ends) {
                    if !matches!(e, End::Silent) {
                        prop_assert!(d.members.contains(m), "{:?} dropped", m.node);
                    }
                }
                for ch in d.changes.iter().filter(|ch| ch.change == "node lost") {
                    prop_assert_eq!(ch.world_before, c.members.len() * NPROC);
                    prop_assert_eq!(ch.world_after, (c.members.len() - lost.len()) * NPROC);
                }
                let joined = d.changes.iter().filter(|ch| ch.change == "node joined").count();
                prop_assert_eq!(d.members.len(), c.members.len() - lost.len() + joined);
            } else {
                prop_assert!(d.changes.is_empty());
            }
        }

        /// A survivor that takes over the store goes on only with a strict majority, at least
        /// the minimum of nodes, and rank 0's checkpoint in reach; whatever it rules, node 0 and
        /// the survivors that did not come are named lost.
        #[test]
        fn a_new_leader_goes_on_only_with_a_majority_and_the_checkpoint(
            n in 2usize..6,
            came in prop::collection::vec(any::<bool>(), 6),
            min_nodes in 1usize..4,
            restarts in 0usize..3,
            seen_step in 0u64..100,
            newest in 0u64..100,
        ) {
            let members: Vec<Member> = (0..n).map(|i| member(i, 1)).collect();
            let mut present: Vec<Member> = members[1..].iter().zip(&came)
                .filter(|(_, c)| **c).map(|(m, _)| m.clone()).collect();
            if present.first().map(|m| m.node) != Some(1) {
                present.insert(0, members[1].clone());
            }
            let rules = Rules { nproc: NPROC, min_nodes, max_nodes: n,
                heartbeat_timeout: Duration::from_secs(3), max_restarts: 2 };
            let loss = LeaderLoss {
                attempt: 1, members: &members, old_leader: 0, me: 1, present: present.clone(),
                restarts, seen_step, checkpoint_every: 10, newest_checkpoint: newest,
                checkpoint_dir: std::path::Path::new("/ckpt"),
            };
            let d = after_leader_loss(loss, &rules);
            if d.next == Next::Restart {
                prop_assert!(present.len() * 2 > n);
                prop_assert!(present.len() >= min_nodes);
                prop_assert!(newest >= seen_step / 10 * 10);
                prop_assert!(restarts < 2);
            }
            prop_assert_eq!(&d.members, &present);
            prop_assert_eq!(d.failure.as_ref().map(|f| f.kind), Some(FailureKind::StoreHostLost));
            prop_assert_eq!(d.changes.len(), 1 + (n - 1 - present.len()));
            prop_assert_eq!(&d.changes[0].who, "node 0 (h0)");
        }
    }
}
