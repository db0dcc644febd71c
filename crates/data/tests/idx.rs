//! IDX round trips with small generated files, gzipped and raw.

mod common;

use common::{gzip, idx_bytes, write, TempDir};
use lockstep_data::{load_idx, load_idx_with_classes, read_idx, IDX_IMAGES_U8, IDX_LABELS_U8};

/// 3 images of 2×4 with pixel (n, r, c) = 10n + 4r + c... scaled to bytes, labels 7, 0, 9.
fn sample() -> (Vec<u8>, Vec<u8>) {
    let pixels: Vec<u8> = (0..3u8 * 8).map(|i| i * 11).collect(); // 0, 11, ..., 253
    (
        idx_bytes(IDX_IMAGES_U8, &[3, 2, 4], &pixels),
        idx_bytes(IDX_LABELS_U8, &[3], &[7, 0, 9]),
    )
}

fn check(ds: &lockstep_data::Dataset) {
    assert_eq!(ds.name, "tiny");
    assert_eq!(ds.len(), 3);
    assert_eq!(ds.shape, [1, 2, 4]);
    assert_eq!(ds.dim(), 8);
    assert_eq!(ds.classes, 10);
    assert_eq!(ds.labels, [7, 0, 9]);
    let expected: Vec<f32> = (0..24u8).map(|i| f32::from(i * 11) / 255.0).collect();
    assert_eq!(ds.features, expected);
    assert_eq!(ds.features[23], 253.0 / 255.0);
}

#[test]
fn gzip_round_trip() {
    let dir = TempDir::new("idx-gz");
    let (img, lab) = sample();
    let (ip, lp) = (dir.path("img-idx3-ubyte.gz"), dir.path("lab-idx1-ubyte.gz"));
    write(&ip, &gzip(&img));
    write(&lp, &gzip(&lab));
    check(&load_idx(&ip, &lp, "tiny").unwrap());
}

#[test]
fn raw_round_trip() {
    let dir = TempDir::new("idx-raw");
    let (img, lab) = sample();
    let (ip, lp) = (dir.path("img-idx3-ubyte"), dir.path("lab-idx1-ubyte"));
    write(&ip, &img);
    write(&lp, &lab);
    check(&load_idx(&ip, &lp, "tiny").unwrap());
}

#[test]
fn format_is_detected_by_content_not_name() {
    // A raw file named .gz and a gzip file without the suffix, mixed in one dataset.
    let dir = TempDir::new("idx-mixed");
    let (img, lab) = sample();
    let (ip, lp) = (dir.path("images.gz"), dir.path("labels"));
    write(&ip, &img);
    write(&lp, &gzip(&lab));
    check(&load_idx(&ip, &lp, "tiny").unwrap());
}

#[test]
fn concatenated_gzip_members_are_one_stream() {
    let dir = TempDir::new("idx-multi");
    let (img, lab) = sample();
    let (a, b) = img.split_at(10);
    let mut two = gzip(a);
    two.extend(gzip(b));
    let (ip, lp) = (dir.path("img"), dir.path("lab"));
    write(&ip, &two);
    write(&lp, &lab);
    check(&load_idx(&ip, &lp, "tiny").unwrap());
}

#[test]
fn read_idx_returns_dims_and_bytes() {
    let dir = TempDir::new("idx-read");
    let p = dir.path("a");
    write(&p, &idx_bytes(IDX_IMAGES_U8, &[1, 1, 3], &[1, 2, 3]));
    let arr = read_idx(&p, IDX_IMAGES_U8, "u8 images").unwrap();
    assert_eq!(arr.dims, [1, 1, 3]);
    assert_eq!(arr.data, [1, 2, 3]);
}

#[test]
fn other_class_counts() {
    let dir = TempDir::new("idx-classes");
    let (ip, lp) = (dir.path("img"), dir.path("lab"));
    write(&ip, &idx_bytes(IDX_IMAGES_U8, &[2, 1, 1], &[0, 255]));
    write(&lp, &idx_bytes(IDX_LABELS_U8, &[2], &[25, 3]));
    let ds = load_idx_with_classes(&ip, &lp, "letters", 26).unwrap();
    assert_eq!((ds.classes, ds.labels.clone()), (26, vec![25, 3]));
    assert_eq!(ds.features, [0.0, 1.0]);
    // With the default 10 classes, label 25 is rejected.
    assert!(load_idx(&ip, &lp, "letters").is_err());
}
