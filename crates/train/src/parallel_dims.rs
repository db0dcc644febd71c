//! The one place that maps a rank to its (data-parallel replica, pipeline stage) coordinates.
//!
//! Layout: `rank = replica · pp + stage`, so the stages of one replica are neighbouring ranks (on
//! one host when the launcher packs ranks by host, which keeps the latency-bound activation
//! traffic local) and each stage's data-parallel group strides across replicas.

use crate::config::{ConfigError, TrainConfig};

/// A validated `dp × pp` layout of `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    pub world: usize,
    pub dp: usize,
    pub pp: usize,
}

/// Where one rank sits in the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    /// Data-parallel replica (0..dp).
    pub replica: usize,
    /// Pipeline stage (0..pp).
    pub stage: usize,
}

impl ParallelDims {
    /// Check `dp · pp == world` (`dp = 0` means "world / pp"); the error names each factor.
    pub fn new(world: usize, dp: usize, pp: usize) -> Result<Self, ConfigError> {
        let bad = |message: String| ConfigError::Invalid {
            field: "parallel",
            message,
        };
        if world == 0 || pp == 0 {
            return Err(bad(format!(
                "world size {world} and parallel.pp = {pp} must be ≥ 1"
            )));
        }
        let dp = if dp == 0 {
            if !world.is_multiple_of(pp) {
                return Err(bad(format!(
                    "parallel.pp = {pp} stages do not divide the world of {world} workers \
                     (parallel.dp = world / pp must be a whole number)"
                )));
            }
            world / pp
        } else {
            dp
        };
        if dp * pp != world {
            return Err(bad(format!(
                "parallel.dp = {dp} × parallel.pp = {pp} = {} workers, but the world has {world} \
                 (dp · pp must equal the number of workers)",
                dp * pp
            )));
        }
        Ok(Self { world, dp, pp })
    }

    /// The layout of `cfg` on `world` ranks, with the checks that need both: at least one
    /// micro-batch per replica.
    pub fn from_config(cfg: &TrainConfig, world: usize) -> Result<Self, ConfigError> {
        let dims = Self::new(world, cfg.parallel.dp, cfg.parallel.pp)?;
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
        Coords {
            replica: rank / self.pp,
            stage: rank % self.pp,
        }
    }

    pub fn rank_of(&self, c: Coords) -> usize {
        assert!(c.replica < self.dp && c.stage < self.pp);
        c.replica * self.pp + c.stage
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordinates_round_trip_and_replicas_hold_neighbouring_ranks() {
        let d = ParallelDims::new(6, 0, 3).unwrap();
        assert_eq!((d.dp, d.pp), (2, 3));
        for r in 0..6 {
            assert_eq!(d.rank_of(d.coords(r)), r);
        }
        assert_eq!(
            d.coords(4),
            Coords {
                replica: 1,
                stage: 1
            }
        );
    }

    #[test]
    fn bad_products_name_each_factor() {
        let e = ParallelDims::new(4, 2, 3).unwrap_err().to_string();
        assert!(
            e.contains("parallel.dp = 2") && e.contains("parallel.pp = 3") && e.contains("4"),
            "{e}"
        );
        let e = ParallelDims::new(5, 0, 2).unwrap_err().to_string();
        assert!(e.contains("parallel.pp = 2") && e.contains("5"), "{e}");
    }

    #[test]
    fn every_replica_needs_a_microbatch() {
        let cfg = TrainConfig::from_toml_str(
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
