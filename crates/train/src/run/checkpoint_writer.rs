//! Rank 0's checkpoint writes, in the step or in the background (`checkpoint.async`).
//!
//! Both ways keep the ledger's rule that a checkpoint is published (given its name) only after
//! metrics.jsonl holds every step up to it:
//! - **in the step** (default): [`CheckpointWriter::take`] writes and syncs the file under a
//!   temporary name before the step's record is flushed, so the write counts in the step's
//!   `checkpoint` phase; [`CheckpointWriter::release`] renames it after the flush;
//! - **in the background**: `take` keeps the step's gathered state in memory (after waiting for
//!   the previous write: one at a time) and `release` hands it to a writer thread that writes,
//!   syncs and publishes it while training goes on. Training stalls only for the gather and for
//!   a previous write that has not ended. The thread's outcome (the `Checkpointed` event, a
//!   damaged-checkpoint notice, or an error such as a full disk) is reported on the training
//!   thread at the next [`CheckpointWriter::poll`] or at [`CheckpointWriter::wait`].
//!
//! A process killed in the middle leaves the previous checkpoints as they were and at most a
//! temporary file under a hidden name; the files a resume reads are only ever complete ones.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use crate::checkpoint::{self, Checkpoint, CheckpointView, StagedCheckpoint};
use crate::context::Event;
use crate::error::TrainError;
use crate::faults::{self, Fault};

/// What a finished write reports.
struct Written {
    step: u64,
    path: PathBuf,
    /// An injected `corrupt-checkpoint` fault damaged it after it was written.
    damaged: bool,
}

enum State {
    Idle,
    /// In the step: written under a temporary name, waiting for the record's flush.
    Staged(StagedCheckpoint),
    /// In the background: the gathered state, waiting for the record's flush.
    Snapshot(Checkpoint),
    /// In the background: the thread writing it.
    Writing(JoinHandle<Result<Written, TrainError>>),
}

pub(crate) struct CheckpointWriter {
    dir: PathBuf,
    keep: usize,
    background: bool,
    faults: Vec<Fault>,
    state: State,
}

impl CheckpointWriter {
    pub(crate) fn new(dir: PathBuf, keep: usize, background: bool, faults: &[Fault]) -> Self {
        CheckpointWriter {
            dir,
            keep,
            background,
            faults: faults.to_vec(),
            state: State::Idle,
        }
    }

    /// Before the step's record: take checkpoint `c` (see the module doc): written from where it
    /// lies, or copied for the background writer after the previous write ended (and was
    /// reported).
    pub(crate) fn take(
        &mut self,
        c: CheckpointView<'_>,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<(), TrainError> {
        self.wait(on_event)?;
        self.state = if self.background {
            State::Snapshot(c.into_owned())
        } else {
            State::Staged(stage(&self.dir, &c, &self.faults)?)
        };
        Ok(())
    }

    /// After the step's record is flushed: publish the checkpoint taken, or start writing it in
    /// the background. Nothing to do when none was taken.
    pub(crate) fn release(&mut self, on_event: &mut dyn FnMut(Event)) -> Result<(), TrainError> {
        match std::mem::replace(&mut self.state, State::Idle) {
            State::Staged(staged) => {
                let written = publish(staged, self.keep, &self.faults)?;
                report(written, on_event);
            }
            State::Snapshot(c) => {
                let (dir, keep, faults) = (self.dir.clone(), self.keep, self.faults.clone());
                let handle = std::thread::Builder::new()
                    .name("lockstep-checkpoint".into())
                    .spawn(move || {
                        lower_priority();
                        let staged = stage(&dir, &c.view(), &faults)?;
                        drop(c);
                        publish(staged, keep, &faults)
                    })
                    .map_err(|e| TrainError::Io {
                        path: self.dir.display().to_string(),
                        cause: e,
                    })?;
                self.state = State::Writing(handle);
            }
            other => self.state = other,
        }
        Ok(())
    }

    /// Is a background write still going on? One that ended is reported (and its error
    /// returned) now.
    pub(crate) fn poll(&mut self, on_event: &mut dyn FnMut(Event)) -> Result<bool, TrainError> {
        match &self.state {
            State::Writing(h) if !h.is_finished() => Ok(true),
            _ => self.wait(on_event).map(|()| false),
        }
    }

    /// Wait for a background write to end, and report it.
    pub(crate) fn wait(&mut self, on_event: &mut dyn FnMut(Event)) -> Result<(), TrainError> {
        if let State::Writing(handle) = std::mem::replace(&mut self.state, State::Idle) {
            let written = handle.join().map_err(|_| TrainError::Io {
                path: self.dir.display().to_string(),
                cause: std::io::Error::other("the checkpoint writer thread panicked"),
            })??;
            report(written, on_event);
        }
        Ok(())
    }
}

/// A run that stops on an error still lets a background write end (published, or removed on its
/// own error) rather than leaving a partial temporary file when the process exits.
impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        if let State::Writing(handle) = std::mem::replace(&mut self.state, State::Idle) {
            let _ = handle.join();
        }
    }
}

/// The writer yields to the training threads (nice 19 for this thread only): it takes the
/// cores they leave idle instead of slowing the steps it overlaps, and a write that has not
/// ended by the next checkpoint is waited for there (counted as stall). Best effort.
fn lower_priority() {
    // SAFETY: setpriority on this thread's own id; no memory is passed.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19);
    }
}

/// Write and sync `c` under a temporary name (a `kill-while-checkpointing` fault fires after its
/// first vector).
fn stage(dir: &Path, c: &CheckpointView, faults: &[Fault]) -> Result<StagedCheckpoint, TrainError> {
    let step = c.step;
    let mut first = true;
    let mut between = |_done: f64| {
        if std::mem::take(&mut first) {
            faults::while_checkpointing(faults, step);
        }
    };
    Ok(checkpoint::stage(dir, c, &mut between)?)
}

/// Publish `staged` (then damage it if a `corrupt-checkpoint` fault names its step).
fn publish(staged: StagedCheckpoint, keep: usize, faults: &[Fault]) -> Result<Written, TrainError> {
    let step = staged.step();
    let path = staged.publish(keep)?;
    let damaged = faults::corrupts_checkpoint(faults, step);
    if damaged {
        damage(&path)?;
    }
    Ok(Written {
        step,
        path,
        damaged,
    })
}

fn report(w: Written, on_event: &mut dyn FnMut(Event)) {
    if w.damaged {
        on_event(Event::Notice(format!(
            "injected fault: damaged checkpoint {}",
            w.path.display()
        )));
    }
    on_event(Event::Checkpointed {
        step: w.step,
        path: w.path,
    });
}

/// Flip one byte in the middle of a file (the `corrupt-checkpoint` fault).
fn damage(path: &Path) -> Result<(), TrainError> {
    let io = |source| TrainError::Io {
        path: path.display().to_string(),
        cause: source,
    };
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::unix::fs::OpenOptionsExt;
    // The file this rank just wrote, changed in place (never created, never through a link).
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io)?;
    let mid = f.metadata().map_err(io)?.len() / 2;
    let mut byte = [0u8];
    f.seek(SeekFrom::Start(mid)).map_err(io)?;
    f.read_exact(&mut byte).map_err(io)?;
    f.seek(SeekFrom::Start(mid)).map_err(io)?;
    f.write_all(&[byte[0] ^ 0xff]).map_err(io)
}
