//! Malformed inputs: each error names the file and says what is wrong.

mod common;

use std::path::Path;

use common::{gzip, idx_bytes, write, TempDir};
use lockstep_data::{load_digits, load_idx, DataError, Sampler, IDX_IMAGES_U8, IDX_LABELS_U8};

/// A valid 65-field digits line with the given label.
fn digits_line(label: u8) -> String {
    let mut fields: Vec<String> = (0..64).map(|i| (i % 17).to_string()).collect();
    fields.push(label.to_string());
    fields.join(",")
}

fn digits_error(dir: &TempDir, name: &str, text: &str) -> String {
    let p = dir.path(name);
    write(&p, text.as_bytes());
    load_digits(&p).unwrap_err().to_string()
}

fn assert_msg(msg: &str, path: &Path, rest: &str) {
    let expected = format!("{}{rest}", path.display());
    assert_eq!(msg, expected);
}

#[test]
fn csv_row_with_too_few_values() {
    let dir = TempDir::new("err-csv-short");
    let mut short = digits_line(3);
    short.truncate(short.rfind(',').unwrap()); // drop the label: 64 values
    let text = format!("{}\n{}\n{short}\n", digits_line(1), digits_line(2));
    let msg = digits_error(&dir, "d.csv", &text);
    assert_msg(
        &msg,
        &dir.path("d.csv"),
        " line 3: expected 65 comma-separated values (64 pixels, then the label), found 64",
    );
}

#[test]
fn csv_row_with_too_many_values_and_empty_line() {
    let dir = TempDir::new("err-csv-long");
    let msg = digits_error(&dir, "d.csv", &format!("{},4\n", digits_line(1)));
    assert!(
        msg.ends_with(
            " line 1: expected 65 comma-separated values (64 pixels, then the label), found 66"
        ),
        "{msg}"
    );
    let msg = digits_error(
        &dir,
        "e.csv",
        &format!("{}\n\n{}\n", digits_line(1), digits_line(2)),
    );
    assert!(msg.ends_with(" line 2: expected 65 comma-separated values (64 pixels, then the label), found an empty line"), "{msg}");
}

#[test]
fn csv_non_numeric_field() {
    let dir = TempDir::new("err-csv-nan");
    let line = digits_line(1).replacen("5", "x5", 1); // field 6 holds "5"
    let msg = digits_error(&dir, "d.csv", &format!("{}\n{line}\n", digits_line(0)));
    assert_msg(
        &msg,
        &dir.path("d.csv"),
        " line 2: field 6 is \"x5\", not an integer pixel value",
    );
    // A header line (the real file has none) is not silently skipped either.
    let header: Vec<String> = (0..64)
        .map(|i| format!("pixel_{i}"))
        .chain(["target".to_string()])
        .collect();
    let text = format!("{}\n{}\n", header.join(","), digits_line(0));
    let msg = digits_error(&dir, "h.csv", &text);
    assert!(
        msg.ends_with(" line 1: field 1 is \"pixel_0\", not an integer pixel value"),
        "{msg}"
    );
}

#[test]
fn csv_values_out_of_range() {
    let dir = TempDir::new("err-csv-range");
    let msg = digits_error(&dir, "d.csv", &format!("{}\n", digits_line(10)));
    assert!(
        msg.ends_with(" line 1: field 65: label 10 is outside 0..=9"),
        "{msg}"
    );
    let line = format!("300,{}", &digits_line(0)[2..]); // first field "0" becomes "300"
    let msg = digits_error(&dir, "p.csv", &format!("{line}\n"));
    assert!(
        msg.ends_with(" line 1: field 1: pixel value 300 is outside 0..=16"),
        "{msg}"
    );
}

#[test]
fn csv_empty_file() {
    let dir = TempDir::new("err-csv-empty");
    let msg = digits_error(&dir, "d.csv", "");
    assert_msg(&msg, &dir.path("d.csv"), ": contains no samples");
}

#[test]
fn truncated_gzip() {
    let dir = TempDir::new("err-gz");
    let text: String = (0..50).map(|i| digits_line(i % 10) + "\n").collect();
    let gz = gzip(text.as_bytes());
    let p = dir.path("d.csv.gz");
    write(&p, &gz[..gz.len() / 2]);
    let err = load_digits(&p).unwrap_err();
    assert!(matches!(err, DataError::Gzip { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!(
            "{}: gzip data is corrupt or truncated: ",
            p.display()
        )),
        "{msg}"
    );
    // Only the 8-byte trailer (CRC and length) missing: still detected.
    write(&p, &gz[..gz.len() - 8]);
    assert!(matches!(load_digits(&p), Err(DataError::Gzip { .. })));
}

#[test]
fn missing_files_name_the_file_and_the_fix() {
    let dir = TempDir::new("err-missing");
    let (ip, lp) = (dir.path("train-images-idx3-ubyte.gz"), dir.path("l"));
    let msg = load_idx(&ip, &lp, "x").unwrap_err().to_string();
    assert_msg(
        &msg,
        &ip,
        ": file not found (for Fashion-MNIST run scripts/setup.sh as root; it installs /usr/share/datasets/fashion-mnist)",
    );
    let msg = load_digits(&dir.path("digits.csv.gz"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("digits.csv.gz: file not found (the digits file is committed at data/digits/digits.csv.gz"), "{msg}");
}

/// Writes `img` (raw) and a valid 2-label file, returns the loader's error message.
fn idx_error(dir: &TempDir, img: &[u8], lab: &[u8]) -> String {
    let (ip, lp) = (
        dir.path("train-images-idx3-ubyte.gz"),
        dir.path("train-labels-idx1-ubyte.gz"),
    );
    write(&ip, &gzip(img));
    write(&lp, &gzip(lab));
    load_idx(&ip, &lp, "x").unwrap_err().to_string()
}

#[test]
fn truncated_idx() {
    let dir = TempDir::new("err-idx-trunc");
    let ip = dir.path("train-images-idx3-ubyte.gz");
    let labels = idx_bytes(IDX_LABELS_U8, &[2], &[0, 1]);
    let img = idx_bytes(IDX_IMAGES_U8, &[2, 28, 28], &[0; 1234]);
    assert_msg(
        &idx_error(&dir, &img, &labels),
        &ip,
        ": truncated: header says 2×28×28 = 1568 bytes of u8 images, file has 1234",
    );
    let img = idx_bytes(IDX_IMAGES_U8, &[2, 2, 2], &[0; 9]);
    assert_msg(
        &idx_error(&dir, &img, &labels),
        &ip,
        ": trailing bytes: header says 2×2×2 = 8 bytes of u8 images, file has 9",
    );
    let img = idx_bytes(IDX_IMAGES_U8, &[2, 28], &[]);
    assert_msg(
        &idx_error(&dir, &img, &labels),
        &ip,
        ": truncated: the header of 3 dimension(s) takes 16 bytes, file has 12",
    );
    assert_msg(
        &idx_error(&dir, &[0, 0, 8], &labels),
        &ip,
        ": truncated: 3 bytes, too short for the 4-byte IDX magic",
    );
}

#[test]
fn wrong_magic() {
    let dir = TempDir::new("err-idx-magic");
    let labels = idx_bytes(IDX_LABELS_U8, &[2], &[0, 1]);
    let img = idx_bytes(0x1234_5678, &[2, 2, 2], &[0; 8]);
    assert_msg(
        &idx_error(&dir, &img, &labels),
        &dir.path("train-images-idx3-ubyte.gz"),
        ": bad IDX magic 0x12345678 (expected 0x00000803 for u8 images)",
    );
    // Images and labels swapped.
    let img = idx_bytes(IDX_IMAGES_U8, &[2, 1, 1], &[0; 2]);
    assert_msg(
        &idx_error(&dir, &img, &img),
        &dir.path("train-labels-idx1-ubyte.gz"),
        ": bad IDX magic 0x00000803 (expected 0x00000801 for u8 labels)",
    );
}

#[test]
fn count_mismatch() {
    let dir = TempDir::new("err-idx-count");
    let img = idx_bytes(IDX_IMAGES_U8, &[3, 1, 1], &[0; 3]);
    let labels = idx_bytes(IDX_LABELS_U8, &[2], &[0, 1]);
    let msg = idx_error(&dir, &img, &labels);
    assert_eq!(
        msg,
        format!(
            "{} holds 3 images but {} holds 2 labels; they must be the same set",
            dir.path("train-images-idx3-ubyte.gz").display(),
            dir.path("train-labels-idx1-ubyte.gz").display()
        )
    );
}

#[test]
fn label_out_of_range() {
    let dir = TempDir::new("err-idx-label");
    let img = idx_bytes(IDX_IMAGES_U8, &[3, 1, 1], &[0; 3]);
    let labels = idx_bytes(IDX_LABELS_U8, &[3], &[0, 9, 10]);
    assert_msg(
        &idx_error(&dir, &img, &labels),
        &dir.path("train-labels-idx1-ubyte.gz"),
        ": label 10 of sample 2 is not below the class count 10",
    );
}

#[test]
fn empty_idx() {
    let dir = TempDir::new("err-idx-empty");
    let img = idx_bytes(IDX_IMAGES_U8, &[0, 28, 28], &[]);
    let labels = idx_bytes(IDX_LABELS_U8, &[0], &[]);
    assert_msg(
        &idx_error(&dir, &img, &labels),
        &dir.path("train-images-idx3-ubyte.gz"),
        ": contains no samples",
    );
}

#[test]
fn bad_sampler_settings() {
    let msg = Sampler::new(100, 0, 1).unwrap_err().to_string();
    assert_eq!(msg, "sampler over 100 samples with global batch 0: the global batch must hold at least one sample");
    let msg = Sampler::new(100, 101, 1).unwrap_err().to_string();
    assert_eq!(msg, "sampler over 100 samples with global batch 101: the global batch is larger than the dataset, so an epoch would have no step");
}
