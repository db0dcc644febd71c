//! Dissemination barrier: no rank leaves before every rank has arrived.
//!
//! Rounds `k = 0..⌈log2 n⌉`: rank `r` sends a 1-byte token to `r + 2^k` while receiving one from
//! `r - 2^k` (mod `n`, one `send_recv`). By induction, after round `k` a rank has heard, directly
//! or indirectly, from the `2^(k+1) - 1` ranks before it, so after the last round from all of them.
//!
//! Cost per rank: `⌈log2 n⌉` rounds, `⌈log2 n⌉` bytes sent. Unlike a tree barrier there is no
//! root and no separate release phase, so it needs half the latency.

use super::{step_tag, Group};
use crate::error::TransportError;
use crate::transport::Tag;

/// Block until every rank of the group has entered the barrier (or the deadline passes).
pub fn dissemination_barrier(g: &Group, tag: Tag) -> Result<(), TransportError> {
    let n = g.size();
    let me = g.me;
    let mut dist = 1;
    let mut round = 0;
    while dist < n {
        let mut token = [0u8; 1];
        g.exchange(
            (me + dist) % n,
            &[1u8],
            (me + n - dist) % n,
            &mut token,
            step_tag(tag, round),
        )?;
        dist <<= 1;
        round += 1;
    }
    Ok(())
}
