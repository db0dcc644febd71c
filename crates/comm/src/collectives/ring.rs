//! Ring all-reduce and ring reduce-scatter: the bandwidth-optimal algorithms for large messages.
//!
//! The buffer of `S` bytes is cut into `n` chunks with [`chunk_range`]; rank `r` owns chunk `r`.
//! Every step is one `Group::exchange` (a `send_recv`): send to the right neighbour `r+1` while
//! receiving from the left neighbour `r-1`, so no rank ever blocks in a plain send that nobody
//! reads, however large the chunks (TCP buffers cannot deadlock the ring). Each chunk travels in
//! segments of at most `segment_bytes`, and a received segment is reduced immediately, while it is
//! still in cache.
//!
//! 1. Reduce-scatter, steps `s = 0..n-1`: send chunk `r-s-1`, receive chunk `r-s-2` and reduce it
//!    into the local copy (`local ∘ received`). After `n-1` steps chunk `r` holds the reduction of
//!    all ranks. Mean divides the owned chunk by `n` here, once per element in the whole group.
//! 2. All-gather, steps `s = 0..n-1` (`all_gather::ring_all_gather_blocks`): send chunk `r-s`, receive chunk
//!    `r-s-1` straight into the caller's buffer (no copy, no reduction).
//!
//! Cost per rank: reduce-scatter `n-1` steps and `(n-1)/n·S` bytes sent; all-reduce `2(n-1)`
//! steps and `2(n-1)/n·S` bytes sent (the minimum possible for an all-reduce). Latency grows with
//! `n`, which is why small messages use [`super::recursive_doubling`].
//!
//! Determinism: each element's final value is computed by exactly one rank (its chunk's owner) in
//! a fixed order and then copied to all others, so every rank ends with identical bits, and the
//! same group size, length and segment size give the same bits run after run.

use std::ops::Range;

use super::all_gather::ring_all_gather_blocks;
use super::{
    as_bytes, chunk_range, divide, reduce_received, segment, segment_count, step_tag, Group,
    Scratch,
};
use crate::element::{Element, ReduceOp};
use crate::error::TransportError;
use crate::transport::Tag;

/// All-reduce `buf` in place across the group (reduce-scatter, then all-gather).
pub fn ring_all_reduce<T: Element>(
    g: &Group,
    tag: Tag,
    buf: &mut [T],
    op: ReduceOp,
    scratch: &mut Scratch,
) -> Result<(), TransportError> {
    let n = g.size();
    let len = buf.len();
    ring_reduce_scatter(g, tag, buf, op, scratch)?;
    // Steps continue after reduce-scatter's n-1, so a rank that skipped a phase mismatches tags.
    ring_all_gather_blocks(g, tag, buf, n - 1, |i| chunk_range(len, n, i))
}

/// Reduce-scatter in place on the full-length `buf`: afterwards `buf[returned range]` (chunk
/// `g.me` of [`chunk_range`]) holds the reduction over the group; the rest of `buf` holds partial
/// sums and should be treated as garbage.
pub fn ring_reduce_scatter<T: Element>(
    g: &Group,
    tag: Tag,
    buf: &mut [T],
    op: ReduceOp,
    scratch: &mut Scratch,
) -> Result<Range<usize>, TransportError> {
    let n = g.size();
    let me = g.me;
    let len = buf.len();
    let right = (me + 1) % n;
    let left = (me + n - 1) % n;
    let esz = std::mem::size_of::<T>();
    // Chunk 0 is the largest; every chunk is cut into the same number of segments, so sender and
    // receiver of a chunk agree on its segments.
    let nseg = segment_count(chunk_range(len, n, 0).len(), g.seg_elems::<T>());
    for s in 0..n - 1 {
        let send_chunk = chunk_range(len, n, (me + 2 * n - s - 1) % n);
        let recv_chunk = chunk_range(len, n, (me + 2 * n - s - 2) % n);
        let t = step_tag(tag, s);
        for j in 0..nseg {
            let send_seg = segment(&send_chunk, nseg, j);
            let recv_seg = segment(&recv_chunk, nseg, j);
            let incoming = scratch.bytes(recv_seg.len() * esz);
            g.exchange(right, as_bytes(&buf[send_seg]), left, incoming, t)?;
            reduce_received(&mut buf[recv_seg], incoming, op, false);
        }
    }
    let mine = chunk_range(len, n, me);
    if op == ReduceOp::Mean && n > 1 {
        divide(&mut buf[mine.clone()], n);
    }
    Ok(mine)
}
