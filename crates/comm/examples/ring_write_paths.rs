//! Cached against streaming stores into a ring that another core reads: the measurement behind
//! `crates/comm/src/shm/write_path.rs`.
//!
//! `cargo run --release -p lockstep-comm --example ring_write_paths [CPU_A CPU_B]` (default 0 1).
//! A writer thread on CPU_A copies 64 KiB chunks into a 1 MiB ring, a reader thread on CPU_B
//! copies them out, 256 MiB per measurement; both paths are measured in turn, 3 times. First it
//! prints the cache-line round trip between the two CPUs, which tells where they sit (≈ 55 ns on
//! the dev VM when its two vCPUs share an L3, ≈ 360 ns when they do not; a VM's vCPUs can move
//! between runs). Expected on the dev VM: near, cached ≈ 23 and streamed ≈ 17 GB/s; far, cached
//! ≈ 2.4 and streamed ≈ 21 GB/s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

const RING: usize = 1 << 20;
const CHUNK: usize = 64 * 1024;
const TOTAL: usize = 256 << 20;

fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; the calls only read it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) != 0 {
            eprintln!("could not pin to CPU {cpu}; measuring unpinned");
        }
    }
}

/// One cache-line round trip between the two CPUs, in ns (median of 5 runs of 100k).
fn round_trip_ns(a: usize, b: usize) -> f64 {
    let mut runs: Vec<f64> = (0..5)
        .map(|_| {
            let flag = Arc::new(AtomicU64::new(0));
            let n = 100_000u64;
            let peer = {
                let flag = flag.clone();
                std::thread::spawn(move || {
                    pin(b);
                    for i in 0..n {
                        while flag.load(Ordering::Acquire) != 2 * i + 1 {}
                        flag.store(2 * i + 2, Ordering::Release);
                    }
                })
            };
            pin(a);
            let t = Instant::now();
            for i in 0..n {
                flag.store(2 * i + 1, Ordering::Release);
                while flag.load(Ordering::Acquire) != 2 * i + 2 {}
            }
            let ns = t.elapsed().as_secs_f64() * 1e9 / n as f64;
            peer.join().unwrap();
            ns
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[2]
}

struct Shared {
    ring: Vec<u8>,
    head: AtomicU64,
    tail: AtomicU64,
}

/// GB/s through the ring with `streamed` (or cached) stores on the writer's side.
fn through_ring(a: usize, b: usize, streamed: bool) -> f64 {
    let shared = Arc::new(Shared {
        ring: vec![0u8; RING + 64],
        head: AtomicU64::new(0),
        tail: AtomicU64::new(0),
    });
    let ring_at = shared.ring.as_ptr().align_offset(64);
    let reader = {
        let shared = shared.clone();
        std::thread::spawn(move || {
            pin(b);
            let mut dst = vec![0u8; 4 * RING];
            let base = shared.ring.as_ptr().wrapping_add(ring_at);
            let mut pos = 0usize;
            while pos < TOTAL {
                let head = loop {
                    let h = shared.head.load(Ordering::Acquire) as usize;
                    if h != pos {
                        break h;
                    }
                    std::hint::spin_loop();
                };
                let n = (head - pos).min(CHUNK);
                let at = pos % (4 * RING);
                // SAFETY: `[pos, pos + n)` is published ring data; `dst` has room at `at`.
                unsafe {
                    lockstep_comm::copy::copy_nonoverlapping(
                        base.add(pos % RING),
                        dst.as_mut_ptr().add(at),
                        n,
                    )
                };
                pos += n;
                shared.tail.store(pos as u64, Ordering::Release);
            }
        })
    };
    pin(a);
    let src = vec![7u8; 4 * RING];
    let base = shared.ring.as_ptr().wrapping_add(ring_at).cast_mut();
    let t = Instant::now();
    let mut pos = 0usize;
    while pos < TOTAL {
        while pos + CHUNK - shared.tail.load(Ordering::Acquire) as usize > RING {
            std::hint::spin_loop();
        }
        let from = src[pos % (4 * RING)..].as_ptr();
        // SAFETY: the reader is done with `[pos, pos + CHUNK)` of the ring (checked above);
        // chunks never wrap (CHUNK divides RING).
        unsafe {
            let to = base.add(pos % RING);
            if streamed {
                lockstep_comm::copy::stream_nonoverlapping(from, to, CHUNK);
            } else {
                lockstep_comm::copy::copy_nonoverlapping(from, to, CHUNK);
            }
        }
        pos += CHUNK;
        shared.head.store(pos as u64, Ordering::Release);
    }
    reader.join().unwrap();
    TOTAL as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn main() {
    let cpus: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("CPU_A CPU_B: numbers"))
        .collect();
    let (a, b) = match cpus[..] {
        [a, b] => (a, b),
        [] => (0, 1),
        _ => panic!("usage: ring_write_paths [CPU_A CPU_B]"),
    };
    println!(
        "CPUs {a} → {b}: cache-line round trip {:.0} ns",
        round_trip_ns(a, b)
    );
    println!("{:>4} {:>12} {:>14}", "rep", "cached GB/s", "streamed GB/s");
    for rep in 1..=3 {
        let cached = through_ring(a, b, false);
        let streamed = through_ring(a, b, true);
        println!("{rep:>4} {cached:>12.1} {streamed:>14.1}");
    }
    println!(
        "CPUs {a} → {b}: cache-line round trip {:.0} ns",
        round_trip_ns(a, b)
    );
}
