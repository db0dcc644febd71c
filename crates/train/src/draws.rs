//! Random numbers that do not depend on the layout: every micro-batch draws from its own stream,
//! keyed by (`train.seed`, step, the micro-batch's index in the step), so burn's `Dropout`, a
//! `Tensor::random` inside a loss or a batch function's augmentation give the same values
//! whichever rank computes that micro-batch, at any world size, and again after a restart.
//!
//! Why a reseed rather than a generator handed to the model: burn's random tensors draw from the
//! backend's one generator (`Backend::seed`; on flex a process-global one), which user code
//! reaches without lockstep seeing it. The drivers reseed it before each part of a micro-batch's
//! computation; that is sound because one worker process computes one micro-batch at a time on
//! one thread (ranks are processes, never threads sharing the generator, in a lockstep run).
//!
//! A layered model's stages reseed per part ([`DrawPart`]): the batch, each layer by its index in
//! the whole model, the loss. A layer's draws are then the same whichever stage holds it, so
//! `parallel.pp` does not change them either. (Draws on a tensor-parallel rank's *slice* of an
//! activation differ from the whole tensor's: randomness in `lockstep::tp` layers is not
//! layout-independent; documented in the guide.)

use burn::tensor::Device;

/// The random stream of one micro-batch of one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Draws {
    seed: u64,
    step: u64,
    microbatch: u64,
}

/// Which part of a micro-batch's computation draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DrawPart {
    /// Turning items into the batch (and, for a whole model, everything after it).
    Batch,
    /// Layer `l` of a layered model (its index in the whole model, not in the stage).
    Layer(usize),
    /// The loss on the last layer's output.
    Loss,
}

impl Draws {
    /// The stream of global micro-batch `microbatch` (its index among the step's micro-batches,
    /// the same on every layout) of step `step` under `seed` (`train.seed`).
    pub fn new(seed: u64, step: u64, microbatch: usize) -> Self {
        Draws {
            seed,
            step,
            microbatch: microbatch as u64,
        }
    }

    /// The generator seed of `part`: the key mixed with SplitMix64 (distinct keys give unrelated
    /// streams; the seed of the model's initialisation, `train.seed` itself, is never one of them
    /// in practice).
    pub fn stream(&self, part: DrawPart) -> u64 {
        let part = match part {
            DrawPart::Batch => 0,
            DrawPart::Loss => 1,
            DrawPart::Layer(l) => 2 + l as u64,
        };
        [self.step, self.microbatch, part]
            .into_iter()
            .fold(mix(self.seed ^ 0x6c6f_636b_7374_6570), |h, v| mix(h ^ v))
    }

    /// Reseed `device`'s generator for `part`: what `part` draws next comes from its stream.
    pub fn seed(&self, device: &Device, part: DrawPart) {
        device.seed(self.stream(part));
    }
}

/// SplitMix64's finaliser: a bijection of u64 that spreads every input bit over the output.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_of_every_microbatch_has_its_own_stream() {
        let mut seen = std::collections::HashSet::new();
        for step in 0..8 {
            for mb in 0..8 {
                let d = Draws::new(7, step, mb);
                for part in [
                    DrawPart::Batch,
                    DrawPart::Loss,
                    DrawPart::Layer(0),
                    DrawPart::Layer(5),
                ] {
                    assert!(
                        seen.insert(d.stream(part)),
                        "{d:?} {part:?} repeats a stream"
                    );
                }
            }
        }
        assert_ne!(
            Draws::new(7, 1, 2).stream(DrawPart::Batch),
            Draws::new(8, 1, 2).stream(DrawPart::Batch),
            "the seed changes the stream"
        );
    }

    #[test]
    fn a_reseeded_device_draws_the_same_values_again() {
        use burn::tensor::{Distribution, Tensor};
        let device = Device::flex();
        let draw = |d: Draws| {
            d.seed(&device, DrawPart::Layer(1));
            Tensor::<1>::random([16], Distribution::Default, &device)
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
        };
        let a = draw(Draws::new(1, 3, 4));
        let _ = draw(Draws::new(1, 3, 5));
        assert_eq!(a, draw(Draws::new(1, 3, 4)));
        assert_ne!(a, draw(Draws::new(1, 4, 4)));
    }
}
