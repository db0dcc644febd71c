//! Train your own burn model across N workers with lockstep's library API.
//!
//! The model below is ordinary single-device burn code. Distribution is applied from outside:
//! - `lockstep_model::flat` turns any burn `Module` into a flat `Vec<f32>` of parameters and
//!   gradients (canonical declaration order; never burn's per-process `ParamId`s);
//! - `lockstep_data` gives the fixed global batch, fixed micro-batches and each rank's share;
//! - `lockstep_comm` broadcasts the initial parameters and sums the micro-batch gradients exactly
//!   (`ExactReducer`), so the result does not depend on the number of workers.
//!
//! Workers here are threads on the in-process transport, to keep the example self-contained; in a
//! real job each worker is a process and the communicator sits on `ShmTransport` or `TcpTransport`
//! (what `lockstep train` sets up for you).
//!
//! Run: `cargo run --release -p lockstep-train --example custom_model`
//! Expected: one line per world size 1, 2 and 3, all with the same parameter hash, and test
//! accuracy above 0.90 (see examples/README.md).

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::{log_softmax, relu};
use burn::tensor::{Device, Int, Tensor, TensorData};
use lockstep_comm::exact::ExactReducer;
use lockstep_comm::inproc::in_process_group;
use lockstep_comm::Communicator;
use lockstep_data::{
    assign, load_digits_embedded, microbatches, split_train_test, Dataset, Sampler,
};
use lockstep_model::flat;

/// Your model: nothing lockstep-specific in it.
#[derive(Module, Debug)]
struct TwoLayer {
    hidden: Linear,
    out: Linear,
}

impl TwoLayer {
    fn new(device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(64, 48).init(device),
            out: LinearConfig::new(48, 10).init(device),
        }
    }
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out.forward(relu(self.hidden.forward(x)))
    }
}

const GLOBAL_BATCH: usize = 64;
const MICROBATCH: usize = 16;
const STEPS: u64 = 200;
const LR: f32 = 0.2;

fn batch_tensors(data: &Dataset, idx: &[u32], device: &Device) -> (Tensor<2>, Tensor<2, Int>) {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    data.gather(idx, &mut x, &mut y);
    let n = idx.len();
    let x = Tensor::from_data(TensorData::new(x, [n, data.dim()]), device);
    let y = Tensor::<2, Int>::from_data(
        TensorData::new(y.iter().map(|&l| l as i64).collect::<Vec<_>>(), [n, 1]),
        device,
    );
    (x, y)
}

/// One worker's whole training run. Returns (parameter hash, test accuracy).
fn worker(
    mut comm: Communicator,
    initial: &[f32],
    train: &Dataset,
    test: &Dataset,
) -> (String, f64) {
    let device = Device::flex().autodiff();
    // Every rank builds the model; rank 0's initial values are broadcast to all.
    let mut model = TwoLayer::new(&device);
    let n_params: usize = flat::layout(&model).iter().map(|p| p.len).sum();
    let mut params = if comm.rank() == 0 {
        initial.to_vec()
    } else {
        vec![0f32; n_params]
    };
    comm.broadcast(&mut params, 0)
        .expect("broadcast initial parameters");
    model = flat::write(model, &params, &device);

    let sampler = Sampler::new(train.len(), GLOBAL_BATCH, 7).expect("sampler");
    let mut reducer = ExactReducer::new(1 << 16);
    let mut total = vec![0f32; n_params];
    for step in 0..STEPS {
        let batch = sampler.global_batch(step);
        let pieces = microbatches(&batch, MICROBATCH);
        // This rank's micro-batch gradients, each of sum-loss / GLOBAL_BATCH.
        let mut grads = Vec::new();
        for k in assign(pieces.len(), comm.size(), comm.rank()) {
            let (x, y) = batch_tensors(train, pieces[k], &device);
            let loss = log_softmax(model.forward(x), 1)
                .gather(1, y)
                .sum()
                .mul_scalar(-1.0 / GLOBAL_BATCH as f32);
            let mut g = vec![0f32; n_params];
            flat::read_grads(&model, loss.backward(), &mut g);
            grads.push(g);
        }
        let parts: Vec<&[f32]> = grads.iter().map(|g| g.as_slice()).collect();
        reducer
            .reduce(&mut comm, &parts, pieces.len(), &mut total)
            .expect("exact gradient sum");
        // Plain SGD on the flat vector: the same bits on every rank, so replicas never drift.
        for (p, g) in params.iter_mut().zip(&total) {
            *p -= LR * g;
        }
        model = flat::write(model, &params, &device);
    }

    let all: Vec<u32> = (0..test.len() as u32).collect();
    let (x, y) = batch_tensors(test, &all, &device);
    let predicted = model.forward(x).argmax(1);
    let correct: i64 = predicted.equal(y).int().sum().into_scalar();
    (
        lockstep_model::param_hash(&params),
        correct as f64 / test.len() as f64,
    )
}

fn main() {
    let (train, test) = split_train_test(load_digits_embedded().expect("embedded digits"), 0.2, 1);
    // A seeded initialisation, made once: the same starting point for every world size.
    let device = Device::flex();
    device.seed(42);
    let init_model = TwoLayer::new(&device);
    let initial = flat::read(
        &init_model,
        flat::layout(&init_model).iter().map(|p| p.len).sum(),
    );
    for world in 1..=3 {
        let results: Vec<(String, f64)> = std::thread::scope(|s| {
            let handles: Vec<_> = in_process_group(world)
                .into_iter()
                .map(|t| {
                    let comm = Communicator::new(Arc::new(t), Duration::from_secs(30));
                    let (initial, train, test) = (&initial, &train, &test);
                    s.spawn(move || worker(comm, initial, train, test))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("worker panicked"))
                .collect()
        });
        let (hash, accuracy) = &results[0];
        assert!(results.iter().all(|r| &r.0 == hash), "replicas diverged");
        println!(
            "world size {world}: param hash {}…, test accuracy {accuracy:.3}",
            &hash[..16]
        );
    }
}
