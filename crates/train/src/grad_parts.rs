//! Where a data-parallel worker keeps its micro-batch gradients between their backward and the
//! sum: in its own vectors, or in its shared window (`lockstep_comm::shared_parts`), from which
//! the exact sum of a one-host group reads each rank's parts where they lie instead of sending
//! copies through the rings.
//!
//! The window is used when the sum is exact and takes all parts at once (`dist.reproducible`,
//! no `dist.overlap`, which streams the last micro-batch's gradient into the sum, and ZeRO below
//! level 2, whose sum is a reduce-scatter) and the ranks share memory (the `shm` transport).
//! Anything else, or a window that cannot be set up on some rank (every rank learns it alike),
//! keeps the vectors. The bits are the same either way.

use lockstep_comm::shared_parts::{SharedParts, Sharing};
use lockstep_comm::{CommError, Communicator};

pub enum GradParts {
    Private(Vec<Vec<f32>>),
    Shared(SharedParts),
}

impl GradParts {
    /// `slots` parts of `len` values. Collective when `try_shared` (every rank must pass the same).
    pub fn new(
        comm: &mut Communicator,
        slots: usize,
        len: usize,
        try_shared: bool,
    ) -> Result<GradParts, CommError> {
        if try_shared {
            match SharedParts::establish(comm, slots, len)? {
                Sharing::Shared(shared) => return Ok(GradParts::Shared(shared)),
                Sharing::NoSharedMemory => {}
                Sharing::Unavailable(why) => {
                    if comm.rank() == 0 {
                        eprintln!(
                            "lockstep: the exact sum goes through the rings (no shared gradient \
                             windows: {why})"
                        );
                    }
                }
            }
        }
        Ok(GradParts::Private(vec![vec![0f32; len]; slots]))
    }

    pub fn part_mut(&mut self, slot: usize) -> &mut [f32] {
        match self {
            GradParts::Private(v) => &mut v[slot],
            GradParts::Shared(s) => s.part_mut(slot),
        }
    }

    pub fn part(&self, slot: usize) -> &[f32] {
        match self {
            GradParts::Private(v) => &v[slot],
            GradParts::Shared(s) => s.own_part(slot),
        }
    }

    /// The whole sum after a shared reduction (`None`: the caller's vector holds it).
    pub fn sum(&self) -> Option<&[f32]> {
        match self {
            GradParts::Private(_) => None,
            GradParts::Shared(s) => Some(s.sum()),
        }
    }

    /// Every gradient buffer this holds (for memory reports): the parts, and the sum area.
    pub fn held(&self) -> Vec<&[f32]> {
        let mut held = self.parts();
        held.extend(self.sum());
        held
    }

    /// Every part this rank holds.
    pub fn parts(&self) -> Vec<&[f32]> {
        match self {
            GradParts::Private(v) => v.iter().map(Vec::as_slice).collect(),
            GradParts::Shared(s) => s.own_parts(s.slots()),
        }
    }
}
