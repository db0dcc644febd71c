//! Reading a dataset file into memory, decompressing it when it is gzip.
//!
//! The format is decided by the content (gzip's magic bytes 1f 8b), not the file name, so a
//! decompressed `train-images-idx3-ubyte` and the original `.gz` both load.

use std::io::Read;
use std::path::Path;

use flate2::read::MultiGzDecoder;

use crate::error::DataError;

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Returns the file's bytes, gunzipped if they start with the gzip magic. `hint` tells the user
/// where the file should come from when it does not exist.
pub(crate) fn read_maybe_gz(path: &Path, hint: &'static str) -> Result<Vec<u8>, DataError> {
    decode(&read_file(path, hint)?, path)
}

/// The file's bytes as stored; `hint` as for [`read_maybe_gz`].
pub(crate) fn read_file(path: &Path, hint: &'static str) -> Result<Vec<u8>, DataError> {
    std::fs::read(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => DataError::NotFound {
            path: path.to_path_buf(),
            hint,
        },
        _ => DataError::Io {
            path: path.to_path_buf(),
            cause: source,
        },
    })
}

/// Whether `raw` starts with gzip's magic bytes.
pub(crate) fn is_gzip(raw: &[u8]) -> bool {
    raw.starts_with(&GZIP_MAGIC)
}

/// Gunzips `raw` if it is gzip, else returns it unchanged; `origin` only names it in errors.
pub(crate) fn decode(raw: &[u8], origin: &Path) -> Result<Vec<u8>, DataError> {
    if !is_gzip(raw) {
        return Ok(raw.to_vec());
    }
    // Multi-member aware: concatenated gzip files are valid gzip and some tools write them.
    // The last 4 bytes of a gzip member hold its uncompressed size mod 2^32: exact for the files
    // here, so one allocation suffices. Capped in case the trailer is corrupt (then the decoder
    // reports the error).
    let isize_hint = raw[raw.len().saturating_sub(4)..]
        .try_into()
        .map_or(0, |b: [u8; 4]| u32::from_le_bytes(b) as usize);
    let mut out = Vec::with_capacity(isize_hint.min(raw.len().saturating_mul(64)));
    MultiGzDecoder::new(raw)
        .read_to_end(&mut out)
        .map_err(|source| DataError::Gzip {
            path: origin.to_path_buf(),
            cause: source,
        })?;
    Ok(out)
}
