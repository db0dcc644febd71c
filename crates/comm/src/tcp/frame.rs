//! One data frame, sent or received incrementally on a nonblocking socket.
//!
//! Header (24 bytes, little-endian): `MAGIC` · version u16 · reserved u16 · tag u64 · len u64,
//! then `len` payload bytes. Sending gathers header and payload into one `sendmsg`; receiving
//! scatters them with `readv`, the payload straight into the caller's buffer.

use std::io::ErrorKind;
use std::os::fd::RawFd;
use std::time::Instant;

use crate::error::LinkFailure;
use crate::transport::Tag;
use crate::wire::{self, PREFIX_LEN};

pub(crate) const HEADER_LEN: usize = PREFIX_LEN + 2 + 8 + 8;

pub(crate) fn frame_header(tag: Tag, len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..PREFIX_LEN].copy_from_slice(&wire::prefix());
    h[PREFIX_LEN + 2..PREFIX_LEN + 10].copy_from_slice(&tag.to_le_bytes());
    h[PREFIX_LEN + 10..].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

fn io_failure(e: std::io::Error) -> LinkFailure {
    match e.kind() {
        ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::BrokenPipe
        | ErrorKind::NotConnected => LinkFailure::Closed,
        _ => LinkFailure::Io(e.to_string()),
    }
}

/// An outgoing frame, written incrementally.
pub(crate) struct SendOp<'a> {
    header: [u8; HEADER_LEN],
    payload: &'a [u8],
    done: usize,
}

impl<'a> SendOp<'a> {
    pub(crate) fn new(tag: Tag, payload: &'a [u8]) -> Self {
        Self {
            header: frame_header(tag, payload.len()),
            payload,
            done: 0,
        }
    }

    /// Part of the frame went out but not all: the stream is out of step if we stop now.
    pub(crate) fn cut_short(&self) -> bool {
        self.done > 0 && !self.finished()
    }

    pub(crate) fn finished(&self) -> bool {
        self.done == HEADER_LEN + self.payload.len()
    }

    /// Write as much as the socket takes now. `Ok(true)` when the whole frame is out.
    pub(crate) fn step(&mut self, fd: RawFd) -> std::result::Result<bool, LinkFailure> {
        while !self.finished() {
            let mut iov = [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; 2];
            let n = if self.done < HEADER_LEN {
                iov[0] = libc::iovec {
                    iov_base: self.header[self.done..].as_ptr() as *mut libc::c_void,
                    iov_len: HEADER_LEN - self.done,
                };
                iov[1] = libc::iovec {
                    iov_base: self.payload.as_ptr() as *mut libc::c_void,
                    iov_len: self.payload.len(),
                };
                2
            } else {
                let off = self.done - HEADER_LEN;
                iov[0] = libc::iovec {
                    iov_base: self.payload[off..].as_ptr() as *mut libc::c_void,
                    iov_len: self.payload.len() - off,
                };
                1
            };
            // SAFETY: a zeroed msghdr is valid; iov points at `n` live iovecs over live buffers.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = n;
            // MSG_NOSIGNAL: a vanished peer must be an error, not SIGPIPE killing the process.
            let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                match e.kind() {
                    ErrorKind::WouldBlock => return Ok(false),
                    ErrorKind::Interrupted => continue,
                    _ => return Err(io_failure(e)),
                }
            }
            self.done += r as usize;
        }
        Ok(true)
    }
}

/// An incoming frame, read incrementally: header into a stack buffer, payload straight into the
/// caller's buffer.
pub(crate) struct RecvOp<'a> {
    header: [u8; HEADER_LEN],
    buf: &'a mut [u8],
    tag: Tag,
    done: usize,
}

impl<'a> RecvOp<'a> {
    pub(crate) fn new(tag: Tag, buf: &'a mut [u8]) -> Self {
        Self {
            header: [0; HEADER_LEN],
            buf,
            tag,
            done: 0,
        }
    }

    /// Part of the frame arrived but not all: the stream is out of step if we stop now.
    pub(crate) fn cut_short(&self) -> bool {
        self.done > 0 && !self.finished()
    }

    pub(crate) fn finished(&self) -> bool {
        self.done == HEADER_LEN + self.buf.len()
    }

    /// Bytes worth waking up for: the rest of the header while it is incomplete (so a frame that
    /// announces another length is reported at once, not after the deadline), then the rest of
    /// the payload, which the peer has committed to sending.
    pub(crate) fn wake_bytes(&self) -> usize {
        if self.done < HEADER_LEN {
            HEADER_LEN - self.done
        } else {
            HEADER_LEN + self.buf.len() - self.done
        }
    }

    pub(crate) fn step(&mut self, fd: RawFd) -> std::result::Result<bool, LinkFailure> {
        while !self.finished() {
            let mut iov = [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; 2];
            let had_header = self.done >= HEADER_LEN;
            // Reading header and payload together is safe: if the header turns out to announce
            // a different length, the link is poisoned anyway.
            let n = if !had_header {
                iov[0] = libc::iovec {
                    iov_base: self.header[self.done..].as_mut_ptr().cast(),
                    iov_len: HEADER_LEN - self.done,
                };
                iov[1] = libc::iovec {
                    iov_base: self.buf.as_mut_ptr().cast(),
                    iov_len: self.buf.len(),
                };
                2
            } else {
                let off = self.done - HEADER_LEN;
                iov[0] = libc::iovec {
                    iov_base: self.buf[off..].as_mut_ptr().cast(),
                    iov_len: self.buf.len() - off,
                };
                1
            };
            // SAFETY: iov points at `n` live iovecs over buffers we exclusively borrow.
            let r = unsafe { libc::readv(fd, iov.as_ptr(), n) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                match e.kind() {
                    ErrorKind::WouldBlock => return Ok(false),
                    ErrorKind::Interrupted => continue,
                    _ => return Err(io_failure(e)),
                }
            }
            if r == 0 {
                return Err(LinkFailure::Closed);
            }
            self.done += r as usize;
            if !had_header && self.done >= HEADER_LEN {
                self.check_header()?;
            }
        }
        Ok(true)
    }

    fn check_header(&self) -> std::result::Result<(), LinkFailure> {
        let (tag, len) = parse_header(&self.header)?;
        if tag != self.tag || len != self.buf.len() as u64 {
            return Err(LinkFailure::Protocol(format!(
                "expected tag {:#x} with {} bytes, got tag {tag:#x} with {len} bytes",
                self.tag,
                self.buf.len()
            )));
        }
        Ok(())
    }
}

/// Decodes a frame header: (tag, payload length). The length is only compared with the
/// receiver's buffer, never used to allocate.
pub(crate) fn parse_header(h: &[u8; HEADER_LEN]) -> std::result::Result<(Tag, u64), LinkFailure> {
    let pre: [u8; PREFIX_LEN] = h[..PREFIX_LEN].try_into().unwrap();
    wire::check_prefix(&pre).map_err(|r| LinkFailure::Protocol(r.reason))?;
    // Reserved must be zero: a frame that differs from what our encoder writes is a desynchronised
    // or foreign stream, not something to accept silently (found by `fuzz_recv_mutated`).
    let reserved = u16::from_le_bytes([h[PREFIX_LEN], h[PREFIX_LEN + 1]]);
    if reserved != 0 {
        return Err(LinkFailure::Protocol(format!(
            "frame header with reserved field {reserved:#06x} (must be 0)"
        )));
    }
    let tag = u64::from_le_bytes(h[PREFIX_LEN + 2..PREFIX_LEN + 10].try_into().unwrap());
    let len = u64::from_le_bytes(h[PREFIX_LEN + 10..].try_into().unwrap());
    Ok((tag, len))
}

/// Poll timeout for the time left until `deadline`, rounded up so we never spin just short of it.
pub(super) fn poll_ms(deadline: Instant) -> libc::c_int {
    let left = deadline.saturating_duration_since(Instant::now());
    let ms = left.as_micros().div_ceil(1000);
    ms.min(i32::MAX as u128) as libc::c_int
}

/// Fuzz harnesses for the frame decoder (see `fuzz_util`): the header parser over any 24 bytes,
/// and `RecvOp` reading arbitrary bytes from a real socket. Properties: no panic, a frame is
/// accepted only when its header names the expected tag and length, the payload lands only in
/// the caller's buffer (no allocation from the claimed length), valid frames round-trip.
#[cfg(test)]
mod fuzz {
    use super::*;
    use crate::fuzz_util::{config, mutated};
    use proptest::prelude::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    /// Feeds `input` to a RecvOp expecting (`tag`, `want` bytes); returns whether it finished.
    fn receive(input: &[u8], tag: Tag, want: usize) -> std::result::Result<Vec<u8>, LinkFailure> {
        let (mut tx, rx) = UnixStream::pair().unwrap();
        rx.set_nonblocking(true).unwrap();
        tx.write_all(input).unwrap();
        drop(tx);
        let mut buf = vec![0u8; want];
        let mut op = RecvOp::new(tag, &mut buf);
        // Everything is already in the socket: a bounded number of steps settles it.
        for _ in 0..4 {
            if op.step(rx.as_raw_fd())? {
                return Ok(buf);
            }
        }
        Err(LinkFailure::Closed)
    }

    /// Regression (`fuzz_recv_mutated`): a nonzero reserved field used to be accepted.
    #[test]
    fn reserved_field_must_be_zero() {
        let mut f = frame(5, b"ab");
        f[PREFIX_LEN] = 1;
        assert!(matches!(receive(&f, 5, 2), Err(LinkFailure::Protocol(_))));
    }

    fn frame(tag: Tag, payload: &[u8]) -> Vec<u8> {
        let mut v = frame_header(tag, payload.len()).to_vec();
        v.extend_from_slice(payload);
        v
    }

    proptest! {
        #![proptest_config(config(2000))]

        #[test]
        fn fuzz_frame_header(h in any::<[u8; HEADER_LEN]>()) {
            if let Ok((tag, len)) = parse_header(&h) {
                prop_assert_eq!(frame_header(tag, len as usize), h);
            }
        }

        #[test]
        fn frame_header_round_trips(tag in any::<u64>(), len in any::<u32>()) {
            prop_assert_eq!(parse_header(&frame_header(tag, len as usize)).unwrap(), (tag, len as u64));
        }

        #[test]
        fn fuzz_recv_random(input in prop::collection::vec(any::<u8>(), 0..128), want in 0usize..64) {
            let r = receive(&input, 5, want);
            if let Ok(buf) = r {
                // Only a well-formed frame for tag 5 of `want` bytes completes.
                prop_assert_eq!(&input[..HEADER_LEN + want], &frame(5, &buf)[..]);
            }
        }

        #[test]
        fn fuzz_recv_mutated(
            input in prop::collection::vec(any::<u8>(), 0..48).prop_flat_map(|p| mutated(frame(5, &p))),
            want in 0usize..48,
        ) {
            if let Ok(buf) = receive(&input, 5, want) {
                prop_assert_eq!(&input[..HEADER_LEN + want], &frame(5, &buf)[..]);
            }
        }

        #[test]
        fn frame_round_trips(tag in any::<u64>(), payload in prop::collection::vec(any::<u8>(), 0..512)) {
            prop_assert_eq!(receive(&frame(tag, &payload), tag, payload.len()).unwrap(), payload);
        }
    }
}
