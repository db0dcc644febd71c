//! What the training loops share, written once: the run's bookkeeping around each step
//! ([`Ledger`]), checkpoint cadence and resume, run outputs, the collectives over records and
//! hashes, and the end-of-run summary. The loops (`trainer.rs` data parallel,
//! `pipeline/train.rs` dp × pp) import from here and never from each other.

pub(crate) mod checkpoint_writer;
pub(crate) mod checkpointing;
pub(crate) mod collect;
pub(crate) mod end;
pub(crate) mod evaluation;
pub(crate) mod ledger;
pub(crate) mod outputs;
pub(crate) mod schedule;

pub(crate) use checkpoint_writer::WriteFence;
pub(crate) use ledger::Ledger;
