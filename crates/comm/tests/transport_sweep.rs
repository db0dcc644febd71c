//! The collectives over the real transports: TCP (each rank its own `TcpTransport`, meshed through
//! an authenticated `StoreServer` on 127.0.0.1) and shared memory (`ShmTransport` in a private
//! directory), one thread per rank. `collectives.rs` covers the same grid in process; this file
//! proves that framing, segmentation, ring wrap-around and tags survive real links.
//!
//! Grid per transport: world sizes 1..=8 × element counts {0, 1, 7919 (an odd prime), 1 Mi} ×
//! {Ring, RecursiveDoubling, Auto} × {Sum f32, Sum i64, Max f32, Max i64}, every answer checked
//! element by element against a closed form; broadcast (tree and chain) and all_gather once per
//! world size. One mesh per world size carries all of its cases. The whole grid, 1 Mi included at
//! every world size, takes ~9 s for both transports together on the 2-core dev machine.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use lockstep_comm::shm::{ShmOptions, ShmTransport};
use lockstep_comm::store::{StoreClient, StoreServer};
use lockstep_comm::tcp::{TcpOptions, TcpTransport};
use lockstep_comm::{Algorithm, Communicator, Element, JobSecret, ReduceOp, Transport};

/// Only reached if something is broken: a healthy operation here takes well under a second.
const TIMEOUT: Duration = Duration::from_secs(30);
/// Below this many bytes `Auto` picks recursive doubling: 0 and 1 elements are small, 7919 and
/// 1 Mi are large, so `Auto` takes both paths within the grid.
const THRESHOLD: usize = 4096;
const MEBI: usize = 1 << 20;
/// An odd prime count makes every ring chunk, segment and recursive-doubling half uneven.
const COUNTS: [usize; 4] = [0, 1, 7919, MEBI];
const ALGS: [Algorithm; 3] = [
    Algorithm::Ring,
    Algorithm::RecursiveDoubling,
    Algorithm::Auto,
];
/// Shared-memory ring per directed pair: smaller than one 512 KiB collective segment, so large
/// messages wrap around the ring many times.
const SHM_RING_BYTES: usize = 64 * 1024;

// ---------------------------------------------------------------------------------------------
// Closed forms
// ---------------------------------------------------------------------------------------------

/// `v(i) = i mod 101 − 50` and a weight `w = (rank + i) mod n + 1`, a permutation of `1..=n` over
/// the ranks for every `i`, so the largest contribution sits on a different rank per element.
fn base(i: usize) -> i64 {
    i as i64 % 101 - 50
}

fn weight(rank: usize, n: usize, i: usize) -> i64 {
    ((rank + i) % n + 1) as i64
}

/// f32 contributions: small integers (|sum| ≤ 50·36), exact in any summation order.
fn f32_data(rank: usize, n: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (base(i) * weight(rank, n, i)) as f32)
        .collect()
}

/// i64 contributions use the upper 32 bits too (`· 2^33`) and carry the rank in the low bits, so a
/// truncated or misplaced word, or a contribution from the wrong rank, changes the answer.
const HIGH: i64 = 1 << 33;

fn i64_data(rank: usize, n: usize, len: usize) -> Vec<i64> {
    (0..len)
        .map(|i| base(i) * weight(rank, n, i) * HIGH + rank as i64)
        .collect()
}

/// The rank whose weight for element `i` is `w` (the inverse of [`weight`]).
fn rank_with_weight(w: i64, n: usize, i: usize) -> i64 {
    ((w as usize - 1 + n - i % n) % n) as i64
}

fn f32_expected(n: usize, i: usize, op: ReduceOp) -> f32 {
    let (v, n64) = (base(i), n as i64);
    (match op {
        ReduceOp::Sum => v * n64 * (n64 + 1) / 2,
        ReduceOp::Max if v >= 0 => v * n64,
        ReduceOp::Max => v,
        _ => unreachable!("only Sum and Max are swept here"),
    }) as f32
}

fn i64_expected(n: usize, i: usize, op: ReduceOp) -> i64 {
    let (v, n64) = (base(i), n as i64);
    match op {
        ReduceOp::Sum => v * HIGH * n64 * (n64 + 1) / 2 + n64 * (n64 - 1) / 2,
        // v = 0: every high part is 0 and the largest rank wins on the low bits.
        ReduceOp::Max if v == 0 => n64 - 1,
        ReduceOp::Max if v > 0 => v * n64 * HIGH + rank_with_weight(n64, n, i),
        ReduceOp::Max => v * HIGH + rank_with_weight(1, n, i),
        _ => unreachable!("only Sum and Max are swept here"),
    }
}

// ---------------------------------------------------------------------------------------------
// The cases, run on every rank of one mesh
// ---------------------------------------------------------------------------------------------

/// All-reduce `buf` with `alg` and compare it to `want(i)`; returns the bytes this rank sent.
fn check_all_reduce<T: Element + std::fmt::Debug>(
    comm: &mut Communicator,
    mut buf: Vec<T>,
    op: ReduceOp,
    alg: Algorithm,
    want: impl Fn(usize) -> T,
) -> u64 {
    let (r, n, len) = (comm.rank(), comm.size(), buf.len());
    let what = format!(
        "{} {} {op:?} {alg:?} n={n} len={len} rank {r}",
        comm.transport_name(),
        T::NAME
    );
    let before = comm.stats().bytes_sent;
    comm.all_reduce_with(&mut buf, op, alg)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    if let Some((i, got)) = buf.iter().enumerate().find(|(i, got)| **got != want(*i)) {
        panic!("{what} element {i}: got {got:?}, want {:?}", want(i));
    }
    comm.stats().bytes_sent - before
}

/// Every algorithm × type × operator at one element count. `Auto` must do exactly what the
/// algorithm it should pick does, byte for byte on the wire.
fn all_reduce_cases(comm: &mut Communicator, len: usize) {
    let (r, n) = (comm.rank(), comm.size());
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        let mut sent = Vec::new();
        for alg in ALGS {
            let a = check_all_reduce(comm, f32_data(r, n, len), op, alg, |i| {
                f32_expected(n, i, op)
            });
            let b = check_all_reduce(comm, i64_data(r, n, len), op, alg, |i| {
                i64_expected(n, i, op)
            });
            sent.push((a, b));
        }
        let f32_picks_ring = len * 4 >= THRESHOLD;
        let i64_picks_ring = len * 8 >= THRESHOLD;
        let (ring, rd, auto) = (sent[0], sent[1], sent[2]);
        let want = (
            if f32_picks_ring { ring.0 } else { rd.0 },
            if i64_picks_ring { ring.1 } else { rd.1 },
        );
        assert_eq!(
            auto, want,
            "{} n={n} len={len} rank {r} {op:?}: Auto sent (f32, i64) bytes {auto:?}, ring {ring:?}, recursive doubling {rd:?}",
            comm.transport_name()
        );
    }
}

/// Broadcast from the last rank (a non-zero root wherever n > 1) over the binomial tree and over
/// the pipelined chain, of a length that spans many segments.
fn broadcast_cases(comm: &mut Communicator) {
    let (r, n) = (comm.rank(), comm.size());
    let root = n - 1;
    let len = 7919;
    let fill = |i: usize| (i as i64 * 3 + root as i64 * 1_000_000) * HIGH + i as i64;
    for (threshold, shape) in [(usize::MAX, "tree"), (0, "chain")] {
        comm.set_small_message_threshold(threshold);
        let mut buf: Vec<i64> = if r == root {
            (0..len).map(fill).collect()
        } else {
            vec![-1; len]
        };
        comm.broadcast(&mut buf, root).unwrap_or_else(|e| {
            panic!(
                "{} {shape} broadcast n={n} rank {r}: {e}",
                comm.transport_name()
            )
        });
        if let Some(i) = (0..len).find(|&i| buf[i] != fill(i)) {
            panic!(
                "{} {shape} broadcast n={n} root {root} rank {r} element {i}: got {}, want {}",
                comm.transport_name(),
                buf[i],
                fill(i)
            );
        }
    }
    comm.set_small_message_threshold(THRESHOLD);
}

/// All-gather blocks of an odd prime length into rank order.
fn all_gather_cases(comm: &mut Communicator) {
    let (r, n) = (comm.rank(), comm.size());
    let block = 7919;
    let value = |rank: usize, i: usize| (rank * 100_000 + i) as f64;
    let send: Vec<f64> = (0..block).map(|i| value(r, i)).collect();
    let mut recv = vec![f64::NAN; block * n];
    comm.all_gather(&send, &mut recv)
        .unwrap_or_else(|e| panic!("{} all_gather n={n} rank {r}: {e}", comm.transport_name()));
    if let Some(k) = (0..recv.len()).find(|&k| recv[k] != value(k / block, k % block)) {
        panic!(
            "{} all_gather n={n} rank {r} element {k}: got {}, want {}",
            comm.transport_name(),
            recv[k],
            value(k / block, k % block)
        );
    }
}

/// Everything one rank of an `n`-rank mesh runs.
fn run_rank(t: Arc<dyn Transport>, transport: &str) {
    let mut comm = Communicator::new(t, TIMEOUT);
    assert_eq!(comm.transport_name(), transport);
    comm.set_small_message_threshold(THRESHOLD);
    for len in COUNTS {
        all_reduce_cases(&mut comm, len);
    }
    broadcast_cases(&mut comm);
    all_gather_cases(&mut comm);
    assert!(comm.broken().is_none());
}

/// Run [`run_rank`] on every transport of one mesh, one thread each. A rank that fails drops its
/// transport, so its peers fail promptly too; all failures are reported together.
fn run_mesh(transports: Vec<Arc<dyn Transport>>, transport: &str) {
    let failures: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = transports
            .into_iter()
            .map(|t| s.spawn(move || run_rank(t, transport)))
            .collect();
        hs.into_iter()
            .enumerate()
            .filter_map(|(rank, h)| h.join().err().map(|p| (rank, p)))
            .map(|(rank, p)| {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                format!("rank {rank}: {msg}")
            })
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// Meshes
// ---------------------------------------------------------------------------------------------

fn tcp_mesh(
    world: usize,
    secret: &JobSecret,
    job: &str,
    store: SocketAddr,
) -> Vec<Arc<dyn Transport>> {
    let opts = TcpOptions {
        bind_ip: "127.0.0.1".parse().unwrap(),
        connect_timeout: TIMEOUT,
        ..TcpOptions::default()
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let opts = &opts;
                s.spawn(move || {
                    let mut c = StoreClient::connect(store, secret, job, TIMEOUT).unwrap();
                    let t = TcpTransport::establish(&mut c, rank, world, secret, job, opts)
                        .unwrap_or_else(|e| panic!("tcp establish rank {rank} of {world}: {e}"));
                    Arc::new(t) as Arc<dyn Transport>
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn tcp_collectives_match_closed_forms_for_world_sizes_1_to_8() {
    let secret = JobSecret::generate().unwrap();
    for n in 1..=8 {
        // A store and job id per world size, so no key of one mesh can leak into the next.
        let job = format!("sweep-tcp-{n}");
        let srv = StoreServer::bind("127.0.0.1:0".parse().unwrap(), &secret, &job).unwrap();
        let mesh = tcp_mesh(n, &secret, &job, srv.local_addr());
        run_mesh(mesh, "tcp");
        assert_eq!(srv.refused_connections(), 0);
    }
}

/// A private directory for one mesh's segment files, removed on drop.
struct ShmDir(PathBuf);

impl ShmDir {
    fn new(tag: &str) -> ShmDir {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("lockstep-sweep-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        ShmDir(dir)
    }
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn shm_collectives_match_closed_forms_for_world_sizes_1_to_8() {
    for n in 1..=8 {
        let dir = ShmDir::new(&n.to_string());
        let opts = ShmOptions {
            ring_bytes: SHM_RING_BYTES,
            dir: dir.0.clone(),
        };
        let job = format!("sweep{:x}-{n}", std::process::id());
        let mesh: Vec<Arc<dyn Transport>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|rank| {
                    let (opts, job) = (&opts, &job);
                    s.spawn(move || {
                        let t = ShmTransport::establish(rank, n, job, TIMEOUT, opts)
                            .unwrap_or_else(|e| panic!("shm establish rank {rank} of {n}: {e}"));
                        Arc::new(t) as Arc<dyn Transport>
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        run_mesh(mesh, "shm");
        // Established segments are unlinked; nothing of this job may remain in its directory.
        let left: Vec<_> = std::fs::read_dir(&dir.0).unwrap().collect();
        assert!(left.is_empty(), "n={n}: files left in {}", dir.0.display());
    }
}
