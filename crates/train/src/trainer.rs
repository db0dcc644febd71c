//! Training a job: build it, make its parallel plan from what the built model can do, and run the
//! one training loop (`pipeline/train.rs`) — a layered model cut into stages, or a model trained
//! whole as a one-stage schedule (`pipeline/flat.rs`).

use crate::config::TrainConfig;
use crate::context::{JobLabel, WorkerContext};
use crate::error::TrainError;
use crate::job::{catch_job_panic, JobSpec, Trainable};
use crate::metrics::Summary;
use crate::pipeline::flat::FlatModel;
use lockstep_run::{ModelShape, ParallelPlan};

/// Train `job` according to `cfg` as one rank of `ctx.comm`. Returns the summary (complete on
/// rank 0; other ranks return it too, with the same global figures).
pub fn train<'a>(
    job: &dyn JobSpec,
    cfg: &'a TrainConfig,
    ctx: WorkerContext<'a>,
) -> Result<Summary, TrainError> {
    let name = job.name();
    let built =
        catch_job_panic(|| job.build(cfg, &ctx.device)).map_err(|p| TrainError::JobSetup {
            job: name.clone(),
            message: format!("opening the job panicked: {p}"),
        })??;
    // The plan, again from what the built model can do (the launcher made it from what the job
    // declared): every capability rule is `ParallelPlan`'s.
    let declared = job.shape(cfg);
    let shape = match &built {
        Trainable::Layered(model) => ModelShape::Layered {
            layers: Some(model.num_layers()),
            tp_pieces: Some(model.tp_pieces()),
            pieces_from: match &declared {
                ModelShape::Layered { pieces_from, .. } if !pieces_from.is_empty() => {
                    pieces_from.clone()
                }
                _ => format!("job `{name}`'s tensor-parallel layers"),
            },
            recomputes: matches!(
                declared,
                ModelShape::Layered {
                    recomputes: true,
                    ..
                }
            ),
            bf16_products: declared.bf16_products(),
        },
        Trainable::Replica(replica) => match declared {
            ModelShape::Flat {
                to_layer,
                bf16_products,
                ..
            } => ModelShape::Flat {
                streams_gradients: replica.streams_gradients(),
                to_layer,
                bf16_products,
            },
            layered => layered,
        },
    };
    let plan = ParallelPlan::new(cfg, ctx.comm.size(), &shape)?;
    let label = JobLabel {
        name: name.clone(),
        sections: job.config_sections(),
    };
    match built {
        // Layered model: the pipeline loop (one stage when parallel.pp = 1).
        Trainable::Layered(model) => crate::pipeline::train::train(&*model, cfg, &plan, ctx, label),
        // Data parallelism is a schedule of one stage: the replica as a one-layer model.
        Trainable::Replica(replica) => {
            let model = FlatModel::new(&name, replica)?;
            crate::pipeline::train::train(&model, cfg, &plan, ctx, label)
        }
    }
}
