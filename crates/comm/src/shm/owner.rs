//! Who made a shared-memory file and who owns its name: the creator's identity that lets a later
//! job prove a leaked file's creator dead ([`Creator`]), and the owner check that turns a name
//! another user took first into a typed, permanent error ([`taken_by_other`]).
//!
//! A pid alone does not identify a process: after the creator dies its pid may be handed to an
//! unrelated process. The pair (pid, start time in clock ticks since boot, field 22 of
//! `/proc/<pid>/stat`) does: a reused pid comes with a later start time.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::CommError;

/// The process that created a file: pid and start time (`None` when unknown, e.g. a file written
/// by an older build, which recorded the pid only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Creator {
    pub pid: u32,
    pub start: Option<u64>,
}

impl Creator {
    /// This process.
    pub fn me() -> Creator {
        let pid = std::process::id();
        Creator {
            pid,
            start: process_stat(pid).map(|s| s.start),
        }
    }

    /// Whether the creator is certainly gone: no process has its pid, the process that has it
    /// started at another time (the pid was reused), or it is a zombie (it can never touch the
    /// file again). An unknown start time proves nothing while the pid exists.
    pub fn is_gone(&self) -> bool {
        if self.pid == 0 {
            return false;
        }
        if pid_absent(self.pid) {
            return true;
        }
        match process_stat(self.pid) {
            // It exited between the two looks.
            None => pid_absent(self.pid),
            Some(now) => now.zombie || self.start.is_some_and(|s| s != now.start),
        }
    }
}

/// What `/proc/<pid>/stat` says about a process.
#[derive(Debug, Clone, Copy)]
struct Stat {
    zombie: bool,
    start: u64,
}

/// State and start time of `pid`, or `None` if it cannot be read (no such process).
fn process_stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

/// Fields after the command name, which is in parentheses and may itself hold spaces and ')'.
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state); the start time is field 22.
    let state = fields.first()?;
    let start = fields.get(22 - 3)?.parse().ok()?;
    Some(Stat {
        zombie: *state == "Z" || *state == "X",
        start,
    })
}

/// `kill(pid, 0)` fails with ESRCH: no process (not even a zombie) has this pid.
fn pid_absent(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid, 0) };
    rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Our effective uid: the owner of every file we create.
pub(crate) fn my_uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// If whatever sits at `path` (not followed when a symlink) belongs to another user and we are
/// not root, the typed error saying so; `None` when the name is free, ours, or we are root (root
/// may replace or remove any file in a sticky directory, so nothing of another user can block
/// it).
pub(crate) fn taken_by_other(path: &Path) -> Option<CommError> {
    taken_by_other_than(path, my_uid())
}

/// [`taken_by_other`] for a given "us" (tests pretend to be another user).
pub(crate) fn taken_by_other_than(path: &Path, me: u32) -> Option<CommError> {
    let uid = std::fs::symlink_metadata(path).ok()?.uid();
    owned_by_other(path, uid, me)
}

/// The typed error for a file at `path` owned by `uid` when that is not `me` and `me` is not
/// root.
pub(crate) fn owned_by_other(path: &Path, uid: u32, me: u32) -> Option<CommError> {
    (uid != me && me != 0).then(|| CommError::NameTaken {
        path: path.display().to_string(),
        uid,
        user: user_name(uid),
        me,
    })
}

/// The login name of `uid`, if the user database knows it.
pub(crate) fn user_name(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: passwd is plain data; all-zero is a valid value to be filled in.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call and `buf` outlives the use of `pw`'s strings.
    let rc =
        unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut found) };
    if rc != 0 || found.is_null() || pw.pw_name.is_null() {
        return None;
    }
    // SAFETY: getpwuid_r succeeded, so pw_name points to a NUL-terminated string inside `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(pw.pw_name) };
    Some(name.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_found_after_a_command_name_with_spaces_and_parentheses() {
        let line = "4242 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 19 20";
        let s = parse_stat(line).unwrap();
        assert_eq!(s.start, 987654);
        assert!(!s.zombie);
        let z = parse_stat("7 (x) Z 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 5 0").unwrap();
        assert!(z.zombie);
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn this_process_is_alive_and_a_reused_pid_or_a_dead_one_is_gone() {
        let me = Creator::me();
        assert!(me.start.is_some());
        assert!(!me.is_gone());
        // Same pid, another start time: the pid was reused, the creator is gone.
        let reused = Creator {
            start: me.start.map(|s| s + 1),
            ..me
        };
        assert!(reused.is_gone());
        // A pid we cannot judge without a start time is kept alive.
        assert!(!Creator { start: None, ..me }.is_gone());
        // A child that has exited and been reaped.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(Creator { pid, start: None }.is_gone());
    }

    #[test]
    fn a_name_of_another_user_is_refused_with_its_path_and_owner() {
        let dir = std::env::temp_dir().join(format!("lockstep-owner-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lockstep-job-0");
        assert!(taken_by_other_than(&path, 12345).is_none(), "free name");
        std::fs::write(&path, b"x").unwrap();
        let mine = my_uid();
        assert!(taken_by_other_than(&path, mine).is_none(), "our own file");
        // Pretend to be another (non-root) user: the file is then someone else's.
        let e = taken_by_other_than(&path, 54321).unwrap();
        assert!(e.is_permanent());
        let m = e.to_string();
        assert!(m.contains(&path.display().to_string()), "{m}");
        assert!(m.contains(&format!("uid {mine}")), "{m}");
        if let Some(name) = user_name(mine) {
            assert!(m.contains(&name), "{m}");
        }
        // Root can replace anything: never blocked.
        assert!(taken_by_other_than(&path, 0).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
