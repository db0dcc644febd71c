//! `lockstep bench-collectives`: nccl-tests-style timing of collectives across worker processes,
//! with single-thread memcpy bandwidth measured in the same run as the physical reference.
//!
//! Conventions (as nccl-tests): `bytes` is the size of the buffer each rank passes in (for
//! all_gather, the gathered output); algbw = bytes / time; busbw = algbw · factor with factor
//! 2(n−1)/n for all_reduce, (n−1)/n for all_gather and reduce_scatter, 1 for broadcast — the bandwidth
//! a link must sustain, comparable across world sizes.

use std::time::Instant;

use anyhow::{bail, Result};
use lockstep_comm::{Algorithm, Communicator, ReduceOp};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    pub op: String,
    pub transport: String,
    pub world_size: usize,
    pub bytes: u64,
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Report {
    pub memcpy_gbps: f64,
    pub rows: Vec<Row>,
}

pub const OPS: &[&str] = &["all_reduce", "broadcast", "all_gather", "reduce_scatter"];

/// Largest buffer a benchmark size may name (bytes per rank).
pub const MAX_SIZE: u64 = 1 << 36;

fn bad(message: String) -> anyhow::Error {
    crate::request::BadRequest(message).into()
}

/// Parse "4K..256M" (powers of two between, inclusive) or a comma list "4K,1M"; every size from
/// 1 byte to [`MAX_SIZE`].
pub fn parse_sizes(spec: &str) -> Result<Vec<u64>> {
    let one = |s: &str| -> Result<u64> {
        let s = s.trim();
        let (num, mult) = match s.chars().last() {
            Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
            Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
            Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
            _ => (s, 1),
        };
        let n = num
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(mult))
            .ok_or_else(|| {
                bad(format!(
                    "--sizes {spec}: `{s}` is not a number of bytes with optional K/M/G suffix"
                ))
            })?;
        if n == 0 || n > MAX_SIZE {
            return Err(bad(format!(
                "--sizes {spec}: `{s}` must be from 1 byte to {} GiB",
                MAX_SIZE >> 30
            )));
        }
        Ok(n)
    };
    if let Some((a, b)) = spec.split_once("..") {
        let (lo, hi) = (one(a)?, one(b)?);
        if lo > hi {
            return Err(bad(format!(
                "--sizes {spec}: a range must go from a size up to a larger one"
            )));
        }
        let mut v = Vec::new();
        let mut s = lo;
        while s <= hi {
            v.push(s);
            s *= 2;
        }
        Ok(v)
    } else {
        spec.split(',').map(one).collect()
    }
}

/// Buffers of the largest size, on every rank of this host, must fit in its memory: each rank
/// holds about three (input, output, a ring's scratch).
pub fn check_memory(sizes: &[u64], nproc: usize) -> Result<()> {
    let largest = sizes.iter().copied().max().unwrap_or(0) as u128;
    let need = largest * 3 * nproc as u128;
    let memory = lockstep_train::limits::host_memory_bytes();
    if need > memory {
        return Err(bad(format!(
            "--sizes: {} ranks with buffers of {:.1} GiB need about {:.1} GiB, more than this \
             host's {:.1} GiB of memory",
            nproc,
            largest as f64 / (1u64 << 30) as f64,
            need as f64 / (1u64 << 30) as f64,
            memory as f64 / (1u64 << 30) as f64
        )));
    }
    Ok(())
}

pub fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// Single-thread memcpy bandwidth (GB/s, 1e9 bytes) of a `bytes`-sized copy, best of a few.
pub fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src); // fault the pages in
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

/// Run on every rank; returns rows on rank 0 (others return an empty list).
pub fn run_worker(
    comm: &mut Communicator,
    op: &str,
    sizes: &[u64],
    algorithm: Algorithm,
) -> Result<Vec<Row>> {
    if !OPS.contains(&op) {
        bail!("unknown op `{op}`; one of {OPS:?}");
    }
    comm.set_algorithm(algorithm);
    let n = comm.size();
    let mut rows = Vec::new();
    for &bytes in sizes {
        let elems = (bytes as usize / 4).max(1);
        let mut buf = vec![1.0f32; elems];
        let mut out = vec![0f32; if op == "all_gather" { elems } else { 0 }];
        let send_len = if op == "all_gather" {
            (elems / n).max(1)
        } else {
            0
        };
        if op == "all_gather" {
            out.resize(send_len * n, 0.0);
        }
        let mut once = |comm: &mut Communicator| -> Result<()> {
            match op {
                "all_reduce" => comm.all_reduce(&mut buf, ReduceOp::Sum)?,
                "broadcast" => comm.broadcast(&mut buf, 0)?,
                "all_gather" => comm.all_gather(&buf[..send_len], &mut out)?,
                _ => {
                    comm.reduce_scatter(&mut buf, ReduceOp::Sum)?;
                }
            }
            Ok(())
        };
        // Warm up, then size the iteration count to ~0.3 s (agreed on by all ranks via max).
        once(comm)?;
        comm.barrier()?;
        let t = Instant::now();
        once(comm)?;
        let mut probe = [t.elapsed().as_secs_f64()];
        comm.all_reduce(&mut probe, ReduceOp::Max)?;
        let iters = ((0.3 / probe[0].max(1e-7)) as usize).clamp(3, 2000);
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            once(comm)?;
        }
        let mut elapsed = [t.elapsed().as_secs_f64()];
        comm.all_reduce(&mut elapsed, ReduceOp::Max)?;
        let secs = elapsed[0] / iters as f64;
        let real_bytes = if op == "all_gather" {
            (send_len * n * 4) as u64
        } else {
            (elems * 4) as u64
        };
        let algbw = real_bytes as f64 / secs / 1e9;
        rows.push(Row {
            op: op.to_string(),
            transport: comm.transport_name().to_string(),
            world_size: n,
            bytes: real_bytes,
            time_us: secs * 1e6,
            algbw_gbps: algbw,
            busbw_gbps: algbw * bus_factor(op, n),
        });
    }
    Ok(if comm.rank() == 0 { rows } else { Vec::new() })
}

pub fn format_table(report: &Report) -> String {
    let mut s = format!("# single-thread memcpy: {:.2} GB/s\n", report.memcpy_gbps);
    s += &format!(
        "{:>14} {:>10} {:>5} {:>12} {:>12} {:>11} {:>11} {:>9}\n",
        "op", "transport", "n", "bytes", "time_us", "algbw_GB/s", "busbw_GB/s", "%memcpy"
    );
    for r in &report.rows {
        s += &format!(
            "{:>14} {:>10} {:>5} {:>12} {:>12.1} {:>11.2} {:>11.2} {:>8.0}%\n",
            r.op,
            r.transport,
            r.world_size,
            r.bytes,
            r.time_us,
            r.algbw_gbps,
            r.busbw_gbps,
            100.0 * r.busbw_gbps / report.memcpy_gbps
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(
            parse_sizes("4K..32K").unwrap(),
            vec![4096, 8192, 16384, 32768]
        );
        assert_eq!(parse_sizes("1M,3").unwrap(), vec![1 << 20, 3]);
        assert!(parse_sizes("4X").is_err());
        assert!(parse_sizes("8K..4K").is_err());
    }

    #[test]
    fn bus_factors_match_nccl_tests() {
        assert_eq!(bus_factor("all_reduce", 2), 1.0);
        assert_eq!(bus_factor("all_reduce", 4), 1.5);
        assert_eq!(bus_factor("all_gather", 4), 0.75);
        assert_eq!(bus_factor("broadcast", 8), 1.0);
    }
}
