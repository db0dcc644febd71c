//! ZeRO 3 one layer at a time: where a stage that recomputes its layers takes each layer's
//! parameters ([`LayerSource`]), all-gathered from the replicas' chunks over the stage's
//! data-parallel group.
//!
//! With prefetch (`parallel.prefetch_layers = n ≥ 1`, default 1), a thread of the step gathers
//! the layers in the order the stage's schedule will ask for them ([`gather_order`]: each
//! forward first layer to last, each recomputed backward last to first), at most `n` layers
//! ahead of the one the stage is using, so the next layer's all-gather runs while the current
//! one computes. Each gather is a collective of the data-parallel group; every replica runs the
//! same schedule, so their gathers still meet in the same order. The gathered values are the
//! ones the stage would have gathered itself, so the bits do not change. The price is memory:
//! up to `n` more layers' parameters held at once.
//!
//! Steps and bytes: per layer `k` of the stage and each forward and backward, one all-gather of
//! its `len_k` values (each replica sends its chunk, `≈ len_k · (dp − 1) / dp` values in and
//! out per rank, as without prefetch); none is added or skipped by the prefetch.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::time::Instant;

use lockstep_comm::{CommError, Communicator};

use super::layered::LayerSource;
use super::schedule::Op;
use crate::zero::Zero;

/// The stage's layers in the order its schedule `ops` asks for them (stage-relative indices
/// of its `layers`): each forward first to last, each recomputed backward last to first.
pub(super) fn gather_order(ops: &[Op], layers: usize) -> Vec<usize> {
    let mut order = Vec::new();
    for op in ops {
        match op {
            Op::Forward(_) => order.extend(0..layers),
            Op::Backward(_) => order.extend((0..layers).rev()),
            _ => {}
        }
    }
    order
}

/// What the stage's data-parallel group gathers from.
pub(super) struct Chunks<'a> {
    pub zero: &'a Zero,
    pub dp: &'a mut Communicator,
    /// This rank's chunks of the stage's parameters.
    pub owned: &'a [f32],
}

/// A layer gathered ahead.
///
/// (The gathering thread's own time is not reported as overlapped communication: a gather
/// started ahead also waits for the other replicas to start theirs, which is not transfer.)
struct Gathered {
    layer: usize,
    values: Result<Vec<f32>, CommError>,
}

enum Gathering<'a> {
    /// Each layer gathered when the stage asks for it.
    OnRequest(Chunks<'a>),
    /// Layers gathered ahead by the step's gathering thread.
    Ahead(Receiver<Gathered>),
}

/// ZeRO 3 per layer ([`LayerSource`]): the first failure kept for the step's error, and the
/// seconds the stage waited for gathers, during forwards and during backwards.
pub(super) struct LayerGather<'a> {
    gathering: Gathering<'a>,
    pub failure: Option<CommError>,
    /// Seconds the stage waited for gathers (exposed communication): during forwards, during
    /// backwards.
    pub waited: [f64; 2],
    /// Which of the two the next requests count towards (0: forward, 1: backward).
    pub pass: usize,
}

impl LayerGather<'_> {
    fn fail(&mut self, e: CommError) -> String {
        let message = e.to_string();
        self.failure.get_or_insert(e);
        message
    }
}

impl LayerSource for LayerGather<'_> {
    fn layer(&mut self, k: usize) -> Result<Vec<f32>, String> {
        let t0 = Instant::now();
        let got = match &mut self.gathering {
            Gathering::OnRequest(c) => c.zero.gather_segment(k, c.owned, c.dp),
            Gathering::Ahead(gathered) => match gathered.recv() {
                Ok(g) if g.layer == k => g.values,
                Ok(g) => {
                    return Err(format!(
                        "the stage asked for its layer {k}, the prefetch gathered layer {}: the \
                         schedule and the gather order disagree",
                        g.layer
                    ))
                }
                Err(_) => {
                    return Err(format!(
                        "the stage asked for its layer {k} after the step's gather order ended"
                    ))
                }
            },
        };
        self.waited[self.pass] += t0.elapsed().as_secs_f64();
        got.map_err(|e| self.fail(e))
    }
}

/// Runs `stage_step` with the [`LayerGather`] of `chunks`: on request without prefetch
/// (`ahead = 0`), else gathering `order` on a thread of its own, at most `ahead` layers ahead.
/// `stage_step` must drop the gather before it returns (that ends the thread's last wait).
pub(super) fn with_layer_gather<R>(
    chunks: Chunks<'_>,
    order: Vec<usize>,
    ahead: usize,
    stage_step: impl FnOnce(LayerGather<'_>) -> R,
) -> R {
    let gather = |gathering| LayerGather {
        gathering,
        failure: None,
        waited: [0.0; 2],
        pass: 0,
    };
    if ahead == 0 {
        return stage_step(gather(Gathering::OnRequest(chunks)));
    }
    std::thread::scope(|scope| {
        // `ahead − 1` waiting in the channel, one more held by the blocked sender.
        let (tx, rx) = sync_channel(ahead - 1);
        let thread = scope.spawn(move || gather_ahead(chunks, &order, &tx));
        let result = stage_step(gather(Gathering::Ahead(rx)));
        if let Err(panic) = thread.join() {
            std::panic::resume_unwind(panic);
        }
        result
    })
}

/// The gathering thread: `order`'s layers, each sent as soon as gathered. Stops at the first
/// failure (sent) or when the stage stops listening (its step ended or failed).
fn gather_ahead(c: Chunks<'_>, order: &[usize], tx: &SyncSender<Gathered>) {
    for &layer in order {
        let values = c.zero.gather_segment(layer, c.owned, c.dp);
        let failed = values.is_err();
        let sent = tx.send(Gathered { layer, values });
        if failed || sent.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_order_follows_forwards_up_and_backwards_down() {
        let ops = [
            Op::RecvActivation(0),
            Op::Forward(0),
            Op::SendActivation(0),
            Op::Forward(1),
            Op::Backward(0),
            Op::Backward(1),
        ];
        assert_eq!(gather_order(&ops, 3), [0, 1, 2, 0, 1, 2, 2, 1, 0, 2, 1, 0]);
        assert!(gather_order(&ops, 0).is_empty());
    }
}
