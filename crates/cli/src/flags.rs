//! Range checks of every numeric flag and output path, run by each command before anything is
//! written or spawned. A value that parses is not yet a value that can run: `--stall-timeout
//! 1e300` overflows a `Duration`, `--threads-per-worker 100000` starts a hundred thousand
//! threads, `--json /dev/full` would replace a device node. Each such value is refused here as a
//! [`BadRequest`] naming the flag and the accepted range (exit status 3, never retried).

use std::path::Path;
use std::time::Duration;

use lockstep_train::limits::MAX_TIMEOUT_SECS;

use crate::request::BadRequest;

/// Most worker processes one launcher starts on its node.
pub const MAX_LOCAL_WORKERS: usize = 1024;
/// Most nodes of a job (and of a cluster `lockstep plan` describes).
pub const MAX_NODES: usize = 1 << 16;
/// Most restarts `--max-restarts` may allow.
pub const MAX_RESTARTS: usize = 10_000;

/// A number of seconds for `flag`: finite, at least `min` and at most a week.
pub fn seconds(flag: &str, value: f64, min: f64) -> Result<Duration, BadRequest> {
    if value.is_finite() && (min..=MAX_TIMEOUT_SECS).contains(&value) {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(BadRequest(format!(
            "{flag} {value}: must be a number of seconds from {min} to {MAX_TIMEOUT_SECS} (a week)"
        )))
    }
}

/// Largest `--worker-memory-gib`: a petabyte is no cap.
pub const MAX_MEMORY_GIB: f64 = 1024.0 * 1024.0;

/// A memory size in GiB, as bytes: at least 1 MiB (less could not even start a worker).
pub fn gib(flag: &str, value: f64) -> Result<u64, BadRequest> {
    if value.is_finite() && (1.0 / 1024.0..=MAX_MEMORY_GIB).contains(&value) {
        Ok((value * (1u64 << 30) as f64) as u64)
    } else {
        Err(BadRequest(format!(
            "{flag} {value}: must be a number of GiB from {} to {MAX_MEMORY_GIB}",
            1.0 / 1024.0
        )))
    }
}

/// This host's cores (logical CPUs this process may run on).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Threads per worker: at least one, at most this host's cores (more only contend for them).
pub fn threads(flag: &str, value: usize) -> Result<usize, BadRequest> {
    let cores = cores();
    if (1..=cores).contains(&value) {
        Ok(value)
    } else {
        Err(BadRequest(format!(
            "{flag} {value}: must be from 1 to this host's {cores} core(s)"
        )))
    }
}

/// A count for `flag` within `lo..=hi`.
pub fn count(flag: &str, value: usize, lo: usize, hi: usize) -> Result<usize, BadRequest> {
    if (lo..=hi).contains(&value) {
        Ok(value)
    } else {
        Err(BadRequest(format!(
            "{flag} {value}: must be from {lo} to {hi}"
        )))
    }
}

/// A file a command will write at the end: absent or a regular file, in an existing directory —
/// checked now, not after the work that produces it.
pub fn output_file(flag: &str, path: &Path) -> Result<(), BadRequest> {
    lockstep_train::files::check_output_path(path)
        .map_err(|e| BadRequest(format!("{flag} {}: {e}", path.display())))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(BadRequest(format!(
            "{flag} {}: the directory {} does not exist",
            path.display(),
            dir.display()
        )));
    }
    Ok(())
}

/// The text of a small input file (a cluster description): a regular file of at most `limit`
/// bytes (`lockstep_run::read`), never `/dev/zero` or a FIFO read forever.
pub fn small_file(flag: &str, path: &Path, limit: u64) -> Result<String, BadRequest> {
    lockstep_run::read::read_text(path, limit)
        .map_err(|e| BadRequest(format!("{flag} {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_refuse_what_no_duration_holds() {
        for v in [f64::NAN, f64::INFINITY, -1.0, 0.0, 1e300, 0.5] {
            assert!(seconds("--stall-timeout", v, 2.0).is_err(), "{v}");
        }
        assert_eq!(
            seconds("--stall-timeout", 3.0, 2.0).unwrap(),
            Duration::from_secs(3)
        );
    }

    #[test]
    fn threads_are_capped_by_the_cores() {
        assert!(threads("--threads-per-worker", 0).is_err());
        assert!(threads("--threads-per-worker", cores() + 1).is_err());
        assert_eq!(threads("--threads-per-worker", 1).unwrap(), 1);
    }

    #[test]
    fn output_files_must_be_regular_and_in_a_directory() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(output_file("--json", &tmp.path().join("a.json")).is_ok());
        assert!(output_file("--json", Path::new("/dev/full")).is_err());
        assert!(output_file("--json", &tmp.path().join("no/such/dir.json")).is_err());
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink("/etc/passwd", &link).unwrap();
        let e = output_file("--json", &link).unwrap_err();
        assert!(e.0.contains("symbolic link"), "{e}");
    }

    #[test]
    fn small_files_stop_at_their_limit() {
        assert!(small_file("--cluster", Path::new("/dev/zero"), 1 << 20).is_err());
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("c.toml");
        std::fs::write(&p, "x".repeat(100)).unwrap();
        assert!(small_file("--cluster", &p, 99).is_err());
        assert_eq!(small_file("--cluster", &p, 100).unwrap().len(), 100);
    }
}
