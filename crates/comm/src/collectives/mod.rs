//! Collective algorithms as plain functions over a [`Transport`] (gloo style).
//!
//! Every algorithm takes a [`Group`] (who takes part, and until when we wait) and a base [`Tag`]
//! made by [`op_tag`], and returns the first [`TransportError`] it meets. Wrapping errors with the
//! operation's name, choosing an algorithm and counting operations is the job of
//! [`crate::Communicator`]; this module only moves and reduces bytes.
//!
//! Shared conventions:
//! - Ranks inside a group are *group ranks* `0..members.len()`; `members[r]` is the global rank
//!   the transport knows. Errors therefore name global ranks, which is what a user can look up.
//! - Large buffers travel in segments of at most [`Group::segment_bytes`] so that a received
//!   segment is reduced while it is still in cache and no frame grows without bound. Sender and
//!   receiver derive the same segmentation from lengths both know (SPMD), so segment boundaries
//!   never travel on the wire.
//! - A message both sides know to be empty is not sent at all (see `Group::exchange`).
//!
//! Files: [`ring`] (bandwidth-optimal all-reduce and reduce-scatter), [`recursive_doubling`]
//! (latency-optimal all-reduce), [`broadcast`] (binomial tree, pipelined chain), [`all_gather`]
//! (ring), [`barrier`] (dissemination), [`p2p`] (point-to-point for pipelines).

pub mod all_gather;
pub mod barrier;
pub mod broadcast;
pub mod p2p;
pub mod recursive_doubling;
pub mod ring;

use std::ops::Range;
use std::time::Instant;

use crate::element::{reduce_bytes_into, Element, ReduceOp};
use crate::error::TransportError;
use crate::transport::{Tag, Transport};

/// Default upper bound on the bytes of one segment (one `send_recv`). Two segments (the one
/// received and the slice of the caller's buffer it is reduced into) fit in a typical L2 cache.
pub const DEFAULT_SEGMENT_BYTES: usize = 512 * 1024;

/// Which operation (and which algorithm of it) a message belongs to. Part of every tag, so ranks
/// that disagree about what they are doing get a protocol error instead of mixing up messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum OpKind {
    RingAllReduce = 1,
    RecursiveDoublingAllReduce = 2,
    ReduceScatter = 3,
    TreeBroadcast = 4,
    ChainBroadcast = 5,
    AllGather = 6,
    Barrier = 7,
    Split = 8,
    PointToPoint = 9,
}

const KIND_SHIFT: u32 = 60;
const GROUP_SHIFT: u32 = 36;
const GROUP_BITS: u32 = 24;
const SEQ_SHIFT: u32 = 8;
const SEQ_BITS: u32 = 28;
const STEP_BITS: u32 = 8;

/// Largest group id [`op_tag`] keeps apart (ids are taken modulo `GROUP_ID_MODULUS`).
pub const GROUP_ID_MODULUS: u32 = 1 << GROUP_BITS;

/// Base tag of one operation: `kind (4 bits) | group id (24) | sequence number (28) | step (8)`.
///
/// The sequence number is per communicator and counts collective operations (or, for
/// point-to-point, messages per peer and direction), so consecutive operations never share a tag;
/// the group id keeps a sub-group's messages apart from its parent's on the links they share.
/// Fields wrap, which is harmless: every rank wraps identically, and a wrapped tag could only
/// collide with a message 2^28 operations older, long since consumed on a FIFO link.
pub fn op_tag(kind: OpKind, group_id: u32, seq: u64) -> Tag {
    ((kind as u64) << KIND_SHIFT)
        | ((group_id as u64 & ((1 << GROUP_BITS) - 1)) << GROUP_SHIFT)
        | ((seq & ((1 << SEQ_BITS) - 1)) << SEQ_SHIFT)
}

/// Tag of step `step` of the operation whose base tag is `tag` (step taken modulo 256). Both sides
/// of a message are in the same step, so this catches ranks that lost step with each other.
#[inline]
pub fn step_tag(tag: Tag, step: usize) -> Tag {
    (tag & !((1 << STEP_BITS) - 1)) | (step as u64 & ((1 << STEP_BITS) - 1))
}

/// The `i`-th of `parts` contiguous, nearly equal pieces of `0..len`: the first `len % parts`
/// pieces have one element more. Every rank computes chunk boundaries with this one function, so
/// ring all-reduce, reduce-scatter and segmentation always agree.
///
/// Panics if `parts == 0` or `i >= parts`.
#[inline]
pub fn chunk_range(len: usize, parts: usize, i: usize) -> Range<usize> {
    assert!(i < parts, "chunk {i} of {parts}");
    let base = len / parts;
    let extra = len % parts;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// Number of segments needed so that no piece of a range of `max_len` elements exceeds
/// `seg_elems`. At least 1, so a loop over segments runs once even for empty ranges.
#[inline]
pub(crate) fn segment_count(max_len: usize, seg_elems: usize) -> usize {
    max_len.div_ceil(seg_elems.max(1)).max(1)
}

/// Segment `j` of `nseg` of `range` (absolute indices).
#[inline]
pub(crate) fn segment(range: &Range<usize>, nseg: usize, j: usize) -> Range<usize> {
    let r = chunk_range(range.len(), nseg, j);
    range.start + r.start..range.start + r.end
}

/// The ranks taking part in one operation, seen from one of them.
#[derive(Clone, Copy)]
pub struct Group<'a> {
    pub transport: &'a dyn Transport,
    /// Group rank -> global rank.
    pub members: &'a [usize],
    /// This process's group rank.
    pub me: usize,
    /// No transport call of the operation may block past this.
    pub deadline: Instant,
    /// Upper bound on the payload bytes of one message.
    pub segment_bytes: usize,
}

impl<'a> Group<'a> {
    #[inline]
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Elements of `T` per segment (at least one).
    #[inline]
    pub(crate) fn seg_elems<T>(&self) -> usize {
        (self.segment_bytes / std::mem::size_of::<T>().max(1)).max(1)
    }

    pub(crate) fn send(&self, to: usize, data: &[u8], tag: Tag) -> Result<(), TransportError> {
        if data.is_empty() {
            return Ok(());
        }
        self.transport
            .send(self.members[to], tag, data, self.deadline)
    }

    pub(crate) fn recv(&self, from: usize, buf: &mut [u8], tag: Tag) -> Result<(), TransportError> {
        if buf.is_empty() {
            return Ok(());
        }
        self.transport
            .recv(self.members[from], tag, buf, self.deadline)
    }

    /// Send `send` to group rank `to` while receiving `recv` from group rank `from`. Sides that are
    /// empty are skipped (both ends know the lengths), so ring steps over empty chunks cost nothing
    /// and transports never see zero-length frames.
    pub(crate) fn exchange(
        &self,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
        tag: Tag,
    ) -> Result<(), TransportError> {
        match (send.is_empty(), recv.is_empty()) {
            (true, true) => Ok(()),
            (false, true) => self.send(to, send, tag),
            (true, false) => self.recv(from, recv, tag),
            (false, false) => self.transport.send_recv(
                self.members[to],
                send,
                self.members[from],
                recv,
                tag,
                self.deadline,
            ),
        }
    }

    /// [`Group::exchange`] with a different tag for each direction (pipelines: activations one
    /// way, gradients the other, each stream with its own message counter).
    pub(crate) fn exchange_tagged(
        &self,
        to: usize,
        send: &[u8],
        send_tag: Tag,
        from: usize,
        recv: &mut [u8],
        recv_tag: Tag,
    ) -> Result<(), TransportError> {
        match (send.is_empty(), recv.is_empty()) {
            (true, true) => Ok(()),
            (false, true) => self.send(to, send, send_tag),
            (true, false) => self.recv(from, recv, recv_tag),
            (false, false) => self.transport.send_recv_tagged(
                self.members[to],
                send,
                send_tag,
                self.members[from],
                recv,
                recv_tag,
                self.deadline,
            ),
        }
    }
}

/// Reusable buffers for reducing algorithms (a received segment; the produced reduce-scatter's
/// working segments and carries), kept by the communicator so that steady-state collectives do
/// not allocate. Backed by `u64` words so the bytes are aligned
/// for every built-in element type and reductions take the aligned fast path.
#[derive(Default)]
pub struct Scratch {
    words: Vec<u64>,
}

impl Scratch {
    /// A zero-initialised-or-stale byte buffer of exactly `n` bytes (contents are overwritten by
    /// the receive that follows).
    pub fn bytes(&mut self, n: usize) -> &mut [u8] {
        let words = n.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words[..words])[..n]
    }

    /// `K` disjoint byte buffers of the given sizes, each 8-byte aligned, from the same reusable
    /// storage as [`Scratch::bytes`] (contents are stale: write before reading).
    pub fn carve<const K: usize>(&mut self, sizes: [usize; K]) -> [&mut [u8]; K] {
        let total: usize = sizes.iter().map(|n| n.div_ceil(8)).sum();
        if self.words.len() < total {
            self.words.resize(total, 0);
        }
        let mut rest: &mut [u64] = &mut self.words[..total];
        sizes.map(|n| {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n.div_ceil(8));
            rest = tail;
            &mut bytemuck::cast_slice_mut::<u64, u8>(head)[..n]
        })
    }
}

/// Reduce received bytes into `acc`. `received_first` picks the operand order
/// (`received ∘ acc` instead of `acc ∘ received`): algorithms in which two ranks compute the same
/// value independently use it to combine in one canonical (rank) order, because Max/Min are not
/// commutative for signed zeros and NaNs, and every rank must end with identical bits.
pub(crate) fn reduce_received<T: Element>(
    acc: &mut [T],
    received: &[u8],
    op: ReduceOp,
    received_first: bool,
) {
    if !received_first {
        reduce_bytes_into(acc, received, op);
        return;
    }
    match bytemuck::try_cast_slice::<u8, T>(received) {
        Ok(src) => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a = s.combine(*a, op);
            }
        }
        Err(_) => {
            let sz = std::mem::size_of::<T>();
            for (i, a) in acc.iter_mut().enumerate() {
                let s: T = bytemuck::pod_read_unaligned(&received[i * sz..(i + 1) * sz]);
                *a = s.combine(*a, op);
            }
        }
    }
}

/// Divide every element by the group size (the second half of `ReduceOp::Mean`).
pub(crate) fn divide<T: Element>(buf: &mut [T], n: usize) {
    for x in buf {
        *x = x.div_count(n);
    }
}

/// `(&buf[send], &mut buf[recv])` for two disjoint ranges of one buffer: lets ring steps send
/// from and receive straight into the caller's buffer without copies.
pub(crate) fn split_send_recv<T>(
    buf: &mut [T],
    send: Range<usize>,
    recv: Range<usize>,
) -> (&[T], &mut [T]) {
    if send.end <= recv.start {
        let (lo, hi) = buf.split_at_mut(recv.start);
        (&lo[send], &mut hi[..recv.len()])
    } else {
        assert!(
            recv.end <= send.start,
            "overlapping ranges {send:?} and {recv:?}"
        );
        let (lo, hi) = buf.split_at_mut(send.start);
        (&hi[..send.len()], &mut lo[recv])
    }
}

#[inline]
pub(crate) fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

#[inline]
pub(crate) fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carved_buffers_are_aligned_disjoint_and_of_the_asked_sizes() {
        let mut scratch = Scratch::default();
        for sizes in [[0usize, 5, 16, 3], [8, 0, 0, 1], [4096, 7, 64, 0]] {
            let parts = scratch.carve(sizes);
            for (k, part) in parts.into_iter().enumerate() {
                assert_eq!(part.len(), sizes[k]);
                assert_eq!(part.as_ptr() as usize % 8, 0, "part {k} of {sizes:?}");
                part.fill(k as u8 + 1);
            }
            // Written part by part, each keeps its own value: no two overlap.
            let parts = scratch.carve(sizes);
            for (k, part) in parts.iter().enumerate() {
                assert!(
                    part.iter().all(|&b| b == k as u8 + 1),
                    "part {k} of {sizes:?}"
                );
            }
        }
    }

    #[test]
    fn chunks_partition_exactly_and_differ_by_at_most_one() {
        for len in [0usize, 1, 2, 7, 8, 9, 7919] {
            for parts in 1..=9 {
                let mut next = 0;
                let sizes: Vec<usize> = (0..parts)
                    .map(|i| {
                        let r = chunk_range(len, parts, i);
                        assert_eq!(r.start, next, "len {len} parts {parts} chunk {i}");
                        next = r.end;
                        r.len()
                    })
                    .collect();
                assert_eq!(next, len);
                let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                assert!(hi - lo <= 1, "len {len} parts {parts}: {sizes:?}");
                // Larger chunks come first, so chunk 0 is the largest (segment counts rely on it).
                assert_eq!(*hi, sizes[0]);
            }
        }
    }

    #[test]
    fn segments_never_exceed_the_bound() {
        for (len, seg) in [
            (0usize, 4usize),
            (1, 4),
            (9, 4),
            (16, 4),
            (17, 4),
            (1000, 1),
        ] {
            let n = segment_count(len, seg);
            let r = 3..3 + len;
            let mut next = r.start;
            for j in 0..n {
                let s = segment(&r, n, j);
                assert!(s.len() <= seg);
                assert_eq!(s.start, next);
                next = s.end;
            }
            assert_eq!(next, r.end);
        }
    }

    #[test]
    fn tags_separate_kind_group_sequence_and_step() {
        let t = op_tag(OpKind::RingAllReduce, 5, 7);
        assert_ne!(t, op_tag(OpKind::RecursiveDoublingAllReduce, 5, 7));
        assert_ne!(t, op_tag(OpKind::RingAllReduce, 6, 7));
        assert_ne!(t, op_tag(OpKind::RingAllReduce, 5, 8));
        assert_ne!(step_tag(t, 1), step_tag(t, 2));
        assert_eq!(step_tag(step_tag(t, 1), 0), t);
        // Out-of-range fields wrap instead of spilling into their neighbours.
        assert_eq!(
            op_tag(OpKind::Barrier, GROUP_ID_MODULUS + 3, 0),
            op_tag(OpKind::Barrier, 3, 0)
        );
        assert_eq!(
            op_tag(OpKind::Barrier, 3, 1 << 28),
            op_tag(OpKind::Barrier, 3, 0)
        );
    }

    #[test]
    fn reversed_reduction_puts_the_received_operand_first() {
        // Max(-0.0, +0.0) keeps the first operand, so the order is observable.
        let mut acc = [0.0f32];
        reduce_received(
            &mut acc,
            bytemuck::cast_slice(&[-0.0f32]),
            ReduceOp::Max,
            true,
        );
        assert!(acc[0].is_sign_negative());
        let mut acc = [0.0f32];
        reduce_received(
            &mut acc,
            bytemuck::cast_slice(&[-0.0f32]),
            ReduceOp::Max,
            false,
        );
        assert!(acc[0].is_sign_positive());
    }

    #[test]
    fn split_send_recv_works_in_both_orders() {
        let mut v = [0, 1, 2, 3, 4, 5];
        let (s, r) = split_send_recv(&mut v, 0..2, 4..6);
        assert_eq!(s, &[0, 1]);
        r.copy_from_slice(&[9, 9]);
        let (s, r) = split_send_recv(&mut v, 4..6, 1..3);
        assert_eq!(s, &[9, 9]);
        r.copy_from_slice(&[7, 7]);
        assert_eq!(v, [0, 7, 7, 3, 9, 9]);
    }
}
