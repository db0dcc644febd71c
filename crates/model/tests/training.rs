//! Optimizers against closed forms, the learning-rate schedule, and short training runs.

mod common;

use common::blobs;
use lockstep_model::{LrSchedule, Model, ModelSpec, Optimizer, OptimizerSpec};

fn close(a: f32, b: f64) -> bool {
    (a as f64 - b).abs() <= 1e-6 * b.abs().max(1.0)
}

#[test]
fn sgd_matches_closed_form() {
    let plain = OptimizerSpec::Sgd {
        momentum: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    let mut o = Optimizer::new(&plain, 2);
    assert!(o.state().is_empty());
    let mut p = [1.0f32, -2.0];
    o.step(&mut p, &[0.5, 0.25], 0.1);
    assert!(close(p[0], 0.95) && close(p[1], -2.025));
    assert_eq!(o.steps_taken(), 1);

    // Momentum 0.9: buf1 = g, p1 = 1 - 0.1*0.5; buf2 = 0.9*0.5 + 0.5, p2 = p1 - 0.1*0.95.
    let heavy = OptimizerSpec::Sgd {
        momentum: 0.9,
        weight_decay: 0.0,
        nesterov: false,
    };
    let mut o = Optimizer::new(&heavy, 1);
    let mut p = [1.0f32];
    o.step(&mut p, &[0.5], 0.1);
    o.step(&mut p, &[0.5], 0.1);
    assert!(close(p[0], 0.855), "{}", p[0]);
    assert!(close(o.state()[0][0], 0.95));
    assert_eq!(o.state_names(), ["momentum"]);

    // Nesterov: step along g + 0.9 * buf = 0.5 + 0.45.
    let nesterov = OptimizerSpec::Sgd {
        momentum: 0.9,
        weight_decay: 0.0,
        nesterov: true,
    };
    let mut o = Optimizer::new(&nesterov, 1);
    let mut p = [1.0f32];
    o.step(&mut p, &[0.5], 0.1);
    assert!(close(p[0], 0.905), "{}", p[0]);

    // L2 weight decay 0.1 on p = 2: g = 0.5 + 0.2.
    let wd = OptimizerSpec::Sgd {
        momentum: 0.0,
        weight_decay: 0.1,
        nesterov: false,
    };
    let mut o = Optimizer::new(&wd, 1);
    let mut p = [2.0f32];
    o.step(&mut p, &[0.5], 0.1);
    assert!(close(p[0], 2.0 - 0.07), "{}", p[0]);
}

#[test]
fn adamw_matches_closed_form() {
    let spec = OptimizerSpec::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let mut o = Optimizer::new(&spec, 2);
    assert_eq!(o.state_names(), ["exp_avg", "exp_avg_sq"]);
    let (lr, g) = (0.1f64, [0.5f64, -2.0]);
    let mut p = [1.0f32, 3.0];
    o.step(&mut p, &[g[0] as f32, g[1] as f32], lr as f32);
    // First step: m_hat = g, v_hat = g^2, so p = p (1 - lr wd) - lr g / (|g| + eps).
    for k in 0..2 {
        let p0 = [1.0, 3.0][k];
        let want = p0 * (1.0 - lr * 0.01) - lr * g[k] / (g[k].abs() + 1e-8);
        assert!(close(p[k], want), "{k}: {} vs {want}", p[k]);
    }
    // Second step, same gradient: m = 0.19 g and 1 - 0.9^2 = 0.19, so m_hat = g; v_hat = g^2.
    let before = p;
    o.step(&mut p, &[g[0] as f32, g[1] as f32], lr as f32);
    for k in 0..2 {
        let want = before[k] as f64 * (1.0 - lr * 0.01) - lr * g[k] / (g[k].abs() + 1e-8);
        assert!(close(p[k], want), "{k}: {} vs {want}", p[k]);
    }
    assert_eq!(o.steps_taken(), 2);
    assert!(close(o.state()[0][0], 0.19 * 0.5));
    assert!(close(o.state()[1][1], (1.0 - 0.999f64.powi(2)) * 4.0));
}

#[test]
fn sharded_steps_equal_a_full_step_bitwise() {
    let specs = [
        OptimizerSpec::Sgd {
            momentum: 0.9,
            weight_decay: 1e-4,
            nesterov: true,
        },
        OptimizerSpec::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
    ];
    for spec in specs {
        let n = 1000;
        let grads: Vec<Vec<f32>> = (0..3).map(|s| common::noise(s, n)).collect();
        let mut full = Optimizer::new(&spec, n);
        let mut sharded = Optimizer::new(&spec, n);
        let (mut p_full, mut p_sharded) = (common::noise(9, n), common::noise(9, n));
        for g in &grads {
            full.step(&mut p_full, g, 0.01);
            for (lo, hi) in [(0, 333), (333, 334), (334, 1000)] {
                sharded.step_range(lo, &mut p_sharded[lo..hi], &g[lo..hi], 0.01);
            }
            sharded.finish_step();
        }
        assert!(p_full
            .iter()
            .zip(&p_sharded)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        for (a, b) in full.state().iter().zip(sharded.state()) {
            assert!(a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}

#[test]
fn lr_schedule_warms_up_then_follows_the_cosine() {
    let s = LrSchedule {
        base_lr: 1.0,
        warmup_steps: 10,
        total_steps: 110,
        min_lr: 0.1,
    };
    assert_eq!(s.lr(0), 0.1); // warmup start: base / warmup
    assert_eq!(s.lr(4), 0.5);
    assert_eq!(s.lr(9), 1.0); // warmup end
    assert_eq!(s.lr(10), 1.0); // cosine start
    assert!(close(s.lr(60), 0.55)); // half way: min + (base - min) / 2
    assert!(close(
        s.lr(35),
        0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos())
    ));
    assert!(s.lr(109) > 0.1 && s.lr(109) < 0.1003);
    assert_eq!(s.lr(110), 0.1); // end of the cosine
    assert_eq!(s.lr(1_000_000), 0.1);
    assert!((1..110).all(|t| s.lr(t) <= s.lr(t - 1) || t < 10));
    assert_eq!(LrSchedule::constant(0.3).lr(0), 0.3);
    assert_eq!(LrSchedule::constant(0.3).lr(77), 0.3);
}

/// Full-batch training on separable blobs; returns (initial mean loss, final mean loss,
/// final accuracy).
fn train(spec: &ModelSpec, opt: &OptimizerSpec, lr: f32, steps: usize) -> (f64, f64, f64) {
    let n = 96;
    let (x, y) = match spec {
        ModelSpec::Mlp { input, .. } => blobs(n, *input, spec.classes(), 3),
        ModelSpec::Cnn { .. } => {
            // Class c is a bright c-th quadrant of an 8x8 image, on top of noise.
            let d = spec.input_len();
            let eps = common::noise(4, n * d);
            let mut x = vec![0.0; n * d];
            let y: Vec<u8> = (0..n).map(|i| (i % 4) as u8).collect();
            for i in 0..n {
                for r in 0..8 {
                    for c in 0..8 {
                        let quadrant = (r / 4) * 2 + c / 4;
                        let on = if quadrant == y[i] as usize { 1.0 } else { 0.0 };
                        x[i * d + r * 8 + c] = on + 0.5 * eps[i * d + r * 8 + c];
                    }
                }
            }
            (x, y)
        }
    };
    let mut m = Model::new(spec, 1).unwrap();
    let mut o = Optimizer::new(opt, m.num_params());
    let mut p = m.params_flat();
    let mut g = vec![0.0; m.num_params()];
    let initial = m.evaluate(&x, &y, n).unwrap().0 / n as f64;
    for _ in 0..steps {
        m.loss_and_grad(&x, &y, n, 1.0 / n as f32, &mut g).unwrap();
        o.step(&mut p, &g, lr);
        m.set_params_flat(&p).unwrap();
    }
    let (sum, correct) = m.evaluate(&x, &y, n).unwrap();
    (initial, sum / n as f64, correct as f64 / n as f64)
}

#[test]
fn sgd_and_adamw_train_an_mlp() {
    let spec = ModelSpec::Mlp {
        input: 4,
        hidden: vec![16],
        classes: 4,
    };
    let sgd = OptimizerSpec::Sgd {
        momentum: 0.9,
        weight_decay: 0.0,
        nesterov: false,
    };
    let (l0, l1, acc) = train(&spec, &sgd, 0.1, 40);
    assert!(l1 < 0.1 * l0, "sgd: loss {l0} -> {l1}");
    assert!(acc >= 0.98, "sgd accuracy {acc}");
    let adamw = OptimizerSpec::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let (l0, l1, acc) = train(&spec, &adamw, 0.02, 40);
    assert!(l1 < 0.1 * l0, "adamw: loss {l0} -> {l1}");
    assert!(acc >= 0.98, "adamw accuracy {acc}");
}

#[test]
fn sgd_trains_a_cnn() {
    let spec = ModelSpec::Cnn {
        channels: 1,
        height: 8,
        width: 8,
        conv: vec![4],
        hidden: 16,
        classes: 4,
    };
    let sgd = OptimizerSpec::Sgd {
        momentum: 0.9,
        weight_decay: 0.0,
        nesterov: false,
    };
    let (l0, l1, acc) = train(&spec, &sgd, 0.05, 40);
    assert!(l1 < 0.2 * l0, "cnn: loss {l0} -> {l1}");
    assert!(acc >= 0.95, "cnn accuracy {acc}");
}
