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
use crate::error::TrainError;
use crate::metrics::PipelineStep;

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
    /// Elements of micro-batch `mb`'s activations received from the previous stage (and of the
    /// input gradient sent back).
    fn input_len(&self, mb: usize) -> usize;
    /// Elements of micro-batch `mb`'s activations sent to the next stage (and of the gradient
    /// received back).
    fn output_len(&self, mb: usize) -> usize;
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
        lockstep_comm::activity::touch();
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
                let mut buf = vec![0f32; work.input_len(mb)];
                pp.recv(prev, &mut buf)?;
                act_in.insert(mb, buf);
                t.pipeline.recv_seconds += t0.elapsed().as_secs_f64();
            }
            Op::RecvGrad(mb) => {
                let mut buf = vec![0f32; work.output_len(mb)];
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
                let mut buf = vec![0f32; work.output_len(recv)];
                pp.send_recv(next, &out, next, &mut buf)?;
                grad_in.insert(recv, buf);
                t.pipeline.recv_seconds += t0.elapsed().as_secs_f64();
            }
            Op::SendGradRecvActivation { send, recv } => {
                let out = take(&mut grad_out, send, "input gradient");
                let mut buf = vec![0f32; work.input_len(recv)];
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
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// Forward costs 1 unit of logical time, backward 2 (as a real backward costs about twice a
    /// forward).
    const FWD: u64 = 1;
    const BWD: u64 = 2;

    /// What the stages did, in the order it happened across all threads.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Event {
        /// Stage s finished its last compute operation.
        ComputeDone(usize),
        /// Stage s's `run_schedule` returned.
        Returned(usize),
    }

    /// A stage on a logical clock instead of the wall clock: an operation starts when the stage
    /// is free and its input has been produced (messages carry the time they were produced in
    /// element 1), and takes FWD or BWD units. So the stage's final clock is the step's makespan
    /// as the executor ran it (each stage's operations in the executor's order, messages through
    /// the real communicator), with free communication: deterministic, whatever the machine's
    /// load. Messages also carry checkable values: stage s adds s+1 to every activation, and
    /// gradients carry the micro-batch index.
    struct Clocked {
        stage: usize,
        stages: usize,
        m: usize,
        clock: u64,
        busy: u64,
        computed: usize,
        held: usize,
        seen: Vec<f32>,
        events: Arc<Mutex<Vec<Event>>>,
    }

    impl Clocked {
        /// Run one operation of `cost` that may start once `input` (if any) was produced.
        fn tick(&mut self, input: Option<&[f32]>, cost: u64) -> u64 {
            let ready = input.map_or(0, |v| v[1] as u64);
            self.clock = self.clock.max(ready) + cost;
            self.busy += cost;
            self.computed += 1;
            if self.computed == 2 * self.m {
                self.events
                    .lock()
                    .unwrap()
                    .push(Event::ComputeDone(self.stage));
            }
            self.clock
        }
    }

    impl StageWork for Clocked {
        fn forward(
            &mut self,
            mb: usize,
            input: Option<&[f32]>,
        ) -> Result<Option<Vec<f32>>, TrainError> {
            let done = self.tick(input, FWD);
            self.held += 1;
            let base = input.map(|v| v[0]).unwrap_or(mb as f32 * 100.0);
            let out = base + (self.stage + 1) as f32;
            if self.stage + 1 == self.stages {
                self.seen.push(out);
                return Ok(None);
            }
            Ok(Some(vec![out, done as f32, 0.0, 0.0]))
        }
        fn backward(
            &mut self,
            mb: usize,
            grad_output: Option<&[f32]>,
        ) -> Result<Option<Vec<f32>>, TrainError> {
            let done = self.tick(grad_output, BWD);
            self.held -= 1;
            if let Some(g) = grad_output {
                assert_eq!(g[0], mb as f32, "gradient of the wrong micro-batch");
            }
            Ok((self.stage > 0).then(|| vec![mb as f32, done as f32, 0.0, 0.0]))
        }
        fn input_len(&self, _mb: usize) -> usize {
            4
        }
        fn output_len(&self, _mb: usize) -> usize {
            4
        }
        fn held(&self) -> usize {
            self.held
        }
    }

    struct StageResult {
        timing: ScheduleTiming,
        seen: Vec<f32>,
        /// Logical time at the stage's last operation, and the units it computed.
        clock: u64,
        busy: u64,
    }

    fn run(kind: ScheduleKind, stages: usize, m: usize) -> (Vec<StageResult>, Vec<Event>) {
        let transports = in_process_group(stages);
        let events = Arc::new(Mutex::new(Vec::new()));
        let results = std::thread::scope(|sc| {
            let handles: Vec<_> = transports
                .into_iter()
                .enumerate()
                .map(|(s, tr)| {
                    let events = Arc::clone(&events);
                    sc.spawn(move || {
                        // A hang guard only: nothing here waits for time to pass.
                        let mut comm = Communicator::new(Arc::new(tr), Duration::from_secs(60));
                        let mut work = Clocked {
                            stage: s,
                            stages,
                            m,
                            clock: 0,
                            busy: 0,
                            computed: 0,
                            held: 0,
                            seen: Vec::new(),
                            events: Arc::clone(&events),
                        };
                        let ops = schedule(kind, stages, s, m);
                        let timing = run_schedule(&ops, s, &mut work, &mut comm).unwrap();
                        events.lock().unwrap().push(Event::Returned(s));
                        StageResult {
                            timing,
                            seen: work.seen,
                            clock: work.clock,
                            busy: work.busy,
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        let events = events.lock().unwrap().clone();
        (results, events)
    }

    /// The executor runs each schedule correctly (every activation through every stage in
    /// micro-batch order, each gradient to its micro-batch, the schedule's peak of held
    /// activations, one message per micro-batch and boundary), its step takes exactly the ideal
    /// makespan (m + p − 1)·(f + b) so each stage's bubble is exactly (p − 1)/(m + p − 1), and no
    /// stage's step ends before every stage has finished computing (the barrier that makes all
    /// spans end together). Measured on a logical clock, so exact and independent of load.
    #[test]
    fn messages_arrive_in_order_and_the_bubble_matches_theory() {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            for stages in 2..=4 {
                for m in 1..=6 {
                    let case = format!("{kind:?} p={stages} m={m}");
                    let (out, events) = run(kind, stages, m);
                    // Every micro-batch passed through all stages: mb·100 + 1 + 2 + ... + p.
                    let want: Vec<f32> = (0..m)
                        .map(|i| (i * 100 + stages * (stages + 1) / 2) as f32)
                        .collect();
                    assert_eq!(out[stages - 1].seen, want, "{case}");

                    let span = out.iter().map(|r| r.clock).max().unwrap();
                    let ideal_span = (m + stages - 1) as u64 * (FWD + BWD);
                    assert_eq!(span, ideal_span, "{case}: makespan");
                    let ideal = ideal_bubble_fraction(stages, m);
                    for (s, r) in out.iter().enumerate() {
                        assert_eq!(r.busy, m as u64 * (FWD + BWD), "{case} stage {s}");
                        let bubble = (span - r.busy) as f64 / span as f64;
                        assert!(
                            (bubble - ideal).abs() < 1e-12,
                            "{case} stage {s}: bubble {bubble} vs ideal {ideal}"
                        );
                        let p = r.timing.pipeline;
                        let peak = if kind == ScheduleKind::GPipe {
                            m
                        } else {
                            (stages - s).min(m)
                        };
                        assert_eq!(p.peak_activations, peak, "{case} stage {s}");
                        let boundaries = usize::from(s > 0) + usize::from(s + 1 < stages);
                        assert_eq!(
                            p.p2p_bytes,
                            (boundaries * m * 4 * 4) as u64,
                            "{case} stage {s}: one message per micro-batch and boundary"
                        );
                        // The executor's own wall-clock accounting is consistent: the bubble is
                        // the span less the stage's compute.
                        let compute = r.timing.forward + r.timing.backward;
                        assert!(p.schedule_seconds >= compute, "{case} stage {s}: {p:?}");
                        assert!(
                            (p.bubble_seconds - (p.schedule_seconds - compute)).abs() < 1e-9,
                            "{case} stage {s}: {p:?}"
                        );
                    }
                    // The barrier: every stage's compute is done before any stage returns.
                    let first_return = events
                        .iter()
                        .position(|e| matches!(e, Event::Returned(_)))
                        .unwrap();
                    let done: Vec<usize> = events[..first_return]
                        .iter()
                        .filter_map(|e| match e {
                            Event::ComputeDone(s) => Some(*s),
                            _ => None,
                        })
                        .collect();
                    assert_eq!(done.len(), stages, "{case}: events {events:?}");
                }
            }
        }
    }
}
