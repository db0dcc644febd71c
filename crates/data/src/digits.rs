//! scikit-learn's copy of the UCI "Optical Recognition of Handwritten Digits" data (1,797 8×8
//! images, 10 classes): the default dataset, small enough to commit and to embed in the binary.
//!
//! Format of `data/digits/digits.csv.gz` (checked against the file, see data/README.md): gzip of a
//! CSV with no header line, one sample per line, 65 integers: 64 pixel values 0..=16 (row-major
//! 8×8, each the count of set pixels in a 4×4 block) then the label 0..=9.

use std::path::Path;

use crate::dataset::Dataset;
use crate::error::DataError;
use crate::read::{decode, read_maybe_gz};

/// Where the file is committed, relative to the repository root.
pub const DIGITS_PATH: &str = "data/digits/digits.csv.gz";

/// sha256 of the committed file (scikit-learn 1.7.2's `sklearn/datasets/data/digits.csv.gz`).
pub const DIGITS_SHA256: &str = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22";

/// The most bytes a digits CSV may hold, after decompression: 256 MiB.
///
/// CSV has no header saying how long it is, so without a cap a small gzip bomb would be
/// inflated into memory whole; reading stops as soon as the file passes the cap. The committed
/// file is 265 KB (1,797 samples); the cap admits about 1.3 million 8×8 samples (1.3 GB of `f32`
/// features at most, 4 bytes for each pixel's 2 or 3 characters), far more than any data in
/// this format, while bounding what a loader holds.
pub const DIGITS_MAX_BYTES: u64 = 256 << 20;

/// Names the CSV in [`DataError::TooLarge`].
const DIGITS_WHAT: &str = "the digits CSV (decompressed)";

const PIXELS: usize = 64;
const MAX_PIXEL: u8 = 16;
const CLASSES: usize = 10;
const FIELD_COUNT_RULE: &str = "expected 65 comma-separated values (64 pixels, then the label)";

/// The committed file compiled into the library, so programs run from any directory (57 KB).
static EMBEDDED: &[u8] = include_bytes!("../../../data/digits/digits.csv.gz");

/// Loads the digits from a `.csv.gz` or plain `.csv` file in the format above.
///
/// The file is streamed through one bounded reader: only a regular file is opened (not
/// /dev/zero, not a FIFO), and more than [`DIGITS_MAX_BYTES`] (after decompression) is refused
/// as soon as reading passes the cap.
pub fn load_digits(path: &Path) -> Result<Dataset, DataError> {
    load_digits_capped(path, DIGITS_MAX_BYTES)
}

fn load_digits_capped(path: &Path, cap: u64) -> Result<Dataset, DataError> {
    let text = read_maybe_gz(
        path,
        "the digits file is committed at data/digits/digits.csv.gz in the lockstep repository",
        cap,
        DIGITS_WHAT,
    )?;
    parse_csv(&text, path)
}

/// Loads the copy of data/digits/digits.csv.gz compiled into this library.
pub fn load_digits_embedded() -> Result<Dataset, DataError> {
    parse_digits(EMBEDDED, "data/digits/digits.csv.gz (embedded)")
}

/// Parses digits from bytes in memory, gzipped or plain CSV; `origin` names them in errors.
/// At most [`DIGITS_MAX_BYTES`] are decompressed.
pub fn parse_digits(bytes: &[u8], origin: impl AsRef<Path>) -> Result<Dataset, DataError> {
    parse_digits_capped(bytes, origin.as_ref(), DIGITS_MAX_BYTES)
}

fn parse_digits_capped(bytes: &[u8], origin: &Path, cap: u64) -> Result<Dataset, DataError> {
    parse_csv(&decode(bytes, origin, cap, DIGITS_WHAT)?, origin)
}

/// Parses decompressed CSV bytes; `origin` names the source in errors.
fn parse_csv(text: &[u8], origin: &Path) -> Result<Dataset, DataError> {
    let csv_err = |line: usize, problem: String| DataError::BadLine {
        path: origin.to_path_buf(),
        line,
        problem,
    };
    let text = std::str::from_utf8(text).map_err(|e| {
        let line = 1 + text[..e.valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count();
        csv_err(line, "not text (invalid UTF-8)".to_string())
    })?;

    let mut features = Vec::new();
    let mut labels = Vec::new();
    let mut values = [0u8; PIXELS + 1];
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        // Count first: a missing or extra value would otherwise surface as a confusing range
        // error about whichever value landed in the label column.
        let count = line.split(',').count();
        if count != PIXELS + 1 {
            let found = if line.trim().is_empty() {
                "an empty line".to_string()
            } else {
                count.to_string()
            };
            return Err(csv_err(
                line_no,
                format!("{FIELD_COUNT_RULE}, found {found}"),
            ));
        }
        for (col, field) in line.split(',').enumerate() {
            let field = field.trim();
            let (what, max) = if col == PIXELS {
                ("label", CLASSES as u32 - 1)
            } else {
                ("pixel value", u32::from(MAX_PIXEL))
            };
            // Parsed wider than u8 so that "300" is reported as out of range, not as "not an
            // integer".
            let v: u32 = field.parse().map_err(|_| {
                csv_err(
                    line_no,
                    format!("field {} is {field:?}, not an integer {what}", col + 1),
                )
            })?;
            if v > max {
                return Err(csv_err(
                    line_no,
                    format!("field {}: {what} {v} is outside 0..={max}", col + 1),
                ));
            }
            values[col] = v as u8;
        }
        features.extend(values[..PIXELS].iter().map(|&v| f32::from(v) / 16.0));
        labels.push(values[PIXELS]);
    }
    if labels.is_empty() {
        return Err(DataError::Empty {
            path: origin.to_path_buf(),
        });
    }
    Ok(Dataset {
        name: "digits".to_string(),
        features,
        labels,
        shape: [1, 8, 8],
        classes: CLASSES,
    })
}

#[cfg(test)]
mod tests {
    //! The cap, lowered; tests/bounds.rs has the real one.

    use super::*;
    use crate::read::tests::{gzip, Scratch};

    #[test]
    fn a_gzip_bomb_is_refused_at_the_cap() {
        let bomb = gzip(&b"1,".repeat(4 << 20));
        let err = parse_digits_capped(&bomb, "b.csv.gz".as_ref(), 1 << 20).unwrap_err();
        assert_eq!(
            err.to_string(),
            "b.csv.gz: the digits CSV (decompressed) is more than the limit of 1048576 bytes \
             (reading stopped there)"
        );
        let dir = Scratch::new("digits-bomb");
        let p = dir.0.join("digits.csv.gz");
        std::fs::write(&p, &bomb).unwrap();
        let err = load_digits_capped(&p, 1 << 20).unwrap_err();
        assert!(
            matches!(err, DataError::TooLarge { ref path, found: None, .. } if *path == p),
            "{err:?}"
        );
    }

    #[test]
    fn the_committed_file_is_far_below_the_cap() {
        let text = decode(EMBEDDED, "e".as_ref(), DIGITS_MAX_BYTES, DIGITS_WHAT).unwrap();
        assert!(
            (text.len() as u64) < DIGITS_MAX_BYTES / 500,
            "{}",
            text.len()
        );
    }
}
