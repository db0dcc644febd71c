//! Reading a flex tensor's `f32` values in order, for lockstep's own kernels (`gelu.rs`,
//! `softmax.rs`, `layer_norm.rs`), which work on plain slices.

use std::borrow::Cow;

use burn::backend::flex::FlexTensor;

/// `t`'s values in row-major order: borrowed from its storage when contiguous, else copied.
/// Whether `t` lives on burn's flex CPU backend (with or without autodiff): where lockstep's own
/// kernels run. Elsewhere (wgpu, CUDA) every kernel's caller composes the same function of burn's
/// own operations.
pub(crate) fn on_flex<const D: usize>(t: &burn::tensor::Tensor<D>) -> bool {
    t.device() == burn::tensor::Device::flex()
}

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

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor};

    #[test]
    fn flex_tensors_with_or_without_autodiff_take_lockstep_kernels() {
        // Were this false on the CPU, every built-in model would silently leave its kernels (and
        // change its bits).
        for device in [Device::flex(), Device::flex().autodiff()] {
            assert!(super::on_flex(&Tensor::<2>::zeros([2, 3], &device)));
        }
    }
}
