//! Helpers for the proptest fuzz harnesses that live next to each decoder (`store`, `wire`,
//! `tcp::frame`, `tcp::mesh`, `shm::ring`). They run inside `cargo test` with a fixed case budget;
//! `PROPTEST_CASES=200000 cargo test -p lockstep-comm --lib fuzz` runs them long.

use proptest::prelude::*;

/// `default` cases unless `PROPTEST_CASES` says otherwise.
pub fn config(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        // Findings are kept as named regression tests next to each harness instead.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// A valid message with a few bytes overwritten and possibly cut short: most fuzz inputs
/// should get past the magic, or the decoders' deeper checks are never exercised.
pub fn mutated(valid: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let n = valid.len().max(1);
    (
        prop::collection::vec((0..n, any::<u8>()), 0..4),
        prop::option::of(0..=valid.len()),
        prop::collection::vec(any::<u8>(), 0..16),
    )
        .prop_map(move |(flips, cut, tail)| {
            let mut v = valid.clone();
            for (i, b) in flips {
                if i < v.len() {
                    v[i] = b;
                }
            }
            if let Some(c) = cut {
                v.truncate(c);
            } else {
                v.extend_from_slice(&tail);
            }
            v
        })
}

/// A stream that reads from fixed bytes and swallows writes.
pub struct Scripted {
    pub input: std::io::Cursor<Vec<u8>>,
    pub output: Vec<u8>,
}

impl Scripted {
    pub fn new(input: Vec<u8>) -> Self {
        Self {
            input: std::io::Cursor::new(input),
            output: Vec::new(),
        }
    }
}

impl std::io::Read for Scripted {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl std::io::Write for Scripted {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
