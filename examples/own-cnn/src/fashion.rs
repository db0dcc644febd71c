//! A burn `Dataset` over Fashion-MNIST's IDX files (big-endian header, then raw bytes),
//! gzipped as Debian's `dataset-fashion-mnist` installs them, or plain.

use std::io::Read;
use std::path::{Path, PathBuf};

use burn::data::dataset::{Dataset, DatasetError};
use flate2::read::GzDecoder;
use serde::Deserialize;

/// The `[job]` table of own-cnn.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub data_dir: PathBuf,
}

#[derive(Clone, Debug)]
pub struct Image {
    pub pixels: Vec<u8>,
    pub label: u8,
}

pub struct FashionMnist {
    pixels: Vec<u8>,
    labels: Vec<u8>,
}

const SIDE: usize = 28;

impl FashionMnist {
    /// `split` is "train" or "t10k".
    pub fn open(settings: Settings, split: &str) -> Result<Self, String> {
        let images = read(&settings.data_dir, &format!("{split}-images-idx3-ubyte"))?;
        let labels = read(&settings.data_dir, &format!("{split}-labels-idx1-ubyte"))?;
        let (n_images, pixels) = payload(&images, 2051, 16)?;
        let (n_labels, labels) = payload(&labels, 2049, 8)?;
        if n_images != n_labels || pixels.len() != n_images * SIDE * SIDE {
            return Err(format!(
                "{split}: {n_images} images of {} bytes but {n_labels} labels",
                pixels.len()
            ));
        }
        Ok(FashionMnist {
            pixels: pixels.to_vec(),
            labels: labels.to_vec(),
        })
    }
}

/// The file `stem` (or `stem.gz`) in `dir`, decompressed.
fn read(dir: &Path, stem: &str) -> Result<Vec<u8>, String> {
    let gz = dir.join(format!("{stem}.gz"));
    let (path, zipped) = if gz.exists() {
        (gz, true)
    } else {
        (dir.join(stem), false)
    };
    let raw = std::fs::read(&path)
        .map_err(|e| format!("{}: {e} (run scripts/setup.sh)", path.display()))?;
    if !zipped {
        return Ok(raw);
    }
    let mut out = Vec::new();
    GzDecoder::new(&raw[..])
        .read_to_end(&mut out)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(out)
}

/// Checks the magic number; returns the item count and the bytes after the header.
fn payload(bytes: &[u8], magic: u32, header: usize) -> Result<(usize, &[u8]), String> {
    let word = |i: usize| {
        bytes
            .get(i..i + 4)
            .map(|w| u32::from_be_bytes([w[0], w[1], w[2], w[3]]))
    };
    match (word(0), word(4)) {
        (Some(m), Some(n)) if m == magic && bytes.len() >= header => {
            Ok((n as usize, &bytes[header..]))
        }
        _ => Err(format!("not an IDX file with magic number {magic}")),
    }
}

impl Dataset<Image> for FashionMnist {
    fn get(&self, index: usize) -> Result<Image, DatasetError> {
        let px = SIDE * SIDE;
        Ok(Image {
            pixels: self.pixels[index * px..(index + 1) * px].to_vec(),
            label: self.labels[index],
        })
    }

    fn len(&self) -> usize {
        self.labels.len()
    }
}
