//! Ring all-gather: every rank contributes one block and ends with all blocks in rank order.
//!
//! Steps `s = 0..n-1`: rank `r` sends block `r-s` to its right neighbour while receiving block
//! `r-s-1` from its left neighbour (one `send_recv` per segment, so large blocks cannot deadlock),
//! directly into its place in the caller's buffer: no staging copy, no scratch.
//!
//! Cost per rank with blocks of `B` bytes: `n-1` steps, `(n-1)·B` bytes sent and received, which
//! is the minimum (every rank must receive the `n-1` blocks it lacks). `ring_all_gather_blocks`
//! is also the second half of ring all-reduce, where blocks are the unequal [`super::chunk_range`]
//! chunks.

use std::ops::Range;

use super::{as_bytes, as_bytes_mut, segment, segment_count, split_send_recv, step_tag, Group};
use crate::element::Element;
use crate::error::TransportError;
use crate::transport::Tag;

/// All-gather equal blocks: `recv.len() == send.len() * g.size()`; afterwards
/// `recv[i*B..(i+1)*B]` holds group rank `i`'s `send`.
///
/// Panics if the lengths do not match (the communicator checks them first).
pub fn all_gather<T: Element>(
    g: &Group,
    tag: Tag,
    send: &[T],
    recv: &mut [T],
) -> Result<(), TransportError> {
    let b = send.len();
    assert_eq!(
        recv.len(),
        b * g.size(),
        "all_gather: recv must hold size × send"
    );
    recv[g.me * b..(g.me + 1) * b].copy_from_slice(send);
    ring_all_gather_blocks(g, tag, recv, 0, |i| i * b..(i + 1) * b)
}

/// Ring all-gather over `buf` where group rank `i` owns `block(i)` (disjoint ranges) and `buf`
/// already holds this rank's block. Step tags start at `first_step`.
pub(crate) fn ring_all_gather_blocks<T: Element>(
    g: &Group,
    tag: Tag,
    buf: &mut [T],
    first_step: usize,
    block: impl Fn(usize) -> Range<usize>,
) -> Result<(), TransportError> {
    let n = g.size();
    let me = g.me;
    let right = (me + 1) % n;
    let left = (me + n - 1) % n;
    // Same segment count for every block, so sender and receiver of a block agree on its pieces.
    let longest = (0..n).map(|i| block(i).len()).max().unwrap_or(0);
    let nseg = segment_count(longest, g.seg_elems::<T>());
    for s in 0..n.saturating_sub(1) {
        let send_block = block((me + n - s) % n);
        let recv_block = block((me + 2 * n - s - 1) % n);
        let t = step_tag(tag, first_step + s);
        for j in 0..nseg {
            let (out, into) = split_send_recv(
                buf,
                segment(&send_block, nseg, j),
                segment(&recv_block, nseg, j),
            );
            g.exchange(right, as_bytes(out), left, as_bytes_mut(into), t)?;
        }
    }
    Ok(())
}
