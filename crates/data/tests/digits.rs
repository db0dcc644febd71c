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

// ---- Fuzzing the CSV reader: valid files round-trip, a bad field is named by line and field,
// and arbitrary or mutated bytes never panic. ----

mod fuzz {
    use proptest::prelude::*;

    use super::common::fuzz_cases;

    use super::common::gzip;
    use lockstep_data::{parse_digits, DataError};

    const ORIGIN: &str = "fuzz/digits.csv";

    /// Samples: 64 pixels 0..=16 and a label 0..=9 each.
    fn samples() -> impl Strategy<Value = Vec<(Vec<u8>, u8)>> {
        proptest::collection::vec((proptest::collection::vec(0u8..=16, 64), 0u8..10), 1..12)
    }

    /// The CSV text, with optional spaces around fields and an optional final newline.
    fn csv(samples: &[(Vec<u8>, u8)], spaced: bool, final_newline: bool) -> String {
        let lines: Vec<String> = samples
            .iter()
            .map(|(px, label)| {
                px.iter()
                    .chain(std::iter::once(label))
                    .map(|v| {
                        if spaced {
                            format!(" {v} ")
                        } else {
                            v.to_string()
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect();
        let mut text = lines.join("\n");
        if final_newline {
            text.push('\n');
        }
        text
    }

    /// Parses, checking that an error names the file and is of a kind about the file's content.
    fn parse(bytes: &[u8]) -> Result<lockstep_data::Dataset, String> {
        parse_digits(bytes, ORIGIN).map_err(|e| {
            let msg = e.to_string();
            assert!(
                msg.starts_with(ORIGIN),
                "error does not name the file: {msg}"
            );
            assert!(
                matches!(
                    e,
                    DataError::BadLine { .. } | DataError::Empty { .. } | DataError::Gzip { .. }
                ),
                "{e:?}"
            );
            msg
        })
    }

    /// Field values that are not a valid pixel (and, for the label column, label).
    fn bad_field() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            Just("x".to_string()),
            Just("-1".to_string()),
            Just("1.5".to_string()),
            Just("99999999999999999999".to_string()),
            (17u32..1000).prop_map(|v| v.to_string()),
            "[a-z]{1,3}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(fuzz_cases(256)))]

        #[test]
        fn valid_files_round_trip(
            s in samples(),
            spaced in any::<bool>(),
            final_newline in any::<bool>(),
            gzipped in any::<bool>(),
        ) {
            let text = csv(&s, spaced, final_newline);
            let bytes = if gzipped { gzip(text.as_bytes()) } else { text.into_bytes() };
            let ds = parse(&bytes).unwrap();
            prop_assert_eq!(ds.len(), s.len());
            let want_labels: Vec<u8> = s.iter().map(|(_, l)| *l).collect();
            prop_assert_eq!(&ds.labels, &want_labels);
            let want: Vec<f32> = s.iter().flat_map(|(px, _)| px.iter().map(|&v| f32::from(v) / 16.0)).collect();
            prop_assert_eq!(&ds.features, &want);
        }

        /// One field replaced by a bad value: the error names its line and field (1-based).
        #[test]
        fn a_bad_field_is_named_by_line_and_field(
            s in samples(),
            at in any::<(usize, usize)>(),
            bad in bad_field(),
        ) {
            let mut lines: Vec<Vec<String>> = csv(&s, false, false)
                .lines()
                .map(|l| l.split(',').map(str::to_string).collect())
                .collect();
            let (line, field) = (at.0 % lines.len(), at.1 % 65);
            // Every value of bad_field() is bad in both columns (pixels 0..=16, labels 0..=9).
            lines[line][field] = bad.clone();
            let text: Vec<String> = lines.iter().map(|f| f.join(",")).collect();
            let msg = parse(text.join("\n").as_bytes()).unwrap_err();
            let want_where = format!("{ORIGIN} line {}: field {}", line + 1, field + 1);
            prop_assert!(msg.starts_with(&want_where), "{} (expected {})", msg, want_where);
        }

        /// A line with a field added or removed: named by line, with the count found.
        #[test]
        fn a_wrong_field_count_is_named_by_line(s in samples(), at in any::<usize>(), add in any::<bool>()) {
            let mut lines: Vec<String> = csv(&s, false, false).lines().map(str::to_string).collect();
            let line = at % lines.len();
            let found = if add {
                lines[line].push_str(",0");
                66
            } else {
                let cut = lines[line].rfind(',').unwrap();
                lines[line].truncate(cut);
                64
            };
            let msg = parse(lines.join("\n").as_bytes()).unwrap_err();
            prop_assert!(
                msg.starts_with(&format!("{ORIGIN} line {}: expected 65", line + 1)) && msg.ends_with(&format!("found {found}")),
                "{}", msg
            );
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse(&bytes);
        }

        /// Byte edits of a valid file (plain or gzip): an answer or a located error, no panic.
        #[test]
        fn mutated_files_never_panic(
            s in samples(),
            edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
            cut in proptest::option::of(any::<usize>()),
            gzipped in any::<bool>(),
        ) {
            let text = csv(&s, false, true);
            let mut bytes = if gzipped { gzip(text.as_bytes()) } else { text.into_bytes() };
            for (i, v) in edits {
                let n = bytes.len();
                bytes[i % n] = v;
            }
            if let Some(c) = cut {
                let n = bytes.len();
                bytes.truncate(c % (n + 1));
            }
            if let Err(msg) = parse(&bytes) {
                // Where the error is about a line, that line exists in the (decoded) input.
                if let Some(rest) = msg.strip_prefix(&format!("{ORIGIN} line ")) {
                    let line: usize = rest.split(':').next().unwrap().parse().unwrap();
                    prop_assert!(line >= 1 && line <= s.len() + bytes.len(), "{}", msg);
                }
            }
        }
    }
}
