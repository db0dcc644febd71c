//! IDX round trips with small generated files, gzipped and raw.

#[path = "common/alloc_count.rs"]
mod alloc_count;
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

// ---- Fuzzing: arbitrary and mutated files never panic, never allocate for what a header only
// claims, and errors name the file; valid files round-trip. ----

mod fuzz {
    use proptest::prelude::*;

    use super::common::fuzz_cases;

    use super::common::{gzip, idx_bytes};
    use lockstep_data::{parse_idx, DataError, IDX_IMAGES_U8, IDX_LABELS_U8};

    /// The result of `f` and the most bytes it had allocated at once on this thread.
    fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
        let (out, peak) = super::alloc_count::peak_of(f);
        (out, peak as usize)
    }

    const ORIGIN: &str = "fuzz/train-images-idx3-ubyte";

    /// Parses `bytes` as images, checking the properties every input must have: no panic (a
    /// panic fails the test), memory within a constant and twice the input (the decoded file
    /// plus the header vector; gzip input is checked against its decompressed size by the
    /// caller), and an error that names the file.
    fn parse_checked(
        bytes: &[u8],
        magic: u32,
        budget: usize,
    ) -> Result<(Vec<usize>, Vec<u8>), String> {
        let (result, peak) = peak_of(|| parse_idx(bytes, ORIGIN, magic, "u8 images"));
        assert!(
            peak <= budget,
            "{} input bytes made the parser hold {peak} bytes at once (budget {budget})",
            bytes.len()
        );
        match result {
            Ok(a) => Ok((a.dims, a.data)),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.starts_with(ORIGIN),
                    "error does not name the file: {msg}"
                );
                assert!(
                    matches!(
                        e,
                        DataError::IdxMagic { .. }
                            | DataError::IdxLength { .. }
                            | DataError::IdxTooLarge { .. }
                            | DataError::Gzip { .. }
                    ),
                    "unexpected error kind: {e:?}"
                );
                Err(msg)
            }
        }
    }

    /// Scratch the decoder may need whatever the input (gzip state, error text).
    const SLACK: usize = 256 << 10;

    fn budget(input: usize) -> usize {
        2 * input + SLACK
    }

    /// Dims of a small image file and its pixels.
    fn images() -> impl Strategy<Value = (Vec<u32>, Vec<u8>)> {
        (0u32..6, 0u32..5, 0u32..5).prop_flat_map(|(n, r, c)| {
            (
                Just(vec![n, r, c]),
                proptest::collection::vec(any::<u8>(), (n * r * c) as usize),
            )
        })
    }

    /// A byte-level edit of a file.
    #[derive(Debug, Clone)]
    enum Mutation {
        FlipBit(usize, u8),
        SetByte(usize, u8),
        Truncate(usize),
        Append(Vec<u8>),
        /// Overwrite dimension `d` (0-based) of the header with a value, big-endian.
        SetDim(usize, u32),
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
            (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Mutation::SetByte(i, v)),
            any::<usize>().prop_map(Mutation::Truncate),
            proptest::collection::vec(any::<u8>(), 1..40).prop_map(Mutation::Append),
            (
                0usize..3,
                prop_oneof![Just(u32::MAX), Just(1 << 31), Just(1 << 16), any::<u32>()]
            )
                .prop_map(|(d, v)| Mutation::SetDim(d, v)),
        ]
    }

    fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
        let len = bytes.len();
        match *m {
            Mutation::FlipBit(i, b) if len > 0 => bytes[i % len] ^= 1 << b,
            Mutation::SetByte(i, v) if len > 0 => bytes[i % len] = v,
            Mutation::Truncate(n) => bytes.truncate(n % (len + 1)),
            Mutation::Append(ref extra) => bytes.extend_from_slice(extra),
            Mutation::SetDim(d, v) if len >= 8 + 4 * d => {
                bytes[4 + 4 * d..8 + 4 * d].copy_from_slice(&v.to_be_bytes())
            }
            _ => {}
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(fuzz_cases(512)))]

        /// What was written is what is read, raw and gzipped.
        #[test]
        fn valid_files_round_trip((dims, pixels) in images()) {
            let raw = idx_bytes(IDX_IMAGES_U8, &dims, &pixels);
            let want: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
            for input in [raw.clone(), gzip(&raw)] {
                let got = parse_checked(&input, IDX_IMAGES_U8, budget(raw.len())).unwrap();
                prop_assert_eq!(&got.0, &want);
                prop_assert_eq!(&got.1, &pixels);
            }
        }

        /// Random bytes (with the magic in front half of the time, so the header is reached).
        #[test]
        fn arbitrary_bytes_never_panic(
            with_magic in any::<bool>(),
            tail in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut bytes = if with_magic { IDX_IMAGES_U8.to_be_bytes().to_vec() } else { Vec::new() };
            bytes.extend_from_slice(&tail);
            let _ = parse_checked(&bytes, IDX_IMAGES_U8, budget(bytes.len()));
        }

        /// Edits of a valid file, raw (the edits hit the header) or of its gzip (the edits hit
        /// the compressed stream and its CRC/size trailer).
        #[test]
        fn mutated_files_never_panic(
            (dims, pixels) in images(),
            edits in proptest::collection::vec(mutation(), 1..4),
            gzipped in any::<bool>(),
        ) {
            let mut bytes = idx_bytes(IDX_IMAGES_U8, &dims, &pixels);
            if gzipped {
                let raw_len = bytes.len();
                bytes = gzip(&bytes);
                for m in &edits {
                    apply(&mut bytes, m);
                }
                // A damaged deflate stream can inflate to more than the original, up to deflate's
                // ratio limit (258 bytes from a 2-bit code, ~1032:1); the header caps what is kept.
                let _ = parse_checked(&bytes, IDX_IMAGES_U8, budget(raw_len + 1032 * bytes.len()));
            } else {
                for m in &edits {
                    apply(&mut bytes, m);
                }
                let _ = parse_checked(&bytes, IDX_IMAGES_U8, budget(bytes.len()));
            }
        }

        /// Headers claiming far more than the file holds are refused without allocating for the
        /// claim, and the message says truncated (or overflow, or over the cap on what a header
        /// may declare) with the header's numbers.
        #[test]
        fn huge_header_claims_are_refused_before_allocating(
            dims in proptest::collection::vec(prop_oneof![Just(u32::MAX), Just(1u32 << 31), 1u32..1 << 20], 3),
            payload in proptest::collection::vec(any::<u8>(), 0..32),
            gzipped in any::<bool>(),
        ) {
            let claim: u128 = dims.iter().map(|&d| u128::from(d)).product();
            prop_assume!(claim > payload.len() as u128);
            let raw = idx_bytes(IDX_IMAGES_U8, &dims, &payload);
            let input = if gzipped { gzip(&raw) } else { raw.clone() };
            let err = parse_checked(&input, IDX_IMAGES_U8, budget(raw.len())).unwrap_err();
            let text = dims.iter().map(u32::to_string).collect::<Vec<_>>().join("×");
            prop_assert!(err.contains(&text), "{}", err);
            prop_assert!(
                err.contains("truncated")
                    || err.contains("overflow")
                    || (claim > u128::from(lockstep_data::IDX_MAX_PAYLOAD_BYTES)
                        && err.contains(&format!(
                            "= {claim} bytes of u8 images, more than the limit of {} bytes",
                            lockstep_data::IDX_MAX_PAYLOAD_BYTES
                        ))),
                "{}",
                err
            );
        }
    }

    /// Regression (found while writing this harness, by reading the decoder; the allocation
    /// budget of `parse_checked` fails on the old code): a tiny gzip whose 1×1×1 header is
    /// followed by 64 MiB of zeros used to be inflated into memory whole before the length check
    /// refused it.
    #[test]
    fn gzip_bomb_behind_a_small_header_is_refused_without_inflating_it() {
        let mut raw = idx_bytes(IDX_IMAGES_U8, &[1, 1, 1], &[7]);
        raw.resize(raw.len() + (64 << 20), 0);
        let bomb = gzip(&raw);
        assert!(bomb.len() < 256 << 10, "{} bytes", bomb.len());
        let err = parse_checked(&bomb, IDX_IMAGES_U8, budget(bomb.len())).unwrap_err();
        assert!(
            err.ends_with(&format!(
                "trailing bytes: header says 1×1×1 = 1 bytes of u8 images, file has {}",
                1 + (64 << 20)
            )),
            "{err}"
        );
    }

    /// Regression: 2^31 × 2^31 × 2^31 overflows usize and is named as such, not wrapped.
    #[test]
    fn header_product_overflow_is_named() {
        let raw = idx_bytes(IDX_IMAGES_U8, &[1 << 31, 1 << 31, 1 << 31], &[]);
        let err = parse_checked(&raw, IDX_IMAGES_U8, budget(raw.len())).unwrap_err();
        assert!(
            err.ends_with("header dimensions 2147483648×2147483648×2147483648 overflow"),
            "{err}"
        );
        // Labels: one dimension, so a claim of 2^32 - 1 does not overflow; it is over the cap
        // on what a header may declare, and refused from the header.
        let raw = idx_bytes(IDX_LABELS_U8, &[u32::MAX], &[1, 2]);
        let err = parse_checked(&raw, IDX_LABELS_U8, budget(raw.len())).unwrap_err();
        assert!(
            err.ends_with(
                "header declares 4294967295 = 4294967295 bytes of u8 images, more than the limit \
                 of 1073741824 bytes"
            ),
            "{err}"
        );
        // Under the cap, the same claim in a short file is merely truncated.
        let raw = idx_bytes(IDX_LABELS_U8, &[1 << 30], &[1, 2]);
        let err = parse_checked(&raw, IDX_LABELS_U8, budget(raw.len())).unwrap_err();
        assert!(
            err.contains("truncated: header says 1073741824 = 1073741824 bytes"),
            "{err}"
        );
    }
}
