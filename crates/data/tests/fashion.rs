//! Fashion-MNIST as installed by scripts/setup.sh. Without the files the test returns early with
//! a note, unless LOCKSTEP_REQUIRE_FASHION=1 (set by CI after running setup.sh), where missing
//! files are a failure. LOCKSTEP_FASHION_DIR points the test at another copy of the files.

use std::path::PathBuf;

use lockstep_data::{load_fashion_mnist, FASHION_MNIST_DIR};

#[test]
fn loads_official_split() {
    let dir = PathBuf::from(
        std::env::var_os("LOCKSTEP_FASHION_DIR").unwrap_or_else(|| FASHION_MNIST_DIR.into()),
    );
    let required = std::env::var("LOCKSTEP_REQUIRE_FASHION").is_ok_and(|v| v == "1");
    if !dir.exists() && !required {
        eprintln!(
            "note: {} not found; run scripts/setup.sh to test Fashion-MNIST",
            dir.display()
        );
        return;
    }
    let (train, test) = load_fashion_mnist(&dir).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((train.len(), test.len()), (60_000, 10_000));
    assert_eq!((train.shape, test.shape), ([1, 28, 28], [1, 28, 28]));
    assert_eq!((train.classes, test.classes), (10, 10));
    assert_eq!(
        (train.name.as_str(), test.name.as_str()),
        ("fashion-mnist-train", "fashion-mnist-test")
    );
    // The dataset is balanced by construction: 6,000 / 1,000 images per class.
    assert_eq!(train.class_counts(), [6_000; 10]);
    assert_eq!(test.class_counts(), [1_000; 10]);
    for ds in [&train, &test] {
        let max = ds.features.iter().copied().fold(0.0f32, f32::max);
        assert_eq!(max, 1.0);
        assert!(ds.features.iter().all(|&v| (0.0..=1.0).contains(&v)));
    }
    // First training label of Fashion-MNIST is 9 (ankle boot), first test label 9 as well.
    assert_eq!((train.labels[0], test.labels[0]), (9, 9));
}
