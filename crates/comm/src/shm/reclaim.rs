//! Reclaiming the shared-memory files of dead jobs.
//!
//! A job killed while its shared memory is being set up leaves files behind: a rank's segment
//! whose name was not yet removed (`lockstep-{job}-{rank}[-{tag}]`), a segment still under its
//! private name (`.lockstep-….{pid}.{start}.{nonce}.tmp`), or a gradient window
//! (`lockstep-{job}-parts-{rank}-{nonce}.{pid}.{start}`). Nobody else would ever remove them
//! (every later job has another id), so each new transport reclaims them in its directory, and a
//! launcher may do the same with [`reclaim_leaked`].
//!
//! A file is removed only if all of these hold, each checked without following symlinks:
//! - its name is one of the three forms above;
//! - it is a regular file owned by our effective uid (never another user's);
//! - nobody holds a lock on it (every creator locks its file for as long as it uses it, and the
//!   kernel drops the lock when the process dies);
//! - its creator, recorded in the name or the segment header as (pid, start time), is provably
//!   gone: no process has the pid, the one that has it started at another time, or it is a
//!   zombie ([`Creator::is_gone`]);
//! - the name still refers to the file that was examined, just before `unlinkat`.
//!
//! Files of an older build that recorded no creator (windows named without pid) are left alone.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::owner::{my_uid, Creator};
use super::segment;

/// What [`reclaim_leaked`] did.
#[derive(Debug, Default, Clone)]
pub struct ReclaimReport {
    /// Files removed: ours, unlocked, their creator provably gone.
    pub removed: Vec<PathBuf>,
    /// Their total size in bytes.
    pub bytes: u64,
    /// lockstep files kept because their creator is or may be alive.
    pub alive: usize,
    /// lockstep-named entries left alone: another user's, not a regular file (a symlink, a
    /// directory), no creator recorded, or belonging to the job being set up.
    pub skipped: usize,
    /// Entries that could not be examined or removed: the path and why.
    pub errors: Vec<String>,
}

/// How a lockstep file name says who made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A segment under its public name: the creator is in its header.
    Segment,
    /// A segment under its private name, or a window: the creator is in the name.
    Named(Creator),
    /// A lockstep name that records no creator (an older build's window).
    Unknown,
}

/// Removes the leaked lockstep files of dead processes in `dir` (see the module documentation for
/// exactly which). Never fails as a whole: what could not be examined is listed in the report.
pub fn reclaim_leaked(dir: &Path) -> ReclaimReport {
    reclaim(dir, None)
}

/// [`reclaim_leaked`], leaving alone the files of job `spare` (and of job ids it prefixes, such
/// as its restarts' `{spare}-g1`): a transport being set up replaces its own job's stale files
/// itself and names them in its errors.
pub(crate) fn reclaim(dir: &Path, spare: Option<&str>) -> ReclaimReport {
    let mut report = ReclaimReport::default();
    let (dirfd, entries) = match open_dir(dir).and_then(|fd| Ok((fd, std::fs::read_dir(dir)?))) {
        Ok(x) => x,
        Err(e) => {
            report.errors.push(format!("{}: {e}", dir.display()));
            return report;
        }
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(kind) = classify(name) else { continue };
        if spare.is_some_and(|job| is_of_job(name, job)) || kind == Kind::Unknown {
            report.skipped += 1;
            continue;
        }
        match examine(&dirfd, name, kind) {
            Ok(Verdict::Leaked(bytes)) => match unlink_if_same(&dirfd, name, bytes.1) {
                Ok(true) => {
                    report.removed.push(dir.join(name));
                    report.bytes += bytes.0;
                }
                Ok(false) => report.skipped += 1,
                Err(e) => report
                    .errors
                    .push(format!("{}: {e}", dir.join(name).display())),
            },
            Ok(Verdict::Alive) => report.alive += 1,
            Ok(Verdict::Skip) => report.skipped += 1,
            Err(e) => report
                .errors
                .push(format!("{}: {e}", dir.join(name).display())),
        }
    }
    report
}

/// Which lockstep name form `name` has, if any.
fn classify(name: &str) -> Option<Kind> {
    if let Some(rest) = name.strip_prefix(".lockstep-") {
        let rest = rest.strip_suffix(".tmp")?;
        // {base}.{pid}.{start}.{nonce} (this build) or {base}.{pid}.{nonce} (older builds).
        let fields: Vec<&str> = rest.split('.').collect();
        let pid = fields.get(1)?.parse().ok()?;
        let start = match fields.len() {
            4 => fields[2].parse::<u64>().ok().filter(|&s| s != 0),
            3 => None,
            _ => return None,
        };
        return Some(Kind::Named(Creator { pid, start }));
    }
    let rest = name.strip_prefix("lockstep-")?;
    if !rest.contains('.') {
        // A segment, or an older build's window (its header then fails the segment check).
        return Some(if rest.contains("-parts-") && is_old_window(rest) {
            Kind::Unknown
        } else {
            Kind::Segment
        });
    }
    let fields: Vec<&str> = rest.split('.').collect();
    match fields[..] {
        [base, pid, start] if base.contains("-parts-") => Some(Kind::Named(Creator {
            pid: pid.parse().ok()?,
            start: start.parse::<u64>().ok().filter(|&s| s != 0),
        })),
        _ => None,
    }
}

/// `{job}-parts-{rank}-{16 hex digits}`: a window of a build that did not record its creator.
fn is_old_window(rest: &str) -> bool {
    rest.rsplit('-')
        .next()
        .is_some_and(|n| n.len() == 16 && n.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Whether `name` is a file of job `job` or of a job whose id `job` prefixes.
fn is_of_job(name: &str, job: &str) -> bool {
    let bare = name.strip_prefix('.').unwrap_or(name);
    bare.strip_prefix("lockstep-")
        .and_then(|r| r.strip_prefix(job))
        .is_some_and(|r| r.starts_with('-'))
}

enum Verdict {
    /// Removable: (size in bytes, (device, inode)) of what was examined.
    Leaked((u64, (u64, u64))),
    Alive,
    Skip,
}

/// Looks at one entry: ownership and type without following it, then lock and creator.
fn examine(dirfd: &OwnedFd, name: &str, kind: Kind) -> io::Result<Verdict> {
    let Some(st) = stat_at(dirfd, name)? else {
        return Ok(Verdict::Skip); // gone meanwhile
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_uid != my_uid() {
        return Ok(Verdict::Skip);
    }
    let file = open_at(dirfd, name)?;
    let meta = file.metadata()?;
    let id = file_id(&st);
    if (meta.dev(), meta.ino()) != id {
        return Ok(Verdict::Skip); // replaced between the two looks
    }
    let creator = match kind {
        Kind::Named(c) => c,
        Kind::Segment => match segment::creator_of(&file) {
            Some(c) => c,
            None => return Ok(Verdict::Skip), // not a segment of this layout: not ours to judge
        },
        Kind::Unknown => return Ok(Verdict::Skip),
    };
    if segment::is_locked(&file) || !creator.is_gone() {
        return Ok(Verdict::Alive);
    }
    Ok(Verdict::Leaked((meta.len(), id)))
}

/// (device, inode): what a name refers to.
#[allow(clippy::unnecessary_cast)] // the field types differ between targets
fn file_id(st: &libc::stat) -> (u64, u64) {
    (st.st_dev as u64, st.st_ino as u64)
}

fn open_dir(dir: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: a valid C string; the result is checked.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fstatat` without following a symlink; `None` if the name is gone.
fn stat_at(dirfd: &OwnedFd, name: &str) -> io::Result<Option<libc::stat>> {
    let c = CString::new(name)?;
    // SAFETY: stat is plain data; the call fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor, C string and out-pointer.
    let rc = unsafe {
        libc::fstatat(
            dirfd.as_raw_fd(),
            c.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc == 0 {
        return Ok(Some(st));
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::NotFound {
        Ok(None)
    } else {
        Err(e)
    }
}

/// Opens `name` read-only, refusing a symlink (`O_NOFOLLOW`) and never blocking on a FIFO.
fn open_at(dirfd: &OwnedFd, name: &str) -> io::Result<File> {
    let c = CString::new(name)?;
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    // SAFETY: valid descriptor and C string; the result is checked.
    let fd = unsafe { libc::openat(dirfd.as_raw_fd(), c.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Removes `name` if it still is the file `id` (device, inode); false if it changed or is gone.
fn unlink_if_same(dirfd: &OwnedFd, name: &str, id: (u64, u64)) -> io::Result<bool> {
    match stat_at(dirfd, name)? {
        Some(st) if file_id(&st) == id => {}
        _ => return Ok(false),
    }
    let c = CString::new(name)?;
    // SAFETY: valid descriptor and C string.
    if unsafe { libc::unlinkat(dirfd.as_raw_fd(), c.as_ptr(), 0) } != 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::NotFound {
            Ok(false) // another reclaimer was quicker
        } else {
            Err(e)
        };
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_classified_by_their_form() {
        let named = |pid, start| Some(Kind::Named(Creator { pid, start }));
        assert_eq!(classify("lockstep-job1-0"), Some(Kind::Segment));
        assert_eq!(
            classify("lockstep-a-b-3-0123456789abcdef"),
            Some(Kind::Segment)
        );
        assert_eq!(
            classify(".lockstep-job1-0.42.777.00000000000000ab.tmp"),
            named(42, Some(777))
        );
        assert_eq!(
            classify(".lockstep-job1-0.42.00000000000000ab.tmp"),
            named(42, None)
        );
        assert_eq!(
            classify("lockstep-j-parts-3-00000000000000ab.42.777"),
            named(42, Some(777))
        );
        assert_eq!(
            classify("lockstep-j-parts-3-00000000000000ab"),
            Some(Kind::Unknown)
        );
        for other in [
            "lockstep",
            "lockstepx",
            "other-file",
            ".lockstep-x.tmp",
            "lockstep-a.b",
        ] {
            assert_eq!(classify(other), None, "{other}");
        }
    }

    #[test]
    fn a_job_spares_its_own_files_and_its_restarts_but_not_a_longer_id() {
        assert!(is_of_job("lockstep-ab12-0", "ab12"));
        assert!(is_of_job(".lockstep-ab12-0.1.2.3.tmp", "ab12"));
        assert!(is_of_job("lockstep-ab12-g1-0", "ab12"));
        assert!(!is_of_job("lockstep-ab123-0", "ab12"));
        assert!(!is_of_job("lockstep-zz-0", "ab12"));
    }
}
