//! Collectives over run bookkeeping (not gradients): every rank's strings, records and hashes.

use lockstep_comm::Communicator;

use crate::error::TrainError;
use crate::memory::RankMemory;
use crate::metrics::StepRecord;

/// All ranks must build the same model: compare everyone's structure hash with rank 0's.
pub(crate) fn check_same_structure(
    comm: &mut Communicator,
    mine: [u8; 32],
) -> Result<(), TrainError> {
    let mut all = vec![0u8; 32 * comm.size()];
    comm.all_gather(&mine[..], &mut all)?;
    let ours = hex::encode(&all[..32]);
    for (rank, h) in all.chunks(32).enumerate() {
        if h != &all[..32] {
            return Err(TrainError::ModelMismatch {
                rank,
                theirs: hex::encode(h),
                ours,
            });
        }
    }
    Ok(())
}

/// All ranks must multiply matrices with the same kernel set (else the bits of a reproducible run
/// depend on which rank computed which micro-batch): compare everyone's with rank 0's.
pub(crate) fn check_same_kernels(comm: &mut Communicator) -> Result<(), TrainError> {
    let names = gather_strings(comm, lockstep_model::Kernels::detect().name())?;
    match lockstep_model::first_kernel_mismatch(&names) {
        Some((rank, theirs, ours)) => Err(TrainError::KernelMismatch {
            rank,
            theirs: theirs.to_string(),
            ours: ours.to_string(),
        }),
        None => Ok(()),
    }
}

/// All-gather one variable-length byte string per rank.
pub(crate) fn gather_bytes(
    comm: &mut Communicator,
    mine: &[u8],
) -> Result<Vec<Vec<u8>>, TrainError> {
    let n = comm.size();
    let mut lens = vec![0i64; n];
    comm.all_gather(&[mine.len() as i64], &mut lens)?;
    let max = lens.iter().copied().max().unwrap_or(0) as usize;
    let mut padded = mine.to_vec();
    padded.resize(max, 0);
    let mut all = vec![0u8; max * n];
    comm.all_gather(&padded, &mut all)?;
    Ok((0..n)
        .map(|r| all[r * max..r * max + lens[r] as usize].to_vec())
        .collect())
}

pub(crate) fn gather_strings(
    comm: &mut Communicator,
    mine: &str,
) -> Result<Vec<String>, TrainError> {
    Ok(gather_bytes(comm, mine.as_bytes())?
        .into_iter()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .collect())
}

pub(crate) fn gather_records(
    comm: &mut Communicator,
    mine: &[StepRecord],
) -> Result<Vec<StepRecord>, TrainError> {
    let bytes = serde_json::to_vec(mine).expect("records serialise");
    let mut all = Vec::new();
    for b in gather_bytes(comm, &bytes)? {
        let recs: Vec<StepRecord> =
            serde_json::from_slice(&b).expect("records from our own ranks parse");
        all.extend(recs);
    }
    all.sort_by_key(|r| (r.step, r.rank));
    Ok(all)
}

/// Every rank's memory figures, in rank order.
pub(crate) fn gather_memory(
    comm: &mut Communicator,
    mine: RankMemory,
) -> Result<Vec<RankMemory>, TrainError> {
    let m = mine;
    // Byte counts travel as i64 (the communicator's integer element); they are far below 2^63.
    let fields = [
        m.params_bytes,
        m.grads_bytes,
        m.optimizer_bytes,
        m.activation_peak_bytes,
        m.peak_rss_bytes,
    ]
    .map(|v| v as i64);
    let mut all = vec![0i64; fields.len() * comm.size()];
    comm.all_gather(&fields[..], &mut all)?;
    Ok(all
        .chunks(fields.len())
        .map(|f| RankMemory {
            params_bytes: f[0] as u64,
            grads_bytes: f[1] as u64,
            optimizer_bytes: f[2] as u64,
            activation_peak_bytes: f[3] as u64,
            peak_rss_bytes: f[4] as u64,
        })
        .collect())
}
