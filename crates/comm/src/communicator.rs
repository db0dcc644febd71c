//! A group of ranks that runs collectives together: the API the trainer and the CLI use.
//!
//! A [`Communicator`] adds to the plain functions of [`crate::collectives`]:
//! - a per-operation deadline (`now + timeout`), so no call blocks forever;
//! - the choice of algorithm (ring for large all-reduces, recursive doubling for small ones);
//! - tags derived from (operation kind, group id, operation sequence number), so consecutive
//!   operations and different sub-groups can never mix up their messages;
//! - errors that name the operation, and the *broken* state: after any transport failure the links
//!   may hold stale messages of the failed operation, so every later call fails fast with
//!   [`CommError::Broken`] instead of touching the transport. Recovery means building a new
//!   transport and communicator;
//! - statistics, and sub-groups ([`Communicator::split`]).
//!
//! All operations are collective over the group (every rank calls them in the same order with
//! matching arguments) except [`Communicator::send`] / [`Communicator::recv`]. A parent and its
//! sub-groups share the transport's links, so ranks must also interleave their calls on them in
//! the same order; a violation surfaces as a protocol error, never as silently mixed data.

use std::ops::Range;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::collectives::{
    all_gather, barrier, broadcast, op_tag, p2p, recursive_doubling, ring, Group, OpKind, Scratch,
    DEFAULT_SEGMENT_BYTES, GROUP_ID_MODULUS,
};
use crate::element::{Element, ReduceOp};
use crate::error::{CommError, Result, TransportError};
use crate::transport::{Tag, Transport};

/// Default size (bytes) below which all-reduce uses recursive doubling and broadcast the binomial
/// tree; at or above it, ring all-reduce and the pipelined chain.
pub const DEFAULT_SMALL_MESSAGE_THRESHOLD: usize = 256 * 1024;

/// All-reduce algorithm (in configs: "auto", "ring", "recursive-doubling").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Algorithm {
    /// Recursive doubling below the small-message threshold, ring at or above it.
    #[default]
    Auto,
    /// Bandwidth-optimal: reduce-scatter + all-gather around a ring.
    Ring,
    /// Latency-optimal: butterfly exchange of whole buffers.
    RecursiveDoubling,
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Algorithm::Auto => "auto",
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "recursive-doubling",
        })
    }
}

impl FromStr for Algorithm {
    type Err = String;
    /// Accepts `auto`, `ring`, `recursive-doubling` (or `rd`), case-insensitively.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Algorithm::Auto),
            "ring" => Ok(Algorithm::Ring),
            "recursive-doubling" | "recursive_doubling" | "rd" => Ok(Algorithm::RecursiveDoubling),
            other => Err(format!("unknown all-reduce algorithm {other:?} (expected auto, ring or recursive-doubling)")),
        }
    }
}

/// Accumulated statistics of one communicator.
#[derive(Clone, Copy, Debug, Default)]
pub struct CommStats {
    /// Operations run (collectives and point-to-point messages, failed ones included).
    pub ops: u64,
    /// Payload bytes the transport sent during this communicator's operations.
    pub bytes_sent: u64,
    /// Wall-clock seconds spent inside operations.
    pub seconds: f64,
}

pub struct Communicator {
    transport: Arc<dyn Transport>,
    /// Group rank -> global rank.
    members: Vec<usize>,
    me: usize,
    /// Distinguishes this group's tags from those of its parent and siblings (world = 0).
    group_id: u32,
    /// Sequence number of the next collective operation.
    seq: u64,
    /// Messages sent to / received from each group rank (point-to-point tag counters).
    p2p_sent: Vec<u64>,
    p2p_received: Vec<u64>,
    timeout: Duration,
    algorithm: Algorithm,
    small_message_threshold: usize,
    segment_bytes: usize,
    scratch: Scratch,
    stats: CommStats,
    broken: Option<String>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.me)
            .field("size", &self.members.len())
            .field("transport", &self.transport.name())
            .field("group_id", &self.group_id)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl Communicator {
    /// The world group of `transport`: group rank = global rank.
    pub fn new(transport: Arc<dyn Transport>, timeout: Duration) -> Self {
        let world = transport.world_size();
        let me = transport.rank();
        Self::with_members(transport, (0..world).collect(), me, 0, timeout)
    }

    fn with_members(
        transport: Arc<dyn Transport>,
        members: Vec<usize>,
        me: usize,
        group_id: u32,
        timeout: Duration,
    ) -> Self {
        let n = members.len();
        Self {
            transport,
            members,
            me,
            group_id,
            seq: 0,
            p2p_sent: vec![0; n],
            p2p_received: vec![0; n],
            timeout,
            algorithm: Algorithm::Auto,
            small_message_threshold: DEFAULT_SMALL_MESSAGE_THRESHOLD,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            scratch: Scratch::default(),
            stats: CommStats::default(),
            broken: None,
        }
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.me
    }

    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// The transport (global) rank of group rank `group_rank`. Panics if it is out of range.
    pub fn global_rank_of(&self, group_rank: usize) -> usize {
        self.members[group_rank]
    }

    pub fn transport_name(&self) -> &'static str {
        self.transport.name()
    }

    /// Where the group's ranks can share memory, if its transport has such a place
    /// ([`Transport::shared_memory`]).
    pub fn shared_memory(&self) -> Option<crate::transport::SharedMemory> {
        self.transport.shared_memory()
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Deadline budget of each later operation (measured from the start of the operation).
    pub fn set_timeout(&mut self, t: Duration) {
        self.timeout = t;
    }

    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// All-reduce algorithm used by [`Communicator::all_reduce`]. Every rank must choose the same.
    pub fn set_algorithm(&mut self, a: Algorithm) {
        self.algorithm = a;
    }

    pub fn small_message_threshold(&self) -> usize {
        self.small_message_threshold
    }

    /// Messages of fewer bytes than this are "small" (see [`DEFAULT_SMALL_MESSAGE_THRESHOLD`]).
    /// Every rank must use the same value.
    pub fn set_small_message_threshold(&mut self, bytes: usize) {
        self.small_message_threshold = bytes;
    }

    /// Upper bound on the payload of one message (default [`DEFAULT_SEGMENT_BYTES`]; at least one
    /// element is always sent). A tuning knob; every rank must use the same value.
    pub fn set_segment_bytes(&mut self, bytes: usize) {
        self.segment_bytes = bytes.max(1);
    }

    pub fn stats(&self) -> CommStats {
        self.stats
    }

    /// `Some(reason)` once an operation has failed; every later call returns [`CommError::Broken`].
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// All-reduce `buf` in place with the configured algorithm.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let alg = self.algorithm;
        self.all_reduce_with(buf, op, alg)
    }

    /// All-reduce `buf` in place with algorithm `alg` (errors are reported as `all_reduce`).
    /// Mean is Sum followed by [`Element::div_count`]`(size)`.
    pub fn all_reduce_with<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        alg: Algorithm,
    ) -> Result<()> {
        self.check_usable()?;
        let alg = match alg {
            Algorithm::Auto if std::mem::size_of_val(buf) < self.small_message_threshold => {
                Algorithm::RecursiveDoubling
            }
            Algorithm::Auto => Algorithm::Ring,
            forced => forced,
        };
        match alg {
            Algorithm::RecursiveDoubling => self.collective(
                "all_reduce",
                OpKind::RecursiveDoublingAllReduce,
                |g, tag, scratch| {
                    recursive_doubling::recursive_doubling_all_reduce(g, tag, buf, op, scratch)
                },
            ),
            _ => self.collective("all_reduce", OpKind::RingAllReduce, |g, tag, scratch| {
                ring::ring_all_reduce(g, tag, buf, op, scratch)
            }),
        }
    }

    /// Broadcast `buf` from group rank `root` to all ranks (binomial tree for small messages,
    /// pipelined chain for large ones).
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        self.check_usable()?;
        if root >= self.size() {
            return Err(CommError::invalid(
                OP,
                format!("root {root} is not a rank of a group of {}", self.size()),
            ));
        }
        if std::mem::size_of_val(buf) < self.small_message_threshold {
            self.collective(OP, OpKind::TreeBroadcast, |g, tag, _| {
                broadcast::binomial_broadcast(g, tag, buf, root)
            })
        } else {
            self.collective(OP, OpKind::ChainBroadcast, |g, tag, _| {
                broadcast::chain_broadcast(g, tag, buf, root)
            })
        }
    }

    /// Gather every rank's `send` into `recv` in rank order; `recv.len()` must be
    /// `send.len() * size()`.
    pub fn all_gather<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        const OP: &str = "all_gather";
        self.check_usable()?;
        if send.len().checked_mul(self.size()) != Some(recv.len()) {
            return Err(CommError::invalid(
                OP,
                format!(
                    "recv holds {} elements but must hold send ({}) × group size ({})",
                    recv.len(),
                    send.len(),
                    self.size()
                ),
            ));
        }
        self.collective(OP, OpKind::AllGather, |g, tag, _| {
            all_gather::all_gather(g, tag, send, recv)
        })
    }

    /// All-gather in place over the full-length `buf`, where this rank holds its chunk
    /// ([`crate::collectives::chunk_range`]`(len, size, rank)`, as [`Communicator::reduce_scatter`]
    /// leaves it) and receives every other rank's chunk into its place. The chunks may differ in
    /// length by one; nothing is copied besides the received bytes. Returns this rank's chunk.
    pub fn all_gather_chunks<T: Element>(&mut self, buf: &mut [T]) -> Result<Range<usize>> {
        self.check_usable()?;
        let (len, n) = (buf.len(), self.size());
        let mine = crate::collectives::chunk_range(len, n, self.rank());
        self.collective("all_gather_chunks", OpKind::AllGather, |g, tag, _| {
            all_gather::ring_all_gather_blocks(g, tag, buf, 0, |i| {
                crate::collectives::chunk_range(len, n, i)
            })
        })?;
        Ok(mine)
    }

    /// Reduce-scatter in place over the full-length `buf`. Returns the range of `buf` this rank
    /// owns ([`crate::collectives::chunk_range`]`(len, size, rank)`), which then holds the
    /// reduction over the group; the rest of `buf` is left with partial results.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<Range<usize>> {
        self.check_usable()?;
        self.collective(
            "reduce_scatter",
            OpKind::ReduceScatter,
            |g, tag, scratch| ring::ring_reduce_scatter(g, tag, buf, op, scratch),
        )
    }

    /// [`Communicator::reduce_scatter`] of a `len`-value vector that is never stored whole:
    /// `values` produces this rank's values for each range the ring needs and consumes the
    /// group's reduction of this rank's chunk, segment by segment (see
    /// [`ring::ring_reduce_scatter_produced`]). Same bits as `reduce_scatter` of the produced
    /// vector; `Mean` is refused.
    pub fn reduce_scatter_produced<T: Element>(
        &mut self,
        len: usize,
        op: ReduceOp,
        values: &mut dyn ring::Produced<T>,
    ) -> Result<Range<usize>> {
        const OP: &str = "reduce_scatter";
        self.check_usable()?;
        if op == ReduceOp::Mean {
            return Err(CommError::invalid(
                OP,
                "a produced reduce-scatter sums, takes max or min; scale the result for a mean",
            ));
        }
        self.collective(OP, OpKind::ReduceScatter, |g, tag, scratch| {
            ring::ring_reduce_scatter_produced(g, tag, len, op, values, scratch)
        })
    }

    /// Return once every rank of the group has called `barrier`.
    pub fn barrier(&mut self) -> Result<()> {
        self.check_usable()?;
        self.collective("barrier", OpKind::Barrier, |g, tag, _| {
            barrier::dissemination_barrier(g, tag)
        })
    }

    /// Send `data` to group rank `peer`; it must call [`Communicator::recv`] with the same length.
    pub fn send<T: Element>(&mut self, peer: usize, data: &[T]) -> Result<()> {
        const OP: &str = "send";
        self.check_usable()?;
        self.check_peer(OP, peer)?;
        let tag = op_tag(OpKind::PointToPoint, self.group_id, self.p2p_sent[peer]);
        self.p2p_sent[peer] = self.p2p_sent[peer].wrapping_add(1);
        self.run(OP, tag, |g, tag, _| p2p::send(g, tag, peer, data))
    }

    /// Receive exactly `buf.len()` elements from group rank `peer`.
    pub fn recv<T: Element>(&mut self, peer: usize, buf: &mut [T]) -> Result<()> {
        const OP: &str = "recv";
        self.check_usable()?;
        self.check_peer(OP, peer)?;
        let tag = op_tag(OpKind::PointToPoint, self.group_id, self.p2p_received[peer]);
        self.p2p_received[peer] = self.p2p_received[peer].wrapping_add(1);
        self.run(OP, tag, |g, tag, _| p2p::recv(g, tag, peer, buf))
    }

    /// Send `data` to group rank `to` while receiving `buf.len()` elements from group rank `from`,
    /// both directions at once, so that two ranks swapping large messages cannot block each other
    /// (each message is matched with the peer's `send`/`recv`/`send_recv` in per-peer order, like
    /// [`Communicator::send`] and [`Communicator::recv`]).
    pub fn send_recv<T: Element>(
        &mut self,
        to: usize,
        data: &[T],
        from: usize,
        buf: &mut [T],
    ) -> Result<()> {
        const OP: &str = "send_recv";
        self.check_usable()?;
        self.check_peer(OP, to)?;
        self.check_peer(OP, from)?;
        let send_tag = op_tag(OpKind::PointToPoint, self.group_id, self.p2p_sent[to]);
        let recv_tag = op_tag(OpKind::PointToPoint, self.group_id, self.p2p_received[from]);
        self.p2p_sent[to] = self.p2p_sent[to].wrapping_add(1);
        self.p2p_received[from] = self.p2p_received[from].wrapping_add(1);
        self.run(OP, send_tag, |g, _, _| {
            p2p::send_recv(g, to, data, send_tag, from, buf, recv_tag)
        })
    }

    /// Split the group (collectively): ranks passing the same `color` form a new group, ordered by
    /// `(key, rank in this group)` (MPI_Comm_split). The new communicator shares this one's
    /// transport and inherits its timeout and tuning; its statistics start at zero.
    pub fn split(&mut self, color: u32, key: u32) -> Result<Communicator> {
        self.check_usable()?;
        let n = self.size();
        let split_seq = self.seq;
        let mine = [i64::from(color), i64::from(key)];
        let mut all = vec![0i64; 2 * n];
        self.collective("split", OpKind::Split, |g, tag, _| {
            all_gather::all_gather(g, tag, &mine, &mut all)
        })?;

        let mut order: Vec<(i64, usize)> = (0..n)
            .filter(|&r| all[2 * r] == i64::from(color))
            .map(|r| (all[2 * r + 1], r))
            .collect();
        order.sort_unstable();
        let members: Vec<usize> = order.iter().map(|&(_, r)| self.members[r]).collect();
        let me = order
            .iter()
            .position(|&(_, r)| r == self.me)
            .expect("this rank passed its own color");
        let mut sub = Communicator::with_members(
            self.transport.clone(),
            members,
            me,
            sub_group_id(self.group_id, split_seq, color),
            self.timeout,
        );
        sub.algorithm = self.algorithm;
        sub.small_message_threshold = self.small_message_threshold;
        sub.segment_bytes = self.segment_bytes;
        Ok(sub)
    }

    fn check_usable(&self) -> Result<()> {
        match &self.broken {
            Some(reason) => Err(CommError::Broken(reason.clone())),
            None => Ok(()),
        }
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size() {
            return Err(CommError::invalid(
                op,
                format!("peer {peer} is not a rank of a group of {}", self.size()),
            ));
        }
        if peer == self.me {
            return Err(CommError::invalid(
                op,
                format!("peer {peer} is this rank itself"),
            ));
        }
        Ok(())
    }

    /// Run a collective: take the next sequence number for its tag, then [`Self::run`].
    fn collective<R>(
        &mut self,
        op: &'static str,
        kind: OpKind,
        f: impl FnOnce(&Group, Tag, &mut Scratch) -> std::result::Result<R, TransportError>,
    ) -> Result<R> {
        let tag = op_tag(kind, self.group_id, self.seq);
        self.seq = self.seq.wrapping_add(1);
        self.run(op, tag, f)
    }

    /// Run one operation under a fresh deadline, account for it, and break the communicator if
    /// the transport failed.
    fn run<R>(
        &mut self,
        op: &'static str,
        tag: Tag,
        f: impl FnOnce(&Group, Tag, &mut Scratch) -> std::result::Result<R, TransportError>,
    ) -> Result<R> {
        let _waiting = crate::activity::waiting();
        let start = Instant::now();
        // A timeout too large to represent means "wait practically forever".
        let deadline = start
            .checked_add(self.timeout)
            .unwrap_or_else(|| start + Duration::from_secs(100 * 365 * 86_400));
        let sent_before = self.transport.bytes_sent();
        let group = Group {
            transport: &*self.transport,
            members: &self.members,
            me: self.me,
            deadline,
            segment_bytes: self.segment_bytes,
        };
        let result = f(&group, tag, &mut self.scratch);
        self.stats.ops += 1;
        self.stats.bytes_sent += self.transport.bytes_sent().saturating_sub(sent_before);
        self.stats.seconds += start.elapsed().as_secs_f64();
        result.map_err(|link| {
            let err = CommError::Op { op, link };
            self.broken = Some(err.to_string());
            err
        })
    }
}

/// Group id of the sub-group with `color` split off `parent` by its operation number `seq`.
/// Every member computes it from values all members share, so no extra message is needed; it is
/// never 0 (the world's id). Distinct splits get distinct ids except for hash collisions, which
/// could only weaken the detection of misordered calls, never pair messages wrongly on their own.
fn sub_group_id(parent: u32, seq: u64, color: u32) -> u32 {
    // splitmix64 finaliser over the three inputs.
    let mut x =
        (u64::from(parent) << 32 | u64::from(color)) ^ seq.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    (x % u64::from(GROUP_ID_MODULUS - 1)) as u32 + 1
}
