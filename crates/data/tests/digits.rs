//! The committed sklearn digits file: contents, embedding and the seeded train/test split.

mod common;

use lockstep_data::{
    load_digits, load_digits_embedded, parse_digits, split_train_test, DIGITS_SHA256,
};
use sha2::{Digest, Sha256};

#[test]
fn committed_file_is_the_pinned_one() {
    let bytes = std::fs::read(common::digits_path()).unwrap();
    assert_eq!(hex::encode(Sha256::digest(&bytes)), DIGITS_SHA256);
}

#[test]
fn loads_1797_samples_of_8x8_in_unit_range() {
    let ds = load_digits(&common::digits_path()).unwrap();
    assert_eq!(ds.name, "digits");
    assert_eq!(ds.len(), 1797);
    assert_eq!(ds.shape, [1, 8, 8]);
    assert_eq!(ds.dim(), 64);
    assert_eq!(ds.classes, 10);
    assert_eq!(ds.features.len(), 1797 * 64);
    let min = ds.features.iter().copied().fold(f32::INFINITY, f32::min);
    let max = ds
        .features
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    assert_eq!((min, max), (0.0, 1.0));
    // Every value is a count 0..=16 divided by 16, so exactly a multiple of 1/16.
    assert!(ds.features.iter().all(|&v| (v * 16.0).fract() == 0.0));
    // First line of the file: "0,0,5,13,9,1,0,0,..." with label 0; last line ends "...,1,0,8".
    assert_eq!(&ds.features[..4], &[0.0, 0.0, 5.0 / 16.0, 13.0 / 16.0]);
    assert_eq!(ds.labels[0], 0);
    assert_eq!(ds.labels[1796], 8);
    // Class histogram counted independently with awk over the decompressed CSV.
    assert_eq!(
        ds.class_counts(),
        [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    );
}

#[test]
fn embedded_copy_equals_the_file() {
    let from_file = load_digits(&common::digits_path()).unwrap();
    assert_eq!(load_digits_embedded().unwrap(), from_file);
}

#[test]
fn parse_from_memory_gz_and_plain() {
    let gz = std::fs::read(common::digits_path()).unwrap();
    let from_file = load_digits(&common::digits_path()).unwrap();
    assert_eq!(parse_digits(&gz, "mem").unwrap(), from_file);
    let plain = "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,\
                 0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,16,7\n";
    let one = parse_digits(plain.as_bytes(), "one-line").unwrap();
    assert_eq!((one.len(), one.labels[0]), (1, 7));
    assert_eq!(
        (one.features[1], one.features[16], one.features[63]),
        (1.0 / 16.0, 1.0, 1.0)
    );
    let msg = parse_digits(b"1,2\n", "in-memory sample")
        .unwrap_err()
        .to_string();
    assert!(
        msg.starts_with("in-memory sample line 1: expected 65"),
        "{msg}"
    );
}

#[test]
fn plain_csv_loads_like_gzip() {
    let dir = common::TempDir::new("digits-plain");
    let csv = dir.path("digits.csv");
    let gz = std::fs::read(common::digits_path()).unwrap();
    let mut text = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut text).unwrap();
    common::write(&csv, &text);
    assert_eq!(
        load_digits(&csv).unwrap(),
        load_digits(&common::digits_path()).unwrap()
    );
}

#[test]
fn split_is_deterministic_and_partitions_the_data() {
    let ds = load_digits_embedded().unwrap();
    let (train, test) = split_train_test(ds.clone(), 0.2, 11);
    // round(1797 * 0.2) = round(359.4) = 359.
    assert_eq!((train.len(), test.len()), (1438, 359));
    assert_eq!(
        (train.name.as_str(), test.name.as_str()),
        ("digits-train", "digits-test")
    );
    assert_eq!(train.shape, ds.shape);
    let total: Vec<usize> = train
        .class_counts()
        .iter()
        .zip(test.class_counts())
        .map(|(a, b)| a + b)
        .collect();
    assert_eq!(total, ds.class_counts());
    // Each class should land in the test set roughly in proportion (about 36 of ~180);
    // a broken shuffle (e.g. taking the file's first 359 lines) is still within this, but a
    // split that missed classes would not be.
    assert!(test.class_counts().iter().all(|&c| (15..=60).contains(&c)));

    let (train2, test2) = split_train_test(ds.clone(), 0.2, 11);
    assert_eq!((&train, &test), (&train2, &test2));
    let (_, test3) = split_train_test(ds, 0.2, 12);
    assert_ne!(test, test3);
}
