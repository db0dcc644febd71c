//! The worker → launcher protocol. A worker's output lines are log lines, except those that start
//! with [`PREFIX`]: the rest of such a line is one JSON-encoded [`WorkerMessage`]. Both sides use
//! these types, so a message is never assembled with `format!` nor read back out of prose.

use serde::{Deserialize, Serialize};

/// Marks a protocol line (anything else a worker prints is a log line).
pub const PREFIX: &str = "@@lockstep ";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum WorkerMessage {
    /// Rank 0, every `train.log_every` steps: the progress bar.
    Progress(Progress),
    /// Rank 0: a step completed (counting from 1); the launcher's measure of progress made.
    StepDone { step: u64 },
    /// Rank 0: training continues from the checkpoint of this step.
    Resumed { step: u64 },
    /// A `bench-collectives` worker's result row.
    BenchRow { row: serde_json::Value },
    /// A worker that stops on an error says why, just before its human-readable message.
    Failure(FailureRecord),
    /// Every worker under a launcher, every second: whether it is inside a communication
    /// operation (which has its own deadline) and how long since its code last made progress.
    /// The launcher names a worker hung when it is not waiting and idle for the stall timeout,
    /// or when its heartbeats stop.
    Heartbeat { waiting: bool, idle_secs: f64 },
    /// An allocation of `bytes` failed; the process aborts next. Written without allocating by
    /// [`crate::oom::ReportingAllocator`].
    OutOfMemory { bytes: u64 },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub step: u64,
    pub total_steps: u64,
    pub loss: f64,
    pub samples_per_sec: f64,
    pub eta_seconds: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailureRecord {
    /// The peer this worker timed out waiting for, if that is how it failed: the launcher blames
    /// a rank that everyone waited for and that never exited (it hung).
    pub waited_for: Option<usize>,
    /// The peer whose end of a link closed under this worker (its process exited or its host
    /// went away), if that is how it failed.
    #[serde(default)]
    pub lost_peer: Option<usize>,
    /// Bad input, a misbehaving job or a full disk: a restart cannot cure it (exit status 3).
    pub permanent: bool,
    /// The error, as the worker prints it.
    pub message: String,
}

impl WorkerMessage {
    /// The protocol line (without a newline).
    pub fn line(&self) -> String {
        format!(
            "{PREFIX}{}",
            serde_json::to_string(self).expect("protocol messages serialise")
        )
    }

    /// `None` for a log line; a protocol line that does not parse is an error naming it.
    pub fn parse(line: &str) -> Option<Result<WorkerMessage, String>> {
        let json = line.strip_prefix(PREFIX)?;
        Some(
            serde_json::from_str(json)
                .map_err(|e| format!("malformed protocol line `{line}`: {e}")),
        )
    }
}

/// The peer a failed worker timed out waiting for, from its error's typed causes.
pub fn waited_for(e: &anyhow::Error) -> Option<usize> {
    failed_link(e)
        .filter(|l| l.timed_out_waiting())
        .map(|l| l.peer)
}

/// The peer whose end of a link closed under the error `e` (found in its chain), if any.
pub fn lost_peer(e: &anyhow::Error) -> Option<usize> {
    failed_link(e).filter(|l| l.peer_gone()).map(|l| l.peer)
}

/// The link failure an operation in `e`'s chain met, by type (never by message).
fn failed_link(e: &anyhow::Error) -> Option<&lockstep_comm::TransportError> {
    use lockstep_comm::CommError;
    e.chain().find_map(|c| {
        let comm = c.downcast_ref::<CommError>().or_else(|| {
            match c.downcast_ref::<lockstep_train::TrainError>() {
                Some(lockstep_train::TrainError::Comm(comm)) => Some(comm),
                _ => None,
            }
        })?;
        match comm {
            CommError::Op { link, .. } => Some(link),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_log_lines_are_not_messages() {
        let all = [
            WorkerMessage::Progress(Progress {
                step: 3,
                total_steps: 10,
                loss: 0.5,
                samples_per_sec: 100.0,
                eta_seconds: 2.0,
            }),
            WorkerMessage::StepDone { step: 4 },
            WorkerMessage::Resumed { step: 20 },
            WorkerMessage::BenchRow {
                row: serde_json::json!({"bytes": 4096}),
            },
            WorkerMessage::Failure(FailureRecord {
                waited_for: Some(2),
                lost_peer: None,
                permanent: false,
                message: "all_reduce: timed out".into(),
            }),
        ];
        for m in all {
            assert_eq!(WorkerMessage::parse(&m.line()), Some(Ok(m.clone())));
        }
        assert_eq!(WorkerMessage::parse("step 3/10 loss 0.5"), None);
        let bad = WorkerMessage::parse("@@lockstep {\"kind\":\"nonsense\"}").unwrap();
        assert!(bad.unwrap_err().contains("malformed protocol line"));
    }

    #[test]
    fn a_timeout_waiting_for_a_peer_is_found_in_the_error_chain() {
        use lockstep_comm::{CommError, LinkFailure, TransportError};
        let timeout = CommError::Op {
            op: "all_reduce",
            link: TransportError::recv(
                2,
                "127.0.0.1:1",
                LinkFailure::Timeout(std::time::Duration::from_secs(5)),
            ),
        };
        let e = anyhow::Error::new(lockstep_train::TrainError::Comm(timeout)).context("rank 1");
        assert_eq!(waited_for(&e), Some(2));
        let closed = CommError::Op {
            op: "all_reduce",
            link: TransportError::send(2, "127.0.0.1:1", LinkFailure::Closed),
        };
        assert_eq!(waited_for(&anyhow::Error::new(closed)), None);
    }
}
