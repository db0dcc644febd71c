//! Collectives and the Communicator over the in-process transport (one thread per rank), checked
//! against closed-form answers, plus failure behaviour (dead rank, hung rank, bad arguments).

mod closed_forms;
mod common;
use closed_forms::{expected, local_data, TestElem, ALGS, OPS};
use common::waited_in_message;

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use lockstep_comm::collectives::chunk_range;
use lockstep_comm::inproc::{in_process_group, InProcTransport};
use lockstep_comm::{Algorithm, CommError, Communicator, LinkFailure, ReduceOp, Transport};

/// Generous: only reached if a test is broken (a healthy op finishes in milliseconds).
const TIMEOUT: Duration = Duration::from_secs(20);
/// For the failure tests, which wait for it on purpose.
const SHORT: Duration = Duration::from_millis(500);

/// Run `f` on `n` ranks, one thread each, and return the per-rank results in rank order.
fn spmd<R: Send>(n: usize, f: impl Fn(&mut Communicator) -> R + Sync) -> Vec<R> {
    spmd_raw(n, |t| {
        let mut comm = Communicator::new(Arc::new(t), TIMEOUT);
        f(&mut comm)
    })
}

/// Like [`spmd`] but hands each thread its bare transport (for tests that drop or share it).
fn spmd_raw<R: Send>(n: usize, f: impl Fn(InProcTransport) -> R + Sync) -> Vec<R> {
    let transports = in_process_group(n);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = transports
            .into_iter()
            .map(|t| s.spawn(move || f(t)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// A one-shot meeting point for the test's threads. Unlike `std::sync::Barrier` it gives up
/// (panics) after a while, so a thread that failed before arriving cannot hang the test.
struct Meet {
    arrived: Mutex<usize>,
    all_here: Condvar,
    parties: usize,
}

impl Meet {
    fn new(parties: usize) -> Self {
        Self {
            arrived: Mutex::new(0),
            all_here: Condvar::new(),
            parties,
        }
    }
    fn wait(&self) {
        let mut arrived = self.arrived.lock().unwrap();
        *arrived += 1;
        self.all_here.notify_all();
        let (arrived, timeout) = self
            .all_here
            .wait_timeout_while(arrived, Duration::from_secs(10), |a| *a < self.parties)
            .unwrap();
        assert!(
            !timeout.timed_out(),
            "only {} of {} test threads arrived",
            *arrived,
            self.parties
        );
    }
}

fn check_all_reduce<T: TestElem>(
    comm: &mut Communicator,
    len: usize,
    op: ReduceOp,
    alg: Algorithm,
) {
    let (r, n) = (comm.rank(), comm.size());
    let mut buf = local_data::<T>(r, n, len);
    comm.all_reduce_with(&mut buf, op, alg).unwrap();
    for (i, got) in buf.iter().enumerate() {
        let want = expected::<T>(n, i, op);
        assert!(
            *got == want,
            "{} {op:?} {alg:?} n={n} len={len} rank {r} element {i}: got {got:?}, want {want:?}",
            T::NAME
        );
    }
}

#[test]
fn all_reduce_matches_closed_form_for_every_size_algorithm_type_and_op() {
    for n in 1..=8 {
        spmd(n, |comm| {
            // Auto must pick recursive doubling for the short lengths and ring for 7919 elements.
            comm.set_small_message_threshold(4096);
            for segment_bytes in [1000, 512 * 1024] {
                // 1000 B is not a multiple of 8: segments of 125 f64 / 250 f32, many per chunk.
                comm.set_segment_bytes(segment_bytes);
                for alg in ALGS {
                    for len in [0, 1, 2, n - 1, n + 1, 7919] {
                        for op in OPS {
                            check_all_reduce::<f32>(comm, len, op, alg);
                            check_all_reduce::<f64>(comm, len, op, alg);
                            check_all_reduce::<i32>(comm, len, op, alg);
                            check_all_reduce::<i64>(comm, len, op, alg);
                        }
                    }
                }
            }
        });
    }
}

#[test]
fn all_reduce_of_a_mebi_element_buffer() {
    const LEN: usize = 1 << 20;
    for n in [2, 3, 5, 8] {
        spmd(n, |comm| {
            for alg in ALGS {
                for op in [ReduceOp::Sum, ReduceOp::Mean] {
                    check_all_reduce::<f32>(comm, LEN, op, alg);
                }
            }
        });
    }
}

/// Every rank must end with identical bits even where order matters: inexact float sums, and
/// Max over signed zeros (Max keeps its first operand when neither is greater).
#[test]
fn all_ranks_end_with_identical_bits_run_after_run() {
    let run = |n: usize, alg: Algorithm| -> Vec<(Vec<u32>, Vec<u32>)> {
        spmd(n, |comm| {
            comm.set_segment_bytes(256);
            let r = comm.rank();
            let mut sums: Vec<f32> = (0..1000)
                .map(|i| ((r * 7919 + i * 104_729) % 1_000_003) as f32 * 1.0e-3_f32.sqrt())
                .collect();
            comm.all_reduce_with(&mut sums, ReduceOp::Sum, alg).unwrap();
            let mut zeros: Vec<f32> = (0..64)
                .map(|i| if (r + i) % 2 == 0 { -0.0 } else { 0.0 })
                .collect();
            comm.all_reduce_with(&mut zeros, ReduceOp::Max, alg)
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            (bits(&sums), bits(&zeros))
        })
    };
    for n in [2, 4, 5, 6, 7] {
        for alg in [Algorithm::Ring, Algorithm::RecursiveDoubling] {
            let first = run(n, alg);
            for (rank, got) in first.iter().enumerate() {
                assert_eq!(
                    got, &first[0],
                    "n={n} {alg:?}: rank {rank} differs from rank 0"
                );
            }
            assert_eq!(run(n, alg), first, "n={n} {alg:?}: not reproducible");
        }
    }
}

/// Bytes on the wire per rank reveal the algorithm and must match the closed forms in the
/// algorithm files: ring 2(n-1)/n·S; recursive doubling log2(p)·S, plus S for folded ranks.
#[test]
fn auto_switches_at_the_threshold_and_bytes_match_the_cost_model() {
    const S: usize = 4000; // 1000 f32, divisible by 4 and 5
    for n in [4usize, 5] {
        let sent = spmd(n, |comm| {
            let mut buf = vec![1.0f32; S / 4];
            let mut per_op = Vec::new();
            for threshold in [S, S + 1] {
                comm.set_small_message_threshold(threshold);
                let before = comm.stats().bytes_sent;
                comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                per_op.push(comm.stats().bytes_sent - before);
            }
            assert_eq!(comm.stats().ops, 2);
            per_op
        });
        for (rank, per_op) in sent.iter().enumerate() {
            let ring = 2 * (n - 1) * S / n;
            let rd = match (n, rank) {
                (4, _) => 2 * S,
                (5, 0) => S,     // folded into rank 1
                (5, 1) => 3 * S, // fold partner: 2 butterfly steps + hand-back
                (5, _) => 2 * S,
                _ => unreachable!(),
            };
            assert_eq!(
                per_op[0] as usize, ring,
                "n={n} rank {rank}: threshold = S must choose ring"
            );
            assert_eq!(
                per_op[1] as usize, rd,
                "n={n} rank {rank}: threshold > S must choose recursive doubling"
            );
        }
    }
}

#[test]
fn broadcast_from_every_root_with_tree_and_chain() {
    for n in 1..=8 {
        spmd(n, |comm| {
            comm.set_segment_bytes(1000);
            // usize::MAX: every message is small (tree); 0: every message is large (chain).
            for threshold in [usize::MAX, 0] {
                comm.set_small_message_threshold(threshold);
                for root in 0..n {
                    for len in [0usize, 1, 7919] {
                        let fill = |i: usize| (i * 3 + root * 1_000_000) as i64;
                        let mut buf: Vec<i64> = if comm.rank() == root {
                            (0..len).map(fill).collect()
                        } else {
                            vec![-1; len]
                        };
                        comm.broadcast(&mut buf, root).unwrap();
                        for (i, v) in buf.iter().enumerate() {
                            assert_eq!(
                                *v,
                                fill(i),
                                "n={n} root={root} len={len} threshold={threshold} element {i}"
                            );
                        }
                    }
                }
            }
        });
    }
}

#[test]
fn all_gather_places_every_block_in_rank_order() {
    for n in 1..=8 {
        spmd(n, |comm| {
            comm.set_segment_bytes(1000);
            let r = comm.rank();
            for block in [0usize, 1, 7919] {
                let send: Vec<f64> = (0..block).map(|i| (r * 100_000 + i) as f64).collect();
                let mut recv = vec![f64::NAN; block * n];
                comm.all_gather(&send, &mut recv).unwrap();
                for (k, v) in recv.iter().enumerate() {
                    let want = ((k / block) * 100_000 + k % block) as f64;
                    assert_eq!(*v, want, "n={n} block={block} element {k}");
                }
            }
        });
    }
}

#[test]
fn reduce_scatter_ranges_cover_the_buffer_once_and_hold_the_reduction() {
    for n in 1..=8 {
        for len in [0usize, 1, n - 1, n, 7919] {
            let ranges = spmd(n, |comm| {
                comm.set_segment_bytes(1000);
                let r = comm.rank();
                let mut owned = Vec::new();
                for op in OPS {
                    let mut buf = local_data::<i32>(r, n, len);
                    let range = comm.reduce_scatter(&mut buf, op).unwrap();
                    assert_eq!(range, chunk_range(len, n, r));
                    for i in range.clone() {
                        assert_eq!(
                            buf[i],
                            expected::<i32>(n, i, op),
                            "n={n} len={len} {op:?} element {i}"
                        );
                    }
                    owned.push(range);
                }
                owned
            });
            for op in 0..OPS.len() {
                let mut next = 0;
                for (rank, owned) in ranges.iter().enumerate() {
                    assert_eq!(
                        owned[op].start, next,
                        "n={n} len={len}: gap or overlap before rank {rank}"
                    );
                    next = owned[op].end;
                }
                assert_eq!(next, len, "n={n} len={len}: ranges do not reach the end");
            }
        }
    }
}

/// A produced vector for `produced_reduce_scatter_gives_the_stored_ones_bits`: counts what was
/// produced and checks the order of what is consumed.
struct Values<'a> {
    rank: usize,
    value: &'a dyn Fn(usize, usize) -> f32,
    produced: Vec<u8>,
    got: Vec<f32>,
    mine: Range<usize>,
    next: usize,
}

impl lockstep_comm::collectives::ring::Produced<f32> for Values<'_> {
    fn produce(&mut self, range: Range<usize>, dst: &mut [f32]) {
        for (d, i) in dst.iter_mut().zip(range) {
            self.produced[i] += 1;
            *d = (self.value)(self.rank, i);
        }
    }

    fn consume(&mut self, range: Range<usize>, v: &[f32]) {
        assert_eq!(range.start, self.next, "consumed out of order");
        self.next = range.end;
        self.got[range.start - self.mine.start..range.end - self.mine.start].copy_from_slice(v);
    }
}

/// The produced reduce-scatter (values made segment by segment, never stored whole) against the
/// stored one: every world size 1–8, lengths around the chunk and segment boundaries, f32 values
/// whose sum depends on the order (so equal bits mean equal operations in equal order), every
/// op but Mean; every value produced exactly once, the owned chunk consumed once in order; and
/// peers mixing the two functions (same messages on the wire).
#[test]
fn produced_reduce_scatter_gives_the_stored_ones_bits() {
    use lockstep_comm::ReduceOp;
    let value =
        |r: usize, i: usize| ((r * 31 + i * 17) as f32).sin() * 10f32.powi((r + i) as i32 % 7 - 3);
    for n in 1..=8 {
        for len in [0usize, 1, n - 1, n, 333, 7919] {
            for mixed in [false, true] {
                spmd(n, |comm| {
                    comm.set_segment_bytes(1000);
                    let r = comm.rank();
                    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                        let mut stored: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
                        let mine = comm.reduce_scatter(&mut stored, op).unwrap();
                        let mut values = Values {
                            rank: r,
                            value: &value,
                            produced: vec![0; len],
                            got: vec![f32::NAN; mine.len()],
                            mine: mine.clone(),
                            next: mine.start,
                        };
                        if mixed && r % 2 == 1 {
                            let mut again: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
                            comm.reduce_scatter(&mut again, op).unwrap();
                            values.got.copy_from_slice(&again[mine.clone()]);
                            values.produced.fill(1);
                        } else {
                            let owned = comm.reduce_scatter_produced(len, op, &mut values).unwrap();
                            assert_eq!(owned, mine);
                            assert_eq!(
                                values.next, mine.end,
                                "n={n} len={len}: chunk not all consumed"
                            );
                        }
                        assert!(
                            values.produced.iter().all(|&c| c == 1),
                            "n={n} len={len} {op:?}: values produced {:?} times",
                            values.produced
                        );
                        let want: Vec<u32> =
                            stored[mine.clone()].iter().map(|x| x.to_bits()).collect();
                        let have: Vec<u32> = values.got.iter().map(|x| x.to_bits()).collect();
                        assert_eq!(have, want, "n={n} len={len} {op:?} mixed={mixed}");
                    }
                    let mut values = Values {
                        rank: r,
                        value: &value,
                        produced: vec![0; len],
                        got: Vec::new(),
                        mine: 0..0,
                        next: 0,
                    };
                    let e = comm
                        .reduce_scatter_produced(len, ReduceOp::Mean, &mut values)
                        .unwrap_err();
                    assert!(e.to_string().contains("reduce_scatter"), "{e}");
                });
            }
        }
    }
}

#[test]
fn nobody_leaves_a_barrier_before_everybody_arrived() {
    for n in [2usize, 3, 5, 8] {
        let arrived = AtomicUsize::new(0);
        spmd(n, |comm| {
            for round in 1..=3 {
                if comm.rank() == (round * 3) % n {
                    // The straggler: everybody else must wait for it.
                    std::thread::sleep(Duration::from_millis(30));
                }
                arrived.fetch_add(1, Ordering::SeqCst);
                comm.barrier().unwrap();
                let seen = arrived.load(Ordering::SeqCst);
                assert!(
                    seen >= round * n,
                    "n={n} round {round}: left the barrier after only {seen} arrivals"
                );
            }
        });
    }
}

#[test]
fn point_to_point_ring_and_pipeline() {
    for n in [2usize, 3, 5] {
        spmd(n, |comm| {
            comm.set_segment_bytes(1000);
            let r = comm.rank();
            let (right, left) = ((r + 1) % n, (r + n - 1) % n);
            // Ring shift of three messages of different lengths (in-process sends never block).
            let lens = [0usize, 5, 7919];
            for &len in &lens {
                let data: Vec<i32> = (0..len).map(|i| (r * 10_000 + i) as i32).collect();
                comm.send(right, &data).unwrap();
            }
            for &len in &lens {
                let mut buf = vec![-1i32; len];
                comm.recv(left, &mut buf).unwrap();
                for (i, v) in buf.iter().enumerate() {
                    assert_eq!(*v, (left * 10_000 + i) as i32, "n={n} rank {r} len {len}");
                }
            }
            // Pipeline 0 → 1 → … → n-1: each stage adds its rank and forwards.
            let mut x = vec![0.0f64; 3000];
            if r > 0 {
                comm.recv(r - 1, &mut x).unwrap();
            }
            x.iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v += (r * i) as f64);
            if r + 1 < n {
                comm.send(r + 1, &x).unwrap();
            } else {
                let stages = (n * (n - 1) / 2) as f64;
                assert!(x.iter().enumerate().all(|(i, v)| *v == stages * i as f64));
            }
        });
    }
}

#[test]
fn split_groups_run_collectives_independently() {
    for n in [5usize, 6] {
        spmd(n, |world| {
            let r = world.rank();
            // Two colours by parity; keys reverse the order inside each.
            let mut sub = world.split((r % 2) as u32, (n - r) as u32).unwrap();
            let mine: Vec<usize> = (0..n).filter(|q| q % 2 == r % 2).rev().collect();
            assert_eq!(sub.size(), mine.len());
            assert_eq!(sub.global_rank_of(sub.rank()), r);
            assert_eq!(
                (0..sub.size())
                    .map(|g| sub.global_rank_of(g))
                    .collect::<Vec<_>>(),
                mine
            );

            // Both sub-groups at the same time; sums only over their own members.
            let mut v = vec![r as i64; 100];
            sub.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert!(v.iter().all(|&x| x == mine.iter().sum::<usize>() as i64));
            let mut b = vec![r as i32; 10];
            sub.broadcast(&mut b, 0).unwrap(); // sub-rank 0 = the highest world rank of the colour
            assert!(b.iter().all(|&x| x == mine[0] as i32));
            sub.barrier().unwrap();

            // The parent still works, interleaved with the child.
            let mut w = vec![1.0f32; 10];
            world.all_reduce(&mut w, ReduceOp::Sum).unwrap();
            assert!(w.iter().all(|&x| x == n as f32));

            // Equal keys keep the parent's order; a split of a split works.
            let mut same = sub.split(0, 0).unwrap();
            assert_eq!(
                (0..same.size())
                    .map(|g| same.global_rank_of(g))
                    .collect::<Vec<_>>(),
                mine
            );
            let mut g = vec![0i64; same.size()];
            same.all_gather(&[r as i64], &mut g).unwrap();
            assert_eq!(g, mine.iter().map(|&q| q as i64).collect::<Vec<_>>());
        });
    }
}

/// The same 1-byte messages from a sub-group's barrier and its parent's barrier differ only by
/// tag: ranks that disagree about which group they are in must fail, not pair the messages.
#[test]
fn messages_of_different_groups_are_never_confused() {
    let results = spmd(2, |world| {
        world.set_timeout(SHORT);
        let mut sub = world.split(0, 0).unwrap();
        sub.set_timeout(SHORT);
        if world.rank() == 0 {
            sub.barrier()
        } else {
            world.barrier()
        }
    });
    for (rank, res) in results.iter().enumerate() {
        match res {
            Err(CommError::Op {
                op: "barrier",
                link,
            }) => {
                assert!(
                    matches!(link.failure, LinkFailure::Protocol(_)),
                    "rank {rank}: {link}"
                )
            }
            other => panic!("rank {rank}: expected a protocol error, got {other:?}"),
        }
    }
}

#[test]
fn stats_count_ops_bytes_and_time() {
    spmd(3, |comm| {
        let mut buf = vec![1i64; 300]; // 2400 B: ring sends 2·2/3 of it
        comm.all_reduce_with(&mut buf, ReduceOp::Sum, Algorithm::Ring)
            .unwrap();
        comm.barrier().unwrap();
        let s = comm.stats();
        assert_eq!(s.ops, 2);
        assert_eq!(s.bytes_sent, 3200 + 2); // plus two barrier tokens
        assert!(s.seconds > 0.0);
    });
}

#[test]
fn a_group_of_one_does_everything_locally() {
    spmd(1, |comm| {
        let mut buf = vec![3i32, -7, 5];
        for alg in ALGS {
            comm.all_reduce_with(&mut buf, ReduceOp::Mean, alg).unwrap();
        }
        assert_eq!(buf, [3, -7, 5]);
        comm.broadcast(&mut buf, 0).unwrap();
        let mut all = [0i32; 3];
        comm.all_gather(&buf, &mut all).unwrap();
        assert_eq!(all, [3, -7, 5]);
        assert_eq!(comm.reduce_scatter(&mut buf, ReduceOp::Sum).unwrap(), 0..3);
        comm.barrier().unwrap();
        let sub = comm.split(7, 7).unwrap();
        assert_eq!((sub.size(), sub.rank()), (1, 0));
        assert!(matches!(
            comm.send(0, &buf),
            Err(CommError::InvalidArgument { op: "send", .. })
        ));
        assert_eq!(comm.stats().bytes_sent, 0);
    });
}

#[test]
fn invalid_arguments_are_reported_and_leave_the_communicator_usable() {
    spmd(2, |comm| {
        let r = comm.rank();
        let mut buf = vec![1.0f32; 4];
        let invalid = |res: lockstep_comm::Result<()>, want: &str| match res {
            Err(e @ CommError::InvalidArgument { op, .. }) if op == want => e.to_string(),
            other => panic!("expected InvalidArgument from {want}, got {other:?}"),
        };
        let msg = invalid(comm.broadcast(&mut buf, 2), "broadcast");
        assert!(msg.contains("root 2"), "{msg}");
        let mut short = vec![0.0f32; 7];
        let msg = invalid(comm.all_gather(&buf, &mut short), "all_gather");
        assert!(msg.contains("recv holds 7"), "{msg}");
        invalid(comm.send(r, &buf), "send");
        invalid(comm.recv(r, &mut buf), "recv");
        invalid(comm.send(9, &buf), "send");
        assert!(comm.broken().is_none());
        assert_eq!(comm.stats().ops, 0);

        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        assert_eq!(buf, [2.0; 4]);
    });
}

fn expect_op_error<T: std::fmt::Debug>(
    res: lockstep_comm::Result<T>,
    want_op: &str,
) -> lockstep_comm::TransportError {
    match res {
        Err(CommError::Op { op, link }) if op == want_op => link,
        other => panic!("expected a {want_op} error, got {other:?}"),
    }
}

/// A broken communicator fails fast without touching the transport.
fn assert_broken_afterwards(comm: &mut Communicator) {
    let sent = comm.stats().bytes_sent;
    let t = Instant::now();
    let mut buf = [1.0f32; 8];
    match comm.all_reduce(&mut buf, ReduceOp::Sum) {
        Err(CommError::Broken(reason)) => assert_eq!(Some(reason.as_str()), comm.broken()),
        other => panic!("expected Broken, got {other:?}"),
    }
    assert!(matches!(comm.barrier(), Err(CommError::Broken(_))));
    // Untouched transport is the real check (no bytes sent); the time bound is a hang guard.
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(comm.stats().bytes_sent, sent);
}

#[test]
fn a_dead_rank_is_named_by_every_survivor_and_breaks_the_communicator() {
    let sync = Meet::new(3);
    let survivors_failed = Meet::new(2);
    spmd_raw(3, |t| {
        let mut comm = Communicator::new(Arc::new(t), SHORT);
        comm.set_algorithm(Algorithm::Ring);
        let mut buf = vec![1.0f32; 1000];
        for _ in 0..2 {
            comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        }
        if comm.rank() == 2 {
            drop(comm); // the process "dies": its transport goes away
            sync.wait();
            return;
        }
        sync.wait();
        let t0 = Instant::now();
        let res = comm.all_reduce(&mut buf, ReduceOp::Sum);
        let waited = t0.elapsed();
        // A survivor that finished must not vanish (and be reported as closed) before the other
        // has met the dead rank itself.
        survivors_failed.wait();
        let err = expect_op_error(res, "all_reduce");
        assert!(waited < 2 * SHORT, "took {waited:?}");
        assert_eq!(err.peer, 2, "{err}");
        assert!(matches!(err.failure, LinkFailure::Closed), "{err}");
        assert!(
            comm.broken().unwrap().starts_with("all_reduce: "),
            "{:?}",
            comm.broken()
        );
        assert!(
            comm.broken().unwrap().contains("rank 2 (inproc:2)"),
            "{:?}",
            comm.broken()
        );
        assert_broken_afterwards(&mut comm);
    });
}

#[test]
fn after_a_death_every_survivor_fails_within_the_timeout() {
    const N: usize = 5;
    let dead_gone = Meet::new(N);
    let all_failed = Meet::new(N - 1);
    spmd_raw(N, |t| {
        let mut comm = Communicator::new(Arc::new(t), SHORT);
        let mut buf = vec![1.0f32; 10_000];
        comm.all_reduce_with(&mut buf, ReduceOp::Sum, Algorithm::Ring)
            .unwrap();
        let r = comm.rank();
        if r == 2 {
            drop(comm);
            dead_gone.wait();
            return;
        }
        dead_gone.wait();
        let t0 = Instant::now();
        let res = comm.all_reduce_with(&mut buf, ReduceOp::Sum, Algorithm::Ring);
        let waited = t0.elapsed();
        // Survivors stay alive until all have failed, so the cascade is of timeouts, not closes.
        // (Waiting before asserting: a panicking survivor must not leave the others stuck here.)
        all_failed.wait();
        let err = expect_op_error(res, "all_reduce");
        assert!(waited < 2 * SHORT, "rank {r} took {waited:?}");
        // The ring neighbours of the dead rank see it go; the others time out on a neighbour
        // that stopped because of it.
        if r == 1 || r == 3 {
            assert_eq!(err.peer, 2, "rank {r}: {err}");
            assert!(
                matches!(err.failure, LinkFailure::Closed),
                "rank {r}: {err}"
            );
        }
        assert_broken_afterwards(&mut comm);
    });
}

#[test]
fn a_rank_that_never_calls_is_named_in_a_timeout() {
    // Two ranks: the all-reduce of rank 0 waits for rank 1 only.
    let done = Meet::new(2);
    spmd_raw(2, |t| {
        let mut comm = Communicator::new(Arc::new(t), SHORT);
        if comm.rank() == 1 {
            done.wait(); // alive, but never joins the operation
            return;
        }
        let t0 = Instant::now();
        let res = comm.all_reduce(&mut [1.0f64; 10], ReduceOp::Sum);
        let waited = t0.elapsed();
        done.wait(); // before any assertion, so a failure cannot leave rank 1 waiting forever
        let err = expect_op_error(res, "all_reduce");
        assert!(waited >= SHORT && waited < 2 * SHORT, "waited {waited:?}");
        assert!(err.is_timeout() && err.peer == 1, "{err}");
        let msg = CommError::Op {
            op: "all_reduce",
            link: err,
        }
        .to_string();
        // The message states the time waited: at least the timeout, less than twice it.
        let said = waited_in_message(&msg);
        assert!(
            msg.starts_with("all_reduce: timed out after ")
                && (0.49..1.0).contains(&said)
                && msg.ends_with("rank 1 (inproc:1)"),
            "{msg}"
        );
        assert_broken_afterwards(&mut comm);
    });
    // Three ranks in a dissemination barrier: both others end up waiting for the missing rank.
    let done = Meet::new(3);
    spmd_raw(3, |t| {
        let mut comm = Communicator::new(Arc::new(t), SHORT);
        if comm.rank() == 2 {
            done.wait();
            return;
        }
        let res = comm.barrier();
        done.wait();
        let err = expect_op_error(res, "barrier");
        assert!(
            err.is_timeout() && err.peer == 2,
            "rank {}: {err}",
            comm.rank()
        );
    });
}

/// Each public call reports failures under its own name.
#[test]
fn errors_name_the_public_operation() {
    let gone = Meet::new(2);
    spmd_raw(2, |t| {
        if t.rank() == 1 {
            drop(t);
            gone.wait();
            return;
        }
        gone.wait();
        let t: Arc<dyn Transport> = Arc::new(t);
        let fresh = || Communicator::new(t.clone(), SHORT);
        let mut buf = vec![1i64; 16];
        let mut two = vec![0i64; 32];
        let errors = [
            expect_op_error(fresh().all_reduce(&mut buf, ReduceOp::Sum), "all_reduce"),
            expect_op_error(fresh().broadcast(&mut buf, 0), "broadcast"),
            expect_op_error(fresh().broadcast(&mut buf, 1), "broadcast"),
            expect_op_error(fresh().all_gather(&buf, &mut two), "all_gather"),
            expect_op_error(
                fresh().reduce_scatter(&mut buf, ReduceOp::Max),
                "reduce_scatter",
            ),
            expect_op_error(fresh().barrier(), "barrier"),
            expect_op_error(fresh().send(1, &buf), "send"),
            expect_op_error(fresh().recv(1, &mut buf), "recv"),
            expect_op_error(fresh().split(0, 0), "split"),
        ];
        for e in errors {
            assert!(
                e.peer == 1 && matches!(e.failure, LinkFailure::Closed),
                "{e}"
            );
        }
    });
}
