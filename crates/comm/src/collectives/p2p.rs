//! Point-to-point messages between two group ranks, for pipelines.
//!
//! A message of `S` bytes travels as `⌈S / segment_bytes⌉` segments (none if `S = 0`), all with
//! the message's tag; the receiver states the same length, so both sides derive the same
//! segmentation. Tags come from a counter per (peer, direction) kept by the communicator: the
//! `k`-th message this rank sends to a peer is the `k`-th message that peer receives from it, so
//! sender and receiver agree on tags without coordinating.
//!
//! A send may block (e.g. TCP) until the receiver reads it; two ranks that both send large
//! messages to each other before receiving must either order their calls or use [`send_recv`],
//! which moves both directions at once (segment `j` out with segment `j` in), the way a 1F1B
//! pipeline's neighbours swap activations and gradients.

use super::{as_bytes, as_bytes_mut, segment, segment_count, Group};
use crate::element::Element;
use crate::error::TransportError;
use crate::transport::Tag;

/// Send `data` to group rank `to`.
pub fn send<T: Element>(g: &Group, tag: Tag, to: usize, data: &[T]) -> Result<(), TransportError> {
    let whole = 0..data.len();
    let nseg = segment_count(data.len(), g.seg_elems::<T>());
    for j in 0..nseg {
        g.send(to, as_bytes(&data[segment(&whole, nseg, j)]), tag)?;
    }
    Ok(())
}

/// Receive exactly `buf.len()` elements from group rank `from`, directly into `buf`.
pub fn recv<T: Element>(
    g: &Group,
    tag: Tag,
    from: usize,
    buf: &mut [T],
) -> Result<(), TransportError> {
    let whole = 0..buf.len();
    let nseg = segment_count(buf.len(), g.seg_elems::<T>());
    for j in 0..nseg {
        g.recv(from, as_bytes_mut(&mut buf[segment(&whole, nseg, j)]), tag)?;
    }
    Ok(())
}

/// Send `data` to group rank `to` (tag `send_tag`) while receiving `buf.len()` elements from group
/// rank `from` (tag `recv_tag`). Segment `j` of each direction moves in the same transport call;
/// when one side has more segments, its remaining segments move alone.
pub fn send_recv<T: Element>(
    g: &Group,
    to: usize,
    data: &[T],
    send_tag: Tag,
    from: usize,
    buf: &mut [T],
    recv_tag: Tag,
) -> Result<(), TransportError> {
    let per = g.seg_elems::<T>();
    let (out_all, in_all) = (0..data.len(), 0..buf.len());
    let (n_out, n_in) = (
        segment_count(data.len(), per),
        segment_count(buf.len(), per),
    );
    for j in 0..n_out.max(n_in) {
        let out: &[T] = if j < n_out {
            &data[segment(&out_all, n_out, j)]
        } else {
            &[]
        };
        let into: &mut [T] = if j < n_in {
            let r = segment(&in_all, n_in, j);
            &mut buf[r]
        } else {
            &mut []
        };
        g.exchange_tagged(
            to,
            as_bytes(out),
            send_tag,
            from,
            as_bytes_mut(into),
            recv_tag,
        )?;
    }
    Ok(())
}
