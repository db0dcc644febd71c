//! Softmax cross-entropy: the training loss as a burn graph, the evaluation loss in plain Rust.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};

/// `-scale * sum_i log_softmax(logits_i)[y_i]` as a one-element tensor. A sum (not a mean) so
/// that micro-batches of one global batch add up; the caller's `scale` does the averaging.
pub(crate) fn scaled_cross_entropy(
    logits: Tensor<2>,
    y: &[u8],
    scale: f32,
    device: &Device,
) -> Tensor<1> {
    let labels: Vec<i64> = y.iter().map(|&l| l as i64).collect();
    scaled_cross_entropy_ids(logits, labels, scale, device)
}

/// [`scaled_cross_entropy`] with class ids as `i64` (one per row of `logits`).
pub(crate) fn scaled_cross_entropy_ids(
    logits: Tensor<2>,
    labels: Vec<i64>,
    scale: f32,
    device: &Device,
) -> Tensor<1> {
    let n = labels.len();
    let targets = Tensor::<2, Int>::from_data(TensorData::new(labels, [n, 1]), device);
    let picked = log_softmax(logits, 1).gather(1, targets);
    picked.sum().mul_scalar(-scale)
}

/// `-sum_i log_softmax(logits_i)[y_i]` as a one-element tensor, `targets` `[n, 1]` the class
/// ids: the built-in classifiers' training loss, a sum over the samples (scaled by lockstep to the
/// global batch). Scaled by `s`, its bits are those of `scaled_cross_entropy` with scale `s`:
/// negating is exact, in the value and in its gradient.
pub fn cross_entropy_sum(logits: Tensor<2>, targets: Tensor<2, Int>) -> Tensor<1> {
    log_softmax(logits, 1).gather(1, targets).sum().neg()
}

/// (sum of cross-entropy in f64, number of correct arg-max predictions) for row-major
/// `[n, classes]` logits. Log-sum-exp is shifted by the row maximum for stability.
pub fn sum_ce_and_correct(logits: &[f32], y: &[u8], classes: usize) -> (f64, usize) {
    let mut loss = 0.0f64;
    let mut correct = 0;
    for (row, &label) in logits.chunks_exact(classes).zip(y) {
        let best = arg_max(row);
        correct += usize::from(predicts(row, best, label));
        let max = row[best] as f64;
        let sum_exp: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
        loss += max + sum_exp.ln() - row[label as usize] as f64;
    }
    (loss, correct)
}

/// The number of correct arg-max predictions alone (as [`sum_ce_and_correct`] counts them), for
/// metrics whose loss comes from elsewhere: no exponentials.
pub fn count_correct(logits: &[f32], y: &[u8], classes: usize) -> usize {
    logits
        .chunks_exact(classes)
        .zip(y)
        .filter(|(row, &label)| predicts(row, arg_max(row), label))
        .count()
}

/// First index of the row's maximum. A NaN never compares greater, so it is never chosen after
/// index 0, and a NaN at index 0 is never beaten (a prediction [`predicts`] counts as wrong).
fn arg_max(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

fn predicts(row: &[f32], best: usize, label: u8) -> bool {
    best == label as usize && !row[best].is_nan()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ce_matches_closed_form() {
        // Uniform logits: CE = ln(classes) for each sample; ties resolve to index 0.
        let (loss, correct) = sum_ce_and_correct(&[0.0; 8], &[0, 3], 4);
        assert!((loss - 2.0 * 4f64.ln()).abs() < 1e-12);
        assert_eq!(correct, 1);
        // Logits (ln 1, ln 3): p = (1/4, 3/4).
        let (loss, correct) = sum_ce_and_correct(&[0.0, 3f32.ln()], &[1], 2);
        assert!((loss - (4.0f64 / 3.0).ln()).abs() < 1e-7);
        assert_eq!(correct, 1);
    }

    #[test]
    fn count_correct_counts_as_the_loss_does() {
        // Rows: a tie (predicts 0), NaN first (nothing compares greater than it: predicts 0,
        // never correct), NaN later (never the maximum), a clear winner.
        let logits = [1.0, 1.0, f32::NAN, 2.0, 2.0, f32::NAN, -1.0, 0.5];
        let labels = [0, 1, 0, 1];
        assert_eq!(count_correct(&logits, &labels, 2), 3);
        assert_eq!(sum_ce_and_correct(&logits, &labels, 2).1, 3);
        assert_eq!(count_correct(&logits, &[1, 0, 1, 0], 2), 0);
    }
}
