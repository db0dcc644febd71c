//! The exact sum reduce-scattered (ZeRO's gradient path) and reduce-scattered then all-gathered
//! (the cheaper full reduction), over the in-process transport: world sizes × lengths × bucket
//! sizes against the one-rank sum, integer closed forms, untouched non-owned values, bytes on
//! the wire (fewer when no rank holds more than one micro-batch), and non-finite values reported on every rank; the cheapest schedule
//! (`reduce_cheapest`, `reduce_bucket`: scattered where that saves bytes, fused on one rank) against
//! the all-reduce's bits at every algorithm setting.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use lockstep_comm::collectives::chunk_range;
use lockstep_comm::exact::{scatter_pays, ExactError, ExactReducer};
use lockstep_comm::inproc::in_process_group;
use lockstep_comm::{Algorithm, Communicator};

const TIMEOUT: Duration = Duration::from_secs(20);

fn spmd<R: Send>(n: usize, f: impl Fn(&mut Communicator) -> R + Sync) -> Vec<R> {
    let transports = in_process_group(n);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = transports
            .into_iter()
            .map(|t| {
                s.spawn(move || {
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

/// `m` micro-batch gradients of `len` values whose float sum depends on the order (mixed scales).
fn parts(m: usize, len: usize) -> Vec<Vec<f32>> {
    (0..m)
        .map(|k| {
            (0..len)
                .map(|i| ((k * 31 + i * 17) as f32).sin() * 10f32.powi((k + i) as i32 % 5 - 2))
                .collect()
        })
        .collect()
}

/// Contiguous share of `m` parts for rank `r` of `n` (any assignment must give the same bits).
fn share(m: usize, n: usize, r: usize) -> Range<usize> {
    chunk_range(m, n, r)
}

/// This rank's contiguous share of the `all` parts.
fn my_parts<'a>(all: &'a [Vec<f32>], comm: &Communicator) -> Vec<&'a [f32]> {
    all[share(all.len(), comm.size(), comm.rank())]
        .iter()
        .map(|p| p.as_slice())
        .collect()
}

/// `reducer`'s buckets of a `len`-value vector, as ranges.
fn bucket_ranges(reducer: &ExactReducer, len: usize) -> Vec<Range<usize>> {
    reducer.buckets(len).map(|(s, e)| s..e).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The reference: one rank holding every part.
fn one_rank_sum(all: &[Vec<f32>], len: usize, bucket: usize) -> Vec<f32> {
    spmd(1, |comm| {
        let refs: Vec<&[f32]> = all.iter().map(|p| p.as_slice()).collect();
        let mut out = vec![0f32; len];
        ExactReducer::new(bucket)
            .reduce(comm, &refs, all.len(), &mut out)
            .unwrap();
        out
    })
    .remove(0)
}

#[test]
fn reduce_scatter_owns_its_chunk_with_the_bits_of_the_whole_sum() {
    for n in 1..=5 {
        for len in [0usize, 1, 2, 7, 100, 1031] {
            // 6 micro-batches (several per rank), or at most one per rank (the first step then
            // sends f32 values), some ranks holding none when m < n.
            for (bucket, m) in [1usize, 3, 64, 4096]
                .into_iter()
                .flat_map(|b| [(b, 6), (b, n), (b, n - 1)])
                .filter(|&(_, m)| m > 0)
            {
                let all = parts(m, len);
                let want = one_rank_sum(&all, len, bucket);
                let got = spmd(n, |comm| {
                    let r = comm.rank();
                    let refs: Vec<&[f32]> =
                        all[share(m, n, r)].iter().map(|p| p.as_slice()).collect();
                    let mut shard = vec![f32::NAN; chunk_range(len, n, r).len()];
                    let mine = ExactReducer::new(bucket)
                        .reduce_scatter(comm, &refs, m, len, &mut shard)
                        .unwrap();
                    (mine, shard)
                });
                let mut next = 0;
                for (r, (mine, shard)) in got.iter().enumerate() {
                    let case = format!("n={n} len={len} bucket={bucket} rank={r}");
                    assert_eq!(*mine, chunk_range(len, n, r), "{case}");
                    assert_eq!(mine.start, next, "{case}: chunks tile the vector");
                    next = mine.end;
                    assert_eq!(bits(shard), bits(&want[mine.clone()]), "{case}");
                }
                assert_eq!(next, len);
            }
        }
    }
}

#[test]
fn a_shard_of_the_wrong_length_is_refused_on_every_rank() {
    let results = spmd(2, |comm| {
        let part = vec![1f32; 10];
        let mut shard = vec![0f32; 4]; // each rank owns 5
        ExactReducer::new(4).reduce_scatter(comm, &[&part], 2, 10, &mut shard)
    });
    for r in results {
        match r {
            Err(ExactError::Invalid(m)) => assert!(m.contains("owns values"), "{m}"),
            other => panic!("expected Invalid, got {other:?}"),
        }
    }
}

#[test]
fn scattered_then_gathered_gives_every_rank_the_whole_sum() {
    for n in 1..=5 {
        for (len, m) in [0usize, 1, 5, 257, 4099]
            .into_iter()
            .flat_map(|len| [(len, 7), (len, n), (len, n - 1)])
            .filter(|&(_, m)| m > 0)
        {
            let all = parts(m, len);
            let want = one_rank_sum(&all, len, 256);
            let buckets: Vec<Range<usize>> = ExactReducer::new(256)
                .buckets(len)
                .map(|(s, e)| s..e)
                .collect();
            let got = spmd(n, |comm| {
                let refs: Vec<&[f32]> = all[share(m, n, comm.rank())]
                    .iter()
                    .map(|p| p.as_slice())
                    .collect();
                let mut out = vec![f32::NAN; len];
                ExactReducer::new(256)
                    .reduce_scattered_then_gathered(comm, &refs, m, &mut out, &buckets)
                    .unwrap();
                out
            });
            for (r, out) in got.iter().enumerate() {
                assert_eq!(bits(out), bits(&want), "n={n} len={len} rank={r}");
            }
        }
    }
}

#[test]
fn integer_parts_sum_to_their_closed_form() {
    // Part k on element i holds (k + 1) · (i mod 13) − 6: exactly representable, so the exact sum
    // is Σ_k (k+1)·(i mod 13) − 6·m = m(m+1)/2 · (i mod 13) − 6m.
    let (m, len) = (8usize, 999usize);
    let all: Vec<Vec<f32>> = (0..m)
        .map(|k| {
            (0..len)
                .map(|i| ((k + 1) * (i % 13)) as f32 - 6.0)
                .collect()
        })
        .collect();
    for n in [2usize, 3, 4] {
        let got = spmd(n, |comm| {
            let refs: Vec<&[f32]> = all[share(m, n, comm.rank())]
                .iter()
                .map(|p| p.as_slice())
                .collect();
            let mine = chunk_range(len, n, comm.rank());
            let mut shard = vec![0f32; mine.len()];
            ExactReducer::new(100)
                .reduce_scatter(comm, &refs, m, len, &mut shard)
                .unwrap();
            (mine, shard)
        });
        for (mine, shard) in got {
            for (i, v) in mine.zip(shard) {
                let want = (m * (m + 1) / 2 * (i % 13)) as f32 - 6.0 * m as f32;
                assert_eq!(v, want, "n={n} element {i}");
            }
        }
    }
}

#[test]
fn scattered_then_gathered_sends_three_quarters_or_half_of_the_all_reduce_bytes() {
    // Two ranks, 1 Mi values: all-reduce of i64 sends (n−1)/n · 2 · 8P = 8P bytes per rank;
    // reduce-scatter of i64 + all-gather of f32 send (n−1)/n · (8 + 4)P = 6P; and when no rank
    // holds more than one micro-batch the reduce-scatter's messages carry the f32 values
    // themselves: (n−1)/n · (4 + 4)P = 4P, a plain f32 all-reduce's bytes. The exponent
    // all-reduce adds a few bytes per bucket.
    let len = 1 << 20;
    let bucket = 1 << 16;
    let buckets: Vec<Range<usize>> = ExactReducer::new(bucket)
        .buckets(len)
        .map(|(s, e)| s..e)
        .collect();
    for (m, per_value) in [(2usize, 4u64), (4, 6)] {
        let all = parts(m, len);
        let sent = spmd(2, |comm| {
            let refs: Vec<&[f32]> = all[share(m, 2, comm.rank())]
                .iter()
                .map(|p| p.as_slice())
                .collect();
            let mut out = vec![0f32; len];
            let mut reducer = ExactReducer::new(bucket);
            let before = comm.stats().bytes_sent;
            reducer.reduce(comm, &refs, m, &mut out).unwrap();
            let full = comm.stats().bytes_sent - before;
            let reference = out.clone();
            let before = comm.stats().bytes_sent;
            reducer
                .reduce_scattered_then_gathered(comm, &refs, m, &mut out, &buckets)
                .unwrap();
            assert_eq!(
                bits(&out),
                bits(&reference),
                "m={m}: not the all-reduce's bits"
            );
            (full, comm.stats().bytes_sent - before)
        });
        for (full, cheaper) in sent {
            let p = len as u64;
            let slack = 4096;
            assert!(
                full >= 8 * p && full <= 8 * p + slack,
                "m={m}: all-reduce sent {full}"
            );
            assert!(
                cheaper >= per_value * p && cheaper <= per_value * p + slack,
                "m={m}: reduce-scatter + all-gather sent {cheaper}, expected {per_value} per value"
            );
        }
    }
}

#[test]
fn a_non_finite_value_on_one_rank_is_reported_on_every_rank() {
    let len = 300;
    let results = spmd(3, |comm| {
        let mut part = vec![1f32; len];
        if comm.rank() == 2 {
            part[150] = f32::NAN;
        }
        let mut shard = vec![0f32; chunk_range(len, 3, comm.rank()).len()];
        ExactReducer::new(100).reduce_scatter(comm, &[&part], 3, len, &mut shard)
    });
    for r in results {
        match r {
            Err(ExactError::NonFinite { start, end }) => assert_eq!((start, end), (100, 200)),
            other => panic!("expected NonFinite, got {other:?}"),
        }
    }
}

#[test]
fn the_cheapest_schedule_and_each_bucket_alone_give_the_bits_of_the_all_reduce() {
    // Lengths on both sides of the small-message threshold (256 KiB of i64 = 32,768 values),
    // every algorithm setting, world sizes 1–4 (one rank: the fused local pass).
    for n in 1..=4 {
        for len in [0usize, 1, 5, 4099, 40_000] {
            for bucket in [256usize, 1 << 15] {
                let m = 7;
                let all = parts(m, len);
                let want = one_rank_sum(&all, len, bucket);
                for alg in [
                    Algorithm::Auto,
                    Algorithm::Ring,
                    Algorithm::RecursiveDoubling,
                ] {
                    let got = spmd(n, |comm| {
                        comm.set_algorithm(alg);
                        let refs = my_parts(&all, comm);
                        let mut reducer = ExactReducer::new(bucket);
                        let buckets = bucket_ranges(&reducer, len);
                        let mut whole = vec![f32::NAN; len];
                        reducer
                            .reduce_cheapest(comm, &refs, m, &mut whole, &buckets)
                            .unwrap();
                        let mut by_bucket = vec![f32::NAN; len];
                        for b in buckets.iter().rev() {
                            reducer
                                .reduce_bucket(comm, &refs, m, b.clone(), &mut by_bucket)
                                .unwrap();
                        }
                        (whole, by_bucket)
                    });
                    for (r, (whole, by_bucket)) in got.iter().enumerate() {
                        let case = format!("n={n} len={len} bucket={bucket} {alg:?} rank={r}");
                        assert_eq!(bits(whole), bits(&want), "{case}: reduce_cheapest");
                        assert_eq!(bits(by_bucket), bits(&want), "{case}: reduce_bucket");
                    }
                }
            }
        }
    }
}

#[test]
fn exponents_scanned_ahead_give_the_same_bits_on_every_schedule() {
    // Each rank scans its parts as they are made (scan_part), then reduces: every schedule must
    // give the one-rank bits, and a second reduction without a pre-scan too (it was taken).
    for n in 1..=4 {
        for len in [0usize, 5, 4099, 40_000] {
            for bucket in [256usize, 1 << 15] {
                let m = 7;
                let all = parts(m, len);
                let want = one_rank_sum(&all, len, bucket);
                let got = spmd(n, |comm| {
                    let refs = my_parts(&all, comm);
                    let mut reducer = ExactReducer::new(bucket);
                    let buckets = bucket_ranges(&reducer, len);
                    let scan = |reducer: &mut ExactReducer| {
                        for p in &refs {
                            reducer.scan_part(p, &buckets);
                        }
                    };
                    let mut cheapest = vec![f32::NAN; len];
                    scan(&mut reducer);
                    reducer
                        .reduce_cheapest(comm, &refs, m, &mut cheapest, &buckets)
                        .unwrap();
                    let mut all_reduced = vec![f32::NAN; len];
                    scan(&mut reducer);
                    reducer
                        .reduce_with_buckets(comm, &refs, m, &mut all_reduced, &buckets)
                        .unwrap();
                    let mine = chunk_range(len, comm.size(), comm.rank());
                    let mut shard = vec![f32::NAN; mine.len()];
                    scan(&mut reducer);
                    reducer
                        .reduce_scatter_with_buckets(comm, &refs, m, &mut shard, &buckets)
                        .unwrap();
                    let mut unscanned = vec![f32::NAN; len];
                    reducer
                        .reduce_cheapest(comm, &refs, m, &mut unscanned, &buckets)
                        .unwrap();
                    (cheapest, all_reduced, mine, shard, unscanned)
                });
                for (r, (cheapest, all_reduced, mine, shard, unscanned)) in got.iter().enumerate() {
                    let case = format!("n={n} len={len} bucket={bucket} rank={r}");
                    assert_eq!(bits(cheapest), bits(&want), "{case}: reduce_cheapest");
                    assert_eq!(bits(all_reduced), bits(&want), "{case}: all-reduce");
                    assert_eq!(bits(shard), bits(&want[mine.clone()]), "{case}: shard");
                    assert_eq!(bits(unscanned), bits(&want), "{case}: after the pre-scan");
                }
            }
        }
    }
}

#[test]
fn a_pre_scan_that_does_not_cover_the_parts_is_refused() {
    let all = parts(3, 1000);
    let refs: Vec<&[f32]> = all.iter().map(|p| p.as_slice()).collect();
    spmd(1, |comm| {
        let mut reducer = ExactReducer::new(256);
        let buckets: Vec<Range<usize>> = reducer.buckets(1000).map(|(s, e)| s..e).collect();
        let mut out = vec![0f32; 1000];
        // Two parts scanned, three reduced: on the fused one-rank pass and on the all-reduce.
        for all_reduce in [false, true] {
            reducer.scan_part(refs[0], &buckets);
            reducer.scan_part(refs[1], &buckets);
            let e = if all_reduce {
                reducer.reduce_with_buckets(comm, &refs, 3, &mut out, &buckets)
            } else {
                reducer.reduce_cheapest(comm, &refs, 3, &mut out, &buckets)
            }
            .unwrap_err();
            assert!(
                matches!(&e, ExactError::Invalid(m) if m.contains("2 parts") && m.contains("3 parts")),
                "{e}"
            );
        }
        // Scanned over other buckets; a part of another length among the scanned ones.
        let coarse: Vec<Range<usize>> = vec![0..500, 500..1000];
        let short = &refs[1][..999];
        // (parts scanned with their buckets, what the refusal says)
        type Scans<'a> = Vec<(&'a [f32], &'a [Range<usize>])>;
        let cases: [(Scans, &str); 2] = [
            (
                refs.iter().map(|p| (*p, &coarse[..])).collect(),
                "2 buckets",
            ),
            (
                vec![(refs[0], &buckets), (short, &buckets), (refs[2], &buckets)],
                "different lengths",
            ),
        ];
        for (scans, needle) in cases {
            for (part, b) in scans {
                reducer.scan_part(part, b);
            }
            let e = reducer
                .reduce_cheapest(comm, &refs, 3, &mut out, &buckets)
                .unwrap_err();
            assert!(
                matches!(&e, ExactError::Invalid(m) if m.contains(needle)),
                "{e}"
            );
        }
        // reduce_bucket scans its own bucket: a pending pre-scan is refused, not left over.
        reducer.scan_part(refs[0], &buckets);
        let e = reducer
            .reduce_bucket(comm, &refs, 3, 0..256, &mut out)
            .unwrap_err();
        assert!(
            matches!(&e, ExactError::Invalid(m) if m.contains("scan_part")),
            "{e}"
        );
        reducer
            .reduce_cheapest(comm, &refs, 3, &mut out, &buckets)
            .unwrap();
    });
}

#[test]
fn the_cheapest_schedule_scatters_only_where_it_saves_bytes() {
    let comms = spmd(2, |comm| {
        let small = scatter_pays(comm, 32_767);
        let large = scatter_pays(comm, 32_768);
        comm.set_algorithm(Algorithm::RecursiveDoubling);
        let rd = scatter_pays(comm, 1 << 20);
        comm.set_algorithm(Algorithm::Ring);
        let ring = scatter_pays(comm, 1);
        (small, large, rd, ring)
    });
    for c in comms {
        assert_eq!(c, (false, true, false, true), "(small, large, rd, ring)");
    }
    assert!(
        !spmd(1, |comm| scatter_pays(comm, 1 << 20))[0],
        "one rank never"
    );

    // Two ranks of one micro-batch each, 1 Mi values: 4 bytes per value, as
    // reduce_scattered_then_gathered.
    let len = 1 << 20;
    let all = parts(2, len);
    let sent = spmd(2, |comm| {
        let part = all[comm.rank()].as_slice();
        let mut reducer = ExactReducer::new(1 << 16);
        let buckets: Vec<Range<usize>> = reducer.buckets(len).map(|(s, e)| s..e).collect();
        let mut out = vec![0f32; len];
        let before = comm.stats().bytes_sent;
        reducer
            .reduce_cheapest(comm, &[part], 2, &mut out, &buckets)
            .unwrap();
        comm.stats().bytes_sent - before
    });
    for s in sent {
        assert!((4 * len as u64..4 * len as u64 + 4096).contains(&s), "{s}");
    }
}

#[test]
fn one_rank_reports_a_non_finite_bucket_and_zero_buckets_stay_zero() {
    let mut a = vec![0f32; 300];
    let mut b = vec![0f32; 300];
    a[20] = 1.5;
    b[250] = -0.25;
    let got = spmd(1, |comm| {
        let mut reducer = ExactReducer::new(100);
        let buckets: Vec<Range<usize>> = reducer.buckets(300).map(|(s, e)| s..e).collect();
        let mut out = vec![f32::NAN; 300];
        reducer
            .reduce_cheapest(comm, &[&a, &b], 2, &mut out, &buckets)
            .unwrap();
        let mut bad = b.clone();
        bad[150] = f32::INFINITY;
        let err = reducer
            .reduce_cheapest(comm, &[&a, &bad], 2, &mut vec![0f32; 300], &buckets)
            .unwrap_err();
        (out, err)
    });
    let (out, err) = &got[0];
    let mut want = vec![0f32; 300];
    want[20] = 1.5;
    want[250] = -0.25;
    assert_eq!(
        bits(out),
        bits(&want),
        "zero buckets are zero, values exact"
    );
    match err {
        ExactError::NonFinite { start, end } => assert_eq!((*start, *end), (100, 200)),
        other => panic!("expected NonFinite, got {other:?}"),
    }
}

/// The one-rank pass splits its buckets between the worker's threads above 64k values: the same
/// bits at 1–4 threads, with and without exponents scanned ahead, and the first non-finite
/// bucket in order is the one reported, whichever thread reaches it first.
#[test]
fn one_rank_gives_the_same_bits_on_any_number_of_threads() {
    let len = 200_003;
    let all = parts(3, len);
    let refs: Vec<&[f32]> = all.iter().map(|p| p.as_slice()).collect();
    let mut bad = all[1].clone();
    bad[150_000] = f32::NAN;
    bad[90_000] = f32::NEG_INFINITY;
    let bad_refs = [refs[0], bad.as_slice(), refs[2]];
    let run = |threads: usize, prescan: bool| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut reducer = ExactReducer::new(4096);
            let buckets = bucket_ranges(&reducer, len);
            if prescan {
                for p in &refs {
                    reducer.scan_part(p, &buckets);
                }
            }
            let mut out = vec![f32::NAN; len];
            reducer
                .reduce_local_with_buckets(&refs, 3, &mut out, &buckets)
                .unwrap();
            let err = reducer
                .reduce_local_with_buckets(&bad_refs, 3, &mut vec![0f32; len], &buckets)
                .unwrap_err();
            (bits(&out), err.to_string())
        })
    };
    let (want, want_err) = run(1, false);
    assert_eq!(want, bits(&one_rank_sum(&all, len, 4096)));
    assert!(want_err.contains("elements 86016..90112"), "{want_err}");
    for threads in 1..=4 {
        for prescan in [false, true] {
            let (got, err) = run(threads, prescan);
            assert!(got == want, "{threads} threads, pre-scan {prescan}");
            assert_eq!(err, want_err, "{threads} threads, pre-scan {prescan}");
        }
    }
}
