//! Quick loopback all-reduce timing of the TCP transport (2 ranks on threads), for tuning the
//! transport without the CLI: `cargo run --release -p lockstep-comm --example tcp_bench`.
//! Env: SIZES (bytes, comma list), SOCKBUF (bytes), SEG (segment bytes), REPS.
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockstep_comm::store::{StoreClient, StoreServer};
use lockstep_comm::tcp::{TcpOptions, TcpTransport};
use lockstep_comm::{Communicator, JobSecret, ReduceOp};

fn env<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn cpu_secs() -> f64 {
    // SAFETY: getrusage fills the struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// (run, runqueue wait) of this thread in seconds.
fn schedstat() -> (f64, f64) {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    let v: Vec<f64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();
    (v[0] * 1e-9, v[1] * 1e-9)
}

fn main() {
    let sizes: Vec<usize> = std::env::var("SIZES")
        .unwrap_or("4096,65536,1048576,16777216,67108864".into())
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    let sockbuf: usize = env("SOCKBUF", TcpOptions::default().socket_buffer_bytes);
    let seg: usize = env("SEG", 0);
    let secret = JobSecret::generate().unwrap();
    let srv = StoreServer::bind("127.0.0.1:0".parse().unwrap(), &secret, "b").unwrap();
    let store = srv.local_addr();
    std::thread::scope(|s| {
        for rank in 0..2 {
            let secret = &secret;
            let sizes = &sizes;
            s.spawn(move || {
                let mut c =
                    StoreClient::connect(store, secret, "b", Duration::from_secs(10)).unwrap();
                let opts = TcpOptions {
                    bind_ip: "127.0.0.1".parse().unwrap(),
                    socket_buffer_bytes: sockbuf,
                    ..TcpOptions::default()
                };
                let t = TcpTransport::establish(&mut c, rank, 2, secret, "b", &opts).unwrap();
                let mut comm = Communicator::new(Arc::new(t), Duration::from_secs(60));
                if seg > 0 {
                    comm.set_segment_bytes(seg);
                }
                for &bytes in sizes {
                    let mut buf = vec![1.0f32; bytes / 4];
                    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    comm.barrier().unwrap();
                    let t0 = Instant::now();
                    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    let mut probe = [t0.elapsed().as_secs_f64()];
                    comm.all_reduce(&mut probe, ReduceOp::Max).unwrap();
                    let iters = ((0.3 / probe[0]) as usize).clamp(3, 2000);
                    comm.barrier().unwrap();
                    let t0 = Instant::now();
                    let c0 = cpu_secs();
                    let s0 = schedstat();
                    for _ in 0..iters {
                        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    }
                    let mut el = [t0.elapsed().as_secs_f64()];
                    comm.all_reduce(&mut el, ReduceOp::Max).unwrap();
                    let secs = el[0] / iters as f64;
                    let cpu = (cpu_secs() - c0) / iters as f64;
                    let s1 = schedstat();
                    let wall = t0.elapsed().as_secs_f64();
                    let (run, wait) = (s1.0 - s0.0, s1.1 - s0.1);
                    println!(
                        "   rank {rank}: run {:.0}% runqueue {:.0}% asleep {:.0}%",
                        100.0 * run / wall,
                        100.0 * wait / wall,
                        100.0 * (wall - run - wait) / wall
                    );
                    if rank == 0 {
                        println!(
                            "{bytes:>10} x{iters} {:>10.1} us {:>6.2} GB/s cpu {:>8.1} us/iter ({:.2} GB/s per cpu-s pair)",
                            secs * 1e6,
                            bytes as f64 / secs / 1e9,
                            cpu * 1e6,
                            bytes as f64 / (cpu / 2.0) / 1e9
                        );
                    }
                }
            });
        }
    });
    let n = 64 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!("memcpy {:.2} GB/s", n as f64 / best / 1e9);
}
