//! The collective sweep over the MPI transport, one process per rank under mpirun:
//!
//! ```sh
//! cargo build -p lockstep-comm --features mpi --example mpi_sweep
//! mpirun -np 3 target/debug/examples/mpi_sweep
//! ```
//!
//! Grid (the closed forms of `tests/collectives.rs`): element counts {0, 1, 2, n−1, n+1, 7919,
//! 262144} × {Ring, RecursiveDoubling, Auto} × {Sum, Mean, Max, Min} × {f32, f64, i32, i64} for
//! all-reduce (with 1000-byte segments, so rings wrap many times); broadcast from every root, tree
//! and chain; all-gather; reduce-scatter (every op); barrier; neighbour send_recv. Any wrong
//! element panics, naming the case (exit status ≠ 0, mpirun reports the rank).

use std::sync::Arc;
use std::time::{Duration, Instant};

use lockstep_comm::collectives::chunk_range;
use lockstep_comm::mpi::MpiTransport;
use lockstep_comm::{Algorithm, Communicator, ReduceOp, Transport};

#[path = "../tests/closed_forms/mod.rs"]
mod closed_forms;
use closed_forms::{expected, local_data, TestElem, ALGS, OPS};

fn check_all_reduce<T: TestElem>(
    comm: &mut Communicator,
    len: usize,
    op: ReduceOp,
    alg: Algorithm,
) -> usize {
    let (r, n) = (comm.rank(), comm.size());
    let mut buf = local_data::<T>(r, n, len);
    comm.all_reduce_with(&mut buf, op, alg).unwrap();
    for (i, got) in buf.iter().enumerate() {
        let want = expected::<T>(n, i, op);
        assert!(
            *got == want,
            "all_reduce {} {op:?} {alg:?} n={n} len={len} rank {r} element {i}: got {got:?}, want {want:?}",
            T::NAME
        );
    }
    1
}

fn main() {
    let started = Instant::now();
    let t = MpiTransport::init().expect("MPI init");
    let (r, n) = (t.rank(), t.world_size());
    let mut comm = Communicator::new(Arc::new(t), Duration::from_secs(30));
    let mut cases = 0usize;

    comm.set_small_message_threshold(4096);
    comm.set_segment_bytes(1000);
    let mut lens = vec![0usize, 1, 2, n.saturating_sub(1), n + 1, 7919, 1 << 18];
    lens.sort_unstable();
    lens.dedup();
    for alg in ALGS {
        for &len in &lens {
            for op in OPS {
                cases += check_all_reduce::<f32>(&mut comm, len, op, alg);
                cases += check_all_reduce::<f64>(&mut comm, len, op, alg);
                cases += check_all_reduce::<i32>(&mut comm, len, op, alg);
                cases += check_all_reduce::<i64>(&mut comm, len, op, alg);
            }
        }
    }

    for threshold in [usize::MAX, 0] {
        comm.set_small_message_threshold(threshold);
        for root in 0..n {
            for len in [0usize, 1, 7919] {
                let fill = |i: usize| (i * 3 + root * 1_000_000) as i64;
                let mut buf: Vec<i64> = if r == root {
                    (0..len).map(fill).collect()
                } else {
                    vec![-1; len]
                };
                comm.broadcast(&mut buf, root).unwrap();
                for (i, v) in buf.iter().enumerate() {
                    assert_eq!(
                        *v,
                        fill(i),
                        "broadcast n={n} root={root} len={len} threshold={threshold} element {i}"
                    );
                }
                cases += 1;
            }
        }
    }
    comm.set_small_message_threshold(4096);

    for block in [0usize, 1, 7919] {
        let send: Vec<f64> = (0..block).map(|i| (r * 100_000 + i) as f64).collect();
        let mut recv = vec![f64::NAN; block * n];
        comm.all_gather(&send, &mut recv).unwrap();
        for (k, v) in recv.iter().enumerate() {
            let want = ((k / block) * 100_000 + k % block) as f64;
            assert_eq!(*v, want, "all_gather n={n} block={block} element {k}");
        }
        cases += 1;
    }

    for len in [0usize, 1, n.saturating_sub(1), n, 7919] {
        for op in OPS {
            let mut buf = local_data::<i32>(r, n, len);
            let range = comm.reduce_scatter(&mut buf, op).unwrap();
            assert_eq!(
                range,
                chunk_range(len, n, r),
                "reduce_scatter range n={n} len={len}"
            );
            for i in range {
                assert_eq!(
                    buf[i],
                    expected::<i32>(n, i, op),
                    "reduce_scatter n={n} len={len} {op:?} element {i}"
                );
            }
            cases += 1;
        }
    }

    comm.barrier().unwrap();
    cases += 1;
    if n > 1 {
        let (to, from) = ((r + 1) % n, (r + n - 1) % n);
        let send: Vec<i64> = (0..5000).map(|i| (r * 10_000 + i) as i64).collect();
        let mut recv = vec![0i64; 5000];
        comm.send_recv(to, &send, from, &mut recv).unwrap();
        for (i, v) in recv.iter().enumerate() {
            assert_eq!(
                *v,
                (from * 10_000 + i) as i64,
                "send_recv n={n} element {i}"
            );
        }
        cases += 1;
    }
    comm.barrier().unwrap();
    if r == 0 {
        println!(
            "mpi sweep: world {n}: {cases} cases passed on every rank ({:.1}s, {})",
            started.elapsed().as_secs_f64(),
            MpiTransport::library_version()
        );
    }
}
