//! Decimal digits without allocating, for code that must not allocate: the out-of-memory report
//! (the allocator itself failed) and a forked child before `exec` (`memory_cap::join_in_child`).

/// `n` in decimal, written at the end of `buf`; returns the digits.
pub fn digits(n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let (mut n, mut first) = (n, buf.len());
    loop {
        first -= 1;
        buf[first] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[first..]
}

#[cfg(test)]
mod tests {
    #[test]
    fn digits_are_those_of_format() {
        let mut buf = [0u8; 20];
        for n in [0, 7, 10, 4096, 1 << 45, u64::MAX] {
            assert_eq!(super::digits(n, &mut buf), n.to_string().as_bytes());
        }
    }
}
