//! Pipeline parallelism: the model's layer sequence cut into stages on neighbouring ranks,
//! micro-batches flowing through them under a GPipe or 1F1B schedule, combined with data
//! parallelism across replicas and tensor parallelism within a stage (`dp × tp × pp` ranks, mapped
//! by [`crate::ParallelDims`]).
//!
//! - `schedule`: the per-stage operation lists and a rendezvous simulator that proves them
//!   deadlock-free;
//! - `balance`: stage cuts from measured per-layer costs;
//! - `executor`: runs one stage's list for one step over the pipeline communicator, timed;
//! - `layered`: what the loop trains — a [`layered::Layered`] model cut into
//!   [`layered::LayerStage`]s (every `LayeredJob`, the built-in ones included, through
//!   `job/layered_job.rs`);
//! - `tensor_parallel`: the exact piece sum over a stage's tensor-parallel group and the gather
//!   of a stage's canonical parameters from its tp ranks;
//! - `flat`: a model trained whole (a `Replica`) as a one-layer model, and `whole`: its step
//!   (each micro-batch in one call, optionally streamed into an overlapped sum);
//! - `train`: the one training loop, for every model and layout.

pub mod balance;
mod checkpoint_shards;
pub mod executor;
pub mod flat;
mod layer_gather;
pub mod layered;
pub mod schedule;
pub mod tensor_parallel;
pub mod train;
mod whole;
