//! Order-independent, exact summation of gradients: the heart of world-size-independent
//! reproducibility.
//!
//! Floating-point addition is not associative, so a sum whose grouping depends on how many workers
//! there are (or on the order messages arrive) changes the result's bits. Integer addition *is*
//! associative. So each bucket of values is converted to fixed point against a **shared exponent**
//! (the largest binary exponent of any value in that bucket on any rank), summed as `i64` — exactly,
//! in any order, on any number of ranks — and converted back once.
//!
//! Steps of [`ExactReducer::reduce`] (n ranks, P values, B buckets, M micro-batches in the job):
//! 1. each rank finds, per bucket, the max exponent over its micro-batch gradients;
//!    `all_reduce(max)` of B + 1 i32 (latency-bound, (B + 1)·4 bytes; the extra value is the
//!    number of micro-batches a rank holds, whose maximum decides the first step's form below);
//!    a caller may run the local scan ahead, one micro-batch at a time while it is still in cache
//!    ([`ExactReducer::scan_part`]), and the next reduction then only agrees the maxima;
//! 2. each rank converts every local micro-batch gradient to fixed point with
//!    `shift = 62 − headroom − e_max` (headroom = ⌈log2 M⌉ bits, so the sum of M values can't overflow)
//!    and adds them into an `i64` accumulator: exact (all local parts in one pass, each sum stored
//!    once);
//! 3. `all_reduce(sum)` of P × i64 (bandwidth-bound, 2× the bytes of an f32 all-reduce);
//! 4. convert back: `f32(f64(sum) · 2^−shift)`.
//!
//! [`ExactReducer::reduce_scatter`] replaces step 3 by a `reduce_scatter(sum)` of the i64 values
//! ((n−1)/n·8·P bytes sent per rank) and converts only this rank's chunk
//! (`collectives::chunk_range(P, n, rank)`) in step 4: the owned values have exactly the bits
//! `reduce` gives them. Steps 2–4 then run fused, as a produced reduce-scatter
//! ([`Communicator::reduce_scatter_produced`]): each segment's `i64` values are formed when the
//! ring sends or reduces that segment (still in cache), and this rank's sums are converted back as
//! they complete, so no full-length `i64` vector is written or read. And when no rank holds more
//! than one micro-batch (agreed in step 1's collective), a value's fixed-point form is just its
//! `f32` value rounded at the bucket's scale, so the reduce-scatter's first step sends the `f32`
//! values and the receiver converts them: the reduce-scatter then sends `P/n·(4 + 8·(n−2))` bytes per
//! rank, and with 2 ranks the exact sum moves a plain `f32` all-reduce's bytes. Same bits either
//! way. Why fused: a full-length `i64` vector is twice the gradient's size, and writing it and
//! reading it back costs more memory traffic than the ring itself. Sharded optimizers (ZeRO 1/2)
//! update that chunk only.
//! [`ExactReducer::reduce_scattered_then_gathered`] follows it with an all-gather of the finished
//! f32 chunks ((n−1)/n·4·P bytes): the whole sum, same bits as `reduce`, for 1.5× the bytes of a
//! plain f32 all-reduce instead of 2×.
//!
//! [`ExactReducer::reduce_cheapest`] picks between the two by [`scatter_pays`] (the all-reduce's
//! fewer rounds win for small vectors), and on a group of one runs
//! [`ExactReducer::reduce_local_with_buckets`]: steps 2–4 fused into one pass per bucket (each
//! value's `i64` sum converted back as soon as it is formed), no `i64` vector, no communication —
//! the same bits, since every step is the same arithmetic on the same values. Its buckets are
//! independent, so it splits them between the worker's threads (rayon's pool: a worker with
//! `--threads-per-worker 2`), with the same bits at any thread count.
//!
//! [`ExactReducer::reduce_shared`] runs steps 2–4 without messages when every rank's parts lie in
//! shared-memory windows that all ranks map ([`crate::shared_parts`]): after step 1, each rank
//! sums its chunk of every rank's parts where they lie (one fused pass per bucket, as on one rank),
//! then, after a barrier, copies the peers' finished chunks. Same bits; no part is copied into a
//! ring and out again, so each value crosses memory once.
//!
//! [`ExactReducer::reduce_bucket`] runs the same four steps for one bucket alone (`all_reduce(max)` of
//! one i32, then that bucket's i64 values reduce-scattered and the finished f32 chunks all-gathered
//! when [`scatter_pays`], else all-reduced; skipped when the bucket is zero on every rank), so a
//! caller can reduce buckets one by one as their values become available (overlap with backward). Because exponents are per bucket and integer sums are exact, reducing every bucket
//! of [`ExactReducer::buckets`] this way gives the same bits as one `reduce` of the whole vector; it
//! costs two latency-bound collectives per bucket instead of two in all.
//!
//! The result depends only on the *multiset* of micro-batch gradients, never on which rank computed
//! which, nor on the reduction order: the property that lets 1, 2, 3 or 4 workers produce the same bits.
//! Precision: every value keeps its bits down to 2^(e_max − 62 + headroom), i.e. ~50 bits below the
//! bucket's largest value, far finer than f32's 24-bit mantissa for values near the maximum; tiny values
//! in a bucket with a huge maximum are rounded at that absolute granularity (deterministically).
//! Non-finite values (NaN/±Inf) anywhere are detected in step 1 on every rank alike and reported.

use std::ops::Range;

use rayon::prelude::*;

use crate::collectives::ring::Produced;
use crate::communicator::{Algorithm, Communicator};
use crate::element::ReduceOp;
use crate::error::CommError;
pub use crate::fixed_point::{
    accumulate_fixed, finish_fixed, headroom_bits, max_exponent, shift_for,
};
use crate::fixed_point::{fixed_sum, fixed_sum_finished, ALL_ZERO, NON_FINITE};
use crate::shared_parts::SharedParts;
use lockstep_exact::{check_parts, parts_max_exponent, SumError};

/// Why an exact reduction could not be performed.
#[derive(Debug, thiserror::Error)]
pub enum ExactError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("non-finite gradient (NaN or infinity) in elements {start}..{end} on some rank")]
    NonFinite { start: usize, end: usize },
    #[error("exact reduction: {0}")]
    Invalid(String),
}

impl From<SumError> for ExactError {
    fn from(e: SumError) -> Self {
        match e {
            SumError::NonFinite { start, end } => ExactError::NonFinite { start, end },
            SumError::Invalid(what) => ExactError::Invalid(what),
        }
    }
}

/// Reusable state for exact reductions of a flat gradient split into fixed buckets.
pub struct ExactReducer {
    bucket_elems: usize,
    exponents: Vec<i32>,
    /// The most micro-batches any rank held in the last exact sum (agreed with the exponents).
    most_local_parts: usize,
    acc: Vec<i64>,
    /// Step 1's local scan done ahead ([`ExactReducer::scan_part`]); taken by the next reduction.
    prescanned: Option<Prescan>,
}

/// Per-bucket max exponents of the parts scanned ahead.
struct Prescan {
    maxima: Vec<i32>,
    parts: usize,
    /// The buckets' end (the vector length) of the first scan; `None` once a later scan used
    /// other buckets or a part of another length (the reduction then refuses the pre-scan).
    len: Option<usize>,
}

impl ExactReducer {
    /// `bucket_elems`: values sharing one exponent (and one `all_reduce` call). Smaller buckets keep
    /// more relative precision for small values; larger buckets mean fewer calls.
    pub fn new(bucket_elems: usize) -> Self {
        Self {
            bucket_elems: bucket_elems.max(1),
            exponents: Vec::new(),
            most_local_parts: 0,
            acc: Vec::new(),
            prescanned: None,
        }
    }

    /// Step 1's local part for one micro-batch gradient, done now rather than inside the next
    /// reduction: fold `part`'s per-bucket max exponents (over `buckets`, which must be the next
    /// reduction's) into the pre-scan. Call it right after the gradient was written, while its
    /// values are still in cache: a scan then costs a fraction of the cold one the reduction
    /// would otherwise run over all parts. The next reduction (any of this type's, on any group)
    /// takes the pre-scan and refuses it unless it covers exactly its `local_parts`; the shared
    /// exponents, and so the bits, are the same either way.
    pub fn scan_part(&mut self, part: &[f32], buckets: &[Range<usize>]) {
        let end = buckets.last().map_or(0, |b| b.end);
        let scan = self.prescanned.get_or_insert_with(|| Prescan {
            maxima: vec![ALL_ZERO; buckets.len()],
            parts: 0,
            len: Some(end),
        });
        scan.parts += 1;
        if scan.len != Some(end) || scan.maxima.len() != buckets.len() || part.len() != end {
            scan.len = None;
            return;
        }
        for (m, b) in scan.maxima.iter_mut().zip(buckets) {
            *m = (*m).max(max_exponent(&part[b.clone()]));
        }
    }

    /// Buckets of a vector of `len` values: `(start, end)` pairs.
    pub fn buckets(&self, len: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..len.div_ceil(self.bucket_elems)).map(move |b| {
            (
                b * self.bucket_elems,
                ((b + 1) * self.bucket_elems).min(len),
            )
        })
    }

    /// Exactly sum `local_parts` (this rank's micro-batch gradients, each of `out.len()` values) across
    /// all ranks of `comm`; `total_parts` is the number of parts in the whole job (same on every rank).
    /// `out` receives the sum on every rank, bit-identical whatever the world size or assignment.
    pub fn reduce(
        &mut self,
        comm: &mut Communicator,
        local_parts: &[&[f32]],
        total_parts: usize,
        out: &mut [f32],
    ) -> Result<(), ExactError> {
        let ranges: Vec<Range<usize>> = self.buckets(out.len()).map(|(s, e)| s..e).collect();
        self.reduce_with_buckets(comm, local_parts, total_parts, out, &ranges)
    }

    /// [`ExactReducer::reduce`] with caller-chosen buckets: `buckets` must tile `0..out.len()` in
    /// order (checked). A pipeline uses buckets that never straddle a layer boundary, so that every
    /// way of cutting the model into stages shares exponents exactly like the uncut model does, and
    /// gives the same bits.
    pub fn reduce_with_buckets(
        &mut self,
        comm: &mut Communicator,
        local_parts: &[&[f32]],
        total_parts: usize,
        out: &mut [f32],
        buckets: &[Range<usize>],
    ) -> Result<(), ExactError> {
        let ranges =
            self.exponents_and_fixed(comm, local_parts, total_parts, out.len(), buckets)?;
        // Step 3: exact global sum (integer addition: any order, same bits).
        comm.all_reduce(&mut self.acc, ReduceOp::Sum)?;
        // Step 4: back to f32.
        self.finish(&ranges, total_parts, 0..out.len(), out);
        Ok(())
    }

    /// [`ExactReducer::reduce`], reduce-scattered: `shard` receives this rank's chunk of the exact
    /// sum — values [`crate::collectives::chunk_range`]`(len, size, rank)`, whose range is
    /// returned, bit for bit what `reduce` gives them; `shard.len()` must be that chunk's length.
    /// Step 3 is a reduce-scatter of the `i64` sums (half the bytes of their all-reduce) and step 4
    /// converts only the owned chunk. The basis of sharded optimizers (ZeRO 2) and, followed by an
    /// all-gather of the finished `f32` chunks ([`ExactReducer::reduce_scattered_then_gathered`]),
    /// of a full reduction that moves 1.5× the bytes of a plain `f32` all-reduce instead of 2×.
    pub fn reduce_scatter(
        &mut self,
        comm: &mut Communicator,
        local_parts: &[&[f32]],
        total_parts: usize,
        len: usize,
        shard: &mut [f32],
    ) -> Result<Range<usize>, ExactError> {
        let ranges: Vec<Range<usize>> = self.buckets(len).map(|(s, e)| s..e).collect();
        self.reduce_scatter_with_buckets(comm, local_parts, total_parts, shard, &ranges)
    }

    /// [`ExactReducer::reduce_scatter`] with caller-chosen buckets tiling the whole vector (see
    /// [`ExactReducer::reduce_with_buckets`]); the vector's length is the buckets' end.
    pub fn reduce_scatter_with_buckets(
        &mut self,
        comm: &mut Communicator,
        local_parts: &[&[f32]],
        total_parts: usize,
        shard: &mut [f32],
        buckets: &[Range<usize>],
    ) -> Result<Range<usize>, ExactError> {
        let len = buckets.last().map_or(0, |b| b.end);
        let mine = crate::collectives::chunk_range(len, comm.size(), comm.rank());
        if shard.len() != mine.len() {
            return Err(ExactError::Invalid(format!(
                "rank {} owns values {mine:?} of {len} but its shard holds {}",
                comm.rank(),
                shard.len()
            )));
        }
        let ranges = self.exponents(comm, local_parts, total_parts, len, buckets)?;
        let owned = self.scatter_fixed(comm, local_parts, total_parts, &ranges, shard, &mine)?;
        debug_assert_eq!(owned, mine);
        Ok(mine)
    }

    /// The whole exact sum on every rank, as [`ExactReducer::reduce_with_buckets`] (same bits),
    /// moved as a reduce-scatter of the `i64` sums and an all-gather of the finished `f32`
    /// chunks: per rank `(n−1)/n·(8 + 4)·P` bytes sent instead of `(n−1)/n·2·8·P`.
    pub fn reduce_scattered_then_gathered(
        &mut self,
        comm: &mut Communicator,
        local_parts: &[&[f32]],
        total_parts: usize,
        out: &mut [f32],
        buckets: &[Range<usize>],
    ) -> Result<(), ExactError> {
        let ranges = self.exponents(comm, local_parts, total_parts, out.len(), buckets)?;
        let mine = crate::collectives::chunk_range(out.len(), comm.size(), comm.rank());
        self.scatter_fixed(
            comm,
            local_parts,
            total_parts,
            &ranges,
            &mut out[mine.clone()],
            &mine,
        )?;
        comm.all_gather_chunks(out)?;
        Ok(())
    }

    /// Steps 2–4 as a produced reduce-scatter ([`Communicator::reduce_scatter_produced`]): the
    /// `i64` values are formed segment by segment as the ring sends or reduces them and this
    /// rank's finished sums go straight into `owned_out` (the values `mine`), so no full-length
    /// `i64` vector is written or read. When no rank holds more than one micro-batch, the first
    /// step's messages carry the `f32` gradient values themselves (half the bytes; the receiver
    /// converts them as the sender would have). Same bits either way.
    fn scatter_fixed(
        &self,
        comm: &mut Communicator,
        local_parts: &[&[f32]],
        total_parts: usize,
        ranges: &[(usize, usize)],
        owned_out: &mut [f32],
        mine: &Range<usize>,
    ) -> Result<Range<usize>, ExactError> {
        let len = ranges.last().map_or(0, |b| b.1);
        let mut values = FixedValues {
            ranges,
            exponents: &self.exponents,
            local_parts,
            total_parts,
            owned_out,
            owned_start: mine.start,
            single_part: self.most_local_parts <= 1,
        };
        Ok(comm.reduce_scatter_produced(len, ReduceOp::Sum, &mut values)?)
    }

    /// Steps 1 and 2: [`ExactReducer::exponents`], then this rank's exact fixed-point sums of
    /// all `len` values left in `self.acc`. Returns the buckets as pairs.
    fn exponents_and_fixed(
        &mut self,
        comm: &mut Communicator,
        local_parts: &[&[f32]],
        total_parts: usize,
        len: usize,
        buckets: &[Range<usize>],
    ) -> Result<Vec<(usize, usize)>, ExactError> {
        let ranges = self.exponents(comm, local_parts, total_parts, len, buckets)?;

        // Step 2: local exact accumulation, every local part in one pass over the accumulator
        // (which is overwritten, not cleared first: its capacity is kept from step to step).
        self.acc.resize(len, 0);
        for (b, &(s, e)) in ranges.iter().enumerate() {
            let e_max = self.exponents[b];
            if e_max == ALL_ZERO {
                self.acc[s..e].fill(0);
                continue;
            }
            fixed_sum(
                &mut self.acc[s..e],
                local_parts,
                s..e,
                shift_for(e_max, total_parts),
            );
        }
        Ok(ranges)
    }

    /// Step 1: checks the parts and the tiling and finds every bucket's shared exponent over the
    /// group (into `self.exponents`). Returns the buckets as pairs.
    fn exponents(
        &mut self,
        comm: &mut Communicator,
        local_parts: &[&[f32]],
        total_parts: usize,
        len: usize,
        buckets: &[Range<usize>],
    ) -> Result<Vec<(usize, usize)>, ExactError> {
        check_parts(local_parts, total_parts, len)?;
        check_tiling(buckets, len)?;
        let ranges: Vec<(usize, usize)> = buckets.iter().map(|b| (b.start, b.end)).collect();

        // Step 1: shared exponent per bucket, from this rank's parts (scanned ahead or now).
        self.local_exponents(local_parts, &ranges)?;
        // One more value agreed in the same collective: the most micro-batches any rank holds
        // (whether a reduce-scatter's first messages may carry plain f32 values).
        self.exponents
            .push(i32::try_from(local_parts.len()).unwrap_or(i32::MAX));
        comm.all_reduce(&mut self.exponents, ReduceOp::Max)?;
        self.most_local_parts = self.exponents.pop().map_or(0, |m| m as usize);
        if let Some(i) = self.exponents.iter().position(|&e| e == NON_FINITE) {
            let (start, end) = ranges[i];
            return Err(ExactError::NonFinite { start, end });
        }
        Ok(ranges)
    }

    /// This rank's per-bucket max exponents into `self.exponents`: the pre-scan when there is
    /// one (which must cover exactly `local_parts` and `ranges`), else a scan of the parts now.
    fn local_exponents(
        &mut self,
        local_parts: &[&[f32]],
        ranges: &[(usize, usize)],
    ) -> Result<(), ExactError> {
        self.exponents.clear();
        match self.prescanned.take() {
            Some(Prescan { maxima, parts, len }) => {
                let end = ranges.last().map_or(0, |b| b.1);
                let Some(len) = len else {
                    return Err(ExactError::Invalid(
                        "the exponents scanned ahead (scan_part) mixed parts or buckets of \
                         different lengths"
                            .into(),
                    ));
                };
                if parts != local_parts.len() || maxima.len() != ranges.len() || len != end {
                    return Err(ExactError::Invalid(format!(
                        "the exponents scanned ahead cover {parts} parts in {} buckets of \
                         {len} values, but the reduction has {} parts in {} buckets of {end}",
                        maxima.len(),
                        local_parts.len(),
                        ranges.len()
                    )));
                }
                debug_assert!(ranges
                    .iter()
                    .zip(&maxima)
                    .all(|(&(s, e), &m)| parts_max_exponent(local_parts, s..e) == m));
                self.exponents.extend_from_slice(&maxima);
            }
            None => {
                self.exponents.extend(
                    ranges
                        .iter()
                        .map(|&(s, e)| parts_max_exponent(local_parts, s..e)),
                );
            }
        }
        Ok(())
    }

    /// Step 4 for the values in `within`: `out` (which holds exactly those values, `out[0]` being
    /// value `within.start`) `= f32(acc · 2^−shift)`, bucket by bucket.
    fn finish(
        &self,
        ranges: &[(usize, usize)],
        total_parts: usize,
        within: Range<usize>,
        out: &mut [f32],
    ) {
        debug_assert_eq!(out.len(), within.len());
        for (b, &(s, e)) in ranges.iter().enumerate() {
            let (s, e) = (s.max(within.start), e.min(within.end));
            if s >= e {
                continue;
            }
            let dst = &mut out[s - within.start..e - within.start];
            let e_max = self.exponents[b];
            if e_max == ALL_ZERO {
                dst.fill(0.0);
            } else {
                finish_fixed(&self.acc[s..e], shift_for(e_max, total_parts), dst);
            }
        }
    }

    /// [`ExactReducer::reduce`] restricted to one bucket: `range` must be one of
    /// [`ExactReducer::buckets`]`(out.len())`, and only `out[range]` is written (`local_parts` are
    /// whole vectors, of which only `range` is read). Every rank must call it for the same buckets
    /// in the same order. Reducing all buckets this way, in any order, gives bitwise the result of
    /// one `reduce`: the shared exponent is the bucket's either way and the integer sum is exact.
    pub fn reduce_bucket(
        &mut self,
        comm: &mut Communicator,
        local_parts: &[&[f32]],
        total_parts: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), ExactError> {
        let len = out.len();
        let (s, e) = (range.start, range.end);
        let expected_end = s.saturating_add(self.bucket_elems).min(len);
        if s % self.bucket_elems != 0 || s >= len || e != expected_end {
            return Err(ExactError::Invalid(format!(
                "{s}..{e} is not one of the {}-value buckets of a {len}-value vector",
                self.bucket_elems
            )));
        }
        self.reduce_range(comm, local_parts, total_parts, range, out)
    }

    /// [`ExactReducer::reduce_bucket`] of a bucket the caller chose (its buckets tile the vector
    /// in its own way, e.g. within a model's layers): `range`, non-empty and inside `out`, is
    /// summed with its own shared exponent — the bits of any exact reduction that uses `range`
    /// as a bucket.
    pub fn reduce_range(
        &mut self,
        comm: &mut Communicator,
        local_parts: &[&[f32]],
        total_parts: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), ExactError> {
        if self.prescanned.take().is_some() {
            return Err(ExactError::Invalid(
                "reducing one bucket scans it itself: exponents scanned ahead \
                 (scan_part) would be left unused"
                    .into(),
            ));
        }
        let len = out.len();
        check_parts(local_parts, total_parts, len)?;
        let (s, e) = (range.start, range.end);
        if s >= e || e > len {
            return Err(ExactError::Invalid(format!(
                "bucket {s}..{e} is empty or outside a {len}-value vector"
            )));
        }

        // Step 1: the bucket's shared exponent.
        let mut e_max = [parts_max_exponent(local_parts, s..e)];
        comm.all_reduce(&mut e_max, ReduceOp::Max)?;
        let e_max = e_max[0];
        if e_max == NON_FINITE {
            return Err(ExactError::NonFinite { start: s, end: e });
        }
        if e_max == ALL_ZERO {
            // Zero on every rank (the exponent is global), so every rank skips the sum alike.
            out[s..e].fill(0.0);
            return Ok(());
        }

        // Steps 2–4 for this bucket.
        let shift = shift_for(e_max, total_parts);
        self.acc.resize(e - s, 0);
        fixed_sum(&mut self.acc[..e - s], local_parts, s..e, shift);
        let acc = &mut self.acc[..e - s];
        if scatter_pays(comm, e - s) {
            let mine = comm.reduce_scatter(acc, ReduceOp::Sum)?;
            let dst = &mut out[s..e];
            finish_fixed(&acc[mine.clone()], shift, &mut dst[mine]);
            comm.all_gather_chunks(dst)?;
        } else {
            comm.all_reduce(acc, ReduceOp::Sum)?;
            finish_fixed(acc, shift, &mut out[s..e]);
        }
        Ok(())
    }

    /// The whole exact sum on every rank with the cheaper of the two schedules that give it
    /// (same bits either way): [`ExactReducer::reduce_scattered_then_gathered`] (1.5× the bytes
    /// of a plain `f32` all-reduce) when [`scatter_pays`], else
    /// [`ExactReducer::reduce_with_buckets`] (one all-reduce of the `i64` sums: fewer messages
    /// for a small vector); on a group of one, [`ExactReducer::reduce_local_with_buckets`].
    pub fn reduce_cheapest(
        &mut self,
        comm: &mut Communicator,
        local_parts: &[&[f32]],
        total_parts: usize,
        out: &mut [f32],
        buckets: &[Range<usize>],
    ) -> Result<(), ExactError> {
        if comm.size() == 1 {
            self.reduce_local_with_buckets(local_parts, total_parts, out, buckets)
        } else if scatter_pays(comm, out.len()) {
            self.reduce_scattered_then_gathered(comm, local_parts, total_parts, out, buckets)
        } else {
            self.reduce_with_buckets(comm, local_parts, total_parts, out, buckets)
        }
    }

    /// The exact sum of every rank's parts in `shared` into its sum area ([`SharedParts::sum`]),
    /// reading the peers' parts where they lie (the steps are in [`crate::shared_parts`]); this
    /// rank's parts are `0..local_parts` of its window. Same bits as [`ExactReducer::reduce`] of
    /// the same parts; `shared` must have been set up over `comm`.
    pub fn reduce_shared(
        &mut self,
        comm: &mut Communicator,
        shared: &mut SharedParts,
        local_parts: usize,
        total_parts: usize,
        buckets: &[Range<usize>],
    ) -> Result<(), ExactError> {
        let (len, n, me) = (shared.len(), comm.size(), comm.rank());
        if shared.size() != n || shared.rank() != me {
            return Err(ExactError::Invalid(format!(
                "shared parts of rank {} of {} used on rank {me} of {n}",
                shared.rank(),
                shared.size()
            )));
        }
        shared.set_parts_now(local_parts);
        // Step 1, and the barrier after which every rank's parts are complete.
        let ranges = self.exponents(
            comm,
            &shared.own_parts(local_parts),
            total_parts,
            len,
            buckets,
        )?;

        // Step 2: this rank's chunk of every part of every rank, into its sum area.
        let mine = crate::collectives::chunk_range(len, n, me);
        let (tagged, sum) = shared.parts_and_sum(mine.clone())?;
        let all: Vec<&[f32]> = tagged.iter().map(|&(p, _)| p).collect();
        if all.len() != total_parts {
            return Err(ExactError::Invalid(format!(
                "the ranks' windows hold {} parts, the job has {total_parts}",
                all.len()
            )));
        }
        let mut pieces = Vec::new();
        for_buckets_in(&ranges, &mine, |b, sub| pieces.push((b, sub)));
        let exponents = &self.exponents;
        let piece = |(b, sub): &(usize, Range<usize>), dst: &mut [f32]| match exponents[*b] {
            ALL_ZERO => dst.fill(0.0),
            e => fixed_sum_finished(dst, &all, sub.clone(), shift_for(e, total_parts)),
        };
        let dsts = cut(sum, pieces.iter().map(|(_, sub)| sub.len()));
        // Pieces are independent: the worker's threads may take them in any order (same bits).
        if mine.len() > PARALLEL_MIN && rayon::current_num_threads() > 1 {
            dsts.into_par_iter()
                .zip(pieces.par_iter())
                .for_each(|(dst, p)| piece(p, dst));
        } else {
            for (dst, p) in dsts.into_iter().zip(&pieces) {
                piece(p, dst);
            }
        }
        // A far peer writes these lines next (its next backward): evicted, its stores do not
        // wait for this core to give up its copies.
        for &(part, far) in &tagged {
            if far {
                crate::copy::evict(bytemuck::cast_slice(&part[mine.clone()]));
            }
        }

        // Step 3: every chunk is finished (and, now and then, how far the peers are).
        comm.barrier()?;
        if shared.due_for_measuring() {
            shared.measure_distances();
        }
        // Step 4: the peers' chunks.
        for r in (0..n).filter(|&r| r != me) {
            shared.copy_sum_from(r, crate::collectives::chunk_range(len, n, r));
        }
        Ok(())
    }

    /// [`ExactReducer::reduce_with_buckets`] on a group of one: the same bits, with steps 2–4
    /// fused into one pass per bucket (each value's fixed-point sum is converted back as soon as
    /// it is formed, never stored), and no communication.
    pub fn reduce_local_with_buckets(
        &mut self,
        local_parts: &[&[f32]],
        total_parts: usize,
        out: &mut [f32],
        buckets: &[Range<usize>],
    ) -> Result<(), ExactError> {
        let len = out.len();
        check_parts(local_parts, total_parts, len)?;
        check_tiling(buckets, len)?;
        // Without a pre-scan, each bucket is scanned just before it is summed (still in cache).
        let prescanned = self.prescanned.is_some();
        if prescanned {
            let ranges: Vec<(usize, usize)> = buckets.iter().map(|b| (b.start, b.end)).collect();
            self.local_exponents(local_parts, &ranges)?;
        }
        let exponents = &self.exponents;
        let bucket = |i: usize, b: &Range<usize>, dst: &mut [f32]| {
            let e_max = if prescanned {
                exponents[i]
            } else {
                parts_max_exponent(local_parts, b.clone())
            };
            match e_max {
                NON_FINITE => Err(ExactError::NonFinite {
                    start: b.start,
                    end: b.end,
                }),
                ALL_ZERO => {
                    dst.fill(0.0);
                    Ok(())
                }
                e => {
                    fixed_sum_finished(dst, local_parts, b.clone(), shift_for(e, total_parts));
                    Ok(())
                }
            }
        };
        // Buckets are independent, so the worker's threads may take them in any order: each
        // bucket's values are the same arithmetic either way (same bits at any thread count).
        // The first non-finite bucket in order is reported, as on one thread.
        if len > PARALLEL_MIN && rayon::current_num_threads() > 1 {
            let pieces = cut(out, buckets.iter().map(|b| b.len()));
            let results: Vec<Result<(), ExactError>> = pieces
                .into_par_iter()
                .zip(buckets.par_iter())
                .enumerate()
                .map(|(i, (dst, b))| bucket(i, b, dst))
                .collect();
            results.into_iter().collect()
        } else {
            buckets
                .iter()
                .enumerate()
                .try_for_each(|(i, b)| bucket(i, b, &mut out[b.clone()]))
        }
    }
}

/// `out` cut into consecutive pieces of `lens` (which must not exceed it), for the threads.
fn cut(out: &mut [f32], lens: impl Iterator<Item = usize>) -> Vec<&mut [f32]> {
    let mut pieces = Vec::with_capacity(lens.size_hint().0);
    let mut rest = out;
    for len in lens {
        let (piece, tail) = rest.split_at_mut(len);
        pieces.push(piece);
        rest = tail;
    }
    pieces
}

/// Values below which the one-rank pass stays on one thread (handing buckets to threads would
/// cost more than it saves).
const PARALLEL_MIN: usize = 1 << 16;

/// The exact sum's values as a produced reduce-scatter asks for them: each segment's fixed-point
/// sums formed on demand, this rank's chunk converted back into `owned_out` as it completes.
struct FixedValues<'a> {
    ranges: &'a [(usize, usize)],
    exponents: &'a [i32],
    local_parts: &'a [&'a [f32]],
    total_parts: usize,
    owned_out: &'a mut [f32],
    owned_start: usize,
    /// No rank holds more than one micro-batch: a value's fixed-point form is its `f32` value
    /// rounded at the bucket's scale, so the first step may send the `f32` and let the receiver
    /// convert it.
    single_part: bool,
}

impl Produced<i64> for FixedValues<'_> {
    fn produce(&mut self, range: Range<usize>, dst: &mut [i64]) {
        let (parts, total) = (self.local_parts, self.total_parts);
        for_buckets_in(self.ranges, &range, |b, sub| {
            let dst = &mut dst[sub.start - range.start..sub.end - range.start];
            match self.exponents[b] {
                ALL_ZERO => dst.fill(0),
                e => fixed_sum(dst, parts, sub, shift_for(e, total)),
            }
        });
    }

    fn consume(&mut self, range: Range<usize>, sums: &[i64]) {
        let (out, at) = (&mut *self.owned_out, self.owned_start);
        for_buckets_in(self.ranges, &range, |b, sub| {
            let src = &sums[sub.start - range.start..sub.end - range.start];
            let dst = &mut out[sub.start - at..sub.end - at];
            match self.exponents[b] {
                ALL_ZERO => dst.fill(0.0),
                e => finish_fixed(src, shift_for(e, self.total_parts), dst),
            }
        });
    }

    fn first_step_bytes(&self) -> Option<usize> {
        self.single_part.then_some(std::mem::size_of::<f32>())
    }

    fn encode_first<'s>(&'s mut self, range: Range<usize>, scratch: &'s mut [u8]) -> &'s [u8] {
        match self.local_parts.first() {
            // The gradient's own bytes: sent from where they lie.
            Some(part) => bytemuck::cast_slice(&part[range]),
            // A rank without micro-batches contributes zeros (0.0 is all zero bits).
            None => {
                scratch.fill(0);
                scratch
            }
        }
    }

    fn produce_with_first(&mut self, range: Range<usize>, received: &[u8], dst: &mut [i64]) {
        self.produce(range.clone(), dst);
        let received: &[f32] = bytemuck::cast_slice(received);
        for_buckets_in(self.ranges, &range, |b, sub| {
            let e = self.exponents[b];
            if e != ALL_ZERO {
                let (lo, hi) = (sub.start - range.start, sub.end - range.start);
                accumulate_fixed(
                    &mut dst[lo..hi],
                    &received[lo..hi],
                    shift_for(e, self.total_parts),
                );
            }
        });
    }
}

/// Calls `f(bucket index, part of range)` for every bucket of `ranges` (sorted, tiling) that
/// `range` overlaps, in order.
fn for_buckets_in(
    ranges: &[(usize, usize)],
    range: &Range<usize>,
    mut f: impl FnMut(usize, Range<usize>),
) {
    let first = ranges.partition_point(|&(_, e)| e <= range.start);
    for (b, &(s, e)) in ranges.iter().enumerate().skip(first) {
        if s >= range.end {
            break;
        }
        f(b, s.max(range.start)..e.min(range.end));
    }
}

/// Whether an exact sum of `len` values over `comm` moves fewer bytes as a reduce-scatter of its
/// `i64` sums and an all-gather of the finished `f32` values than as one all-reduce of the sums:
/// on a group of several ranks, when the all-reduce would run as a ring anyway (the algorithm
/// forced to `ring`, or `auto` at or above the small-message threshold). Below it, or with
/// `recursive-doubling` forced, the all-reduce's fewer rounds win. A function of the group's
/// settings and `len` only, so every rank chooses alike.
pub fn scatter_pays(comm: &Communicator, len: usize) -> bool {
    comm.size() > 1
        && match comm.algorithm() {
            Algorithm::Ring => true,
            Algorithm::RecursiveDoubling => false,
            Algorithm::Auto => len.saturating_mul(8) >= comm.small_message_threshold(),
        }
}

/// `buckets` must tile `0..len` in order.
fn check_tiling(buckets: &[Range<usize>], len: usize) -> Result<(), ExactError> {
    let mut expected_start = 0;
    for b in buckets {
        if b.start != expected_start || b.end <= b.start {
            return Err(ExactError::Invalid(format!(
                "bucket {b:?} does not continue the tiling of 0..{len} at {expected_start}"
            )));
        }
        expected_start = b.end;
    }
    if expected_start != len {
        return Err(ExactError::Invalid(format!(
            "buckets end at {expected_start}, the vector has {len} values"
        )));
    }
    Ok(())
}

/// The exact sum of `parts` that one process holds all of ([`lockstep_exact::sum_local`]): the
/// bits [`ExactReducer::reduce_with_buckets`] gives with the single bucket `0..out.len()` when
/// the same `total_parts` parts are spread over any number of ranks.
pub fn sum_local(parts: &[&[f32]], total_parts: usize, out: &mut [f32]) -> Result<(), ExactError> {
    Ok(lockstep_exact::sum_local(parts, total_parts, out)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixed_point::{exponent_bound, i64_to_f64, pow2, round_to_i64, MAX_SCALED_BITS};

    #[test]
    fn exponent_bound_is_tight() {
        for v in [1.0f32, 1.5, 0.75, 3.0, 1e-30, -2.0, f32::MAX, 1e-40] {
            let e = exponent_bound(v);
            assert!((v.abs() as f64) < pow2(e), "{v} < 2^{e}");
            assert!(
                (v.abs() as f64) >= pow2(e - 1) || v.abs() < 1.2e-38,
                "{v} >= 2^{}",
                e - 1
            );
        }
        assert_eq!(max_exponent(&[0.0, 0.0]), ALL_ZERO);
        assert_eq!(max_exponent(&[1.0, f32::NAN]), NON_FINITE);
        assert_eq!(max_exponent(&[1.0, f32::NEG_INFINITY]), NON_FINITE);
    }

    #[test]
    fn round_to_i64_matches_the_library_below_2_pow_51() {
        let two51 = 2_251_799_813_685_248.0f64;
        let mut cases = vec![
            0.0,
            -0.0,
            0.5,
            1.5,
            2.5,
            -0.5,
            -1.5,
            -2.5,
            0.49999999999999994,
            1e-300,
            -1e-300,
        ];
        cases.extend([
            two51 - 0.5,
            two51 - 1.5,
            two51 - 1.0,
            -(two51 - 0.5),
            -(two51 - 1.0),
            two51 / 2.0 + 0.5,
        ]);
        // A sweep over magnitudes with fractional parts, both signs.
        let mut x = 0.123_456_789f64;
        while x < two51 {
            x = x * 1.013 + 0.37;
            if x < two51 {
                cases.extend([x, -x, x.floor() + 0.5, -(x.floor() + 0.5)]);
            }
        }
        for v in cases {
            assert_eq!(round_to_i64(v), v.round_ties_even() as i64, "{v:e}");
        }
    }

    #[test]
    fn i64_to_f64_is_correctly_rounded() {
        let mut cases = vec![
            0i64,
            1,
            -1,
            i64::MAX,
            i64::MIN,
            i64::MIN + 1,
            1 << 53,
            (1 << 53) + 1,
            -(1 << 53) - 1,
        ];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            cases.push(x as i64);
            cases.push((x >> (x % 63)) as i64);
        }
        for a in cases {
            assert_eq!(i64_to_f64(a).to_bits(), (a as f64).to_bits(), "{a}");
        }
    }

    #[test]
    fn scaled_values_stay_in_the_fast_rounding_range() {
        for terms in [1, 2, 3, 4, 64, 1000, 4096] {
            for e in [-140, -20, 0, 7, 128] {
                let s = shift_for(e, terms);
                assert!(e + s <= MAX_SCALED_BITS, "terms {terms}, e {e}");
                assert!(
                    e + s + headroom_bits(terms) <= 62,
                    "terms {terms}, e {e}: the sum could overflow"
                );
            }
        }
    }

    #[test]
    fn headroom_covers_the_number_of_terms() {
        assert_eq!(headroom_bits(1), 1);
        assert_eq!(headroom_bits(2), 2);
        assert_eq!(headroom_bits(3), 3);
        assert_eq!(headroom_bits(4), 3);
        assert_eq!(headroom_bits(5), 4);
        assert_eq!(headroom_bits(1024), 11);
    }

    #[test]
    fn fixed_point_round_trip_is_exact_for_representable_values() {
        let vals = [1.0f32, -0.5, 0.25, 3.75, -7.0, 1e-3];
        let e = max_exponent(&vals);
        let shift = shift_for(e, 1);
        let mut acc = vec![0i64; vals.len()];
        accumulate_fixed(&mut acc, &vals, shift);
        let mut out = vec![0f32; vals.len()];
        finish_fixed(&acc, shift, &mut out);
        assert_eq!(out, vals);
    }

    #[test]
    fn sum_is_independent_of_grouping_and_order() {
        // Values chosen so plain f32 summation order matters.
        let parts: Vec<Vec<f32>> = (0..6)
            .map(|k| {
                (0..5)
                    .map(|i| ((k * 7 + i * 13) as f32).sin() * 10f32.powi(k % 3 - 1))
                    .collect()
            })
            .collect();
        let e = parts.iter().map(|p| max_exponent(p)).max().unwrap();
        let shift = shift_for(e, parts.len());
        let sum_in = |order: &[usize]| {
            let mut acc = vec![0i64; 5];
            for &k in order {
                accumulate_fixed(&mut acc, &parts[k], shift);
            }
            let mut out = vec![0f32; 5];
            finish_fixed(&acc, shift, &mut out);
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let a = sum_in(&[0, 1, 2, 3, 4, 5]);
        assert_eq!(a, sum_in(&[5, 4, 3, 2, 1, 0]));
        assert_eq!(a, sum_in(&[3, 0, 5, 1, 4, 2]));
        // And it is close to the f64 sum.
        for i in 0..5 {
            let exact: f64 = parts.iter().map(|p| p[i] as f64).sum();
            assert!((f32::from_bits(a[i]) as f64 - exact).abs() <= exact.abs() * 1e-7 + 1e-12);
        }
    }

    #[test]
    fn the_fused_sums_are_the_sums_part_by_part() {
        let parts: Vec<Vec<f32>> = (0..5)
            .map(|k| {
                (0..2100)
                    .map(|i| ((k * 13 + i * 7) as f32).cos() * 10f32.powi(i % 7 - 3))
                    .collect()
            })
            .collect();
        for count in 0..=5 {
            let refs: Vec<&[f32]> = parts[..count].iter().map(|p| p.as_slice()).collect();
            let e_max = parts.iter().map(|p| max_exponent(p)).max().unwrap();
            let shift = shift_for(e_max, 5);
            let range = 37..2100;
            let mut want = vec![0i64; range.len()];
            for p in &refs {
                accumulate_fixed(&mut want, &p[range.clone()], shift);
            }
            let mut acc = vec![-1i64; range.len()];
            fixed_sum(&mut acc, &refs, range.clone(), shift);
            assert_eq!(acc, want, "{count} parts");
            let mut finished = vec![0f32; range.len()];
            finish_fixed(&want, shift, &mut finished);
            let mut fused = vec![f32::NAN; range.len()];
            fixed_sum_finished(&mut fused, &refs, range, shift);
            assert_eq!(
                fused.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                finished.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{count} parts"
            );
        }
    }

    #[test]
    fn extreme_exponents_do_not_overflow() {
        let big = [f32::MAX / 4.0, -f32::MAX / 8.0];
        let shift = shift_for(max_exponent(&big), 4);
        let mut acc = vec![0i64; 2];
        for _ in 0..4 {
            accumulate_fixed(&mut acc, &big, shift);
        }
        let mut out = vec![0f32; 2];
        finish_fixed(&acc, shift, &mut out);
        assert_eq!(out, [f32::MAX, -f32::MAX / 2.0]);
        let tiny = [1e-44f32, 2e-44];
        let shift = shift_for(max_exponent(&tiny), 2);
        let mut acc = vec![0i64; 2];
        accumulate_fixed(&mut acc, &tiny, shift);
        accumulate_fixed(&mut acc, &tiny, shift);
        finish_fixed(&acc.clone(), shift, &mut out);
        assert_eq!(out, [tiny[0] * 2.0, tiny[1] * 2.0]);
    }
}
