//! Every key the node agents use in the job's store, in one place: one function per key, so a
//! key is never spelled twice and its meaning is written down once. The workers of attempt
//! `a > 0` meet under [`attempt_namespace`] (their own keys — addresses, hosts — are the
//! transport's).
//!
//! | key | written by | value |
//! |-----|------------|-------|
//! | `join/{node}` | each start of a node's agent | counter: the node's newest incarnation |
//! | `agent/{node}/{c}` | incarnation `c` | its registration (JSON) |
//! | `hb/{node}/{c}` | incarnation `c`, every heartbeat | counter |
//! | `agents/verdict` | node 0, once | `ok`, or why the agents disagree |
//! | `agents/verdict-read` | every other agent | counter of agents that read a refusal |
//! | `agents/done` | the leader, at the end | `1`: agents waiting to be admitted end |
//! | `admit/{node}/{c}` | the leader | the attempt incarnation `c` joins at |
//! | `g{a}/members` | the leader | attempt `a`'s members (JSON) |
//! | `g{a}/failed` | an agent whose workers failed | counter: stop every node's workers |
//! | `g{a}/regroup` | the leader's watcher | joiners' names: stop to admit them |
//! | `g{a}/progress` | the leader's watcher | rank 0's last completed step |
//! | `g{a}/end/{node}` | each member | its end report of attempt `a` (JSON) |
//! | `g{a}/decision` | the leader | its ruling on attempt `a` (JSON; the first written stands) |
//! | `g{a}/store` | attempt `a`'s leader (etcd) | where attempt `a`'s workers meet |

/// Counter of node `node`'s agent starts: its newest incarnation.
pub fn join(node: usize) -> String {
    format!("join/{node}")
}

/// Incarnation `c` of node `node`'s registration.
pub fn registration(node: usize, c: i64) -> String {
    format!("agent/{node}/{c}")
}

/// Incarnation `c` of node `node`'s heartbeat counter.
pub fn heartbeat(node: usize, c: i64) -> String {
    format!("hb/{node}/{c}")
}

/// Node 0's verdict on the agents' settings.
pub const VERDICT: &str = "agents/verdict";
/// How many agents have read a refusing verdict (node 0 waits for them before it leaves).
pub const VERDICT_READ: &str = "agents/verdict-read";
/// The job is over: agents waiting to be admitted end.
pub const DONE: &str = "agents/done";

/// The attempt at which incarnation `c` of node `node` is admitted.
pub fn admission(node: usize, c: i64) -> String {
    format!("admit/{node}/{c}")
}

/// The members of attempt `a`.
pub fn members(a: usize) -> String {
    format!("g{a}/members")
}

/// Posted when a node's workers failed in attempt `a`.
pub fn failed(a: usize) -> String {
    format!("g{a}/failed")
}

/// Posted when the leader stops attempt `a` to admit joiners.
pub fn regroup(a: usize) -> String {
    format!("g{a}/regroup")
}

/// Rank 0's last completed step in attempt `a`.
pub fn progress(a: usize) -> String {
    format!("g{a}/progress")
}

/// Node `node`'s end report of attempt `a`.
pub fn end_report(a: usize, node: usize) -> String {
    format!("g{a}/end/{node}")
}

/// The leader's ruling on attempt `a`.
pub fn decision(a: usize) -> String {
    format!("g{a}/decision")
}

/// etcd: the address of the store attempt `a`'s leader serves for its workers.
pub fn workers_store(a: usize) -> String {
    format!("g{a}/store")
}

/// Where the workers of attempt `a` meet: every key they use starts with it, so nothing of an
/// earlier attempt is mistaken for theirs.
pub fn attempt_namespace(a: usize) -> String {
    format!("g{a}/")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No two keys of different meaning coincide, and the agents' per-attempt keys live in the
    /// attempt's namespace.
    #[test]
    fn keys_are_distinct_and_attempt_keys_are_namespaced() {
        let mut all = vec![
            join(1),
            registration(1, 2),
            heartbeat(1, 2),
            VERDICT.to_string(),
            VERDICT_READ.to_string(),
            DONE.to_string(),
            admission(1, 2),
        ];
        let per_attempt = [
            members(3),
            failed(3),
            regroup(3),
            progress(3),
            end_report(3, 1),
            decision(3),
            workers_store(3),
        ];
        for k in &per_attempt {
            assert!(k.starts_with(&attempt_namespace(3)), "{k}");
        }
        all.extend(per_attempt);
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
    }
}
