//! loss_and_grad against closed forms and finite differences; determinism; additivity.

mod common;

use common::{labels, noise, tiny_cnn, tiny_mlp};
use lockstep_model::{Model, ModelSpec};

fn grad(m: &Model, x: &[f32], y: &[u8], n: usize, scale: f32) -> (f32, Vec<f32>) {
    let mut g = vec![f32::NAN; m.num_params()];
    let loss = m.loss_and_grad(x, y, n, scale, &mut g).unwrap();
    (loss, g)
}

#[test]
fn zero_parameters_give_closed_form_loss_and_output_bias_gradient() {
    // All-zero parameters: logits are 0, softmax is uniform, loss = n ln C, and the gradient of
    // the output bias is scale * (n / C - count(label == c)); every other gradient is 0.
    let spec = tiny_mlp();
    let mut m = Model::new(&spec, 1).unwrap();
    m.set_params_flat(&vec![0.0; m.num_params()]).unwrap();
    let (n, c) = (6, 3);
    let x = noise(5, n * spec.input_len());
    let y = [0u8, 0, 0, 1, 2, 2];
    let scale = 0.25;
    let (loss, g) = grad(&m, &x, &y, n, scale);
    assert!((loss as f64 - scale as f64 * n as f64 * (c as f64).ln()).abs() < 1e-5);
    let last = m.layout().pop().unwrap();
    assert_eq!(last.name, "2.Output.bias");
    let counts = [3.0, 1.0, 2.0];
    for k in 0..c {
        let want = scale * (n as f32 / c as f32 - counts[k]);
        assert!((g[last.offset + k] - want).abs() < 1e-6, "bias {k}");
    }
    assert!(g[..last.offset].iter().all(|&v| v == 0.0));
    let (sum, correct) = m.evaluate(&x, &y, n).unwrap();
    assert!((sum - n as f64 * (c as f64).ln()).abs() < 1e-9);
    assert_eq!(correct, 3); // ties predict class 0
}

/// Central finite differences of the f64 evaluation loss against the analytic gradient, at
/// three coordinates of every parameter tensor.
///
/// ReLU and max-pool kinks make a large step `h` wrong near a switch, while a small `h` drowns
/// in the f32 rounding of the logits (~2e-7 relative on the loss, divided by `h`). So each
/// coordinate passes if, for one of three steps, the difference is within 0.1% plus that
/// rounding bound. A wrong gradient misses at every step.
fn check_finite_differences(spec: &ModelSpec, seed: u64) {
    let n = 4;
    let mut m = Model::new(spec, seed).unwrap();
    // Perturb all parameters (biases start at 0) so that no ReLU sits exactly at its kink.
    let mut p = m.params_flat();
    for (i, v) in noise(seed + 100, p.len()).iter().enumerate() {
        p[i] += 0.05 * v;
    }
    m.set_params_flat(&p).unwrap();
    let x = noise(seed + 1, n * spec.input_len());
    let y = labels(seed + 2, n, spec.classes());
    let (_, g) = grad(&m, &x, &y, n, 1.0);
    let base_loss = m.evaluate(&x, &y, n).unwrap().0;
    let mut loss_at = |i: usize, value: f32| {
        let mut q = p.clone();
        q[i] = value;
        m.set_params_flat(&q).unwrap();
        m.evaluate(&x, &y, n).unwrap().0
    };
    let mut checked = 0;
    for info in Model::new(spec, seed).unwrap().layout() {
        for k in [0, info.len / 2, info.len - 1] {
            let i = info.offset + k;
            let mut report = Vec::new();
            let ok = [1e-2f32, 1e-3, 1e-4].iter().any(|&h| {
                // The step actually taken in f32.
                let (up, down) = (p[i] + h, p[i] - h);
                let fd = (loss_at(i, up) - loss_at(i, down)) / (up as f64 - down as f64);
                let err = (fd - g[i] as f64).abs();
                let tol = 1e-3 * fd.abs().max(g[i].abs() as f64) + 2e-7 * base_loss / h as f64;
                report.push(format!("h={h}: fd {fd} (err {err:.2e}, tol {tol:.2e})"));
                err <= tol
            });
            assert!(ok, "{}[{k}]: analytic {} vs {report:?}", info.name, g[i]);
            checked += 1;
        }
    }
    assert_eq!(checked, 3 * m.layout().len());
}

#[test]
fn mlp_gradient_matches_finite_differences() {
    check_finite_differences(&tiny_mlp(), 11);
}

#[test]
fn cnn_gradient_matches_finite_differences() {
    check_finite_differences(&tiny_cnn(), 21);
}

#[test]
fn loss_and_grad_is_bitwise_deterministic() {
    for spec in [tiny_mlp(), tiny_cnn()] {
        let m = Model::new(&spec, 5).unwrap();
        let n = 8;
        let x = noise(6, n * spec.input_len());
        let y = labels(7, n, spec.classes());
        let (l1, g1) = grad(&m, &x, &y, n, 0.125);
        let (l2, g2) = grad(&m, &x, &y, n, 0.125);
        assert_eq!(l1.to_bits(), l2.to_bits());
        assert!(g1.iter().zip(&g2).all(|(a, b)| a.to_bits() == b.to_bits()));
        // A second model from the same seed computes the same bits too.
        let (l3, g3) = grad(&Model::new(&spec, 5).unwrap(), &x, &y, n, 0.125);
        assert_eq!(l1.to_bits(), l3.to_bits());
        assert!(g1.iter().zip(&g3).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn micro_batch_gradients_add_up_to_the_batch_gradient() {
    for spec in [tiny_mlp(), tiny_cnn()] {
        let m = Model::new(&spec, 8).unwrap();
        let (n, d) = (8, spec.input_len());
        let x = noise(9, n * d);
        let y = labels(10, n, spec.classes());
        let scale = 1.0 / n as f32;
        let (loss, full) = grad(&m, &x, &y, n, scale);
        let (l1, a) = grad(&m, &x[..4 * d], &y[..4], 4, scale);
        let (l2, b) = grad(&m, &x[4 * d..], &y[4..], 4, scale);
        assert!(((l1 + l2) - loss).abs() <= 1e-6 * loss.abs());
        // Not bitwise: matmul reduction order depends on the batch composition.
        let max = full.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, ((f, a), b)) in full.iter().zip(&a).zip(&b).enumerate() {
            assert!(
                (f - (a + b)).abs() <= 1e-6 * max,
                "element {i}: {f} vs {}",
                a + b
            );
        }
    }
}

#[test]
fn non_finite_loss_is_an_error() {
    let spec = tiny_mlp();
    let mut m = Model::new(&spec, 1).unwrap();
    // Activations overflow f32 in the second layer: the logits and the loss are not finite.
    m.set_params_flat(&vec![1e30; m.num_params()]).unwrap();
    let x = vec![1.0; 2 * spec.input_len()];
    let mut g = vec![0.0; m.num_params()];
    let err = m.loss_and_grad(&x, &[0, 1], 2, 0.5, &mut g).unwrap_err();
    assert!(
        matches!(err, lockstep_model::ModelError::NonFiniteLoss { n: 2, loss } if !loss.is_finite()),
        "{err:?}"
    );
    let err = m
        .loss_and_grad_streaming(&x, &[0, 1], 2, 0.5, &|_, _| {})
        .unwrap_err();
    assert!(matches!(
        err,
        lockstep_model::ModelError::NonFiniteLoss { n: 2, .. }
    ));
}
