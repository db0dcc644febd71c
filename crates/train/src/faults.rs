//! Injected faults (see `lockstep train --inject`): deliberate failures that let tests and
//! demonstrations exercise recovery. The CLI parses them; the trainer fires them.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Fault {
    /// `rank` SIGKILLs itself when it reaches `step`.
    Kill { rank: usize, step: u64 },
    /// Like `Kill`, and the worker's slot cannot come back (a dead host): an elastic job shrinks.
    Lose { rank: usize, step: u64 },
    /// `rank` stops making progress at `step`.
    Hang { rank: usize, step: u64 },
    /// `rank` computes `factor` times slower (a straggler).
    Slow { rank: usize, factor: f64 },
    /// The checkpoint written at `step` is damaged after it was written.
    CorruptCheckpoint { step: u64 },
    /// Rank 0's process SIGKILLs itself while it writes the checkpoint of `step`: after the
    /// parameters are written, before the file is complete or published (with
    /// `checkpoint.async`, from the background writer while training goes on).
    KillWhileCheckpointing { step: u64 },
    /// Rank 0's write of the checkpoint of `step` pauses for `seconds` after the parameters, as
    /// a slow disk would (with `checkpoint.async` training goes on meanwhile, so its updates
    /// must leave the values being written alone).
    SlowCheckpointWrite { step: u64, seconds: f64 },
}

/// The fault as `--inject` spells it (`kill:rank=1,step=30`).
impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Fault::Kill { rank, step } => write!(f, "kill:rank={rank},step={step}"),
            Fault::Lose { rank, step } => write!(f, "lose:rank={rank},step={step}"),
            Fault::Hang { rank, step } => write!(f, "hang:rank={rank},step={step}"),
            Fault::Slow { rank, factor } => write!(f, "slow:rank={rank},factor={factor}"),
            Fault::CorruptCheckpoint { step } => write!(f, "corrupt-checkpoint:step={step}"),
            Fault::KillWhileCheckpointing { step } => {
                write!(f, "kill-while-checkpointing:step={step}")
            }
            Fault::SlowCheckpointWrite { step, seconds } => {
                write!(f, "slow-checkpoint-write:step={step},seconds={seconds}")
            }
        }
    }
}

/// Faults that fire only on the first attempt, so a restarted group runs clean.
pub fn first_attempt_only(f: &Fault) -> bool {
    !matches!(f, Fault::Slow { .. })
}

/// Fire kill/lose/hang faults due for `rank` at `step`.
pub fn at_step(faults: &[Fault], rank: usize, step: u64) {
    for f in faults {
        match *f {
            Fault::Kill { rank: r, step: s } | Fault::Lose { rank: r, step: s }
                if r == rank && s == step =>
            {
                say(&format!(
                    "injected fault: rank {rank} kills itself at step {step}\n"
                ));
                // SAFETY: raising a signal on our own process.
                unsafe { libc::raise(libc::SIGKILL) };
            }
            Fault::Hang { rank: r, step: s } if r == rank && s == step => {
                say(&format!(
                    "injected fault: rank {rank} hangs at step {step}\n"
                ));
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                }
            }
            _ => {}
        }
    }
}

/// One write for the whole line: `eprintln!` may write its pieces separately, and under an
/// engine that merges the ranks' output (mpirun) another rank's line could land in the middle,
/// so that the line tests and people look for is never there whole.
fn say(line: &str) {
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
}

/// SIGKILL this process now if a `kill-while-checkpointing` fault names `step`, or pause for a
/// `slow-checkpoint-write` one (called by the checkpoint writer, part-way through the file).
pub fn while_checkpointing(faults: &[Fault], step: u64) {
    for f in faults {
        if let Fault::SlowCheckpointWrite { step: s, seconds } = *f {
            if s == step {
                say(&format!(
                    "injected fault: rank 0 writes the checkpoint of step {step} {seconds} s \
                     slower\n"
                ));
                std::thread::sleep(std::time::Duration::from_secs_f64(seconds));
            }
        }
    }
    if faults.contains(&Fault::KillWhileCheckpointing { step }) {
        say(&format!(
            "injected fault: rank 0 kills itself while writing the checkpoint of step {step}\n"
        ));
        // SAFETY: raising a signal on our own process.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}

/// Slow-down factor for `rank` (1.0 when none).
pub fn slowdown(faults: &[Fault], rank: usize) -> f64 {
    faults
        .iter()
        .filter_map(|f| match *f {
            Fault::Slow { rank: r, factor } if r == rank => Some(factor),
            _ => None,
        })
        .fold(1.0, f64::max)
}

/// Should the checkpoint of `step` be damaged?
pub fn corrupts_checkpoint(faults: &[Fault], step: u64) -> bool {
    faults
        .iter()
        .any(|f| matches!(*f, Fault::CorruptCheckpoint { step: s } if s == step))
}
