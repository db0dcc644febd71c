//! Shared-memory transport: correctness against known byte patterns, failure modes with their
//! deadlines, setup hygiene (no files left, stale files replaced), and a real child process killed
//! mid-transfer. Ranks are threads unless stated; every test uses its own job id and directory.
//!
//! `bench_shm_figures` (ignored) prints throughput/latency figures:
//! `cargo test --release -p lockstep-comm --test shm -- --ignored bench_shm_figures --nocapture`.

mod common;
use common::waited_in_message;
#[path = "common/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lockstep_comm::error::{CommError, LinkFailure, TransportError};
use lockstep_comm::shm::{ShmOptions, ShmTransport};
use lockstep_comm::{Communicator, ReduceOp, Transport};
use std::sync::Arc;

const LONG: Duration = Duration::from_secs(30);
const CHILD_ENV: &str = "LOCKSTEP_SHM_TEST_CHILD";

/// Establish a whole group, one thread per rank (establish blocks until all ranks are there).
fn group(s: &Scratch, world: usize, ring_bytes: usize) -> Vec<ShmTransport> {
    let opts = s.opts(ring_bytes);
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let opts = opts.clone();
                let job = s.job.clone();
                sc.spawn(move || ShmTransport::establish(r, world, &job, LONG, &opts).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Deterministic bytes, different for every (len, seed), so misplaced or stale bytes show.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (len as u64) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn deadline() -> Instant {
    Instant::now() + LONG
}

const SIZES: [usize; 4] = [0, 1, 7919, 8 * 1024 * 1024 + 13];
const SMALL_RING: usize = 256 * 1024;

#[test]
fn send_recv_mirror_calls_of_all_sizes_both_directions() {
    let s = Scratch::new();
    let ts = group(&s, 2, SMALL_RING);
    std::thread::scope(|sc| {
        for t in &ts {
            sc.spawn(move || {
                let me = t.rank();
                let other = 1 - me;
                // Same sizes, then every asymmetric pair (rank 0 sends a, receives b).
                let mut pairs: Vec<(usize, usize)> = SIZES.iter().map(|&n| (n, n)).collect();
                for &a in &SIZES {
                    for &b in &SIZES {
                        if a != b {
                            pairs.push((a, b));
                        }
                    }
                }
                for (i, &(a, b)) in pairs.iter().enumerate() {
                    let (mine, theirs) = if me == 0 { (a, b) } else { (b, a) };
                    let data = pattern(mine, (i * 2 + me) as u64);
                    let mut buf = vec![0u8; theirs];
                    t.send_recv(other, &data, other, &mut buf, 100 + i as u64, deadline())
                        .unwrap();
                    assert!(
                        buf == pattern(theirs, (i * 2 + other) as u64),
                        "pair {i} ({a}, {b}) corrupted"
                    );
                }
            });
        }
    });
    // Each rank sent every size 4 times: once in the equal pair, 3 times in the asymmetric pairs.
    for t in &ts {
        assert_eq!(t.bytes_sent(), 4 * SIZES.iter().sum::<usize>() as u64);
    }
}

#[test]
fn plain_send_and_recv_both_directions_at_once() {
    // Each rank sends from one thread and receives on another, so both directions of the link are
    // busy at the same time; messages larger than the ring must stream while the peer drains.
    let s = Scratch::new();
    let ts = group(&s, 2, SMALL_RING);
    std::thread::scope(|sc| {
        for t in &ts {
            let other = 1 - t.rank();
            sc.spawn(move || {
                for (i, &n) in SIZES.iter().enumerate() {
                    t.send(
                        other,
                        i as u64,
                        &pattern(n, (10 * i + t.rank()) as u64),
                        deadline(),
                    )
                    .unwrap();
                }
            });
            sc.spawn(move || {
                for (i, &n) in SIZES.iter().enumerate() {
                    let mut buf = vec![0u8; n];
                    t.recv(other, i as u64, &mut buf, deadline()).unwrap();
                    assert!(
                        buf == pattern(n, (10 * i + other) as u64),
                        "message {i} of {n} bytes corrupted"
                    );
                }
            });
        }
    });
    drop(ts);
    s.assert_empty();
}

#[test]
fn many_small_messages_arrive_in_order_through_a_tiny_ring() {
    // A 4 KiB ring holds only a few frames, so the sender blocks again and again on the reader.
    let s = Scratch::new();
    let ts = group(&s, 2, 4096);
    const N: usize = 3000;
    std::thread::scope(|sc| {
        let (a, b) = (&ts[0], &ts[1]);
        sc.spawn(move || {
            for i in 0..N {
                a.send(
                    1,
                    0xF000 + i as u64,
                    &pattern(i % 301, i as u64),
                    deadline(),
                )
                .unwrap();
            }
        });
        sc.spawn(move || {
            // Let the ring fill up first: wait (polling, hang-guarded) until the sender has
            // pushed some twenty frames (over half of the ring) before reading.
            let guard = Instant::now() + LONG;
            while a.bytes_sent() < 200 {
                assert!(Instant::now() < guard, "sender never filled the ring");
                std::thread::yield_now();
            }
            for i in 0..N {
                let mut buf = vec![0u8; i % 301];
                b.recv(0, 0xF000 + i as u64, &mut buf, deadline()).unwrap();
                assert!(buf == pattern(i % 301, i as u64), "message {i}");
            }
        });
    });
    let total: usize = (0..N).map(|i| i % 301).sum();
    assert_eq!(ts[0].bytes_sent(), total as u64);
}

fn expect_protocol(e: &TransportError, peer: usize, needle: &str) {
    assert_eq!(e.peer, peer, "{e}");
    match &e.failure {
        LinkFailure::Protocol(m) => assert!(m.contains(needle), "{e}"),
        other => panic!("expected protocol error, got {other:?}: {e}"),
    }
}

#[test]
fn tag_or_length_mismatch_is_a_protocol_error_and_poisons_the_link() {
    let s = Scratch::new();
    let ts = group(&s, 2, SMALL_RING);
    ts[0].send(1, 7, b"hello", deadline()).unwrap();
    let mut buf = [0u8; 5];
    let e = ts[1].recv(0, 8, &mut buf, deadline()).unwrap_err();
    expect_protocol(
        &e,
        0,
        "expected tag 0x8 with 5 bytes, got tag 0x7 with 5 bytes",
    );
    assert!(e.to_string().contains("waiting for rank 0"), "{e}");
    assert!(
        e.to_string().contains(&s.job),
        "address names the segment: {e}"
    );
    // The stream is no longer trustworthy: even the right tag now fails.
    let e = ts[1].recv(0, 7, &mut buf, deadline()).unwrap_err();
    expect_protocol(&e, 0, "unusable");

    // Length mismatch on the other direction.
    ts[1].send(0, 9, &[1, 2, 3], deadline()).unwrap();
    let mut four = [0u8; 4];
    let e = ts[0].recv(1, 9, &mut four, deadline()).unwrap_err();
    expect_protocol(
        &e,
        1,
        "expected tag 0x9 with 4 bytes, got tag 0x9 with 3 bytes",
    );
}

#[test]
fn out_of_range_peer_is_rejected() {
    let s = Scratch::new();
    let ts = group(&s, 2, 4096);
    let e = ts[0].send(2, 0, b"x", deadline()).unwrap_err();
    expect_protocol(&e, 2, "outside world of 2");
    let e = ts[0].recv(5, 0, &mut [0u8; 1], deadline()).unwrap_err();
    expect_protocol(&e, 5, "outside world of 2");
}

fn expect_closed(e: &TransportError, peer: usize) {
    assert_eq!(e.peer, peer, "{e}");
    assert!(
        matches!(e.failure, LinkFailure::Closed),
        "expected Closed: {e}"
    );
}

#[test]
fn dropped_peer_gives_closed_promptly_after_its_last_message_is_drained() {
    let s = Scratch::new();
    let mut ts = group(&s, 2, SMALL_RING);
    let t1 = ts.pop().unwrap();
    let t0 = ts.pop().unwrap();
    let (got_it, leave) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|sc| {
        sc.spawn(move || {
            // Last words, then leave once rank 0 has them (it is then in, or about to enter,
            // its next receive; either order must end in Closed).
            t1.send(0, 1, &pattern(3000, 1), deadline()).unwrap();
            leave.recv_timeout(LONG).unwrap();
            drop(t1);
        });
        let mut buf = vec![0u8; 3000];
        t0.recv(1, 1, &mut buf, deadline()).unwrap();
        assert_eq!(buf, pattern(3000, 1));
        got_it.send(()).unwrap();
        // Closed, not a timeout: the departure was noticed rather than waited out.
        let e = t0.recv(1, 2, &mut buf, deadline()).unwrap_err();
        expect_closed(&e, 1);
        assert!(e.to_string().contains("rank 1 closed its transport"), "{e}");
    });
    // Sending to a closed peer fails at once instead of filling the ring.
    let e = t0.send(1, 3, b"anyone?", deadline()).unwrap_err();
    expect_closed(&e, 1);
    drop(t0);
    s.assert_empty();
}

#[test]
fn message_sent_just_before_drop_is_still_delivered() {
    let s = Scratch::new();
    let mut ts = group(&s, 2, SMALL_RING);
    let t1 = ts.pop().unwrap();
    let t0 = ts.pop().unwrap();
    t1.send(0, 5, &pattern(1000, 5), deadline()).unwrap();
    drop(t1);
    let mut buf = vec![0u8; 1000];
    t0.recv(1, 5, &mut buf, deadline()).unwrap();
    assert_eq!(buf, pattern(1000, 5));
    expect_closed(&t0.recv(1, 6, &mut buf, deadline()).unwrap_err(), 1);
}

#[test]
fn silent_peer_gives_timeout_within_the_deadline() {
    let s = Scratch::new();
    let ts = group(&s, 2, SMALL_RING);
    let timeout = Duration::from_millis(300);

    let started = Instant::now();
    let e = ts[0]
        .recv(1, 1, &mut [0u8; 10], started + timeout)
        .unwrap_err();
    let took = started.elapsed();
    assert!(e.is_timeout(), "{e}");
    assert_eq!(e.peer, 1);
    // The deadline fired (not before it); the upper bound is only a hang guard.
    assert!(took >= timeout && took < 10 * timeout, "took {took:?}");
    assert!(
        (0.29..3.0).contains(&waited_in_message(&e.to_string()))
            && e.to_string().contains("waiting for rank 1"),
        "{e}"
    );

    // send_recv where the peer neither reads nor writes blames the receive side.
    let started = Instant::now();
    let e = ts[0]
        .send_recv(1, b"x", 1, &mut [0u8; 4], 3, started + timeout)
        .unwrap_err();
    assert!(
        e.is_timeout() && e.to_string().contains("waiting for rank 1"),
        "{e}"
    );
    assert!(started.elapsed() < 10 * timeout);

    // A message bigger than the ring cannot complete while the peer does not read.
    let started = Instant::now();
    let e = ts[0]
        .send(1, 2, &vec![0u8; 2 * SMALL_RING], started + timeout)
        .unwrap_err();
    let took = started.elapsed();
    assert!(e.is_timeout() && e.peer == 1, "{e}");
    assert!(e.to_string().contains("sending to rank 1"), "{e}");
    assert!(took >= timeout && took < 10 * timeout, "took {took:?}");
}

#[test]
fn a_second_thread_on_the_same_direction_is_rejected() {
    let s = Scratch::new();
    let ts = group(&s, 2, 4096);
    std::thread::scope(|sc| {
        let t = &ts[0];
        // Two threads receive from rank 1 at once: whichever comes second is refused at once,
        // the first blocks until the message arrives. Order-free, no sleeps.
        let (done, results) = std::sync::mpsc::channel();
        for _ in 0..2 {
            let done = done.clone();
            sc.spawn(move || {
                let _ = done.send(t.recv(1, 1, &mut [0u8; 8], deadline()));
            });
        }
        let first = results.recv_timeout(LONG).expect("hang guard");
        let e = first.expect_err("the second receiver must be refused, not served");
        expect_protocol(&e, 1, "another thread is already receiving from rank 1");
        // Release the blocked receiver with the message it waits for.
        ts[1].send(0, 1, &[7u8; 8], deadline()).unwrap();
        results.recv_timeout(LONG).expect("hang guard").unwrap();
    });
}

#[test]
fn six_ranks_exchange_around_a_ring_and_between_all_pairs() {
    let s = Scratch::new();
    let world = 6;
    let ts = group(&s, world, SMALL_RING);
    s.assert_empty(); // names are removed as soon as everyone has mapped everything
    std::thread::scope(|sc| {
        for t in &ts {
            sc.spawn(move || {
                let r = t.rank();
                let mut tag = 0u64;
                // Ring pattern (as in ring all-reduce): send right, receive from the left.
                for &n in &[3usize, 100_000, 3 * 1024 * 1024 + 5] {
                    for round in 0..3u64 {
                        tag += 1;
                        let (right, left) = ((r + 1) % world, (r + world - 1) % world);
                        let mut buf = vec![0u8; n];
                        t.send_recv(
                            right,
                            &pattern(n, tag * 100 + r as u64),
                            left,
                            &mut buf,
                            tag,
                            deadline(),
                        )
                        .unwrap();
                        assert!(
                            buf == pattern(n, tag * 100 + left as u64),
                            "size {n} round {round}"
                        );
                    }
                }
                // Every directed pair: at shift k, send to r+k and receive from r-k.
                for k in 1..world {
                    tag += 1;
                    let (to, from) = ((r + k) % world, (r + world - k) % world);
                    let n = 50_000 + 17 * k;
                    let mut buf = vec![0u8; n];
                    t.send_recv(
                        to,
                        &pattern(n, tag * 100 + r as u64),
                        from,
                        &mut buf,
                        tag,
                        deadline(),
                    )
                    .unwrap();
                    assert!(buf == pattern(n, tag * 100 + from as u64), "shift {k}");
                }
            });
        }
    });
    drop(ts);
    s.assert_empty();
}

#[test]
fn eight_ranks_on_two_cores_survive_many_small_rounds() {
    // Oversubscribed: ranks keep falling asleep on their doorbells and must be woken every round.
    let s = Scratch::new();
    let world = 8;
    let ts = group(&s, world, 16 * 1024);
    std::thread::scope(|sc| {
        for t in &ts {
            sc.spawn(move || {
                let r = t.rank();
                for round in 0..300u64 {
                    let k = 1 + (round as usize % (world - 1));
                    let (to, from) = ((r + k) % world, (r + world - k) % world);
                    let n = (round as usize * 37) % 5000;
                    let mut buf = vec![0u8; n];
                    t.send_recv(
                        to,
                        &pattern(n, round * 16 + r as u64),
                        from,
                        &mut buf,
                        round,
                        deadline(),
                    )
                    .unwrap();
                    assert!(buf == pattern(n, round * 16 + from as u64), "round {round}");
                }
            });
        }
    });
}

#[test]
fn messages_to_self_work() {
    let s = Scratch::new();
    let ts = group(&s, 1, 4096);
    let t = &ts[0];
    t.send(0, 1, b"note to self", deadline()).unwrap();
    let mut buf = [0u8; 12];
    t.recv(0, 1, &mut buf, deadline()).unwrap();
    assert_eq!(&buf, b"note to self");
    // Bigger than the ring: only possible because send_recv interleaves writing and reading.
    let data = pattern(100_000, 9);
    let mut back = vec![0u8; 100_000];
    t.send_recv(0, &data, 0, &mut back, 2, deadline()).unwrap();
    assert_eq!(back, data);
}

#[test]
fn invalid_arguments_are_rejected_with_clear_errors() {
    let s = Scratch::new();
    let opts = s.opts(4096);
    let bad = |rank: usize, world: usize, job: &str, opts: &ShmOptions| {
        let e = ShmTransport::establish(rank, world, job, Duration::from_secs(5), opts)
            .err()
            .expect("must fail");
        e.to_string()
    };
    for job in ["../escape", "a/b", "x y", "dot.ted", ""] {
        let m = bad(0, 1, job, &opts);
        assert!(m.contains("job id"), "{job:?}: {m}");
    }
    assert!(bad(0, 1, &"a".repeat(65), &opts).contains("1 to 64 characters"));
    assert!(bad(2, 2, "ok", &opts).contains("rank 2 of world 2"));
    assert!(bad(0, 0, "ok", &opts).contains("world 0"));
    assert!(bad(0, 1, "ok", &s.opts(5000)).contains("power of two"));
    assert!(bad(0, 1, "ok", &s.opts(1024)).contains("power of two between 4096"));
    let missing = ShmOptions {
        ring_bytes: 4096,
        dir: s.dir.join("nope"),
    };
    assert!(bad(0, 1, "ok", &missing).contains("does not exist"));
    s.assert_empty();
}

#[test]
fn establish_times_out_naming_the_missing_rank_and_cleans_up() {
    let s = Scratch::new();
    let started = Instant::now();
    let e = ShmTransport::establish(0, 3, &s.job, Duration::from_millis(300), &s.opts(4096))
        .err()
        .unwrap();
    // Hang guard only (10x the timeout); the message below says it was the timeout that fired.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    assert!(matches!(e, CommError::Rendezvous(_)), "{e}");
    let m = e.to_string();
    assert!(m.contains("rank(s) [1, 2] have not attached"), "{m}");
    assert!(m.contains("rank 2 not started?"), "{m}");
    s.assert_empty();
}

#[test]
fn ranks_that_disagree_on_ring_size_fail_fast() {
    let s = Scratch::new();
    let started = Instant::now();
    let results: Vec<_> = std::thread::scope(|sc| {
        let hs: Vec<_> = [(0usize, 4096usize), (1, 8192)]
            .map(|(r, ring)| {
                let (job, opts) = (s.job.clone(), s.opts(ring));
                sc.spawn(move || {
                    ShmTransport::establish(r, 2, &job, Duration::from_secs(120), &opts).err()
                })
            })
            .into_iter()
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Fail fast = well before the 120 s establishment timeout; not a speed assertion.
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
    // Whoever opens the other's segment first sees the difference; the other learns it from a flag.
    let msgs: Vec<String> = results
        .into_iter()
        .map(|e| e.expect("must fail").to_string())
        .collect();
    assert!(
        msgs.iter().all(|m| m.contains("ranks disagree")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter()
            .any(|m| m.contains("4096 B rings") && m.contains("8192 B rings")),
        "{msgs:?}"
    );
    s.assert_empty();
}

#[test]
fn communicator_all_reduce_over_shm_with_three_ranks() {
    let s = Scratch::new();
    let ts = group(&s, 3, SMALL_RING);
    std::thread::scope(|sc| {
        for t in ts {
            sc.spawn(move || {
                let r = t.rank() as f32;
                let mut comm = Communicator::new(Arc::new(t), LONG);
                // Large enough for the ring algorithm (and for chunks bigger than the ring), then
                // small enough for recursive doubling. Small integers: sums are exact.
                for n in [1_000_003usize, 1000] {
                    let mut x: Vec<f32> = (0..n).map(|i| (i % 1024) as f32 * (r + 1.0)).collect();
                    comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                    for (i, v) in x.iter().enumerate() {
                        assert_eq!(*v, (i % 1024) as f32 * 6.0, "n {n} element {i}");
                    }
                    let mut m: Vec<i64> = (0..n as i64)
                        .map(|i| (i * 7 + r as i64 * 1000) % 3001)
                        .collect();
                    comm.all_reduce(&mut m, ReduceOp::Max).unwrap();
                    for (i, v) in m.iter().enumerate() {
                        let want = (0..3)
                            .map(|q| (i as i64 * 7 + q * 1000) % 3001)
                            .max()
                            .unwrap();
                        assert_eq!(*v, want, "max, n {n} element {i}");
                    }
                }
            });
        }
    });
    s.assert_empty();
}

// ---------------------------------------------------------------------------------------------
// Real processes: the test binary re-executes itself running only `child_peer`, configured by env.

fn spawn_child(mode: &str, s: &Scratch) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_peer",
            "--ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(CHILD_ENV, format!("{mode}|{}|{}", s.dir.display(), s.job))
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// Not a test: the peer process for the tests below (does nothing unless started by them).
#[test]
#[ignore = "helper process, started by other tests"]
fn child_peer() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(3, '|');
    let (mode, dir, job) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let opts = ShmOptions {
        ring_bytes: SMALL_RING,
        dir: PathBuf::from(dir),
    };
    match mode {
        // Rank 1 of 2: one known message, then an endless stream until killed.
        "stream" => {
            let t = ShmTransport::establish(1, 2, job, LONG, &opts).unwrap();
            t.send(0, 0, &pattern(1 << 20, 42), deadline()).unwrap();
            for i in 1u64.. {
                t.send(0, i, &pattern(1 << 18, i), deadline()).unwrap();
            }
        }
        // Waits in establish for a rank 0 that never comes, until killed: leaves a stale segment.
        "stale" => {
            let _ = ShmTransport::establish(1, 2, job, LONG, &opts);
        }
        other => panic!("unknown child mode {other}"),
    }
}

#[test]
fn killed_peer_process_gives_closed_naming_the_rank_not_a_hang() {
    let s = Scratch::new();
    let mut child = spawn_child("stream", &s);
    let t = ShmTransport::establish(0, 2, &s.job, LONG, &s.opts(SMALL_RING)).unwrap();
    let mut first = vec![0u8; 1 << 20];
    t.recv(1, 0, &mut first, deadline()).unwrap();
    assert!(
        first == pattern(1 << 20, 42),
        "cross-process payload corrupted"
    );
    let mut buf = vec![0u8; 1 << 18];
    for i in 1..20u64 {
        t.recv(1, i, &mut buf, deadline()).unwrap();
        assert!(buf == pattern(1 << 18, i), "message {i}");
    }
    // The child is blocked mid-stream on a full ring. Kill it and do NOT reap it yet: a zombie
    // still answers kill(pid, 0), so detection must not rely on that alone.
    let pid = child.id();
    child.kill().unwrap();
    let started = Instant::now();
    let mut i = 20u64;
    // What was already in the ring is still delivered, then the link reports the death.
    let e = loop {
        match t.recv(1, i, &mut buf, deadline()) {
            Ok(()) => {
                assert!(buf == pattern(1 << 18, i), "message {i}");
                i += 1;
            }
            Err(e) => break e,
        }
    };
    let took = started.elapsed();
    let _ = child.wait();
    expect_closed(&e, 1);
    let m = e.to_string();
    assert!(
        m.contains("waiting for rank 1")
            && m.contains(&format!("the process of rank 1 (pid {pid}) has exited")),
        "{m}"
    );
    // Closed (asserted above), not the 30 s receive deadline: the death was noticed. The bound is
    // a hang guard well under that deadline.
    assert!(took < LONG / 2, "took {took:?}");
    drop(t);
    s.assert_empty();
}

#[test]
fn stale_and_foreign_files_from_an_earlier_job_do_not_wedge_a_new_one() {
    let s = Scratch::new();
    // A crashed process of an earlier job with the same id left a valid-looking segment for rank 1…
    let mut child = spawn_child("stale", &s);
    let stale = s.dir.join(format!("lockstep-{}-1", s.job));
    let waited = Instant::now();
    while !stale.exists() {
        assert!(waited.elapsed() < LONG, "child never created its segment");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(stale.exists());
    // … and something foreign sits where rank 0's segment goes.
    std::fs::write(
        s.dir.join(format!("lockstep-{}-0", s.job)),
        b"not a segment",
    )
    .unwrap();

    let ts = group(&s, 2, SMALL_RING);
    s.assert_empty();
    std::thread::scope(|sc| {
        for t in &ts {
            sc.spawn(move || {
                let other = 1 - t.rank();
                let mut buf = vec![0u8; 10_000];
                t.send_recv(
                    other,
                    &pattern(10_000, t.rank() as u64),
                    other,
                    &mut buf,
                    1,
                    deadline(),
                )
                .unwrap();
                assert_eq!(buf, pattern(10_000, other as u64));
            });
        }
    });
}

#[test]
fn a_stale_file_alone_is_reported_if_its_rank_never_comes() {
    let s = Scratch::new();
    let mut child = spawn_child("stale", &s);
    let stale = s.dir.join(format!("lockstep-{}-1", s.job));
    while !stale.exists() {
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let e = ShmTransport::establish(
        0,
        2,
        &s.job,
        Duration::from_millis(200),
        &s.opts(SMALL_RING),
    )
    .err()
    .unwrap();
    let m = e.to_string();
    assert!(
        m.contains("has exited (stale file of an earlier job"),
        "{m}"
    );
    // Our own segment is gone; the stale one is left for the next rank 1 to replace.
    assert_eq!(s.files(), vec![format!("lockstep-{}-1", s.job)]);
}

// ---------------------------------------------------------------------------------------------
// Figures (not a test: no timed assertions). Run in release, see the top of the file.

fn best_of<F: FnMut() -> Duration>(reps: usize, mut f: F) -> Duration {
    (0..reps).map(|_| f()).min().unwrap()
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Both ranks prepare with `setup(rank)` (untimed: allocating and faulting in 64 MiB costs more than
/// moving it), then run `body` between two barriers made of tiny exchanges; returns the slower time.
fn timed_pair<S>(
    ts: &[ShmTransport],
    setup: &(dyn Fn(usize) -> S + Sync),
    body: &(dyn Fn(&ShmTransport, &mut S) + Sync),
) -> Duration {
    std::thread::scope(|sc| {
        let hs: Vec<_> = ts
            .iter()
            .map(|t| {
                sc.spawn(move || {
                    let mut state = setup(t.rank());
                    let other = 1 - t.rank();
                    let mut b = [0u8; 1];
                    t.send_recv(other, &[1], other, &mut b, u64::MAX, deadline())
                        .unwrap();
                    let start = Instant::now();
                    body(t, &mut state);
                    t.send_recv(other, &[1], other, &mut b, u64::MAX, deadline())
                        .unwrap();
                    let took = start.elapsed();
                    std::hint::black_box(&state);
                    took
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).max().unwrap()
    })
}

#[test]
#[ignore = "prints ping-pong figures; run in release"]
fn bench_shm_pingpong() {
    pingpong();
}

#[test]
#[ignore = "prints performance figures; run in release"]
fn bench_shm_figures() {
    const MB64: usize = 64 << 20;
    let src = pattern(MB64, 1);
    let mut dst = vec![0u8; MB64];
    dst.copy_from_slice(&src);
    let reps: usize = std::env::var("LOCKSTEP_SHM_BENCH_REPS")
        .map(|v| v.parse().unwrap())
        .unwrap_or(5);
    let memcpy = best_of(2 * reps, || {
        let t = Instant::now();
        std::hint::black_box(&mut dst).copy_from_slice(std::hint::black_box(&src));
        t.elapsed()
    });
    println!("memcpy 64 MiB, one thread: {:.2} GB/s", gbps(MB64, memcpy));

    let rings: Vec<usize> = match std::env::var("LOCKSTEP_SHM_BENCH_RINGS") {
        Ok(v) => v
            .split(',')
            .map(|k| k.trim().parse::<usize>().unwrap() << 10)
            .collect(),
        Err(_) => vec![256 << 10, 1 << 20, 2 << 20, 4 << 20],
    };
    for ring in rings {
        let s = Scratch::new();
        let ts = group(&s, 2, ring);
        let exch = best_of(reps, || {
            timed_pair(
                &ts,
                &|r| (vec![r as u8 + 1; MB64], vec![0xAAu8; MB64]),
                &|t, (send, recv)| {
                    let other = 1 - t.rank();
                    t.send_recv(other, send, other, recv, 1, deadline())
                        .unwrap();
                },
            )
        });
        let n = MB64 / 4;
        // Ring all-reduce on 2 ranks: bus bandwidth = 2(n-1)/n · size / time = size / time.
        let comm = communicator_all_reduce_time(ts, n, reps);
        println!(
            "ring {:>4} KiB: 64 MiB mirror send_recv {:.2} GB/s per direction ({:.0}% of memcpy); \
             Communicator::all_reduce 64 MiB f32, 2 ranks: busbw {:.2} GB/s ({:.0}% of memcpy)",
            ring >> 10,
            gbps(MB64, exch),
            100.0 * memcpy.as_secs_f64() / exch.as_secs_f64(),
            gbps(MB64, comm),
            100.0 * memcpy.as_secs_f64() / comm.as_secs_f64(),
        );
    }
    pingpong();
}

/// Best time of `reps` all-reduces of `n` f32 through a Communicator on each of the 2 transports.
fn communicator_all_reduce_time(ts: Vec<ShmTransport>, n: usize, reps: usize) -> Duration {
    let times: Vec<Duration> = std::thread::scope(|sc| {
        let hs: Vec<_> = ts
            .into_iter()
            .map(|t| {
                sc.spawn(move || {
                    let r = t.rank() as f32;
                    let other = 1 - t.rank();
                    let t = Arc::new(t);
                    let mut comm = Communicator::new(t.clone(), LONG);
                    // Barrier of our own (tag outside the communicator's tag space).
                    let sync = || {
                        t.send_recv(other, &[1], other, &mut [0u8; 1], u64::MAX, deadline())
                            .unwrap()
                    };
                    let mut best = Duration::MAX;
                    for _ in 0..reps + 1 {
                        let mut x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 + r).collect();
                        sync();
                        let start = Instant::now();
                        comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                        sync();
                        best = best.min(start.elapsed());
                        std::hint::black_box(&x);
                    }
                    best
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    times.into_iter().max().unwrap()
}

fn pingpong() {
    let s = Scratch::new();
    let ts = group(&s, 2, 1 << 20);
    for size in [8usize, 4096] {
        const ITERS: usize = 20_000;
        let d = timed_pair(&ts, &|_| (vec![7u8; size], vec![0u8; size]), &|t,
                                                                           (
            data,
            buf,
        )| {
            for i in 0..ITERS as u64 {
                if t.rank() == 0 {
                    t.send(1, i, data, deadline()).unwrap();
                    t.recv(1, i, buf, deadline()).unwrap();
                } else {
                    t.recv(0, i, buf, deadline()).unwrap();
                    t.send(0, i, data, deadline()).unwrap();
                }
            }
        });
        println!(
            "ping-pong {size} B: round trip {:.2} µs (mean of {ITERS})",
            d.as_secs_f64() * 1e6 / ITERS as f64
        );
    }
}

/// Two pipeline neighbours swap messages far larger than the ring in both directions at once,
/// after an unequal number of earlier one-way messages (so the two directions' tag counters
/// differ): `Communicator::send_recv` must neither block nor confuse the streams.
#[test]
fn communicator_send_recv_swaps_large_messages_with_independent_counters() {
    let s = Scratch::new();
    let ts = group(&s, 2, 64 << 10);
    std::thread::scope(|sc| {
        for t in ts {
            sc.spawn(move || {
                let me = t.rank();
                let mut comm = Communicator::new(Arc::new(t), LONG);
                let big = |seed: u32, n: usize| -> Vec<f32> {
                    (0..n).map(|i| (i as u32 ^ seed) as f32).collect()
                };
                // Warm-up: rank 0 sends three "activations" that rank 1 receives one by one.
                for k in 0..3u32 {
                    if me == 0 {
                        comm.send(1, &big(k, 1000)).unwrap();
                    } else {
                        let mut b = vec![0f32; 1000];
                        comm.recv(0, &mut b).unwrap();
                        assert_eq!(b, big(k, 1000));
                    }
                }
                // Steady state: activations forward, gradients back, 1 MiB each way (16 rings).
                for k in 0..4u32 {
                    let (out, n_in) = if me == 0 {
                        (big(100 + k, 1 << 18), 3 << 16)
                    } else {
                        (big(200 + k, 3 << 16), 1 << 18)
                    };
                    let mut inc = vec![0f32; n_in];
                    comm.send_recv(1 - me, &out, 1 - me, &mut inc).unwrap();
                    let want = if me == 0 {
                        big(200 + k, n_in)
                    } else {
                        big(100 + k, n_in)
                    };
                    assert!(inc == want, "rank {me} round {k}: wrong data");
                }
            });
        }
    });
}
