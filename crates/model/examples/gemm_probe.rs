//! The two forms of `dense.rs`'s input gradient `dx = dy · Wᵀ`, against burn's, at the layer
//! shapes of this project's models: `cargo run --release -p lockstep-model --example gemm_probe`
//! prints, per `[rows, in] ← [rows, out] · [in, out]ᵀ`, the median milliseconds of
//! - `burn`: the previous `dense.rs`, `(W · contiguous(dyᵀ))ᵀ` with burn ops;
//! - `in place`: one `gemm::gemm` call reading `W` and `dy` where they lie and writing `dxᵀ`
//!   column-major (= `dx` row-major), no copy;
//! - `transposed`: the same gemm call as `burn`, into a buffer that is not zero-filled, between
//!   the two transposes;
//!
//! then whether both forms give `burn`'s bits and which form `dense.rs` picks.
//!
//! Expected (2-core AMD EPYC VM, AVX-512 kernels): the same bits everywhere; `in place` several
//! times faster than `transposed` for narrow outputs (`out` = 10: the classifier heads) and
//! 1.5–3× slower for wide ones (`out` = 512, 2048: gemm packs the weight's long rows element by
//! element). `dense.rs`'s rule picks the faster form at the models' shapes; near
//! its bound it can miss (128×2048×256 is faster in place, by about a quarter).
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::Flex;
use burn::tensor::TensorData;
use std::time::Instant;

fn median_ms(mut f: impl FnMut() -> Vec<f32>) -> (f64, Vec<f32>) {
    let out = f();
    let mut times: Vec<f64> = (0..31)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(f());
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    (times[15], out)
}

/// `m × n` product with gemm's strides (column stride, then row stride, as gemm takes them),
/// alpha 0, beta 1 and no read of the destination, as burn flex calls it.
#[allow(clippy::too_many_arguments)]
fn gemm(
    (m, n, k): (usize, usize, usize),
    (dst_cs, dst_rs): (isize, isize),
    (lhs, lhs_cs, lhs_rs): (&[f32], isize, isize),
    (rhs, rhs_cs, rhs_rs): (&[f32], isize, isize),
) -> Vec<f32> {
    let mut out = Vec::with_capacity(m * n);
    // SAFETY: the operands are dense `[m, k]` / `[k, n]` matrices at the given strides, and with
    // `read_dst = false` gemm writes all `m × n` outputs (strides a bijection onto `0..m*n`).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            dst_cs,
            dst_rs,
            false,
            lhs.as_ptr(),
            lhs_cs,
            lhs_rs,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
        out.set_len(m * n);
    }
    out
}

fn tensor(values: Vec<f32>, shape: [usize; 2]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

fn values(t: FlexTensor) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

fn main() {
    // (rows, in, out): MLP 784-512-512-10 at micro-batch 128, MLP 784-2048×3-10 and the
    // Fashion-MNIST CNN's head at 64, the digits MLP at 16, and both sides of `out` = 128.
    let shapes = [
        (128, 512, 512),
        (128, 512, 10),
        (64, 2048, 2048),
        (64, 2048, 10),
        (64, 1568, 64),
        (64, 64, 10),
        (16, 128, 64),
        (16, 64, 10),
        (128, 2048, 128),
        (128, 2048, 256),
        (16, 512, 128),
    ];
    println!(
        "{:>20} {:>9} {:>9} {:>11}  same bits  dense.rs picks",
        "rows×in×out", "burn", "in place", "transposed"
    );
    for (rows, inp, out) in shapes {
        let w: Vec<f32> = (0..inp * out)
            .map(|k| ((k * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let dy: Vec<f32> = (0..rows * out)
            .map(|k| ((k * 104729) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let (w_t, dy_t) = (
            tensor(w.clone(), [inp, out]),
            tensor(dy.clone(), [rows, out]),
        );
        let (burn, reference) = median_ms(|| {
            let dy_tr = Flex::float_swap_dims(dy_t.clone(), 0, 1).to_contiguous();
            let dx_tr = Flex::float_matmul(w_t.clone(), dy_tr);
            values(Flex::float_swap_dims(dx_tr, 0, 1).to_contiguous())
        });
        let (in_place, a) = median_ms(|| {
            gemm(
                (inp, rows, out),
                (inp as isize, 1),
                (&w, 1, out as isize),
                (&dy, out as isize, 1),
            )
        });
        let (transposed, b) = median_ms(|| {
            let dy_tr = dy_t.transpose(0, 1).to_contiguous();
            let dy_tr = dy_tr.storage::<f32>();
            let dx_tr = gemm(
                (inp, rows, out),
                (1, rows as isize),
                (&w, 1, out as isize),
                (dy_tr, 1, rows as isize),
            );
            values(tensor(dx_tr, [inp, rows]).transpose(0, 1).to_contiguous())
        });
        let same = |v: &[f32]| {
            v.iter()
                .zip(&reference)
                .all(|(p, q)| p.to_bits() == q.to_bits())
        };
        // dense.rs's rule (with its conditions for gemm's micro-kernel, true at these shapes).
        let picks = if out <= 128 && inp * out <= 2 * rows * (inp + out) {
            "in place"
        } else {
            "transposed"
        };
        println!(
            "{:>20} {burn:9.3} {in_place:9.3} {transposed:11.3}  {:9}  {picks}",
            format!("{rows}×{inp}×{out}"),
            if same(&a) && same(&b) { "yes" } else { "NO" },
        );
    }
}
