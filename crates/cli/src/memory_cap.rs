//! `lockstep train --worker-memory-gib X`: each of this node's workers runs in a memory cgroup
//! of its own, capped at X GiB, and the kernel enforces the cap.
//!
//! - **cgroup v2**: `memory.max`, with `memory.swap.max = 0`, so a worker over its cap is
//!   OOM-killed instead of swapped.
//! - **cgroup v1**: `memory.limit_in_bytes`, and `memory.memsw.limit_in_bytes` where swap is
//!   accounted.
//!
//! The cgroups are `<the launcher's cgroup>/lockstep-<job>-a<attempt>/rank-<r>`. A worker joins
//! its cgroup between `fork` and `exec` (`pre_exec`), so even its first allocation counts. A
//! worker the kernel killed at its cap is found by its cgroup's `oom_kill` count, not by reading
//! any text. The launcher names it as `FailureKind::MemoryCap` and does not restart it: the same
//! cap would be met again. The cgroups are removed when the attempt ends.
//!
//! Needs a memory controller the launcher may create cgroups under: root, or a delegated cgroup
//! v2 subtree. Without one, the request is refused before anything is written.

use std::ffi::CString;
use std::path::{Path, PathBuf};

/// Which cgroup hierarchy holds the memory controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hierarchy {
    V1,
    V2,
}

/// Why no cap can be set (bad input: the request is refused, exit status 3).
#[derive(Debug, thiserror::Error)]
pub enum CapError {
    #[error(
        "--worker-memory-gib needs the kernel's memory cgroup controller, and this process's \
         cgroup has none (no cgroup v2 with `memory` and no cgroup v1 `memory` hierarchy in \
         /proc/self/mountinfo)"
    )]
    NoController,
    #[error(
        "--worker-memory-gib: cannot set up the memory cgroup {path}: {cause} (it needs root, \
         or a cgroup v2 subtree delegated to this user with the memory controller enabled)"
    )]
    Setup { path: String, cause: std::io::Error },
}

/// Where this process's memory cgroup lies: the hierarchy and the directory, from the texts of
/// `/proc/self/mountinfo` and `/proc/self/cgroup`. cgroup v2 is used when it has the memory
/// controller (`v2_has_memory`), else the v1 `memory` hierarchy, if any.
pub fn locate(
    mountinfo: &str,
    proc_cgroup: &str,
    v2_has_memory: impl Fn(&Path) -> bool,
) -> Option<(Hierarchy, PathBuf)> {
    let mounts: Vec<Mount> = mountinfo.lines().filter_map(Mount::parse).collect();
    let member = |wanted: &dyn Fn(&str, &str) -> bool| {
        proc_cgroup.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
            wanted(id, controllers).then(|| path.to_string())
        })
    };
    let v2 = mounts.iter().find(|m| m.fstype == "cgroup2").and_then(|m| {
        let path = member(&|id, c| id == "0" && c.is_empty())?;
        let dir = m.dir_of(&path)?;
        v2_has_memory(&dir).then_some((Hierarchy::V2, dir))
    });
    v2.or_else(|| {
        let m = mounts
            .iter()
            .find(|m| m.fstype == "cgroup" && m.options.split(',').any(|o| o == "memory"))?;
        let path = member(&|_, c| c.split(',').any(|c| c == "memory"))?;
        Some((Hierarchy::V1, m.dir_of(&path)?))
    })
}

/// One line of `/proc/self/mountinfo`: `id parent major:minor root mountpoint options [optional
/// fields] - fstype source super-options`.
struct Mount {
    root: String,
    point: PathBuf,
    fstype: String,
    options: String,
}

impl Mount {
    fn parse(line: &str) -> Option<Mount> {
        let (before, after) = line.split_once(" - ")?;
        let before: Vec<&str> = before.split(' ').collect();
        let after: Vec<&str> = after.split(' ').collect();
        Some(Mount {
            root: before.get(3)?.to_string(),
            point: PathBuf::from(before.get(4)?),
            fstype: after.first()?.to_string(),
            options: after.get(2).unwrap_or(&"").to_string(),
        })
    }

    /// The directory of cgroup `path` (as `/proc/self/cgroup` names it) under this mount, whose
    /// root may be a cgroup itself (inside a container).
    fn dir_of(&self, path: &str) -> Option<PathBuf> {
        let rest = if self.root == "/" {
            path
        } else {
            path.strip_prefix(self.root.as_str())?
        };
        Some(self.point.join(rest.trim_start_matches('/')))
    }
}

/// The cgroups of one attempt's workers on this node (removed when dropped).
pub struct MemoryCaps {
    hierarchy: Hierarchy,
    job_dir: PathBuf,
    limit_bytes: u64,
    ranks: Vec<(usize, PathBuf)>,
}

impl MemoryCaps {
    /// This process's memory cgroup, or why there is none to cap workers under.
    pub fn available() -> Result<(Hierarchy, PathBuf), CapError> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        locate(&mountinfo, &cgroup, |dir| {
            std::fs::read_to_string(dir.join("cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"))
        })
        .ok_or(CapError::NoController)
    }

    /// Check, before anything is written, that caps can be set here: a cgroup is made and
    /// removed again.
    pub fn check(limit_bytes: u64) -> Result<(), CapError> {
        let mut probe = MemoryCaps::create(&format!("probe-{}", std::process::id()), limit_bytes)?;
        probe.rank(0)?;
        Ok(())
    }

    /// The directory for `label`'s workers (`lockstep-<label>`) under this process's cgroup.
    pub fn create(label: &str, limit_bytes: u64) -> Result<MemoryCaps, CapError> {
        let (hierarchy, own) = MemoryCaps::available()?;
        let job_dir = own.join(format!("lockstep-{label}"));
        let setup = |path: &Path, cause| CapError::Setup {
            path: path.display().to_string(),
            cause,
        };
        std::fs::create_dir(&job_dir).map_err(|e| setup(&job_dir, e))?;
        let caps = MemoryCaps {
            hierarchy,
            job_dir,
            limit_bytes,
            ranks: Vec::new(),
        };
        if hierarchy == Hierarchy::V2 {
            // Its children get the memory controller only if it hands it down.
            let control = caps.job_dir.join("cgroup.subtree_control");
            std::fs::write(&control, "+memory").map_err(|e| setup(&control, e))?;
        }
        Ok(caps)
    }

    /// The capped cgroup of worker `rank`: made now; the worker joins it with [`join_in_child`].
    pub fn rank(&mut self, rank: usize) -> Result<CString, CapError> {
        let dir = self.job_dir.join(format!("rank-{rank}"));
        let setup = |path: &Path, cause| CapError::Setup {
            path: path.display().to_string(),
            cause,
        };
        std::fs::create_dir(&dir).map_err(|e| setup(&dir, e))?;
        self.ranks.push((rank, dir.clone()));
        let limit = self.limit_bytes.to_string();
        let files: &[(&str, &str, bool)] = match self.hierarchy {
            Hierarchy::V2 => &[
                ("memory.max", &limit, true),
                ("memory.swap.max", "0", false),
            ],
            // The memory limit first: v1 refuses memsw below it.
            Hierarchy::V1 => &[
                ("memory.limit_in_bytes", &limit, true),
                ("memory.memsw.limit_in_bytes", &limit, false),
            ],
        };
        for &(name, value, required) in files {
            let path = dir.join(name);
            match std::fs::write(&path, value) {
                Ok(()) => {}
                // Swap accounting is optional in the kernel: without it there is no such file.
                Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(setup(&path, e)),
            }
        }
        let procs = dir.join("cgroup.procs");
        Ok(CString::new(procs.as_os_str().as_encoded_bytes()).expect("a path has no NUL"))
    }

    /// Was a process of `rank`'s cgroup killed by the kernel's OOM killer at its cap?
    pub fn oom_killed(&self, rank: usize) -> bool {
        let Some((_, dir)) = self.ranks.iter().find(|(r, _)| *r == rank) else {
            return false;
        };
        let file = match self.hierarchy {
            Hierarchy::V2 => "memory.events",
            Hierarchy::V1 => "memory.oom_control",
        };
        std::fs::read_to_string(dir.join(file)).is_ok_and(|text| oom_kills(&text) > 0)
    }

    /// The cap, in bytes.
    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes
    }
}

/// The `oom_kill N` count of a `memory.events` (v2) or `memory.oom_control` (v1) text.
pub fn oom_kills(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
        .unwrap_or(0)
}

impl Drop for MemoryCaps {
    /// Remove the cgroups (they must be empty: called once the attempt's workers exited). An
    /// exited process leaves its cgroup a moment later, so a busy one is tried again briefly.
    fn drop(&mut self) {
        let dirs = self
            .ranks
            .iter()
            .map(|(_, d)| d.clone())
            .chain([self.job_dir.clone()]);
        for dir in dirs {
            for _ in 0..50 {
                match std::fs::remove_dir(&dir) {
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                        std::thread::sleep(std::time::Duration::from_millis(20))
                    }
                    _ => break,
                }
            }
        }
    }
}

/// In the child between `fork` and `exec`: move this process into the cgroup whose
/// `cgroup.procs` is `procs`. Only system calls, no allocation (what a forked child of a
/// threaded parent may do).
pub fn join_in_child(procs: &CString) -> std::io::Result<()> {
    // SAFETY: open/write/close on a NUL-terminated path and a stack buffer.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut buf = [0u8; 20];
        let pid = crate::decimal::digits(libc::getpid() as u64, &mut buf);
        let n = libc::write(fd, pid.as_ptr().cast(), pid.len());
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if n < 0 {
            return Err(err);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
25 30 0:22 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
28 25 0:25 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
31 25 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 25 0:33 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw";
    const HYBRID_CGROUP: &str = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n";

    #[test]
    fn a_hybrid_host_caps_through_the_v1_memory_hierarchy() {
        // The unified hierarchy has no memory controller there: v1 it is.
        let got = locate(HYBRID, HYBRID_CGROUP, |_| false);
        assert_eq!(
            got,
            Some((
                Hierarchy::V1,
                PathBuf::from("/sys/fs/cgroup/memory/process_api/abc")
            ))
        );
    }

    #[test]
    fn a_unified_host_caps_through_v2_and_a_container_mount_root_is_stripped() {
        let mountinfo = "40 30 0:33 /user.slice/job /sys/fs/cgroup rw - cgroup2 cgroup2 rw";
        let cgroup = "0::/user.slice/job/session\n";
        let seen = std::cell::RefCell::new(Vec::new());
        let got = locate(mountinfo, cgroup, |d| {
            seen.borrow_mut().push(d.to_path_buf());
            true
        });
        assert_eq!(
            got,
            Some((Hierarchy::V2, PathBuf::from("/sys/fs/cgroup/session")))
        );
        assert_eq!(*seen.borrow(), [PathBuf::from("/sys/fs/cgroup/session")]);
        // A v2 cgroup without the memory controller, and no v1 one: nothing to cap with.
        assert_eq!(locate(mountinfo, cgroup, |_| false), None);
        // A cgroup outside the mount's root (another namespace's) is not ours to use.
        assert_eq!(locate(mountinfo, "0::/elsewhere\n", |_| true), None);
    }

    #[test]
    fn oom_kills_are_counted_from_either_hierarchys_file() {
        assert_eq!(
            oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"),
            2
        );
        assert_eq!(
            oom_kills("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\noom_group_kill 0\n"),
            1
        );
        assert_eq!(oom_kills("oom_kill_disable 0\nunder_oom 0\n"), 0);
    }
}
