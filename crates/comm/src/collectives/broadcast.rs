//! Broadcast from `root` to every rank of the group, in place.
//!
//! Ranks are renumbered relative to the root, `v = (r - root) mod n`.
//!
//! **Binomial tree** ([`binomial_broadcast`], for small messages): rank `v ≠ 0` receives the buffer
//! from `v - 2^k`, where `2^k` is the lowest set bit of `v`, then sends it to `v + 2^j` for every
//! `2^j < 2^k` (largest first, so the biggest subtree starts earliest) with `v + 2^j < n`.
//! `⌈log2 n⌉` rounds; each non-root receives `S` bytes once; a rank sends `S` per child (the root
//! `⌈log2 n⌉·S`).
//!
//! **Pipelined chain** ([`chain_broadcast`], for large messages): the buffer is cut into `m`
//! segments and flows `v = 0 → 1 → … → n-1`. In step `t` a middle rank forwards segment `t-1`
//! to the right while receiving segment `t` from the left (one `send_recv`), so all links carry
//! data at once. `m + n - 2` steps of one segment; every rank except the last sends `S` bytes
//! once and every non-root receives `S` once: bandwidth-optimal, with a latency of `n-2` extra
//! segments instead of `log2 n` whole buffers.
//!
//! Both receive directly into the caller's buffer; neither allocates.

use super::{as_bytes, as_bytes_mut, segment, segment_count, split_send_recv, step_tag, Group};
use crate::element::Element;
use crate::error::TransportError;
use crate::transport::Tag;

/// Binomial-tree broadcast of `buf` from group rank `root`.
pub fn binomial_broadcast<T: Element>(
    g: &Group,
    tag: Tag,
    buf: &mut [T],
    root: usize,
) -> Result<(), TransportError> {
    let n = g.size();
    let v = (g.me + n - root) % n;
    let to_group_rank = |rel: usize| (rel + root) % n;
    let whole = 0..buf.len();
    let nseg = segment_count(buf.len(), g.seg_elems::<T>());

    // Receive from the parent (the root has none): mask ends as v's lowest set bit, or the first
    // power of two ≥ n for the root.
    let mut mask = 1;
    while mask < n {
        if v & mask != 0 {
            let parent = to_group_rank(v - mask);
            let t = step_tag(tag, mask.ilog2() as usize);
            for j in 0..nseg {
                g.recv(parent, as_bytes_mut(&mut buf[segment(&whole, nseg, j)]), t)?;
            }
            break;
        }
        mask <<= 1;
    }
    // Send to the children, biggest subtree first.
    mask >>= 1;
    while mask > 0 {
        if v + mask < n {
            let child = to_group_rank(v + mask);
            let t = step_tag(tag, mask.ilog2() as usize);
            for j in 0..nseg {
                g.send(child, as_bytes(&buf[segment(&whole, nseg, j)]), t)?;
            }
        }
        mask >>= 1;
    }
    Ok(())
}

/// Pipelined-chain broadcast of `buf` from group rank `root`.
pub fn chain_broadcast<T: Element>(
    g: &Group,
    tag: Tag,
    buf: &mut [T],
    root: usize,
) -> Result<(), TransportError> {
    let n = g.size();
    if n == 1 {
        return Ok(());
    }
    let me = g.me;
    let v = (me + n - root) % n;
    let left = (me + n - 1) % n;
    let right = (me + 1) % n;
    let has_right = v + 1 < n;
    let whole = 0..buf.len();
    let nseg = segment_count(buf.len(), g.seg_elems::<T>());
    // send_recv carries one tag for both directions and a middle rank forwards segment t-1 while
    // receiving segment t, so all messages of the chain share the base tag (FIFO keeps order).
    let t = step_tag(tag, 0);

    if v == 0 {
        for j in 0..nseg {
            g.send(right, as_bytes(&buf[segment(&whole, nseg, j)]), t)?;
        }
        return Ok(());
    }
    for step in 0..=nseg {
        let recv_seg = if step < nseg {
            segment(&whole, nseg, step)
        } else {
            whole.end..whole.end
        };
        let send_seg = if step > 0 && has_right {
            segment(&whole, nseg, step - 1)
        } else {
            whole.start..whole.start
        };
        let (out, into) = split_send_recv(buf, send_seg, recv_seg);
        g.exchange(right, as_bytes(out), left, as_bytes_mut(into), t)?;
    }
    Ok(())
}
