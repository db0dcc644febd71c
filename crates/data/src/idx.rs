//! IDX files, the format of MNIST and Fashion-MNIST (gzipped or raw; detected by content).
//!
//! Layout: a big-endian u32 magic `0x0000TTNN` (TT = element type, 0x08 for u8; NN = number of
//! dimensions), then NN big-endian u32 sizes, then the elements in row-major order. Images are
//! `0x00000803` (count × rows × cols, u8 pixels) and labels `0x00000801` (count, u8).

use std::path::Path;

use crate::dataset::Dataset;
use crate::error::DataError;
use crate::read::read_maybe_gz;

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
    let bytes = read_maybe_gz(path, NOT_FOUND_HINT)?;
    parse_idx(&bytes, path, expected_magic, what)
}

fn parse_idx(
    bytes: &[u8],
    path: &Path,
    expected_magic: u32,
    what: &'static str,
) -> Result<IdxArray, DataError> {
    let length_err = |problem: String| DataError::IdxLength {
        path: path.to_path_buf(),
        problem,
    };
    let be_u32 = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());

    if bytes.len() < 4 {
        return Err(length_err(format!(
            "truncated: {} bytes, too short for the 4-byte IDX magic",
            bytes.len()
        )));
    }
    let magic = be_u32(0);
    if magic != expected_magic {
        return Err(DataError::IdxMagic {
            path: path.to_path_buf(),
            found: magic,
            expected: expected_magic,
            what,
        });
    }
    let ndims = (magic & 0xff) as usize;
    let header = 4 + 4 * ndims;
    if bytes.len() < header {
        return Err(length_err(format!(
            "truncated: the header of {ndims} dimension(s) takes {header} bytes, file has {}",
            bytes.len()
        )));
    }
    let dims: Vec<usize> = (0..ndims).map(|d| be_u32(4 + 4 * d) as usize).collect();
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
    let payload = bytes.len() - header;
    if payload != expected {
        let state = if payload < expected {
            "truncated"
        } else {
            "trailing bytes"
        };
        return Err(length_err(format!(
            "{state}: header says {dims_text} = {expected} bytes of {what}, file has {payload}"
        )));
    }
    Ok(IdxArray {
        dims,
        data: bytes[header..].to_vec(),
    })
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
