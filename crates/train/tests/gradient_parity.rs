//! One step of gradient synchronisation on N in-process ranks against a single-process reference.

use std::sync::Arc;
use std::time::Duration;

use lockstep_comm::inproc::in_process_group;
use lockstep_comm::Communicator;
use lockstep_data::{assign, load_digits_embedded, microbatches, Sampler};
use lockstep_model::{Model, ModelSpec};
use lockstep_train::grad_sync::GradSync;

const GLOBAL: usize = 64;
const MICRO: usize = 8;

fn spec() -> ModelSpec {
    ModelSpec::Mlp {
        input: 64,
        hidden: vec![32],
        classes: 10,
    }
}

/// Run GradSync for step 0 on `world` threads; returns (gradient, loss) as seen by rank 0, and
/// checks every rank got the same bits.
fn synced_gradient(world: usize, reproducible: bool) -> (Vec<f32>, f64) {
    let data = load_digits_embedded().unwrap();
    let batch = Sampler::new(data.len(), GLOBAL, 1).unwrap().global_batch(0);
    let pieces = microbatches(&batch, MICRO);
    let results: Vec<(Vec<f32>, f64)> = std::thread::scope(|s| {
        let handles: Vec<_> = in_process_group(world)
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let (data, pieces) = (&data, &pieces);
                s.spawn(move || {
                    // One model per rank thread, as in real workers: burn's autodiff graph is not
                    // meant to be driven from several threads at once (it can deadlock).
                    let model = Model::new(&spec(), 3).unwrap();
                    let mut comm = Communicator::new(Arc::new(t), Duration::from_secs(10));
                    let mine = assign(pieces.len(), world, rank);
                    let (mut x, mut y) = (Vec::new(), Vec::new());
                    let mut grads = Vec::new();
                    let mut losses = Vec::new();
                    for k in mine {
                        data.gather(pieces[k], &mut x, &mut y);
                        let mut g = vec![0f32; model.num_params()];
                        losses.push(
                            model
                                .loss_and_grad(&x, &y, pieces[k].len(), 1.0 / GLOBAL as f32, &mut g)
                                .unwrap(),
                        );
                        grads.push(g);
                    }
                    let refs: Vec<&[f32]> = grads.iter().map(|g| g.as_slice()).collect();
                    let mut out = vec![0f32; model.num_params()];
                    let mut sync = GradSync::new(reproducible, 1000);
                    let (loss, _) = sync
                        .sync(&mut comm, &refs, &losses, pieces.len(), &mut out)
                        .unwrap();
                    (out, loss)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, res) in results.iter().enumerate() {
        assert_eq!(res.0, results[0].0, "rank {r} got a different gradient");
        assert_eq!(
            res.1.to_bits(),
            results[0].1.to_bits(),
            "rank {r} got a different loss"
        );
    }
    results.into_iter().next().unwrap()
}

#[test]
fn synced_gradient_matches_single_process_full_batch() {
    let data = load_digits_embedded().unwrap();
    let batch = Sampler::new(data.len(), GLOBAL, 1).unwrap().global_batch(0);
    let model = Model::new(&spec(), 3).unwrap();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    data.gather(&batch, &mut x, &mut y);
    let mut reference = vec![0f32; model.num_params()];
    let ref_loss = model
        .loss_and_grad(&x, &y, GLOBAL, 1.0 / GLOBAL as f32, &mut reference)
        .unwrap();
    let gmax = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(gmax > 0.0);

    for world in [1, 2, 3, 5, 8] {
        for reproducible in [true, false] {
            let (g, loss) = synced_gradient(world, reproducible);
            let worst = g
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= 1e-5 * gmax,
                "world {world} reproducible={reproducible}: max |Δg| {worst} vs max |g| {gmax}"
            );
            assert!(
                (loss - ref_loss as f64).abs() < 1e-5,
                "loss {loss} vs {ref_loss}"
            );
        }
    }
}

#[test]
fn reproducible_gradient_bits_do_not_depend_on_world_size() {
    let (one, loss1) = synced_gradient(1, true);
    for world in [2, 3, 4, 7, 8, 11] {
        let (g, loss) = synced_gradient(world, true);
        assert_eq!(g, one, "world {world}");
        assert_eq!(loss.to_bits(), loss1.to_bits(), "world {world}");
    }
}
