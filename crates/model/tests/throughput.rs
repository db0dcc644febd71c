//! Throughput of loss_and_grad on MLP 784-512-512-10 (prints, asserts nothing about speed).
//! Ignored by default because it takes a few seconds; run with
//! `cargo test -p lockstep-model --test throughput -- --ignored --nocapture`
//! (dependencies are built with opt-level 3 even in the dev profile).

mod common;

use lockstep_model::{Model, ModelSpec, Optimizer, OptimizerSpec};
use std::time::Instant;

/// CPU time of the calling thread: on a shared machine it excludes time other processes held
/// the core, so samples per CPU-second is comparable across loads.
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

#[test]
#[ignore]
fn mlp_784_512_512_10_throughput() {
    let spec = ModelSpec::Mlp {
        input: 784,
        hidden: vec![512, 512],
        classes: 10,
    };
    let mut m = Model::new(&spec, 1).unwrap();
    let mut g = vec![0.0; m.num_params()];
    let x = common::noise(1, 128 * 784);
    let y = common::labels(2, 128, 10);
    let measure = |label: &str, g: &mut [f32]| {
        for batch in [128usize, 64, 32] {
            let iters = 4096 / batch;
            // Warm up allocator pools and caches.
            for _ in 0..3 {
                m.loss_and_grad(&x[..batch * 784], &y[..batch], batch, 1.0, g)
                    .unwrap();
            }
            let (t, cpu) = (Instant::now(), thread_cpu_seconds());
            for _ in 0..iters {
                m.loss_and_grad(&x[..batch * 784], &y[..batch], batch, 1.0, g)
                    .unwrap();
            }
            let dt = t.elapsed().as_secs_f64();
            let dcpu = thread_cpu_seconds() - cpu;
            println!(
                "{label}: loss_and_grad batch {batch:3}: {:6.0} samples/s wall, \
                 {:6.0} per CPU-second ({:.2} ms per call)",
                (iters * batch) as f64 / dt,
                (iters * batch) as f64 / dcpu,
                dt * 1e3 / iters as f64
            );
        }
    };
    measure("default allocator", &mut g);
    let tuned = lockstep_model::tune_allocator_for_training();
    measure(&format!("tuned allocator ({tuned})"), &mut g);
    // Streaming: when does each gradient arrive, relative to the whole call?
    for _ in 0..3 {
        let start = Instant::now();
        let arrivals = std::sync::Mutex::new(Vec::new());
        m.loss_and_grad_streaming(&x, &y, 128, 1.0, &|i, _| {
            arrivals
                .lock()
                .unwrap()
                .push((i, start.elapsed().as_secs_f64() * 1e3));
        })
        .unwrap();
        let total = start.elapsed().as_secs_f64() * 1e3;
        let arrivals = arrivals.into_inner().unwrap();
        let text: Vec<String> = arrivals
            .iter()
            .map(|(i, t)| format!("#{i}@{t:.2}"))
            .collect();
        println!(
            "streaming batch 128: total {total:.2} ms; arrivals (ms) {}",
            text.join(" ")
        );
    }
    // The rest of a training step: flat copies in and out, and the optimizer.
    let mut o = Optimizer::new(
        &OptimizerSpec::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
        },
        m.num_params(),
    );
    let mut p = m.params_flat();
    let iters = 50;
    let t = Instant::now();
    for _ in 0..iters {
        p = m.params_flat();
    }
    let read = t.elapsed().as_secs_f64() / iters as f64;
    let t = Instant::now();
    for _ in 0..iters {
        m.set_params_flat(&p).unwrap();
    }
    let write = t.elapsed().as_secs_f64() / iters as f64;
    let t = Instant::now();
    for _ in 0..iters {
        o.step(&mut p, &g, 0.01);
    }
    let step = t.elapsed().as_secs_f64() / iters as f64;
    println!(
        "{} params: params_flat {:.3} ms, set_params_flat {:.3} ms, sgd step {:.3} ms",
        m.num_params(),
        read * 1e3,
        write * 1e3,
        step * 1e3
    );
    let t = Instant::now();
    for _ in 0..20 {
        m.evaluate(&x, &y, 128).unwrap();
    }
    println!(
        "evaluate batch 128: {:.0} samples/s",
        20.0 * 128.0 / t.elapsed().as_secs_f64()
    );
}
