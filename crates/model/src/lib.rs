//! lockstep-model: single-device burn models, optimizers and learning-rate schedules behind a
//! flat-parameter interface.
//!
//! The distribution layer never touches burn: it moves `Vec<f32>` parameters and gradients in
//! the canonical order of [`Model::layout`], steps an [`Optimizer`] whose state is flat vectors
//! of the same length (so it does not depend on the world size and checkpoints trivially), and
//! asks [`LrSchedule`] for the learning rate of each step.
//!
//! Determinism: initialisation uses our own seeded generator, the optimizers are plain
//! elementwise f32 loops, and burn's flex backend is bitwise reproducible run to run for a fixed
//! batch composition. Splitting a batch differently changes gradient bits in the last place
//! (matmul reduction order), so callers keep micro-batches fixed. Across machines, flex's matmul
//! (the `gemm` crate) picks its kernel by instruction set (FMA or not, AVX-512 with this crate's
//! default feature `avx512`, which turns on gemm's `x86-v4`; [`Kernels::detect`] names the set) and its K-blocking from the L1 cache geometry it reads from `/sys`, so
//! bitwise agreement between different CPU models is not guaranteed by this crate.
//!
//! Overlap: [`Model::loss_and_grad_streaming`] hands out each parameter's gradient as soon as
//! backward has produced it (output layer first), through an identity custom op on every
//! parameter (burn's `extension` feature; see the `streaming` module for how it is scheduled).
//!
//! Tensor parallelism: [`ColumnParallelLinear`], [`RowParallelLinear`] and
//! [`ParallelSelfAttention`] (Megatron-style layers any burn model can use, the built-in
//! transformer's pieces included) are always computed as their fixed pieces, summing pieces
//! through the [`PieceSum`] trait — locally here ([`LocalPieceSum`]), over a tensor-parallel
//! group in `lockstep-train`; this crate never sees a rank.
//!
//! Speed: training binaries should call [`tune_allocator_for_training`] once at start-up (or
//! install a global allocator such as mimalloc); glibc's default `mmap` threshold makes every
//! step page-fault its buffers again.

mod alloc;
mod attention;
mod bf16;
mod dense;
mod error;
mod flex_values;
mod gelu;
mod gemm_call;
mod init;
mod kernels;
mod layer_norm;
mod loss;
mod model;
mod net;
mod optim;
mod softmax;
/// Flat parameter/gradient access for any burn module (also for users' own models).
pub mod flat {
    pub use crate::params::{
        f32_slice, hash_layout, layout, layout_within, read, read_grads, release, write,
        write_shaped, ParamInfo,
    };
}
mod params;
mod peak;
mod rng;
mod schedule;
mod spec;
mod streaming;
mod tensor_parallel;
mod tp_attention;
mod tp_layers;
mod transformer;
mod vector_math;

pub use alloc::tune_allocator_for_training;
pub use bf16::{round_to_bf16, Products};

/// lockstep's CPU kernels as operations any burn model can call: on burn's flex backend (with or
/// without autodiff) they are lockstep's own one-pass forward and backward, split between the
/// worker's threads by outputs only, so their bits do not depend on `--threads-per-worker`; on
/// any other device they are the same functions composed of burn's operations.
pub mod ops {
    pub use crate::bf16::{bf16_operand, Products};
    pub use crate::dense::dense_linear;
    pub use crate::gelu::gelu;
    pub use crate::layer_norm::layer_norm;
    pub use crate::softmax::softmax_last;
    pub use crate::transformer::attend as causal_self_attention;
}
pub use error::ModelError;

/// Threads this worker's own compute loops run on when called from this thread: the size of its
/// rayon pool (in a worker, `RAYON_NUM_THREADS`, which the launcher sets to
/// `--threads-per-worker`). The dense layers' matrix products and transposes (`dense.rs`), the
/// transformer's attention, GELU, softmax and layer norm, the parameter and gradient copies
/// (`params.rs`) and the optimizers' updates (`optim.rs`) split their outputs between them, never
/// a sum, so the bits are the same at any count; burn flex's own kernels run on one thread (built
/// without its `rayon` feature).
pub fn compute_threads() -> usize {
    rayon::current_num_threads()
}

/// Whether `len` values of elementwise or row-wise work, cut into pieces of about `piece`
/// values, are worth handing to this thread's [`compute_threads`]: more than one piece and more
/// than one thread. Each value is the same arithmetic either way.
pub(crate) fn split_between_threads(len: usize, piece: usize) -> bool {
    len > piece && compute_threads() > 1
}

/// Runs `f` with `threads` compute threads (a rayon pool of that size), as a worker with
/// `--threads-per-worker threads` would: for the tests that compare thread counts bit for bit.
#[cfg(test)]
pub(crate) fn on_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("building a test thread pool")
        .install(f)
}
pub use kernels::{first_mismatch as first_kernel_mismatch, Kernels};
pub use loss::{count_correct, cross_entropy_sum, sum_ce_and_correct};
pub use model::{param_hash, Model, ParamHasher, TimedLoss};
pub use net::{classifier_layers, ClassifierLayer, ConvBlock};
pub use optim::{check_elementwise, Optimizer, OptimizerSpec, UpdateRule};
pub use params::ParamInfo;
pub use peak::{
    amx_bf16_reported, measure_gemm_peak, measure_instruction_peaks, GemmPeak, InstructionPeaks,
};
pub use schedule::LrSchedule;
pub use spec::ModelSpec;
pub use tensor_parallel::{gather_map, scatter_map, LocalPieceSum, PieceSum};
pub use tp_attention::{ParallelSelfAttention, ParallelSelfAttentionConfig};
pub use tp_layers::{
    in_tp_scope, narrow_to_pieces, tp_param, tp_params_of, ColumnParallelLinear,
    ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig, TpParam, TpParamKind,
};
pub use transformer::{LayerKind, TransformerSpec};
