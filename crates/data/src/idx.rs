//! IDX files, the format of MNIST and Fashion-MNIST (gzipped or raw; detected by content).
//!
//! Layout: a big-endian u32 magic `0x0000TTNN` (TT = element type, 0x08 for u8; NN = number of
//! dimensions), then NN big-endian u32 sizes, then the elements in row-major order. Images are
//! `0x00000803` (count × rows × cols, u8 pixels) and labels `0x00000801` (count, u8).

use std::path::{Path, PathBuf};

use crate::dataset::Dataset;
use crate::error::{dims_text, DataError};
use crate::read::Bounded;

/// Magic of an IDX file of u8 images (3 dimensions).
pub const IDX_IMAGES_U8: u32 = 0x0000_0803;
/// Magic of an IDX file of u8 labels (1 dimension).
pub const IDX_LABELS_U8: u32 = 0x0000_0801;

/// Class count assumed by [`load_idx`]: MNIST and Fashion-MNIST both have 10.
pub const IDX_DEFAULT_CLASSES: usize = 10;

/// The most payload bytes (elements after the header) an IDX file may declare: 1 GiB.
///
/// A header declaring more is refused from the header alone, before anything is allocated. The
/// cap admits every IDX dataset in common use with a wide margin (Fashion-MNIST and MNIST hold
/// 47 MB of training images, EMNIST ByClass, the largest, 547 MB) while bounding what a loader
/// holds: the bytes, then 4 bytes per pixel as `f32` features, 5 GiB at the cap. A 2048×2048
/// image file reaches the cap at 256 images. Training jobs check the memory of the declared
/// shape first ([`idx_images_shape`]); this cap is the loader's own last line.
pub const IDX_MAX_PAYLOAD_BYTES: u64 = 1 << 30;

/// The longest IDX header: the magic and 255 dimensions of 4 bytes.
const IDX_MAX_HEADER: u64 = 4 + 4 * 255;

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
///
/// The file is streamed (through the gzip decoder when it is gzip) and bounded as
/// [`parse_idx`] describes; only a regular file is opened, and a plain file longer than any
/// header plus [`IDX_MAX_PAYLOAD_BYTES`] is refused from its length.
pub fn read_idx(
    path: &Path,
    expected_magic: u32,
    what: &'static str,
) -> Result<IdxArray, DataError> {
    read_idx_capped(path, expected_magic, what, IDX_MAX_PAYLOAD_BYTES)
}

fn read_idx_capped(
    path: &Path,
    expected_magic: u32,
    what: &'static str,
    cap: u64,
) -> Result<IdxArray, DataError> {
    let mut r = Bounded::file(path, NOT_FOUND_HINT, IDX_MAX_HEADER + cap, "the IDX file")?;
    parse_stream(&mut r, path, expected_magic, what, cap)
}

/// Parses IDX bytes in memory, gzipped or raw (detected by content); `origin` names them in
/// errors.
///
/// Memory is bounded by the input and by the header, whatever the header claims: the header is
/// read and checked first, a declared payload over [`IDX_MAX_PAYLOAD_BYTES`] is refused
/// ([`DataError::IdxTooLarge`]), and at most the payload it declares is kept (a gzip stream is
/// decompressed only that far; the excess of an over-long one is counted, not stored, and
/// counting stops at the cap). So a header claiming 2^31 × 2^31 images in a small file is
/// refused without allocating for the claim, and a small gzip that inflates far beyond its
/// header is not inflated into memory.
pub fn parse_idx(
    raw: &[u8],
    origin: impl AsRef<Path>,
    expected_magic: u32,
    what: &'static str,
) -> Result<IdxArray, DataError> {
    parse_idx_capped(
        raw,
        origin.as_ref(),
        expected_magic,
        what,
        IDX_MAX_PAYLOAD_BYTES,
    )
}

fn parse_idx_capped(
    raw: &[u8],
    origin: &Path,
    expected_magic: u32,
    what: &'static str,
    cap: u64,
) -> Result<IdxArray, DataError> {
    let mut r = Bounded::memory(raw, origin, IDX_MAX_HEADER + cap, "the IDX data")?;
    parse_stream(&mut r, origin, expected_magic, what, cap)
}

/// The header of an IDX stream: its dimensions and the payload bytes they declare (at most
/// `cap`, else [`DataError::IdxTooLarge`]). Reads only the header's bytes.
fn read_header(
    r: &mut Bounded<'_>,
    origin: &Path,
    expected_magic: u32,
    what: &'static str,
    cap: u64,
) -> Result<(Vec<usize>, usize), DataError> {
    let length_err = |problem: String| DataError::IdxLength {
        path: origin.to_path_buf(),
        problem,
    };
    let mut head = Vec::with_capacity(4);
    r.read_up_to(4, &mut head)?;
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
    r.read_up_to(header as u64 - 4, &mut head)?;
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
    // usize is 64-bit on every supported target and each factor is below 2^32, so three factors
    // can still overflow; say so instead of wrapping.
    let expected = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| length_err(format!("header dimensions {} overflow", dims_text(&dims))))?;
    if expected as u64 > cap {
        return Err(DataError::IdxTooLarge {
            path: origin.to_path_buf(),
            dims,
            declared: expected as u64,
            limit: cap,
            what,
        });
    }
    Ok((dims, expected))
}

/// `r` yields the IDX bytes (decompressed). Holds at most the header and the payload it
/// declares; what follows is counted up to `cap` bytes of payload, not stored.
fn parse_stream(
    r: &mut Bounded<'_>,
    origin: &Path,
    expected_magic: u32,
    what: &'static str,
    cap: u64,
) -> Result<IdxArray, DataError> {
    let (dims, expected) = read_header(r, origin, expected_magic, what, cap)?;
    r.lower_limit(r.consumed() + cap);
    // `read_up_to` reserves what the header declares only as far as the input can hold it (raw
    // data is the input; gzip of these files inflates a few times, and the vector grows with
    // the data if it is more).
    let mut data = Vec::new();
    r.read_up_to(expected as u64, &mut data)?;
    // Whatever follows the declared payload is only counted, and only up to the cap.
    let (extra, past_cap) = r.skip_rest()?;
    let payload = data.len() as u64 + extra;
    if payload != expected as u64 || past_cap {
        let state = if data.len() < expected {
            "truncated"
        } else {
            "trailing bytes"
        };
        let found = if past_cap {
            format!("more than {payload} (reading stopped there)")
        } else {
            payload.to_string()
        };
        return Err(DataError::IdxLength {
            path: origin.to_path_buf(),
            problem: format!(
                "{state}: header says {} = {expected} bytes of {what}, file has {found}",
                dims_text(&dims)
            ),
        });
    }
    Ok(IdxArray { dims, data })
}

/// The shape an IDX file of u8 images declares in its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdxShape {
    /// Number of images.
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
}

impl IdxShape {
    /// Pixels (bytes of payload) the header declares: `count × rows × cols`, at most
    /// [`IDX_MAX_PAYLOAD_BYTES`] for a shape [`idx_images_shape`] returns. The loader holds
    /// these bytes and then 4 bytes per pixel as `f32` features.
    pub fn pixels(&self) -> u64 {
        (self.count as u64) * (self.rows as u64) * (self.cols as u64)
    }
}

/// The shape the IDX images file at `path` declares, reading only its header (16 bytes; a
/// gzip file is decompressed only that far), so a memory check can run before the loader.
///
/// The header is checked as [`load_idx`] checks it, with the same errors: only a regular file
/// is opened, a plain file longer than the cap allows is refused from its length, the magic must
/// be [`IDX_IMAGES_U8`], and a declared payload over [`IDX_MAX_PAYLOAD_BYTES`] is
/// [`DataError::IdxTooLarge`]. The payload is not read, so a file whose header is fine but whose
/// payload is short, long or corrupt passes here and is refused by the loader.
pub fn idx_images_shape(path: &Path) -> Result<IdxShape, DataError> {
    idx_images_shape_capped(path, IDX_MAX_PAYLOAD_BYTES)
}

fn idx_images_shape_capped(path: &Path, cap: u64) -> Result<IdxShape, DataError> {
    let mut r = Bounded::file(path, NOT_FOUND_HINT, IDX_MAX_HEADER + cap, "the IDX file")?;
    let (dims, _) = read_header(&mut r, path, IDX_IMAGES_U8, "u8 images", cap)?;
    // The magic fixes 3 dimensions.
    Ok(IdxShape {
        count: dims[0],
        rows: dims[1],
        cols: dims[2],
    })
}

/// The two parts of a directory in the layout of MNIST and Fashion-MNIST.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdxSplit {
    /// `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`.
    Train,
    /// `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`.
    Test,
}

impl IdxSplit {
    /// The file-name prefix: "train" or "t10k".
    pub fn prefix(self) -> &'static str {
        match self {
            IdxSplit::Train => "train",
            IdxSplit::Test => "t10k",
        }
    }
}

/// The image and label files of one part of an MNIST-layout directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxFiles {
    pub images: PathBuf,
    pub labels: PathBuf,
}

/// The files of `split` in `dir` (MNIST, Fashion-MNIST: both use this layout) that the loaders
/// open: `{prefix}-images-idx3-ubyte.gz` when it exists, else `{prefix}-images-idx3-ubyte` (a
/// gunzipped copy; the content decides the format either way), and the same for the labels.
/// When neither exists the name without `.gz` is returned, and loading it reports it missing.
///
/// [`load_idx_split`] and [`crate::load_fashion_mnist`] load these paths, so a memory check that
/// reads [`idx_images_shape`] of `idx_files(dir, split).images` looks at the file that will be
/// loaded.
pub fn idx_files(dir: &Path, split: IdxSplit) -> IdxFiles {
    let pick = |stem: String| {
        let gz = dir.join(format!("{stem}.gz"));
        if gz.exists() {
            gz
        } else {
            dir.join(stem)
        }
    };
    let prefix = split.prefix();
    IdxFiles {
        images: pick(format!("{prefix}-images-idx3-ubyte")),
        labels: pick(format!("{prefix}-labels-idx1-ubyte")),
    }
}

/// Loads `split` of the MNIST-layout directory `dir` (the files of [`idx_files`]; 10 classes)
/// as a dataset named `name`.
pub fn load_idx_split(dir: &Path, split: IdxSplit, name: &str) -> Result<Dataset, DataError> {
    let files = idx_files(dir, split);
    load_idx(&files.images, &files.labels, name)
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

#[cfg(test)]
mod tests {
    //! The cap on a header's claim, lowered; tests/bounds.rs has the real one.

    use super::*;
    use crate::read::tests::{gzip, Scratch};

    fn images(dims: &[u32], payload: &[u8]) -> Vec<u8> {
        let mut out = IDX_IMAGES_U8.to_be_bytes().to_vec();
        for d in dims {
            out.extend_from_slice(&d.to_be_bytes());
        }
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn a_claim_over_the_cap_is_refused_from_the_header() {
        let raw = images(&[2, 2, 2], &[1; 8]);
        for input in [raw.clone(), gzip(&raw)] {
            let ok = parse_idx_capped(&input, "m".as_ref(), IDX_IMAGES_U8, "u8 images", 8);
            assert_eq!(ok.unwrap().data, [1; 8]);
            let err =
                parse_idx_capped(&input, "m".as_ref(), IDX_IMAGES_U8, "u8 images", 7).unwrap_err();
            assert_eq!(
                err.to_string(),
                "m: header declares 2×2×2 = 8 bytes of u8 images, more than the limit of 7 bytes"
            );
        }
    }

    #[test]
    fn trailing_bytes_are_counted_only_to_the_cap() {
        let mut raw = images(&[1, 1, 1], &[7]);
        raw.resize(raw.len() + (8 << 20), 0);
        let err = parse_idx_capped(&gzip(&raw), "m".as_ref(), IDX_IMAGES_U8, "u8 images", 1000)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "m: trailing bytes: header says 1×1×1 = 1 bytes of u8 images, file has more than 1000 \
             (reading stopped there)"
        );
        // Below the cap the excess is counted exactly.
        let err = parse_idx_capped(
            &raw[..16 + 50],
            "m".as_ref(),
            IDX_IMAGES_U8,
            "u8 images",
            1000,
        )
        .unwrap_err();
        assert!(err.to_string().ends_with("file has 50"), "{err}");
    }

    #[test]
    fn a_plain_file_longer_than_any_header_and_the_cap_is_refused_from_its_length() {
        let dir = Scratch::new("idx-long-file");
        let p = dir.0.join("train-images-idx3-ubyte");
        let raw = images(&[1, 1, 1], &[7; 2000]);
        std::fs::write(&p, &raw).unwrap();
        let err = read_idx_capped(&p, IDX_IMAGES_U8, "u8 images", 100).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}: the IDX file is {} bytes, more than the limit of {} bytes",
                p.display(),
                raw.len(),
                IDX_MAX_HEADER + 100
            )
        );
    }
}
