//! The in-memory dataset every loader produces, and the deterministic train/test split.

use crate::rng::Rng;

/// A labelled image-classification dataset held entirely in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// Names the data in logs and checkpoints, e.g. "digits" or "fashion-mnist-train".
    pub name: String,
    /// `len() * dim()` values, one sample after another (row-major image), scaled to [0, 1].
    pub features: Vec<f32>,
    /// One label per sample, each below `classes`.
    pub labels: Vec<u8>,
    /// Image shape as (channels, height, width): digits [1, 8, 8], Fashion-MNIST [1, 28, 28].
    pub shape: [usize; 3],
    pub classes: usize,
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Values per sample (channels × height × width).
    pub fn dim(&self) -> usize {
        self.shape.iter().product()
    }

    /// Copies the samples `idx` (in that order) into `x` (`idx.len() * dim()` values) and their
    /// labels into `y`, replacing what the buffers held; reusing the buffers avoids an allocation
    /// per step.
    ///
    /// # Panics
    /// If an index is out of range (indices come from a [`crate::Sampler`] over this dataset).
    pub fn gather(&self, idx: &[u32], x: &mut Vec<f32>, y: &mut Vec<u8>) {
        let dim = self.dim();
        x.clear();
        y.clear();
        x.reserve(idx.len() * dim);
        y.reserve(idx.len());
        for &i in idx {
            let i = i as usize;
            assert!(
                i < self.len(),
                "sample index {i} out of range for dataset {} of {} samples",
                self.name,
                self.len()
            );
            x.extend_from_slice(&self.features[i * dim..(i + 1) * dim]);
            y.push(self.labels[i]);
        }
    }

    /// A new dataset of the samples `idx`, in that order.
    pub fn subset(&self, idx: &[u32], name: impl Into<String>) -> Dataset {
        let mut features = Vec::new();
        let mut labels = Vec::new();
        self.gather(idx, &mut features, &mut labels);
        Dataset {
            name: name.into(),
            features,
            labels,
            shape: self.shape,
            classes: self.classes,
        }
    }

    /// Number of samples of each class (length `classes`).
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.classes];
        for &l in &self.labels {
            counts[l as usize] += 1;
        }
        counts
    }
}

/// RNG stream of the split, distinct from the sampler's per-epoch streams (which are the epoch
/// numbers) so that a run using one seed for both does not correlate them. ASCII "split".
const SPLIT_STREAM: u64 = 0x73_70_6c_69_74;

/// Splits `ds` into (train, test) for datasets without an official split (digits).
///
/// `round(len * test_fraction)` samples, chosen by a seeded shuffle, form the test set; both
/// parts keep the original sample order, so the result depends only on `(len, test_fraction,
/// seed)`. Names get the suffixes "-train" and "-test".
///
/// # Panics
/// If `test_fraction` is not within [0, 1].
pub fn split_train_test(ds: Dataset, test_fraction: f64, seed: u64) -> (Dataset, Dataset) {
    assert!(
        (0.0..=1.0).contains(&test_fraction),
        "test fraction {test_fraction} is outside [0, 1]"
    );
    let n = ds.len();
    let n_test = ((n as f64) * test_fraction).round() as usize;
    let mut order = Rng::stream(seed, SPLIT_STREAM).permutation(n as u32);
    let (test, train) = order.split_at_mut(n_test);
    test.sort_unstable();
    train.sort_unstable();
    let train_ds = ds.subset(train, format!("{}-train", ds.name));
    let test_ds = ds.subset(test, format!("{}-test", ds.name));
    (train_ds, test_ds)
}
