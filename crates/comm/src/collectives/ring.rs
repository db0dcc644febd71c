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
//! [`ring_reduce_scatter_produced`] runs the same steps and puts the same bytes on the wire, but
//! this rank's values are produced segment by segment by a callback instead of being read from a
//! full-length buffer, and its finished chunk is handed to a second callback segment by segment:
//! a caller whose values are computed (the exact sum's fixed-point conversion) never stores them
//! all. Memory: two chunk-sized carries for `n > 2` (the partial sums that travel on), none for
//! `n ≤ 2`, instead of the whole vector.
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

/// What [`ring_reduce_scatter_produced`] asks of its caller: this rank's values, made on demand,
/// and a place for its finished chunk.
pub trait Produced<T> {
    /// Write this rank's values for `range` into `dst` (each value is asked for exactly once).
    fn produce(&mut self, range: Range<usize>, dst: &mut [T]);
    /// The group's reduction of `range`: all of this rank's chunk, segment by segment in order.
    fn consume(&mut self, range: Range<usize>, values: &[T]);
    /// Bytes per value of step 0's messages, the only ones that carry a rank's own values
    /// unreduced. `None` (the default): they travel as `T`. A caller whose values have a narrower
    /// exact form on *every* rank (the exact sum's fixed-point value of a single micro-batch is
    /// that `f32` number scaled) returns its size and implements the two methods below; every
    /// rank must return the same.
    fn first_step_bytes(&self) -> Option<usize> {
        None
    }
    /// Step 0's message for `range`: this rank's values in the narrow form, written into
    /// `scratch` (exactly the message's size) or, where the caller already holds them in that
    /// form, borrowed from there (no copy).
    fn encode_first<'s>(&'s mut self, range: Range<usize>, scratch: &'s mut [u8]) -> &'s [u8] {
        let _ = (range, scratch);
        unreachable!("encode_first without first_step_bytes");
    }
    /// `dst` = this rank's values for `range` reduced with the values a peer's step-0 message
    /// `received` carries for it.
    fn produce_with_first(&mut self, range: Range<usize>, received: &[u8], dst: &mut [T]) {
        let _ = (range, received, dst);
        unreachable!("produce_with_first without first_step_bytes");
    }
}

/// [`ring_reduce_scatter`] of a vector of `len` values that is never stored whole: `values`
/// produces this rank's values segment by segment (those it sends or reduces) and consumes its
/// finished chunk segment by segment. The same operations in the same order on every element as
/// `ring_reduce_scatter` of the produced vector (same bits); the same bytes on the wire too, so
/// peers may run either function, unless `values` narrows step 0's messages
/// ([`Produced::first_step_bytes`]), which every rank must then do. `Mean` is not supported (the
/// caller scales what it consumes).
pub fn ring_reduce_scatter_produced<T: Element>(
    g: &Group,
    tag: Tag,
    len: usize,
    op: ReduceOp,
    values: &mut dyn Produced<T>,
    scratch: &mut Scratch,
) -> Result<Range<usize>, TransportError> {
    assert!(op != ReduceOp::Mean, "ring_reduce_scatter_produced: Mean");
    let n = g.size();
    let me = g.me;
    let right = (me + 1) % n;
    let left = (me + n - 1) % n;
    let esz = std::mem::size_of::<T>();
    let nseg = segment_count(chunk_range(len, n, 0).len(), g.seg_elems::<T>());
    let mine = chunk_range(len, n, me);
    let seg_cap = segment(&chunk_range(len, n, 0), nseg, 0).len();
    let narrow = if n > 1 {
        values.first_step_bytes()
    } else {
        None
    };
    // carries[s % 2] holds, at chunk-relative offsets, the partial sums received and reduced at
    // step s, which step s + 1 sends on (two buffers: segment j of two chunks of different
    // lengths need not start at the same offset).
    let chunk_cap = if n > 2 {
        chunk_range(len, n, 0).len()
    } else {
        0
    };
    // Every working buffer comes from the communicator's reusable scratch: no allocation and no
    // zero-filling per call (each range is written before it is read).
    let widest = esz.max(narrow.unwrap_or(0));
    let [incoming_buf, reduced, outgoing, outgoing_narrow, carry0, carry1] = scratch.carve([
        widest * seg_cap,
        esz * seg_cap,
        if narrow.is_some() || n == 1 {
            0
        } else {
            esz * seg_cap
        },
        narrow.map_or(0, |b| b * seg_cap),
        esz * chunk_cap,
        esz * chunk_cap,
    ]);
    let reduced: &mut [T] = bytemuck::cast_slice_mut(reduced);
    let outgoing: &mut [T] = bytemuck::cast_slice_mut(outgoing);
    let carries: [&mut [T]; 2] = [
        bytemuck::cast_slice_mut(carry0),
        bytemuck::cast_slice_mut(carry1),
    ];
    if n == 1 {
        for j in 0..nseg {
            let seg = segment(&mine, nseg, j);
            let v = &mut reduced[..seg.len()];
            values.produce(seg.clone(), v);
            values.consume(seg, v);
        }
        return Ok(mine);
    }
    for s in 0..n - 1 {
        let send_chunk = chunk_range(len, n, (me + 2 * n - s - 1) % n);
        let recv_chunk = chunk_range(len, n, (me + 2 * n - s - 2) % n);
        let t = step_tag(tag, s);
        let last = s == n - 2;
        for j in 0..nseg {
            let send_seg = segment(&send_chunk, nseg, j);
            let recv_seg = segment(&recv_chunk, nseg, j);
            let out: &[u8] = match (s, narrow) {
                (0, Some(b)) => {
                    let scratch = &mut outgoing_narrow[..b * send_seg.len()];
                    let o = values.encode_first(send_seg.clone(), scratch);
                    debug_assert_eq!(o.len(), b * send_seg.len());
                    o
                }
                (0, None) => {
                    let o = &mut outgoing[..send_seg.len()];
                    values.produce(send_seg.clone(), o);
                    as_bytes(o)
                }
                _ => {
                    let at = send_seg.start - send_chunk.start;
                    as_bytes(&carries[(s - 1) % 2][at..at + send_seg.len()])
                }
            };
            let v = &mut reduced[..recv_seg.len()];
            let incoming_bytes = match (s, narrow) {
                (0, Some(b)) => b,
                _ => esz,
            };
            let incoming = &mut incoming_buf[..recv_seg.len() * incoming_bytes];
            g.exchange(right, out, left, incoming, t)?;
            if s == 0 && narrow.is_some() {
                values.produce_with_first(recv_seg.clone(), incoming, v);
            } else {
                values.produce(recv_seg.clone(), v);
                reduce_received(v, incoming, op, false);
            }
            if last {
                values.consume(recv_seg, v);
            } else {
                let at = recv_seg.start - recv_chunk.start;
                carries[s % 2][at..at + recv_seg.len()].copy_from_slice(v);
            }
        }
    }
    Ok(mine)
}
