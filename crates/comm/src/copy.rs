//! Byte copies into shared memory: one that avoids a 4 KiB-aliasing slow path of `rep movsb`,
//! and one with streaming stores.
//!
//! glibc's `memcpy` copies mid-sized blocks (from a few KiB up to its non-temporal threshold, a
//! fraction of the L3 cache) with `rep movsb`. On some CPUs (AMD Zen among them) that
//! instruction runs many times slower when the destination lies just after the source modulo
//! 4 KiB — a store that seems to alias a pending load is replayed (`examples/copy_alias.rs` shows
//! the speed by distance; the figures are on docs/src/performance.md). A ring transport hits
//! those distances by chance: its write position moves on by every message, so the distance
//! between a caller's buffer and the ring slot drifts through them. Below 64 bytes of distance
//! [`copy_nonoverlapping`] therefore copies with plain 32-byte vector loads and stores, whose
//! speed does not depend on the distance; everywhere else it calls `memcpy`.
//!
//! [`stream_nonoverlapping`] is the other way to fill a ring slot: streaming stores that do not
//! wait for the reader's core to give up its copies of the lines (`shm::write_path` picks between
//! the two while the transport runs).

/// Copies at least this long take the vector loop at a bad distance (`memcpy` uses plain vector
/// moves for short copies anyway).
const VECTOR_FROM: usize = 2048;

/// `std::ptr::copy_nonoverlapping(src, dst, n)`, but never `rep movsb` at a distance where it is
/// slow (see the module doc).
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: `src` valid for `n` reads, `dst` for `n` writes, the two
/// ranges disjoint.
pub unsafe fn copy_nonoverlapping(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller keeps this function's contract (`src` valid for `n` reads, `dst`
    // for `n` writes, disjoint; the instruction set checked where it matters).
    unsafe {
        let distance = (dst as usize).wrapping_sub(src as usize) % 4096;
        #[cfg(target_arch = "x86_64")]
        if n >= VECTOR_FROM && (1..64).contains(&distance) && has_avx2() {
            // SAFETY: AVX2 is present (checked); the caller guarantees the ranges.
            return vector_copy_avx2(src, dst, n);
        }
        std::ptr::copy_nonoverlapping(src, dst, n)
    }
}

/// Safe form for slices of equal length.
pub fn copy_from_slice(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_from_slice: lengths differ");
    // SAFETY: both slices are valid for their length, and `&mut` cannot alias `&`.
    unsafe { copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr(), src.len()) }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| std::arch::is_x86_feature_detected!("avx2"))
}

/// 128 bytes per iteration in four unaligned 32-byte loads, then four stores (loads first, so a
/// store never waits on a load it could alias); the tail goes to `memcpy` (short: no `rep movsb`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn vector_copy_avx2(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller keeps this function's contract (`src` valid for `n` reads, `dst`
    // for `n` writes, disjoint; the instruction set checked where it matters).
    unsafe {
        use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
        let mut i = 0;
        while i + 128 <= n {
            let s = src.add(i).cast::<__m256i>();
            let d = dst.add(i).cast::<__m256i>();
            let a = _mm256_loadu_si256(s);
            let b = _mm256_loadu_si256(s.add(1));
            let c = _mm256_loadu_si256(s.add(2));
            let e = _mm256_loadu_si256(s.add(3));
            _mm256_storeu_si256(d, a);
            _mm256_storeu_si256(d.add(1), b);
            _mm256_storeu_si256(d.add(2), c);
            _mm256_storeu_si256(d.add(3), e);
            i += 128;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
    }
}

/// `copy_nonoverlapping`, but the destination's whole 64-byte lines are written with
/// non-temporal (streaming) stores: they go to memory without first fetching the line, and
/// without waiting for other cores to give up their copies of it. For shared memory that
/// another core reads (a ring slot its reader emptied earlier), that wait is what a cached store
/// pays per line; when the two cores sit far apart (another die or socket) it bounds a cached
/// copy to a few GB/s (see `shm::write_path`). Ends with `sfence`, so a `Release` store after
/// the call publishes the streamed bytes too. The partial lines at either end go through
/// [`copy_nonoverlapping`].
///
/// # Safety
/// As [`copy_nonoverlapping`].
pub unsafe fn stream_nonoverlapping(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller keeps this function's contract (`src` valid for `n` reads, `dst`
    // for `n` writes, disjoint; the instruction set checked where it matters).
    unsafe {
        #[cfg(target_arch = "x86_64")]
        {
            let head = dst.align_offset(64).min(n);
            let body = (n - head) / 64 * 64;
            if body > 0 {
                copy_nonoverlapping(src, dst, head);
                if has_avx2() {
                    // SAFETY: AVX2 is present (checked); the caller guarantees the ranges, and
                    // `dst + head` is 64-byte aligned.
                    stream_lines_avx2(src.add(head), dst.add(head), body);
                } else {
                    // SAFETY: SSE2 is part of x86-64; as above.
                    stream_lines_sse2(src.add(head), dst.add(head), body);
                }
                let done = head + body;
                copy_nonoverlapping(src.add(done), dst.add(done), n - done);
                return;
            }
        }
        copy_nonoverlapping(src, dst, n)
    }
}

/// `n` (a multiple of 64) bytes into the 64-aligned `dst` with 32-byte streaming stores, then
/// `sfence` (streaming stores are weakly ordered; the fence orders them before later stores).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_lines_avx2(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller keeps this function's contract (`src` valid for `n` reads, `dst`
    // for `n` writes, disjoint; the instruction set checked where it matters).
    unsafe {
        use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
        let mut i = 0;
        while i < n {
            let s = src.add(i).cast::<__m256i>();
            let d = dst.add(i).cast::<__m256i>();
            let a = _mm256_loadu_si256(s);
            let b = _mm256_loadu_si256(s.add(1));
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
            i += 64;
        }
        _mm_sfence();
    }
}

/// As [`stream_lines_avx2`] with 16-byte stores (x86-64's baseline).
#[cfg(target_arch = "x86_64")]
unsafe fn stream_lines_sse2(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller keeps this function's contract (`src` valid for `n` reads, `dst`
    // for `n` writes, disjoint; the instruction set checked where it matters).
    unsafe {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let mut i = 0;
        while i < n {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            for k in 0..4 {
                _mm_stream_si128(d.add(k), _mm_loadu_si128(s.add(k)));
            }
            i += 64;
        }
        _mm_sfence();
    }
}

/// Evicts the cache lines of `bytes` from every cache (`clflushopt`, or `clflush` where the
/// CPU lacks it; nothing off x86-64). For memory another core writes next: a line this core
/// keeps a copy of makes that core's store wait until the copy is invalidated, which between far
/// cores costs more than fetching the line from memory (see `shared_parts`). Changes no value.
pub fn evict(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        let start = bytes.as_ptr() as usize & !63;
        let end = bytes.as_ptr() as usize + bytes.len();
        let opt = has_clflushopt();
        for at in (start..end).step_by(64) {
            if opt {
                // SAFETY: CLFLUSHOPT is present (checked); the line holds bytes of `bytes`,
                // which is mapped. It only evicts the line (no value changes).
                unsafe {
                    std::arch::asm!("clflushopt [{0}]", in(reg) at, options(nostack, preserves_flags))
                };
            } else {
                // SAFETY: SSE2 is part of x86-64; the line holds bytes of `bytes`.
                unsafe { std::arch::x86_64::_mm_clflush(at as *const u8) };
            }
        }
        if opt {
            // Orders the flushes before later stores (clflushopt itself is weakly ordered).
            // SAFETY: SSE is part of x86-64.
            unsafe { std::arch::x86_64::_mm_sfence() };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// CPUID leaf 7, EBX bit 23 (no `is_x86_feature_detected!` name for it on stable Rust).
#[cfg(target_arch = "x86_64")]
fn has_clflushopt() -> bool {
    use std::sync::OnceLock;
    static CLFLUSHOPT: OnceLock<bool> = OnceLock::new();
    // CPUID exists on every x86-64 CPU; leaf 7 when leaf 0 says so.
    *CLFLUSHOPT.get_or_init(|| {
        std::arch::x86_64::__cpuid(0).eax >= 7
            && std::arch::x86_64::__cpuid_count(7, 0).ebx & (1 << 23) != 0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_every_byte_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 13 + i / 97) as u8).collect();
        let mut dst = vec![0u8; 20_000 + 256];
        for src_off in [0usize, 1, 33, 64] {
            for dst_off in [0usize, 1, 31, 63, 64, 65] {
                for n in [0usize, 1, 63, 64, 65, 127, 128, 200, 4096 + 3, 12_345] {
                    let s = &src[src_off..src_off + n];
                    dst.fill(0xAA);
                    let d = &mut dst[dst_off..dst_off + n];
                    // SAFETY: both ranges are valid for `n` bytes and disjoint.
                    unsafe { stream_nonoverlapping(s.as_ptr(), d.as_mut_ptr(), n) };
                    assert_eq!(&dst[dst_off..dst_off + n], s, "n={n} dst_off={dst_off}");
                    assert!(dst[..dst_off].iter().all(|&b| b == 0xAA), "wrote before");
                    assert!(dst[dst_off + n..].iter().all(|&b| b == 0xAA), "wrote after");
                }
            }
        }
    }

    #[test]
    fn evicting_changes_no_value() {
        let v: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        for (from, to) in [(0, 0), (0, 1), (3, 70), (63, 65), (5, 9_999), (0, 10_000)] {
            evict(&v[from..to]);
        }
        assert!(v
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i as u32 * 7) as u8));
    }

    #[test]
    fn copies_every_byte_at_every_distance_and_length() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut dst = vec![0u8; 20_000 + 4096 + 128];
        // Distances around the vector path's window, lengths around its threshold and the
        // 128-byte step, source offsets that are not vector aligned.
        for src_off in [0usize, 1, 5, 64] {
            for distance in [0usize, 1, 4, 15, 16, 63, 64, 100, 4095] {
                for n in [0usize, 1, 127, 2047, 2048, 2049, 4096 + 3, 12_345] {
                    let s = &src[src_off..src_off + n];
                    let base = dst.as_ptr() as usize;
                    let want_addr = s.as_ptr() as usize + distance;
                    let dst_off = (want_addr.wrapping_sub(base)) % 4096;
                    dst.fill(0xAA);
                    copy_from_slice(&mut dst[dst_off..dst_off + n], s);
                    assert_eq!(&dst[dst_off..dst_off + n], s, "n={n} distance={distance}");
                    assert!(dst[..dst_off].iter().all(|&b| b == 0xAA), "wrote before");
                    assert!(dst[dst_off + n..].iter().all(|&b| b == 0xAA), "wrote after");
                }
            }
        }
    }
}
