//! loss_and_grad_streaming: same bits as loss_and_grad, delivered output layer first.

mod common;

use common::{labels, noise, tiny_cnn, tiny_mlp};
use lockstep_model::{Model, ModelError, ModelSpec};
use std::sync::Mutex;

/// (arrival order of tensor indices, flat gradient assembled from the stream, loss).
fn stream(m: &Model, x: &[f32], y: &[u8], n: usize, scale: f32) -> (Vec<usize>, Vec<f32>, f32) {
    let layout = m.layout();
    let got = Mutex::new((Vec::new(), vec![f32::NAN; m.num_params()]));
    let loss = m
        .loss_and_grad_streaming(x, y, n, scale, &|index, values| {
            let info = &layout[index];
            assert_eq!(values.len(), info.len, "{}", info.name);
            let mut got = got.lock().unwrap();
            got.0.push(index);
            got.1[info.offset..info.offset + info.len].copy_from_slice(values);
        })
        .unwrap();
    let (order, flat) = got.into_inner().unwrap();
    (order, flat, loss)
}

/// Position of the layer owning a parameter in forward order (its name's first part).
fn layer_position(name: &str) -> usize {
    name.split('.').next().unwrap().parse().unwrap()
}

fn check(spec: &ModelSpec) {
    let m = Model::new(spec, 3).unwrap();
    let n = 6;
    let x = noise(4, n * spec.input_len());
    let y = labels(5, n, spec.classes());
    let mut want = vec![0.0; m.num_params()];
    let want_loss = m.loss_and_grad(&x, &y, n, 1.0 / 6.0, &mut want).unwrap();
    let (order, got, loss) = stream(&m, &x, &y, n, 1.0 / 6.0);
    assert_eq!(loss.to_bits(), want_loss.to_bits());
    assert!(got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let layout = m.layout();
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(sorted, (0..layout.len()).collect::<Vec<_>>());
    let positions: Vec<usize> = order
        .iter()
        .map(|&i| layer_position(&layout[i].name))
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] >= w[1]),
        "arrival order by layer: {positions:?}"
    );
    assert_eq!(positions[0], layer_position(&layout.last().unwrap().name));
    // The stream leaves the model usable for the plain path, with the same result.
    let mut again = vec![0.0; m.num_params()];
    m.loss_and_grad(&x, &y, n, 1.0 / 6.0, &mut again).unwrap();
    assert!(again
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn mlp_stream_matches_loss_and_grad_in_reverse_layer_order() {
    check(&tiny_mlp());
}

#[test]
fn cnn_stream_matches_loss_and_grad_in_reverse_layer_order() {
    check(&tiny_cnn());
}

#[test]
fn bad_input_is_refused_without_calling_back() {
    let m = Model::new(&tiny_mlp(), 1).unwrap();
    let calls = Mutex::new(0);
    let err = m
        .loss_and_grad_streaming(&[0.0; 9], &[0, 1], 2, 1.0, &|_, _| {
            *calls.lock().unwrap() += 1;
        })
        .unwrap_err();
    assert!(matches!(err, ModelError::InputLength { got: 9, .. }));
    assert_eq!(*calls.lock().unwrap(), 0);
}

// The point of streaming, that the output layer's gradient is out while the layers below are
// still in backward, is tested in `src/streaming.rs` (unit test
// `output_gradient_is_delivered_before_the_layers_below_run_backward`): it needs the crate's
// private tap hook to put probes into the backward pass, and checks the order of backward's
// steps instead of timing a call.
