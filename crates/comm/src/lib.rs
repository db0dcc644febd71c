//! lockstep-comm: how workers find each other and exchange tensors.
//!
//! Layers, bottom up:
//! - [`transport`]: tagged, deadline-bounded send/recv of bytes between global ranks, implemented
//!   in-process ([`inproc`]), over TCP ([`tcp`]) and over shared memory ([`shm`]).
//! - [`auth`] and [`store`]: the per-job secret and the authenticated rendezvous key-value store.
//! - [`collectives`]: algorithms as plain functions over a transport (gloo style).
//! - [`communicator`]: a group of ranks with a timeout, algorithm choice, statistics, sub-groups,
//!   and the "broken after a failure" state.
//!
//! Invariant: this crate knows nothing about models, tensors or configs; it moves `&[T]` / `&mut [T]`.

pub mod activity;
pub mod admission;
pub mod auth;
pub mod collectives;
pub mod communicator;
pub mod copy;
pub mod element;
pub mod error;
pub mod etcd;
pub mod exact;
/// The exact sum's fixed-point loops (in `lockstep-exact`, shared with models).
pub use lockstep_exact::fixed_point;
#[cfg(test)]
mod fuzz_util;
pub mod inproc;
pub(crate) mod lobby;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod shared_parts;
pub mod shm;
pub mod store;
pub mod tcp;
pub mod transport;
pub(crate) mod wire;

pub use auth::JobSecret;
pub use communicator::{Algorithm, CommStats, Communicator};
pub use element::{Element, ReduceOp};
pub use error::{CommError, Direction, LinkFailure, Result, TransportError};
pub use transport::{SharedMemory, Tag, Transport};
