//! IDX files, the format of MNIST and Fashion-MNIST (gzipped or raw; detected by content).
//!
//! Layout: a big-endian u32 magic `0x0000TTNN` (TT = element type, 0x08 for u8; NN = number of
//! dimensions), then NN big-endian u32 sizes, then the elements in row-major order. Images are
//! `0x00000803` (count × rows × cols, u8 pixels) and labels `0x00000801` (count, u8).

use std::io::Read;
use std::path::Path;

use flate2::read::MultiGzDecoder;

use crate::dataset::Dataset;
use crate::error::DataError;
use crate::read::{is_gzip, read_file};

/// Magic of an IDX file of u8 images (3 dimensions).
pub const IDX_IMAGES_U8: u32 = 0x0000_0803;
/// Magic of an IDX file of u8 labels (1 dimension).
pub const IDX_LABELS_U8: u32 = 0x0000_0801;

/// Class count assumed by [`load_idx`]: MNIST and Fashion-MNIST both have 10.
pub const IDX_DEFAULT_CLASSES: usize = 10;

const NOT_FOUND_HINT: &str =
    "for Fashion-MNIST run scripts/setup.sh as root; it installs /usr/share/datasets/fashion-mnist";

/// A decoded IDX array of bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxArray {
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

/// Reads an IDX file whose magic must equal `expected_magic` (a u8 type); `what` describes it in
/// errors ("u8 images").
pub fn read_idx(
    path: &Path,
    expected_magic: u32,
    what: &'static str,
) -> Result<IdxArray, DataError> {
    let raw = read_file(path, NOT_FOUND_HINT)?;
    parse_idx(&raw, path, expected_magic, what)
}

/// Parses IDX bytes in memory, gzipped or raw (detected by content); `origin` names them in
/// errors.
///
/// Memory is bounded by the input, whatever the header claims: the header is read and checked
/// first, and at most the payload it announces is kept (a gzip stream is decompressed only that
/// far; the excess of an over-long one is counted, not stored). So a header claiming
/// 2^31 × 2^31 images in a small file is refused after reading the file, not after allocating
/// for the claim, and a small gzip that inflates far beyond its header is not inflated into
/// memory.
pub fn parse_idx(
    raw: &[u8],
    origin: impl AsRef<Path>,
    expected_magic: u32,
    what: &'static str,
) -> Result<IdxArray, DataError> {
    let origin = origin.as_ref();
    if is_gzip(raw) {
        parse_stream(
            &mut MultiGzDecoder::new(raw),
            raw.len(),
            origin,
            expected_magic,
            what,
        )
    } else {
        parse_stream(&mut &raw[..], raw.len(), origin, expected_magic, what)
    }
}

/// Reads up to `n` bytes (fewer only at the end of the stream) into `buf`.
fn read_up_to(
    r: &mut dyn Read,
    n: usize,
    buf: &mut Vec<u8>,
    origin: &Path,
) -> Result<(), DataError> {
    r.take(n as u64)
        .read_to_end(buf)
        .map(drop)
        .map_err(|cause| gzip_err(origin, cause))
}

fn gzip_err(origin: &Path, cause: std::io::Error) -> DataError {
    // Reading from memory fails only in the gzip decoder.
    DataError::Gzip {
        path: origin.to_path_buf(),
        cause,
    }
}

/// `r` yields the IDX bytes (decompressed); `raw_len` is the size of the input, which bounds
/// what is allocated before the data has arrived.
fn parse_stream(
    r: &mut dyn Read,
    raw_len: usize,
    origin: &Path,
    expected_magic: u32,
    what: &'static str,
) -> Result<IdxArray, DataError> {
    let length_err = |problem: String| DataError::IdxLength {
        path: origin.to_path_buf(),
        problem,
    };
    let mut head = Vec::with_capacity(4);
    read_up_to(r, 4, &mut head, origin)?;
    if head.len() < 4 {
        return Err(length_err(format!(
            "truncated: {} bytes, too short for the 4-byte IDX magic",
            head.len()
        )));
    }
    let be_u32 = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    let magic = be_u32(&head);
    if magic != expected_magic {
        return Err(DataError::IdxMagic {
            path: origin.to_path_buf(),
            found: magic,
            expected: expected_magic,
            what,
        });
    }
    let ndims = (magic & 0xff) as usize;
    let header = 4 + 4 * ndims;
    read_up_to(r, header - 4, &mut head, origin)?;
    if head.len() < header {
        return Err(length_err(format!(
            "truncated: the header of {ndims} dimension(s) takes {header} bytes, file has {}",
            head.len()
        )));
    }
    let dims: Vec<usize> = head[4..]
        .chunks_exact(4)
        .map(|b| be_u32(b) as usize)
        .collect();
    let dims_text = dims
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join("×");
    // usize is 64-bit on every supported target and each factor is below 2^32, so three factors
    // can still overflow; say so instead of wrapping.
    let expected = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| length_err(format!("header dimensions {dims_text} overflow")))?;
    // Reserve what the header announces only as far as the input can hold it (raw data is the
    // input; gzip of these files inflates a few times, and the vector grows if it is more).
    let mut data = Vec::with_capacity(expected.min(raw_len));
    read_up_to(r, expected, &mut data, origin)?;
    // Whatever follows the announced payload is only counted.
    let extra = std::io::copy(r, &mut std::io::sink()).map_err(|cause| gzip_err(origin, cause))?;
    let payload = data.len() as u64 + extra;
    if payload != expected as u64 {
        let state = if (data.len()) < expected {
            "truncated"
        } else {
            "trailing bytes"
        };
        return Err(length_err(format!(
            "{state}: header says {dims_text} = {expected} bytes of {what}, file has {payload}"
        )));
    }
    Ok(IdxArray { dims, data })
}

/// Loads an image IDX file and its label IDX file (MNIST, Fashion-MNIST; 10 classes) as one
/// dataset named `name`; pixels are scaled by 1/255 to [0, 1].
pub fn load_idx(images: &Path, labels: &Path, name: &str) -> Result<Dataset, DataError> {
    load_idx_with_classes(images, labels, name, IDX_DEFAULT_CLASSES)
}

/// [`load_idx`] for IDX data with a class count other than 10; every label must be below it.
pub fn load_idx_with_classes(
    images: &Path,
    labels: &Path,
    name: &str,
    classes: usize,
) -> Result<Dataset, DataError> {
    let img = read_idx(images, IDX_IMAGES_U8, "u8 images")?;
    let lab = read_idx(labels, IDX_LABELS_U8, "u8 labels")?;
    let (n_images, rows, cols) = (img.dims[0], img.dims[1], img.dims[2]);
    let n_labels = lab.dims[0];
    if n_images != n_labels {
        return Err(DataError::CountMismatch {
            images: images.to_path_buf(),
            n_images,
            labels: labels.to_path_buf(),
            n_labels,
        });
    }
    if n_images == 0 {
        return Err(DataError::Empty {
            path: images.to_path_buf(),
        });
    }
    if let Some((index, &label)) = lab
        .data
        .iter()
        .enumerate()
        .find(|&(_, &l)| usize::from(l) >= classes)
    {
        return Err(DataError::LabelOutOfRange {
            path: labels.to_path_buf(),
            index,
            label: u32::from(label),
            classes,
        });
    }
    Ok(Dataset {
        name: name.to_string(),
        features: img.data.iter().map(|&p| f32::from(p) / 255.0).collect(),
        labels: lab.data,
        shape: [1, rows, cols],
        classes,
    })
}
