//! One `gemm::gemm` product as burn flex's matmul makes it (`alpha` 0, `beta` 1, destination not
//! read, operands where they lie at their own strides), for lockstep's own kernels: the dense
//! layers (`dense.rs`, whole tensors) and attention (`attention.rs`, blocks of larger buffers).

use burn::backend::flex::FlexTensor;

/// A 2-D f32 operand of a gemm call, read in place: its values, its first element and its row
/// and column strides, in elements.
#[derive(Clone, Copy)]
pub(crate) struct Operand<'a> {
    values: &'a [f32],
    offset: usize,
    rows: usize,
    cols: usize,
    rs: isize,
    cs: isize,
}

impl<'a> Operand<'a> {
    /// `t` as it lies in memory (any strides). Panics unless `t` is a 2-D f32 tensor whose
    /// elements all lie inside its storage (flex's layouts always do; checked because gemm
    /// reads them through raw pointers).
    pub(crate) fn of(t: &'a FlexTensor) -> Self {
        let layout = t.layout();
        let (shape, strides) = (layout.shape(), layout.strides());
        assert_eq!(shape.num_dims(), 2, "gemm: 2-D operands only");
        Operand {
            values: t.storage::<f32>(),
            offset: layout.start_offset(),
            rows: shape[0],
            cols: shape[1],
            rs: strides[0],
            cs: strides[1],
        }
        .checked()
    }

    /// The `rows × cols` block of `values` starting at `offset`, rows `row_stride` apart, columns
    /// adjacent. Panics unless every element lies inside `values`.
    pub(crate) fn rows_of(
        values: &'a [f32],
        offset: usize,
        rows: usize,
        cols: usize,
        row_stride: isize,
    ) -> Self {
        Operand {
            values,
            offset,
            rows,
            cols,
            rs: row_stride,
            cs: 1,
        }
        .checked()
    }

    fn checked(self) -> Self {
        if self.rows > 0 && self.cols > 0 {
            let (mut lo, mut hi) = (self.offset as isize, self.offset as isize);
            for (len, stride) in [(self.rows, self.rs), (self.cols, self.cs)] {
                let reach = (len as isize - 1) * stride;
                if reach < 0 {
                    lo += reach;
                } else {
                    hi += reach;
                }
            }
            assert!(
                lo >= 0 && (hi as usize) < self.values.len(),
                "gemm: operand outside its values"
            );
        }
        self
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    pub(crate) fn cols(&self) -> usize {
        self.cols
    }

    /// The transposed view (no copy).
    pub(crate) fn t(self) -> Self {
        Operand {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Row-major or column-major, possibly with padding between rows or columns (a narrowed view).
    pub(crate) fn is_plain(&self) -> bool {
        (self.cs == 1 && self.rs >= self.cols as isize)
            || (self.rs == 1 && self.cs >= self.rows as isize)
    }

    fn ptr(&self) -> *const f32 {
        self.values.as_ptr().wrapping_add(self.offset)
    }
}

/// `dst = lhs · rhs` (`[m, k] · [k, n]`), `dst`'s rows `dst_rs` and columns `dst_cs` elements
/// apart, on `threads` (gemm splits the rows and columns of the output, never the sum).
///
/// # Safety
/// `dst` must be valid for writes at `i·dst_rs + j·dst_cs` for every `i < m`, `j < n`, those
/// places distinct, and nothing else may read or write them during the call.
pub(crate) unsafe fn product(
    lhs: Operand,
    rhs: Operand,
    dst: *mut f32,
    dst_rs: isize,
    dst_cs: isize,
    threads: gemm::Parallelism,
) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    assert_eq!(rhs.rows, k, "gemm: inner dimensions differ");
    // SAFETY: the operands address only elements inside the values they borrow (checked when
    // made; `t` keeps that), which outlive the call; the destination is the caller's promise.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs,
            dst_rs,
            false,
            lhs.ptr(),
            lhs.cs,
            lhs.rs,
            rhs.ptr(),
            rhs.cs,
            rhs.rs,
            0.0,
            1.0,
            false,
            false,
            false,
            threads,
        );
    }
}
