//! The single-producer/single-consumer byte ring and the message framing on top of it.
//!
//! `head` counts bytes ever written, `tail` bytes ever read; both only grow, so `head - tail` is
//! the fill level and position `x` lives at `x % size`. The writer loads `tail` (Acquire) to learn
//! the free space, copies, then publishes `head` (Release); the reader mirrors it. One store per
//! chunk, never per byte or per message part.
//!
//! Frame: a 64-byte header `[mark, seq, tag, len, 0…]`, then `len` payload bytes, then padding to
//! a multiple of 64. Frames therefore start 64-aligned, so a header never straddles the wrap
//! (ring sizes are powers of two ≥ 4 KiB) and payload copies start cache-line aligned in the ring.
//! `seq` counts frames on this ring and `mark` is a constant: together they tell "the ranks
//! disagree on tag/length" (the SPMD program diverged) apart from "the ring is desynchronised".
//!
//! Payload moves in steps of at most [`CHUNK`] bytes so the peer can copy one chunk while we copy
//! the next (both cores busy), and large messages stream through rings smaller than themselves.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::segment::SlotHeader;
use super::write_path::{WritePath, WritePathChooser, CHOOSE_FROM};
// Not `std::ptr::copy_nonoverlapping`: the distance between a caller's buffer and the ring slot
// drifts with the write position, through distances where `rep movsb` is slow (see `copy`).
use crate::copy::{copy_nonoverlapping, stream_nonoverlapping};
use crate::transport::Tag;

pub(super) const FRAME_HEADER: u64 = 64;
const FRAME_MARK: u64 = u64::from_le_bytes(*b"LSFRAME1");
/// Largest copy between two index publications. 64 KiB keeps both sides copying concurrently
/// (16 chunks in flight in a 1 MiB ring) at ~1 atomic store per 64 KiB; a quarter of it was
/// measurably slower, two to four times it no faster.
pub(super) const CHUNK: u64 = 64 * 1024;

/// Bytes a message of `len` payload bytes occupies in the ring.
fn frame_bytes(len: usize) -> u64 {
    FRAME_HEADER + (len as u64).div_ceil(64) * 64
}

/// One direction of one pair: a slot header and its data area.
#[derive(Clone, Copy)]
pub(super) struct Ring {
    slot: *const SlotHeader,
    data: *mut u8,
    size: u64,
}

impl Ring {
    /// # Safety
    /// `slot` and `data..data+size` must stay mapped while the ring is used, and `size` must be a
    /// power of two that is a multiple of 64.
    pub unsafe fn new(slot: &SlotHeader, data: *mut u8, size: usize) -> Ring {
        Ring {
            slot,
            data,
            size: size as u64,
        }
    }

    fn slot(&self) -> &SlotHeader {
        // SAFETY: guaranteed by `new`'s contract.
        unsafe { &*self.slot }
    }

    /// Copy `n` bytes from `src` into the ring at stream position `pos`, wrapping at the end.
    ///
    /// # Safety
    /// `[pos, pos+n)` must be free space owned by the writer and `src` valid for `n` bytes.
    unsafe fn copy_in(&self, pos: u64, src: *const u8, n: usize) {
        // SAFETY: the caller keeps this function's contract; `off + first` and `n - first`
        // stay inside the ring's mapped `size` bytes.
        unsafe {
            let off = (pos & (self.size - 1)) as usize;
            let first = n.min(self.size as usize - off);
            copy_nonoverlapping(src, self.data.add(off), first);
            copy_nonoverlapping(src.add(first), self.data, n - first);
        }
    }

    /// [`Ring::copy_in`] with streaming stores (see `write_path`).
    ///
    /// # Safety
    /// As [`Ring::copy_in`].
    unsafe fn stream_in(&self, pos: u64, src: *const u8, n: usize) {
        // SAFETY: the caller keeps this function's contract; `off + first` and `n - first`
        // stay inside the ring's mapped `size` bytes.
        unsafe {
            let off = (pos & (self.size - 1)) as usize;
            let first = n.min(self.size as usize - off);
            stream_nonoverlapping(src, self.data.add(off), first);
            stream_nonoverlapping(src.add(first), self.data, n - first);
        }
    }

    /// Copy `n` bytes at stream position `pos` out of the ring into `dst`, wrapping at the end.
    ///
    /// # Safety
    /// `[pos, pos+n)` must be published data owned by the reader and `dst` valid for `n` bytes.
    unsafe fn copy_out(&self, pos: u64, dst: *mut u8, n: usize) {
        // SAFETY: the caller keeps this function's contract; `off + first` and `n - first`
        // stay inside the ring's mapped `size` bytes.
        unsafe {
            let off = (pos & (self.size - 1)) as usize;
            let first = n.min(self.size as usize - off);
            copy_nonoverlapping(self.data.add(off), dst, first);
            copy_nonoverlapping(self.data, dst.add(first), n - first);
        }
    }
}

/// A message being written. `step` is non-blocking; the transport decides how to wait.
pub(super) struct Outgoing<'a> {
    pub peer: usize,
    ring: Ring,
    write_path: &'a WritePathChooser,
    tag: Tag,
    data: &'a [u8],
    seq: u64,
    done: u64,
    total: u64,
}

impl<'a> Outgoing<'a> {
    pub fn new(
        peer: usize,
        ring: Ring,
        write_path: &'a WritePathChooser,
        tag: Tag,
        data: &'a [u8],
        seq: u64,
    ) -> Self {
        Outgoing {
            peer,
            ring,
            write_path,
            tag,
            data,
            seq,
            done: 0,
            total: frame_bytes(data.len()),
        }
    }
    pub fn payload_len(&self) -> usize {
        self.data.len()
    }
    pub fn finished(&self) -> bool {
        self.done == self.total
    }
    /// Part of the frame is in the ring but not all of it: abandoning now corrupts the stream.
    pub fn partial(&self) -> bool {
        self.done != 0 && !self.finished()
    }

    /// Write as much as fits (at most one chunk of payload). Returns whether `head` moved.
    pub fn step(&mut self) -> bool {
        let ring = self.ring;
        let s = ring.slot();
        let head = s.head.load(Ordering::Relaxed); // we are its only writer
        let tail = s.tail.load(Ordering::Acquire); // reader is done with everything before it
        let mut free = ring.size - (head - tail);
        let mut pos = head;
        if self.done == 0 {
            if free < FRAME_HEADER {
                return false;
            }
            let mut hdr = [0u64; 8];
            hdr[0] = FRAME_MARK;
            hdr[1] = self.seq;
            hdr[2] = self.tag;
            hdr[3] = self.data.len() as u64;
            // SAFETY: 64 free bytes at a 64-aligned position (never wraps).
            unsafe { ring.copy_in(pos, hdr.as_ptr().cast(), FRAME_HEADER as usize) };
            pos += FRAME_HEADER;
            free -= FRAME_HEADER;
            self.done = FRAME_HEADER;
        }
        let n = (self.total - self.done).min(free).min(CHUNK);
        if n > 0 {
            // Payload bytes of this step; the rest of `n` (if any) is end-of-frame padding.
            let from = (self.done - FRAME_HEADER) as usize;
            let to = (from + n as usize).min(self.data.len());
            if to > from {
                let (src, len) = (self.data[from..].as_ptr(), to - from);
                let path = self.write_path.pick(len);
                // Only large copies are timed: a small message's latency is not spent on the clock.
                let started = (len >= CHOOSE_FROM).then(Instant::now);
                // SAFETY: `n` free bytes from `pos`; the source range is inside `data`.
                unsafe {
                    match path {
                        WritePath::Cached => ring.copy_in(pos, src, len),
                        WritePath::Streamed => ring.stream_in(pos, src, len),
                    }
                }
                if let Some(started) = started {
                    self.write_path.record(path, len, started.elapsed());
                }
            }
            pos += n;
            self.done += n;
        }
        if pos == head {
            return false;
        }
        s.head.store(pos, Ordering::Release);
        true
    }
}

/// A message being read into the caller's buffer.
pub(super) struct Incoming<'a> {
    pub peer: usize,
    ring: Ring,
    tag: Tag,
    buf: &'a mut [u8],
    seq: u64,
    done: u64,
    total: u64,
}

impl<'a> Incoming<'a> {
    pub fn new(peer: usize, ring: Ring, tag: Tag, buf: &'a mut [u8], seq: u64) -> Self {
        let total = frame_bytes(buf.len());
        Incoming {
            peer,
            ring,
            tag,
            buf,
            seq,
            done: 0,
            total,
        }
    }
    pub fn finished(&self) -> bool {
        self.done == self.total
    }
    pub fn partial(&self) -> bool {
        self.done != 0 && !self.finished()
    }

    /// Read what is there (at most one chunk of payload). Returns whether `tail` moved, or a
    /// protocol violation (the header is then left in the ring; the link is unusable anyway).
    pub fn step(&mut self) -> Result<bool, String> {
        let ring = self.ring;
        let s = ring.slot();
        let tail = s.tail.load(Ordering::Relaxed); // we are its only writer
        let head = s.head.load(Ordering::Acquire); // writer's bytes before it are visible
        let mut avail = head.wrapping_sub(tail);
        if avail > ring.size {
            return Err(format!(
                "ring indices are corrupt (head {head}, tail {tail}, size {})",
                ring.size
            ));
        }
        let mut pos = tail;
        if self.done == 0 {
            if avail < FRAME_HEADER {
                return Ok(false);
            }
            let mut hdr = [0u64; 8];
            // SAFETY: 64 published bytes at a 64-aligned position.
            unsafe { ring.copy_out(pos, hdr.as_mut_ptr().cast(), FRAME_HEADER as usize) };
            let [mark, seq, tag, len, ..] = hdr;
            if mark != FRAME_MARK {
                return Err(format!(
                    "corrupt frame header at stream byte {pos} (mark {mark:#018x}); the ring is desynchronised"
                ));
            }
            if seq != self.seq {
                return Err(format!(
                    "frame #{seq} arrived where #{} was expected; the ring is desynchronised",
                    self.seq
                ));
            }
            if tag != self.tag || len != self.buf.len() as u64 {
                return Err(format!(
                    "expected tag {:#x} with {} bytes, got tag {tag:#x} with {len} bytes",
                    self.tag,
                    self.buf.len()
                ));
            }
            pos += FRAME_HEADER;
            avail -= FRAME_HEADER;
            self.done = FRAME_HEADER;
        }
        let n = (self.total - self.done).min(avail).min(CHUNK);
        if n > 0 {
            let from = (self.done - FRAME_HEADER) as usize;
            let to = (from + n as usize).min(self.buf.len());
            if to > from {
                // SAFETY: `n` published bytes from `pos`; the destination range is inside `buf`.
                unsafe { ring.copy_out(pos, self.buf.as_mut_ptr().add(from), to - from) };
            }
            pos += n;
            self.done += n;
        }
        if pos == tail {
            return Ok(false);
        }
        s.tail.store(pos, Ordering::Release);
        Ok(true)
    }
}

/// Fuzz harness for the shared-memory frame reader (see `fuzz_util`). The ring and its indices
/// live in a file any process of the same user can write, so the reader must treat them as
/// untrusted: arbitrary ring contents and arbitrary `head`/`tail` must give an error or a frame
/// that matches what was expected, never a panic or an access outside the ring or the buffer.
#[cfg(test)]
mod fuzz {
    use super::*;
    use crate::fuzz_util::config;
    use proptest::prelude::*;

    const SIZE: usize = 4096;

    fn run(contents: &[u8], head: u64, tail: u64, want: usize, frame_at_tail: bool) {
        // SAFETY: SlotHeader is atomics and padding; all-zero is a valid value.
        let slot: Box<SlotHeader> = Box::new(unsafe { std::mem::zeroed() });
        let mut data = vec![0u64; SIZE / 8];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut data);
        for (i, b) in contents.iter().enumerate() {
            bytes[i % SIZE] = *b;
        }
        if frame_at_tail {
            // A plausible header where the reader will look, so the checks past `mark` run.
            let hdr = [FRAME_MARK, 0, 5, want as u64];
            let off = (tail as usize) & (SIZE - 1) & !63;
            let h: &[u8] = bytemuck::cast_slice(&hdr);
            bytes[off..off + 32].copy_from_slice(h);
        }
        slot.head.store(head, Ordering::SeqCst);
        slot.tail.store(tail, Ordering::SeqCst);
        // SAFETY: slot and data outlive the ring; SIZE is a power of two and a multiple of 64.
        let ring = unsafe { Ring::new(&slot, data.as_mut_ptr().cast(), SIZE) };
        let mut buf = vec![0u8; want];
        let mut inc = Incoming::new(1, ring, 5, &mut buf, 0);
        for _ in 0..16 {
            match inc.step() {
                Ok(_) if inc.finished() => break,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let t = slot.tail.load(Ordering::SeqCst);
        // The reader never moves past what the writer published.
        assert!(
            t.wrapping_sub(tail) <= head.wrapping_sub(tail)
                || head.wrapping_sub(tail) > SIZE as u64
        );
    }

    proptest! {
        #![proptest_config(config(2000))]

        #[test]
        fn fuzz_shm_incoming(
            contents in prop::collection::vec(any::<u8>(), 0..SIZE),
            head in any::<u64>(),
            tail in any::<u64>(),
            want in 0usize..3 * SIZE,
            frame_at_tail in any::<bool>(),
        ) {
            run(&contents, head, tail, want, frame_at_tail);
        }

        #[test]
        fn fuzz_shm_incoming_near(
            contents in prop::collection::vec(any::<u8>(), 0..SIZE),
            tail in 0u64..(1 << 20),
            ahead in 0u64..2 * SIZE as u64,
            want in 0usize..3 * SIZE,
            frame_at_tail in any::<bool>(),
        ) {
            // Indices close together (the usual case), including slightly past the ring size.
            run(&contents, tail.wrapping_add(ahead), tail, want, frame_at_tail);
        }
    }
}
