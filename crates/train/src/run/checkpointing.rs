//! When checkpoints are written, where, and resuming from the newest good one.

use std::path::Path;

use lockstep_comm::Communicator;
use lockstep_model::Optimizer;

use crate::checkpoint::{self, Checkpoint, Identity};
use crate::config::TrainConfig;
use crate::context::Event;
use crate::error::TrainError;
use crate::faults::{self, Fault};

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

/// Rank 0: write checkpoint `c` atomically (keeping the newest `checkpoint.keep`), then damage it
/// if a `corrupt-checkpoint` fault is injected for its step.
pub(crate) fn save_checkpoint(
    cfg: &TrainConfig,
    dir: &Path,
    c: &Checkpoint,
    faults: &[Fault],
    on_event: &mut dyn FnMut(Event),
) -> Result<(), TrainError> {
    let path = checkpoint::save(dir, c, cfg.checkpoint.keep)?;
    if faults::corrupts_checkpoint(faults, c.step) {
        damage(&path)?;
        on_event(Event::Notice(format!(
            "injected fault: damaged checkpoint {}",
            path.display()
        )));
    }
    on_event(Event::Checkpointed { step: c.step, path });
    Ok(())
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
