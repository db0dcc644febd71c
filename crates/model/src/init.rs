//! Initial parameter values: He (Kaiming) uniform for layers followed by ReLU, LeCun uniform
//! for the output layer (so initial logits have unit scale and the initial loss is near
//! ln(classes)), zero biases.

use crate::params::ParamInfo;
use crate::rng::SplitMix64;

/// Flat initial parameters for `layout`, reproducible from `seed` alone.
pub(crate) fn initial_values(layout: &[ParamInfo], seed: u64) -> Vec<f32> {
    let total = layout.iter().map(|p| p.len).sum();
    let mut out = Vec::with_capacity(total);
    // The output layer is the last weight in canonical order.
    let last_weight = layout.iter().rposition(|p| p.shape.len() >= 2);
    for (index, info) in layout.iter().enumerate() {
        if info.shape.len() < 2 {
            out.resize(out.len() + info.len, 0.0);
            continue;
        }
        // Linear weights are [in, out]: fan-in is dim 0. Conv weights are [out, in, kh, kw]:
        // fan-in is everything but dim 0.
        let fan_in: usize = if info.shape.len() == 2 {
            info.shape[0]
        } else {
            info.shape[1..].iter().product()
        };
        let gain_sq = if Some(index) == last_weight { 1.0 } else { 2.0 };
        // Uniform(-b, b) has variance b^2/3, so b = sqrt(3 * gain^2 / fan_in).
        let bound = (3.0 * gain_sq / fan_in as f64).sqrt() as f32;
        let mut rng = SplitMix64::for_tensor(seed, index);
        out.extend((0..info.len).map(|_| rng.next_symmetric_f32(bound)));
    }
    out
}
