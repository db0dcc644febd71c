//! `--inject`: deliberate faults for tests and demonstrations.
//!
//! - `kill:rank=R,step=S` — rank R kills itself (SIGKILL) when it reaches step S;
//! - `lose:rank=R,step=S` — as kill, and the slot cannot come back (a dead host): an elastic
//!   job (`--nproc MIN:MAX`) goes on with fewer workers;
//! - `hang:rank=R,step=S` — rank R stops making progress at step S (sleeps forever);
//! - `slow:rank=R,factor=F` — rank R's computation takes F times as long (a straggler);
//! - `corrupt-checkpoint:step=S` — the checkpoint written at step S is damaged after writing;
//! - `kill-while-checkpointing:step=S` — rank 0 kills itself (SIGKILL) part-way through writing
//!   the checkpoint of step S (with `checkpoint.async`, while training goes on);
//! - `slow-checkpoint-write:step=S,seconds=X` — rank 0's write of the checkpoint of step S pauses
//!   X seconds part-way through (a slow disk; with `checkpoint.async` training goes on meanwhile).
//!
//! Kill, lose, hang and the checkpoint faults fire on the first attempt only, so the restarted group runs
//! clean. Several faults are separated by `;`.

use anyhow::{bail, Context, Result};
use lockstep_train::faults::Fault;

/// Longest `slow-checkpoint-write` pause, in seconds.
pub const MAX_WRITE_PAUSE: f64 = 600.0;

/// Largest `slow` factor: a straggler, not a worker that never finishes a step (and a sleep that
/// a `Duration` can hold).
pub const MAX_SLOWDOWN: f64 = 1000.0;

pub fn parse(spec: &str) -> Result<Vec<Fault>> {
    spec.split(';')
        .filter(|s| !s.trim().is_empty())
        .map(parse_one)
        .collect()
}

fn parse_one(spec: &str) -> Result<Fault> {
    let (kind, args) = spec.trim().split_once(':').unwrap_or((spec.trim(), ""));
    let mut rank = None;
    let mut step = None;
    let mut factor = None;
    let mut seconds = None;
    for kv in args.split(',').filter(|s| !s.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--inject {spec}: `{kv}` is not key=value"))?;
        match k.trim() {
            "rank" => {
                rank = Some(
                    v.trim()
                        .parse::<usize>()
                        .with_context(|| format!("--inject {spec}: rank `{v}`"))?,
                )
            }
            "step" => {
                step = Some(
                    v.trim()
                        .parse::<u64>()
                        .with_context(|| format!("--inject {spec}: step `{v}`"))?,
                )
            }
            "factor" => {
                let f: f64 = v
                    .trim()
                    .parse()
                    .with_context(|| format!("--inject {spec}: factor `{v}`"))?;
                if !(f.is_finite() && (1.0..=MAX_SLOWDOWN).contains(&f)) {
                    bail!("--inject {spec}: factor must be a number from 1 to {MAX_SLOWDOWN}");
                }
                factor = Some(f);
            }
            "seconds" => {
                let s: f64 = v
                    .trim()
                    .parse()
                    .with_context(|| format!("--inject {spec}: seconds `{v}`"))?;
                if !(s.is_finite() && s > 0.0 && s <= MAX_WRITE_PAUSE) {
                    bail!(
                        "--inject {spec}: seconds must be a number above 0 and at most \
                         {MAX_WRITE_PAUSE}"
                    );
                }
                seconds = Some(s);
            }
            other => bail!("--inject {spec}: unknown key `{other}` (rank, step, factor, seconds)"),
        }
    }
    let need =
        |what: &str, v: Option<u64>| v.with_context(|| format!("--inject {spec}: needs {what}="));
    Ok(match kind {
        "kill" => Fault::Kill {
            rank: rank.context("--inject kill needs rank=")?,
            step: need("step", step)?,
        },
        "lose" => Fault::Lose {
            rank: rank.context("--inject lose needs rank=")?,
            step: need("step", step)?,
        },
        "hang" => Fault::Hang {
            rank: rank.context("--inject hang needs rank=")?,
            step: need("step", step)?,
        },
        "slow" => Fault::Slow {
            rank: rank.context("--inject slow needs rank=")?,
            factor: factor.context("--inject slow needs factor=")?,
        },
        "corrupt-checkpoint" => Fault::CorruptCheckpoint {
            step: need("step", step)?,
        },
        "kill-while-checkpointing" => Fault::KillWhileCheckpointing {
            step: need("step", step)?,
        },
        "slow-checkpoint-write" => Fault::SlowCheckpointWrite {
            step: need("step", step)?,
            seconds: seconds.context("--inject slow-checkpoint-write needs seconds=")?,
        },
        other => bail!(
            "--inject: unknown fault `{other}` (kill, lose, hang, slow, corrupt-checkpoint, \
             kill-while-checkpointing, slow-checkpoint-write)"
        ),
    })
}

/// Refuse faults that could never fire in this job: a rank outside the world, a step after the
/// last one, a corrupted checkpoint that is never written. (Silently ignoring them would make a
/// recovery test pass without any failure.) `steps` is 0 when the length is given in epochs and
/// only known to the workers.
pub fn validate(faults: &[Fault], world: usize, steps: u64, checkpoint_every: u64) -> Result<()> {
    for f in faults {
        let (rank, step) = match *f {
            Fault::Kill { rank, step }
            | Fault::Lose { rank, step }
            | Fault::Hang { rank, step } => (Some(rank), Some(step)),
            Fault::Slow { rank, .. } => (Some(rank), None),
            Fault::CorruptCheckpoint { step }
            | Fault::KillWhileCheckpointing { step }
            | Fault::SlowCheckpointWrite { step, .. } => {
                if checkpoint_every == 0 || step == 0 || step % checkpoint_every != 0 {
                    bail!(
                        "--inject {f}: no checkpoint is written at step {step} \
                         (checkpoint.every = {checkpoint_every})"
                    );
                }
                (None, Some(step))
            }
        };
        if let Some(rank) = rank.filter(|&r| r >= world) {
            bail!("--inject {f}: rank {rank} does not exist in a world of {world} workers");
        }
        if let Some(step) = step.filter(|&s| steps > 0 && s >= steps) {
            bail!("--inject {f}: step {step} is never reached (the run has steps 0..{steps})");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_kind_and_rejects_nonsense() {
        let f = parse("kill:rank=1,step=30; slow:rank=2,factor=3;corrupt-checkpoint:step=20;hang:rank=0,step=5").unwrap();
        assert_eq!(
            f,
            vec![
                Fault::Kill { rank: 1, step: 30 },
                Fault::Slow {
                    rank: 2,
                    factor: 3.0
                },
                Fault::CorruptCheckpoint { step: 20 },
                Fault::Hang { rank: 0, step: 5 }
            ]
        );
        for bad in [
            "explode:rank=1",
            "kill:rank=1",
            "kill:step=3",
            "slow:rank=1,factor=0.5",
            "kill:rank=x,step=1",
            "kill:rank=1,step=2,color=red",
            "slow-checkpoint-write:step=20",
            "slow-checkpoint-write:step=20,seconds=0",
            "slow-checkpoint-write:step=20,seconds=601",
            "slow-checkpoint-write:step=20,seconds=NaN",
        ] {
            assert!(parse(bad).is_err(), "{bad} should be refused");
        }
        // Each fault prints as the spec it was parsed from (errors quote it so).
        let spec = "kill:rank=1,step=30;slow:rank=2,factor=3;corrupt-checkpoint:step=20;hang:rank=0,step=5;lose:rank=3,step=4;kill-while-checkpointing:step=40;slow-checkpoint-write:step=20,seconds=1.5";
        let printed: Vec<String> = parse(spec).unwrap().iter().map(|f| f.to_string()).collect();
        assert_eq!(printed.join(";"), spec);
    }

    #[test]
    fn faults_that_could_never_fire_are_refused() {
        let ok =
            parse("kill:rank=1,step=30;slow:rank=0,factor=2;corrupt-checkpoint:step=20").unwrap();
        validate(&ok, 2, 100, 10).unwrap();
        for (spec, world, steps, every, want) in [
            (
                "kill:rank=9,step=3",
                2,
                100,
                10,
                "rank 9 does not exist in a world of 2",
            ),
            ("slow:rank=2,factor=2", 2, 100, 10, "rank 2 does not exist"),
            (
                "hang:rank=0,step=100",
                2,
                100,
                10,
                "step 100 is never reached",
            ),
            (
                "corrupt-checkpoint:step=15",
                2,
                100,
                10,
                "no checkpoint is written at step 15",
            ),
            (
                "corrupt-checkpoint:step=10",
                2,
                100,
                0,
                "checkpoint.every = 0",
            ),
            (
                "kill-while-checkpointing:step=25",
                2,
                100,
                10,
                "kill-while-checkpointing:step=25: no checkpoint is written at step 25",
            ),
            (
                "slow-checkpoint-write:step=25,seconds=1",
                2,
                100,
                10,
                "slow-checkpoint-write:step=25,seconds=1: no checkpoint is written at step 25",
            ),
        ] {
            let e = validate(&parse(spec).unwrap(), world, steps, every)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
    }
}
