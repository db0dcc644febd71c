//! Flat-parameter views of any burn [`Module`]: layout, read, write and gradient extraction.
//! lockstep's own nets use them, and so does `lockstep::Job` for a user's own model (in
//! lockstep-train): this is all the distribution layer needs from a model.
//!
//! All four walk the module with burn's visitor/mapper, whose order is the `#[derive(Module)]`
//! declaration order, so they agree by construction. Nothing here keys anything by `ParamId`:
//! ids are random per process, while names and positions are the same on every rank.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Device, Gradients, Tensor, TensorData};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Values per piece when a copy is split between the worker's threads.
const COPY_PIECE: usize = 1 << 15;

/// `dst.copy_from_slice(src)`, split between the worker's threads ([`crate::compute_threads`])
/// when long: every step copies each parameter in and each micro-batch's gradient out, which on
/// one thread was ≈ 9% of the benchmark MLP's step at 2 threads.
fn copy_values(dst: &mut [f32], src: &[f32]) {
    if crate::split_between_threads(src.len(), COPY_PIECE) {
        dst.par_chunks_mut(COPY_PIECE)
            .zip(src.par_chunks(COPY_PIECE))
            .for_each(|(d, s)| d.copy_from_slice(s));
    } else {
        dst.copy_from_slice(src);
    }
}

/// `src.to_vec()`, split between the worker's threads when long.
fn copied(src: &[f32]) -> Vec<f32> {
    if !crate::split_between_threads(src.len(), COPY_PIECE) {
        return src.to_vec();
    }
    let mut out = Vec::with_capacity(src.len());
    out.spare_capacity_mut()[..src.len()]
        .par_chunks_mut(COPY_PIECE)
        .zip(src.par_chunks(COPY_PIECE))
        .for_each(|(d, s)| {
            for (d, &v) in d.iter_mut().zip(s) {
                d.write(v);
            }
        });
    // SAFETY: the pieces cover `0..src.len()` and each wrote every element of its piece.
    unsafe { out.set_len(src.len()) };
    out
}

/// Where one parameter tensor lives in the flat vector.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamInfo {
    /// Dotted module path, e.g. `layers.0.weight` or `convs.1.bias`.
    pub name: String,
    /// Tensor shape (linear weights `[in, out]`, conv weights `[out, in, 3, 3]`).
    pub shape: Vec<usize>,
    /// First element in the flat vector.
    pub offset: usize,
    /// Number of elements (product of `shape`).
    pub len: usize,
}

/// Collects names and shapes, tracking the module path entered so far.
struct LayoutVisitor {
    path: Vec<String>,
    out: Vec<ParamInfo>,
    offset: usize,
}

impl ModuleVisitor for LayoutVisitor {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let shape = param.val().dims().to_vec();
        let len = shape.iter().product();
        self.out.push(ParamInfo {
            name: self.path.join("."),
            shape,
            offset: self.offset,
            len,
        });
        self.offset += len;
    }
}

/// Names, shapes and flat offsets of every float parameter, in canonical (declaration) order.
pub fn layout<M: Module>(net: &M) -> Vec<ParamInfo> {
    let mut v = LayoutVisitor {
        path: Vec::new(),
        out: Vec::new(),
        offset: 0,
    };
    net.visit(&mut v);
    v.out
}

/// Appends every parameter's values in canonical order.
struct ReadVisitor {
    out: Vec<f32>,
}

impl ModuleVisitor for ReadVisitor {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let data = param.val().into_data();
        self.out.extend_from_slice(f32_slice(&data));
    }
}

/// The entries of `layout` whose values start within `range` of the flat vector (one layer's, for
/// [`write_shaped`] into that layer alone), offsets unchanged.
pub fn layout_within(layout: &[ParamInfo], range: &std::ops::Range<usize>) -> Vec<ParamInfo> {
    layout
        .iter()
        .filter(|p| range.contains(&p.offset))
        .cloned()
        .collect()
}

/// All parameter values, concatenated in canonical order.
pub fn read<M: Module>(net: &M, num_params: usize) -> Vec<f32> {
    let mut v = ReadVisitor {
        out: Vec::with_capacity(num_params),
    };
    net.visit(&mut v);
    v.out
}

/// Replaces every parameter with the next slice of a flat vector (length checked by the
/// caller). The new tensors are fresh autodiff leaves that require gradients; parameter ids are
/// kept so that the module stays the same module.
struct WriteMapper<'a> {
    src: &'a [f32],
    offset: usize,
    device: &'a Device,
    /// Each parameter's shape, when the module holds released (empty) tensors; `None`: the
    /// tensors' own shapes.
    shapes: Option<std::slice::Iter<'a, ParamInfo>>,
}

impl ModuleMapper for WriteMapper<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let device = self.device;
        let src = self.src;
        let offset = &mut self.offset;
        let shape = self.shapes.as_mut().map(|s| {
            s.next()
                .expect("one recorded shape per parameter")
                .shape
                .clone()
        });
        param.map(|old| {
            let dims: [usize; D] = match shape {
                Some(shape) => shape.try_into().expect("the recorded shape's rank"),
                None => old.dims(),
            };
            let len: usize = dims.iter().product();
            let values = copied(&src[*offset..*offset + len]);
            *offset += len;
            Tensor::from_data(TensorData::new(values, dims), device).require_grad()
        })
    }
}

/// Replace every parameter with the next slice of `src` (whose length must be the parameter
/// count); the new tensors are autodiff leaves that require gradients.
pub fn write<M: Module>(net: M, src: &[f32], device: &Device) -> M {
    let mut m = WriteMapper {
        src,
        offset: 0,
        device,
        shapes: None,
    };
    let net = net.map(&mut m);
    debug_assert_eq!(m.offset, src.len());
    net
}

/// [`write()`] into a module whose parameters were [`release`]d: each parameter takes its shape
/// from `layout` (the module's [`layout`] before the release) instead of its empty tensor.
pub fn write_shaped<M: Module>(net: M, src: &[f32], device: &Device, layout: &[ParamInfo]) -> M {
    let mut m = WriteMapper {
        src,
        offset: 0,
        device,
        shapes: Some(layout.iter()),
    };
    let net = net.map(&mut m);
    debug_assert_eq!(m.offset, src.len());
    net
}

/// Replaces every parameter's tensor with an empty one (its values freed; ids and structure
/// kept): ZeRO 3 holds only its shard of a stage between steps. [`write_shaped`] fills it again.
pub fn release<M: Module>(net: M, device: &Device) -> M {
    struct ReleaseMapper<'a>(&'a Device);
    impl ModuleMapper for ReleaseMapper<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let device = self.0;
            param.map(|_| Tensor::empty([0; D], device))
        }
    }
    net.map(&mut ReleaseMapper(device))
}

/// Copies each parameter's gradient into its slot of `out`.
struct GradVisitor<'a> {
    grads: &'a mut Gradients,
    out: &'a mut [f32],
    offset: usize,
}

impl ModuleVisitor for GradVisitor<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        let len: usize = value.dims().iter().product();
        let slot = &mut self.out[self.offset..self.offset + len];
        // Removing (not cloning) leaves the gradient buffer uniquely owned, so reading it out
        // moves the buffer instead of copying it first.
        match value.grad_remove(self.grads) {
            Some(grad) => copy_values(slot, f32_slice(&grad.into_data())),
            // A parameter the loss does not depend on has a zero gradient; every parameter of
            // our nets is used, so this arm only keeps the output well defined.
            None => slot.fill(0.0),
        }
        self.offset += len;
    }
}

/// Move each parameter's gradient out of `grads` into its slot of `out` (canonical order).
pub fn read_grads<M: Module>(net: &M, mut grads: Gradients, out: &mut [f32]) {
    let mut v = GradVisitor {
        grads: &mut grads,
        out,
        offset: 0,
    };
    net.visit(&mut v);
    debug_assert_eq!(v.offset, v.out.len());
}

/// The f32 contents of tensor data. Every tensor of this crate is created as f32, so another
/// dtype here is a programming error, not an input error.
pub fn f32_slice(data: &TensorData) -> &[f32] {
    data.as_slice::<f32>()
        .expect("lockstep-model tensors are f32 by construction")
}

/// Feed every parameter's name and shape, in order, into `h`: the architecture part of a
/// structure fingerprint (the values are not hashed).
pub fn hash_layout(h: &mut sha2::Sha256, layout: &[ParamInfo]) {
    use sha2::Digest;
    for p in layout {
        h.update((p.name.len() as u64).to_le_bytes());
        h.update(p.name.as_bytes());
        h.update((p.shape.len() as u64).to_le_bytes());
        for &d in &p.shape {
            h.update((d as u64).to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies split between 1–3 threads give every value, at lengths around the piece size.
    #[test]
    fn copies_on_threads_give_every_value() {
        for threads in 1..=3 {
            for len in [
                0,
                1,
                COPY_PIECE - 1,
                COPY_PIECE,
                COPY_PIECE + 1,
                3 * COPY_PIECE + 7,
            ] {
                let src: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
                let (fresh, into) = crate::on_threads(threads, || {
                    let mut into = vec![f32::NAN; len];
                    copy_values(&mut into, &src);
                    (copied(&src), into)
                });
                assert!(fresh == src, "copied, {threads} threads, {len} values");
                assert!(into == src, "copy_values, {threads} threads, {len} values");
            }
        }
    }
}
