//! The run directory is a ledger: nothing in it is rewritten by a request that has not been
//! validated first, and an ordinary command never destroys a run.
//!
//! - One launcher at a time: a run directory is locked ([`RunDirLock`], an advisory `flock` on
//!   `.lockstep.lock`) for the life of the launcher that writes it; a second one is refused,
//!   naming the holder. Every check below runs under the lock.
//! - A fresh `train` refuses a directory that already holds a run (it names the files and
//!   suggests `--resume` or another `--out`). `--overwrite` works out everything it would remove
//!   first ([`check_fresh`]) and removes it only once the whole request is validated
//!   ([`Fresh::apply`]): the run's own files, and of the checkpoints only those whose header
//!   names the replaced run's identity — never through a symbolic link, never another run's or
//!   a user's file.
//! - `--resume DIR` checks the request against the run before writing anything: its config.toml
//!   must be whole; `--set` may change how the run is executed (workers, timeouts, logging,
//!   checkpoints) but not what it computes; metrics.jsonl must read back whole; a run with
//!   recorded steps must find a checkpoint to continue from; a finished run is reported as
//!   finished and left untouched, unless a larger `train.steps` (or `train.epochs`) extends it —
//!   every earlier record is then kept. A run whose summary lacks its final figures is not
//!   finished: resuming it evaluates the final model again and writes the summary.
//! - Checkpoint directories are probed for writability before any worker starts.

use lockstep_train::ConfigLoad;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use lockstep_run::read::{read_text, CONFIG_MAX_BYTES, METRICS_MAX_BYTES, SUMMARY_MAX_BYTES};
use lockstep_train::{StepRecord, TrainConfig};

/// A request that would damage or cannot continue a run. Bad input: exit status 3.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error(
        "{dir} already holds a run ({files}); continue it with `{bin} train --resume {dir}`, \
         choose another --out, or pass --overwrite to replace it"
    )]
    HoldsRun {
        dir: String,
        files: String,
        bin: String,
    },
    #[error("--resume {dir}: {dir}/config.toml is missing, so this is not a run directory")]
    NotARun { dir: String },
    #[error(
        "--resume {dir}: --set would change what the run computes ({changes}); a resumed run \
         keeps its settings: start a new run with --out instead"
    )]
    ChangesIdentity { dir: String, changes: String },
    #[error("--resume {dir}: {what}")]
    BadLength { dir: String, what: String },
    #[error("checkpoint directory {dir} is not writable: {cause}")]
    Unwritable { dir: String, cause: String },
    #[error("run directory {dir}: {cause}")]
    RunDirUnusable { dir: String, cause: String },
    #[error("{path}: {what}")]
    Unreadable { path: String, what: String },
    #[error(
        "run directory {dir} is in use by another lockstep launcher ({holder}); wait for it to \
         end, or choose another --out"
    )]
    Busy { dir: String, holder: String },
    #[error(
        "--resume: {path} lacks {missing}; lockstep writes a run's config whole, so this file \
         was cut or edited, and resuming would silently use defaults instead: restore it \
         (nothing was changed)"
    )]
    Incomplete { path: String, missing: String },
    #[error(
        "--resume {dir}: metrics.jsonl records steps up to {steps}, but {ckpt_dir} holds no \
         checkpoint: resuming would train again from step 0 and rewrite those records. Point \
         checkpoint.dir at the run's checkpoints (nothing was changed)"
    )]
    NoCheckpoint {
        dir: String,
        ckpt_dir: String,
        steps: u64,
    },
    #[error(
        "{path}, line {line}: not a step record ({what}); the run's records would be lost by \
         resuming past it: repair or remove that line (nothing was changed)"
    )]
    CorruptMetrics {
        path: String,
        line: usize,
        what: String,
    },
    #[error(
        "--overwrite {dir}: {ckpt_dir} is a symbolic link; --overwrite never deletes through a \
         link: remove the link (or set checkpoint.dir) and try again (nothing was changed)"
    )]
    LinkedCheckpoints { dir: String, ckpt_dir: String },
    #[error(
        "--overwrite {dir}: {files} in {ckpt_dir} {are} not the replaced run's checkpoints \
         ({why}); --overwrite removes only files it can identify as that run's: move them or \
         set checkpoint.dir (nothing was changed)"
    )]
    ForeignCheckpoints {
        dir: String,
        ckpt_dir: String,
        files: String,
        are: &'static str,
        why: String,
    },
}

/// Files that make a directory a run.
const RUN_FILES: &[&str] = &[
    "config.toml",
    "summary.json",
    "metrics.jsonl",
    "report.md",
    "report.html",
    // lockstep_run::tensorboard::EVENT_FILE under tensorboard/ (a const cannot concatenate).
    "tensorboard/events.out.tfevents.0.lockstep",
];

/// The lock file of a run directory (empty when nobody holds it).
pub const LOCK_FILE: &str = ".lockstep.lock";

fn display(p: &Path) -> String {
    p.display().to_string()
}

/// The name this program is called by (a user's binary is not `lockstep`), for hints.
fn program() -> String {
    std::env::args_os()
        .next()
        .map(PathBuf::from)
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "lockstep".into())
}

/// The run files (and checkpoint directory) present in `dir`.
fn run_files(dir: &Path, ckpt_dir: &Path) -> Vec<String> {
    let mut found: Vec<String> = RUN_FILES
        .iter()
        .filter(|f| std::fs::symlink_metadata(dir.join(f)).is_ok())
        .map(|f| f.to_string())
        .collect();
    if lockstep_train::checkpoint::list(ckpt_dir).is_ok_and(|l| !l.is_empty()) {
        found.push(format!("checkpoints in {}", display(ckpt_dir)));
    }
    found
}

/// A run directory held by this process: an exclusive advisory lock on its lock file, which
/// says who holds it. Released (and the file emptied) when dropped or when the process ends.
#[derive(Debug)]
pub struct RunDirLock {
    file: std::fs::File,
}

impl RunDirLock {
    /// Create `dir` if needed and lock it, or name the launcher that holds it.
    pub fn acquire(dir: &Path) -> Result<RunDirLock, RunDirError> {
        let path = dir.join(LOCK_FILE);
        let unwritable = |cause: std::io::Error| RunDirError::RunDirUnusable {
            dir: display(dir),
            cause: cause.to_string(),
        };
        if std::fs::metadata(dir).is_ok_and(|m| !m.is_dir()) {
            return Err(RunDirError::RunDirUnusable {
                dir: display(dir),
                cause: "exists and is not a directory".into(),
            });
        }
        std::fs::create_dir_all(dir).map_err(unwritable)?;
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| RunDirError::Unreadable {
                path: display(&path),
                what: format!("cannot open the run directory's lock file ({e})"),
            })?;
        if !file.metadata().map_err(unwritable)?.is_file() {
            return Err(RunDirError::Unreadable {
                path: display(&path),
                what: "the run directory's lock file is not a regular file".into(),
            });
        }
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut holder = String::new();
                let _ = file.take(4096).read_to_string(&mut holder);
                return Err(RunDirError::Busy {
                    dir: display(dir),
                    holder: describe_holder(holder.trim()),
                });
            }
            // A file system without locks (rare): go on unlocked rather than refuse every run.
            eprintln!(
                "lockstep: warning: cannot lock {} ({e}); two launchers could share this run \
                 directory",
                display(&path)
            );
        }
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let me = format!(
            "pid={} host={} since={since}\n",
            std::process::id(),
            hostname()
        );
        let _ = file.set_len(0);
        let _ = file.rewind();
        let _ = file.write_all(me.as_bytes());
        Ok(RunDirLock { file })
    }
}

impl Drop for RunDirLock {
    fn drop(&mut self) {
        // The lock goes with the descriptor; an empty file says nobody holds it.
        let _ = self.file.set_len(0);
    }
}

/// "pid 123 on host h, for 5 s" from a lock file's `pid=… host=… since=…`.
fn describe_holder(text: &str) -> String {
    let field = |k: &str| {
        text.split_whitespace()
            .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
    };
    let (Some(pid), Some(host)) = (field("pid"), field("host")) else {
        return "its holder did not say who it is".into();
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    match field("since").and_then(|s| s.parse::<u64>().ok()) {
        Some(since) => format!(
            "pid {pid} on host {host}, for {} s",
            now.saturating_sub(since)
        ),
        None => format!("pid {pid} on host {host}"),
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer's length is passed; gethostname writes at most that many bytes.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "?".into()
    }
}

/// What a fresh run into a directory will remove (with `--overwrite`), decided before anything
/// is removed.
#[derive(Debug, Default)]
#[must_use = "nothing is removed until `apply`"]
pub struct Fresh {
    remove: Vec<PathBuf>,
}

impl Fresh {
    /// Remove the replaced run's files (links themselves, never their targets).
    pub fn apply(self) {
        for p in self.remove {
            // A checkpoint file, or a sharded checkpoint's directory.
            let _ = lockstep_train::checkpoint::remove(&p);
        }
    }
}

/// A fresh run into `dir`: refuse a directory holding a run, unless `overwrite`, in which case
/// list what replacing it removes — the run's files and its own checkpoints — refusing instead
/// when a checkpoint there cannot be identified as the replaced run's.
pub fn check_fresh(dir: &Path, cfg: &TrainConfig, overwrite: bool) -> Result<Fresh, RunDirError> {
    let ckpt_dir = lockstep_train::checkpoint_dir(cfg, dir);
    let found = run_files(dir, &ckpt_dir);
    if found.is_empty() {
        return Ok(Fresh::default());
    }
    if !overwrite {
        return Err(RunDirError::HoldsRun {
            dir: display(dir),
            files: found.join(", "),
            bin: program(),
        });
    }
    let mut remove: Vec<PathBuf> = RUN_FILES
        .iter()
        .map(|f| dir.join(f))
        .filter(|p| std::fs::symlink_metadata(p).is_ok())
        .collect();
    remove.extend(replaced_checkpoints(dir, &ckpt_dir)?);
    Ok(Fresh { remove })
}

/// The checkpoints in `ckpt_dir` of the run in `dir` that `--overwrite` replaces; refused if any
/// checkpoint there is not provably that run's, or if the directory is a link.
fn replaced_checkpoints(dir: &Path, ckpt_dir: &Path) -> Result<Vec<PathBuf>, RunDirError> {
    use lockstep_train::checkpoint;
    let all = checkpoint::list(ckpt_dir).unwrap_or_default();
    if all.is_empty() {
        return Ok(Vec::new());
    }
    if std::fs::symlink_metadata(ckpt_dir).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(RunDirError::LinkedCheckpoints {
            dir: display(dir),
            ckpt_dir: display(ckpt_dir),
        });
    }
    let foreign = |files: Vec<&PathBuf>, why: String| {
        let names: Vec<String> = files
            .iter()
            .take(5)
            .map(|p| p.file_name().unwrap_or_default().to_string_lossy().into())
            .collect();
        RunDirError::ForeignCheckpoints {
            dir: display(dir),
            ckpt_dir: display(ckpt_dir),
            files: names.join(", ") + if files.len() > 5 { ", …" } else { "" },
            are: if files.len() == 1 { "is" } else { "are" },
            why,
        }
    };
    let config = dir.join("config.toml");
    let identity = match TrainConfig::load_for(crate::job(), Some(&config), &[]) {
        Ok(old) => old.identity_hash(),
        Err(e) => {
            return Err(foreign(
                all.iter().map(|(_, p)| p).collect(),
                format!(
                    "the run's {} cannot tell whose they are: {e}",
                    display(&config)
                ),
            ))
        }
    };
    let ours = checkpoint::of_run(ckpt_dir, |id| id.config == identity).unwrap_or_default();
    let theirs: Vec<&PathBuf> = all
        .iter()
        .map(|(_, p)| p)
        .filter(|p| !ours.contains(p))
        .collect();
    if !theirs.is_empty() {
        return Err(foreign(
            theirs,
            "another run's, damaged, or not checkpoints at all".into(),
        ));
    }
    Ok(ours)
}

/// What `--resume` will do.
#[derive(Debug)]
pub enum Resume {
    /// Continue (an interrupted run, or a finished one extended to more steps).
    Continue,
    /// The run is complete and the request asks for nothing more: touch nothing.
    Finished { steps: u64, param_hash: String },
}

/// Check `--resume dir` with the config `cfg` (the run's config.toml plus `--set`) against the run.
pub fn check_resume(dir: &Path, cfg: &TrainConfig) -> Result<Resume, RunDirError> {
    let config_path = dir.join("config.toml");
    if !config_path.exists() {
        return Err(RunDirError::NotARun { dir: display(dir) });
    }
    let unreadable = |what: String| RunDirError::Unreadable {
        path: display(&config_path),
        what,
    };
    let old = TrainConfig::load_for(crate::job(), Some(&config_path), &[])
        .map_err(|e| unreadable(e.to_string()))?;
    let text = read_text(&config_path, CONFIG_MAX_BYTES).map_err(|e| unreadable(e.to_string()))?;
    let missing = old.missing_keys(&text, crate::job().config_sections());
    if !missing.is_empty() {
        let shown: Vec<&str> = missing.iter().take(12).map(String::as_str).collect();
        return Err(RunDirError::Incomplete {
            path: display(&config_path),
            missing: shown.join(", ") + if missing.len() > 12 { ", …" } else { "" },
        });
    }
    let changes = old.identity_differences(cfg);
    if !changes.is_empty() {
        return Err(RunDirError::ChangesIdentity {
            dir: display(dir),
            changes: changes.join(", "),
        });
    }
    check_length(dir, &old, cfg)?;
    let recorded = recorded_steps(&dir.join("metrics.jsonl"))?;
    if finished(dir, &old, cfg)? {
        let summary = read_summary(dir)?;
        return Ok(Resume::Finished {
            steps: summary["steps"].as_u64().unwrap_or(0),
            param_hash: summary["param_hash"].as_str().unwrap_or("?").to_string(),
        });
    }
    let ckpt_dir = lockstep_train::checkpoint_dir(cfg, dir);
    if let Some(steps) = recorded {
        if lockstep_train::checkpoint::list(&ckpt_dir).is_ok_and(|l| l.is_empty()) {
            return Err(RunDirError::NoCheckpoint {
                dir: display(dir),
                ckpt_dir: display(&ckpt_dir),
                steps,
            });
        }
    }
    Ok(Resume::Continue)
}

/// A resumed run can be extended, in the key its length is given in, but not shortened.
fn check_length(dir: &Path, old: &TrainConfig, cfg: &TrainConfig) -> Result<(), RunDirError> {
    let (o, n) = (&old.train, &cfg.train);
    let bad_length = |what: String| RunDirError::BadLength {
        dir: display(dir),
        what,
    };
    if o.steps > 0 && (n.steps == 0 || n.epochs != o.epochs) {
        return Err(bad_length(format!(
            "the run's length is given in train.steps ({}), so train.epochs does not apply to \
             it; extend it with --set train.steps=N",
            o.steps
        )));
    }
    if o.steps == 0 && n.steps != 0 {
        return Err(bad_length(format!(
            "the run's length is given in train.epochs ({}); extend it with the same key",
            o.epochs
        )));
    }
    if n.steps < o.steps || n.epochs < o.epochs {
        return Err(bad_length(format!(
            "a resumed run can be extended but not shortened (train.steps {} → {}, train.epochs \
             {} → {})",
            o.steps, n.steps, o.epochs, n.epochs
        )));
    }
    Ok(())
}

/// The highest step metrics.jsonl records (counting from 1), if it records any; every line must
/// be a step record.
fn recorded_steps(path: &Path) -> Result<Option<u64>, RunDirError> {
    let text = match read_text(path, METRICS_MAX_BYTES) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(RunDirError::Unreadable {
                path: display(path),
                what: e.to_string(),
            })
        }
    };
    let mut last = None;
    for (i, line) in text.lines().enumerate() {
        let r: StepRecord =
            serde_json::from_str(line).map_err(|e| RunDirError::CorruptMetrics {
                path: display(path),
                line: i + 1,
                what: e.to_string(),
            })?;
        last = last.max(Some(r.step + 1));
    }
    Ok(last)
}

fn read_summary(dir: &Path) -> Result<serde_json::Value, RunDirError> {
    let path = dir.join("summary.json");
    let text = read_text(&path, SUMMARY_MAX_BYTES).map_err(|e| RunDirError::Unreadable {
        path: display(&path),
        what: e.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|e| RunDirError::Unreadable {
        path: display(&path),
        what: format!("not valid JSON ({e}); the run's files were left as they are"),
    })
}

/// Is the run complete for the config `old` and `cfg` asks for no more? Its summary must exist,
/// belong to that config and hold the final figures (a summary written by an attempt that ran
/// no step — before this version — lacks them).
fn finished(dir: &Path, old: &TrainConfig, cfg: &TrainConfig) -> Result<bool, RunDirError> {
    if !dir.join("summary.json").exists() {
        return Ok(false); // interrupted before its end
    }
    let summary = read_summary(dir)?;
    // A summary belongs to the config in config.toml unless an extension rewrote that config and
    // has not finished yet.
    let extended = cfg.train.steps > old.train.steps || cfg.train.epochs > old.train.epochs;
    Ok(!extended
        && summary["config_hash"].as_str() == Some(old.hash_hex().as_str())
        && summary["final_loss"].is_number())
}

/// Create `dir` (the checkpoint directory) if needed and prove it writable with a probe file, so
/// an unwritable `checkpoint.dir` is found before the first checkpoint, not at it.
pub fn check_writable(dir: &Path) -> Result<(), RunDirError> {
    let unwritable = |cause: std::io::Error| RunDirError::Unwritable {
        dir: display(dir),
        cause: cause.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(unwritable)?;
    lockstep_train::files::probe_writable(dir).map_err(unwritable)
}

/// A fresh run that stopped on bad input before recording a step leaves nothing behind: its
/// config.toml and, when this launch created `dir` (`created`), its checkpoint directory
/// (`ckpt_dir`, when inside `dir` and empty), the lock file and `dir` itself (only if then
/// empty). Anything else — a stranger's file, a step's metrics, a directory that was there
/// before — stays as it is.
pub fn remove_unstarted(dir: &Path, ckpt_dir: &Path, created: bool) {
    if dir.join("metrics.jsonl").exists() {
        return;
    }
    let _ = std::fs::remove_file(dir.join("config.toml"));
    if created {
        if ckpt_dir.parent() == Some(dir) {
            // remove_dir removes only an empty directory, and never follows a link.
            let _ = std::fs::remove_dir(ckpt_dir);
        }
        let only_lock = std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .all(|e| e.file_name() == LOCK_FILE)
            })
            .unwrap_or(false);
        if only_lock {
            let _ = std::fs::remove_file(dir.join(LOCK_FILE));
            let _ = std::fs::remove_dir(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tensorboard_file_is_a_run_file() {
        let name = format!("tensorboard/{}", lockstep_run::tensorboard::EVENT_FILE);
        assert!(RUN_FILES.contains(&name.as_str()));
    }

    #[test]
    fn an_unstarted_run_is_removed_but_nothing_of_anyone_else() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        let lock = RunDirLock::acquire(&run).unwrap();
        std::fs::write(run.join("config.toml"), "x").unwrap();
        std::fs::create_dir(run.join("checkpoints")).unwrap();
        remove_unstarted(&run, &run.join("checkpoints"), true);
        drop(lock);
        assert!(!run.exists(), "a directory this launch created goes");
        // A directory that existed, with a stranger's file: only the run's own files go.
        let mine = tmp.path().join("mine");
        std::fs::create_dir(&mine).unwrap();
        std::fs::write(mine.join("notes.txt"), "keep").unwrap();
        std::fs::write(mine.join("config.toml"), "x").unwrap();
        remove_unstarted(&mine, &mine.join("checkpoints"), false);
        assert!(mine.join("notes.txt").exists() && !mine.join("config.toml").exists());
        // A run that recorded a step keeps everything.
        std::fs::write(mine.join("config.toml"), "x").unwrap();
        std::fs::write(mine.join("metrics.jsonl"), "{}").unwrap();
        remove_unstarted(&mine, &mine.join("checkpoints"), true);
        assert!(mine.join("config.toml").exists());
    }

    #[test]
    fn a_second_lock_names_the_holder_and_a_released_lock_is_free_again() {
        let tmp = tempfile::tempdir().unwrap();
        let held = RunDirLock::acquire(tmp.path()).unwrap();
        // flock locks belong to the open file description: a second open conflicts even in the
        // same process, as a second launcher's would.
        let e = RunDirLock::acquire(tmp.path()).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, RunDirError::Busy { .. }), "{msg}");
        assert!(
            msg.contains(&format!("pid {}", std::process::id())) && msg.contains("host "),
            "{msg}"
        );
        drop(held);
        assert_eq!(
            std::fs::read(tmp.path().join(LOCK_FILE)).unwrap(),
            b"",
            "a released lock file must be empty"
        );
        RunDirLock::acquire(tmp.path()).unwrap();
    }

    #[test]
    fn a_planted_link_as_lock_file_is_refused_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, tmp.path().join(LOCK_FILE)).unwrap();
        assert!(RunDirLock::acquire(tmp.path()).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }
}
