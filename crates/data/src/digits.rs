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

const PIXELS: usize = 64;
const MAX_PIXEL: u8 = 16;
const CLASSES: usize = 10;
const FIELD_COUNT_RULE: &str = "expected 65 comma-separated values (64 pixels, then the label)";

/// The committed file compiled into the library, so programs run from any directory (57 KB).
static EMBEDDED: &[u8] = include_bytes!("../../../data/digits/digits.csv.gz");

/// Loads the digits from a `.csv.gz` or plain `.csv` file in the format above.
pub fn load_digits(path: &Path) -> Result<Dataset, DataError> {
    let text = read_maybe_gz(
        path,
        "the digits file is committed at data/digits/digits.csv.gz in the lockstep repository",
    )?;
    parse_csv(&text, path)
}

/// Loads the copy of data/digits/digits.csv.gz compiled into this library.
pub fn load_digits_embedded() -> Result<Dataset, DataError> {
    parse_digits(EMBEDDED, "data/digits/digits.csv.gz (embedded)")
}

/// Parses digits from bytes in memory, gzipped or plain CSV; `origin` names them in errors.
pub fn parse_digits(bytes: &[u8], origin: impl AsRef<Path>) -> Result<Dataset, DataError> {
    let origin = origin.as_ref();
    parse_csv(&decode(bytes, origin)?, origin)
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
