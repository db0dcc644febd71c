//! The one place that maps a rank to its (data-parallel replica, pipeline stage, tensor-parallel
//! rank) coordinates.
//!
//! Layout: `rank = (replica · pp + stage) · tp + tp_rank`, so the ranks of a tensor-parallel
//! group (which talk most: two exact sums per sublayer, forward and backward) are neighbours, then
//! the stages of one replica (on one host when the launcher packs ranks by host, which keeps the
//! latency-bound activation traffic local), and each (stage, tp rank)'s data-parallel group
//! strides across replicas.

use crate::config::{ConfigError, TrainConfig};

/// A validated `dp × tp × pp` layout of `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    pub world: usize,
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
}

/// Where one rank sits in the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    /// Data-parallel replica (0..dp).
    pub replica: usize,
    /// Pipeline stage (0..pp).
    pub stage: usize,
    /// Rank within the stage's tensor-parallel group (0..tp).
    pub tp_rank: usize,
}

/// Parameters one rank of a tensor-parallel group of `tp` holds of a layer with `params`, of
/// which `split` are cut into `tp` equal runs of rows (each rank keeps one) and the rest
/// replicated: the rule of every tp layout (ZeRO's segments, a stage's local vector, the plan).
pub fn params_per_tp_rank(params: usize, split: usize, tp: usize) -> usize {
    params - split + split / tp.max(1)
}

/// `Communicator::split` colours of the three groups a rank belongs to (distinct per group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupColors {
    /// Same replica and stage: the tensor-parallel group (ordered by tp rank).
    pub tp: u32,
    /// Same replica and tp rank: the pipeline (ordered by stage).
    pub pp: u32,
    /// Same stage and tp rank: the data-parallel group (ordered by replica).
    pub dp: u32,
}

impl ParallelDims {
    /// Check `dp · tp · pp == world` (`dp = 0` means "world / (tp · pp)"); the error names each
    /// factor.
    pub fn new(world: usize, dp: usize, tp: usize, pp: usize) -> Result<Self, ConfigError> {
        let bad = |message: String| ConfigError::Invalid {
            field: "parallel",
            message,
        };
        if world == 0 || pp == 0 || tp == 0 {
            return Err(bad(format!(
                "world size {world}, parallel.tp = {tp} and parallel.pp = {pp} must be ≥ 1"
            )));
        }
        let dp = if dp == 0 {
            if !world.is_multiple_of(pp * tp) {
                return Err(bad(format!(
                    "parallel.tp = {tp} × parallel.pp = {pp} = {} ranks per replica do not divide \
                     the world of {world} workers (parallel.dp = world / (tp · pp) must be a \
                     whole number)",
                    tp * pp
                )));
            }
            world / (pp * tp)
        } else {
            dp
        };
        if dp * tp * pp != world {
            return Err(bad(format!(
                "parallel.dp = {dp} × parallel.tp = {tp} × parallel.pp = {pp} = {} workers, but \
                 the world has {world} (dp · tp · pp must equal the number of workers)",
                dp * tp * pp
            )));
        }
        Ok(Self { world, dp, pp, tp })
    }

    /// The layout of `cfg` on `world` ranks, with the checks that need both: at least one
    /// micro-batch per replica.
    pub fn from_config(cfg: &TrainConfig, world: usize) -> Result<Self, ConfigError> {
        let dims = Self::new(world, cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp)?;
        let m = cfg.microbatches_per_step();
        if m < dims.dp {
            return Err(ConfigError::Invalid {
                field: "parallel.microbatches",
                message: format!(
                    "{m} micro-batches per step cannot feed {} data-parallel replicas \
                     (each needs at least one)",
                    dims.dp
                ),
            });
        }
        Ok(dims)
    }

    pub fn coords(&self, rank: usize) -> Coords {
        assert!(
            rank < self.world,
            "rank {rank} outside a world of {}",
            self.world
        );
        let group = rank / self.tp;
        Coords {
            replica: group / self.pp,
            stage: group % self.pp,
            tp_rank: rank % self.tp,
        }
    }

    pub fn rank_of(&self, c: Coords) -> usize {
        assert!(c.replica < self.dp && c.stage < self.pp && c.tp_rank < self.tp);
        (c.replica * self.pp + c.stage) * self.tp + c.tp_rank
    }

    /// The split colours of the rank at `c`.
    pub fn colors(&self, c: Coords) -> GroupColors {
        let id = |v: usize| u32::try_from(v).expect("layout coordinates fit in u32");
        GroupColors {
            tp: id(c.replica * self.pp + c.stage),
            pp: id(c.replica * self.tp + c.tp_rank),
            dp: id(c.stage * self.tp + c.tp_rank),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordinates_round_trip_and_replicas_hold_neighbouring_ranks() {
        let d = ParallelDims::new(6, 0, 1, 3).unwrap();
        assert_eq!((d.dp, d.pp), (2, 3));
        for r in 0..6 {
            assert_eq!(d.rank_of(d.coords(r)), r);
        }
        assert_eq!(
            d.coords(4),
            Coords {
                replica: 1,
                stage: 1,
                tp_rank: 0
            }
        );
    }

    #[test]
    fn bad_products_name_each_factor() {
        let e = ParallelDims::new(4, 2, 1, 3).unwrap_err().to_string();
        assert!(
            e.contains("parallel.dp = 2") && e.contains("parallel.pp = 3") && e.contains("4"),
            "{e}"
        );
        let e = ParallelDims::new(5, 0, 1, 2).unwrap_err().to_string();
        assert!(e.contains("parallel.pp = 2") && e.contains("5"), "{e}");
        let e = ParallelDims::new(8, 2, 2, 3).unwrap_err().to_string();
        assert!(
            e.contains("parallel.dp = 2 × parallel.tp = 2 × parallel.pp = 3 = 12 workers")
                && e.contains("the world has 8"),
            "{e}"
        );
        let e = ParallelDims::new(6, 0, 4, 1).unwrap_err().to_string();
        assert!(e.contains("parallel.tp = 4") && e.contains("6"), "{e}");
    }

    #[test]
    fn tensor_parallel_groups_are_neighbours_and_groups_partition_the_world() {
        let d = ParallelDims::new(8, 0, 2, 2).unwrap();
        assert_eq!((d.dp, d.tp, d.pp), (2, 2, 2));
        for r in 0..8 {
            let c = d.coords(r);
            assert_eq!(d.rank_of(c), r);
            // tp rank varies fastest: a tp group is two neighbouring ranks.
            assert_eq!(c.tp_rank, r % 2);
        }
        // Each kind of group: members share its colour and no one else does.
        for (pick, size) in [
            (
                &(|g: GroupColors| g.tp) as &dyn Fn(GroupColors) -> u32,
                d.tp,
            ),
            (&|g: GroupColors| g.pp, d.pp),
            (&|g: GroupColors| g.dp, d.dp),
        ] {
            let colours: Vec<u32> = (0..8).map(|r| pick(d.colors(d.coords(r)))).collect();
            for &c in &colours {
                assert_eq!(colours.iter().filter(|&&x| x == c).count(), size);
            }
        }
    }

    #[test]
    fn every_replica_needs_a_microbatch() {
        let cfg = TrainConfig::parse_builtin(
            "",
            "x",
            &[
                "train.global_batch=8".into(),
                "parallel.microbatches=2".into(),
            ],
        )
        .unwrap();
        assert_eq!(cfg.train.microbatch, 4);
        let e = ParallelDims::from_config(&cfg, 4).unwrap_err().to_string();
        assert!(e.contains("parallel.microbatches"), "{e}");
        assert!(ParallelDims::from_config(&cfg, 2).is_ok());
    }
}
