//! Element types collectives can reduce, and the reduction operators.

/// Reduction operator of `all_reduce` / `reduce_scatter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum, then divide by the group size (integers: truncating division).
    Mean,
    Max,
    Min,
}

/// A plain-old-data element that can travel as bytes and be reduced.
pub trait Element: bytemuck::Pod + Send + Sync + PartialOrd + 'static {
    const NAME: &'static str;
    fn add(self, other: Self) -> Self;
    fn div_count(self, n: usize) -> Self;

    #[inline]
    fn combine(self, other: Self, op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => self.add(other),
            ReduceOp::Max => {
                if other > self {
                    other
                } else {
                    self
                }
            }
            ReduceOp::Min => {
                if other < self {
                    other
                } else {
                    self
                }
            }
        }
    }
}

macro_rules! float_element {
    ($t:ty) => {
        impl Element for $t {
            const NAME: &'static str = stringify!($t);
            #[inline]
            fn add(self, other: Self) -> Self {
                self + other
            }
            #[inline]
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
macro_rules! int_element {
    ($t:ty) => {
        impl Element for $t {
            const NAME: &'static str = stringify!($t);
            #[inline]
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            #[inline]
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
float_element!(f32);
float_element!(f64);
int_element!(i32);
int_element!(i64);
int_element!(u8);

/// `acc[i] = acc[i] ∘ src[i]`. Written as a plain loop over slices so it vectorises.
#[inline]
pub fn reduce_into<T: Element>(acc: &mut [T], src: &[T], op: ReduceOp) {
    debug_assert_eq!(acc.len(), src.len());
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a = a.add(*s);
            }
        }
        _ => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a = a.combine(*s, op);
            }
        }
    }
}

/// Reduce `src` (raw bytes of `T`, possibly unaligned) into `acc`.
#[inline]
pub fn reduce_bytes_into<T: Element>(acc: &mut [T], src: &[u8], op: ReduceOp) {
    match bytemuck::try_cast_slice::<u8, T>(src) {
        Ok(s) => reduce_into(acc, s, op),
        Err(_) => {
            let sz = std::mem::size_of::<T>();
            for (i, a) in acc.iter_mut().enumerate() {
                let v: T = bytemuck::pod_read_unaligned(&src[i * sz..(i + 1) * sz]);
                *a = a.combine(v, op);
            }
        }
    }
}
