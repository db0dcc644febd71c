//! Fixtures shared by the plan tests: a relative float comparison and small workloads.

use super::stages::StageSize;
use super::{Layer, Workload};

pub(super) fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-12)
}

/// The whole model of `w` as one stage of one layer.
pub(super) fn whole(w: &Workload) -> StageSize {
    StageSize {
        params: w.params,
        buckets: w.params.div_ceil(w.bucket_elems),
    }
}

pub(super) fn workload(params: usize) -> Workload {
    Workload {
        params,
        microbatches: 4,
        microbatch: 64,
        reproducible: true,
        overlap: false,
        bucket_elems: 1 << 16,
        algorithm: lockstep_comm::Algorithm::Auto,
        small_message_threshold: 256 * 1024,
        segment_bytes: 512 * 1024,
        layers: vec![Layer {
            name: "mlp".into(),
            params,
            activation_bytes_per_sample: 0,
            held_activation_bytes_per_sample: 0,
            tp_split_params: 0,
        }],
        optimizer_vectors: 2,
        zero: 0,
        schedule: lockstep_run::config::ScheduleKind::OneFOneB,
        tp_pieces: 1,
        shared_memory: false,
        recompute: false,
        clipped: false,
    }
}

pub(super) fn pipeline_workload(layers: usize, act: usize) -> Workload {
    Workload {
        microbatches: 8,
        microbatch: 4,
        layers: (0..layers)
            .map(|i| Layer {
                name: format!("l{i}"),
                params: 1000,
                activation_bytes_per_sample: if i + 1 == layers { 0 } else { act },
                held_activation_bytes_per_sample: 0,
                tp_split_params: 0,
            })
            .collect(),
        ..workload(1000 * layers)
    }
}
