//! Errors of the communication layer.
//!
//! A transport reports *what went wrong with which peer* ([`TransportError`]); a collective wraps it
//! with the operation's name ([`CommError::Op`]) so that the message a user reads names the operation,
//! the peer rank, its address and how long we waited, e.g.
//! `all_reduce: timed out after 5.00s waiting for rank 2 (127.0.0.1:40312)`.

use std::time::Duration;

/// What happened on the link to one peer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LinkFailure {
    #[error("timed out after {:.2}s", .0.as_secs_f64())]
    Timeout(Duration),
    #[error("connection closed by peer (process gone?)")]
    Closed,
    #[error("I/O error: {0}")]
    Io(String),
    #[error("protocol violation: {0}")]
    Protocol(String),
}

/// Which way the failed operation moved data on the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Receiving: this rank was waiting for the peer.
    WaitingFor,
    /// Sending to the peer.
    SendingTo,
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Direction::WaitingFor => "waiting for",
            Direction::SendingTo => "sending to",
        })
    }
}

/// A failure on the link to `peer` (a global rank).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{failure} {direction} rank {peer} ({addr})")]
pub struct TransportError {
    pub peer: usize,
    pub addr: String,
    /// Chosen by the transport.
    pub direction: Direction,
    pub failure: LinkFailure,
}

impl TransportError {
    pub fn recv(peer: usize, addr: impl Into<String>, failure: LinkFailure) -> Self {
        Self {
            peer,
            addr: addr.into(),
            direction: Direction::WaitingFor,
            failure,
        }
    }
    pub fn send(peer: usize, addr: impl Into<String>, failure: LinkFailure) -> Self {
        Self {
            peer,
            addr: addr.into(),
            direction: Direction::SendingTo,
            failure,
        }
    }
    pub fn is_timeout(&self) -> bool {
        matches!(self.failure, LinkFailure::Timeout(_))
    }
    /// Timed out waiting for the peer: it is the one that stopped (or was slow).
    pub fn timed_out_waiting(&self) -> bool {
        self.is_timeout() && self.direction == Direction::WaitingFor
    }
    /// The peer's end of the link is gone (its process exited or its host went away).
    pub fn peer_gone(&self) -> bool {
        matches!(self.failure, LinkFailure::Closed)
    }
}

/// Errors surfaced to users of a [`crate::Communicator`] and of the rendezvous store.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// A collective or point-to-point operation failed on one link. (The link error is part of
    /// the message, not a `source`, so a printed error chain does not repeat it.)
    #[error("{op}: {link}")]
    Op {
        op: &'static str,
        link: TransportError,
    },
    /// An earlier failure broke this communicator; it must be rebuilt.
    #[error("communicator is broken (earlier failure: {0}); rebuild it before further use")]
    Broken(String),
    /// The caller passed arguments that cannot work (mismatched lengths, bad root, …).
    #[error("{op}: invalid argument: {detail}")]
    InvalidArgument { op: &'static str, detail: String },
    /// Rendezvous / connection setup failed.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// Authentication of a peer or of the store failed.
    #[error("authentication failed: {0}")]
    Auth(String),
    /// Other I/O during setup (binding, mapping shared memory, …).
    #[error("{context}: {detail}")]
    Setup { context: String, detail: String },
    /// A shared-memory name this job must create or open is held by a file of another user
    /// (`uid`, `user` when the user database knows it), who got there first. Only that user or
    /// root can free it, so no restart under the same name can succeed: see
    /// [`CommError::is_permanent`].
    #[error(
        "{path} is held by a file of {} (uid {uid}), not of this job's user (uid {me}): another \
         user took the name first and only they or root can remove it, so restarting cannot help \
         (remove the file, or use another shared-memory directory)",
        .user.as_deref().map_or_else(|| "another user".to_string(), |u| format!("user {u}"))
    )]
    NameTaken {
        path: String,
        uid: u32,
        user: Option<String>,
        me: u32,
    },
}

impl CommError {
    pub fn setup(context: impl Into<String>, detail: impl std::fmt::Display) -> Self {
        CommError::Setup {
            context: context.into(),
            detail: detail.to_string(),
        }
    }
    pub fn invalid(op: &'static str, detail: impl Into<String>) -> Self {
        CommError::InvalidArgument {
            op,
            detail: detail.into(),
        }
    }

    /// Whether retrying cannot cure this failure, whatever the timing: a launcher should end the
    /// job instead of restarting it. Decided by the variant, never by the message.
    pub fn is_permanent(&self) -> bool {
        matches!(self, CommError::NameTaken { .. })
    }
}

pub type Result<T, E = CommError> = std::result::Result<T, E>;
