//! When checkpoints are written, where, and resuming from the newest good one.

use std::path::{Path, PathBuf};

use lockstep_comm::Communicator;
use lockstep_model::Optimizer;

use crate::checkpoint::sharded::{self, Manifest};
use crate::checkpoint::{self, Checkpoint, Identity, Latest};
use crate::config::TrainConfig;
use crate::context::Event;
use crate::error::TrainError;

/// Is a checkpoint written after `step` (counting from 0)? Every `checkpoint.every` steps, and
/// after the last step, so that a finished run can be extended from where it ended.
pub(crate) fn checkpoint_due(cfg: &TrainConfig, step: u64, total_steps: u64) -> bool {
    let every = cfg.checkpoint.every;
    every > 0 && ((step + 1).is_multiple_of(every) || step + 1 == total_steps)
}

/// Where checkpoints live: `checkpoint.dir`, or `<run dir>/checkpoints`.
pub fn checkpoint_dir(cfg: &TrainConfig, out_dir: &Path) -> std::path::PathBuf {
    if cfg.checkpoint.dir.is_empty() {
        out_dir.join("checkpoints")
    } else {
        std::path::PathBuf::from(&cfg.checkpoint.dir)
    }
}

/// The newest good checkpoint, as every rank learns of it from [`find_checkpoint`].
pub(crate) enum Found {
    /// A whole-model file, held by rank 0 (`None` elsewhere) until [`broadcast_whole`].
    Whole(Option<Checkpoint>),
    /// A sharded set (verified by rank 0), from which every rank reads its own values.
    Set { path: PathBuf, manifest: Manifest },
}

/// Collective: rank 0 finds the newest good checkpoint in `dir` — a whole-model file or a
/// sharded set, damaged ones skipped with a notice naming the file or shard — and every rank
/// learns which: `(step, optimizer steps, what)`, or `None` when there is none. Only rank 0
/// verifies checksums; with a set, every rank then reads its part of it.
pub(crate) fn find_checkpoint(
    comm: &mut Communicator,
    dir: &Path,
    identity: &Identity,
    on_event: &mut dyn FnMut(Event),
) -> Result<Option<(u64, u64, Found)>, TrainError> {
    // status: 0 = nothing to resume from, 1 = a file, 2 = rank 0 failed, 3 = a set.
    let mut header = [0i64; 3];
    let mut found = Ok(None);
    if comm.rank() == 0 {
        for path in checkpoint::remove_abandoned(dir, identity) {
            on_event(Event::Notice(format!(
                "removed {}, left unfinished by an interrupted checkpoint write",
                path.display()
            )));
        }
        found = checkpoint::load_latest(dir, identity).map(|(latest, skipped)| {
            for (path, why) in skipped {
                on_event(Event::Notice(format!(
                    "skipping damaged checkpoint {}: {why}",
                    path.display()
                )));
            }
            latest.map(|l| {
                let (step, steps) = (l.step(), l.optimizer_steps());
                let found = match l {
                    Latest::File(c) => Found::Whole(Some(c)),
                    Latest::Set { path, manifest } => Found::Set { path, manifest },
                };
                (step, steps, found)
            })
        });
        header = match &found {
            Ok(Some((step, steps, Found::Whole(_)))) => [1, *step as i64, *steps as i64],
            Ok(Some((step, steps, Found::Set { .. }))) => [3, *step as i64, *steps as i64],
            Ok(None) => [0, 0, 0],
            Err(_) => [2, 0, 0],
        };
    }
    comm.broadcast(&mut header, 0)?;
    let (step, steps) = (header[1] as u64, header[2] as u64);
    match header[0] {
        0 => Ok(None),
        2 => Err(found
            .err()
            .map(TrainError::Checkpoint)
            .unwrap_or(TrainError::ResumeFailed)),
        _ if comm.rank() == 0 => found.map_err(TrainError::Checkpoint),
        1 => Ok(Some((step, steps, Found::Whole(None)))),
        _ => {
            let path = dir.join(sharded::set_name(step));
            let manifest = sharded::read_manifest(&path)?;
            Ok(Some((step, steps, Found::Set { path, manifest })))
        }
    }
}

/// Collective, after [`find_checkpoint`] found a whole-model file: rank 0 checks its sizes and
/// broadcasts it into every rank's whole-model `params` and `optimizer`.
pub(crate) fn broadcast_whole(
    comm: &mut Communicator,
    c: Option<&Checkpoint>,
    dir: &Path,
    optimizer_steps: u64,
    params: &mut [f32],
    optimizer: &mut Optimizer,
) -> Result<(), TrainError> {
    if let Some(c) = c {
        // Every state vector, not just their number: copy_from_slice panics on a length mismatch.
        let state: Vec<usize> = optimizer.state().iter().map(|v| v.len()).collect();
        c.check_sizes(dir, params.len(), &state)?;
        params.copy_from_slice(&c.params);
        for (dst, src) in optimizer.state_mut().into_iter().zip(&c.optimizer_state) {
            dst.copy_from_slice(src);
        }
    }
    comm.broadcast(params, 0)?;
    for v in optimizer.state_mut() {
        comm.broadcast(v, 0)?;
    }
    optimizer.set_steps_taken(optimizer_steps);
    Ok(())
}
