//! What the layers of a [`crate::job::StagedJob`] hand each other, and how it crosses a stage
//! boundary.
//!
//! An [`Activation`] is one tensor of any rank, an integer tensor (token ids, masks, positions),
//! or a small struct or tuple of them, whose first dimension is always the batch's samples. It
//! goes to the wire as its [`Part`]s in order: float values as they are, integer values as two
//! `f32` words each (the `i64`'s low and high 32 bits, bit for bit: transports copy words, never
//! compute with them). The gradient sent back has the same layout, with the float parts'
//! gradients and zeros where the integer parts lie (they have none), so the pipeline moves one
//! fixed number of words per sample each way. The shape of every part at every stage boundary is
//! learned once from one sample when the model is built, and each micro-batch's is checked
//! against it.

use burn::tensor::{Device, Int, Tensor, TensorData};

/// One tensor of an activation, flattened, with its shape (`dims[0]` = samples).
#[derive(Clone, Debug)]
pub enum Part {
    /// Float values: they carry gradients.
    Float { values: Tensor<1>, dims: Vec<usize> },
    /// Integer values (no gradient).
    Int {
        values: Tensor<1, Int>,
        dims: Vec<usize>,
    },
}

/// A part's kind and rank ([`Parts::peek`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartKind {
    Float { rank: usize },
    Int { rank: usize },
}

/// An activation's parts, handed out in order to [`Activation::from_parts`].
pub struct Parts {
    parts: std::vec::IntoIter<Part>,
    taken: usize,
}

/// An activation that does not match what a layer expects, or the model's first sample.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("activation part {part}: {message}")]
pub struct ActivationError {
    /// The part's index in the activation's order.
    pub part: usize,
    pub message: String,
}

impl Parts {
    /// The parts of an activation, in its order.
    pub fn new(parts: Vec<Part>) -> Self {
        Parts {
            parts: parts.into_iter(),
            taken: 0,
        }
    }

    fn next(&mut self, want: &str) -> Result<(usize, Part), ActivationError> {
        let index = self.taken;
        self.taken += 1;
        let part = self.parts.next().ok_or_else(|| ActivationError {
            part: index,
            message: format!("missing (expected a {want} tensor)"),
        })?;
        Ok((index, part))
    }

    /// What the next part is, without taking it: lets an enum activation tell its variant by
    /// its parts (e.g. integer token ids before the embedding, float states after).
    pub fn peek(&self) -> Option<PartKind> {
        self.parts.as_slice().first().map(|p| match p {
            Part::Float { dims, .. } => PartKind::Float { rank: dims.len() },
            Part::Int { dims, .. } => PartKind::Int { rank: dims.len() },
        })
    }

    /// The next part as a float tensor of rank `D`.
    pub fn float<const D: usize>(&mut self) -> Result<Tensor<D>, ActivationError> {
        match self.next("float")? {
            (i, Part::Float { values, dims }) => Ok(values.reshape(rank::<D>(i, &dims)?)),
            (i, Part::Int { .. }) => Err(ActivationError {
                part: i,
                message: "is an integer tensor, where a float tensor is expected".into(),
            }),
        }
    }

    /// The next part as an integer tensor of rank `D`.
    pub fn int<const D: usize>(&mut self) -> Result<Tensor<D, Int>, ActivationError> {
        match self.next("integer")? {
            (i, Part::Int { values, dims }) => Ok(values.reshape(rank::<D>(i, &dims)?)),
            (i, Part::Float { .. }) => Err(ActivationError {
                part: i,
                message: "is a float tensor, where an integer tensor is expected".into(),
            }),
        }
    }

    /// Whether every part was taken.
    fn finished(&mut self) -> Result<(), ActivationError> {
        match self.parts.next() {
            None => Ok(()),
            Some(_) => Err(ActivationError {
                part: self.taken,
                message: "is left over (the activation has fewer parts)".into(),
            }),
        }
    }
}

fn rank<const D: usize>(part: usize, dims: &[usize]) -> Result<[usize; D], ActivationError> {
    dims.try_into().map_err(|_| ActivationError {
        part,
        message: format!("has shape {dims:?}, where a tensor of rank {D} is expected"),
    })
}

/// What the layers of a [`crate::job::StagedJob`] exchange: burn tensors (float or integer, any
/// rank, the first dimension the samples), tuples of activations, or your own struct of them:
///
/// ```
/// use burn::tensor::{Int, Tensor};
/// use lockstep_train::job::{Activation, ActivationError, Part, Parts};
///
/// /// Hidden states and the token ids a later layer still needs.
/// #[derive(Clone)]
/// struct Hidden {
///     states: Tensor<3>,
///     tokens: Tensor<2, Int>,
/// }
///
/// impl Activation for Hidden {
///     fn into_parts(self, parts: &mut Vec<Part>) {
///         self.states.into_parts(parts);
///         self.tokens.into_parts(parts);
///     }
///     fn from_parts(parts: &mut Parts) -> Result<Self, ActivationError> {
///         Ok(Hidden { states: parts.float()?, tokens: parts.int()? })
///     }
/// }
/// ```
pub trait Activation: Sized + Clone {
    /// Append this activation's tensors to `parts`, in a fixed order.
    fn into_parts(self, parts: &mut Vec<Part>);
    /// Take this activation's tensors back, in the same order.
    fn from_parts(parts: &mut Parts) -> Result<Self, ActivationError>;
}

impl<const D: usize> Activation for Tensor<D> {
    fn into_parts(self, parts: &mut Vec<Part>) {
        let dims = self.dims().to_vec();
        let values = self.reshape([dims.iter().product::<usize>()]);
        parts.push(Part::Float { values, dims });
    }

    fn from_parts(parts: &mut Parts) -> Result<Self, ActivationError> {
        parts.float()
    }
}

impl<const D: usize> Activation for Tensor<D, Int> {
    fn into_parts(self, parts: &mut Vec<Part>) {
        let dims = self.dims().to_vec();
        let values = self.reshape([dims.iter().product::<usize>()]);
        parts.push(Part::Int { values, dims });
    }

    fn from_parts(parts: &mut Parts) -> Result<Self, ActivationError> {
        parts.int()
    }
}

macro_rules! tuple_activation {
    ($($name:ident),+) => {
        impl<$($name: Activation),+> Activation for ($($name,)+) {
            #[allow(non_snake_case)]
            fn into_parts(self, parts: &mut Vec<Part>) {
                let ($($name,)+) = self;
                $($name.into_parts(parts);)+
            }

            fn from_parts(parts: &mut Parts) -> Result<Self, ActivationError> {
                Ok(($($name::from_parts(parts)?,)+))
            }
        }
    };
}

tuple_activation!(A, B);
tuple_activation!(A, B, C);
tuple_activation!(A, B, C, D);

/// The parts of `x`.
pub(crate) fn parts_of<A: Activation>(x: A) -> Vec<Part> {
    let mut parts = Vec::new();
    x.into_parts(&mut parts);
    parts
}

/// The activation made of all of `parts`.
pub(crate) fn activation_of<A: Activation>(parts: Vec<Part>) -> Result<A, ActivationError> {
    let mut parts = Parts::new(parts);
    let x = A::from_parts(&mut parts)?;
    parts.finished()?;
    Ok(x)
}

/// One part's kind and shape at a stage boundary (`dims[0]` = samples).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PartShape {
    pub int: bool,
    pub dims: Vec<usize>,
}

impl PartShape {
    /// Wire words per sample.
    fn words_per_sample(&self) -> usize {
        let values: usize = self.dims.iter().skip(1).product();
        if self.int {
            2 * values
        } else {
            values
        }
    }

    fn shown(&self) -> String {
        let kind = if self.int { "integer" } else { "float" };
        format!("{kind} [samples, {}]", join(&self.dims[1..]))
    }
}

fn join(dims: &[usize]) -> String {
    dims.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The layout of an activation at one stage boundary: every part's kind and per-sample shape.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub(crate) struct Layout(pub Vec<PartShape>);

impl Layout {
    /// The layout of `parts`, each of whose first dimension must be the `n` samples.
    pub fn of(parts: &[Part], n: usize) -> Result<Layout, ActivationError> {
        let shapes = parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (int, dims) = match p {
                    Part::Float { dims, .. } => (false, dims),
                    Part::Int { dims, .. } => (true, dims),
                };
                if dims.first() != Some(&n) {
                    return Err(ActivationError {
                        part: i,
                        message: format!(
                            "has shape {dims:?}, whose first dimension is not the batch's {n} \
                             samples"
                        ),
                    });
                }
                Ok(PartShape {
                    int,
                    dims: dims.clone(),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Layout(shapes))
    }

    /// Wire words per sample, each way.
    pub fn words_per_sample(&self) -> usize {
        self.0.iter().map(PartShape::words_per_sample).sum()
    }

    /// Why `other` (a micro-batch's) differs from this layout (the model's), if it does.
    pub fn mismatch(&self, other: &Layout) -> Option<String> {
        let same = |a: &PartShape, b: &PartShape| a.int == b.int && a.dims[1..] == b.dims[1..];
        if self.0.len() == other.0.len() && self.0.iter().zip(&other.0).all(|(a, b)| same(a, b)) {
            return None;
        }
        let show = |l: &Layout| {
            l.0.iter()
                .map(PartShape::shown)
                .collect::<Vec<_>>()
                .join(", ")
        };
        Some(format!(
            "it is ({}), but ({}) when the model was built from one sample (layers must give \
             shapes that do not depend on the batch)",
            show(other),
            show(self)
        ))
    }

    /// `parts` on the wire: float values, then each `i64` as its low and high 32 bits.
    pub fn encode(parts: &[Part]) -> Result<Vec<f32>, String> {
        let mut words = Vec::new();
        for p in parts {
            match p {
                Part::Float { values, .. } => words.extend(
                    values
                        .try_to_vec_as::<f32>()
                        .map_err(|e| format!("reading activations: {e:?}"))?,
                ),
                Part::Int { values, .. } => {
                    let ints = values
                        .try_to_vec_as::<i64>()
                        .map_err(|e| format!("reading integer activations: {e:?}"))?;
                    for v in ints {
                        let bits = v as u64;
                        words.push(f32::from_bits(bits as u32));
                        words.push(f32::from_bits((bits >> 32) as u32));
                    }
                }
            }
        }
        Ok(words)
    }

    /// The parts of `n` samples from `words` on `device`, with the float parts' leaves (which
    /// require a gradient when `grad`), or why the word count is wrong.
    pub fn decode(
        &self,
        words: &[f32],
        n: usize,
        device: &Device,
        grad: bool,
    ) -> Result<(Vec<Part>, Vec<Tensor<1>>), String> {
        if words.len() != n * self.words_per_sample() {
            return Err(format!(
                "received {} activation words for {n} samples of ({}), {} per sample",
                words.len(),
                self.0
                    .iter()
                    .map(PartShape::shown)
                    .collect::<Vec<_>>()
                    .join(", "),
                self.words_per_sample()
            ));
        }
        let (mut parts, mut leaves, mut at) = (Vec::new(), Vec::new(), 0);
        for shape in &self.0 {
            let mut dims = shape.dims.clone();
            dims[0] = n;
            let len = n * shape.words_per_sample();
            let chunk = &words[at..at + len];
            at += len;
            if shape.int {
                let ints: Vec<i64> = chunk
                    .chunks_exact(2)
                    .map(|w| (w[0].to_bits() as u64 | ((w[1].to_bits() as u64) << 32)) as i64)
                    .collect();
                let values = Tensor::<1, Int>::from_data(TensorData::new(ints, [len / 2]), device);
                parts.push(Part::Int { values, dims });
            } else {
                let t = Tensor::<1>::from_data(TensorData::new(chunk.to_vec(), [len]), device);
                let t = if grad { t.require_grad() } else { t };
                leaves.push(t.clone());
                parts.push(Part::Float { values: t, dims });
            }
        }
        Ok((parts, leaves))
    }

    /// The float parts' values in a gradient of `n` samples in this layout (the words over the
    /// integer parts are ignored), or why the word count is wrong.
    pub fn split_floats<'w>(&self, words: &'w [f32], n: usize) -> Result<Vec<&'w [f32]>, String> {
        let expected = n * self.words_per_sample();
        if words.len() != expected {
            return Err(format!(
                "received {} gradient words for an output of {expected}",
                words.len()
            ));
        }
        Ok(self
            .float_ranges(n)
            .into_iter()
            .map(|r| &words[r])
            .collect())
    }

    /// A gradient of `n` samples in this layout: each float part's values (`floats`, in order)
    /// at its place, zeros over the integer parts.
    pub fn gradient_words(&self, n: usize, floats: &[Vec<f32>]) -> Vec<f32> {
        let mut words = vec![0f32; n * self.words_per_sample()];
        for (values, range) in floats.iter().zip(self.float_ranges(n)) {
            words[range].copy_from_slice(values);
        }
        words
    }

    /// The wire positions of the float parts for `n` samples, in order (where their gradients
    /// go; the integer parts' words stay zero).
    pub fn float_ranges(&self, n: usize) -> Vec<std::ops::Range<usize>> {
        let (mut out, mut at) = (Vec::new(), 0);
        for shape in &self.0 {
            let len = n * shape.words_per_sample();
            if !shape.int {
                out.push(at..at + len);
            }
            at += len;
        }
        out
    }
}

/// The float parts of `parts` (flattened, in order): what a gradient from the next stage
/// multiplies.
pub(crate) fn float_values(parts: Vec<Part>) -> Vec<Tensor<1>> {
    parts
        .into_iter()
        .filter_map(|p| match p {
            Part::Float { values, .. } => Some(values),
            Part::Int { .. } => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> Device {
        Device::flex()
    }

    #[test]
    fn a_tuple_of_float_and_integer_tensors_crosses_the_wire_bit_for_bit() {
        let d = device();
        let states = Tensor::<3>::from_data(
            TensorData::new((0..24).map(|i| i as f32 * 0.25 - 1.0).collect(), [2, 3, 4]),
            &d,
        );
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new(
                vec![0i64, -1, (1 << 24) + 1, i32::MIN.into(), i32::MAX.into(), 3],
                [2, 3],
            ),
            &d,
        );
        let parts = parts_of((states.clone(), ids.clone()));
        let layout = Layout::of(&parts, 2).unwrap();
        assert_eq!(layout.words_per_sample(), 12 + 2 * 3);
        let words = Layout::encode(&parts).unwrap();
        assert_eq!(words.len(), 2 * 18);
        let (back, leaves) = layout.decode(&words, 2, &d, false).unwrap();
        assert_eq!(leaves.len(), 1);
        let (s, i): (Tensor<3>, Tensor<2, Int>) = activation_of(back).unwrap();
        assert_eq!(s.dims(), [2, 3, 4]);
        assert_eq!(
            s.try_to_vec_as::<f32>().unwrap(),
            states.try_to_vec_as::<f32>().unwrap()
        );
        assert_eq!(
            i.try_to_vec_as::<i64>().unwrap(),
            // Beyond 2^24 (where floats would round them) and at the ends of flex's i32 ints.
            vec![0, -1, (1 << 24) + 1, i32::MIN.into(), i32::MAX.into(), 3]
        );
        assert_eq!(layout.float_ranges(2), vec![0..24]);
        // A gradient: the float part's values in place, zeros over the ids; read back.
        let floats: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let grad = layout.gradient_words(2, std::slice::from_ref(&floats));
        assert_eq!(grad.len(), 36);
        assert!(grad[24..].iter().all(|w| *w == 0.0));
        assert_eq!(layout.split_floats(&grad, 2).unwrap(), vec![&floats[..]]);
        let e = layout.split_floats(&grad[1..], 2).unwrap_err();
        assert!(
            e.contains("received 35 gradient words for an output of 36"),
            "{e}"
        );
    }

    #[test]
    fn mismatched_parts_are_named() {
        let d = device();
        let x = Tensor::<2>::zeros([4, 5], &d);
        let e = activation_of::<Tensor<2, Int>>(parts_of(x.clone())).unwrap_err();
        assert_eq!(e.part, 0);
        assert!(e.message.contains("is a float tensor"), "{e}");
        let e = activation_of::<Tensor<3>>(parts_of(x.clone())).unwrap_err();
        assert!(e.message.contains("rank 3"), "{e}");
        let e = activation_of::<Tensor<2>>(parts_of((x.clone(), x.clone()))).unwrap_err();
        assert!(e.to_string().contains("part 1: is left over"), "{e}");
        let e = activation_of::<(Tensor<2>, Tensor<2>)>(parts_of(x.clone())).unwrap_err();
        assert!(e.to_string().contains("part 1: missing"), "{e}");
        let e = Layout::of(&parts_of(x.clone()), 3).unwrap_err();
        assert!(e.message.contains("not the batch's 3 samples"), "{e}");
        let built = Layout::of(&parts_of(x.clone()), 4).unwrap();
        let other = Layout::of(&parts_of(Tensor::<2>::zeros([4, 6], &d)), 4).unwrap();
        let why = built.mismatch(&other).unwrap();
        assert!(why.contains("(float [samples, 6])") && why.contains("(float [samples, 5])"));
        assert_eq!(built.mismatch(&built), None);
        let e = built.decode(&[0.0; 7], 4, &d, false).unwrap_err();
        assert!(
            e.contains("received 7 activation words for 4 samples"),
            "{e}"
        );
    }
}
