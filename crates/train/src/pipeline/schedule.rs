//! Pipeline schedules as plain lists of operations per stage.
//!
//! A replica's `p` stages each run one list per step over the replica's `m` micro-batches:
//!
//! - **GPipe**: all forwards (receive activation, compute, send), then all backwards (receive
//!   gradient, compute, send). A stage holds the activations of all `m` micro-batches at once.
//!   Idle ("bubble") fraction with balanced stages: (p − 1) / (m + p − 1).
//! - **1F1B** (PipeDream-flush, as in Megatron-LM): stage `s` runs `w = min(p − s − 1, m)` warm-up
//!   forwards, then alternates one forward and one backward, then drains `w` backwards. Same
//!   bubble as GPipe, but a stage never holds more than `p − s` micro-batches' activations.
//!
//! Messages between neighbours: per micro-batch one activation tensor forward and one gradient of
//! the same size backward (`microbatch · context · d_model` f32 each). In 1F1B's steady state a
//! stage sends and receives in **one** operation ([`Op::SendActivationRecvGrad`],
//! [`Op::SendGradRecvActivation`], both directions moving at once): two neighbours that each sent
//! before receiving could block each other forever once messages outgrow transport buffers.
//! [`simulate`] checks every schedule against strict rendezvous semantics (a send completes only
//! when the peer receives), the worst case of any transport.

pub use crate::config::ScheduleKind;

/// One operation of a stage's list. Numbers are the replica's micro-batch indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Forward(usize),
    Backward(usize),
    /// From the previous stage.
    RecvActivation(usize),
    /// To the next stage.
    SendActivation(usize),
    /// From the next stage.
    RecvGrad(usize),
    /// To the previous stage.
    SendGrad(usize),
    /// With the next stage, both directions at once.
    SendActivationRecvGrad {
        send: usize,
        recv: usize,
    },
    /// With the previous stage, both directions at once.
    SendGradRecvActivation {
        send: usize,
        recv: usize,
    },
}

/// The operations stage `stage` of `stages` runs for `m` micro-batches.
pub fn schedule(kind: ScheduleKind, stages: usize, stage: usize, m: usize) -> Vec<Op> {
    assert!(stage < stages, "stage {stage} of {stages}");
    let first = stage == 0;
    let last = stage + 1 == stages;
    let mut ops = Vec::new();
    let forward = |ops: &mut Vec<Op>, i: usize, recv: bool| {
        if recv && !first {
            ops.push(Op::RecvActivation(i));
        }
        ops.push(Op::Forward(i));
    };
    match kind {
        ScheduleKind::GPipe => {
            for i in 0..m {
                forward(&mut ops, i, true);
                if !last {
                    ops.push(Op::SendActivation(i));
                }
            }
            for i in 0..m {
                if !last {
                    ops.push(Op::RecvGrad(i));
                }
                ops.push(Op::Backward(i));
                if !first {
                    ops.push(Op::SendGrad(i));
                }
            }
        }
        ScheduleKind::OneFOneB => {
            let warmup = (stages - stage - 1).min(m);
            let steady = m - warmup;
            for i in 0..warmup {
                forward(&mut ops, i, true);
                ops.push(Op::SendActivation(i));
            }
            if steady > 0 && !first {
                ops.push(Op::RecvActivation(warmup));
            }
            for i in 0..steady {
                let (f, b) = (warmup + i, i);
                ops.push(Op::Forward(f));
                if !last {
                    ops.push(Op::SendActivationRecvGrad { send: f, recv: b });
                }
                ops.push(Op::Backward(b));
                if !first {
                    if i + 1 == steady {
                        ops.push(Op::SendGrad(b));
                    } else {
                        ops.push(Op::SendGradRecvActivation {
                            send: b,
                            recv: f + 1,
                        });
                    }
                }
            }
            for i in 0..warmup {
                let b = steady + i;
                ops.push(Op::RecvGrad(b));
                ops.push(Op::Backward(b));
                if !first {
                    ops.push(Op::SendGrad(b));
                }
            }
        }
    }
    ops
}

/// The idle fraction of a schedule with balanced stages and free communication.
pub fn ideal_bubble_fraction(stages: usize, m: usize) -> f64 {
    if stages == 0 || m == 0 {
        return 0.0;
    }
    (stages - 1) as f64 / (m + stages - 1) as f64
}

/// What [`simulate`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Simulation {
    /// Most micro-batches whose activations each stage held at once.
    pub peak_held: Vec<usize>,
}

/// Run all stages' lists against each other with rendezvous semantics (a send completes only
/// together with the matching receive; the two halves of a combined operation progress
/// independently). Errors describe a deadlock or a schedule that computes wrongly.
pub fn simulate(kind: ScheduleKind, stages: usize, m: usize) -> Result<Simulation, String> {
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum Dir {
        Act,
        Grad,
    }
    // A communication half: (send?, peer stage, direction, micro-batch).
    type Half = (bool, usize, Dir, usize);
    let halves = |s: usize, op: Op| -> Vec<Half> {
        match op {
            Op::Forward(_) | Op::Backward(_) => vec![],
            Op::RecvActivation(i) => vec![(false, s - 1, Dir::Act, i)],
            Op::SendActivation(i) => vec![(true, s + 1, Dir::Act, i)],
            Op::RecvGrad(i) => vec![(false, s + 1, Dir::Grad, i)],
            Op::SendGrad(i) => vec![(true, s - 1, Dir::Grad, i)],
            Op::SendActivationRecvGrad { send, recv } => {
                vec![
                    (true, s + 1, Dir::Act, send),
                    (false, s + 1, Dir::Grad, recv),
                ]
            }
            Op::SendGradRecvActivation { send, recv } => {
                vec![
                    (true, s - 1, Dir::Grad, send),
                    (false, s - 1, Dir::Act, recv),
                ]
            }
        }
    };
    let lists: Vec<Vec<Op>> = (0..stages).map(|s| schedule(kind, stages, s, m)).collect();
    let mut pc = vec![0usize; stages];
    let mut done_halves: Vec<Vec<bool>> = vec![Vec::new(); stages];
    let mut held = vec![0usize; stages];
    let mut peak = vec![0usize; stages];
    let mut forwarded = vec![vec![false; m]; stages];
    let mut backwarded = vec![vec![false; m]; stages];
    // What each stage has received, so compute can check its inputs arrived.
    let mut got_act = vec![vec![false; m]; stages];
    let mut got_grad = vec![vec![false; m]; stages];
    loop {
        let mut progress = false;
        // Compute ops run as soon as they are current.
        for s in 0..stages {
            while let Some(&op) = lists[s].get(pc[s]) {
                match op {
                    Op::Forward(i) => {
                        if s > 0 && !got_act[s][i] {
                            return Err(format!("stage {s} forward {i} before its activation"));
                        }
                        if forwarded[s][i] {
                            return Err(format!("stage {s} forwards {i} twice"));
                        }
                        forwarded[s][i] = true;
                        held[s] += 1;
                        peak[s] = peak[s].max(held[s]);
                    }
                    Op::Backward(i) => {
                        if !forwarded[s][i] || backwarded[s][i] {
                            return Err(format!("stage {s} backward {i} out of order"));
                        }
                        if s + 1 < stages && !got_grad[s][i] {
                            return Err(format!("stage {s} backward {i} before its gradient"));
                        }
                        backwarded[s][i] = true;
                        held[s] -= 1;
                    }
                    _ => break,
                }
                pc[s] += 1;
                progress = true;
            }
            if let Some(&op) = lists[s].get(pc[s]) {
                let n = halves(s, op).len();
                if done_halves[s].len() != n {
                    done_halves[s] = vec![false; n];
                }
            }
        }
        // Match pending halves pairwise.
        for a in 0..stages {
            let Some(&op_a) = lists[a].get(pc[a]) else {
                continue;
            };
            for (ha, &(send, peer, dir, mb)) in halves(a, op_a).iter().enumerate() {
                if !send || done_halves[a][ha] {
                    continue;
                }
                let Some(&op_b) = lists[peer].get(pc[peer]) else {
                    continue;
                };
                let hb = halves(peer, op_b)
                    .iter()
                    .position(|&(s2, p2, d2, m2)| !s2 && p2 == a && d2 == dir && m2 == mb);
                if let Some(hb) = hb {
                    if !done_halves[peer][hb] {
                        done_halves[a][ha] = true;
                        done_halves[peer][hb] = true;
                        match dir {
                            Dir::Act => got_act[peer][mb] = true,
                            Dir::Grad => got_grad[peer][mb] = true,
                        }
                        progress = true;
                    }
                }
            }
        }
        for s in 0..stages {
            if lists[s].get(pc[s]).is_some()
                && !done_halves[s].is_empty()
                && done_halves[s].iter().all(|&d| d)
            {
                pc[s] += 1;
                done_halves[s].clear();
                progress = true;
            }
        }
        if (0..stages).all(|s| pc[s] == lists[s].len()) {
            break;
        }
        if !progress {
            let stuck: Vec<String> = (0..stages)
                .filter_map(|s| lists[s].get(pc[s]).map(|op| format!("stage {s} at {op:?}")))
                .collect();
            return Err(format!("deadlock: {}", stuck.join(", ")));
        }
    }
    for s in 0..stages {
        if !(forwarded[s].iter().all(|&f| f) && backwarded[s].iter().all(|&b| b)) {
            return Err(format!("stage {s} skipped a micro-batch"));
        }
    }
    Ok(Simulation { peak_held: peak })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_schedule_completes_under_rendezvous_and_holds_what_it_should() {
        for stages in 1..=6 {
            for m in 1..=10 {
                let g = simulate(ScheduleKind::GPipe, stages, m)
                    .unwrap_or_else(|e| panic!("gpipe p={stages} m={m}: {e}"));
                assert!(g.peak_held.iter().all(|&h| h == m), "gpipe holds all m");
                let f = simulate(ScheduleKind::OneFOneB, stages, m)
                    .unwrap_or_else(|e| panic!("1f1b p={stages} m={m}: {e}"));
                for (s, &h) in f.peak_held.iter().enumerate() {
                    assert_eq!(h, (stages - s).min(m), "1f1b p={stages} m={m} stage {s}");
                    assert!(h <= stages);
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_alternates_in_steady_state() {
        // Stage 0 of 2 with 4 micro-batches: F0 warm-up, then F1 B0, F2 B1, F3 B2, then B3.
        let computes: Vec<Op> = schedule(ScheduleKind::OneFOneB, 2, 0, 4)
            .into_iter()
            .filter(|op| matches!(op, Op::Forward(_) | Op::Backward(_)))
            .collect();
        use Op::*;
        assert_eq!(
            computes,
            vec![
                Forward(0),
                Forward(1),
                Backward(0),
                Forward(2),
                Backward(1),
                Forward(3),
                Backward(2),
                Backward(3)
            ]
        );
    }

    #[test]
    fn ideal_bubble_closed_form() {
        assert_eq!(ideal_bubble_fraction(1, 8), 0.0);
        assert!((ideal_bubble_fraction(2, 4) - 0.2).abs() < 1e-12);
        assert!((ideal_bubble_fraction(4, 8) - 3.0 / 11.0).abs() < 1e-12);
    }
}
