//! The exact sum over shared gradient windows (`shared_parts`, `ExactReducer::reduce_shared`),
//! over real shared-memory transports between threads: world sizes × lengths × parts per rank
//! against the one-rank sum's bits, several steps through the same windows, the worker's threads,
//! nothing left in the directory, no windows where there is no shared memory, and a rank that
//! announces the wrong number of parts refused on every rank.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use lockstep_comm::collectives::chunk_range;
use lockstep_comm::exact::{ExactError, ExactReducer};
use lockstep_comm::inproc::in_process_group;
use lockstep_comm::shared_parts::{SharedParts, Sharing};
use lockstep_comm::shm::ShmTransport;
use lockstep_comm::Communicator;

#[path = "common/scratch.rs"]
mod scratch;
use scratch::Scratch;

const TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `f` on `n` ranks (threads) joined by shared-memory transports in `s`'s directory.
fn spmd_shm<R: Send>(s: &Scratch, n: usize, f: impl Fn(&mut Communicator) -> R + Sync) -> Vec<R> {
    let opts = s.opts(1 << 16);
    std::thread::scope(|sc| {
        let f = &f;
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (opts, job) = (opts.clone(), s.job.clone());
                sc.spawn(move || {
                    let t = ShmTransport::establish(r, n, &job, TIMEOUT, &opts).unwrap();
                    let mut comm = Communicator::new(Arc::new(t), TIMEOUT);
                    f(&mut comm)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// `m` micro-batch gradients of `len` values whose float sum depends on the order (mixed
/// scales), different for every `seed`.
fn parts(m: usize, len: usize, seed: usize) -> Vec<Vec<f32>> {
    (0..m)
        .map(|k| {
            (0..len)
                .map(|i| {
                    ((k * 31 + i * 17 + seed * 7) as f32).sin()
                        * 10f32.powi((k + i + seed) as i32 % 5 - 2)
                })
                .collect()
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn buckets(len: usize, bucket: usize) -> Vec<Range<usize>> {
    ExactReducer::new(bucket)
        .buckets(len)
        .map(|(s, e)| s..e)
        .collect()
}

/// The reference: one rank holding every part.
fn one_rank_sum(all: &[Vec<f32>], len: usize, bucket: usize) -> Vec<f32> {
    let t = in_process_group(1).remove(0);
    let mut comm = Communicator::new(Arc::new(t), TIMEOUT);
    let refs: Vec<&[f32]> = all.iter().map(|p| p.as_slice()).collect();
    let mut out = vec![0f32; len];
    ExactReducer::new(bucket)
        .reduce(&mut comm, &refs, all.len(), &mut out)
        .unwrap();
    out
}

/// Every rank's result of `steps` reductions of `m` parts (rank r holds its contiguous share)
/// through one set of windows, each step with other values.
fn shared_sums(n: usize, len: usize, m: usize, bucket: usize, steps: usize) -> Vec<Vec<Vec<f32>>> {
    let s = Scratch::new();
    let got = spmd_shm(&s, n, |comm| {
        let mine = chunk_range(m, n, comm.rank());
        let Sharing::Shared(mut shared) = SharedParts::establish(comm, mine.len(), len).unwrap()
        else {
            panic!("a shared-memory group of several ranks has windows");
        };
        let mut reducer = ExactReducer::new(bucket);
        (0..steps)
            .map(|step| {
                let all = parts(m, len, step);
                for (slot, k) in mine.clone().enumerate() {
                    shared.part_mut(slot).copy_from_slice(&all[k]);
                }
                reducer
                    .reduce_shared(comm, &mut shared, mine.len(), m, &buckets(len, bucket))
                    .unwrap();
                shared.sum().to_vec()
            })
            .collect()
    });
    s.assert_empty();
    got
}

#[test]
fn every_rank_gets_the_one_rank_bits_step_after_step() {
    for n in 2..=4 {
        for (len, m) in [0usize, 1, 5, 257, 4099]
            .into_iter()
            .flat_map(|len| [(len, 7), (len, n), (len, n - 1)])
        {
            let got = shared_sums(n, len, m, 256, 2);
            for step in 0..2 {
                let want = one_rank_sum(&parts(m, len, step), len, 256);
                for (r, outs) in got.iter().enumerate() {
                    assert_eq!(
                        bits(&outs[step]),
                        bits(&want),
                        "n={n} len={len} m={m} step={step} rank={r}"
                    );
                }
            }
        }
    }
}

#[test]
fn buckets_cut_by_chunk_boundaries_and_the_worker_threads_keep_the_bits() {
    // 200k values: each of 2 ranks' chunks is above the size where the pieces go to threads;
    // buckets of 30k straddle the chunk boundary.
    let (len, m) = (200_000usize, 4usize);
    let want = one_rank_sum(&parts(m, len, 0), len, 30_000);
    for threads in [1usize, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let got = pool.install(|| shared_sums(2, len, m, 30_000, 1));
        for (r, outs) in got.iter().enumerate() {
            assert_eq!(bits(&outs[0]), bits(&want), "threads={threads} rank={r}");
        }
    }
}

#[test]
fn no_windows_without_shared_memory_or_peers() {
    let t = in_process_group(2);
    std::thread::scope(|sc| {
        for t in t {
            sc.spawn(move || {
                let mut comm = Communicator::new(Arc::new(t), TIMEOUT);
                let sharing = SharedParts::establish(&mut comm, 2, 100).unwrap();
                assert!(matches!(sharing, Sharing::NoSharedMemory));
            });
        }
    });
    let s = Scratch::new();
    let none = spmd_shm(&s, 1, |comm| {
        matches!(
            SharedParts::establish(comm, 2, 100).unwrap(),
            Sharing::NoSharedMemory
        )
    });
    assert_eq!(none, [true]);
}

#[test]
fn a_window_that_cannot_be_created_leaves_every_rank_on_the_rings() {
    let s = Scratch::new();
    let answers = spmd_shm(&s, 3, |comm| {
        // Rank 1 asks for 2^40 parts: no tmpfs holds that.
        let slots = if comm.rank() == 1 { 1 << 40 } else { 2 };
        match SharedParts::establish(comm, slots, 1000).unwrap() {
            Sharing::Unavailable(why) => why,
            _ => panic!("rank {} got windows", comm.rank()),
        }
    });
    for (r, why) in answers.iter().enumerate() {
        assert!(
            why.contains("rank 1 could not create its window"),
            "rank {r}: {why}"
        );
    }
    s.assert_empty();
}

#[test]
fn parts_that_do_not_add_up_to_the_job_are_refused_on_every_rank() {
    let s = Scratch::new();
    let results = spmd_shm(&s, 2, |comm| {
        let Sharing::Shared(mut shared) = SharedParts::establish(comm, 2, 10).unwrap() else {
            panic!("no windows");
        };
        shared.part_mut(0).fill(1.0);
        shared.part_mut(1).fill(2.0);
        // Each rank holds 2 parts, but the job is said to have 3 micro-batches.
        ExactReducer::new(4).reduce_shared(comm, &mut shared, 2, 3, &buckets(10, 4))
    });
    for r in results {
        match r {
            Err(ExactError::Invalid(m)) => assert!(m.contains("hold 4 parts"), "{m}"),
            other => panic!("expected Invalid, got {other:?}"),
        }
    }
}
