//! When checkpoints are written, where, and resuming from the newest good one.

use std::path::Path;

use lockstep_comm::Communicator;
use lockstep_model::Optimizer;

use crate::checkpoint::{self, Identity};
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

/// Rank 0 loads the newest good checkpoint and broadcasts it; returns the step to continue
/// from (0 when there is none). Only rank 0 reads files, so node 0's disk is enough.
pub(crate) fn resume_from_checkpoint(
    comm: &mut Communicator,
    dir: &Path,
    identity: &Identity,
    params: &mut [f32],
    optimizer: &mut Optimizer,
    on_event: &mut dyn FnMut(Event),
) -> Result<u64, TrainError> {
    // status: 0 = nothing to resume from, 1 = found, 2 = rank 0 failed.
    let mut header = [0i64; 3];
    let mut loaded = Ok(None);
    if comm.rank() == 0 {
        for path in checkpoint::remove_abandoned(dir, identity) {
            on_event(Event::Notice(format!(
                "removed {}, left unfinished by an interrupted checkpoint write",
                path.display()
            )));
        }
        loaded = checkpoint::load_latest(dir, identity).map(|(c, skipped)| {
            for (path, why) in skipped {
                on_event(Event::Notice(format!(
                    "skipping damaged checkpoint {}: {why}",
                    path.display()
                )));
            }
            c
        });
        header = match &loaded {
            Ok(Some(c)) => [1, c.step as i64, c.optimizer_steps as i64],
            Ok(None) => [0, 0, 0],
            Err(_) => [2, 0, 0],
        };
    }
    comm.broadcast(&mut header, 0)?;
    match header[0] {
        0 => return Ok(0),
        2 => {
            return Err(loaded
                .err()
                .map(TrainError::Checkpoint)
                .unwrap_or(TrainError::ResumeFailed))
        }
        _ => {}
    }
    if let Ok(Some(c)) = &loaded {
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
    optimizer.set_steps_taken(header[2] as u64);
    Ok(header[1] as u64)
}
