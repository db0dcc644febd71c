//! Writing run outputs so that nothing already written is ever lost: atomic replacement, no
//! temporary file left behind on any error path, and a full disk told apart from a transient
//! failure (retrying cannot free space).

use std::io::Write;
use std::path::Path;

use crate::trainer::TrainError;

/// The disk, or the user's quota, is full.
pub fn is_no_space(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// Write to a temporary file in the same directory, fsync, rename: readers see the old file or the
/// complete new one, never a torn one. On failure the temporary file is removed and the old file
/// is untouched.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    result.map_err(|cause| {
        let _ = std::fs::remove_file(&tmp);
        TrainError::Io {
            path: path.display().to_string(),
            cause,
        }
    })
}
