//! Gradient synchronisation overlapped with backward ([`GradSync::sync_overlapped`]) against the
//! synchronisation after backward ([`GradSync::sync`]), on in-process ranks: same bits, errors
//! instead of hangs.

use lockstep_train::ConfigLoad;
use std::sync::Arc;
use std::time::Duration;

use lockstep_comm::exact::{ExactError, ExactReducer};
use lockstep_comm::inproc::in_process_group;
use lockstep_comm::{CommError, Communicator, LinkFailure};
use lockstep_data::{assign, load_digits_embedded, microbatches, Dataset, Sampler};
use lockstep_model::{Model, ModelError, ModelSpec};
use lockstep_train::grad_sync::{GradSync, LastMicrobatch, SyncError};
use lockstep_train::{train, TrainConfig, WorkerContext};

/// 4 micro-batches: a world of 5 has a rank without any.
const GLOBAL: usize = 32;
const MICRO: usize = 8;
/// Communicator timeout where a test must not depend on it: long enough never to fire on a
/// loaded machine, so only a hang (a regression) would reach it.
const HANG_GUARD: Duration = Duration::from_secs(120);
/// Small buckets, so that the 2778 parameters make 10 buckets, several of them straddling tensors.
const BUCKET: usize = 300;

fn spec() -> ModelSpec {
    ModelSpec::Mlp {
        input: 64,
        hidden: vec![32, 16],
        classes: 10,
    }
}

fn comms(world: usize, timeout: Duration) -> Vec<Communicator> {
    in_process_group(world)
        .into_iter()
        .map(|t| Communicator::new(Arc::new(t), timeout))
        .collect()
}

/// Gradient and loss of one step as seen by one rank.
struct RankResult {
    grad: Vec<f32>,
    loss: f64,
}

/// One synchronisation of step 0 on `world` in-process ranks, overlapped or not. Checks that every
/// rank ends with the same bits and returns rank 0's result.
fn one_step(world: usize, reproducible: bool, overlap: bool) -> RankResult {
    let data = load_digits_embedded().unwrap();
    let batch = Sampler::new(data.len(), GLOBAL, 7).unwrap().global_batch(0);
    let pieces = microbatches(&batch, MICRO);
    let results: Vec<RankResult> = std::thread::scope(|s| {
        let handles: Vec<_> = comms(world, Duration::from_secs(20))
            .into_iter()
            .map(|mut comm| {
                let (data, pieces) = (&data, &pieces);
                s.spawn(move || {
                    // One model per rank, as in separate processes: burn's autodiff merges the graphs
                    // of threads that share parameter tensors, and can then deadlock (its graph and
                    // global locks are taken in opposite orders by backward and by op registration).
                    let model = Model::new(&spec(), 11).unwrap();
                    assert!(
                        model.num_params() > 9 * BUCKET,
                        "the model must span several buckets"
                    );
                    rank_step(&mut comm, data, pieces, &model, reproducible, overlap)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, res) in results.iter().enumerate() {
        assert!(
            res.grad == results[0].grad,
            "world {world}: rank {r} got a different gradient"
        );
        assert_eq!(
            res.loss.to_bits(),
            results[0].loss.to_bits(),
            "world {world}: rank {r} got a different loss"
        );
    }
    results.into_iter().next().unwrap()
}

fn rank_step(
    comm: &mut Communicator,
    data: &Dataset,
    pieces: &[&[u32]],
    model: &Model,
    reproducible: bool,
    overlap: bool,
) -> RankResult {
    let mine = assign(pieces.len(), comm.size(), comm.rank());
    let scale = 1.0 / GLOBAL as f32;
    let mut sync = GradSync::new(reproducible, BUCKET);
    let mut grads = vec![vec![0f32; model.num_params()]; mine.len()];
    let mut out = vec![0f32; model.num_params()];
    let (mut x, mut y) = (Vec::new(), Vec::new());
    let mut losses = Vec::new();
    if !overlap {
        for (slot, k) in mine.clone().enumerate() {
            data.gather(pieces[k], &mut x, &mut y);
            losses.push(
                model
                    .loss_and_grad(&x, &y, pieces[k].len(), scale, &mut grads[slot])
                    .unwrap(),
            );
        }
        let refs: Vec<&[f32]> = grads.iter().map(|g| g.as_slice()).collect();
        let (loss, timing) = sync
            .sync(comm, &refs, &losses, pieces.len(), &mut out)
            .unwrap();
        assert_eq!(timing.overlapped_communication, 0.0);
        return RankResult { grad: out, loss };
    }
    // Overlapped: all but the last local micro-batch beforehand, the last one streamed.
    let streamed = usize::from(!mine.is_empty());
    let (earlier, rest) = grads.split_at_mut(mine.len() - streamed);
    for (slot, k) in mine.clone().enumerate().take(earlier.len()) {
        data.gather(pieces[k], &mut x, &mut y);
        losses.push(
            model
                .loss_and_grad(&x, &y, pieces[k].len(), scale, &mut earlier[slot])
                .unwrap(),
        );
    }
    let last = rest.first_mut().map(|grad| {
        let k = mine.end - 1;
        data.gather(pieces[k], &mut x, &mut y);
        LastMicrobatch {
            x: &x,
            y: &y,
            n: pieces[k].len(),
            scale,
            grad,
        }
    });
    let earlier: Vec<&[f32]> = earlier.iter().map(|g| g.as_slice()).collect();
    let o = sync
        .sync_overlapped(comm, model, &earlier, &losses, last, pieces.len(), &mut out)
        .unwrap();
    let t = o.timing;
    for v in [
        t.waiting,
        t.communication,
        t.overlapped_communication,
        o.forward,
        o.backward,
    ] {
        assert!(
            v.is_finite() && v >= 0.0,
            "timing {t:?}, forward {}, backward {}",
            o.forward,
            o.backward
        );
    }
    if mine.is_empty() {
        assert_eq!(
            (o.forward, o.backward),
            (0.0, 0.0),
            "no micro-batch, no compute time"
        );
    } else {
        assert!(
            o.forward > 0.0 && o.backward > 0.0,
            "forward {} backward {}",
            o.forward,
            o.backward
        );
    }
    RankResult {
        grad: out,
        loss: o.loss,
    }
}

#[test]
fn overlapped_sync_gives_the_bits_of_the_sync_after_backward() {
    let reference = one_step(1, true, false);
    let gmax = reference.grad.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(gmax > 0.0);
    for world in [1, 2, 3, 5] {
        // Reproducible: the same bits with or without overlap, and for every world size.
        let plain = one_step(world, true, false);
        let overlapped = one_step(world, true, true);
        assert!(
            overlapped.grad == plain.grad,
            "world {world}: overlap changed the reproducible gradient"
        );
        assert!(
            overlapped.grad == reference.grad,
            "world {world}: differs from world 1"
        );
        assert_eq!(
            overlapped.loss.to_bits(),
            reference.loss.to_bits(),
            "world {world}: loss"
        );

        // Plain f32 mode: the same additions in the same order per bucket, so also the same bits at
        // a fixed world size; across world sizes only close.
        let plain = one_step(world, false, false);
        let overlapped = one_step(world, false, true);
        assert!(
            overlapped.grad == plain.grad,
            "world {world}: overlap changed the plain-mode gradient"
        );
        let worst = overlapped
            .grad
            .iter()
            .zip(&reference.grad)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-5 * gmax,
            "world {world}: plain mode off by {worst} (max |g| {gmax})"
        );
        assert!(
            (overlapped.loss - reference.loss).abs() <= 1e-6 * reference.loss.abs(),
            "world {world}: loss"
        );
    }
}

#[test]
fn buckets_are_reduced_while_backward_runs() {
    // World 1 (no peer to wait for) and a model whose first layer's backward takes milliseconds:
    // buckets 7..=10 hold only layers 1 and 2, complete long before layer 0's gradient, so the
    // communication thread must have reduced some of them before backward ended.
    let model = Model::new(
        &ModelSpec::Mlp {
            input: 784,
            hidden: vec![512, 512],
            classes: 10,
        },
        5,
    )
    .unwrap();
    let n = 64;
    let x: Vec<f32> = (0..n * 784)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0)
        .collect();
    let y: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
    let mut grad = vec![0f32; model.num_params()];
    let mut out = vec![0f32; model.num_params()];
    let mut comm = comms(1, Duration::from_secs(30)).pop().unwrap();
    let mut sync = GradSync::new(true, 1 << 16);
    // On one compute thread, as a worker at --threads-per-worker 1: with the test process's
    // default pool, gemm's threads took both cores and backward could end before the
    // communication thread ran at all.
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    // Whether the communication thread gets a core before backward ends is up to the scheduler
    // (other tests of this process run beside it): a few tries, one must overlap.
    let mut timings = Vec::new();
    for _ in 0..5 {
        let last = LastMicrobatch {
            x: &x,
            y: &y,
            n,
            scale: 1.0 / n as f32,
            grad: &mut grad,
        };
        let o = one_thread
            .install(|| sync.sync_overlapped(&mut comm, &model, &[], &[], Some(last), 1, &mut out))
            .unwrap();
        timings.push(o.timing);
        if o.timing.overlapped_communication > 0.0 {
            break;
        }
    }
    assert!(
        timings.last().unwrap().overlapped_communication > 0.0,
        "nothing overlapped in {} tries: {timings:?}",
        timings.len()
    );
    // One micro-batch on one rank: the reduced gradient is that micro-batch's gradient.
    let mut direct = vec![0f32; model.num_params()];
    model
        .loss_and_grad(&x, &y, n, 1.0 / n as f32, &mut direct)
        .unwrap();
    assert!(
        grad == direct,
        "the streamed gradient differs from loss_and_grad's"
    );
    let worst = out
        .iter()
        .zip(&direct)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let gmax = direct.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(worst <= gmax * 1e-6, "reduced gradient off by {worst}");
}

/// Values of very different magnitudes per bucket, an all-zero bucket and a short last bucket.
fn parts_for(rank: usize, parts: usize, len: usize) -> Vec<Vec<f32>> {
    (0..parts)
        .map(|p| {
            (0..len)
                .map(|i| {
                    let bucket = i / 100;
                    if bucket == 2 {
                        return 0.0;
                    }
                    let v = ((i * 31 + p * 17 + rank * 7) as f32 * 0.37).sin();
                    v * 10f32.powi((bucket % 5) as i32 * 3 - 6)
                })
                .collect()
        })
        .collect()
}

#[test]
fn per_bucket_exact_reduction_equals_the_whole_vector_reduction() {
    const LEN: usize = 750; // buckets of 100: the last one has 50 values
    for world in [1, 2, 3] {
        let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = comms(world, Duration::from_secs(20))
                .into_iter()
                .enumerate()
                .map(|(rank, mut comm)| {
                    s.spawn(move || {
                        let owned = parts_for(rank, 2, LEN);
                        let parts: Vec<&[f32]> = owned.iter().map(|p| p.as_slice()).collect();
                        let total = 2 * world;
                        let mut reducer = ExactReducer::new(100);
                        let mut whole = vec![0f32; LEN];
                        reducer
                            .reduce(&mut comm, &parts, total, &mut whole)
                            .unwrap();
                        // Buckets from the highest offset down, as the overlapped schedule runs them.
                        let mut by_bucket = vec![f32::NAN; LEN];
                        let ranges: Vec<(usize, usize)> = reducer.buckets(LEN).collect();
                        for &(s, e) in ranges.iter().rev() {
                            reducer
                                .reduce_bucket(&mut comm, &parts, total, s..e, &mut by_bucket)
                                .unwrap();
                        }
                        // A range that is not one of the buckets is refused before any collective.
                        let err = reducer
                            .reduce_bucket(&mut comm, &parts, total, 50..150, &mut by_bucket)
                            .unwrap_err();
                        assert!(matches!(err, ExactError::Invalid(_)), "{err}");
                        let err = reducer
                            .reduce_bucket(&mut comm, &parts, total, 700..760, &mut by_bucket)
                            .unwrap_err();
                        assert!(err.to_string().contains("700..760"), "{err}");
                        (whole, by_bucket)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (whole, by_bucket) in &results {
            let a: Vec<u32> = whole.iter().map(|v| v.to_bits()).collect();
            let b: Vec<u32> = by_bucket.iter().map(|v| v.to_bits()).collect();
            assert_eq!(a, b, "world {world}");
            assert!(whole[200..300].iter().all(|&v| v == 0.0));
            assert!(whole[..200].iter().any(|&v| v != 0.0));
        }
    }
}

#[test]
fn a_dropped_peer_is_an_error_not_a_hang() {
    let data = load_digits_embedded().unwrap();
    let batch = Sampler::new(data.len(), GLOBAL, 7).unwrap().global_batch(0);
    let pieces = microbatches(&batch, MICRO);
    let model = &Model::new(&spec(), 11).unwrap();
    let pieces = &pieces;
    // Rank 1 takes part in the first bucket's collectives, then its transport goes away, while
    // rank 0 is (or soon will be) in the middle of its streaming backward.
    for peer_buckets in [0usize, 1] {
        // The timeout is only a hang guard: the test requires the failure to be the peer's
        // disconnection, which a timeout is not.
        let mut group = comms(2, HANG_GUARD);
        let mut peer = group.pop().unwrap();
        let mut comm = group.pop().unwrap();
        let result = std::thread::scope(|s| {
            s.spawn(move || {
                let mut reducer = ExactReducer::new(BUCKET);
                let zeros = vec![0f32; model.num_params()];
                let mut out = vec![0f32; model.num_params()];
                let ranges: Vec<(usize, usize)> = reducer.buckets(out.len()).collect();
                for &(s, e) in ranges.iter().rev().take(peer_buckets) {
                    reducer
                        .reduce_bucket(&mut peer, &[&zeros[..]], pieces.len(), s..e, &mut out)
                        .unwrap();
                }
                drop(peer);
            });
            let (mut x, mut y) = (Vec::new(), Vec::new());
            data.gather(pieces[0], &mut x, &mut y);
            let mut grad = vec![0f32; model.num_params()];
            let mut out = vec![0f32; model.num_params()];
            let last = LastMicrobatch {
                x: &x,
                y: &y,
                n: pieces[0].len(),
                scale: 1.0 / GLOBAL as f32,
                grad: &mut grad,
            };
            GradSync::new(true, BUCKET).sync_overlapped(
                &mut comm,
                model,
                &[],
                &[],
                Some(last),
                pieces.len(),
                &mut out,
            )
        });
        match result {
            Err(SyncError::Exact(ExactError::Comm(CommError::Op { link, .. }))) => {
                assert!(
                    matches!(link.failure, LinkFailure::Closed) && link.peer == 1,
                    "after {peer_buckets} bucket(s): the dropped peer must be noticed as closed, \
                     not waited for: {link}"
                );
            }
            other => panic!(
                "after {peer_buckets} bucket(s): expected a communication error, got {other:?}"
            ),
        }
        assert!(
            comm.broken().is_some(),
            "the communicator must refuse further use"
        );
    }
}

#[test]
fn a_failing_backward_is_reported_and_stops_the_communication_thread() {
    let data = load_digits_embedded().unwrap();
    let model = Model::new(&spec(), 11).unwrap();
    let mut comm = comms(1, HANG_GUARD).pop().unwrap();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    data.gather(&[0, 1, 2], &mut x, &mut y);
    y[1] = 200; // no such class: forward refuses the batch
    let mut grad = vec![0f32; model.num_params()];
    let mut out = vec![0f32; model.num_params()];
    let last = LastMicrobatch {
        x: &x,
        y: &y,
        n: 3,
        scale: 1.0,
        grad: &mut grad,
    };
    // Returning at all proves the communication thread stopped: sync_overlapped joins it, and on
    // a world of one it has no peer whose timeout could end it otherwise (HANG_GUARD only keeps
    // a regression from hanging the suite).
    let err = GradSync::new(true, BUCKET)
        .sync_overlapped(&mut comm, &model, &[], &[], Some(last), 1, &mut out)
        .unwrap_err();
    assert!(
        matches!(
            err,
            SyncError::Model(ModelError::LabelOutOfRange { index: 1, .. })
        ),
        "{err:?}"
    );
    assert!(
        comm.broken().is_none(),
        "a model error is not a communication failure"
    );
}

/// Whole training runs on in-process ranks: the parameters after a few steps do not depend on the
/// switch, nor (reproducible mode) on the world size. The digits MLP (64-128-64-10) has 17226
/// parameters, the first layer's weight 8192.
#[test]
fn training_with_and_without_overlap_ends_with_the_same_parameters() {
    let run = |world: usize, overlap: bool, bucket_elems: usize| -> String {
        let cfg = TrainConfig::from_toml_str(
            "",
            "test",
            &[
                "train.steps=4".into(),
                "train.eval_every=0".into(),
                format!("dist.bucket_elems={bucket_elems}"),
                format!("dist.overlap={overlap}"),
            ],
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let summaries: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = comms(world, Duration::from_secs(30))
                .into_iter()
                .map(|mut comm| {
                    let (cfg, dir) = (&cfg, dir.path());
                    s.spawn(move || {
                        let mut on_event = |_| {};
                        let ctx = WorkerContext {
                            comm: &mut comm,
                            host: "test".into(),
                            device: lockstep_train::device::Placement::cpu(),
                            out_dir: dir,
                            on_event: &mut on_event,
                            resume: false,
                            faults: &[],
                        };
                        train(&lockstep_train::BuiltinJob, cfg, ctx)
                            .unwrap()
                            .param_hash
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(summaries.iter().all(|h| h == &summaries[0]));
        summaries[0].clone()
    };
    // 2000-value buckets: 9 buckets, the upper 4 early (overlapped with the first layer's backward).
    let reference = run(1, false, 2000);
    assert_eq!(run(1, true, 2000), reference);
    assert_eq!(run(3, true, 2000), reference);
    assert_eq!(run(3, false, 2000), reference);
    // The default bucket size holds the whole digits MLP: no early bucket, so the overlapped
    // schedule falls back to the one after backward; the parameters do not depend on that either.
    let one_bucket = run(2, false, 65536);
    assert_eq!(run(2, true, 65536), one_bucket);
    assert_eq!(run(1, true, 65536), one_bucket);
}
