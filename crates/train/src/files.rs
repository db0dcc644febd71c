//! Writing run outputs so that nothing already written is ever lost: atomic replacement, no
//! temporary file left behind on any error path, and a full disk told apart from a transient
//! failure (retrying cannot free space).

use std::io::Write;
use std::path::Path;

/// The disk, or the user's quota, is full.
pub fn is_no_space(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// Write `bytes` to `tmp` (a temporary name in `path`'s directory), fsync, rename over `path`:
/// readers see the old file or the complete new one, never a torn one. On failure `tmp` is
/// removed — a partial file must not eat the space that is left — and `path` is untouched.
pub fn replace_via(tmp: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let result = (|| {
        let mut f = std::fs::File::create(tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    result
}
