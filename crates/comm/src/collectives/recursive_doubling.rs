//! Recursive-doubling all-reduce: the latency-optimal algorithm for small messages.
//!
//! With `p` the largest power of two `≤ n` and `rem = n - p`:
//! 1. Fold (only if `n` is not a power of two): among ranks `< 2·rem`, each even rank sends its
//!    whole buffer to the odd rank above it, which reduces it in; the even ranks then sit out.
//!    The `p` remaining ranks are renumbered `0..p` (`r/2` for odd `r < 2·rem`, `r - rem` above).
//! 2. `log2 p` steps, `mask = 1, 2, 4, …`: exchange the whole buffer with the rank whose new number
//!    differs in bit `mask` (one `send_recv` per segment) and reduce. After the last step every
//!    remaining rank holds the full reduction; Mean divides here.
//! 3. Unfold: each odd rank `< 2·rem` sends the result to the even rank below it, which receives
//!    it straight into its buffer.
//!
//! Cost per rank with a buffer of `S` bytes: a remaining rank sends `log2 p · S` bytes in
//! `log2 p` steps (plus `S` in step 3 if a rank was folded into it); a folded-out rank sends `S`.
//! At most `⌊log2 n⌋ + 2` message latencies: more bytes than the ring's `2(n-1)/n · S`, but far
//! fewer round trips, which is what matters for small messages.
//!
//! Determinism: two partners compute the same value independently, so they combine in one
//! canonical order, the lower-numbered side's operand first (Max/Min are not commutative for
//! signed zeros and NaNs); every rank therefore ends with identical bits.

use super::{
    as_bytes, as_bytes_mut, divide, reduce_received, segment, segment_count, step_tag, Group,
    Scratch,
};
use crate::element::{Element, ReduceOp};
use crate::error::TransportError;
use crate::transport::Tag;

/// All-reduce `buf` in place across the group.
pub fn recursive_doubling_all_reduce<T: Element>(
    g: &Group,
    tag: Tag,
    buf: &mut [T],
    op: ReduceOp,
    scratch: &mut Scratch,
) -> Result<(), TransportError> {
    let n = g.size();
    let me = g.me;
    let p = 1usize << n.ilog2();
    let rem = n - p;
    let whole = 0..buf.len();
    let nseg = segment_count(buf.len(), g.seg_elems::<T>());
    let esz = std::mem::size_of::<T>();
    let last_step = p.ilog2() as usize + 1;

    // Step 1 (fold) and, for the even ranks that sit out, step 3 (unfold).
    let new_rank = if me < 2 * rem {
        if me & 1 == 0 {
            let t = step_tag(tag, 0);
            for j in 0..nseg {
                g.send(me + 1, as_bytes(&buf[segment(&whole, nseg, j)]), t)?;
            }
            let t = step_tag(tag, last_step);
            for j in 0..nseg {
                g.recv(me + 1, as_bytes_mut(&mut buf[segment(&whole, nseg, j)]), t)?;
            }
            return Ok(());
        }
        let t = step_tag(tag, 0);
        for j in 0..nseg {
            let seg = segment(&whole, nseg, j);
            let incoming = scratch.bytes(seg.len() * esz);
            g.recv(me - 1, incoming, t)?;
            // The partner is the lower rank: its operand goes first.
            reduce_received(&mut buf[seg], incoming, op, true);
        }
        me / 2
    } else {
        me - rem
    };
    let old_rank = |new: usize| if new < rem { 2 * new + 1 } else { new + rem };

    // Step 2: butterfly exchanges among the p remaining ranks.
    let mut mask = 1;
    let mut step = 1;
    while mask < p {
        let partner_new = new_rank ^ mask;
        let partner = old_rank(partner_new);
        let t = step_tag(tag, step);
        for j in 0..nseg {
            let seg = segment(&whole, nseg, j);
            let incoming = scratch.bytes(seg.len() * esz);
            // Segment j is sent before it is reduced, and later segments are untouched until
            // their own turn, so each exchange sends the pre-step value as the algorithm needs.
            g.exchange(partner, as_bytes(&buf[seg.clone()]), partner, incoming, t)?;
            reduce_received(&mut buf[seg], incoming, op, partner_new < new_rank);
        }
        mask <<= 1;
        step += 1;
    }
    if op == ReduceOp::Mean && n > 1 {
        divide(buf, n);
    }

    // Step 3: hand the result back to the rank folded into this one.
    if me < 2 * rem {
        let t = step_tag(tag, last_step);
        for j in 0..nseg {
            g.send(me - 1, as_bytes(&buf[segment(&whole, nseg, j)]), t)?;
        }
    }
    Ok(())
}
