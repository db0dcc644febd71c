//! Dataset::gather and the split, on a synthetic dataset whose features encode the sample index.

use lockstep_data::{split_train_test, Dataset};

/// `n` samples of shape [1, 1, 2]: sample i has features (i, -i) and label i % 3.
fn indexed(n: usize) -> Dataset {
    Dataset {
        name: "synthetic".into(),
        features: (0..n).flat_map(|i| [i as f32, -(i as f32)]).collect(),
        labels: (0..n).map(|i| (i % 3) as u8).collect(),
        shape: [1, 1, 2],
        classes: 3,
    }
}

#[test]
fn gather_copies_rows_in_index_order_and_reuses_buffers() {
    let ds = indexed(10);
    let mut x = vec![99.0; 50];
    let mut y = vec![7; 9];
    ds.gather(&[4, 0, 9], &mut x, &mut y);
    assert_eq!(x, [4.0, -4.0, 0.0, -0.0, 9.0, -9.0]);
    assert_eq!(y, [1, 0, 0]);
}

#[test]
#[should_panic(expected = "sample index 10 out of range for dataset synthetic of 10 samples")]
fn gather_rejects_out_of_range_index() {
    indexed(10).gather(&[10], &mut Vec::new(), &mut Vec::new());
}

#[test]
fn split_partitions_indices_and_keeps_order() {
    let ds = indexed(100);
    for &frac in &[0.0, 0.1, 0.25, 0.5, 1.0] {
        let (train, test) = split_train_test(ds.clone(), frac, 3);
        assert_eq!(test.len(), (100.0 * frac) as usize);
        let ids =
            |d: &Dataset| -> Vec<usize> { d.features.chunks(2).map(|r| r[0] as usize).collect() };
        let (a, b) = (ids(&train), ids(&test));
        assert!(a.windows(2).all(|w| w[0] < w[1]), "train keeps file order");
        assert!(b.windows(2).all(|w| w[0] < w[1]), "test keeps file order");
        let mut all: Vec<usize> = a.iter().chain(&b).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..100).collect::<Vec<_>>());
        // Labels travel with their rows.
        assert!(train
            .labels
            .iter()
            .zip(&a)
            .all(|(&l, &i)| l as usize == i % 3));
    }
    // Not simply the first or last k samples.
    let (_, test) = split_train_test(ds, 0.1, 3);
    let first: Vec<f32> = test.features.chunks(2).map(|r| r[0]).collect();
    assert_ne!(first, (0..10).map(|i| i as f32).collect::<Vec<_>>());
    assert_ne!(first, (90..100).map(|i| i as f32).collect::<Vec<_>>());
}

#[test]
#[should_panic(expected = "test fraction 1.5 is outside [0, 1]")]
fn split_rejects_bad_fraction() {
    split_train_test(indexed(10), 1.5, 0);
}
