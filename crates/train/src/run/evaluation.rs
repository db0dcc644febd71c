//! Every rank's evaluation sums into the run's figures.
//!
//! Sums travel in fixed point (2^-24 units) and are added as integers, so the result does not
//! depend on the order of addition: a layout that evaluates the same fixed chunks reports the
//! same bits (chunks are fixed: a micro-batch of samples, or 512 for a model trained whole; the
//! replicas take contiguous shares of them). The job's metric names travel with them: every rank that evaluated something must
//! report the same names in the same order.

use std::collections::BTreeMap;

use lockstep_comm::{Communicator, ReduceOp};

use super::collect::gather_strings;
use crate::error::TrainError;
use crate::metrics::Eval;
use crate::outcome::{EvalSums, ReplicaError};

/// Units per 1.0 of a sum.
const FIXED_POINT: f64 = (1u64 << 24) as f64;
/// Largest magnitude of a sum that fits the fixed point with room for many ranks' additions.
const MAX_SUM: f64 = (1u64 << 36) as f64;

/// One rank's evaluation sums, each chunk's added in fixed point as it arrives (so the total
/// does not depend on how chunks are grouped on ranks).
#[derive(Default)]
pub(crate) struct EvalTotals {
    /// The job's metric names (from the first chunk); `None` before any chunk.
    names: Option<Vec<String>>,
    /// Loss, then each metric, in fixed point.
    fixed: Vec<i64>,
}

impl EvalTotals {
    /// Add one chunk's sums (the same metric names in the same order on every chunk).
    pub(crate) fn add(&mut self, sums: EvalSums) -> Result<(), ReplicaError> {
        let names: Vec<String> = sums.metrics.iter().map(|(n, _)| n.clone()).collect();
        match &self.names {
            None => {
                self.fixed = vec![0; 1 + names.len()];
                self.names = Some(names);
            }
            Some(known) if *known != names => {
                return Err(ReplicaError::Other(format!(
                    "metrics must have the same names in the same order on every batch \
                     (`{}` then `{}`)",
                    known.join(", "),
                    names.join(", ")
                )))
            }
            Some(_) => {}
        }
        let values = std::iter::once(("loss", sums.loss))
            .chain(sums.metrics.iter().map(|(n, v)| (n.as_str(), *v)));
        for (slot, (name, v)) in self.fixed.iter_mut().zip(values) {
            if !v.is_finite() || v.abs() > MAX_SUM {
                return Err(ReplicaError::Other(format!(
                    "the {name} sum {v} of an evaluation batch is not finite or too large to add \
                     exactly (more than 2^36)"
                )));
            }
            *slot += (v * FIXED_POINT).round() as i64;
        }
        Ok(())
    }
}

/// Collective over `comm`: every rank's totals (empty on a rank that evaluated nothing: an empty
/// share, or a pipeline stage other than the last), divided by `units` (the evaluated samples, or
/// what the job counts per sample). The metric `accuracy`, when reported, is the test accuracy.
pub(crate) fn combine(
    comm: &mut Communicator,
    mine: EvalTotals,
    units: f64,
    job: &str,
    step: u64,
) -> Result<Eval, TrainError> {
    let line = mine.names.as_ref().map_or(String::new(), |n| n.join("\n"));
    let lines = gather_strings(comm, &line)?;
    let reference = lines
        .iter()
        .find(|l| !l.is_empty())
        .cloned()
        .unwrap_or_default();
    if mine.names.is_some() && !line.is_empty() && line != reference {
        return Err(TrainError::JobEval {
            job: job.to_string(),
            step: step + 1,
            cause: ReplicaError::Other(format!(
                "ranks report different metrics (`{}` and `{}`)",
                line.replace('\n', ", "),
                reference.replace('\n', ", ")
            )),
        });
    }
    let names: Vec<&str> = if reference.is_empty() {
        Vec::new()
    } else {
        reference.split('\n').collect()
    };
    let mut sums = vec![0i64; 1 + names.len()];
    if mine.names.is_some() {
        sums.copy_from_slice(&mine.fixed);
    }
    comm.all_reduce(&mut sums, ReduceOp::Sum)?;
    let mean = |s: i64| s as f64 / FIXED_POINT / units.max(1.0);
    let mut metrics: BTreeMap<String, f64> = names
        .iter()
        .zip(&sums[1..])
        .map(|(name, &s)| (name.to_string(), mean(s)))
        .collect();
    let test_accuracy = metrics.remove("accuracy").unwrap_or(f64::NAN);
    Ok(Eval {
        test_loss: mean(sums[0]),
        test_accuracy,
        metrics,
    })
}
