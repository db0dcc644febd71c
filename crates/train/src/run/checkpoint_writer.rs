//! Rank 0's checkpoint writes, in the step or in the background (`checkpoint.async`).
//!
//! Both ways keep the ledger's rule that a checkpoint is published (given its name) only after
//! metrics.jsonl holds every step up to it:
//! - **in the step** (default): [`CheckpointWriter::take`] writes and syncs the file under a
//!   temporary name before the step's record is flushed, so the write counts in the step's
//!   `checkpoint` phase; [`CheckpointWriter::release`] renames it after the flush;
//! - **in the background**: `take` keeps the step's gathered state in memory (after waiting for
//!   the previous write: one at a time) — or [`CheckpointWriter::take_held`] the training loop's
//!   own vectors, shared rather than copied, where they are the whole model — and `release`
//!   hands it to a writer thread that writes, syncs and publishes it while training goes on.
//!   Training stalls only for the gather and for a previous write that has not ended. The
//!   thread's outcome (the `Checkpointed` event, a damaged-checkpoint notice, or an error such as
//!   a full disk) is reported on the training thread at the next [`CheckpointWriter::poll`] or
//!   at [`CheckpointWriter::wait`].
//!
//! Sharded sets (`checkpoint.sharded`) are collective: [`write_set`] in the step, or with
//! `checkpoint.async` [`start_set`] (each rank's shard written by a thread of its own, from the
//! training loop's own vectors, shared rather than copied; the loop's next update waits for the
//! write on its [`WriteFence`], so a set costs no memory) and, at the next step, [`settle_set`]
//! (every rank's outcome learnt, the set published by rank 0), so training stalls only for a
//! write slower than a step's forward and backward.
//!
//! A process killed in the middle leaves the previous checkpoints as they were and at most a
//! temporary file under a hidden name; the files a resume reads are only ever complete ones.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use lockstep_comm::Communicator;
use serde::{Deserialize, Serialize};

use super::collect::gather_strings;
use crate::checkpoint::sharded::{self, Manifest, ShardInfo, ShardView, SharedShard, StagedSet};
use crate::checkpoint::{
    self, Checkpoint, CheckpointError, CheckpointView, Identity, SharedVectors, StagedCheckpoint,
};
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
    /// In the step, sharded: every rank's shard and the manifest in the staging directory,
    /// waiting for the record's flush.
    StagedSet(StagedSet),
    /// In the background: the state, waiting for the record's flush.
    Snapshot(Held),
    /// In the background: the thread writing it.
    Writing(JoinHandle<Result<Written, TrainError>>),
}

/// A checkpoint's state held for a write.
pub(crate) enum Held {
    /// Gathered for it, or copied from buffers that do not outlive the step.
    Owned(Checkpoint),
    /// The training loop's own vectors (see [`SharedVectors`]).
    Shared {
        step: u64,
        vectors: SharedVectors,
        optimizer_steps: u64,
        identity: Identity,
    },
}

impl Held {
    fn view(&self) -> CheckpointView<'_> {
        match self {
            Held::Owned(c) => c.view(),
            Held::Shared {
                step,
                vectors,
                optimizer_steps,
                identity,
            } => CheckpointView {
                step: *step,
                params: Cow::Borrowed(&vectors.params[..]),
                optimizer_state: vectors.state().into_iter().map(Cow::Borrowed).collect(),
                optimizer_steps: *optimizer_steps,
                identity,
            },
        }
    }
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
            State::Snapshot(Held::Owned(c.into_owned()))
        } else {
            State::Staged(stage(&self.dir, &c, &self.faults)?)
        };
        Ok(())
    }

    /// [`CheckpointWriter::take`] of a state that may be kept as it is for the background
    /// writer (no copy).
    pub(crate) fn take_held(
        &mut self,
        held: Held,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<(), TrainError> {
        if !self.background {
            return self.take(held.view(), on_event);
        }
        self.wait(on_event)?;
        self.state = State::Snapshot(held);
        Ok(())
    }

    /// Rank 0, before the step's record: a sharded set staged by [`write_set`], published by
    /// [`CheckpointWriter::release`].
    pub(crate) fn take_set(&mut self, staged: StagedSet) {
        self.state = State::StagedSet(staged);
    }

    /// After the step's record is flushed: publish the checkpoint taken, or start writing it in
    /// the background. Nothing to do when none was taken.
    pub(crate) fn release(&mut self, on_event: &mut dyn FnMut(Event)) -> Result<(), TrainError> {
        match std::mem::replace(&mut self.state, State::Idle) {
            State::Staged(staged) => {
                let written = publish(staged, self.keep, &self.faults)?;
                report(written, on_event);
            }
            State::StagedSet(staged) => {
                let step = staged.step();
                let path = staged.publish(self.keep)?;
                let damaged = faults::corrupts_checkpoint(&self.faults, step);
                if damaged {
                    // The first shard stands for the set: one damaged shard spoils it whole.
                    damage(&path.join(sharded::shard_name(0)))?;
                }
                report(
                    Written {
                        step,
                        path,
                        damaged,
                    },
                    on_event,
                );
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

/// What a rank's shard write came to, as every rank learns it.
#[derive(Serialize, Deserialize)]
pub(crate) enum ShardOutcome {
    Written(ShardInfo),
    Failed {
        path: String,
        what: String,
        no_space: bool,
        /// The rank did not see the staging directory rank 0 made: the ranks do not share
        /// `checkpoint.dir`.
        unshared: bool,
    },
}

/// What a set's manifest needs besides the shards: the optimizer steps, the model's parameters
/// and the vectors per shard.
#[derive(Clone, Copy)]
pub(crate) struct SetCounts {
    pub(crate) optimizer_steps: u64,
    pub(crate) num_params: usize,
    pub(crate) vectors: usize,
}

/// The checkpoint `set` (after `step` steps; `view`: this rank's shard) as a sharded set,
/// collective over the world: rank 0 prepares the staging directory, every rank writes and
/// syncs its shard, all learn every outcome (so all stop alike on one rank's error, which names
/// that rank), and rank 0 writes the manifest and returns the staged set (`None` elsewhere).
pub(crate) fn write_set(
    comm: &mut Communicator,
    dir: &Path,
    step: u64,
    identity: &Identity,
    view: &ShardView,
    counts: SetCounts,
    faults: &[Fault],
) -> Result<Option<StagedSet>, TrainError> {
    prepare_set(comm, dir, step, identity)?;
    let outcome = shard_outcome(dir, step, identity, comm.rank(), view, faults);
    settle(comm, dir, step, identity, outcome, counts)
}

/// Opened by a background shard write once it no longer holds the training loop's vectors (it
/// ended, failed or panicked): the loop waits on it before it updates them, so that the update
/// writes in place rather than copying vectors the write still reads.
#[derive(Clone)]
pub(crate) struct WriteFence(Arc<(Mutex<bool>, Condvar)>);

impl WriteFence {
    fn new() -> Self {
        WriteFence(Arc::new((Mutex::new(false), Condvar::new())))
    }

    fn open(&self) {
        let (done, opened) = &*self.0;
        *done.lock().unwrap_or_else(|e| e.into_inner()) = true;
        opened.notify_all();
    }

    /// Wait for the write to let go of the vectors. No deadline: it is this process's own write
    /// to its own disk, which the next step's settle waits for anyway.
    pub(crate) fn wait(&self) {
        let (done, opened) = &*self.0;
        let mut done = done.lock().unwrap_or_else(|e| e.into_inner());
        while !*done {
            done = opened.wait(done).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Opens its fence when dropped: after the vectors it is declared before, also on unwinding.
struct OpenOnDrop(WriteFence);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// This rank's shard of a sharded set written on a thread of its own (`checkpoint.async`),
/// from the training loop's vectors (shared, not copied), while training goes on;
/// [`settle_set`] ends it, on every rank at the same step.
pub(crate) struct PendingSet {
    step: u64,
    counts: SetCounts,
    writer: Option<JoinHandle<ShardOutcome>>,
    /// Opened when the writer no longer holds the vectors.
    fence: WriteFence,
    /// Rank 0's: where the staging directory is, to remove it when the run stops before the set
    /// is settled (`None` on other ranks).
    staging: Option<(PathBuf, Identity)>,
}

/// [`write_set`]'s first half in the background: the staging directory prepared (collective),
/// this rank's shard written by a low-priority thread that holds `shard`'s vectors until it
/// ends.
pub(crate) fn start_set(
    comm: &mut Communicator,
    dir: &Path,
    step: u64,
    identity: &Identity,
    shard: SharedShard,
    counts: SetCounts,
    faults: &[Fault],
) -> Result<PendingSet, TrainError> {
    prepare_set(comm, dir, step, identity)?;
    let rank = comm.rank();
    let staging = (rank == 0).then(|| (dir.to_path_buf(), identity.clone()));
    let (identity, faults) = (identity.clone(), faults.to_vec());
    let at = dir.to_path_buf();
    let fence = WriteFence::new();
    let release = OpenOnDrop(fence.clone());
    let writer = std::thread::Builder::new()
        .name("lockstep-shard".into())
        .spawn(move || {
            // Dropped in reverse order: the vectors, then the fence opens.
            let _release = release;
            let shard = shard;
            lower_priority();
            shard_outcome(&at, step, &identity, rank, &shard.view(), &faults)
        })
        .map_err(|e| TrainError::Io {
            path: dir.display().to_string(),
            cause: e,
        })?;
    Ok(PendingSet {
        step,
        counts,
        writer: Some(writer),
        fence,
        staging,
    })
}

impl PendingSet {
    /// What the training loop waits on before it updates the vectors the write holds.
    pub(crate) fn fence(&self) -> WriteFence {
        self.fence.clone()
    }
}

/// [`write_set`]'s second half for a [`PendingSet`]: this rank's write waited for, every
/// rank's outcome learnt, the manifest staged on rank 0 (`None` elsewhere).
pub(crate) fn settle_set(
    comm: &mut Communicator,
    dir: &Path,
    identity: &Identity,
    mut pending: PendingSet,
) -> Result<Option<StagedSet>, TrainError> {
    let writer = pending.writer.take().expect("a pending set has its writer");
    let outcome = writer.join().unwrap_or_else(|_| ShardOutcome::Failed {
        path: dir.display().to_string(),
        what: "the shard writer thread panicked".into(),
        no_space: false,
        unshared: false,
    });
    settle(comm, dir, pending.step, identity, outcome, pending.counts)
}

/// A run that stops on an error before the set is settled lets its shard write end, as
/// [`CheckpointWriter`] does, and rank 0 removes the staging directory: nothing unfinished is
/// left behind (a kill leaves it to the resumed run, which removes it).
impl Drop for PendingSet {
    fn drop(&mut self) {
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
            if let Some((dir, identity)) = &self.staging {
                sharded::abandon(dir, self.step, identity);
            }
        }
    }
}

/// Collective: rank 0 makes the staging directory of the set after `step`, and every rank
/// learns whether it could.
fn prepare_set(
    comm: &mut Communicator,
    dir: &Path,
    step: u64,
    identity: &Identity,
) -> Result<(), TrainError> {
    let rank = comm.rank();
    let mut prepared = [1i64];
    let mut prepare_error = None;
    if rank == 0 {
        if let Err(e) = sharded::prepare(dir, step, identity) {
            prepared[0] = 0;
            prepare_error = Some(e);
        }
    }
    comm.broadcast(&mut prepared, 0)?;
    if prepared[0] == 0 {
        if rank == 0 {
            sharded::abandon(dir, step, identity);
        }
        return Err(TrainError::Checkpoint(prepare_error.unwrap_or_else(|| {
            CheckpointError::Io {
                path: dir.display().to_string(),
                what: format!("rank 0 could not prepare the sharded checkpoint of step {step}"),
            }
        })));
    }
    Ok(())
}

/// This rank writes and syncs its shard of the set after `step` (rank 0 meets an injected
/// `kill-while-checkpointing` fault after its first vector).
fn shard_outcome(
    dir: &Path,
    step: u64,
    identity: &Identity,
    rank: usize,
    view: &ShardView,
    faults: &[Fault],
) -> ShardOutcome {
    let mut first = true;
    let mut between = || {
        if rank == 0 && std::mem::take(&mut first) {
            faults::while_checkpointing(faults, step);
        }
    };
    match sharded::write_shard(dir, step, identity, rank, view, &mut between) {
        Ok(info) => ShardOutcome::Written(info),
        Err(e) => {
            let (path, what) = error_parts(&e);
            ShardOutcome::Failed {
                no_space: matches!(e, CheckpointError::NoSpace { .. }),
                unshared: !sharded::staging_dir(dir, step, identity).is_dir(),
                path,
                what,
            }
        }
    }
}

/// Collective: every rank's `outcome` learnt (one rank's failure stops all, naming it), and on
/// rank 0 the manifest staged.
fn settle(
    comm: &mut Communicator,
    dir: &Path,
    step: u64,
    identity: &Identity,
    outcome: ShardOutcome,
    counts: SetCounts,
) -> Result<Option<StagedSet>, TrainError> {
    let rank = comm.rank();
    let json = serde_json::to_string(&outcome).expect("outcome serialises");
    let mut shards = Vec::new();
    for (r, text) in gather_strings(comm, &json)?.into_iter().enumerate() {
        match serde_json::from_str(&text) {
            Ok(ShardOutcome::Written(info)) => shards.push(info),
            Ok(ShardOutcome::Failed {
                path,
                what,
                no_space,
                unshared,
            }) => {
                if rank == 0 {
                    sharded::abandon(dir, step, identity);
                }
                let what = format!(
                    "rank {r} could not write its shard: {what}{}",
                    if unshared {
                        " (checkpoint.sharded = true needs checkpoint.dir on a file system \
                         every rank sees)"
                    } else {
                        ""
                    }
                );
                return Err(TrainError::Checkpoint(if no_space {
                    CheckpointError::NoSpace { path, what }
                } else {
                    CheckpointError::Io { path, what }
                }));
            }
            Err(e) => panic!("rank {r}'s shard outcome does not parse: {e}"),
        }
    }
    if rank != 0 {
        return Ok(None);
    }
    let manifest = Manifest {
        format: sharded::FORMAT.into(),
        version: sharded::VERSION,
        identity: identity.clone(),
        step,
        optimizer_steps: counts.optimizer_steps,
        num_params: counts.num_params as u64,
        vectors: counts.vectors as u32,
        shards,
    };
    Ok(Some(sharded::stage_manifest(dir, &manifest)?))
}

/// The path an error names, and what it says of it.
fn error_parts(e: &CheckpointError) -> (String, String) {
    match e {
        CheckpointError::Io { path, what }
        | CheckpointError::Corrupt { path, what }
        | CheckpointError::Mismatch { path, what }
        | CheckpointError::NoSpace { path, what }
        | CheckpointError::NotRegular { path, what } => (path.clone(), what.clone()),
        CheckpointError::BadMagic { path } | CheckpointError::Version { path, .. } => {
            (path.clone(), e.to_string())
        }
    }
}
