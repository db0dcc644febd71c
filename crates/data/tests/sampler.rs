//! The sampler and the micro-batch partition: permutations, determinism, world-size independence.

use lockstep_data::{assign, microbatches, Sampler};

fn is_permutation(v: &[u32], n: usize) -> bool {
    let mut seen = vec![false; n];
    v.len() == n
        && v.iter()
            .all(|&i| !std::mem::replace(&mut seen[i as usize], true))
}

#[test]
fn golden_first_batches() {
    // Values computed by an independent Python transcription of rng.rs (splitmix64 seeding,
    // xoshiro256**, Lemire bounded integers, Fisher–Yates from the end). If this fails, the
    // sample order of every existing run has changed: that needs a deliberate decision.
    let s = Sampler::new(10, 4, 7).unwrap();
    assert_eq!(s.steps_per_epoch(), 2);
    assert_eq!(s.epoch_permutation(0), [5, 3, 8, 1, 0, 2, 4, 9, 7, 6]);
    assert_eq!(s.epoch_permutation(1), [1, 3, 9, 2, 4, 0, 7, 6, 8, 5]);
    assert_eq!(s.global_batch(0), [5, 3, 8, 1]);
    assert_eq!(s.global_batch(1), [0, 2, 4, 9]);
    assert_eq!(s.global_batch(2), [1, 3, 9, 2]);
    let d = Sampler::new(1797, 64, 2024).unwrap();
    assert_eq!(
        d.global_batch(0)[..8],
        [1360, 1302, 1054, 1212, 582, 1224, 1425, 1751]
    );
}

#[test]
fn each_epoch_is_a_permutation_and_steps_tile_it() {
    let (n, gb) = (103, 10);
    let s = Sampler::new(n, gb, 5).unwrap();
    assert_eq!(s.steps_per_epoch(), 10); // 3 samples dropped per epoch
    let spe = s.steps_per_epoch() as u64;
    for epoch in 0..4u64 {
        let perm = s.epoch_permutation(epoch);
        assert!(is_permutation(&perm, n));
        let steps: Vec<u32> = (epoch * spe..(epoch + 1) * spe)
            .flat_map(|step| {
                assert_eq!(s.epoch(step), epoch);
                s.global_batch(step)
            })
            .collect();
        assert_eq!(steps, perm[..100]);
    }
}

#[test]
fn epochs_differ_seeds_differ_same_seed_repeats() {
    let a = Sampler::new(1000, 100, 1).unwrap();
    let b = Sampler::new(1000, 100, 1).unwrap();
    let c = Sampler::new(1000, 100, 2).unwrap();
    assert_ne!(a.epoch_permutation(0), a.epoch_permutation(1));
    assert_ne!(a.epoch_permutation(0), c.epoch_permutation(0));
    assert_ne!(a.epoch_permutation(0), (0..1000).collect::<Vec<u32>>());
    // Same seed: same batches, whatever order the steps are asked in (the cache must not leak
    // state between epochs): b walks backwards, jumping between epochs.
    let forward: Vec<Vec<u32>> = (0..35).map(|s| a.global_batch(s)).collect();
    for step in (0..35).rev() {
        assert_eq!(b.global_batch(step), forward[step as usize]);
    }
}

#[test]
fn batch_of_whole_dataset_is_a_permutation() {
    let s = Sampler::new(7, 7, 9).unwrap();
    assert_eq!(s.steps_per_epoch(), 1);
    assert!(is_permutation(&s.global_batch(3), 7));
}

#[test]
fn assign_shares_are_balanced_and_contiguous() {
    assert_eq!(
        (0..3).map(|r| assign(4, 3, r)).collect::<Vec<_>>(),
        [0..2, 2..3, 3..4]
    );
    assert_eq!(
        (0..4).map(|r| assign(2, 4, r)).collect::<Vec<_>>(),
        [0..1, 1..2, 2..2, 2..2]
    );
    assert_eq!(assign(8, 1, 0), 0..8);
    assert_eq!(assign(0, 3, 2), 0..0);
}

#[test]
#[should_panic(expected = "rank 3 is not below the world size 3")]
fn assign_rejects_bad_rank() {
    assign(4, 3, 3);
}

#[test]
fn microbatches_are_fixed_and_ranks_cover_each_sample_once() {
    let s = Sampler::new(500, 48, 77).unwrap();
    for step in [0u64, 1, 9, 10, 23] {
        let global = s.global_batch(step);
        for mb in [1usize, 4, 6, 8, 16, 48] {
            let micro = microbatches(&global, mb);
            assert_eq!(micro.len(), 48 / mb);
            assert!(micro.iter().all(|m| m.len() == mb));
            for world in 1..=8 {
                // Concatenating every rank's micro-batches in rank order rebuilds the global
                // batch exactly: each sample once, same micro-batch boundaries for any world.
                let mut rebuilt: Vec<u32> = Vec::new();
                let mut next = 0;
                for rank in 0..world {
                    let r = assign(micro.len(), world, rank);
                    assert_eq!(r.start, next, "contiguous");
                    next = r.end;
                    let len = r.len();
                    let expect = micro.len() / world + usize::from(rank < micro.len() % world);
                    assert_eq!(
                        len,
                        expect,
                        "n_micro {} world {world} rank {rank}",
                        micro.len()
                    );
                    for m in &micro[r] {
                        rebuilt.extend_from_slice(m);
                    }
                }
                assert_eq!(next, micro.len());
                assert_eq!(rebuilt, global);
            }
        }
    }
}

#[test]
fn microbatches_last_piece_may_be_short() {
    let g = [1u32, 2, 3, 4, 5];
    assert_eq!(microbatches(&g, 2), [&[1, 2][..], &[3, 4], &[5]]);
    assert_eq!(microbatches(&g, 5), [&g[..]]);
}

#[test]
fn sampler_is_shareable_between_threads() {
    let s = std::sync::Arc::new(Sampler::new(300, 30, 4).unwrap());
    let expected: Vec<Vec<u32>> = (0..40).map(|st| s.global_batch(st)).collect();
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                (0..40u64)
                    .map(|st| s.global_batch((st * 7 + t) % 40))
                    .zip((0..40u64).map(|st| (st * 7 + t) % 40))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for h in handles {
        for (batch, step) in h.join().unwrap() {
            assert_eq!(batch, expected[step as usize]);
        }
    }
}
