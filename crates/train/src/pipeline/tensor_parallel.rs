//! Tensor parallelism's communication, kept out of the model crate: [`GroupPieceSum`] sums the
//! pieces of a tensor over a stage's tensor-parallel group exactly (Megatron's g forward and f
//! backward), and [`gather_stage`] rebuilds a stage's canonical flat vector from its tp ranks'
//! local vectors (checkpoints, the final hash).
//!
//! The sum is `comm/exact.rs`'s reduction with one bucket, the whole tensor: a shared exponent
//! (all-reduce max over the group), each rank's pieces in fixed point, an integer all-reduce.
//! One rank holding all pieces computes the same bits with `exact::sum_local`, so the result
//! depends only on the multiset of pieces, never on the number of tp ranks.

use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::rc::Rc;

use lockstep_comm::exact::{ExactError, ExactReducer};
use lockstep_comm::{CommError, Communicator};
use lockstep_model::{param_hash, PieceSum};

use crate::error::TrainError;

/// What a [`GroupPieceSum`] (inside a stage, behind the model crate's `PieceSum`) tells the
/// driver: the communication failure behind a failed sum (so that it is reported as a link
/// failure naming the peer, not as a job error) and the bytes it has sent.
#[derive(Default)]
pub struct TpLink {
    failure: RefCell<Option<CommError>>,
    bytes_sent: Cell<u64>,
}

impl TpLink {
    /// The communication failure behind the last failed sum, if that was the cause.
    pub fn take_failure(&self) -> Option<CommError> {
        self.failure.borrow_mut().take()
    }
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent.get()
    }
}

/// [`PieceSum`] over a tensor-parallel group's communicator.
pub struct GroupPieceSum {
    comm: Communicator,
    reducer: ExactReducer,
    link: Rc<TpLink>,
}

impl GroupPieceSum {
    /// Sums over `comm` (the tp group), reporting to `link`.
    pub fn new(comm: Communicator, link: Rc<TpLink>) -> Self {
        GroupPieceSum {
            comm,
            reducer: ExactReducer::new(usize::MAX),
            link,
        }
    }
}

impl PieceSum for GroupPieceSum {
    fn sum_pieces(
        &mut self,
        local: &[&[f32]],
        total: usize,
        out: &mut [f32],
    ) -> Result<(), String> {
        // One bucket: the whole tensor shares one exponent.
        let whole = 0..out.len();
        let result = self.reducer.reduce_with_buckets(
            &mut self.comm,
            local,
            total,
            out,
            std::slice::from_ref(&whole),
        );
        self.link.bytes_sent.set(self.comm.stats().bytes_sent);
        match result {
            Ok(()) => Ok(()),
            Err(ExactError::Comm(c)) => {
                let message = c.to_string();
                *self.link.failure.borrow_mut() = Some(c);
                Err(message)
            }
            Err(other) => Err(other.to_string()),
        }
    }
}

/// Collective over a tensor-parallel group: tp rank 0 receives every rank's local vector and
/// returns the stage's canonical flat vector (`stage_len` values) built from them with `maps`
/// (every rank's index map, known to tp rank 0); the others return `None`. The replicated
/// tensors, which every rank holds, must agree bit for bit (checked: a difference is reported
/// as diverged replicas).
pub fn gather_stage(
    tp: &mut Communicator,
    mine: &[f32],
    maps: &[Vec<Range<usize>>],
    stage_len: usize,
) -> Result<Option<Vec<f32>>, TrainError> {
    if tp.rank() != 0 {
        tp.send(0, mine)?;
        return Ok(None);
    }
    let mut stage = vec![0f32; stage_len];
    let mut written = vec![false; stage_len];
    for (r, map) in maps.iter().enumerate() {
        let mut buf = Vec::new();
        let values = if r == 0 {
            mine
        } else {
            buf.resize(map.iter().map(|m| m.len()).sum(), 0f32);
            tp.recv(r, &mut buf)?;
            &buf
        };
        let mut local = values.iter();
        let mut differs = Vec::new();
        for i in map.iter().flat_map(|m| m.clone()) {
            let v = *local.next().expect("a local vector as long as its map");
            if written[i] {
                if v.to_bits() != stage[i].to_bits() {
                    differs.push((i, v, stage[i]));
                }
            } else {
                (stage[i], written[i]) = (v, true);
            }
        }
        if !differs.is_empty() {
            let (theirs, ours): (Vec<f32>, Vec<f32>) =
                differs.iter().map(|&(_, a, b)| (a, b)).unzip();
            return Err(TrainError::Diverged {
                rank: tp.global_rank_of(r),
                theirs: format!(
                    "{} (replicated values {}.. of its stage)",
                    param_hash(&theirs),
                    differs[0].0
                ),
                ours: format!(
                    "{} (compared on rank {}, tp rank 0 of the same stage)",
                    param_hash(&ours),
                    tp.global_rank_of(0)
                ),
            });
        }
    }
    Ok(Some(stage))
}

/// Collective over a tensor-parallel group: tp rank 0 learns every rank's index map (the others
/// get an empty list).
pub fn exchange_maps(
    tp: &mut Communicator,
    mine: &[Range<usize>],
) -> Result<Vec<Vec<Range<usize>>>, TrainError> {
    let flat: Vec<i64> = mine
        .iter()
        .flat_map(|r| [r.start as i64, r.end as i64])
        .collect();
    if tp.rank() != 0 {
        tp.send(0, &[flat.len() as i64])?;
        tp.send(0, &flat)?;
        return Ok(Vec::new());
    }
    let mut maps = vec![mine.to_vec()];
    for r in 1..tp.size() {
        let mut len = [0i64];
        tp.recv(r, &mut len)?;
        let mut buf = vec![0i64; len[0] as usize];
        tp.recv(r, &mut buf)?;
        maps.push(
            buf.chunks(2)
                .map(|p| p[0] as usize..p[1] as usize)
                .collect(),
        );
    }
    Ok(maps)
}

#[cfg(test)]
mod tests {
    //! The group's sums over 2 and 4 in-process ranks against one rank holding every piece, bit
    //! for bit, and a stage gathered from its tp ranks (the layers' pieces over simulated ranks
    //! are `lockstep-model`'s `tp_layers` tests; whole runs `crates/cli/tests/tensor_parallel.rs`).

    use std::sync::Arc;
    use std::time::Duration;

    use lockstep_comm::inproc::in_process_group;
    use lockstep_model::{gather_map, LocalPieceSum};

    use super::*;

    const PIECES: usize = 4;

    /// `f(tp rank, its tp group)` on `tp` threads.
    fn on_ranks<R: Send>(tp: usize, f: impl Fn(usize, Communicator) -> R + Sync) -> Vec<R> {
        let transports = in_process_group(tp);
        std::thread::scope(|sc| {
            let handles: Vec<_> = transports
                .into_iter()
                .enumerate()
                .map(|(r, tr)| {
                    let f = &f;
                    // A hang guard only: nothing here waits for time to pass.
                    sc.spawn(move || f(r, Communicator::new(Arc::new(tr), Duration::from_secs(60))))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn group_sums_of_pieces_are_the_local_sums_bit_for_bit() {
        let len = 257;
        // Pieces of very different magnitudes and signs, with zeros, shrinking along the vector
        // (2^-i/4): the fixed point's rounding would show if the exponent (one for the whole
        // tensor) or the grouping depended on the split.
        let pieces: Vec<Vec<f32>> = (0..PIECES)
            .map(|p| {
                (0..len)
                    .map(|i| {
                        let v = ((i * 7919 + p * 104_729) % 1000) as f32 / 997.0 - 0.5;
                        if i % 11 == 0 {
                            0.0
                        } else {
                            v * 10f32.powi((p as i32) * 3 - 6) * 2f32.powi(-(i as i32) / 4)
                        }
                    })
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = pieces.iter().map(|p| p.as_slice()).collect();
        let mut want = vec![0f32; len];
        LocalPieceSum.sum_pieces(&refs, PIECES, &mut want).unwrap();
        for tp in [2, 4] {
            let got = on_ranks(tp, |r, comm| {
                let per = PIECES / tp;
                let mine: Vec<&[f32]> = refs[r * per..(r + 1) * per].to_vec();
                let mut out = vec![0f32; len];
                let mut sum = GroupPieceSum::new(comm, Rc::default());
                sum.sum_pieces(&mine, PIECES, &mut out).unwrap();
                out
            });
            for out in got {
                assert_eq!(bits(&out), bits(&want), "tp = {tp}");
            }
        }
        // A non-finite piece is refused on every rank alike.
        let mut bad = pieces.clone();
        bad[3][5] = f32::NAN;
        let bad_refs: Vec<&[f32]> = bad.iter().map(|p| p.as_slice()).collect();
        let errors = on_ranks(2, |r, comm| {
            let mut out = vec![0f32; len];
            let mut sum = GroupPieceSum::new(comm, Rc::default());
            sum.sum_pieces(&bad_refs[r * 2..r * 2 + 2], PIECES, &mut out)
                .unwrap_err()
        });
        assert!(
            errors.iter().all(|e| e.contains("non-finite")),
            "{errors:?}"
        );
    }

    #[test]
    fn a_stage_is_gathered_whole_and_diverged_replicated_tensors_are_named() {
        // A stage of 12 values: [0, 2) and [8, 10) replicated, [2, 8) and [10, 12) split in two
        // pieces, one per tp rank (each rank's map in its local order).
        let stage_len = 12;
        let maps = [vec![0..5, 8..10, 10..11], vec![0..2, 5..8, 8..10, 11..12]];
        let whole: Vec<f32> = (0..stage_len).map(|i| i as f32 * 0.5 - 7.0).collect();
        for corrupt in [false, true] {
            let results = on_ranks(2, |r, mut comm| {
                let my_map = &maps[r];
                let mut mine = gather_map(&whole, my_map);
                if corrupt && r == 1 {
                    mine[0] += 1.0; // a replicated value
                }
                let got_maps = exchange_maps(&mut comm, my_map).unwrap();
                if r == 0 {
                    assert_eq!(got_maps, maps, "tp rank 0 learns every map");
                }
                gather_stage(&mut comm, &mine, &got_maps, stage_len).map_err(|e| e.to_string())
            });
            assert_eq!(results[1], Ok(None), "only tp rank 0 assembles");
            match (&results[0], corrupt) {
                (Ok(Some(got)), false) => assert_eq!(bits(got), bits(&whole)),
                (Err(e), true) => assert!(e.contains("rank 1") && e.contains("diverged"), "{e}"),
                (other, _) => panic!("corrupt = {corrupt}: {other:?}"),
            }
        }
    }
}
