//! Running one stage's schedule for one step: compute through [`StageWork`], messages through the
//! replica's pipeline communicator (group rank = stage), everything timed.
//!
//! Bytes on the wire per micro-batch and boundary: one activation tensor forward, one gradient
//! tensor of the same size backward. Receives block until the neighbour has sent (that wait is
//! the bubble); every call carries the communicator's timeout, so a dead neighbour is named, not
//! waited for forever.

use std::collections::HashMap;
use std::time::Instant;

use lockstep_comm::Communicator;

use super::schedule::Op;
use crate::metrics::PipelineStep;
use crate::trainer::TrainError;

/// The compute side of a stage, as the executor sees it.
pub trait StageWork {
    /// Forward of micro-batch `mb`; `input` is the previous stage's activations (`None` on the
    /// first stage). Returns the activations for the next stage (`None` on the last stage).
    fn forward(&mut self, mb: usize, input: Option<&[f32]>)
        -> Result<Option<Vec<f32>>, TrainError>;
    /// Backward of micro-batch `mb`; `grad_output` comes from the next stage (`None` on the last).
    /// Returns the input gradient for the previous stage (`None` on the first stage).
    fn backward(
        &mut self,
        mb: usize,
        grad_output: Option<&[f32]>,
    ) -> Result<Option<Vec<f32>>, TrainError>;
    /// Elements of one boundary message (activations or their gradient) of micro-batch `mb`.
    fn message_len(&self, mb: usize) -> usize;
    /// Micro-batches whose forward graphs are held now.
    fn held(&self) -> usize;
}

/// Forward and backward compute seconds of one schedule run, plus the pipeline figures.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScheduleTiming {
    pub forward: f64,
    pub backward: f64,
    pub pipeline: PipelineStep,
}

/// Run `ops` for stage `stage` of the replica whose pipeline communicator is `pp` (group rank =
/// stage), then wait for the replica's other stages (a barrier), so that every stage's
/// `schedule_seconds` spans the whole pipeline step and `bubble_seconds` (span − own compute) is
/// its idle time, comparable with (p − 1)/(m + p − 1). The combined operations' time counts as
/// receive time: they end when the neighbour's message has arrived.
pub fn run_schedule(
    ops: &[Op],
    stage: usize,
    work: &mut dyn StageWork,
    pp: &mut Communicator,
) -> Result<ScheduleTiming, TrainError> {
    let start = Instant::now();
    let bytes_before = pp.stats().bytes_sent;
    let mut t = ScheduleTiming::default();
    t.pipeline.stage = stage;
    let (prev, next) = (stage.wrapping_sub(1), stage + 1);
    // Messages received but not yet consumed, and produced but not yet sent.
    let mut act_in: HashMap<usize, Vec<f32>> = HashMap::new();
    let mut grad_in: HashMap<usize, Vec<f32>> = HashMap::new();
    let mut act_out: HashMap<usize, Vec<f32>> = HashMap::new();
    let mut grad_out: HashMap<usize, Vec<f32>> = HashMap::new();
    let take = |map: &mut HashMap<usize, Vec<f32>>, mb: usize, what: &str| {
        map.remove(&mb)
            .unwrap_or_else(|| panic!("schedule bug: {what} of micro-batch {mb} missing"))
    };
    for &op in ops {
        let t0 = Instant::now();
        match op {
            Op::Forward(mb) => {
                let input = act_in.remove(&mb);
                if let Some(out) = work.forward(mb, input.as_deref())? {
                    act_out.insert(mb, out);
                }
                t.forward += t0.elapsed().as_secs_f64();
                t.pipeline.peak_activations = t.pipeline.peak_activations.max(work.held());
            }
            Op::Backward(mb) => {
                let g = grad_in.remove(&mb);
                if let Some(gin) = work.backward(mb, g.as_deref())? {
                    grad_out.insert(mb, gin);
                }
                t.backward += t0.elapsed().as_secs_f64();
            }
            Op::RecvActivation(mb) => {
                let mut buf = vec![0f32; work.message_len(mb)];
                pp.recv(prev, &mut buf)?;
                act_in.insert(mb, buf);
                t.pipeline.recv_seconds += t0.elapsed().as_secs_f64();
            }
            Op::RecvGrad(mb) => {
                let mut buf = vec![0f32; work.message_len(mb)];
                pp.recv(next, &mut buf)?;
                grad_in.insert(mb, buf);
                t.pipeline.recv_seconds += t0.elapsed().as_secs_f64();
            }
            Op::SendActivation(mb) => {
                pp.send(next, &take(&mut act_out, mb, "activation"))?;
                t.pipeline.send_seconds += t0.elapsed().as_secs_f64();
            }
            Op::SendGrad(mb) => {
                pp.send(prev, &take(&mut grad_out, mb, "input gradient"))?;
                t.pipeline.send_seconds += t0.elapsed().as_secs_f64();
            }
            Op::SendActivationRecvGrad { send, recv } => {
                let out = take(&mut act_out, send, "activation");
                let mut buf = vec![0f32; work.message_len(recv)];
                pp.send_recv(next, &out, next, &mut buf)?;
                grad_in.insert(recv, buf);
                t.pipeline.recv_seconds += t0.elapsed().as_secs_f64();
            }
            Op::SendGradRecvActivation { send, recv } => {
                let out = take(&mut grad_out, send, "input gradient");
                let mut buf = vec![0f32; work.message_len(recv)];
                pp.send_recv(prev, &out, prev, &mut buf)?;
                act_in.insert(recv, buf);
                t.pipeline.recv_seconds += t0.elapsed().as_secs_f64();
            }
        }
    }
    // The pipeline's step ends when its last stage finishes: a stage done early is idle until
    // then (the tail of the bubble), so every stage's span is measured to the same end.
    t.pipeline.p2p_bytes = pp.stats().bytes_sent - bytes_before;
    if pp.size() > 1 {
        pp.barrier()?;
    }
    t.pipeline.schedule_seconds = start.elapsed().as_secs_f64();
    t.pipeline.bubble_seconds = (t.pipeline.schedule_seconds - t.forward - t.backward).max(0.0);
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::super::schedule::{ideal_bubble_fraction, schedule, ScheduleKind};
    use super::*;
    use lockstep_comm::inproc::in_process_group;
    use std::sync::Arc;
    use std::time::Duration;

    /// A stage whose compute is a fixed sleep and whose messages carry checkable values:
    /// stage s adds s+1 to every activation, and gradients carry the micro-batch index.
    struct Sleepy {
        stage: usize,
        stages: usize,
        fwd: Duration,
        held: usize,
        seen: Vec<f32>,
    }

    impl StageWork for Sleepy {
        fn forward(
            &mut self,
            mb: usize,
            input: Option<&[f32]>,
        ) -> Result<Option<Vec<f32>>, TrainError> {
            std::thread::sleep(self.fwd);
            self.held += 1;
            let base = input.map(|v| v[0]).unwrap_or(mb as f32 * 100.0);
            let out = base + (self.stage + 1) as f32;
            if self.stage + 1 == self.stages {
                self.seen.push(out);
                return Ok(None);
            }
            Ok(Some(vec![out; 4]))
        }
        fn backward(
            &mut self,
            mb: usize,
            grad_output: Option<&[f32]>,
        ) -> Result<Option<Vec<f32>>, TrainError> {
            std::thread::sleep(self.fwd * 2);
            self.held -= 1;
            if let Some(g) = grad_output {
                assert_eq!(g[0], mb as f32, "gradient of the wrong micro-batch");
            }
            Ok((self.stage > 0).then(|| vec![mb as f32; 4]))
        }
        fn message_len(&self, _mb: usize) -> usize {
            4
        }
        fn held(&self) -> usize {
            self.held
        }
    }

    fn run(
        kind: ScheduleKind,
        stages: usize,
        m: usize,
        fwd_ms: u64,
    ) -> Vec<(ScheduleTiming, Vec<f32>)> {
        let transports = in_process_group(stages);
        std::thread::scope(|sc| {
            let handles: Vec<_> = transports
                .into_iter()
                .enumerate()
                .map(|(s, tr)| {
                    sc.spawn(move || {
                        let mut comm = Communicator::new(Arc::new(tr), Duration::from_secs(20));
                        let mut work = Sleepy {
                            stage: s,
                            stages,
                            fwd: Duration::from_millis(fwd_ms),
                            held: 0,
                            seen: Vec::new(),
                        };
                        let ops = schedule(kind, stages, s, m);
                        let t = run_schedule(&ops, s, &mut work, &mut comm).unwrap();
                        (t, work.seen)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn messages_arrive_in_order_and_the_bubble_matches_theory() {
        let (stages, m) = (2, 4);
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let out = run(kind, stages, m, 40);
            // Every micro-batch passed through both stages: mb·100 + 1 + 2.
            let want: Vec<f32> = (0..m).map(|i| i as f32 * 100.0 + 3.0).collect();
            assert_eq!(out[stages - 1].1, want, "{kind:?}");
            let ideal = ideal_bubble_fraction(stages, m);
            for (s, (t, _)) in out.iter().enumerate() {
                let p = t.pipeline;
                let measured = p.bubble_seconds / p.schedule_seconds;
                assert!(
                    (measured - ideal).abs() <= 0.05,
                    "{kind:?} stage {s}: bubble {measured:.3} vs ideal {ideal:.3}"
                );
                let peak = if kind == ScheduleKind::GPipe {
                    m
                } else {
                    stages - s
                };
                assert_eq!(p.peak_activations, peak, "{kind:?} stage {s}");
                assert_eq!(
                    p.p2p_bytes,
                    (m * 4 * 4) as u64,
                    "one message per micro-batch"
                );
            }
        }
    }
}
