//! Writing lockstep's files so that nothing already written is ever lost or clobbered — the one
//! safe-write path for every file lockstep writes (run outputs, checkpoints, benchmark and plan
//! JSON, probes):
//!
//! - the destination must be absent or a regular file: a symbolic link, FIFO, device or
//!   directory at the output path is refused ([`NotRegularFile`]), never replaced or written
//!   through;
//! - the bytes go to a fresh temporary file in the destination's directory, created exclusively
//!   (`O_CREAT | O_EXCL`, which never follows a link) under a random name — so nobody who can
//!   write into that directory can make lockstep open a file of their choosing — then fsync,
//!   rename over the destination and fsync of the directory: readers see the old file or the
//!   complete new one, never a torn one;
//! - on any error the temporary file is removed (a partial file must not eat the space that is
//!   left) and the destination is untouched; a full disk is told apart from a transient failure
//!   (retrying cannot free space).

use std::io::Write;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The disk, or the user's quota, is full. By the error's kind, which survives the path context
/// `tempfile` wraps its errors in (the raw OS code does not).
pub fn is_no_space(e: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(e.kind(), ErrorKind::StorageFull | ErrorKind::QuotaExceeded)
        || matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// An output path that holds something other than a regular file. Bad input: a restart cannot
/// change what is there.
#[derive(Debug, thiserror::Error)]
#[error(
    "{} is {kind}, not a regular file: lockstep writes only regular files (it never replaces \
     or writes through a link, FIFO, device or directory); choose another path",
    path.display()
)]
pub struct NotRegularFile {
    pub path: PathBuf,
    /// What is there, in words ("a symbolic link", "a character device", …).
    pub kind: &'static str,
}

/// What lives at `path`, if it is not a regular file (the link itself, never its target).
fn special_kind(path: &Path) -> Option<&'static str> {
    let t = std::fs::symlink_metadata(path).ok()?.file_type();
    Some(if t.is_file() {
        return None;
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "a special file"
    })
}

/// Refuse an output path that exists and is not a regular file; absent or regular is fine.
/// Called when a request is validated (before hours of work), and again by every write.
pub fn check_output_path(path: &Path) -> Result<(), NotRegularFile> {
    match special_kind(path) {
        Some(kind) => Err(NotRegularFile {
            path: path.to_path_buf(),
            kind,
        }),
        None => Ok(()),
    }
}

/// Is `e` (an error from [`replace_atomically`]) a refused output path?
pub fn is_not_regular(e: &std::io::Error) -> bool {
    e.get_ref()
        .is_some_and(|inner| inner.is::<NotRegularFile>())
}

/// The directory a relative or absolute file path lives in ("." for a bare name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Write `bytes` to `path` atomically (see the module doc): `path` is replaced by the complete
/// new file or left as it was. The new file gets mode 0644 less the umask.
pub fn replace_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut staged = Staged::create(path)?;
    staged.file().write_all(bytes)?;
    staged.sync()?;
    staged.publish()
}

/// [`replace_atomically`] in two steps, for a file too large to build in memory first or whose
/// publication must wait for something else (a checkpoint waits for metrics.jsonl): the bytes are
/// written to the temporary file ([`Staged::file`], [`Staged::sync`]) and it replaces the
/// destination later ([`Staged::publish`]). Dropped unpublished, the temporary file is removed.
pub struct Staged {
    tmp: tempfile::NamedTempFile,
    path: PathBuf,
}

impl Staged {
    /// A fresh temporary file beside `path` (refused when `path` is not absent or a regular file).
    pub fn create(path: &Path) -> std::io::Result<Staged> {
        check_output_path(path)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = tempfile::Builder::new()
            .prefix(&format!(".{name}."))
            .suffix(".tmp")
            .permissions(std::fs::Permissions::from_mode(0o644))
            .tempfile_in(parent_dir(path))?;
        Ok(Staged {
            tmp,
            path: path.to_path_buf(),
        })
    }

    /// The temporary file, to write the bytes into.
    pub fn file(&mut self) -> &mut std::fs::File {
        self.tmp.as_file_mut()
    }

    /// The bytes on stable storage.
    pub fn sync(&mut self) -> std::io::Result<()> {
        self.tmp.as_file().sync_all()
    }

    /// Rename over the destination (checked again: it may have changed since `create`), then
    /// fsync the directory. On failure the temporary file is removed.
    pub fn publish(self) -> std::io::Result<()> {
        check_output_path(&self.path)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let dir = parent_dir(&self.path).to_path_buf();
        self.tmp.persist(&self.path).map_err(|e| e.error)?;
        std::fs::File::open(dir)?.sync_all()
    }
}

/// Prove `dir` writable with a probe file (exclusively created under a random name, removed at
/// once), so an unwritable directory is found before the first write, not at it.
pub fn probe_writable(dir: &Path) -> std::io::Result<()> {
    let mut probe = tempfile::Builder::new()
        .prefix(".lockstep-probe.")
        .tempfile_in(dir)?;
    probe.write_all(b"probe")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_is_told_apart_through_tempfiles_path_context() {
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let wrapped = std::io::Error::new(full.kind(), format!("{full} at path \"x\""));
        assert!(is_no_space(&full) && is_no_space(&wrapped));
        assert!(!is_no_space(&std::io::Error::from_raw_os_error(libc::EIO)));
    }

    #[test]
    fn replaces_a_regular_file_and_leaves_no_temporary() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("out.json");
        replace_atomically(&p, b"one").unwrap();
        replace_atomically(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "a temporary file was left behind");
    }

    #[test]
    fn refuses_links_fifos_devices_and_directories_without_touching_them() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("victim");
        std::fs::write(&target, b"precious").unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let fifo = tmp.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for (path, kind) in [
            (link.as_path(), "a symbolic link"),
            (fifo.as_path(), "a FIFO"),
            (Path::new("/dev/null"), "a character device"),
            (tmp.path(), "a directory"),
        ] {
            let e = replace_atomically(path, b"x").unwrap_err();
            assert!(is_not_regular(&e), "{path:?}: {e}");
            assert!(e.to_string().contains(kind), "{e}");
        }
        assert_eq!(std::fs::read(&target).unwrap(), b"precious");
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
    }

    #[test]
    fn a_planted_link_at_a_predictable_temporary_name_is_never_followed() {
        // The old scheme wrote `<name>.tmp.<pid>`: plant links at every such name an attacker
        // could guess; none of their targets may change.
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("victim");
        std::fs::write(&target, b"precious").unwrap();
        let p = tmp.path().join("summary.json");
        for name in [
            format!("summary.tmp.{}", std::process::id()),
            format!(".summary.json.tmp.{}", std::process::id()),
        ] {
            std::os::unix::fs::symlink(&target, tmp.path().join(name)).unwrap();
        }
        replace_atomically(&p, b"{}").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"precious");
        assert_eq!(std::fs::read(&p).unwrap(), b"{}");
    }
}
