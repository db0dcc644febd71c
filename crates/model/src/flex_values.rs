//! Reading a flex tensor's `f32` values in order, for lockstep's own kernels (`gelu.rs`,
//! `softmax.rs`, `layer_norm.rs`), which work on plain slices.

use std::borrow::Cow;

use burn::backend::flex::FlexTensor;

/// `t`'s values in row-major order: borrowed from its storage when contiguous, else copied.
pub(crate) fn values(t: &FlexTensor) -> Cow<'_, [f32]> {
    match t.layout().contiguous_offsets() {
        Some((start, end)) => Cow::Borrowed(&t.storage::<f32>()[start..end]),
        None => Cow::Owned(t.to_contiguous().storage::<f32>().to_vec()),
    }
}

/// `t`'s dimensions.
pub(crate) fn shape(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().iter().copied().collect()
}
