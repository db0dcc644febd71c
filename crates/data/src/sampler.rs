//! Which samples form the global batch of each training step.
//!
//! The answer depends only on `(n, global_batch, seed, step)`, never on the world size or rank:
//! every rank computes the same global batch and then takes its share of it (see
//! [`crate::partition`]). That is what lets a run on 1 process and a run on 8 see the same data in
//! the same order, and lets a resumed run continue from any step without replaying the past.
//!
//! Epoch `e` is the permutation of `0..n` drawn by Fisher–Yates from `Rng::stream(seed, e)`;
//! step `s` is the `(s mod steps_per_epoch)`-th run of `global_batch` consecutive entries of
//! epoch `s / steps_per_epoch`. The `n mod global_batch` samples at the end of each permutation
//! are left out of that epoch (a partial batch would change the step's arithmetic); since each
//! epoch shuffles anew, different samples are left out each time.

use std::sync::Mutex;

use crate::error::DataError;
use crate::rng::Rng;

/// Deterministic epoch-shuffling sampler. `Sync`: share it between threads freely.
#[derive(Debug)]
pub struct Sampler {
    n: usize,
    global_batch: usize,
    seed: u64,
    /// The permutation of the epoch asked for last: consecutive steps reuse it instead of
    /// reshuffling all `n` indices per step.
    cache: Mutex<Option<(u64, Vec<u32>)>>,
}

impl Sampler {
    /// A sampler over `n` samples. Fails if `global_batch` is 0 or larger than `n`, or if `n`
    /// does not fit the u32 sample indices.
    pub fn new(n: usize, global_batch: usize, seed: u64) -> Result<Sampler, DataError> {
        let problem = if global_batch == 0 {
            Some("the global batch must hold at least one sample")
        } else if global_batch > n {
            Some("the global batch is larger than the dataset, so an epoch would have no step")
        } else if u32::try_from(n).is_err() {
            Some("more samples than u32 sample indices can address")
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(DataError::Sampler {
                n,
                global_batch,
                problem,
            });
        }
        Ok(Sampler {
            n,
            global_batch,
            seed,
            cache: Mutex::new(None),
        })
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    pub fn batch_size(&self) -> usize {
        self.global_batch
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Full global batches per epoch (the last partial batch is dropped).
    pub fn steps_per_epoch(&self) -> usize {
        self.n / self.global_batch
    }

    /// The epoch a step belongs to.
    pub fn epoch(&self, step: u64) -> u64 {
        step / self.steps_per_epoch() as u64
    }

    /// The shuffled order of all `n` samples in `epoch`.
    pub fn epoch_permutation(&self, epoch: u64) -> Vec<u32> {
        Rng::stream(self.seed, epoch).permutation(self.n as u32)
    }

    /// Sample indices of the global batch at `step` (length `global_batch`, no repeats).
    pub fn global_batch(&self, step: u64) -> Vec<u32> {
        let spe = self.steps_per_epoch() as u64;
        let epoch = step / spe;
        let start = (step % spe) as usize * self.global_batch;
        // A poisoned lock only means another thread panicked mid-update; the cache is rebuilt
        // whenever its epoch does not match, so recover the guard rather than propagate.
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.as_ref().map(|(e, _)| *e) != Some(epoch) {
            *cache = Some((epoch, self.epoch_permutation(epoch)));
        }
        let (_, perm) = cache.as_ref().expect("cache filled above");
        perm[start..start + self.global_batch].to_vec()
    }
}
