//! The transport abstraction every collective is written against.
//!
//! A transport moves tagged byte buffers between *global* ranks `0..world_size`. Links are FIFO per
//! direction; the receiver states the exact length and tag it expects, and a mismatch is a protocol
//! error (collectives are SPMD, so a mismatch means the ranks disagree about what they are doing:
//! failing loudly beats silently pairing the wrong messages).
//!
//! Every call takes a deadline; no call may block past it. A transport is used by one thread at a
//! time per peer (the [`crate::Communicator`] takes `&mut self`); a second, concurrent stream of
//! operations (e.g. gradient all-reduce on a background thread) gets its own transport instance.

use std::time::Instant;

use crate::error::TransportError;

/// Which message a buffer is. Collectives derive tags from an operation sequence number so that
/// messages of consecutive operations can never be confused.
pub type Tag = u64;

pub trait Transport: Send + Sync {
    /// This process's global rank.
    fn rank(&self) -> usize;
    /// Number of ranks reachable through this transport.
    fn world_size(&self) -> usize;
    /// Human-readable address of `peer` for error messages (e.g. `127.0.0.1:4040`, `shm:/lockstep-…`).
    fn peer_addr(&self, peer: usize) -> String;
    /// Short name: "inproc", "tcp", "shm".
    fn name(&self) -> &'static str;

    /// Send `data` to `peer`. May return before the peer has received it.
    fn send(
        &self,
        peer: usize,
        tag: Tag,
        data: &[u8],
        deadline: Instant,
    ) -> Result<(), TransportError>;

    /// Receive exactly `buf.len()` bytes tagged `tag` from `peer`.
    fn recv(
        &self,
        peer: usize,
        tag: Tag,
        buf: &mut [u8],
        deadline: Instant,
    ) -> Result<(), TransportError>;

    /// Send `send` tagged `send_tag` to `to` while receiving `recv.len()` bytes tagged `recv_tag`
    /// from `from`. Must not deadlock when `to` does the mirror-image call at the same time,
    /// whatever the sizes (ring algorithms use one tag for both sides; pipelines, whose two
    /// directions carry different message streams, use two).
    #[allow(clippy::too_many_arguments)]
    fn send_recv_tagged(
        &self,
        to: usize,
        send: &[u8],
        send_tag: Tag,
        from: usize,
        recv: &mut [u8],
        recv_tag: Tag,
        deadline: Instant,
    ) -> Result<(), TransportError>;

    /// [`Transport::send_recv_tagged`] with one tag for both directions.
    fn send_recv(
        &self,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
        tag: Tag,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        self.send_recv_tagged(to, send, tag, from, recv, tag, deadline)
    }

    /// Total payload bytes this transport has sent so far (for run reports).
    fn bytes_sent(&self) -> u64;

    /// Where every rank of this transport can create memory that all of them map: set only by
    /// transports whose ranks share one host's memory ([`crate::shm`]). The exact sum then reads
    /// its peers' gradients where they lie ([`crate::shared_parts`]).
    fn shared_memory(&self) -> Option<SharedMemory> {
        None
    }
}

/// A directory of memory-backed files every rank of a transport can open, and the job id that
/// keeps one job's files apart from another's.
#[derive(Debug, Clone)]
pub struct SharedMemory {
    pub dir: std::path::PathBuf,
    pub job_id: String,
}
